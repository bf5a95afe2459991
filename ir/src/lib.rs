//! pipec-ir: the program IR, the one value every stage after lowering reads, and what judges
//! and stores it. No CLI, no cost model, no lowering: those live in `pipec` and hand this
//! crate plain values.
//!
//! ```text
//! spec -> schedules (pipec-schedules) -> program (ir) -> verdict (verify) -> files / exports / runtimes
//! ```
//!
//! What it owns:
//! - [`ir`]: [`Program`] (per-rank instruction streams with explicit send/recv), [`Instr`],
//!   [`Payload`], [`InstrRef`], and the analyses every reader shares, each written once:
//!   [`ir::steps`] (a stream cut into compute ops, comm batches and waits), [`ir::Matching`]
//!   (sends paired with receives), [`ir::activations`] (live activations per rank).
//! - [`verify`](mod@verify): the verifier; its module doc is the specification of a valid program.
//!   Its verdict is a type: [`verify::Verified`] (the program with the report and matching the
//!   checks built), which the writers, exporters, simulator and runtimes require, or
//!   [`verify::Rejected`]; `--no-verify` paths hold a [`verify::Unverified`] program.
//! - [`memory`]: the peak-memory rule the verifier, the simulator and the tuner report, over
//!   per-stage activation weights and per-rank parameters given as numbers.
//! - [`files`]: the instruction-file format (manifest, JSON and binary rank files, hashes,
//!   seal), written and read back.
//! - [`par`] and [`words`]: the threads and the counted nouns the above use.
//!
//! Invariants:
//! - Data flows one way: this crate depends on `pipec-schedules` only, never on the compiler.
//! - A [`Program`] read from files is untrusted: the verifier and the loaders range-check
//!   every id before indexing, and never panic or recurse on its size.
//! - Same program, same bytes: the writers are deterministic, and the verifier's report does
//!   not depend on the number of threads.

pub mod files;
pub mod human;
pub mod ir;
pub mod memory;
pub mod par;
pub mod verify;

pub use ir::{Instr, InstrRef, MemKind, MemOp, Payload, PayloadKind, Program};
pub use verify::{verify, Report, Unverified, Verified, VerifyOptions, Violation};
