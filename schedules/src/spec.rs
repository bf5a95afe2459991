//! What the user asks for: a schedule kind and its parameters, validated before any allocation.

use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;
use thiserror::Error;

use crate::kind::{ChunkRule, MegatronLoop, ScheduleKind};

/// One row of `pipec schedules`.
pub struct KindInfo {
    pub kind: ScheduleKind,
    pub summary: &'static str,
    pub params: &'static str,
    pub source: &'static str,
}

impl ScheduleKind {
    pub fn name(self) -> &'static str {
        self.row().name
    }

    /// The names of all kinds, comma separated (for messages).
    pub fn known_names() -> String {
        ScheduleKind::ALL.map(ScheduleKind::name).join(", ")
    }

    pub fn info(self) -> KindInfo {
        let r = self.row();
        KindInfo {
            kind: self,
            summary: r.summary,
            params: r.params,
            source: r.source,
        }
    }

    /// Whether the kind takes more than one chunk per rank.
    pub fn multi_chunk(self) -> bool {
        self.chunk_rule() != ChunkRule::One
    }

    /// Chunks per rank the kind accepts.
    pub fn chunk_rule(self) -> ChunkRule {
        self.row().chunks
    }

    /// The vpp used when the user gives neither `--vpp` nor a layout.
    pub fn default_vpp(self) -> u32 {
        match self.chunk_rule() {
            ChunkRule::TwoV => 2,
            _ => 1,
        }
    }

    /// Whether `--combined` (Megatron's combined 1F1B) applies.
    pub fn supports_combined(self) -> bool {
        self.row().flags.combined
    }

    /// Whether the kind splits backward into `bwd_D` and `bwd_W` somewhere.
    pub fn splits_backward(self) -> bool {
        self.row().flags.splits_backward
    }

    /// Whether `--group-size` applies.
    pub fn takes_group_size(self) -> bool {
        self.row().flags.group_size
    }
}

impl fmt::Display for ScheduleKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// An unknown kind name, with the list of known ones and, where the name is one torch,
/// torchtitan or Megatron users type for a kind pipec has, that kind as a suggestion.
#[derive(Debug, Error, PartialEq, Eq)]
#[error("unknown schedule kind `{0}`{hint} (known: {known})", hint = self.hint(), known = ScheduleKind::known_names())]
pub struct UnknownKind(pub String);

impl UnknownKind {
    /// The kind the user most likely meant: a pipec name typed in another case or without
    /// hyphens, or the name torch and torchtitan give its exact counterpart.
    pub fn suggestion(&self) -> Option<ScheduleKind> {
        let folded: String = self
            .0
            .chars()
            .filter(|c| c.is_ascii_alphanumeric())
            .map(|c| c.to_ascii_lowercase())
            .collect();
        let folded = folded.strip_prefix("schedule").unwrap_or(&folded);
        ScheduleKind::ALL
            .into_iter()
            .find(|k| k.name().replace('-', "") == folded)
            .or_else(|| {
                ScheduleKind::ALL
                    .into_iter()
                    .find(|k| k.row().aliases.contains(&folded))
            })
    }

    fn hint(&self) -> String {
        self.suggestion()
            .map(|k| format!("; did you mean `{k}`?"))
            .unwrap_or_default()
    }
}

impl FromStr for ScheduleKind {
    type Err = UnknownKind;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        ScheduleKind::ALL
            .into_iter()
            .find(|k| k.name() == s)
            .ok_or_else(|| UnknownKind(s.to_string()))
    }
}

/// Most pipeline ranks a schedule may have: 16 times the deepest pipelines trained today
/// (pp = 256), and far below what would fill a disk with one file per rank.
pub const MAX_PP: u32 = 4096;

/// Most stages (pp x vpp) a schedule may have: as many as a layout string of
/// [`MAX_PP`] ranks with 16 chunks each.
pub const MAX_STAGES: u32 = 1 << 16;

/// Bounds checked before anything proportional to the parameters is allocated.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Limits {
    /// Largest number of compute ops (passes over all stages and microbatches) accepted.
    pub max_compute_ops: u64,
}

