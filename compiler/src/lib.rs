//! pipec: the pipeline-parallel schedule compiler.
//!
//! Data flows one way across three crates, and the modules are named for the stages it
//! passes:
//!
//! ```text
//! pipec-schedules: spec, layout -> Schedule (per-rank compute orders)
//! pipec:           compile (+ sweep files) -> lower ----------------------+
//! pipec-ir:        ir (Program) -> verify (Report) -> files <------------+
//! pipec:           back (torch, view), simulate (cost, timeline), tune
//! ```
//!
//! A layout string and a [`compile::CompileRequest`] become a [`pipec_schedules::Schedule`]
//! (per-rank compute orders), which [`lower`]ing turns into an [`ir::Program`] (per-rank
//! instruction streams with explicit send/recv). The program, its verifier, the memory rule
//! and the instruction-file format are the `pipec-ir` crate's, re-exported here under the
//! paths they always had ([`ir`], [`verify`], [`back::files`], [`memory`]); simulation, the
//! other back ends and the tuner read the program.
//!
//! A library only: the `pipec` command line (clap, its spinners, the allocator) is the crate
//! `pipec-cli` in `cli/`, so embedders such as the Python package do not compile it.

pub mod back;
pub mod compile;
pub mod front;
pub mod lower;
pub mod memory;
pub mod simulate;
pub mod tidy;
pub mod tune;

pub use pipec_ir::{ir, par, words};

pub use compile::{compile, CompileError, CompileRequest, Compiled};
pub use ir::{Instr, InstrRef, Payload, PayloadKind, Program};
pub use lower::{lower, lower_orders, lower_with, Lowering};
pub use pipec_ir::verify::{self, verify, Report, VerifyOptions, Violation};
