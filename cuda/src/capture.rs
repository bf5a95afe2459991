//! The captured step of `pipec-run --backend cuda --cuda-graph` (issue #39, "A captured step").
//! [`crate::graph`] decides which programs qualify.
//!
//! Step 1 runs eagerly (the warm-up: kernels loaded, cuBLAS initialised, memory pools grown).
//! Step 2 is captured: every rank thread of the process issues its step into one stream capture,
//! forked from an origin stream (`cuStreamBeginCapture`, then each rank's stream waits for an
//! event recorded in the capture, which joins it; CUDA Programming Guide, "Cross-stream
//! Dependencies and Events"), and joined back into the origin at the end, once no rank thread
//! issues work any more, so the hand-overs between ranks' streams are edges of one graph. The
//! graph is instantiated and launched for step 2 and relaunched for every later step; the host
//! runs no interpreter then. The capture is in relaxed mode: whichever rank thread arrives last
//! at a meeting ends it, where the other modes want the thread that began it
//! (`CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD`).
//!
//! What makes that sound:
//! - cudarc's per-buffer event tracking is turned off for the capture and after it: a capturing
//!   stream may not wait for an event recorded outside the capture (the guide's "Prohibited and
//!   Unhandled Operations"), which is what cudarc would do on the first use of every weight.
//!   Without it, each rank runs all its work on one stream (its compute stream: the side, comm
//!   and copy streams are the same stream in this mode), so a rank's buffers are ordered by
//!   that stream; across ranks the receiver waits for the sender's event recorded at the post
//!   and takes the sent buffer over (it is freed on the receiver's stream after its last use),
//!   so nothing is issued into another rank's stream ([`Capture::post`],
//!   [`Capture::after_post`], `comm::local_receive_captured`).
//! - inputs that change per step (token ids, targets, the embedding gradient's grouping, padded
//!   to a fixed length: `kernels::EmbedPlan::padded`) live in buffers allocated before capture
//!   and refilled before each launch ([`Staged`]); losses are copied into a fixed buffer.
//! - cuBLAS gets a workspace of its own before capture (`cublasSetWorkspace`), so it allocates
//!   nothing while capturing (`cublasSetStream` would reset it: the handles keep their stream).
//! - every allocation inside the capture is freed inside it; the graph is instantiated without
//!   `AUTO_FREE_ON_LAUNCH`, so one that escaped would fail the next launch loudly instead of
//!   being freed under a buffer the host still holds.
//! - a step that fails while captured leaves the capture open; it is ended once every rank
//!   thread of the process has stopped issuing work ([`Capture::leave`]), before any cuBLAS
//!   handle is destroyed (which synchronizes the device, not allowed while capturing).
//! - the host never polls a capturing stream: completion is polled on the origin stream after
//!   each launch, under the run's timeout.

use super::model::{err, Staged};
use cudarc::driver::sys::{CUevent_flags, CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaContext, CudaEvent, CudaGraph, CudaSlice, CudaStream};
use pipec_runtime::backend::BackendError;
use pipec_runtime::watchdog::Watch;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// A driver error as a meeting's outcome, saying what failed.
fn fails(what: &'static str) -> impl Fn(cudarc::driver::DriverError) -> String {
    move |x| format!("{what}: {x:?}")
}

/// An instantiated graph. cudarc's `CudaGraph` is not `Send` (graph objects are not internally
/// synchronized, CUDA Driver API "Graph object thread safety"); this one lives in
/// [`Capture`]'s mutex and is touched only under it.
struct Graph(CudaGraph);
// SAFETY: every use is under `Capture::state`'s lock, which serializes them as CUDA requires.
unsafe impl Send for Graph {}

/// What the rank threads of one process share for the capture and the replays.
pub struct Capture {
    /// Rank threads of this process.
    n: usize,
    ctx: Arc<CudaContext>,
    watch: Arc<Watch>,
    timeout: Duration,
    /// The stream the capture is forked from and joined into, and the graph launched on.
    origin: Arc<CudaStream>,
    state: Mutex<State>,
    cv: Condvar,
    /// Per rank, the event recorded on its stream at its latest comm post (see the module doc).
    posted: Vec<Mutex<Option<Arc<CudaEvent>>>>,
}

#[derive(Default)]
struct State {
    /// Completed meetings, so a thread can tell its own meeting's end.
    generation: u64,
    /// (rank, its stream) of the threads at the current meeting.
    arrived: Vec<(u32, Arc<CudaStream>)>,
    /// The outcome of the last meeting, for every thread of it.
    outcome: Option<Result<Met, String>>,
    graph: Option<Graph>,
    /// Rank threads whose backend is being dropped ([`Capture::leave`]).
    left: usize,
}

/// What a meeting hands every rank thread.
#[derive(Clone)]
pub enum Met {
    /// Capture began: join it by waiting for this event.
    Fork(Arc<CudaEvent>),
    /// The graph ran: its GPU time in microseconds, and the most memory the graph's own
    /// allocations held on the GPU during it (CUDA keeps them in a pool of their own, which the
    /// device pool's watermark does not see), in bytes.
    Ran(f64, u64),
}