/// The highest `max_compute_ops` a request may raise the limit to: 16 times the default
/// (268M compute ops; a program that size takes tens of GB of memory before it is written).
pub const MAX_COMPUTE_OPS: u64 = 1 << 28;

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
    /// Megatron's combined 1F1B (`overlap_moe_expert_parallel_comm`): one more warmup
    /// microbatch, and each steady forward/backward pair becomes one overlapped `fwd_bwd` op.
    /// Absent in files written before it existed, and omitted when false.
    #[serde(default, skip_serializing_if = "is_false")]
    pub combined: bool,
    /// How Megatron posts its P2P calls (1f1b and interleaved-1f1b only). Omitted when it is
    /// megatron-core's default, [`MegatronP2p::Batched`], so older files read unchanged.
    #[serde(default, skip_serializing_if = "MegatronP2p::is_default")]
    pub megatron_p2p: MegatronP2p,
}

fn is_false(b: &bool) -> bool {
    !*b
}

/// Megatron's P2P placement, set by `ModelParallelConfig.batch_p2p_comm`,
/// `overlap_p2p_comm` and `overlap_p2p_comm_warmup_flush`
/// (`megatron/core/pipeline_parallel/p2p_communication.py`, `schedules.py`).
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MegatronP2p {
    /// `batch_p2p_comm=True`: each P2P call is one `batch_isend_irecv` of its sends and
    /// receives, waited at once (megatron-core's default; the only mode of the
    /// non-interleaved schedule in Megatron-LM's training script).
    #[default]
    Batched,
    /// `batch_p2p_comm=False`, `overlap_p2p_comm=False`: each call posts its `isend`/`irecv`
    /// one by one in `_p2p_ops`' even/odd order and waits for all of them at once.
    Unbatched,
    /// `overlap_p2p_comm=True` with `deallocate_pipeline_outputs=True` (interleaved only;
    /// Megatron-LM's training default there): every `isend`/`irecv` is posted on its own and
    /// waited just before its tensor is used; each forward's send is waited at once, before
    /// its output is freed.
    Overlap,
    /// [`MegatronP2p::Overlap`] plus `overlap_p2p_comm_warmup_flush`: receives for the next
    /// warmup and cooldown step are prefetched before the current compute.
    OverlapFlush,
    /// [`MegatronP2p::Overlap`] with `deallocate_pipeline_outputs=False` (megatron-core's config
    /// default): a forward's send is waited only when the next one is posted.
    OverlapKeepOutputs,
    /// [`MegatronP2p::OverlapFlush`] with `deallocate_pipeline_outputs=False`.
    OverlapFlushKeepOutputs,
}

impl MegatronP2p {
    pub const ALL: [MegatronP2p; 6] = [
        MegatronP2p::Batched,
        MegatronP2p::Unbatched,
        MegatronP2p::Overlap,
        MegatronP2p::OverlapFlush,
        MegatronP2p::OverlapKeepOutputs,
        MegatronP2p::OverlapFlushKeepOutputs,
    ];

    pub fn is_default(&self) -> bool {
        *self == MegatronP2p::Batched
    }

    /// The mode pipec uses when none is asked for: megatron-core's default (`batched`), except
    /// interleaving at pp = 2, which Megatron runs only with `overlap_p2p_comm`.
    pub fn default_for(kind: ScheduleKind, pp: u32) -> MegatronP2p {
        if kind.row().megatron == Some(MegatronLoop::Interleaved) && pp == 2 {
            MegatronP2p::Overlap
        } else {
            MegatronP2p::Batched
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            MegatronP2p::Batched => "batched",
            MegatronP2p::Unbatched => "unbatched",
            MegatronP2p::Overlap => "overlap",
            MegatronP2p::OverlapFlush => "overlap-flush",
            MegatronP2p::OverlapKeepOutputs => "overlap-keep-outputs",
            MegatronP2p::OverlapFlushKeepOutputs => "overlap-flush-keep-outputs",
        }
    }

    /// Whether Megatron's `overlap_p2p_comm` is on.
    pub fn overlaps(self) -> bool {
        !matches!(self, MegatronP2p::Batched | MegatronP2p::Unbatched)
    }

