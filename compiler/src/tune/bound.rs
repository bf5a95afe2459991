//! A lower bound on the makespan of any schedule of a problem, computed from the costs alone
//! (no schedule involved), so that tuning results can be measured against it.
//!
//! Two independent arguments, the larger is the bound:
//! - **Rank work**: rank `r` runs `M` forwards, `bwd_D` and `bwd_W` of each of its stages, one
//!   at a time, and can start no earlier than the first microbatch's forward reaches its
//!   first stage: `head(r) + M * sum over its stages of (f + b + w)`.
//! - **One microbatch's critical path**: the forward through every stage, the input-gradient
//!   backward back through every stage and the weight gradient of stage 0, with a tensor delay
//!   wherever consecutive stages sit on different ranks.

use super::problem::Problem;

/// The bound and its two parts.
#[derive(Copy, Clone, Debug, PartialEq, serde::Serialize)]
pub struct Bound {
    pub value: f64,
    /// Most work on one rank, its head start included.
    pub rank_work: f64,
    /// The critical path of one microbatch.
    pub critical_path: f64,
}

/// The bound of a problem. Bidirectional placements (DualPipe) are handled per direction:
/// microbatches from `mirror_from` on run the mirrored pipeline.
pub fn lower_bound(p: &Problem) -> Bound {
    let n = p.num_stages();
    let m = p.microbatches;
    // The directions: (first microbatch, microbatch count).
    let dirs: Vec<(u32, u32)> = match p.placement.mirror_from() {
        Some(h) if h < m => vec![(0, h), (h, m - h)],
        _ => vec![(0, m)],
    };
    let rank_of = |s: usize, mb: u32| {
        p.placement
            .rank_of(pipec_schedules::Task::new(s as u32, mb))
            .index()
    };
    let delay = |a: usize, b: usize, mb: u32| {
        if rank_of(a, mb) == rank_of(b, mb) {
            0.0
        } else {
            p.comm
        }
    };
    let mut head = vec![f64::INFINITY; p.pp()];
    let mut work = vec![0.0; p.pp()];
    let mut critical_path: f64 = 0.0;
    for &(first, count) in &dirs {
        let mut t = 0.0;
        let mut path = 0.0;
        for s in 0..n {
            let r = rank_of(s, first);
            head[r] = head[r].min(t);
            work[r] += count as f64 * (p.f[s] + p.b[s] + p.w[s]);
            let hop = if s + 1 < n {
                delay(s, s + 1, first)
            } else {
                0.0
            };
            t += p.f[s] + hop;
            path += p.f[s] + p.b[s] + 2.0 * hop;
        }
        critical_path = critical_path.max(path + p.w.first().copied().unwrap_or(0.0));
    }
    let rank_work = (0..p.pp())
        .map(|r| {
            if head[r].is_finite() {
                head[r] + work[r]
            } else {
                0.0
            }
        })
        .fold(0.0, f64::max);
    Bound {
        value: rank_work.max(critical_path),
        rank_work,
        critical_path,
    }
}
