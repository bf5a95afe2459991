//! [`run_cuda`]: the CUDA step driver, the GPU twin of [`crate::run::run_cpu`].
//!
//! - Single process (no `RANK`/`WORLD_SIZE`): one long-lived thread per rank, rank `r` on GPU
//!   `r % device_count`; several ranks may share a GPU (each with its own streams). Ranks talk
//!   through the in-process rendezvous [`Transport`] and device-to-device copies
//!   ([`super::comm::Net::Local`]). A backend holds an NCCL communicator type and is not
//!   `Send`, so each is created and dropped on its own thread; threads meet at a [`Gate`]
//!   between steps.
//! - Multi-process ([`LaunchEnv`], torchrun or Slurm): this process runs only its rank, on GPU
//!   `LOCAL_RANK % device_count`; rank 0 makes the NCCL unique id and hands it out over
//!   [`launch::Server`] at `MASTER_ADDR:MASTER_PORT` (the next port under torchrun, see
//!   [`launch::AGENT_STORE_ENV`]), then every rank joins with `ncclCommInitRank`. A one-rank
//!   launch (`WORLD_SIZE=1`) needs no NCCL and runs as a single process. A rank's failure
//!   does not reach other processes: they stop at the timeout of their own
//!   [`CudaBackend::sync`].
//!
//! Each step: `begin_step`, [`run_rank`] (which only enqueues GPU work and rendezvous), `sync`
//! under the timeout (a hang is reported like the watchdog's), the measured CUDA-event spans
//! replace the host ones, then SGD. `check`: the single-thread f32 [`reference`] with the same
//! seed, compared normwise (the GPU sums in another order, and bf16 rounds): for each tensor
//! `‖gpu − ref‖₂ / ‖ref‖₂ ≤ tol`, `tol` = 1e-4 in fp32 and 5e-2 in bf16.

use super::device::CudaBackend;
use super::launch::{self, LaunchEnv};
use super::model::{err, ByMicrobatch, Elem, GSums, GTensor};
use super::{comm::Net, probe_libraries};
use crate::backend::BackendError;
use crate::error::RunError;
use crate::interp::{run_rank, static_peak_activations, RankRun};
use crate::model::{self, ModelConfig, Stage, StageGrads};
use crate::reference;
use crate::run::{
    for_each_gradient, replicated_stages, CheckSummary, RankStats, Replicated, RunReport,
    StepReport,
};
use crate::transport::Transport;
use crate::watchdog::{Failure, FailureKind, Watch};
use cudarc::driver::CudaContext;
use pipec::back::files::MANIFEST_FILE;
use pipec::front::layout::Layout;
use pipec::ir::{Instr, InstrRef, Program};
use pipec::simulate::timeline::{Span, TimeUnit, Timeline};
use pipec_schedules::Rank;
use std::sync::{mpsc, Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// Element type of weights and activations on the GPU.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Dtype {
    F32,
    Bf16,
}

impl Dtype {
    pub fn name(self) -> &'static str {
        match self {
            Dtype::F32 => "fp32",
            Dtype::Bf16 => "bf16",
        }
    }

    /// The normwise relative tolerance of `--check`: fp32 differs from the CPU only in the
    /// order of sums (cuBLAS); bf16 keeps 8 bits of mantissa (relative rounding 2^-9 per value,
    /// accumulated over a few GEMMs and kernels).
    pub fn tolerance(self) -> f64 {
        match self {
            Dtype::F32 => 1e-4,
            Dtype::Bf16 => 5e-2,
        }
    }
}

/// What to run and how.
#[derive(Clone, Debug)]
pub struct CudaRunOptions {
    pub model: ModelConfig,
    pub steps: u32,
    pub lr: f32,
    /// How long a rank may wait on a comm batch (single process) or on the step's GPU work.
    pub timeout: Duration,
    /// Compare every step with the single-thread CPU reference (normwise, [`Dtype::tolerance`]).
    pub check: bool,
    pub dtype: Dtype,
    /// `Some`: a multi-process launch, this process runs `launch.rank` only.
    pub launch: Option<LaunchEnv>,
}

