//! End-to-end runtime tests: compile -> write the instruction files -> load them back -> run on
//! the CPU backend, through the library and through the `pipec-run` binary.
//!
//! The check compares each pipelined step with an independent computation: the same model run
//! without pipelining, microbatch after microbatch, on one thread (`reference.rs`), and must
//! agree bitwise. The measured activation peak is compared with a count from the program alone.

use crate::harness::pipec_run;
use crate::memory::{
    every_memory_op_1f1b, has, insert, kinds, mem, program, replay_split, with_memory_ops, Rng,
};
use pipec_compiler::compile::{compile, CompileRequest, Compiled};
use pipec_ir::files::{self, Encoding, Header};
use pipec_ir::ir::{Instr, InstrRef, MemKind, Payload, Program};
use pipec_ir::memory::{MemoryModel, Unit};
use pipec_ir::verify::{verified, VerifyOptions};
use pipec_runtime::model::ModelConfig;
use pipec_runtime::run::{run_cpu_unchecked, run_cpu_with_memory};
use pipec_runtime::watchdog::FailureKind;
use pipec_runtime::{load, run_cpu, LaunchWorld, RunError, RunOptions, RunReport};
use pipec_schedules::layout::Layout;
use pipec_schedules::{
    generate, CommPolicy, Compute, Limits, Pass, Placement, Rank, RankOrder, ScheduleKind,
    ScheduleSpec, Task,
};
use pipec_tests::ir::{bwd, fwd, recv, send};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The tiny model and options the runtime tests run with (`lengths_run` too).
pub(crate) fn opts(steps: u32) -> RunOptions {
    RunOptions {
        model: ModelConfig {
            hidden: 4,
            ffn: 8,
            vocab: 8,
            seq: 3,
            seed: 11,
        },
        steps,
        lr: 0.1,
        timeout: Duration::from_secs(20),
        check: true,
        trace_steps: None,
    }
}

fn request(kind: ScheduleKind, pp: u32, vpp: u32, m: u32, forward_only: bool) -> CompileRequest {
    CompileRequest {
        vpp: Some(vpp),
        forward_only,
        ..CompileRequest::new(kind, pp, m)
    }
}

fn write_compiled(c: &Compiled, dir: &Path) {
    let header = Header {
        source: "generated",
        schedule: Some(c.spec),
        layout: &c.layout,
    };
    files::write_program(
        dir,
        &header,
        &pipec_tests::verified(&c.program),
        Encoding::Json,
    )
    .unwrap();
}

/// Write a hand-made program (bypassing verification) with the uniform layout.
fn write_program(p: &Program, dir: &Path) {
    let layout = Layout::uniform(p.num_stages());
    let header = Header {
        source: "hand-written",
        schedule: None,
        layout: &layout,
    };
    files::write_unverified(dir, &header, &pipec_tests::unverified(p), Encoding::Json).unwrap();
}

/// Load from disk and run: the path `pipec-run` takes, minus printing.
fn run_dir(dir: &Path, o: &RunOptions) -> Result<RunReport, RunError> {
    let loaded = load(dir, None)?;
    run_cpu(&loaded.program, &loaded.manifest.layout, o)
}

/// The path of `pipec-run --no-verify`: structural checks only, so a broken schedule runs and
/// the watchdog has something to catch.
fn run_dir_unverified(dir: &Path, o: &RunOptions) -> Result<RunReport, RunError> {
    let loaded = pipec_runtime::load_unverified(dir, None)?;
    run_cpu(&loaded.program, &loaded.manifest.layout, o)
}

fn assert_checked(report: &RunReport, what: &str) {
    for s in &report.steps {
        let c = s
            .check
            .as_ref()
            .unwrap_or_else(|| panic!("{what}: no check"));
        assert_eq!(c.max_abs_diff, 0.0, "{what}");
        let measured: Vec<u32> = s.ranks.iter().map(|r| r.peak_activations).collect();
        assert_eq!(
            measured, report.static_peak_activations,
            "{what}: activation peak"
        );
        assert!(s.loss.is_finite(), "{what}");
    }
}

#[test]
fn check_passes_for_every_generated_kind() {
    let tmp = tempfile::tempdir().unwrap();
    let mut ran = 0;
    for (kind, vpps) in [
        (ScheduleKind::Gpipe, &[1][..]),
        (ScheduleKind::OneFOneB, &[1][..]),
        (ScheduleKind::Interleaved1F1B, &[2, 3][..]),
        (ScheduleKind::LoopedBfs, &[1, 2][..]),
    ] {
        for pp in 1..=4u32 {
            for &vpp in vpps {
                for m in [1, pp, 2 * pp + 1] {
                    let req = request(kind, pp, vpp, m, false);
                    let Ok(c) = compile(&req) else { continue };
                    let dir = tmp.path().join(format!("{kind}-{pp}-{vpp}-{m}"));
                    write_compiled(&c, &dir);
                    let what = format!("{kind} pp {pp} vpp {vpp} M {m}");
                    let report = run_dir(&dir, &opts(2)).unwrap_or_else(|e| panic!("{what}: {e}"));
                    assert_checked(&report, &what);
                    assert_eq!(report.steps[0].ranks.len(), pp as usize);
                    ran += 1;
                }
            }
        }
    }
    assert!(ran >= 30, "only {ran} configurations compiled");
}

/// A forward-only program stashes nothing, but each forward holds its activation while it
/// runs: the verifier's peak of 1, which the static count and the measured one agree with.
#[test]
fn forward_only_programs_run_holding_one_activation_at_a_time() {
    let tmp = tempfile::tempdir().unwrap();
    for (kind, vpp) in [
        (ScheduleKind::OneFOneB, 1),
        (ScheduleKind::Interleaved1F1B, 2),
    ] {
        let c = compile(&request(kind, 2, vpp, 4, true)).unwrap();
        let dir = tmp.path().join(kind.name());
        write_compiled(&c, &dir);
        let report = run_dir(&dir, &opts(1)).unwrap();
        assert_checked(&report, kind.name());
        assert_eq!(report.static_peak_activations, vec![1, 1]);
        assert_eq!(report.steps[0].check.as_ref().unwrap().tensors, 0);
    }
}

