//! Fitting candidates over the memory limit with the memory levers (offload, recompute;
//! [`levers::fit`]): the tuned scheduler's extra plans for them, and the fastest candidates
//! over the limit fitted, fastest first, in batches.

use crate::build::{build, finish, rebuild_builtin, Built, Recipe};
use crate::candidates::{layouts_for, tuned_placements};
use crate::greedy;
use crate::levers;
use crate::problem::Problem;
use crate::request::{LeverReport, TuneRequest};
use crate::search::best_plan_with;
use pipec_compiler::target::Levers;
use pipec_ir::verify;
use pipec_schedules::Placement;

/// The tuned scheduler's plans for fitting with levers (small instances only,
/// [`LEVER_PLAN_OPS`]): on every
/// placement it plans (the loops with 3 and 4 chunks too, as PipeOffload's grouped schedule
/// uses), on the balanced split, without the limit and under 1.5 and 2 times it. An order
/// planned against the real limit is slow; one planned without a limit is the fastest but
/// defers weight gradients, and activations waiting for theirs cannot leave the device; the
/// budgets between give the planner orders that hold fewer (on PipeOffload's grid they are
/// the ones fitted at copies of 2 forwards).
pub(crate) fn lever_plans(req: &TuneRequest, user_stages: Option<usize>, limit: f64) -> Vec<Built> {
    if 3 * 2 * req.pp as u64 * req.microbatches as u64 > LEVER_PLAN_OPS {
        return Vec::new();
    }
    let mut placements = tuned_placements(req.pp, req.microbatches, user_stages);
    if user_stages.is_none() {
        placements.extend([Placement::looped(req.pp, 3), Placement::looped(req.pp, 4)]);
    }
    let mut recipes: Vec<Recipe> = Vec::new();
    for pl in placements {
        if req.target.placement_refusal(&pl).is_some() {
            continue;
        }
        let Some(layout) = layouts_for(req, &pl).into_iter().next() else {
            continue;
        };
        for budget in [None, Some(2.0 * limit), Some(1.5 * limit)] {
            let p = Problem::new(&req.model, &layout, pl.clone(), req.microbatches, budget);
            // Without a limit the quick heuristics (that order is rarely the one fitted, and
            // the full set changed no result on PipeOffload's grid); under the budgets every
            // heuristic.
            let hs = if budget.is_none() {
                greedy::quick_heuristics(&p)
            } else {
                greedy::heuristics_for(&p)
            };
            // The fastest plan, and the fastest whose bwd_W follow their bwd_D (slower as it
            // is, but its activations can leave the device after their backward).
            for hs in [hs, greedy::lever_heuristics(&p)] {
                if let Some((plan, h)) = best_plan_with(&p, hs) {
                    recipes.push(Recipe::Tuned(Box::new((
                        p.clone(),
                        layout.clone(),
                        plan,
                        h,
                    ))));
                }
            }
        }
    }
    // Verified here, as they may win without passing through the levers: an order a timed
    // lowering cannot post without a stream deadlock (two directions between the same pair
    // of ranks at pp = 2) is dropped.
    pipec_ir::par::map(recipes.len(), pipec_ir::par::cores(), |i| {
        let (mut b, program) = build(req, &recipes[i], Some(limit))?;
        verify::verify(&program, &verify::VerifyOptions::default())
            .is_valid()
            .then(|| {
                b.program = Some(program);
                b
            })
    })
    .into_iter()
    .flatten()
    .collect()
}

