//! The tuned scheduler's best plan on one problem: every heuristic of [`greedy`] run (runs
//! that decide alike shared, [`run_all`]), with cutoffs where a known plan bounds them, the
//! best picked and small instances polished; and the least peak memory it reaches
//! ([`min_peak`]).

use crate::bound;
use crate::greedy;
use crate::plan::Plan;
use crate::problem::Problem;

/// The best plan of the tuned scheduler on one problem over every heuristic.
pub fn best_plan(p: &Problem) -> Option<(Plan, greedy::Heuristic)> {
    best_plan_with(p, greedy::heuristics_for(p))
}

/// The best plan over the heuristics `hs`.
pub fn best_plan_with(
    p: &Problem,
    hs: Vec<greedy::Heuristic>,
) -> Option<(Plan, greedy::Heuristic)> {
    best_plan_within(p, hs, None)
}

/// [`best_plan_with`] where one of `hs` is known to plan within `known` (its makespan and
/// peak memory): the others stop as soon as they must end later
/// ([`greedy::schedule_within`]); when `known` meets the lower bound (nothing ends sooner, so
/// the choice below goes by peak memory), also as soon as their peak passes its peak. The
/// margins are above the 1e-9 ties of the choice, so what is dropped could never have been
/// chosen: the result is the same as without the cutoff.
fn best_plan_within(
    p: &Problem,
    hs: Vec<greedy::Heuristic>,
    known: Option<(f64, f64)>,
) -> Option<(Plan, greedy::Heuristic)> {
    let (cutoff, peak_cutoff) = match known {
        Some((m, peak)) => (
            margin(m),
            if m <= bound::lower_bound(p).value + 1e-9 {
                margin(peak)
            } else {
                f64::INFINITY
            },
        ),
        None => (f64::INFINITY, f64::INFINITY),
    };
    let plans = run_all(p, &hs, &vec![Some((cutoff, peak_cutoff)); hs.len()]);
    if known.is_some() && plans.iter().all(Option::is_none) {
        // `known` came from elsewhere than `hs`: plan without it.
        return best_plan_within(p, hs, None);
    }
    pick(p, hs, plans)
}

/// `x` and the margin above it within which the choice may still call a figure a tie.
pub(crate) fn margin(x: f64) -> f64 {
    x + 1e-6 * x.abs().max(1.0)
}

/// [`best_plan_with`] on a large instance whose quick heuristics have already run: `quick`
/// is their best plan, by `hq`, one of `hs`. It stands in for their runs: the other quick
/// heuristics lost to it, so they are not run again. The heuristics before `hq` stop as in
/// [`best_plan_within`]; those after it must beat it, not tie, so when it meets the lower
/// bound they stop once their peak is no longer below its own (most plans tie at the bound
/// and differ only there). The result is the one of [`best_plan_with`].
pub(crate) fn best_plan_after(
    p: &Problem,
    hs: Vec<greedy::Heuristic>,
    quick: Plan,
    hq: greedy::Heuristic,
) -> Option<(Plan, greedy::Heuristic)> {
    let m = quick.makespan;
    let peak = quick.peak.iter().fold(0.0, |a: f64, &x| a.max(x));
    let Some(iq) = hs.iter().position(|h| *h == hq) else {
        return best_plan_within(p, hs, Some((m, peak)));
    };
    let ran = greedy::quick_heuristics(p);
    let at_bound = m <= bound::lower_bound(p).value + 1e-9;
    // Before `hq` a tie wins (it comes first); after it, only a peak below `peak - 1e-9`.
    let (tie, beat) = if at_bound {
        (margin(peak), (peak - 1e-9).next_down())
    } else {
        (f64::INFINITY, f64::INFINITY)
    };
    let cuts: Vec<Option<(f64, f64)>> = (0..hs.len())
        .map(|i| {
            if i == iq || ran.contains(&hs[i]) {
                return None;
            }
            Some((margin(m), if i < iq { tie } else { beat }))
        })
        .collect();
    let mut plans = run_all(p, &hs, &cuts);
    plans[iq] = Some(quick);
    pick(p, hs, plans)
}