    /// Whether `overlap_p2p_comm_warmup_flush` is on.
    pub fn flushes(self) -> bool {
        matches!(
            self,
            MegatronP2p::OverlapFlush | MegatronP2p::OverlapFlushKeepOutputs
        )
    }

    /// Whether `deallocate_pipeline_outputs` is on where it changes the calls (overlap modes).
    pub fn deallocates_outputs(self) -> bool {
        matches!(self, MegatronP2p::Overlap | MegatronP2p::OverlapFlush)
    }

    /// The Megatron config flags of this mode, in words.
    pub fn config(self) -> &'static str {
        match self {
            MegatronP2p::Batched => "batch_p2p_comm",
            MegatronP2p::Unbatched => "batch_p2p_comm=False",
            MegatronP2p::Overlap => "overlap_p2p_comm, deallocate_pipeline_outputs",
            MegatronP2p::OverlapFlush => {
                "overlap_p2p_comm, overlap_p2p_comm_warmup_flush, deallocate_pipeline_outputs"
            }
            MegatronP2p::OverlapKeepOutputs => "overlap_p2p_comm",
            MegatronP2p::OverlapFlushKeepOutputs => {
                "overlap_p2p_comm, overlap_p2p_comm_warmup_flush"
            }
        }
    }
}

impl fmt::Display for MegatronP2p {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for MegatronP2p {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        MegatronP2p::ALL
            .into_iter()
            .find(|m| m.name() == s)
            .ok_or_else(|| {
                let names: Vec<&str> = MegatronP2p::ALL.iter().map(|m| m.name()).collect();
                format!(
                    "unknown Megatron P2P mode `{s}` (expected one of {})",
                    names.join(", ")
                )
            })
    }
}

/// Why a spec is refused. Each names the parameters involved and the rule, as the user wrote them.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum SpecError {
    #[error("pp must be at least 1")]
    ZeroPp,
    #[error("vpp must be at least 1")]
    ZeroVpp,
    /// A kind that takes any number of chunks, asked for without vpp or a layout: silently
    /// running one chunk gives a different schedule than the name promises.
    #[error("{kind} needs the number of model chunks per rank (vpp) or a layout whose stage count gives it; {hint}")]
    ChunksNotGiven {
        kind: ScheduleKind,
        hint: &'static str,
    },
    #[error("microbatches must be at least 1")]
    ZeroMicrobatches,
    #[error("{kind} runs one model chunk per rank, but vpp = {vpp}; use interleaved-1f1b or looped-bfs for several chunks")]
    SingleChunkOnly { kind: ScheduleKind, vpp: u32 },
    #[error("{kind} with vpp = {vpp} needs pp >= 2: at pp = 1 Megatron runs forward_backward_no_pipelining, which has no model chunks to interleave")]
    ChunksNeedPipeline { kind: ScheduleKind, vpp: u32 },
    #[error("a group size applies to interleaved-1f1b and group-interleaved only, not {kind}")]
    GroupSizeNotApplicable { kind: ScheduleKind },
    #[error("group size {g} is out of range: Megatron requires pp <= group size <= microbatches, here {pp} <= {g} <= {m} does not hold")]
    GroupSizeOutOfRange { g: u32, pp: u32, m: u32 },
    #[error("group size {g} is out of range for group-interleaved: PipeOffload's building block takes 1 <= group size <= pp, here pp = {pp}")]
    GroupOutOfRange { g: u32, pp: u32 },
    #[error("microbatches = {m} leaves a last group of {rem} microbatches (group size {g}), fewer than pp = {pp}; Megatron rejects 0 < M % group size < pp because that last group cannot fill the ring")]
    PartialLastGroup { m: u32, g: u32, pp: u32, rem: u32 },
    #[error("pp = {pp} is over the limit of {MAX_PP} ranks: a schedule writes one file per rank, and no pipeline runs that deep")]
    TooManyRanks { pp: u32 },
    #[error("pp x vpp = {pp} x {vpp} stages is over the limit of {MAX_STAGES} stages")]
    TooManyStages { pp: u32, vpp: u32 },
    #[error("the schedule would have {ops} compute ops, over the limit of {limit}")]
    TooLarge { ops: u64, limit: u64 },
    #[error("{kind} runs exactly 2 model chunks per rank on a V placement (stage s and 2pp-1-s on rank s), but vpp = {vpp}; leave vpp unset or set it to 2 (a layout must have 2 x pp stages)")]
    VShapeNeedsTwoChunks { kind: ScheduleKind, vpp: u32 },
    #[error("{kind} needs an even pp (its microbatches enter from both ends and the ranks pair up around the middle), got {pp}")]
    OddPp { kind: ScheduleKind, pp: u32 },
    #[error("{kind} needs an even number of microbatches (half go each direction), got {m}")]
    OddMicrobatches { kind: ScheduleKind, m: u32 },
    #[error("{kind} needs at least 2 x pp = {min} microbatches, got {m} ({source_rule})")]
    TooFewMicrobatches {
        kind: ScheduleKind,
        m: u32,
        min: u32,
        source_rule: &'static str,
    },
    #[error("combined 1F1B (Megatron's) applies to 1f1b and interleaved-1f1b only, not {kind}")]
    CombinedNotApplicable { kind: ScheduleKind },
    #[error(
        "the Megatron P2P mode `{mode}` applies to 1f1b and interleaved-1f1b only, not {kind}"
    )]
    P2pNotApplicable {
        kind: ScheduleKind,
        mode: MegatronP2p,
    },
    #[error("Megatron's non-interleaved 1F1B refuses the P2P mode `{mode}`: \"Non-interleaved pipeline parallelism does not support overlapping p2p communication\" (forward_backward_pipelining_without_interleaving)")]
    OverlapNeedsInterleaving { mode: MegatronP2p },
    #[error("interleaved-1f1b at pp = 2 cannot use the P2P mode `{mode}`: Megatron-LM refuses it (\"pipeline-model-parallel size should be greater than 2 to avoid having multiple p2p sends and recvs between same 2 ranks per communication batch\"): both neighbours are one rank, and a batched call sends a gradient then an activation to it while the peer receives an activation then a gradient, so FIFO matching swaps them (silently, as they have one shape); use overlap (Megatron-LM's default there), overlap-flush or unbatched")]
    InterleavedPp2NeedsOverlap { mode: MegatronP2p },
}