/// The fastest candidates over the memory limit (faster than every one that fits; at most
/// [`LEVER_CANDIDATES`] of `built`, and every plan of `extra`), fitted with `levers`
/// ([`levers::fit`]) and added as candidates of their own. A plan of `extra` that fits as it
/// is, faster, is added too. Returns the least host peak among fits the host memory limit
/// alone refused, with the candidate it came from (for the refusal when nothing fits).
pub(crate) fn fit_over_limit(
    req: &TuneRequest,
    built: &mut Vec<Built>,
    extra: Vec<Built>,
    limit: f64,
    levers: Levers,
) -> Option<(f64, String)> {
    let host_limit = req.host_limit();
    let over_host: std::sync::Mutex<Option<(f64, String)>> = std::sync::Mutex::new(None);
    let fitting = built
        .iter()
        .filter(|b| b.cand.fits && b.cand.not_runnable.is_none())
        .map(|b| b.cand.makespan)
        .fold(f64::INFINITY, f64::min);
    let mut todo: Vec<usize> = (0..built.len())
        .filter(|&i| {
            let c = &built[i].cand;
            !c.fits && c.not_runnable.is_none() && c.makespan < fitting
        })
        .collect();
    todo.sort_by(|&a, &b| built[a].cand.makespan.total_cmp(&built[b].cand.makespan));
    // The fastest few, and every kind whose row asks for the levers always (PipeOffload's
    // schedule: the order their offload is built for, each bwd_W right after its bwd_D, is
    // often the one that fits, while slower unfitted).
    let offload_kind = |i: &usize| {
        built[*i]
            .spec
            .is_some_and(|s| s.kind.row().tune.levers_always)
    };
    let (kind, rest): (Vec<usize>, Vec<usize>) = todo.into_iter().partition(offload_kind);
    todo = rest;
    todo.truncate(LEVER_CANDIDATES);
    todo.extend(kind);
    let first_extra = built.len();
    for b in extra {
        if b.cand.not_runnable.is_none() && b.cand.makespan < fitting {
            if b.cand.fits {
                built.push(b);
            } else {
                todo.push(built.len());
                built.push(b);
            }
        }
    }
    let fit_one = |i: usize, levers: Levers| -> Option<Built> {
        let b = &built[i];
        // The kept program as it is; a built-in kind dropped while another led, generated again.
        let program = match (&b.program, b.spec) {
            (Some(p), _) => std::borrow::Cow::Borrowed(p),
            (None, Some(spec)) => {
                std::borrow::Cow::Owned(rebuild_builtin(req, &spec, &b.layout, &b.cand)?)
            }
            (None, None) => return None,
        };
        let mut f = match levers::fit(&program, &b.layout, &req.model, limit, host_limit, levers) {
            Ok(f) => f,
            Err(levers::NoFit { host }) => {
                if let Some(h) = host {
                    let mut least = over_host.lock().expect("no panics while held");
                    if least.as_ref().is_none_or(|(x, _)| h < *x) {
                        *least = Some((h, crate::report::describe(&b.cand)));
                    }
                }
                return None;
            }
        };
        // On the request's communicators whatever the levers rebuilt.
        f.program = crate::build::with_groups(req, f.program);
        if !verify::verify(&f.program, &verify::VerifyOptions::default()).is_valid() {
            return None;
        }
        // Its times are the simulator's, not a plan's (copies and recomputes were added).
        let mut nb = finish(
            b.cand.clone(),
            b.layout.clone(),
            None,
            &f.program,
            &req.model,
            Some(limit),
            None,
            req.target,
        )?;
        nb.cand.levers = Some(LeverReport {
            offloaded: f.offloaded,
            recomputed: f.recomputed,
            unfitted_makespan: b.cand.makespan,
        });
        nb.program = Some(f.program);
        Some(nb)
    };
    // Fastest first, a few at a time: fitting never makes a candidate faster (copies can only
    // delay, recomputes add time), so one whose unfitted makespan is already above the best
    // fitted one cannot win and is skipped. Offload alone first, on every candidate (cheap:
    // one plan, one simulation); then recompute and both, which search over checkpoint sets,
    // only where that could still win. The batches do not depend on the machine's threads,
    // so neither does the candidate table.
    let mut by_speed: Vec<usize> = (0..todo.len()).collect();
    by_speed.sort_by(|&a, &b| {
        let (x, y) = (&built[todo[a]].cand, &built[todo[b]].cand);
        x.makespan.total_cmp(&y.makespan).then(a.cmp(&b))
    });
    let mut done: Vec<Option<Built>> = (0..todo.len()).map(|_| None).collect();
    let mut best = f64::INFINITY;
    let copies_only = Levers {
        recompute: false,
        ..levers
    };
    let phases = if levers.offload && levers.recompute {
        vec![copies_only, levers]
    } else {
        vec![levers]
    };
    for (phase, &lv) in phases.iter().enumerate() {
        for batch in by_speed.chunks(FIT_BATCH) {
            let live: Vec<usize> = batch
                .iter()
                .copied()
                .filter(|&k| {
                    let m = built[todo[k]].cand.makespan;
                    if phase == 0 {
                        return m <= best;
                    }
                    // Fitted without loss already: nothing left to gain on it.
                    let lossless = done[k].as_ref().is_some_and(|d| d.cand.makespan <= m);
                    m < best && !lossless
                })
                .collect();
            let out = pipec_ir::par::map(live.len(), pipec_ir::par::cores(), |i| {
                fit_one(todo[live[i]], lv)
            });
            for (k, r) in live.into_iter().zip(out) {
                let Some(nb) = r else { continue };
                if nb.cand.fits && nb.cand.not_runnable.is_none() {
                    best = best.min(nb.cand.makespan);
                }
                if done[k]
                    .as_ref()
                    .is_none_or(|d| nb.cand.makespan < d.cand.makespan)
                {
                    done[k] = Some(nb);
                }
            }
        }
    }
    // The extra plans stay only where they fit as they are; their fitted forms are added.
    let kept: Vec<Built> = built.drain(first_extra..).filter(|b| b.cand.fits).collect();
    built.extend(kept);
    built.extend(done.into_iter().flatten());
    over_host.into_inner().expect("not poisoned")
}

/// The most compute ops ([`lever_plans`] plans 18 orders) for which the tuned scheduler plans
/// extra orders for the levers.
const LEVER_PLAN_OPS: u64 = 6_000;

/// How many candidates over the limit [`fit_over_limit`] tries.
const LEVER_CANDIDATES: usize = 8;

/// Candidates [`fit_over_limit`] fits at once between two checks of the best so far.
const FIT_BATCH: usize = 4;
