//! Point-to-point for the CUDA backend, on communication streams ordered against compute with
//! events (they wait for the compute issued before the batch; compute waits for the batch
//! before it goes on, as the interpreter's program order says).
//!
//! - [`Net::Nccl`]: one process per rank, one NCCL communicator per P2P group of the program
//!   ([`crate::groups`], `--p2p-groups`), each on a stream of its own; each comm batch is one
//!   `ncclGroupStart/End` of `ncclSend`/`ncclRecv`, every op on its group's communicator.
//!   NCCL matches sends and receives per communicator and peer in FIFO order, the rule the
//!   verifier proves schedules against. Receive sizes come from the layout ([`wire`]).
//! - [`Net::Local`]: several ranks in one process (one thread each, one or several GPUs): the
//!   runtime's rendezvous [`Transport`] matches and checks payloads exactly as for the CPU
//!   backend, and the receiver copies the sender's buffer on its own comm stream (a
//!   device-to-device or peer copy), so the rendezvous semantics are kept.

use super::capture::Capture;
use super::groups::GroupPlan;
use super::model::{err, Elem, GTensor};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, SyncOnDrop};
use cudarc::nccl::Comm;
use pipec_ir::ir::{Payload, PayloadKind};
use pipec_runtime::backend::{BackendError, CommOp, Dir};
use pipec_runtime::transport::Transport;
use pipec_schedules::layout::{LayerKind, Layout};
use pipec_schedules::Rank;
use std::sync::Arc;

pub enum Net<T> {
    Local(Arc<Transport<GTensor<T>>>),
    Nccl(NcclNet),
}

/// A rank's NCCL communicators in a multi-process run.
///
/// Field order is drop order: every `Comm` drops as `ncclCommAbort` (cudarc), which does not
/// wait for a peer, so none of them can block the backend's drop after a hang.
pub struct NcclNet {
    /// Over all ranks, on the rank's comm stream: the all-reduce of the step's losses
    /// ([`crate::device::CudaBackend::all_losses`]), which every rank joins whatever the P2P
    /// groups (a `pair` or `edge` group holds two ranks only).
    pub world: Comm,
    /// Per group of [`NcclNet::plan`] (same index), this rank's communicator, on its own
    /// stream; `None` for a group this rank is not in.
    pub groups: Vec<Option<Comm>>,
    pub plan: Arc<GroupPlan>,
    pub rank: Rank,
}

