//! How a stopped rank is worded: the instruction it failed at, what it waited for, and what
//! every other rank was doing then (the hang diagnosis `pipec-run` prints). The interpreter
//! hands over a [`Fault`]; this module turns it into the [`Failure`] the watchdog reports.

use crate::backend::{CommError, Dir, Pending};
use crate::watchdog::{Failure, FailureKind, Status, Watch};
use pipec_ir::ir::{InstrRef, Program};
use pipec_schedules::Rank;
use std::fmt::Write as _;

/// Why an instruction failed, before it is worded into a [`Failure`].
pub(crate) enum Fault {
    Schedule(String),
    Compute(String),
    Comm(CommError),
}

fn ordinal(n: u64) -> String {
    let suffix = match (n % 10, n % 100) {
        (_, 11..=13) => "th",
        (1, _) => "st",
        (2, _) => "nd",
        (3, _) => "rd",
        _ => "th",
    };
    format!("{n}{suffix}")
}

/// `rank 1, #7 recv(act of stage 0, mb 2 <- rank 0)`.
pub fn describe_instr(program: &Program, rank: Rank, index: u32) -> String {
    match program.get(InstrRef { rank, index }) {
        Some(ins) => format!("{}, #{index} {ins}", rank),
        None => format!("{rank}, #{index}"),
    }
}

fn describe_pending(program: &Program, rank: Rank, p: &Pending) -> String {
    let (theirs, dir_word) = match p.dir {
        Dir::Send => ("recv", "from"),
        Dir::Recv => ("send", "to"),
    };
    format!(
        "#{} {} waits for {} to post the matching {theirs} (its {} {theirs} {dir_word} {rank}; it has posted {} so far)",
        p.at,
        program
            .get(InstrRef { rank, index: p.at })
            .map(|i| i.to_string())
            .unwrap_or_default(),
        p.peer,
        ordinal(p.seq + 1),
        p.peer_posted
    )
}

/// What every rank but `me` is doing, one line each.
pub fn others(program: &Program, me: Rank, watch: &Watch) -> String {
    let mut s = String::new();
    for r in 0..program.world() {
        if r == me.0 {
            continue;
        }
        let rank = Rank(r);
        let line = match watch.get(r as usize) {
            Status::NotStarted => "not started".to_string(),
            Status::Finished => "finished".to_string(),
            Status::Running(i) => format!("running {}", describe_instr(program, rank, i)),
            Status::Waiting(i) => format!(
                "waiting in the comm batch at {}",
                describe_instr(program, rank, i)
            ),
            Status::Stopped(i) => format!("stopped at {}", describe_instr(program, rank, i)),
        };
        let _ = writeln!(s, "  {rank}: {line}");
    }
    s
}

/// `other ranks:` and one line per other rank; empty for a single rank.
fn others_section(program: &Program, me: Rank, watch: &Watch) -> String {
    if program.world() < 2 {
        return String::new();
    }
    format!("other ranks:\n{}", others(program, me, watch))
}

/// Word a fault; `None` when the rank merely stopped because another one failed.
pub(crate) fn describe(
    program: &Program,
    rank: Rank,
    i: usize,
    end: usize,
    f: Fault,
    watch: &Watch,
) -> Option<Failure> {
    let at = InstrRef {
        rank,
        index: i as u32,
    };
    let here = describe_instr(program, rank, i as u32);
    let (kind, at, report) = match f {
        Fault::Comm(CommError::Aborted) => return None,
        Fault::Comm(CommError::InFlightUnsupported) => (
            FailureKind::Schedule,
            at,
            format!(
                "schedule error at {here}: this backend cannot leave a comm batch in flight (the schedule has wait instructions, e.g. Megatron's overlap P2P mode); run it on the cpu backend"
            ),
        ),
        Fault::Schedule(msg) => (
            FailureKind::Schedule,
            at,
            format!(
                "schedule error at {here}: {msg}\n{}",
                others_section(program, rank, watch)
            ),
        ),
        Fault::Compute(msg) => (
            FailureKind::Compute,
            at,
            format!("compute error at {here}: {msg}"),
        ),
        Fault::Comm(CommError::WrongTokens {
            at: bad,
            dir,
            tokens,
            rows,
        }) => (
            FailureKind::WrongPayload,
            InstrRef { rank, index: bad },
            format!(
                "wrong tensor size: {} carries tokens {tokens} (its size in the plan) but the tensor {} holds {rows} rows",
                describe_instr(program, rank, bad),
                match dir {
                    Dir::Send => "to send",
                    Dir::Recv => "received",
                }
            ),
        ),
        Fault::Comm(CommError::WrongPayload {
            recv_at,
            expected,
            peer,
            send_at,
            got,
        }) => (
            FailureKind::WrongPayload,
            InstrRef {
                rank,
                index: recv_at,
            },
            format!(
                "wrong tensor: {} expects {expected} but the matching send {} carries {got}",
                describe_instr(program, rank, recv_at),
                describe_instr(program, peer, send_at)
            ),
        ),
        Fault::Comm(CommError::Stalled {
            pending,
            waited,
            peer_finished,
        }) => {
            let first = pending.first().map(|p| p.at).unwrap_or(i as u32);
            let mut s = match peer_finished {
                Some(p) => format!(
                    "hang detected: {} waits for {p}, which has finished and will never post it\n",
                    describe_instr(program, rank, first)
                ),
                None => format!(
                    "hang detected: {} has waited {:.2} s (timeout {:.2} s)\n",
                    describe_instr(program, rank, first),
                    waited.as_secs_f64(),
                    watch.timeout().as_secs_f64()
                ),
            };
            if end > i + 1 {
                let _ = writeln!(s, "  in the comm batch #{i}..#{}", end - 1);
            }
            for p in &pending {
                let _ = writeln!(s, "  {}", describe_pending(program, rank, p));
            }
            s.push_str(&others_section(program, rank, watch));
            (FailureKind::Hang, InstrRef { rank, index: first }, s)
        }
    };
    Some(Failure {
        kind,
        at,
        report: report.trim_end().to_string(),
    })
}
