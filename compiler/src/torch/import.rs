//! Import a torch.distributed.pipelining schedule CSV (`_dump_csv` output, or a hand-written
//! file in the same form) as a pipec [`Program`].
//!
//! - The form is detected: any `SEND_*`/`RECV_*` action makes the file compute+comms
//!   (torch's `format="compute_comms"`), otherwise it is compute-only.
//! - Line `r` is rank `r`. The stage -> rank placement is read off the file (the stages each
//!   line names; a stage on two lines is an error) or given ([`PlacementChoice`]); either way
//!   every action must sit on its line's rank and every stage `0..S` must have a rank.
//! - Compute-only files are lowered with pipec's own [`CommPolicy::Lockstep`], so the
//!   result is a complete program the verifier can judge.
//! - Compute+comms files become the program exactly as written: torch's
//!   `_PipelineScheduleRuntime` posts each P2P action as its own operation, so each `SEND`/`RECV`
//!   is its own comm batch (batch numbers count up per rank). The FSDP / wait bookkeeping
//!   actions carry no data and are dropped (counted in [`Imported::bookkeeping`]).
//!
//! Nothing here panics on any input, and ids are bounded ([`MAX_STAGES`],
//! [`MAX_MICROBATCHES`], and stages x microbatches within [`Limits::DEFAULT`]) so a short
//! file cannot make pipec allocate without bound.

use crate::lower::lower_orders;
#[cfg(doc)]
use crate::torch::action::MAX_MICROBATCHES;
use crate::torch::action::{parse_cell, Action, ActionType, Cell, CsvErrorKind, MAX_STAGES};
use crate::torch::CsvForm;
use pipec_ir::ir::{Instr, Payload, Program};
use pipec_schedules::{
    CommPolicy, Compute, Limits, Placement, PlacementKind, Rank, RankOrder, StageId, Task,
};
use std::collections::BTreeMap;
use std::fmt;

/// A stage -> rank rule given on the command line (`--placement loop|v`).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum PlacementChoice {
    /// Stage `s` on rank `s % pp`; the stage count is the smallest multiple of `pp` that
    /// covers every stage the file names.
    Loop,
    /// Stage `s` on rank `s` for `s < pp`, else `2pp-1-s`; `2pp` stages.
    V,
}

impl PlacementChoice {
    pub fn name(self) -> &'static str {
        match self {
            PlacementChoice::Loop => "loop",
            PlacementChoice::V => "v",
        }
    }
}

impl std::str::FromStr for PlacementChoice {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "loop" => Ok(PlacementChoice::Loop),
            "v" => Ok(PlacementChoice::V),
            _ => Err(format!("unknown placement `{s}` (expected `loop` or `v`)")),
        }
    }
}

/// What the user may pin down instead of letting the file say it.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct ImportOptions {
    /// Expected number of ranks; the file must have exactly this many lines.
    pub pp: Option<u32>,
    /// The placement rule; `None` reads it off the file.
    pub placement: Option<PlacementChoice>,
}

/// Where the placement of an import came from.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum PlacementSource {
    /// Read off the file: each stage on the rank whose line names it.
    File,
    /// Given by [`ImportOptions::placement`].
    Given(PlacementChoice),
}

/// The result of an import.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Imported {
    /// For compute-only files, lowered with [`CommPolicy::Lockstep`]; for compute+comms
    /// files, exactly as written, each P2P action its own comm batch. `forward_only` is set
    /// when the file has no backward action at all.
    pub program: Program,
    pub form: CsvForm,
    pub placement_source: PlacementSource,
    /// Bookkeeping actions accepted and dropped (`UNSHARD`, `RESHARD`, `REDUCE_GRAD`,
    /// `WAIT_REDUCE_GRAD`, `WAIT_SEND_F`, `WAIT_SEND_B`).
    pub bookkeeping: usize,
    /// Empty cells (idle slots) dropped from a compute-only file.
    pub idle_cells: usize,
}

/// An import error with its position. `line`, `cell_index` and `column` are 1-based; 0 means
/// the error is not about one line (or not about one cell). `column` counts characters
/// (Unicode scalar values) from the start of the line to the first non-blank character of
/// the cell; `cell_index` counts comma-separated cells.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CsvError {
    pub line: u32,
    pub cell_index: u32,
    pub column: u32,
    /// The cell's text (blanks trimmed), or empty.
    pub cell: String,
    /// The whole line, for the caret display.
    pub line_text: String,
    pub kind: CsvErrorKind,
}

impl std::error::Error for CsvError {}

