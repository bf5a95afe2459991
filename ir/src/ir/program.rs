//! The lowered program: per-rank instruction streams with explicit communication.
//!
//! This is pipec's IR. Generation produces it through `pipec_compiler::lower`, the torch importer
//! produces it from CSV, the instruction-file loader reads it back; the verifier, the
//! simulator, the emitters and the runtime all consume it. Ids in a `Program` read from a file
//! are untrusted: the verifier range-checks them before anything indexes with them.

use pipec_schedules::{
    CommPolicy, Compute, Lengths, Microbatch, P2pGroups, Placement, Rank, StageId, Task,
};
use serde::{Deserialize, Serialize};
use std::fmt;

/// A message's size in tokens: never zero (a microbatch holds at least one token).
pub type Tokens = std::num::NonZeroU32;

/// What a message carries.
#[derive(Copy, Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PayloadKind {
    /// The activation leaving stage `s` for stage `s + 1`.
    Act,
    /// The input gradient leaving stage `s` for stage `s - 1`.
    Grad,
    /// The shape of `Act` of the same stage and microbatch, sent ahead of it: Megatron's
    /// `_communicate_shapes` under `variable_seq_lengths` (a 3-element int64 tensor posted
    /// before every transfer). Only `--megatron-variable-seq-lengths` programs have these: a
    /// model of Megatron's handshake for the verifier, not something pipec's plans need.
    ActShape,
    /// The shape of `Grad` of the same stage and microbatch, sent ahead of it.
    GradShape,
}

impl PayloadKind {
    /// Whether this is a shape message (Megatron's handshake), not a tensor a compute uses.
    pub fn is_shape(self) -> bool {
        matches!(self, PayloadKind::ActShape | PayloadKind::GradShape)
    }

    /// The tensor kind this message is about: itself, or the tensor whose shape it announces
    /// (a shape travels the route of its tensor).
    pub fn data(self) -> PayloadKind {
        match self {
            PayloadKind::Act | PayloadKind::ActShape => PayloadKind::Act,
            PayloadKind::Grad | PayloadKind::GradShape => PayloadKind::Grad,
        }
    }

    /// The rank-file name: `act`, `grad`, `act_shape`, `grad_shape`.
    pub fn name(self) -> &'static str {
        match self {
            PayloadKind::Act => "act",
            PayloadKind::Grad => "grad",
            PayloadKind::ActShape => "act_shape",
            PayloadKind::GradShape => "grad_shape",
        }
    }
}

/// A tensor that travels: named by its producing stage, as docs/design.md's conventions say.
#[derive(Copy, Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Payload {
    pub kind: PayloadKind,
    pub stage: StageId,
    pub mb: Microbatch,
}

impl Payload {
    pub fn act(stage: u32, mb: u32) -> Self {
        Payload {
            kind: PayloadKind::Act,
            stage: StageId(stage),
            mb: Microbatch(mb),
        }
    }

    pub fn grad(stage: u32, mb: u32) -> Self {
        Payload {
            kind: PayloadKind::Grad,
            stage: StageId(stage),
            mb: Microbatch(mb),
        }
    }

    /// The shape message announcing this tensor (Megatron's `_communicate_shapes`).
    pub fn shape(self) -> Self {
        let kind = match self.kind {
            PayloadKind::Act | PayloadKind::ActShape => PayloadKind::ActShape,
            PayloadKind::Grad | PayloadKind::GradShape => PayloadKind::GradShape,
        };
        Payload { kind, ..self }
    }

    /// The stage that consumes this tensor (a shape: its tensor's consumer), `None` when it
    /// would fall off either end.
    pub fn consumer(&self) -> Option<StageId> {
        match self.kind {
            PayloadKind::Act | PayloadKind::ActShape => self.stage.0.checked_add(1).map(StageId),
            PayloadKind::Grad | PayloadKind::GradShape => self.stage.0.checked_sub(1).map(StageId),
        }
    }
}

