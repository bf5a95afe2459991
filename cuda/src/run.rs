//! [`run_cuda`]: the CUDA run, through the step [`pipec_runtime::driver`] it shares with
//! [`pipec_runtime::run::run_cpu`]; this file says where the ranks run, how they reach each other,
//! how a step ends on a GPU and how the check compares.
//!
//! - Single process (no `RANK`/`WORLD_SIZE`): one thread per rank, rank `r` on GPU
//!   `r % device_count`; several ranks may share a GPU (each with its own streams). Ranks talk
//!   through the in-process rendezvous [`Transport`] and device-to-device copies
//!   ([`super::comm::Net::Local`]). A backend holds an NCCL communicator type and is not
//!   `Send`, so each is created and dropped on its own thread (the driver's rank threads).
//! - Multi-process ([`LaunchEnv`], torchrun or Slurm): this process runs only its rank, on GPU
//!   `LOCAL_RANK % device_count`; rank 0 makes one NCCL unique id per communicator (one over
//!   all ranks, for the losses' all-reduce, and one per P2P group of the program,
//!   [`super::groups::GroupPlan`]) and hands them out over [`launch::Server`] at
//!   `MASTER_ADDR:MASTER_PORT` (the next port under torchrun, see
//!   [`launch::AGENT_STORE_ENV`]), then every rank joins its communicators with
//!   `ncclCommInitRank` in one global order ([`super::comm::NcclNet::open`]). A one-rank
//!   launch (`WORLD_SIZE=1`) needs no NCCL and runs as a single process. A rank's failure
//!   does not reach other processes: they stop at the timeout of their own
//!   [`CudaBackend::sync`].
//!
//! Each step: `begin_step`, [`pipec_runtime::interp::run_rank`] (which only enqueues GPU work and
//! rendezvous), `sync` under the timeout (a hang is reported like the watchdog's), the
//! measured CUDA-event spans replace the host ones, then SGD. `check`: the single-thread f32
//! [`pipec_runtime::reference`] with the same seed, compared normwise (the GPU sums in another order,
//! and bf16 rounds): for each tensor `‖gpu − ref‖₂ / ‖ref‖₂ ≤ tol`, `tol` = 1e-4 in fp32 and
//! 5e-2 in bf16.

use super::capture::{Capture, Meeting};
use super::device::CudaBackend;
use super::groups::GroupPlan;
use super::launch::{self, LaunchEnv};
use super::model::{err, ByMicrobatch, Elem, GSums, GTensor};
use super::{
    comm::{NcclNet, Net},
    probe_libraries,
};
use cudarc::driver::CudaContext;
use pipec_ir::files::MANIFEST_FILE;
use pipec_ir::ir::{Instr, Program};
use pipec_runtime::backend::BackendError;
use pipec_runtime::driver::{
    build_model, check_layout, drive, replicated_stages, stages_of, Device, LocalGrads, Setup,
    StepBackend, StepCheck, StepError,
};
use pipec_runtime::error::RunError;
use pipec_runtime::interp::RankRun;
use pipec_runtime::model::ModelConfig;
use pipec_runtime::report::{CheckSummary, RunOptions, RunReport};
use pipec_runtime::run::for_each_gradient;
use pipec_runtime::transport::Transport;
use pipec_runtime::watchdog::Watch;
use pipec_schedules::layout::Layout;
use pipec_schedules::Rank;
use std::sync::Arc;
use std::time::Duration;

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
    /// Capture step 2 in a CUDA graph and replay it for the later steps ([`crate::capture`]).
    pub cuda_graph: bool,
}

/// What a run measured, plus where it ran.
#[derive(Clone, Debug)]
pub struct CudaRunReport {
    /// As [`pipec_runtime::run::run_cpu`]'s; in multi-process mode `steps[i].ranks` holds this
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

/// An NCCL unique id's bytes, for the rendezvous payload ([`launch::encode_ids`]).
fn id_bytes(id: &cudarc::nccl::Id) -> [u8; launch::NCCL_ID_BYTES] {
    id.internal().map(|c| c as u8)
}

fn id_from(bytes: [u8; launch::NCCL_ID_BYTES]) -> cudarc::nccl::Id {
    cudarc::nccl::Id::uninit(bytes.map(|b| b as std::ffi::c_char))
}

/// How a rank thread reaches its peers.
enum NetPlan<T: Elem> {
    Local(Arc<Transport<GTensor<T>>>),
    /// `ids`: the world's unique id, then one per group of `plan`.
    Nccl {
        ids: Vec<cudarc::nccl::Id>,
        world: usize,
        plan: Arc<GroupPlan>,
    },
}

/// The GPUs of this process as the driver's device.
struct Gpus<T: Elem> {
    dtype: Dtype,
    /// `--cuda-graph`: what the rank threads share for the capture.
    capture: Option<Arc<Capture>>,
    /// The in-process transport of a single-process run, reset between steps.
    local: Option<Arc<Transport<GTensor<T>>>>,
}

impl<T: Elem> Device for Gpus<T> {
    type Rank = CudaBackend<T>;
    /// The GPU and the network.
    type Plan = (usize, NetPlan<T>);
    /// The largest normwise relative difference and what it was in.
    type Worst = (f64, String);
    const SHARED_CLOCK: bool = false;

