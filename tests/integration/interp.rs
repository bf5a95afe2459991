//! The interpreter (`pipec_runtime::interp`) on lowered programs of the built-in kinds: what
//! the runtime's own unit tests cannot build, since the runtime knows nothing of lowering.

use pipec_ir::ir::{Instr, InstrRef, MemKind, MemOp, Program};
use pipec_runtime::backend::noop::NoopBackend;
use pipec_runtime::backend::BackendError;
use pipec_runtime::backend::{Backend, CommError, CommOp};
use pipec_runtime::interp::*;
use pipec_runtime::watchdog::{FailureKind, Watch};
use pipec_schedules::{generate, Limits, Placement, ScheduleKind, ScheduleSpec};
use pipec_schedules::{Compute, Rank, Task};
use std::time::Duration;
use std::time::Instant;

fn program_fo(kind: ScheduleKind, pp: u32, vpp: u32, m: u32, forward_only: bool) -> Program {
    let spec = ScheduleSpec {
        forward_only,
        ..ScheduleSpec::new(kind, pp, vpp, m)
    };
    pipec_compiler::lower::lower(&generate(&spec, &Limits::DEFAULT).unwrap())
}

fn program(kind: ScheduleKind, pp: u32, vpp: u32, m: u32) -> Program {
    program_fo(kind, pp, vpp, m, false)
}

/// With the no-op backend each rank runs alone; the measured stash peak equals the static
/// count, training and forward-only, and every instruction gets one span.
#[test]
fn noop_runs_measure_the_static_peak() {
    for forward_only in [false, true] {
        for (k, vpp) in [
            (ScheduleKind::Gpipe, 1),
            (ScheduleKind::OneFOneB, 1),
            (ScheduleKind::Interleaved1F1B, 2),
            (ScheduleKind::ZbH1, 1),
        ] {
            let p = program_fo(k, 4, vpp, 8, forward_only);
            let statics = static_peak_activations(&p);
            let watch = Watch::new(4, Duration::from_secs(5));
            for r in 0..4u32 {
                let run = run_rank(&p, Rank(r), &mut NoopBackend, &watch, Instant::now()).unwrap();
                assert_eq!(run.spans.len(), p.ranks[r as usize].len());
                let what = format!("{k} forward-only {forward_only} rank {r}");
                assert_eq!(run.peak_activations, statics[r as usize], "{what}");
            }
        }
    }
    // 1F1B keeps pp - r activations on rank r (PipeDream-Flush), GPipe all M; forward-only,
    // a forward's activation lives while it runs.
    assert_eq!(
        static_peak_activations(&program(ScheduleKind::OneFOneB, 4, 1, 8)),
        vec![4, 3, 2, 1]
    );
    assert_eq!(
        static_peak_activations(&program(ScheduleKind::Gpipe, 2, 1, 5)),
        vec![5, 5]
    );
    assert_eq!(
        static_peak_activations(&program_fo(ScheduleKind::OneFOneB, 4, 1, 8, true)),
        vec![1, 1, 1, 1]
    );
}

/// 1F1B (pp = 4, M = 6) with memory instructions on rank 1 (stage 1): an offload,
/// `wait_offload` and reload of mb 0, a checkpointed forward and a recompute of mb 1; the
/// program verifies.
pub fn with_memory_ops() -> Program {
    let mut p = program(ScheduleKind::OneFOneB, 4, 1, 6);
    let r = &mut p.ranks[1];
    let mem = |kind, t| Instr::Memory(MemOp { kind, task: t });
    let at = |r: &[Instr], c: Compute| r.iter().position(|i| *i == Instr::Compute(c)).unwrap();
    let (t0, t1) = (Task::new(1, 0), Task::new(1, 1));
    let f0 = at(r, Compute::Fwd(t0));
    r.insert(f0 + 1, mem(MemKind::Offload, t0));
    r.insert(f0 + 2, mem(MemKind::WaitOffload, t0));
    let b0 = at(r, Compute::Bwd(t0));
    r.insert(b0, mem(MemKind::Reload, t0));
    let f1 = at(r, Compute::Fwd(t1));
    r[f1] = Instr::FwdCheckpoint(t1);
    let b1 = at(r, Compute::Bwd(t1));
    r.insert(b1, mem(MemKind::Recompute, t1));
    let report = pipec_ir::verify::verify(&p, &Default::default());
    assert!(report.is_valid(), "{:?}", report.violations);
    p
}

/// The no-op backend, recording each call.
#[derive(Default)]
struct Calls(Vec<String>);

