//! Building a candidate: its program lowered (the tuned scheduler's order with the timed
//! lowering, a built-in kind its own way), simulated for its figures and measured for memory,
//! every candidate in one worker pool ([`pipec_ir::par`]).

use crate::greedy;
use crate::order;
use crate::plan::{list_times, Plan};
use crate::problem::Problem;
use crate::request::{Candidate, CandidateKind, TuneRequest};
use crate::split;
use pipec_compiler::lower::{lower, Lowering};
use pipec_compiler::target::TargetChoice;
use pipec_cost::cost::{CostModel, StageCosts};
use pipec_ir::ir::Program;
use pipec_ir::verify;
use pipec_schedules::layout::Layout;
use pipec_schedules::{generate, Lengths, Placement, PlacementKind, ScheduleSpec};

/// A candidate with its program, before the winner is chosen.
pub(crate) struct Built {
    pub(crate) cand: Candidate,
    pub(crate) layout: Layout,
    pub(crate) spec: Option<ScheduleSpec>,
    /// `None` for a built-in kind dropped as not the best (rebuilt from `spec` if needed).
    pub(crate) program: Option<Program>,
    pub(crate) peaks: Vec<f64>,
    pub(crate) planned: Option<f64>,
    /// Per rank: host memory held by offloaded activations at most (0 without offloads).
    pub(crate) host_peaks: Vec<f64>,
}

/// A candidate to build: the tuned scheduler's plan on a problem and split, or a built-in
/// kind on its split.
pub(crate) enum Recipe {
    Tuned(Box<(Problem, Layout, Plan, greedy::Heuristic)>),
    Builtin(ScheduleSpec, Layout),
}

/// The program of `orders` on `p` that keeps their list-schedule time under `p`'s costs
/// ([`Lowering::TimedInFlight`]); `None` when the orders wait on each other or send a tensor
/// they never consume.
pub fn lower_timed(p: &Problem, orders: &[pipec_schedules::RankOrder]) -> Option<Program> {
    let times = list_times(p, orders)?;
    let how = Lowering::TimedInFlight {
        times: &times,
        transfer: p.comm,
    };
    pipec_compiler::lower::lower_with(&p.placement, p.microbatches, false, orders, how).ok()
}

/// `program` on the request's communicators ([`TuneRequest::p2p_groups`]), as `pipec compile`
/// records them: every program the tuner builds passes through here before it is verified,
/// so the stream rule (D2) judges it under the groups the plan will be run with.
pub(crate) fn with_groups(req: &TuneRequest, mut program: Program) -> Program {
    program.p2p_groups = req.p2p_groups;
    program
}

/// A built-in kind's program as the tuner weighs it: the kind's own lowering, except
/// `group-interleaved`, which PipeOffload's runtime runs as their `add_time` list schedule
/// under the real costs, i.e. pipec's timed in-flight lowering (lockstep batches are timed at
/// unit costs and lose time on heavier ranks); the lockstep program where that one does not
/// verify (under the request's groups).
pub(crate) fn lower_builtin(
    req: &TuneRequest,
    schedule: &pipec_schedules::Schedule,
    layout: &Layout,
) -> Program {
    if schedule.spec.kind.row().tune.timed {
        let p = Problem::new(
            &req.model,
            layout,
            schedule.placement.clone(),
            schedule.spec.microbatches,
            None,
        );
        if let Some(q) = lower_timed(&p, &schedule.ranks) {
            let q = with_groups(req, q);
            if verify::verify(&q, &verify::VerifyOptions::default()).is_valid() {
                return q;
            }
        }
    }
    with_groups(req, lower(schedule))
}

