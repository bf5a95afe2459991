//! Export a pipec [`Program`] as a torch.distributed.pipelining schedule CSV.
//!
//! Both of torch's forms, one line per rank, cells joined by `,`, lines ended by `\r\n`
//! exactly as torch's `_dump_csv` (Python `csv.writer`) writes them:
//!
//! - [`CsvForm::ComputeOnly`]: the rank's compute ops in order, an overlapped pair as
//!   `(f;b)OVERLAP_F_B`. No idle cells: torch's runtime skips them anyway.
//! - [`CsvForm::ComputeComms`]: the rank's compute ops and P2P actions in program order, for
//!   `_PipelineScheduleRuntime._load_csv(..., format="compute_comms")`, which executes a line
//!   as written. That runtime needs the bookkeeping actions too, placed the way torch's own
//!   `_dump_csv` output (conformance `interleaved1f1b_pp2_v2_m2.compute_comms.csv`) places them:
//!   - `sUNSHARD` for each of the rank's stages at the start of the line, in order of first use;
//!   - `sWAIT_SEND_Fm` right after the compute holding the backward (`B` or `I`) of `(s, m)`:
//!     the activation sent by `sSEND_Fm` is stashed until that backward, and by then the
//!     receiver has necessarily posted its `RECV_F` (the backward needed the gradient the
//!     receiver computed from it), so the wait cannot block; a send with no later backward
//!     (forward-only) is waited at the end of the line;
//!   - `sWAIT_SEND_Bm` at the end of the line, in send order (nothing on the rank reuses the
//!     gradient buffer, so waiting late never stalls compute);
//!   - `sREDUCE_GRAD`, `sWAIT_REDUCE_GRAD`, `sRESHARD` before the rank's first compute after the
//!     stage's last backward-family op (`B`, `I`, `W`), i.e. after the P2P that follows it, or
//!     at the end of the line. Without `REDUCE_GRAD` torch never scales the accumulated
//!     gradients, which then come out M times too large. In a forward-only program there is
//!     no gradient: `sRESHARD` follows the stage's last compute instead.
//!
//!   - The messages of one comm batch (unordered in pipec) are written in an order that keeps
//!     the file deadlock-free when each action is taken to block until matched, which is how
//!     `pipec check` reads compute+comms files (see [`super::order`]).
//!
//!   Every cell holds an action (torch's `_load_actions` asserts none is `None`). Between two
//!   ranks torch matches P2P first-in first-out (tag 0), so the per-peer order of pipec's sends
//!   and recvs is the order torch will match them in.
//!
//! The program should have passed the verifier; what the CSV cannot express (a message to a
//! rank other than the neighbouring stage's, or with no neighbouring stage) is refused.
//!
//! Memory instructions (issue 30: `offload`, `reload`, `wait_offload`, `recompute`, `fwd` with
//! `"checkpoint": true`) have no torch action, so [`export_csv`] refuses them. [`export_cells`]
//! writes each as one of pipec's own action types ([`ActionType::MEMORY`]) at its place in the
//! compute+comms line (a checkpointed forward where the forward would be, as `sF_CHECKPOINTm`,
//! in both forms; the other four in compute+comms only), for `pipec.torch.build_schedule`,
//! whose runtime executes them (docs/torch.md, "Memory instructions"). Everything else in the
//! line is placed as for the same program without them.

use super::action::{Action, ActionType, Cell};
use super::CsvForm;
use pipec_ir::ir::Matching;
use pipec_ir::ir::{Instr, InstrRef, MemKind, MemOp, Payload, PayloadKind, Program};
use pipec_ir::verify::{Unverified, Verified};
use pipec_schedules::{Compute, Pass, Rank, StageId};
use std::borrow::Borrow;
use std::collections::HashMap;
use std::fmt::Write as _;
use thiserror::Error;

/// torch's `csv.writer` line terminator.
pub const LINE_END: &str = "\r\n";

