//! Memory instructions (issue 30) in compiled schedules: random valid insertions of offload,
//! reload, wait_offload and checkpoint/recompute, and the offload planner's own inserts
//! (`pipec_tune::offload::plan`), judged by
//! - a brute-force replay of each rank written here, which shares no code with
//!   `pipec_ir::ir::activations`: it lists every device and host buffer with the interval of
//!   instructions it is alive in (from docs/format.md, "Memory instructions") and sums them
//!   at every instruction;
//! - the planner's own positional peak, computed by its own profile;
//! - the verifier: a valid schedule with valid memory instructions has no violation (the copy
//!   stream adds no deadlock), and the brute-force executor (`pipec_tests::reference`) agrees.

use crate::harness::compile;
use pipec_compiler::lower::lower;
use pipec_ir::ir::{Instr, MemKind, MemOp, Program};
use pipec_ir::memory::{MemoryModel, Unit};
use pipec_ir::verify::{verify, Unverified, VerifyOptions};
use pipec_schedules::{generate, Compute, Limits, Pass, ScheduleKind, ScheduleSpec, Task};
use pipec_tests::reference::{execute, Verdict};
use proptest::prelude::*;
use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};
use serde_json::Value;
use std::collections::HashSet;
use std::path::Path;
use std::process::Output;

/// SplitMix64: the insertions' own choices, from one proptest seed.
pub(crate) struct Rng(pub(crate) u64);

