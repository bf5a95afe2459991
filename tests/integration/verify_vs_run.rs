//! The verifier agrees with reality: thousands of randomly mutated schedules, each judged by
//! `pipec_ir::verify` and then run on the CPU runtime (`pipec_runtime::run::run_cpu_unchecked`, rendezvous
//! transport, `--check` against the single-thread reference), with no verification or
//! structural pre-check in between (the program goes straight from the mutation to the
//! interpreter).
//!
//! Mutations (fixed seed, one or two per case) of Gpipe, 1F1B, interleaved 1F1B and looped-BFS
//! programs at pp 2..4, training and forward-only: swap neighbouring instructions, move a
//! receive elsewhere on its rank, drop or duplicate an instruction, change a payload's kind,
//! stage or microbatch, split an op out of its comm batch or merge two neighbouring batches.
//!
//! What each runtime outcome must be explained by (the mapping):
//! - runs to the end and `--check` is bitwise equal  <=>  the verifier finds no violation.
//!   This is the property that matters (never accept what fails, never refuse what works)
//!   and it is exact: no class crossing is allowed here.
//! - `FailureKind::Hang` (a comm batch waits past the watchdog timeout, or on a finished
//!   peer)  =>  a `deadlock`-class violation (a `Deadlock` cycle or an `Unmatched` message):
//!   the CPU transport is rendezvous, the semantics the verifier's wait graph models.
//! - `FailureKind::WrongPayload` (a receive got another tensor)  =>  `WrongTensor`, or an
//!   `Unmatched` message: an extra or missing message on a channel shifts every FIFO pair
//!   behind it, and the verifier reports the unmatched op, not the shifted pairs
//!   (`verify/matching.rs`, by design: the root cause, not its consequences).
//! - `FailureKind::Schedule` (an instruction found its input missing or its output already
//!   there)  =>  `incomplete`, `dependency`, or a message defect (`WrongTensor`,
//!   `Unmatched`). The runtime's send takes its tensor out of the rank's table and a receive
//!   puts one in, so a send of a tensor the rank does not hold (its payload was changed), a
//!   second send of one tensor, or a second receive of it fails right there, before the
//!   message could deliver a wrong tensor or block; NCCL would do the latter, which is what
//!   the verifier reports.
//! - `RunError::Check` (ran to the end, values differ from the reference)  =>  `incomplete` or
//!   `dependency` (a pass missing or run twice changes the gradients).
//! - anything else (`Compute`, i.e. a runtime panic; a refusal) is a disagreement.
//!
//! A mutated program often breaks several rules at once, and the runtime reports the first
//! failure any rank meets (which one wins may depend on thread timing), so the test asks for
//! the runtime's failure to be among the verifier's classes, not equal to the report's most
//! serious class. A hang can also be a false alarm on a loaded machine (the timeout is short
//! to keep the test fast): a hang the verifier does not predict is re-run with a long timeout
//! before it counts as a disagreement. A short timeout can make a clean run look hung, never
//! the other way round.

use pipec_ir::ir::{Instr, Payload, PayloadKind, Program};
use pipec_ir::verify::{Class, VerifyOptions, Violation};
use pipec_runtime::model::ModelConfig;
use pipec_runtime::run::run_cpu_unchecked;
use pipec_runtime::watchdog::FailureKind;
use pipec_runtime::{RunError, RunOptions};
use pipec_schedules::layout::Layout;
use pipec_schedules::{generate, Limits, Microbatch, ScheduleKind, ScheduleSpec, StageId};
use std::collections::BTreeMap;
use std::time::Duration;

/// splitmix64: a fixed, dependency-free random stream.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

