//! What the verifier finds: typed violations that say in words what is wrong and where, and
//! the program's counts (`report.rs`'s `Report` gathers them). Every variant carries the
//! positions it talks about ([`InstrRef`]s, as [`Site`]s with the instruction itself so a
//! message never needs the program to be printed).

use crate::human::count;
use crate::ir::{Instr, InstrRef, Payload, PayloadKind};
use pipec_schedules::{Compute, P2pGroups, Pass, Rank, StageId, Task};
use serde::ser::SerializeStruct;
use serde::{Serialize, Serializer};
use std::fmt;

/// An instruction and where it is: `rank 1, #9 recv(act of stage 0, mb 3 <- rank 0)`.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Site {
    pub at: InstrRef,
    pub instr: Instr,
}

impl fmt::Display for Site {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}", self.at, self.instr)
    }
}

/// Serialized flat, with the instruction in words: `{"rank": 1, "index": 9, "instr": "recv(...)"}`.
impl Serialize for Site {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut st = s.serialize_struct("Site", 3)?;
        st.serialize_field("rank", &self.at.rank.0)?;
        st.serialize_field("index", &self.at.index)?;
        st.serialize_field("instr", &self.instr.to_string())?;
        st.end()
    }
}

/// One pass of one task: `bwd(stage 5, mb 3)`.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Part {
    pub pass: Pass,
    pub task: Task,
}

impl fmt::Display for Part {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", Compute::single(self.pass, self.task))
    }
}

/// An id that can fall outside the program's ranges.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Field {
    Stage,
    Microbatch,
    Peer,
}

/// One link of a deadlock: why `waiter` cannot complete.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "wait", rename_all = "snake_case")]
pub enum WaitStep {
    /// `waiter` is posted, but its partner `peer` cannot be posted until `until` (the last comm
    /// batch before `peer` on the peer's rank) completes.
    Peer {
        waiter: Site,
        peer: Site,
        until: Site,
    },
    /// `waiter`'s batch cannot be posted until `until`, earlier on the same rank, completes.
    Order { waiter: Site, until: Site },
}

impl WaitStep {
    pub fn waiter(&self) -> &Site {
        match self {
            WaitStep::Peer { waiter, .. } | WaitStep::Order { waiter, .. } => waiter,
        }
    }
}

/// The class of a violation. The order is the precedence [`Report::class`] uses to name one
/// verdict: a malformed program first, then one that hangs, then one that computes on the
/// wrong tensor, then missing work, then ordering, then memory.
#[derive(Copy, Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Class {
    /// Ids out of range, a placement that does not fit the program.
    Malformed,
    /// A cycle of waits, or a message that nothing matches.
    Deadlock,
    /// A receive matched with a send of another tensor.
    WrongTensor,
    /// A pass missing, duplicated or on the wrong rank.
    Incomplete,
    /// A pass or a send before what it needs; a message to the wrong place or never used.
    Dependency,
    /// More live activations than `--memory-limit`.
    Memory,
}

impl Class {
    pub fn name(self) -> &'static str {
        match self {
            Class::Malformed => "malformed",
            Class::Deadlock => "deadlock",
            Class::WrongTensor => "wrong tensor",
            Class::Incomplete => "incomplete",
            Class::Dependency => "dependency",
            Class::Memory => "memory",
        }
    }
}