/// What a run measured, plus where it ran.
#[derive(Clone, Debug)]
pub struct CudaRunReport {
    /// As [`crate::run::run_cpu`]'s; in multi-process mode `steps[i].ranks` holds this
    /// process's rank only and the timeline's other ranks are empty.
    pub run: RunReport,
    /// The ranks run by this process, in the order of `steps[i].ranks`.
    pub ranks: Vec<u32>,
    /// The GPU ordinal of each of those ranks.
    pub devices: Vec<usize>,
    pub device_count: usize,
    /// Per step, when checked: the largest normwise relative difference and what it was in.
    pub worst: Vec<Option<(f64, String)>>,
    pub dtype: Dtype,
}

/// A barrier that can be broken: a failing rank (or the driver) breaks it so that no thread
/// waits for a rank that will not come.
struct Gate {
    n: usize,
    st: Mutex<(usize, u64, bool)>,
    cv: Condvar,
}

struct Broken;

impl Gate {
    fn new(n: usize) -> Self {
        Gate {
            n,
            st: Mutex::new((0, 0, false)),
            cv: Condvar::new(),
        }
    }

    /// `Ok(true)` for exactly one thread per round (the last to arrive).
    fn wait(&self) -> Result<bool, Broken> {
        let mut g = self.st.lock().unwrap_or_else(|e| e.into_inner());
        if g.2 {
            return Err(Broken);
        }
        g.0 += 1;
        if g.0 == self.n {
            g.0 = 0;
            g.1 += 1;
            self.cv.notify_all();
            return Ok(true);
        }
        let gen = g.1;
        while g.1 == gen && !g.2 {
            g = self.cv.wait(g).unwrap_or_else(|e| e.into_inner());
        }
        if g.1 == gen {
            Err(Broken)
        } else {
            Ok(false)
        }
    }

    fn break_(&self) {
        self.st.lock().unwrap_or_else(|e| e.into_inner()).2 = true;
        self.cv.notify_all();
    }
}

/// One rank's results of one step, sent to the driver.
struct StepOut {
    rank: u32,
    run: RankRun,
    losses: Vec<Option<f32>>,
    grads: Vec<(u32, StageGrads<f32>, u32)>,
}

/// Where a rank thread reports.
struct Shared<'a> {
    program: &'a Program,
    layout: &'a Layout,
    opts: &'a CudaRunOptions,
    full: &'a [Stage<f32>],
    watch: Arc<Watch>,
    gate: Gate,
    /// Stages held by several ranks (DualPipe), whose gradients are summed after each step.
    replicated: Vec<Replicated>,
}

/// Where the rank threads of one process hand each other a replicated stage's gradients.
struct Mailbox<T> {
    /// (stage, that replica's gradients by microbatch), for the rank that sums them.
    parked: Mutex<Vec<(u32, ByMicrobatch<T>)>>,
    /// (stage, the reduced sum, microbatches in it), for the other replicas.
    sums: Mutex<Vec<(u32, GSums, u32)>>,
}

fn lock<X>(m: &Mutex<X>) -> std::sync::MutexGuard<'_, X> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// DualPipe's post-step gradient all-reduce between the copies of a stage, in one process:
/// each other replica hands over the gradients it could not add in order, the rank that ran
/// microbatch 0 adds them in microbatch order (so the sum equals the CPU reference's), then
/// every replica takes a copy of the sum. Three gate rounds; the first owner frees its
/// published copies after the last. `Err` with an empty message: the gate broke (another rank
/// failed and reported).
fn reduce_replicas<T: Elem>(
    sh: &Shared<'_>,
    mail: &Mailbox<T>,
    rank: u32,
    be: &mut CudaBackend<T>,
) -> Result<(), (FailureKind, String)> {
    let c = |e: BackendError| (FailureKind::Compute, format!("rank {rank}: {e}"));
    let round = || {
        sh.gate
            .wait()
            .map(drop)
            .map_err(|_| (FailureKind::Compute, String::new()))
    };
    for r in sh.replicated.iter().filter(|r| r.others.contains(&rank)) {
        let g = be.take_parked(r.stage);
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
    be.ctx
        .bind_to_thread()
        .map_err(err("bind the GPU"))
        .map_err(c)?;
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

/// Fails the run if a rank thread panics, so no peer waits for it.
struct PanicGuard<'a> {
    sh: &'a Shared<'a>,
    rank: u32,
}

impl Drop for PanicGuard<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.sh.watch.fail(compute_failure(
                self.rank,
                0,
                format!("rank {} panicked (a bug in pipec-run)", self.rank),
            ));
            self.sh.gate.break_();
        }
    }
}