fn bases() -> Vec<Program> {
    let mut v = Vec::new();
    for (kind, pp, vpp, m) in [
        (ScheduleKind::OneFOneB, 2, 1, 2),
        (ScheduleKind::OneFOneB, 3, 1, 3),
        (ScheduleKind::OneFOneB, 4, 1, 4),
        (ScheduleKind::Gpipe, 2, 1, 3),
        (ScheduleKind::Gpipe, 3, 1, 2),
        (ScheduleKind::Interleaved1F1B, 2, 2, 4),
        (ScheduleKind::LoopedBfs, 2, 2, 2),
    ] {
        for forward_only in [false, true] {
            let spec = ScheduleSpec {
                forward_only,
                ..ScheduleSpec::new(kind, pp, vpp, m)
            };
            v.push(pipec_compiler::lower(
                &generate(&spec, &Limits::DEFAULT).unwrap(),
            ));
        }
    }
    v
}

#[derive(Copy, Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Mutation {
    SwapNeighbours,
    MoveRecv,
    Drop,
    Duplicate,
    ChangePayload,
    SplitBatch,
    MergeBatches,
}

const MUTATIONS: [Mutation; 7] = [
    Mutation::SwapNeighbours,
    Mutation::MoveRecv,
    Mutation::Drop,
    Mutation::Duplicate,
    Mutation::ChangePayload,
    Mutation::SplitBatch,
    Mutation::MergeBatches,
];

fn is_comm(i: &Instr) -> bool {
    matches!(i, Instr::Send { .. } | Instr::Recv { .. })
}

fn payload_mut(i: &mut Instr) -> Option<&mut Payload> {
    match i {
        Instr::Send { payload, .. } | Instr::Recv { payload, .. } => Some(payload),
        Instr::Compute(_) | Instr::Wait { .. } | Instr::FwdCheckpoint(_) | Instr::Memory(_) => None,
    }
}

fn set_batch(i: &mut Instr, b: u32) {
    if let Instr::Send { batch, .. } | Instr::Recv { batch, .. } = i {
        *batch = b;
    }
}

/// Apply `m` somewhere in `p`; false when `p` has no place for it.
fn mutate(p: &mut Program, m: Mutation, rng: &mut Rng) -> bool {
    let r = rng.below(p.ranks.len());
    let stages = p.num_stages();
    let mbs = p.microbatches;
    let max_batch = p
        .ranks
        .iter()
        .flatten()
        .filter_map(Instr::batch)
        .max()
        .unwrap_or(0);
    let ops = &mut p.ranks[r];
    let n = ops.len();
    let comm: Vec<usize> = (0..n).filter(|&i| is_comm(&ops[i])).collect();
    match m {
        Mutation::SwapNeighbours if n >= 2 => {
            let i = rng.below(n - 1);
            ops.swap(i, i + 1);
        }
        Mutation::MoveRecv => {
            let recvs: Vec<usize> = (0..n)
                .filter(|&i| matches!(ops[i], Instr::Recv { .. }))
                .collect();
            if recvs.is_empty() {
                return false;
            }
            let ins = ops.remove(recvs[rng.below(recvs.len())]);
            ops.insert(rng.below(n), ins);
        }
        Mutation::Drop if n >= 1 => {
            ops.remove(rng.below(n));
        }
        Mutation::Duplicate if n >= 1 => {
            let i = rng.below(n);
            let ins = ops[i];
            ops.insert(i + 1, ins);
        }
        Mutation::ChangePayload if !comm.is_empty() => {
            let i = comm[rng.below(comm.len())];
            let p = payload_mut(&mut ops[i]).unwrap();
            match rng.below(3) {
                0 => {
                    p.kind = match p.kind {
                        PayloadKind::Act => PayloadKind::Grad,
                        PayloadKind::Grad => PayloadKind::Act,
                        PayloadKind::ActShape => PayloadKind::GradShape,
                        PayloadKind::GradShape => PayloadKind::ActShape,
                    }
                }
                1 if stages > 1 => {
                    p.stage =
                        StageId((p.stage.0 + 1 + rng.below(stages as usize - 1) as u32) % stages)
                }
                _ if mbs > 1 => {
                    p.mb = Microbatch((p.mb.0 + 1 + rng.below(mbs as usize - 1) as u32) % mbs)
                }
                _ => return false,
            }
        }
        Mutation::SplitBatch => {
            // An op whose batch has another op next to it.
            let cand: Vec<usize> = comm
                .iter()
                .copied()
                .filter(|&i| {
                    let b = ops[i].batch();
                    (i > 0 && is_comm(&ops[i - 1]) && ops[i - 1].batch() == b)
                        || (i + 1 < n && is_comm(&ops[i + 1]) && ops[i + 1].batch() == b)
                })
                .collect();
            if cand.is_empty() {
                return false;
            }
            set_batch(&mut ops[cand[rng.below(cand.len())]], max_batch + 1);
        }
        Mutation::MergeBatches => {
            // Two neighbouring ops in different batches: the second's whole batch joins the first's.
            let cand: Vec<usize> = (0..n.saturating_sub(1))
                .filter(|&i| {
                    is_comm(&ops[i]) && is_comm(&ops[i + 1]) && ops[i].batch() != ops[i + 1].batch()
                })
                .collect();
            if cand.is_empty() {
                return false;
            }
            let i = cand[rng.below(cand.len())];
            let (into, old) = (ops[i].batch().unwrap(), ops[i + 1].batch());
            let mut j = i + 1;
            while j < n && is_comm(&ops[j]) && ops[j].batch() == old {
                set_batch(&mut ops[j], into);
                j += 1;
            }
        }
        _ => return false,
    }
    true
}

