//! What the tuner weighs: the kinds a request allows, the placements and layer splits the
//! tuned scheduler plans on (ranked first on large instances), the tuned scheduler's best
//! plan on each, and the built-in kinds with their vpp and group-size choices, each as a
//! [`Recipe`] to build.

use crate::bound;
use crate::build::{placement_name, Recipe};
use crate::greedy;
use crate::plan::Plan;
use crate::problem::Problem;
use crate::request::{CandidateKind, TuneError, TuneRequest};
use crate::search::{best_plan_after, best_plan_with, margin, pick, run_all};
use crate::split;
use pipec_schedules::layout::Layout;
use pipec_schedules::{ChunkRule, Placement, ScheduleKind, ScheduleSpec, SearchQuery};

/// The kinds a request weighs (`tuned` and the built-in kinds), after `kinds` and
/// `exclude_kinds`; an unknown name is an error.
pub(crate) fn allowed_kinds(req: &TuneRequest) -> Result<Vec<CandidateKind>, TuneError> {
    let all = CandidateKind::all();
    for k in req.kinds.iter().flatten().chain(&req.exclude_kinds) {
        if !all.iter().any(|a| a.name() == k) {
            let names: Vec<&str> = all.iter().map(|a| a.name()).collect();
            return Err(TuneError::Kind(k.clone(), names.join(", ")));
        }
    }
    let named = |names: &[String], k: &CandidateKind| names.iter().any(|n| n == k.name());
    Ok(all
        .into_iter()
        .filter(|k| req.kinds.as_ref().is_none_or(|ks| named(ks, k)))
        .filter(|k| !named(&req.exclude_kinds, k))
        .collect())
}

/// The placements the tuned scheduler tries, and the stage count they need.
pub(crate) fn tuned_placements(
    pp: u32,
    microbatches: u32,
    stages: Option<usize>,
) -> Vec<Placement> {
    let mut v = vec![
        Placement::looped(pp, 1),
        Placement::looped(pp, 2),
        Placement::v_shape(pp),
    ];
    // DualPipe's two directions, with pipec's own order: half the microbatches enter at
    // each end (every rank holds two stages' parameters).
    if pp >= 2 && microbatches >= 2 {
        v.push(Placement::bidirectional(pp, microbatches / 2));
    }
    if let Some(s) = stages {
        // A user layout with more chunks per rank: the loop with that many.
        let vpp = s as u32 / pp.max(1);
        if vpp > 2 {
            v.push(Placement::looped(pp, vpp));
        }
        v.retain(|p| p.num_stages() as usize == s);
    }
    v
}

/// The layouts to weigh on `placement`: the user's when kept, else the candidate splits.
pub(crate) fn layouts_for(req: &TuneRequest, placement: &Placement) -> Vec<Layout> {
    if let (Some(l), false) = (&req.layout, req.rebalance) {
        return if l.stages.len() == placement.num_stages() as usize {
            vec![l.clone()]
        } else {
            Vec::new()
        };
    }
    let (n, mtp) = req.model_size();
    split::candidates(&req.model, placement, n, mtp)
        .into_iter()
        .map(|c| split::layout_of(&c, mtp))
        .collect()
}

/// The built-in specs to weigh: every kind with its vpp and group-size choices.
fn builtin_specs(req: &TuneRequest, stages: Option<usize>) -> Vec<ScheduleSpec> {
    let (pp, m) = (req.pp, req.microbatches);
    let mut out = Vec::new();
    // Large instances weigh the common choices only (vpp 2, Megatron's group size), to stay
    // within seconds; small ones every vpp up to 4 and more group sizes: each kind's row says
    // which (`KindRow::search_space`). With lengths every schedule is simulated once per
    // microbatch order (`order::candidates`), so the size counts the orders too: a job that
    // plans every step (per-step planning, docs/tune.md) stays within its time.
    let orders = if req.lengths.is_some() {
        crate::order::RULES.len() as u64
    } else {
        1
    };
    let q = SearchQuery {
        pp,
        microbatches: m,
        big: pp as u64 * m as u64 * orders > 16_384,
        memory_limit: req.memory_limit.is_some(),
    };
    for kind in ScheduleKind::ALL {
        let Some(space) = kind.row().search_space(&q) else {
            continue;
        };
        for vpp in space.vpps {
            for &g in &space.groups {
                let spec = ScheduleSpec {
                    group_size: g,
                    ..ScheduleSpec::new(kind, pp, vpp, m)
                };
                if spec.validate(&req.limits).is_err() {
                    continue;
                }
                let s = spec.num_stages() as usize;
                if stages.is_some_and(|n| n != s) {
                    continue;
                }
                out.push(spec);
            }
        }
    }
    out
}

/// A placement and split to plan, with the best plan of the quick heuristics on it (large
/// instances) and its heuristic.
type Job = (Placement, Layout, Option<(Plan, greedy::Heuristic)>);