    fn open(
        &self,
        rank: u32,
        (ordinal, net): (usize, NetPlan<T>),
        s: &Setup<'_>,
    ) -> Result<CudaBackend<T>, String> {
        let mine = stages_of(s.program, rank as usize);
        CudaBackend::<T>::new(
            Rank(rank),
            ordinal,
            s.model,
            s.layout,
            s.program.microbatches,
            s.full,
            &mine,
            |st| match net {
                NetPlan::Local(t) => Ok(Net::Local(t)),
                NetPlan::Nccl { ids, world, plan } => {
                    NcclNet::open(st, Rank(rank), world, &ids, plan).map(Net::Nccl)
                }
            },
            s.watch.clone(),
            self.capture.clone(),
        )
        .map_err(|e| format!("rank {rank} on GPU {ordinal}: {e}"))
    }

    fn reset(&self) {
        if let Some(t) = &self.local {
            t.reset();
        }
    }

    fn compare(&self, c: &StepCheck<'_>) -> Result<(CheckSummary, (f64, String)), RunError> {
        let tol = self.dtype.tolerance();
        compare_normwise(tol, c)
    }
}

/// GPU work is only enqueued by the interpreter: a step ends when the streams are done, timed
/// by CUDA events; replicas hand each other device copies.
impl<T: Elem> StepBackend for CudaBackend<T> {
    type Parked = ByMicrobatch<T>;
    type Sum = GSums;

    fn bind(&self) -> Result<(), BackendError> {
        self.ctx.bind_to_thread().map_err(err("bind the GPU"))
    }

    fn begin_step(&mut self, step: u32) -> Result<(), BackendError> {
        CudaBackend::begin_step(self, step)
    }

    fn end_step(
        &mut self,
        instrs: &[Instr],
        run: RankRun,
        timeout: Duration,
    ) -> Result<RankRun, StepError> {
        if self.capturing().is_some() {
            let (us, pool) = self.launch_graph(Meeting::End)?;
            let captured = RankRun {
                spans: Vec::new(),
                busy_us: 0.0,
                end_us: us,
                pool_peak_bytes: pool,
                graph: true,
                ..run
            };
            if let Some(g) = self.graph_mut() {
                g.captured = Some(captured.clone());
            }
            return Ok(captured);
        }
        self.sync(timeout).map_err(|e| StepError::Hang(e.0))?;
        let spans = self.spans()?;
        if spans.len() != instrs.len() {
            return Err(BackendError(format!(
                "{} event spans for {} instructions",
                spans.len(),
                instrs.len()
            ))
            .into());
        }
        let busy = instrs
            .iter()
            .zip(&spans)
            .filter(|(i, _)| i.as_compute().is_some())
            .map(|(_, s)| s.end - s.start)
            .sum();
        let end = spans.iter().map(|s| s.end).fold(0.0, f64::max);
        Ok(RankRun {
            spans,
            busy_us: busy,
            end_us: end,
            peak_activations: run.peak_activations,
            device_peak: run.device_peak,
            host_peak: run.host_peak,
            pool_peak_bytes: self.pool_peak()?,
            buffer_slots: run.buffer_slots,
            graph: false,
        })
    }

    /// Steps after the captured one relaunch its graph; the metering is the captured step's.
    fn replay(&mut self, step: u32, _timeout: Duration) -> Option<Result<RankRun, StepError>> {
        if step < 2 || self.graph_mut().is_none() {
            return None;
        }
        Some((|| {
            let (us, pool) = self.launch_graph(Meeting::Replay)?;
            let captured = self
                .graph_mut()
                .and_then(|g| g.captured.clone())
                .ok_or_else(|| BackendError("no captured step to replay".into()))?;
            Ok(RankRun {
                end_us: us,
                pool_peak_bytes: pool,
                ..captured
            })
        })())
    }

    fn losses(&self, timeout: Duration) -> Result<Vec<Option<f32>>, BackendError> {
        self.all_losses(timeout)
    }

    fn grads(&self, copy: bool) -> Result<LocalGrads, BackendError> {
        if !copy {
            return Ok(Vec::new());
        }
        Ok(CudaBackend::grads(self)?
            .into_iter()
            .map(|(s, g, done)| (s, done, Some(g)))
            .collect())
    }

