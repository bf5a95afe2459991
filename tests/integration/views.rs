//! Simulation and views: the simulator against the published bubble and memory formulas and
//! against an independent equation-solving reference; the Chrome trace, SVG and DOT outputs
//! parsed back; snapshots of small cases; the CLI's commands and exit codes; and inspection at
//! real sizes: `compare` on equal models, `show` columns checked against the simulated timeline
//! by independent code, one named bubble, checked costs, and CSV input wherever `check` takes
//! it.

use crate::harness::{compiled, pipec};
use assert_cmd::prelude::*;
use pipec_compiler::compile::{compile, CompileRequest, Compiled};
use pipec_compiler::view::{chrome, dot, svg, timeline_text};
use pipec_cost::cost::{CostModel, StageCosts};
use pipec_cost::simulate::{simulate, SimError, Simulation};
use pipec_cost::timeline::Timeline;
use pipec_ir::files::{self, Header};
use pipec_ir::Instr;
use pipec_ir::Payload;
use pipec_ir::Program;
use pipec_schedules::layout::Layout;
use pipec_schedules::{Compute, Placement, Rank, ScheduleKind, Task};
use proptest::prelude::*;
use std::path::{Path, PathBuf};
use std::process::Command;

fn req(kind: ScheduleKind, pp: u32, vpp: u32, m: u32) -> CompileRequest {
    CompileRequest {
        vpp: Some(vpp),
        ..CompileRequest::new(kind, pp, m)
    }
}

fn build(kind: ScheduleKind, pp: u32, vpp: u32, m: u32) -> Compiled {
    compile(&req(kind, pp, vpp, m)).expect("valid spec")
}

fn sim(c: &Compiled, cost: &str) -> Simulation {
    let model = CostModel::parse(cost).expect("cost spec");
    let costs = StageCosts::new(&model, &c.layout, c.program.num_stages());
    assert!(costs.layout_used);
    simulate(&pipec_tests::verified(&c.program), &costs).expect("no deadlock")
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * (1.0 + a.abs().max(b.abs()))
}

// ---------------------------------------------------------------------------------------------
// Published formulas (tests/golden/conformance/README.md), uniform op times, free communication.

/// Per-layer costs (f, bwd_D, bwd_W) tried for every formula: the full backward is b + w.
/// (1, 2, 0) and (1, 1, 1) are the classic "backward = 2 x forward"; the others check that
/// the formulas hold for any forward/backward ratio, as the Megatron-LM paper states them
/// (bubble time (p-1)(t_f + t_b)).
const COSTS: [(f64, f64, f64); 4] = [
    (1.0, 2.0, 0.0),
    (1.0, 1.0, 1.0),
    (2.0, 1.0, 0.0),
    (0.5, 2.0, 1.0),
];

fn cost_specs() -> Vec<String> {
    let mut v = Vec::new();
    for (f, b, w) in COSTS {
        for rv in ["true", "false"] {
            v.push(format!("f={f},b={b},w={w},rendezvous={rv}"));
        }
    }
    v
}

/// GPipe and 1F1B: every rank is idle (p-1)/(m+p-1) of the makespan (bubble time
/// (p-1)(f+b) on top of the ideal m(f+b)), under rendezvous and eager sends alike.
#[test]
fn gpipe_and_1f1b_bubble_is_p_minus_1_over_m_plus_p_minus_1() {
    for kind in [ScheduleKind::Gpipe, ScheduleKind::OneFOneB] {
        for p in 1..=8u32 {
            for m in 1..=16u32 {
                let c = build(kind, p, 1, m);
                for spec in cost_specs() {
                    let s = sim(&c, &spec);
                    let want = (p - 1) as f64 / (m + p - 1) as f64;
                    for r in &s.summary.ranks {
                        assert!(
                            close(r.bubble_ratio, want),
                            "{kind} p={p} m={m} {spec}: rank {} bubble {} != (p-1)/(m+p-1) = {want}",
                            r.rank,
                            r.bubble_ratio
                        );
                    }
                }
            }
        }
    }
}

/// Interleaved 1F1B with v chunks per rank (each chunk one stage of cost f, b): the ideal time
/// is v*m*(f+b) and the bubble (p-1)(f+b), i.e. (p-1)/v of a microbatch's full-rank f+b
/// (Narayanan et al., 2021, t_pb = (p-1)(t_f+t_b)/v). So the idle share of every rank is
///     (p-1)(f+b) / (v*m*(f+b) + (p-1)(f+b)) = (p-1) / (v*m + p-1).
/// Megatron's default group size g = p requires m to be a multiple of p.
#[test]
fn interleaved_bubble_is_p_minus_1_over_vm_plus_p_minus_1() {
    // Interleaving needs pp >= 2 (at pp = 1 Megatron runs no pipelining; pipec refuses it).
    for p in 2..=6u32 {
        for v in 2..=4u32 {
            for m in [p, 2 * p, 3 * p] {
                let c = build(ScheduleKind::Interleaved1F1B, p, v, m);
                for spec in cost_specs() {
                    let s = sim(&c, &spec);
                    let want = (p - 1) as f64 / (v * m + p - 1) as f64;
                    for r in &s.summary.ranks {
                        assert!(
                            close(r.bubble_ratio, want),
                            "interleaved p={p} v={v} m={m} {spec}: rank {} bubble {} != (p-1)/(vm+p-1) = {want}",
                            r.rank,
                            r.bubble_ratio
                        );
                    }
                }
            }
        }
    }
}

/// Peak live activations (units of one microbatch on one stage): GPipe keeps all m; 1F1B rank
/// r keeps its p-r-1 warmup forwards plus one, min(p-r, m) (worst rank: p); interleaved rank r
/// keeps Megatron's warmup 2(p-r-1)+(v-1)p plus one, capped at v*m (worst rank: about
/// p + (p-1)/v microbatches of the whole rank).
#[test]
fn peak_activations_match_the_published_counts() {
    // p >= 2: with one rank Megatron runs `forward_backward_no_pipelining` (F B F B ...), which
    // the formulas do not describe.
    for p in 2..=6u32 {
        for m in 1..=12u32 {
            let g = sim(&build(ScheduleKind::Gpipe, p, 1, m), "");
            assert!(g
                .summary
                .ranks
                .iter()
                .all(|r| r.peak_activations == m as f64));
            let o = sim(&build(ScheduleKind::OneFOneB, p, 1, m), "");
            for r in &o.summary.ranks {
                assert_eq!(
                    r.peak_activations,
                    (p - r.rank).min(m) as f64,
                    "1f1b p={p} m={m}"
                );
            }
        }
        for v in 2..=3u32 {
            for m in [p, 2 * p, 3 * p] {
                let s = sim(&build(ScheduleKind::Interleaved1F1B, p, v, m), "");
                for r in &s.summary.ranks {
                    let warmup = 2 * (p - r.rank - 1) + (v - 1) * p;
                    let want = (warmup + 1).min(v * m);
                    assert_eq!(
                        r.peak_activations, want as f64,
                        "interleaved p={p} v={v} m={m} rank {}",
                        r.rank
                    );
                }
            }
        }
    }
}

/// Uneven layouts cost what they hold: with eager sends, free communication and one op per
/// comm step (GPipe, 1F1B), the simulated compute spans equal the pure dataflow schedule
/// (start = max(rank free, inputs done)) computed here from the compute orders and per-stage
/// costs summed by hand from the layout string.
#[test]
fn uneven_layouts_match_a_dataflow_reference() {
    let cases = [
        (ScheduleKind::OneFOneB, 4, "Ettt|t|tt|tL", 8),
        (ScheduleKind::Gpipe, 4, "Et|ttt|t|ttL", 5),
        (ScheduleKind::OneFOneB, 2, "E|ttttL", 3),
        (ScheduleKind::OneFOneB, 3, "Et||tmL", 4),
    ];
    let spec = "f=1,b=1.5,w=0.5,E.f=0.25,E.b=0.5,L.f=0.5,L.b=0.75,floor=0.125,rendezvous=false";
    // Per layer (f, bwd_D + bwd_W) by symbol, as the spec says.
    let layer = |c: char| match c {
        't' | 'm' => (1.0, 2.0),
        'E' => (0.25, 0.5),
        'L' => (0.5, 0.75),
        _ => unreachable!(),
    };
    for (kind, pp, layout, m) in cases {
        let mut r = req(kind, pp, 1, m);
        r.vpp = None;
        r.layout = Some(layout.to_string());
        let c = compile(&r).expect("layout compiles");
        let stage_cost: Vec<(f64, f64)> = layout
            .split('|')
            .map(|st| {
                if st.is_empty() {
                    (0.125, 0.25)
                } else {
                    st.chars()
                        .map(layer)
                        .fold((0.0, 0.0), |a, l| (a.0 + l.0, a.1 + l.1))
                }
            })
            .collect();
        let s = sim(&c, spec);
        let want = dataflow(&c.program, &stage_cost);
        for (r, ops) in want.iter().enumerate() {
            let got: Vec<(f64, f64)> = c.program.ranks[r]
                .iter()
                .zip(&s.timeline.ranks[r])
                .filter(|(i, _)| matches!(i, Instr::Compute(_)))
                .map(|(_, sp)| (sp.start, sp.end))
                .collect();
            assert_eq!(got.len(), ops.len());
            for (g, w) in got.iter().zip(ops) {
                assert!(
                    close(g.0, w.0) && close(g.1, w.1),
                    "{kind} {layout} rank {r}: {got:?} vs {ops:?}"
                );
            }
        }
    }
}

/// Compute spans per rank from program order and data dependencies only.
fn dataflow(p: &Program, stage_cost: &[(f64, f64)]) -> Vec<Vec<(f64, f64)>> {
    use std::collections::HashMap;
    let orders = p.compute_orders();
    let last = p.num_stages() - 1;
    let mut done: HashMap<(bool, u32, u32), f64> = HashMap::new();
    let mut out: Vec<Vec<(f64, f64)>> = vec![Vec::new(); orders.len()];
    let mut pc = vec![0usize; orders.len()];
    let mut free = vec![0.0f64; orders.len()];
    loop {
        let mut progressed = false;
        for r in 0..orders.len() {
            while let Some(op) = orders[r].get(pc[r]) {
                let (is_fwd, t) = match *op {
                    Compute::Fwd(t) => (true, t),
                    Compute::Bwd(t) => (false, t),
                    other => panic!("unexpected {other}"),
                };
                let (s, mb) = (t.stage.0, t.mb.0);
                let deps: Vec<(bool, u32, u32)> = if is_fwd {
                    if s > 0 {
                        vec![(true, s - 1, mb)]
                    } else {
                        vec![]
                    }
                } else if s < last {
                    vec![(true, s, mb), (false, s + 1, mb)]
                } else {
                    vec![(true, s, mb)]
                };
                let Some(ready) = deps
                    .iter()
                    .map(|d| done.get(d).copied())
                    .try_fold(0.0f64, |a, x| x.map(|x| a.max(x)))
                else {
                    break;
                };
                let start = free[r].max(ready);
                let d = if is_fwd {
                    stage_cost[s as usize].0
                } else {
                    stage_cost[s as usize].1
                };
                out[r].push((start, start + d));
                free[r] = start + d;
                done.insert((is_fwd, s, mb), start + d);
                pc[r] += 1;
                progressed = true;
            }
        }
        if !progressed {
            break;
        }
    }
    assert!(
        pc.iter().zip(&orders).all(|(&i, o)| i == o.len()),
        "reference stuck"
    );
    out
}

