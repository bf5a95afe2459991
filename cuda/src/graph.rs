//! Which programs `pipec-run --backend cuda --cuda-graph` can capture (issue #39, "A captured
//! step"); the capture itself is the module `capture` (feature `cuda`).
//!
//! A CUDA graph replays the device work of one step with the host out of the loop: every
//! buffer the replay touches must be fixed before it starts, and nothing the host decides
//! while the step runs may change from one step to the next. For this backend that means:
//!
//! - weights, gradient sums, losses, the token ids and targets of each microbatch and the
//!   embedding gradient's grouping are buffers allocated before capture, the inputs refilled
//!   before each replay (stream-ordered copies outside the graph);
//! - activations, stashes and received tensors are allocated and freed inside the graph
//!   (CUDA graph memory nodes, whose addresses are fixed when the graph is instantiated);
//! - the ranks of one process exchange tensors through the in-process rendezvous while the
//!   step is captured, so the copies between their streams are graph edges.
//!
//! What cannot be made so is refused here, before any GPU work, with the reason:
//! [`NotCapturable`].

use pipec_ir::files::MANIFEST_FILE;
use pipec_ir::ir::{Instr, MemKind, Program};
use pipec_runtime::driver::replicated_stages;
use pipec_runtime::RunError;
use std::fmt;

/// Why a program's step cannot be captured; the CLI reports it with exit code 1.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NotCapturable {
    /// One process per rank under torchrun/Slurm: each process would capture its own rank's
    /// NCCL calls; not written (it needs two GPUs to test).
    Launcher { world: u32 },
    /// `offload`/`reload`: the copies are planned to run beside compute on the copy stream,
    /// while a captured step runs each rank's work on one stream (see the module `capture`).
    HostCopies {
        rank: u32,
        index: u32,
        instr: String,
    },
    /// DualPipe's copies of a stage sum their gradients between steps through the host.
    Replicated { stage: u32, ranks: Vec<u32> },
    /// `microbatch_lengths`: the CUDA backend runs microbatches of one length (`--seq`).
    Lengths,
}

impl fmt::Display for NotCapturable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NotCapturable::Launcher { world } => write!(
                f,
                "--cuda-graph runs in one process (all ranks as threads of it); this is a \
                 launch of {world} processes (torchrun/Slurm variables), where each would \
                 capture its own NCCL calls: not written; unset the launcher's variables"
            ),
            NotCapturable::HostCopies { rank, index, instr } => write!(
                f,
                "rank {rank}, #{index} {instr}: a captured step runs each rank's work on one \
                 stream, so this copy to or from host memory could not run beside compute as \
                 planned; capture a plan without offload (tune --no-offload), or run without \
                 --cuda-graph"
            ),
            NotCapturable::Replicated { stage, ranks } => write!(
                f,
                "stage {stage} runs on ranks {} (DualPipe's two directions): their gradients \
                 are summed between steps through the host, which a replayed step skips; run \
                 it without --cuda-graph",
                ranks
                    .iter()
                    .map(u32::to_string)
                    .collect::<Vec<_>>()
                    .join(" and ")
            ),
            NotCapturable::Lengths => write!(
                f,
                "the plan carries microbatch_lengths, and the cuda backend runs microbatches of \
                 one length (--seq): run it with --backend cpu"
            ),
        }
    }
}

impl std::error::Error for NotCapturable {}

/// A plan refused for capture is a refused schedule (exit 1), in the manifest's `schedule`:
/// what `pipec-run` and `run_cuda` (feature `cuda`) both report.
impl From<NotCapturable> for RunError {
    fn from(e: NotCapturable) -> RunError {
        RunError::Refused {
            file: MANIFEST_FILE.into(),
            field: "schedule".into(),
            msg: e.to_string(),
        }
    }
}

/// The first reason `program`'s step cannot be captured, or `Ok` when it can. `processes`: how
/// many processes the launch has (1 without a launcher).
pub fn capturable(program: &Program, processes: u32) -> Result<(), NotCapturable> {
    if processes > 1 {
        return Err(NotCapturable::Launcher { world: processes });
    }
    if program.lengths.is_some() {
        return Err(NotCapturable::Lengths);
    }
    for (r, instrs) in program.ranks.iter().enumerate() {
        for (i, ins) in instrs.iter().enumerate() {
            if let Instr::Memory(m) = ins {
                if matches!(
                    m.kind,
                    MemKind::Offload | MemKind::Reload | MemKind::WaitOffload
                ) {
                    return Err(NotCapturable::HostCopies {
                        rank: r as u32,
                        index: i as u32,
                        instr: ins.to_string(),
                    });
                }
            }
        }
    }
    if !program.forward_only {
        if let Some(r) = replicated_stages(program).into_iter().next() {
            let mut ranks = vec![r.first];
            ranks.extend(r.others);
            return Err(NotCapturable::Replicated {
                stage: r.stage,
                ranks,
            });
        }
    }
    Ok(())
}
