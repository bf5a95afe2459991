//! [`CudaBackend`]: one rank on one GPU. Compute on a main stream (and a second stream for the
//! forward half of an overlapped pair), communication on a third, offloads and reloads on a
//! fourth (the copy stream of docs/format.md, "Memory instructions"); CUDA events around every
//! instruction give the measured timeline.
//!
//! Copies follow the format's rules with events: a copy's stream waits for an event the
//! compute stream records where the program posts it (so an offload starts after its forward,
//! and a reload's buffer, allocated on the compute stream there, exists); its span is the copy
//! stream's own events (the trace's `rank R copy` row); `wait_offload` and the backward of a
//! reloaded stash make the compute stream wait for the copy's end event, and the device copies
//! of the offloads known to have ended are freed then (cudarc frees a buffer on its own stream
//! after the copy stream's read of it).

use super::capture::{Capture, Meeting, Met, RankGraph};
use super::comm::{self, Net};
use super::copy::{HStash, Pinned};
use super::model::{
    err, ByMicrobatch, Dev, Elem, GGrads, GPartial, GStage, GStash, GSums, GTensor, Kernels,
};
use super::poll::poll_until;
use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaContext, CudaEvent, CudaSlice, CudaStream};
use pipec_ir::ir::InstrRef;
use pipec_runtime::backend::{Backend, BackendError, CommError, CommOp};
use pipec_runtime::model::{self, ModelConfig, Stage};
use pipec_runtime::watchdog::{Failure, FailureKind, Watch};
use pipec_schedules::layout::{LayerKind, Layout};
use pipec_schedules::{Rank, Task};
use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

/// Events of one interpreter call: `n` instructions (1 for compute, the batch size for comm),
/// from `start` to `end` (and a second pair for the other stream of an overlapped pair).
pub struct Mark {
    pub n: usize,
    pub compute: bool,
    pub start: CudaEvent,
    pub end: CudaEvent,
    pub other: Option<(CudaEvent, CudaEvent)>,
}

struct Accum {
    next: u32,
    pending: BTreeMap<u32, usize>,
    sum: GSums,
}

/// A forward's output and, when saved, its stash.
type FwdResult<T> = Result<(GTensor<T>, Option<Vec<GStash<T>>>), BackendError>;

/// An offloaded stash's place in its backend's host store. The pinned buffers stay with the
/// backend, dropped after its NCCL communicator: a pinned buffer's drop waits for its last copy
/// (`cuEventSynchronize`), which after a hang would wait for ever if the interpreter's tables
/// dropped it first (see [`CudaBackend::net`]).
pub struct HostStash(u64);

/// A copy posted on the copy stream and not yet known to have ended.
struct InFlight<T> {
    task: Task,
    /// An offload's device stash, freed once the copy is known to have ended; `None` for a
    /// reload.
    device: Option<Vec<GStash<T>>>,
    /// The copy's mark in [`CudaBackend::marks`]: its end event is the copy's end.
    mark: usize,
}

pub struct CudaBackend<T: Elem> {
    /// First field, so dropped first (Rust drops fields in declaration order): each `Comm`'s
    /// drop is `ncclCommAbort`, which stops NCCL kernels still waiting for a peer, while
    /// dropping a [`Dev`] runs `cublasDestroy`, which "implicitly calls
    /// `cudaDeviceSynchronize()`" (cuBLAS docs, `cublasDestroy`) and so would block for ever on
    /// such a kernel after a hang was reported; the rank thread would never end and `pipec-run`
    /// never exit.
    net: Net<T>,
    pub rank: Rank,
    pub ctx: Arc<CudaContext>,
    main: Dev<T>,
    side: Dev<T>,
    comm_stream: Arc<CudaStream>,
    /// Offloads and reloads, in program order.
    copy_stream: Arc<CudaStream>,
    /// Copies posted and not yet known to have ended, in posting order.
    copies: VecDeque<InFlight<T>>,
    /// Offloaded stashes by [`HostStash`] number, until their reload.
    host: BTreeMap<u64, Vec<HStash<T>>>,
    next_host: u64,
    pinned: Pinned<T>,
    layout: Layout,
    microbatches: u32,
    step: u32,
    stages: Vec<Option<GStage<T>>>,
    accum: Vec<Option<Accum>>,
    /// Out-of-order per-microbatch gradients waiting for their turn.
    parked: Vec<Option<GGrads<T>>>,
    losses: Vec<Option<CudaSlice<f32>>>,
    origin: Option<CudaEvent>,
    pub marks: Vec<Mark>,
    watch: Arc<Watch>,
    /// Index of the next instruction (for failure reports).
    at: u32,
    /// Batches left in flight: (first op's instruction index, index of the batch's mark).
    in_flight: Vec<(u32, usize)>,
    /// `--cuda-graph` ([`crate::capture`]): step 0 runs eagerly, step 1 is captured, later
    /// steps replay it. Last, so dropped after the cuBLAS handles that use its workspaces.
    graph: Option<RankGraph>,
}

/// Copies of per-layer tensors onto `stream` (from any GPU of this process).
fn copy_all<U: cudarc::driver::DeviceRepr>(
    stream: &Arc<CudaStream>,
    layers: &[Vec<CudaSlice<U>>],
) -> Result<Vec<Vec<CudaSlice<U>>>, BackendError> {
    layers
        .iter()
        .map(|l| l.iter().map(|t| comm::copy_in(stream, t)).collect())
        .collect()
}

