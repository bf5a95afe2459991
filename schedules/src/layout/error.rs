//! Layout errors: a typed kind, the byte position it refers to, and a Display that echoes the
//! layout with a caret under the offending character.

use super::LayerKind;
use std::fmt;
use thiserror::Error;

/// Why a layout was refused. The Display of each kind is the one-line reason.
///
/// The "Megatron would ..." kinds are strings that Megatron-LM's textual expansion
/// (`PipelineParallelLayerLayout.parse_str_to_list`) accepts but expands in a way a reader is
/// unlikely to mean; pipec refuses them rather than guess.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum LayoutErrorKind {
    // --- syntax -------------------------------------------------------------------------------
    #[error("unknown symbol {0:?}: a layer is one of E (embedding), t (decoder), m (MTP), L (loss), stages are separated by |")]
    UnknownSymbol(char),
    #[error("digit {0:?} outside a count: a count follows `*`, as in `t*3`")]
    UnexpectedDigit(char),
    #[error("{0:?} is not an ASCII digit: write counts with 0-9 (Megatron's `\\d` would accept it, pipec does not guess)")]
    NonAsciiDigit(char),
    #[error("comma inside a count: Megatron deletes commas before expanding, so the digits on both sides would join into one number; write the count without a comma")]
    CommaInCount,
    #[error("`*` must directly follow what it repeats: Megatron deletes commas first (so `t,*3` would repeat `t`), and a space is not allowed there")]
    SeparatorBeforeStar,
    #[error("`*` has nothing before it to repeat")]
    RepeatWithoutItem,
    #[error("`*` must be followed directly by a count, as in `t*3`")]
    MissingCount,
    #[error("count of 0: Megatron would silently delete the item before `*0` (a layer, a `|` or a `)`); remove the item instead")]
    ZeroCount,
    #[error("repeat applied to `|`: Megatron would repeat the bare separator, adding empty stages; write `(|)*n` if that is meant, or `(...|)*n` to repeat stages")]
    RepeatedBar,
    #[error("a second `*` after a count: Megatron applies it to the last character only (`(tt)*2*2` gives 5 layers, not 8); write a single count")]
    RepeatOfRepeat,
    #[error("`(` is never closed")]
    UnclosedGroup,
    #[error("`)` without a matching `(`")]
    UnopenedGroup,
    #[error("parentheses must be followed by a repeat count such as `*2` (Megatron has no plain grouping)")]
    UnrepeatedGroup,
    #[error("empty parentheses: nothing to repeat")]
    EmptyGroup,
    #[error("parentheses nested more than {max} deep")]
    TooDeep { max: u32 },
    #[error("layout is {len} bytes long; at most {max} are accepted")]
    TooLong { len: usize, max: usize },
    #[error("the layout expands to more than {max} layers")]
    TooManyLayers { max: u64 },
    #[error("the layout expands to more than {max} stages")]
    TooManyStages { max: u64 },

    // --- structure (independent of pp) --------------------------------------------------------
    #[error("the layout has no layers; it needs at least the embedding `E` and the loss `L`")]
    NoLayers,
    #[error("the first layer must be the embedding `E`, found {:?} ({})", .0.symbol(), .0.word())]
    FirstNotEmbedding(LayerKind),
    #[error("the last layer must be the loss `L`, found {:?} ({})", .0.symbol(), .0.word())]
    LastNotLoss(LayerKind),
    #[error("the embedding `E` must appear exactly once; this one expands to another `E`")]
    DuplicateEmbedding,
    #[error("the loss `L` must appear exactly once, as the last layer; this `L` is not the last")]
    DuplicateLoss,
    #[error("decoder layers must be placed before MTP layers; this decoder follows an MTP layer")]
    DecoderAfterMtp,
    #[error("all MTP layers must be in one stage; this one is in stage {stage}, the first MTP layer in stage {first}")]
    MtpSplit { first: usize, stage: usize },

    // --- against the pipeline (pp, vpp, layer counts) -----------------------------------------
    #[error("pp must be at least 1")]
    ZeroPp,
    #[error("the layout has {stages} stages, which is not a multiple of pp = {pp}; add or remove stages (empty stages `||` are allowed)")]
    NotDivisible { stages: usize, pp: u32 },
    #[error("vpp {given} conflicts with the layout: {stages} stages / pp {pp} = vpp {derived}")]
    VppConflict {
        stages: usize,
        pp: u32,
        derived: u32,
        given: u32,
    },
    #[error("MTP layers must be in the last virtual stage of their pp rank (a Megatron restriction); stage {stage} is virtual stage {vpp_rank} of {vpp} on pp rank {pp_rank}")]
    MtpNotInLastChunk {
        stage: usize,
        pp_rank: u32,
        vpp_rank: u32,
        vpp: u32,
    },
    #[error(
        "the layout has {found} decoder layers `t`, but the model has {expected} (num_layers)"
    )]
    DecoderCount { found: usize, expected: u32 },
    #[error(
        "the layout has {found} MTP layers `m`, but the model has {expected} (mtp_num_layers)"
    )]
    MtpCount { found: usize, expected: u32 },
}

/// A refused layout: the text, the byte offset of the offending character (`None` when the
/// error is about the whole layout, such as stage-count divisibility) and why.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub struct LayoutError {
    pub input: String,
    /// Byte offset into `input`, on a char boundary; may equal `input.len()` (end of input).
    pub pos: Option<usize>,
    pub kind: LayoutErrorKind,
}

/// Echo at most this many characters of a long layout around the caret.
const ECHO_WINDOW: usize = 100;

impl LayoutError {
    pub(crate) fn at(input: &str, pos: usize, kind: LayoutErrorKind) -> Self {
        LayoutError {
            input: input.to_string(),
            pos: Some(pos),
            kind,
        }
    }

