//! Checkpointed forwards and their recomputes, placed in a lowered program.
//!
//! Activation checkpointing keeps only a forward's input and runs the forward again just before
//! its backward (megatron-core's `checkpoint_activations_microbatch`, torch's
//! `torch.utils.checkpoint`: the recompute happens inside the backward call). So a checkpointed
//! `fwd(s, m)` becomes `fwd(s, m)` with `"checkpoint": true`, and `recompute(s, m)` is placed
//! immediately before the instruction that runs its backward (`bwd` or `bwd_D`). Nothing else
//! moves: the order of compute and communication is the program's (Megatron's order does not
//! depend on N, see `pipec_schedules::megatron_recompute`). A forward-only program has no
//! backward, hence no recompute.

use pipec_ir::ir::{Instr, MemKind, MemOp, Program};
use pipec_schedules::{Compute, Pass, RankCheckpoints, Task};
use std::collections::HashSet;
use thiserror::Error;

/// A checkpoint mark the program cannot take.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum CheckpointError {
    #[error("rank {rank}: fwd(stage {}, mb {}) is not a forward of its own on that rank (a fused fwd_bwd or missing), so it cannot be checkpointed", .task.stage.0, .task.mb.0)]
    NoForward { rank: u32, task: Task },
    #[error("{ranks} ranks of marks for a program of {world} ranks")]
    Ranks { ranks: usize, world: u32 },
}

/// Mark, on every rank, the forwards `marks` flags as checkpointed and place their recomputes.
pub fn checkpoint_forwards(
    program: &mut Program,
    marks: &[RankCheckpoints],
) -> Result<(), CheckpointError> {
    let sets: Vec<HashSet<Task>> = marks.iter().map(|m| m.checkpointed().collect()).collect();
    checkpoint_tasks(program, &sets)
}

/// Checkpoint, on each rank `r`, the forwards of `chosen[r]` and place their recomputes.
pub fn checkpoint_tasks(
    program: &mut Program,
    chosen: &[HashSet<Task>],
) -> Result<(), CheckpointError> {
    if chosen.len() != program.ranks.len() {
        return Err(CheckpointError::Ranks {
            ranks: chosen.len(),
            world: program.world(),
        });
    }
    for (r, (instrs, chosen)) in program.ranks.iter_mut().zip(chosen).enumerate() {
        if chosen.is_empty() {
            continue;
        }
        let mut found = 0;
        let mut out = Vec::with_capacity(instrs.len() + 2 * chosen.len());
        for ins in instrs.iter() {
            match *ins {
                Instr::Compute(Compute::Fwd(t)) if chosen.contains(&t) => {
                    found += 1;
                    out.push(Instr::FwdCheckpoint(t));
                }
                Instr::Compute(op) => {
                    for (pass, t) in op.parts() {
                        if matches!(pass, Pass::Bwd | Pass::BwdD) && chosen.contains(&t) {
                            out.push(Instr::Memory(MemOp {
                                kind: MemKind::Recompute,
                                task: t,
                            }));
                        }
                    }
                    out.push(*ins);
                }
                _ => out.push(*ins),
            }
        }
        if found != chosen.len() {
            let have: HashSet<Task> = out
                .iter()
                .filter_map(|i| match i {
                    Instr::FwdCheckpoint(t) => Some(*t),
                    _ => None,
                })
                .collect();
            let task = *chosen
                .iter()
                .filter(|t| !have.contains(t))
                .min_by_key(|t| (t.stage.0, t.mb.0))
                .expect("some mark was not found");
            return Err(CheckpointError::NoForward {
                rank: r as u32,
                task,
            });
        }
        *instrs = out;
    }
    Ok(())
}