/// Peak live activations are one analysis (`pipec_ir::ir::activations`): the verifier's peak and
/// where it is reached, `pipec tune`'s weighted peak at weight 1, the simulator's peak and its
/// time, the runtime's static figure and the interpreter's measured peak agree for every
/// built-in kind, training (split backwards and combined pairs included) and forward-only.
#[test]
fn every_peak_activation_figure_is_the_verifiers() {
    use pipec_cost::cost::{CostModel, StageCosts};
    use pipec_runtime::backend::noop::NoopBackend;
    use pipec_runtime::interp::{run_rank, static_peak_activations};
    use pipec_runtime::watchdog::Watch;
    use pipec_schedules::Rank;
    use std::time::Instant;
    let (mut ran, mut forward_only_ran, mut split, mut paired) = (0, 0, 0, 0);
    for kind in ScheduleKind::ALL {
        for (pp, m) in [(2u32, 4u32), (4, 8), (4, 9)] {
            for (forward_only, combined) in [(false, false), (true, false), (false, true)] {
                if combined && !kind.supports_combined() {
                    continue;
                }
                let vpp = match kind {
                    ScheduleKind::Interleaved1F1B | ScheduleKind::LoopedBfs => Some(2),
                    _ => None,
                };
                let req = CompileRequest {
                    vpp,
                    forward_only,
                    combined,
                    ..CompileRequest::new(kind, pp, m)
                };
                let Ok(c) = compile(&req) else { continue };
                let p = &c.program;
                let what =
                    format!("{kind} pp {pp} m {m} fwd-only {forward_only} combined {combined}");
                let report = pipec_ir::verify(p, &pipec_ir::VerifyOptions::default());
                assert!(report.is_valid(), "{what}: {report}");
                let peaks: Vec<u64> = report.memory.iter().map(|r| r.peak as u64).collect();
                let n = p.num_stages() as usize;
                let weighted = pipec_ir::verify::memory::weighted_peaks(p, &vec![1.0; n], &[]);
                let want: Vec<f64> = peaks.iter().map(|&x| x as f64).collect();
                assert_eq!(weighted, want, "{what}: tune");
                let costs = StageCosts::uniform(&CostModel::default(), p.num_stages());
                let sim =
                    pipec_cost::simulate::simulate(&pipec_tests::verified(p), &costs).unwrap();
                let t0 = sim
                    .timeline
                    .ranks
                    .iter()
                    .flatten()
                    .map(|s| s.start)
                    .fold(f64::INFINITY, f64::min);
                for (r, (mem, got)) in report.memory.iter().zip(&sim.summary.ranks).enumerate() {
                    assert_eq!(got.peak_activations, mem.peak, "{what}: simulator rank {r}");
                    let at = mem
                        .at
                        .map_or(0.0, |a| sim.timeline.ranks[r][a.index as usize].start - t0);
                    assert_eq!(got.peak_at, at, "{what}: simulator's peak time rank {r}");
                }
                let statics = static_peak_activations(p);
                let want: Vec<u32> = peaks.iter().map(|&x| x as u32).collect();
                assert_eq!(statics, want, "{what}: runtime's static figure");
                let watch = Watch::new(p.ranks.len(), Duration::from_secs(5));
                for r in 0..p.world() {
                    let run = run_rank(p, Rank(r), &mut NoopBackend, &watch, Instant::now())
                        .unwrap_or_else(|_| panic!("{what}: rank {r} stopped"));
                    assert_eq!(
                        run.peak_activations, want[r as usize],
                        "{what}: measured rank {r}"
                    );
                }
                let computes = || p.ranks.iter().flatten().filter_map(Instr::as_compute);
                split += computes().any(|c| matches!(c, Compute::BwdW(_))) as u32;
                paired += computes().any(|c| matches!(c, Compute::FwdBwd { .. })) as u32;
                forward_only_ran += forward_only as u32;
                ran += 1;
            }
        }
    }
    assert!(
        ran >= 60 && forward_only_ran >= 20 && split >= 10 && paired >= 2,
        "ran {ran}, forward-only {forward_only_ran}, split {split}, paired {paired}"
    );
}

/// A layout with empty stages and `m` layers: identity stages at both ends carry token ids
/// forward and the loss gradient backward.
#[test]
fn layouts_with_empty_and_mtp_stages_check() {
    let tmp = tempfile::tempdir().unwrap();
    let mut req = request(ScheduleKind::Interleaved1F1B, 2, 3, 4, false);
    req.vpp = None;
    req.layout = Some("|E|tt|t|mL|".into());
    let c = compile(&req).unwrap();
    let dir = tmp.path().join("layout");
    write_compiled(&c, &dir);
    assert_checked(&run_dir(&dir, &opts(2)).unwrap(), "layout");
}

// ---- split backward and overlapped pairs, built from hand-made orders -----------------------

fn orders(kind: ScheduleKind, pp: u32, vpp: u32, m: u32) -> Option<pipec_schedules::Schedule> {
    let spec = ScheduleSpec::new(kind, pp, vpp, m);
    generate(&spec, &Limits::DEFAULT).ok()
}

/// Replace every `bwd` by `bwd_D`, with its `bwd_W` `delay` ops later (clamped to the end).
fn split(order: &RankOrder, delay: usize) -> RankOrder {
    let mut ops: Vec<Compute> = Vec::new();
    let mut deferred: Vec<(usize, Task)> = Vec::new();
    for (i, op) in order.ops.iter().enumerate() {
        match *op {
            Compute::Bwd(t) => {
                ops.push(Compute::BwdD(t));
                deferred.push((i + delay, t));
            }
            other => ops.push(other),
        }
        while let Some(&(due, t)) = deferred.first() {
            if due > i {
                break;
            }
            ops.push(Compute::BwdW(t));
            deferred.remove(0);
        }
    }
    ops.extend(deferred.into_iter().map(|(_, t)| Compute::BwdW(t)));
    RankOrder {
        rank: order.rank,
        ops,
        warmup: order.warmup,
    }
}

/// Megatron's combined 1F1B (`combined_1f1b.py`): one more warmup forward than the plain
/// schedule, then each steady-state step runs the next forward overlapped with the oldest
/// pending backward as one `fwd_bwd`, then the cooldown backwards.
fn combine(order: &RankOrder) -> RankOrder {
    let fwds: Vec<Task> = order
        .ops
        .iter()
        .filter_map(|c| match c {
            Compute::Fwd(t) => Some(*t),
            _ => None,
        })
        .collect();
    let bwds: Vec<Task> = order
        .ops
        .iter()
        .filter_map(|c| match c {
            Compute::Bwd(t) => Some(*t),
            _ => None,
        })
        .collect();
    let w = (order.warmup as usize + 1).min(fwds.len());
    let mut ops: Vec<Compute> = fwds[..w].iter().map(|&t| Compute::Fwd(t)).collect();
    let pairs = fwds.len() - w;
    for k in 0..pairs {
        ops.push(Compute::FwdBwd {
            fwd: fwds[w + k],
            bwd: bwds[k],
        });
    }
    ops.extend(bwds[pairs..].iter().map(|&t| Compute::Bwd(t)));
    RankOrder {
        rank: order.rank,
        ops,
        warmup: w as u32,
    }
}

fn count_kinds(p: &Program, seen: &mut [usize; 3]) {
    for c in p.compute_orders().into_iter().flatten() {
        match c {
            Compute::FwdBwd { .. } => seen[0] += 1,
            Compute::BwdD(_) | Compute::BwdW(_) => seen[1] += 1,
            Compute::Bwd(_) => seen[2] += 1,
            Compute::Fwd(_) => {}
        }
    }
}

