//! The verifier: proves a [`Program`] correct before it runs, or says in words why it is not.
//!
//! A program is valid when every invariant below holds. Each broken invariant is one
//! [`Violation`] (the variant named in brackets); the verifier collects all of them rather
//! than stopping at the first, but skips checks that could only repeat an earlier finding
//! (a check that would index with an out-of-range id, a dependency on a pass that never
//! runs). Programs read from files are untrusted: every id is range-checked before it is used
//! as an index, and nothing here panics or recurses on the program's size.
//!
//! Structure
//! - S1. The placement is for as many ranks as the program has streams [`WorldMismatch`],
//!   and places every stage on one of them [`PlacementOutOfRange`].
//! - S2. Every stage, microbatch and peer id is in range [`OutOfRange`].
//! - S3. The instructions can be numbered by the verifier's positions [`TooLarge`], and the
//!   (stage, microbatch) tasks are few enough for the program's compute ops to cover them
//!   [`TooFewOps`] (else the per-task checks are skipped instead of allocating a table per
//!   task).
//!
//! Completeness (docs/design.md rule 1)
//! - C1. Every `(s, m)` has exactly one `fwd` [`Missing`], [`Duplicate`].
//! - C2. Unless the program is forward-only, every `(s, m)` has exactly one backward: one
//!   `bwd`, or one `bwd_D` and one `bwd_W` [`Missing`], [`Duplicate`], [`UnpairedSplit`],
//!   [`MixedBackward`]; a forward-only program has none [`BackwardInForwardOnly`].
//! - C3. Every pass runs on the rank that owns it, `placement.rank_of(task)` [`WrongRank`].
//!
//! Matching (rule 3)
//! - M1. Per ordered pair of ranks, the k-th send meets the k-th receive (NCCL's FIFO order
//!   per peer); each pair carries the same (kind, stage, mb) on both sides [`WrongTensor`].
//! - M2. Every send and receive has a partner [`Unmatched`].
//! - M3. A matched send and receive of the same tensor agree on its `tokens` [`WrongTokens`].
//! - M4. Every send and receive carries the tokens of its microbatch as the program's
//!   `microbatch_lengths` give them, and none without lengths [`TokensNotLengths`].
//!
//! Deadlock freedom (rule 4)
//! - D1. Under rendezvous semantics with comm batches as units (all ops of a batch are posted
//!   together; an op completes when its partner is posted; a batch completes when all its ops
//!   have), the wait graph of batches is acyclic [`Deadlock`], reported as the cycle of waits
//!   in words. See [`deadlock`] for the graph and why it is exact.
//! - D2. Where batches are left in flight or ops issued one by one, the same under NCCL's
//!   stream order (ops of one communicator between two ranks run in issue order), with the
//!   communicators of the program's own model ([`Program::comm`]) [`StreamDeadlock`]. See
//!   [`streams`].
//! - D3. A `wait` names a batch its rank posted earlier [`WaitWithoutBatch`], and only one
//!   [`WaitAmbiguous`]; a pass using a tensor from a receive left in flight waits for it first
//!   [`RunsBeforeWait`].
//!
//! Dependencies (rule 2)
//! - P1. `fwd(s,m)` runs after `fwd(s-1,m)`; `bwd(s,m)`/`bwd_D(s,m)` after `fwd(s,m)` and
//!   after the backward (`bwd` or `bwd_D`) of `(s+1,m)`; `bwd_W(s,m)` after `bwd_D(s,m)`; a
//!   `fwd_bwd` pair has the union of its parts' needs, and neither part feeds the other.
//! - P2. An input made on the same rank comes from an earlier instruction there
//!   [`RunsBeforeLocal`]; one made on another rank from an earlier receive of exactly that
//!   payload [`RunsBeforeInput`], [`InputNeverReceived`], used by one pass only
//!   [`InputUsedTwice`]; every received tensor is used [`ReceivedUnused`].
//! - P3. A send comes after the pass that produces its tensor on the sending rank
//!   [`SendBeforeProduce`], [`SendsUnproduced`]; goes to the rank that owns the consuming
//!   stage [`WrongDestination`]; carries a tensor some stage consumes [`NoConsumer`]; and never
//!   targets its own rank, since same-rank hand-offs are local [`SelfMessage`].
//!
//! Memory (rule 5)
//! - R1. Peak live activations per rank are reported with the instruction where they are first
//!   reached, with the host memory offloads hold; with a limit, exceeding it is a violation
//!   [`MemoryLimit`]. The count includes the memory instructions (in-flight copies count). See
//!   [`memory`] and [`crate::ir::activations`].
//!
//! Memory instructions, labelled O for offload so as not to clash with the matching rules M1-M2
//! (issue 30, docs/format.md "Memory instructions"; each violation at its
//! rank and instruction; also checked at [`Level::Structure`]). See [`offload`], which also
//! argues why the copy stream adds no deadlock.
//! - O1. An `offload(s, m)` comes after `fwd(s, m)` on its rank [`OffloadWithoutForward`],
//!   never of a checkpointed forward [`OffloadOfCheckpointed`].
//! - O2. `offload`, `reload` and `recompute` of one `(s, m)` happen at most once
//!   [`MemoryOpTwice`], and before the backward (`bwd`/`bwd_D`) of `(s, m)`
//!   [`MemoryOpAfterBackward`].
//! - O3. A `reload` comes after its offload [`ReloadWithoutOffload`]; no backward of offloaded
//!   activations before their reload [`BackwardWhileOffloaded`].
//! - O4. A `wait_offload` comes after its offload [`WaitOffloadWithoutOffload`].
//! - O5. A `recompute` comes after a checkpointed `fwd` of its `(s, m)`
//!   [`RecomputeWithoutCheckpoint`]; the backward of a checkpointed forward comes after its
//!   recompute [`BackwardWithoutRecompute`].
//!
//! Buffer plan (issue #39, `--buffer-plan`; docs/format.md `slot`, `buffer_slots`; also
//! checked at [`Level::Structure`]: a runtime indexes its pools with the slots). See
//! [`buffers`] and [`crate::ir::buffers`] for the lifetimes.
//! - B1. With `buffer_slots`, every send and receive of a tensor names a slot [`SlotMissing`]
//!   of its rank's pool [`SlotOutOfRange`]; without them none does, and a shape message never
//!   does [`SlotWithoutPlan`].
//! - B2. A slot is never given to a message while it holds another message's tensor
//!   [`SlotReused`].
//! - B3. Under a cost model that sizes messages, every slot is at least as large as each
//!   message it holds [`SlotTooSmall`]; the pools count in R1's peak.
//!
//! Risks (reported beside the verdict, see [`risk`]): what holds under this model but is
//! fragile on NCCL, such as two tensors to one peer in one batch.
//!
//! The verdict is a type ([`Verified`], see [`mod@verified`]): [`verify`] and its variants judge
//! a borrowed program and return the [`Report`]; [`verified()`] and [`verified_with`] run the
//! same checks and hand back the program with its report and matching only when the report has
//! no violations (else [`Rejected`]: the program and its report). The writers, the torch
//! exporter, the simulator and the runtimes take a [`Verified`]; `pipec-run --no-verify` runs a
//! [`Structural`] program, and the other `--no-verify` paths hold an [`Unverified`] one, with
//! entry points of their own.
//!
//! Costs are linear in the program (plus sorting cycle members when there are cycles): one
//! indexing pass builds dense tables over positions, tasks and payloads, and every check reads
//! them. D1 first runs the ranks against each other and builds the wait graph only for a
//! program that gets stuck. On a big program the checks run on two threads ([`verify_at`]),
//! with the report the same as on one.
//!
//! [`StreamDeadlock`]: Violation::StreamDeadlock
//! [`TooLarge`]: Violation::TooLarge
//! [`TooFewOps`]: Violation::TooFewOps
//! [`WaitWithoutBatch`]: Violation::WaitWithoutBatch
//! [`WaitAmbiguous`]: Violation::WaitAmbiguous
//! [`RunsBeforeWait`]: Violation::RunsBeforeWait
//! [`WorldMismatch`]: Violation::WorldMismatch
//! [`PlacementOutOfRange`]: Violation::PlacementOutOfRange
//! [`OutOfRange`]: Violation::OutOfRange
//! [`Missing`]: Violation::Missing
//! [`Duplicate`]: Violation::Duplicate
//! [`UnpairedSplit`]: Violation::UnpairedSplit
//! [`MixedBackward`]: Violation::MixedBackward
//! [`BackwardInForwardOnly`]: Violation::BackwardInForwardOnly
//! [`WrongRank`]: Violation::WrongRank
//! [`WrongTensor`]: Violation::WrongTensor
//! [`WrongTokens`]: Violation::WrongTokens
//! [`TokensNotLengths`]: Violation::TokensNotLengths
//! [`Unmatched`]: Violation::Unmatched
//! [`Deadlock`]: Violation::Deadlock
//! [`RunsBeforeLocal`]: Violation::RunsBeforeLocal
//! [`RunsBeforeInput`]: Violation::RunsBeforeInput
//! [`InputNeverReceived`]: Violation::InputNeverReceived
//! [`InputUsedTwice`]: Violation::InputUsedTwice
//! [`ReceivedUnused`]: Violation::ReceivedUnused
//! [`SendBeforeProduce`]: Violation::SendBeforeProduce
//! [`SendsUnproduced`]: Violation::SendsUnproduced
//! [`WrongDestination`]: Violation::WrongDestination
//! [`NoConsumer`]: Violation::NoConsumer
//! [`SelfMessage`]: Violation::SelfMessage
//! [`MemoryLimit`]: Violation::MemoryLimit
//! [`SlotMissing`]: Violation::SlotMissing
//! [`SlotWithoutPlan`]: Violation::SlotWithoutPlan
//! [`SlotOutOfRange`]: Violation::SlotOutOfRange
//! [`SlotReused`]: Violation::SlotReused
//! [`SlotTooSmall`]: Violation::SlotTooSmall
//! [`OffloadWithoutForward`]: Violation::OffloadWithoutForward
//! [`OffloadOfCheckpointed`]: Violation::OffloadOfCheckpointed
//! [`ReloadWithoutOffload`]: Violation::ReloadWithoutOffload
//! [`WaitOffloadWithoutOffload`]: Violation::WaitOffloadWithoutOffload
//! [`RecomputeWithoutCheckpoint`]: Violation::RecomputeWithoutCheckpoint
//! [`MemoryOpTwice`]: Violation::MemoryOpTwice
//! [`MemoryOpAfterBackward`]: Violation::MemoryOpAfterBackward
//! [`BackwardWhileOffloaded`]: Violation::BackwardWhileOffloaded
//! [`BackwardWithoutRecompute`]: Violation::BackwardWithoutRecompute