fn timing_event(s: &CudaStream) -> Result<CudaEvent, BackendError> {
    s.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
        .map_err(err("record an event"))
}

impl<T: Elem> CudaBackend<T> {
    /// `ordinal`: the GPU; `model`: the whole CPU-initialized model, of which the stages in
    /// `mine` are uploaded.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        rank: Rank,
        ordinal: usize,
        cfg: ModelConfig,
        layout: &Layout,
        microbatches: u32,
        model: &[Stage<f32>],
        mine: &[u32],
        net: impl FnOnce(&Arc<CudaStream>) -> Result<Net<T>, BackendError>,
        watch: Arc<Watch>,
        capture: Option<Arc<Capture>>,
    ) -> Result<Self, BackendError> {
        let ctx = CudaContext::new(ordinal).map_err(err("open the GPU"))?;
        let k = Arc::new(Kernels::<T>::compile(&ctx)?);
        let main = Dev::new(
            ctx.new_stream().map_err(err("create a stream"))?,
            k.clone(),
            cfg,
        )?;
        // A captured step runs each rank's work on one stream (see `capture`'s module doc).
        let other = || -> Result<Arc<CudaStream>, BackendError> {
            match capture {
                Some(_) => Ok(main.stream.clone()),
                None => ctx.new_stream().map_err(err("create a stream")),
            }
        };
        let side = Dev::new(other()?, k, cfg)?;
        let comm_stream = other()?;
        let copy_stream = other()?;
        let graph = match capture {
            Some(c) => {
                let mut g = RankGraph::new(c, &main.stream, microbatches, cfg.seq)?;
                for d in [&main, &side] {
                    g.workspaces.push(d.own_cublas_workspace()?);
                }
                Some(g)
            }
            None => None,
        };
        let net = net(&comm_stream)?;
        let mut stages: Vec<Option<GStage<T>>> = (0..model.len()).map(|_| None).collect();
        let mut accum: Vec<Option<Accum>> = (0..model.len()).map(|_| None).collect();
        for &s in mine {
            let st = main.upload_stage(&model[s as usize])?;
            let sum = st
                .layers
                .iter()
                .map(|l| {
                    l.tensors
                        .iter()
                        .map(|t| main.zeros::<f32>(t.len()))
                        .collect()
                })
                .collect::<Result<_, _>>()?;
            accum[s as usize] = Some(Accum {
                next: 0,
                pending: BTreeMap::new(),
                sum,
            });
            stages[s as usize] = Some(st);
        }
        let pinned = Pinned::new(Arc::clone(&ctx));
        Ok(CudaBackend {
            net,
            rank,
            ctx,
            main,
            side,
            comm_stream,
            copy_stream,
            copies: VecDeque::new(),
            host: BTreeMap::new(),
            next_host: 0,
            pinned,
            layout: layout.clone(),
            microbatches,
            step: 0,
            stages,
            accum,
            parked: Vec::new(),
            losses: (0..microbatches).map(|_| None).collect(),
            origin: None,
            marks: Vec::new(),
            watch,
            at: 0,
            in_flight: Vec::new(),
            graph,
        })
    }

    /// Graph mode's state while a step is captured (steps after the first; replayed steps
    /// never reach the interpreter's calls).
    pub(crate) fn capturing(&self) -> Option<&RankGraph> {
        self.graph.as_ref().filter(|_| self.step >= 1)
    }

    /// Start step `step`: zero the gradient sums, forget losses and marks, record the origin.
    pub fn begin_step(&mut self, step: u32) -> Result<(), BackendError> {
        self.step = step;
        if self.graph.is_some() && step >= 1 {
            return self.begin_graph_step(step);
        }
        self.zero_sums()?;
        self.forget_last_step();
        self.reset_pool_peak()?;
        self.side
            .stream
            .join(&self.main.stream)
            .map_err(err("order streams"))?;
        self.comm_stream
            .join(&self.main.stream)
            .map_err(err("order streams"))?;
        self.copy_stream
            .join(&self.main.stream)
            .map_err(err("order streams"))?;
        self.origin = Some(timing_event(&self.main.stream)?);
        Ok(())
    }

    /// Drop the last step's host state: parked gradients, losses, copies (all ended, `sync`:
    /// their device copies go, and host copies never reloaded, which a program may leave, go
    /// back to the pool), marks and batches in flight.
    fn forget_last_step(&mut self) {
        self.parked.clear();
        self.losses.iter_mut().for_each(|l| *l = None);
        self.copies.clear();
        for (_, h) in std::mem::take(&mut self.host) {
            self.pinned.recycle(h);
        }
        self.marks.clear();
        self.in_flight.clear();
        self.at = 0;
    }

    /// Zero the gradient sums on the compute stream and restart their microbatch count.
    fn zero_sums(&mut self) -> Result<(), BackendError> {
        for a in self.accum.iter_mut().flatten() {
            a.next = 0;
            a.pending.clear();
            for t in a.sum.iter_mut().flatten() {
                self.main
                    .stream
                    .memset_zeros(t)
                    .map_err(err("zero gradients"))?;
            }
        }
        Ok(())
    }

    /// A step of graph mode: the last step's host state goes (before any capture: its buffers
    /// were allocated outside it), this step's inputs are staged; step 1 then joins the
    /// capture and zeroes the gradient sums inside it (replays run the captured zeroing).
    fn begin_graph_step(&mut self, step: u32) -> Result<(), BackendError> {
        self.forget_last_step();
        self.reset_pool_peak()?;
        let cfg = self.main.cfg;
        let g = self.graph.as_mut().expect("graph mode");
        g.staged.fill(&self.main.stream, &cfg, step)?;
        if step >= 2 {
            return Ok(());
        }
        let Met::Fork(fork) =
            g.capture
                .meet(self.rank.0, Meeting::Begin, self.main.stream.clone())?
        else {
            return Err(BackendError(
                "the capture began without a fork event".into(),
            ));
        };
        g.has_loss.iter_mut().for_each(|h| *h = false);
        // SAFETY: from here on this rank orders its buffers itself: one stream, and explicit
        // events across ranks (`capture`'s module doc). cudarc would otherwise make the
        // capturing stream wait for events recorded before the capture, which CUDA forbids.
        unsafe { self.ctx.disable_event_tracking() };
        self.main
            .stream
            .wait(&fork)
            .map_err(err("join the capture"))?;
        self.zero_sums()?;
        self.origin = Some(timing_event(&self.main.stream)?);
        Ok(())
    }

    /// Launch the graph with the other rank threads, after this rank's work so far: step 1
    /// ([`Meeting::End`], after the interpreter: the last rank to arrive ends the capture,
    /// instantiates the graph and launches it) or a replay ([`Meeting::Replay`], after this
    /// rank's inputs and last update). The GPU time of the launch in microseconds, and the
    /// GPU's memory over it in bytes: the device pool's high watermark plus the graph memory's
    /// (CUDA keeps graph allocations apart), at least the true peak.
    pub fn launch_graph(&mut self, what: Meeting) -> Result<(f64, Option<u64>), BackendError> {
        // Errors of calls cudarc makes where it cannot return them (a buffer's free while
        // captured, an event record) wait in the context: the capture would be wrong.
        self.ctx.check_err().map_err(err(
            "a CUDA call of the captured step (a free or an event record)",
        ))?;
        let g = self.graph.as_ref().expect("graph mode");
        match g
            .capture
            .meet(self.rank.0, what, self.main.stream.clone())?
        {
            // The two watermarks need not fall at one moment: their sum bounds the peak.
            Met::Ran(us, graph) => Ok((us, self.pool_peak()?.map(|p| p + graph))),
            Met::Fork(_) => Err(BackendError(format!(
                "a {what:?} meeting began a capture instead of launching"
            ))),
        }
    }

    /// Graph mode's per-rank state (`None` when not in graph mode).
    pub fn graph_mut(&mut self) -> Option<&mut RankGraph> {
        self.graph.as_mut()
    }

    /// The GPU's current memory pool, which cudarc's stream-ordered allocations
    /// (`cuMemAllocAsync`) draw from; `None` where the driver has none (cudarc then allocates
    /// with `cuMemAlloc`).
    fn pool(&self) -> Result<Option<cudarc::driver::sys::CUmemoryPool>, BackendError> {
        if !self.ctx.has_async_alloc() {
            return Ok(None);
        }
        let mut pool = std::ptr::null_mut();
        // SAFETY: an out-parameter for the device this context runs on.
        unsafe { cudarc::driver::sys::cuDeviceGetMemPool(&mut pool, self.ctx.cu_device()) }
            .result()
            .map_err(err("get the memory pool"))?;
        Ok(Some(pool))
    }

    /// Restart the pool's high watermark at its current use (CUDA: setting
    /// `CU_MEMPOOL_ATTR_USED_MEM_HIGH` to 0 resets it).
    fn reset_pool_peak(&self) -> Result<(), BackendError> {
        use cudarc::driver::sys::{cuMemPoolSetAttribute, CUmemPool_attribute_enum};
        if let Some(pool) = self.pool()? {
            let mut zero = 0u64;
            // SAFETY: the attribute is a cuuint64_t; `zero` outlives the call.
            unsafe {
                cuMemPoolSetAttribute(
                    pool,
                    CUmemPool_attribute_enum::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
                    (&mut zero as *mut u64).cast(),
                )
            }
            .result()
            .map_err(err("reset the memory pool's high watermark"))?;
        }
        Ok(())
    }

    /// The pool's high watermark in bytes since [`Self::reset_pool_peak`] (after
    /// [`Self::sync`]).
    pub fn pool_peak(&self) -> Result<Option<u64>, BackendError> {
        use cudarc::driver::sys::{cuMemPoolGetAttribute, CUmemPool_attribute_enum};
        let Some(pool) = self.pool()? else {
            return Ok(None);
        };
        let mut high = 0u64;
        // SAFETY: the attribute is a cuuint64_t written into `high`.
        unsafe {
            cuMemPoolGetAttribute(
                pool,
                CUmemPool_attribute_enum::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
                (&mut high as *mut u64).cast(),
            )
        }
        .result()
        .map_err(err("read the memory pool's high watermark"))?;
        Ok(Some(high))
    }

    /// Wait for all of this rank's GPU work, polling so that a hang (an NCCL peer that never
    /// posts) becomes an error after `timeout` instead of blocking forever.
    pub fn sync(&self, timeout: Duration) -> Result<(), BackendError> {
        let ev = [
            &self.main.stream,
            &self.side.stream,
            &self.comm_stream,
            &self.copy_stream,
        ]
        .iter()
        .map(|s| s.record_event(None).map_err(err("record an event")))
        .collect::<Result<Vec<_>, _>>()?;
        let done = poll_until(timeout, || {
            let mut done = true;
            for e in &ev {
                done &= e.try_is_complete().map_err(err("GPU work"))?;
            }
            Ok(done)
        })?;
        if done {
            return Ok(());
        }
        Err(BackendError(format!(
            "{}: the GPU work of the step did not finish within {:.1} s (a communication hang?)",
            self.rank,
            timeout.as_secs_f64()
        )))
    }

    /// Post a comm batch on the comm stream (after the compute issued so far) and push its
    /// mark; its end event is provisional until [`Self::finish_batch`]. The outer error is the
    /// GPU's, the inner one the rendezvous'.
    fn post_batch(
        &mut self,
        ops: &mut [CommOp<GTensor<T>>],
    ) -> Result<Result<(), CommError>, BackendError> {
        self.comm_stream
            .join(&self.main.stream)
            .map_err(err("order streams"))?;
        let start = timing_event(&self.comm_stream)?;
        if let Some(g) = self.capturing() {
            g.capture.post(self.rank.0, &self.comm_stream)?;
        }
        match &self.net {
            Net::Local(t) => {
                if let Err(e) = t.post(self.rank, ops) {
                    return Ok(Err(e));
                }
            }
            Net::Nccl(n) => {
                let cfg = self.main.cfg;
                comm::nccl_batch(n, &self.comm_stream, &self.layout, cfg.seq, cfg.hidden, ops)?
            }
        }
        let end = timing_event(&self.comm_stream)?;
        self.marks.push(Mark {
            n: ops.len(),
            compute: false,
            start,
            end,
            other: None,
        });
        self.at += ops.len() as u32;
        Ok(Ok(()))
    }

    /// Complete a posted batch: in one process, wait for the peers' posts (the transport's
    /// rendezvous) and copy what arrived onto the comm stream; NCCL already enqueued it all.
    /// Returns the event after the batch's last GPU work, which is also the batch mark's end.
    fn finish_batch(
        &mut self,
        ops: &mut [CommOp<GTensor<T>>],
    ) -> Result<Result<CudaEvent, CommError>, BackendError> {
        if let Net::Local(t) = &self.net {
            if let Err(e) = t.complete(self.rank, ops) {
                return Ok(Err(e));
            }
            match self.capturing() {
                Some(g) => comm::local_receive_captured(&self.comm_stream, ops, &g.capture)?,
                None => comm::local_receive(&self.comm_stream, ops)?,
            }
        }
        timing_event(&self.comm_stream).map(Ok)
    }

    /// Close the span of one instruction on the compute stream, opened by `start`: a compute
    /// pass, or a `wait` (how long compute stalled for its batch).
    fn close_mark(&mut self, start: CudaEvent, compute: bool) -> Result<(), BackendError> {
        let end = timing_event(&self.main.stream)?;
        self.marks.push(Mark {
            n: 1,
            compute,
            start,
            end,
            other: None,
        });
        self.at += 1;
        Ok(())
    }

    /// A comm call's result: a GPU error fails the run (reported here, with the batch's first
    /// instruction); a rendezvous error goes back to the interpreter, which words it.
    fn comm_result(
        &self,
        r: Result<Result<(), CommError>, BackendError>,
        ops: &[CommOp<GTensor<T>>],
    ) -> Result<(), CommError> {
        match r {
            Ok(x) => x,
            Err(e) => {
                self.watch.fail(Failure {
                    kind: FailureKind::Compute,
                    at: InstrRef {
                        rank: self.rank,
                        index: ops.first().map(|o| o.at).unwrap_or(self.at),
                    },
                    report: format!("{}: communication failed: {}", self.rank, e.0),
                });
                Err(CommError::Aborted)
            }
        }
    }

    /// Per-instruction spans in microseconds since the step's origin (after [`Self::sync`]).
    pub fn spans(&self) -> Result<Vec<pipec_cost::timeline::Span>, BackendError> {
        let origin = self
            .origin
            .as_ref()
            .ok_or_else(|| BackendError("no step ran".into()))?;
        let us = |e: &CudaEvent| -> Result<f64, BackendError> {
            Ok(origin.elapsed_ms(e).map_err(err("read an event"))? as f64 * 1000.0)
        };
        let mut out = Vec::new();
        for m in &self.marks {
            let (mut s, mut e) = (us(&m.start)?, us(&m.end)?);
            if let Some((s2, e2)) = &m.other {
                s = s.min(us(s2)?);
                e = e.max(us(e2)?);
            }
            for _ in 0..m.n {
                out.push(pipec_cost::timeline::Span {
                    start: s,
                    end: e.max(s),
                });
            }
        }
        Ok(out)
    }

    /// (microbatch, loss) recorded on this rank (after [`Self::sync`]).
    pub fn losses(&self) -> Result<Vec<(u32, f32)>, BackendError> {
        if let Some(g) = self.capturing() {
            let v = self
                .main
                .stream
                .clone_dtoh(&g.losses)
                .map_err(err("read the losses"))?;
            return Ok(g
                .has_loss
                .iter()
                .zip(v)
                .enumerate()
                .filter(|(_, (h, _))| **h)
                .map(|(m, (_, l))| (m as u32, l))
                .collect());
        }
        let mut out = Vec::new();
        for (m, l) in self.losses.iter().enumerate() {
            if let Some(l) = l {
                let v = self.main.stream.clone_dtoh(l).map_err(err("read a loss"))?;
                out.push((m as u32, v[0]));
            }
        }
        Ok(out)
    }

    /// Every microbatch's loss, known on every rank. Single process: this rank's own (the
    /// caller merges ranks). NCCL: the ranks that hold `L` contribute theirs and an all-reduce
    /// (sum) of `[loss; m] ++ [present; m]` gives everyone all of them, so rank 0 can print
    /// the loss whichever rank computes it (rank 0 under a V-shape placement, the last rank
    /// under a looped one). Collective in NCCL mode: every rank calls it once per step; a rank
    /// whose peer never joins gets an error after `timeout` (see [`Self::sync`]).
    pub fn all_losses(&self, timeout: Duration) -> Result<Vec<Option<f32>>, BackendError> {
        let m = self.losses.len();
        let mut v = vec![0.0f32; 2 * m];
        for (mb, l) in self.losses()? {
            v[mb as usize] = l;
            v[m + mb as usize] = 1.0;
        }
        if let Net::Nccl(n) = &self.net {
            let mut buf = self
                .comm_stream
                .clone_htod(&v)
                .map_err(err("upload losses"))?;
            n.world
                .all_reduce_in_place(&mut buf, &cudarc::nccl::ReduceOp::Sum)
                .map_err(|e| BackendError(format!("NCCL all-reduce of the losses: {:?}", e.0)))?;
            // A peer that stopped never joins the all-reduce, and `clone_dtoh` into a `Vec`
            // blocks until the copy is done (`cuMemcpyDtoHAsync` to pageable memory returns
            // only then; cudarc adds no wait of its own): poll first, as `sync` does.
            let reduced = self
                .comm_stream
                .record_event(None)
                .map_err(err("record an event"))?;
            let done = poll_until(timeout, || {
                reduced
                    .try_is_complete()
                    .map_err(err("NCCL all-reduce of the losses"))
            })?;
            if !done {
                return Err(BackendError(format!(
                    "{}: the all-reduce of the step's losses did not finish within {:.1} s (another rank stopped?)",
                    self.rank,
                    timeout.as_secs_f64()
                )));
            }
            v = self
                .comm_stream
                .clone_dtoh(&buf)
                .map_err(err("read losses"))?;
        }
        Ok((0..m)
            .map(|mb| (v[m + mb] > 0.5).then_some(v[mb]))
            .collect())
    }

    /// The step's gradient sums per local stage, as CPU arrays, with the count summed in order.
    pub fn grads(&self) -> Result<Vec<(u32, model::StageGrads<f32>, u32)>, BackendError> {
        let mut out = Vec::new();
        for (s, (a, st)) in self.accum.iter().zip(&self.stages).enumerate() {
            let (Some(a), Some(st)) = (a, st) else {
                continue;
            };
            let mut layers = Vec::new();
            for (l, sums) in st.layers.iter().zip(&a.sum) {
                let mut tensors = Vec::new();
                for (shape, t) in l.shapes.iter().zip(sums) {
                    let v = self
                        .main
                        .stream
                        .clone_dtoh(t)
                        .map_err(err("read gradients"))?;
                    tensors.push(
                        ndarray::Array2::from_shape_vec(*shape, v)
                            .map_err(|e| BackendError(format!("gradient shape: {e}")))?,
                    );
                }
                layers.push(model::Layer {
                    kind: l.kind,
                    tensors,
                });
            }
            out.push((s as u32, layers, a.next));
        }
        Ok(out)
    }

    /// The gradients of stage `s` this rank could not add in order (a replica's: another rank
    /// ran the earlier microbatches), by microbatch, for the replica that sums them.
    pub fn take_parked(&mut self, s: u32) -> ByMicrobatch<T> {
        let Some(acc) = self.accum.get_mut(s as usize).and_then(Option::as_mut) else {
            return Vec::new();
        };
        let pending = std::mem::take(&mut acc.pending);
        pending
            .into_iter()
            .filter_map(|(mb, i)| self.parked[i].take().map(|g| (mb, g)))
            .collect()
    }

    /// Add another replica's gradients of stage `s` (from [`Self::take_parked`], possibly on
    /// another GPU) in microbatch order, after copying them onto this rank's GPU.
    pub fn absorb(&mut self, s: u32, grads: ByMicrobatch<T>) -> Result<(), BackendError> {
        for (mb, g) in grads {
            let local = copy_all(&self.main.stream, &g)?;
            drop(g);
            self.ctx.bind_to_thread().map_err(err("bind the GPU"))?;
            self.add_in_order(s as usize, mb, local)?;
        }
        Ok(())
    }

    /// A copy of stage `s`'s gradient sum and how many microbatches it holds in order.
    pub fn sum_copy(&self, s: u32) -> Result<(GSums, u32), BackendError> {
        let acc = self
            .accum
            .get(s as usize)
            .and_then(Option::as_ref)
            .ok_or_else(|| {
                BackendError(format!("{} holds no gradients of stage {s}", self.rank))
            })?;
        Ok((copy_all(&self.main.stream, &acc.sum)?, acc.next))
    }

    /// Make stage `s`'s sum the replica's reduced one, so every copy applies the same update.
    pub fn replace_sum(&mut self, s: u32, sum: &GSums, next: u32) -> Result<(), BackendError> {
        let local = copy_all(&self.main.stream, sum)?;
        self.ctx.bind_to_thread().map_err(err("bind the GPU"))?;
        if let Some(acc) = self.accum.get_mut(s as usize).and_then(Option::as_mut) {
            acc.sum = local;
            acc.next = next;
            acc.pending.clear();
        }
        Ok(())
    }

    pub fn sgd(&mut self, lr: f32) -> Result<(), BackendError> {
        for (st, a) in self.stages.iter_mut().zip(&self.accum) {
            if let (Some(st), Some(a)) = (st.as_mut(), a.as_ref()) {
                self.main.sgd(st, &a.sum, lr)?;
            }
        }
        Ok(())
    }

    fn stage(&self, t: Task) -> Result<&GStage<T>, BackendError> {
        self.stages
            .get(t.stage.index())
            .and_then(Option::as_ref)
            .ok_or_else(|| {
                BackendError(format!(
                    "{} does not hold the weights of {}",
                    self.rank, t.stage
                ))
            })
    }

    fn input(
        &self,
        dev: &Dev<T>,
        t: Task,
        input: Option<GTensor<T>>,
    ) -> Result<GTensor<T>, BackendError> {
        match (input, self.capturing()) {
            (Some(x), _) => Ok(x),
            (None, Some(g)) => Ok(GTensor::Tokens(
                dev.stream
                    .clone_dtod(&g.staged.tokens[t.mb.index()])
                    .map_err(err("copy the token ids"))?,
            )),
            (None, None) => Ok(GTensor::Tokens(
                dev.upload_u32(&model::tokens(&dev.cfg, self.step, t.mb.0))?,
            )),
        }
    }

    fn fwd_on(
        &mut self,
        side: bool,
        t: Task,
        input: Option<GTensor<T>>,
        save: bool,
    ) -> FwdResult<T> {
        let dev = if side { &self.side } else { &self.main };
        let x = self.input(dev, t, input)?;
        let st = self.stage(t)?;
        let holds_loss = st.layers.iter().any(|l| l.kind == LayerKind::Loss);
        let staged = self.capturing().map(|g| &g.staged);
        let (out, stash) = dev.stage_fwd(st, x, self.step, t.mb.0, staged)?;
        if holds_loss && self.capturing().is_some() {
            // Into the fixed buffer a replay rewrites; read after each launch.
            if let GTensor::Loss(l) = &out {
                let stream = dev.stream.clone();
                let g = self.graph.as_mut().expect("graph mode");
                let mb = t.mb.index();
                let mut slot = g.losses.slice_mut(mb..mb + 1);
                stream
                    .memcpy_dtod(l, &mut slot)
                    .map_err(err("keep the loss"))?;
                g.has_loss[mb] = true;
            }
        } else if holds_loss {
            if let GTensor::Loss(l) = &out {
                let copy = dev.stream.clone_dtod(l).map_err(err("keep the loss"))?;
                if let Some(slot) = self.losses.get_mut(t.mb.index()) {
                    *slot = Some(copy);
                }
            }
        }
        Ok((out, save.then_some(stash)))
    }

    fn bwd_w_inner(
        &mut self,
        t: Task,
        saved: &[GStash<T>],
        partial: &[GPartial<T>],
    ) -> Result<(), BackendError> {
        let staged = self.capturing().map(|g| &g.staged);
        let grads = self
            .main
            .stage_bwd_w(self.stage(t)?, saved, partial, staged)?;
        self.add_in_order(t.stage.index(), t.mb.0, grads)
    }

    /// Add microbatch `mb`'s gradients of stage `s` to its sum in microbatch order, parking
    /// early arrivals (bitwise-reproducible sums).
    fn add_in_order(&mut self, s: usize, mb: u32, grads: GGrads<T>) -> Result<(), BackendError> {
        let Some(acc) = self.accum.get_mut(s).and_then(Option::as_mut) else {
            return Ok(());
        };
        if mb != acc.next {
            self.parked.push(Some(grads));
            acc.pending.insert(mb, self.parked.len() - 1);
            return Ok(());
        }
        self.main.accumulate(&mut acc.sum, &grads)?;
        acc.next += 1;
        while let Some(i) = acc.pending.remove(&acc.next) {
            if let Some(g) = self.parked[i].take() {
                self.main.accumulate(&mut acc.sum, &g)?;
            }
            acc.next += 1;
        }
        Ok(())
    }

    /// Push the mark of a copy (`start`..`end` on the copy stream) and remember it in flight.
    fn post_copy(
        &mut self,
        task: Task,
        device: Option<Vec<GStash<T>>>,
        start: CudaEvent,
        end: CudaEvent,
    ) {
        self.marks.push(Mark {
            n: 1,
            compute: false,
            start,
            end,
            other: None,
        });
        self.copies.push_back(InFlight {
            task,
            device,
            mark: self.marks.len() - 1,
        });
        self.at += 1;
    }

    /// The copy stream waits until the compute stream has reached this point of the program:
    /// a copy starts no earlier than the rank posts it (docs/format.md).
    fn copy_after_compute(&self) -> Result<(), BackendError> {
        let posted = timing_event(&self.main.stream)?;
        self.copy_stream
            .wait(&posted)
            .map_err(err("order the copy stream"))
    }

    /// The compute stream waits for copy `pos` of [`Self::copies`], and so for every copy
    /// before it (the copy stream is in order); the device copies of the offloads among them
    /// are freed (cudarc orders each free after the copy that read the buffer).
    fn copies_ended(&mut self, pos: usize) -> Result<(), BackendError> {
        let mark = self.copies[pos].mark;
        self.main
            .stream
            .wait(&self.marks[mark].end)
            .map_err(err("wait for a copy"))?;
        self.copies.drain(..=pos);
        Ok(())
    }

    /// A backward (`bwd`, `bwd_D`) of `t` waits for `t`'s reload when it is still in flight.
    fn await_reload(&mut self, t: Task) -> Result<(), BackendError> {
        if let Some(pos) = self
            .copies
            .iter()
            .rposition(|c| c.task == t && c.device.is_none())
        {
            self.copies_ended(pos)?;
        }
        Ok(())
    }

    fn mark<R>(
        &mut self,
        f: impl FnOnce(&mut Self) -> Result<R, BackendError>,
    ) -> Result<R, BackendError> {
        let start = timing_event(&self.main.stream)?;
        let r = f(self)?;
        self.close_mark(start, true)?;
        Ok(r)
    }
}