/// Build one candidate: its program (returned apart), simulated and measured.
pub(crate) fn build(
    req: &TuneRequest,
    recipe: &Recipe,
    limit: Option<f64>,
) -> Option<(Built, Program)> {
    let (cand, layout, spec, program, planned) = match recipe {
        Recipe::Tuned(t) => {
            let (p, layout, plan, h) = &**t;
            let program = with_groups(req, lower_timed(p, &plan.orders)?);
            let cand = Candidate::unmeasured(
                CandidateKind::Tuned,
                p.placement.num_stages() / req.pp,
                None,
                placement_name(&p.placement),
                Some(h.name()),
            );
            let planned = Some(plan.makespan);
            (cand, layout, None, program, planned)
        }
        Recipe::Builtin(spec, layout) => {
            let schedule = generate(spec, &req.limits).ok()?;
            let program = lower_builtin(req, &schedule, layout);
            let cand = Candidate::unmeasured(
                CandidateKind::Builtin(spec.kind),
                spec.vpp,
                spec.group_size,
                placement_name(&schedule.placement),
                None,
            );
            (cand, layout, Some(*spec), program, None)
        }
    };
    if let Some(lengths) = &req.lengths {
        return best_order(req, cand, layout, spec, program, planned, limit, lengths);
    }
    let b = finish(
        cand,
        layout.clone(),
        spec,
        &program,
        &req.model,
        limit,
        planned,
        req.target,
    )?;
    Some((b, program))
}

/// With lengths: the candidate in every order of [`order::candidates`] (applied to its
/// program as `pipec compile` applies `microbatch_order`, [`order::apply`]), simulated and
/// measured; the best kept: one the target runs before one it does not (torchtitan runs the
/// plan's ids on torch's runtime, which takes microbatch m's loss from position m of its list),
/// then one that fits before one that does
/// not, then the shorter (a
/// tie keeps the earlier rule, index order first), then the smaller peak (under a limit). So
/// the winner is never slower than any of the orders.
#[allow(clippy::too_many_arguments)]
fn best_order(
    req: &TuneRequest,
    cand: Candidate,
    layout: &Layout,
    spec: Option<ScheduleSpec>,
    program: Program,
    planned: Option<f64>,
    limit: Option<f64>,
    lengths: &Lengths,
) -> Option<(Built, Program)> {
    let costs = order::costs(&req.model, lengths);
    let orders = order::candidates(&costs, program.placement.mirror_from());
    if limit.is_none() {
        // Without a limit every order fits: the makespans decide (a tie keeps the earlier
        // rule), and only the chosen order's memory is measured.
        let stage_costs = StageCosts::new(&req.model, layout, program.num_stages());
        let mut best: Option<(bool, pipec_cost::simulate::Figures, usize, Program)> = None;
        for (i, (_, ord)) in orders.iter().enumerate() {
            let mut p = program.clone();
            order::apply(&mut p, ord, lengths);
            // An order the target cannot run (torchtitan takes microbatch m's loss from
            // position m) loses to one it runs.
            let runs = req.target.refusal(&p).is_none();
            let Ok(sim) = pipec_cost::simulate::figures(
                &pipec_ir::verify::Unverified::unchecked(&p),
                &stage_costs,
            ) else {
                continue;
            };
            let beats = |(r, b): (bool, f64)| {
                if runs != r {
                    return runs;
                }
                sim.makespan < b - 1e-12 * b.abs()
            };
            if best
                .as_ref()
                .is_none_or(|(r, b, ..)| beats((*r, b.makespan)))
            {
                best = Some((runs, sim, i, p));
            }
        }
        let (_, sim, i, p) = best?;
        let mut b = measured(
            cand,
            layout.clone(),
            spec,
            &p,
            &req.model,
            limit,
            planned,
            req.target,
            &sim,
        );
        let (rule, ord) = orders.into_iter().nth(i)?;
        b.cand.microbatch_order = Some(ord);
        b.cand.microbatch_order_rule = Some(rule.to_string());
        return Some((b, p));
    }
    let mut best: Option<(Built, Program)> = None;
    let mut least: Option<(f64, String)> = None;
    for (rule, ord) in orders {
        let mut p = program.clone();
        order::apply(&mut p, &ord, lengths);
        let Some(mut b) = finish(
            cand.clone(),
            layout.clone(),
            spec,
            &p,
            &req.model,
            limit,
            planned,
            req.target,
        ) else {
            continue;
        };
        b.cand.microbatch_order = Some(ord);
        b.cand.microbatch_order_rule = Some(rule.to_string());
        if least.as_ref().is_none_or(|(x, _)| b.cand.peak_memory < *x) {
            least = Some((b.cand.peak_memory, rule.to_string()));
        }
        if best.as_ref().is_none_or(|(o, _)| better(&b.cand, &o.cand)) {
            best = Some((b, p));
        }
    }
    if let Some((b, _)) = &mut best {
        if !b.cand.fits {
            b.cand.least_order_peak = least;
        }
    }
    best
}

