//! The action grammar of torch.distributed.pipelining's schedule CSV files.
//!
//! torch writes one action per cell with `_Action.__repr__` and reads it back with
//! `_Action.from_str` (torch 2.15, `torch/distributed/pipelining/schedules.py`):
//!
//! ```text
//! cell    := ws* ( "" | action | overlap ) ws*
//! action  := stage TYPE [microbatch]        e.g. 0F3  2SEND_B1  1UNSHARD
//! overlap := "(" action ";" action ")" "OVERLAP_F_B"     e.g. (0F3;3B1)OVERLAP_F_B
//! stage, microbatch := ASCII digits
//! ```
//!
//! torch's reader is a regex anchored only at the start, so it silently accepts `1F0xyz` (as
//! `1F0`), Unicode digits, and empty parts inside parentheses. This parser accepts exactly what
//! torch writes plus torch's whitespace stripping around a cell and around each part of a
//! pair, and rejects everything else with the reason.

use std::fmt;

/// Largest accepted stage id + 1. Far beyond any real pipeline (Megatron runs pp <= 64 with a
/// few chunks each); it keeps the stage -> rank table a file can ask for small.
pub const MAX_STAGES: u32 = 1 << 16;
/// Largest accepted microbatch id + 1.
pub const MAX_MICROBATCHES: u32 = 1 << 24;

/// torch's `_ComputationType`, with its CSV spelling, and pipec's own memory actions.
///
/// The memory types ([`ActionType::MEMORY`]) are not torch's: they appear only in the cells
/// [`super::export_cells`] hands to `pipec.torch.build_schedule`, which executes them on its
/// subclass of torch's runtime; no CSV holds them (torch's `_Action.from_str` has no such
/// type, so the CSV exporter refuses programs with memory instructions and the reader, which
/// knows only [`ActionType::ALL`], refuses the names).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ActionType {
    /// `F`: forward.
    Forward,
    /// `B`: full backward.
    FullBackward,
    /// `I`: backward for the input gradient only (pipec's `bwd_D`).
    BackwardInput,
    /// `W`: backward for the weight gradient only (pipec's `bwd_W`).
    BackwardWeight,
    /// `SEND_F`: send this stage's output activation to the next stage.
    SendF,
    /// `RECV_F`: receive this stage's input activation from the previous stage.
    RecvF,
    /// `SEND_B`: send this stage's input gradient to the previous stage.
    SendB,
    /// `RECV_B`: receive this stage's output gradient from the next stage.
    RecvB,
    /// FSDP: gather the stage's parameters.
    Unshard,
    /// FSDP: free the gathered parameters.
    Reshard,
    /// Start the data-parallel gradient reduction (and scaling) of the stage.
    ReduceGrad,
    /// Wait for [`ActionType::ReduceGrad`].
    WaitReduceGrad,
    /// Wait for the completion of a `SEND_F`.
    WaitSendF,
    /// Wait for the completion of a `SEND_B`.
    WaitSendB,
    /// pipec: `fwd` with `"checkpoint": true`, a forward that keeps only its input.
    ForwardCheckpoint,
    /// pipec: `offload`, copy the forward's saved activations to host memory.
    Offload,
    /// pipec: `reload`, copy them back to the device.
    Reload,
    /// pipec: `wait_offload`, the compute stream waits for the offload.
    WaitOffload,
    /// pipec: `recompute`, rebuild a checkpointed forward's activations.
    Recompute,
}

impl ActionType {
    /// torch's types: what its CSV holds and the reader accepts.
    pub const ALL: [ActionType; 14] = [
        ActionType::Forward,
        ActionType::FullBackward,
        ActionType::BackwardInput,
        ActionType::BackwardWeight,
        ActionType::SendF,
        ActionType::RecvF,
        ActionType::SendB,
        ActionType::RecvB,
        ActionType::Unshard,
        ActionType::Reshard,
        ActionType::ReduceGrad,
        ActionType::WaitReduceGrad,
        ActionType::WaitSendF,
        ActionType::WaitSendB,
    ];