impl fmt::Display for Payload {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let k = match self.kind {
            PayloadKind::Act => "act",
            PayloadKind::Grad => "grad",
            PayloadKind::ActShape => "shape of act",
            PayloadKind::GradShape => "shape of grad",
        };
        write!(f, "{k} of {}, {}", self.stage, self.mb)
    }
}

/// One instruction. Consecutive `Send`/`Recv` with the same `batch` on one rank are posted
/// together (one NCCL group, one `batch_isend_irecv`) and complete together. A batch is
/// blocking (the rank waits for it right after posting) unless a later `Wait` on the same rank
/// names it: then it is left in flight (`isend`/`irecv` handles, Megatron's
/// `overlap_p2p_comm`) and the rank waits for it at the `Wait`.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Instr {
    Compute(Compute),
    Send {
        peer: Rank,
        payload: Payload,
        batch: u32,
        /// The tokens of the tensor it moves, when the plan knows its microbatches' lengths
        /// (issue #38): a runtime allocates the receive from it, no shape handshake.
        tokens: Option<Tokens>,
        /// The slot of the rank's message-buffer pool ([`Program::buffer_slots`], issue #39)
        /// the tensor lives in from the pass that produces it until the send completes;
        /// `None` without a buffer plan.
        slot: Option<u32>,
    },
    Recv {
        peer: Rank,
        payload: Payload,
        batch: u32,
        /// As [`Instr::Send`]'s; a matched pair must agree.
        tokens: Option<Tokens>,
        /// The pool slot the tensor lands in, held from the receive until its last use on
        /// this rank ([`crate::ir::buffers`]); `None` without a buffer plan.
        slot: Option<u32>,
    },
    /// Block until the earlier batch `batch` of this rank has completed (`work.wait()`).
    Wait {
        batch: u32,
    },
    /// `fwd` with `checkpoint: true`: the forward of `task` keeping only its input, its
    /// activations rebuilt by a later [`MemKind::Recompute`] (Megatron's
    /// `checkpoint_activations_microbatch`). Its own variant, not a flag on
    /// [`Compute::Fwd`], so that every reader of a forward is made to decide what it means.
    FwdCheckpoint(Task),
    /// An activation-memory instruction (`offload`, `reload`, `wait_offload`, `recompute`).
    Memory(MemOp),
}

/// What a memory instruction does to the activations of one forward (docs/format.md,
/// "Memory instructions"; PipeOffload's execution model, `tests/golden/pipeoffload/README.md`).
#[derive(Copy, Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum MemKind {
    /// Copy them to host memory on the rank's copy stream.
    Offload,
    /// Copy them back to device memory on the copy stream.
    Reload,
    /// Block the compute stream until the offload has ended.
    WaitOffload,
    /// Run a checkpointed forward again on the compute stream.
    Recompute,
}

impl MemKind {
    /// Runs on the rank's copy stream (not the compute stream).
    pub fn is_copy(self) -> bool {
        matches!(self, MemKind::Offload | MemKind::Reload)
    }

    /// The rank-file op.
    pub fn op(self) -> &'static str {
        match self {
            MemKind::Offload => "offload",
            MemKind::Reload => "reload",
            MemKind::WaitOffload => "wait_offload",
            MemKind::Recompute => "recompute",
        }
    }
}

/// A memory instruction: `kind` applied to the activations of forward `task`.
#[derive(Copy, Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct MemOp {
    pub kind: MemKind,
    pub task: Task,
}

impl fmt::Display for MemOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}({})", self.kind.op(), self.task)
    }
}

impl Instr {
    /// A send (`is_send`) or receive of `payload` with `peer`, in comm batch `batch`.
    pub fn message(is_send: bool, peer: Rank, payload: Payload, batch: u32) -> Instr {
        if is_send {
            Instr::Send {
                peer,
                payload,
                batch,
                tokens: None,
                slot: None,
            }
        } else {
            Instr::Recv {
                peer,
                payload,
                batch,
                tokens: None,
                slot: None,
            }
        }
    }