/// Why a program cannot be written as torch CSV.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum ExportError {
    #[error("{at}: {instr} names no neighbouring stage in a model of {stages} stages; torch names messages by the stage that sends or receives them")]
    NoNeighbour {
        at: InstrRef,
        instr: String,
        stages: u32,
    },
    #[error("{at}: {instr} is a message to the rank itself; torch hands tensors between stages of one rank over locally, without SEND/RECV")]
    SelfMessage { at: InstrRef, instr: String },
    #[error("{at}: {instr} goes to {peer}, but the neighbouring stage is on {expected}; torch sends to the rank of the neighbouring stage and cannot express this")]
    WrongPeer {
        at: InstrRef,
        instr: String,
        peer: Rank,
        expected: String,
    },
    #[error("{at}: {instr}: torch's schedule CSV has no action for offload, reload, wait_offload, recompute or a checkpointed forward; pipec.torch.build_schedule runs them (docs/torch.md)")]
    MemoryOp { at: InstrRef, instr: String },
    #[error("the schedule's microbatches have different lengths ({summary}); torch's schedule CSV carries no shapes and torch's runtime sizes every receive once (pytorch #159942), so a job run from it would receive wrong-sized tensors; pipec.torch.build_schedule sizes each receive from the plan (docs/torch.md)")]
    Lengths { summary: String },
    #[error("the schedule is verified under the P2P groups `{groups}` (issue #39); torch's schedule CSV names no communicators and torch's runtime posts every message on its own, whose order that verdict does not cover; pipec.torch.build_schedule creates the groups (docs/torch.md), or compile with the default groups, `pair`")]
    P2pGroups { groups: pipec_schedules::P2pGroups },
    #[error("{at}: {instr} is one of Megatron's shape messages (compiled with --megatron-variable-seq-lengths to check Megatron's handshake); torch's CSV has no action for it, and a plan needs none: compile without that flag")]
    ShapeMessage { at: InstrRef, instr: String },
    #[error("the schedule places stages on ranks by microbatch ({kind} placement: DualPipe's two directions keep stage s on two ranks); torch's CSV names a stage's rank by the line it is on and cannot express that")]
    Bidirectional {
        kind: pipec_schedules::PlacementKind,
    },
}

/// The CSV cell of a compute op.
pub fn compute_cell(op: &Compute) -> Cell {
    let a = |ty, t: pipec_schedules::Task| Action::new(t.stage.0, ty, t.mb.0);
    match *op {
        Compute::Fwd(t) => Cell::Action(a(ActionType::Forward, t)),
        Compute::Bwd(t) => Cell::Action(a(ActionType::FullBackward, t)),
        Compute::BwdD(t) => Cell::Action(a(ActionType::BackwardInput, t)),
        Compute::BwdW(t) => Cell::Action(a(ActionType::BackwardWeight, t)),
        Compute::FwdBwd { fwd, bwd } => Cell::Overlap {
            fwd: a(ActionType::Forward, fwd),
            bwd: a(ActionType::FullBackward, bwd),
        },
    }
}

/// The first memory instruction of `program`, which torch's CSV cannot hold.
fn first_memory_op(program: &Program) -> Option<(InstrRef, &Instr)> {
    program.ranks.iter().enumerate().find_map(|(r, instrs)| {
        let i = instrs
            .iter()
            .position(|ins| matches!(ins, Instr::FwdCheckpoint(_) | Instr::Memory(_)))?;
        let at = InstrRef {
            rank: Rank(r as u32),
            index: i as u32,
        };
        Some((at, &instrs[i]))
    })
}

/// pipec's action of a checkpointed forward.
fn checkpoint_action(t: pipec_schedules::Task) -> Action {
    Action::new(t.stage.0, ActionType::ForwardCheckpoint, t.mb.0)
}

/// pipec's action of a memory instruction.
fn memory_action(op: &MemOp) -> Action {
    let ty = match op.kind {
        MemKind::Offload => ActionType::Offload,
        MemKind::Reload => ActionType::Reload,
        MemKind::WaitOffload => ActionType::WaitOffload,
        MemKind::Recompute => ActionType::Recompute,
    };
    Action::new(op.task.stage.0, ty, op.task.mb.0)
}

