//! Microbatches of different lengths (issue #38): the token counts of the sequences packed
//! into each microbatch, as the user gives them (`--microbatch-lengths FILE`, Python
//! `lengths=`). A plan that knows them sizes every message when it is made, so a runtime
//! needs no shape handshake (Megatron's `_communicate_shapes`).
//!
//! The text form is one line per microbatch, the lengths of its sequences separated by spaces
//! or commas; a line with one number is one unpacked sequence.

use serde::de::{self, Deserializer, SeqAccess, Visitor};
use serde::ser::{SerializeSeq, Serializer};
use serde::{Deserialize, Serialize};
use std::fmt;
use thiserror::Error;

/// Most tokens one microbatch may hold: a message's size is counted in `u32` tokens.
pub const MAX_TOKENS: u64 = u32::MAX as u64;

/// The sequences of every microbatch, by the user's microbatch index. Never empty, no
/// microbatch empty, no length zero, no microbatch over [`MAX_TOKENS`].
#[derive(Clone, Debug)]
pub struct Lengths {
    mbs: Vec<Vec<u32>>,
    /// Tokens per microbatch (the sum of its sequences), cached: every message reads it.
    tokens: Vec<u32>,
    /// Read from a file (errors found later name lines) rather than lists (list indices).
    lines: bool,
}

/// Equal when the microbatches are, however they were given.
impl PartialEq for Lengths {
    fn eq(&self, other: &Self) -> bool {
        self.mbs == other.mbs
    }
}

impl Eq for Lengths {}

/// Where a bad length sits: a line of a file (1-based) or an index of a Python list.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum At {
    Line(usize),
    Index(usize),
}

impl fmt::Display for At {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            At::Line(l) => write!(f, "line {l}"),
            At::Index(i) => write!(f, "lengths[{i}]"),
        }
    }
}

/// What is wrong with a microbatch's lengths.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum LengthsErrorKind {
    #[error("no microbatches: give one line of sequence lengths per microbatch")]
    Empty,
    #[error("empty line: every microbatch needs at least one sequence length")]
    EmptyLine,
    #[error("`{0}` is not a length in tokens (a whole number above 0)")]
    NotANumber(String),
    #[error("length {0} is not above 0")]
    NotPositive(i128),
    #[error("the microbatch holds {0} tokens, more than {MAX_TOKENS}")]
    TooManyTokens(u64),
    #[error("length {len} is longer than the model's seq = {seq}")]
    OverSeq { len: u32, seq: u64 },
}

/// A bad length, with where it is.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
#[error("microbatch lengths, {}: {kind}", place(.at))]
pub struct LengthsError {
    /// `None` for an error of the whole input (no microbatches).
    pub at: Option<At>,
    pub kind: LengthsErrorKind,
}

impl LengthsError {
    fn new(at: Option<At>, kind: LengthsErrorKind) -> Self {
        LengthsError { at, kind }
    }
}

fn place(at: &Option<At>) -> String {
    at.map_or_else(|| "input".to_string(), |a| a.to_string())
}

impl Lengths {
    /// Read the text form. Lines are numbered from 1 in errors; a final newline is allowed.
    pub fn parse(text: &str) -> Result<Lengths, LengthsError> {
        let text = text.strip_suffix('\n').unwrap_or(text);
        let text = text.strip_suffix('\r').unwrap_or(text);
        if text.trim().is_empty() {
            return Err(LengthsError::new(None, LengthsErrorKind::Empty));
        }
        let mut mbs = Vec::new();
        for (i, line) in text.split('\n').enumerate() {
            let at = At::Line(i + 1);
            let words: Vec<&str> = line
                .split(|c: char| c == ',' || c.is_whitespace())
                .filter(|w| !w.is_empty())
                .collect();
            if words.is_empty() {
                return Err(LengthsError::new(Some(at), LengthsErrorKind::EmptyLine));
            }
            let mut seqs = Vec::with_capacity(words.len());
            for w in words {
                let v: i128 = w.parse().map_err(|_| {
                    LengthsError::new(Some(at), LengthsErrorKind::NotANumber(w.to_string()))
                })?;
                seqs.push(v);
            }
            mbs.push((at, seqs));
        }
        Lengths::build(mbs, true)
    }

