//! Megatron-LM's pipeline schedules, reproduced order for order.
//!
//! Sources (Megatron-LM `megatron/core/pipeline_parallel/schedules.py`):
//! `get_pp_rank_microbatches` (warmup counts), `get_schedule_table` (the tunable lookup table of
//! (microbatch, chunk) per virtual microbatch) and `convert_schedule_table_to_order` (the
//! interleaving of forwards and backwards). Combined 1F1B (`combined_1f1b.py`, enabled by
//! `overlap_moe_expert_parallel_comm`) adds one warmup microbatch and runs each steady
//! forward/backward pair as one overlapped step
//! (`combined_1f1b_schedule_for_interleaved_pipelining`), which pipec writes as one
//! [`Compute::FwdBwd`].

use crate::ids::Rank;
use crate::kind::SearchQuery;
use crate::op::{Compute, Task};
use crate::order::RankOrder;
use crate::schedule::CommPolicy;
use crate::spec::{MegatronP2p, ScheduleSpec, SpecError};

/// Megatron's per-rank microbatch counts (`get_pp_rank_microbatches`).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct RankMicrobatches {
    pub total: u32,
    pub warmup: u32,
    pub remaining: u32,
    pub all_in_warmup: bool,
}

/// `get_pp_rank_microbatches` for rank `r`. `vpp = None` is the non-interleaved schedule.
pub fn rank_microbatches(
    pp: u32,
    r: u32,
    vpp: Option<u32>,
    m: u32,
    group: u32,
    forward_only: bool,
    combined: bool,
) -> RankMicrobatches {
    let chunks = vpp.unwrap_or(1);
    let total = m * chunks;
    let mut warmup = if forward_only {
        total
    } else if pp > 1 {
        match vpp {
            None => pp - r - 1,
            Some(v) => (pp - r - 1) * 2 + (v - 1) * group,
        }
    } else {
        1
    };
    if combined && !forward_only {
        warmup += 1;
    }
    let all_in_warmup = warmup >= total;
    if all_in_warmup {
        warmup = total;
    }
    RankMicrobatches {
        total,
        warmup,
        remaining: total - warmup,
        all_in_warmup,
    }
}

/// `get_schedule_table`: (microbatch, chunk) for each virtual microbatch id. Groups of `group`
/// microbatches run through every chunk before the next group starts; the last group takes
/// whatever microbatches remain.
pub fn schedule_table(m: u32, chunks: u32, group: u32) -> Vec<(u32, u32)> {
    let mut table = Vec::with_capacity((m * chunks) as usize);
    let mut lo = 0;
    while lo < m {
        let hi = if lo + group >= m { m } else { lo + group };
        for c in 0..chunks {
            table.extend((lo..hi).map(|mb| (mb, c)));
        }
        lo = hi;
    }
    table
}

/// `convert_schedule_table_to_order`, returned as compute ops of rank `r`: the first `warmup`
/// forwards, then forward/backward alternating, then the remaining backwards. The backward of
/// table entry `i` runs chunk `chunks - 1 - c_i` on microbatch `mb_i`. With `combined`, each
/// steady (forward, backward) pair is one `FwdBwd` op, as combined 1F1B runs it.
fn table_order(
    pp: u32,
    r: u32,
    chunks: u32,
    table: &[(u32, u32)],
    warmup: u32,
    forward_only: bool,
    combined: bool,
) -> Vec<Compute> {
    let stage = |c: u32| c * pp + r;
    let fwd = |i: usize| {
        let (mb, c) = table[i];
        Compute::Fwd(Task::new(stage(c), mb))
    };
    let bwd = |i: usize| {
        let (mb, c) = table[i];
        Compute::Bwd(Task::new(stage(chunks - 1 - c), mb))
    };
    let n = table.len();
    if forward_only {
        return (0..n).map(fwd).collect();
    }
    let w = warmup as usize;
    let mut ops = Vec::with_capacity(2 * n);
    ops.extend((0..w).map(fwd));
    for i in w..n {
        match (combined, fwd(i), bwd(i - w)) {
            (true, Compute::Fwd(f), Compute::Bwd(b)) => {
                ops.push(Compute::FwdBwd { fwd: f, bwd: b })
            }
            (_, f, b) => {
                ops.push(f);
                ops.push(b);
            }
        }
    }
    ops.extend((n - w..n).map(bwd));
    ops
}

