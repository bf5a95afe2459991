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
pub use report::{describe, fmt_mem, TableRows, LONG_TABLE};
pub use request::{Candidate, CandidateKind, LeverReport, TuneError, TuneRequest, Tuned};
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
    if let (Some(limit), true) = (req.limit(), levers.any()) {
        // The plans made for the levers are pipec's own orders: only where `tuned` is weighed.
        let extra = if allowed.contains(&CandidateKind::Tuned) {
            fit::lever_plans(req, user_stages, limit)
        } else {
            Vec::new()
        };
        fit::fit_over_limit(req, &mut built, extra, limit, levers);
    }
    let order = choose::eligible(req, &built, &jobs, &skipped)?;
    let candidates = choose::table(&built);
    choose::verify_winner(req, built, order, candidates, skipped, levers)
}