// ---------------------------------------------------------------------------------------------
// The simulator against an equation-solving reference of the documented semantics.

/// (start, end) of every instruction, per rank.
type Spans = Vec<Vec<(f64, f64)>>;

/// Times of every instruction by fixpoint iteration over the equations in the simulate
/// module's documentation: a compute op ends `cost` after the previous instruction; a batch
/// is posted when the previous instruction ends and ends at the latest completion of its
/// messages; under rendezvous a message completes at max(both posts) + x, eagerly the send
/// at its post and the recv at max(its post, the send's post + x). `None`: deadlock, with
/// the first unresolved instruction of each stuck rank.
fn reference(
    p: &Program,
    cost: f64,
    x: f64,
    rendezvous: bool,
) -> Result<Spans, Vec<(usize, usize)>> {
    let w = p.ranks.len();
    // FIFO matching per ordered pair, counted independently of the simulator.
    let mut partner: Vec<Vec<Option<(usize, usize)>>> =
        p.ranks.iter().map(|r| vec![None; r.len()]).collect();
    for a in 0..w {
        for b in 0..w {
            let sends: Vec<usize> = (0..p.ranks[a].len())
                .filter(|&i| matches!(p.ranks[a][i], Instr::Send { peer, .. } if peer.index() == b))
                .collect();
            let recvs: Vec<usize> = (0..p.ranks[b].len())
                .filter(|&i| matches!(p.ranks[b][i], Instr::Recv { peer, .. } if peer.index() == a))
                .collect();
            for (&s, &r) in sends.iter().zip(&recvs) {
                partner[a][s] = Some((b, r));
                partner[b][r] = Some((a, s));
            }
        }
    }
    // Batch bounds per instruction.
    let bounds: Vec<Vec<(usize, usize)>> = p
        .ranks
        .iter()
        .map(|instrs| {
            let mut v = vec![(0, 0); instrs.len()];
            let mut i = 0;
            while i < instrs.len() {
                if matches!(instrs[i], Instr::Compute(_)) {
                    v[i] = (i, i + 1);
                    i += 1;
                    continue;
                }
                let mut j = i + 1;
                while j < instrs.len()
                    && !matches!(instrs[j], Instr::Compute(_))
                    && instrs[j].batch() == instrs[i].batch()
                {
                    j += 1;
                }
                v[i..j].fill((i, j));
                i = j;
            }
            v
        })
        .collect();
    let mut end: Vec<Vec<Option<f64>>> = p.ranks.iter().map(|r| vec![None; r.len()]).collect();
    let post = |end: &Vec<Vec<Option<f64>>>, r: usize, i: usize| -> Option<f64> {
        let lo = bounds[r][i].0;
        if lo == 0 {
            Some(0.0)
        } else {
            end[r][lo - 1]
        }
    };
    loop {
        let mut changed = false;
        for r in 0..w {
            for i in 0..p.ranks[r].len() {
                if end[r][i].is_some() {
                    continue;
                }
                let Some(t) = post(&end, r, i) else { break };
                if let Instr::Compute(_) = p.ranks[r][i] {
                    end[r][i] = Some(t + cost);
                    changed = true;
                    continue;
                }
                let (lo, hi) = bounds[r][i];
                let mut e = Some(t);
                for (ins, part) in p.ranks[r][lo..hi].iter().zip(&partner[r][lo..hi]) {
                    let is_send = matches!(ins, Instr::Send { .. });
                    let c = match *part {
                        // An eager send completes when posted, matched or not.
                        _ if is_send && !rendezvous => Some(t),
                        None => None,
                        Some((q, j)) => {
                            let tq = post(&end, q, j);
                            if rendezvous {
                                tq.map(|tq| t.max(tq) + x)
                            } else {
                                tq.map(|tq| t.max(tq + x))
                            }
                        }
                    };
                    e = match (e, c) {
                        (Some(a), Some(b)) => Some(a.max(b)),
                        _ => None,
                    };
                }
                let Some(e) = e else { break };
                end[r][lo..hi].fill(Some(e));
                changed = true;
            }
        }
        if !changed {
            break;
        }
    }
    let stuck: Vec<(usize, usize)> = end
        .iter()
        .enumerate()
        .filter_map(|(r, v)| v.iter().position(Option::is_none).map(|i| (r, i)))
        .collect();
    if !stuck.is_empty() {
        return Err(stuck);
    }
    Ok((0..w)
        .map(|r| {
            (0..p.ranks[r].len())
                .map(|i| (post(&end, r, i).unwrap(), end[r][i].unwrap()))
                .collect()
        })
        .collect())
}

fn check_against_reference(p: &Program, x: f64, rendezvous: bool) -> Result<(), TestCaseError> {
    let spec = format!("f=1,b=0.5,w=0.5,p2p={x},rendezvous={rendezvous}");
    let costs = StageCosts::uniform(&CostModel::parse(&spec).unwrap(), p.num_stages());
    let got = pipec_cost::simulate::simulate_unverified(&pipec_tests::unverified(p), &costs);
    match (reference(p, 1.0, x, rendezvous), got) {
        (Ok(want), Ok(s)) => {
            for (r, spans) in want.iter().enumerate() {
                for (i, &(a, b)) in spans.iter().enumerate() {
                    let sp = s.timeline.ranks[r][i];
                    prop_assert!(
                        close(sp.start, a) && close(sp.end, b),
                        "rank {r} #{i}: {sp:?} vs ({a}, {b})"
                    );
                }
            }
        }
        (Err(stuck), Err(SimError::Deadlock(d))) => {
            let got: Vec<(usize, usize)> = d
                .stuck
                .iter()
                .map(|s| (s.at.rank.index(), s.at.index as usize))
                .collect();
            prop_assert_eq!(got, stuck);
        }
        (want, got) => prop_assert!(false, "reference {want:?} vs simulator {got:?}"),
    }
    Ok(())
}