impl Rng {
    pub(crate) fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    pub(crate) fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

pub(crate) fn program(kind: ScheduleKind, pp: u32, vpp: u32, m: u32) -> Option<Program> {
    let s = ScheduleSpec {
        kind,
        pp,
        vpp,
        microbatches: m,
        group_size: None,
        forward_only: false,
        combined: false,
        megatron_p2p: pipec_tests::megatron_p2p_for(kind, pp),
    };
    s.validate(&Limits::DEFAULT).ok()?;
    Some(lower(&generate(&s, &Limits::DEFAULT).ok()?))
}

pub(crate) fn mem(kind: MemKind, task: Task) -> Instr {
    Instr::Memory(MemOp { kind, task })
}

/// Whether `ins` holds a pass of `t` among `passes`.
pub(crate) fn has(ins: &Instr, t: Task, passes: &[Pass]) -> bool {
    ins.as_compute()
        .is_some_and(|c| c.parts().any(|(p, u)| u == t && passes.contains(&p)))
}

/// Positions `x` (insert before instruction `x`) that do not split a comm batch.
pub(crate) fn boundary(instrs: &[Instr], x: usize) -> bool {
    x == 0
        || x == instrs.len()
        || !(instrs[x - 1].batch().is_some() && instrs[x - 1].batch() == instrs[x].batch())
}

/// Insert `(position, instr)` pairs: each before the instruction at its position in
/// `instrs`, pairs at one position in the order given.
pub(crate) fn insert(instrs: &[Instr], mut ins: Vec<(usize, Instr)>) -> Vec<Instr> {
    ins.sort_by_key(|&(x, _)| x); // stable: keeps the given order at one position
    let mut out = Vec::with_capacity(instrs.len() + ins.len());
    let mut k = 0;
    for (x, i) in instrs.iter().enumerate() {
        while k < ins.len() && ins[k].0 == x {
            out.push(ins[k].1);
            k += 1;
        }
        out.push(*i);
    }
    out.extend(ins[k..].iter().map(|p| p.1));
    out
}

/// Random valid memory instructions on every rank: per plain forward, nothing, an offload
/// (posted between the forward and its backward) with its reload (between the offload and
/// the backward) and maybe a `wait_offload` (anywhere after the offload), or a checkpoint with
/// its recompute (between the forward and the backward).
pub(crate) fn with_memory_ops(p: &Program, rng: &mut Rng) -> Program {
    let mut out = p.clone();
    for (r, instrs) in p.ranks.iter().enumerate() {
        let mut instrs = instrs.clone();
        let mut ins: Vec<(usize, Instr)> = Vec::new();
        let n = instrs.len();
        let pick = |rng: &mut Rng, lo: usize, hi: usize, instrs: &[Instr]| -> usize {
            let ok: Vec<usize> = (lo..=hi).filter(|&x| boundary(instrs, x)).collect();
            ok[rng.below(ok.len())]
        };
        for i in 0..n {
            let Instr::Compute(Compute::Fwd(t)) = instrs[i] else {
                continue;
            };
            let Some(need) = (i + 1..n).find(|&j| has(&instrs[j], t, &[Pass::Bwd, Pass::BwdD]))
            else {
                continue;
            };
            match rng.below(4) {
                0 | 1 => {
                    let a = pick(rng, i + 1, need, &instrs);
                    ins.push((a, mem(MemKind::Offload, t)));
                    let c = pick(rng, a, need, &instrs);
                    ins.push((c, mem(MemKind::Reload, t)));
                    if rng.below(2) == 0 {
                        let w = pick(rng, a, n, &instrs);
                        ins.push((w, mem(MemKind::WaitOffload, t)));
                    }
                }
                2 => {
                    instrs[i] = Instr::FwdCheckpoint(t);
                    let c = pick(rng, i + 1, need, &instrs);
                    ins.push((c, mem(MemKind::Recompute, t)));
                }
                _ => {}
            }
        }
        out.ranks[r] = insert(&instrs, ins);
    }
    out
}

/// 1F1B at pp=2, M=3 with every memory instruction on rank 0: microbatch 0 offloaded (and
/// waited) after its forward and reloaded before its backward, microbatch 1 checkpointed and
/// recomputed before its backward. The compiled schedule and the program.
pub(crate) fn every_memory_op_1f1b() -> (pipec_compiler::compile::Compiled, Program) {
    let c = pipec_compiler::compile::compile(&pipec_compiler::compile::CompileRequest::new(
        ScheduleKind::OneFOneB,
        2,
        3,
    ))
    .unwrap();
    let r0 = &c.program.ranks[0];
    let (t0, t1) = (Task::new(0, 0), Task::new(0, 1));
    let at = |t: Task, pass: Pass| r0.iter().position(|i| has(i, t, &[pass])).unwrap();
    let mut ops = vec![
        (at(t0, Pass::Fwd) + 1, mem(MemKind::Offload, t0)),
        (at(t0, Pass::Fwd) + 1, mem(MemKind::WaitOffload, t0)),
        (at(t0, Pass::Bwd), mem(MemKind::Reload, t0)),
        (at(t1, Pass::Bwd), mem(MemKind::Recompute, t1)),
    ];
    ops.sort_by_key(|o| o.0);
    let mut r = insert(r0, ops);
    let f1 = r.iter().position(|i| has(i, t1, &[Pass::Fwd])).unwrap();
    r[f1] = Instr::FwdCheckpoint(t1);
    let mut q = c.program.clone();
    q.ranks[0] = r;
    (c, q)
}

/// The brute-force replay: every buffer with the instructions it is alive at (inclusive; a
/// buffer freed by an instruction is alive during it), device and host summed at every
/// instruction. Valid programs only (every rule of `verify::offload` kept).
pub(crate) fn replay(instrs: &[Instr], act: impl Fn(Task) -> f64) -> (f64, f64) {
    replay_split(instrs, |t| (act(t), act(t)))
}

/// [`replay`] with `weights(t) = (act, act_w)`: an activation on the device until its
/// backward is two buffers when a `bwd_D` of it comes first, `act - act_w` alive through that
/// `bwd_D` and `act_w` through the backward that frees the rest (issue #39: what the input
/// gradient alone reads goes at `bwd_D`, the weight GEMMs' inputs stay for `bwd_W`).
pub(crate) fn replay_split(instrs: &[Instr], weights: impl Fn(Task) -> (f64, f64)) -> (f64, f64) {
    let act = |t: Task| weights(t).0;
    let n = instrs.len();
    const NEVER: usize = usize::MAX;
    let first = |from: usize, f: &dyn Fn(&Instr) -> bool| (from..n).find(|&j| f(&instrs[j]));
    let is_mem = |i: &Instr, k: MemKind, t: Task| matches!(i, Instr::Memory(MemOp { kind, task }) if *kind == k && *task == t);
    // Where the copy posted at `k` is known to have ended: a wait_offload of it or of a
    // later copy, or a backward whose reload was posted at or after `k` and before it.
    let ended = |k: usize| -> usize {
        for j in k + 1..n {
            match instrs[j] {
                Instr::Memory(MemOp {
                    kind: MemKind::WaitOffload,
                    task,
                }) => {
                    let off = (0..j)
                        .rev()
                        .find(|&x| is_mem(&instrs[x], MemKind::Offload, task));
                    if off.is_some_and(|x| x >= k) {
                        return j;
                    }
                }
                Instr::Compute(c) => {
                    for (p, u) in c.parts() {
                        if matches!(p, Pass::Bwd | Pass::BwdD) {
                            let rel = (0..j)
                                .rev()
                                .find(|&x| is_mem(&instrs[x], MemKind::Reload, u));
                            if rel.is_some_and(|x| x >= k) {
                                return j;
                            }
                        }
                    }
                }
                _ => {}
            }
        }
        NEVER
    };
    let freed = |t: Task, from: usize| {
        first(from, &|i| has(i, t, &[Pass::Bwd, Pass::BwdW])).unwrap_or(NEVER)
    };
    let mut device: Vec<(usize, usize, f64)> = Vec::new();
    let mut host: Vec<(usize, usize, f64)> = Vec::new();
    // A whole activation alive from `i` until the backward at `b`: split at a `bwd_D` between.
    let whole = |device: &mut Vec<(usize, usize, f64)>, t: Task, i: usize, b: usize| {
        let (a, w) = weights(t);
        match first(i, &|x| has(x, t, &[Pass::BwdD])).filter(|&d| d < b) {
            Some(d) => {
                device.push((i, d, a - w));
                device.push((i, b, w));
            }
            None => device.push((i, b, a)),
        }
    };
    for (i, ins) in instrs.iter().enumerate() {
        match *ins {
            Instr::Compute(c) => {
                for (p, t) in c.parts() {
                    if p != Pass::Fwd {
                        continue;
                    }
                    let b = freed(t, i);
                    let off = first(i + 1, &|x| is_mem(x, MemKind::Offload, t));
                    match off {
                        Some(k) if k < b => device.push((i, ended(k), act(t))),
                        _ => whole(&mut device, t, i, b),
                    }
                }
            }
            Instr::FwdCheckpoint(t) => device.push((i, i, act(t))),
            Instr::Memory(MemOp { kind, task: t }) => match kind {
                MemKind::Reload | MemKind::Recompute => whole(&mut device, t, i, freed(t, i)),
                MemKind::Offload => {
                    let rel = first(i + 1, &|x| is_mem(x, MemKind::Reload, t));
                    host.push((i, rel.map_or(NEVER, ended), act(t)));
                }
                MemKind::WaitOffload => {}
            },
            _ => {}
        }
    }
    let peak = |bufs: &[(usize, usize, f64)]| {
        (0..n)
            .map(|i| {
                bufs.iter()
                    .filter(|&&(a, e, _)| a <= i && i <= e)
                    .map(|b| b.2)
                    .sum::<f64>()
            })
            .fold(0.0, f64::max)
    };
    (peak(&device), peak(&host))
}

fn weights(p: &Program, rng: &mut Rng) -> MemoryModel {
    MemoryModel {
        act: (0..p.num_stages())
            .map(|_| (1 + rng.below(5)) as f64)
            .collect(),
        param: vec![0.0; p.world() as usize],
        unit: Unit::LayerActivations,
        mb_scale: None,
        msg: None,
        act_w: None,
    }
}

pub(crate) fn kinds() -> Vec<(ScheduleKind, u32)> {
    vec![
        (ScheduleKind::Gpipe, 1),
        (ScheduleKind::DualPipe, 1),
        (ScheduleKind::VHalf, 2),
        (ScheduleKind::OneFOneB, 1),
        (ScheduleKind::Interleaved1F1B, 2),
        (ScheduleKind::ZbH1, 1),
        (ScheduleKind::ZbV, 2),
        (ScheduleKind::DualPipeV, 2),
    ]
}

/// Random insertions into compiled schedules: the verifier finds nothing wrong, the
/// executor runs them to the end, and the count equals the replay's on every rank.
#[test]
fn random_memory_ops_count_as_the_replay_and_verify() {
    let mut runner = TestRunner::new_with_rng(
        Config::default(),
        TestRng::deterministic_rng(RngAlgorithm::ChaCha),
    );
    let cases = (0..kinds().len(), 2u32..5, 1u32..9, any::<u64>());
    runner
        .run(&cases, |(k, pp, m, seed)| {
            let (kind, vpp) = kinds()[k];
            let Some(p) = program(kind, pp, vpp, m.max(pp)) else {
                return Ok(());
            };
            let mut rng = Rng(seed);
            let q = with_memory_ops(&p, &mut rng);
            let report = verify(&q, &VerifyOptions::default());
            prop_assert!(report.violations.is_empty(), "{:?}: {}", kind, report);
            let run = execute(&q);
            prop_assert!(
                run.finished && run.verdict == Verdict::Valid,
                "{:?}",
                run.problems
            );
            let mm = weights(&q, &mut rng);
            let walk = pipec_ir::memory::walk(&q, &mm, None);
            for (r, instrs) in q.ranks.iter().enumerate() {
                let (device, host) = replay(instrs, |t| mm.act[t.stage.index()]);
                prop_assert_eq!(walk[r].0.activations, device, "{:?} rank {}", kind, r);
                prop_assert_eq!(walk[r].0.host, host, "{:?} rank {}", kind, r);
            }
            // With part of each activation freed at `bwd_D` (`K.act_w`, whole numbers up to
            // `act`): the two-buffer replay.
            let mut split = mm.clone();
            split.act_w = Some(
                mm.act
                    .iter()
                    .map(|&a| rng.below(a as usize + 1) as f64)
                    .collect(),
            );
            let walk_split = pipec_ir::memory::walk(&q, &split, None);
            let m = q.microbatches;
            for (r, instrs) in q.ranks.iter().enumerate() {
                let (device, host) = replay_split(instrs, |t| split.weights(t, m));
                prop_assert_eq!(
                    walk_split[r].0.activations,
                    device,
                    "{:?} rank {} split",
                    kind,
                    r
                );
                prop_assert_eq!(walk_split[r].0.host, host, "{:?} rank {} split", kind, r);
            }
            // The memory limit sees the same count.
            let peak = walk.iter().map(|w| w.0.peak).fold(0.0, f64::max);
            let limited = pipec_ir::verify::verify_with(
                &q,
                pipec_ir::verify::Level::Full,
                1,
                &mm,
                Some(peak - 0.5),
            );
            let over = limited
                .violations
                .iter()
                .any(|v| matches!(v, pipec_ir::verify::Violation::MemoryLimit { .. }));
            prop_assert!(over);
            Ok(())
        })
        .unwrap();
}

/// The offload planner's inserts (`pipec_tune::offload::plan`, PipeOffload's planning on any
/// schedule) placed into compiled schedules: valid, and counted by the verifier as the planner
/// counted them (its own profile) and as the replay does.
#[test]
fn planner_inserts_count_as_planned() {
    use pipec_cost::cost::{CostModel, StageCosts};
    use pipec_tune::offload::{plan, RankInput};
    let mut planned = 0;
    for (kind, vpp) in kinds() {
        for (pp, m) in [(2, 4), (4, 8), (4, 12)] {
            let Some(p) = program(kind, pp, vpp, m) else {
                continue;
            };
            let costs = StageCosts::uniform(&CostModel::default(), p.num_stages());
            let sim = pipec_cost::simulate::simulate_unverified(&Unverified::unchecked(&p), &costs)
                .unwrap();
            let inputs: Vec<RankInput> = pipec_tune::offload::inputs(&p, &sim.timeline, |_| 0.0);
            let act = |t: Task| 1.0 + (t.stage.0 % 3) as f64;
            let mm = MemoryModel {
                act: (0..p.num_stages()).map(|s| 1.0 + (s % 3) as f64).collect(),
                param: vec![0.0; p.world() as usize],
                unit: Unit::LayerActivations,
                mb_scale: None,
                msg: None,
                act_w: None,
            };
            let before = pipec_ir::memory::walk(&p, &mm, None);
            let top = before.iter().map(|w| w.0.peak).fold(0.0, f64::max);
            let f = costs.compute(&Compute::Fwd(Task::new(0, 0))).unwrap();
            for (limit, copy) in [(0.75 * top, 0.25 * f), (0.5 * top, 0.5 * f)] {
                let Ok(plans) = plan(&inputs, limit, act, |_| copy) else {
                    continue;
                };
                // The tuner's own placement of the inserts (what `tune` writes).
                let q = pipec_tune::levers::insert(&p, &plans);
                planned += plans.iter().map(|rp| rp.inserts.len()).sum::<usize>();
                let report = verify(&q, &VerifyOptions::default());
                assert!(report.violations.is_empty(), "{kind:?} pp {pp}: {report}");
                let walk = pipec_ir::memory::walk(&q, &mm, None);
                for (r, rp) in plans.iter().enumerate() {
                    let (device, host) = replay(&q.ranks[r], act);
                    let got = walk[r].0.activations;
                    assert_eq!(got, device, "{kind:?} pp {pp} rank {r}: replay");
                    assert_eq!(walk[r].0.host, host, "{kind:?} pp {pp} rank {r}: host");
                    assert_eq!(
                        got, rp.peak,
                        "{kind:?} pp {pp} rank {r}: the planner's peak"
                    );
                    assert!(got <= limit * (1.0 + 1e-12), "{kind:?} pp {pp} rank {r}");
                }
            }
        }
    }
    assert!(planned > 100, "the planner placed {planned} instructions");
}

/// The copy stream's waits in the deadlock proof: a backward whose activations were offloaded
/// and are reloaded only after it would wait forever; the executor hangs there, and the
/// verifier names it (its memory rule, at that backward), not as a cycle between ranks, since
/// copies add none. With the reload moved before the backward both find nothing wrong.
#[test]
fn a_late_reload_hangs_and_the_verifier_names_it() {
    let p = program(ScheduleKind::OneFOneB, 2, 1, 2).unwrap();
    let t = Task::new(0, 0);
    let r0 = &p.ranks[0];
    let fwd = r0.iter().position(|i| has(i, t, &[Pass::Fwd])).unwrap();
    let bwd = r0.iter().position(|i| has(i, t, &[Pass::Bwd])).unwrap();
    let late = |reload_at: usize| {
        let mut q = p.clone();
        q.ranks[0] = insert(
            r0,
            vec![
                (fwd + 1, mem(MemKind::Offload, t)),
                (reload_at, mem(MemKind::Reload, t)),
            ],
        );
        q
    };
    let q = late(bwd + 1);
    let run = execute(&q);
    assert!(!run.finished);
    let report = verify(&q, &VerifyOptions::default());
    let msgs: Vec<String> = report.violations.iter().map(|v| v.to_string()).collect();
    // The backward moved one later by the offload inserted before it.
    let at = format!("rank 0, #{}", bwd + 1);
    assert!(
        msgs.iter()
            .any(|m| m.starts_with(&at) && m.contains("while its activations are on the host")),
        "{msgs:?}"
    );
    assert!(!report
        .violations
        .iter()
        .any(|v| v.class() == pipec_ir::verify::Class::Deadlock));
    let q = late(bwd);
    assert!(execute(&q).finished);
    assert!(verify(&q, &VerifyOptions::default()).violations.is_empty());
}

/// Written, read back and checked: the new ops round-trip through both encodings and the
/// loader, and `pipec check --json` reports the host memory of the rank that offloads.
#[test]
fn check_reports_host_memory() {
    use pipec_ir::files::{write_program, Encoding, Header};
    let (c, q) = every_memory_op_1f1b();
    let checked = pipec_ir::verify::verified(q.clone(), &VerifyOptions::default()).unwrap();
    let header = Header {
        source: "generated",
        schedule: Some(c.spec),
        layout: &c.layout,
    };
    let tmp = tempfile::tempdir().unwrap();
    for enc in [Encoding::Json, Encoding::Postcard] {
        let dir = tmp.path().join(format!("{enc:?}"));
        write_program(&dir, &header, &checked, enc).unwrap();
        if enc == Encoding::Json {
            let text = std::fs::read_to_string(dir.join("rank-0.json")).unwrap();
            for line in [
                r#"{"op":"offload","stage":0,"mb":0}"#,
                r#"{"op":"wait_offload","stage":0,"mb":0}"#,
                r#"{"op":"reload","stage":0,"mb":0}"#,
                r#"{"op":"fwd","stage":0,"mb":1,"checkpoint":true}"#,
                r#"{"op":"recompute","stage":0,"mb":1}"#,
            ] {
                assert!(text.contains(line), "{line}");
            }
        }
        let loaded = pipec_ir::files::load_dir(&dir).unwrap();
        assert_eq!(loaded.program, q);
        let out = crate::harness::pipec()
            .args(["check", "--json"])
            .arg(&dir)
            .output()
            .unwrap();
        assert_eq!(
            out.status.code(),
            Some(0),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let memory = v["memory"].as_array().unwrap();
        assert_eq!(memory[0]["host"], 1, "{v}");
        assert!(memory[1].get("host").is_none(), "{v}");
        // The unit count: rank 0 holds two forwards at its peak as before (the offloaded one
        // is back for its backward while the other is live).
        assert_eq!(memory[0]["peak"], 2, "{v}");
        let out = crate::harness::pipec()
            .arg("check")
            .arg(&dir)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(text.contains("  rank 0: 2 (first at #"), "{text}");
        assert!(text.contains(", host 1)\n"), "{text}");
    }
    // The CPU runtime executes them (`runtime.rs`), checked bitwise against the
    // reference, and measures the verifier's figures.
    let opts = pipec_runtime::RunOptions {
        check: true,
        ..Default::default()
    };
    let run = pipec_runtime::run_cpu(&checked, &c.layout, &opts).unwrap();
    let measured: Vec<(f64, f64)> = run.steps[0]
        .ranks
        .iter()
        .map(|r| (r.peak_memory, r.host_memory))
        .collect();
    assert_eq!(measured, vec![(2.0, 1.0), (1.0, 0.0)]);
    let first = q.ranks[0]
        .iter()
        .position(|i| matches!(i, Instr::Memory(_) | Instr::FwdCheckpoint(_)))
        .unwrap();
    // On a host link shared by a rank pair every copy takes its time while the partner copies
    // too: the lone time / 0.7 (PipeOffload's measurement), an upper bound.
    let span = |spec: &str| {
        let model = pipec_cost::cost::CostModel::parse(spec).unwrap();
        let costs = pipec_cost::cost::StageCosts::uniform(&model, q.num_stages());
        let sp = pipec_cost::simulate::simulate(&checked, &costs)
            .unwrap()
            .timeline
            .ranks[0][first];
        sp.end - sp.start
    };
    let lone = span("t.offload=0.7");
    assert!((lone - 0.7).abs() < 1e-12, "{lone}");
    let paired = span("t.offload=0.7,offload_pair=true");
    assert!((paired - 1.0).abs() < 1e-12, "{paired}");
    // Nor does torch's CSV (pipec.torch runs them from the exporter's cells).
    let form = pipec_compiler::torch::CsvForm::ComputeComms;
    let e = pipec_compiler::torch::export_csv(&checked, form).unwrap_err();
    assert!(
        e.to_string()
            .starts_with(&format!("rank 0, #{first}: offload("))
            && e.to_string().contains("torch's schedule CSV has no action"),
        "{e}"
    );
}

/// The simulator's copy stream against the timing rules written as a graph of waits and
/// solved as its longest path: one rank holding every stage (no messages), random valid
/// memory instructions, random costs. Rules (docs/format.md): compute-stream instructions
/// (everything but `offload`/`reload`) one after another; copies one after another on the copy
/// stream, each no earlier than the rank reaches it (the end of the compute-stream instruction
/// before it) and an offload no earlier than its forward's end; a backward no earlier than its
/// reload's end; `wait_offload` until its offload's end; `recompute` a forward's time.
#[test]
fn copy_stream_times_as_its_graph() {
    use pipec_cost::cost::{CostModel, StageCosts};
    let mut rng = Rng(7);
    for case in 0..200 {
        let stages = 1 + rng.below(4) as u32;
        let m = 1 + rng.below(5) as u32;
        // GPipe or 1F1B order on one rank: forwards in stage order, backwards in reverse.
        let fwd = |mb: u32| (0..stages).map(move |s| Compute::Fwd(Task::new(s, mb)));
        let bwd = |mb: u32| {
            (0..stages)
                .rev()
                .map(move |s| Compute::Bwd(Task::new(s, mb)))
        };
        let ops: Vec<Compute> = if case % 2 == 0 {
            (0..m).flat_map(fwd).chain((0..m).flat_map(bwd)).collect()
        } else {
            (0..m).flat_map(|mb| fwd(mb).chain(bwd(mb))).collect()
        };
        let p = Program {
            placement: pipec_schedules::Placement::looped(1, stages),
            microbatches: m,
            forward_only: false,
            comm: None,
            ranks: vec![ops.into_iter().map(Instr::Compute).collect()],
            lengths: None,
            p2p_groups: Default::default(),
            buffer_slots: None,
        };
        let q = with_memory_ops(&p, &mut rng);
        let spec = format!(
            "t.f={},t.b={},t.w={},t.offload={}",
            1 + rng.below(3),
            1 + rng.below(4),
            rng.below(3),
            rng.below(5) as f64 / 2.0
        );
        let model = CostModel::parse(&spec).unwrap();
        let costs = StageCosts::uniform(&model, stages);
        let sim =
            pipec_cost::simulate::simulate_unverified(&Unverified::unchecked(&q), &costs).unwrap();
        let instrs = &q.ranks[0];
        let f = costs.pass(Pass::Fwd, pipec_schedules::StageId(0)).unwrap();
        let copy = costs.copy(pipec_schedules::StageId(0)).unwrap();
        let is_copy = |i: &Instr| matches!(i, Instr::Memory(op) if op.kind.is_copy());
        let mut end = vec![0.0f64; instrs.len()];
        for (i, ins) in instrs.iter().enumerate() {
            let prev_compute = (0..i).rev().find(|&j| !is_copy(&instrs[j]));
            let reach = prev_compute.map_or(0.0, |j| end[j]);
            let latest = |k: MemKind, t: Task| {
                (0..i)
                    .rev()
                    .find(
                        |&j| matches!(instrs[j], Instr::Memory(op) if op.kind == k && op.task == t),
                    )
                    .map_or(0.0, |j| end[j])
            };
            end[i] = match *ins {
                Instr::Memory(op) if op.kind.is_copy() => {
                    let prev_copy = (0..i).rev().find(|&j| is_copy(&instrs[j]));
                    let mut start = reach.max(prev_copy.map_or(0.0, |j| end[j]));
                    if op.kind == MemKind::Offload {
                        let fwd = (0..i)
                            .rev()
                            .find(|&j| has(&instrs[j], op.task, &[Pass::Fwd]));
                        start = start.max(end[fwd.unwrap()]);
                    }
                    start + copy
                }
                Instr::Memory(op) if op.kind == MemKind::WaitOffload => {
                    reach.max(latest(MemKind::Offload, op.task))
                }
                Instr::Memory(_) | Instr::FwdCheckpoint(_) => reach + f,
                Instr::Compute(c) => {
                    let mut start = reach;
                    for (pass, t) in c.parts() {
                        if matches!(pass, Pass::Bwd | Pass::BwdD) {
                            start = start.max(latest(MemKind::Reload, t));
                        }
                    }
                    start + costs.compute(&c).unwrap()
                }
                _ => unreachable!("one rank, no messages"),
            };
        }
        let spans = &sim.timeline.ranks[0];
        for (i, e) in end.iter().enumerate() {
            assert!(
                (spans[i].end - e).abs() < 1e-9,
                "case {case} ({spec}) #{i} {}: simulated end {} vs {e}",
                instrs[i],
                spans[i].end
            );
        }
        let makespan = end.iter().copied().fold(0.0, f64::max);
        assert!(
            (sim.summary.makespan - makespan).abs() < 1e-9,
            "case {case}"
        );
    }
}

/// In compiled schedules (messages between ranks): memory instructions only add waits, so the
/// makespan never shrinks, and with copies that take no time and no recompute it is the same.
#[test]
fn copies_only_delay_and_free_copies_do_not() {
    use pipec_cost::cost::{CostModel, StageCosts};
    let mut rng = Rng(11);
    for (kind, vpp) in kinds() {
        for (pp, m) in [(2, 4), (4, 8)] {
            let Some(p) = program(kind, pp, vpp, m) else {
                continue;
            };
            let base = |spec: &str, q: &Program| {
                let costs = StageCosts::uniform(&CostModel::parse(spec).unwrap(), q.num_stages());
                pipec_cost::simulate::simulate_unverified(&Unverified::unchecked(q), &costs)
                    .unwrap()
                    .summary
                    .makespan
            };
            let q = with_memory_ops(&p, &mut rng);
            for spec in [
                "t.offload=0.5",
                "t.offload=2",
                "t.f=1,t.b=2,t.w=1,t.offload=1.5",
            ] {
                assert!(base(spec, &q) >= base(spec, &p) - 1e-9, "{kind:?} {spec}");
            }
            // Offloads and reloads only, free copies: nothing moves.
            let mut only_copies = q.clone();
            for r in &mut only_copies.ranks {
                r.retain(|i| !matches!(i, Instr::Memory(op) if op.kind == MemKind::Recompute));
                for i in r.iter_mut() {
                    if let Instr::FwdCheckpoint(t) = *i {
                        *i = Instr::Compute(Compute::Fwd(t));
                    }
                }
            }
            assert_eq!(
                base("t.offload=0", &only_copies),
                base("t.offload=0", &p),
                "{kind:?}"
            );
        }
    }
}

// ---------------------------------------------------------------------------------------------
// One memory model for every command (issue 28): the same schedule reports the same peak, in
// the same unit, from `compile`, `check`, `simulate`, `show`, `compare` and `tune`; byte
// limits work where the costs are in bytes and are refused (saying what to add) where they
// are not; the manifest keeps the cost model a schedule was planned with. Expected peaks are
// computed here by brute force from the written rank files: walk each rank's instructions,
// hold `(stage, mb)` from its forward to its `bwd` (or `bwd_W`), weigh it by the layers of
// its stage, add the parameters of every stage the rank holds (both directions' copies for a
// bidirectional placement).

const GIB: f64 = 1073741824.0;

/// Per layer kind: bytes (or layer-activations) of one layer.
type Table<'a> = Vec<(&'a str, f64)>;

fn pipec_output(args: &[&str]) -> Output {
    crate::harness::pipec_with(args)
        .output()
        .expect("pipec runs")
}

fn ok(args: &[&str]) -> String {
    let o = pipec_output(args);
    assert!(
        o.status.success(),
        "pipec {args:?}: {}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8(o.stdout).unwrap()
}

fn json(args: &[&str]) -> Value {
    serde_json::from_str(&ok(args)).expect("JSON")
}

fn read(p: &Path) -> Value {
    serde_json::from_slice(&std::fs::read(p).unwrap()).unwrap()
}

/// Per-kind (act, param) of a layer, as the test's own table.
fn layer(kind: &str, act: &[(&str, f64)], param: &[(&str, f64)]) -> (f64, f64) {
    let get = |t: &[(&str, f64)]| t.iter().find(|(k, _)| *k == kind).map_or(0.0, |x| x.1);
    (get(act), get(param))
}

/// Brute-force peak memory per rank of a written directory.
fn brute(dir: &Path, act: &[(&str, f64)], param: &[(&str, f64)]) -> Vec<f64> {
    let m = read(&dir.join("manifest.json"));
    let stages: Vec<(f64, f64)> = m["layout"]["stages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            s.as_array().unwrap().iter().fold((0.0, 0.0), |acc, k| {
                let (a, p) = layer(k.as_str().unwrap(), act, param);
                (acc.0 + a, acc.1 + p)
            })
        })
        .collect();
    let pl = &m["placement"];
    let pp = pl["pp"].as_u64().unwrap() as usize;
    let table: Vec<usize> = pl["stage_rank"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as usize)
        .collect();
    // Parameters: every rank that runs some microbatch of a stage holds a copy.
    let mut params = vec![0.0; pp];
    for (s, &r) in table.iter().enumerate() {
        let mut holders = HashSet::from([r]);
        if pl.get("mirror_from").is_some_and(|x| !x.is_null()) {
            holders.insert(pp - 1 - r);
        }
        for h in holders {
            params[h] += stages[s].1;
        }
    }
    (0..pp)
        .map(|r| {
            let f = read(&dir.join(format!("rank-{r}.json")));
            let mut live: HashSet<(u64, u64)> = HashSet::new();
            let (mut cur, mut peak) = (0.0f64, 0.0f64);
            for ins in f["instructions"].as_array().unwrap() {
                let g = |k: &str| ins[k].as_u64().unwrap();
                let mut frees = Vec::new();
                match ins["op"].as_str().unwrap() {
                    "fwd" => {
                        live.insert((g("stage"), g("mb")));
                        cur += stages[g("stage") as usize].0;
                    }
                    "bwd" | "bwd_W" => frees.push((g("stage"), g("mb"))),
                    "fwd_bwd" => {
                        live.insert((g("fwd_stage"), g("fwd_mb")));
                        cur += stages[g("fwd_stage") as usize].0;
                        frees.push((g("bwd_stage"), g("bwd_mb")));
                    }
                    _ => continue,
                }
                peak = peak.max(cur);
                for t in frees {
                    if live.remove(&t) {
                        cur -= stages[t.0 as usize].0;
                    }
                }
            }
            params[r] + peak
        })
        .collect()
}

