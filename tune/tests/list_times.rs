//! The list scheduler that lowers with real costs (`pipec_compiler::lower::list`, called by
//! the tuner as `plan::list_times`) against the tuner's own list schedule as it was before
//! the two were made one: the reference.

use pipec_schedules::{generate, Compute, Limits, RankOrder, ScheduleKind, ScheduleSpec};
use pipec_tune::plan::list_times;
use pipec_tune::problem::Problem;
use proptest::prelude::*;
use std::cmp::Reverse;
use std::collections::BinaryHeap;

const UNSET: f64 = f64::INFINITY;

/// `tune::plan::list_times` as it was before it became `pipec_compiler::lower::list::schedule` under the
/// tuner's clock (pipec commit 80b66b2): the reference.
fn list_times_before(p: &Problem, orders: &[RankOrder]) -> Option<Vec<Vec<(f64, f64)>>> {
    let n = p.num_stages();
    let m = p.microbatches as usize;
    let mut fend = vec![UNSET; n * m];
    let mut bend = vec![UNSET; n * m];
    let mut pc = vec![0usize; orders.len()];
    let mut free = vec![0.0f64; orders.len()];
    let mut times: Vec<Vec<(f64, f64)>> = orders
        .iter()
        .map(|o| Vec::with_capacity(o.ops.len()))
        .collect();
    let mut visits: BinaryHeap<Reverse<(u64, usize)>> =
        (0..orders.len()).map(|r| Reverse((0, r))).collect();
    let mut waiting: std::collections::HashMap<(bool, usize), Vec<usize>> = Default::default();
    let mut finished = 0;
    while let Some(Reverse((sweep, r))) = visits.pop() {
        let o = &orders[r];
        while let Some(op) = o.ops.get(pc[r]) {
            // (ready, the tensor it waits for, the tensor it ends, cost)
            let (ready, input, end_slot, cost) = match *op {
                Compute::Fwd(t) => {
                    let s = t.stage.index();
                    let mb = t.mb.index();
                    let (ready, input) = if s == 0 {
                        (0.0, None)
                    } else {
                        let i = (s - 1) * m + mb;
                        (fend[i] + p.delay_mb(s - 1, s, mb), Some((true, i)))
                    };
                    (ready, input, Some((true, s * m + mb)), p.f[s])
                }
                // A full backward is `bwd_D` and `bwd_W` back to back: same inputs.
                Compute::BwdD(t) | Compute::Bwd(t) => {
                    let s = t.stage.index();
                    let mb = t.mb.index();
                    let fe = fend[s * m + mb];
                    let (ready, input) = if s + 1 == n {
                        (fe, (true, s * m + mb))
                    } else {
                        let i = (s + 1) * m + mb;
                        let missing = if fe == UNSET {
                            (true, s * m + mb)
                        } else {
                            (false, i)
                        };
                        (fe.max(bend[i] + p.delay_mb(s + 1, s, mb)), missing)
                    };
                    let w = if matches!(op, Compute::Bwd(_)) {
                        p.w[s]
                    } else {
                        0.0
                    };
                    (ready, Some(input), Some((false, s * m + mb)), p.b[s] + w)
                }
                Compute::BwdW(t) => {
                    let s = t.stage.index();
                    let i = s * m + t.mb.index();
                    (bend[i], Some((false, i)), None, p.w[s])
                }
                Compute::FwdBwd { .. } => return None,
            };
            if ready == UNSET {
                waiting
                    .entry(input.expect("only a missing tensor is UNSET"))
                    .or_default()
                    .push(r);
                break;
            }
            let start = free[r].max(ready);
            let end = start + cost;
            if let Some(cell) = end_slot {
                if cell.0 {
                    fend[cell.1] = end;
                } else {
                    bend[cell.1] = end;
                }
                for w in waiting.remove(&cell).into_iter().flatten() {
                    visits.push(Reverse((sweep + u64::from(w < r), w)));
                }
            }
            free[r] = end;
            times[r].push((start, end));
            pc[r] += 1;
        }
        if pc[r] == o.ops.len() {
            finished += 1;
        }
    }
    (finished == orders.len()).then_some(times)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]
    /// The one list scheduler under the tuner's costs gives the tuner's own list schedule
    /// as it was, to the bit: per-stage f, b, w and a transfer time, for generated orders
    /// of every kind and broken ones (ops swapped, repeated or dropped); both refuse fused
    /// `F&B` orders and orders that wait on each other.
    #[test]
    fn real_cost_times_equal_the_tuners_own(
        kind in proptest::sample::select(ScheduleKind::ALL.to_vec()),
        pp in 1u32..6,
        m in 1u32..12,
        costs in proptest::collection::vec((1u32..9, 0u32..9, 0u32..5), 12),
        comm in 0u32..4,
        edits in proptest::collection::vec(
            (0u8..3, any::<proptest::sample::Index>(),
             any::<proptest::sample::Index>(), any::<proptest::sample::Index>()),
            0..4,
        ),
    ) {
        let Ok(s) = generate(&ScheduleSpec::new(kind, pp, 2, m), &Limits::DEFAULT)
            .or_else(|_| generate(&ScheduleSpec::new(kind, pp, 1, m), &Limits::DEFAULT))
        else {
            return Ok(());
        };
        let n = s.placement.num_stages() as usize;
        // Thirds and tenths, so sums round.
        let (f, b, w) = (
            (0..n).map(|i| f64::from(costs[i % 12].0) / 3.0).collect(),
            (0..n).map(|i| f64::from(costs[i % 12].1) / 10.0 + 0.5).collect(),
            (0..n).map(|i| f64::from(costs[i % 12].2) / 3.0).collect(),
        );
        let mut p = Problem::from_tables(s.placement.clone(), m, f, b, w, None);
        p.comm = f64::from(comm) * 0.3;
        let mut orders: Vec<RankOrder> = s.ranks.clone();
        for (what, r, i, j) in edits {
            let ops = &mut orders[r.index(pp as usize)].ops;
            if ops.is_empty() {
                continue;
            }
            let (i, j) = (i.index(ops.len()), j.index(ops.len()));
            match what {
                0 => ops.swap(i, j),
                1 => ops.insert(j, ops[i]),
                _ => {
                    ops.remove(i);
                }
            }
        }
        let want = list_times_before(&p, &orders);
        let got = list_times(&p, &orders);
        // Bit for bit: both add the same costs in the same order.
        let bits = |t: Option<Vec<Vec<(f64, f64)>>>| {
            t.map(|t| {
                t.into_iter()
                    .map(|r| r.into_iter().map(|(a, b)| (a.to_bits(), b.to_bits())).collect())
                    .collect::<Vec<Vec<_>>>()
            })
        };
        prop_assert_eq!(bits(got), bits(want));
    }
}
