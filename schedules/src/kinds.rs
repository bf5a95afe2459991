//! The kinds table: one row per [`ScheduleKind`], from which every per-kind fact is read.
//!
//! Each row of `kinds!` gives a kind's [`KindRow`] (its variant and name are the enum's, in
//! the leaf `kind.rs`): how many chunks per rank it takes, its placement, the P2P placement
//! lowering follows, its generator, its flags, the line `pipec schedules` prints, the rules it
//! checks beyond the common ones and what the tuner weighs of it. Code elsewhere asks the row
//! (`kind.row()`) and never matches on a kind, so adding a kind is a family file (the
//! generator and its rules, with its `mod` line in `lib.rs`), its variant and name in
//! `kind.rs`, one row here and one row in the README's schedule table; `docs/schedules.md`,
//! "Adding a kind", says how.
//!
//! The table sits above the families it names: they and the spec read the vocabulary from
//! `kind.rs`, never from here.

pub use crate::kind::{ChunkRule, Flags, MegatronLoop, ScheduleKind, SearchQuery, SearchSpace};

use crate::kind::N;
use crate::order::RankOrder;
use crate::placement::Placement;
use crate::schedule::CommPolicy;
use crate::spec::{ScheduleSpec, SpecError};

/// The table: `Variant { KindRow fields but kind and name }`, one row per variant of
/// [`ScheduleKind`] in its order, which is also the order `pipec schedules` lists them in and
/// the order the tuner weighs them in (a tie goes to the earlier row), so rows are appended.
/// Writes [`KINDS`]; a row missing, extra or out of the enum's order does not build.
macro_rules! kinds {
    ($( $variant:ident { $($field:tt)* } )*) => {
        /// The kinds table: row `i` describes `ScheduleKind::ALL[i]`.
        pub static KINDS: [KindRow; N] = [$(
            KindRow {
                kind: ScheduleKind::$variant,
                name: ScheduleKind::NAMES[ScheduleKind::$variant as usize],
                $($field)*
            }
        ),*];

        // The rows follow the enum's order.
        const _: () = {
            let mut i = 0;
            $(
                assert!(
                    ScheduleKind::$variant as usize == i,
                    "the kinds table's rows follow ScheduleKind's variants"
                );
                i += 1;
            )*
            assert!(i == N);
        };
    };
}