impl ScheduleSpec {
    /// The one-line name of this exact schedule: kind, sizes, and every parameter that makes
    /// it differ from the kind's default (`group=G`, `combined`, `p2p=MODE`, `forward-only`),
    /// so that variants compared side by side never print under one name.
    pub fn label(&self) -> String {
        let mut s = format!(
            "{} pp={} vpp={} microbatches={}",
            self.kind, self.pp, self.vpp, self.microbatches
        );
        if let Some(g) = self.group_size {
            s.push_str(&format!(" group={g}"));
        }
        if self.combined {
            s.push_str(" combined");
        }
        if self.megatron_p2p != MegatronP2p::default_for(self.kind, self.pp) {
            s.push_str(&format!(" p2p={}", self.megatron_p2p));
        }
        if self.forward_only {
            s.push_str(" forward-only");
        }
        s
    }

    /// A training schedule with Megatron's default group size and no combined pairs; set the
    /// other fields with struct update syntax (`ScheduleSpec { forward_only: true, ..new }`).
    pub fn new(kind: ScheduleKind, pp: u32, vpp: u32, microbatches: u32) -> Self {
        ScheduleSpec {
            kind,
            pp,
            vpp,
            microbatches,
            group_size: None,
            forward_only: false,
            combined: false,
            megatron_p2p: MegatronP2p::default_for(kind, pp),
        }
    }

    /// Number of stages, `pp * vpp`.
    pub fn num_stages(&self) -> u32 {
        self.pp * self.vpp
    }

    /// The group size in effect (interleaved-1f1b, group-interleaved).
    pub fn effective_group_size(&self) -> u32 {
        self.group_size.unwrap_or(self.pp)
    }