impl<T: Elem> Backend for CudaBackend<T> {
    type Tensor = GTensor<T>;
    type Saved = Vec<GStash<T>>;
    type Partial = Vec<GPartial<T>>;
    type Host = HostStash;

    fn fwd(
        &mut self,
        task: Task,
        input: Option<GTensor<T>>,
        save: bool,
    ) -> Result<(GTensor<T>, Option<Self::Saved>), BackendError> {
        self.mark(|b| b.fwd_on(false, task, input, save))
    }

    fn bwd(
        &mut self,
        task: Task,
        saved: Self::Saved,
        grad: Option<GTensor<T>>,
    ) -> Result<GTensor<T>, BackendError> {
        self.await_reload(task)?;
        self.mark(|b| {
            let (din, partial) = b.main.stage_bwd_d(
                b.stage(task)?,
                &saved,
                grad.unwrap_or(GTensor::LossGrad),
                b.microbatches,
            )?;
            b.bwd_w_inner(task, &saved, &partial)?;
            Ok(din)
        })
    }

    fn bwd_d(
        &mut self,
        task: Task,
        saved: &Self::Saved,
        grad: Option<GTensor<T>>,
    ) -> Result<(GTensor<T>, Self::Partial), BackendError> {
        self.await_reload(task)?;
        self.mark(|b| {
            b.main.stage_bwd_d(
                b.stage(task)?,
                saved,
                grad.unwrap_or(GTensor::LossGrad),
                b.microbatches,
            )
        })
    }