impl fmt::Display for Class {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Everything that can be wrong with a program. Messages name ranks, instruction indices and
/// payloads the way the rest of pipec prints them.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Violation {
    /// The placement is for `pp` ranks but the program has another number of rank streams.
    WorldMismatch { pp: u32, ranks: u32 },
    /// The placement puts a stage on a rank the program does not have.
    PlacementOutOfRange {
        stage: StageId,
        rank: Rank,
        world: u32,
    },
    /// More instructions than positions can be numbered with.
    TooLarge { instructions: u64 },
    /// A stage, microbatch or peer id out of range.
    OutOfRange {
        site: Site,
        field: Field,
        value: u32,
        bound: u32,
    },
    /// So many (stage, microbatch) tasks that the program cannot hold them all; per-task
    /// checks are skipped.
    TooFewOps { tasks: u64, compute_parts: u64 },
    /// A pass that never runs.
    Missing { part: Part, owner: Rank },
    /// A pass that runs more than once.
    Duplicate {
        part: Part,
        first: Site,
        again: Site,
    },
    /// A pass on a rank that does not own its stage.
    WrongRank { site: Site, part: Part, owner: Rank },
    /// `bwd_D` without `bwd_W`, or `bwd_W` without `bwd_D`.
    UnpairedSplit { site: Site, part: Part },
    /// Both a full `bwd` and a split backward for one task.
    MixedBackward { task: Task, bwd: Site, split: Site },
    /// A backward pass in a forward-only program.
    BackwardInForwardOnly { site: Site, part: Part },
    /// The k-th send of a rank pair meets a k-th receive that names another tensor.
    WrongTensor { recv: Site, send: Site },
    /// A matched send and receive of the same tensor that disagree on its `tokens` (issue
    /// #38): the receive would be allocated for another size.
    WrongTokens { recv: Site, send: Site },
    /// A send or receive whose `tokens` is not its microbatch's as the program's
    /// `microbatch_lengths` give it (or is there without lengths, or missing with them).
    TokensNotLengths { site: Site, expected: Option<u32> },
    /// A send or receive that no peer operation matches.
    Unmatched { site: Site, sends: u32, recvs: u32 },
    /// A cycle of waits under rendezvous semantics.
    Deadlock { cycle: Vec<WaitStep> },
    /// A cycle of ops that wait for each other under NCCL's stream order (each op waits for
    /// the next: the op before it on a stream, its partner, or a blocking point).
    StreamDeadlock {
        cycle: Vec<Site>,
        /// The program's communicators (`--p2p-groups`).
        #[serde(skip_serializing_if = "P2pGroups::is_pair")]
        groups: P2pGroups,
        /// Under `direction` or `edge`, the communicator of each op of `cycle`; empty under
        /// the default (one per pair, which the message says).
        #[serde(skip_serializing_if = "Vec::is_empty")]
        on: Vec<String>,
    },
    /// A `Wait` names a batch that this rank has not posted before it.
    WaitWithoutBatch { site: Site, batch: u32 },
    /// A `Wait` names a batch id that two separate batches of the rank use.
    WaitAmbiguous { site: Site, batch: u32 },
    /// A pass uses a tensor from a receive left in flight before (or without) waiting for it.
    RunsBeforeWait {
        site: Site,
        part: Part,
        input: Payload,
        recv: Site,
    },
    /// A pass runs before the receive that brings its input.
    RunsBeforeInput {
        site: Site,
        part: Part,
        input: Payload,
        recv: Site,
    },
    /// A pass needs a tensor from another rank that its rank never receives.
    InputNeverReceived {
        site: Site,
        part: Part,
        input: Payload,
        from: Rank,
    },
    /// A pass runs before the pass on its own rank that it depends on.
    RunsBeforeLocal { site: Site, part: Part, needs: Site },
    /// A received tensor consumed by a second pass.
    InputUsedTwice {
        site: Site,
        part: Part,
        recv: Site,
        first_use: Site,
    },
    /// A received tensor that nothing on the rank consumes.
    ReceivedUnused { site: Site },
    /// A send of a tensor before the pass that produces it.
    SendBeforeProduce { site: Site, producer: Site },
    /// A send of a tensor that its rank does not produce.
    SendsUnproduced { site: Site, producer: Site },
    /// A send to a rank that does not own the consuming stage.
    WrongDestination {
        site: Site,
        consumer: StageId,
        owner: Rank,
    },
    /// A send of a tensor no stage consumes (the last stage's activation, stage 0's gradient).
    NoConsumer { site: Site },
    /// A message from a rank to itself: a same-rank hand-off needs no message.
    SelfMessage { site: Site },
    /// An `offload` with no forward of its (stage, microbatch) before it on the rank.
    OffloadWithoutForward { site: Site },
    /// An `offload` of a checkpointed forward, which keeps nothing to copy.
    OffloadOfCheckpointed { site: Site, fwd: Site },
    /// A `reload` with no `offload` of its (stage, microbatch) before it on the rank.
    ReloadWithoutOffload { site: Site },
    /// A `wait_offload` with no `offload` of its (stage, microbatch) before it on the rank.
    WaitOffloadWithoutOffload { site: Site },
    /// A `recompute` with no checkpointed forward of its (stage, microbatch) before it.
    RecomputeWithoutCheckpoint { site: Site },
    /// A second `offload`, `reload` or `recompute` of one (stage, microbatch).
    MemoryOpTwice { site: Site, first: Site },
    /// An `offload`, `reload` or `recompute` after the backward that needed its activations.
    MemoryOpAfterBackward { site: Site, backward: Site },
    /// A backward of activations that are offloaded and not reloaded before it.
    BackwardWhileOffloaded {
        site: Site,
        part: Part,
        offload: Site,
    },
    /// A backward of a checkpointed forward with no `recompute` before it.
    BackwardWithoutRecompute { site: Site, part: Part, fwd: Site },
    /// A send or receive of a tensor without a `slot` in a program with a buffer plan.
    SlotMissing { site: Site },
    /// A `slot` in a program without a buffer plan (no `buffer_slots`), or on a shape message,
    /// which takes none.
    SlotWithoutPlan { site: Site },
    /// A `slot` past the end of its rank's pool.
    SlotOutOfRange { site: Site, slot: u32, slots: u32 },
    /// A message put in a slot while the slot still holds another message's tensor: `live`
    /// holds it over `[live_from, live_until]` (instruction indices of the rank), and
    /// `reuse` takes it from `reuse_from` (issue #39, [`crate::ir::buffers`]).
    SlotReused {
        slot: u32,
        live: Site,
        live_from: u32,
        live_until: u32,
        reuse: Site,
        reuse_from: u32,
    },
    /// A slot smaller than a message put in it (sizes in `unit`).
    SlotTooSmall {
        site: Site,
        slot: u32,
        #[serde(serialize_with = "crate::memory::figure")]
        size: f64,
        #[serde(serialize_with = "crate::memory::figure")]
        needs: f64,
        unit: crate::memory::Unit,
    },
    /// More live activations than the limit.
    MemoryLimit {
        rank: Rank,
        #[serde(serialize_with = "crate::memory::figure")]
        limit: f64,
        first_over: Site,
        #[serde(serialize_with = "crate::memory::figure")]
        peak: f64,
        peak_at: Site,
        unit: crate::memory::Unit,
    },
}