    /// pipec's memory types, in the order of the rank file's schema.
    pub const MEMORY: [ActionType; 5] = [
        ActionType::ForwardCheckpoint,
        ActionType::Offload,
        ActionType::Reload,
        ActionType::WaitOffload,
        ActionType::Recompute,
    ];

    /// torch's spelling (pipec's for the memory types).
    pub fn name(self) -> &'static str {
        match self {
            ActionType::Forward => "F",
            ActionType::FullBackward => "B",
            ActionType::BackwardInput => "I",
            ActionType::BackwardWeight => "W",
            ActionType::SendF => "SEND_F",
            ActionType::RecvF => "RECV_F",
            ActionType::SendB => "SEND_B",
            ActionType::RecvB => "RECV_B",
            ActionType::Unshard => "UNSHARD",
            ActionType::Reshard => "RESHARD",
            ActionType::ReduceGrad => "REDUCE_GRAD",
            ActionType::WaitReduceGrad => "WAIT_REDUCE_GRAD",
            ActionType::WaitSendF => "WAIT_SEND_F",
            ActionType::WaitSendB => "WAIT_SEND_B",
            ActionType::ForwardCheckpoint => "F_CHECKPOINT",
            ActionType::Offload => "OFFLOAD",
            ActionType::Reload => "RELOAD",
            ActionType::WaitOffload => "WAIT_OFFLOAD",
            ActionType::Recompute => "RECOMPUTE",
        }
    }

    /// torch's type of that spelling; `None` for anything else, pipec's memory types included.
    pub fn from_name(s: &str) -> Option<Self> {
        ActionType::ALL.into_iter().find(|t| t.name() == s)
    }

    /// Whether the action names a microbatch. The per-stage bookkeeping actions do not.
    pub fn takes_microbatch(self) -> bool {
        !matches!(
            self,
            ActionType::Unshard
                | ActionType::Reshard
                | ActionType::ReduceGrad
                | ActionType::WaitReduceGrad
        )
    }

    pub fn is_compute(self) -> bool {
        matches!(
            self,
            ActionType::Forward
                | ActionType::FullBackward
                | ActionType::BackwardInput
                | ActionType::BackwardWeight
        )
    }

    /// A point-to-point send or receive (these make a file compute+comms).
    pub fn is_p2p(self) -> bool {
        matches!(
            self,
            ActionType::SendF | ActionType::RecvF | ActionType::SendB | ActionType::RecvB
        )
    }

    /// One of pipec's memory types ([`ActionType::MEMORY`]), never in a CSV.
    pub fn is_memory(self) -> bool {
        ActionType::MEMORY.contains(&self)
    }

    /// FSDP and wait actions: accepted on import, carry no data dependency pipec checks.
    pub fn is_bookkeeping(self) -> bool {
        !self.is_compute() && !self.is_p2p() && !self.is_memory()
    }
}

impl fmt::Display for ActionType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One action, `<stage><TYPE>[<microbatch>]`. `mb` is `Some` exactly when
/// [`ActionType::takes_microbatch`].
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct Action {
    pub stage: u32,
    pub ty: ActionType,
    pub mb: Option<u32>,
}

impl Action {
    pub fn new(stage: u32, ty: ActionType, mb: u32) -> Self {
        Action {
            stage,
            ty,
            mb: Some(mb),
        }
    }

    /// A per-stage action without a microbatch (`0UNSHARD`).
    pub fn stage_only(stage: u32, ty: ActionType) -> Self {
        Action {
            stage,
            ty,
            mb: None,
        }
    }
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{}", self.stage, self.ty.name())?;
        if let Some(m) = self.mb {
            write!(f, "{m}")?;
        }
        Ok(())
    }
}

/// One CSV cell.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum Cell {
    /// An idle slot (torch writes `None` as an empty cell in compute-only files).
    Empty,
    Action(Action),
    /// `(f;b)OVERLAP_F_B`: a forward and a full backward run together. Stored forward first,
    /// whatever order the file used.
    Overlap {
        fwd: Action,
        bwd: Action,
    },
}