kinds! {
    Gpipe {
        chunks: ChunkRule::One,
        placement: looped,
        comm: lockstep,
        generate: crate::gpipe::orders,
        flags: Flags::NONE,
        megatron: None,
        summary: "all forwards, then all backwards",
        params: "pp, microbatches; vpp = 1",
        source: "GPipe (Huang et al., 2019); torch ScheduleGPipe",
        validate: no_rules,
        vpp_required: None,
        aliases: &[],
        tune: Tune::PLAIN,
    }
    // Megatron runs combined 1F1B only from its interleaved loop; `1f1b --combined`
    // takes that loop's P2P placement too (one batch after each step, a `fwd_bwd` one
    // step).
    OneFOneB {
        chunks: ChunkRule::One,
        placement: looped,
        comm: crate::megatron::one_f_one_b_comm,
        generate: crate::megatron::one_f_one_b,
        flags: Flags { combined: true, ..Flags::NONE },
        megatron: Some(MegatronLoop::NonInterleaved),
        summary: "warmup forwards, steady one-forward-one-backward, cooldown backwards",
        params: "pp, microbatches; vpp = 1; combined fuses steady pairs into fwd_bwd",
        source: "PipeDream-Flush; Megatron forward_backward_pipelining_without_interleaving",
        validate: crate::megatron::one_f_one_b_rules,
        vpp_required: None,
        aliases: &[],
        tune: Tune::PLAIN,
    }
    Interleaved1F1B {
        chunks: ChunkRule::Any,
        placement: looped,
        comm: crate::megatron::interleaved_comm,
        generate: crate::megatron::interleaved,
        flags: Flags { combined: true, group_size: true, ..Flags::NONE },
        megatron: Some(MegatronLoop::Interleaved),
        summary: "1F1B over vpp model chunks per rank, Megatron's exact order",
        params: "pp, vpp, microbatches, group size (default pp; pp <= g <= M); combined fuses steady pairs into fwd_bwd",
        source: "Narayanan et al., 2021; Megatron forward_backward_pipelining_with_interleaving",
        validate: crate::megatron::interleaved_rules,
        vpp_required: Some("one chunk per rank is Megatron's non-interleaved schedule, 1f1b"),
        aliases: &[],
        tune: Tune { groups: crate::megatron::interleaved_groups, ..Tune::PLAIN },
    }
    LoopedBfs {
        chunks: ChunkRule::Any,
        placement: looped,
        comm: lockstep,
        generate: crate::looped_bfs::orders,
        flags: Flags::NONE,
        megatron: None,
        summary: "each chunk runs all microbatches forward, then backward in reverse",
        params: "pp, vpp, microbatches",
        source: "Lamy-Poirier, Breadth-First Pipeline Parallelism (2022); torch ScheduleLoopedBFS",
        validate: no_rules,
        vpp_required: Some("give vpp = 1 explicitly for one chunk per rank"),
        aliases: &[],
        tune: Tune::PLAIN,
    }
    // Fused per op is deadlock-free for ZB-H1 and costs it no time (checked over a grid
    // by tests/integration/schedules.rs). It deadlocks for ZB-H2 (its doubled warmup
    // offset pairs a rank's activation send with a gradient its neighbour sends one
    // batch earlier), zb-v, v-half, v-min, dualpipe and dualpipe-v, and slows ZB-1P
    // down; those use the lockstep rounds, deadlock-free for any valid order.
    ZbH1 {
        chunks: ChunkRule::One,
        placement: looped,
        comm: fused_per_op,
        generate: crate::zero_bubble::zb_h1,
        flags: Flags { splits_backward: true, ..Flags::NONE },
        megatron: None,
        summary: "1F1B with split backward; the first W passes wait so B passes flow (1F1B memory, ~1/3 of its bubble)",
        params: "pp, microbatches; vpp = 1",
        source: "Qi et al., Zero Bubble Pipeline Parallelism (2024), ZB-H1; sail-sg zb-h1-quick-start",
        validate: no_rules,
        vpp_required: None,
        aliases: &[],
        tune: Tune::PLAIN,
    }
    ZbH2 {
        chunks: ChunkRule::One,
        placement: looped,
        comm: lockstep,
        generate: crate::zero_bubble::zb_h2,
        flags: Flags { splits_backward: true, ..Flags::NONE },
        megatron: None,
        summary: "split backward with 2(pp-1-r) warmup forwards: parallelogram, ~zero bubble at ~2x 1F1B memory",
        params: "pp, microbatches; vpp = 1",
        source: "Qi et al., Zero Bubble Pipeline Parallelism (2024), ZB-H2",
        validate: no_rules,
        vpp_required: None,
        aliases: &[],
        tune: Tune::PLAIN,
    }
    Zb1P {
        chunks: ChunkRule::One,
        placement: looped,
        comm: lockstep,
        generate: crate::zero_bubble::zb_1p,
        flags: Flags { splits_backward: true, ..Flags::NONE },
        megatron: None,
        summary: "one-pass zero bubble: 1F1B warmup, then F and bwd_D, with each rank's bwd_W passes delayed by its rank",
        params: "pp, microbatches; vpp = 1",
        source: "Qi et al. (2024) ZB-1P; PP-schedule-visualizer generate_zero_bubble_1p_schedule; torch ScheduleInterleavedZeroBubble (one chunk)",
        validate: no_rules,
        vpp_required: None,
        aliases: &[],
        tune: Tune::PLAIN,
    }
    ZbV {
        chunks: ChunkRule::TwoV,
        placement: v_shape,
        comm: lockstep,
        generate: crate::v_shape::zb_v,
        flags: Flags { splits_backward: true, ..Flags::NONE },
        megatron: None,
        summary: "zero bubble on a V placement, two chunks per rank, 1F1B memory",
        params: "pp, microbatches; vpp = 2 (fixed)",
        source: "Qi et al. (2024) ZB-V; torch ScheduleZBVZeroBubble",
        validate: no_rules,
        vpp_required: None,
        // torch's and torchtitan's name, which does not fold to pipec's.
        aliases: &["zbvzerobubble"],
        tune: Tune::PLAIN,
    }
    VHalf {
        chunks: ChunkRule::TwoV,
        placement: v_shape,
        comm: lockstep,
        generate: crate::v_shape::v_half,
        flags: Flags { splits_backward: true, ..Flags::NONE },
        megatron: None,
        summary: "V placement building block schedule at about half of 1F1B's activation memory",
        params: "pp, microbatches; vpp = 2 (fixed)",
        source: "Qi et al., Pipeline Parallelism with Controllable Memory (2024), V-Half; sail-sg zbv_greedy.py",
        validate: no_rules,
        vpp_required: None,
        aliases: &[],
        tune: Tune::PLAIN,
    }
    VMin {
        chunks: ChunkRule::TwoV,
        placement: v_shape,
        comm: lockstep,
        generate: crate::v_shape::v_min,
        flags: Flags { splits_backward: true, ..Flags::NONE },
        megatron: None,
        summary: "V placement building block schedule at about a third of 1F1B's activation memory",
        params: "pp, microbatches; vpp = 2 (fixed)",
        source: "Qi et al., Pipeline Parallelism with Controllable Memory (2024), V-Min; sail-sg zbv_greedy.py",
        validate: no_rules,
        vpp_required: None,
        aliases: &[],
        tune: Tune::PLAIN,
    }
    DualPipe {
        chunks: ChunkRule::One,
        placement: crate::dualpipe::placement,
        comm: lockstep,
        generate: crate::dualpipe::dualpipe,
        flags: Flags { splits_backward: true, same_peer_batches: true, ..Flags::NONE },
        megatron: None,
        summary: "bidirectional: half the microbatches enter at each end, overlapped F&B chunks; parameters 2x",
        params: "pp (even), microbatches (even, >= 2 pp); vpp = 1",
        source: "DeepSeek-V3 report (2024); deepseek-ai/DualPipe dualpipe.py",
        validate: crate::dualpipe::dualpipe_rules,
        vpp_required: None,
        aliases: &[],
        tune: Tune::PLAIN,
    }
    DualPipeV {
        chunks: ChunkRule::TwoV,
        placement: v_shape,
        comm: lockstep,
        generate: crate::dualpipe::dualpipe_v,
        flags: Flags { splits_backward: true, same_peer_batches: true, ..Flags::NONE },
        megatron: None,
        summary: "DualPipe folded onto a V placement (two chunks per rank), overlapped F&B chunks",
        params: "pp, microbatches (>= 2 pp); vpp = 2 (fixed)",
        source: "deepseek-ai/DualPipe dualpipev.py; torch ScheduleDualPipeV",
        validate: crate::dualpipe::dualpipe_v_rules,
        vpp_required: None,
        aliases: &[],
        tune: Tune::PLAIN,
    }
    // PipeOffload's runtime posts its own P2P; lockstep rounds are deadlock-free for
    // any valid order. The tuner lowers it as that runtime runs it (timed, in flight)
    // and always tries to fit it with the memory levers: the order their offload is
    // built for (each bwd_W right after its bwd_D) is often the one that fits.
    GroupInterleaved {
        chunks: ChunkRule::Any,
        placement: looped,
        comm: lockstep,
        generate: crate::group_interleaved::orders,
        flags: Flags { splits_backward: true, group_size: true, ..Flags::NONE },
        megatron: None,
        summary: "interleaved 1F1B over groups of g microbatches with split backward, each bwd_W right after its bwd_D: the schedule PipeOffload offloads",
        params: "pp, vpp, microbatches, group size (default pp; 1 <= g <= pp)",
        source: "Wan et al., PipeOffload (ICML 2025); sail-sg group_interleaved_1f1b.py GroupBuildingBlockScheduler",
        validate: crate::group_interleaved::rules,
        vpp_required: Some("give vpp = 1 explicitly for one chunk per rank"),
        aliases: &[],
        tune: Tune {
            groups: crate::group_interleaved::tune_groups,
            timed: true,
            levers_always: true,
        },
    }
}

