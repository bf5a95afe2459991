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
//!
//! Under a memory limit a third ([`with_memory`]): until the first backward can reach rank
//! `r` (at `t0`), the rank can only run forwards, and every forward it starts keeps its
//! activations on the device unless a copy has taken them to the host by then (a copy stream
//! of its own, at the lone copy time) or the forward is checkpointed (which saves no work: its
//! recompute costs the same forward again). So the work done before `t0` is at most the
//! forwards that fit in the limit plus those the copies can free, and the rest of the rank's
//! work comes after `t0`: `t0 + work - min(t0 - head, max f/act * (limit - params + (t0 -
//! head) * max act/copy))`.

use super::problem::Problem;

/// The bound and its two parts.
#[derive(Copy, Clone, Debug, PartialEq, serde::Serialize)]
pub struct Bound {
    pub value: f64,
    /// Most work on one rank, its head start included.
    pub rank_work: f64,
    /// The critical path of one microbatch.
    pub critical_path: f64,
    /// Under a memory limit: the work a rank cannot do before its first backward can arrive,
    /// since the limit and the copy stream bound the forwards it may hold ([`with_memory`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub memory: Option<f64>,
}

/// A stage's rank for microbatch `mb` (bidirectional placements depend on it).
fn rank_of(p: &Problem, s: usize, mb: u32) -> usize {
    p.placement
        .rank_of(pipec_schedules::Task::new(s as u32, mb))
        .index()
}

/// The tensor delay between stages `a` and `b` for microbatch `mb`: none on one rank.
fn hop(p: &Problem, a: usize, b: usize, mb: u32) -> f64 {
    if rank_of(p, a, mb) == rank_of(p, b, mb) {
        0.0
    } else {
        p.comm
    }
}

/// What both bounds read off the first microbatch of each direction walking forward: the
/// directions as (first microbatch, count), each rank's earliest start and total work, and
/// the critical path.
struct Forward {
    dirs: Vec<(u32, u32)>,
    head: Vec<f64>,
    work: Vec<f64>,
    critical_path: f64,
}

fn forward(p: &Problem) -> Forward {
    let n = p.num_stages();
    let m = p.microbatches;
    let dirs: Vec<(u32, u32)> = match p.placement.mirror_from() {
        Some(h) if h < m => vec![(0, h), (h, m - h)],
        _ => vec![(0, m)],
    };
    let mut head = vec![f64::INFINITY; p.pp()];
    let mut work = vec![0.0; p.pp()];
    let mut critical_path: f64 = 0.0;
    for &(first, count) in &dirs {
        let mut t = 0.0;
        let mut path = 0.0;
        for s in 0..n {
            let r = rank_of(p, s, first);
            head[r] = head[r].min(t);
            work[r] += count as f64 * (p.f[s] + p.b[s] + p.w[s]);
            let hop = if s + 1 < n {
                hop(p, s, s + 1, first)
            } else {
                0.0
            };
            t += p.f[s] + hop;
            path += p.f[s] + p.b[s] + 2.0 * hop;
        }
        critical_path = critical_path.max(path + p.w.first().copied().unwrap_or(0.0));
    }
    Forward {
        dirs,
        head,
        work,
        critical_path,
    }
}

/// The bound of a problem. Bidirectional placements (DualPipe) are handled per direction:
/// microbatches from `mirror_from` on run the mirrored pipeline.
pub fn lower_bound(p: &Problem) -> Bound {
    bound_of(p, &forward(p))
}

fn bound_of(p: &Problem, fw: &Forward) -> Bound {
    let rank_work = (0..p.pp())
        .map(|r| {
            if fw.head[r].is_finite() {
                fw.head[r] + fw.work[r]
            } else {
                0.0
            }
        })
        .fold(0.0, f64::max);
    Bound {
        value: rank_work.max(fw.critical_path),
        rank_work,
        critical_path: fw.critical_path,
        memory: None,
    }
}