/// The torch action of a send (`send`) or recv `instr` to/from `peer`, checked against the
/// placement.
fn p2p_action(
    program: &Program,
    at: InstrRef,
    instr: &Instr,
    (peer, payload, send): (Rank, Payload, bool),
) -> Result<Action, ExportError> {
    let stages = program.num_stages();
    let no_neighbour = || ExportError::NoNeighbour {
        at,
        instr: instr.to_string(),
        stages,
    };
    // The stage that acts here and the stage at the other end.
    let (here, there) = if send {
        (Some(payload.stage), payload.consumer())
    } else {
        (payload.consumer(), Some(payload.stage))
    };
    let (here, there) = match (here, there) {
        (Some(h), Some(t)) if h.0 < stages && t.0 < stages => (h, t),
        _ => return Err(no_neighbour()),
    };
    let expected = program
        .placement
        .rank_of(pipec_schedules::Task::new(there.0, payload.mb.0));
    if peer == at.rank {
        return Err(ExportError::SelfMessage {
            at,
            instr: instr.to_string(),
        });
    }
    if expected != peer {
        return Err(ExportError::WrongPeer {
            at,
            instr: instr.to_string(),
            peer,
            expected: format!("{expected} (stage {})", there.0),
        });
    }
    let ty = match (payload.kind, send) {
        (PayloadKind::Act, true) => ActionType::SendF,
        (PayloadKind::Act, false) => ActionType::RecvF,
        (PayloadKind::Grad, true) => ActionType::SendB,
        (PayloadKind::Grad, false) => ActionType::RecvB,
        (PayloadKind::ActShape | PayloadKind::GradShape, _) => {
            return Err(ExportError::ShapeMessage {
                at,
                instr: instr.to_string(),
            })
        }
    };
    Ok(Action::new(here.0, ty, payload.mb.0))
}

/// Write `program` in torch's CSV `form`. Deterministic: the same program gives the same bytes.
///
/// Use from `pipec export --format torch-csv` (with the form the user picks, compute+comms by
/// default being the one torch's runtime executes as written).
pub fn export_csv<P: Borrow<Program>>(
    program: &Verified<P>,
    form: CsvForm,
) -> Result<String, ExportError> {
    csv(program.program(), form, Some(program.matching()))
}

/// Why [`export_csv`] would refuse `program` before writing a line (microbatch lengths, P2P
/// groups torch's runtime does not create, a memory instruction), or `None`: what `pipec tune` asks before it prints the CSV command
/// as a way to run its winner, so it never prints one that exits 1.
pub fn csv_refusal(program: &Program) -> Option<ExportError> {
    if let Some(l) = &program.lengths {
        return Some(ExportError::Lengths {
            summary: l.summary(),
        });
    }
    if !program.p2p_groups.is_pair() {
        return Some(ExportError::P2pGroups {
            groups: program.p2p_groups,
        });
    }
    first_memory_op(program).map(|(at, ins)| ExportError::MemoryOp {
        at,
        instr: ins.to_string(),
    })
}

/// [`export_csv`] of a program nobody verified (`pipec export` of loaded or imported files).
pub fn export_csv_unverified<P: Borrow<Program>>(
    program: &Unverified<P>,
    form: CsvForm,
) -> Result<String, ExportError> {
    csv(program.program(), form, None)
}

fn csv(
    program: &Program,
    form: CsvForm,
    matching: Option<&Matching>,
) -> Result<String, ExportError> {
    if let Some(e) = csv_refusal(program) {
        return Err(e);
    }
    let lines = cells(program, form, matching)?;
    let mut out = String::with_capacity(program.len() * 8 + 16);
    for cells in &lines {
        for (i, c) in cells.iter().enumerate() {
            if i > 0 {
                out.push(',');
            }
            let _ = write!(out, "{c}");
        }
        out.push_str(LINE_END);
    }
    Ok(out)
}

/// The cells [`export_csv`] writes, one list per rank, as structured actions: what the Python
/// adapter (`pipec.torch.build_schedule`) turns into torch `_Action`s without a CSV round trip.
pub fn export_cells<P: Borrow<Program>>(
    program: &Verified<P>,
    form: CsvForm,
) -> Result<Vec<Vec<Cell>>, ExportError> {
    cells(program.program(), form, Some(program.matching()))
}