#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Outcome {
    Clean,
    Hang,
    WrongPayload,
    Schedule,
    CheckMismatch,
    Other(String),
}

fn run(p: &Program, timeout: Duration) -> Outcome {
    let opts = RunOptions {
        model: ModelConfig {
            hidden: 2,
            ffn: 2,
            vocab: 4,
            seq: 2,
            seed: 5,
        },
        steps: 1,
        lr: 0.1,
        timeout,
        check: true,
        trace_steps: None,
    };
    match run_cpu_unchecked(p, &Layout::uniform(p.num_stages()), &opts) {
        Ok(r) => match &r.steps[0].check {
            Some(c) if c.max_abs_diff == 0.0 => Outcome::Clean,
            other => Outcome::Other(format!("ran, check {other:?}")),
        },
        Err(RunError::Failed(f)) => match f.kind {
            FailureKind::Hang => Outcome::Hang,
            FailureKind::WrongPayload => Outcome::WrongPayload,
            FailureKind::Schedule => Outcome::Schedule,
            FailureKind::Compute => Outcome::Other(format!("compute: {}", f.report)),
        },
        Err(RunError::Check { .. }) => Outcome::CheckMismatch,
        Err(e) => Outcome::Other(e.to_string()),
    }
}

/// Whether the runtime's `outcome` is explained by the verifier's `classes` (see the module
/// doc); `unmatched`: the report has an [`Violation::Unmatched`] message.
fn agrees(classes: &[Class], unmatched: bool, outcome: &Outcome) -> bool {
    let has = |c: Class| classes.contains(&c);
    match outcome {
        Outcome::Clean => classes.is_empty(),
        Outcome::Hang => has(Class::Deadlock),
        Outcome::WrongPayload => has(Class::WrongTensor) || unmatched,
        Outcome::Schedule => {
            has(Class::Incomplete) || has(Class::Dependency) || has(Class::WrongTensor) || unmatched
        }
        Outcome::CheckMismatch => has(Class::Incomplete) || has(Class::Dependency),
        Outcome::Other(_) => false,
    }
}

const CASES: usize = 3000;