/// [`lower_bound`] with the memory argument of the module doc for `p`'s limits: `copy[s]` is
/// the time one microbatch's activations of stage `s` take to reach the host alone (`None`
/// without offload). Ranks whose stages keep nothing, or copy in no time, add nothing.
pub fn with_memory(p: &Problem, copy: Option<&[f64]>) -> Bound {
    let fw = forward(p);
    let mut b = bound_of(p, &fw);
    if p.limit.iter().all(|l| l.is_infinite()) {
        return b;
    }
    let n = p.num_stages();
    // Per rank: its stages, and the earliest a backward can start there (the first
    // microbatch of a direction forward to the last stage, then back down to the rank).
    let mut t0 = vec![f64::INFINITY; p.pp()];
    let mut stages: Vec<Vec<usize>> = vec![Vec::new(); p.pp()];
    for &(first, _) in &fw.dirs {
        let mut t = 0.0;
        for s in 0..n {
            let r = rank_of(p, s, first);
            if !stages[r].contains(&s) {
                stages[r].push(s);
            }
            t += p.f[s]
                + if s + 1 < n {
                    hop(p, s, s + 1, first)
                } else {
                    0.0
                };
        }
        // `t` is the end of the last forward; a backward then walks down.
        for s in (0..n).rev() {
            let r = rank_of(p, s, first);
            t0[r] = t0[r].min(t);
            t += p.b[s] + if s > 0 { hop(p, s, s - 1, first) } else { 0.0 };
        }
    }
    let (head, work) = (&fw.head, &fw.work);
    let mut memory: f64 = 0.0;
    for r in 0..p.pp() {
        let room = p.limit[r] - p.param[r];
        if !room.is_finite() || !head[r].is_finite() || stages[r].is_empty() {
            continue;
        }
        let ratio = |num: &dyn Fn(usize) -> f64, den: &dyn Fn(usize) -> f64| {
            stages[r]
                .iter()
                .map(|&s| {
                    let (x, y) = (num(s), den(s));
                    if x == 0.0 {
                        0.0
                    } else if y == 0.0 {
                        f64::INFINITY
                    } else {
                        x / y
                    }
                })
                .fold(0.0, f64::max)
        };
        let work_per_act = ratio(&|s| p.f[s], &|s| p.act[s]);
        let freed_per_time = match copy {
            Some(c) => ratio(&|s| p.act[s], &|s| c.get(s).copied().unwrap_or(0.0)),
            None => 0.0,
        };
        let window = t0[r] - head[r];
        let ahead = if work_per_act.is_infinite() || freed_per_time.is_infinite() {
            window
        } else {
            (work_per_act * (room.max(0.0) + window * freed_per_time)).min(window)
        };
        memory = memory.max(t0[r] + work[r] - ahead);
    }
    b.memory = Some(memory);
    b.value = b.value.max(memory);
    b
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::exact::exact;
    use pipec_schedules::Placement;
    use proptest::prelude::*;

    /// pp = 2, M = 4, f = b = w = 1, one activation of room per rank, no copies, by hand:
    /// rank 0's first backward can start at 3 (F on both stages, B on stage 1), and before
    /// that it may hold one forward (1 unit of its 12), so it ends no earlier than 3 + 11.
    #[test]
    fn memory_bound_by_hand() {
        let p = Problem::from_tables(
            Placement::looped(2, 1),
            4,
            vec![1.0; 2],
            vec![1.0; 2],
            vec![1.0; 2],
            Some(1.0),
        );
        let b = with_memory(&p, None);
        // Rank work: rank 1 starts at 1, then its 12.
        assert_eq!(
            (b.rank_work, b.critical_path, b.memory),
            (13.0, 5.0, Some(14.0))
        );
        assert_eq!(b.value, 14.0);
        // Copies that free an activation per unit of time lift the limit before `t0`: the
        // rank-work bound again.
        assert_eq!(with_memory(&p, Some(&[1.0, 1.0])).value, 13.0);
        // No limit: the plain bound.
        let free = Problem::from_tables(
            Placement::looped(2, 1),
            4,
            vec![1.0; 2],
            vec![1.0; 2],
            vec![1.0; 2],
            None,
        );
        assert_eq!(with_memory(&free, None), lower_bound(&free));
        // The exact optimum (every order, the limit held) is above it.
        let e = exact(&p, None, 5_000_000).unwrap();
        assert!(e.proven && e.makespan >= 14.0, "{}", e.makespan);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(24))]
        /// The bound never exceeds the exact optimum under the limit (branch and bound over
        /// every order of every rank, the verifier's memory rule), on loops and V shapes.
        #[test]
        fn memory_bound_is_below_the_exact_optimum(
            pp in 2u32..=3,
            m in 2u32..=3,
            v in proptest::bool::ANY,
            costs in proptest::collection::vec((0.3f64..2.0, 0.3f64..2.0, 0.2f64..1.5), 6),
            limit in 1u32..=3,
        ) {
            let pl = if v { Placement::v_shape(pp) } else { Placement::looped(pp, 1) };
            let n = pl.num_stages() as usize;
            let p = Problem::from_tables(
                pl,
                m,
                costs[..n].iter().map(|c| c.0).collect(),
                costs[..n].iter().map(|c| c.1).collect(),
                costs[..n].iter().map(|c| c.2).collect(),
                Some(limit as f64),
            );
            let b = with_memory(&p, None);
            if let Some(e) = exact(&p, None, 500_000) {
                if e.proven {
                    prop_assert!(e.makespan >= b.value - 1e-9, "{} < {:?}", e.makespan, b);
                }
            }
        }
    }
}
