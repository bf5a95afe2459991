//! The program IR: per-rank instruction streams with explicit send/recv ([`Program`]), the
//! one value every later stage reads (verification, simulation, back ends, runtimes).

mod program;

pub use program::{Instr, InstrRef, Payload, PayloadKind, Program};