/// Whether `a` beats `b` among one schedule's orders: runs on the target where `b` does not,
/// else fits where `b` does not, else shorter (by more than rounding), else as long with a
/// smaller peak. Among orders none of which fits, the fastest leads: the levers fit it
/// (fitting a slower, smaller one was measured to give slower plans).
fn better(a: &Candidate, b: &Candidate) -> bool {
    if a.not_runnable.is_some() != b.not_runnable.is_some() {
        return a.not_runnable.is_none();
    }
    if a.fits != b.fits {
        return a.fits;
    }

    let tie = (a.makespan - b.makespan).abs() <= 1e-12 * b.makespan.abs().max(1e-300);
    if tie {
        a.peak_memory < b.peak_memory
    } else {
        a.makespan < b.makespan
    }
}

/// A built-in candidate's program made again (it was dropped while another led), in the
/// microbatch order it was measured in.
pub(crate) fn rebuild_builtin(
    req: &TuneRequest,
    spec: &ScheduleSpec,
    layout: &Layout,
    cand: &Candidate,
) -> Option<Program> {
    let mut program = lower_builtin(req, &generate(spec, &req.limits).ok()?, layout);
    if let (Some(l), Some(o)) = (&req.lengths, &cand.microbatch_order) {
        order::apply(&mut program, o, l);
    }
    Some(program)
}

/// `loop`, `v`, `bidirectional` or `custom`: how a candidate's placement is named.
pub(crate) fn placement_name(p: &Placement) -> String {
    match p.kind {
        PlacementKind::Looped => "loop".into(),
        PlacementKind::V => "v".into(),
        PlacementKind::Bidirectional => "bidirectional".into(),
        PlacementKind::Custom => "custom".into(),
    }
}

/// A named candidate's figures measured on its program: makespan and bubble (figures only),
/// per-rank peak memory by the one memory rule, whether it fits `limit`, whether `target`
/// runs it.
#[allow(clippy::too_many_arguments)]
pub(crate) fn finish(
    cand: Candidate,
    layout: Layout,
    spec: Option<ScheduleSpec>,
    program: &Program,
    model: &CostModel,
    limit: Option<f64>,
    planned: Option<f64>,
    target: TargetChoice,
) -> Option<Built> {
    let costs = StageCosts::new(model, &layout, program.num_stages());
    // Makespan and bubble only: the winner is verified and simulated in full once chosen.
    let sim =
        pipec_cost::simulate::figures(&pipec_ir::verify::Unverified::unchecked(program), &costs)
            .ok()?;
    Some(measured(
        cand, layout, spec, program, model, limit, planned, target, &sim,
    ))
}