    fn sgd(&mut self, lr: f32) -> Result<(), BackendError> {
        CudaBackend::sgd(self, lr)
    }

    fn park(&mut self, stage: u32) -> ByMicrobatch<T> {
        self.take_parked(stage)
    }

    fn absorb(&mut self, stage: u32, parked: ByMicrobatch<T>) -> Result<(), BackendError> {
        CudaBackend::absorb(self, stage, parked)
    }

    fn sum_copy(&self, stage: u32) -> Result<(GSums, u32), BackendError> {
        CudaBackend::sum_copy(self, stage)
    }

    fn replace_sum(&mut self, stage: u32, sum: &GSums, next: u32) -> Result<(), BackendError> {
        CudaBackend::replace_sum(self, stage, sum, next)
    }
}

/// Run `program` on GPUs; see the module doc for the two modes.
pub fn run_cuda(
    program: &impl pipec_ir::verify::Checked,
    layout: &Layout,
    opts: &CudaRunOptions,
) -> Result<CudaRunReport, RunError> {
    let program = program.program();
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
    check_layout(program, layout)?;
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
            // torch's `ProcessGroupNCCL` runs each communicator's P2P ops on that
            // communicator's own stream, the order the verifier proves (D2). This mode has one
            // communicator and stream per P2P group too, but posts each batch to completion:
            // the rank's comm stream waits for every group stream a batch used, and the next
            // batch's group streams wait for the comm stream. A batch left in flight would so
            // hold back the later batches of every group, not only its own: an order nothing
            // has checked, so a possible hang. Posting a batch and waiting for it at its
            // `wait` is not written for NCCL.
            return Err(RunError::Refused {
                file: MANIFEST_FILE.into(),
                field: "schedule".into(),
                msg: format!(
                    "{}: the schedule leaves comm batches in flight (`wait` instructions, e.g. \
                     Megatron's overlap P2P mode), which the CUDA backend runs only in one \
                     process (its NCCL mode completes each batch before the next, whatever \
                     the P2P groups, so a batch in flight would hold back the other groups' \
                     batches too); run it without a launcher or on the cpu backend",
                    pipec_runtime::diagnose::describe_instr(program, Rank(r as u32), i as u32)
                ),
            });
        }
    }
    if opts.cuda_graph {
        if opts.steps < 2 {
            return Err(RunError::Usage(
                "a captured step needs 2 steps or more (step 1 runs eagerly, step 2 is captured)"
                    .into(),
            ));
        }
        let processes = opts.launch.as_ref().map_or(1, |l| l.world_size);
        crate::graph::capturable(program, processes)?;
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
    let full = build_model(layout, &opts.model, "CUDA")?;
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
            // Every process derives the same groups in the same order from the same program.
            let plan = Arc::new(GroupPlan::of(program));
            let comms = 1 + plan.groups.len();
            let ids = if l.rank == 0 {
                // `ncclGetUniqueId` starts the communicator's bootstrap root in this process,
                // also for groups rank 0 is not in; this process lives until they are made.
                let ids = (0..comms)
                    .map(|_| cudarc::nccl::Id::new())
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(|e| RunError::Device(format!("NCCL: ncclGetUniqueId: {:?}", e.0)))?;
                let payload = launch::encode_ids(&ids.iter().map(id_bytes).collect::<Vec<_>>())
                    .map_err(|e| RunError::Launch(e.to_string()))?;
                let server = launch::Server::bind(&format!("0.0.0.0:{}", l.master_port))
                    .map_err(|e| RunError::Launch(e.to_string()))?;
                server
                    .serve(l.world_size, &payload, rv_timeout)
                    .map_err(|e| RunError::Launch(e.to_string()))?;
                ids
            } else {
                let bytes = launch::fetch(&l.master(), l.rank, l.world_size, rv_timeout)
                    .map_err(|e| RunError::Launch(e.to_string()))?;
                launch::decode_ids(&bytes, comms)
                    .map_err(|e| RunError::Launch(format!("rank {}: {e}", l.rank)))?
                    .into_iter()
                    .map(id_from)
                    .collect()
            };
            vec![(l.rank, ordinal, NetPlan::Nccl { ids, world, plan })]
        }
    };
    let ranks: Vec<u32> = plan.iter().map(|p| p.0).collect();
    let devices: Vec<usize> = plan.iter().map(|p| p.1).collect();
    let capture = if opts.cuda_graph {
        if let Some(&g) = devices.iter().find(|&&g| g != devices[0]) {
            return Err(RunError::Usage(format!(
                "--cuda-graph captures the ranks of one GPU; here they run on GPUs {} and {g} \
                 (set CUDA_VISIBLE_DEVICES to one GPU)",
                devices[0]
            )));
        }
        let ctx = CudaContext::new(devices[0])
            .map_err(|e| RunError::Device(format!("CUDA: open GPU {}: {e:?}", devices[0])))?;
        if !ctx.has_async_alloc() {
            // Without stream-ordered allocation cudarc frees with a stream synchronisation,
            // which a capture forbids; buffers allocated inside a graph need it.
            return Err(RunError::Device(format!(
                "--cuda-graph needs stream-ordered allocation (cuMemAllocAsync), which GPU {} \
                 does not support with this driver",
                devices[0]
            )));
        }
        Some(Arc::new(
            Capture::new(ctx, world, plan.len(), watch.clone(), opts.timeout)
                .map_err(|e| RunError::Device(format!("CUDA: {e}")))?,
        ))
    } else {
        None
    };
    let gpus = Gpus {
        dtype: opts.dtype,
        capture,
        local: plan.iter().find_map(|p| match &p.2 {
            NetPlan::Local(t) => Some(t.clone()),
            NetPlan::Nccl { .. } => None,
        }),
    };
    let setup = Setup {
        program,
        layout,
        model: opts.model,
        full: &full,
        watch,
        memory: &pipec_runtime::run::memory_model(program, layout, None),
    };
    let run_opts = RunOptions {
        model: opts.model,
        steps: opts.steps,
        lr: opts.lr,
        timeout: opts.timeout,
        check: opts.check,
        trace_steps: None,
    };
    let plan = plan.into_iter().map(|(r, g, net)| (r, (g, net))).collect();
    // Multi-process: this process checks the stages of its own rank.
    let partial = opts.launch.is_some();
    let (run, worst) = drive(setup, &run_opts, &gpus, plan, partial)?;
    Ok(CudaRunReport {
        run,
        ranks,
        devices,
        device_count: count,
        worst,
        dtype: opts.dtype,
    })
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
pub fn compare_normwise(
    tol: f64,
    c: &StepCheck<'_>,
) -> Result<(CheckSummary, (f64, String)), RunError> {
    let StepCheck {
        step,
        losses,
        loss,
        grads,
        mine,
        r,
        model,
    } = *c;
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
    use pipec_runtime::model::{self, Stage, StageGrads};
    use pipec_runtime::reference::{self, RefStep};

    fn check<'a>(
        r: &'a RefStep,
        model: &'a [Stage<f32>],
        losses: &'a [f32],
        grads: &'a [Option<&'a StageGrads<f32>>],
        mine: &'a [bool],
    ) -> StepCheck<'a> {
        StepCheck {
            step: 0,
            losses,
            loss: r.loss,
            grads,
            mine,
            r,
            model,
        }
    }

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
        let layout = pipec_schedules::layout::parse("Et|tL").unwrap();
        let stages = model::build::<f32>(&layout, &cfg).unwrap();
        let r = reference::step(&stages, &cfg, 0, 3, false).unwrap();
        let all = [true, true];
        let mut g = r.grads.clone();
        g[1][0].tensors[2].mapv_inplace(|x| x * (1.0 + 1e-6));
        let gr: Vec<Option<&StageGrads<f32>>> = g.iter().map(Some).collect();
        let (sum, worst) =
            compare_normwise(1e-4, &check(&r, &stages, &r.losses, &gr, &all)).unwrap();
        assert_eq!(sum.tensors, 1 + 4 + 4 + 2);
        assert!(worst.0 > 0.0 && worst.0 < 2e-6, "{worst:?}");
        assert!(worst.1.contains("stage 1, layer 0 (t), W2"), "{worst:?}");
        g[1][0].tensors[2].mapv_inplace(|x| x * 1.01);
        let gr: Vec<Option<&StageGrads<f32>>> = g.iter().map(Some).collect();
        let e = compare_normwise(1e-4, &check(&r, &stages, &r.losses, &gr, &all))
            .unwrap_err()
            .to_string();
        assert!(e.contains("stage 1, layer 0 (t), W2"), "{e}");
        assert!(e.contains("exceeds 1e-4"), "{e}");
        // Stage 1 is another process's: not compared.
        let (sum, _) =
            compare_normwise(1e-4, &check(&r, &stages, &r.losses, &gr, &[true, false])).unwrap();
        assert_eq!(sum.tensors, 1 + 4);
        // A NaN is never within tolerance.
        let mut losses = r.losses.clone();
        losses[1] = f32::NAN;
        let e = compare_normwise(5e-2, &check(&r, &stages, &losses, &gr, &all)).unwrap_err();
        assert!(e.to_string().contains("microbatch losses"), "{e}");
    }
}