    /// The buffer slot of a send or recv (`None` without a plan, and for any other op).
    pub fn slot(&self) -> Option<u32> {
        match *self {
            Instr::Send { slot, .. } | Instr::Recv { slot, .. } => slot,
            _ => None,
        }
    }

    /// The comm batch of a send or recv.
    pub fn batch(&self) -> Option<u32> {
        match *self {
            Instr::Send { batch, .. } | Instr::Recv { batch, .. } => Some(batch),
            Instr::Compute(_) | Instr::Wait { .. } | Instr::FwdCheckpoint(_) | Instr::Memory(_) => {
                None
            }
        }
    }

    /// The compute pass this instruction is, a checkpointed forward as the forward it is
    /// (a `recompute` is not a pass of the schedule: it is a [`MemOp`]).
    pub fn as_compute(&self) -> Option<Compute> {
        match *self {
            Instr::Compute(c) => Some(c),
            Instr::FwdCheckpoint(t) => Some(Compute::Fwd(t)),
            Instr::Send { .. } | Instr::Recv { .. } | Instr::Wait { .. } | Instr::Memory(_) => None,
        }
    }

    /// The memory instruction, if this is one.
    pub fn as_memory(&self) -> Option<MemOp> {
        match *self {
            Instr::Memory(m) => Some(m),
            _ => None,
        }
    }
}

impl fmt::Display for Instr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Instr::Compute(c) => write!(f, "{c}"),
            Instr::Send { peer, payload, .. } => write!(f, "send({payload} -> {peer})"),
            Instr::Recv { peer, payload, .. } => write!(f, "recv({payload} <- {peer})"),
            Instr::Wait { batch } => write!(f, "wait(batch {batch})"),
            Instr::FwdCheckpoint(t) => write!(f, "fwd({t}, checkpoint)"),
            Instr::Memory(m) => write!(f, "{m}"),
        }
    }
}

/// A position in a program, printed the way every message names it: `rank 2, #17`.
#[derive(Copy, Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct InstrRef {
    pub rank: Rank,
    pub index: u32,
}

impl fmt::Display for InstrRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}, #{}", self.rank, self.index)
    }
}

/// Every rank's instruction stream plus what is needed to judge it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Program {
    pub placement: Placement,
    pub microbatches: u32,
    /// Inference: no backward is expected.
    pub forward_only: bool,
    /// How the lowering that produced the program posts its sends and receives, set by that
    /// lowering and stored as the manifest's `comm_policy`, so that no reader has to guess it:
    /// the verifier's NCCL stream rule (D2, [`crate::verify::StreamRule::of`]) follows from it.
    /// `None` for a program taken as written (a compute+comms torch CSV, files from another
    /// tool): every batch one NCCL group, one communicator per pair of ranks.
    #[serde(default)]
    pub comm: Option<CommPolicy>,
    /// The tokens of the sequences in each microbatch (issue #38), by the user's microbatch
    /// index; `None` when every microbatch is alike. Recorded as the manifest's
    /// `microbatch_lengths`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lengths: Option<Lengths>,
    pub ranks: Vec<Vec<Instr>>,
    /// Which communicator carries each send and receive (`--p2p-groups`, the manifest's
    /// `p2p_groups`, [`P2pGroups`]): the verifier's stream rule (D2) serialises the ops of one
    /// group on a rank. The default, one per pair of ranks, is torch's own.
    #[serde(default, skip_serializing_if = "P2pGroups::is_pair")]
    pub p2p_groups: P2pGroups,
    /// The message-buffer pools of a static buffer plan (issue #39, `--buffer-plan`), stored
    /// as the manifest's `buffer_slots`; `None` without a plan. Every send and receive then
    /// names a slot of its rank's pool.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub buffer_slots: Option<Pools>,
}

