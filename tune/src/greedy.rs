//! The cost-aware automatic scheduler: list scheduling in the zero-bubble family.
//!
//! Backward is split (`bwd_D`, `bwd_W`). An event-driven simulation runs every rank: whenever a
//! rank is free it starts the ready pass its priority rules rank first, under the real
//! per-stage costs and the tensor delay between ranks; when nothing is ready it idles until
//! something arrives. Forwards run ahead only while the rank's activation memory (weighted by
//! each stage's `act`, parameters subtracted from the limit) and a warmup cap allow; `bwd_W`
//! passes fill what would otherwise be bubbles, or run early when memory runs short. Per stage
//! the passes of each kind run in microbatch order.
//!
//! A [`Heuristic`] fixes the priority rules; [`schedule`] runs one, [`heuristics`] lists the
//! ones `pipec tune` tries (the best is kept). The result's times are exactly those of a list
//! schedule of its orders (each op starts when its rank is free and its inputs exist), which
//! is what the timed lockstep lowering reproduces.

use super::plan::{list_makespan, order_peaks, staircase_applies, Plan};
use super::problem::Problem;
use pipec_schedules::{Compute, Rank, RankOrder, Task};
use std::cmp::Reverse;
use std::collections::BinaryHeap;

/// Priority rules of one run of the list scheduler.
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct Heuristic {
    /// Most forwards in flight (done, `bwd_D` not yet) per rank, as a multiple of the rank's
    /// warmup estimate (the forwards that fit before its first `bwd_D` can arrive);
    /// `f64::INFINITY`: only memory limits them.
    pub cap: f64,
    /// A forward goes before a ready `bwd_D` while the rank is under its cap (warmup first);
    /// otherwise `bwd_D` always goes first (critical path first).
    pub forward_first: bool,
    /// Among ready forwards of several chunks, the deeper stage first (the microbatch nearest
    /// the loss); otherwise the oldest microbatch first.
    pub deep_first: bool,
    /// A `bwd_W` goes before forwards once the rank's activations fill more than this share of
    /// its budget (1: never; `bwd_W` then runs only when nothing else is ready).
    pub eager_w: f64,
    /// One-chunk loop placements only: every rank may hold at most one forward in flight
    /// fewer than the rank before it (1F1B's staircase warmup), the previous rank's allowance
    /// counted after its memory limit. Keeps a free activation slot on the middle ranks
    /// under a tight limit instead of filling every rank's memory during warmup.
    pub staircase: bool,
    /// A `bwd_W` that fills a gap only starts if it ends by the time the rank's next forward
    /// or `bwd_D` input is known to arrive; otherwise the rank idles until then (a short
    /// bubble instead of delaying the critical path by the rest of the `bwd_W`). Without it
    /// the schedule never idles while work is ready.
    pub patient_w: bool,
    /// Every `bwd_W` right after its `bwd_D` (one backward in two passes, as PipeOffload's
    /// grouped schedule runs them): an activation is freed, or may leave for host memory, as
    /// soon as its backward is done instead of waiting on the device for a bubble. For the
    /// orders the offload planner fits ([`super::levers`]).
    pub w_next: bool,
    /// The zero-bubble authors' greedy scheduler with these flags instead of the rules above
    /// ([`super::zb`]; one stage per rank only).
    pub zb: Option<super::zb::Rules>,
}

impl Heuristic {
    pub fn name(&self) -> String {
        if let Some(z) = self.zb {
            return format!(
                "zb{}{}{}",
                if z.bubble_before_first_b {
                    ",warm+"
                } else {
                    ""
                },
                if z.prioritize_b { ",B>F" } else { "" },
                if z.no_bubble_greedy { ",Wgap" } else { "" }
            );
        }
        format!(
            "cap={}{}{}{}{}{}{}",
            if self.cap.is_infinite() {
                "mem".to_string()
            } else {
                pipec_ir::human::num(self.cap)
            },
            if self.forward_first { ",F>B" } else { ",B>F" },
            if self.deep_first { ",deep" } else { "" },
            if self.eager_w < 1.0 {
                format!(",W@{}", pipec_ir::human::num(self.eager_w))
            } else {
                String::new()
            },
            if self.staircase { ",stair" } else { "" },
            if self.patient_w { ",Wfit" } else { "" },
            if self.w_next { ",Wnext" } else { "" }
        )
    }
}

