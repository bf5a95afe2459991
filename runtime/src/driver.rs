//! The step driver, written once for every device. One thread per rank of this process lives
//! for the whole run and does each step on its own backend: [`StepBackend::begin_step`],
//! [`run_rank`](crate::interp::run_rank), [`StepBackend::end_step`] under the timeout, the losses, DualPipe's replica
//! reduction, the gradients and SGD. The driver thread takes the ranks' results, checks them
//! against the single-thread [`reference`](mod@reference), writes the report, and only then releases the
//! next step, so the reference never runs during a measured step.
//!
//! What varies per device, and why:
//! - where a rank's backend lives and how it reaches its peers ([`Device::open`]): the CPU's
//!   and a single-process GPU run's through the in-process [`crate::transport::Transport`], a multi-process
//!   launch's through NCCL with one rank per process. Backends are built on their own thread
//!   because a CUDA backend (NCCL communicator) is not `Send`;
//! - how a step ends and is timed ([`StepBackend::end_step`], [`Device::SHARED_CLOCK`]): the
//!   CPU's work is done when the interpreter returns and its host spans, from one origin shared
//!   by every rank, are the measurement; a GPU's work is only enqueued, so the rank waits for
//!   its streams under the timeout and CUDA events replace the host spans;
//! - how replicas of a stage sum their gradients ([`StepBackend::park`] and the rest): host
//!   arrays, or device copies across GPUs; the protocol (three rounds of a barrier of the rank threads) is here;
//! - how the check compares ([`Device::compare`]): bitwise on the CPU (the same order of sums
//!   as the reference), normwise on a GPU (cuBLAS sums in another order, bf16 rounds).