fn floats(v: &Value) -> Vec<f64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect()
}

/// 1F1B and ZB-V on the same 16-layer model at pp = 4: every command gives the brute-force
/// peak per rank, in layer-activations by default and in bytes under `t.act=1GiB`, and
/// `compare` no longer says 4 against 8 for two schedules that both hold 16 layers.
#[test]
fn every_command_reports_the_brute_force_peak_in_one_unit() {
    let tmp = tempfile::tempdir().unwrap();
    let cases = [
        ("1f1b", "Et*4|t*4|t*4|t*4L"),
        ("zb-v", "Ett|tt|tt|tt|tt|tt|tt|ttL"),
    ];
    for (cost, unit, scale) in [
        (None, "layer-activations", 1.0),
        (Some("t.act=1GiB,t.param=0.5GiB"), "bytes", GIB),
    ] {
        let (act, param): (Table, Table) = match cost {
            None => (vec![("t", 1.0)], vec![]),
            Some(_) => (vec![("t", GIB)], vec![("t", 0.5 * GIB)]),
        };
        let mut worst = Vec::new();
        for (kind, layout) in cases {
            let dir = tmp.path().join(format!("{kind}-{unit}"));
            let d = dir.to_str().unwrap();
            let mut args = vec![
                "compile",
                "--schedule",
                kind,
                "--pp",
                "4",
                "--microbatches",
                "8",
                "--layout",
                layout,
                "-o",
                d,
            ];
            let mut c = vec![];
            if let Some(spec) = cost {
                c = vec!["--cost", spec];
            }
            args.extend(&c);
            let compiled = ok(&args);
            let want = brute(&dir, &act, &param);
            let mut check = vec!["check", d, "--json"];
            check.extend(&c);
            let r = json(&check);
            assert_eq!(r["memory_unit"], unit);
            let got: Vec<f64> = r["memory"]
                .as_array()
                .unwrap()
                .iter()
                .map(|m| m["peak"].as_f64().unwrap())
                .collect();
            assert_eq!(got, want, "{kind} {unit}: check --json memory[r].peak");
            // The manifest recorded the cost model: show/simulate use it without --cost.
            let s = json(&["simulate", d, "--json"]);
            assert_eq!(s["memory_unit"], unit);
            let sim: Vec<f64> = s["ranks"]
                .as_array()
                .unwrap()
                .iter()
                .map(|r| r["peak_memory"].as_f64().unwrap())
                .collect();
            assert_eq!(sim, want, "{kind} {unit}: simulate --json");
            let w = want.iter().cloned().fold(0.0, f64::max);
            worst.push(w);
            // Text: every command labels the figure with its unit.
            let label = if scale == 1.0 {
                format!("{} layer-activations", w)
            } else {
                format!("{:.2}GiB", w / GIB)
            };
            let show = ok(&["show", d]);
            assert!(
                show.contains(&format!("peak memory {label} (worst rank)")),
                "{show}"
            );
            let text = ok(&["simulate", d]);
            assert!(text.contains(&format!("peak memory {label}")), "{text}");
            let first = if scale == 1.0 {
                format!("{}", want[0])
            } else {
                format!("{:.2}GiB", want[0] / GIB)
            };
            assert!(
                compiled.contains(&format!("peak memory per rank: {first} ")),
                "{compiled}"
            );
            assert!(!compiled.contains("peak activations"), "{compiled}");
        }
        // compare: both schedules side by side, the same figures as above.
        let mut args = vec![
            "compare",
            "--schedule",
            "1f1b",
            "--schedule",
            "zb-v",
            "--pp",
            "4",
            "--microbatches",
            "8",
            "--num-layers",
            "16",
            "--json",
        ];
        if let Some(spec) = cost {
            args.extend(["--cost", spec]);
        }
        let c = json(&args);
        let peaks: Vec<f64> = c["schedules"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| {
                assert_eq!(s["memory_unit"], unit);
                s["peak_memory"].as_f64().unwrap()
            })
            .collect();
        assert_eq!(peaks, worst, "compare --json under {cost:?}");
    }
}

