//! PipeOffload's grouped interleaved 1F1B (Wan et al., "PipeOffload: Improving Scalability of
//! Pipeline Parallelism with Memory Optimization", ICML 2025), in the order of the authors'
//! `GroupBuildingBlockScheduler` (sail-sg zero-bubble-pipeline-parallelism,
//! `scheduler/group_interleaved_1f1b.py`), the schedule their offload runs on.
//!
//! A building block of `3 g v` slots per rank holds, for `g` microbatches (the group) and `v`
//! chunks, each chunk's forwards and, after the rank's warmup, each chunk's `bwd_D` directly
//! followed by its `bwd_W` (a weight gradient never waits, so an offloaded activation leaves
//! the device right after its backward). Groups repeat the block every `3 g v` slots. Their
//! later passes (dependency shift, squeezing) move passes in time, never in order, so each
//! rank's order is its passes by slot.
//!
//! `min_group_size` is their `create_schedule`'s `ceil(pp / 2)`, which their cost rule raises
//! only when one rank's `f + b + w` times it is less than the whole pipeline's forward (never
//! with equal costs per rank, nor with first and last ranks 1.5 times as heavy).

use crate::kind::SearchQuery;
use crate::op::{Compute, Pass, Task};
use crate::order::{rank_orders, RankOrder};
use crate::spec::{ScheduleSpec, SpecError};

/// Their group size: `1 <= g <= pp`.
pub(crate) fn rules(spec: &ScheduleSpec) -> Result<(), SpecError> {
    let (g, pp) = (spec.effective_group_size(), spec.pp);
    // Their code resets a larger group to pp, silently: refused here instead.
    if g == 0 || g > pp {
        return Err(SpecError::GroupOutOfRange { g, pp });
    }
    Ok(())
}

/// What the tuner weighs: the schedule is weighed for what it saves in memory, so without a
/// limit large instances skip it (its timed lowering is verified, which is slow at size L);
/// it trades time for memory by its group size, so under a limit every group (their code
/// takes `1..=pp`), spread over at most 8 for deep pipelines.
pub(crate) fn tune_groups(q: &SearchQuery) -> Option<Vec<Option<u32>>> {
    if q.big && !q.memory_limit {
        return None;
    }
    let mut groups = vec![None];
    if q.memory_limit && !q.big {
        groups.extend(
            group_sizes(q.pp)
                .into_iter()
                .filter(|&g| g != q.pp)
                .map(Some),
        );
    }
    Some(groups)
}

/// Group sizes `1..=pp`, or 8 of them spread evenly for deep pipelines.
fn group_sizes(pp: u32) -> Vec<u32> {
    if pp <= 8 {
        return (1..=pp).collect();
    }
    let mut out: Vec<u32> = (0..8).map(|i| 1 + i * (pp - 1) / 7).collect();
    out.dedup();
    out
}

fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// The passes of rank `d` in one building block: `(slot, pass, stage, position in the
/// group)`. `get_optimal_building_block` with `f_offset = 1`, `b_offset = 2`.
fn block(pp: u64, g: u64, v: u64, d: u64) -> Vec<(u64, Pass, u32, u32)> {
    let min_group = pp.div_ceil(2);
    let min_k = min_group.div_ceil(g);
    let period = v / gcd(v, min_k);
    let skew = |c: u64| 3 * min_k * g * c + 3 * g * (c / period);
    let mut out = Vec::with_capacity((3 * g * v) as usize);
    for c in 0..v {
        for i in 0..g {
            out.push((
                skew(c) + 3 * i + d,
                Pass::Fwd,
                (c * pp + d) as u32,
                i as u32,
            ));
        }
    }
    let last_f = skew(v - 1) + d;
    let first_b = last_f + 3 * (pp - 1 - d) + 1;
    for c in 0..v {
        let chunk = v - 1 - c;
        for i in 0..g {
            let b = first_b + skew(c) + 3 * i;
            let stage = (chunk * pp + d) as u32;
            out.push((b, Pass::BwdD, stage, i as u32));
            out.push((b + 1, Pass::BwdW, stage, i as u32));
        }
    }
    out
}

pub(crate) fn orders(spec: &ScheduleSpec) -> Vec<RankOrder> {
    let (pp, v, m) = (
        u64::from(spec.pp),
        u64::from(spec.vpp),
        u64::from(spec.microbatches),
    );
    let g = u64::from(spec.effective_group_size());
    let len = 3 * g * v;
    let groups = m.div_ceil(g);
    let per_rank = (0..pp).map(|d| {
        let one = block(pp, g, v, d);
        let mut passes: Vec<(u64, Compute)> = Vec::with_capacity(one.len() * groups as usize);
        for k in 0..groups {
            for &(slot, pass, stage, i) in &one {
                // `remove_redundant_micro`: the last group may be partial.
                let mb = u64::from(i) + k * g;
                if mb < m {
                    let op = Compute::single(pass, Task::new(stage, mb as u32));
                    passes.push((slot + k * len, op));
                }
            }
        }
        passes.sort_by_key(|&(slot, _)| slot);
        passes.into_iter().map(|(_, op)| op).collect::<Vec<_>>()
    });
    rank_orders(spec, per_rank)
}
