//! The step driver (`pipec_runtime::driver`) on lowered programs: bitwise checks under both
//! clocks, hangs, panics and ranks that cannot open.

//! The driver's failure paths, on the CPU backend with a fault injected where a device
//! could fail: every rank stops, the first failure is the report, nothing waits for ever.
use pipec_ir::ir::Instr;
use pipec_runtime::backend::cpu::{CpuBackend, CpuTensor};
use pipec_runtime::backend::{Backend, BackendError};
use pipec_runtime::backend::{CommError, CommOp};
use pipec_runtime::driver::*;
use pipec_runtime::error::RunError;
use pipec_runtime::interp::RankRun;
use pipec_runtime::report::{CheckSummary, RunOptions, RunReport};
use pipec_runtime::transport::Transport;
use pipec_runtime::watchdog::{Failure, FailureKind, Watch};
use pipec_schedules::layout::Layout;
use pipec_schedules::{generate, Limits, ScheduleKind, ScheduleSpec};
use pipec_schedules::{Rank, Task};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

#[derive(Copy, Clone, PartialEq, Eq)]
enum Inject {
    None,
    /// `end_step` of (rank, step) times out.
    Hang(u32, u32),
    /// `losses` of (rank, step) panics.
    Panic(u32, u32),
    /// Opening the rank fails.
    Open(u32),
    /// Steps after the first are replayed (`StepBackend::replay`, as `--cuda-graph` does):
    /// the step's run, losses and sums are the last interpreted step's.
    Replay,
}

/// The CPU device with a fault; `SHARED` picks the clock.
struct Flaky<const SHARED: bool> {
    transport: Arc<Transport<CpuTensor>>,
    inject: Inject,
    /// Forward passes the ranks ran, all steps.
    fwds: Arc<AtomicUsize>,
}

struct FlakyRank {
    be: CpuBackend,
    rank: u32,
    step: u32,
    inject: Inject,
    fwds: Arc<AtomicUsize>,
    /// The last interpreted step's run, which a replay repeats.
    last: Option<RankRun>,
}

impl Backend for FlakyRank {
    type Tensor = CpuTensor;
    type Saved = <CpuBackend as Backend>::Saved;
    type Partial = <CpuBackend as Backend>::Partial;
    /// Never offloads: the trait's refusals.
    type Host = ();
    fn fwd(
        &mut self,
        t: Task,
        i: Option<CpuTensor>,
        save: bool,
    ) -> Result<(CpuTensor, Option<Self::Saved>), BackendError> {
        self.fwds.fetch_add(1, Ordering::Relaxed);
        self.be.fwd(t, i, save)
    }
    fn bwd(
        &mut self,
        t: Task,
        s: Self::Saved,
        g: Option<CpuTensor>,
    ) -> Result<CpuTensor, BackendError> {
        self.be.bwd(t, s, g)
    }
    fn bwd_d(
        &mut self,
        t: Task,
        s: &Self::Saved,
        g: Option<CpuTensor>,
    ) -> Result<(CpuTensor, Self::Partial), BackendError> {
        self.be.bwd_d(t, s, g)
    }
    fn bwd_w(&mut self, t: Task, s: Self::Saved, p: Self::Partial) -> Result<(), BackendError> {
        self.be.bwd_w(t, s, p)
    }
    fn exchange(&mut self, ops: &mut [CommOp<CpuTensor>]) -> Result<(), CommError> {
        self.be.exchange(ops)
    }
    fn post(&mut self, ops: &mut [CommOp<CpuTensor>]) -> Result<(), CommError> {
        self.be.post(ops)
    }
    fn complete(&mut self, ops: &mut [CommOp<CpuTensor>]) -> Result<(), CommError> {
        self.be.complete(ops)
    }
    fn finish(&mut self) {
        self.be.finish()
    }
}