/// [`finish`] with the program's figures already simulated.
#[allow(clippy::too_many_arguments)]
fn measured(
    mut cand: Candidate,
    layout: Layout,
    spec: Option<ScheduleSpec>,
    program: &Program,
    model: &CostModel,
    limit: Option<f64>,
    planned: Option<f64>,
    target: TargetChoice,
    sim: &pipec_cost::simulate::Figures,
) -> Built {
    cand.not_runnable = target.refusal(program);
    // The one memory rule every command reports ([`pipec_ir::memory`]).
    let mem = pipec_cost::memory::weights(program, &layout, model);
    let rank_peaks = pipec_ir::memory::peaks(program, &mem);
    let peaks: Vec<f64> = rank_peaks.iter().map(|p| p.peak).collect();
    let host_peaks: Vec<f64> = rank_peaks.iter().map(|p| p.host).collect();
    cand.host_peak_memory = host_peaks.iter().fold(0.0, |a: f64, &x| a.max(x));
    cand.makespan = sim.makespan;
    cand.bubble = sim.mean_bubble();
    cand.peak_memory = peaks.iter().fold(0.0, |a: f64, &x| a.max(x));
    cand.fits = limit.is_none_or(|l| cand.peak_memory <= l * (1.0 + 1e-12));
    cand.layout = split::layout_string(&layout);
    Built {
        cand,
        layout,
        spec,
        program: None,
        peaks,
        planned,
        host_peaks,
    }
}

/// Of the tuned candidates, the fastest fitting one per placement and vpp; built-ins untouched.
pub(crate) fn keep_best_per(built: Vec<Built>) -> Vec<Built> {
    let mut out: Vec<Built> = Vec::new();
    for b in built {
        if let Some(o) = out.iter_mut().find(|o| {
            o.cand.schedule == b.cand.schedule
                && o.cand.placement == b.cand.placement
                && o.cand.vpp == b.cand.vpp
        }) {
            let better = (b.cand.fits, -b.cand.makespan) > (o.cand.fits, -o.cand.makespan);
            if better {
                *o = b;
            }
        } else {
            out.push(b);
        }
    }
    out
}

/// Every recipe built, simulated and measured in one pool (the first `tuned` are the tuned
/// scheduler's, the rest built-in kinds); the tuned ones then cut to the best split per
/// placement ([`keep_best_per`]), the built-ins after them, in recipe order. A built-in kind's
/// program is kept only while it is the best eligible built-in so far (the others are rebuilt
/// if ever needed): the programs of a large request would otherwise all be in memory at once.
/// The tuned ones are few and always kept.
pub(crate) fn build_all(req: &TuneRequest, recipes: &[Recipe], tuned: usize) -> Vec<Built> {
    let limit = req.limit();
    let programs: Vec<std::sync::Mutex<Option<Program>>> = recipes
        .iter()
        .map(|_| std::sync::Mutex::new(None))
        .collect();
    let leader: std::sync::Mutex<Option<(f64, f64, usize)>> = std::sync::Mutex::new(None);
    let results = pipec_ir::par::map(recipes.len(), pipec_ir::par::cores(), |i| {
        let (built, program) = build(req, &recipes[i], limit)?;
        let keep = |program| *programs[i].lock().expect("no panics while held") = Some(program);
        match recipes[i] {
            Recipe::Tuned(_) => keep(program),
            Recipe::Builtin(..) => {
                let c = &built.cand;
                let key = (c.makespan, c.peak_memory, i);
                let before = |a: &(f64, f64, usize), b: &(f64, f64, usize)| {
                    a.0.total_cmp(&b.0)
                        .then(a.1.total_cmp(&b.1))
                        .then(a.2.cmp(&b.2))
                        .is_lt()
                };
                // Held while the programs change hands, so only the leader's stays.
                let mut lead = leader.lock().expect("no panics while held");
                if c.fits && c.not_runnable.is_none() && lead.is_none_or(|l| before(&key, &l)) {
                    if let Some(l) = lead.replace(key) {
                        *programs[l.2].lock().expect("no panics while held") = None;
                    }
                    keep(program);
                }
            }
        }
        Some(built)
    });
    let mut built: Vec<Built> = Vec::new();
    let mut builtins: Vec<Built> = Vec::new();
    for (i, (r, program)) in results.into_iter().zip(programs).enumerate() {
        let Some(mut b) = r else { continue };
        b.program = program.into_inner().expect("not poisoned");
        if i < tuned {
            built.push(b);
        } else {
            builtins.push(b);
        }
    }
    // Keep the best split per tuned placement only: the table stays short.
    built = keep_best_per(built);
    built.extend(builtins);
    built
}