/// Random programs over 1..4 ranks: compute ops and comm batches of 1..3 messages to random
/// peers. Most deadlock; the simulator must agree with the reference on every time and on
/// every stuck rank, and never hang.
fn arb_program() -> impl Strategy<Value = Program> {
    (1usize..=4).prop_flat_map(|w| {
        let item = prop_oneof![
            Just(None),
            proptest::collection::vec((any::<bool>(), 0..w as u32), 1..=3).prop_map(Some),
        ];
        proptest::collection::vec(proptest::collection::vec(item, 0..8), w).prop_map(move |ranks| {
            let ranks = ranks
                .into_iter()
                .enumerate()
                .map(|(r, items)| {
                    let mut out = Vec::new();
                    for (b, it) in items.into_iter().enumerate() {
                        match it {
                            None => out.push(Instr::Compute(Compute::Fwd(Task::new(r as u32, 0)))),
                            Some(msgs) => {
                                for (send, peer) in msgs {
                                    let payload = Payload::act(0, 0);
                                    out.push(if send {
                                        Instr::Send {
                                            peer: Rank(peer),
                                            payload,
                                            batch: b as u32,
                                            tokens: None,
                                            slot: None,
                                        }
                                    } else {
                                        Instr::Recv {
                                            peer: Rank(peer),
                                            payload,
                                            batch: b as u32,
                                            tokens: None,
                                            slot: None,
                                        }
                                    });
                                }
                            }
                        }
                    }
                    out
                })
                .collect();
            Program {
                placement: Placement::looped(w as u32, 1),
                microbatches: 1,
                forward_only: false,
                comm: None,
                ranks,
                lengths: None,
                p2p_groups: Default::default(),
                buffer_slots: None,
            }
        })
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]
    #[test]
    fn simulator_matches_reference_on_random_programs(p in arb_program(), x in prop_oneof![Just(0.0), Just(0.5)], rv in any::<bool>()) {
        check_against_reference(&p, x, rv)?;
    }
}

/// Generated schedules, with a transfer time, under both send semantics.
#[test]
fn simulator_matches_reference_on_generated_schedules() {
    for (kind, pp, vpp, m) in [
        (ScheduleKind::Gpipe, 3, 1, 4),
        (ScheduleKind::OneFOneB, 4, 1, 6),
        (ScheduleKind::Interleaved1F1B, 4, 2, 8),
        (ScheduleKind::Interleaved1F1B, 3, 3, 6),
        (ScheduleKind::LoopedBfs, 3, 2, 4),
    ] {
        let c = build(kind, pp, vpp, m);
        for rv in [true, false] {
            for x in [0.0, 0.3] {
                // Uniform compute cost 1 per op in the reference: f=1, full bwd = 0.5 + 0.5.
                check_against_reference(&c.program, x, rv)
                    .unwrap_or_else(|e| panic!("{kind}: {e}"));
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Emitters parsed back.

#[test]
fn chrome_trace_has_one_event_per_instruction_and_one_flow_per_message() {
    for (kind, pp, vpp, m) in [
        (ScheduleKind::OneFOneB, 4, 1, 8),
        (ScheduleKind::Interleaved1F1B, 2, 2, 4),
    ] {
        let c = build(kind, pp, vpp, m);
        let s = sim(&c, "p2p=0.1");
        let text = chrome::chrome_trace("test", &c.program, &s.timeline);
        let v: serde_json::Value = serde_json::from_str(&text).expect("trace is JSON");
        let events = v["traceEvents"].as_array().expect("traceEvents");
        let ph = |p: &'static str| events.iter().filter(move |e| e["ph"] == p);
        assert_eq!(ph("X").count(), c.program.len());
        let sends = c
            .program
            .ranks
            .iter()
            .flatten()
            .filter(|i| matches!(i, Instr::Send { .. }))
            .count();
        assert_eq!(ph("s").count(), sends);
        assert_eq!(ph("f").count(), sends);
        assert!(ph("f").all(|e| e["bp"] == "e"));
        let mut ids: Vec<u64> = ph("s").map(|e| e["id"].as_u64().unwrap()).collect();
        let mut fids: Vec<u64> = ph("f").map(|e| e["id"].as_u64().unwrap()).collect();
        ids.sort();
        fids.sort();
        assert_eq!(ids, fids);
        ids.dedup();
        assert_eq!(ids.len(), sends);
        let threads: Vec<&str> = ph("M")
            .filter(|e| e["name"] == "thread_name")
            .map(|e| e["args"]["name"].as_str().unwrap())
            .collect();
        assert_eq!(
            threads,
            (0..pp).map(|r| format!("rank {r}")).collect::<Vec<_>>()
        );
        // Every X event sits on its rank's thread, and each rank's compute events follow the
        // program (count per tid).
        for r in 0..pp {
            let n = ph("X")
                .filter(|e| e["tid"] == r && e["cat"] != "comm")
                .count();
            let want = c.program.ranks[r as usize]
                .iter()
                .filter(|i| matches!(i, Instr::Compute(_)))
                .count();
            assert_eq!(n, want);
        }
        // Flows start on the sending rank and end on the receiving one.
        for e in ph("s") {
            let id = &e["id"];
            let f = ph("f").find(|f| &f["id"] == id).unwrap();
            assert_ne!(e["tid"], f["tid"]);
        }
    }
}

#[test]
fn svg_parses_and_has_one_rect_per_compute_op_in_its_rank_row() {
    for (kind, pp, vpp, m) in [
        (ScheduleKind::OneFOneB, 4, 1, 8),
        (ScheduleKind::Interleaved1F1B, 16, 2, 16),
        (ScheduleKind::Gpipe, 64, 1, 4),
    ] {
        let c = build(kind, pp, vpp, m);
        let s = sim(&c, "");
        let text = svg::render(&c.program, &s.timeline, &svg::SvgOptions::default());
        let doc = roxmltree::Document::parse(&text).expect("SVG is XML");
        let rects: Vec<_> = doc
            .descendants()
            .filter(|n| {
                n.has_tag_name("rect") && n.attribute("class").is_some_and(|c| c.starts_with("op "))
            })
            .collect();
        let computes = c
            .program
            .ranks
            .iter()
            .flatten()
            .filter(|i| matches!(i, Instr::Compute(_)))
            .count();
        assert_eq!(rects.len(), computes, "{kind} pp={pp}");
        // Rows: distinct y values, one per rank in rank order, each holding that rank's ops.
        let mut rows: Vec<(f64, usize)> = Vec::new();
        for r in &rects {
            let y: f64 = r.attribute("y").unwrap().parse().unwrap();
            match rows.iter_mut().find(|(ry, _)| *ry == y) {
                Some(row) => row.1 += 1,
                None => rows.push((y, 1)),
            }
            let title = r
                .children()
                .find(|n| n.has_tag_name("title"))
                .expect("tooltip")
                .text()
                .unwrap();
            assert!(title.starts_with("rank "), "{title}");
        }
        rows.sort_by(|a, b| a.0.partial_cmp(&b.0).unwrap());
        let per_rank: Vec<usize> = c
            .program
            .ranks
            .iter()
            .map(|r| r.iter().filter(|i| matches!(i, Instr::Compute(_))).count())
            .collect();
        assert_eq!(rows.iter().map(|r| r.1).collect::<Vec<_>>(), per_rank);
        // Deterministic.
        assert_eq!(
            text,
            svg::render(&c.program, &s.timeline, &svg::SvgOptions::default())
        );
    }
}

#[test]
fn dot_full_and_condensed_views() {
    let c = build(ScheduleKind::OneFOneB, 2, 1, 2);
    let full = dot::render(&c.program, dot::Condense::None, None);
    // One node per instruction, one program-order edge per consecutive pair, one message edge
    // per send.
    let nodes = full
        .lines()
        .filter(|l| l.trim_start().starts_with('r') && l.contains("[label="))
        .count();
    assert_eq!(nodes, c.program.len());
    let order = full
        .lines()
        .filter(|l| l.contains("color=\"#999999\"]") && l.contains("->"))
        .count();
    assert_eq!(
        order,
        c.program.ranks.iter().map(|r| r.len() - 1).sum::<usize>()
    );
    let sends = c
        .program
        .ranks
        .iter()
        .flatten()
        .filter(|i| matches!(i, Instr::Send { .. }))
        .count();
    assert_eq!(
        full.matches("style=dashed, color=\"#e15759\"").count(),
        sends
    );
    let big = build(ScheduleKind::Interleaved1F1B, 8, 2, 16);
    assert_eq!(dot::Condense::auto(&big.program), dot::Condense::Stage);
    let st = dot::render(&big.program, dot::Condense::Stage, None);
    assert_eq!(st.matches("[label=\"stage ").count(), 16);
    // 15 boundaries, each with an act and a grad edge of 16 messages.
    assert_eq!(st.matches("×16\", color").count(), 30);
    let rm = dot::render(&big.program, dot::Condense::RankMb, None);
    assert_eq!(rm.matches("[label=\"mb ").count(), 8 * 16);
}

// ---------------------------------------------------------------------------------------------
// Snapshots of small cases (reviewed by eye).

#[test]
fn snapshot_views_of_small_schedules() {
    let c = build(ScheduleKind::OneFOneB, 2, 1, 3);
    let s = sim(&c, "");
    insta::assert_snapshot!(
        "svg_1f1b_pp2_m3",
        svg::render(
            &c.program,
            &s.timeline,
            &svg::SvgOptions {
                width: 640.0,
                title: Some("1f1b pp=2 microbatches=3".into()),
                ..Default::default()
            }
        )
    );
    insta::assert_snapshot!(
        "dot_1f1b_pp2_m3",
        dot::render(&c.program, dot::Condense::None, Some("1f1b"))
    );
    insta::assert_snapshot!(
        "chrome_1f1b_pp2_m3",
        chrome::chrome_trace("1f1b", &c.program, &s.timeline)
    );
    let c = build(ScheduleKind::Interleaved1F1B, 2, 2, 4);
    let s = sim(&c, "");
    let text = timeline_text::render(
        &c.program,
        &s.timeline,
        &timeline_text::TextOptions {
            width: 100,
            ..Default::default()
        },
    );
    // The rows are derived from the timeline by the brute-force reader; the snapshot pins
    // the axis and legend around them.
    check_rows(&text, &c.program, &s.timeline, 100, &[0, 1], 0.0, None);
    insta::assert_snapshot!("text_interleaved_pp2_vpp2_m4", text);
}

// ---------------------------------------------------------------------------------------------
// The command line.

/// Two ranks that both send first, each in its own batch: a deadlock under rendezvous.
fn deadlock_dir(tmp: &Path) -> PathBuf {
    let program = Program {
        placement: Placement::looped(2, 1),
        microbatches: 1,
        forward_only: false,
        comm: None,
        ranks: vec![
            vec![
                Instr::Compute(Compute::Fwd(Task::new(0, 0))),
                Instr::Send {
                    peer: Rank(1),
                    payload: Payload::act(0, 0),
                    batch: 0,
                    tokens: None,
                    slot: None,
                },
                Instr::Recv {
                    peer: Rank(1),
                    payload: Payload::grad(1, 0),
                    batch: 1,
                    tokens: None,
                    slot: None,
                },
                Instr::Compute(Compute::Bwd(Task::new(0, 0))),
            ],
            vec![
                Instr::Send {
                    peer: Rank(0),
                    payload: Payload::grad(1, 0),
                    batch: 0,
                    tokens: None,
                    slot: None,
                },
                Instr::Recv {
                    peer: Rank(0),
                    payload: Payload::act(0, 0),
                    batch: 1,
                    tokens: None,
                    slot: None,
                },
                Instr::Compute(Compute::Fwd(Task::new(1, 0))),
                Instr::Compute(Compute::Bwd(Task::new(1, 0))),
            ],
        ],
        lengths: None,
        p2p_groups: Default::default(),
        buffer_slots: None,
    };
    let layout = Layout::uniform(2);
    let header = Header {
        source: "generated",
        schedule: None,
        layout: &layout,
    };
    let dir = tmp.join("deadlock");
    files::write_unverified(
        &dir,
        &header,
        &pipec_tests::unverified(&program),
        files::Encoding::Json,
    )
    .unwrap();
    dir
}

fn stdout_of(c: &mut Command) -> String {
    let out = c.output().unwrap();
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn cli_show() {
    let tmp = tempfile::tempdir().unwrap();
    let d = compiled(tmp.path(), "a", "--schedule 1f1b --pp 4 --microbatches 8");
    let out = pipec()
        .arg("show")
        .arg(&d)
        .arg("--no-color")
        .arg("--width")
        .arg("100")
        .assert()
        .success();
    let text = String::from_utf8(out.get_output().stdout.clone()).unwrap();
    let (program, timeline) = timeline_of(&d);
    check_rows(&text, &program, &timeline, 100, &[0, 1, 2, 3], 0.0, None);
    insta::assert_snapshot!("show_1f1b_pp4_m8", text);
    // Not a terminal: no colour unless forced; NO_COLOR and --no-color win over auto.
    assert!(!stdout_of(pipec().arg("show").arg(&d)).contains('\x1b'));
    assert!(
        stdout_of(pipec().arg("show").arg(&d).args(["--color", "always"])).contains("\x1b[44;97m")
    );
    assert!(!stdout_of(
        pipec()
            .arg("show")
            .arg(&d)
            .args(["--color", "always", "--no-color"])
    )
    .contains('\x1b'));
    assert!(!stdout_of(pipec().arg("show").arg(&d).env("NO_COLOR", "1")).contains('\x1b'));
    // COLUMNS sets the width; every timeline line fits.
    let narrow = stdout_of(pipec().arg("show").arg(&d).env("COLUMNS", "60"));
    assert!(
        narrow
            .lines()
            .filter(|l| l.starts_with("rank "))
            .all(|l| l.chars().count() <= 60),
        "{narrow}"
    );
    pipec()
        .arg("show")
        .arg(tmp.path().join("missing"))
        .assert()
        .code(2);
    pipec()
        .arg("show")
        .arg(&d)
        .args(["--cost", "f=1,zz=2"])
        .assert()
        .code(1);
    pipec()
        .arg("show")
        .arg(deadlock_dir(tmp.path()))
        .assert()
        .code(1)
        .stderr(predicates::str::contains("deadlock"));
}

#[test]
fn cli_simulate() {
    let tmp = tempfile::tempdir().unwrap();
    let d = compiled(tmp.path(), "a", "--schedule 1f1b --pp 4 --microbatches 8");
    let json = stdout_of(
        pipec()
            .arg("simulate")
            .arg(&d)
            .arg("--json")
            .args(["--cost", "f=1,b=2,w=0"]),
    );
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    // (m + p - 1)(f + b) = 11 * 3.
    assert_eq!(v["makespan"], 33.0);
    let ranks = v["ranks"].as_array().unwrap();
    assert_eq!(ranks.len(), 4);
    for r in ranks {
        assert!(close(r["bubble_ratio"].as_f64().unwrap(), 3.0 / 11.0));
        assert_eq!(r["busy"], 24.0);
        for k in ["rank", "peak_activations", "peak_at"] {
            assert!(r.get(k).is_some(), "{k}");
        }
    }
    assert_eq!(ranks[0]["peak_activations"], 4);
    pipec()
        .arg("simulate")
        .arg(&d)
        .assert()
        .success()
        .stdout(predicates::str::contains("makespan 33"));
    // Errors: missing directory, bad spec (caret), bad file (path:line:col).
    pipec()
        .arg("simulate")
        .arg(tmp.path().join("missing"))
        .assert()
        .code(2);
    pipec()
        .arg("simulate")
        .arg(&d)
        .args(["--cost", "f=1,b=x"])
        .assert()
        .code(1)
        .stderr(predicates::str::contains(
            "`x` is not a number\n  f=1,b=x\n        ^",
        ));
    let cf = tmp.path().join("costs.toml");
    std::fs::write(&cf, "# per layer\nf = 1\nw = -2\n").unwrap();
    pipec()
        .arg("simulate")
        .arg(&d)
        .arg("--cost-file")
        .arg(&cf)
        .assert()
        .code(1)
        .stderr(predicates::str::contains(
            "costs.toml:3:5: `-2` is negative",
        ));
    std::fs::write(&cf, "f = 1\nb = 2\nw = 0\n").unwrap();
    let json = stdout_of(
        pipec()
            .arg("simulate")
            .arg(&d)
            .arg("--json")
            .arg("--cost-file")
            .arg(&cf),
    );
    assert!(json.contains("\"makespan\": 33.0"), "{json}");
    // Deadlock: exit 1, the stuck ranks named; with --json the report is JSON.
    let dd = deadlock_dir(tmp.path());
    pipec()
        .arg("simulate")
        .arg(&dd)
        .assert()
        .code(1)
        .stderr(predicates::str::contains(
            "rank 0, #1 waits in a comm batch",
        ))
        .stderr(predicates::str::contains(
            "rank 1, #0 waits in a comm batch",
        ));
    let out = pipec()
        .arg("simulate")
        .arg(&dd)
        .arg("--json")
        .assert()
        .code(1);
    let v: serde_json::Value = serde_json::from_slice(&out.get_output().stdout).unwrap();
    assert_eq!(v["deadlock"]["stuck"].as_array().unwrap().len(), 2);
    // Eager sends break the cycle.
    pipec()
        .arg("simulate")
        .arg(&dd)
        .args(["--cost", "rendezvous=false"])
        .assert()
        .success();
}

#[test]
fn cli_compare() {
    let tmp = tempfile::tempdir().unwrap();
    let a = compiled(tmp.path(), "a", "--schedule gpipe --pp 4 --microbatches 8");
    let out = stdout_of(pipec().arg("compare").arg(&a).args([
        "--schedule",
        "1f1b",
        "--schedule",
        "interleaved-1f1b",
        "--pp",
        "4",
        "--vpp",
        "2",
        "--microbatches",
        "8",
    ]));
    // The header names the model and the bubble before the table.
    let lines: Vec<&str> = out
        .lines()
        .skip_while(|l| !l.starts_with("schedule"))
        .collect();
    assert!(lines[0].starts_with("schedule"), "{out}");
    assert!(
        lines[2].starts_with("1f1b pp=4 vpp=1 microbatches=8"),
        "{out}"
    );
    assert!(
        lines[3].starts_with("interleaved-1f1b pp=4 vpp=2 microbatches=8"),
        "{out}"
    );
    let json = stdout_of(pipec().arg("compare").arg(&a).args([
        "--schedule",
        "interleaved-1f1b",
        "--pp",
        "4",
        "--vpp",
        "2",
        "--microbatches",
        "8",
        "--json",
    ]));
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    let s = v["schedules"].as_array().unwrap();
    // GPipe (m+p-1)*3 = 33; interleaved 48 * (vm+p-1)/(vm) = 57.
    assert_eq!(s[0]["makespan"], 33.0);
    assert_eq!(s[1]["makespan"], 57.0);
    assert_eq!(s[0]["peak_activations"], 8);
    pipec()
        .arg("compare")
        .args(["--schedule", "1f1b"])
        .assert()
        .code(2);
    pipec().arg("compare").assert().code(2);
    pipec()
        .arg("compare")
        .arg(tmp.path().join("missing"))
        .assert()
        .code(2);
    pipec()
        .arg("compare")
        .arg(&a)
        .arg(deadlock_dir(tmp.path()))
        .assert()
        .code(1)
        .stdout(predicates::str::contains("DEADLOCK"));
}

/// `pipec compare DIR` costs a tuned directory on the model its manifest records, as `pipec
/// simulate DIR` does (issue #40: it re-costed them at unit costs); directories whose recorded
/// models differ are refused, naming both, unless `--cost` puts them on one.
#[test]
fn compare_uses_recorded_costs() {
    let tmp = tempfile::tempdir().unwrap();
    let cost = "f=1,b=2,w=1,p2p=0.3";
    let tune = |name: &str, kinds: &str| {
        let d = tmp.path().join(name);
        pipec()
            .args(["tune", "--pp", "2", "--microbatches", "4", "--cost", cost])
            .args(["--kinds", kinds, "-o"])
            .arg(&d)
            .assert()
            .success();
        d
    };
    let t1 = tune("t1", "1f1b");
    let t2 = tune("t2", "gpipe");
    let json = |cmd: &mut std::process::Command| -> serde_json::Value {
        serde_json::from_str(&stdout_of(cmd)).unwrap()
    };
    let simulated = |d: &std::path::Path| {
        json(pipec().arg("simulate").arg(d).arg("--json"))["makespan"]
            .as_f64()
            .unwrap()
    };
    let (s1, s2) = (simulated(&t1), simulated(&t2));
    // The recorded model is not the unit one: the unit costs give another makespan, so a
    // compare at unit costs cannot pass this test.
    let unit = json(
        pipec()
            .arg("simulate")
            .arg(&t1)
            .args(["--json", "--cost", "f=1"]),
    );
    assert_ne!(unit["makespan"].as_f64().unwrap(), s1);
    let alone = json(pipec().arg("compare").arg(&t1).arg("--json"));
    assert_eq!(alone["schedules"][0]["makespan"].as_f64().unwrap(), s1);
    let both = json(pipec().arg("compare").arg(&t1).arg(&t2).arg("--json"));
    assert_eq!(both["schedules"][0]["makespan"].as_f64().unwrap(), s1);
    assert_eq!(both["schedules"][1]["makespan"].as_f64().unwrap(), s2);
    assert_eq!(
        both["cost"],
        serde_json::to_value(CostModel::parse(cost).unwrap()).unwrap()
    );
    // A directory compiled without a model records none: the pair is refused, both named.
    let c = compiled(tmp.path(), "c", "--schedule 1f1b --pp 2 --microbatches 4");
    let out = pipec().arg("compare").arg(&t1).arg(&c).assert().code(1);
    let err = String::from_utf8_lossy(&out.get_output().stderr).to_string();
    assert!(err.contains("different cost models"), "{err}");
    assert!(err.contains(&t1.display().to_string()), "{err}");
    assert!(
        err.contains(&format!("{}: none recorded", c.display())),
        "{err}"
    );
    // One model given: both on it.
    pipec()
        .arg("compare")
        .arg(&t1)
        .arg(&c)
        .args(["--cost", "f=1"])
        .assert()
        .success();
}

#[test]
fn cli_export() {
    let tmp = tempfile::tempdir().unwrap();
    let d = compiled(
        tmp.path(),
        "a",
        "--schedule interleaved-1f1b --pp 2 --vpp 2 --microbatches 4",
    );
    let t = tmp.path().join("t.json");
    pipec()
        .arg("export")
        .arg(&d)
        .args(["--format", "chrome-trace", "-o"])
        .arg(&t)
        .assert()
        .success();
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&t).unwrap()).unwrap();
    assert!(!v["traceEvents"].as_array().unwrap().is_empty());
    let s = tmp.path().join("t.svg");
    pipec()
        .arg("export")
        .arg(&d)
        .args(["--format", "svg", "-o"])
        .arg(&s)
        .assert()
        .success();
    roxmltree::Document::parse(&std::fs::read_to_string(&s).unwrap()).unwrap();
    pipec()
        .arg("export")
        .arg(&d)
        .args(["--format", "dot"])
        .assert()
        .success()
        .stdout(predicates::str::starts_with("digraph pipec {"));
    pipec()
        .arg("export")
        .arg(&d)
        .args(["--format", "dot", "--condense", "rank-mb"])
        .assert()
        .success();
    // torch CSV: one line per rank, and it imports back to the same compute order.
    let loaded = pipec_ir::files::load_dir(&d).unwrap();
    for (flag, lines) in [
        (None, loaded.program.world()),
        (Some("--compute-only"), loaded.program.world()),
    ] {
        let mut cmd = pipec();
        cmd.arg("export").arg(&d).args(["--format", "torch-csv"]);
        if let Some(f) = flag {
            cmd.arg(f);
        }
        let out = cmd.assert().success();
        let text = String::from_utf8(out.get_output().stdout.clone()).unwrap();
        assert_eq!(text.lines().count() as u32, lines, "{text}");
        let back = pipec_compiler::torch::import_csv(&text, &Default::default()).unwrap();
        assert_eq!(
            back.program.compute_orders(),
            loaded.program.compute_orders()
        );
    }
    pipec()
        .arg("export")
        .arg(tmp.path().join("missing"))
        .args(["--format", "svg"])
        .assert()
        .code(2);
    pipec()
        .arg("export")
        .arg(&d)
        .args(["--format", "svg", "--cost", "p2p=-1"])
        .assert()
        .code(1);
    pipec()
        .arg("export")
        .arg(deadlock_dir(tmp.path()))
        .args(["--format", "chrome-trace"])
        .assert()
        .code(1);
}

/// 1F1B orders rewritten with split backwards (each `bwd` becomes `bwd_D`, its `bwd_W`
/// deferred by one op) and with steady-state (B, next F) fused into overlapped `fwd_bwd` ops
/// (one more forward in warmup, as Megatron's combined 1F1B), lowered one op per comm step: programs with every kind of compute op, until the
/// zero-bubble and DualPipe generators exist.
fn split_and_paired(pp: u32, m: u32) -> (Compiled, Program, Program) {
    use pipec_schedules::{CommPolicy, RankOrder};
    let c = build(ScheduleKind::OneFOneB, pp, 1, m);
    let split: Vec<RankOrder> = c
        .schedule
        .ranks
        .iter()
        .map(|o| {
            let mut ops = Vec::new();
            let mut pending_w = None;
            for op in &o.ops {
                match *op {
                    Compute::Bwd(t) => {
                        ops.push(Compute::BwdD(t));
                        if let Some(w) = pending_w.replace(Compute::BwdW(t)) {
                            ops.push(w);
                        }
                    }
                    other => ops.push(other),
                }
            }
            ops.extend(pending_w);
            RankOrder { ops, ..o.clone() }
        })
        .collect();
    let paired: Vec<RankOrder> = c
        .schedule
        .ranks
        .iter()
        .map(|o| {
            let mut ops = Vec::new();
            let mut i = 0;
            while i < o.ops.len() {
                match (o.ops[i], o.ops.get(i + 1)) {
                    (Compute::Bwd(b), Some(&Compute::Fwd(f))) if i > o.warmup as usize => {
                        ops.push(Compute::FwdBwd { fwd: f, bwd: b });
                        i += 2;
                    }
                    (op, _) => {
                        ops.push(op);
                        i += 1;
                    }
                }
            }
            RankOrder { ops, ..o.clone() }
        })
        .collect();
    let lower = |orders: &[RankOrder]| {
        pipec_compiler::lower_orders(
            &c.schedule.placement,
            m,
            false,
            CommPolicy::FusedPerOp,
            orders,
        )
    };
    let (s, p) = (lower(&split), lower(&paired));
    (c, s, p)
}

#[test]
fn snapshot_split_backward_and_pairs() {
    let (c, split, paired) = split_and_paired(3, 4);
    let costs = StageCosts::new(
        &CostModel::parse("f=1,b=1,w=1,overlap=0.5").unwrap(),
        &c.layout,
        3,
    );
    let opts = timeline_text::TextOptions {
        width: 100,
        ..Default::default()
    };
    let s = simulate(&pipec_tests::verified(&split), &costs).expect("split program runs");
    let p = simulate(&pipec_tests::verified(&paired), &costs).expect("paired program runs");
    for (prog, sim) in [(&split, &s), (&paired, &p)] {
        let text = timeline_text::render(prog, &sim.timeline, &opts);
        check_rows(&text, prog, &sim.timeline, 100, &[0, 1, 2], 0.0, None);
    }
    insta::assert_snapshot!(
        "text_split_and_paired_pp3_m4",
        format!(
            "{}\n{}",
            timeline_text::render(&split, &s.timeline, &opts),
            timeline_text::render(&paired, &p.timeline, &opts)
        )
    );
    // Same compute, split: the busy time per rank is unchanged (bwd = bwd_D + bwd_W).
    let full = sim(&c, "f=1,b=1,w=1");
    for (a, b) in s.summary.ranks.iter().zip(&full.summary.ranks) {
        assert!(close(a.busy, b.busy));
    }
    // A pair costs max(f, b) + (1 - overlap) * min(f, b) = 2 + 0.5.
    let pair_spans: Vec<f64> = paired
        .ranks
        .iter()
        .zip(&p.timeline.ranks)
        .flat_map(|(is, ss)| is.iter().zip(ss))
        .filter(|(i, _)| matches!(i, Instr::Compute(Compute::FwdBwd { .. })))
        .map(|(_, s)| s.end - s.start)
        .collect();
    assert!(!pair_spans.is_empty() && pair_spans.iter().all(|&d| close(d, 2.5)));
}

// ---------------------------------------------------------------------------------------------
// Issue 29: bounded size flags, `show` at real sizes, SVG chunks and the SVG overview.

/// The rows and legend of `render` at `width`: every line fits, colour codes aside.
fn visible(s: &str) -> usize {
    timeline_text::visible_width(s)
}

#[test]
fn show_width_is_bounded() {
    let tmp = tempfile::tempdir().unwrap();
    let d = compiled(tmp.path(), "a", "--schedule 1f1b --pp 4 --microbatches 8");
    // Each used to run for minutes or be killed for memory (100000000, 4294967295).
    for bad in [
        "100000000",
        "4294967295",
        "10001",
        "19",
        "0",
        "-5",
        "abc",
        "1e3",
    ] {
        let t = std::time::Instant::now();
        pipec()
            .arg("show")
            .arg(&d)
            .args(["--width", bad])
            .assert()
            .code(2)
            .stderr(predicates::str::contains("--width"))
            .stderr(predicates::str::contains("20 to 10000 columns"));
        assert!(t.elapsed().as_secs() < 20, "--width {bad}");
    }
    // The bounds themselves draw, using every column.
    for w in [20usize, 10_000] {
        let out =
            stdout_of(
                pipec()
                    .arg("show")
                    .arg(&d)
                    .args(["--no-color", "--width", &w.to_string()]),
            );
        let rows: Vec<&str> = out
            .lines()
            .filter(|l| l.starts_with("rank ") && l.contains('│'))
            .collect();
        assert_eq!(rows.len(), 4, "{out}");
        assert!(rows.iter().all(|l| l.chars().count() == w), "{out}");
    }
    // COLUMNS is a terminal's hint: brought within the range, never an unbounded width.
    for (cols, w) in [("100000000", 10_000usize), ("5", 20)] {
        let out = stdout_of(pipec().arg("show").arg(&d).env("COLUMNS", cols));
        assert!(
            out.lines()
                .filter(|l| l.starts_with("rank ") && l.contains('│'))
                .all(|l| l.chars().count() == w),
            "COLUMNS={cols}"
        );
    }
}

#[test]
fn export_size_flags_are_bounded() {
    let tmp = tempfile::tempdir().unwrap();
    let d = compiled(
        tmp.path(),
        "a",
        "--schedule 1f1b --pp 8 --microbatches 1024",
    );
    for bad in ["1e12", "32769", "299", "10", "-5", "nan", "inf", "wide"] {
        pipec()
            .arg("export")
            .arg(&d)
            .args(["--format", "svg", "--svg-width", bad])
            .assert()
            .code(2)
            .stderr(predicates::str::contains("--svg-width"))
            .stderr(predicates::str::contains("300 to 32768 pixels"));
    }
    // Every instruction as a node: more than Graphviz lays out, refused unless --full.
    let loaded = pipec_ir::files::load_dir(&d).unwrap();
    assert!(loaded.program.len() > 20_000);
    pipec()
        .arg("export")
        .arg(&d)
        .args(["--format", "dot", "--condense", "none"])
        .assert()
        .code(2)
        .stderr(predicates::str::contains("--condense none"))
        .stderr(predicates::str::contains("at most 20000"));
    let full = stdout_of(pipec().arg("export").arg(&d).args([
        "--format",
        "dot",
        "--condense",
        "none",
        "--full",
    ]));
    let nodes = full
        .lines()
        .filter(|l| l.trim_start().starts_with('r') && l.contains("[label="))
        .count();
    assert_eq!(nodes, loaded.program.len());
    // The default (auto) and per-stage graphs stay small.
    pipec()
        .arg("export")
        .arg(&d)
        .args(["--format", "dot"])
        .assert()
        .success();
    pipec()
        .arg("export")
        .arg(&d)
        .args(["--format", "torch-csv", "--full"])
        .assert()
        .code(2);
}

#[test]
fn show_uses_the_whole_width() {
    let tmp = tempfile::tempdir().unwrap();
    let d = compiled(tmp.path(), "a", "--schedule 1f1b --pp 4 --microbatches 8");
    let (program, timeline) = timeline_of(&d);
    let mut seen = Vec::new();
    for width in [30usize, 80, 100, 117, 250] {
        let out = stdout_of(pipec().arg("show").arg(&d).args([
            "--no-color",
            "--width",
            &width.to_string(),
        ]));
        // Rows fill the width exactly (rank label, two borders, the rest timeline).
        for l in out
            .lines()
            .filter(|l| l.starts_with("rank ") && l.contains('│'))
        {
            assert_eq!(l.chars().count(), width, "{out}");
        }
        check_rows(&out, &program, &timeline, width, &[0, 1, 2, 3], 0.0, None);
        seen.push(out);
    }
    // 80 and 100 columns used to print the same picture (the scale snapped to whole units).
    assert_ne!(seen[1], seen[2]);
}

#[test]
fn show_legend_fits_the_width() {
    let (c, split, paired) = split_and_paired(3, 4);
    let costs = StageCosts::new(
        &CostModel::parse("f=1,b=1,w=1,overlap=0.5").unwrap(),
        &c.layout,
        3,
    );
    for program in [&split, &paired, &c.program] {
        let s = simulate(&pipec_tests::verified(program), &costs).unwrap();
        for width in (20..=140).step_by(3) {
            for color in [false, true] {
                let text = timeline_text::render(
                    program,
                    &s.timeline,
                    &timeline_text::TextOptions {
                        width,
                        color,
                        ..Default::default()
                    },
                );
                for l in text.lines() {
                    assert!(visible(l) <= width, "{width} {color}: {l:?}\n{text}");
                }
                // Nothing of the legend is lost: every kind drawn is named.
                let flat = text.split_whitespace().collect::<Vec<_>>().join(" ");
                assert!(flat.contains("idle"), "{text}");
            }
        }
    }
    // At 80 columns the legend of all five kinds takes several lines, none wider than 80.
    let s = simulate(&pipec_tests::verified(&paired), &costs).unwrap();
    let text = timeline_text::render(
        &paired,
        &s.timeline,
        &timeline_text::TextOptions {
            width: 80,
            ..Default::default()
        },
    );
    assert!(text.contains("overlapped forward + backward"), "{text}");
    assert!(text.lines().all(|l| l.chars().count() <= 80), "{text}");
}

/// Llama-3 70B's pipeline (80 layers, pp=8, vpp=5, M=64): at 200 columns the steady state was
/// 95% `+`. Each long mixed run now names its work by kind, checked against the timeline.
#[test]
fn show_mixed_runs_name_their_work() {
    let tmp = tempfile::tempdir().unwrap();
    let d = compiled(
        tmp.path(),
        "llama",
        "--schedule interleaved-1f1b --pp 8 --vpp 5 --microbatches 64 --num-layers 80",
    );
    let (program, timeline) = timeline_of(&d);
    let all: Vec<usize> = (0..8).collect();
    for width in [80usize, 100, 200, 300] {
        let out = stdout_of(pipec().arg("show").arg(&d).args([
            "--no-color",
            "--width",
            &width.to_string(),
        ]));
        check_rows(&out, &program, &timeline, width, &all, 0.0, None);
        if width <= 100 {
            // The long steady state is one labelled run per rank: 1F1B does two backward
            // time units per forward one (b + w = 2f), so B 67% F 33%. (At 200 columns a
            // column is about 10 units and some hold over 3/4 backward: letters break the run.)
            for l in out
                .lines()
                .filter(|l| l.starts_with("rank ") && l.contains('│'))
            {
                assert!(l.contains("F3") && l.contains('%'), "{out}");
            }
            assert!(out.contains("a run of + names its work"), "{out}");
        }
    }
}

/// The chunk of the stage in an SVG op's tooltip (`rank 1, #4: F s3 mb5 ...`), from the
/// looped placement: stage s is chunk s / pp.
fn tooltip_chunk(title: &str, pp: u32) -> u32 {
    let s = title.split(" s").nth(1).unwrap();
    let stage: u32 = s.split(' ').next().unwrap().parse().unwrap();
    stage / pp
}

#[test]
fn svg_chunks_distinct_when_vpp_gt_2() {
    for vpp in 2..=12u32 {
        let pp = 2;
        let c = build(ScheduleKind::Interleaved1F1B, pp, vpp, 4);
        let s = sim(&c, "");
        let text = svg::render(&c.program, &s.timeline, &svg::SvgOptions::default());
        let doc = roxmltree::Document::parse(&text).expect("SVG is XML");
        let patterns: Vec<String> = doc
            .descendants()
            .filter(|n| n.has_tag_name("pattern"))
            .map(|n| n.attribute("id").unwrap().to_string())
            .collect();
        // kind letter -> chunk -> fill
        let mut fills: std::collections::BTreeMap<(String, u32), String> = Default::default();
        for r in doc.descendants().filter(|n| {
            n.has_tag_name("rect") && n.attribute("class").is_some_and(|c| c.starts_with("op "))
        }) {
            let kind = r.attribute("class").unwrap()[3..].to_string();
            let title = r
                .children()
                .find(|n| n.has_tag_name("title"))
                .unwrap()
                .text()
                .unwrap();
            let chunk = tooltip_chunk(title, pp);
            let f = r.attribute("fill").unwrap().to_string();
            if let Some(id) = f.strip_prefix("url(#").and_then(|x| x.strip_suffix(')')) {
                assert!(patterns.iter().any(|p| p == id), "{f} undefined");
            }
            let prev = fills.insert((kind.clone(), chunk), f.clone());
            assert!(
                prev.is_none_or(|p| p == f),
                "chunk {chunk} of {kind}: two looks"
            );
        }
        assert_eq!(fills.len() as u32, 2 * vpp, "vpp={vpp}: {fills:?}");
        // Within a kind, every chunk looks different; solid shades differ clearly (at least
        // 40 in some RGB channel), not only by light/dark parity.
        for kind in ["F", "B"] {
            let looks: Vec<&String> = (0..vpp).map(|ch| &fills[&(kind.to_string(), ch)]).collect();
            for a in 0..looks.len() {
                for b in 0..a {
                    assert_ne!(looks[a], looks[b], "vpp={vpp} chunks {a} and {b}");
                    let rgb = |s: &str| {
                        (0..3)
                            .map(|i| i64::from_str_radix(&s[1 + 2 * i..3 + 2 * i], 16).unwrap())
                            .collect::<Vec<_>>()
                    };
                    if looks[a].starts_with('#') && looks[b].starts_with('#') {
                        let (x, y) = (rgb(looks[a]), rgb(looks[b]));
                        let d = (0..3).map(|i| (x[i] - y[i]).abs()).max().unwrap();
                        assert!(
                            d >= 40,
                            "vpp={vpp} chunks {a} {b}: {} {}",
                            looks[a],
                            looks[b]
                        );
                    }
                }
            }
        }
        if vpp == 2 {
            // Two chunks keep the light/dark parity of before.
            assert_eq!(fills[&("F".to_string(), 0)], "#4e79a7");
            assert_eq!(fills[&("F".to_string(), 1)], "#9db5ce");
            assert!(!text.contains("chunk 0"));
        } else {
            assert!(text.contains("chunk 0"), "the legend names the chunks");
        }
    }
}

/// The overview's tenths of a cell per kind, from the cell's work by kind (time units) and
/// length `u`, by the rule docs/views.md states, written out independently: the busy share in
/// tenths rounded up (at least 1, at most 10), shared by largest remainder (ties F, B, I, W,
/// X order).
fn overview_tenths(work: &[(char, f64)], u: f64) -> Vec<(char, u32)> {
    let busy: f64 = work.iter().map(|x| x.1).sum();
    if busy <= 0.0 {
        return Vec::new();
    }
    let total = ((busy / u * 10.0 - 1e-9).ceil() as u32).clamp(1, 10);
    let order = "FBIWX";
    let mut parts: Vec<(char, u32, f64)> = work
        .iter()
        .map(|&(k, w)| {
            let q = w / busy * total as f64;
            (k, q.floor() as u32, q - q.floor())
        })
        .collect();
    let mut left = total - parts.iter().map(|p| p.1).sum::<u32>();
    let mut idx: Vec<usize> = (0..parts.len()).collect();
    idx.sort_by(|&a, &b| {
        parts[b]
            .2
            .total_cmp(&parts[a].2)
            .then(order.find(parts[a].0).cmp(&order.find(parts[b].0)))
    });
    for i in idx {
        if left == 0 {
            break;
        }
        parts[i].1 += 1;
        left -= 1;
    }
    let mut out: Vec<(char, u32)> = parts
        .into_iter()
        .filter(|p| p.1 > 0)
        .map(|p| (p.0, p.1))
        .collect();
    out.sort_by_key(|p| order.find(p.0));
    out
}

/// One overview cell read back: `(kind letter, tenths)`, top down.
type Stack = Vec<(char, u32)>;

/// Read an overview back: per lane and bucket, the `(kind, tenths)` drawn there, top down;
/// each kind's rect is as tall as its tenths of the lane and stacked under the previous one.
fn overview_cells(text: &str, lanes: usize) -> (usize, Vec<Vec<Stack>>) {
    let doc = roxmltree::Document::parse(text).expect("SVG is XML");
    let g = doc
        .descendants()
        .find(|n| n.attribute("class") == Some("overview"))
        .expect("overview group");
    let buckets: usize = g.attribute("data-buckets").unwrap().parse().unwrap();
    let lane_y: Vec<(f64, f64)> = doc
        .descendants()
        .filter(|n| n.attribute("class") == Some("lane"))
        .map(|n| {
            (
                n.attribute("y").unwrap().parse().unwrap(),
                n.attribute("height").unwrap().parse().unwrap(),
            )
        })
        .collect();
    assert_eq!(lane_y.len(), lanes);
    let width: f64 = doc
        .root_element()
        .attribute("width")
        .unwrap()
        .parse()
        .unwrap();
    let (left, plot_w) = (64.0, width - 64.0 - 24.0);
    let bw = plot_w / buckets as f64;
    let mut cells = vec![vec![Vec::new(); buckets]; lanes];
    let mut tops = vec![vec![None::<f64>; buckets]; lanes];
    for r in g.children().filter(|n| n.has_tag_name("rect")) {
        let y: f64 = r.attribute("y").unwrap().parse().unwrap();
        let hgt: f64 = r.attribute("height").unwrap().parse().unwrap();
        let rank = lane_y
            .iter()
            .position(|&(l, h)| y >= l - 1e-6 && y + hgt <= l + h + 1e-6)
            .expect("a lane");
        let x: f64 = r.attribute("x").unwrap().parse().unwrap();
        let w: f64 = r.attribute("width").unwrap().parse().unwrap();
        let (b0, b1) = (
            ((x - left) / bw).round() as usize,
            ((x + w - left) / bw).round() as usize,
        );
        let kind = r.attribute("class").unwrap()["bucket ".len()..]
            .chars()
            .next()
            .unwrap();
        let t: u32 = r.attribute("data-tenths").unwrap().parse().unwrap();
        for b in b0..b1 {
            // Stacked: each rect starts where the one above ended.
            if let Some(end) = tops[rank][b] {
                assert!(
                    (end - y).abs() < 0.02,
                    "rank {rank} bucket {b}: gap in the stack"
                );
            }
            tops[rank][b] = Some(y + hgt);
            cells[rank][b].push((kind, t));
        }
    }
    (buckets, cells)
}

/// The work by kind in `[a, z)` of rank `r`, straight from the spans.
fn work_in(program: &Program, tl: &Timeline, r: usize, a: f64, z: f64) -> Vec<(char, f64)> {
    let mut by_kind: Vec<(char, f64)> = Vec::new();
    for (ins, sp) in program.ranks[r].iter().zip(&tl.ranks[r]) {
        let Instr::Compute(op) = ins else { continue };
        let o = sp.end.min(z) - sp.start.max(a);
        if o > 0.0 {
            let k = pipec_compiler::view::OpKind::of(op).letter();
            match by_kind.iter_mut().find(|x| x.0 == k) {
                Some(x) => x.1 += o,
                None => by_kind.push((k, o)),
            }
        }
    }
    by_kind
}

/// The overview against the timeline: bucket `b` of rank `r` (the window cut into
/// `data-buckets` equal buckets) is a stack of one rect per kind, each as many tenths of the
/// lane as the documented rule gives from the bucket's work by kind; nothing where no op runs.
#[test]
fn svg_at_scale_is_an_overview() {
    let c = build(ScheduleKind::Interleaved1F1B, 4, 3, 16);
    let s = sim(&c, "f=1,b=2,w=1,p2p=0.25");
    let opts = svg::SvgOptions {
        max_ops: 100,
        ..Default::default()
    };
    let text = svg::render(&c.program, &s.timeline, &opts);
    assert!(
        !text.contains("class=\"op "),
        "an overview draws no single op"
    );
    let (buckets, cells) = overview_cells(&text, 4);
    let u = s.timeline.makespan() / buckets as f64;
    let mut mixed = 0;
    for (r, row) in cells.iter().enumerate() {
        for (b, cell) in row.iter().enumerate() {
            let work = work_in(&c.program, &s.timeline, r, b as f64 * u, (b + 1) as f64 * u);
            assert_eq!(
                *cell,
                overview_tenths(&work, u),
                "rank {r} bucket {b}: {work:?}"
            );
            mixed += usize::from(cell.len() > 1);
        }
    }
    assert!(mixed > 0, "some buckets hold two kinds");
    // Below the threshold, or asked for, every op.
    let ops = svg::render(
        &c.program,
        &s.timeline,
        &svg::SvgOptions {
            detail: svg::Detail::Ops,
            ..opts.clone()
        },
    );
    let computes = c
        .program
        .ranks
        .iter()
        .flatten()
        .filter(|i| matches!(i, Instr::Compute(_)))
        .count();
    assert_eq!(ops.matches("class=\"op ").count(), computes);
    assert_eq!(
        ops,
        svg::render(&c.program, &s.timeline, &svg::SvgOptions::default())
    );
}

/// Issue #40: the overview drew a 50/50 steady state as solid backward (the kind doing most
/// work took the whole cell). 1F1B at pp=8, M=512 with a backward as long as a forward
/// (`b=1,w=0`) in a 300-pixel picture: a bucket holds about five cycles, so every bucket of
/// every rank's steady state is half forward and half backward, drawn as 5 tenths of each,
/// as the brute-force reading says of every bucket.
#[test]
fn svg_overview_draws_a_mixed_steady_state_as_mixed() {
    let c = build(ScheduleKind::OneFOneB, 8, 1, 512);
    let s = sim(&c, "f=1,b=1,w=0");
    let text = svg::render(
        &c.program,
        &s.timeline,
        &svg::SvgOptions {
            width: 300.0,
            detail: svg::Detail::Overview,
            ..Default::default()
        },
    );
    let (buckets, cells) = overview_cells(&text, 8);
    let u = s.timeline.makespan() / buckets as f64;
    for (r, row) in cells.iter().enumerate() {
        // The steady state: from the end of the rank's first backward to the start of its
        // last forward.
        let spans: Vec<(&Instr, &pipec_cost::timeline::Span)> = c.program.ranks[r]
            .iter()
            .zip(&s.timeline.ranks[r])
            .collect();
        let first_b = spans
            .iter()
            .find(|(i, _)| matches!(i, Instr::Compute(Compute::Bwd(_))))
            .unwrap()
            .1
            .end;
        let last_f = spans
            .iter()
            .rev()
            .find(|(i, _)| matches!(i, Instr::Compute(Compute::Fwd(_))))
            .unwrap()
            .1
            .start;
        let steady = ((first_b / u).ceil() as usize)..((last_f / u).floor() as usize);
        assert!(
            steady.len() > buckets / 2,
            "rank {r}: {steady:?} of {buckets}"
        );
        for (b, cell) in row.iter().enumerate() {
            let work = work_in(&c.program, &s.timeline, r, b as f64 * u, (b + 1) as f64 * u);
            assert_eq!(*cell, overview_tenths(&work, u), "rank {r} bucket {b}");
            if steady.contains(&b) {
                assert_eq!(
                    *cell,
                    vec![('F', 5), ('B', 5)],
                    "rank {r} bucket {b}: {work:?}"
                );
            }
        }
    }
}

/// The CLI writes the overview above 20000 ops by default, says so and how to get every op.
#[test]
fn svg_export_at_scale_is_an_overview() {
    let tmp = tempfile::tempdir().unwrap();
    let d = compiled(
        tmp.path(),
        "big",
        "--schedule interleaved-1f1b --pp 8 --vpp 4 --microbatches 320",
    );
    let out = pipec()
        .arg("export")
        .arg(&d)
        .args(["--format", "svg"])
        .assert()
        .success()
        .stderr(predicates::str::contains("--svg-detail ops"));
    let text = String::from_utf8(out.get_output().stdout.clone()).unwrap();
    roxmltree::Document::parse(&text).unwrap();
    assert!(text.contains("class=\"overview\"") && !text.contains("class=\"op "));
    assert!(text.len() < 2 << 20, "{} bytes", text.len());
    for flags in [&["--svg-detail", "ops"][..], &["--full"]] {
        let all = stdout_of(
            pipec()
                .arg("export")
                .arg(&d)
                .args(["--format", "svg"])
                .args(flags),
        );
        assert_eq!(
            all.matches("class=\"op ").count(),
            8 * 4 * 320 * 2,
            "{flags:?}"
        );
    }
    // A window small enough draws every op without being asked.
    let win = stdout_of(
        pipec()
            .arg("export")
            .arg(&d)
            .args(["--format", "svg", "--ranks", "0", "--to", "200"]),
    );
    assert!(win.contains("class=\"op ") && !win.contains("class=\"overview\""));
    pipec()
        .arg("export")
        .arg(&d)
        .args(["--format", "dot", "--svg-detail", "ops"])
        .assert()
        .code(2);
}

/// The copy stream in every view (#30): a tuned schedule fitted with offload shows one copy
/// row per copying rank in `show` (`>` and `<`), one SVG bar and one Chrome event per copy
/// (on a thread `rank R copy`), each at the simulator's span.
#[test]
fn views_draw_the_copy_stream() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("fit");
    let o = crate::harness::pipec()
        .args([
            "tune",
            "--pp",
            "2",
            "--microbatches",
            "4",
            "--num-layers",
            "4",
        ])
        .args([
            "--cost",
            "t.offload=0.3",
            "--memory-limit",
            "2",
            "--target",
            "pipec-run",
            "-o",
        ])
        .arg(&out)
        .output()
        .unwrap();
    assert_eq!(
        o.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let program = pipec_ir::files::load_dir(&out).unwrap().program;
    let copies: Vec<usize> = program
        .ranks
        .iter()
        .map(|r| {
            r.iter()
                .filter(|i| matches!(i, pipec_ir::ir::Instr::Memory(m) if m.kind.is_copy()))
                .count()
        })
        .collect();
    let total: usize = copies.iter().sum();
    assert!(total > 0, "the winner offloads nothing");
    let show = crate::harness::pipec()
        .args(["show", "--width", "100", "--no-color"])
        .arg(&out)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&show.stdout);
    let rows = text
        .lines()
        .filter(|l| l.trim_start().starts_with("copy │"))
        .count();
    assert_eq!(rows, copies.iter().filter(|&&n| n > 0).count(), "{text}");
    assert!(
        text.contains('>') && text.contains("> offload, < reload"),
        "{text}"
    );
    let svg = dir.path().join("t.svg");
    let trace = dir.path().join("t.json");
    for (format, file) in [("svg", &svg), ("chrome-trace", &trace)] {
        let o = crate::harness::pipec()
            .args(["export", "--format", format, "-o"])
            .arg(file)
            .arg(&out)
            .output()
            .unwrap();
        assert_eq!(
            o.status.code(),
            Some(0),
            "{}",
            String::from_utf8_lossy(&o.stderr)
        );
    }
    let svg = std::fs::read_to_string(svg).unwrap();
    assert_eq!(svg.matches(r#"class="copy "#).count(), total);
    let trace: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(trace).unwrap()).unwrap();
    let events = trace
        .get("traceEvents")
        .and_then(|e| e.as_array())
        .or_else(|| trace.as_array())
        .unwrap();
    let copy_events = events.iter().filter(|e| e["cat"] == "copy").count();
    assert_eq!(copy_events, total);
    let world = program.ranks.len() as u64;
    for (r, &n) in copies.iter().enumerate() {
        let name = format!("rank {r} copy");
        let named = events
            .iter()
            .any(|e| e["name"] == "thread_name" && e["args"]["name"] == name.as_str());
        assert_eq!(named, n > 0, "{name}");
        let on = events
            .iter()
            .filter(|e| e["cat"] == "copy" && e["tid"] == world + r as u64)
            .count();
        assert_eq!(on, n, "{name}");
    }
}

// ---------------------------------------------------------------------------------------------
// Inspection at real sizes (issue #17): `compare` on equal models, `show` columns checked
// against the simulated timeline by independent code, one named bubble, checked costs, exit
// codes, and CSV input wherever `check` takes it.

fn stdout(c: &mut Command) -> String {
    let out = c.assert().success().get_output().stdout.clone();
    String::from_utf8(out).expect("utf-8")
}

/// The rows of a `compare` table after its header line, as whitespace-split cells.
fn table_rows(out: &str) -> Vec<Vec<String>> {
    let mut lines = out.lines().skip_while(|l| !l.starts_with("schedule"));
    lines.next().expect("table header");
    lines
        .take_while(|l| !l.starts_with('*'))
        .map(|l| l.split_whitespace().map(str::to_string).collect())
        .collect()
}

/// The issue's example: without a layout every candidate gets the same 16 decoder layers, so
/// 1F1B's makespan is the published `(m + p - 1)(F + B)` with two layers per stage (F = 2,
/// B = 4), 426 rather than the 213 of a half-size model, and ZB-V beats it.
#[test]
fn compare_builds_every_schedule_on_the_same_model() {
    let out = stdout(pipec().args([
        "compare",
        "--schedule",
        "1f1b",
        "--schedule",
        "zb-v",
        "--schedule",
        "interleaved-1f1b",
        "--pp",
        "8",
        "--vpp",
        "2",
        "--microbatches",
        "64",
    ]));
    assert!(out.contains("same for every schedule"), "{out}");
    let rows = table_rows(&out);
    assert_eq!(rows.len(), 3, "{out}");
    // Cells: name (4 words), model (2), instrs, makespan, vs first, ...
    for r in &rows {
        assert_eq!(r[4..6], ["16".to_string(), "t".to_string()], "{out}");
        assert!(!r[8].ends_with('*'), "{out}");
    }
    let (p, m, f, b) = (8.0, 64.0, 2.0, 4.0);
    assert_eq!(rows[0][7], format!("{}", (m + p - 1.0) * (f + b)), "{out}");
    let zbv: f64 = rows[1][8].trim_end_matches('x').parse().unwrap();
    assert!(zbv < 1.0, "zb-v must beat 1f1b on the same model: {out}");

    // --num-layers picks the model; an uneven split is refused as invalid input.
    let out = stdout(pipec().args([
        "compare",
        "--schedule",
        "1f1b",
        "--schedule",
        "gpipe",
        "--pp",
        "4",
        "--microbatches",
        "8",
        "--num-layers",
        "8",
    ]));
    assert!(table_rows(&out).iter().all(|r| r[4] == "8"), "{out}");
    pipec()
        .args([
            "compare",
            "--schedule",
            "1f1b",
            "--pp",
            "4",
            "--microbatches",
            "8",
            "--num-layers",
            "6",
        ])
        .assert()
        .code(1);
}

/// Directories of different models are flagged, not ranked.
#[test]
fn compare_flags_rows_of_different_models() {
    let tmp = tempfile::tempdir().unwrap();
    let small = compiled(
        tmp.path(),
        "small",
        "--schedule 1f1b --pp 2 --microbatches 4",
    );
    let big = compiled(
        tmp.path(),
        "big",
        "--schedule 1f1b --pp 2 --microbatches 4 --num-layers 4",
    );
    let out = stdout(pipec().arg("compare").arg(&small).arg(&big));
    let rows = table_rows(&out);
    assert!(rows[1].iter().any(|c| c.ends_with("x*")), "{out}");
    assert!(out.contains("not comparable"), "{out}");
}

/// `--num-layers` without `--layout` builds that model instead of being ignored.
#[test]
fn num_layers_without_layout_splits_the_layers() {
    let tmp = tempfile::tempdir().unwrap();
    let d = compiled(
        tmp.path(),
        "nl",
        "--schedule 1f1b --pp 4 --microbatches 8 --num-layers 16 --mtp-num-layers 1",
    );
    let loaded = pipec_ir::files::load_dir(&d).unwrap();
    let layout = &loaded.manifest.layout;
    assert_eq!(
        layout.count(pipec_schedules::layout::LayerKind::Decoder),
        16
    );
    assert_eq!(layout.count(pipec_schedules::layout::LayerKind::Mtp), 1);
    pipec()
        .args([
            "compile",
            "--schedule",
            "1f1b",
            "--pp",
            "4",
            "--microbatches",
            "8",
            "--num-layers",
            "6",
            "-o",
        ])
        .arg(tmp.path().join("bad"))
        .assert()
        .code(1);
}

// ---------------------------------------------------------------------------------------------
// `show`: every column against the simulated timeline.

/// The simulated timeline of a compiled directory under the default costs.
pub(crate) fn timeline_of(dir: &Path) -> (Program, Timeline) {
    let loaded = pipec_ir::files::load_dir(dir).unwrap();
    let costs = StageCosts::new(
        &CostModel::default(),
        &loaded.manifest.layout,
        loaded.program.num_stages(),
    );
    let sim = pipec_cost::simulate::simulate_unverified(
        &pipec_tests::unverified(&loaded.program),
        &costs,
    )
    .unwrap();
    (loaded.program, sim.timeline)
}

/// Check the rank rows of `show --no-color` output against the timeline: each equals the row
/// the brute-force reader of [`crate::views_marks`] derives from the spans with the rule
/// docs/views.md states.
pub(crate) fn check_rows(
    out: &str,
    program: &Program,
    timeline: &Timeline,
    width: usize,
    ranks: &[usize],
    from: f64,
    to: Option<f64>,
) {
    let got = crate::views_marks::drawn_rows(out);
    let want = crate::views_marks::expected_rows(program, timeline, width, ranks, from, to);
    assert_eq!(got, want, "at width {width}:\n{out}");
    for l in out
        .lines()
        .filter(|l| l.trim_start().starts_with("rank ") && l.contains(" │"))
    {
        assert_eq!(l.chars().count(), width, "{out}");
    }
}

#[test]
fn show_columns_agree_with_the_simulated_timeline_at_every_width() {
    let tmp = tempfile::tempdir().unwrap();
    let cases: [(&str, &[&str]); 5] = [
        ("1f1b", &["--pp", "8", "--microbatches", "64"]),
        (
            "interleaved-1f1b",
            &[
                "--pp",
                "4",
                "--vpp",
                "2",
                "--microbatches",
                "8",
                "--layout",
                "Et|tt|tt|tt|tt|tt|tt|tL",
            ],
        ),
        ("zb-h1", &["--pp", "4", "--microbatches", "12"]),
        ("zb-v", &["--pp", "4", "--microbatches", "8"]),
        ("dualpipe", &["--pp", "4", "--microbatches", "8"]),
    ];
    for (kind, args) in cases {
        let mut a = vec!["--schedule", kind];
        a.extend_from_slice(args);
        let d = compiled(tmp.path(), kind, &a.join(" "));
        let (program, timeline) = timeline_of(&d);
        let all: Vec<usize> = (0..program.ranks.len()).collect();
        for width in [30usize, 80, 117, 200, 400] {
            let out = stdout(pipec().arg("show").arg(&d).args([
                "--no-color",
                "--width",
                &width.to_string(),
            ]));
            check_rows(&out, &program, &timeline, width, &all, 0.0, None);
        }
        // A window and a choice of ranks.
        let to = (timeline.makespan() * 0.6).round();
        let from = (timeline.makespan() * 0.2).round();
        let out = stdout(pipec().arg("show").arg(&d).args([
            "--no-color",
            "--width",
            "90",
            "--ranks",
            "1,3",
            "--from",
            &from.to_string(),
            "--to",
            &to.to_string(),
        ]));
        check_rows(&out, &program, &timeline, 90, &[1, 3], from, Some(to));
    }
}

#[test]
fn show_refuses_bad_windows_and_widths() {
    let tmp = tempfile::tempdir().unwrap();
    let d = compiled(tmp.path(), "s", "--schedule 1f1b --pp 2 --microbatches 4");
    for bad in [
        &["--width", "0"][..],
        &["--ranks", "2"],
        &["--ranks", "1-0"],
        &["--from", "5", "--to", "5"],
        &["--from", "1000"],
    ] {
        pipec()
            .arg("show")
            .arg(&d)
            .args(bad)
            .assert()
            .code(2)
            .stderr(predicates::str::starts_with("error:"));
    }
}

// ---------------------------------------------------------------------------------------------
// One bubble, checked costs, exit codes, CSV input.

#[test]
fn every_output_names_its_bubble() {
    let tmp = tempfile::tempdir().unwrap();
    let d = compiled(tmp.path(), "s", "--schedule 1f1b --pp 2 --microbatches 4");
    let def = pipec_cost::simulate::BUBBLE;
    assert!(stdout(pipec().arg("simulate").arg(&d)).contains(def));
    assert!(stdout(pipec().arg("show").arg(&d)).contains(def));
    assert!(stdout(pipec().arg("compare").arg(&d)).contains(def));
    let json: serde_json::Value =
        serde_json::from_str(&stdout(pipec().arg("simulate").arg(&d).arg("--json"))).unwrap();
    assert_eq!(json["bubble"], def);
}

#[test]
fn costs_are_finite_and_in_range_and_bad_input_exits_1() {
    let tmp = tempfile::tempdir().unwrap();
    let d = compiled(tmp.path(), "s", "--schedule 1f1b --pp 2 --microbatches 4");
    for cost in ["f=1e308,b=1e308", "f=1e13", "b=1e-12", "f=x"] {
        for cmd in ["show", "simulate"] {
            pipec()
                .arg(cmd)
                .arg(&d)
                .args(["--cost", cost])
                .assert()
                .code(1)
                .stderr(predicates::str::starts_with("error:"));
        }
    }
    pipec()
        .args([
            "compare",
            "--schedule",
            "nope",
            "--pp",
            "2",
            "--microbatches",
            "2",
        ])
        .assert()
        .code(1);
    pipec()
        .args([
            "compile",
            "--schedule",
            "nope",
            "--pp",
            "2",
            "--microbatches",
            "2",
            "-o",
        ])
        .arg(tmp.path().join("x"))
        .assert()
        .code(1);
    // Usage stays 2.
    pipec().args(["compare", "--bogus-flag"]).assert().code(2);
}

/// A torch CSV without the `.csv` extension is still a CSV (detected by content), and every
/// viewer takes what `check` takes.
#[test]
fn viewers_accept_torch_csv_like_check() {
    let tmp = tempfile::tempdir().unwrap();
    let d = compiled(tmp.path(), "s", "--schedule 1f1b --pp 2 --microbatches 4");
    let csv = tmp.path().join("schedule.txt");
    pipec()
        .arg("export")
        .arg(&d)
        .args(["--format", "torch-csv", "-o"])
        .arg(&csv)
        .assert()
        .success();
    pipec().arg("check").arg(&csv).assert().success();
    pipec().arg("show").arg(&csv).assert().success();
    pipec()
        .arg("simulate")
        .arg(&csv)
        .args(["--pp", "2"])
        .assert()
        .success();
    pipec()
        .arg("export")
        .arg(&csv)
        .args(["--format", "svg"])
        .assert()
        .success();
    // --pp applies to CSV input only.
    pipec()
        .arg("show")
        .arg(&d)
        .args(["--pp", "2"])
        .assert()
        .code(2);
}

/// Export, import with the layout, compare: the same schedule at 1.00x on the same model.
#[test]
fn csv_round_trip_keeps_the_layout_with_import_layout() {
    let tmp = tempfile::tempdir().unwrap();
    let layout = "Ett|tt|tt|ttL";
    let d = compiled(
        tmp.path(),
        "s",
        &format!("--schedule 1f1b --pp 4 --microbatches 8 --layout {layout}"),
    );
    let csv = tmp.path().join("s.csv");
    pipec()
        .arg("export")
        .arg(&d)
        .args(["--format", "torch-csv", "-o"])
        .arg(&csv)
        .assert()
        .success();
    let back = tmp.path().join("back");
    pipec()
        .arg("import")
        .arg(&csv)
        .args(["--layout", layout, "-o"])
        .arg(&back)
        .assert()
        .success();
    let out = stdout(pipec().arg("compare").arg(&d).arg(&back));
    let rows = table_rows(&out);
    assert!(rows[1].contains(&"1.00x".to_string()), "{out}");
    pipec()
        .arg("import")
        .arg(&csv)
        .args(["--layout", "Et|tL", "-o"])
        .arg(tmp.path().join("bad"))
        .assert()
        .code(1);
}

// ---------------------------------------------------------------------------------------------
// Exports: filters, flags that apply or are refused.

#[test]
fn export_filters_keep_the_ranks_and_window_asked_for() {
    let tmp = tempfile::tempdir().unwrap();
    let d = compiled(tmp.path(), "s", "--schedule 1f1b --pp 4 --microbatches 8");
    let (program, timeline) = timeline_of(&d);
    let (from, to) = (6.0, 15.0);
    // Expected, counted here: spans of ranks 1 and 2 meeting [from, to].
    let meets = |r: usize, compute: bool| {
        program.ranks[r]
            .iter()
            .zip(&timeline.ranks[r])
            .filter(|(i, s)| {
                (!compute || matches!(i, Instr::Compute(_))) && s.end >= from && s.start <= to
            })
            .count()
    };
    let args = [
        "--ranks",
        "1-2",
        "--from",
        &from.to_string(),
        "--to",
        &to.to_string(),
    ];
    let trace: serde_json::Value = serde_json::from_str(&stdout(
        pipec()
            .arg("export")
            .arg(&d)
            .args(["--format", "chrome-trace"])
            .args(args),
    ))
    .unwrap();
    let events = trace["traceEvents"].as_array().unwrap();
    for r in [0usize, 1, 2, 3] {
        let slices = events
            .iter()
            .filter(|e| e["ph"] == "X" && e["tid"] == r as u64)
            .count();
        let want = if r == 1 || r == 2 { meets(r, false) } else { 0 };
        assert_eq!(slices, want, "rank {r}");
    }
    // Compute only: no comm slices and no arrows.
    let trace: serde_json::Value = serde_json::from_str(&stdout(
        pipec()
            .arg("export")
            .arg(&d)
            .args(["--format", "chrome-trace", "--compute-only"])
            .args(args),
    ))
    .unwrap();
    let events = trace["traceEvents"].as_array().unwrap();
    assert!(events.iter().all(|e| e["cat"] != "comm" && e["ph"] != "s"));
    assert_eq!(
        events.iter().filter(|e| e["ph"] == "X").count(),
        meets(1, true) + meets(2, true)
    );
    // The SVG: one op rect per kept compute op, rows for the kept ranks only.
    let svg = stdout(
        pipec()
            .arg("export")
            .arg(&d)
            .args(["--format", "svg"])
            .args(args),
    );
    assert_eq!(
        svg.matches("<rect class=\"op ").count(),
        meets(1, true) + meets(2, true)
    );
    assert_eq!(svg.matches("<rect class=\"lane\"").count(), 2);
    assert!(svg.contains("showing 2 of 4 ranks"));
}

#[test]
fn export_refuses_flags_that_do_not_apply() {
    let tmp = tempfile::tempdir().unwrap();
    let d = compiled(tmp.path(), "s", "--schedule 1f1b --pp 2 --microbatches 4");
    for (format, flags) in [
        ("svg", &["--condense", "stage"][..]),
        ("chrome-trace", &["--svg-width", "800"]),
        ("dot", &["--compute-only"]),
        ("dot", &["--ranks", "0"]),
        ("torch-csv", &["--from", "1"]),
        ("svg", &["--ranks", "5"]),
        ("svg", &["--from", "3", "--to", "2"]),
    ] {
        pipec()
            .arg("export")
            .arg(&d)
            .args(["--format", format])
            .args(flags)
            .assert()
            .code(2)
            .stderr(predicates::str::starts_with("error:"));
    }
}

/// The verdict line of a wide pipeline lists a few peaks, not one per rank.
#[test]
fn compile_keeps_its_verdict_line_short_at_large_pp() {
    let tmp = tempfile::tempdir().unwrap();
    let out = crate::harness::compile(
        &tmp.path().join("wide"),
        "--schedule gpipe --pp 64 --microbatches 1",
    );
    let verdict = out.lines().find(|l| l.starts_with("verified")).unwrap();
    assert!(verdict.contains("64 ranks; pipec check"), "{verdict}");
    assert!(verdict.len() < 200, "{verdict}");
}

/// Progress goes to a terminal only: piped, a compile writes nothing on stderr.
#[test]
fn no_progress_output_when_stderr_is_not_a_terminal() {
    let tmp = tempfile::tempdir().unwrap();
    pipec()
        .args([
            "compile",
            "--schedule",
            "1f1b",
            "--pp",
            "4",
            "--microbatches",
            "64",
            "-o",
        ])
        .arg(tmp.path().join("s"))
        .assert()
        .success()
        .stderr("");
}

/// At real sizes the default trace stays openable: smaller than 100 MiB, with a note saying
/// what was kept; `--full` is the way to everything (the whole trace of pp=64, vpp=8, M=512 is
/// well over the cut).
#[test]
fn a_large_trace_is_cut_to_an_openable_size_with_a_note() {
    let tmp = tempfile::tempdir().unwrap();
    let d = compiled(
        tmp.path(),
        "big",
        "--schedule interleaved-1f1b --pp 64 --vpp 8 --microbatches 512 --format bin",
    );
    let out = tmp.path().join("big.json");
    let assert = pipec()
        .arg("export")
        .arg(&d)
        .args(["--format", "chrome-trace", "-o"])
        .arg(&out)
        .assert()
        .success();
    let err = String::from_utf8_lossy(&assert.get_output().stderr).to_string();
    assert!(err.contains("too big to open; kept"), "{err}");
    let size = std::fs::metadata(&out).unwrap().len();
    assert!(size < 100 << 20, "{size} bytes");
    assert!(size > 10 << 20, "kept far less than it could: {size} bytes");
}

/// "1 ranks" no more.
#[test]
fn compile_counts_in_words() {
    let tmp = tempfile::tempdir().unwrap();
    let out = crate::harness::compile(
        &tmp.path().join("one"),
        "--schedule gpipe --pp 1 --microbatches 1",
    );
    assert!(out.contains(": 1 rank, 1 stage, "), "{out}");
    // The verifier's verdict too.
    assert!(out.contains("verified: 1 rank, 2 instructions, "), "{out}");
}
