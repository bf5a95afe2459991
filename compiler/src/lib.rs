//! pipec: the pipeline-parallel schedule compiler.
//!
//! Data flows one way: a layout string and a [`compile::CompileRequest`] become a
//! [`pipec_schedules::Schedule`] (per-rank compute orders), which [`lower`]ing turns into a
//! [`program::Program`] (per-rank instruction streams with explicit send/recv). Verification,
//! simulation and the emitters read the program; [`files`] stores it.

pub mod compile;
pub mod cost;
pub mod emit;
pub mod files;
pub mod graph;
pub mod layout;
pub mod lower;
pub mod program;
pub mod sigpipe;
pub mod simulate;
pub mod sweep;
pub mod timeline;
pub mod torch;
pub mod tune;
pub mod verify;

pub use compile::{compile, CompileError, CompileRequest, Compiled};
pub use lower::{lower, lower_orders};
pub use program::{Instr, InstrRef, Payload, PayloadKind, Program};
pub use verify::{verify, Report, VerifyOptions, Violation};
