//! Zero-bubble schedules on one chunk per rank ("Zero Bubble Pipeline Parallelism", Qi et al.,
//! 2024): the backward is split into `bwd_D` (input gradient, torch's `I`, on the critical
//! path) and `bwd_W` (weight gradient, torch's `W`), and the `W` passes are moved into the
//! bubbles 1F1B leaves.
//!
//! - [`zb_1p`]: the one-pass ZB-1P order, as torch's `ScheduleInterleavedZeroBubble` builds it
//!   for one chunk (`_get_1f1b_rank_ops` with `enable_zero_bubble`) and as
//!   PP-schedule-visualizer's `generate_zero_bubble_1p_schedule` writes it: 1F1B's warmup, then
//!   `F, I` pairs with each rank's `W` passes starting `rank` steps late.
//! - [`zb_h1`]: ZB-H1 as the paper's authors ship it (sail-sg/zero-bubble-pipeline-parallelism,
//!   branch `zb-h1-quick-start`, `forward_backward_pipelining_without_interleaving` with
//!   `WeightGradStore`): only the backward passes whose `W` must wait are split; the others stay
//!   full `bwd`, which keeps Megatron's fused P2P calls.
//! - [`zb_h2`]: ZB-H2 (paper Section 2.2, Figure 3): twice 1F1B's warmup, so that the first
//!   backward never waits, and `W` passes reordered into a parallelogram tail.
//!
//! With uniform `F = I = W` the paper's ZB-H1 figure and ZB-1P are the same order: slot `x`
//! of rank `i` runs `F_x, I_(x-(p-1-i)), W_(x-(p-1))` (skipping ids out of `0..m`); ZB-H2 is the
//! same with both lags doubled. [`slot_order`] writes that rule out; the tests check the torch
//! order against it.

use crate::ids::Rank;
use crate::op::{Compute, Task};
use crate::order::RankOrder;
use crate::spec::ScheduleSpec;
use std::collections::VecDeque;

fn fwd(r: u32, mb: u32) -> Compute {
    Compute::Fwd(Task::new(r, mb))
}
fn bwd(r: u32, mb: u32) -> Compute {
    Compute::Bwd(Task::new(r, mb))
}
fn bwd_d(r: u32, mb: u32) -> Compute {
    Compute::BwdD(Task::new(r, mb))
}
fn bwd_w(r: u32, mb: u32) -> Compute {
    Compute::BwdW(Task::new(r, mb))
}

/// Forward-only runs every forward in microbatch order.
fn forward_only(spec: &ScheduleSpec) -> Vec<RankOrder> {
    (0..spec.pp)
        .map(|r| RankOrder {
            rank: Rank(r),
            ops: (0..spec.microbatches).map(|mb| fwd(r, mb)).collect(),
            warmup: spec.microbatches,
        })
        .collect()
}

/// ZB-1P: torch `_get_1f1b_rank_ops(..., enable_zero_bubble=True)` for one local stage with
/// `_get_warmup_ops(multiply_factor=1)` (warmup `min(pp-1-r, M)`) and
/// `num_1f1b_microbatches = rank` (the first `rank` steady steps leave their `W` pending).
pub(crate) fn zb_1p(spec: &ScheduleSpec) -> Vec<RankOrder> {
    if spec.forward_only {
        return forward_only(spec);
    }
    let (pp, m) = (spec.pp, spec.microbatches);
    (0..pp)
        .map(|r| {
            let warmup = (pp - 1 - r).min(m);
            let mut ops = Vec::with_capacity(3 * m as usize);
            let (mut f, mut b, mut w) = (0, 0, 0);
            for op in 0..m + warmup {
                if op < warmup {
                    ops.push(fwd(r, f));
                    f += 1;
                    continue;
                }
                if op < m {
                    ops.push(fwd(r, f));
                    f += 1;
                }
                ops.push(bwd_d(r, b));
                b += 1;
                if op - warmup >= r {
                    ops.push(bwd_w(r, w));
                    w += 1;
                }
            }
            ops.extend((w..m).map(|mb| bwd_w(r, mb)));
            RankOrder {
                rank: Rank(r),
                ops,
                warmup,
            }
        })
        .collect()
}

