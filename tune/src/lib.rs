//! pipec-tune, `pipec tune`: the fastest verified schedule for a model's costs and memory, layer split
//! included.
//!
//! For every placement (loop with one or two chunks per rank, V) and every candidate layer
//! split ([`split`]), the cost-aware list scheduler ([`greedy`]) runs each of its heuristics
//! and keeps the best order; the order is lowered with the timed lockstep placement (so the
//! program keeps the order's time) and simulated. Every built-in kind (with its vpp and group
//! size choices) is compiled on the same model and simulated too. The fastest candidate whose
//! peak memory ([`pipec_ir::memory`], the rule every command reports) fits the limit wins, after the full
//! verifier has accepted it. [`bound`] gives the lower bound it is measured against; [`exact`]
//! the optimum of tiny instances.
//!
//! [`tune`] reads as its steps: the request checked (`request`), the candidates enumerated
//! and the tuned scheduler's plans made (`candidates`, `search`), every candidate built in
//! one worker pool (`build`), those over the memory limit fitted with the levers (`fit`), the
//! winner chosen and verified (`choose`); `report` words the answer.

pub mod bound;
mod build;
mod candidates;
mod choose;
pub mod exact;
mod fit;
pub mod greedy;
pub mod levers;
pub mod offload;
pub mod order;
pub mod plan;
pub mod problem;
mod report;
mod request;
mod search;
pub mod split;
pub mod zb;

pub use build::lower_timed;
use pipec_compiler::target::{Target, TargetChoice};
use pipec_cost::cost::{CostModel, MEGATRON_SPLIT_EXTRA};
pub use report::{describe, fmt_mem, TableRows, COPY_ASSUMED, LONG_TABLE};
pub use request::{
    Candidate, CandidateKind, LeverReport, TargetBest, TuneError, TuneRequest, Tuned,
};
pub use search::{best_plan, best_plan_with, min_peak};

/// Tune: weigh every candidate, verify the winner, or say why nothing fits.
/// The refusal of a layer count beside a layout (`pipec tune --layout L --num-layers N`,
/// `pipec.tune(layout=..., num_layers=...)`), in each caller's names for the two: the layout
/// gives the layers, so a count beside it is either redundant or contradicts it (issue #40:
/// Python ignored the count silently). One wording for the CLI and Python.
pub fn layers_with_layout(layers: &str, layout: &str) -> String {
    format!(
        "{layers} cannot be given with {layout}: the layout gives the layers (its `t` and `m`); give one or the other"
    )
}

pub fn tune(req: &TuneRequest) -> Result<Tuned, TuneError> {
    // A target whose split backward keeps the whole graph until `bwd_W` is planned (and its
    // manifest records the model) with `act_w = act`.
    if !req.target.frees_at_bwd_d() && req.model.has_act_w() {
        let mut whole = req.clone();
        whole.model = whole.model.without_act_w();
        return tune(&whole);
    }
    // The target's own costs (Megatron's split backward), once.
    let with_target = TuneRequest {
        model: target_model(&req.model, req.target),
        ..req.clone()
    };
    let req = &with_target;
    let user_stages = req.check()?;
    let allowed = candidates::allowed_kinds(req)?;
    // The tuned scheduler's best plan per placement and split, then the built-in kinds.
    let (jobs, skipped) = candidates::tuned_jobs(req, &allowed, user_stages);
    let selected = candidates::rank_splits(req, &jobs);
    let mut recipes = candidates::tuned_recipes(req, selected);
    let tuned = recipes.len();
    recipes.extend(candidates::builtin_recipes(req, &allowed, user_stages));
    let mut built = build::build_all(req, &recipes, tuned);
    let levers = req.target.levers(req.levers);
    let mut over_host = None;
    if let (Some(limit), true) = (req.limit(), levers.any()) {
        // The plans made for the levers are pipec's own orders: only where `tuned` is weighed.
        let extra = if allowed.contains(&CandidateKind::Tuned) {
            fit::lever_plans(req, user_stages, limit)
        } else {
            Vec::new()
        };
        over_host = fit::fit_over_limit(req, &mut built, extra, limit, levers);
    }
    let order = choose::eligible(req, &built, &jobs, &skipped, over_host)?;
    let candidates = choose::table(&built);
    let mut t = choose::verify_winner(req, built, order, candidates, skipped, levers)?;
    if req.target == TargetChoice::Every {
        t.per_target = per_target(req);
    }
    Ok(t)
}

/// `model` as `target` runs it: for Megatron, a split backward costs
/// [`MEGATRON_SPLIT_EXTRA`] more unless `model` gives `split_extra` (pipec's split runs
/// Megatron's linear layers' backward twice, docs/megatron.md); every other target, and every
/// framework at once (whose plans run one stage per rank on any of them), as given. The CLI
/// and Python record this model with the plan, so `simulate` of the directory agrees.
pub fn target_model(model: &CostModel, target: TargetChoice) -> CostModel {
    let mut m = model.clone();
    if target == TargetChoice::One(Target::Megatron) && m.split_extra.is_none() {
        m.split_extra = Some(MEGATRON_SPLIT_EXTRA);
    }
    m
}

/// Each framework's own best plan for `req` (#40 point 11): the plan every framework runs
/// gives up what only some run (more than one stage per rank, V and interleaved placements,
/// the memory levers), so the default's report says what each would get with `--target`. It
/// is that request, tuned: the figures are the ones `--target T` prints.
pub fn per_target(req: &TuneRequest) -> Vec<(Target, Result<TargetBest, String>)> {
    Target::FRAMEWORKS
        .iter()
        .map(|&t| {
            let one = TuneRequest {
                target: TargetChoice::One(t),
                ..req.clone()
            };
            let r = tune(&one).map(|x| TargetBest {
                best: x.best,
                peak_memory: x.peak_memory,
                host_peak_memory: x.host_peak_memory,
                copy_speed_assumed: x.copy_speed_assumed,
            });
            (t, r.map_err(|e| e.to_string()))
        })
        .collect()
}
