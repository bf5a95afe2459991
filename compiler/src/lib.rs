//! pipec: the pipeline-parallel schedule compiler.
//!
//! Data flows one way, and the modules are named for the stages it passes:
//!
//! ```text
//! front (layout) -> compile (+ sweep files) -> lower -> ir (Program) -> verify -> back (files, torch, view)
//!                                                         \-> simulate (cost, timeline)
//! ```
//!
//! A layout string and a [`compile::CompileRequest`] become a [`pipec_schedules::Schedule`]
//! (per-rank compute orders), which [`lower`]ing turns into an [`ir::Program`] (per-rank
//! instruction streams with explicit send/recv). Verification, simulation and the back ends
//! read the program; [`back::files`] stores it and reads it back.
//!
//! A library only: the `pipec` command line (clap, its spinners, the allocator) is the crate
//! `pipec-cli` in `cli/`, so embedders such as the Python package do not compile it.

pub mod back;
pub mod compile;
pub mod front;
pub mod ir;
pub mod lower;
pub mod memory;
pub mod par;
pub mod simulate;
pub mod tidy;
pub mod tune;
pub mod verify;
pub mod words;

pub use compile::{compile, CompileError, CompileRequest, Compiled};
pub use ir::{Instr, InstrRef, Payload, PayloadKind, Program};
pub use lower::{lower, lower_orders};
pub use verify::{verify, Report, VerifyOptions, Violation};