impl Heuristic {
    /// The priority rules in words, for people (`name` is the compact form).
    pub fn describe(&self) -> String {
        if let Some(z) = self.zb {
            let mut s = "the zero-bubble authors' greedy scheduler (sail-sg, zb.py): warmup \
                         forwards until the first input-gradient backward (bwd_D) can arrive"
                .to_string();
            if z.bubble_before_first_b {
                s.push_str(", the last one allowed to end after it");
            }
            s.push_str(
                "; then one forward per stage per round and the bwd_Ds from the last stage; \
                 weight-gradient passes (bwd_W) where they end before the next input arrives \
                 or memory runs short",
            );
            if z.no_bubble_greedy {
                s.push_str(", or fill a gap no longer than the largest bubble so far");
            }
            if z.prioritize_b {
                s.push_str(
                    "; a stage two forwards ahead of the next holds back a forward that would \
                     delay the next stage",
                );
            }
            return s;
        }
        let mut parts = vec![if self.forward_first {
            "warmup forwards before a ready input-gradient backward (bwd_D)".to_string()
        } else {
            "the input-gradient backward (bwd_D) before forwards".to_string()
        }];
        parts.push(if self.cap.is_infinite() {
            "forwards run ahead as far as memory allows".to_string()
        } else {
            format!(
                "forwards in flight capped at {}x the number that fit before the rank's first \
                 backward can arrive",
                pipec_ir::human::num(self.cap)
            )
        });
        parts.push(if self.deep_first {
            "among ready forwards, the deepest stage first".to_string()
        } else {
            "among ready forwards, the oldest microbatch first".to_string()
        });
        parts.push(if self.w_next {
            "each weight-gradient pass (bwd_W) right after its bwd_D".to_string()
        } else if self.eager_w >= 1.0 {
            "weight-gradient passes (bwd_W) fill the bubbles".to_string()
        } else if self.eager_w <= 0.0 {
            "bwd_W before forwards whenever activations are live".to_string()
        } else {
            format!(
                "bwd_W before forwards once activations fill {}% of the memory budget",
                pipec_ir::human::num(self.eager_w * 100.0)
            )
        });
        if self.staircase {
            parts.push(
                "1F1B's staircase warmup (each rank one forward in flight fewer than the one before)"
                    .to_string(),
            );
        }
        if self.patient_w {
            parts.push(
                "a bwd_W fills a gap only if it ends before the next input arrives".to_string(),
            );
        }
        parts.join("; ")
    }
}

/// The heuristics `pipec tune` tries on every placement and split.
pub fn heuristics() -> Vec<Heuristic> {
    let mut v = Vec::new();
    for cap in [0.5, 0.75, 1.0, 1.5, f64::INFINITY] {
        for forward_first in [false, true] {
            for deep_first in [true, false] {
                for eager_w in [1.0, 0.5, 0.0] {
                    for staircase in [false, true] {
                        for patient_w in [false, true] {
                            // Measured against the zero-bubble authors' scheduler
                            // (docs/tune.md): waiting for an input pays with `bwd_D` first,
                            // and the staircase with patient `bwd_W`s; the other
                            // combinations never won and would only cost time.
                            if (patient_w && forward_first) || (staircase && !patient_w) {
                                continue;
                            }
                            v.push(Heuristic {
                                cap,
                                forward_first,
                                deep_first,
                                eager_w,
                                staircase,
                                patient_w,
                                w_next: false,
                                zb: None,
                            });
                        }
                    }
                }
            }
        }
    }
    // Last, so that on a tie pipec's own rules keep the plan.
    v.extend(super::zb::Rules::all().into_iter().map(|z| Heuristic {
        cap: f64::INFINITY,
        forward_first: false,
        deep_first: true,
        eager_w: 1.0,
        staircase: false,
        patient_w: false,
        w_next: false,
        zb: Some(z),
    }));
    v
}

/// The heuristics that can differ on `p`: the deep-first tie break only matters where a rank
/// runs several lanes, the early `bwd_W` only under a memory limit.
pub fn heuristics_for(p: &Problem) -> Vec<Heuristic> {
    let lanes = p.lanes();
    let mut per_rank = vec![0usize; p.pp()];
    for l in &lanes {
        per_rank[l.rank] += 1;
    }
    let multi = per_rank.iter().any(|&c| c > 1);
    let limited = p.limit.iter().any(|l| l.is_finite());
    let stair = staircase_applies(p);
    heuristics()
        .into_iter()
        .filter(|h| (multi || h.deep_first) && (limited || h.eager_w >= 1.0))
        .filter(|h| stair || !h.staircase)
        .filter(|h| h.zb.is_none() || super::zb::applies(p))
        .collect()
}