/// The tuner's hooks: what it weighs of a kind and how.
#[derive(Copy, Clone)]
pub struct Tune {
    /// The group sizes to weigh (`None` in the list: the default), or `None` to skip the
    /// kind for this request. The chunk counts follow from the kind's [`ChunkRule`].
    pub groups: fn(&SearchQuery) -> Option<Vec<Option<u32>>>,
    /// The tuner lowers the kind timed under the real costs with every message in flight
    /// (as the kind's own runtime runs it), falling back to its comm policy where that
    /// program does not verify.
    pub timed: bool,
    /// The memory levers are tried on the kind whenever it does not fit, not only when it
    /// is among the fastest that do not.
    pub levers_always: bool,
}

impl Tune {
    /// The kind's default group size only, lowered with its comm policy.
    pub const PLAIN: Tune = Tune {
        groups: default_group,
        timed: false,
        levers_always: false,
    };
}

/// One row of the kinds table.
#[derive(Copy, Clone)]
pub struct KindRow {
    pub kind: ScheduleKind,
    /// The name on the command line and in files.
    pub name: &'static str,
    /// Chunks per rank the kind accepts.
    pub chunks: ChunkRule,
    /// Which rank holds each stage (the spec is valid).
    pub placement: fn(&ScheduleSpec) -> Placement,
    /// How lowering places the sends and receives.
    pub comm: fn(&ScheduleSpec) -> CommPolicy,
    /// Each rank's compute order (the spec is valid; generation cannot fail).
    pub generate: fn(&ScheduleSpec) -> Vec<RankOrder>,
    pub flags: Flags,
    /// The Megatron-LM schedule function that runs the kind as it is, if one does: then
    /// `--megatron-p2p` applies (a mode other than the default is refused otherwise),
    /// partial recompute can be asked for, and `tune --target megatron` names the function.
    pub megatron: Option<MegatronLoop>,
    /// `pipec schedules`: what the kind is, its parameters, where it comes from.
    pub summary: &'static str,
    pub params: &'static str,
    pub source: &'static str,
    /// The kind's own rules, checked after the common ones (sizes, chunks, `--combined`,
    /// `--megatron-p2p` for kinds without it) and before `--group-size` is refused for kinds
    /// without it.
    pub validate: fn(&ScheduleSpec) -> Result<(), SpecError>,
    /// When compiling without `--vpp` or a layout: `Some(hint)` refuses (the number of chunks
    /// must be given, the hint says why), `None` takes [`ScheduleKind::default_vpp`].
    pub vpp_required: Option<&'static str>,
    /// Other names users type for the kind (folded: lowercase, alphanumeric, no `schedule`
    /// prefix) that do not fold to its own; suggested for an unknown kind.
    pub aliases: &'static [&'static str],
    pub tune: Tune,
}

