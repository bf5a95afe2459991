//! Point-to-point for the CUDA backend, on a communication stream ordered against compute
//! with events (the comm stream waits for the compute issued before the batch; compute waits
//! for the batch before it goes on, as the interpreter's program order says).
//!
//! - [`Net::Nccl`]: one process per rank; each comm batch is one `ncclGroupStart/End` of
//!   `ncclSend`/`ncclRecv`. NCCL matches sends and receives per peer in FIFO order, the rule the
//!   verifier proves schedules against. Receive sizes come from the layout ([`wire`]).
//! - [`Net::Local`]: several ranks in one process (one thread each, one or several GPUs): the
//!   runtime's rendezvous [`Transport`] matches and checks payloads exactly as for the CPU
//!   backend, and the receiver copies the sender's buffer on its own comm stream (a
//!   device-to-device or peer copy), so the rendezvous semantics are kept.

use super::capture::Capture;
use super::model::{err, Elem, GTensor};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, SyncOnDrop};
use cudarc::nccl::Comm;
use pipec_ir::ir::{Payload, PayloadKind};
use pipec_runtime::backend::{BackendError, CommOp, Dir};
use pipec_runtime::transport::Transport;
use pipec_schedules::layout::{LayerKind, Layout};
use std::sync::Arc;

pub enum Net<T> {
    Local(Arc<Transport<GTensor<T>>>),
    Nccl(Comm),
}

/// What a message carries, derived from the layout (NCCL receives need the size up front).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Wire {
    Tokens,
    Hidden,
    Loss,
    /// `LossGrad`/`TokenGrad`: no data; one byte travels so the pair still rendezvous.
    Empty,
}

/// The tensor kind of `p` under `layout`: the activation leaving stage `s` is token ids while no
/// layer has run yet, a loss once `L` has, else hidden; the gradient leaving stage `s` (of its
/// input) likewise by what its input is.
pub fn wire(layout: &Layout, p: Payload) -> Wire {
    let s = p.stage.index();
    let upto = |end: usize| layout.stages.iter().take(end).flatten().copied();
    let kinds_before: Vec<LayerKind> = match p.kind {
        PayloadKind::Act | PayloadKind::ActShape => upto(s + 1).collect(),
        PayloadKind::Grad | PayloadKind::GradShape => upto(s).collect(),
    };
    let (any, loss) = (
        !kinds_before.is_empty(),
        kinds_before.contains(&LayerKind::Loss),
    );
    match (p.kind, any, loss) {
        (PayloadKind::Act, false, _) => Wire::Tokens,
        (PayloadKind::Act, true, true) => Wire::Loss,
        (PayloadKind::Act, true, false) => Wire::Hidden,
        (PayloadKind::Grad, true, false) => Wire::Hidden,
        (PayloadKind::Grad, _, _) => Wire::Empty,
        // Megatron's shape messages: the loader refuses programs with them; were one run, it
        // would carry no tensor.
        (PayloadKind::ActShape | PayloadKind::GradShape, _, _) => Wire::Empty,
    }
}

/// Copy `src` (possibly on another device) into a new buffer on `stream`.
///
/// Same GPU: cudarc's `clone_dtod` orders the copy after `src`'s last write and records `src`'s
/// read event on `stream`, so dropping `src` (a stream-ordered `cuMemFreeAsync` on the stream
/// that allocated it) waits for the copy.
///
/// Another GPU: `src.device_ptr(stream)` still makes `stream` wait for `src`'s last write
/// (`cuStreamWaitEvent` accepts an event of another context and then synchronizes across
/// devices), but the guard it returns would record `src`'s read event, an event of `src`'s
/// context, on `stream`: `CudaEvent::record` refuses a stream of another context with
/// `CUDA_ERROR_INVALID_CONTEXT` (cudarc `driver/safe/core.rs`, `CudaEvent::record`), the guard
/// stores that error in `stream`'s context (`SyncOnDrop::drop`, `record_err`) and the next cudarc
/// call on this rank fails with it. So the guard is disarmed, and instead `src`'s own stream is
/// made to wait for an event recorded after the copy, so that its free cannot overtake the copy
/// (cudarc's own cross-context `memcpy_dtod` records the read event on the source stream before
/// the copy is even enqueued, which does not order the free either).
pub fn copy_in<U: DeviceRepr>(
    stream: &Arc<CudaStream>,
    src: &CudaSlice<U>,
) -> Result<CudaSlice<U>, BackendError> {
    if src.context().ordinal() == stream.context().ordinal() {
        return stream.clone_dtod(src).map_err(err("device-to-device copy"));
    }
    let mut dst = unsafe { stream.alloc::<U>(src.len()) }.map_err(err("allocate"))?;
    {
        let (sp, mut rs) = src.device_ptr(stream);
        disarm(&mut rs);
        let (dp, _rd) = dst.device_ptr_mut(stream);
        unsafe {
            cudarc::driver::result::memcpy_peer_async(
                stream.context().cu_ctx(),
                dp,
                src.context().cu_ctx(),
                sp,
                src.num_bytes(),
                stream.cu_stream(),
            )
        }
        .map_err(err("peer copy between GPUs"))?;
    }
    let copied = stream.record_event(None).map_err(err("record an event"))?;
    src.stream()
        .wait(&copied)
        .map_err(err("order the source's free after the peer copy"))?;
    // `wait` made `src`'s context current on this thread; cuBLAS calls do not rebind it.
    stream
        .context()
        .bind_to_thread()
        .map_err(err("bind the GPU"))?;
    Ok(dst)
}