/// torch's name for an overlapped forward/backward pair.
pub const OVERLAP_F_B: &str = "OVERLAP_F_B";

impl fmt::Display for Cell {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Cell::Empty => Ok(()),
            Cell::Action(a) => write!(f, "{a}"),
            Cell::Overlap { fwd, bwd } => write!(f, "({fwd};{bwd}){OVERLAP_F_B}"),
        }
    }
}

/// What is wrong with a cell, or with the file around it.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CsvErrorKind {
    // --- one cell ---
    #[error("expected a stage number at the start of the action, found {found}")]
    MissingStage { found: String },
    #[error(
        "no action type after the stage number (expected one of {})",
        type_list()
    )]
    MissingType,
    #[error("unknown action type `{word}` (expected one of {})", type_list())]
    UnknownType { word: String },
    #[error("`{ty}` needs a microbatch number after it, e.g. `0{ty}3`")]
    MissingMicrobatch { ty: ActionType },
    #[error("`{ty}` is per stage and takes no microbatch number (write `<stage>{ty}`)")]
    UnexpectedMicrobatch { ty: ActionType },
    #[error("unexpected text `{rest}` after the action `{action}`")]
    TrailingText { action: String, rest: String },
    #[error("`{ch}` is not an ASCII digit; stage and microbatch numbers are written with 0-9")]
    NonAsciiDigit { ch: char },
    #[error("the {what} number `{digits}` is too large (pipec accepts {what} ids below {limit})")]
    NumberTooLarge {
        what: &'static str,
        digits: String,
        limit: u32,
    },
    #[error("an overlapped pair holds exactly two actions, `(f;b)OVERLAP_F_B`; found {parts} `;`-separated parts, {empty} of them empty")]
    OverlapArity { parts: usize, empty: usize },
    #[error("an overlapped pair needs one forward (F) and one full backward (B); found `{first}` and `{second}`")]
    OverlapParts { first: String, second: String },
    #[error("nested parentheses are not allowed; an overlapped pair is `(f;b)OVERLAP_F_B`")]
    NestedParens,
    #[error("`(` is not closed; an overlapped pair is `(f;b)OVERLAP_F_B`")]
    UnclosedParen,
    #[error("expected `{OVERLAP_F_B}` after the closing parenthesis, found {found}")]
    OverlapType { found: String },
    #[error("unexpected character {ch:?}")]
    UnexpectedChar { ch: char },
    // --- the file ---
    #[error("the input is empty: expected one line per rank")]
    EmptyInput,
    #[error("the input is not valid UTF-8 (first bad byte at byte offset {offset})")]
    InvalidUtf8 { offset: usize },
    #[error("the file has {found} lines (one per rank), but pp is {expected}")]
    LineCount { found: usize, expected: u32 },
    #[error("an empty cell in a compute+comms file; torch's runtime executes every cell of that form and has no idle slot")]
    EmptyCellInComms,
    #[error("the file has {found} lines; pipec accepts at most {limit} ranks (every rank must own a stage)")]
    TooManyLines { found: usize, limit: u32 },
    #[error("the file has no compute action (F, B, I, W or an overlapped pair)")]
    NoCompute,
    #[error("stage {stage} appears on line {first_line} (rank {first_rank}) and here on rank {rank}; a stage belongs to one rank")]
    StageOnTwoRanks {
        stage: u32,
        first_line: usize,
        first_rank: u32,
        rank: u32,
    },
    #[error("stage {stage} appears on no line, but the file names stages up to {max}; every stage 0..{stages} must sit on some rank")]
    StageMissing { stage: u32, max: u32, stages: u32 },
    #[error("rank {rank}'s line names no stage, so the file does not say which stages it owns; give the placement (loop or v)")]
    RankWithoutStage { rank: u32 },
    #[error("stage {stage} is on rank {owner} under the {placement} placement, but this is rank {rank}'s line")]
    WrongRank {
        stage: u32,
        owner: u32,
        rank: u32,
        placement: &'static str,
    },
    #[error("stage {stage} does not exist in the {placement} placement over {pp} ranks (stages 0..{stages})")]
    StageOutOfPlacement {
        stage: u32,
        placement: &'static str,
        pp: u32,
        stages: u32,
    },
    #[error(
        "`{ty}` on stage {stage} has no {side} stage to talk to (the model has stages 0..{stages})"
    )]
    NoNeighbour {
        ty: ActionType,
        stage: u32,
        side: &'static str,
        stages: u32,
    },
    #[error("`{ty}` on stage {stage}: its peer stage {peer} is on the same rank {rank}; torch hands tensors between stages of one rank over locally, without SEND/RECV")]
    SelfMessage {
        ty: ActionType,
        stage: u32,
        peer: u32,
        rank: u32,
    },
    #[error("{stages} stages x {microbatches} microbatches is over pipec's limit of {limit} (stage, microbatch) pairs")]
    TooLarge {
        stages: u64,
        microbatches: u64,
        limit: u64,
    },
}