pub mod buffers;
mod complete;
pub mod deadlock;
mod deps;
pub(crate) mod index;
pub(crate) mod matching;
pub mod memory;
pub mod offload;
pub mod report;
pub mod risk;
mod routes;
pub mod streams;
pub mod verified;
pub mod violation;

use crate::ir::{Matching, Program};
pub use report::{RankMemory, Report};
pub use risk::Risk;
pub use streams::StreamRule;
pub use verified::{
    structural, verified, verified_with, Checked, Rejected, Structural, Unverified, Verified,
};
pub use violation::{Class, Field, Part, Site, Stats, Violation, WaitStep};

/// How much to prove.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub enum Level {
    /// What a runtime needs before it can execute a program at all, each check linear and
    /// cheap: S1-S2, C1-C3, M1-M2 and P3's routes (a send goes to the rank owning the stage
    /// that consumes it). A program that passes cannot make an interpreter index out of range
    /// or pair the wrong tensors; it may still deadlock or run a pass before its input
    /// (`pipec-run --no-verify` runs it to watch that happen, under the watchdog).
    Structure,
    /// Every invariant of the module doc.
    #[default]
    Full,
}

/// What to check beyond the invariants every program must meet. The rest of what a check
/// depends on is the program's own ([`Program::comm`]: its communicator model).
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct VerifyOptions {
    /// Most live activations a rank may hold (`--memory-limit`).
    pub memory_limit: Option<u64>,
}