/// Make a [`SyncOnDrop`] guard record nothing when dropped.
fn disarm(guard: &mut SyncOnDrop<'_>) {
    match guard {
        SyncOnDrop::Record(target) => *target = None,
        SyncOnDrop::Sync(target) => *target = None,
    }
}

/// Post one batch over NCCL as one group. Receives get buffers of the size [`wire`] says.
pub fn nccl_batch<T: Elem>(
    comm: &Comm,
    stream: &Arc<CudaStream>,
    layout: &Layout,
    seq: usize,
    hidden: usize,
    ops: &mut [CommOp<GTensor<T>>],
) -> Result<(), BackendError> {
    use cudarc::nccl::result::{group_end, group_start};
    let nerr = |what: &'static str| {
        move |e: cudarc::nccl::result::NcclError| BackendError(format!("NCCL {what}: {:?}", e.0))
    };
    let empty_is_loss_grad = |p: Payload| {
        // The gradient of an input that is a loss (stages after `L`).
        layout
            .stages
            .iter()
            .take(p.stage.index())
            .flatten()
            .any(|&k| k == LayerKind::Loss)
    };
    // Buffers for the receives, allocated before the group.
    let mut recv: Vec<Option<GTensor<T>>> = Vec::with_capacity(ops.len());
    let mut dummies: Vec<CudaSlice<u8>> = Vec::new();
    for op in ops.iter() {
        recv.push(match op.dir {
            Dir::Send => None,
            Dir::Recv => Some(match wire(layout, op.payload) {
                Wire::Tokens => {
                    GTensor::Tokens(stream.alloc_zeros::<u32>(seq).map_err(err("allocate"))?)
                }
                Wire::Hidden => GTensor::Hidden(
                    stream
                        .alloc_zeros::<T>(seq * hidden)
                        .map_err(err("allocate"))?,
                ),
                Wire::Loss => GTensor::Loss(stream.alloc_zeros::<f32>(1).map_err(err("allocate"))?),
                Wire::Empty => {
                    if empty_is_loss_grad(op.payload) {
                        GTensor::LossGrad
                    } else {
                        GTensor::TokenGrad
                    }
                }
            }),
        });
    }
    for op in ops.iter() {
        if matches!(op.dir, Dir::Send) {
            if let Some(GTensor::LossGrad | GTensor::TokenGrad) = op.tensor {
                dummies.push(stream.alloc_zeros::<u8>(1).map_err(err("allocate"))?);
            }
        }
    }
    group_start().map_err(nerr("group start"))?;
    let mut posted: Result<(), BackendError> = Ok(());
    let mut recv_dummies: Vec<CudaSlice<u8>> = Vec::new();
    let mut d = 0;
    for (op, slot) in ops.iter_mut().zip(recv.iter_mut()) {
        let peer = op.peer.0 as i32;
        let r = match op.dir {
            Dir::Send => match op.tensor.as_ref() {
                Some(GTensor::Tokens(t)) => comm.send(t, peer),
                Some(GTensor::Hidden(t)) => comm.send(t, peer),
                Some(GTensor::Loss(t)) => comm.send(t, peer),
                Some(GTensor::LossGrad | GTensor::TokenGrad) => {
                    d += 1;
                    comm.send(&dummies[d - 1], peer)
                }
                None => {
                    posted = Err(BackendError("a send without its tensor".into()));
                    break;
                }
            },
            Dir::Recv => match slot.as_mut() {
                Some(GTensor::Tokens(t)) => comm.recv(t, peer).map(|_| ()),
                Some(GTensor::Hidden(t)) => comm.recv(t, peer).map(|_| ()),
                Some(GTensor::Loss(t)) => comm.recv(t, peer).map(|_| ()),
                _ => {
                    // Allocation inside a group is allowed: it is not an NCCL call.
                    match stream.alloc_zeros::<u8>(1) {
                        Ok(b) => {
                            recv_dummies.push(b);
                            let b = recv_dummies.last_mut().expect("just pushed");
                            comm.recv(b, peer).map(|_| ())
                        }
                        Err(e) => {
                            posted = Err(err("allocate")(e));
                            break;
                        }
                    }
                }
            },
        };
        if let Err(e) = r {
            posted = Err(nerr("send/recv")(e));
            break;
        }
    }
    group_end().map_err(nerr("group end"))?;
    posted?;
    // cudarc's `Comm::send`/`Comm::recv` record the buffer's read/write event when they return,
    // that is inside the group, before `ncclGroupEnd` enqueues the NCCL kernel (cudarc's own
    // `nccl::Group` defers those records past `group_end` for this reason, nccl/safe.rs). Such
    // events do not cover the transfer: a sent buffer's stream-ordered free, or a reader on
    // another stream, would not wait for it. Record them again, now after the kernel.
    for (op, slot) in ops.iter().zip(recv.iter_mut()) {
        match op.dir {
            Dir::Send => match op.tensor.as_ref() {
                Some(GTensor::Tokens(t)) => drop(t.device_ptr(stream)),
                Some(GTensor::Hidden(t)) => drop(t.device_ptr(stream)),
                Some(GTensor::Loss(t)) => drop(t.device_ptr(stream)),
                _ => {}
            },
            Dir::Recv => match slot.as_mut() {
                Some(GTensor::Tokens(t)) => drop(t.device_ptr_mut(stream)),
                Some(GTensor::Hidden(t)) => drop(t.device_ptr_mut(stream)),
                Some(GTensor::Loss(t)) => drop(t.device_ptr_mut(stream)),
                _ => {}
            },
        }
    }
    for (op, slot) in ops.iter_mut().zip(recv) {
        op.tensor = slot;
    }
    Ok(())
}