/// Split backward and overlapped pairs from hand-made compute orders, lowered by
/// `pipec_compiler::lower_orders` with one comm step per op. (With several chunks per rank that
/// lowering can deadlock under rendezvous, so the multi-chunk cases are covered by the
/// rewrite below, which keeps a compiled program's batches.)
#[test]
fn check_passes_for_split_and_overlapped_orders() {
    let tmp = tempfile::tempdir().unwrap();
    let mut seen = [0usize; 3];
    for kind in [ScheduleKind::Gpipe, ScheduleKind::OneFOneB] {
        for pp in 1..=4u32 {
            for m in [1, pp, 2 * pp + 1] {
                let s = orders(kind, pp, 1, m).unwrap();
                let mut variants: Vec<(String, Vec<RankOrder>)> = Vec::new();
                for delay in [0, 1, 3, usize::MAX / 2] {
                    variants.push((
                        format!("split, W delayed by {delay}"),
                        s.ranks.iter().map(|o| split(o, delay)).collect(),
                    ));
                }
                if kind == ScheduleKind::OneFOneB {
                    variants.push(("combined".into(), s.ranks.iter().map(combine).collect()));
                }
                for (name, ords) in variants {
                    let p = pipec_compiler::lower_orders(
                        &s.placement,
                        m,
                        false,
                        CommPolicy::FusedPerOp,
                        &ords,
                    );
                    count_kinds(&p, &mut seen);
                    let dir = tmp
                        .path()
                        .join(format!("{kind}-{pp}-{m}-{}", name.replace([' ', ','], "_")));
                    write_program(&p, &dir);
                    let what = format!("{kind} pp {pp} M {m} {name}");
                    let report = run_dir(&dir, &opts(2)).unwrap_or_else(|e| panic!("{what}: {e}"));
                    assert_checked(&report, &what);
                }
            }
        }
    }
    assert!(
        seen[0] > 0 && seen[1] > 0,
        "not every op kind ran: {seen:?}"
    );
}

/// Rewrite a compiled program's instruction stream, leaving every comm batch as it is:
/// `bwd(t)` becomes `bwd_D(t)` with `bwd_W(t)` `delay` compute instructions later, or (with
/// `fuse`) each `fwd` immediately followed by a `bwd` of another task becomes one `fwd_bwd`,
/// the pair Megatron's interleaved loop runs between two batches.
fn rewrite(p: &Program, delay: Option<usize>, fuse: bool) -> Program {
    let mut out = p.clone();
    for instrs in &mut out.ranks {
        let mut v: Vec<Instr> = Vec::with_capacity(instrs.len() * 2);
        let mut deferred: Vec<(usize, Task)> = Vec::new();
        let mut computes = 0usize;
        let mut i = 0;
        while i < instrs.len() {
            let ins = instrs[i];
            i += 1;
            match (ins, delay) {
                (Instr::Compute(Compute::Fwd(f)), _) if fuse => match instrs.get(i) {
                    Some(&Instr::Compute(Compute::Bwd(b))) if b != f => {
                        v.push(Instr::Compute(Compute::FwdBwd { fwd: f, bwd: b }));
                        i += 1;
                    }
                    _ => v.push(ins),
                },
                (Instr::Compute(Compute::Bwd(t)), Some(d)) => {
                    v.push(Instr::Compute(Compute::BwdD(t)));
                    deferred.push((computes + d, t));
                }
                _ => v.push(ins),
            }
            if matches!(ins, Instr::Compute(_)) {
                computes += 1;
                while let Some(&(due, t)) = deferred.first() {
                    if due >= computes {
                        break;
                    }
                    v.push(Instr::Compute(Compute::BwdW(t)));
                    deferred.remove(0);
                }
            }
        }
        v.extend(
            deferred
                .into_iter()
                .map(|(_, t)| Instr::Compute(Compute::BwdW(t))),
        );
        *instrs = v;
    }
    out
}

#[test]
fn check_passes_for_split_and_overlapped_rewrites_of_compiled_programs() {
    let tmp = tempfile::tempdir().unwrap();
    let mut seen = [0usize; 3];
    for (kind, vpps) in [
        (ScheduleKind::OneFOneB, &[1][..]),
        (ScheduleKind::Interleaved1F1B, &[2, 3][..]),
        (ScheduleKind::LoopedBfs, &[2][..]),
    ] {
        for pp in 2..=4u32 {
            for &vpp in vpps {
                for m in [pp, 2 * pp] {
                    let Ok(c) = compile(&request(kind, pp, vpp, m, false)) else {
                        continue;
                    };
                    for (name, delay, fuse) in [
                        ("split now", Some(0), false),
                        ("split, W 2 ops later", Some(2), false),
                        ("split, W last", Some(usize::MAX / 2), false),
                        ("overlapped pairs", None, true),
                    ] {
                        let p = rewrite(&c.program, delay, fuse);
                        count_kinds(&p, &mut seen);
                        let dir = tmp.path().join(format!(
                            "{kind}-{pp}-{vpp}-{m}-{}",
                            name.replace([' ', ','], "_")
                        ));
                        write_program(&p, &dir);
                        let what = format!("{kind} pp {pp} vpp {vpp} M {m} {name}");
                        let report =
                            run_dir(&dir, &opts(1)).unwrap_or_else(|e| panic!("{what}: {e}"));
                        assert_checked(&report, &what);
                    }
                }
            }
        }
    }
    assert!(
        seen[0] > 0 && seen[1] > 0,
        "not every op kind ran: {seen:?}"
    );
}

/// Deferring `bwd_W` keeps activations alive longer: the peak grows, measured and static agree.
#[test]
fn deferred_weight_gradients_raise_the_activation_peak() {
    let tmp = tempfile::tempdir().unwrap();
    let s = orders(ScheduleKind::OneFOneB, 2, 1, 4).unwrap();
    let peak = |delay: usize, name: &str| {
        let ords: Vec<RankOrder> = s.ranks.iter().map(|o| split(o, delay)).collect();
        let p = pipec_compiler::lower_orders(&s.placement, 4, false, CommPolicy::FusedPerOp, &ords);
        let dir = tmp.path().join(name);
        write_program(&p, &dir);
        let r = run_dir(&dir, &opts(1)).unwrap();
        assert_checked(&r, name);
        r.static_peak_activations
    };
    // 1F1B keeps pp - r activations on rank r; with every bwd_W at the end, all M stay.
    assert_eq!(peak(0, "now"), vec![2, 1]);
    assert_eq!(peak(usize::MAX / 2, "last"), vec![4, 4]);
}

// ---- the watchdog ---------------------------------------------------------------------------