/// Heuristics whose orders the offload planner can fit ([`Heuristic::w_next`]), for the
/// memory levers' extra plans: the quick ones' caps and priorities with each `bwd_W` right
/// after its `bwd_D`.
pub fn lever_heuristics(p: &Problem) -> Vec<Heuristic> {
    let mut v: Vec<Heuristic> = heuristics_for(p)
        .into_iter()
        .filter(|h| h.eager_w >= 1.0 && !h.staircase && !h.patient_w && h.zb.is_none())
        .map(|h| Heuristic { w_next: true, ..h })
        .collect();
    v.dedup_by(|a, b| a == b);
    v
}

/// A few heuristics that are usually among the best, to rank candidate splits quickly.
pub fn quick_heuristics(p: &Problem) -> Vec<Heuristic> {
    heuristics_for(p)
        .into_iter()
        .filter(|h| !h.forward_first && (h.cap == 1.0 || h.cap == 1.5 || h.cap.is_infinite()))
        .filter(|h| h.eager_w < 1.0 || p.limit.iter().all(|l| l.is_infinite()))
        .filter(|h| h.deep_first && !h.staircase && !h.patient_w && h.zb.is_none())
        .collect()
}

/// Rank `r` wakes at a time: a min-heap entry on (time as [`f64::total_cmp`] orders it,
/// rank), packed into one integer (the time's order-preserving bits above the rank), which
/// the heap compares in one step.
#[derive(Copy, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct Event(Reverse<u128>);

impl Event {
    #[inline]
    fn new(t: f64, r: usize) -> Self {
        let b = t.to_bits();
        let k = if b >> 63 == 0 { b | 1 << 63 } else { !b };
        Event(Reverse((k as u128) << 32 | r as u32 as u128))
    }

    #[inline]
    fn get(self) -> (f64, usize) {
        let x = self.0 .0;
        let (k, r) = ((x >> 32) as u64, x as u32);
        let b = if k >> 63 == 1 { k & !(1 << 63) } else { !k };
        (f64::from_bits(b), r as usize)
    }
}

const UNSET: f64 = f64::INFINITY;

/// Forwards each rank can run before its first `bwd_D` can arrive (at least 1), from the
/// as-soon-as-possible times of each direction's first microbatch.
pub fn warmup_estimate(p: &Problem) -> Vec<f64> {
    let n = p.num_stages();
    let pp = p.pp();
    let mut first = vec![f64::INFINITY; pp];
    let mut first_b = vec![f64::INFINITY; pp];
    let mut fsum = vec![0.0; pp];
    let mut lanes = vec![0usize; pp];
    for (lo, _) in p.directions() {
        let mut fs = vec![0.0; n];
        for s in 1..n {
            fs[s] = fs[s - 1] + p.f[s - 1] + p.delay_mb(s - 1, s, lo);
        }
        let mut bs = vec![0.0; n];
        bs[n - 1] = fs[n - 1] + p.f[n - 1];
        for s in (0..n - 1).rev() {
            bs[s] = (bs[s + 1] + p.b[s + 1] + p.delay_mb(s + 1, s, lo)).max(fs[s] + p.f[s]);
        }
        for s in 0..n {
            let r = p.rank_of(s, lo);
            first[r] = first[r].min(fs[s]);
            first_b[r] = first_b[r].min(bs[s]);
            fsum[r] += p.f[s];
            lanes[r] += 1;
        }
    }
    (0..pp)
        .map(|r| {
            let mean_f = fsum[r] / lanes[r].max(1) as f64;
            if mean_f <= 0.0 || !first[r].is_finite() {
                (p.microbatches as usize * lanes[r].max(1)) as f64
            } else {
                ((first_b[r] - first[r]) / mean_f).max(1.0)
            }
        })
        .collect()
}

/// Run the list scheduler with one heuristic. `None` when the memory limit leaves some rank
/// unable to move (no order under these rules fits).
pub fn schedule(p: &Problem, h: &Heuristic) -> Option<Plan> {
    schedule_within(p, h, f64::INFINITY, f64::INFINITY)
}