fn type_list() -> String {
    let mut s: Vec<&str> = ActionType::ALL.iter().map(|t| t.name()).collect();
    s.push("(f;b)OVERLAP_F_B");
    s.join(", ")
}

fn describe(rest: &str) -> String {
    match rest.chars().next() {
        None => "the end of the cell".to_string(),
        Some(c) => format!("{:?}", c),
    }
}

/// Parse one cell (surrounding ASCII whitespace already allowed). The error kinds are all
/// cell-level ones; the importer adds the position.
pub fn parse_cell(text: &str) -> Result<Cell, CsvErrorKind> {
    let t = trim(text);
    if t.is_empty() {
        return Ok(Cell::Empty);
    }
    if let Some(inner) = t.strip_prefix('(') {
        return parse_overlap(inner);
    }
    parse_action(t).map(Cell::Action)
}

fn trim(s: &str) -> &str {
    s.trim_matches(|c| c == ' ' || c == '\t')
}

fn parse_overlap(inner: &str) -> Result<Cell, CsvErrorKind> {
    let mut close = None;
    for (i, c) in inner.char_indices() {
        match c {
            '(' => return Err(CsvErrorKind::NestedParens),
            ')' => {
                close = Some(i);
                break;
            }
            _ => {}
        }
    }
    let close = close.ok_or(CsvErrorKind::UnclosedParen)?;
    let (body, after) = (&inner[..close], &inner[close + 1..]);
    if after != OVERLAP_F_B {
        let found = if after.is_empty() {
            "the end of the cell".to_string()
        } else {
            format!("`{after}`")
        };
        return Err(CsvErrorKind::OverlapType { found });
    }
    let parts: Vec<&str> = body.split(';').map(trim).collect();
    let empty = parts.iter().filter(|p| p.is_empty()).count();
    if parts.len() != 2 || empty > 0 {
        return Err(CsvErrorKind::OverlapArity {
            parts: parts.len(),
            empty,
        });
    }
    let a = parse_action(parts[0])?;
    let b = parse_action(parts[1])?;
    let pair = match (a.ty, b.ty) {
        (ActionType::Forward, ActionType::FullBackward) => Some((a, b)),
        (ActionType::FullBackward, ActionType::Forward) => Some((b, a)),
        _ => None,
    };
    match pair {
        Some((fwd, bwd)) => Ok(Cell::Overlap { fwd, bwd }),
        None => Err(CsvErrorKind::OverlapParts {
            first: a.to_string(),
            second: b.to_string(),
        }),
    }
}

/// Leading ASCII digits as a bounded id; `what` names the number in messages.
fn number<'a>(
    s: &'a str,
    what: &'static str,
    limit: u32,
) -> Result<Option<(u32, &'a str)>, CsvErrorKind> {
    let end = s
        .char_indices()
        .find(|(_, c)| !c.is_ascii_digit())
        .map_or(s.len(), |(i, _)| i);
    if let Some(c) = s[end..].chars().next() {
        if c.is_numeric() && !c.is_ascii_digit() {
            return Err(CsvErrorKind::NonAsciiDigit { ch: c });
        }
    }
    if end == 0 {
        return Ok(None);
    }
    let digits = &s[..end];
    let mut v: u64 = 0;
    for b in digits.bytes() {
        v = v * 10 + u64::from(b - b'0');
        if v >= u64::from(limit) {
            return Err(CsvErrorKind::NumberTooLarge {
                what,
                digits: shorten(digits),
                limit,
            });
        }
    }
    Ok(Some((v as u32, &s[end..])))
}