/// Check every invariant of the module doc. Pure and deterministic: the same program gives
/// the same report.
pub fn verify(program: &Program, opts: &VerifyOptions) -> Report {
    verify_at(program, opts, Level::Full)
}

/// Check the invariants of `level` ([`Level::Structure`] or all of them).
///
/// On a big program the independent checks run on two threads (indexing beside matching,
/// then the matching and deadlock checks beside the rest); the violations are gathered in the
/// order the module doc lists them either way, so the report does not depend on the threads.
pub fn verify_at(program: &Program, opts: &VerifyOptions, level: Level) -> Report {
    let threads = crate::par::threads_for(program.len() as u64);
    verify_on(program, opts, level, threads)
}

/// [`verify_at`] on at most `threads` threads (two are used at most; one below 64k
/// instructions is best, see [`crate::par::threads_for`]). For callers that run other work
/// beside the verifier: `pipec compile` writing a large program as JSON keeps every core busy
/// without it, and is faster verifying on one thread.
pub fn verify_on(program: &Program, opts: &VerifyOptions, level: Level, threads: usize) -> Report {
    verify_under(program, opts, level, threads, StreamRule::of(program))
}

/// [`verify`], keeping the matching for a [`Verified`] value ([`Verified::seal`]).
pub(crate) fn full_check(program: &Program, opts: &VerifyOptions) -> (Report, Option<Matching>) {
    let threads = crate::par::threads_for(program.len() as u64);
    let units = crate::memory::MemoryModel::units(program);
    let limit = opts.memory_limit.map(|l| l as f64);
    check(
        program,
        StreamRule::of(program),
        Level::Full,
        threads,
        &units,
        limit,
    )
}