    /// The caret column in characters (not bytes) from the start of `input`.
    pub fn column(&self) -> Option<usize> {
        let pos = self.pos?;
        let pos = pos.min(self.input.len());
        Some(
            self.input
                .char_indices()
                .take_while(|&(i, _)| i < pos)
                .count(),
        )
    }

    /// The one-line reason.
    pub fn reason(&self) -> String {
        self.kind.to_string()
    }

    /// The 1-based line of the caret and that line's text, when the layout spans several
    /// lines (a `--layout-file` written over lines): the echo then shows that line alone.
    fn caret_line(&self) -> Option<(usize, &str, Option<usize>)> {
        if !self.input.contains('\n') {
            return None;
        }
        let pos = self.pos.unwrap_or(0).min(self.input.len());
        let start = self.input[..pos].rfind('\n').map_or(0, |i| i + 1);
        let end = self.input[start..]
            .find('\n')
            .map_or(self.input.len(), |i| start + i);
        let line_no = self.input[..start].matches('\n').count() + 1;
        let col = self.pos.map(|_| self.input[start..pos].chars().count());
        Some((line_no, &self.input[start..end], col))
    }

    /// The echoed line and the caret column within it: the whole layout (or, over several
    /// lines, the caret's line) when short, else a window of it around the caret with `...`
    /// marking the cut ends. Control characters are shown as U+FFFD so the echo stays one
    /// line and the caret column stays right.
    fn echo(&self) -> (String, Option<usize>) {
        let (text, col) = match self.caret_line() {
            Some((_, line, col)) => (line, col),
            None => (self.input.as_str(), self.column()),
        };
        let chars: Vec<char> = text
            .chars()
            .map(|c| if c.is_control() { '\u{FFFD}' } else { c })
            .collect();
        if chars.len() <= ECHO_WINDOW {
            return (chars.into_iter().collect(), col);
        }
        let center = col.unwrap_or(0);
        let start = center.saturating_sub(ECHO_WINDOW / 2);
        let end = (start + ECHO_WINDOW).min(chars.len());
        let mut line = String::new();
        let mut shift = 0;
        if start > 0 {
            line.push_str("...");
            shift = 3;
        }
        line.extend(&chars[start..end]);
        if end < chars.len() {
            line.push_str("...");
        }
        (line, col.map(|c| c - start + shift))
    }
}

impl fmt::Display for LayoutError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (line, col) = self.echo();
        match self.caret_line() {
            Some((n, _, _)) => writeln!(f, "invalid layout (line {n}):")?,
            None => writeln!(f, "invalid layout:")?,
        }
        writeln!(f, "  {line}")?;
        if let Some(c) = col {
            writeln!(f, "  {}^", " ".repeat(c))?;
        }
        write!(f, "  {}", self.kind)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shown(input: &str, pos: Option<usize>) -> String {
        LayoutError {
            input: input.to_string(),
            pos,
            kind: LayoutErrorKind::UnknownSymbol('X'),
        }
        .to_string()
    }

    #[test]
    fn caret_under_the_character_counting_chars_not_bytes() {
        let reason = LayoutErrorKind::UnknownSymbol('X').to_string();
        assert_eq!(
            shown("EtX|L", Some(2)),
            format!("invalid layout:\n  EtX|L\n    ^\n  {reason}")
        );
        // "é" is 2 bytes; X is at byte 3, character 2.
        assert_eq!(
            shown("EéX", Some(3)),
            format!("invalid layout:\n  EéX\n    ^\n  {reason}")
        );
        // End of input: the caret sits just past the last character.
        assert_eq!(
            shown("Et*", Some(3)),
            format!("invalid layout:\n  Et*\n     ^\n  {reason}")
        );
        // No position: no caret line.
        assert_eq!(
            shown("E|t|L", None),
            format!("invalid layout:\n  E|t|L\n  {reason}")
        );
    }

    #[test]
    fn control_characters_keep_the_echo_on_one_line() {
        let s = shown("E\tX", Some(2));
        assert_eq!(s.lines().nth(1), Some("  E\u{FFFD}X"));
        assert_eq!(s.lines().nth(2), Some("    ^"));
    }

    /// Regression (#29): a layout file written over several lines echoed its newlines as
    /// U+FFFD; the caret's line is shown alone, named by number.
    #[test]
    fn multi_line_layout_error_shows_the_caret_line() {
        let s = shown("Et|t\nt|Xt\n|L", Some(7));
        let lines: Vec<&str> = s.lines().collect();
        assert_eq!(lines[0], "invalid layout (line 2):");
        assert_eq!(lines[1], "  t|Xt");
        assert_eq!(lines[2], "    ^");
        assert!(!s.contains('\u{FFFD}'), "{s}");
        // An error at the start of line 3.
        let s = shown("Et\nt\n|X", Some(6));
        assert_eq!(s.lines().next(), Some("invalid layout (line 3):"));
        assert_eq!(s.lines().nth(1), Some("  |X"));
        assert_eq!(s.lines().nth(2), Some("   ^"));
    }

    #[test]
    fn long_layouts_are_echoed_in_a_window() {
        let input = format!("{}X{}", "t".repeat(1000), "t".repeat(1000));
        let s = shown(&input, Some(1000));
        let lines: Vec<&str> = s.lines().collect();
        assert!(lines[1].starts_with("  ...") && lines[1].ends_with("..."));
        assert_eq!(lines[1].chars().count(), 2 + 3 + ECHO_WINDOW + 3);
        let caret = lines[2].len() - 1;
        assert_eq!(&lines[1][caret..=caret], "X");
    }
}