/// 1F1B on two ranks with every send in its own batch (Megatron fuses `send_forward` with
/// `recv_backward` precisely to avoid this): after warmup rank 0 sends act(0,1) while rank 1
/// sends grad(1,0), each before posting the other's receive. With eager buffering of small
/// messages this would run; under rendezvous it hangs, so the runtime must report it.
fn unfused_1f1b() -> Program {
    Program {
        placement: Placement::looped(2, 1),
        microbatches: 2,
        forward_only: false,
        comm: None,
        ranks: vec![
            vec![
                fwd(0, 0),
                send(1, Payload::act(0, 0), 0),
                fwd(0, 1),
                send(1, Payload::act(0, 1), 1),
                recv(1, Payload::grad(1, 0), 2),
                bwd(0, 0),
                recv(1, Payload::grad(1, 1), 3),
                bwd(0, 1),
            ],
            vec![
                recv(0, Payload::act(0, 0), 0),
                fwd(1, 0),
                bwd(1, 0),
                send(0, Payload::grad(1, 0), 1),
                recv(0, Payload::act(0, 1), 2),
                fwd(1, 1),
                bwd(1, 1),
                send(0, Payload::grad(1, 1), 3),
            ],
        ],
        lengths: None,
        p2p_groups: Default::default(),
        buffer_slots: None,
    }
}

const HANG_R0: &str = "rank 0, #3 send(act of stage 0, mb 1 -> rank 1)";
const HANG_R1: &str = "rank 1, #3 send(grad of stage 1, mb 0 -> rank 0)";

#[test]
fn watchdog_reports_a_rendezvous_hang() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("hang");
    write_program(&unfused_1f1b(), &dir);
    let mut o = opts(1);
    // Long enough that a loaded machine still lets both ranks reach their waits.
    o.timeout = Duration::from_millis(1000);
    match run_dir_unverified(&dir, &o) {
        Err(e @ RunError::Failed(_)) => {
            let RunError::Failed(f) = &e else {
                unreachable!()
            };
            assert_eq!(f.kind, FailureKind::Hang);
            assert_eq!(e.exit_code(), 1);
            let text = f.report.as_str();
            assert!(text.starts_with("hang detected: "), "{text}");
            // Whichever rank timed out first reports itself and shows the other waiting.
            assert!(text.contains(HANG_R0) && text.contains(HANG_R1), "{text}");
            assert!(text.contains("waits for rank"), "{text}");
            assert!(text.contains("waiting in the comm batch"), "{text}");
        }
        other => panic!("expected a hang report, got {other:?}"),
    }
}

/// Regression: both ranks of a 2-rank hang start waiting at about the same moment, so both
/// time out together. A rank used to publish `stopped` before filing its report, and the
/// report that won could show its peer as "stopped at #3" instead of waiting (1 full-suite
/// run in 12 failed `watchdog_reports_a_rendezvous_hang` that way). Short timeouts, many runs:
/// the race window is wide open here.
#[test]
fn hang_report_never_shows_a_peer_that_timed_out_with_it_as_stopped() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("hang");
    write_program(&unfused_1f1b(), &dir);
    let mut o = opts(1);
    o.timeout = Duration::from_millis(5);
    for run in 0..60 {
        match run_dir_unverified(&dir, &o) {
            Err(RunError::Failed(f)) => {
                assert_eq!(f.kind, FailureKind::Hang, "run {run}: {}", f.report);
                // On a loaded machine the peer may not have reached its wait yet ("running",
                // "not started"), which is a true report; "stopped" never is.
                assert!(!f.report.contains("stopped"), "run {run}: {}", f.report);
            }
            other => panic!("run {run}: expected a hang report, got {other:?}"),
        }
    }
}

/// Swapping rank 0's send of act(0,0) with its receive of grad(1,0) makes both ranks wait for
/// each other (a cyclic wait under any semantics).
#[test]
fn watchdog_reports_swapped_instructions() {
    let tmp = tempfile::tempdir().unwrap();
    let c = compile(&request(ScheduleKind::OneFOneB, 2, 1, 1, false)).unwrap();
    let mut p = c.program.clone();
    let s = p.ranks[0]
        .iter()
        .position(|i| matches!(i, Instr::Send { .. }))
        .unwrap();
    let r = p.ranks[0]
        .iter()
        .position(|i| matches!(i, Instr::Recv { .. }))
        .unwrap();
    p.ranks[0].swap(s, r);
    let dir = tmp.path().join("swapped");
    write_program(&p, &dir);
    let mut o = opts(1);
    o.timeout = Duration::from_millis(1000);
    match run_dir_unverified(&dir, &o) {
        Err(RunError::Failed(f)) => {
            assert_eq!(f.kind, FailureKind::Hang, "{}", f.report);
            assert!(
                f.report.contains("recv(grad of stage 1, mb 0 <- rank 1)"),
                "{}",
                f.report
            );
            assert!(
                f.report.contains("recv(act of stage 0, mb 0 <- rank 0)"),
                "{}",
                f.report
            );
        }
        other => panic!("expected a hang report, got {other:?}"),
    }
}

// ---- refusals -------------------------------------------------------------------------------

#[test]
fn world_size_mismatch_is_refused_before_running() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ws");
    write_compiled(
        &compile(&request(ScheduleKind::OneFOneB, 2, 1, 2, false)).unwrap(),
        &dir,
    );
    let e = load(
        &dir,
        Some(LaunchWorld {
            size: 3,
            from: "--world-size",
        }),
    )
    .unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains("manifest.json") && msg.contains("`world_size`"),
        "{msg}"
    );
    assert!(
        msg.contains("compiled for 2 ranks, but the launch has 3"),
        "{msg}"
    );
    assert_eq!(e.exit_code(), 1);
    assert!(load(
        &dir,
        Some(LaunchWorld {
            size: 2,
            from: "--world-size"
        })
    )
    .is_ok());
}

#[test]
fn edited_rank_file_is_refused_by_hash() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("hash");
    write_compiled(
        &compile(&request(ScheduleKind::OneFOneB, 2, 1, 2, false)).unwrap(),
        &dir,
    );
    tamper(&dir);
    let e = load(&dir, None).unwrap_err();
    assert!(
        e.to_string().contains("rank-1.json") && e.to_string().contains("sha256"),
        "{e}"
    );
    assert_eq!(e.exit_code(), 1);
}

/// Change one microbatch id in rank 1's file, leaving the manifest's hash as it was.
fn tamper(dir: &Path) {
    let p = dir.join("rank-1.json");
    let text = std::fs::read_to_string(&p).unwrap();
    let edited = text.replacen("\"mb\":1", "\"mb\":0", 1);
    assert_ne!(text, edited, "the rank file has an mb 1 to edit");
    std::fs::write(&p, edited).unwrap();
}

#[test]
fn unmatched_program_is_refused_naming_rank_and_instruction() {
    let tmp = tempfile::tempdir().unwrap();
    let mut p = unfused_1f1b();
    p.ranks[1].remove(4); // rank 1 no longer receives act(0, 1)
    let dir = tmp.path().join("unmatched");
    write_program(&p, &dir);
    let e = load(&dir, None).unwrap_err();
    let msg = e.to_string();
    assert!(msg.contains("refusing to run"), "{msg}");
    assert!(
        msg.contains("rank 0, #3 send(act of stage 0, mb 1 -> rank 1) has no matching recv"),
        "{msg}"
    );
    // Without the full verifier (`--no-verify`), the structural level refuses it too, naming
    // the file and the instruction.
    let e = pipec_runtime::load_unverified(&dir, None).unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains("rank-0.json: field `instructions[3]`")
            && msg.contains("has no matching recv"),
        "{msg}"
    );
}