/// The choice among the plans of `hs` (same order): the shortest, ties (1e-9) to the smaller
/// peak, then to the earlier heuristic; small instances then polished by local search.
pub(crate) fn pick(
    p: &Problem,
    hs: Vec<greedy::Heuristic>,
    plans: Vec<Option<Plan>>,
) -> Option<(Plan, greedy::Heuristic)> {
    let mut best: Option<(Plan, greedy::Heuristic)> = None;
    for (plan, h) in plans.into_iter().zip(hs) {
        let Some(plan) = plan else { continue };
        let better = match &best {
            None => true,
            Some((b, _)) => {
                let (pm, bm) = (
                    plan.peak.iter().fold(0.0, |a: f64, &x| a.max(x)),
                    b.peak.iter().fold(0.0, |a: f64, &x| a.max(x)),
                );
                plan.makespan < b.makespan - 1e-9
                    || (plan.makespan <= b.makespan + 1e-9 && pm < bm - 1e-9)
            }
        };
        if better {
            best = Some((plan, h));
        }
    }
    // Small instances: polish the best plan by local search (moves of one op), unless it
    // already meets the bound. The budget keeps the work near 2M op visits.
    let ops = 3 * p.num_stages() * p.microbatches as usize;
    if ops <= 1000 {
        if let Some((plan, h)) = best.take() {
            let plan = if plan.makespan > bound::lower_bound(p).value + 1e-9 {
                greedy::improve(p, &plan, (2_000_000 / ops.max(1)).min(20_000))
            } else {
                plan
            };
            best = Some((plan, h));
        }
    }
    best
}

/// [`greedy::schedule_within`] of every heuristic of `hs` with its cutoffs (`None`: not run,
/// no plan), on up to every core ([`pipec_ir::par::cores`]). One run of the list scheduler stands
/// for every heuristic with the same cutoffs that decides alike at each of its events
/// ([`greedy::run`]); a heuristic that decides otherwise is handed back and runs on its own
/// (another thread may take it at once). Each result is exactly its heuristic's own run, so
/// how the runs were shared never shows.
pub(crate) fn run_all(
    p: &Problem,
    hs: &[greedy::Heuristic],
    cuts: &[Option<(f64, f64)>],
) -> Vec<Option<Plan>> {
    use std::sync::{Condvar, Mutex};
    enum St {
        Todo,
        Taken,
        Done(Option<Plan>),
    }
    let state: Mutex<Vec<St>> = Mutex::new(
        cuts.iter()
            .map(|c| {
                if c.is_some() {
                    St::Todo
                } else {
                    St::Done(None)
                }
            })
            .collect(),
    );
    let wake = Condvar::new();
    let key = |i: usize| cuts[i].map(|(c, pc)| (c.to_bits(), pc.to_bits()));
    let work = || loop {
        let (lead, fidx) = {
            let mut st = state.lock().expect("no panics while held");
            let lead = loop {
                if let Some(i) = st.iter().position(|s| matches!(s, St::Todo)) {
                    break i;
                }
                if !st.iter().any(|s| matches!(s, St::Taken)) {
                    return;
                }
                st = wake.wait(st).expect("no panics while held");
            };
            st[lead] = St::Taken;
            let mut fidx = Vec::new();
            if hs[lead].zb.is_none() {
                for j in lead + 1..hs.len() {
                    if matches!(st[j], St::Todo) && hs[j].zb.is_none() && key(j) == key(lead) {
                        st[j] = St::Taken;
                        fidx.push(j);
                    }
                }
            }
            (lead, fidx)
        };
        let followers: Vec<greedy::Heuristic> = fidx.iter().map(|&j| hs[j]).collect();
        let (cutoff, peak_cutoff) = cuts[lead].expect("only heuristics to run are taken");
        let (plan, alive) = greedy::run(p, &hs[lead], &followers, cutoff, peak_cutoff, |j| {
            let mut st = state.lock().expect("no panics while held");
            st[fidx[j]] = St::Todo;
            wake.notify_all();
        });
        let mut st = state.lock().expect("no panics while held");
        for (j, &a) in alive.iter().enumerate() {
            if a {
                st[fidx[j]] = St::Done(plan.clone());
            }
        }
        st[lead] = St::Done(plan);
        wake.notify_all();
    };
    let threads = pipec_ir::par::cores().min(hs.len()).max(1);
    if threads == 1 {
        work();
    } else {
        std::thread::scope(|sc| {
            for _ in 0..threads {
                sc.spawn(work);
            }
        });
    }
    state
        .into_inner()
        .expect("not poisoned")
        .into_iter()
        .map(|s| match s {
            St::Done(plan) => plan,
            _ => unreachable!("every heuristic ran"),
        })
        .collect()
}