impl StepBackend for FlakyRank {
    type Parked = <CpuBackend as StepBackend>::Parked;
    type Sum = <CpuBackend as StepBackend>::Sum;
    fn begin_step(&mut self, step: u32) -> Result<(), BackendError> {
        self.step = step;
        if self.inject == Inject::Replay && step > 0 {
            // A replay keeps the captured step's bookkeeping (sums in order, losses), as the
            // CUDA backend's graph mode does.
            return Ok(());
        }
        self.be.begin_step(step)
    }
    fn end_step(&mut self, i: &[Instr], run: RankRun, t: Duration) -> Result<RankRun, StepError> {
        if self.inject == Inject::Hang(self.rank, self.step) {
            return Err(StepError::Hang(format!(
                "rank {}: the GPU work hung",
                self.rank
            )));
        }
        let run = self.be.end_step(i, run, t)?;
        self.last = Some(run.clone());
        Ok(run)
    }
    fn replay(&mut self, step: u32, _: Duration) -> Option<Result<RankRun, StepError>> {
        if self.inject != Inject::Replay || step == 0 {
            return None;
        }
        let last = self.last.clone()?;
        Some(Ok(RankRun {
            spans: Vec::new(),
            busy_us: 0.0,
            end_us: 1.0,
            graph: true,
            ..last
        }))
    }
    fn losses(&self, t: Duration) -> Result<Vec<Option<f32>>, BackendError> {
        assert!(
            self.inject != Inject::Panic(self.rank, self.step),
            "injected"
        );
        self.be.losses(t)
    }
    fn grads(&self, copy: bool) -> Result<LocalGrads, BackendError> {
        self.be.grads(copy)
    }
    fn sgd(&mut self, lr: f32) -> Result<(), BackendError> {
        self.be.sgd(lr)
    }
    fn park(&mut self, s: u32) -> Self::Parked {
        self.be.park(s)
    }
    fn absorb(&mut self, s: u32, p: Self::Parked) -> Result<(), BackendError> {
        self.be.absorb(s, p)
    }
    fn sum_copy(&self, s: u32) -> Result<(Self::Sum, u32), BackendError> {
        self.be.sum_copy(s)
    }
    fn replace_sum(&mut self, s: u32, sum: &Self::Sum, n: u32) -> Result<(), BackendError> {
        self.be.replace_sum(s, sum, n)
    }
}

impl<const SHARED: bool> Device for Flaky<SHARED> {
    type Rank = FlakyRank;
    type Plan = ();
    type Worst = ();
    const SHARED_CLOCK: bool = SHARED;
    fn open(&self, rank: u32, (): (), s: &Setup<'_>) -> Result<FlakyRank, String> {
        if self.inject == Inject::Open(rank) {
            return Err(format!("rank {rank}: no such device"));
        }
        let be = CpuBackend::new(
            Rank(rank),
            s.model,
            s.program.microbatches,
            s.full,
            &stages_of(s.program, rank as usize),
            self.transport.clone(),
        );
        Ok(FlakyRank {
            be,
            rank,
            step: 0,
            inject: self.inject,
            fwds: self.fwds.clone(),
            last: None,
        })
    }
    fn reset(&self) {
        self.transport.reset();
    }
    fn compare(&self, c: &StepCheck<'_>) -> Result<(CheckSummary, ()), RunError> {
        pipec_runtime::run::compare(c).map(|s| (s, ()))
    }
}

fn run<const SHARED: bool>(kind: ScheduleKind, inject: Inject) -> Result<RunReport, RunError> {
    run_counting::<SHARED>(kind, inject, &Arc::new(AtomicUsize::new(0)))
}

fn run_counting<const SHARED: bool>(
    kind: ScheduleKind,
    inject: Inject,
    fwds: &Arc<AtomicUsize>,
) -> Result<RunReport, RunError> {
    let program = pipec_compiler::lower::lower(
        &generate(&ScheduleSpec::new(kind, 2, 1, 4), &Limits::DEFAULT).unwrap(),
    );
    let layout = Layout::uniform(program.num_stages());
    let opts = RunOptions {
        steps: 3,
        // A replay repeats step 1's results without computing: nothing to check.
        check: inject != Inject::Replay,
        timeout: Duration::from_secs(10),
        ..RunOptions::default()
    };
    let full = build_model(&layout, &opts.model, "CPU").unwrap();
    let watch = Arc::new(Watch::new(2, opts.timeout));
    let dev = Flaky::<SHARED> {
        transport: Transport::new(2, watch.clone()),
        inject,
        fwds: fwds.clone(),
    };
    let setup = Setup {
        program: &program,
        layout: &layout,
        model: opts.model,
        full: &full,
        watch,
        memory: &pipec_ir::memory::MemoryModel::units(&program),
    };
    drive(setup, &opts, &dev, vec![(0, ()), (1, ())], false).map(|(r, _)| r)
}