/// The global stages a rank runs compute ops of.
fn stages_of(program: &Program, rank: usize) -> Vec<u32> {
    let mut v: Vec<u32> = program.ranks[rank]
        .iter()
        .filter_map(Instr::as_compute)
        .flat_map(|c| c.parts().map(|(_, t)| t.stage.0))
        .collect();
    v.sort_unstable();
    v.dedup();
    v
}

/// The NCCL unique id as the rendezvous payload.
fn id_bytes(id: &cudarc::nccl::Id) -> Vec<u8> {
    id.internal().iter().map(|&c| c as u8).collect()
}

fn id_from(bytes: &[u8]) -> Result<cudarc::nccl::Id, String> {
    let arr: [u8; 128] = bytes
        .try_into()
        .map_err(|_| format!("rank 0 sent a {}-byte NCCL id, not 128", bytes.len()))?;
    Ok(cudarc::nccl::Id::uninit(arr.map(|b| b as std::ffi::c_char)))
}

/// How a rank thread reaches its peers.
enum NetPlan<T: Elem> {
    Local(Arc<Transport<GTensor<T>>>),
    Nccl { id: cudarc::nccl::Id, world: usize },
}

/// One rank's whole run on its own thread: build the backend, then every step between gate
/// rounds. Errors go to the watch (first failure wins) and break the gate.
fn rank_thread<T: Elem>(
    sh: &Shared<'_>,
    mail: &Mailbox<T>,
    rank: u32,
    ordinal: usize,
    net: NetPlan<T>,
    tx: mpsc::Sender<StepOut>,
) {
    let _guard = PanicGuard { sh, rank };
    let fail = |index: u32, kind: FailureKind, report: String| {
        sh.watch.fail(Failure {
            kind,
            at: InstrRef {
                rank: Rank(rank),
                index,
            },
            report,
        });
        sh.gate.break_();
    };
    let (program, opts) = (sh.program, sh.opts);
    let transport = match &net {
        NetPlan::Local(t) => Some(t.clone()),
        NetPlan::Nccl { .. } => None,
    };
    let mine = stages_of(program, rank as usize);
    let be = CudaBackend::<T>::new(
        Rank(rank),
        ordinal,
        opts.model,
        sh.layout,
        program.microbatches,
        sh.full,
        &mine,
        |s| {
            match net {
            NetPlan::Local(t) => Ok(Net::Local(t)),
            NetPlan::Nccl { id, world } => {
                cudarc::nccl::Comm::from_rank(s.clone(), rank as usize, world, id)
                    .map(Net::Nccl)
                    .map_err(|e| {
                        BackendError(format!(
                            "NCCL: ncclCommInitRank: {:?} (NCCL refuses two ranks of one communicator on the same GPU: launch at most one process per GPU; several ranks share a GPU in single-process mode)",
                            e.0
                        ))
                    })
            }
        }
        },
        sh.watch.clone(),
    );
    let mut be = match be {
        Ok(b) => b,
        Err(e) => {
            return fail(
                0,
                FailureKind::Compute,
                format!("rank {rank} on GPU {ordinal}: {e}"),
            )
        }
    };
    let last = program.ranks[rank as usize].len().saturating_sub(1) as u32;
    for step in 0..opts.steps {
        // Round 1: everyone is done with the previous step; the last to arrive resets the
        // shared state. Round 2: nobody starts before the reset.
        match sh.gate.wait() {
            Ok(true) if step > 0 => {
                if let Some(t) = &transport {
                    t.reset();
                }
                sh.watch.reset();
            }
            Ok(_) => {}
            Err(Broken) => return,
        }
        if sh.gate.wait().is_err() {
            return;
        }
        let res = (|| -> Result<StepOut, (FailureKind, String)> {
            let c = |e: BackendError| (FailureKind::Compute, format!("rank {rank}: {e}"));
            be.ctx
                .bind_to_thread()
                .map_err(err("bind the GPU"))
                .map_err(c)?;
            be.begin_step(step).map_err(c)?;
            let t0 = Instant::now();
            let run = run_rank(program, Rank(rank), &mut be, &sh.watch, t0)
                .map_err(|_| (FailureKind::Compute, String::new()))?;
            be.sync(opts.timeout)
                .map_err(|e| (FailureKind::Hang, e.0))?;
            let spans = be.spans().map_err(c)?;
            let instrs = &program.ranks[rank as usize];
            if spans.len() != instrs.len() {
                return Err(c(BackendError(format!(
                    "{} event spans for {} instructions",
                    spans.len(),
                    instrs.len()
                ))));
            }
            let busy = instrs
                .iter()
                .zip(&spans)
                .filter(|(i, _)| matches!(i, Instr::Compute(_)))
                .map(|(_, s)| s.end - s.start)
                .sum();
            let end = spans.iter().map(|s| s.end).fold(0.0, f64::max);
            let losses = be.all_losses(opts.timeout).map_err(c)?;
            if !program.forward_only && !sh.replicated.is_empty() {
                reduce_replicas(sh, mail, rank, &mut be)?;
            }
            let grads = if opts.check && !program.forward_only {
                be.grads().map_err(c)?
            } else {
                Vec::new()
            };
            if !program.forward_only {
                be.sgd(opts.lr).map_err(c)?;
            }
            Ok(StepOut {
                rank,
                run: RankRun {
                    spans,
                    busy_us: busy,
                    end_us: end,
                    peak_activations: run.peak_activations,
                },
                losses,
                grads,
            })
        })();
        match res {
            Ok(out) => {
                if tx.send(out).is_err() {
                    return;
                }
            }
            // run_rank already reported to the watch.
            Err((_, msg)) if msg.is_empty() => {
                sh.gate.break_();
                return;
            }
            Err((kind, msg)) => return fail(last, kind, msg),
        }
    }
}