/// [`local_receive`] while a step is captured (`--cuda-graph`), where cudarc's buffer events
/// are off: the copy waits for the sender's post ([`Capture::after_post`]), and the sender's
/// stream waits for the copy before the sent buffer is freed on it (the graph's free node must
/// follow every read). One GPU (graph mode refuses several).
pub fn local_receive_captured<T: Elem>(
    stream: &Arc<CudaStream>,
    ops: &mut [CommOp<GTensor<T>>],
    capture: &Capture,
) -> Result<(), BackendError> {
    fn copy<U: DeviceRepr>(
        stream: &Arc<CudaStream>,
        src: CudaSlice<U>,
    ) -> Result<CudaSlice<U>, BackendError> {
        // SAFETY: every element is written by the copy below before any read.
        let mut dst = unsafe { stream.alloc::<U>(src.len()) }.map_err(err("allocate"))?;
        stream
            .memcpy_dtod(&src, &mut dst)
            .map_err(err("device-to-device copy"))?;
        let copied = stream.record_event(None).map_err(err("record an event"))?;
        src.stream()
            .wait(&copied)
            .map_err(err("order the sent buffer's free after the copy"))?;
        drop(src);
        Ok(dst)
    }
    for op in ops.iter_mut().filter(|o| o.dir == Dir::Recv) {
        if matches!(
            op.tensor,
            Some(GTensor::Tokens(_) | GTensor::Hidden(_) | GTensor::Loss(_))
        ) {
            capture.after_post(op.peer.0, stream)?;
        }
        op.tensor = match op.tensor.take() {
            Some(GTensor::Tokens(t)) => Some(GTensor::Tokens(copy(stream, t)?)),
            Some(GTensor::Hidden(t)) => Some(GTensor::Hidden(copy(stream, t)?)),
            Some(GTensor::Loss(t)) => Some(GTensor::Loss(copy(stream, t)?)),
            other => other,
        };
    }
    Ok(())
}

/// After the local transport delivered sender-owned buffers, copy them onto this rank's comm
/// stream.
pub fn local_receive<T: Elem>(
    stream: &Arc<CudaStream>,
    ops: &mut [CommOp<GTensor<T>>],
) -> Result<(), BackendError> {
    for op in ops.iter_mut().filter(|o| o.dir == Dir::Recv) {
        op.tensor = match op.tensor.take() {
            Some(GTensor::Tokens(t)) => Some(GTensor::Tokens(copy_in(stream, &t)?)),
            Some(GTensor::Hidden(t)) => Some(GTensor::Hidden(copy_in(stream, &t)?)),
            Some(GTensor::Loss(t)) => Some(GTensor::Loss(copy_in(stream, &t)?)),
            other => other,
        };
    }
    // Dropping another GPU's buffer (`CudaSlice::drop` waits on its events through its own
    // stream) makes that GPU's context current on this thread; rebind ours.
    stream
        .context()
        .bind_to_thread()
        .map_err(err("bind the GPU"))?;
    Ok(())
}
