//! The verdict as a type: what the verifier hands back besides its report.
//!
//! As naga's validator returns a `ModuleInfo` that its back ends require, pipec's verifier
//! returns a [`Verified`] program: the program with the side table the checks built on the way
//! (the [`Report`]: per-rank memory peaks, risks, statistics; and the [`Matching`], which the
//! simulator and the torch exporter reuse instead of pairing the messages again). The writers,
//! the torch exporter, the simulator and the runtimes take it, so a bare [`Program`] cannot
//! reach them by mistake. Nothing outside this crate builds one except through [`verified`],
//! [`verified_with`] and [`crate::files::load_dir_verified`].
//!
//! The other ways in are named: [`Structural`] (the structural level only, what
//! `pipec-run --no-verify` runs to watch a broken schedule fail; the runtimes take it beside
//! [`Verified`], [`Checked`]), and [`Unverified`] (nothing proved: what `--no-verify` writes,
//! `pipec seal` rewrites and the viewers of loaded files show), which only entry points named
//! for it take (`files::write_unverified`, `simulate_unverified`, `export_csv_unverified`).
//!
//! [`Verified`] and [`Unverified`] are generic over how the program is held (`P`: owned, or
//! borrowed while `pipec compile` writes the files beside the verifier), so no caller clones a
//! program for its verdict.

use super::{check, Level, Report, StreamRule, VerifyOptions};
use crate::ir::{Matching, Program};
use crate::memory::MemoryModel;
use std::borrow::Borrow;

/// A program every invariant of the verifier holds for, with the report that says so and the
/// matching its checks read.
#[derive(Clone, Debug)]
pub struct Verified<P: Borrow<Program> = Program> {
    program: P,
    report: Report,
    matching: Matching,
}

/// A program whose structure the verifier checked ([`Level::Structure`]: ids in range, every
/// pass once on its owner's rank, messages paired and routed), not its deadlock freedom or
/// dependency order.
#[derive(Clone, Debug)]
pub struct Structural {
    program: Program,
}

/// A program nobody verified, held as such on purpose: `--no-verify`'s files, `pipec seal`'s
/// rewrite, the viewers' loaded or imported files, the tuner's candidates before the winner is
/// verified. Only functions named for it take it.
#[derive(Clone, Debug)]
pub struct Unverified<P: Borrow<Program> = Program> {
    program: P,
}

/// Why a program is neither: the program back, with the violations.
#[derive(Clone, Debug)]
pub struct Rejected<P = Program> {
    pub program: P,
    pub report: Report,
}

impl<P: Borrow<Program>> Verified<P> {
    pub fn program(&self) -> &Program {
        self.program.borrow()
    }

    /// The verifier's findings on the way (no violations): statistics, peaks, risks.
    pub fn report(&self) -> &Report {
        &self.report
    }

    /// Sends paired with receives, as the verifier paired them (every op has its partner).
    pub fn matching(&self) -> &Matching {
        &self.matching
    }

    pub fn into_program(self) -> P {
        self.program
    }

    pub fn into_parts(self) -> (P, Report) {
        (self.program, self.report)
    }

    /// `program` with what the full verifier found on it, when that is nothing (the loader
    /// runs the checks beside its hash check: [`crate::files::load_dir_verified`]).
    pub(crate) fn seal(
        program: P,
        (report, matching): (Report, Option<Matching>),
    ) -> Result<Self, Box<Rejected<P>>> {
        match matching {
            Some(matching) if report.is_valid() => Ok(Verified {
                program,
                report,
                matching,
            }),
            _ => Err(Box::new(Rejected { program, report })),
        }
    }
}

impl<'p> Verified<&'p Program> {
    /// The program, for as long as it is borrowed (not only as long as `self`).
    pub fn borrowed(&self) -> &'p Program {
        self.program
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

impl<P: Borrow<Program>> Unverified<P> {
    /// `program`, nothing proved: said at the call site.
    pub fn unchecked(program: P) -> Self {
        Unverified { program }
    }

    pub fn program(&self) -> &Program {
        self.program.borrow()
    }

    pub fn into_program(self) -> P {
        self.program
    }
}

impl<'p> Unverified<&'p Program> {
    /// The program, for as long as it is borrowed (not only as long as `self`).
    pub fn borrowed(&self) -> &'p Program {
        self.program
    }
}

/// A program a runtime may execute: verified, or structurally checked on request.
pub trait Checked: sealed::Sealed {
    fn program(&self) -> &Program;
    /// Whether the full verifier proved it (else only its structure was checked).
    fn fully_verified(&self) -> bool;
}

impl<P: Borrow<Program>> Checked for Verified<P> {
    fn program(&self) -> &Program {
        self.program.borrow()
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
    impl<P: std::borrow::Borrow<crate::ir::Program>> Sealed for super::Verified<P> {}
    impl Sealed for super::Structural {}
}

/// Run the full verifier on `program` ([`super::verify`]) and keep the verdict with it.
pub fn verified<P: Borrow<Program>>(
    program: P,
    opts: &VerifyOptions,
) -> Result<Verified<P>, Box<Rejected<P>>> {
    let checked = super::full_check(program.borrow(), opts);
    Verified::seal(program, checked)
}

/// [`verified`] on at most `threads` threads, with memory counted under `mem` against `limit`
/// in its unit ([`super::verify_with`]: what every command with a layout and a cost model
/// verifies with).
pub fn verified_with<P: Borrow<Program>>(
    program: P,
    threads: usize,
    mem: &MemoryModel,
    limit: Option<f64>,
) -> Result<Verified<P>, Box<Rejected<P>>> {
    let p = program.borrow();
    let checked = check(p, StreamRule::of(p), Level::Full, threads, mem, limit);
    Verified::seal(program, checked)
}

/// Check `program`'s structure only ([`Level::Structure`]).
pub fn structural(program: Program) -> Result<Structural, Box<Rejected>> {
    let report = super::verify_at(&program, &VerifyOptions::default(), Level::Structure);
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
            lengths: None,
            p2p_groups: Default::default(),
            buffer_slots: None,
        }
    }

    fn rank0(grad_first: bool) -> Vec<Instr> {
        let act = Instr::Send {
            peer: Rank(1),
            payload: Payload::act(0, 0),
            batch: u32::from(grad_first),
            tokens: None,
            slot: None,
        };
        let grad = Instr::Recv {
            peer: Rank(1),
            payload: Payload::grad(1, 0),
            batch: u32::from(!grad_first),
            tokens: None,
            slot: None,
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

    /// A borrowed program verifies with the same report as `verify` and the matching
    /// `Matching::of` builds, and stays where it was (no copy); a memory limit the peak
    /// exceeds refuses it (R1), with `verify`'s report.
    #[test]
    fn borrowed_verdicts_keep_the_report_and_matching() {
        let good = program(rank0(false));
        let report = super::super::verify(&good, &VerifyOptions::default());
        let v = verified(&good, &VerifyOptions::default()).expect("valid");
        assert_eq!(v.report(), &report);
        assert!(std::ptr::eq(v.program(), &good) && std::ptr::eq(v.borrowed(), &good));
        let m = Matching::of(&good).unwrap();
        assert_eq!(v.matching().messages(&good), m.messages(&good));
        let opts = VerifyOptions {
            memory_limit: Some(0),
        };
        let r = verified(&good, &opts).unwrap_err();
        assert_eq!(r.report, super::super::verify(&good, &opts));
        assert!(r
            .report
            .violations
            .iter()
            .any(|v| matches!(v, super::super::Violation::MemoryLimit { .. })));
    }
}