    /// After `bwd_D`: free what only the input gradient read (`GStash::keep_for_w`), so the
    /// GPU holds `act_w` until `bwd_W`, as the interpreter then meters and the verifier counts.
    /// Each buffer is freed on the stream that allocated it (the side stream for an overlapped
    /// pair's forward), after the `bwd_D` that read it (cudarc's buffer events).
    fn keep_for_w(&mut self, _: Task, saved: &mut Self::Saved) -> Result<bool, BackendError> {
        for st in saved.iter_mut() {
            st.keep_for_w();
        }
        Ok(true)
    }

    fn bwd_w(
        &mut self,
        task: Task,
        saved: Self::Saved,
        partial: Self::Partial,
    ) -> Result<(), BackendError> {
        self.mark(|b| b.bwd_w_inner(task, &saved, &partial))
    }

    /// The forward on the side stream, the backward on the main stream: the GPU runs them
    /// concurrently (cudarc orders each buffer's readers and writers across streams).
    fn fwd_bwd(
        &mut self,
        fwd: Task,
        input: Option<GTensor<T>>,
        save: bool,
        bwd: Task,
        saved: Self::Saved,
        grad: Option<GTensor<T>>,
    ) -> Result<(GTensor<T>, Option<Self::Saved>, GTensor<T>), BackendError> {
        self.side
            .stream
            .join(&self.main.stream)
            .map_err(err("order streams"))?;
        let s2 = timing_event(&self.side.stream)?;
        let (out, stash) = self.fwd_on(true, fwd, input, save)?;
        let e2 = timing_event(&self.side.stream)?;
        // Only the backward half waits for its reload.
        self.await_reload(bwd)?;
        let start = timing_event(&self.main.stream)?;
        let (din, partial) = self.main.stage_bwd_d(
            self.stage(bwd)?,
            &saved,
            grad.unwrap_or(GTensor::LossGrad),
            self.microbatches,
        )?;
        self.bwd_w_inner(bwd, &saved, &partial)?;
        let end = timing_event(&self.main.stream)?;
        // Program order: what follows waits for both halves.
        self.main.stream.wait(&e2).map_err(err("order streams"))?;
        self.marks.push(Mark {
            n: 1,
            compute: true,
            start,
            end,
            other: Some((s2, e2)),
        });
        self.at += 1;
        Ok((out, stash, din))
    }