/// ZB-H1 as sail-sg's `zb-h1-quick-start` runs it inside Megatron's non-interleaved loop:
/// warmup `pp-1-r` forwards; steady step `i` splits its backward when `i < rank` or it is the
/// last step (`WeightGradStore.split_bw = (i < rank or last_iteration) and rank > 0`), the last
/// step also pops one pending `W` when `i >= rank > 0`; every cooldown backward is split and
/// pops one pending `W` once `remaining + i >= rank`; the rest are popped at the end
/// (`pop_all`). Pending `W` passes run first-in first-out. Rank 0 is plain 1F1B.
pub(crate) fn zb_h1(spec: &ScheduleSpec) -> Vec<RankOrder> {
    if spec.forward_only {
        return forward_only(spec);
    }
    let (pp, m) = (spec.pp, spec.microbatches);
    (0..pp)
        .map(|r| {
            let warmup = (pp - 1 - r).min(m);
            let remaining = m - warmup;
            let mut ops = Vec::with_capacity(3 * m as usize);
            let mut pending: VecDeque<u32> = VecDeque::new();
            ops.extend((0..warmup).map(|mb| fwd(r, mb)));
            for i in 0..remaining {
                ops.push(fwd(r, warmup + i));
                let last = i + 1 == remaining;
                if (i < r || last) && r > 0 {
                    ops.push(bwd_d(r, i));
                    pending.push_back(i);
                    if last && i >= r {
                        let mb = pending.pop_front().expect("a W was just queued");
                        ops.push(bwd_w(r, mb));
                    }
                } else {
                    ops.push(bwd(r, i));
                }
            }
            for i in 0..warmup {
                let mb = remaining + i;
                if r > 0 {
                    ops.push(bwd_d(r, mb));
                    pending.push_back(mb);
                    if remaining + i >= r {
                        let mb = pending.pop_front().expect("a W was just queued");
                        ops.push(bwd_w(r, mb));
                    }
                } else {
                    ops.push(bwd(r, mb));
                }
            }
            ops.extend(pending.into_iter().map(|mb| bwd_w(r, mb)));
            RankOrder {
                rank: Rank(r),
                ops,
                warmup,
            }
        })
        .collect()
}

/// ZB-H2: [`slot_order`] with both lags doubled (`I` lags `2(pp-1-r)` slots, `W` lags
/// `2(pp-1)`), which gives the paper's `2(pp-1-r)` extra warmup forwards, peak `2pp-1` live
/// activations and the parallelogram tail of Figure 3 (bottom).
pub(crate) fn zb_h2(spec: &ScheduleSpec) -> Vec<RankOrder> {
    if spec.forward_only {
        return forward_only(spec);
    }
    (0..spec.pp)
        .map(|r| slot_order(spec.pp, r, spec.microbatches, 2))
        .collect()
}

