//! pipec's capture order (`pipec_ir::ir::capture_order`, `pipec export --format capture-order`,
//! `Schedule.capture_order`) against megatron-core's own.
//!
//! `tests/golden/megatron/capture_order.txt.gz` was recorded by
//! `tests/golden/megatron/record_capture_order.py`: for every configuration of its grid and
//! every pipeline rank, the `_order` megatron-core 0.19.2's `TECudaGraphHelper` hands
//! Transformer Engine, computed by megatron-core's own `get_pp_rank_microbatches`,
//! `get_schedule_table`, `convert_schedule_table_to_order` (and, with expert-parallel overlap,
//! `get_overlap_moe_expert_parallel_comm_order`); whether Megatron runs the configuration was
//! decided by running its real schedule. pipec must accept exactly what Megatron runs and give
//! every rank Megatron's order, number for number.

use super::megatron_calls::{golden_line, golden_text, unless_megatron_refuses};
use pipec_compiler::lower;
use pipec_ir::ir::{capture_order, CaptureError, CaptureStep};
use pipec_schedules::{generate, Limits, MegatronP2p, Pass, ScheduleKind, ScheduleSpec, KINDS};
use std::collections::HashMap;

fn render(order: &[CaptureStep]) -> String {
    order
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(" ")
}

#[test]
fn every_rank_is_megatrons_capture_order() {
    let text = golden_text("capture_order.txt.gz");
    let mut lines = text.lines();
    let header = lines.next().expect("header");
    assert!(header.starts_with("# megatron-core 0.19.2"), "{header}");
    let (mut matched, mut refused, mut wgrad) = (0, 0, 0);
    let mut failures = Vec::new();
    let mut docstring = false;
    for line in lines {
        let (head, rest) = golden_line(line);
        let mut f = head.split_whitespace();
        let interleaved = match f.next() {
            Some("interleaved") => true,
            Some("1f1b") => false,
            other => panic!("unknown function {other:?}"),
        };
        let kv: HashMap<&str, u32> = f
            .filter_map(|t| t.split_once('='))
            .map(|(k, v)| (k, v.parse().expect("number")))
            .collect();
        let (pp, vpp, m, g) = (kv["pp"], kv["vpp"], kv["m"], kv["g"]);
        let (ep, wg) = (kv["ep_overlap"] == 1, kv["wgrad"] == 1);
        let kind = if interleaved {
            ScheduleKind::Interleaved1F1B
        } else {
            ScheduleKind::OneFOneB
        };
        let spec = ScheduleSpec {
            group_size: interleaved.then_some(g),
            combined: ep,
            megatron_p2p: MegatronP2p::default_for(kind, pp),
            ..ScheduleSpec::new(kind, pp, vpp, m)
        };
        let verdict = spec.validate(&Limits::DEFAULT);
        let Some(ranks) =
            unless_megatron_refuses(head, rest, &verdict, &mut failures, &mut refused)
        else {
            continue;
        };
        if wg {
            // Megatron's half steps for a delayed weight gradient inside its combined 1F1B:
            // pipec's combined 1F1B fuses each backward (no bwd_W to place), so these lines
            // pin the convention pipec's split-backward orders follow, compared with nothing.
            wgrad += 1;
            continue;
        }
        if let Err(e) = verdict {
            failures.push(format!("{head}: Megatron runs it but pipec refuses: {e}"));
            continue;
        }
        let program = lower(&generate(&spec, &Limits::DEFAULT).unwrap());
        for (r, want) in ranks.split(" | ").enumerate() {
            let got = match capture_order(&program, r as u32) {
                Ok(o) => render(&o),
                Err(e) => e.to_string(),
            };
            if got != want {
                failures.push(format!("{head}: rank {r}: Megatron {want}, pipec {got}"));
                break;
            }
        }
        // megatron-core's docstring example of convert_schedule_table_to_order (PP2 N3M5 with
        // VP2, 5 warmup microbatches: rank 0), written here by hand from the docstring.
        if head == "interleaved pp=2 vpp=2 m=5 g=3 ep_overlap=0 wgrad=0" {
            let r0 = ranks.split(" | ").next().unwrap();
            assert_eq!(r0, "1 1 1 2 2 2 -2 1 -2 1 -2 2 -1 2 -1 -1 -2 -2 -1 -1");
            docstring = true;
        }
        matched += 1;
    }
    assert!(
        failures.is_empty(),
        "{} configurations differ; first ones:\n{}",
        failures.len(),
        failures[..failures.len().min(15)].join("\n")
    );
    assert!(docstring);
    eprintln!("megatron capture order: {matched} configurations matched on every rank, {refused} refused by both, {wgrad} half-step recordings not compared");
    assert!(
        matched > 1000 && refused > 3000,
        "{matched} matched, {refused} refused"
    );
}

