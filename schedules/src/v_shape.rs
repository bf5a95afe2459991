//! Schedules on the V placement (`Placement::v_shape`): two chunks per rank, stage `r`
//! (chunk 0) and stage `2pp-1-r` (chunk 1) on rank `r`, so the turnaround at the last rank is
//! local and the first and last stage share rank 0.
//!
//! - [`zb_v`]: ZB-V ("Zero Bubble Pipeline Parallelism", Qi et al., 2024, the V schedule of
//!   the revised paper), in the order of torch's `ScheduleZBVZeroBubble`.
//! - [`v_half`], [`v_min`]: V-Half and V-Min ("Pipeline Parallelism with Controllable
//!   Memory", Qi et al., 2024), built by the authors' greedy algorithm ([`greedy`]).

mod greedy;

use crate::op::{Compute, Task};
use crate::order::rank_orders;
use crate::order::RankOrder;
use crate::spec::ScheduleSpec;
use greedy::Block;

/// Stage of chunk `c` on rank `r` of a V with `pp` ranks.
fn stage(pp: u32, r: u32, c: u32) -> u32 {
    if c == 0 {
        r
    } else {
        2 * pp - 1 - r
    }
}

/// ZB-V in torch `ScheduleZBVZeroBubble._calculate_single_rank_operations` order: warmup
/// `2(pp-r)-1` chunk-0 forwards, `r` pairs (chunk-1 F, chunk-0 F), `pp-r` chunk-1 (F, I, W);
/// steady (F0, I0, W0, F1, I1, W1); cooldown `r` pairs (I0, I1), `pp-r` (I0, W0), then the
/// pending W of chunk 1, then of chunk 0. Like torch, it plans `max(2pp-1, M)` microbatches and
/// drops the ops of the ones beyond `M`; it skips them instead of building them (a loop stops
/// once every counter it advances is past `M`), so a rank costs `O(M)`, not `O(pp)` (issue
/// #28: at `pp = 4000, M = 8` the planned ops were 6 GB).
pub(crate) fn zb_v(spec: &ScheduleSpec) -> Vec<RankOrder> {
    let (pp, m) = (spec.pp, spec.microbatches);
    let n = m.max(2 * pp - 1);
    let per_rank = (0..pp).map(|r| {
        let (s0, s1) = (stage(pp, r, 0), stage(pp, r, 1));
        let mut ops = Vec::with_capacity(6 * m as usize);
        let mut emit = |op: fn(Task) -> Compute, s: u32, mb: u32| {
            if mb < m {
                ops.push(op(Task::new(s, mb)));
            }
        };
        let (fwd, d, w) = (Compute::Fwd, Compute::BwdD, Compute::BwdW);
        let (mut f0, mut f1, mut b0, mut b1) = (0, 0, 0, 0);
        for mb in 0..(2 * (pp - r) - 1).min(m) {
            emit(fwd, s0, mb);
        }
        f0 += 2 * (pp - r) - 1;
        for j in 0..r.min(m.saturating_sub(f1.min(f0))) {
            emit(fwd, s1, f1 + j);
            emit(fwd, s0, f0 + j);
        }
        (f1, f0) = (f1 + r, f0 + r);
        for j in 0..(pp - r).min(m.saturating_sub(f1.min(b1))) {
            emit(fwd, s1, f1 + j);
            emit(d, s1, b1 + j);
            emit(w, s1, b1 + j);
        }
        (f1, b1) = (f1 + pp - r, b1 + pp - r);
        while f1 < f0 || f0 < n {
            if f0.min(f1).min(b0).min(b1) >= m {
                // Every op left has a microbatch `>= M`: the cooldown's `I` and `W` count on
                // from `b0` and `b1`.
                return ops;
            }
            if f0 < n {
                emit(fwd, s0, f0);
                f0 += 1;
            }
            emit(d, s0, b0);
            emit(w, s0, b0);
            b0 += 1;
            emit(fwd, s1, f1);
            f1 += 1;
            emit(d, s1, b1);
            emit(w, s1, b1);
            b1 += 1;
        }
        let (mut w0, w1) = (b0, b1);
        for j in 0..r.min(m.saturating_sub(b0.min(b1))) {
            emit(d, s0, b0 + j);
            emit(d, s1, b1 + j);
        }
        (b0, b1) = (b0 + r, b1 + r);
        for j in 0..(pp - r).min(m.saturating_sub(b0.min(w0))) {
            emit(d, s0, b0 + j);
            emit(w, s0, w0 + j);
        }
        (b0, w0) = (b0 + pp - r, w0 + pp - r);
        for mb in w1..b1.min(m) {
            emit(w, s1, mb);
        }
        for mb in w0..b0.min(m) {
            emit(w, s0, mb);
        }
        debug_assert!(b0 == f0 && b1 == f1);
        ops
    });
    rank_orders(spec, per_rank)
}