    /// A device copy of a checkpointed forward's input, on the compute stream.
    fn keep(&mut self, input: &GTensor<T>) -> Result<GTensor<T>, BackendError> {
        let s = &self.main.stream;
        let e = || err("keep a checkpointed forward's input");
        Ok(match input {
            GTensor::Tokens(t) => GTensor::Tokens(s.clone_dtod(t).map_err(e())?),
            GTensor::Hidden(h) => GTensor::Hidden(s.clone_dtod(h).map_err(e())?),
            GTensor::Loss(l) => GTensor::Loss(s.clone_dtod(l).map_err(e())?),
            GTensor::LossGrad => GTensor::LossGrad,
            GTensor::TokenGrad => GTensor::TokenGrad,
        })
    }

    /// Device to pinned host memory on the copy stream, after the compute stream has reached
    /// the offload (its forward has ended); the device stash stays allocated until the copy is
    /// known to have ended.
    fn offload(&mut self, task: Task, saved: Self::Saved) -> Result<Self::Host, BackendError> {
        self.copy_after_compute()?;
        let start = timing_event(&self.copy_stream)?;
        let host = self.pinned.offload(&self.copy_stream, &saved)?;
        let end = timing_event(&self.copy_stream)?;
        self.post_copy(task, Some(saved), start, end);
        let id = self.next_host;
        self.next_host += 1;
        self.host.insert(id, host);
        Ok(HostStash(id))
    }