use crate::backend::{Backend, BackendError};
use crate::error::RunError;
use crate::interp::{run_rank_scaled, static_peak_activations, RankRun};
use crate::model::{self, ModelConfig, Stage, StageGrads};
use crate::reference;
use crate::report::{CheckSummary, RankStats, RunOptions, RunReport, StepReport};
use crate::trace;
use crate::watchdog::{Failure, FailureKind, Watch};
use pipec_ir::files::MANIFEST_FILE;
use pipec_ir::ir::{Instr, InstrRef, Program};
use pipec_ir::memory::MemoryModel;
use pipec_schedules::layout::Layout;
use pipec_schedules::{Rank, Task};
use std::sync::{mpsc, Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// How a step failed to end on a device.
#[derive(Debug)]
pub enum StepError {
    /// The step's work did not finish within the timeout (reported as a hang).
    Hang(String),
    Backend(BackendError),
}

impl From<BackendError> for StepError {
    fn from(e: BackendError) -> Self {
        StepError::Backend(e)
    }
}

/// (stage, microbatches summed in order, the sum as host arrays when asked for) per stage.
pub type LocalGrads = Vec<(u32, u32, Option<StageGrads<f32>>)>;

/// A run's report and, per step, the check's extra finding ([`Device::Worst`]).
pub(crate) type Driven<W> = (RunReport, Vec<Option<W>>);

/// What the driver asks of one rank's backend beyond the interpreter's [`Backend`]. Called on
/// the rank's own thread.
pub trait StepBackend: Backend {
    /// One replica's gradients of a stage that it could not sum in order (another replica ran
    /// the earlier microbatches), handed to the replica that sums them.
    type Parked: Send;
    /// A copy of a stage's reduced gradient sum, handed back to the other replicas.
    type Sum: Send;

    /// Make the device current on this thread (CUDA binds its context): before each step and
    /// after the replica exchange, which may have touched another GPU.
    fn bind(&self) -> Result<(), BackendError> {
        Ok(())
    }
    /// Zero the gradient sums and forget the losses and timings of the last step.
    fn begin_step(&mut self, step: u32) -> Result<(), BackendError>;
    /// After [`run_rank`](crate::interp::run_rank): wait for the step's work and return what was measured (`run`, the
    /// host's, or the device's own).
    fn end_step(
        &mut self,
        instrs: &[Instr],
        run: RankRun,
        timeout: Duration,
    ) -> Result<RankRun, StepError>;
    /// Run step `step` without the interpreter, when the backend can (a CUDA graph replaying
    /// a captured step): what it measured, or `None` to run the program as usual.
    fn replay(&mut self, _step: u32, _timeout: Duration) -> Option<Result<RankRun, StepError>> {
        None
    }
    /// The step's loss of every microbatch this rank knows, by microbatch.
    fn losses(&self, timeout: Duration) -> Result<Vec<Option<f32>>, BackendError>;
    /// The step's gradient sums of the local stages; a backend may return none when `copy` is
    /// false (reading them costs).
    fn grads(&self, copy: bool) -> Result<LocalGrads, BackendError>;
    fn sgd(&mut self, lr: f32) -> Result<(), BackendError>;
    /// Take the gradients of `stage` this replica holds out of order.
    fn park(&mut self, stage: u32) -> Self::Parked;
    /// Add another replica's parked gradients of `stage`, in microbatch order.
    fn absorb(&mut self, stage: u32, parked: Self::Parked) -> Result<(), BackendError>;
    /// A copy of `stage`'s gradient sum and how many microbatches it holds in order.
    fn sum_copy(&self, stage: u32) -> Result<(Self::Sum, u32), BackendError>;
    /// Make `stage`'s sum the reduced one, so every replica applies the same update.
    fn replace_sum(&mut self, stage: u32, sum: &Self::Sum, next: u32) -> Result<(), BackendError>;
}

/// What the driver runs on, shared by the rank threads of this process.
pub trait Device: Sync {
    type Rank: StepBackend;
    /// What one rank thread needs to open its backend (its GPU, its network).
    type Plan: Send;
    /// What the check reports beyond [`CheckSummary`] (the normwise check's worst tensor).
    type Worst: Send;
    /// Every rank's clock starts at one host instant, once all ranks are ready, so spans share
    /// an origin and thread start-up is not idle time (the CPU). Otherwise each rank starts
    /// its own (a GPU, whose events are timed from the rank's own origin event).
    const SHARED_CLOCK: bool;

    /// Open `rank`'s backend on its thread; `Err` is the failure's report.
    fn open(&self, rank: u32, plan: Self::Plan, setup: &Setup<'_>) -> Result<Self::Rank, String>;
    /// Reset what the ranks of this process share between steps (the in-process transport);
    /// no rank runs meanwhile.
    fn reset(&self);
    /// Compare a step with the reference; the gradients of stages not in `c.mine` are not
    /// compared (another process holds them).
    fn compare(&self, c: &StepCheck<'_>) -> Result<(CheckSummary, Self::Worst), RunError>;
}

/// One step as this process ran it, beside the reference's: what [`Device::compare`] judges.
#[derive(Clone, Copy)]
pub struct StepCheck<'a> {
    pub step: u32,
    /// Per microbatch, then the step's.
    pub losses: &'a [f32],
    pub loss: f32,
    /// Per stage, `None` where this process holds none.
    pub grads: &'a [Option<&'a StageGrads<f32>>],
    /// The stages whose gradients this process compares.
    pub mine: &'a [bool],
    pub r: &'a reference::RefStep,
    pub model: &'a [Stage<f32>],
}

/// What every rank thread opens its backend from.
pub struct Setup<'a> {
    pub program: &'a Program,
    pub layout: &'a Layout,
    pub model: ModelConfig,
    /// The whole model as the CPU builds it; each rank takes its stages.
    pub full: &'a [Stage<f32>],
    pub watch: Arc<Watch>,
    /// The weights the interpreter meters its stores in, the verifier's
    /// ([`pipec_cost::memory::weights`] of the layout and the cost model the schedule records).
    pub memory: &'a MemoryModel,
}