// ---- the binary -----------------------------------------------------------------------------

fn cli_dir(tmp: &Path, name: &str, kind: ScheduleKind, pp: u32, vpp: u32, m: u32) -> PathBuf {
    let dir = tmp.join(name);
    write_compiled(&compile(&request(kind, pp, vpp, m, false)).unwrap(), &dir);
    dir
}

const TINY: [&str; 8] = ["--hidden", "4", "--ffn", "8", "--vocab", "8", "--seq", "3"];

#[test]
fn cli_checks_every_kind_and_writes_a_trace() {
    let tmp = tempfile::tempdir().unwrap();
    for (kind, vpp) in [
        (ScheduleKind::Gpipe, 1),
        (ScheduleKind::OneFOneB, 1),
        (ScheduleKind::Interleaved1F1B, 2),
        (ScheduleKind::LoopedBfs, 2),
    ] {
        let dir = cli_dir(tmp.path(), kind.name(), kind, 2, vpp, 4);
        let trace = tmp.path().join(format!("{}.json", kind.name()));
        let out = pipec_run()
            .arg(&dir)
            .args([
                "--backend",
                "cpu",
                "--check",
                "--steps",
                "2",
                "--timeout",
                "10",
                "--trace",
            ])
            .arg(&trace)
            .args(TINY)
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert_eq!(
            out.status.code(),
            Some(0),
            "{kind}: {stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            stdout.contains("step 1: loss ") && stdout.contains("step 2: loss "),
            "{stdout}"
        );
        assert_eq!(
            stdout
                .matches("equal the single-thread reference bitwise")
                .count(),
            2,
            "{stdout}"
        );
        assert!(stdout.contains("rank 1: busy "), "{stdout}");
        let t: serde_json::Value = serde_json::from_slice(&std::fs::read(&trace).unwrap()).unwrap();
        let events = t["traceEvents"].as_array().unwrap();
        let x: Vec<_> = events.iter().filter(|e| e["ph"] == "X").collect();
        let loaded = load(&dir, None).unwrap();
        assert_eq!(
            x.len(),
            loaded.program.program().len(),
            "one event per instruction"
        );
        assert!(x.iter().all(|e| e["pid"] == 0
            && e["tid"].as_u64().unwrap() < 2
            && e["dur"].as_f64().unwrap() >= 0.0));
    }
}

#[test]
fn cli_hang_exits_1_with_the_watchdog_report() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("hang");
    write_program(&unfused_1f1b(), &dir);
    // Without --no-verify the schedule is refused before any rank starts, with the cycle.
    let refused = pipec_run().arg(&dir).args(TINY).output().unwrap();
    let text = String::from_utf8_lossy(&refused.stderr);
    assert_eq!(refused.status.code(), Some(1), "{text}");
    assert!(
        text.contains("refusing to run") && text.contains("deadlock"),
        "{text}"
    );
    let out = pipec_run()
        .arg(&dir)
        .args(["--no-verify", "--timeout", "1"])
        .args(TINY)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("error: hang detected: "), "{stderr}");
    assert!(
        stderr.contains(HANG_R0) && stderr.contains(HANG_R1),
        "{stderr}"
    );
}

#[test]
fn cli_refusals_and_usage_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = cli_dir(tmp.path(), "ok", ScheduleKind::OneFOneB, 2, 1, 2);
    // World size from the flag and from the environment.
    let out = pipec_run()
        .arg(&dir)
        .args(["--world-size", "4"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("`world_size`"));
    let out = pipec_run()
        .arg(&dir)
        .env("WORLD_SIZE", "3")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("launch has 3 (WORLD_SIZE)"));
    let out = pipec_run()
        .arg(&dir)
        .env("WORLD_SIZE", "2")
        .args(TINY)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0));
    // CUDA is not built in.
    let out = pipec_run()
        .arg(&dir)
        .args(["--backend", "cuda"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("without the `cuda` feature"));
    // Missing directory, bad flags.
    let out = pipec_run().arg(tmp.path().join("nope")).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    let out = pipec_run()
        .arg(&dir)
        .args(["--timeout", "-1"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let out = pipec_run()
        .arg(&dir)
        .args(["--steps", "0"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    // A tampered rank file.
    tamper(&dir);
    let out = pipec_run().arg(&dir).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("rank-1.json"));
}

/// `--json` prints one JSON object with what the text report says: the same losses (the text
/// prints six decimals), one entry per step and rank, the check, and the static peaks the
/// text prints as "(static N)".
#[test]
fn cli_json_report_matches_the_text_report() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = cli_dir(tmp.path(), "json", ScheduleKind::ZbV, 2, 2, 4);
    let args = ["--check", "--steps", "2"];
    let text = pipec_run()
        .arg(&dir)
        .args(args)
        .args(TINY)
        .output()
        .unwrap();
    assert!(text.status.success());
    let text = String::from_utf8(text.stdout).unwrap();
    let out = pipec_run()
        .arg(&dir)
        .args(args)
        .args(TINY)
        .arg("--json")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["backend"], "cpu");
    assert_eq!(v["schedule"]["kind"], "zb-v");
    assert_eq!(
        (v["world_size"].as_u64(), v["microbatches"].as_u64()),
        (Some(2), Some(4))
    );
    assert_eq!(v["model"]["hidden"], 4);
    assert_eq!(v["lr"], 0.1);
    let steps = v["steps"].as_array().unwrap();
    assert_eq!(steps.len(), 2);
    let text_losses: Vec<&str> = text
        .lines()
        .filter_map(|l| {
            l.strip_prefix("step ")?
                .split("loss ")
                .nth(1)?
                .split_whitespace()
                .next()
        })
        .collect();
    for (s, want) in steps.iter().zip(&text_losses) {
        assert_eq!(format!("{:.6}", s["loss"].as_f64().unwrap()), *want);
        assert_eq!(s["ranks"].as_array().unwrap().len(), 2);
        assert_eq!(s["check"]["max_abs_diff"], 0.0);
    }
    for (r, peak) in v["static_peak_activations"]
        .as_array()
        .unwrap()
        .iter()
        .enumerate()
    {
        assert!(text.contains(&format!("rank {r}: ")), "{text}");
        assert!(text.contains(&format!("(static {peak})")), "{text}");
    }
    // The interpreter's own time (a no-op backend run of each rank) is there for every rank;
    // its share of the step is a measurement, so only its presence is checked.
    let interp = v["interpreter_us"].as_array().unwrap();
    assert_eq!(interp.len(), 2);
    assert!(
        interp.iter().all(|u| u.as_f64().unwrap() > 0.0),
        "{interp:?}"
    );
    assert!(v["interpreter_share"].as_f64().unwrap() > 0.0);
    assert!(text.contains("interpreter: "), "{text}");
    // Errors go to stderr with their exit codes, and stdout still holds one JSON document
    // (issue 29: a JSON consumer never reads an empty one).
    let bad = pipec_run()
        .arg(tmp.path().join("missing"))
        .arg("--json")
        .output()
        .unwrap();
    assert_eq!(bad.status.code(), Some(2));
    let stderr = String::from_utf8(bad.stderr).unwrap();
    assert!(stderr.contains("missing"), "{stderr}");
    let e: serde_json::Value = serde_json::from_slice(&bad.stdout).unwrap();
    assert_eq!(e["exit_code"], 2);
    assert!(stderr.contains(e["error"].as_str().unwrap()), "{e}");
}

/// `--trace-steps` picks the steps of `pipec-run`'s trace: one trace process per step, each
/// with one event per instruction of every rank; bad ranges are usage errors.
#[test]
fn trace_steps_selects_the_traced_steps() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = cli_dir(tmp.path(), "ts", ScheduleKind::OneFOneB, 2, 1, 4);
    let instrs = load(&dir, None).unwrap().program.program().len();
    let trace = tmp.path().join("t.json");
    let run = |steps: &str, spec: &str| {
        pipec_run()
            .arg(&dir)
            .args(["--steps", steps, "--trace"])
            .arg(&trace)
            .args(["--trace-steps", spec])
            .args(TINY)
            .output()
            .unwrap()
    };
    for (spec, want) in [("2..3", vec![2, 3]), ("all", vec![1, 2, 3]), ("1", vec![1])] {
        let out = run("3", spec);
        assert_eq!(out.status.code(), Some(0), "{spec}");
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&trace).unwrap()).unwrap();
        let events = v["traceEvents"].as_array().unwrap();
        let names: Vec<String> = events
            .iter()
            .filter(|e| e["name"] == "process_name")
            .map(|e| e["args"]["name"].as_str().unwrap().to_string())
            .collect();
        let expect: Vec<String> = want
            .iter()
            .map(|s| format!("measured (pipec-run) step {s}"))
            .collect();
        assert_eq!(names, expect, "{spec}");
        let pids: Vec<&serde_json::Value> = events
            .iter()
            .filter(|e| e["name"] == "process_name")
            .map(|e| &e["pid"])
            .collect();
        for pid in pids {
            let x = events
                .iter()
                .filter(|e| e["ph"] == "X" && &e["pid"] == pid)
                .count();
            assert_eq!(x, instrs, "{spec}: process {pid}");
        }
    }
    for bad in ["0", "4", "3..2", "x", "1..9"] {
        let out = run("3", bad);
        assert_eq!(out.status.code(), Some(2), "{bad}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("--trace-steps"), "{bad}: {err}");
    }
}