    /// The compute stream waits for `task`'s latest offload still in flight (none: an
    /// earlier wait covered it); its span is how long compute stalled.
    fn wait_offload(&mut self, task: Task) -> Result<(), BackendError> {
        let start = timing_event(&self.main.stream)?;
        if let Some(pos) = self
            .copies
            .iter()
            .rposition(|c| c.task == task && c.device.is_some())
        {
            self.copies_ended(pos)?;
        }
        self.close_mark(start, false)
    }

    /// Fresh device buffers on the compute stream, filled from the pinned copy on the copy
    /// stream; the backward waits for the copy ([`Self::await_reload`]).
    fn reload(&mut self, task: Task, host: Self::Host) -> Result<Self::Saved, BackendError> {
        let host = self.host.remove(&host.0).ok_or_else(|| {
            BackendError(format!(
                "{}: the host copy of {task} is not in this backend's host store",
                self.rank
            ))
        })?;
        let mut dev = Pinned::alloc_like(&self.main.stream, &host)?;
        self.copy_after_compute()?;
        let start = timing_event(&self.copy_stream)?;
        self.pinned.reload(&self.copy_stream, host, &mut dev)?;
        let end = timing_event(&self.copy_stream)?;
        self.post_copy(task, None, start, end);
        Ok(dev)
    }