/// The least peak memory (largest over ranks) the tuned scheduler reaches on `p`: the
/// smallest limit it can still plan under, by bisection.
pub fn min_peak(p: &Problem) -> Option<f64> {
    let hs: Vec<greedy::Heuristic> = greedy::heuristics()
        .into_iter()
        .filter(|h| h.eager_w < 1.0 && !h.forward_first)
        .collect();
    let under = |limit: f64| -> Option<f64> {
        let mut q = p.clone();
        q.limit = vec![limit; q.pp()];
        hs.iter()
            .filter_map(|h| greedy::schedule(&q, h))
            .map(|plan| plan.peak.iter().fold(0.0, |a: f64, &x| a.max(x)))
            .min_by(f64::total_cmp)
    };
    let mut hi = under(f64::INFINITY)?;
    let mut lo = 0.0f64;
    for _ in 0..30 {
        let mid = (lo + hi) / 2.0;
        match under(mid) {
            Some(x) => hi = x.min(mid),
            None => lo = mid,
        }
        if hi - lo <= 1e-6 * hi.max(1e-9) {
            break;
        }
    }
    Some(hi)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::split;
    use pipec_cost::cost::CostModel;
    use pipec_schedules::Placement;

    /// Shared runs change nothing: [`run_all`] gives every heuristic exactly the plan of its
    /// own [`greedy::schedule_within`] run, on every placement, with and without a memory
    /// limit and comm delay, under infinite, makespan and peak cutoffs (some heuristics not
    /// run at all), on uneven costs.
    #[test]
    fn shared_runs_are_each_heuristics_own() {
        let model = CostModel::parse("t.f=1,t.b=1.3,t.w=0.7,E.f=2,L.f=2.5,p2p=0.2").unwrap();
        let mut checked = 0;
        for pp in [2u32, 4] {
            for m in [4u32, 9] {
                let placements = [
                    Placement::looped(pp, 1),
                    Placement::looped(pp, 2),
                    Placement::v_shape(pp),
                    Placement::bidirectional(pp, m / 2),
                ];
                for pl in placements {
                    let n = pl.num_stages();
                    let layout = split::layout_of(&vec![2; n as usize], 0);
                    for limit in [None, Some(2.5 * pp as f64)] {
                        let p = Problem::new(&model, &layout, pl.clone(), m, limit);
                        let hs = greedy::heuristics_for(&p);
                        let solo = greedy::schedule(&p, &hs[0]).map(|x| x.makespan);
                        let cutoffs = [
                            (f64::INFINITY, f64::INFINITY),
                            (solo.map_or(f64::INFINITY, margin), f64::INFINITY),
                            (f64::INFINITY, 1.5 * pp as f64),
                        ];
                        for (c, pc) in cutoffs {
                            let cuts: Vec<Option<(f64, f64)>> = (0..hs.len())
                                .map(|i| {
                                    (i % 5 != 3)
                                        .then_some((c, if i % 2 == 0 { pc } else { c.min(pc) }))
                                })
                                .collect();
                            let got = run_all(&p, &hs, &cuts);
                            for (i, h) in hs.iter().enumerate() {
                                let want = cuts[i]
                                    .and_then(|(c, pc)| greedy::schedule_within(&p, h, c, pc));
                                assert_eq!(
                                    got[i],
                                    want,
                                    "pp={pp} m={m} {pl:?} {limit:?} {}",
                                    h.name()
                                );
                                checked += 1;
                            }
                        }
                    }
                }
            }
        }
        assert!(checked > 1000, "{checked}");
    }
}