/// `check --cost-file F --memory-limit 80GiB --json` in CI: under the limit exit 0, over it
/// exit 1 with a memory violation that names both figures in GiB; `compile` refuses to
/// write the same schedule over the limit.
#[test]
fn byte_limits_work_in_check_and_compile() {
    let tmp = tempfile::tempdir().unwrap();
    let cost = tmp.path().join("model.toml");
    std::fs::write(&cost, "t.act = 2GiB\nt.param = 1GiB\n").unwrap();
    let c = cost.to_str().unwrap();
    let dir = tmp.path().join("s");
    let d = dir.to_str().unwrap();
    compile(
        &dir,
        "--schedule 1f1b --pp 4 --microbatches 8 --num-layers 16",
    );
    let want = brute(&dir, &[("t", 2.0 * GIB)], &[("t", GIB)]);
    // Rank 0: 4 layers of parameters + 4 microbatches x 4 layers x 2 GiB = 36 GiB.
    assert_eq!(want[0], 36.0 * GIB);
    let r = json(&[
        "check",
        d,
        "--cost-file",
        c,
        "--memory-limit",
        "80GiB",
        "--json",
    ]);
    assert_eq!(r["valid"], true);
    assert_eq!(r["memory"][0]["peak"].as_f64().unwrap(), want[0]);
    let o = pipec_output(&[
        "check",
        d,
        "--cost-file",
        c,
        "--memory-limit",
        "30GiB",
        "--json",
    ]);
    assert_eq!(o.status.code(), Some(1));
    let r: Value = serde_json::from_slice(&o.stdout).unwrap();
    let v = &r["violations"][0];
    assert_eq!(v["kind"], "memory_limit");
    assert_eq!(v["peak"].as_f64().unwrap(), want[0]);
    assert!(
        v["message"]
            .as_str()
            .unwrap()
            .contains("more than 30.00GiB"),
        "{v}"
    );
    // Ranks under the limit are not reported.
    let over: Vec<u64> = r["violations"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["rank"].as_u64().unwrap())
        .collect();
    let expect: Vec<u64> = (0..4).filter(|&i| want[i as usize] > 30.0 * GIB).collect();
    assert_eq!(over, expect);
    // compile refuses to write it.
    let out = tmp.path().join("refused");
    let o = pipec_output(&[
        "compile",
        "--schedule",
        "1f1b",
        "--pp",
        "4",
        "--microbatches",
        "8",
        "--num-layers",
        "16",
        "--cost-file",
        c,
        "--memory-limit",
        "30GiB",
        "-o",
        out.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(1));
    assert!(!out.exists());
    // A plain number is in the report's unit: layer-activations without byte costs.
    let o = pipec_output(&["check", d, "--memory-limit", "15"]);
    assert_eq!(
        o.status.code(),
        Some(1),
        "rank 0 holds 16 layer-activations"
    );
    assert_eq!(
        pipec_output(&["check", d, "--memory-limit", "16"])
            .status
            .code(),
        Some(0)
    );
}

/// A byte limit against costs without bytes is refused by every command that takes one, and
/// the message says what to add, instead of comparing 40 GiB with 1-byte activations.
#[test]
fn a_byte_limit_without_byte_costs_says_what_to_add() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("s");
    let d = dir.to_str().unwrap();
    compile(&dir, "--schedule 1f1b --pp 2 --microbatches 4");
    let out = tmp.path().join("o");
    let o = out.to_str().unwrap();
    for args in [
        vec!["check", d, "--memory-limit", "40GiB"],
        vec![
            "compile",
            "--schedule",
            "1f1b",
            "--pp",
            "2",
            "--microbatches",
            "4",
            "--memory-limit",
            "40GiB",
            "-o",
            o,
        ],
        vec![
            "tune",
            "--pp",
            "2",
            "--microbatches",
            "4",
            "--memory-limit",
            "40GiB",
        ],
    ] {
        let r = pipec_output(&args);
        assert_eq!(r.status.code(), Some(1), "{args:?}");
        let err = String::from_utf8_lossy(&r.stderr);
        assert!(err.contains("t.act="), "{args:?}: {err}");
        assert!(!err.contains("0.0MiB"), "{err}");
    }
}