// ---------------------------------------------------------------------------------------------
// The CPU runtime executes memory instructions (issue 30): offload to a host store, reload,
// wait_offload, checkpointed forwards and recompute, with real tensors. Judged by
// - the single-thread reference (`pipec_runtime::reference`, the model run without
//   pipelining): a run with memory instructions must match it bitwise (`check`), as the same
//   program without them does, so their gradients are bitwise equal; the step losses of both
//   runs are compared bit for bit too (later steps depend on every earlier gradient);
// - the brute-force buffer replay of `memory.rs` (shares no code with the runtime or with
//   `pipec_ir::ir::activations`) and the verifier's `pipec_ir::memory::walk`: the measured device and
//   host peaks of every rank must equal both;
// - the offload planner's own profile (`pipec_tune::offload::plan`) for its inserts;
// - `pipec check --json` for the `pipec-run` CLI.

fn memory_opts(steps: u32) -> RunOptions {
    RunOptions {
        model: ModelConfig {
            hidden: 4,
            ffn: 8,
            vocab: 8,
            seq: 3,
            seed: 3,
        },
        steps,
        check: true,
        timeout: Duration::from_secs(20),
        ..RunOptions::default()
    }
}

/// Run `p` (verified first) with memory metered in `mm`; every step checked bitwise against
/// the reference.
fn run(p: &Program, mm: &MemoryModel, steps: u32) -> RunReport {
    let v = verified(p.clone(), &VerifyOptions::default())
        .unwrap_or_else(|r| panic!("does not verify: {}", r.report));
    let r = run_cpu_with_memory(
        &v,
        &Layout::uniform(p.num_stages()),
        &memory_opts(steps),
        mm,
    )
    .unwrap_or_else(|e| panic!("{e}"));
    for s in &r.steps {
        let c = s.check.as_ref().expect("checked");
        assert_eq!(c.max_abs_diff, 0.0);
    }
    r
}

/// The measured peaks of every step and rank equal the replay's (parameters added) and the
/// verifier's.
fn assert_measured(what: &str, q: &Program, mm: &MemoryModel, r: &RunReport) {
    let walk = pipec_ir::memory::peaks(q, mm);
    assert_eq!(r.static_memory, walk, "{what}");
    for s in &r.steps {
        for (rank, st) in s.ranks.iter().enumerate() {
            let m = q.microbatches;
            let (device, host) = replay_split(&q.ranks[rank], |t| mm.weights(t, m));
            let params = mm.param[rank];
            let at = format!("{what}: step {} rank {rank}", s.step);
            assert_eq!(st.peak_memory, params + device, "{at}: device, replay");
            assert_eq!(st.host_memory, host, "{at}: host, replay");
            assert_eq!(st.peak_memory, walk[rank].peak, "{at}: device, verifier");
            assert_eq!(st.host_memory, walk[rank].host, "{at}: host, verifier");
        }
        let counted: Vec<u32> = s.ranks.iter().map(|x| x.peak_activations).collect();
        assert_eq!(
            counted, r.static_peak_activations,
            "{what}: activation count"
        );
    }
}

fn losses(r: &RunReport) -> Vec<u32> {
    r.steps.iter().map(|s| s.loss.to_bits()).collect()
}

fn memory_ops(q: &Program) -> usize {
    q.ranks
        .iter()
        .flatten()
        .filter(|i| matches!(i, Instr::Memory(_) | Instr::FwdCheckpoint(_)))
        .count()
}