impl NcclNet {
    /// Join this rank's communicators: the one over all ranks on `stream` (the rank's comm
    /// stream), then one per group of `plan` that holds `rank`, each on a new stream of its
    /// own. `ids[0]` is the world's unique id, `ids[1 + g]` group `g`'s (rank 0 made them all,
    /// [`crate::launch::encode_ids`]).
    ///
    /// `ncclCommInitRank` blocks until every member of the communicator has called it, so the
    /// order matters: every rank creates its communicators in one global order (the world
    /// first, then [`GroupPlan::groups`]' order, which every process derives from the same
    /// program), skipping those it is not in. That cannot deadlock: take the first
    /// communicator in that order that is not yet created; every communicator before it is,
    /// so each of its members has returned from all the earlier ones it belongs to and, not
    /// being able to finish this one alone, is calling `ncclCommInitRank` on it now: all its
    /// members are there, so it completes, and by induction so do all. (Two ranks creating two
    /// shared communicators in opposite orders would each wait in the first for the other.)
    pub fn open(
        stream: &Arc<CudaStream>,
        rank: Rank,
        world: usize,
        ids: &[cudarc::nccl::Id],
        plan: Arc<GroupPlan>,
    ) -> Result<NcclNet, BackendError> {
        let ctx = stream.context().clone();
        let id = |i: usize| {
            ids.get(i).copied().ok_or_else(|| {
                BackendError(format!(
                    "{} NCCL unique ids for {} communicators",
                    ids.len(),
                    1 + plan.groups.len()
                ))
            })
        };
        let init = |s: Arc<CudaStream>, size: usize, index: usize, id, what: &str| {
            // `ncclCommInitRank` runs on the thread's current device.
            ctx.bind_to_thread().map_err(err("bind the GPU"))?;
            Comm::from_rank(s, index, size, id).map_err(|e| {
                BackendError(format!(
                    "NCCL: ncclCommInitRank ({what}): {:?} (NCCL refuses two ranks of one communicator on the same GPU: launch at most one process per GPU; several ranks share a GPU in single-process mode)",
                    e.0
                ))
            })
        };
        let world_comm = init(stream.clone(), world, rank.index(), id(0)?, "all ranks")?;
        let mut groups = Vec::with_capacity(plan.groups.len());
        for (g, group) in plan.groups.iter().enumerate() {
            groups.push(match group.index_of(rank) {
                None => None,
                Some(i) => {
                    let s = ctx.new_stream().map_err(err("create a stream"))?;
                    let what = format!("communicator `{}`", group.key);
                    Some(init(s, group.members.len(), i, id(1 + g)?, &what)?)
                }
            });
        }
        Ok(NcclNet {
            world: world_comm,
            groups,
            plan,
            rank,
        })
    }
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

/// What one op of a batch moves: a tensor of the op (a send's, or a receive's buffer in the
/// receive slots), or one byte for a message without data.
enum Data {
    Tensor,
    Dummy(CudaSlice<u8>),
}

/// Post one batch over NCCL as one group. Receives get buffers of the size [`wire`] says.
///
/// Each op goes on its group's communicator (the verifier's key, [`GroupPlan::route`]) with the
/// peer's NCCL rank in that group, so the ops of one group are in issue order on that group's
/// stream, as D2 assumes. The batch is still one `ncclGroupStart/End`: NCCL lets a group hold
/// the operations of several communicators ("all three usages can be combined", NCCL user
/// guide, Group Calls), and the ops of one batch must all be posted before any can complete,
/// as in the single-communicator version.
///
/// Streams: `stream` is the rank's comm stream, which already waits for the compute issued
/// before the batch ([`crate::device::CudaBackend`]'s `post_batch`). Every buffer is allocated
/// on it first; then each group stream the batch uses waits for it (so for the compute and the
/// allocations), the group posts, and `stream` waits for each of those group streams, so
/// everything that waits for `stream` (the batch's end event, the compute after the batch, a
/// later batch) waits for the transfers. Batches are therefore serialised on the GPU as before:
/// two communicators are only ever active together inside one NCCL group (NCCL user guide,
/// "Using multiple NCCL communicators concurrently").
pub fn nccl_batch<T: Elem>(
    net: &NcclNet,
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
    // Each op's communicator and the peer's rank in it.
    let mut routes: Vec<(&Comm, i32)> = Vec::with_capacity(ops.len());
    for op in ops.iter() {
        let r = net
            .plan
            .route(net.rank, op.peer, op.dir == Dir::Send, op.payload)
            .map_err(BackendError)?;
        let comm = net.groups[r.group].as_ref().ok_or_else(|| {
            BackendError(format!(
                "{}: no communicator of its own for `{}`",
                net.rank, net.plan.groups[r.group].key
            ))
        })?;
        routes.push((comm, r.peer as i32));
    }
    // Buffers for the receives and one-byte stand-ins, all allocated on `stream` before the
    // group streams wait for it.
    let mut recv: Vec<Option<GTensor<T>>> = Vec::with_capacity(ops.len());
    let mut data: Vec<Data> = Vec::with_capacity(ops.len());
    for op in ops.iter() {
        let slot = match op.dir {
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
        };
        let t = match op.dir {
            Dir::Send => op.tensor.as_ref(),
            Dir::Recv => slot.as_ref(),
        };
        data.push(match t {
            Some(GTensor::LossGrad | GTensor::TokenGrad) => {
                Data::Dummy(stream.alloc_zeros::<u8>(1).map_err(err("allocate"))?)
            }
            Some(_) => Data::Tensor,
            None => return Err(BackendError("a send without its tensor".into())),
        });
        recv.push(slot);
    }
    // The group streams this batch uses, each once.
    let mut used: Vec<Arc<CudaStream>> = Vec::new();
    for (c, _) in &routes {
        let s = c.stream();
        if !used.iter().any(|u| Arc::ptr_eq(u, &s)) {
            s.join(stream).map_err(err("order streams"))?;
            used.push(s);
        }
    }
    group_start().map_err(nerr("group start"))?;
    let mut posted: Result<(), BackendError> = Ok(());
    for (((op, slot), d), &(comm, peer)) in ops
        .iter()
        .zip(recv.iter_mut())
        .zip(data.iter_mut())
        .zip(&routes)
    {
        let r = match (op.dir, d, op.tensor.as_ref(), slot.as_mut()) {
            (Dir::Send, Data::Dummy(b), _, _) => comm.send(&*b, peer),
            (Dir::Recv, Data::Dummy(b), _, _) => comm.recv(b, peer).map(|_| ()),
            (Dir::Send, Data::Tensor, Some(GTensor::Tokens(t)), _) => comm.send(t, peer),
            (Dir::Send, Data::Tensor, Some(GTensor::Hidden(t)), _) => comm.send(t, peer),
            (Dir::Send, Data::Tensor, Some(GTensor::Loss(t)), _) => comm.send(t, peer),
            (Dir::Recv, Data::Tensor, _, Some(GTensor::Tokens(t))) => {
                comm.recv(t, peer).map(|_| ())
            }
            (Dir::Recv, Data::Tensor, _, Some(GTensor::Hidden(t))) => {
                comm.recv(t, peer).map(|_| ())
            }
            (Dir::Recv, Data::Tensor, _, Some(GTensor::Loss(t))) => comm.recv(t, peer).map(|_| ()),
            // `data` says `Tensor` only for these tensors (built above from the same ops).
            _ => {
                posted = Err(BackendError("a message without its buffer".into()));
                break;
            }
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
    // another stream, would not wait for it. Record them again, now after the kernel, on the
    // stream the op ran on: its communicator's.
    for (((op, slot), d), (comm, _)) in ops
        .iter()
        .zip(recv.iter_mut())
        .zip(data.iter_mut())
        .zip(&routes)
    {
        let s = comm.stream();
        match (op.dir, d) {
            (Dir::Send, Data::Dummy(b)) => drop(b.device_ptr(&s)),
            (Dir::Recv, Data::Dummy(b)) => drop(b.device_ptr_mut(&s)),
            (Dir::Send, Data::Tensor) => match op.tensor.as_ref() {
                Some(GTensor::Tokens(t)) => drop(t.device_ptr(&s)),
                Some(GTensor::Hidden(t)) => drop(t.device_ptr(&s)),
                Some(GTensor::Loss(t)) => drop(t.device_ptr(&s)),
                _ => {}
            },
            (Dir::Recv, Data::Tensor) => match slot.as_mut() {
                Some(GTensor::Tokens(t)) => drop(t.device_ptr_mut(&s)),
                Some(GTensor::Hidden(t)) => drop(t.device_ptr_mut(&s)),
                Some(GTensor::Loss(t)) => drop(t.device_ptr_mut(&s)),
                _ => {}
            },
        }
    }
    // The comm stream (the batch's end event, what compute and the next batch wait on) waits
    // for every transfer. The one-byte stand-ins drop after this, their stream-ordered frees on
    // `stream` behind it.
    for s in &used {
        stream.join(s).map_err(err("order streams"))?;
    }
    drop(data);
    for (op, slot) in ops.iter_mut().zip(recv) {
        op.tensor = slot;
    }
    Ok(())
}

/// [`local_receive`] while a step is captured (`--cuda-graph`), where cudarc's buffer events
/// are off: this rank's stream waits for the sender's post ([`Capture::after_post`]) and takes
/// the sent buffer over, with no copy: it is freed on this rank's stream after its last use
/// here, so the graph's free follows every read, and nothing is issued into the sender's
/// stream (which may already have been joined back for the capture's end). One GPU (graph mode
/// refuses several).
pub fn local_receive_captured<T: Elem>(
    stream: &Arc<CudaStream>,
    ops: &mut [CommOp<GTensor<T>>],
    capture: &Capture,
) -> Result<(), BackendError> {
    fn adopt<U>(stream: &Arc<CudaStream>, src: CudaSlice<U>) -> CudaSlice<U> {
        let len = src.len();
        // With event tracking off, `leak` waits on nothing and frees nothing.
        let ptr = src.leak();
        // SAFETY: `ptr` is the sender's allocation of `len` elements of `U`, fully written
        // before its post, which this stream now waits for; nobody else frees it.
        unsafe { stream.upgrade_device_ptr::<U>(ptr, len) }
    }
    for op in ops.iter_mut().filter(|o| o.dir == Dir::Recv) {
        if matches!(
            op.tensor,
            Some(GTensor::Tokens(_) | GTensor::Hidden(_) | GTensor::Loss(_))
        ) {
            capture.after_post(op.peer.0, stream)?;
        }
        op.tensor = match op.tensor.take() {
            Some(GTensor::Tokens(t)) => Some(GTensor::Tokens(adopt(stream, t))),
            Some(GTensor::Hidden(t)) => Some(GTensor::Hidden(adopt(stream, t))),
            Some(GTensor::Loss(t)) => Some(GTensor::Loss(adopt(stream, t))),
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