    /// From lists of sequence lengths, one list per microbatch (Python's `lengths=`); errors
    /// name the list index.
    pub fn from_lists(lists: Vec<Vec<i128>>) -> Result<Lengths, LengthsError> {
        if lists.is_empty() {
            return Err(LengthsError::new(None, LengthsErrorKind::Empty));
        }
        Lengths::build(
            lists
                .into_iter()
                .enumerate()
                .map(|(i, l)| (At::Index(i), l))
                .collect(),
            false,
        )
    }

    fn build(rows: Vec<(At, Vec<i128>)>, lines: bool) -> Result<Lengths, LengthsError> {
        let mut mbs = Vec::with_capacity(rows.len());
        let mut tokens = Vec::with_capacity(rows.len());
        for (at, row) in rows {
            if row.is_empty() {
                return Err(LengthsError::new(Some(at), LengthsErrorKind::EmptyLine));
            }
            let mut seqs = Vec::with_capacity(row.len());
            let mut sum: u64 = 0;
            for v in row {
                if v <= 0 {
                    return Err(LengthsError::new(
                        Some(at),
                        LengthsErrorKind::NotPositive(v),
                    ));
                }
                let v = u64::try_from(v).unwrap_or(u64::MAX);
                sum = sum.saturating_add(v);
                if sum > MAX_TOKENS {
                    return Err(LengthsError::new(
                        Some(at),
                        LengthsErrorKind::TooManyTokens(sum),
                    ));
                }
                seqs.push(v as u32);
            }
            tokens.push(sum as u32);
            mbs.push(seqs);
        }
        Ok(Lengths { mbs, tokens, lines })
    }

    /// Refuse a sequence longer than the model's `seq` (from a `[model]` table), naming where
    /// it was given (a line of a file, an index of a list).
    pub fn check_seq(&self, seq: u64) -> Result<(), LengthsError> {
        for (i, seqs) in self.mbs.iter().enumerate() {
            if let Some(&len) = seqs.iter().find(|&&l| l as u64 > seq) {
                let at = if self.lines {
                    At::Line(i + 1)
                } else {
                    At::Index(i)
                };
                return Err(LengthsError::new(
                    Some(at),
                    LengthsErrorKind::OverSeq { len, seq },
                ));
            }
        }
        Ok(())
    }

    /// Number of microbatches.
    pub fn microbatches(&self) -> u32 {
        self.mbs.len() as u32
    }

    /// The sequence lengths of microbatch `mb` (empty when out of range).
    pub fn sequences(&self, mb: u32) -> &[u32] {
        self.mbs.get(mb as usize).map_or(&[], Vec::as_slice)
    }

    /// Tokens of microbatch `mb`: the size of every activation and gradient it sends.
    pub fn tokens(&self, mb: u32) -> Option<u32> {
        self.tokens.get(mb as usize).copied()
    }

    /// Tokens of every microbatch, by index.
    pub fn all_tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// The largest microbatch's tokens.
    pub fn max_tokens(&self) -> u32 {
        self.tokens.iter().copied().max().unwrap_or(1)
    }

    /// Whether every microbatch is one sequence.
    pub fn unpacked(&self) -> bool {
        self.mbs.iter().all(|s| s.len() == 1)
    }

    /// One phrase for titles: `lengths 300-8000 tokens per microbatch (mean 3974, 6
    /// sequences)`.
    pub fn summary(&self) -> String {
        let min = self.tokens.iter().copied().min().unwrap_or(0);
        let max = self.max_tokens();
        let sum: u64 = self.tokens.iter().map(|&t| t as u64).sum();
        let mean = sum as f64 / self.tokens.len().max(1) as f64;
        let seqs: usize = self.mbs.iter().map(Vec::len).sum();
        format!(
            "lengths {min}-{max} tokens per microbatch (mean {}, {seqs} sequences)",
            mean.round()
        )
    }