/// Per rank, each slot's size in the memory unit of the cost model the plan was made with
/// (bytes when its costs are; [`crate::memory::Unit`]). Compared bit for bit, so that a
/// program equals itself (sizes are finite: the reader refuses others).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Pools(pub Vec<Vec<f64>>);

impl PartialEq for Pools {
    fn eq(&self, other: &Self) -> bool {
        self.0.len() == other.0.len()
            && self.0.iter().zip(&other.0).all(|(a, b)| {
                a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
            })
    }
}

impl Eq for Pools {}

impl Pools {
    /// Rank `r`'s slots (none for a rank the pools do not name).
    pub fn rank(&self, r: usize) -> &[f64] {
        self.0.get(r).map_or(&[], Vec::as_slice)
    }

    /// The sum of rank `r`'s slot sizes: what its pool holds for the whole step.
    pub fn bytes(&self, r: usize) -> f64 {
        self.rank(r).iter().sum()
    }
}

impl Program {
    pub fn world(&self) -> u32 {
        self.ranks.len() as u32
    }

    pub fn num_stages(&self) -> u32 {
        self.placement.num_stages()
    }

    /// Total instruction count over all ranks.
    pub fn len(&self) -> usize {
        self.ranks.iter().map(Vec::len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether a table with a slot per task (`stages * M`) is affordable. A complete program
    /// holds a pass per task, so a table much larger than the program means missing work (the
    /// verifier reports it once); analyses then do without, rather than allocate for ids that
    /// never occur.
    pub fn task_tables_fit(&self) -> bool {
        let tasks = self.num_stages() as u64 * self.microbatches as u64;
        tasks <= (4 * self.len() as u64).max(1 << 20)
    }

    pub fn get(&self, at: InstrRef) -> Option<&Instr> {
        self.ranks.get(at.rank.index())?.get(at.index as usize)
    }

    /// The tokens a message of microbatch `mb` carries under this program's lengths.
    pub fn tokens_of(&self, mb: Microbatch) -> Option<Tokens> {
        Tokens::new(self.lengths.as_ref()?.tokens(mb.0)?)
    }

    /// Give the program its microbatches' lengths: every send and receive then carries the
    /// tokens of its microbatch.
    pub fn set_lengths(&mut self, lengths: Option<Lengths>) {
        let of = |mb: Microbatch| Tokens::new(lengths.as_ref()?.tokens(mb.0)?);
        for ins in self.ranks.iter_mut().flatten() {
            if let Instr::Send {
                payload, tokens, ..
            }
            | Instr::Recv {
                payload, tokens, ..
            } = ins
            {
                *tokens = of(payload.mb);
            }
        }
        self.lengths = lengths;
    }

    /// Renumber microbatches: the one that entered the pipeline `k`-th becomes the user's
    /// microbatch `order[k]` (tune's microbatch order, issue #38). `order` must be a
    /// permutation of `0..microbatches`; ids outside it are left as they are.
    pub fn renumber(&mut self, order: &[u32]) {
        let map = |mb: Microbatch| order.get(mb.index()).map_or(mb, |&to| Microbatch(to));
        let task = |t: Task| Task {
            stage: t.stage,
            mb: map(t.mb),
        };
        for ins in self.ranks.iter_mut().flatten() {
            match ins {
                Instr::Compute(c) => *c = c.map_tasks(task),
                Instr::Send { payload, .. } | Instr::Recv { payload, .. } => {
                    payload.mb = map(payload.mb)
                }
                Instr::Wait { .. } => {}
                Instr::FwdCheckpoint(t) => *t = task(*t),
                Instr::Memory(m) => m.task = task(m.task),
            }
        }
    }

    /// Each rank's compute ops in order, communication dropped.
    pub fn compute_orders(&self) -> Vec<Vec<Compute>> {
        self.ranks
            .iter()
            .map(|r| r.iter().filter_map(Instr::as_compute).collect())
            .collect()
    }
}