/// [`schedule`], given up (`None`) as soon as the plan is sure to end after `cutoff`: at
/// event time `t` no rank can end before `max(t, free) + its remaining work` (events come in
/// time order, so nothing starts before `t`), or as soon as some rank's peak memory
/// (activations plus parameters) passes `peak_cutoff`. Branch and bound for the tuner: a
/// heuristic that cannot beat a plan already in hand stops early instead of running to its
/// end.
pub fn schedule_within(p: &Problem, h: &Heuristic, cutoff: f64, peak_cutoff: f64) -> Option<Plan> {
    run(p, h, &[], cutoff, peak_cutoff, |_| {}).0
}

/// What one heuristic does at one event of a run: nothing, idle until a time (its bits), or
/// run a pass (0 forward, 1 `bwd_D`, 2 `bwd_W`) of a lane.
#[derive(Copy, Clone, PartialEq, Eq)]
enum Action {
    Nothing,
    Idle(u64),
    Run(u8, usize),
}

/// The per-rank forward caps of `h` (its multiple of the warmup estimate, the staircase
/// applied).
fn caps(
    p: &Problem,
    h: &Heuristic,
    lanes: &[super::problem::Lane],
    reserve: &[f64],
    budget: &[f64],
) -> Vec<usize> {
    let n = p.num_stages();
    let warm = warmup_estimate(p);
    let mut cap: Vec<usize> = warm
        .iter()
        .map(|&w| {
            if h.cap.is_infinite() {
                usize::MAX
            } else {
                ((w * h.cap).round() as usize).max(1)
            }
        })
        .collect();
    if h.staircase && staircase_applies(p) {
        // Stage order along the pipeline; every rank holds one lane.
        let mut prev = usize::MAX;
        for s in 0..n {
            let li = lanes
                .iter()
                .position(|l| l.stage == s)
                .expect("one lane per stage");
            let r = lanes[li].rank;
            let room = budget[r] - reserve[li];
            let by_mem = if p.act[s] > 0.0 && room.is_finite() {
                ((room + 1e-9) / p.act[s]).floor().max(0.0) as usize
            } else {
                usize::MAX
            };
            let mut c = cap[r].min(by_mem);
            if s > 0 {
                c = c.min(prev.saturating_sub(1));
            }
            cap[r] = c.max(1);
            prev = cap[r];
        }
    }
    cap
}

