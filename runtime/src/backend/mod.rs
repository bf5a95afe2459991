//! What the interpreter asks of a device: compute passes on (stage, microbatch) tasks and
//! batched point-to-point communication. The CPU reference backend ([`cpu`]) and the CUDA
//! backend (crate `pipec-cuda`) implement the same trait, so the interpreter is written once; what the
//! step driver asks beyond it is [`crate::driver::StepBackend`].
//!
//! Tensors stay opaque to the interpreter (associated types): it only moves them between its
//! tables, the backend and the transport.

pub mod cpu;
pub mod noop;

use pipec_ir::ir::Payload;
use pipec_schedules::{Rank, Task};
use std::time::Duration;
use thiserror::Error;

/// A compute failure inside a backend, worded by the backend.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
#[error("{0}")]
pub struct BackendError(pub String);

/// Send or receive.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Dir {
    Send,
    Recv,
}

/// One operation of a comm batch, as handed to [`Backend::exchange`].
#[derive(Debug)]
pub struct CommOp<T> {
    /// Index of the instruction in its rank's stream (for messages).
    pub at: u32,
    pub dir: Dir,
    pub peer: Rank,
    pub payload: Payload,
    /// A send's tensor on entry (taken by the transport); a receive's tensor on return.
    pub tensor: Option<T>,
    /// Position of this op in the FIFO of its ordered rank pair (the k-th send from A to B
    /// matches the k-th receive on B from A); set by the transport.
    pub seq: u64,
    /// The tokens (rows) of the tensor, from the instruction, when the plan carries
    /// microbatch lengths (issue #38): a backend sizes the receive from it, with no shape
    /// exchange, and refuses a tensor of another size ([`CommError::WrongTokens`]).
    pub tokens: Option<u32>,
    /// The slot of the rank's message-buffer pool the tensor lives in, from the instruction,
    /// when the plan has a buffer plan (issue #39): a backend lands the receive in that slot's
    /// buffer, allocated before the step.
    pub slot: Option<u32>,
}

/// One operation of a batch that could not complete: what it waits for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pending {
    /// Instruction index of the waiting op.
    pub at: u32,
    pub dir: Dir,
    pub peer: Rank,
    /// This op's position in its pair's FIFO (0-based).
    pub seq: u64,
    /// How many matching ops the peer has posted so far (all `<= seq`).
    pub peer_posted: u64,
}

/// Why a comm batch did not complete.
#[derive(Debug, Clone, PartialEq)]
pub enum CommError {
    /// Another rank failed and everyone stops.
    Aborted,
    /// The batch waited `waited` without completing (a hang under rendezvous semantics), or
    /// a peer it waits for has finished and will never post (`peer_finished`).
    Stalled {
        pending: Vec<Pending>,
        waited: Duration,
        peer_finished: Option<Rank>,
    },
    /// The schedule leaves batches in flight (`wait` instructions), which this backend cannot
    /// do.
    InFlightUnsupported,
    /// A tensor's rows are not the `tokens` its instruction (at `at`) carries: the receive
    /// was sized from the plan, so a tensor of another size cannot land in it (or a send
    /// holds a tensor of another size than the plan says it sends).
    WrongTokens {
        at: u32,
        dir: Dir,
        tokens: u32,
        rows: usize,
    },
    /// The message that arrived is not the tensor the receive expects.
    WrongPayload {
        recv_at: u32,
        expected: Payload,
        peer: Rank,
        send_at: u32,
        got: Payload,
    },
}

/// A device the interpreter can drive. Inputs are `None` where the schedule has none: the
/// forward of stage 0 (data comes from the backend) and the backward of the last stage (the
/// loss seeds it).
pub trait Backend {
    /// An activation or gradient that travels between stages.
    type Tensor: Send;
    /// What a forward keeps for its backward (the activation stash).
    type Saved: Send;
    /// What an input-gradient pass (`bwd_D`) keeps for the weight-gradient pass (`bwd_W`).
    type Partial: Send;
    /// A stash an `offload` moved to host memory, until its `reload` (docs/format.md,
    /// "Memory instructions"): the stash itself on the CPU; on a GPU a handle to pinned host
    /// buffers the backend holds.
    type Host: Send;

    /// `fwd(s, m)`: returns the stage's output and, when `save`, what its backward needs.
    fn fwd(
        &mut self,
        task: Task,
        input: Option<Self::Tensor>,
        save: bool,
    ) -> Result<(Self::Tensor, Option<Self::Saved>), BackendError>;

    /// Full `bwd(s, m)`: input gradient and weight gradients. Returns the input gradient.
    fn bwd(
        &mut self,
        task: Task,
        saved: Self::Saved,
        grad: Option<Self::Tensor>,
    ) -> Result<Self::Tensor, BackendError>;

