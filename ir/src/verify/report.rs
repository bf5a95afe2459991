//! The verdict on one program ([`Report`]): the violations found ([`super::violation`]),
//! the per-rank peak memory, the NCCL risks ([`super::risk`]) and counts, as a line, as text
//! and as JSON.

use super::risk::Risk;
use super::violation::{Class, Stats, Violation};
use crate::ir::InstrRef;
use pipec_schedules::Rank;
use serde::ser::SerializeStruct;
use serde::{Serialize, Serializer};
use std::fmt;

/// Peak live activations on one rank and the instruction where the peak is first reached.
#[derive(Copy, Clone, Debug, PartialEq, Serialize)]
pub struct RankMemory {
    pub rank: Rank,
    /// Parameters + the most live activations at once, in the report's `memory_unit`.
    #[serde(serialize_with = "crate::memory::figure")]
    pub peak: f64,
    /// The parameters of the stages the rank holds (included in `peak`).
    #[serde(
        serialize_with = "crate::memory::figure",
        skip_serializing_if = "is_zero"
    )]
    pub params: f64,
    /// `None` when the rank never holds an activation.
    pub at: Option<InstrRef>,
    /// The most host memory its offloads hold at once, in `memory_unit` (issue 30: `offload`
    /// and `reload`, docs/format.md); absent from JSON when 0, so reports without offloads
    /// are what they were.
    #[serde(
        serialize_with = "crate::memory::figure",
        skip_serializing_if = "is_zero"
    )]
    pub host: f64,
    /// The message-buffer pool of a buffer plan (issue #39), in `memory_unit`, included in
    /// `peak`; absent from JSON when 0.
    #[serde(
        serialize_with = "crate::memory::figure",
        skip_serializing_if = "is_zero"
    )]
    pub buffers: f64,
}

fn is_zero(x: &f64) -> bool {
    *x == 0.0
}

/// The verdict on one program.
#[derive(Clone, Debug, PartialEq)]
pub struct Report {
    pub violations: Vec<Violation>,
    pub memory: Vec<RankMemory>,
    /// What `memory` counts ([`crate::memory`]).
    pub memory_unit: crate::memory::Unit,
    /// Valid but fragile on NCCL ([`super::risk`]); not violations.
    pub risks: Vec<Risk>,
    pub stats: Stats,
}

impl Report {
    pub fn is_valid(&self) -> bool {
        self.violations.is_empty()
    }

    /// The most serious class present, `None` when valid (precedence as [`Class`] orders it).
    pub fn class(&self) -> Option<Class> {
        self.violations.iter().map(Violation::class).min()
    }

    /// Whether every comm batch can complete (no wait cycle, no unmatched message).
    pub fn deadlock_free(&self) -> bool {
        !self.violations.iter().any(|v| v.class() == Class::Deadlock)
    }

    /// `10 8 6 4 layer-activations` or `40.00GiB 39.80GiB`: the peak of each rank, labelled.
    pub fn peaks(&self) -> String {
        self.memory_unit.list(self.memory.iter().map(|m| m.peak))
    }

    /// One line: `verified: 4 ranks, 352 instructions, deadlock-free; peak memory per
    /// rank: 10 8 6 4 layer-activations`, or the count of violations per class.
    pub fn verdict_line(&self) -> String {
        let plural = |n: u64, word: &str| format!("{n} {word}{}", if n == 1 { "" } else { "s" });
        let size = format!(
            "{}, {}",
            plural(self.stats.ranks as u64, "rank"),
            plural(self.stats.instructions, "instruction")
        );
        if self.is_valid() {
            return format!(
                "verified: {size}, deadlock-free; peak memory per rank: {}",
                self.peaks()
            );
        }
        let mut counts: Vec<(Class, usize)> = Vec::new();
        for v in &self.violations {
            let c = v.class();
            match counts.iter_mut().find(|(k, _)| *k == c) {
                Some((_, n)) => *n += 1,
                None => counts.push((c, 1)),
            }
        }
        counts.sort();
        let parts: Vec<String> = counts.iter().map(|(c, n)| format!("{n} {c}")).collect();
        let n = self.violations.len();
        format!(
            "INVALID: {n} violation{} ({}) in {size}",
            if n == 1 { "" } else { "s" },
            parts.join(", ")
        )
    }
}

/// One violation as JSON: its class and message next to its typed fields.
#[derive(Serialize)]
struct ViolationJson<'a> {
    class: Class,
    message: String,
    #[serde(flatten)]
    detail: &'a Violation,
}

impl Serialize for Report {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let violations: Vec<ViolationJson<'_>> = self
            .violations
            .iter()
            .map(|v| ViolationJson {
                class: v.class(),
                message: v.to_string(),
                detail: v,
            })
            .collect();
        let risks: Vec<serde_json::Value> = self
            .risks
            .iter()
            .map(|r| {
                let mut v = serde_json::to_value(r).unwrap_or_default();
                if let Some(o) = v.as_object_mut() {
                    o.insert("message".into(), r.to_string().into());
                }
                v
            })
            .collect();
        let mut st = s.serialize_struct("Report", 8)?;
        st.serialize_field("valid", &self.is_valid())?;
        st.serialize_field("verdict", &self.verdict_line())?;
        st.serialize_field("class", &self.class())?;
        st.serialize_field("stats", &self.stats)?;
        st.serialize_field("memory", &self.memory)?;
        st.serialize_field("memory_unit", &self.memory_unit)?;
        st.serialize_field("violations", &violations)?;
        st.serialize_field("risks", &risks)?;
        st.end()
    }
}

impl fmt::Display for Report {
    /// The verdict line, then every violation on its own line, then peak memory per rank.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "{}", self.verdict_line())?;
        for v in &self.violations {
            writeln!(f, "  [{}] {v}", v.class())?;
        }
        for r in &self.risks {
            writeln!(f, "  [risk] {r}")?;
        }
        if !self.is_valid() {
            write!(f, "peak memory per rank ({}):", self.memory_unit.label())?;
            for m in &self.memory {
                match m.at {
                    Some(at) => write!(f, " {}@#{}", self.memory_unit.fmt(m.peak), at.index)?,
                    None => write!(f, " {}", self.memory_unit.fmt(m.peak))?,
                }
            }
            writeln!(f)?;
        }
        Ok(())
    }
}