    /// Compute ops the schedule will hold at most, computed without overflow (split backward
    /// counts three passes).
    pub fn compute_ops(&self) -> u64 {
        let passes = if self.forward_only {
            1
        } else if self.kind.splits_backward() {
            3
        } else {
            2
        };
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
        if self.pp > MAX_PP {
            return Err(SpecError::TooManyRanks { pp: self.pp });
        }
        let stages = u64::from(self.pp) * u64::from(self.vpp);
        if stages > u64::from(MAX_STAGES) {
            return Err(SpecError::TooManyStages {
                pp: self.pp,
                vpp: self.vpp,
            });
        }
        let ops = self.compute_ops();
        if ops > limits.max_compute_ops || (self.pp as u64) * (self.vpp as u64) > u32::MAX as u64 {
            return Err(SpecError::TooLarge {
                ops,
                limit: limits.max_compute_ops,
            });
        }
        match self.kind.chunk_rule() {
            ChunkRule::One if self.vpp != 1 => {
                return Err(SpecError::SingleChunkOnly {
                    kind: self.kind,
                    vpp: self.vpp,
                })
            }
            ChunkRule::TwoV if self.vpp != 2 => {
                return Err(SpecError::VShapeNeedsTwoChunks {
                    kind: self.kind,
                    vpp: self.vpp,
                })
            }
            _ => {}
        }
        if self.combined && !self.kind.supports_combined() {
            return Err(SpecError::CombinedNotApplicable { kind: self.kind });
        }
        let mode = self.megatron_p2p;
        if self.kind.row().megatron.is_none() && !mode.is_default() {
            return Err(SpecError::P2pNotApplicable {
                kind: self.kind,
                mode,
            });
        }
        (self.kind.row().validate)(self)?;
        if !self.kind.takes_group_size() && self.group_size.is_some() {
            return Err(SpecError::GroupSizeNotApplicable { kind: self.kind });
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
            combined: false,
            megatron_p2p: Default::default(),
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
        let s = spec(ScheduleKind::OneFOneB, MAX_PP, 1, u32::MAX, None);
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

    #[test]
    fn new_kind_rules() {
        let l = Limits::DEFAULT;
        use ScheduleKind::*;
        for k in [ZbV, VHalf, VMin, DualPipeV] {
            assert_eq!(k.default_vpp(), 2);
            assert!(spec(k, 4, 2, 8, None).validate(&l).is_ok());
            for vpp in [1, 3] {
                let e = spec(k, 4, vpp, 8, None).validate(&l).unwrap_err();
                assert_eq!(e, SpecError::VShapeNeedsTwoChunks { kind: k, vpp });
                assert!(e.to_string().contains("exactly 2 model chunks"), "{e}");
            }
        }
        for k in [ZbH1, ZbH2, Zb1P, DualPipe] {
            assert!(matches!(
                spec(k, 4, 2, 8, None).validate(&l),
                Err(SpecError::SingleChunkOnly { .. })
            ));
        }
        assert!(spec(DualPipe, 4, 1, 8, None).validate(&l).is_ok());
        assert_eq!(
            spec(DualPipe, 3, 1, 8, None).validate(&l),
            Err(SpecError::OddPp {
                kind: DualPipe,
                pp: 3
            })
        );
        assert_eq!(
            spec(DualPipe, 4, 1, 9, None).validate(&l),
            Err(SpecError::OddMicrobatches {
                kind: DualPipe,
                m: 9
            })
        );
        assert!(matches!(
            spec(DualPipe, 4, 1, 6, None).validate(&l),
            Err(SpecError::TooFewMicrobatches { min: 8, .. })
        ));
        // DualPipeV: M >= 2 pp, odd M allowed.
        assert!(spec(DualPipeV, 3, 2, 7, None).validate(&l).is_ok());
        assert!(matches!(
            spec(DualPipeV, 4, 2, 7, None).validate(&l),
            Err(SpecError::TooFewMicrobatches { min: 8, .. })
        ));
        // The zero-bubble kinds take any M >= 1.
        for k in [ZbH1, ZbH2, Zb1P, ZbV, VHalf, VMin] {
            assert!(spec(k, 8, k.default_vpp(), 1, None).validate(&l).is_ok());
        }
    }

    #[test]
    fn combined_applies_to_megatron_kinds_only() {
        let l = Limits::DEFAULT;
        let with = |k: ScheduleKind, vpp| ScheduleSpec {
            combined: true,
            ..spec(k, 4, vpp, 8, None)
        };
        assert!(with(ScheduleKind::OneFOneB, 1).validate(&l).is_ok());
        assert!(with(ScheduleKind::Interleaved1F1B, 2).validate(&l).is_ok());
        let e = with(ScheduleKind::ZbH1, 1).validate(&l).unwrap_err();
        assert_eq!(
            e,
            SpecError::CombinedNotApplicable {
                kind: ScheduleKind::ZbH1
            }
        );
        // Written only when set, read back as false when absent.
        let plain = serde_json::to_string(&spec(ScheduleKind::OneFOneB, 4, 1, 8, None)).unwrap();
        assert!(!plain.contains("combined"));
        let back: ScheduleSpec = serde_json::from_str(&plain).unwrap();
        assert!(!back.combined);
        let json = serde_json::to_string(&with(ScheduleKind::OneFOneB, 1)).unwrap();
        let back: ScheduleSpec = serde_json::from_str(&json).unwrap();
        assert!(back.combined);
    }

    #[test]
    fn unknown_kind_lists_every_name() {
        let e = "zb-h3".parse::<ScheduleKind>().unwrap_err().to_string();
        for k in ScheduleKind::ALL {
            assert!(e.contains(k.name()), "{e}");
        }
    }
}

#[cfg(test)]
mod kind_suggestion_tests {
    use super::*;

    /// Regression (#29): `--schedule 1F1B`, `Interleaved1F1B`, `ZBVZeroBubble`, `DualPipeV`,
    /// the names torch and torchtitan users type, were unknown kinds with no suggestion.
    #[test]
    fn torch_names_suggest_the_pipec_kind() {
        let cases = [
            ("1F1B", ScheduleKind::OneFOneB),
            ("Schedule1F1B", ScheduleKind::OneFOneB),
            ("Interleaved1F1B", ScheduleKind::Interleaved1F1B),
            ("ScheduleLoopedBFS", ScheduleKind::LoopedBfs),
            ("GPipe", ScheduleKind::Gpipe),
            ("ZBVZeroBubble", ScheduleKind::ZbV),
            ("ScheduleZBVZeroBubble", ScheduleKind::ZbV),
            ("DualPipeV", ScheduleKind::DualPipeV),
            ("ZB_H1", ScheduleKind::ZbH1),
        ];
        for (typed, want) in cases {
            let e = typed.parse::<ScheduleKind>().unwrap_err();
            assert_eq!(e.suggestion(), Some(want), "{typed}");
            assert!(
                e.to_string()
                    .contains(&format!("did you mean `{}`?", want.name())),
                "{e}"
            );
        }
        // No counterpart: no guess.
        let e = "InterleavedZeroBubble".parse::<ScheduleKind>().unwrap_err();
        assert_eq!(e.suggestion(), None);
        assert!(!e.to_string().contains("did you mean"), "{e}");
    }
}

#[cfg(test)]
mod bound_tests {
    use super::*;

    /// Regression (#29): `compile --pp 100000` and `--vpp 100000` wrote 415 MB and 1.3 GB
    /// with only a size warning.
    #[test]
    fn compile_pp_and_vpp_are_bounded() {
        let l = Limits::DEFAULT;
        let deep = ScheduleSpec::new(ScheduleKind::OneFOneB, 100_000, 1, 1);
        assert_eq!(
            deep.validate(&l),
            Err(SpecError::TooManyRanks { pp: 100_000 })
        );
        let wide = ScheduleSpec::new(ScheduleKind::Interleaved1F1B, 2, 100_000, 2);
        assert_eq!(
            wide.validate(&l),
            Err(SpecError::TooManyStages {
                pp: 2,
                vpp: 100_000
            })
        );
        // The bounds themselves are accepted (the op count is the next limit).
        let edge = ScheduleSpec::new(ScheduleKind::Gpipe, MAX_PP, 1, 1);
        assert_eq!(edge.validate(&l), Ok(()));
        let edge = ScheduleSpec::new(ScheduleKind::LoopedBfs, 2, MAX_STAGES / 2, 1);
        assert_eq!(edge.validate(&l), Ok(()));
    }
}