/// The list scheduler's run of `h` that also follows `followers` (heuristics of the same
/// cutoffs, none of the zero-bubble authors' rules): at every event it works out what each
/// follower would do in the same state, and drops a follower (calling `diverged` with its
/// index) at the first event where that differs. Up to then the follower's run is this run,
/// event for event (same state, same heap, same cutoff checks), so every follower still
/// following at the end has exactly this run's result: one run stands for several
/// heuristics that decide alike (most differ only in tie breaks that never arise). Returns
/// the result and which followers followed to the end.
pub(crate) fn run(
    p: &Problem,
    h: &Heuristic,
    followers: &[Heuristic],
    cutoff: f64,
    peak_cutoff: f64,
    mut diverged: impl FnMut(usize),
) -> (Option<Plan>, Vec<bool>) {
    let mut alive = vec![true; followers.len()];
    // The zero-bubble authors' rules (their own clock, [`super::zb`]) run to the end: they
    // are cheap next to the list scheduler and a cut run would hide their plan.
    if let Some(z) = h.zb {
        for (j, a) in alive.iter_mut().enumerate() {
            *a = false;
            diverged(j);
        }
        return (super::zb::schedule(p, z), alive);
    }
    let n = p.num_stages();
    let m = p.microbatches as usize;
    let pp = p.pp();
    let lanes = p.lanes();
    let mut local: Vec<Vec<usize>> = vec![Vec::new(); pp];
    for (i, l) in lanes.iter().enumerate() {
        local[l.rank].push(i);
    }
    // Memory a forward of each lane must leave free: the activations of the rank's later
    // stages in the same direction, so that the microbatch can still pass them.
    let reserve: Vec<f64> = lanes
        .iter()
        .map(|l| {
            local[l.rank]
                .iter()
                .map(|&j| &lanes[j])
                .filter(|o| o.dir == l.dir && o.stage > l.stage)
                .map(|o| p.act[o.stage])
                .sum()
        })
        .collect();
    let budget: Vec<f64> = (0..pp).map(|r| p.budget(r)).collect();
    let cap = caps(p, h, &lanes, &reserve, &budget);
    let fcaps: Vec<Vec<usize>> = followers
        .iter()
        .map(|f| caps(p, f, &lanes, &reserve, &budget))
        .collect();
    // Per lane, fixed over its microbatches (one direction): the delays from the stage
    // before and after, and the ranks of those stages.
    let lane_info: Vec<(f64, f64, usize, usize)> = lanes
        .iter()
        .map(|l| {
            let s = l.stage;
            (
                if s == 0 {
                    0.0
                } else {
                    p.delay_mb(s - 1, s, l.lo)
                },
                if s + 1 == n {
                    0.0
                } else {
                    p.delay_mb(s + 1, s, l.lo)
                },
                if s + 1 < n {
                    p.rank_of(s + 1, l.lo)
                } else {
                    usize::MAX
                },
                if s > 0 {
                    p.rank_of(s - 1, l.lo)
                } else {
                    usize::MAX
                },
            )
        })
        .collect();
    let mut fend = vec![UNSET; n * m];
    let mut bend = vec![UNSET; n * m];
    // Next microbatch of each pass kind per lane (global ids).
    let mut nf: Vec<usize> = lanes.iter().map(|l| l.lo).collect();
    let mut nb = nf.clone();
    let mut nw = nf.clone();
    let mut free = vec![0.0f64; pp];
    let mut live = vec![0.0f64; pp];
    let mut peak = vec![0.0f64; pp];
    let mut inflight = vec![0usize; pp];
    let mut orders: Vec<Vec<Compute>> = local
        .iter()
        .map(|ls| Vec::with_capacity(ls.len() * m * 3))
        .collect();
    // Per rank: what its last backward frees when it ends (`bwd_D`: `act - act_w`; `bwd_W`:
    // `act_w`), and when.
    let mut pending_free: Vec<Option<(f64, f64)>> = vec![None; pp];
    let total = n * m * 3;
    let mut done = 0usize;
    let mut heap = BinaryHeap::with_capacity(pp * 4);
    for r in 0..pp {
        heap.push(Event::new(0.0, r));
    }
    let mut makespan = 0.0f64;
    let eps = 1e-9;
    // Work left per rank, for the cutoff's bound.
    let mut rem = vec![0.0f64; pp];
    if cutoff.is_finite() {
        for l in &lanes {
            rem[l.rank] += (l.hi - l.lo) as f64 * (p.f[l.stage] + p.b[l.stage] + p.w[l.stage]);
        }
    }
    let mut following = followers.len();
    let mut events = 0u32;
    while let Some(ev) = heap.pop() {
        let (t, r) = ev.get();
        if free[r] > t {
            continue;
        }
        events = events.wrapping_add(1);
        if cutoff.is_finite() && events.is_multiple_of(256) {
            let bound = (0..pp)
                .map(|q| free[q].max(t) + rem[q])
                .fold(0.0f64, f64::max);
            if bound > cutoff {
                return (None, alive);
            }
        }
        // A backward that ended frees its part when the rank is next free.
        if let Some((amount, end)) = pending_free[r] {
            if end <= t {
                live[r] -= amount;
                pending_free[r] = None;
            }
        }
        // Ready forwards that fit, best by each tie break (deep first, oldest first); the
        // rank's cap, the same for all of them, is applied per heuristic below.
        let mut f_deep: Option<usize> = None;
        let mut f_old: Option<usize> = None;
        let mut best_b: Option<usize> = None;
        let mut best_w: Option<usize> = None;
        // The earliest later time a forward that fits (`nr_f`) or a `bwd_D` (`nr_b`) of this
        // rank is known to become ready.
        let mut nr_f = f64::INFINITY;
        let mut nr_b = f64::INFINITY;
        for &li in &local[r] {
            let l = &lanes[li];
            let s = l.stage;
            let (din, dback, _, _) = lane_info[li];
            let mb = nf[li];
            if mb < l.hi && live[r] + p.act[s] + reserve[li] <= budget[r] + eps {
                let ready = if s == 0 {
                    0.0
                } else {
                    fend[(s - 1) * m + mb] + din
                };
                if ready > t + eps {
                    nr_f = nr_f.min(ready);
                } else {
                    let deeper = |o: usize| {
                        (s, usize::MAX - (mb - l.lo))
                            > (lanes[o].stage, usize::MAX - (nf[o] - lanes[o].lo))
                    };
                    if f_deep.is_none_or(deeper) {
                        f_deep = Some(li);
                    }
                    let older = |o: usize| {
                        (mb - l.lo, usize::MAX - s)
                            < (nf[o] - lanes[o].lo, usize::MAX - lanes[o].stage)
                    };
                    if f_old.is_none_or(older) {
                        f_old = Some(li);
                    }
                }
            }
            let mb = nb[li];
            if mb < nf[li] {
                let fe = fend[s * m + mb];
                let ready = if s + 1 == n {
                    fe
                } else {
                    fe.max(bend[(s + 1) * m + mb] + dback)
                };
                if ready > t + eps {
                    nr_b = nr_b.min(ready);
                }
                if ready <= t + eps {
                    let better = match best_b {
                        None => true,
                        Some(o) => {
                            (mb - l.lo, usize::MAX - s)
                                < (nb[o] - lanes[o].lo, usize::MAX - lanes[o].stage)
                        }
                    };
                    if better {
                        best_b = Some(li);
                    }
                }
            }
            let mb = nw[li];
            if mb < nb[li] && bend[s * m + mb] <= t + eps {
                let better = match best_w {
                    None => true,
                    Some(o) => mb - l.lo < nw[o] - lanes[o].lo,
                };
                if better {
                    best_w = Some(li);
                }
            }
        }
        // What heuristic `h` (with caps `cap`) does now.
        let decide = |h: &Heuristic, cap: &[usize]| -> Action {
            let open = inflight[r] < cap[r];
            let best_f = if !open {
                None
            } else if h.deep_first {
                f_deep
            } else {
                f_old
            };
            let next_ready = if open { nr_f.min(nr_b) } else { nr_b };
            let mem_tight =
                budget[r].is_finite() && h.eager_w < 1.0 && live[r] > h.eager_w * budget[r];
            let pick = if h.w_next && best_w.is_some() {
                best_w.map(|s| (2, s))
            } else if mem_tight && best_w.is_some() && best_b.is_none() {
                best_w.map(|s| (2, s))
            } else if h.forward_first && best_f.is_some() {
                best_f.map(|s| (0, s))
            } else if let Some(s) = best_b {
                Some((1, s))
            } else if mem_tight && best_w.is_some() {
                best_w.map(|s| (2, s))
            } else if let Some(s) = best_f {
                Some((0, s))
            } else {
                best_w.map(|s| (2, s))
            };
            let Some((kind, li)) = pick else {
                return Action::Nothing;
            };
            let s = lanes[li].stage;
            if h.patient_w && kind == 2 && !mem_tight && t + p.w[s] > next_ready + eps {
                // Idle until the input arrives (its event is already queued).
                return Action::Idle(next_ready.to_bits());
            }
            Action::Run(kind, li)
        };
        let action = decide(h, &cap);
        if following > 0 {
            for (j, f) in followers.iter().enumerate() {
                if alive[j] && decide(f, &fcaps[j]) != action {
                    alive[j] = false;
                    following -= 1;
                    diverged(j);
                }
            }
        }
        let (kind, li) = match action {
            Action::Nothing => continue,
            Action::Idle(at) => {
                heap.push(Event::new(f64::from_bits(at), r));
                continue;
            }
            Action::Run(kind, li) => (kind, li),
        };
        let s = lanes[li].stage;
        let (_, _, next_rank, prev_rank) = lane_info[li];
        let start = t;
        let end;
        match kind {
            0 => {
                let mb = nf[li];
                end = start + p.f[s];
                fend[s * m + mb] = end;
                nf[li] += 1;
                live[r] += p.act[s];
                peak[r] = peak[r].max(live[r]);
                if peak[r] + p.param[r] > peak_cutoff {
                    return (None, alive);
                }
                inflight[r] += 1;
                orders[r].push(Compute::Fwd(Task::new(s as u32, mb as u32)));
                if s + 1 < n {
                    wake(&mut heap, &free, t, next_rank, r, end + p.comm);
                }
            }
            1 => {
                let mb = nb[li];
                end = start + p.b[s];
                bend[s * m + mb] = end;
                nb[li] += 1;
                inflight[r] -= 1;
                pending_free[r] = Some((p.freed_at_d(s), end));
                orders[r].push(Compute::BwdD(Task::new(s as u32, mb as u32)));
                if s > 0 {
                    wake(&mut heap, &free, t, prev_rank, r, end + p.comm);
                }
            }
            _ => {
                let mb = nw[li];
                end = start + p.w[s];
                nw[li] += 1;
                pending_free[r] = Some((p.act_w[s], end));
                orders[r].push(Compute::BwdW(Task::new(s as u32, mb as u32)));
            }
        }
        free[r] = end;
        rem[r] -= end - start;
        makespan = makespan.max(end);
        done += 1;
        heap.push(Event::new(end, r));
    }
    if done < total {
        return (None, alive);
    }
    let orders = orders
        .into_iter()
        .enumerate()
        .map(|(r, ops)| RankOrder {
            rank: Rank(r as u32),
            warmup: ops.iter().take_while(|o| o.is_forward()).count() as u32,
            ops,
        })
        .collect();
    let peak = peak.iter().zip(&p.param).map(|(a, b)| a + b).collect();
    (
        Some(Plan {
            orders,
            makespan,
            peak,
        }),
        alive,
    )
}