/// `show` of a directory tune wrote (issue #40): a manifest that records `E.f=0` (from a
/// `[model]` table, where the embedding has no matmul) reads `E free (E.f=0)`, not "no cost
/// given", which only a directory without any model reads; and a built-in kind fitted with
/// levers is titled by the plan tune printed, not "tuned schedule".
#[test]
fn show_of_a_tuned_directory_names_its_costs_and_plan() {
    let tmp = tempfile::tempdir().unwrap();
    let cost = tmp.path().join("m.toml");
    std::fs::write(
        &cost,
        "[model]\nhidden = 1024\nffn = 4096\nheads = 16\nseq = 2048\nvocab = 32000\n",
    )
    .unwrap();
    let dir = tmp.path().join("t");
    let (c, d) = (cost.to_str().unwrap(), dir.to_str().unwrap());
    ok(&[
        "tune",
        "--pp",
        "2",
        "--microbatches",
        "4",
        "--num-layers",
        "4",
        "--cost-file",
        c,
        "-o",
        d,
    ]);
    let recorded = read(&dir.join("manifest.json"))["cost"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(recorded.starts_with("E.f=0,E.b=0,E.w=0,"), "{recorded}");
    let shown = ok(&["show", d]);
    let line = shown.lines().find(|l| l.starts_with("cost: ")).unwrap();
    assert!(line.contains("; E free (E.f=0);"), "{line}");
    assert!(!shown.contains("no cost given"), "{shown}");
    // Without any model the hint stays.
    let plain = tmp.path().join("c");
    compile(&plain, "--schedule 1f1b --pp 2 --microbatches 4");
    let shown = ok(&["show", plain.to_str().unwrap()]);
    assert!(
        shown.contains("E, L free (no cost given: set E.f, L.f)"),
        "{shown}"
    );

    // 1F1B's peak at pp=4 is 4 microbatches of 2 layers on rank 0: a limit of 5 needs offload.
    let lv = tmp.path().join("lv");
    let lvs = lv.to_str().unwrap();
    let report = ok(&[
        "tune",
        "--pp",
        "4",
        "--microbatches",
        "8",
        "--num-layers",
        "8",
        "--kinds",
        "1f1b",
        "--target",
        "pipec-run",
        "--memory-limit",
        "5",
        "-o",
        lvs,
    ]);
    let plan = report
        .lines()
        .find_map(|l| l.strip_prefix("schedule: "))
        .unwrap();
    assert!(plan.starts_with("1f1b + offload "), "{report}");
    let m = read(&lv.join("manifest.json"));
    assert_eq!(
        (m["source"].as_str(), m["plan"].as_str()),
        (Some("tuned"), Some(plan))
    );
    for cmd in ["show", "simulate"] {
        let out = ok(&[cmd, lvs]);
        assert_eq!(
            out.lines().next().unwrap(),
            format!("{plan}, 4 ranks, 4 stages, microbatches=8"),
            "{out}"
        );
    }
    // Sealing keeps it.
    ok(&["seal", lvs]);
    assert_eq!(read(&lv.join("manifest.json"))["plan"].as_str(), Some(plan));
    // A plan of the tuner's own is named as tune's report names it, chunks per rank included.
    let report = ok(&[
        "tune",
        "--pp",
        "4",
        "--microbatches",
        "8",
        "--num-layers",
        "16",
        "--target",
        "megatron",
        "--kinds",
        "tuned",
        "-o",
        d,
    ]);
    let plan = report
        .lines()
        .find_map(|l| l.strip_prefix("schedule: "))
        .unwrap();
    assert_eq!(plan, "tuned loop vpp=2", "{report}");
    assert_eq!(
        read(&dir.join("manifest.json"))["plan"].as_str(),
        Some(plan)
    );
    assert!(ok(&["show", d]).starts_with("tuned loop vpp=2, 4 ranks, 8 stages, microbatches=8\n"));
    // A built-in kind as generated is named by its spec, and records no plan.
    ok(&[
        "tune",
        "--pp",
        "2",
        "--microbatches",
        "4",
        "--kinds",
        "1f1b",
        "-o",
        d,
    ]);
    let m = read(&dir.join("manifest.json"));
    assert!(m.get("plan").is_none() && m["source"] == "generated", "{m}");
    assert!(ok(&["show", d]).starts_with("1f1b pp=2 vpp=1 microbatches=4\n"));
}

/// `pipec tune --layout L --num-layers N` is a usage error (exit 2) in the words Python's
/// `pipec.tune` uses (issue #40), for the MTP count too.
#[test]
fn tune_refuses_layer_counts_beside_a_layout() {
    for flag in ["--num-layers", "--mtp-num-layers"] {
        let r = pipec_output(&[
            "tune",
            "--pp",
            "2",
            "--microbatches",
            "4",
            "--layout",
            "Et|tL",
            flag,
            "2",
        ]);
        assert_eq!(r.status.code(), Some(2), "{flag}");
        let err = String::from_utf8_lossy(&r.stderr);
        assert!(
            err.contains(&format!(
                "error: {flag} cannot be given with --layout: the layout gives the layers"
            )),
            "{err}"
        );
    }
}

/// `--memory-limit 40G` is refused (exit 1) by every command that takes a limit, with both
/// readings offered (issue #40: it got no suggestion).
#[test]
fn an_ambiguous_limit_unit_gets_a_suggestion() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("s");
    let d = dir.to_str().unwrap();
    compile(&dir, "--schedule 1f1b --pp 2 --microbatches 4");
    let o = tmp.path().join("o");
    let o = o.to_str().unwrap();
    let (pp, m) = (["--pp", "2"], ["--microbatches", "4"]);
    for args in [
        vec!["check", d],
        [
            &["compile", "--schedule", "1f1b"],
            &pp[..],
            &m[..],
            &["-o", o],
        ]
        .concat(),
        [&["tune"], &pp[..], &m[..]].concat(),
    ] {
        let args = [&args[..], &["--memory-limit", "40G"]].concat();
        let r = pipec_output(&args);
        assert_eq!(r.status.code(), Some(1), "{args:?}");
        let err = String::from_utf8_lossy(&r.stderr);
        assert!(
            err.contains(
                "--memory-limit: `40G` has an ambiguous unit: did you mean 40GiB or 40GB?"
            ),
            "{args:?}: {err}"
        );
    }
}