/// Run `program` on GPUs; see the module doc for the two modes.
pub fn run_cuda(
    program: &Program,
    layout: &Layout,
    opts: &CudaRunOptions,
) -> Result<CudaRunReport, RunError> {
    if opts.steps == 0 {
        return Err(RunError::ZeroSteps);
    }
    let world = program.ranks.len();
    if let Some(l) = &opts.launch {
        if l.world_size as usize != world {
            return Err(RunError::Refused {
                file: MANIFEST_FILE.into(),
                field: "world_size".into(),
                msg: format!(
                    "the schedule has {world} ranks, the launch has {} ({} = {} of WORLD_SIZE = {})",
                    l.world_size, l.from, l.rank, l.world_size
                ),
            });
        }
    }
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
    let multi = opts.launch.as_ref().is_some_and(|l| l.world_size > 1);
    if multi {
        if let Some(r) = replicated_stages(program).first() {
            // DualPipe's copies of a stage must sum their gradients after each step, a
            // cross-process all-reduce this mode does not run: each copy would step on half.
            return Err(RunError::Refused {
                file: MANIFEST_FILE.into(),
                field: "placement".into(),
                msg: format!(
                    "stage {} runs on ranks {} and {} (DualPipe's two directions): their \
                     gradients are summed after each step only in one process; run it \
                     without a launcher or on the cpu backend",
                    r.stage,
                    r.first,
                    r.others
                        .iter()
                        .map(u32::to_string)
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            });
        }
        if let Some((r, i)) = first_wait(program) {
            // torch's `ProcessGroupNCCL` runs one pair's P2P ops on that pair's own stream,
            // the order the verifier proves (D2); this backend has one communicator and one
            // comm stream per rank, where an op left in flight would also hold back the ops to
            // every other peer: an order nothing has checked, so a possible hang.
            return Err(RunError::Refused {
                file: MANIFEST_FILE.into(),
                field: "schedule".into(),
                msg: format!(
                    "{}: the schedule leaves comm batches in flight (`wait` instructions, e.g. \
                     Megatron's overlap P2P mode), which the CUDA backend runs only in one \
                     process (its NCCL mode has one stream per rank, not one per pair of \
                     ranks); run it without a launcher or on the cpu backend",
                    crate::interp::describe_instr(program, Rank(r as u32), i as u32)
                ),
            });
        }
    }
    probe_libraries(multi).map_err(|e| RunError::Device(e.to_string()))?;
    let count = CudaContext::device_count()
        .map_err(|e| RunError::Device(format!("CUDA: cannot count the GPUs: {e:?}")))?;
    if count <= 0 {
        return Err(RunError::Device(
            "CUDA: the driver loads but reports no GPU".into(),
        ));
    }
    let count = count as usize;
    match opts.dtype {
        Dtype::F32 => run_typed::<f32>(program, layout, opts, count),
        Dtype::Bf16 => run_typed::<half::bf16>(program, layout, opts, count),
    }
}

/// The first `wait` instruction, as (rank, index).
fn first_wait(program: &Program) -> Option<(usize, usize)> {
    program.ranks.iter().enumerate().find_map(|(r, instrs)| {
        instrs
            .iter()
            .position(|i| matches!(i, Instr::Wait { .. }))
            .map(|i| (r, i))
    })
}

fn run_typed<T: Elem>(
    program: &Program,
    layout: &Layout,
    opts: &CudaRunOptions,
    count: usize,
) -> Result<CudaRunReport, RunError> {
    let world = program.ranks.len();
    let full: Vec<Stage<f32>> =
        model::build(layout, &opts.model).map_err(|e| RunError::Refused {
            file: MANIFEST_FILE.into(),
            field: "layout".into(),
            msg: format!("the CUDA backend's model cannot run it: {e}"),
        })?;
    let watch = Arc::new(Watch::new(world, opts.timeout));
    // (rank, GPU, network) of each thread of this process.
    let plan: Vec<(u32, usize, NetPlan<T>)> = match &opts.launch {
        None => {
            let t = Transport::<GTensor<T>>::new(world, watch.clone());
            (0..world as u32)
                .map(|r| (r, r as usize % count, NetPlan::Local(t.clone())))
                .collect()
        }
        // `RANK=0 WORLD_SIZE=1`: nobody to talk to. NCCL is neither probed for this launch
        // (`probe_libraries(multi)`) nor linked by `pipec-run`'s re-exec, and cudarc panics
        // when `ncclGetUniqueId` cannot load it (`nccl::sys::culib`), so do not touch NCCL.
        Some(l) if l.world_size == 1 => vec![(
            l.rank,
            l.local_rank as usize % count,
            NetPlan::Local(Transport::<GTensor<T>>::new(world, watch.clone())),
        )],
        Some(l) => {
            let ordinal = l.local_rank as usize % count;
            // The rendezvous gets the whole timeout of a step and at least a minute: the
            // other processes may still be starting.
            let rv_timeout = opts.timeout.max(Duration::from_secs(60));
            let id = if l.rank == 0 {
                let id = cudarc::nccl::Id::new()
                    .map_err(|e| RunError::Device(format!("NCCL: ncclGetUniqueId: {:?}", e.0)))?;
                let server = launch::Server::bind(&format!("0.0.0.0:{}", l.master_port))
                    .map_err(|e| RunError::Launch(e.to_string()))?;
                server
                    .serve(l.world_size, &id_bytes(&id), rv_timeout)
                    .map_err(|e| RunError::Launch(e.to_string()))?;
                id
            } else {
                let bytes = launch::fetch(&l.master(), l.rank, l.world_size, rv_timeout)
                    .map_err(|e| RunError::Launch(e.to_string()))?;
                id_from(&bytes).map_err(RunError::Launch)?
            };
            vec![(l.rank, ordinal, NetPlan::Nccl { id, world })]
        }
    };
    let mut ref_model = opts.check.then(|| full.clone());
    let mail = Mailbox::<T> {
        parked: Mutex::new(Vec::new()),
        sums: Mutex::new(Vec::new()),
    };
    let sh = Shared {
        program,
        layout,
        opts,
        full: &full,
        watch: watch.clone(),
        gate: Gate::new(plan.len()),
        replicated: replicated_stages(program),
    };
    let ranks: Vec<u32> = plan.iter().map(|p| p.0).collect();
    let devices: Vec<usize> = plan.iter().map(|p| p.1).collect();
    let static_peak = static_peak_activations(program);
    let mut steps = Vec::with_capacity(opts.steps as usize);
    let mut worst = Vec::with_capacity(opts.steps as usize);
    let mut last: Vec<Option<RankRun>> = vec![None; world];
    let (tx, rx) = mpsc::channel::<StepOut>();
    let outcome: Result<(), RunError> = std::thread::scope(|s| {
        for (rank, ordinal, net) in plan {
            let tx = tx.clone();
            let (sh, mail) = (&sh, &mail);
            std::thread::Builder::new()
                .name(format!("rank-{rank}"))
                .spawn_scoped(s, move || {
                    rank_thread::<T>(sh, mail, rank, ordinal, net, tx)
                })
                .expect("spawn a rank thread");
        }
        drop(tx);
        for step in 0..opts.steps {
            let mut outs: Vec<StepOut> = Vec::with_capacity(ranks.len());
            while outs.len() < ranks.len() {
                match rx.recv() {
                    Ok(o) => outs.push(o),
                    // Every thread has ended: a failure is in the watch.
                    Err(_) => {
                        return Err(RunError::Failed(watch.failure().unwrap_or_else(|| {
                            compute_failure(0, 0, "a rank stopped without a report".into())
                        })))
                    }
                }
            }
            outs.sort_by_key(|o| o.rank);
            match finish_step(program, opts, step, &mut ref_model, &outs) {
                Ok((report, w)) => {
                    steps.push(report);
                    worst.push(w);
                }
                Err(e) => {
                    sh.gate.break_();
                    return Err(e);
                }
            }
            for o in outs {
                let r = o.rank as usize;
                last[r] = Some(o.run);
            }
        }
        Ok(())
    });
    outcome?;
    Ok(CudaRunReport {
        run: RunReport {
            steps,
            static_peak_activations: static_peak,
            timeline: Timeline {
                unit: TimeUnit::Micros,
                ranks: last
                    .into_iter()
                    .map(|r| r.map(|r| r.spans).unwrap_or_default())
                    .collect::<Vec<Vec<Span>>>(),
            },
            traced: Vec::new(),
        },
        ranks,
        devices,
        device_count: count,
        worst,
        dtype: opts.dtype,
    })
}

/// The step's report from every local rank's results, checked against the reference.
fn finish_step(
    program: &Program,
    opts: &CudaRunOptions,
    step: u32,
    ref_model: &mut Option<Vec<Stage<f32>>>,
    outs: &[StepOut],
) -> Result<(StepReport, Option<(f64, String)>), RunError> {
    let m = program.microbatches as usize;
    let mut losses: Vec<Option<f32>> = vec![None; m];
    for o in outs {
        for (mb, l) in o.losses.iter().enumerate() {
            if let Some(l) = l {
                losses[mb] = Some(*l);
            }
        }
    }
    let losses = crate::run::complete_losses(step, losses)?;
    let loss = model::step_loss(&losses);
    let wall = outs.iter().map(|o| o.run.end_us).fold(0.0, f64::max);
    let mut summary = None;
    let mut worst = None;
    if let Some(rm) = ref_model.as_mut() {
        let r = reference::step(
            rm,
            &opts.model,
            step,
            program.microbatches,
            program.forward_only,
        )
        .map_err(|e| RunError::Check {
            step,
            msg: format!("the reference failed: {e}"),
        })?;
        let mut grads: Vec<Option<&StageGrads<f32>>> = vec![None; program.num_stages() as usize];
        for o in outs {
            for (s, g, done) in &o.grads {
                if *done != program.microbatches {
                    return Err(RunError::Check {
                        step,
                        msg: format!(
                            "stage {s} summed the gradients of {done} microbatches in order, not {m}"
                        ),
                    });
                }
                grads[*s as usize] = Some(g);
            }
        }
        // Multi-process: this process checks the stages of its own rank.
        let mine: Vec<bool> = (0..program.num_stages() as usize)
            .map(|s| {
                opts.launch.is_none()
                    || outs
                        .iter()
                        .any(|o| stages_of(program, o.rank as usize).contains(&(s as u32)))
            })
            .collect();
        let (sum, w) = compare_normwise(
            step,
            opts.dtype.tolerance(),
            &losses,
            loss,
            &grads,
            &mine,
            &r,
            rm,
        )?;
        if !program.forward_only {
            for (st, g) in rm.iter_mut().zip(&r.grads) {
                model::sgd(st, g, opts.lr);
            }
        }
        summary = Some(sum);
        worst = Some(w);
    }
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
                })
                .collect(),
            check: summary,
        },
        worst,
    ))
}

