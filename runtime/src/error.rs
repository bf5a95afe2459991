//! Why a run did not succeed, and the exit code each reason maps to.

use crate::watchdog::Failure;
use pipec_ir::files::LoadError;
use thiserror::Error;

#[derive(Debug, Error)]
pub enum RunError {
    /// The directory could not be read or was refused by the instruction-file checks.
    #[error(transparent)]
    Load(#[from] LoadError),
    /// The files load but cannot be run as they are; names the file and the field.
    #[error("{file}: field `{field}`: {msg}")]
    Refused {
        file: String,
        field: String,
        msg: String,
    },
    /// The schedule does not verify (`pipec_ir::verify`): it would hang, use a wrong tensor or
    /// break a dependency. Every violation is listed.
    #[error("{dir}: refusing to run: {report}")]
    NotVerified {
        dir: String,
        report: Box<pipec_ir::verify::Report>,
    },
    /// The schedule failed while running: hang, wrong tensor, out-of-order instruction.
    #[error("{0}")]
    Failed(Failure),
    /// The pipelined step disagrees with the single-thread reference.
    #[error("check failed at step {step}: {msg}")]
    Check { step: u32, msg: String },
    /// A run of zero steps was asked for.
    #[error("the number of steps must be at least 1")]
    ZeroSteps,
    /// The GPU stack cannot run: a CUDA or NCCL library missing, no GPU, a driver call failed.
    #[error("{0}")]
    Device(String),
    /// A multi-process launch could not form: the rendezvous that hands out NCCL's unique id.
    #[error("launch: {0}")]
    Launch(String),
    /// Bad arguments (the binaries' own checks of their flags and environment).
    #[error("{0}")]
    Usage(String),
}

impl RunError {
    /// 1: the schedule failed (refused, hang, check mismatch); 2: usage or I/O error.
    pub fn exit_code(&self) -> u8 {
        match self {
            RunError::Load(LoadError::Io { .. })
            // A path that is not a schedule directory: the launch named the wrong thing.
            | RunError::Load(LoadError::NotADirectory { .. })
            | RunError::Load(LoadError::HoldsSchedules { .. })
            | RunError::Usage(_)
            | RunError::ZeroSteps
            | RunError::Device(_)
            | RunError::Launch(_) => 2,
            _ => 1,
        }
    }
}