    /// The text form [`Lengths::parse`] reads back: one line per microbatch.
    pub fn to_text(&self) -> String {
        let mut s = String::new();
        for seqs in &self.mbs {
            let line: Vec<String> = seqs.iter().map(u32::to_string).collect();
            s.push_str(&line.join(" "));
            s.push('\n');
        }
        s
    }
}

/// A list of ints when every microbatch is one sequence (as a Python list of ints or a file
/// of one number per line gives them), else a list of lists.
impl Serialize for Lengths {
    fn serialize<S: Serializer>(&self, ser: S) -> Result<S::Ok, S::Error> {
        let mut seq = ser.serialize_seq(Some(self.mbs.len()))?;
        if self.unpacked() {
            for s in &self.mbs {
                seq.serialize_element(&s[0])?;
            }
        } else {
            for s in &self.mbs {
                seq.serialize_element(s)?;
            }
        }
        seq.end()
    }
}

#[derive(Deserialize)]
#[serde(untagged)]
enum Row {
    One(i64),
    Many(Vec<i64>),
}

impl<'de> Deserialize<'de> for Lengths {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Lengths;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a list of sequence lengths per microbatch")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut a: A) -> Result<Lengths, A::Error> {
                let mut lists = Vec::new();
                while let Some(r) = a.next_element::<Row>()? {
                    lists.push(match r {
                        Row::One(v) => vec![v as i128],
                        Row::Many(v) => v.into_iter().map(i128::from).collect(),
                    });
                }
                Lengths::from_lists(lists).map_err(de::Error::custom)
            }
        }
        d.deserialize_seq(V)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_lines_of_spaces_and_commas() {
        let l = Lengths::parse("4096\n1000, 2000 500\n7\n").unwrap();
        assert_eq!(l.microbatches(), 3);
        assert_eq!(l.sequences(1), &[1000, 2000, 500]);
        assert_eq!(l.all_tokens(), &[4096, 3500, 7]);
        assert_eq!(Lengths::parse(&l.to_text()).unwrap(), l);
    }

    #[test]
    fn errors_name_the_line() {
        let e = Lengths::parse("5\n\n6").unwrap_err();
        assert_eq!(e.at, Some(At::Line(2)));
        assert_eq!(e.kind, LengthsErrorKind::EmptyLine);
        assert!(e.to_string().contains("line 2"), "{e}");
        let e = Lengths::parse("5\n6 0").unwrap_err();
        assert_eq!(e.at, Some(At::Line(2)));
        assert_eq!(e.kind, LengthsErrorKind::NotPositive(0));
        let e = Lengths::parse("5\n-3").unwrap_err();
        assert_eq!(e.kind, LengthsErrorKind::NotPositive(-3));
        let e = Lengths::parse("5\n3x").unwrap_err();
        assert_eq!(e.kind, LengthsErrorKind::NotANumber("3x".into()));
        assert_eq!(
            Lengths::parse("").unwrap_err().kind,
            LengthsErrorKind::Empty
        );
        let l = Lengths::parse("5\n9000 10").unwrap();
        let e = l.check_seq(8192).unwrap_err();
        assert_eq!(e.at, Some(At::Line(2)));
        assert!(e.to_string().contains("seq = 8192"), "{e}");
        let e = Lengths::parse("4294967295 1").unwrap_err();
        assert!(matches!(e.kind, LengthsErrorKind::TooManyTokens(_)));
    }

    #[test]
    fn json_is_flat_when_unpacked() {
        let l = Lengths::parse("5\n6").unwrap();
        assert_eq!(serde_json::to_string(&l).unwrap(), "[5,6]");
        let p = Lengths::parse("5 1\n6").unwrap();
        assert_eq!(serde_json::to_string(&p).unwrap(), "[[5,1],[6]]");
        let back: Lengths = serde_json::from_str("[[5,1],6]").unwrap();
        assert_eq!(back, p);
        assert!(serde_json::from_str::<Lengths>("[0]").is_err());
    }
}
