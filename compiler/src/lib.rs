//! pipec-compiler: a schedule request to a lowered program, and what is made of one.
//!
//! Data flows one way across the crates, and the modules are named for the stages it passes:
//!
//! ```text
//! pipec-schedules: spec, layout -> Schedule (per-rank compute orders)
//! pipec-compiler:  compile -> lower ------------------------------------+
//! pipec-ir:        Program -> verify (Verified) -> files <--------------+
//! pipec-cost:      cost model, memory weights, simulate -> Timeline
//! pipec-compiler:  torch (CSV import/export), view (text, Chrome trace, SVG, DOT), target
//! pipec-tune:      the tuner, over all of the above
//! ```
//!
//! A layout string and a [`compile::CompileRequest`] become a [`pipec_schedules::Schedule`]
//! (per-rank compute orders), which [`lower`]ing turns into a [`pipec_ir::Program`] (per-rank
//! instruction streams with explicit send/recv); [`compile::compile_verified`] is the one path
//! from a request to a verified program. [`torch`] reads and writes torch's pipelining CSV,
//! [`view`] draws programs and timelines, and [`target`] holds what each framework's runtime
//! accepts.
//!
//! A library only: the `pipec` command line (clap, its spinners, the allocator) is the crate
//! `pipec-cli` in `cli/`, so embedders such as the Python package do not compile it.

pub mod compile;
pub mod lower;
pub mod target;
pub mod torch;
pub mod view;

pub use compile::{compile, CompileError, CompileRequest, Compiled};
pub use lower::{lower, lower_orders, lower_with, Lowering};
