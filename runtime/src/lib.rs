//! pipec-runtime: loads compiled instruction files and executes them.
//!
//! [`load::load`] reads and checks a directory (nothing starts unless every rank loads and
//! checks); [`interp::run_rank`] runs one rank's stream on any [`backend::Backend`]; the CPU
//! reference backend ([`backend::cpu`]) trains a small real model ([`model`]) with one thread
//! per rank over an in-process rendezvous [`transport`], watched by the [`watchdog`]; the step
//! [`driver`], shared by every backend, runs steps and compares them with the single-thread
//! [`reference`](mod@reference) ([`run::run_cpu`] on the CPU).

pub mod backend;
pub mod diagnose;
pub mod driver;
pub mod error;
pub mod interp;
pub mod load;
pub mod model;
pub mod reference;
pub mod report;
pub mod run;
pub mod trace;
pub mod transport;
pub mod watchdog;

pub use error::RunError;
pub use load::{check_structure, load, load_unverified, LaunchWorld, Runnable};
pub use report::{RunOptions, RunReport};
pub use run::run_cpu;
