//! What the tuner's schedulers hand back and how fixed orders are judged: a [`Plan`], the list
//! schedule of fixed per-rank orders under a [`Problem`]'s costs ([`list_times`]), their peak
//! memory ([`order_peaks`]). A leaf: pipec's list scheduler (`greedy`) and the zero-bubble
//! authors' rules (`zb`) both build on it.

use super::problem::Problem;
use pipec_schedules::{Compute, RankOrder};

/// Whether the staircase cap can apply: one direction, one stage per rank.
pub fn staircase_applies(p: &Problem) -> bool {
    p.directions().len() == 1 && p.num_stages() == p.pp() && p.pp() > 1
}

/// A planned schedule: per-rank orders and the times the list schedule gives them.
#[derive(Clone, Debug, PartialEq)]
pub struct Plan {
    pub orders: Vec<RankOrder>,
    pub makespan: f64,
    /// Per rank: peak activation memory plus parameters.
    pub peak: Vec<f64>,
}

/// As-soon-as-possible times of fixed per-rank orders (each op starts when its rank is free
/// and its inputs exist, tensors between ranks delayed by `comm`): the makespan, or `None`
/// when the orders wait on each other. An independent check of the list scheduler's times
/// (`greedy::schedule`).
pub fn list_makespan(p: &Problem, orders: &[RankOrder]) -> Option<f64> {
    list_times(p, orders).map(|t| t.iter().flatten().map(|&(_, e)| e).fold(0.0, f64::max))
}

/// The (start, end) of every op of fixed per-rank orders in their list schedule
/// ([`pipec_compiler::lower::list::schedule`] under `p`'s costs; see [`list_makespan`]); `None` when
/// the orders wait on each other or hold a fused `F&B` op (the tuner's costs have none).
pub fn list_times(p: &Problem, orders: &[RankOrder]) -> Option<Vec<Vec<(f64, f64)>>> {
    let t = pipec_compiler::lower::list::schedule(&p.placement, p.microbatches, orders, p);
    t.complete.then_some(t.ranks)
}

/// The tuner's clock: each stage's f, b and w, and `comm` for a tensor between ranks.
impl pipec_compiler::lower::list::Clock for Problem {
    type Time = f64;
    const ZERO: f64 = 0.0;
    const NEVER: f64 = f64::INFINITY;

    fn cost(&self, op: &Compute) -> Option<f64> {
        Some(match *op {
            Compute::Fwd(t) => self.f[t.stage.index()],
            // A full backward is `bwd_D` and `bwd_W` back to back.
            Compute::Bwd(t) => self.b[t.stage.index()] + self.w[t.stage.index()],
            Compute::BwdD(t) => self.b[t.stage.index()] + 0.0,
            Compute::BwdW(t) => self.w[t.stage.index()],
            // No overlap in the tuner's model: `list_times` refuses such orders.
            Compute::FwdBwd { .. } => return None,
        })
    }

    fn arrive(&self, t: f64, from: u32, to: u32, mb: u32) -> f64 {
        t + self.delay_mb(from as usize, to as usize, mb as usize)
    }

    fn add(a: f64, b: f64) -> f64 {
        a + b
    }

    fn max(a: f64, b: f64) -> f64 {
        a.max(b)
    }
}

/// Peak memory per rank of fixed orders (parameters plus the most `act`-weighted live
/// activations, by the verifier's rule, `ir::activations::order_peak`), and whether every rank
/// stays within its limit.
pub fn order_peaks(p: &Problem, orders: &[RankOrder]) -> (Vec<f64>, bool) {
    let mut fits = true;
    let peaks = orders
        .iter()
        .enumerate()
        .map(|(r, o)| {
            // The verifier's rule (`ir::activations`), weighted by each stage's `act`.
            let peak = pipec_ir::ir::activations::order_peak(&o.ops, false, |t| {
                (p.act[t.stage.index()], p.act_w[t.stage.index()])
            });
            let total = peak + p.param[r];
            if total > p.limit[r] + 1e-9 {
                fits = false;
            }
            total
        })
        .collect();
    (peaks, fits)
}