/// The placements and splits the tuned scheduler plans on (none unless `tuned` is allowed):
/// every placement the target runs x its splits; and the placements not planned on because
/// the target cannot run them, as (name, reason).
#[allow(clippy::type_complexity)]
pub(crate) fn tuned_jobs(
    req: &TuneRequest,
    allowed: &[CandidateKind],
    user_stages: Option<usize>,
) -> (Vec<(Placement, Layout)>, Vec<(String, String)>) {
    let mut jobs: Vec<(Placement, Layout)> = Vec::new();
    let mut skipped: Vec<(String, String)> = Vec::new();
    if allowed.contains(&CandidateKind::Tuned) {
        for pl in tuned_placements(req.pp, req.microbatches, user_stages) {
            if let Some(why) = req.target.placement_refusal(&pl) {
                let vpp = pl.num_stages() / req.pp;
                skipped.push((format!("tuned {} vpp={vpp}", placement_name(&pl)), why));
                continue;
            }
            for l in layouts_for(req, &pl) {
                jobs.push((pl.clone(), l));
            }
        }
    }
    (jobs, skipped)
}

/// The jobs to plan in full. Large instances: the splits of each placement ranked with a few
/// heuristics first, every heuristic then run on the best split only (with that best plan
/// of the quick ones); small ones: every job as it is.
pub(crate) fn rank_splits(req: &TuneRequest, jobs: &[(Placement, Layout)]) -> Vec<Job> {
    let limit = req.limit();
    let per_job_ops = 3 * 2 * req.pp as u64 * req.microbatches as u64;
    if per_job_ops <= 60_000 {
        return jobs
            .iter()
            .map(|(p, l)| (p.clone(), l.clone(), None))
            .collect();
    }
    let mut keep: Vec<Job> = Vec::new();
    for (pl, layout) in jobs {
        let p = Problem::new(&req.model, layout, pl.clone(), req.microbatches, limit);
        let kept = keep.iter().position(|k| k.0 == *pl);
        // Only a shorter plan replaces the placement's split kept so far: runs that must
        // end later stop, and a split whose lower bound is above that is not planned.
        let cutoff = kept
            .and_then(|i| keep[i].2.as_ref())
            .map_or(f64::INFINITY, |(plan, _)| margin(plan.makespan));
        if bound::lower_bound(&p).value > cutoff {
            continue;
        }
        let hs = greedy::quick_heuristics(&p);
        let plans = run_all(&p, &hs, &vec![Some((cutoff, f64::INFINITY)); hs.len()]);
        let best = pick(&p, hs, plans);
        let score = best.as_ref().map_or(f64::INFINITY, |b| b.0.makespan);
        match kept {
            Some(i) if score < keep[i].2.as_ref().map_or(f64::INFINITY, |b| b.0.makespan) => {
                keep[i] = (pl.clone(), layout.clone(), best)
            }
            Some(_) => {}
            None => keep.push((pl.clone(), layout.clone(), best)),
        }
    }
    keep
}

/// The tuned scheduler's best plan on each job, over every heuristic.
pub(crate) fn tuned_recipes(req: &TuneRequest, selected: Vec<Job>) -> Vec<Recipe> {
    let mut recipes = Vec::new();
    for (pl, layout, quick) in selected {
        let p = Problem::new(
            &req.model,
            &layout,
            pl.clone(),
            req.microbatches,
            req.limit(),
        );
        let hs = greedy::heuristics_for(&p);
        let best = match quick {
            // The quick heuristics are among these: their best plan bounds the others.
            Some((plan, h)) => best_plan_after(&p, hs, plan, h),
            None => best_plan_with(&p, hs),
        };
        if let Some((plan, h)) = best {
            recipes.push(Recipe::Tuned(Box::new((p, layout, plan, h))));
        }
    }
    recipes
}

/// The built-in kinds allowed (none unless the request weighs them), each on the first
/// candidate split (the balanced one) of its placement.
pub(crate) fn builtin_recipes(
    req: &TuneRequest,
    allowed: &[CandidateKind],
    user_stages: Option<usize>,
) -> Vec<Recipe> {
    if !req.builtins {
        return Vec::new();
    }
    let mut specs = builtin_specs(req, user_stages);
    specs.retain(|s| allowed.contains(&CandidateKind::Builtin(s.kind)));
    specs
        .into_iter()
        .filter_map(|spec| {
            let pl = match spec.kind.chunk_rule() {
                ChunkRule::TwoV => Placement::v_shape(req.pp),
                _ => Placement::looped(req.pp, spec.vpp),
            };
            layouts_for(req, &pl)
                .into_iter()
                .next()
                .map(|l| Recipe::Builtin(spec, l))
        })
        .collect()
}