fn tensor_word(kind: PayloadKind) -> &'static str {
    match kind {
        PayloadKind::Act => "activation",
        PayloadKind::Grad => "gradient",
        PayloadKind::ActShape => "activation's shape",
        PayloadKind::GradShape => "gradient's shape",
    }
}

/// `#17` when `at` is on `rank`, else `rank 3, #17`.
struct Near(Rank, InstrRef);

impl fmt::Display for Near {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0 == self.1.rank {
            write!(f, "#{}", self.1.index)
        } else {
            write!(f, "{}", self.1)
        }
    }
}

impl Violation {
    pub fn class(&self) -> Class {
        use Violation::*;
        match self {
            WorldMismatch { .. } | PlacementOutOfRange { .. } | TooLarge { .. } => Class::Malformed,
            OutOfRange { .. } => Class::Malformed,
            TooFewOps { .. }
            | Missing { .. }
            | Duplicate { .. }
            | WrongRank { .. }
            | UnpairedSplit { .. }
            | MixedBackward { .. }
            | BackwardInForwardOnly { .. } => Class::Incomplete,
            SlotMissing { .. } | SlotWithoutPlan { .. } | SlotOutOfRange { .. } => Class::Malformed,
            WrongTensor { .. }
            | WrongTokens { .. }
            | TokensNotLengths { .. }
            | SlotReused { .. } => Class::WrongTensor,
            Unmatched { .. } | Deadlock { .. } | StreamDeadlock { .. } => Class::Deadlock,
            RunsBeforeInput { .. }
            | RunsBeforeWait { .. }
            | WaitWithoutBatch { .. }
            | WaitAmbiguous { .. }
            | InputNeverReceived { .. }
            | RunsBeforeLocal { .. }
            | InputUsedTwice { .. }
            | ReceivedUnused { .. }
            | SendBeforeProduce { .. }
            | SendsUnproduced { .. }
            | WrongDestination { .. }
            | NoConsumer { .. }
            | SelfMessage { .. } => Class::Dependency,
            OffloadWithoutForward { .. }
            | OffloadOfCheckpointed { .. }
            | ReloadWithoutOffload { .. }
            | WaitOffloadWithoutOffload { .. }
            | RecomputeWithoutCheckpoint { .. }
            | MemoryOpTwice { .. }
            | MemoryOpAfterBackward { .. }
            | BackwardWhileOffloaded { .. }
            | BackwardWithoutRecompute { .. }
            | SlotTooSmall { .. }
            | MemoryLimit { .. } => Class::Memory,
        }
    }