/// `‖a − b‖₂ / ‖b‖₂` (the absolute norm when `b` is zero).
pub fn rel_err(a: impl Iterator<Item = f32>, b: impl Iterator<Item = f32>) -> (f64, f64) {
    let (mut d2, mut n2, mut max_abs) = (0.0f64, 0.0f64, 0.0f64);
    for (x, y) in a.zip(b) {
        let d = x as f64 - y as f64;
        d2 += d * d;
        n2 += (y as f64) * (y as f64);
        max_abs = max_abs.max(d.abs());
    }
    let rel = if n2 > 0.0 {
        (d2 / n2).sqrt()
    } else {
        d2.sqrt()
    };
    (if rel.is_nan() { f64::INFINITY } else { rel }, max_abs)
}

/// Compare the losses and the gradients of the stages in `mine` with the reference; the error
/// names the worst tensor over the tolerance.
#[allow(clippy::too_many_arguments)]
pub fn compare_normwise(
    step: u32,
    tol: f64,
    losses: &[f32],
    loss: f32,
    grads: &[Option<&StageGrads<f32>>],
    mine: &[bool],
    r: &reference::RefStep,
    model: &[Stage<f32>],
) -> Result<(CheckSummary, (f64, String)), RunError> {
    let mut sum = CheckSummary {
        tensors: 0,
        values: 0,
        max_abs_diff: 0.0,
    };
    let mut worst = (0.0f64, String::from("nothing"));
    let mut note = |rel: f64, abs: f64, n: usize, what: String, sum: &mut CheckSummary| {
        sum.values += n;
        sum.max_abs_diff = sum.max_abs_diff.max(abs);
        if rel > worst.0 || worst.1 == "nothing" {
            worst = (rel, what);
        }
    };
    let (rel, abs) = rel_err(losses.iter().copied(), r.losses.iter().copied());
    note(
        rel,
        abs,
        losses.len(),
        "the microbatch losses".into(),
        &mut sum,
    );
    let (rel, abs) = rel_err(std::iter::once(loss), std::iter::once(r.loss));
    note(rel, abs, 1, "the step loss".into(), &mut sum);
    let include = |s: usize| mine.get(s).copied().unwrap_or(false);
    for_each_gradient(step, grads, r, model, include, |what, gt, rt| {
        sum.tensors += 1;
        let (rel, abs) = rel_err(gt.iter().copied(), rt.iter().copied());
        note(rel, abs, rt.len(), what, &mut sum);
        Ok(())
    })?;
    if worst.0 > tol {
        return Err(RunError::Check {
            step,
            msg: format!(
                "{}: normwise relative difference {:.3e} from the reference exceeds {:.0e}",
                worst.1, worst.0, tol
            ),
        });
    }
    Ok((sum, worst))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The normwise check passes a tiny relative error, fails a larger one in one tensor and
    /// names that tensor; only the stages marked as this process's are compared.
    #[test]
    fn normwise_check_names_the_worst_tensor() {
        let cfg = ModelConfig {
            hidden: 3,
            ffn: 4,
            vocab: 5,
            seq: 2,
            seed: 1,
        };
        let layout = pipec::front::layout::parse("Et|tL").unwrap();
        let stages = model::build::<f32>(&layout, &cfg).unwrap();
        let r = reference::step(&stages, &cfg, 0, 3, false).unwrap();
        let all = [true, true];
        let mut g = r.grads.clone();
        g[1][0].tensors[2].mapv_inplace(|x| x * (1.0 + 1e-6));
        let gr: Vec<Option<&StageGrads<f32>>> = g.iter().map(Some).collect();
        let (sum, worst) =
            compare_normwise(0, 1e-4, &r.losses, r.loss, &gr, &all, &r, &stages).unwrap();
        assert_eq!(sum.tensors, 1 + 4 + 4 + 2);
        assert!(worst.0 > 0.0 && worst.0 < 2e-6, "{worst:?}");
        assert!(worst.1.contains("stage 1, layer 0 (t), W2"), "{worst:?}");
        g[1][0].tensors[2].mapv_inplace(|x| x * 1.01);
        let gr: Vec<Option<&StageGrads<f32>>> = g.iter().map(Some).collect();
        let e = compare_normwise(0, 1e-4, &r.losses, r.loss, &gr, &all, &r, &stages)
            .unwrap_err()
            .to_string();
        assert!(e.contains("stage 1, layer 0 (t), W2"), "{e}");
        assert!(e.contains("exceeds 1e-4"), "{e}");
        // Stage 1 is another process's: not compared.
        let (sum, _) =
            compare_normwise(0, 1e-4, &r.losses, r.loss, &gr, &[true, false], &r, &stages).unwrap();
        assert_eq!(sum.tensors, 1 + 4);
        // A NaN is never within tolerance.
        let mut losses = r.losses.clone();
        losses[1] = f32::NAN;
        let e = compare_normwise(0, 5e-2, &losses, r.loss, &gr, &all, &r, &stages).unwrap_err();
        assert!(e.to_string().contains("microbatch losses"), "{e}");
    }
}