/// [`export_cells`] of a program nobody verified.
pub fn export_cells_unverified<P: Borrow<Program>>(
    program: &Unverified<P>,
    form: CsvForm,
) -> Result<Vec<Vec<Cell>>, ExportError> {
    cells(program.program(), form, None)
}

fn cells(
    program: &Program,
    form: CsvForm,
    matching: Option<&Matching>,
) -> Result<Vec<Vec<Cell>>, ExportError> {
    if program.placement.kind == pipec_schedules::PlacementKind::Bidirectional {
        return Err(ExportError::Bidirectional {
            kind: program.placement.kind,
        });
    }
    let orders = match form {
        CsvForm::ComputeOnly => Vec::new(),
        CsvForm::ComputeComms => super::order::emission_orders_with(program, matching),
    };
    let mut lines = Vec::with_capacity(program.ranks.len());
    for (r, instrs) in program.ranks.iter().enumerate() {
        lines.push(match form {
            CsvForm::ComputeOnly => instrs
                .iter()
                .filter_map(|ins| match ins {
                    Instr::FwdCheckpoint(t) => Some(Cell::Action(checkpoint_action(*t))),
                    _ => ins.as_compute().map(|c| compute_cell(&c)),
                })
                .collect(),
            CsvForm::ComputeComms => comms_line(program, Rank(r as u32), instrs, &orders[r])?,
        });
    }
    Ok(lines)
}

/// The stages whose gradients are final after instruction `i` (the stage's last
/// backward-family op), or, forward-only, whose last compute is `i`.
fn last_uses(instrs: &[Instr], forward_only: bool) -> (Vec<StageId>, Vec<(usize, StageId)>) {
    let mut first_use: Vec<StageId> = Vec::new();
    let mut last: HashMap<StageId, usize> = HashMap::new();
    for (i, ins) in instrs.iter().enumerate() {
        let Some(op) = ins.as_compute() else { continue };
        for (pass, t) in op.parts() {
            if !first_use.contains(&t.stage) {
                first_use.push(t.stage);
            }
            if forward_only || pass != Pass::Fwd {
                last.insert(t.stage, i);
            }
        }
    }
    let mut ends: Vec<(usize, StageId)> = last.into_iter().map(|(s, i)| (i, s)).collect();
    ends.sort();
    (first_use, ends)
}

