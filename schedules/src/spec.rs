//! What the user asks for: a schedule kind and its parameters, validated before any allocation.

use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;
use thiserror::Error;

/// The schedule families pipec generates.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ScheduleKind {
    #[serde(rename = "gpipe")]
    Gpipe,
    #[serde(rename = "1f1b")]
    OneFOneB,
    #[serde(rename = "interleaved-1f1b")]
    Interleaved1F1B,
    #[serde(rename = "looped-bfs")]
    LoopedBfs,
}

/// One row of `pipec schedules`.
pub struct KindInfo {
    pub kind: ScheduleKind,
    pub summary: &'static str,
    pub params: &'static str,
    pub source: &'static str,
}

impl ScheduleKind {
    pub const ALL: [ScheduleKind; 4] = [
        ScheduleKind::Gpipe,
        ScheduleKind::OneFOneB,
        ScheduleKind::Interleaved1F1B,
        ScheduleKind::LoopedBfs,
    ];

    pub fn name(self) -> &'static str {
        match self {
            ScheduleKind::Gpipe => "gpipe",
            ScheduleKind::OneFOneB => "1f1b",
            ScheduleKind::Interleaved1F1B => "interleaved-1f1b",
            ScheduleKind::LoopedBfs => "looped-bfs",
        }
    }

    pub fn info(self) -> KindInfo {
        let (summary, params, source) = match self {
            ScheduleKind::Gpipe => (
                "all forwards, then all backwards",
                "--pp, --microbatches; vpp = 1",
                "GPipe (Huang et al., 2019); torch ScheduleGPipe",
            ),
            ScheduleKind::OneFOneB => (
                "warmup forwards, steady one-forward-one-backward, cooldown backwards",
                "--pp, --microbatches; vpp = 1",
                "PipeDream-Flush; Megatron forward_backward_pipelining_without_interleaving",
            ),
            ScheduleKind::Interleaved1F1B => (
                "1F1B over vpp model chunks per rank, Megatron's exact order",
                "--pp, --vpp, --microbatches, --group-size (default pp; pp <= g <= M)",
                "Narayanan et al., 2021; Megatron forward_backward_pipelining_with_interleaving",
            ),
            ScheduleKind::LoopedBfs => (
                "each chunk runs all microbatches forward, then backward in reverse",
                "--pp, --vpp, --microbatches",
                "Lamy-Poirier, Breadth-First Pipeline Parallelism (2022); torch ScheduleLoopedBFS",
            ),
        };
        KindInfo {
            kind: self,
            summary,
            params,
            source,
        }
    }

    /// Whether the kind takes more than one chunk per rank.
    pub fn multi_chunk(self) -> bool {
        matches!(
            self,
            ScheduleKind::Interleaved1F1B | ScheduleKind::LoopedBfs
        )
    }
}

impl fmt::Display for ScheduleKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// An unknown kind name, with the list of known ones for the message.
#[derive(Debug, Error, PartialEq, Eq)]
#[error("unknown schedule kind `{0}` (known: gpipe, 1f1b, interleaved-1f1b, looped-bfs)")]
pub struct UnknownKind(pub String);

impl FromStr for ScheduleKind {
    type Err = UnknownKind;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        ScheduleKind::ALL
            .into_iter()
            .find(|k| k.name() == s)
            .ok_or_else(|| UnknownKind(s.to_string()))
    }
}

/// Bounds checked before anything proportional to the parameters is allocated.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Limits {
    /// Largest number of compute ops (passes over all stages and microbatches) accepted.
    pub max_compute_ops: u64,
}

impl Limits {
    /// 16M compute ops: sixteen times the largest frontier configuration we benchmark
    /// (pp=64, vpp=8, M=1024 has about one million).
    pub const DEFAULT: Limits = Limits {
        max_compute_ops: 1 << 24,
    };
}

impl Default for Limits {
    fn default() -> Self {
        Limits::DEFAULT
    }
}

/// A schedule request. `vpp` is the number of model chunks per rank.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ScheduleSpec {
    pub kind: ScheduleKind,
    pub pp: u32,
    pub vpp: u32,
    pub microbatches: u32,
    /// Megatron's `microbatch_group_size_per_vp_stage`; `None` means the default, `pp`.
    pub group_size: Option<u32>,
    pub forward_only: bool,
}

/// Why a spec is refused. Each names the parameters involved and the rule, as the user wrote them.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum SpecError {
    #[error("--pp must be at least 1")]
    ZeroPp,
    #[error("--vpp must be at least 1")]
    ZeroVpp,
    #[error("--microbatches must be at least 1")]
    ZeroMicrobatches,
    #[error("{kind} runs one model chunk per rank, but vpp = {vpp}; use interleaved-1f1b or looped-bfs for several chunks")]
    SingleChunkOnly { kind: ScheduleKind, vpp: u32 },
    #[error("{kind} with vpp = {vpp} needs pp >= 2: at pp = 1 Megatron runs forward_backward_no_pipelining, which has no model chunks to interleave")]
    ChunksNeedPipeline { kind: ScheduleKind, vpp: u32 },
    #[error("--group-size applies to interleaved-1f1b only, not {kind}")]
    GroupSizeNotApplicable { kind: ScheduleKind },
    #[error("--group-size {g} is out of range: Megatron requires pp <= group size <= microbatches, here {pp} <= {g} <= {m} does not hold")]
    GroupSizeOutOfRange { g: u32, pp: u32, m: u32 },
    #[error("microbatches = {m} leaves a last group of {rem} microbatches (group size {g}), fewer than pp = {pp}; Megatron rejects 0 < M % group size < pp because that last group cannot fill the ring")]
    PartialLastGroup { m: u32, g: u32, pp: u32, rem: u32 },
    #[error("the schedule would have {ops} compute ops, over the limit of {limit} (raise it with --max-ops)")]
    TooLarge { ops: u64, limit: u64 },
}