/// Refuse a layout whose stage count is not the program's.
pub fn check_layout(program: &Program, layout: &Layout) -> Result<(), RunError> {
    if layout.num_stages() != program.num_stages() {
        return Err(RunError::Refused {
            file: MANIFEST_FILE.into(),
            field: "layout".into(),
            msg: format!(
                "the layout has {} stages, the program {}",
                layout.num_stages(),
                program.num_stages()
            ),
        });
    }
    Ok(())
}

/// The whole model of `layout`, or a refusal naming the backend (`CPU`, `CUDA`).
pub fn build_model(
    layout: &Layout,
    cfg: &ModelConfig,
    backend: &str,
) -> Result<Vec<Stage<f32>>, RunError> {
    model::build(layout, cfg).map_err(|e| RunError::Refused {
        file: MANIFEST_FILE.into(),
        field: "layout".into(),
        msg: format!("the {backend} backend's model cannot run it: {e}"),
    })
}

/// The global stages a rank runs compute ops of.
pub fn stages_of(program: &Program, rank: usize) -> Vec<u32> {
    let mut v: Vec<u32> = program.ranks[rank]
        .iter()
        .filter_map(Instr::as_compute)
        .flat_map(|c| c.parts().map(|(_, t)| t.stage.0))
        .collect();
    v.sort_unstable();
    v.dedup();
    v
}

/// A stage that runs on more than one rank, and who sums its gradients.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Replicated {
    pub stage: u32,
    /// The rank that runs microbatch 0: it absorbs the others' gradients in microbatch order.
    pub first: u32,
    /// The other ranks holding a copy, ascending.
    pub others: Vec<u32>,
}

/// Every stage whose microbatches run on more than one rank (DualPipe's two directions).
pub fn replicated_stages(program: &Program) -> Vec<Replicated> {
    let placement = &program.placement;
    (0..program.num_stages())
        .filter_map(|s| {
            let first = placement.rank_of(Task::new(s, 0)).0;
            let mut others: Vec<u32> = (0..program.microbatches)
                .map(|mb| placement.rank_of(Task::new(s, mb)).0)
                .filter(|&r| r != first)
                .collect();
            others.sort_unstable();
            others.dedup();
            (!others.is_empty()).then_some(Replicated {
                stage: s,
                first,
                others,
            })
        })
        .collect()
}

/// Every microbatch's loss of a step, or a check error naming the first one no rank computed.
fn complete_losses(step: u32, losses: Vec<Option<f32>>) -> Result<Vec<f32>, RunError> {
    losses
        .into_iter()
        .enumerate()
        .map(|(mb, l)| {
            l.ok_or_else(|| RunError::Check {
                step,
                msg: format!("no loss was computed for mb {mb}"),
            })
        })
        .collect()
}

/// A barrier of the rank threads that can be broken (a failing rank, or the driver, breaks
/// it so that no thread waits for a rank that will not come), and the driver's release of
/// each step.
struct Gate {
    n: usize,
    st: Mutex<GateState>,
    cv: Condvar,
}

struct GateState {
    arrived: usize,
    round: u64,
    broken: bool,
    /// The last step the ranks may start.
    released: u32,
}

struct Broken;

impl Gate {
    fn new(n: usize) -> Self {
        Gate {
            n,
            st: Mutex::new(GateState {
                arrived: 0,
                round: 0,
                broken: false,
                released: 0,
            }),
            cv: Condvar::new(),
        }
    }

    fn wait(&self) -> Result<(), Broken> {
        let mut g = lock(&self.st);
        if g.broken {
            return Err(Broken);
        }
        g.arrived += 1;
        if g.arrived == self.n {
            g.arrived = 0;
            g.round += 1;
            self.cv.notify_all();
            return Ok(());
        }
        let round = g.round;
        while g.round == round && !g.broken {
            g = self.cv.wait(g).unwrap_or_else(|e| e.into_inner());
        }
        if g.round == round {
            Err(Broken)
        } else {
            Ok(())
        }
    }