/// Longest echoed line before the echo is cut to a window around the cell.
const ECHO_MAX: usize = 100;
const ECHO_CONTEXT: usize = 40;

impl fmt::Display for CsvError {
    /// `line 2, cell 3 (column 9), `0X1`: unknown action type ...`, then the line with a
    /// caret under the cell.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.line == 0 {
            return write!(f, "{}", self.kind);
        }
        write!(f, "line {}", self.line)?;
        if self.cell_index > 0 {
            write!(
                f,
                ", cell {} (column {}), `{}`",
                self.cell_index,
                self.column,
                self.cell.escape_debug()
            )?;
        }
        write!(f, ": {}", self.kind)?;
        let chars: Vec<char> = self
            .line_text
            .chars()
            .map(|c| if c.is_control() { '?' } else { c })
            .collect();
        if chars.is_empty() {
            return write!(f, "\n    (the line is empty)");
        }
        let (start, width) = if self.cell_index > 0 {
            (
                (self.column as usize).saturating_sub(1),
                self.cell.chars().count().max(1),
            )
        } else {
            (0, chars.len())
        };
        let (lo, hi) = if chars.len() <= ECHO_MAX {
            (0, chars.len())
        } else {
            (
                start.saturating_sub(ECHO_CONTEXT),
                (start + width.min(ECHO_MAX) + ECHO_CONTEXT).min(chars.len()),
            )
        };
        let lead = if lo > 0 { "..." } else { "" };
        let tail = if hi < chars.len() { "..." } else { "" };
        let shown: String = chars[lo.min(hi)..hi].iter().collect();
        write!(f, "\n    {lead}{shown}{tail}\n    ")?;
        let pad = lead.len() + start.saturating_sub(lo);
        let carets = width.min(hi.saturating_sub(start).max(1)).min(ECHO_MAX);
        write!(f, "{}{}", " ".repeat(pad), "^".repeat(carets))
    }
}

/// The lines of the input as torch's `csv.reader` sees them: `\n` or `\r\n` ends a line and a
/// final line terminator does not start another line.
fn split_lines(text: &str) -> Vec<&str> {
    let body = text.strip_suffix('\n').unwrap_or(text);
    body.split('\n')
        .map(|l| l.strip_suffix('\r').unwrap_or(l))
        .collect()
}

/// The cells of one line; an empty line has none (torch's reader yields `[]`).
fn split_cells(line: &str) -> impl Iterator<Item = &str> {
    let mut it = Some(line.split(','));
    if line.is_empty() {
        it = None;
    }
    it.into_iter().flatten()
}

fn is_blank(c: char) -> bool {
    c == ' ' || c == '\t'
}

/// Build the positioned error for cell `cell` (0-based; `None` for the whole line) of line
/// `line` (0-based).
fn at(lines: &[&str], line: usize, cell: Option<usize>, kind: CsvErrorKind) -> CsvError {
    let text = lines.get(line).copied().unwrap_or("");
    let mut e = CsvError {
        line: sat(line + 1),
        cell_index: 0,
        column: 0,
        cell: String::new(),
        line_text: text.to_string(),
        kind,
    };
    if let Some(ci) = cell {
        let mut col = 0usize;
        for (i, raw) in text.split(',').enumerate() {
            if i == ci {
                let lead = raw.chars().take_while(|&c| is_blank(c)).count();
                e.cell_index = sat(ci + 1);
                e.column = sat(col + lead + 1);
                e.cell = raw.trim_matches(is_blank).to_string();
                break;
            }
            col += raw.chars().count() + 1;
        }
    }
    e
}