/// Queue the arrival of a tensor at rank `q` (sent by `r` at time `now`) for time `at`, unless
/// `q` is busy until then: its own end event (queued when its op started, still ahead since
/// it ends after `now`) wakes it no earlier than the arrival, and the arrival's event would
/// only be popped and dropped as stale. Keeps the heap to the events that do something.
#[inline]
fn wake(heap: &mut BinaryHeap<Event>, free: &[f64], now: f64, q: usize, r: usize, at: f64) {
    if q != r && !(at <= free[q] && free[q] > now) {
        heap.push(Event::new(at, q));
    }
}

/// Local search on a plan: move one op of one rank up to 8 places earlier or later and keep
/// the move when the list schedule gets shorter within the memory limit (orders that cannot
/// run are rejected by the list schedule itself), until no move helps or `max_evals`
/// schedules have been evaluated.
pub fn improve(p: &Problem, plan: &Plan, max_evals: usize) -> Plan {
    const WINDOW: usize = 8;
    let mut orders = plan.orders.clone();
    let mut best = plan.makespan;
    let mut evals = 0;
    let mut improved = true;
    while improved && evals < max_evals {
        improved = false;
        for r in 0..orders.len() {
            let n = orders[r].ops.len();
            for i in 0..n {
                for j in i.saturating_sub(WINDOW)..(i + WINDOW + 1).min(n) {
                    if j == i || evals >= max_evals {
                        continue;
                    }
                    let op = orders[r].ops.remove(i);
                    orders[r].ops.insert(j, op);
                    evals += 1;
                    let keep = order_peaks(p, &orders).1
                        && list_makespan(p, &orders).is_some_and(|m| {
                            if m < best - 1e-9 {
                                best = m;
                                true
                            } else {
                                false
                            }
                        });
                    if keep {
                        improved = true;
                    } else {
                        let op = orders[r].ops.remove(j);
                        orders[r].ops.insert(i, op);
                    }
                }
            }
        }
    }
    for o in &mut orders {
        o.warmup = o.ops.iter().take_while(|op| op.is_forward()).count() as u32;
    }
    let peak = order_peaks(p, &orders).0;
    Plan {
        orders,
        makespan: best,
        peak,
    }
}

#[cfg(test)]
mod tests {
    use super::Event;

    /// The integer key orders events as `f64::total_cmp` then rank did, and gives both back.
    #[test]
    fn event_key_orders_as_total_cmp() {
        let times = [
            f64::NEG_INFINITY,
            -3.5,
            -0.0,
            0.0,
            1e-300,
            0.7,
            1.0,
            6205.000000001,
            f64::INFINITY,
        ];
        for &a in &times {
            for &b in &times {
                for (ra, rb) in [(0usize, 1usize), (1, 0), (3, 3)] {
                    let want = b.total_cmp(&a).then(rb.cmp(&ra));
                    assert_eq!(Event::new(a, ra).cmp(&Event::new(b, rb)), want, "{a} {b}");
                }
                let (t, r) = Event::new(a, 7).get();
                assert_eq!((t.to_bits(), r), (a.to_bits(), 7));
            }
        }
    }
}