    /// Wait until the driver releases `step`.
    fn started(&self, step: u32) -> Result<(), Broken> {
        let mut g = lock(&self.st);
        while g.released < step && !g.broken {
            g = self.cv.wait(g).unwrap_or_else(|e| e.into_inner());
        }
        if g.broken {
            Err(Broken)
        } else {
            Ok(())
        }
    }

    fn release(&self, step: u32) {
        lock(&self.st).released = step;
        self.cv.notify_all();
    }

    fn break_(&self) {
        lock(&self.st).broken = true;
        self.cv.notify_all();
    }
}

fn lock<X>(m: &Mutex<X>) -> MutexGuard<'_, X> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// One rank's results of one step, sent to the driver.
struct StepOut {
    rank: u32,
    run: RankRun,
    losses: Vec<Option<f32>>,
    grads: LocalGrads,
}

/// What the rank threads share.
struct Shared<'a, D: Device> {
    setup: Setup<'a>,
    opts: &'a RunOptions,
    device: &'a D,
    gate: Gate,
    /// The step's common origin under [`Device::SHARED_CLOCK`]; the first rank sets it.
    origin: Mutex<Option<Instant>>,
    /// Stages held by several ranks (DualPipe), whose gradients are summed after each step.
    replicated: Vec<Replicated>,
}

/// Where the rank threads of one process hand each other a replicated stage's gradients.
struct Mailbox<B: StepBackend> {
    /// (stage, one replica's parked gradients), for the rank that sums them.
    parked: Mutex<Vec<(u32, B::Parked)>>,
    /// (stage, the reduced sum, microbatches in it), for the other replicas.
    sums: Mutex<Vec<(u32, B::Sum, u32)>>,
}

/// A failure of a rank's step: its kind and report; an empty report means the failure is
/// already in the watch (the interpreter's, or another rank's).
type Fault = (FailureKind, String);

fn stopped() -> Fault {
    (FailureKind::Compute, String::new())
}

/// DualPipe's post-step gradient all-reduce between the copies of a stage, in one process:
/// each other replica hands over the gradients it could not add in order, the rank that ran
/// microbatch 0 adds them in microbatch order (so the sum equals the reference's, bitwise on
/// the CPU), then every replica takes a copy of the sum. Three gate rounds; the first owner
/// frees its published copies after the last.
fn reduce_replicas<D: Device>(
    sh: &Shared<'_, D>,
    mail: &Mailbox<D::Rank>,
    rank: u32,
    be: &mut D::Rank,
) -> Result<(), Fault> {
    let c = |e: BackendError| (FailureKind::Compute, format!("rank {rank}: {e}"));
    let round = || sh.gate.wait().map_err(|_| stopped());
    for r in sh.replicated.iter().filter(|r| r.others.contains(&rank)) {
        let g = be.park(r.stage);
        lock(&mail.parked).push((r.stage, g));
    }
    round()?;
    for r in sh.replicated.iter().filter(|r| r.first == rank) {
        let theirs: Vec<_> = {
            let mut p = lock(&mail.parked);
            let (mine, rest) = std::mem::take(&mut *p)
                .into_iter()
                .partition(|(s, _)| *s == r.stage);
            *p = rest;
            mine
        };
        for (_, g) in theirs {
            be.absorb(r.stage, g).map_err(c)?;
        }
        let (sum, next) = be.sum_copy(r.stage).map_err(c)?;
        lock(&mail.sums).push((r.stage, sum, next));
    }
    round()?;
    for r in sh.replicated.iter().filter(|r| r.others.contains(&rank)) {
        let sums = lock(&mail.sums);
        let Some((_, sum, next)) = sums.iter().find(|x| x.0 == r.stage) else {
            return Err(c(BackendError(format!(
                "no reduced gradients of stage {} from rank {}",
                r.stage, r.first
            ))));
        };
        be.replace_sum(r.stage, sum, *next).map_err(c)?;
    }
    round()?;
    for r in sh.replicated.iter().filter(|r| r.first == rank) {
        lock(&mail.sums).retain(|x| x.0 != r.stage);
    }
    be.bind().map_err(c)?;
    Ok(())
}