    fn exchange(&mut self, ops: &mut [CommOp<GTensor<T>>]) -> Result<(), CommError> {
        let r = (|| {
            if let Err(e) = self.post_batch(ops)? {
                return Ok(Err(e));
            }
            let end = match self.finish_batch(ops)? {
                Ok(end) => end,
                Err(e) => return Ok(Err(e)),
            };
            // Compute goes on only once the batch is done, as the program says.
            self.main.stream.wait(&end).map_err(err("order streams"))?;
            if let Some(m) = self.marks.last_mut() {
                m.end = end;
            }
            Ok(Ok(()))
        })();
        self.comm_result(r, ops)
    }

    /// Post the batch on the comm stream and leave it there: compute goes on until the `wait`
    /// that names it ([`Backend::complete`]). Single process only; `run_cuda` refuses programs
    /// with waits under NCCL (see there).
    fn post(&mut self, ops: &mut [CommOp<GTensor<T>>]) -> Result<(), CommError> {
        let r = (|| {
            let posted = self.post_batch(ops)?;
            if posted.is_ok() {
                let key = ops.first().map_or(u32::MAX, |o| o.at);
                self.in_flight.push((key, self.marks.len() - 1));
            }
            Ok(posted)
        })();
        self.comm_result(r, ops)
    }