/// A 1-based position as stored (lines are capped far below `u32::MAX`; a column past it
/// in a multi-gigabyte line saturates).
fn sat(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

fn whole_file(kind: CsvErrorKind) -> CsvError {
    CsvError {
        line: 0,
        cell_index: 0,
        column: 0,
        cell: String::new(),
        line_text: String::new(),
        kind,
    }
}

/// Import from bytes, as read from a file: invalid UTF-8 is reported with its line and column.
pub fn import_csv_bytes(bytes: &[u8], opts: &ImportOptions) -> Result<Imported, CsvError> {
    match std::str::from_utf8(bytes) {
        Ok(text) => import_csv(text, opts),
        Err(e) => {
            let good = e.valid_up_to();
            // The prefix is valid UTF-8 by definition of `valid_up_to`.
            let prefix = std::str::from_utf8(&bytes[..good]).unwrap_or("");
            let line_start = prefix.rfind('\n').map_or(0, |i| i + 1);
            let line_no = prefix[..].matches('\n').count();
            let line_end = bytes[good..]
                .iter()
                .position(|&b| b == b'\n')
                .map_or(bytes.len(), |i| good + i);
            let raw_line = String::from_utf8_lossy(&bytes[line_start..line_end]);
            let raw_line = raw_line.strip_suffix('\r').unwrap_or(&raw_line);
            let in_line = &prefix[line_start..];
            let cell = in_line.matches(',').count();
            let lines = vec![""; line_no].into_iter().chain([raw_line]);
            let lines: Vec<&str> = lines.collect();
            Err(at(
                &lines,
                line_no,
                Some(cell),
                CsvErrorKind::InvalidUtf8 { offset: good },
            ))
        }
    }
}

/// A parsed non-empty cell and its 0-based index on its line.
struct Placed {
    index: u32,
    cell: Cell,
}

fn actions(cell: &Cell) -> impl Iterator<Item = Action> {
    let (a, b) = match *cell {
        Cell::Empty => (None, None),
        Cell::Action(a) => (Some(a), None),
        Cell::Overlap { fwd, bwd } => (Some(fwd), Some(bwd)),
    };
    a.into_iter().chain(b)
}

/// Import a CSV text. See the module docs for what is accepted and how it maps.
pub fn import_csv(text: &str, opts: &ImportOptions) -> Result<Imported, CsvError> {
    if text.is_empty() {
        return Err(whole_file(CsvErrorKind::EmptyInput));
    }
    let lines = split_lines(text);
    if let Some(pp) = opts.pp {
        if lines.len() != pp as usize {
            let kind = CsvErrorKind::LineCount {
                found: lines.len(),
                expected: pp,
            };
            return Err(if lines.len() > pp as usize {
                at(&lines, pp as usize, None, kind)
            } else {
                whole_file(kind)
            });
        }
    }
    // Every rank owns a stage, so more lines than stages cannot be a schedule; refusing them
    // here bounds everything sized by the rank count.
    if lines.len() > MAX_STAGES as usize {
        return Err(at(
            &lines,
            MAX_STAGES as usize,
            None,
            CsvErrorKind::TooManyLines {
                found: lines.len(),
                limit: MAX_STAGES,
            },
        ));
    }
    let pp = lines.len() as u32;

    // Parse every cell; remember the first empty one for the compute+comms rule.
    let mut parsed: Vec<Vec<Placed>> = Vec::with_capacity(lines.len());
    let mut first_empty: Option<(usize, usize)> = None;
    let mut idle_cells = 0usize;
    let (mut any_p2p, mut any_compute, mut any_backward) = (false, false, false);
    let (mut max_stage, mut max_mb) = (0u32, None::<u32>);
    for (li, line) in lines.iter().enumerate() {
        let mut row = Vec::new();
        for (ci, raw) in split_cells(line).enumerate() {
            let cell = parse_cell(raw).map_err(|k| at(&lines, li, Some(ci), k))?;
            if cell == Cell::Empty {
                idle_cells += 1;
                first_empty.get_or_insert((li, ci));
                continue;
            }
            for a in actions(&cell) {
                max_stage = max_stage.max(a.stage);
                any_p2p |= a.ty.is_p2p();
                any_compute |= a.ty.is_compute();
                any_backward |= matches!(
                    a.ty,
                    ActionType::FullBackward
                        | ActionType::BackwardInput
                        | ActionType::BackwardWeight
                );
                if a.ty.is_compute() || a.ty.is_p2p() {
                    max_mb = max_mb.max(a.mb);
                }
            }
            row.push(Placed {
                index: ci as u32,
                cell,
            });
        }
        parsed.push(row);
    }
    let form = if any_p2p {
        CsvForm::ComputeComms
    } else {
        CsvForm::ComputeOnly
    };
    if let (CsvForm::ComputeComms, Some((li, ci))) = (form, first_empty) {
        return Err(at(&lines, li, Some(ci), CsvErrorKind::EmptyCellInComms));
    }
    if !any_compute {
        return Err(whole_file(CsvErrorKind::NoCompute));
    }
    let microbatches = max_mb.map_or(0, |m| m + 1);

    let (placement, placement_source) = match opts.placement {
        None => (
            derive_placement(&lines, &parsed, pp, max_stage)?,
            PlacementSource::File,
        ),
        Some(choice) => (
            given_placement(&lines, &parsed, pp, max_stage, choice)?,
            PlacementSource::Given(choice),
        ),
    };
    let stages = placement.num_stages();
    let limit = Limits::DEFAULT.max_compute_ops;
    if u64::from(stages) * u64::from(microbatches) > limit {
        return Err(whole_file(CsvErrorKind::TooLarge {
            stages: stages.into(),
            microbatches: microbatches.into(),
            limit,
        }));
    }
    let forward_only = !any_backward;

    let mut bookkeeping = 0usize;
    let program = match form {
        CsvForm::ComputeOnly => {
            let orders: Vec<RankOrder> = parsed
                .iter()
                .enumerate()
                .map(|(r, row)| {
                    let ops: Vec<Compute> = row
                        .iter()
                        .filter_map(|p| {
                            let c = compute_of(&p.cell);
                            if c.is_none() {
                                bookkeeping += 1;
                            }
                            c
                        })
                        .collect();
                    let warmup = ops.iter().take_while(|c| c.is_forward()).count() as u32;
                    RankOrder {
                        rank: Rank(r as u32),
                        ops,
                        warmup,
                    }
                })
                .collect();
            lower_orders(
                &placement,
                microbatches,
                forward_only,
                CommPolicy::Lockstep,
                &orders,
            )
        }
        CsvForm::ComputeComms => {
            let mut ranks = Vec::with_capacity(parsed.len());
            for (li, row) in parsed.iter().enumerate() {
                let rank = Rank(li as u32);
                let mut instrs = Vec::with_capacity(row.len());
                let mut batch = 0u32;
                for p in row {
                    if let Some(c) = compute_of(&p.cell) {
                        instrs.push(Instr::Compute(c));
                        continue;
                    }
                    let Cell::Action(a) = p.cell else {
                        continue;
                    };
                    let Some(dir) = P2p::of(a.ty) else {
                        bookkeeping += 1;
                        continue;
                    };
                    let err = |k| at(&lines, li, Some(p.index as usize), k);
                    let i = p2p_instr(dir, a, rank, &placement, batch).map_err(err)?;
                    instrs.push(i);
                    batch += 1;
                }
                ranks.push(instrs);
            }
            Program {
                placement,
                microbatches,
                forward_only,
                // Taken as written: the file's own batches, nothing lowered.
                comm: None,
                ranks,
                lengths: None,
                p2p_groups: Default::default(),
                buffer_slots: None,
            }
        }
    };
    Ok(Imported {
        program,
        form,
        placement_source,
        bookkeeping,
        idle_cells,
    })
}

/// The compute op of a cell, `None` for P2P and bookkeeping.
fn compute_of(cell: &Cell) -> Option<Compute> {
    let task = |a: &Action| Task::new(a.stage, a.mb.unwrap_or(0));
    match cell {
        Cell::Empty => None,
        Cell::Overlap { fwd, bwd } => Some(Compute::FwdBwd {
            fwd: task(fwd),
            bwd: task(bwd),
        }),
        Cell::Action(a) => match a.ty {
            ActionType::Forward => Some(Compute::Fwd(task(a))),
            ActionType::FullBackward => Some(Compute::Bwd(task(a))),
            ActionType::BackwardInput => Some(Compute::BwdD(task(a))),
            ActionType::BackwardWeight => Some(Compute::BwdW(task(a))),
            _ => None,
        },
    }
}

/// The four P2P action types.
#[derive(Copy, Clone)]
enum P2p {
    SendF,
    RecvF,
    SendB,
    RecvB,
}

impl P2p {
    fn of(ty: ActionType) -> Option<P2p> {
        match ty {
            ActionType::SendF => Some(P2p::SendF),
            ActionType::RecvF => Some(P2p::RecvF),
            ActionType::SendB => Some(P2p::SendB),
            ActionType::RecvB => Some(P2p::RecvB),
            _ => None,
        }
    }
}

/// A P2P action of `rank` as a send or recv: the peer is the rank of the neighbouring stage,
/// the payload is named by its producing stage (torch's `sRECV_Fm` receives the activation
/// of stage `s-1`, `sRECV_Bm` the gradient of stage `s+1`).
fn p2p_instr(
    dir: P2p,
    a: Action,
    rank: Rank,
    placement: &Placement,
    batch: u32,
) -> Result<Instr, CsvErrorKind> {
    let (s, mb) = (a.stage, a.mb.unwrap_or(0));
    let stages = placement.num_stages();
    let next = s.checked_add(1).filter(|&p| p < stages);
    let prev = s.checked_sub(1);
    // (neighbour stage, payload, is_send)
    let (peer_stage, side, payload, send) = match dir {
        P2p::SendF => (next, "next", next.map(|_| Payload::act(s, mb)), true),
        P2p::RecvF => (prev, "previous", prev.map(|p| Payload::act(p, mb)), false),
        P2p::SendB => (prev, "previous", prev.map(|_| Payload::grad(s, mb)), true),
        P2p::RecvB => (next, "next", next.map(|n| Payload::grad(n, mb)), false),
    };
    let (Some(peer_stage), Some(payload)) = (peer_stage, payload) else {
        return Err(CsvErrorKind::NoNeighbour {
            ty: a.ty,
            stage: s,
            side,
            stages,
        });
    };
    let peer = placement.rank_of(Task::new(peer_stage, mb));
    if peer == rank {
        return Err(CsvErrorKind::SelfMessage {
            ty: a.ty,
            stage: s,
            peer: peer_stage,
            rank: rank.0,
        });
    }
    Ok(Instr::message(send, peer, payload, batch))
}

/// The placement the file implies: each stage on the rank of the line(s) that name it.
fn derive_placement(
    lines: &[&str],
    parsed: &[Vec<Placed>],
    pp: u32,
    max_stage: u32,
) -> Result<Placement, CsvError> {
    // stage -> (rank, line index). A map, not a table, so a stray large id is reported
    // (as a missing stage) before anything of its size is allocated.
    let mut owner: BTreeMap<u32, u32> = BTreeMap::new();
    for (li, row) in parsed.iter().enumerate() {
        let rank = li as u32;
        for p in row {
            for a in actions(&p.cell) {
                match owner.get(&a.stage) {
                    Some(&r) if r != rank => {
                        return Err(at(
                            lines,
                            li,
                            Some(p.index as usize),
                            CsvErrorKind::StageOnTwoRanks {
                                stage: a.stage,
                                first_line: r as usize + 1,
                                first_rank: r,
                                rank,
                            },
                        ))
                    }
                    Some(_) => {}
                    None => {
                        owner.insert(a.stage, rank);
                    }
                }
            }
        }
    }
    let mut has_stage = vec![false; parsed.len()];
    for &r in owner.values() {
        has_stage[r as usize] = true;
    }
    if let Some(r) = has_stage.iter().position(|&h| !h) {
        return Err(at(
            lines,
            r,
            None,
            CsvErrorKind::RankWithoutStage { rank: r as u32 },
        ));
    }
    let stages = max_stage + 1;
    if owner.len() != stages as usize {
        let missing = (0..stages)
            .zip(owner.keys())
            .find(|(want, &got)| *want != got)
            .map_or(owner.len() as u32, |(want, _)| want);
        return Err(whole_file(CsvErrorKind::StageMissing {
            stage: missing,
            max: max_stage,
            stages,
        }));
    }
    let table: Vec<Rank> = owner.values().map(|&r| Rank(r)).collect();
    // (`stages % pp == 0`, written so for rust-version 1.80, which lacks `is_multiple_of`.)
    if (stages / pp) * pp == stages {
        let looped = Placement::looped(pp, stages / pp);
        if looped.table() == table.as_slice() {
            return Ok(looped);
        }
    }
    if stages == 2 * pp {
        let v = Placement::v_shape(pp);
        if v.table() == table.as_slice() {
            return Ok(v);
        }
    }
    let p = Placement::custom(pp, table);
    debug_assert_eq!(p.kind, PlacementKind::Custom);
    Ok(p)
}

/// The placement the user named, checked against every action of the file.
fn given_placement(
    lines: &[&str],
    parsed: &[Vec<Placed>],
    pp: u32,
    max_stage: u32,
    choice: PlacementChoice,
) -> Result<Placement, CsvError> {
    let placement = match choice {
        PlacementChoice::Loop => Placement::looped(pp, max_stage / pp + 1),
        PlacementChoice::V => Placement::v_shape(pp),
    };
    let stages = placement.num_stages();
    for (li, row) in parsed.iter().enumerate() {
        for p in row {
            for a in actions(&p.cell) {
                let err = |kind| at(lines, li, Some(p.index as usize), kind);
                let owner = placement.get(StageId(a.stage)).ok_or_else(|| {
                    err(CsvErrorKind::StageOutOfPlacement {
                        stage: a.stage,
                        placement: choice.name(),
                        pp,
                        stages,
                    })
                })?;
                if owner.0 != li as u32 {
                    return Err(err(CsvErrorKind::WrongRank {
                        stage: a.stage,
                        owner: owner.0,
                        rank: li as u32,
                        placement: choice.name(),
                    }));
                }
            }
        }
    }
    Ok(placement)
}