impl KindRow {
    /// The variants the tuner weighs, or `None` to skip the kind.
    pub fn search_space(&self, q: &SearchQuery) -> Option<SearchSpace> {
        let groups = (self.tune.groups)(q)?;
        let vpps = match self.chunks {
            ChunkRule::One => vec![1],
            ChunkRule::TwoV => vec![2],
            ChunkRule::Any if q.big => vec![2],
            ChunkRule::Any => vec![2, 3, 4],
        };
        Some(SearchSpace { vpps, groups })
    }
}

impl ScheduleKind {
    /// The kind's row of the kinds table.
    pub fn row(self) -> &'static KindRow {
        &KINDS[self as usize]
    }
}

// Shared row entries.

fn looped(spec: &ScheduleSpec) -> Placement {
    Placement::looped(spec.pp, spec.vpp)
}

fn v_shape(spec: &ScheduleSpec) -> Placement {
    Placement::v_shape(spec.pp)
}

fn lockstep(_: &ScheduleSpec) -> CommPolicy {
    CommPolicy::Lockstep
}

fn fused_per_op(_: &ScheduleSpec) -> CommPolicy {
    CommPolicy::FusedPerOp
}

fn no_rules(_: &ScheduleSpec) -> Result<(), SpecError> {
    Ok(())
}