    /// `bwd_D(s, m)`: the input gradient only; the stash stays for `bwd_W`.
    fn bwd_d(
        &mut self,
        task: Task,
        saved: &Self::Saved,
        grad: Option<Self::Tensor>,
    ) -> Result<(Self::Tensor, Self::Partial), BackendError>;

    /// After `bwd_D(s, m)`: drop from the stash what only the input gradient read, keeping
    /// the inputs of the weight-gradient GEMMs for `bwd_W` (the memory rule's `act - act_w`,
    /// `pipec_ir::ir::activations`). Returns whether it did: the default keeps everything (a
    /// backend whose stash cannot be cut), and the interpreter then meters the whole stash
    /// until `bwd_W`, so a run that holds more than the plan counts says so.
    fn keep_for_w(&mut self, task: Task, saved: &mut Self::Saved) -> Result<bool, BackendError> {
        let _ = (task, saved);
        Ok(false)
    }

    /// `bwd_W(s, m)`: the weight gradients only; frees the stash.
    fn bwd_w(
        &mut self,
        task: Task,
        saved: Self::Saved,
        partial: Self::Partial,
    ) -> Result<(), BackendError>;

    /// An overlapped pair (Megatron's combined 1F1B, DualPipe's F&B): the forward of one task
    /// with the full backward of another. The default runs them one after the other, which is
    /// what a single CPU thread can do; a GPU backend overlaps them on two streams.
    #[allow(clippy::type_complexity)]
    fn fwd_bwd(
        &mut self,
        fwd: Task,
        input: Option<Self::Tensor>,
        save: bool,
        bwd: Task,
        saved: Self::Saved,
        grad: Option<Self::Tensor>,
    ) -> Result<(Self::Tensor, Option<Self::Saved>, Self::Tensor), BackendError> {
        let (out, stash) = self.fwd(fwd, input, save)?;
        let din = self.bwd(bwd, saved, grad)?;
        Ok((out, stash, din))
    }

    /// A copy of a forward's input, which a checkpointed forward keeps for its `recompute`
    /// (docs/format.md, "Memory instructions"). Backends that cannot refuse.
    fn keep(&mut self, input: &Self::Tensor) -> Result<Self::Tensor, BackendError> {
        let _ = input;
        Err(BackendError(
            "this backend cannot keep a checkpointed forward's input".into(),
        ))
    }

    /// `offload(s, m)`: post the copy of `saved` to host memory on the rank's copy stream and
    /// return the host copy at once. A device keeps the source allocated until the copy is
    /// known to have ended ([`Backend::wait_offload`], or a backward waiting for a later
    /// reload); the interpreter meters that release itself. Backends that cannot refuse.
    fn offload(&mut self, task: Task, saved: Self::Saved) -> Result<Self::Host, BackendError> {
        let _ = (task, saved);
        Err(BackendError(
            "this backend cannot offload activations".into(),
        ))
    }

    /// `wait_offload(s, m)`: the compute stream waits until `task`'s latest offload (and so
    /// every copy posted before it) has ended; the device copies of those offloads are freed.
    fn wait_offload(&mut self, task: Task) -> Result<(), BackendError> {
        let _ = task;
        Err(BackendError(
            "this backend cannot wait for an offload".into(),
        ))
    }

    /// `reload(s, m)`: allocate the device stash (counted from here) and post the copy back
    /// on the copy stream; the backward of `task` waits for it. Backends that cannot refuse.
    fn reload(&mut self, task: Task, host: Self::Host) -> Result<Self::Saved, BackendError> {
        let _ = (task, host);
        Err(BackendError(
            "this backend cannot reload activations".into(),
        ))
    }

    /// Post one comm batch (one NCCL group) and wait for all of it: sends carry their tensor
    /// in `tensor`, receives get theirs there.
    fn exchange(&mut self, ops: &mut [CommOp<Self::Tensor>]) -> Result<(), CommError>;

    /// Post one comm batch and return at once, leaving it in flight (Megatron's
    /// `overlap_p2p_comm`); [`Backend::complete`] waits for it. Backends that cannot refuse.
    fn post(&mut self, ops: &mut [CommOp<Self::Tensor>]) -> Result<(), CommError> {
        let _ = ops;
        Err(CommError::InFlightUnsupported)
    }

    /// Wait for a batch posted with [`Backend::post`]; receives get their tensors.
    fn complete(&mut self, ops: &mut [CommOp<Self::Tensor>]) -> Result<(), CommError> {
        let _ = ops;
        Err(CommError::InFlightUnsupported)
    }

    /// A `wait` for a batch that an earlier `wait` already completed (as `work.wait()` twice):
    /// nothing to do, but a backend that keeps one timing mark per instruction keeps one here.
    fn rewait(&mut self) {}

    /// Called once when the rank has run its last instruction (a transport uses it to tell
    /// peers that nothing more will be posted).
    fn finish(&mut self) {}
}