/// Random valid memory instructions in compiled schedules of every kind: the run with them
/// trains bitwise as the run without them, and measures the replay's and the verifier's
/// peaks, device and host, under random stage weights and parameters.
#[test]
fn random_memory_ops_run_bitwise_and_measure_the_verifiers_peaks() {
    let mut rng = Rng(0x30);
    let mut executed = 0;
    for (kind, vpp) in kinds() {
        for (pp, m) in [(2, 4), (4, 4)] {
            let Some(p) = program(kind, pp, vpp, m) else {
                continue;
            };
            let mm = MemoryModel {
                act: (0..p.num_stages())
                    .map(|_| (1 + rng.below(5)) as f64)
                    .collect(),
                param: (0..p.world()).map(|_| rng.below(3) as f64).collect(),
                unit: Unit::LayerActivations,
                mb_scale: None,
                msg: None,
                act_w: None,
            };
            // Odd stages keep half their activations (rounded down) from `bwd_D` to `bwd_W`
            // (issue #39): the run cuts those stashes at `bwd_D` and meters the rest.
            let mm = MemoryModel {
                act_w: Some(
                    mm.act
                        .iter()
                        .enumerate()
                        .map(|(s, &a)| if s % 2 == 1 { (a / 2.0).floor() } else { a })
                        .collect(),
                ),
                ..mm
            };
            let base = run(&p, &mm, 2);
            assert_measured(&format!("{kind:?} pp {pp} plain"), &p, &mm, &base);
            for seed in 0..2 {
                let q = with_memory_ops(&p, &mut rng);
                let what = format!("{kind:?} pp {pp} seed {seed}");
                let got = run(&q, &mm, 2);
                assert_eq!(losses(&got), losses(&base), "{what}: step losses");
                assert_measured(&what, &q, &mm, &got);
                executed += memory_ops(&q);
            }
        }
    }
    assert!(executed > 200, "{executed} memory instructions ran");
}

/// The offload planner's inserts (PipeOffload's planning) under a limit below the plain peak:
/// the run trains bitwise as without them and measures the peak the planner planned.
#[test]
fn planned_offloads_run_at_the_planned_peak() {
    use pipec_cost::cost::{CostModel, StageCosts};
    use pipec_tune::offload::{plan, RankInput};
    let mut runs = Vec::new();
    for ((kind, vpp), (pp, m)) in kinds().into_iter().flat_map(|k| [(k, (2, 4)), (k, (4, 8))]) {
        let Some(p) = program(kind, pp, vpp, m) else {
            continue;
        };
        let costs = StageCosts::uniform(&CostModel::default(), p.num_stages());
        let sim = pipec_cost::simulate::simulate_unverified(
            &pipec_ir::verify::Unverified::unchecked(&p),
            &costs,
        )
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
        let top = pipec_ir::memory::peaks(&p, &mm)
            .iter()
            .map(|w| w.peak)
            .fold(0.0, f64::max);
        let f = costs.compute(&Compute::Fwd(Task::new(0, 0))).unwrap();
        let Some((limit, plans)) = [(0.5, 0.5), (0.75, 0.25), (0.75, 0.05), (0.9, 0.05)]
            .into_iter()
            .filter_map(|(l, c)| {
                plan(&inputs, l * top, act, |_| c * f)
                    .ok()
                    .map(|x| (l * top, x))
            })
            .find(|(_, plans)| plans.iter().any(|rp| !rp.inserts.is_empty()))
        else {
            continue;
        };
        // The tuner's own placement of the inserts (what `tune` writes).
        let q = pipec_tune::levers::insert(&p, &plans);
        assert!(memory_ops(&q) > 0, "{kind:?} pp {pp}: nothing planned");
        let base = run(&p, &mm, 1);
        let got = run(&q, &mm, 1);
        let what = format!("{kind:?} pp {pp} m {m} planned");
        assert_eq!(losses(&got), losses(&base), "{what}");
        assert_measured(&what, &q, &mm, &got);
        for (r, rp) in plans.iter().enumerate() {
            let peak = got.steps[0].ranks[r].peak_memory;
            assert_eq!(peak, rp.peak, "{what} rank {r}: the planner's peak");
            assert!(peak <= limit, "{what} rank {r}: over the limit");
        }
        // The limit is below the plain run's worst rank, which the offloads brought under it.
        let worst = |r: &RunReport| {
            r.steps[0]
                .ranks
                .iter()
                .map(|x| x.peak_memory)
                .fold(0.0, f64::max)
        };
        assert!(worst(&got) < worst(&base), "{what}");
        runs.push(what);
    }
    assert!(runs.len() >= 6, "{runs:?}");
}

/// 1F1B, 2 ranks, 2 microbatches, and where rank 0 runs each pass of `t`.
fn small() -> (Program, impl Fn(&Program, Task, Pass) -> usize) {
    let p = program(ScheduleKind::OneFOneB, 2, 1, 2).unwrap();
    let at = |q: &Program, t: Task, pass: Pass| {
        q.ranks[0]
            .iter()
            .position(|i| {
                has(i, t, &[pass]) || (pass == Pass::Fwd && *i == Instr::FwdCheckpoint(t))
            })
            .unwrap()
    };
    (p, at)
}

/// What the verifier rejects, the runtime stops at (run unchecked, as `pipec-run
/// --no-verify` may reach it): a schedule error naming the rank and instruction, never a
/// panic.
#[test]
fn misused_memory_instructions_stop_with_a_schedule_error() {
    let (p, at) = small();
    let t = Task::new(0, 0);
    let (fwd, bwd) = (at(&p, t, Pass::Fwd), at(&p, t, Pass::Bwd));
    let with = |ins: Vec<(usize, Instr)>, checkpoint: bool| {
        let mut q = p.clone();
        q.ranks[0] = insert(&p.ranks[0], ins);
        if checkpoint {
            let f = at(&q, t, Pass::Fwd);
            q.ranks[0][f] = Instr::FwdCheckpoint(t);
        }
        q
    };
    let cases: Vec<(Program, &str)> = vec![
        (
            with(vec![(fwd + 1, mem(MemKind::Offload, t))], false),
            "bwd(stage 0, mb 0): the saved activation of stage 0, mb 0 is on the host: offloaded and not reloaded",
        ),
        (
            with(vec![], true),
            "bwd(stage 0, mb 0): the activation of stage 0, mb 0 was checkpointed and is not recomputed yet",
        ),
        (
            with(vec![(bwd, mem(MemKind::Recompute, t))], false),
            "recompute(stage 0, mb 0): nothing to recompute: fwd(stage 0, mb 0) was not checkpointed",
        ),
        (
            with(vec![(bwd, mem(MemKind::Reload, t))], false),
            "reload(stage 0, mb 0): nothing to reload: the activation of stage 0, mb 0 is not on the host",
        ),
        (
            with(vec![(fwd, mem(MemKind::Offload, t))], false),
            "offload(stage 0, mb 0): nothing to offload: the saved activation of stage 0, mb 0 is not here",
        ),
        (
            with(vec![(bwd, mem(MemKind::WaitOffload, t))], false),
            "wait_offload(stage 0, mb 0): no offload of stage 0, mb 0 was posted before",
        ),
    ];
    for (q, want) in cases {
        let report = pipec_ir::verify::verify(&q, &VerifyOptions::default());
        assert!(!report.is_valid(), "the verifier accepts {want}");
        let layout = Layout::uniform(q.num_stages());
        let f = match run_cpu_unchecked(&q, &layout, &memory_opts(1)) {
            Err(RunError::Failed(f)) => f,
            other => panic!("{want}: {:?}", other.map(|r| r.steps.len())),
        };
        assert_eq!(f.kind, FailureKind::Schedule, "{}", f.report);
        let index = q.ranks[0]
            .iter()
            .position(|i| want.starts_with(&i.to_string()))
            .unwrap() as u32;
        assert_eq!(
            f.at,
            InstrRef {
                rank: Rank(0),
                index
            },
            "{}",
            f.report
        );
        let head = format!("schedule error at rank 0, #{index} {want}");
        assert!(f.report.starts_with(&head), "{}\nwant {head}", f.report);
    }
}