/// The handcrafted slot rule of the paper's Figure 3: on rank `r`, slot `x` runs `F_x`, then
/// `I_(x - k(pp-1-r))`, then `W_(x - k(pp-1))`, each only when its microbatch is in `0..m`.
/// `k = 1` is ZB-H1's figure (and equals ZB-1P), `k = 2` is ZB-H2.
pub(crate) fn slot_order(pp: u32, r: u32, m: u32, k: u32) -> RankOrder {
    let lag_i = k * (pp - 1 - r);
    let lag_w = k * (pp - 1);
    let mut ops = Vec::with_capacity(3 * m as usize);
    for x in 0..m + lag_w {
        if x < m {
            ops.push(fwd(r, x));
        }
        if x >= lag_i && x - lag_i < m {
            ops.push(bwd_d(r, x - lag_i));
        }
        if x >= lag_w {
            ops.push(bwd_w(r, x - lag_w));
        }
    }
    RankOrder {
        rank: Rank(r),
        ops,
        warmup: lag_i.min(m),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ScheduleKind;

    fn spec(kind: ScheduleKind, pp: u32, m: u32) -> ScheduleSpec {
        ScheduleSpec::new(kind, pp, 1, m)
    }

    /// Every (pass, microbatch) once on each rank, W after its I, I after its F.
    fn assert_complete(orders: &[RankOrder], m: u32) {
        for o in orders {
            let r = o.rank.0;
            let pos = |c: Compute| o.ops.iter().position(|x| *x == c);
            for mb in 0..m {
                let f = pos(fwd(r, mb)).expect("forward present");
                match (pos(bwd(r, mb)), pos(bwd_d(r, mb)), pos(bwd_w(r, mb))) {
                    (Some(b), None, None) => assert!(f < b),
                    (None, Some(d), Some(w)) => assert!(f < d && d < w),
                    other => panic!("rank {r} mb {mb}: backward {other:?}"),
                }
            }
        }
    }

    #[test]
    fn zb_1p_is_the_papers_slot_rule() {
        for pp in 1..=8u32 {
            for m in (pp.saturating_sub(1)).max(1)..=3 * pp + 1 {
                let s = spec(ScheduleKind::Zb1P, pp, m);
                let got = zb_1p(&s);
                assert_complete(&got, m);
                for (r, o) in got.iter().enumerate() {
                    assert_eq!(
                        o.ops,
                        slot_order(pp, r as u32, m, 1).ops,
                        "pp {pp} m {m} rank {r}"
                    );
                }
            }
        }
    }

    /// Visualizer example: pp = 4, m = 8, rank 2 has one warmup forward and starts its W
    /// passes two steady steps late.
    #[test]
    fn zb_1p_rank_2_of_4() {
        let o = &zb_1p(&spec(ScheduleKind::Zb1P, 4, 8))[2];
        let text: Vec<String> = o.ops.iter().map(torch).collect();
        assert_eq!(
            text.join(","),
            "F0,F1,I0,F2,I1,F3,I2,W0,F4,I3,W1,F5,I4,W2,F6,I5,W3,F7,I6,W4,I7,W5,W6,W7"
        );
    }

    fn torch(c: &Compute) -> String {
        let (p, t) = c.parts().next().unwrap();
        format!("{}{}", p.torch_letter(), t.mb.0)
    }

    #[test]
    fn zb_h1_splits_only_where_w_waits() {
        for pp in 1..=8 {
            for m in 1..=3 * pp + 1 {
                let got = zb_h1(&spec(ScheduleKind::ZbH1, pp, m));
                assert_complete(&got, m);
                // Rank 0 is 1F1B: no split at all.
                assert!(got[0]
                    .ops
                    .iter()
                    .all(|c| matches!(c, Compute::Fwd(_) | Compute::Bwd(_))));
            }
        }
        // pp = 4, m = 8, rank 2: steady steps 0, 1 and the last split; W0 runs after I5.
        let o = &zb_h1(&spec(ScheduleKind::ZbH1, 4, 8))[2];
        let text: Vec<String> = o.ops.iter().map(torch).collect();
        assert_eq!(
            text.join(","),
            "F0,F1,I0,F2,I1,F3,B2,F4,B3,F5,B4,F6,B5,F7,I6,W0,I7,W1,W6,W7"
        );
    }

    #[test]
    fn zb_h2_keeps_2p_minus_1_in_flight() {
        for pp in 1..=8 {
            let m = 3 * pp;
            let got = zb_h2(&spec(ScheduleKind::ZbH2, pp, m));
            assert_complete(&got, m);
            for o in &got {
                let (mut live, mut peak) = (0i32, 0i32);
                for c in &o.ops {
                    match c {
                        Compute::Fwd(_) => live += 1,
                        Compute::BwdW(_) => live -= 1,
                        _ => {}
                    }
                    peak = peak.max(live);
                }
                assert_eq!(peak as u32, (2 * pp - 1).min(m));
                assert_eq!(o.warmup, 2 * (pp - 1 - o.rank.0));
            }
        }
    }

    #[test]
    fn forward_only_is_forwards_in_order() {
        let mut s = spec(ScheduleKind::ZbH2, 3, 5);
        s.forward_only = true;
        for o in zb_h2(&s) {
            assert_eq!(o.ops.len(), 5);
            assert!(o.ops.iter().all(Compute::is_forward));
        }
    }
}