/// [`verify_on`] under `streams` instead of the rule of the program's own communicator model
/// ([`StreamRule::of`]): for judges that model another transport (the CPU runtime's rendezvous
/// channels have one stream per direction) and tests that compare rules.
pub fn verify_under(
    program: &Program,
    opts: &VerifyOptions,
    level: Level,
    threads: usize,
    streams: StreamRule,
) -> Report {
    let units = crate::memory::MemoryModel::units(program);
    let limit = opts.memory_limit.map(|l| l as f64);
    check(program, streams, level, threads, &units, limit).0
}

/// [`verify_on`] with R1 counted under `mem` (per-stage activation weights and per-rank
/// parameters, [`crate::memory`]) against `limit` in `mem`'s unit. What every command that
/// has a layout and a cost model verifies with.
pub fn verify_with(
    program: &Program,
    level: Level,
    threads: usize,
    mem: &crate::memory::MemoryModel,
    limit: Option<f64>,
) -> Report {
    check(program, StreamRule::of(program), level, threads, mem, limit).0
}

/// The report, and the matching the checks read (kept by [`Verified`]; `None` only when the
/// program is too large to number).
fn check(
    program: &Program,
    streams: StreamRule,
    level: Level,
    threads: usize,
    mem: &crate::memory::MemoryModel,
    limit: Option<f64>,
) -> (Report, Option<Matching>) {
    let mut violations = Vec::new();
    let (m, ix) = crate::par::join(
        threads,
        || Matching::of(program),
        || index::Index::build(program, &mut violations),
    );
    let (Some(ix), Some(m)) = (ix, m) else {
        let report = Report {
            violations,
            memory: Vec::new(),
            memory_unit: mem.unit,
            risks: Vec::new(),
            stats: Stats {
                ranks: program.world(),
                instructions: program.len() as u64,
                ..Stats::default()
            },
        };
        return (report, None);
    };
    let full = level == Level::Full;
    // Thread one: M1-M2 (the matching compared the payloads already), then D1, D2 and the
    // risks. Thread two: C1-C2, then P1-P3 (or only P3's routes) and R1. The split is chosen
    // so that the two take about as long on a large program.
    let ((comm, risks), (complete, later, memory)) = crate::par::join(
        threads,
        || {
            let mut found = Vec::new();
            matching::check(&ix, &m, &mut found);
            if !full {
                return (found, Vec::new());
            }
            deadlock::check(&ix, &m, &mut found);
            if !found
                .iter()
                .any(|v| matches!(v, Violation::Deadlock { .. }))
            {
                streams::check(&ix, &m, streams, &mut found);
            }
            let mut risks = risk::check(&ix);
            // K2 only where the program names its communicators: under the default the
            // runtime's layout is not known (torch's batched P2P shares one device-keyed
            // communicator, its raw P2P one per pair, Megatron its pipeline group), so a
            // head-of-line reading would be a guess, and the default's verdict and risks stay
            // what they were before `--p2p-groups` existed.
            if ix.p.p2p_groups != pipec_schedules::P2pGroups::Pair {
                risks.extend(streams::head_of_line(&ix, streams));
            }
            (found, risks)
        },
        || {
            let mut complete = Vec::new();
            complete::check(&ix, &mut complete);
            offload::check(&ix, &mut complete);
            buffers::check(&ix, mem, &mut complete);
            let mut found = Vec::new();
            if !full {
                routes::check(&ix, &mut found);
                return (complete, found, Vec::new());
            }
            deps::check(&ix, &m, &mut found);
            let memory = memory::check(&ix, mem, limit, &mut found);
            (complete, found, memory)
        },
    );
    violations.extend(complete);
    violations.extend(comm);
    violations.extend(later);
    let report = Report {
        violations,
        memory,
        memory_unit: mem.unit,
        risks,
        stats: ix.stats,
    };
    (report, Some(m))
}