/// Whether some chunk of rank `r` runs its backwards (fused or input-gradient) in another
/// microbatch order than its forwards, read from the program's instructions.
fn lifo(p: &pipec_ir::Program, r: usize) -> bool {
    let mut f: HashMap<u32, Vec<u32>> = HashMap::new();
    let mut b: HashMap<u32, Vec<u32>> = HashMap::new();
    for c in p.ranks[r].iter().filter_map(|i| i.as_compute()) {
        for (pass, t) in c.parts() {
            match pass {
                Pass::Fwd => f.entry(t.stage.0).or_default().push(t.mb.0),
                Pass::Bwd | Pass::BwdD => b.entry(t.stage.0).or_default().push(t.mb.0),
                Pass::BwdW => {}
            }
        }
    }
    b.iter().any(|(s, mbs)| f.get(s) != Some(mbs))
}

/// Every other kind has an order too: for each kind at small sizes, every rank's order is
/// Transformer Engine's contract, checked from the list alone: each chunk's k-th backward (and
/// k-th weight gradient) comes after its k-th forward, every chunk has as many backwards as
/// forwards, weight gradients for all of them or none, and the list has one entry per compute
/// pass of the rank (an overlapped pair two), plus one per fused backward of a chunk that
/// splits others (its weight-gradient half). Refused exactly where the program runs a chunk's
/// backwards in another order than its forwards (looped BFS: last in, first out).
#[test]
fn every_kind_has_a_well_formed_capture_order() {
    let mut kinds_seen = std::collections::BTreeSet::new();
    let mut refused_kinds = std::collections::BTreeSet::new();
    for row in KINDS.iter() {
        let kind = row.kind;
        for pp in 2..=4u32 {
            for vpp in 1..=3u32 {
                for m in [pp, 2 * pp] {
                    let spec = ScheduleSpec::new(kind, pp, vpp, m);
                    if spec.validate(&Limits::DEFAULT).is_err() {
                        continue;
                    }
                    let program = lower(&generate(&spec, &Limits::DEFAULT).unwrap());
                    for r in 0..pp {
                        let order = match capture_order(&program, r) {
                            Ok(o) => {
                                assert!(!lifo(&program, r as usize), "{kind:?} rank {r}");
                                o
                            }
                            Err(e @ CaptureError::OutOfOrder { .. }) => {
                                assert!(lifo(&program, r as usize), "{kind:?} rank {r}: {e}");
                                refused_kinds.insert(format!("{kind:?}"));
                                continue;
                            }
                            Err(e) => panic!("{kind:?} pp={pp} vpp={vpp} m={m} rank {r}: {e}"),
                        };
                        let mut n: HashMap<u32, [usize; 3]> = HashMap::new();
                        for s in &order {
                            let (c, i) = match *s {
                                CaptureStep::Fwd(c) => (c, 0),
                                CaptureStep::Bwd(c) => (c, 1),
                                CaptureStep::Wgrad(c) => (c, 2),
                            };
                            let e = n.entry(c).or_default();
                            e[i] += 1;
                            assert!(
                                i == 0 || e[i] <= e[0],
                                "{kind:?} rank {r}: {s} before its forward"
                            );
                        }
                        let parts: usize = program.ranks[r as usize]
                            .iter()
                            .filter_map(|i| i.as_compute())
                            .map(|c| c.parts().count())
                            .sum();
                        let halves = order.len() - parts;
                        let (mut wgrads, chunks) = (0, n.len() as u32);
                        for (c, [f, b, w]) in n {
                            assert!((1..=chunks).contains(&c), "{kind:?} rank {r}: chunk {c}");
                            assert!(
                                f > 0 && b == f && (w == 0 || w == f),
                                "{kind:?} rank {r} chunk {c}: {f} {b} {w}"
                            );
                            wgrads += w;
                        }
                        // Every W entry is a bwd_W of the program or the half of a fused one.
                        let bwd_w = program.ranks[r as usize]
                            .iter()
                            .filter_map(|i| i.as_compute())
                            .flat_map(|c| c.parts())
                            .filter(|(p, _)| *p == Pass::BwdW)
                            .count();
                        assert_eq!(halves, wgrads - bwd_w, "{kind:?} rank {r}");
                    }
                    kinds_seen.insert(format!("{kind:?}"));
                }
            }
        }
    }
    assert_eq!(kinds_seen.len(), KINDS.len(), "{kinds_seen:?}");
    assert_eq!(
        refused_kinds.into_iter().collect::<Vec<_>>(),
        ["LoopedBfs"],
        "kinds whose backwards run last in, first out"
    );
}