    /// The `wait` of a batch left in flight: receive what arrived (the rendezvous), then make
    /// the compute stream wait for the batch's last copy. The wait itself gets its own span
    /// (on the compute stream: how long compute stalled for it); the batch's span runs from its
    /// post to its completion.
    fn complete(&mut self, ops: &mut [CommOp<GTensor<T>>]) -> Result<(), CommError> {
        let r = (|| {
            let key = ops.first().map_or(u32::MAX, |o| o.at);
            let Some(pos) = self.in_flight.iter().position(|&(k, _)| k == key) else {
                return Err(BackendError(
                    "a wait for a batch this backend did not post".into(),
                ));
            };
            let (_, mark) = self.in_flight.swap_remove(pos);
            let start = timing_event(&self.main.stream)?;
            let end = match self.finish_batch(ops)? {
                Ok(end) => end,
                Err(e) => return Ok(Err(e)),
            };
            self.main.stream.wait(&end).map_err(err("order streams"))?;
            self.marks[mark].end = end;
            self.close_mark(start, false)?;
            Ok(Ok(()))
        })();
        self.comm_result(r, ops)
    }

    fn rewait(&mut self) {
        let r = timing_event(&self.main.stream).and_then(|start| self.close_mark(start, false));
        if let Err(e) = r {
            self.watch.fail(Failure {
                kind: FailureKind::Compute,
                at: InstrRef {
                    rank: self.rank,
                    index: self.at,
                },
                report: format!("{}: {}", self.rank, e.0),
            });
        }
    }

    fn finish(&mut self) {
        if let Net::Local(t) = &self.net {
            t.finish(self.rank);
        }
    }
}

/// A failed captured step leaves the capture open: end it before the fields drop (the cuBLAS
/// handles' destruction synchronizes the device, which an active capture forbids).
impl<T: Elem> Drop for CudaBackend<T> {
    fn drop(&mut self) {
        if let Some(g) = &self.graph {
            g.capture.leave();
        }
    }
}