/// `pipec-run` on a written directory with every memory instruction: exit 0, the check
/// passes, and the measured peaks it prints (text and JSON) are `pipec check --json`'s.
/// `--no-verify` on a directory whose backward finds its activation on the host stops with
/// exit 1 naming the instruction.
#[test]
fn pipec_run_executes_memory_instructions_and_prints_the_verifiers_peaks() {
    use pipec_ir::files::{write_program, write_unverified, Encoding, Header};
    let (c, q) = every_memory_op_1f1b();
    let header = Header {
        source: "generated",
        schedule: Some(c.spec),
        layout: &c.layout,
    };
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("mem");
    let v = verified(q.clone(), &VerifyOptions::default()).unwrap();
    write_program(&dir, &header, &v, Encoding::Json).unwrap();
    let out = crate::harness::pipec()
        .args(["check", "--json"])
        .arg(&dir)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0));
    let check: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let figure = |m: &serde_json::Value, k: &str| m.get(k).and_then(|x| x.as_f64()).unwrap_or(0.0);
    let want: Vec<(f64, f64)> = check["memory"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| (figure(m, "peak"), figure(m, "host")))
        .collect();
    assert_eq!(want[0].1, 1.0, "rank 0 offloads: {check}");

    let out = pipec_run()
        .args(["--check", "--steps", "2", "--json"])
        .arg(&dir)
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    for s in j["steps"].as_array().unwrap() {
        let got: Vec<(f64, f64)> = s["ranks"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| (figure(r, "peak_memory"), figure(r, "host_memory")))
            .collect();
        assert_eq!(got, want, "{j}");
        assert_eq!(s["check"]["max_abs_diff"], 0.0);
    }
    assert_eq!(j["memory_unit"], check["memory_unit"]);

    let out = pipec_run().arg("--check").arg(&dir).output().unwrap();
    assert_eq!(out.status.code(), Some(0));
    let text = String::from_utf8_lossy(&out.stdout);
    let list = |f: &dyn Fn(&(f64, f64)) -> f64| {
        want.iter()
            .map(|x| Unit::LayerActivations.fmt(f(x)))
            .collect::<Vec<_>>()
            .join(" ")
    };
    let (peaks, hosts) = (list(&|x| x.0), list(&|x| x.1));
    let line = format!(
        "peak memory per rank (layer-activations, modelled: each held tensor at its cost-model size): {peaks} held in the run, verifier {peaks}; host {hosts} held in the run, verifier {hosts}\n"
    );
    assert!(text.contains(&line), "{text}\nwant {line}");

    // Without the reload, the backward finds its activation on the host.
    let mut broken = q.clone();
    let reload = broken.ranks[0]
        .iter()
        .position(|i| *i == mem(MemKind::Reload, Task::new(0, 0)))
        .unwrap();
    broken.ranks[0].remove(reload);
    let bad = tmp.path().join("bad");
    let unverified = pipec_ir::verify::Unverified::unchecked(&broken);
    write_unverified(&bad, &header, &unverified, Encoding::Json).unwrap();
    // `--no-verify` keeps the structural level, which already names it (the runtime's own
    // error on the same program: `misused_memory_instructions_stop_with_a_schedule_error`).
    let out = pipec_run().arg("--no-verify").arg(&bad).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains(&format!("rank 0, #{reload} bwd(stage 0, mb 0)"))
            && err.contains("while its activations are on the host"),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
}

/// Random valid memory instructions, then one of them removed, moved or doubled, run
/// unchecked (as `pipec-run --no-verify` would, past the structural level): a program the
/// verifier accepts runs bitwise at the verifier's peaks; a run that stops does so with a
/// schedule error naming a rank and instruction, on a program the verifier rejects; nothing
/// panics.
#[test]
fn mutated_memory_instructions_stop_cleanly_or_run_as_verified() {
    let mut rng = Rng(0x5eed);
    let (mut valid, mut stopped) = (0, 0);
    let o = RunOptions {
        timeout: Duration::from_secs(5),
        ..memory_opts(1)
    };
    for case in 0..80 {
        let (kind, vpp) = kinds()[case % kinds().len()];
        let Some(p) = program(kind, 2, vpp, 4) else {
            continue;
        };
        let mut q = with_memory_ops(&p, &mut rng);
        let sites: Vec<(usize, usize)> = q
            .ranks
            .iter()
            .enumerate()
            .flat_map(|(r, instrs)| {
                instrs
                    .iter()
                    .enumerate()
                    .filter(|(_, i)| matches!(i, Instr::Memory(_) | Instr::FwdCheckpoint(_)))
                    .map(move |(i, _)| (r, i))
            })
            .collect();
        if sites.is_empty() {
            continue;
        }
        let (r, i) = sites[rng.below(sites.len())];
        let ins = q.ranks[r][i];
        let what = format!("case {case} {kind:?}: {ins} at rank {r}, #{i}");
        match (ins, rng.below(3)) {
            // A checkpointed forward back to a plain one, or dropped with its output.
            (Instr::FwdCheckpoint(t), 0) => q.ranks[r][i] = Instr::Compute(Compute::Fwd(t)),
            (_, 0) => {
                q.ranks[r].remove(i);
            }
            (_, 1) => {
                q.ranks[r].remove(i);
                let to = rng.below(q.ranks[r].len() + 1);
                q.ranks[r].insert(to, ins);
            }
            _ => {
                let to = rng.below(q.ranks[r].len() + 1);
                q.ranks[r].insert(to, ins);
            }
        }
        let report = pipec_ir::verify::verify(&q, &VerifyOptions::default());
        let layout = Layout::uniform(q.num_stages());
        match run_cpu_unchecked(&q, &layout, &o) {
            Ok(got) => {
                if report.is_valid() {
                    valid += 1;
                    assert_eq!(got.steps[0].check.as_ref().unwrap().max_abs_diff, 0.0);
                    let mm = pipec_runtime::run::memory_model(&q, &layout, None);
                    assert_measured(&what, &q, &mm, &got);
                }
            }
            Err(RunError::Failed(f)) => {
                stopped += 1;
                assert!(!report.is_valid(), "{what}: verified, but {}", f.report);
                assert_eq!(f.kind, FailureKind::Schedule, "{what}: {}", f.report);
                let head = format!("schedule error at {}, #{} ", f.at.rank, f.at.index);
                assert!(f.report.starts_with(&head), "{what}: {}", f.report);
            }
            Err(e) => panic!("{what}: {e}"),
        }
    }
    assert!(
        valid > 5 && stopped > 10,
        "{valid} valid, {stopped} stopped"
    );
}