#[test]
fn verifier_verdicts_agree_with_cpu_runs_of_mutated_schedules() {
    let bases = bases();
    let mut rng = Rng(0x005e_ed0f_c0de_2024);
    // (verifier's most serious class or "valid", runtime outcome) -> cases
    let mut matrix: BTreeMap<(String, String), usize> = BTreeMap::new();
    let mut by_mutation: BTreeMap<Mutation, usize> = BTreeMap::new();
    let mut disagreements = Vec::new();
    let mut crossings: BTreeMap<String, usize> = BTreeMap::new();
    let mut case = 0;
    while case < CASES {
        let base = &bases[rng.below(bases.len())];
        let mut p = base.clone();
        let count = 1 + usize::from(rng.below(4) == 0);
        let mut applied = Vec::new();
        for _ in 0..count {
            let m = MUTATIONS[rng.below(MUTATIONS.len())];
            if mutate(&mut p, m, &mut rng) {
                applied.push(m);
            }
        }
        if applied.is_empty() {
            continue;
        }
        case += 1;
        for m in &applied {
            *by_mutation.entry(*m).or_default() += 1;
        }
        // The CPU runtime's transport is rendezvous with FIFO channels and no NCCL streams:
        // the verifier's model with one stream per direction (which adds nothing to it).
        let rendezvous = pipec_ir::verify::StreamRule {
            per_direction: true,
            ops_in_order: false,
            groups: pipec_schedules::P2pGroups::Pair,
        };
        let report = pipec_ir::verify::verify_under(
            &p,
            &VerifyOptions::default(),
            pipec_ir::verify::Level::Full,
            1,
            rendezvous,
        );
        let mut classes: Vec<Class> = report.violations.iter().map(|v| v.class()).collect();
        classes.sort();
        classes.dedup();
        let unmatched = report
            .violations
            .iter()
            .any(|v| matches!(v, Violation::Unmatched { .. }));
        let mut outcome = run(&p, Duration::from_millis(40));
        if !agrees(&classes, unmatched, &outcome) && outcome == Outcome::Hang {
            outcome = run(&p, Duration::from_secs(3));
        }
        let verdict = report
            .class()
            .map_or("valid".to_string(), |c| c.name().to_string());
        *matrix
            .entry((verdict, format!("{outcome:?}").chars().take(40).collect()))
            .or_default() += 1;
        if !agrees(&classes, unmatched, &outcome) {
            let mut kinds: Vec<String> = report
                .violations
                .iter()
                .map(|v| {
                    format!("{v:?}")
                        .split([' ', '{'])
                        .next()
                        .unwrap()
                        .to_string()
                })
                .collect();
            kinds.sort();
            kinds.dedup();
            *crossings
                .entry(format!("{kinds:?} -> {outcome:?}"))
                .or_default() += 1;
            disagreements.push(format!(
                "case {case} {applied:?}: verifier {classes:?} ({}), runtime {outcome:?}\n{:?}",
                report.verdict_line(),
                p.ranks
            ));
        }
    }
    eprintln!("verify-vs-run: {CASES} cases; mutations applied {by_mutation:?}");
    for ((v, o), n) in &matrix {
        eprintln!("verify-vs-run: verifier {v:>12} | runtime {o:<14} | {n}");
    }
    for (k, n) in &crossings {
        eprintln!("verify-vs-run: crossing {k}: {n}");
    }
    assert!(
        disagreements.is_empty(),
        "{} disagreements, first ones:\n{}",
        disagreements.len(),
        disagreements
            .iter()
            .take(5)
            .cloned()
            .collect::<Vec<_>>()
            .join("\n\n")
    );
    // docs/robustness.md publishes the verdicts (deterministic: fixed seed, no timing).
    let mut totals: BTreeMap<&str, usize> = BTreeMap::new();
    for ((v, _), n) in &matrix {
        *totals.entry(v.as_str()).or_default() += n;
    }
    let line = [
        "valid",
        "deadlock",
        "wrong tensor",
        "incomplete",
        "dependency",
    ]
    .iter()
    .map(|v| format!("{v} {}", totals.get(v).copied().unwrap_or(0)))
    .collect::<Vec<_>>()
    .join(", ");
    let doc = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../docs/robustness.md"
    ))
    .expect("docs/robustness.md");
    let line = format!("verdicts: {line}\n");
    assert!(
        doc.contains(&format!(
            "<!-- verify-vs-run:begin -->\n{line}<!-- verify-vs-run:end -->"
        )),
        "docs/robustness.md's verdict totals are stale; now: {line}"
    );
    // The mix must exercise every side of the mapping, or the test proves little.
    let seen = |v: &str| matrix.keys().any(|(k, _)| k == v);
    for v in [
        "valid",
        "deadlock",
        "wrong tensor",
        "incomplete",
        "dependency",
    ] {
        assert!(seen(v), "no case judged {v}: {matrix:?}");
    }
}