/// `tune -o DIR --cost ...` records its cost model; `show DIR` then draws tune's timeline
/// (the makespan tune reported), not the default model's, and `--cost` still overrides it.
#[test]
fn the_manifest_keeps_tunes_cost_model() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("t");
    let d = dir.to_str().unwrap();
    let spec = "t.f=1,t.b=2,t.w=1,E.f=1,L.f=3,t.act=1GiB";
    let t = json(&[
        "tune",
        "--pp",
        "4",
        "--microbatches",
        "8",
        "--num-layers",
        "8",
        "--cost",
        spec,
        "-o",
        d,
        "--json",
    ]);
    let makespan = t["makespan"].as_f64().expect("tune --json makespan");
    let s = json(&["simulate", d, "--json"]);
    let recorded = read(&dir.join("manifest.json"))["cost"].clone();
    assert!(recorded.is_string(), "manifest cost: {recorded}");
    assert_eq!(s["makespan"].as_f64().unwrap(), makespan);
    // The same figures as simulating under the spec itself.
    let direct = json(&["simulate", d, "--json", "--cost", spec]);
    assert_eq!(s["makespan"], direct["makespan"]);
    assert_eq!(s["ranks"], direct["ranks"]);
    let default = json(&["simulate", d, "--json", "--cost", "f=1"]);
    assert_ne!(s["makespan"], default["makespan"]);
    let show = ok(&["show", d]);
    assert!(show.contains(&format!(
        "makespan {} cost units",
        pipec_ir::human::num(s["makespan"].as_f64().unwrap())
    )));
    assert_eq!(s["memory_unit"], "bytes");
    assert_eq!(
        floats(&t["peak_memory"]),
        s["ranks"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["peak_memory"].as_f64().unwrap())
            .collect::<Vec<_>>()
    );
    // Without a cost model the manifest has no `cost` (files unchanged).
    let plain = tmp.path().join("p");
    compile(&plain, "--schedule 1f1b --pp 2 --microbatches 4");
    assert!(read(&plain.join("manifest.json")).get("cost").is_none());
}

/// DualPipe places every stage on two ranks: each rank holds both copies' parameters, which
/// the brute force adds up from the placement, and check and simulate agree with it.
#[test]
fn dualpipe_parameters_count_twice() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("d");
    let d = dir.to_str().unwrap();
    let spec = "t.act=1GiB,t.param=3GiB";
    compile(
        &dir,
        &format!("--schedule dualpipe --pp 4 --microbatches 8 --num-layers 8 --cost {spec}"),
    );
    let want = brute(&dir, &[("t", GIB)], &[("t", 3.0 * GIB)]);
    let r = json(&["check", d, "--json"]);
    for (i, m) in r["memory"].as_array().unwrap().iter().enumerate() {
        // 4 stages of 2 layers on 4 ranks, two copies each: 2 stages x 2 layers x 3 GiB.
        assert_eq!(m["params"].as_f64().unwrap(), 12.0 * GIB, "rank {i}");
        assert_eq!(m["peak"].as_f64().unwrap(), want[i], "rank {i}");
    }
    let s = json(&["simulate", d, "--json"]);
    for (i, rk) in s["ranks"].as_array().unwrap().iter().enumerate() {
        assert_eq!(rk["peak_memory"].as_f64().unwrap(), want[i], "rank {i}");
    }
}
