//! Megatron-LM's pipeline schedules, reproduced order for order.
//!
//! Sources (Megatron-LM `megatron/core/pipeline_parallel/schedules.py`):
//! `get_pp_rank_microbatches` (warmup counts), `get_schedule_table` (the tunable lookup table of
//! (microbatch, chunk) per virtual microbatch) and `convert_schedule_table_to_order` (the
//! interleaving of forwards and backwards). Combined 1F1B (`combined_1f1b.py`, enabled by
//! `overlap_moe_expert_parallel_comm`) adds one warmup microbatch.

use crate::ids::Rank;
use crate::op::{Compute, Task};
use crate::schedule::RankOrder;
use crate::spec::ScheduleSpec;

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
/// table entry `i` runs chunk `chunks - 1 - c_i` on microbatch `mb_i`.
fn table_order(
    pp: u32,
    r: u32,
    chunks: u32,
    table: &[(u32, u32)],
    warmup: u32,
    forward_only: bool,
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
        ops.push(fwd(i));
        ops.push(bwd(i - w));
    }
    ops.extend((n - w..n).map(bwd));
    ops
}

/// Warmup actually used on a rank. At pp = 1 Megatron's `get_forward_backward_func` picks
/// `forward_backward_no_pipelining`, which runs each microbatch's forward then its backward
/// (no warmup), although `get_pp_rank_microbatches` reports 1 there (that count serves the
/// combined 1F1B variant of no-pipelining).
fn effective_warmup(pp: u32, mbs: &RankMicrobatches, forward_only: bool) -> u32 {
    if pp == 1 && !forward_only {
        0
    } else {
        mbs.warmup
    }
}

/// Non-interleaved 1F1B (`forward_backward_pipelining_without_interleaving`).
pub(crate) fn one_f_one_b(spec: &ScheduleSpec) -> Vec<RankOrder> {
    let (pp, m) = (spec.pp, spec.microbatches);
    let table = schedule_table(m, 1, m.max(1));
    (0..pp)
        .map(|r| {
            let mbs = rank_microbatches(pp, r, None, m, pp, spec.forward_only, false);
            let warmup = effective_warmup(pp, &mbs, spec.forward_only);
            RankOrder {
                rank: Rank(r),
                ops: table_order(pp, r, 1, &table, warmup, spec.forward_only),
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
            let mbs = rank_microbatches(pp, r, Some(v), m, g, spec.forward_only, false);
            let warmup = effective_warmup(pp, &mbs, spec.forward_only);
            RankOrder {
                rank: Rank(r),
                ops: table_order(pp, r, v, &table, warmup, spec.forward_only),
                warmup,
            }
        })
        .collect()
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
        let ops = table_order(2, 0, 2, &table, 5, false);
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
}