/// `pipec export --format capture-order`: docs/format.md's example (1F1B, pp = 2, two
/// microbatches: rank 0 warms up one forward, rank 1 none, as megatron-core's
/// `get_pp_rank_microbatches` gives `pp - rank - 1`), the recorded line of interleaved pp = 2
/// vpp = 2 M = 4, a half step, and the refusals.
#[test]
fn export_writes_one_list_per_rank() {
    use super::harness::{compiled, pipec_with};
    let tmp = tempfile::tempdir().unwrap();
    let export = |dir: &std::path::Path, extra: &[&str]| {
        pipec_with(["export", "--format", "capture-order"])
            .arg(dir)
            .args(extra)
            .output()
            .unwrap()
    };
    let d = compiled(tmp.path(), "a", "--schedule 1f1b --pp 2 --microbatches 2");
    let o = export(&d, &[]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(
        String::from_utf8_lossy(&o.stdout),
        "[\n  [1, 1, -1, -1],\n  [1, -1, 1, -1]\n]\n"
    );
    let d = compiled(
        tmp.path(),
        "b",
        "--schedule interleaved-1f1b --pp 2 --vpp 2 --microbatches 4",
    );
    let o = export(&d, &[]);
    let got: Vec<Vec<i64>> = serde_json::from_slice(&o.stdout).unwrap();
    let text = golden_text("capture_order.txt.gz");
    let line = text
        .lines()
        .find(|l| l.starts_with("interleaved pp=2 vpp=2 m=4 g=2 ep_overlap=0 wgrad=0 |"))
        .unwrap();
    let want: Vec<Vec<i64>> = line
        .split(" | ")
        .skip(1)
        .map(|r| r.split(' ').map(|x| x.parse().unwrap()).collect())
        .collect();
    assert_eq!(got, want);
    // ZB-H1 at pp = 2, rank 1: f, D, then fused backwards as D and W halves (the chunk splits
    // others), the two delayed Ws at the end (the program's rank file, read by hand).
    let d = compiled(tmp.path(), "c", "--schedule zb-h1 --pp 2 --microbatches 4");
    let o = export(&d, &[]);
    let got: Vec<Vec<f64>> = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(
        got[1],
        [1.0, -1.0, 1.0, -1.0, -1.5, 1.0, -1.0, -1.5, 1.0, -1.0, -1.5, -1.5]
    );
    let d = compiled(
        tmp.path(),
        "d",
        "--schedule 1f1b --pp 2 --microbatches 2 --forward-only",
    );
    let o = export(&d, &[]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("forward-only program has no capture order")
    );
    let o = export(&d, &["--compute-only"]);
    assert_eq!(o.status.code(), Some(2));
}