impl Backend for Calls {
    type Tensor = ();
    type Saved = ();
    type Partial = ();
    type Host = ();
    fn fwd(
        &mut self,
        t: Task,
        i: Option<()>,
        save: bool,
    ) -> Result<((), Option<()>), BackendError> {
        self.0.push(format!("fwd {t} save {save}"));
        NoopBackend.fwd(t, i, save)
    }
    fn bwd(&mut self, t: Task, s: (), g: Option<()>) -> Result<(), BackendError> {
        self.0.push(format!("bwd {t}"));
        NoopBackend.bwd(t, s, g)
    }
    fn bwd_d(&mut self, t: Task, s: &(), g: Option<()>) -> Result<((), ()), BackendError> {
        self.0.push(format!("bwd_d {t}"));
        NoopBackend.bwd_d(t, s, g)
    }
    fn bwd_w(&mut self, t: Task, s: (), p: ()) -> Result<(), BackendError> {
        self.0.push(format!("bwd_w {t}"));
        NoopBackend.bwd_w(t, s, p)
    }
    fn keep(&mut self, _: &()) -> Result<(), BackendError> {
        self.0.push("keep".into());
        Ok(())
    }
    fn offload(&mut self, t: Task, _: ()) -> Result<(), BackendError> {
        self.0.push(format!("offload {t}"));
        Ok(())
    }
    fn wait_offload(&mut self, t: Task) -> Result<(), BackendError> {
        self.0.push(format!("wait_offload {t}"));
        Ok(())
    }
    fn reload(&mut self, t: Task, _: ()) -> Result<(), BackendError> {
        self.0.push(format!("reload {t}"));
        Ok(())
    }
    fn exchange(&mut self, ops: &mut [CommOp<()>]) -> Result<(), CommError> {
        self.0.push(format!("exchange {}", ops.len()));
        NoopBackend.exchange(ops)
    }
}

/// What the CUDA backend relies on (one timing mark per instruction): every compute or
/// memory instruction is exactly one pass or copy call, in program order, a checkpointed
/// forward a `keep` and an unsaved forward, a recompute a saving forward; comm batches
/// are one exchange each.
#[test]
fn memory_instructions_call_the_backend_once_each_in_order() {
    let p = with_memory_ops();
    let watch = Watch::new(4, Duration::from_secs(5));
    let mut calls = Calls::default();
    run_rank(&p, Rank(1), &mut calls, &watch, Instant::now()).unwrap();
    let mut want = Vec::new();
    let instrs = &p.ranks[1];
    let mut i = 0;
    while i < instrs.len() {
        match instrs[i] {
            Instr::Compute(Compute::Fwd(t)) => want.push(format!("fwd {t} save true")),
            Instr::Compute(Compute::Bwd(t)) => want.push(format!("bwd {t}")),
            Instr::FwdCheckpoint(t) => {
                want.push("keep".into());
                want.push(format!("fwd {t} save false"));
            }
            Instr::Memory(m) => want.push(match m.kind {
                MemKind::Recompute => format!("fwd {} save true", m.task),
                k => format!("{} {}", k.op(), m.task),
            }),
            Instr::Send { .. } | Instr::Recv { .. } => {
                let end = pipec_ir::ir::batch_end(instrs, i);
                want.push(format!("exchange {}", end - i));
                i = end;
                continue;
            }
            ref other => panic!("not in 1F1B: {other}"),
        }
        i += 1;
    }
    assert!(want.iter().any(|c| c.starts_with("reload")), "{want:?}");
    assert_eq!(calls.0, want);
}

#[test]
fn backward_before_forward_stops_with_a_schedule_error() {
    let p = Program {
        placement: Placement::looped(1, 1),
        microbatches: 1,
        forward_only: false,
        comm: None,
        ranks: vec![vec![
            Instr::Compute(Compute::Bwd(Task::new(0, 0))),
            Instr::Compute(Compute::Fwd(Task::new(0, 0))),
        ]],
        lengths: None,
        p2p_groups: Default::default(),
        buffer_slots: None,
    };
    let watch = Watch::new(1, Duration::from_secs(5));
    assert_eq!(
        run_rank(&p, Rank(0), &mut NoopBackend, &watch, Instant::now()).unwrap_err(),
        Stopped
    );
    let f = watch.failure().unwrap();
    assert_eq!(f.kind, FailureKind::Schedule);
    assert_eq!(
        f.at,
        InstrRef {
            rank: Rank(0),
            index: 0
        }
    );
    assert!(f.report.starts_with("schedule error at rank 0, #0 bwd(stage 0, mb 0): the saved activation of stage 0, mb 0 is not here"), "{}", f.report);
}

/// With a buffer plan (issue #39) the interpreter lands every receive in its slot and holds a
/// sent tensor's slot from its producer to the send's completion: it allocates the plan's
/// pool up front, never finds a slot taken, and holds at most as many at once as the plan
/// has; the plan's count is the most messages live at once, which the run reaches.
#[test]
fn runs_use_the_plans_slots() {
    use pipec_compiler::compile::{compile_verified, CompileRequest};
    for (k, vpp) in [
        (ScheduleKind::OneFOneB, None),
        (ScheduleKind::ZbV, None),
        (ScheduleKind::Interleaved1F1B, Some(2)),
    ] {
        let req = CompileRequest {
            vpp,
            buffer_plan: true,
            ..CompileRequest::new(k, 4, 8)
        };
        let built = compile_verified(&req, &pipec_cost::cost::CostModel::default(), None).unwrap();
        let p = built.verified.program();
        let pools = p.buffer_slots.as_ref().unwrap();
        let watch = Watch::new(4, Duration::from_secs(5));
        for r in 0..4u32 {
            let run = run_rank(p, Rank(r), &mut NoopBackend, &watch, Instant::now()).unwrap();
            let n = pools.rank(r as usize).len() as u32;
            assert_eq!(run.buffer_slots, Some((n, n)), "{k} rank {r}");
        }
    }
    // Without a plan, no pool.
    let p = program(ScheduleKind::OneFOneB, 2, 1, 2);
    let watch = Watch::new(2, Duration::from_secs(5));
    let run = run_rank(&p, Rank(0), &mut NoopBackend, &watch, Instant::now()).unwrap();
    assert_eq!(run.buffer_slots, None);
}