fn compute_failure(rank: u32, index: u32, report: String) -> Failure {
    Failure {
        kind: FailureKind::Compute,
        at: InstrRef {
            rank: Rank(rank),
            index,
        },
        report,
    }
}

/// Fails the run if a rank thread panics, so no peer waits for it until the timeout.
struct PanicGuard<'a> {
    watch: &'a Watch,
    gate: &'a Gate,
    rank: Rank,
}

impl Drop for PanicGuard<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.watch.fail(compute_failure(
                self.rank.0,
                0,
                format!("{} panicked (a bug in pipec-run)", self.rank),
            ));
            self.gate.break_();
        }
    }
}

/// One rank's step on its own thread.
fn rank_step<D: Device>(
    sh: &Shared<'_, D>,
    mail: &Mailbox<D::Rank>,
    rank: u32,
    step: u32,
    be: &mut D::Rank,
) -> Result<StepOut, Fault> {
    let (program, opts) = (sh.setup.program, sh.opts);
    let c = |e: BackendError| (FailureKind::Compute, format!("rank {rank}: {e}"));
    be.bind().map_err(c)?;
    be.begin_step(step).map_err(c)?;
    let t0 = if D::SHARED_CLOCK {
        sh.gate.wait().map_err(|_| stopped())?;
        *lock(&sh.origin).get_or_insert_with(Instant::now)
    } else {
        Instant::now()
    };
    let ended = |e| match e {
        StepError::Hang(msg) => (FailureKind::Hang, msg),
        StepError::Backend(e) => c(e),
    };
    let run = match be.replay(step, opts.timeout) {
        Some(r) => r.map_err(ended)?,
        None => {
            // With microbatch lengths each microbatch's activations weigh its stage's `act`
            // times its factor (tokens / `seq`), and from `bwd_D` to `bwd_W` its `act_w`, as
            // the verifier counts.
            let run = run_rank_scaled(
                program,
                Rank(rank),
                be,
                &sh.setup.watch,
                t0,
                sh.setup.memory,
            )
            .map_err(|_| stopped())?;
            be.end_step(&program.ranks[rank as usize], run, opts.timeout)
                .map_err(ended)?
        }
    };
    let losses = be.losses(opts.timeout).map_err(c)?;
    if !program.forward_only && !sh.replicated.is_empty() {
        reduce_replicas(sh, mail, rank, be)?;
    }
    let mut grads = Vec::new();
    if !program.forward_only {
        grads = be.grads(opts.check).map_err(c)?;
        be.sgd(opts.lr).map_err(c)?;
    }
    Ok(StepOut {
        rank,
        run,
        losses,
        grads,
    })
}

/// One rank's whole run on its own thread: open the backend, then every step the driver
/// releases. Errors go to the watch (first failure wins) and break the gate.
fn rank_thread<D: Device>(
    sh: &Shared<'_, D>,
    mail: &Mailbox<D::Rank>,
    rank: u32,
    plan: D::Plan,
    tx: mpsc::Sender<StepOut>,
) {
    let _guard = PanicGuard {
        watch: &sh.setup.watch,
        gate: &sh.gate,
        rank: Rank(rank),
    };
    let fail = |index: u32, kind: FailureKind, report: String| {
        sh.setup.watch.fail(Failure {
            kind,
            at: InstrRef {
                rank: Rank(rank),
                index,
            },
            report,
        });
        sh.gate.break_();
    };
    let mut be = match sh.device.open(rank, plan, &sh.setup) {
        Ok(b) => b,
        Err(report) => return fail(0, FailureKind::Compute, report),
    };
    let last = sh.setup.program.ranks[rank as usize]
        .len()
        .saturating_sub(1) as u32;
    for step in 0..sh.opts.steps {
        if sh.gate.started(step).is_err() {
            return;
        }
        match rank_step(sh, mail, rank, step, &mut be) {
            Ok(out) => {
                if tx.send(out).is_err() {
                    return;
                }
            }
            // Already reported to the watch.
            Err((_, msg)) if msg.is_empty() => {
                sh.gate.break_();
                return;
            }
            Err((kind, msg)) => return fail(last, kind, msg),
        }
    }
}