impl ScheduleSpec {
    /// Number of stages, `pp * vpp`.
    pub fn num_stages(&self) -> u32 {
        self.pp * self.vpp
    }

    /// The group size in effect (interleaved 1F1B).
    pub fn effective_group_size(&self) -> u32 {
        self.group_size.unwrap_or(self.pp)
    }

    /// Compute ops the schedule will hold, computed without overflow.
    pub fn compute_ops(&self) -> u64 {
        let passes = if self.forward_only { 1 } else { 2 };
        (self.pp as u64)
            .saturating_mul(self.vpp as u64)
            .saturating_mul(self.microbatches as u64)
            .saturating_mul(passes)
    }

    /// Check every rule of the kind; `Ok` means generation cannot fail.
    pub fn validate(&self, limits: &Limits) -> Result<(), SpecError> {
        if self.pp == 0 {
            return Err(SpecError::ZeroPp);
        }
        if self.vpp == 0 {
            return Err(SpecError::ZeroVpp);
        }
        if self.microbatches == 0 {
            return Err(SpecError::ZeroMicrobatches);
        }
        let ops = self.compute_ops();
        if ops > limits.max_compute_ops || (self.pp as u64) * (self.vpp as u64) > u32::MAX as u64 {
            return Err(SpecError::TooLarge {
                ops,
                limit: limits.max_compute_ops,
            });
        }
        if !self.kind.multi_chunk() && self.vpp != 1 {
            return Err(SpecError::SingleChunkOnly {
                kind: self.kind,
                vpp: self.vpp,
            });
        }
        if self.kind == ScheduleKind::Interleaved1F1B && self.pp == 1 && self.vpp > 1 {
            return Err(SpecError::ChunksNeedPipeline {
                kind: self.kind,
                vpp: self.vpp,
            });
        }
        if self.kind != ScheduleKind::Interleaved1F1B && self.group_size.is_some() {
            return Err(SpecError::GroupSizeNotApplicable { kind: self.kind });
        }
        if self.kind == ScheduleKind::Interleaved1F1B {
            let (g, pp, m) = (self.effective_group_size(), self.pp, self.microbatches);
            if g < pp || g > m {
                return Err(SpecError::GroupSizeOutOfRange { g, pp, m });
            }
            let rem = m % g;
            if rem > 0 && rem < pp {
                return Err(SpecError::PartialLastGroup { m, g, pp, rem });
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(kind: ScheduleKind, pp: u32, vpp: u32, m: u32, g: Option<u32>) -> ScheduleSpec {
        ScheduleSpec {
            kind,
            pp,
            vpp,
            microbatches: m,
            group_size: g,
            forward_only: false,
        }
    }

    #[test]
    fn kind_names_round_trip() {
        for k in ScheduleKind::ALL {
            assert_eq!(k.name().parse::<ScheduleKind>(), Ok(k));
        }
        assert!("zb-h3".parse::<ScheduleKind>().is_err());
    }

    #[test]
    fn megatron_group_rules() {
        let l = Limits::DEFAULT;
        let i = ScheduleKind::Interleaved1F1B;
        assert!(spec(i, 4, 2, 8, None).validate(&l).is_ok());
        // g < pp
        assert!(matches!(
            spec(i, 4, 2, 8, Some(3)).validate(&l),
            Err(SpecError::GroupSizeOutOfRange { .. })
        ));
        // g > M
        assert!(matches!(
            spec(i, 4, 2, 8, Some(9)).validate(&l),
            Err(SpecError::GroupSizeOutOfRange { .. })
        ));
        // M = 6, g = 4: 6 % 4 = 2 < 4
        assert!(matches!(
            spec(i, 4, 2, 6, None).validate(&l),
            Err(SpecError::PartialLastGroup { rem: 2, .. })
        ));
        // M = 9, g = 5, pp = 4: 9 % 5 = 4, not < pp
        assert!(spec(i, 4, 2, 9, Some(5)).validate(&l).is_ok());
        // pp > M is refused for interleaved (g >= pp > M)
        assert!(spec(i, 4, 2, 3, None).validate(&l).is_err());
    }

    #[test]
    fn size_limit_is_checked_without_overflow() {
        let s = spec(ScheduleKind::OneFOneB, u32::MAX, 1, u32::MAX, None);
        assert!(matches!(
            s.validate(&Limits::DEFAULT),
            Err(SpecError::TooLarge { .. })
        ));
    }

    #[test]
    fn single_chunk_kinds_refuse_vpp() {
        let s = spec(ScheduleKind::OneFOneB, 4, 2, 8, None);
        assert!(matches!(
            s.validate(&Limits::DEFAULT),
            Err(SpecError::SingleChunkOnly { .. })
        ));
    }
}