fn comms_line(
    program: &Program,
    rank: Rank,
    instrs: &[Instr],
    order: &[usize],
) -> Result<Vec<Cell>, ExportError> {
    let fo = program.forward_only;
    let (first_use, ends) = last_uses(instrs, fo);
    let mut cells = Vec::with_capacity(instrs.len() * 2 + 4 * first_use.len());
    let stage_cell = |s: StageId, ty| Cell::Action(Action::stage_only(s.0, ty));
    for &s in &first_use {
        cells.push(stage_cell(s, ActionType::Unshard));
    }
    // Sends in issue order, and the SEND_F ones not yet waited for, by (stage, mb).
    let mut sends: Vec<Action> = Vec::new();
    let mut unwaited_f: HashMap<(u32, u32), u32> = HashMap::new();
    let mut deferred: Vec<Cell> = Vec::new();
    let mut ends = ends.into_iter().peekable();
    for &i in order {
        let ins = &instrs[i];
        match ins {
            Instr::Compute(_) | Instr::FwdCheckpoint(_) => {
                let op = ins.as_compute().expect("a compute instruction");
                cells.append(&mut deferred);
                cells.push(match *ins {
                    Instr::FwdCheckpoint(t) => Cell::Action(checkpoint_action(t)),
                    _ => compute_cell(&op),
                });
                for (pass, t) in op.parts() {
                    if matches!(pass, Pass::Bwd | Pass::BwdD) {
                        let key = (t.stage.0, t.mb.0);
                        if let Some(n) = unwaited_f.get_mut(&key).filter(|n| **n > 0) {
                            *n -= 1;
                            cells.push(Cell::Action(Action::new(
                                key.0,
                                ActionType::WaitSendF,
                                key.1,
                            )));
                        }
                    }
                }
                while let Some(&(_, s)) = ends.peek().filter(|(at, _)| *at == i) {
                    ends.next();
                    if !fo {
                        deferred.push(stage_cell(s, ActionType::ReduceGrad));
                        deferred.push(stage_cell(s, ActionType::WaitReduceGrad));
                    }
                    deferred.push(stage_cell(s, ActionType::Reshard));
                }
            }
            &Instr::Send { peer, payload, .. } | &Instr::Recv { peer, payload, .. } => {
                let at = InstrRef {
                    rank,
                    index: i as u32,
                };
                let send = matches!(ins, Instr::Send { .. });
                let a = p2p_action(program, at, ins, (peer, payload, send))?;
                if a.ty == ActionType::SendF {
                    *unwaited_f.entry((a.stage, a.mb.unwrap_or(0))).or_insert(0) += 1;
                }
                if matches!(a.ty, ActionType::SendF | ActionType::SendB) {
                    sends.push(a);
                }
                cells.push(Cell::Action(a));
            }
            // torch's runtime waits for a receive just before the compute that uses it and for
            // sends with WAIT_SEND_*, so an explicit wait adds nothing to its CSV.
            Instr::Wait { .. } => {}
            // Where the program has it; [`export_csv`] refused the program on entry.
            Instr::Memory(m) => cells.push(Cell::Action(memory_action(m))),
        }
    }
    cells.append(&mut deferred);
    for a in sends {
        let m = a.mb.unwrap_or(0);
        let wait = match a.ty {
            ActionType::SendF => match unwaited_f.get_mut(&(a.stage, m)).filter(|n| **n > 0) {
                Some(n) => {
                    *n -= 1;
                    ActionType::WaitSendF
                }
                None => continue,
            },
            _ => ActionType::WaitSendB,
        };
        cells.push(Cell::Action(Action::new(a.stage, wait, m)));
    }
    Ok(cells)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{compile, CompileRequest};
    use pipec_ir::verify::{verified, VerifyOptions};
    use pipec_schedules::ScheduleKind;

    /// `kind` at pp=2, M=4 with memory instructions on every rank: the forwards of even
    /// microbatches offloaded right after the forward (waited right after) and reloaded right
    /// before the backward (`bwd` or `bwd_D`), those of odd ones checkpointed and recomputed
    /// right before it. Returns the plain program too.
    fn with_memory(kind: ScheduleKind) -> (Program, Program) {
        let plain = compile(&CompileRequest::new(kind, 2, 4)).unwrap().program;
        let mut mem = plain.clone();
        for instrs in &mut mem.ranks {
            let mut out = Vec::new();
            for ins in instrs.iter() {
                let m = |kind, task| Instr::Memory(MemOp { kind, task });
                let backward = ins.as_compute().into_iter().flat_map(|c| {
                    c.parts()
                        .filter(|(p, _)| matches!(p, Pass::Bwd | Pass::BwdD))
                        .map(|(_, t)| t)
                        .collect::<Vec<_>>()
                });
                for t in backward {
                    let kind = if t.mb.0 % 2 == 0 {
                        MemKind::Reload
                    } else {
                        MemKind::Recompute
                    };
                    out.push(m(kind, t));
                }
                match *ins {
                    Instr::Compute(Compute::Fwd(t)) if t.mb.0 % 2 == 1 => {
                        out.push(Instr::FwdCheckpoint(t));
                    }
                    Instr::Compute(Compute::Fwd(t)) => {
                        out.push(*ins);
                        out.push(m(MemKind::Offload, t));
                        out.push(m(MemKind::WaitOffload, t));
                    }
                    _ => out.push(*ins),
                }
            }
            *instrs = out;
        }
        (plain, mem)
    }

    /// A cell as the plain program's exporter writes it: a checkpointed forward as `F`.
    fn plain_cell(c: &Cell) -> Cell {
        match c {
            Cell::Action(a) if a.ty == ActionType::ForwardCheckpoint => Cell::Action(Action {
                ty: ActionType::Forward,
                ..*a
            }),
            _ => *c,
        }
    }

    /// The compute and memory instructions of a rank as the cells they export to.
    fn compute_and_memory(instrs: &[Instr]) -> Vec<Cell> {
        instrs
            .iter()
            .filter_map(|ins| match ins {
                Instr::FwdCheckpoint(t) => Some(Cell::Action(checkpoint_action(*t))),
                Instr::Memory(m) => Some(Cell::Action(memory_action(m))),
                _ => ins.as_compute().map(|c| compute_cell(&c)),
            })
            .collect()
    }

    #[test]
    fn memory_actions_sit_where_the_program_has_them() {
        use ScheduleKind::*;
        for kind in [OneFOneB, ZbH1, ZbV, Gpipe] {
            let (plain, mem) = with_memory(kind);
            let checked = verified(&mem, &VerifyOptions::default())
                .unwrap_or_else(|r| panic!("{kind:?}: {:?}", r.report.violations));
            let reference = export_cells(
                &verified(&plain, &VerifyOptions::default()).unwrap(),
                CsvForm::ComputeComms,
            )
            .unwrap();
            let got = export_cells(&checked, CsvForm::ComputeComms).unwrap();
            for (r, line) in got.iter().enumerate() {
                // Without pipec's memory actions, the line the plain program exports.
                let rest: Vec<Cell> = line
                    .iter()
                    .filter(|c| !matches!(c, Cell::Action(a) if a.ty.is_memory() && a.ty != ActionType::ForwardCheckpoint))
                    .map(plain_cell)
                    .collect();
                assert_eq!(rest, reference[r], "{kind:?} rank {r}");
                // Compute and memory cells in the order of the rank's instructions.
                let ordered: Vec<Cell> = line
                    .iter()
                    .filter(|c| match c {
                        Cell::Action(a) => a.ty.is_compute() || a.ty.is_memory(),
                        _ => true,
                    })
                    .copied()
                    .collect();
                assert_eq!(
                    ordered,
                    compute_and_memory(&mem.ranks[r]),
                    "{kind:?} rank {r}"
                );
                let n = |ty| {
                    line.iter()
                        .filter(|c| matches!(c, Cell::Action(a) if a.ty == ty))
                        .count()
                };
                assert!(n(ActionType::Offload) > 0 && n(ActionType::Recompute) > 0);
                assert_eq!(n(ActionType::Offload), n(ActionType::Reload));
                assert_eq!(n(ActionType::ForwardCheckpoint), n(ActionType::Recompute));
            }
            // Compute-only: the compute cells, a checkpointed forward as itself.
            let only = export_cells(&checked, CsvForm::ComputeOnly).unwrap();
            for (r, line) in only.iter().enumerate() {
                let want: Vec<Cell> = compute_and_memory(&mem.ranks[r])
                    .into_iter()
                    .filter(|c| !matches!(c, Cell::Action(a) if a.ty.is_memory() && a.ty != ActionType::ForwardCheckpoint))
                    .collect();
                assert_eq!(line, &want, "{kind:?} rank {r}");
            }
        }
    }

    #[test]
    fn the_csv_refuses_memory_instructions_naming_the_first() {
        let (_, mem) = with_memory(ScheduleKind::OneFOneB);
        let checked = verified(&mem, &VerifyOptions::default()).unwrap();
        let first = mem.ranks[0]
            .iter()
            .position(|i| matches!(i, Instr::FwdCheckpoint(_) | Instr::Memory(_)))
            .unwrap();
        for form in [CsvForm::ComputeOnly, CsvForm::ComputeComms] {
            let e = export_csv(&checked, form).unwrap_err();
            assert_eq!(
                e,
                ExportError::MemoryOp {
                    at: InstrRef {
                        rank: Rank(0),
                        index: first as u32
                    },
                    instr: mem.ranks[0][first].to_string(),
                }
            );
            assert!(
                e.to_string().contains("torch's schedule CSV has no action"),
                "{e}"
            );
        }
        // The names are not torch's: its reader (and pipec's) refuses them.
        for ty in ActionType::MEMORY {
            assert_eq!(ActionType::from_name(ty.name()), None);
            assert!(!ActionType::ALL.contains(&ty) && !ty.is_bookkeeping());
            let cell = Action::new(0, ty, 1).to_string();
            assert!(super::super::action::parse_cell(&cell).is_err(), "{cell}");
        }
    }
}