/// Run every step of `setup.program` on the ranks of `plan` (rank, what it opens with): all
/// of them, or (`partial`) this process's share of a multi-process launch, whose check then
/// covers only its own stages. Returns the report and, per step, the check's extra finding.
pub fn drive<D: Device>(
    setup: Setup<'_>,
    opts: &RunOptions,
    device: &D,
    plan: Vec<(u32, D::Plan)>,
    partial: bool,
) -> Result<Driven<D::Worst>, RunError> {
    let program = setup.program;
    let world = program.ranks.len();
    let watch = setup.watch.clone();
    let mut ref_model = opts.check.then(|| setup.full.to_vec());
    let local: Vec<Vec<u32>> = plan
        .iter()
        .map(|p| stages_of(program, p.0 as usize))
        .collect();
    let mine: Vec<bool> = (0..program.num_stages())
        .map(|s| !partial || local.iter().any(|l| l.contains(&s)))
        .collect();
    let sh = Shared {
        gate: Gate::new(plan.len()),
        replicated: replicated_stages(program),
        setup,
        opts,
        device,
        origin: Mutex::new(None),
    };
    let mail = Mailbox::<D::Rank> {
        parked: Mutex::new(Vec::new()),
        sums: Mutex::new(Vec::new()),
    };
    let n = plan.len();
    let mut steps = Vec::with_capacity(opts.steps as usize);
    let mut worst = Vec::with_capacity(opts.steps as usize);
    let mut traced = Vec::new();
    let mut last: Vec<Option<RankRun>> = vec![None; world];
    let (tx, rx) = mpsc::channel::<StepOut>();
    // `Err(None)`: a rank failed, and the failure is in the watch.
    let outcome: Result<(), Option<RunError>> = std::thread::scope(|s| {
        let threads: Vec<_> = plan
            .into_iter()
            .map(|(rank, plan)| {
                let tx = tx.clone();
                let (sh, mail) = (&sh, &mail);
                std::thread::Builder::new()
                    .name(format!("rank-{rank}"))
                    .spawn_scoped(s, move || rank_thread(sh, mail, rank, plan, tx))
                    .expect("spawn a rank thread")
            })
            .collect();
        drop(tx);
        let res = (|| {
            for step in 0..opts.steps {
                if step > 0 {
                    watch.reset();
                    device.reset();
                    *lock(&sh.origin) = None;
                    sh.gate.release(step);
                }
                let mut outs: Vec<StepOut> = Vec::with_capacity(n);
                while outs.len() < n {
                    // Every thread has ended: a failure is in the watch.
                    outs.push(rx.recv().map_err(|_| None)?);
                }
                outs.sort_by_key(|o| o.rank);
                let (report, w) =
                    finish_step(&sh, step, &mut ref_model, &mine, &outs).map_err(Some)?;
                steps.push(report);
                worst.push(w);
                let runs: Vec<(u32, RankRun)> = outs.into_iter().map(|o| (o.rank, o.run)).collect();
                if opts
                    .trace_steps
                    .is_some_and(|(a, b)| (a..=b).contains(&step))
                {
                    traced.push((step, trace::timeline(world, &runs)));
                }
                for (r, run) in runs {
                    // A graph step has no per-instruction times: the timeline stays the last
                    // step that has them.
                    if !run.graph || last[r as usize].is_none() {
                        last[r as usize] = Some(run);
                    }
                }
            }
            Ok(())
        })();
        if res.is_err() {
            sh.gate.break_();
        }
        // Joined here, not by the scope, which would re-raise a rank's panic: its guard has
        // already filed the report.
        for t in threads {
            let _ = t.join();
        }
        res
    });
    match outcome {
        Ok(()) => {}
        Err(Some(e)) => return Err(e),
        Err(None) => {
            return Err(RunError::Failed(watch.failure().unwrap_or_else(|| {
                compute_failure(0, 0, "a rank stopped without a report".into())
            })))
        }
    }
    let last: Vec<(u32, RankRun)> = last
        .into_iter()
        .enumerate()
        .filter_map(|(r, run)| run.map(|run| (r as u32, run)))
        .collect();
    Ok((
        RunReport {
            steps,
            static_peak_activations: static_peak_activations(program),
            static_memory: pipec_ir::memory::peaks(program, sh.setup.memory),
            memory_unit: sh.setup.memory.unit,
            timeline: trace::timeline(world, &last),
            traced,
        },
        worst,
    ))
}