/// What a meeting does once every rank thread has arrived with its event.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Meeting {
    /// Wait for the ranks' events (their staged inputs), then begin capturing.
    Begin,
    /// Join the ranks' streams into the origin, end the capture, instantiate, launch.
    End,
    /// Wait for the ranks' events (inputs, SGD), then relaunch.
    Replay,
}

impl Capture {
    /// `ranks`: the world size (ranks index [`Self::posted`]); `n`: the rank threads here.
    pub fn new(
        ctx: Arc<CudaContext>,
        ranks: usize,
        n: usize,
        watch: Arc<Watch>,
        timeout: Duration,
    ) -> Result<Self, BackendError> {
        Ok(Capture {
            n,
            origin: ctx.new_stream().map_err(err("create a stream"))?,
            ctx,
            watch,
            timeout,
            state: Mutex::new(State::default()),
            cv: Condvar::new(),
            posted: (0..ranks).map(|_| Mutex::new(None)).collect(),
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Record where `rank`'s stream is at a comm post (its stream has joined its compute).
    pub fn post(&self, rank: u32, stream: &CudaStream) -> Result<(), BackendError> {
        let e = stream
            .record_event(None)
            .map_err(err("record a post event"))?;
        *self.posted[rank as usize]
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = Some(Arc::new(e));
        Ok(())
    }

    /// Make `stream` wait for `rank`'s latest post: at or after the post of any message of
    /// `rank`'s this thread has received (the rendezvous completed after it).
    pub fn after_post(&self, rank: u32, stream: &CudaStream) -> Result<(), BackendError> {
        let e = self.posted[rank as usize]
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        match e {
            Some(e) => stream.wait(&e).map_err(err("wait for the sender's post")),
            None => Err(BackendError(format!(
                "received from rank {rank} before it posted anything"
            ))),
        }
    }

    /// Meet every rank thread of the process, each with its stream; the last to arrive does
    /// `what` for all, ordering the origin after every stream's work so far (no thread issues
    /// any more work then). Gives up after the run's timeout, or when another rank has failed
    /// (the watch holds its report).
    pub fn meet(
        &self,
        rank: u32,
        what: Meeting,
        stream: Arc<CudaStream>,
    ) -> Result<Met, BackendError> {
        let mut st = self.lock();
        let generation = st.generation;
        st.arrived.push((rank, stream));
        if st.arrived.len() == self.n {
            let streams: Vec<Arc<CudaStream>> = std::mem::take(&mut st.arrived)
                .into_iter()
                .map(|a| a.1)
                .collect();
            let outcome = self.lead(&mut st, what, &streams);
            st.outcome = Some(outcome.clone());
            st.generation += 1;
            self.cv.notify_all();
            return outcome.map_err(BackendError);
        }
        let t0 = Instant::now();
        while st.generation == generation {
            if t0.elapsed() > self.timeout || self.watch.failure().is_some() {
                // Not at this meeting any more: a later one must not count this thread.
                st.arrived.retain(|a| a.0 != rank);
                return Err(BackendError(format!(
                    "the rank threads did not all reach the captured step's {} within {:.1} s",
                    match what {
                        Meeting::Begin => "start",
                        Meeting::End | Meeting::Replay => "launch",
                    },
                    self.timeout.as_secs_f64()
                )));
            }
            st = self
                .cv
                .wait_timeout(st, Duration::from_millis(50))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        st.outcome
            .clone()
            .unwrap_or_else(|| Err("a capture meeting ended without an outcome".into()))
            .map_err(BackendError)
    }

    fn lead(
        &self,
        st: &mut State,
        what: Meeting,
        streams: &[Arc<CudaStream>],
    ) -> Result<Met, String> {
        let origin = &self.origin;
        match what {
            Meeting::Begin => {
                // Before capture begins: the ranks' staged inputs, recorded outside it.
                for s in streams {
                    origin.join(s).map_err(fails("order the origin stream"))?;
                }
                origin
                    .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
                    .map_err(fails("begin the capture (cuStreamBeginCapture)"))?;
                let fork = origin
                    .record_event(None)
                    .map_err(fails("record the capture's fork"))?;
                Ok(Met::Fork(Arc::new(fork)))
            }
            Meeting::End => {
                // Every rank thread is here, so each stream's captured work is complete
                // (frees included): join them all back into the origin.
                let joined: Result<(), String> = streams
                    .iter()
                    .try_for_each(|s| origin.join(s).map_err(fails("join a rank's stream")));
                let graph = origin.end_capture(CUgraphInstantiate_flags(0));
                joined?;
                let graph = graph
                    .map_err(|x| {
                        format!(
                            "the step could not be captured: {x:?} (a CUDA call the capture \
                             does not allow was made during it)"
                        )
                    })?
                    .ok_or("the capture recorded no GPU work".to_string())?;
                graph.upload().map_err(fails("upload the graph"))?;
                st.graph = Some(Graph(graph));
                self.launch(st, &[])
            }
            Meeting::Replay => self.launch(st, streams),
        }
    }

    /// Launch the graph on the origin stream after the work on `streams` (inputs, updates), and
    /// wait for it (polled, so a step that never ends is an error after the timeout).
    fn launch(&self, st: &mut State, streams: &[Arc<CudaStream>]) -> Result<Met, String> {
        let origin = &self.origin;
        let Some(graph) = st.graph.as_ref() else {
            return Err("no captured step to launch".into());
        };
        for s in streams {
            origin.join(s).map_err(fails("order the origin stream"))?;
        }
        self.graph_mem_high(Some(0))?;
        let timing = Some(CUevent_flags::CU_EVENT_DEFAULT);
        let start = origin
            .record_event(timing)
            .map_err(fails("record an event"))?;
        graph.0.launch().map_err(fails("launch the graph"))?;
        let end = origin
            .record_event(timing)
            .map_err(fails("record an event"))?;
        let done = super::poll::poll_until(self.timeout, || {
            end.try_is_complete().map_err(fails("the captured step"))
        })?;
        if !done {
            return Err(format!(
                "the captured step did not finish within {:.1} s",
                self.timeout.as_secs_f64()
            ));
        }
        let ms = start.elapsed_ms(&end).map_err(fails("read an event"))?;
        Ok(Met::Ran(ms as f64 * 1000.0, self.graph_mem_high(None)?))
    }

    /// A rank thread's backend is being dropped. Once every rank thread of the process is here
    /// (or after the timeout), a capture a failed step left open is ended and discarded, so
    /// that no cuBLAS handle is destroyed (a device synchronization) while it is active. Ended
    /// only when nobody issues work any more: a stream leaving the capture would run the rest
    /// of its captured step eagerly.
    pub fn leave(&self) {
        use cudarc::driver::sys::CUstreamCaptureStatus;
        let capturing = || {
            self.origin
                .capture_status()
                .is_ok_and(|c| c != CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
        };
        let mut st = self.lock();
        st.left += 1;
        self.cv.notify_all();
        if !capturing() {
            return;
        }
        let t0 = Instant::now();
        while st.left < self.n && t0.elapsed() <= self.timeout {
            st = self
                .cv
                .wait_timeout(st, Duration::from_millis(50))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        if capturing() {
            // The failure is already reported; this only releases the capture.
            let _ = self.origin.end_capture(CUgraphInstantiate_flags(0));
        }
    }

    /// The high watermark of graph allocations on this GPU (`CU_GRAPH_MEM_ATTR_USED_MEM_HIGH`),
    /// after resetting it to `reset` when given (CUDA allows only 0).
    fn graph_mem_high(&self, reset: Option<u64>) -> Result<u64, String> {
        use cudarc::driver::sys::{
            cuDeviceGetGraphMemAttribute, cuDeviceSetGraphMemAttribute, CUgraphMem_attribute,
        };
        let attr = CUgraphMem_attribute::CU_GRAPH_MEM_ATTR_USED_MEM_HIGH;
        let mut v = reset.unwrap_or(0);
        // SAFETY: the attribute is a cuuint64_t read from or written into `v`.
        unsafe {
            match reset {
                Some(_) => cuDeviceSetGraphMemAttribute(
                    self.ctx.cu_device(),
                    attr,
                    (&mut v as *mut u64).cast(),
                ),
                None => cuDeviceGetGraphMemAttribute(
                    self.ctx.cu_device(),
                    attr,
                    (&mut v as *mut u64).cast(),
                ),
            }
        }
        .result()
        .map_err(|x| format!("the graph memory watermark: {x:?}"))?;
        Ok(v)
    }
}

/// One rank's part of graph mode.
pub struct RankGraph {
    pub capture: Arc<Capture>,
    pub staged: Staged,
    /// Each microbatch's loss, where this rank computes it ([`Self::has_loss`]).
    pub losses: CudaSlice<f32>,
    pub has_loss: Vec<bool>,
    /// cuBLAS workspaces of the rank's handles, kept as long as the handles.
    pub workspaces: Vec<CudaSlice<u8>>,
    /// The captured step's metering, which every replay repeats.
    pub captured: Option<pipec_runtime::interp::RankRun>,
}

impl RankGraph {
    pub fn new(
        capture: Arc<Capture>,
        stream: &Arc<CudaStream>,
        microbatches: u32,
        seq: usize,
    ) -> Result<Self, BackendError> {
        Ok(RankGraph {
            capture,
            staged: Staged::new(stream, microbatches, seq)?,
            losses: stream
                .alloc_zeros::<f32>(microbatches.max(1) as usize)
                .map_err(err("allocate"))?,
            has_loss: vec![false; microbatches as usize],
            workspaces: Vec::new(),
            captured: None,
        })
    }
}
