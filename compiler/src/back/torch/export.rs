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

use super::action::{Action, ActionType, Cell};
use super::CsvForm;
use crate::ir::Matching;
use crate::ir::{Instr, InstrRef, Payload, PayloadKind, Program};
use crate::verify::{Unverified, Verified};
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
    #[error("{at}: {instr}: offload, reload, wait_offload, recompute and checkpointed forwards are not supported by the torch exporter yet")]
    MemoryOp { at: InstrRef, instr: String },
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
    for (r, instrs) in program.ranks.iter().enumerate() {
        for (i, ins) in instrs.iter().enumerate() {
            if let Instr::FwdCheckpoint(_) | Instr::Memory(_) = ins {
                return Err(ExportError::MemoryOp {
                    at: InstrRef {
                        rank: Rank(r as u32),
                        index: i as u32,
                    },
                    instr: ins.to_string(),
                });
            }
        }
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
                .filter_map(Instr::as_compute)
                .map(|c| compute_cell(&c))
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
            Instr::Compute(op) => {
                cells.append(&mut deferred);
                cells.push(compute_cell(op));
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
            // Refused on entry (`export_lines`): torch's CSV has no action for them.
            Instr::FwdCheckpoint(_) | Instr::Memory(_) => {}
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