/// The step's report from every local rank's results, checked against the reference.
#[allow(clippy::type_complexity)]
fn finish_step<D: Device>(
    sh: &Shared<'_, D>,
    step: u32,
    ref_model: &mut Option<Vec<Stage<f32>>>,
    mine: &[bool],
    outs: &[StepOut],
) -> Result<(StepReport, Option<D::Worst>), RunError> {
    let (program, opts) = (sh.setup.program, sh.opts);
    let m = program.microbatches;
    let mut losses: Vec<Option<f32>> = vec![None; m as usize];
    for o in outs {
        for (mb, l) in o.losses.iter().enumerate() {
            if let Some(l) = l {
                losses[mb] = Some(*l);
            }
        }
    }
    let losses = complete_losses(step, losses)?;
    let lengths = program.lengths.as_ref().map(|l| l.all_tokens());
    let loss = model::step_loss_of(&losses, lengths);
    let mut grads: Vec<Option<&StageGrads<f32>>> = vec![None; program.num_stages() as usize];
    for o in outs {
        for (s, done, g) in &o.grads {
            if *done != m {
                return Err(RunError::Check {
                    step,
                    msg: format!(
                        "stage {s} summed the gradients of {done} microbatches in order, not {m}"
                    ),
                });
            }
            grads[*s as usize] = g.as_ref();
        }
    }
    let mut summary = None;
    let mut worst = None;
    if let Some(rm) = ref_model.as_mut() {
        let r = reference::step_with(rm, &opts.model, step, m, program.forward_only, lengths)
            .map_err(|e| RunError::Check {
                step,
                msg: format!("the reference failed: {e}"),
            })?;
        let (sum, w) = sh.device.compare(&StepCheck {
            step,
            losses: &losses,
            loss,
            grads: &grads,
            mine,
            r: &r,
            model: rm,
        })?;
        if !program.forward_only {
            for (st, g) in rm.iter_mut().zip(&r.grads) {
                model::sgd(st, g, opts.lr);
            }
        }
        summary = Some(sum);
        worst = Some(w);
    }
    let wall = outs.iter().map(|o| o.run.end_us).fold(0.0, f64::max);
    let params = |r: u32| {
        sh.setup
            .memory
            .param
            .get(r as usize)
            .copied()
            .unwrap_or(0.0)
    };
    Ok((
        StepReport {
            step,
            loss,
            wall_us: wall,
            ranks: outs
                .iter()
                .map(|o| RankStats {
                    busy_us: o.run.busy_us,
                    idle_us: (wall - o.run.busy_us).max(0.0),
                    peak_activations: o.run.peak_activations,
                    peak_memory: params(o.rank) + o.run.device_peak,
                    host_memory: o.run.host_peak,
                    gpu_peak_bytes: o.run.pool_peak_bytes,
                })
                .collect(),
            check: summary,
            graph: outs.iter().any(|o| o.run.graph),
        },
        worst,
    ))
}