fn failure(r: Result<RunReport, RunError>) -> Failure {
    match r {
        Err(RunError::Failed(f)) => f,
        other => panic!("expected a failure, got {other:?}"),
    }
}

/// Both clocks give the reference's results bitwise, DualPipe's replicas included.
#[test]
fn both_clocks_check_bitwise() {
    for kind in [ScheduleKind::OneFOneB, ScheduleKind::DualPipe] {
        for r in [
            run::<true>(kind, Inject::None),
            run::<false>(kind, Inject::None),
        ] {
            let r = r.unwrap();
            assert_eq!(r.steps.len(), 3);
            assert!(r.steps.iter().all(|s| s.check.is_some()));
            assert!(r.timeline.ranks.iter().all(|s| !s.is_empty()));
        }
    }
}

/// A step that does not end on one rank in a later step is a hang at its last
/// instruction; the other rank, already waiting for the next step, stops.
#[test]
fn a_device_hang_in_a_later_step_stops_every_rank() {
    let f = failure(run::<false>(ScheduleKind::OneFOneB, Inject::Hang(1, 1)));
    assert_eq!(f.kind, FailureKind::Hang);
    assert_eq!(f.at.rank, Rank(1));
    assert!(f.report.contains("the GPU work hung"), "{}", f.report);
}

#[test]
fn a_panicking_rank_is_reported_and_nothing_waits_for_it() {
    for kind in [ScheduleKind::OneFOneB, ScheduleKind::DualPipe] {
        let f = failure(run::<true>(kind, Inject::Panic(0, 2)));
        assert_eq!(f.report, "rank 0 panicked (a bug in pipec-run)");
    }
}

#[test]
fn a_rank_that_cannot_open_is_reported() {
    let f = failure(run::<true>(ScheduleKind::OneFOneB, Inject::Open(1)));
    assert_eq!((f.kind, f.at.rank), (FailureKind::Compute, Rank(1)));
    assert_eq!(f.report, "rank 1: no such device");
}

/// The replay hook (`StepBackend::replay`, what `pipec-run --cuda-graph` uses): a replayed step
/// runs no interpreter (no forward after step 1), is reported as a graph step with the
/// backend's time, and the report's timeline stays step 1's, the last with per-instruction
/// spans.
#[test]
fn replayed_steps_skip_the_interpreter_and_keep_the_last_timeline() {
    let plain = Arc::new(AtomicUsize::new(0));
    let interpreted = run_counting::<false>(ScheduleKind::OneFOneB, Inject::None, &plain).unwrap();
    let fwds = Arc::new(AtomicUsize::new(0));
    let r = run_counting::<false>(ScheduleKind::OneFOneB, Inject::Replay, &fwds).unwrap();
    // 1F1B, pp = 2, M = 4: 8 forwards a step; three steps interpreted, one here.
    assert_eq!(plain.load(Ordering::Relaxed), 3 * 8);
    assert_eq!(fwds.load(Ordering::Relaxed), 8);
    let graph: Vec<bool> = r.steps.iter().map(|s| s.graph).collect();
    assert_eq!(graph, [false, true, true]);
    assert!(r.steps[1..].iter().all(|s| s.wall_us == 1.0));
    // The replays report step 1's losses, and the timeline is step 1's.
    assert_eq!(r.steps[1].loss, r.steps[0].loss);
    assert_eq!(r.steps[0].loss, interpreted.steps[0].loss);
    assert!(r.timeline.ranks.iter().all(|s| !s.is_empty()));
    assert!(interpreted.steps.iter().all(|s| !s.graph));
}