/// Warmup actually used on a rank. At pp = 1 Megatron's `get_forward_backward_func` picks
/// `forward_backward_no_pipelining`, which runs each microbatch's forward then its backward
/// (no warmup), although `get_pp_rank_microbatches` reports 1 there (that count serves the
/// combined 1F1B variant of no-pipelining, `combined_1f1b_schedule_for_no_pipelining`: "Phase
/// 1: 1st microbatch backward + 2nd microbatch forward"). With pipelining, combined 1F1B adds
/// one warmup microbatch (`overlap_moe_expert_parallel_comm`).
fn warmup_of(pp: u32, r: u32, vpp: Option<u32>, m: u32, g: u32, spec: &ScheduleSpec) -> u32 {
    let extra = spec.combined && pp > 1;
    let mbs = rank_microbatches(pp, r, vpp, m, g, spec.forward_only, extra);
    if pp == 1 && !spec.forward_only && !spec.combined {
        0
    } else {
        mbs.warmup
    }
}

/// Non-interleaved 1F1B (`forward_backward_pipelining_without_interleaving`). With
/// `combined`, the same warmup rule plus one and fused steady pairs; Megatron itself runs
/// combined 1F1B only from its interleaved and no-pipelining loops, so this one (pp > 1) is
/// pipec's extension.
pub(crate) fn one_f_one_b(spec: &ScheduleSpec) -> Vec<RankOrder> {
    let (pp, m) = (spec.pp, spec.microbatches);
    let table = schedule_table(m, 1, m.max(1));
    (0..pp)
        .map(|r| {
            let warmup = warmup_of(pp, r, None, m, pp, spec);
            RankOrder {
                rank: Rank(r),
                ops: table_order(pp, r, 1, &table, warmup, spec.forward_only, spec.combined),
                warmup,
            }
        })
        .collect()
}

/// Interleaved 1F1B (`forward_backward_pipelining_with_interleaving`).
pub(crate) fn interleaved(spec: &ScheduleSpec) -> Vec<RankOrder> {
    let (pp, v, m) = (spec.pp, spec.vpp, spec.microbatches);
    let g = spec.effective_group_size();
    let table = schedule_table(m, v, g);
    (0..pp)
        .map(|r| {
            let warmup = warmup_of(pp, r, Some(v), m, g, spec);
            RankOrder {
                rank: Rank(r),
                ops: table_order(pp, r, v, &table, warmup, spec.forward_only, spec.combined),
                warmup,
            }
        })
        .collect()
}

/// 1F1B's P2P placement: the non-interleaved loop's calls, or with `--combined` the
/// interleaved loop's (Megatron runs combined 1F1B only from that loop).
pub(crate) fn one_f_one_b_comm(spec: &ScheduleSpec) -> CommPolicy {
    CommPolicy::megatron(spec.combined, spec.megatron_p2p)
}

/// Interleaved 1F1B's P2P placement: the interleaved loop's calls in the spec's mode.
pub(crate) fn interleaved_comm(spec: &ScheduleSpec) -> CommPolicy {
    CommPolicy::megatron(true, spec.megatron_p2p)
}

/// 1F1B's own rules: the non-interleaved loop has no overlapped P2P.
pub(crate) fn one_f_one_b_rules(spec: &ScheduleSpec) -> Result<(), SpecError> {
    let mode = spec.megatron_p2p;
    if mode.overlaps() {
        return Err(SpecError::OverlapNeedsInterleaving { mode });
    }
    Ok(())
}

/// Interleaved 1F1B's own rules: batched P2P at pp = 2, chunks without a pipeline, and
/// Megatron's group size (`pp <= g <= M`, no partial last group smaller than pp).
pub(crate) fn interleaved_rules(spec: &ScheduleSpec) -> Result<(), SpecError> {
    let mode = spec.megatron_p2p;
    if spec.pp == 2 && mode == MegatronP2p::Batched {
        return Err(SpecError::InterleavedPp2NeedsOverlap { mode });
    }
    if spec.pp == 1 && spec.vpp > 1 {
        return Err(SpecError::ChunksNeedPipeline {
            kind: spec.kind,
            vpp: spec.vpp,
        });
    }
    let (g, pp, m) = (spec.effective_group_size(), spec.pp, spec.microbatches);
    if g < pp || g > m {
        return Err(SpecError::GroupSizeOutOfRange { g, pp, m });
    }
    let rem = m % g;
    if rem > 0 && rem < pp {
        return Err(SpecError::PartialLastGroup { m, g, pp, rem });
    }
    Ok(())
}