fn from_greedy(spec: &ScheduleSpec, block: Block) -> Vec<RankOrder> {
    let pp = spec.pp;
    let per_rank = greedy::order(block, pp, spec.microbatches)
        .into_iter()
        .enumerate()
        .map(|(r, passes)| {
            let r = r as u32;
            passes
                .into_iter()
                .map(|(ty, mb)| {
                    let mb = mb as u32;
                    let t = |c| Task::new(stage(pp, r, c), mb);
                    match ty {
                        greedy::F0 => Compute::Fwd(t(0)),
                        greedy::F1 => Compute::Fwd(t(1)),
                        greedy::B1 => Compute::BwdD(t(1)),
                        greedy::B0 => Compute::BwdD(t(0)),
                        greedy::W1 => Compute::BwdW(t(1)),
                        greedy::W0 => Compute::BwdW(t(0)),
                        _ => unreachable!("greedy::order yields six pass types"),
                    }
                })
                .collect::<Vec<Compute>>()
        });
    rank_orders(spec, per_rank)
}

/// V-Half: the building block `stable_pattern_v_half` (about half of 1F1B's activations).
pub(crate) fn v_half(spec: &ScheduleSpec) -> Vec<RankOrder> {
    from_greedy(spec, Block::Half)
}

/// V-Min: the building block `stable_pattern_v_min` (about a third of 1F1B's activations).
pub(crate) fn v_min(spec: &ScheduleSpec) -> Vec<RankOrder> {
    from_greedy(spec, Block::Min)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ScheduleKind;

    fn spec(kind: ScheduleKind, pp: u32, m: u32) -> ScheduleSpec {
        ScheduleSpec::new(kind, pp, 2, m)
    }

    /// torch's pp = 2, M = 4 ZB-V, rank 0 (stages 0 and 3), written out from
    /// `_calculate_single_rank_operations` by hand: warmup 3 F0, no (F1, F0) pair, 2 (F1, I1,
    /// W1), one steady round with F0, then cooldown (I0, W0) x 2 and nothing pending.
    #[test]
    fn zb_v_pp2_rank0_by_hand() {
        let o = &zb_v(&spec(ScheduleKind::ZbV, 2, 4))[0];
        let text: Vec<String> = o
            .ops
            .iter()
            .map(|c| {
                let (p, t) = c.parts().next().unwrap();
                format!("{}{}{}", t.stage.0, p.torch_letter(), t.mb.0)
            })
            .collect();
        assert_eq!(
            text.join(","),
            "0F0,0F1,0F2,3F0,3I0,3W0,3F1,3I1,3W1,0F3,0I0,0W0,3F2,3I2,3W2,0I1,0W1,3F3,3I3,3W3,0I2,0W2,0I3,0W3"
        );
    }

    /// [`zb_v`] as first written (every planned microbatch built, then the extra ones
    /// dropped): the reference the skipping version is tested against.
    fn zb_v_reference(spec: &ScheduleSpec) -> Vec<RankOrder> {
        let (pp, m) = (spec.pp, spec.microbatches);
        let n = m.max(2 * pp - 1);
        let per_rank = (0..pp).map(|r| {
            let (s0, s1) = (stage(pp, r, 0), stage(pp, r, 1));
            let mut ops = Vec::with_capacity(6 * n as usize);
            let (mut f0, mut f1, mut b0, mut b1) = (0, 0, 0, 0);
            let t = |s: u32, mb: u32| Task::new(s, mb);
            for _ in 0..2 * (pp - r) - 1 {
                ops.push(Compute::Fwd(t(s0, f0)));
                f0 += 1;
            }
            for _ in 0..r {
                ops.push(Compute::Fwd(t(s1, f1)));
                f1 += 1;
                ops.push(Compute::Fwd(t(s0, f0)));
                f0 += 1;
            }
            for _ in 0..pp - r {
                ops.push(Compute::Fwd(t(s1, f1)));
                f1 += 1;
                ops.push(Compute::BwdD(t(s1, b1)));
                ops.push(Compute::BwdW(t(s1, b1)));
                b1 += 1;
            }
            while f1 < f0 || f0 < n {
                if f0 < n {
                    ops.push(Compute::Fwd(t(s0, f0)));
                    f0 += 1;
                }
                ops.push(Compute::BwdD(t(s0, b0)));
                ops.push(Compute::BwdW(t(s0, b0)));
                b0 += 1;
                ops.push(Compute::Fwd(t(s1, f1)));
                f1 += 1;
                ops.push(Compute::BwdD(t(s1, b1)));
                ops.push(Compute::BwdW(t(s1, b1)));
                b1 += 1;
            }
            let (mut w0, mut w1) = (b0, b1);
            for _ in 0..r {
                ops.push(Compute::BwdD(t(s0, b0)));
                b0 += 1;
                ops.push(Compute::BwdD(t(s1, b1)));
                b1 += 1;
            }
            for _ in 0..pp - r {
                ops.push(Compute::BwdD(t(s0, b0)));
                b0 += 1;
                ops.push(Compute::BwdW(t(s0, w0)));
                w0 += 1;
            }
            while w1 < b1 {
                ops.push(Compute::BwdW(t(s1, w1)));
                w1 += 1;
            }
            while w0 < b0 {
                ops.push(Compute::BwdW(t(s0, w0)));
                w0 += 1;
            }
            debug_assert!(w0 == b0 && b0 == f0 && w1 == b1 && b1 == f1);
            ops.retain(|op| op.parts().all(|(_, task)| task.mb.0 < m));
            ops
        });
        rank_orders(spec, per_rank)
    }

    #[test]
    fn zb_v_equals_the_reference() {
        for pp in 1..=24 {
            for m in (1..=4 * pp + 3).chain([8 * pp, 8 * pp + 5]) {
                let s = spec(ScheduleKind::ZbV, pp, m);
                assert_eq!(zb_v(&s), zb_v_reference(&s), "pp {pp} m {m}");
            }
        }
    }

    #[test]
    fn every_pass_once() {
        for kind in [ScheduleKind::ZbV, ScheduleKind::VHalf, ScheduleKind::VMin] {
            for pp in 1..=8 {
                for m in [1, 2, pp, 2 * pp - 1, 2 * pp + 3] {
                    let s = spec(kind, pp, m);
                    let orders = match kind {
                        ScheduleKind::ZbV => zb_v(&s),
                        ScheduleKind::VHalf => v_half(&s),
                        _ => v_min(&s),
                    };
                    for o in &orders {
                        assert_eq!(o.ops.len() as u32, 6 * m, "{kind} pp {pp} m {m}");
                        let r = o.rank.0;
                        for c in 0..2 {
                            let st = stage(pp, r, c);
                            for mb in 0..m {
                                let pos = |x: Compute| o.ops.iter().position(|y| *y == x).unwrap();
                                let f = pos(Compute::Fwd(Task::new(st, mb)));
                                let d = pos(Compute::BwdD(Task::new(st, mb)));
                                let w = pos(Compute::BwdW(Task::new(st, mb)));
                                assert!(f < d && d < w, "{kind} pp {pp} m {m} rank {r}");
                            }
                        }
                    }
                }
            }
        }
    }
}
