//! The verdict as a type: what the verifier hands back besides its report.
//!
//! As naga's validator returns a `ModuleInfo` that the back ends require, pipec's verifier
//! returns a [`Verified`] program (the program and the report it earned: statistics, memory
//! peaks, risks) that the runtimes require ([`Checked`]). A bare [`Program`] cannot be run by
//! mistake: [`Structural`] (the structural level only, what `pipec-run --no-verify` runs to
//! watch a broken schedule fail) is the one other way in, and it has to be asked for by name.
//! Neither can be built outside this crate except through [`verified`], [`structural`] and
//! [`crate::files::load_dir_verified`].

use super::{verify_at, Level, Report, VerifyOptions};
use crate::ir::Program;

/// A program every invariant of the verifier holds for, with the report that says so.
#[derive(Clone, Debug)]
pub struct Verified {
    program: Program,
    report: Report,
}

/// A program whose structure the verifier checked ([`Level::Structure`]: ids in range, every
/// pass once on its owner's rank, messages paired and routed), not its deadlock freedom or
/// dependency order.
#[derive(Clone, Debug)]
pub struct Structural {
    program: Program,
}

/// Why a program is neither: the program back, with the violations.
#[derive(Clone, Debug)]
pub struct Rejected {
    pub program: Program,
    pub report: Report,
}

impl Verified {
    pub fn program(&self) -> &Program {
        &self.program
    }

    /// The verifier's findings on the way (no violations): statistics, peaks, risks.
    pub fn report(&self) -> &Report {
        &self.report
    }

    pub fn into_parts(self) -> (Program, Report) {
        (self.program, self.report)
    }

    /// `program` with its report, when the report is the full verifier's verdict on it and
    /// finds nothing (the loader pairs them: [`crate::files::load_dir_verified`]).
    pub(crate) fn seal(program: Program, report: Report) -> Result<Verified, Box<Rejected>> {
        if report.is_valid() {
            Ok(Verified { program, report })
        } else {
            Err(Box::new(Rejected { program, report }))
        }
    }
}

impl Structural {
    pub fn program(&self) -> &Program {
        &self.program
    }

    pub fn into_program(self) -> Program {
        self.program
    }
}

/// A program a runtime may execute: verified, or structurally checked on request.
pub trait Checked: sealed::Sealed {
    fn program(&self) -> &Program;
    /// Whether the full verifier proved it (else only its structure was checked).
    fn fully_verified(&self) -> bool;
}

impl Checked for Verified {
    fn program(&self) -> &Program {
        &self.program
    }

    fn fully_verified(&self) -> bool {
        true
    }
}

impl Checked for Structural {
    fn program(&self) -> &Program {
        &self.program
    }

    fn fully_verified(&self) -> bool {
        false
    }
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for super::Verified {}
    impl Sealed for super::Structural {}
}

/// Run the full verifier on `program` and keep the verdict with it.
pub fn verified(program: Program, opts: &VerifyOptions) -> Result<Verified, Box<Rejected>> {
    let report = verify_at(&program, opts, Level::Full);
    Verified::seal(program, report)
}

/// [`verified`] with memory counted under `mem` against `limit` in its unit
/// ([`super::verify_with`]: what every command with a layout and a cost model verifies with).
pub fn verified_with(
    program: Program,
    threads: usize,
    mem: &crate::memory::MemoryModel,
    limit: Option<f64>,
) -> Result<Verified, Box<Rejected>> {
    let report = super::verify_with(&program, Level::Full, threads, mem, limit);
    Verified::seal(program, report)
}

/// Check `program`'s structure only ([`Level::Structure`]).
pub fn structural(program: Program) -> Result<Structural, Box<Rejected>> {
    let report = verify_at(&program, &VerifyOptions::default(), Level::Structure);
    if report.is_valid() {
        Ok(Structural { program })
    } else {
        Err(Box::new(Rejected { program, report }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{Instr, Payload};
    use pipec_schedules::{Compute, Placement, Rank, Task};

    fn program(rank0: Vec<Instr>) -> Program {
        let c = |c| Instr::Compute(c);
        let send = |peer, payload, batch| Instr::message(true, Rank(peer), payload, batch);
        let recv = |peer, payload, batch| Instr::message(false, Rank(peer), payload, batch);
        Program {
            placement: Placement::looped(2, 1),
            microbatches: 1,
            forward_only: false,
            comm: None,
            ranks: vec![
                rank0,
                vec![
                    recv(0, Payload::act(0, 0), 0),
                    c(Compute::Fwd(Task::new(1, 0))),
                    c(Compute::Bwd(Task::new(1, 0))),
                    send(0, Payload::grad(1, 0), 1),
                ],
            ],
        }
    }

    fn rank0(grad_first: bool) -> Vec<Instr> {
        let act = Instr::Send {
            peer: Rank(1),
            payload: Payload::act(0, 0),
            batch: u32::from(grad_first),
        };
        let grad = Instr::Recv {
            peer: Rank(1),
            payload: Payload::grad(1, 0),
            batch: u32::from(!grad_first),
        };
        let (a, b) = if grad_first { (grad, act) } else { (act, grad) };
        vec![
            Instr::Compute(Compute::Fwd(Task::new(0, 0))),
            a,
            b,
            Instr::Compute(Compute::Bwd(Task::new(0, 0))),
        ]
    }

    /// The full verifier makes a `Verified` of a correct program only; the structural level
    /// passes one that deadlocks (rank 0 waits for the gradient before it sends the
    /// activation) and refuses one with a pass missing, and each refusal keeps its report.
    #[test]
    fn only_what_the_verifier_accepts_is_verified() {
        let good = program(rank0(false));
        let v = verified(good.clone(), &VerifyOptions::default()).expect("valid");
        assert_eq!(v.program(), &good);
        assert!(v.report().is_valid() && v.fully_verified());

        let deadlock = program(rank0(true));
        let r = verified(deadlock.clone(), &VerifyOptions::default()).unwrap_err();
        assert!(!r.report.deadlock_free(), "{}", r.report.verdict_line());
        let s = structural(deadlock.clone()).expect("the structure is sound");
        assert!(!s.fully_verified());
        assert_eq!(s.into_program(), deadlock);

        let mut missing = program(rank0(false));
        missing.ranks[1].retain(|i| !matches!(i, Instr::Compute(Compute::Bwd(_))));
        let r = structural(missing.clone()).unwrap_err();
        assert!(!r.report.is_valid());
        assert_eq!(r.program, missing);
    }
}