/// The group sizes the tuner weighs for interleaved 1F1B: Megatron's default, and on small
/// instances the whole batch as one group.
pub(crate) fn interleaved_groups(q: &SearchQuery) -> Option<Vec<Option<u32>>> {
    let mut groups = vec![None];
    if q.microbatches > q.pp && !q.big {
        groups.push(Some(q.microbatches));
    }
    Some(groups)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The worked example in `convert_schedule_table_to_order`'s docstring: PP2, M5, VP2, N3
    /// (group size 3) with 5 warmup microbatches gives `1 1 1 2 2 2 -2 1 -2 1 -2 2 -1 2 -1 -1
    /// -2 -2 -1 -1` (`chunk+1` for forwards, `-(chunk+1)` for backwards).
    #[test]
    fn docstring_example_of_convert_schedule_table_to_order() {
        let table = schedule_table(5, 2, 3);
        let mbs: Vec<u32> = table.iter().map(|e| e.0).collect();
        let chunks: Vec<u32> = table.iter().map(|e| e.1).collect();
        assert_eq!(mbs, vec![0, 1, 2, 0, 1, 2, 3, 4, 3, 4]);
        assert_eq!(chunks, vec![0, 0, 0, 1, 1, 1, 0, 0, 1, 1]);
        let ops = table_order(2, 0, 2, &table, 5, false, false);
        let code: Vec<i32> = ops
            .iter()
            .map(|op| match op {
                Compute::Fwd(t) => (t.stage.0 / 2) as i32 + 1,
                Compute::Bwd(t) => -((t.stage.0 / 2) as i32 + 1),
                _ => unreachable!(),
            })
            .collect();
        assert_eq!(
            code,
            vec![1, 1, 1, 2, 2, 2, -2, 1, -2, 1, -2, 2, -1, 2, -1, -1, -2, -2, -1, -1]
        );
    }

    #[test]
    fn warmup_counts_cap_at_total() {
        let w = rank_microbatches(4, 0, Some(2), 4, 4, false, false);
        assert_eq!(w.warmup, 8);
        assert!(w.all_in_warmup);
        let w = rank_microbatches(4, 3, None, 8, 4, false, false);
        assert_eq!((w.warmup, w.remaining), (0, 8));
    }

    /// `combined_1f1b_schedule_for_no_pipelining`'s docstring, 4 microbatches: F0, then
    /// (B0 + F1), (B1 + F2), (B2 + F3), then B3.
    #[test]
    fn combined_without_pipelining() {
        let spec = ScheduleSpec {
            kind: crate::ScheduleKind::OneFOneB,
            pp: 1,
            vpp: 1,
            microbatches: 4,
            group_size: None,
            forward_only: false,
            combined: true,
            megatron_p2p: Default::default(),
        };
        let t = |mb| Task::new(0, mb);
        let fb = |f, b| Compute::FwdBwd {
            fwd: t(f),
            bwd: t(b),
        };
        assert_eq!(
            one_f_one_b(&spec)[0].ops,
            vec![
                Compute::Fwd(t(0)),
                fb(1, 0),
                fb(2, 1),
                fb(3, 2),
                Compute::Bwd(t(3))
            ]
        );
    }

    /// Combined 1F1B fuses every steady pair: with one warmup more, each rank has
    /// `total - warmup` fused ops, `warmup` leading forwards and `warmup` trailing backwards.
    #[test]
    fn combined_fuses_steady_pairs() {
        let spec = ScheduleSpec {
            kind: crate::ScheduleKind::OneFOneB,
            pp: 4,
            vpp: 1,
            microbatches: 8,
            group_size: None,
            forward_only: false,
            combined: true,
            megatron_p2p: Default::default(),
        };
        for order in one_f_one_b(&spec) {
            let r = order.rank.0;
            let w = (4 - r - 1 + 1) as usize;
            assert_eq!(order.warmup as usize, w);
            let fused = order
                .ops
                .iter()
                .filter(|o| matches!(o, Compute::FwdBwd { .. }))
                .count();
            assert_eq!(fused, 8 - w);
            assert_eq!(order.ops.len(), 8 + w);
            assert!(order.ops[..w].iter().all(Compute::is_forward));
            assert!(order.ops[8..].iter().all(|o| matches!(o, Compute::Bwd(_))));
            // The last rank fuses fwd(mb k+1) with bwd(mb k).
            if r == 3 {
                assert_eq!(
                    order.ops[1],
                    Compute::FwdBwd {
                        fwd: Task::new(3, 1),
                        bwd: Task::new(3, 0)
                    }
                );
            }
        }
    }
}
