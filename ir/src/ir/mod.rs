//! The program IR: per-rank instruction streams with explicit send/recv ([`Program`]), the
//! one value every later stage reads (verification, simulation, back ends, runtimes), and the
//! analyses of it they share, each written once: global instruction ids ([`Positions`]), the
//! optional index of dense tables ([`OptIdx`]), a stream cut into compute ops, comm batches
//! and waits ([`steps`]), sends paired with receives ([`Matching`]), live activations per
//! rank ([`activations`]), and an order that runs with blocking one-at-a-time sends and
//! receives ([`blocking_order`]).

pub mod activations;
mod blocking;
pub mod buffers;
mod capture;
mod id;
mod matching;
mod program;
mod steps;

pub use blocking::blocking_order;
pub use capture::{capture_order, capture_order_json, CaptureError, CaptureStep};
pub use id::{OptIdx, Positions, TooLarge};
pub use matching::{Channel, Matching};
pub use program::{Instr, InstrRef, MemKind, MemOp, Payload, PayloadKind, Pools, Program, Tokens};
pub use steps::{batch_end, steps, waited_batches, Step, Steps};