/// At most 24 characters of `s` for a message.
fn shorten(s: &str) -> String {
    if s.chars().count() <= 24 {
        s.to_string()
    } else {
        format!("{}...", s.chars().take(20).collect::<String>())
    }
}

/// One `<stage><TYPE>[<microbatch>]` action, the whole of `s`.
pub fn parse_action(s: &str) -> Result<Action, CsvErrorKind> {
    let (stage, rest) = number(s, "stage", MAX_STAGES)?
        .ok_or_else(|| CsvErrorKind::MissingStage { found: describe(s) })?;
    let word_end = rest
        .char_indices()
        .find(|(_, c)| !(c.is_ascii_alphabetic() || *c == '_'))
        .map_or(rest.len(), |(i, _)| i);
    let (word, rest) = rest.split_at(word_end);
    if word.is_empty() {
        return Err(match rest.chars().next() {
            None => CsvErrorKind::MissingType,
            Some(c) => CsvErrorKind::UnexpectedChar { ch: c },
        });
    }
    let ty = ActionType::from_name(word).ok_or_else(|| CsvErrorKind::UnknownType {
        word: shorten(word),
    })?;
    let (mb, rest) = match number(rest, "microbatch", MAX_MICROBATCHES)? {
        Some((m, r)) => (Some(m), r),
        None => (None, rest),
    };
    let action = Action { stage, ty, mb };
    if !rest.is_empty() {
        return Err(CsvErrorKind::TrailingText {
            action: action.to_string(),
            rest: shorten(rest),
        });
    }
    match (ty.takes_microbatch(), mb) {
        (true, None) => Err(CsvErrorKind::MissingMicrobatch { ty }),
        (false, Some(_)) => Err(CsvErrorKind::UnexpectedMicrobatch { ty }),
        _ => Ok(action),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_action_type_round_trips() {
        for ty in ActionType::ALL {
            let a = if ty.takes_microbatch() {
                Action::new(3, ty, 17)
            } else {
                Action::stage_only(3, ty)
            };
            let text = a.to_string();
            assert_eq!(parse_cell(&text), Ok(Cell::Action(a)), "{text}");
        }
    }

    #[test]
    fn overlap_either_order_and_whitespace() {
        let want = Cell::Overlap {
            fwd: Action::new(0, ActionType::Forward, 3),
            bwd: Action::new(3, ActionType::FullBackward, 1),
        };
        assert_eq!(parse_cell("(0F3;3B1)OVERLAP_F_B"), Ok(want));
        assert_eq!(parse_cell(" ( 3B1 ; 0F3 )OVERLAP_F_B\t"), Ok(want));
        assert_eq!(want.to_string(), "(0F3;3B1)OVERLAP_F_B");
    }

    #[test]
    fn what_torch_lets_through_is_refused() {
        assert!(matches!(
            parse_cell("1F0xyz"),
            Err(CsvErrorKind::TrailingText { .. })
        ));
        assert!(matches!(
            parse_cell("1F\u{663}"),
            Err(CsvErrorKind::NonAsciiDigit { ch: '\u{663}' })
        ));
        assert!(matches!(
            parse_cell("(0F3;;3B1)OVERLAP_F_B"),
            Err(CsvErrorKind::OverlapArity { parts: 3, empty: 1 })
        ));
        assert!(matches!(
            parse_cell("0F"),
            Err(CsvErrorKind::MissingMicrobatch { .. })
        ));
        assert!(matches!(
            parse_cell("0UNSHARD1"),
            Err(CsvErrorKind::UnexpectedMicrobatch { .. })
        ));
        assert!(matches!(
            parse_cell("0F99999999999999999999999999"),
            Err(CsvErrorKind::NumberTooLarge { .. })
        ));
    }
}