#[cfg(test)]
mod tests {

    /// Regression (#27): the module doc, the verifier's specification, omitted 5 of its
    /// violations. Every variant of [`Violation`] is named in it.
    #[test]
    fn module_doc_names_every_violation() {
        let doc = include_str!("mod.rs");
        let report = include_str!("violation.rs");
        let body = &report[report.find("pub enum Violation {").unwrap()..];
        let body = &body[..body.find("\n}\n").unwrap()];
        let variants: Vec<&str> = body
            .lines()
            .filter_map(|l| l.strip_prefix("    "))
            .filter(|l| l.starts_with(|c: char| c.is_ascii_uppercase()))
            .map(|l| {
                l.split(|c: char| !c.is_ascii_alphanumeric())
                    .next()
                    .unwrap()
            })
            .collect();
        assert!(variants.len() >= 29, "{variants:?}");
        for v in variants {
            assert!(doc.contains(&format!("[`{v}`]: Violation::{v}")), "{v}");
        }
    }

    use super::*;
    use crate::ir::{Instr, Payload};
    use pipec_schedules::{Compute, Placement, Rank, Task};

    #[test]
    fn huge_microbatch_count_is_reported_not_allocated() {
        let p = Program {
            placement: Placement::looped(1, 1),
            microbatches: u32::MAX,
            forward_only: false,
            comm: None,
            ranks: vec![vec![Instr::Compute(Compute::Fwd(Task::new(0, 0)))]],
            lengths: None,
            p2p_groups: Default::default(),
            buffer_slots: None,
        };
        let r = verify(&p, &VerifyOptions::default());
        assert_eq!(
            r.violations,
            vec![Violation::TooFewOps {
                tasks: u32::MAX as u64,
                compute_parts: 1
            }]
        );
        assert_eq!(r.memory[0].peak, 1.0);
    }

    /// A wait cycle through 2 * 100_000 batches: Kahn's algorithm and the explicit-stack
    /// Tarjan must get through it without recursion. Rank 0 first waits for rank 1's only
    /// send, which rank 1 posts after receiving all of rank 0's sends.
    #[test]
    fn a_long_cycle_does_not_overflow_the_stack() {
        let n = 100_000u32;
        let recv = |peer, payload, batch| Instr::Recv {
            peer: Rank(peer),
            payload,
            batch,
            tokens: None,
            slot: None,
        };
        let send = |peer, payload, batch| Instr::Send {
            peer: Rank(peer),
            payload,
            batch,
            tokens: None,
            slot: None,
        };
        let mut r0 = vec![recv(1, Payload::grad(1, 0), 0)];
        let mut r1 = Vec::new();
        for k in 0..n {
            r0.push(send(1, Payload::act(0, k), k + 1));
            r1.push(recv(0, Payload::act(0, k), k));
        }
        r1.push(send(0, Payload::grad(1, 0), n));
        let p = Program {
            placement: Placement::looped(2, 1),
            microbatches: n,
            forward_only: true,
            comm: None,
            ranks: vec![r0, r1],
            lengths: None,
            p2p_groups: Default::default(),
            buffer_slots: None,
        };
        let r = verify(&p, &VerifyOptions::default());
        let cycles: Vec<&Violation> = r
            .violations
            .iter()
            .filter(|v| matches!(v, Violation::Deadlock { .. }))
            .collect();
        assert_eq!(cycles.len(), 1);
        let Violation::Deadlock { cycle } = cycles[0] else {
            unreachable!()
        };
        // rank 0 #0 waits for rank 1's send, which cannot run until rank 1's last receive
        // completes, which waits for rank 0's last send, which cannot be posted until ... #0.
        assert_eq!(cycle[0].waiter().at.index, 0);
        // Runs of program-order waits are folded, so the words stay short.
        assert!(cycle.len() <= 4, "{}", cycles[0]);
        assert!(cycles[0].to_string().len() < 1000);
    }
}