    /// The instruction the violation is reported at, if it has one.
    pub fn at(&self) -> Option<InstrRef> {
        use Violation::*;
        match self {
            WorldMismatch { .. }
            | PlacementOutOfRange { .. }
            | TooLarge { .. }
            | TooFewOps { .. }
            | Missing { .. } => None,
            OutOfRange { site, .. }
            | WrongRank { site, .. }
            | UnpairedSplit { site, .. }
            | BackwardInForwardOnly { site, .. }
            | Unmatched { site, .. }
            | TokensNotLengths { site, .. }
            | RunsBeforeInput { site, .. }
            | RunsBeforeWait { site, .. }
            | WaitWithoutBatch { site, .. }
            | WaitAmbiguous { site, .. }
            | InputNeverReceived { site, .. }
            | RunsBeforeLocal { site, .. }
            | InputUsedTwice { site, .. }
            | ReceivedUnused { site }
            | SendBeforeProduce { site, .. }
            | SendsUnproduced { site, .. }
            | WrongDestination { site, .. }
            | NoConsumer { site }
            | SelfMessage { site }
            | OffloadWithoutForward { site }
            | OffloadOfCheckpointed { site, .. }
            | ReloadWithoutOffload { site }
            | WaitOffloadWithoutOffload { site }
            | RecomputeWithoutCheckpoint { site }
            | MemoryOpTwice { site, .. }
            | MemoryOpAfterBackward { site, .. }
            | BackwardWhileOffloaded { site, .. }
            | BackwardWithoutRecompute { site, .. }
            | SlotMissing { site }
            | SlotWithoutPlan { site }
            | SlotOutOfRange { site, .. }
            | SlotTooSmall { site, .. } => Some(site.at),
            SlotReused { reuse, .. } => Some(reuse.at),
            Duplicate { again, .. } => Some(again.at),
            MixedBackward { bwd, .. } => Some(bwd.at),
            WrongTensor { recv, .. } | WrongTokens { recv, .. } => Some(recv.at),
            Deadlock { cycle } => cycle.first().map(|s| s.waiter().at),
            StreamDeadlock { cycle, .. } => cycle.first().map(|s| s.at),
            MemoryLimit { first_over, .. } => Some(first_over.at),
        }
    }
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        use Violation::*;
        match self {
            WorldMismatch { pp, ranks } => write!(
                f,
                "the placement is for {pp} ranks, but the program has {ranks} rank streams"
            ),
            PlacementOutOfRange { stage, rank, world } => write!(
                f,
                "the placement puts {stage} on {rank}, but the program has only {world} ranks"
            ),
            TooLarge { instructions } => write!(
                f,
                "the program has {instructions} instructions, more than the verifier can number"
            ),
            OutOfRange {
                site,
                field,
                value,
                bound,
            } => {
                let (what, range) = match field {
                    Field::Stage => (format!("stage {value}"), count(*bound, "stage")),
                    Field::Microbatch => (format!("mb {value}"), count(*bound, "microbatch")),
                    Field::Peer => (format!("peer rank {value}"), count(*bound, "rank")),
                };
                write!(
                    f,
                    "{site}: {what} is out of range (the program has {range})"
                )
            }
            TooFewOps {
                tasks,
                compute_parts,
            } => write!(
                f,
                "the program needs a forward for each of {tasks} (stage, microbatch) tasks but holds only {compute_parts} compute passes; per-task checks skipped"
            ),
            Missing { part, owner } => write!(f, "{owner}: {part} never runs"),
            Duplicate { first, again, part } => {
                write!(f, "{}: {part} runs a second time (first at {})", again.at, first.at)
            }
            WrongRank { site, part, owner } => write!(
                f,
                "{site}: {part} runs on {}, but {} is on {owner}",
                site.at.rank, part.task.stage
            ),
            UnpairedSplit { site, part } => {
                let other = if part.pass == Pass::BwdD {
                    "bwd_W"
                } else {
                    "bwd_D"
                };
                write!(f, "{site}: {part} has no matching {other}")
            }
            MixedBackward { task, bwd, split } => write!(
                f,
                "{bwd} and {split} both compute the backward of {task}"
            ),
            BackwardInForwardOnly { site, part } => {
                write!(f, "{site}: {part} in a forward-only program")
            }
            WrongTensor { recv, send } => {
                let got = match send.instr {
                    Instr::Send { payload, .. } => payload.to_string(),
                    _ => "?".to_string(),
                };
                write!(f, "{recv} would receive {got} sent at {}", send.at)
            }
            WrongTokens { recv, send } => {
                let tokens = |i: &Instr| match *i {
                    Instr::Send { tokens, .. } | Instr::Recv { tokens, .. } => {
                        tokens.map_or_else(|| "no size".to_string(), |t| format!("{t} tokens"))
                    }
                    _ => "?".to_string(),
                };
                write!(
                    f,
                    "{recv} expects {} but {} sends {}",
                    tokens(&recv.instr),
                    send,
                    tokens(&send.instr)
                )
            }
            TokensNotLengths { site, expected } => {
                let found = match site.instr {
                    Instr::Send { tokens, .. } | Instr::Recv { tokens, .. } => tokens,
                    _ => None,
                };
                match (found, expected) {
                    (Some(t), Some(e)) => write!(
                        f,
                        "{site} carries {t} tokens, but its microbatch holds {e} (microbatch_lengths)"
                    ),
                    (Some(t), None) => write!(
                        f,
                        "{site} carries {t} tokens, but the program gives no microbatch_lengths"
                    ),
                    (None, Some(e)) => write!(
                        f,
                        "{site} carries no tokens, but its microbatch holds {e} (microbatch_lengths)"
                    ),
                    (None, None) => write!(f, "{site} carries no tokens"),
                }
            }
            Unmatched { site, sends, recvs } => {
                let (me, peer, what) = match site.instr {
                    Instr::Send { peer, .. } => (site.at.rank, peer, "recv"),
                    Instr::Recv { peer, .. } => (site.at.rank, peer, "send"),
                    Instr::Compute(_)
                    | Instr::Wait { .. }
                    | Instr::FwdCheckpoint(_)
                    | Instr::Memory(_) => (site.at.rank, site.at.rank, "peer"),
                };
                let (src, dst) = if what == "recv" {
                    (me, peer)
                } else {
                    (peer, me)
                };
                write!(
                    f,
                    "{site} has no matching {what}: {src} sends {} to {dst}, which posts {} from {src}",
                    count(*sends, "message"),
                    count(*recvs, "receive"),
                )
            }
            Deadlock { cycle } => {
                f.write_str("deadlock: ")?;
                for (i, step) in cycle.iter().enumerate() {
                    if i == 0 {
                        write!(f, "{}", step.waiter())?;
                    } else {
                        f.write_str(", which")?;
                    }
                    match step {
                        WaitStep::Peer { peer, until, .. } => write!(
                            f,
                            " waits for {peer}, which cannot run until {until} completes"
                        )?,
                        WaitStep::Order { until, .. } => {
                            write!(f, " cannot be posted until {until} completes")?
                        }
                    }
                }
                Ok(())
            }
            StreamDeadlock { cycle, groups, on } => {
                if groups.is_pair() {
                    write!(
                        f,
                        "deadlock under NCCL's stream order (ops of one communicator between two ranks run in issue order):"
                    )?;
                } else {
                    write!(
                        f,
                        "deadlock under NCCL's stream order (ops of one communicator run in issue order; --p2p-groups {groups}):"
                    )?;
                }
                for (k, s) in cycle.iter().enumerate() {
                    write!(f, "\n    {s}")?;
                    if let Some(g) = on.get(k) {
                        write!(f, " [on {g}]")?;
                    }
                }
                write!(f, "\n    (each waits for the one after it, the last for the first)")
            }
            WaitWithoutBatch { site, batch } => write!(
                f,
                "{}: waits for batch {batch}, which this rank has not posted before",
                site.at
            ),
            WaitAmbiguous { site, batch } => write!(
                f,
                "{}: waits for batch {batch}, but two separate batches of this rank use that id",
                site.at
            ),
            RunsBeforeWait {
                site,
                part,
                input,
                recv,
            } => write!(
                f,
                "{}: {part} uses its {} from the receive at {} before waiting for it (the receive is still in flight)",
                site.at,
                tensor_word(input.kind),
                Near(site.at.rank, recv.at)
            ),
            RunsBeforeInput {
                site,
                part,
                input,
                recv,
            } => write!(
                f,
                "{}: {part} runs before its {} arrives (recv at {})",
                site.at,
                tensor_word(input.kind),
                Near(site.at.rank, recv.at)
            ),
            InputNeverReceived {
                site,
                part,
                input,
                from,
            } => write!(
                f,
                "{}: {part} needs {input} from {from}, but {} never receives it",
                site.at, site.at.rank
            ),
            RunsBeforeLocal { site, part, needs } => write!(
                f,
                "{}: {part} runs before {} (at {})",
                site.at,
                needs.instr,
                Near(site.at.rank, needs.at)
            ),
            InputUsedTwice {
                site,
                part,
                recv,
                first_use,
            } => write!(
                f,
                "{}: {part} uses the {} received at {}, already used by {}",
                site.at,
                tensor_word(match recv.instr {
                    Instr::Recv { payload, .. } => payload.kind,
                    _ => PayloadKind::Act,
                }),
                Near(site.at.rank, recv.at),
                Near(site.at.rank, first_use.at)
            ),
            ReceivedUnused { site } => write!(f, "{site}: the received tensor is never used"),
            SendBeforeProduce { site, producer } => write!(
                f,
                "{site} sends the tensor before {} produces it (at {})",
                producer.instr,
                Near(site.at.rank, producer.at)
            ),
            SendsUnproduced { site, producer } => write!(
                f,
                "{site} sends a tensor that {} does not produce ({} produces it)",
                site.at.rank, producer
            ),
            WrongDestination {
                site,
                consumer,
                owner,
            } => {
                let local = if *owner == site.at.rank {
                    " (a same-rank hand-off needs no message)"
                } else {
                    ""
                };
                write!(
                    f,
                    "{site} goes to the wrong rank: its consumer {consumer} is on {owner}{local}"
                )
            }
            NoConsumer { site } => write!(f, "{site} sends a tensor that no stage consumes"),
            SelfMessage { site } => write!(
                f,
                "{site} sends to its own rank; a same-rank hand-off needs no message"
            ),
            OffloadWithoutForward { site } => write!(
                f,
                "{site} offloads activations its rank has not made: no forward of that stage and microbatch comes before it there"
            ),
            OffloadOfCheckpointed { site, fwd } => write!(
                f,
                "{site} offloads a checkpointed forward ({}), which keeps only its input: there is nothing to copy",
                Near(site.at.rank, fwd.at)
            ),
            ReloadWithoutOffload { site } => write!(
                f,
                "{site} reloads activations that no earlier offload on its rank sent to the host"
            ),
            WaitOffloadWithoutOffload { site } => write!(
                f,
                "{site} waits for an offload that its rank has not posted before it"
            ),
            RecomputeWithoutCheckpoint { site } => write!(
                f,
                "{site} recomputes a forward that is not checkpointed before it on its rank"
            ),
            MemoryOpTwice { site, first } => write!(
                f,
                "{site} repeats {} at {}: each is done at most once per stage and microbatch",
                crate::files::op_name(&first.instr),
                Near(site.at.rank, first.at)
            ),
            MemoryOpAfterBackward { site, backward } => write!(
                f,
                "{site} comes after the backward that needed those activations ({})",
                Near(site.at.rank, backward.at)
            ),
            BackwardWhileOffloaded {
                site,
                part,
                offload,
            } => write!(
                f,
                "{site} runs {part} while its activations are on the host: offloaded at {} and not reloaded before it",
                Near(site.at.rank, offload.at)
            ),
            BackwardWithoutRecompute { site, part, fwd } => write!(
                f,
                "{site} runs {part} of a checkpointed forward ({}) with no recompute before it",
                Near(site.at.rank, fwd.at)
            ),
            SlotMissing { site } => write!(
                f,
                "{site} has no buffer slot, but the program has a buffer plan (buffer_slots): every send and receive of a tensor names one"
            ),
            SlotWithoutPlan { site } => match site.instr {
                Instr::Send { payload, .. } | Instr::Recv { payload, .. }
                    if payload.kind.is_shape() =>
                {
                    write!(f, "{site} names a buffer slot, but shape messages take none")
                }
                _ => write!(
                    f,
                    "{site} names a buffer slot, but the program has no buffer plan (no buffer_slots)"
                ),
            },
            SlotOutOfRange { site, slot, slots } => write!(
                f,
                "{site}: buffer slot {slot} is out of range ({} has {})",
                site.at.rank,
                count(*slots, "slot")
            ),
            SlotReused {
                slot,
                live,
                live_from,
                live_until,
                reuse,
                reuse_from,
            } => write!(
                f,
                "{reuse} puts its tensor in buffer slot {slot} at #{reuse_from}, while the slot still holds the tensor of {live} (live from #{live_from} to #{live_until})"
            ),
            SlotTooSmall {
                site,
                slot,
                size,
                needs,
                unit,
            } => write!(
                f,
                "{site}: buffer slot {slot} holds {}, but the message needs {}",
                unit.with_unit(*size),
                unit.with_unit(*needs)
            ),
            MemoryLimit {
                limit,
                first_over,
                peak,
                peak_at,
                unit,
                ..
            } => write!(
                f,
                "{first_over}: more than {} (the memory limit: parameters + live activations); the rank peaks at {} at #{}",
                unit.with_unit(*limit),
                unit.with_unit(*peak),
                peak_at.at.index
            ),
        }
    }
}

/// Sizes of the verified program.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Stats {
    pub ranks: u32,
    pub instructions: u64,
    pub compute_ops: u64,
    pub sends: u64,
    pub recvs: u64,
    /// Comm batches (maximal runs of consecutive send/recv with one batch id).
    pub batches: u64,
}