fn default_group(_: &SearchQuery) -> Option<Vec<Option<u32>>> {
    Some(vec![None])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_follow_the_enum() {
        for (i, k) in ScheduleKind::ALL.into_iter().enumerate() {
            assert_eq!(KINDS[i].kind, k);
            assert_eq!(k.row().kind, k);
            // The serde name is the row's name.
            assert_eq!(
                serde_json::to_string(&k).unwrap(),
                format!("\"{}\"", KINDS[i].name)
            );
        }
    }

    #[test]
    fn names_and_aliases_are_distinct() {
        let mut seen = std::collections::BTreeSet::new();
        for r in &KINDS {
            assert!(seen.insert(r.name), "{} twice", r.name);
            for a in r.aliases {
                assert!(seen.insert(a), "{a} twice");
            }
        }
    }

    /// The tuner's hooks weigh what `tune` weighed before the table: every vpp up to 4 and
    /// the whole batch as one interleaved group on small instances, group-interleaved skipped
    /// on large ones without a limit and weighed at every group size (8 spread for deep
    /// pipelines) under one.
    #[test]
    fn search_spaces() {
        let q = |pp, m, limit| SearchQuery {
            pp,
            microbatches: m,
            big: pp as u64 * m as u64 > 16_384,
            memory_limit: limit,
        };
        let space = |k: ScheduleKind, q: SearchQuery| k.row().search_space(&q);
        let sp = |vpps: &[u32], groups: &[Option<u32>]| {
            Some(SearchSpace {
                vpps: vpps.to_vec(),
                groups: groups.to_vec(),
            })
        };
        use ScheduleKind::*;
        assert_eq!(
            space(Interleaved1F1B, q(4, 8, false)),
            sp(&[2, 3, 4], &[None, Some(8)])
        );
        assert_eq!(
            space(Interleaved1F1B, q(8, 8, false)),
            sp(&[2, 3, 4], &[None])
        );
        assert_eq!(
            space(Interleaved1F1B, q(64, 1024, false)),
            sp(&[2], &[None])
        );
        assert_eq!(space(ZbV, q(4, 8, true)), sp(&[2], &[None]));
        assert_eq!(space(OneFOneB, q(4, 8, true)), sp(&[1], &[None]));
        assert_eq!(
            space(GroupInterleaved, q(4, 8, false)),
            sp(&[2, 3, 4], &[None])
        );
        assert_eq!(space(GroupInterleaved, q(64, 1024, false)), None);
        assert_eq!(
            space(GroupInterleaved, q(64, 1024, true)),
            sp(&[2], &[None])
        );
        assert_eq!(
            space(GroupInterleaved, q(4, 8, true)),
            sp(&[2, 3, 4], &[None, Some(1), Some(2), Some(3)])
        );
        let deep = space(GroupInterleaved, q(16, 32, true)).unwrap().groups;
        assert_eq!(
            deep,
            [
                None,
                Some(1),
                Some(3),
                Some(5),
                Some(7),
                Some(9),
                Some(11),
                Some(13)
            ]
        );
        // Only group-interleaved is lowered timed and always given the levers.
        for r in &KINDS {
            let gi = r.kind == GroupInterleaved;
            assert_eq!((r.tune.timed, r.tune.levers_always), (gi, gi), "{}", r.name);
        }
    }

    #[test]
    fn multi_chunk_kinds_say_whether_vpp_is_required() {
        for r in &KINDS {
            if r.vpp_required.is_some() {
                assert_eq!(r.chunks, ChunkRule::Any, "{}", r.name);
            }
        }
    }
}
