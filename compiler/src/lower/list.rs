//! The list schedule of fixed per-rank orders: each op starts as soon as its rank is free and
//! its inputs exist (Graham's list scheduling with the orders as the lists). One scheduler
//! over two clocks: the lockstep lowering's integer ticks ([`super::Ticks`], unit passes, no
//! transfer time) and the tuner's real costs (`tune::plan::list_times`: per-stage f, b, w
//! and a transfer time between ranks).
//!
//! Ranks are visited only when they can move, in the order of sweeps over the ranks until
//! nothing moves (first sweep, then when the tensor a rank waits for is written: in the same
//! sweep by a lower rank, else the next), so every time is the one the full sweeps give, even
//! where an order produces a tensor twice, without their `O(pp²)` cost when waves run against
//! the rank order (a V's chunk 1, any backward).

use pipec_schedules::{Compute, Pass, Placement, RankOrder};
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

/// How long ops take and when a tensor can be used where it is consumed.
pub trait Clock {
    type Time: Copy + PartialEq;
    /// Time 0: the start, and when inputs from outside the program exist.
    const ZERO: Self::Time;
    /// Later than every real time: a tensor not produced yet.
    const NEVER: Self::Time;
    /// How long `op` runs; `None` for an op the clock cannot time (the tuner's costs have no
    /// overlapped `F&B`), which stops its rank there.
    fn cost(&self, op: &Compute) -> Option<Self::Time>;
    /// When microbatch `mb`'s tensor from stage `from`, produced at `t`, can be used on stage
    /// `to` (`t` plus the transfer time when the two run on different ranks).
    fn arrive(&self, t: Self::Time, from: u32, to: u32, mb: u32) -> Self::Time;
    fn add(a: Self::Time, b: Self::Time) -> Self::Time;
    fn max(a: Self::Time, b: Self::Time) -> Self::Time;
}

/// The (start, end) of every op that could run, rank by rank: a rank's list stops at the first
/// op whose inputs its order never lets exist, or that the clock cannot time.
pub struct Times<T> {
    pub ranks: Vec<Vec<(T, T)>>,
    /// Every op of every rank ran.
    pub complete: bool,
}

/// The list schedule of `orders` under `clock`. Inputs outside the program (microbatch or
/// stage out of range: an unverified order) count as there from the start.
pub fn schedule<C: Clock>(
    placement: &Placement,
    microbatches: u32,
    orders: &[RankOrder],
    clock: &C,
) -> Times<C::Time> {
    let m = microbatches as usize;
    let cells = placement.num_stages() as usize * m;
    let last = placement.num_stages().saturating_sub(1);
    // End of fwd (act) and of bwd/bwd_D (grad) of (stage, mb).
    let mut act = vec![C::NEVER; cells];
    let mut grad = vec![C::NEVER; cells];
    let idx = |s: u32, mb: u32| s as usize * m + mb as usize;
    // `Ok(end)` once the tensor exists, else the missing cell: (is a gradient, index).
    let at = |table: &[C::Time], grad: bool, s: u32, mb: u32| -> Result<C::Time, (bool, usize)> {
        if (mb as usize) >= m {
            return Ok(C::ZERO);
        }
        match table.get(idx(s, mb)) {
            None => Ok(C::ZERO),
            Some(&t) if t == C::NEVER => Err((grad, idx(s, mb))),
            Some(&t) => Ok(t),
        }
    };
    let inputs = |op: &Compute, act: &[C::Time], grad: &[C::Time]| {
        let mut ready = C::ZERO;
        for (pass, t) in op.parts() {
            let (s, mb) = (t.stage.0, t.mb.0);
            let need = match pass {
                Pass::Fwd if s == 0 => C::ZERO,
                Pass::Fwd => clock.arrive(at(act, false, s - 1, mb)?, s - 1, s, mb),
                Pass::Bwd | Pass::BwdD => {
                    let a = at(act, false, s, mb)?;
                    if s >= last {
                        a
                    } else {
                        C::max(a, clock.arrive(at(grad, true, s + 1, mb)?, s + 1, s, mb))
                    }
                }
                Pass::BwdW => at(grad, true, s, mb)?,
            };
            ready = C::max(ready, need);
        }
        Ok(ready)
    };
    let world = orders.len();
    let mut times: Vec<Vec<(C::Time, C::Time)>> = orders
        .iter()
        .map(|o| Vec::with_capacity(o.ops.len()))
        .collect();
    let mut free = vec![C::ZERO; world];
    let mut visits: BinaryHeap<Reverse<(u64, usize)>> =
        (0..world).map(|r| Reverse((0, r))).collect();
    let mut waiting: HashMap<(bool, usize), Vec<usize>> = HashMap::new();
    while let Some(Reverse((sweep, r))) = visits.pop() {
        let order = &orders[r];
        while let Some(op) = order.ops.get(times[r].len()) {
            // Checked here, not by a pass over the orders first: that pass is one more walk of
            // every op, which the tuner's largest list schedules pay for.
            let Some(cost) = clock.cost(op) else {
                break;
            };
            let ready = match inputs(op, &act, &grad) {
                Ok(ready) => ready,
                Err(cell) => {
                    waiting.entry(cell).or_default().push(r);
                    break;
                }
            };
            let s = C::max(free[r], ready);
            let e = C::add(s, cost);
            for (pass, t) in op.parts() {
                if (t.mb.0 as usize) < m && t.stage.0 <= last {
                    let cell = match pass {
                        Pass::Fwd => (false, idx(t.stage.0, t.mb.0)),
                        Pass::Bwd | Pass::BwdD => (true, idx(t.stage.0, t.mb.0)),
                        Pass::BwdW => continue,
                    };
                    let table = if cell.0 { &mut grad } else { &mut act };
                    table[cell.1] = e;
                    for w in waiting.remove(&cell).into_iter().flatten() {
                        visits.push(Reverse((sweep + u64::from(w < r), w)));
                    }
                }
            }
            times[r].push((s, e));
            free[r] = e;
        }
    }
    let complete = times
        .iter()
        .zip(orders)
        .all(|(t, o)| t.len() == o.ops.len());
    Times {
        ranks: times,
        complete,
    }
}
