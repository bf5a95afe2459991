//! Choosing the winner among the built candidates: the eligible ones (they fit and the target
//! runs them) ranked, or the error saying why there are none; the table of every candidate;
//! the first of the ranking the full verifier accepts, simulated in full with its lower bound.

use crate::bound;
use crate::build::{placement_name, rebuild_builtin, Built};
use crate::problem::Problem;
use crate::report::{describe, fmt_mem};
use crate::request::{Candidate, CandidateKind, TuneError, TuneRequest, Tuned};
use crate::search::min_peak;
use pipec_compiler::target::{Levers, Target};
use pipec_cost::cost::StageCosts;
use pipec_cost::simulate::simulate;
use pipec_ir::verify;
use pipec_schedules::layout::Layout;
use pipec_schedules::Placement;

/// Whether memory figures are bytes (the model's memory in bytes).
fn bytes(req: &TuneRequest) -> bool {
    pipec_cost::memory::unit_of(&req.model) == pipec_ir::memory::Unit::Bytes
}

fn runnable(b: &Built) -> bool {
    b.cand.not_runnable.is_none()
}

/// The candidates that fit and run on the target, best first: the shortest (makespans equal
/// to 12 significant digits tie), then the smaller peak, then a built-in kind before the
/// tuned order. None: [`TuneError::NotRunnable`] (or [`TuneError::Nothing`]) when the
/// target runs nothing or there is no limit, else [`TuneError::Memory`] with the smallest
/// peak reached (the tuned scheduler's by bisection over `jobs`).
pub(crate) fn eligible(
    req: &TuneRequest,
    built: &[Built],
    jobs: &[(Placement, Layout)],
    skipped: &[(String, String)],
    over_host: Option<(f64, String)>,
) -> Result<Vec<usize>, TuneError> {
    let limit = req.limit();
    let mut order: Vec<usize> = (0..built.len())
        .filter(|&i| built[i].cand.fits && runnable(&built[i]))
        .collect();
    if order.is_empty() && (!built.iter().any(runnable) || limit.is_none()) {
        return Err(not_runnable(req, built, skipped));
    }
    if let (true, Some((host, by)), Some(host_limit)) =
        (order.is_empty(), over_host, req.host_limit())
    {
        // Offloading met the device limit; only the host memory limit refused it.
        return Err(TuneError::HostMemory {
            limit: fmt_mem(limit.unwrap_or(f64::INFINITY), bytes(req)),
            host_limit: fmt_mem(host_limit, bytes(req)),
            host_best: fmt_mem(host, bytes(req)),
            by,
        });
    }
    if order.is_empty() {
        return Err(over_limit(req, built, jobs));
    }
    order.sort_by(|&a, &b| {
        let (x, y) = (&built[a].cand, &built[b].cand);
        // Makespans equal but for rounding (two orders with the same critical path summed in
        // another order) are a tie: the smaller peak wins it.
        significant(x.makespan)
            .total_cmp(&significant(y.makespan))
            .then(x.peak_memory.total_cmp(&y.peak_memory))
            // A built-in kind before the tuned order on a tie: it is the known schedule.
            .then((x.schedule == CandidateKind::Tuned).cmp(&(y.schedule == CandidateKind::Tuned)))
    });
    Ok(order)
}

/// Nothing the target runs: every reason, once each.
fn not_runnable(req: &TuneRequest, built: &[Built], skipped: &[(String, String)]) -> TuneError {
    if built.is_empty() && skipped.is_empty() {
        return TuneError::Nothing(
            "no placement fits the layout and pp, or the kinds asked for exclude them all".into(),
        );
    }
    let mut reasons: Vec<String> = Vec::new();
    for r in built
        .iter()
        .filter_map(|b| {
            b.cand
                .not_runnable
                .as_ref()
                .map(|w| format!("{}: {w}", describe(&b.cand)))
        })
        .chain(skipped.iter().map(|(n, w)| format!("{n}: {w}")))
    {
        if !reasons.contains(&r) {
            reasons.push(r);
        }
    }
    TuneError::NotRunnable {
        target: req.target.label(),
        reasons,
    }
}

/// Nothing fits the limit: the smallest peak, the built-ins' and the tuned scheduler's least
/// (bisection over the limit it plans under), among what the target runs.
fn over_limit(req: &TuneRequest, built: &[Built], jobs: &[(Placement, Layout)]) -> TuneError {
    let limit = req.limit().unwrap_or(f64::INFINITY);
    let mut best: Option<(f64, String)> = built
        .iter()
        .filter(|b| runnable(b))
        .map(|b| match &b.cand.least_order_peak {
            Some((x, rule)) => (*x, format!("{} in {rule} order", describe(&b.cand))),
            None => (b.cand.peak_memory, describe(&b.cand)),
        })
        .min_by(|a, b| a.0.total_cmp(&b.0));
    for (pl, layout) in jobs {
        let p = Problem::new(&req.model, layout, pl.clone(), req.microbatches, None);
        if let Some(x) = min_peak(&p) {
            if best.as_ref().is_none_or(|(b, _)| x < *b) {
                let vpp = pl.num_stages() / req.pp;
                best = Some((x, format!("tuned {} vpp={vpp}", placement_name(pl))));
            }
        }
    }
    let (peak, by) = best.unwrap_or((f64::INFINITY, "nothing".into()));
    TuneError::Memory {
        limit: fmt_mem(limit, bytes(req)),
        best: fmt_mem(peak, bytes(req)),
        by,
    }
}

/// `x` to 12 significant digits: a total order that ties values equal but for float
/// rounding.
fn significant(x: f64) -> f64 {
    if !x.is_finite() || x == 0.0 {
        return x;
    }
    let scale = 10f64.powi(11 - x.abs().log10().floor() as i32);
    (x * scale).round() / scale
}

/// Every candidate weighed, for the report: those the target runs first, then those that
/// fit, then by makespan.
pub(crate) fn table(built: &[Built]) -> Vec<Candidate> {
    let mut c: Vec<Candidate> = built.iter().map(|b| b.cand.clone()).collect();
    c.sort_by(|x, y| {
        (x.not_runnable.is_some())
            .cmp(&y.not_runnable.is_some())
            .then((!x.fits).cmp(&!y.fits))
            .then(x.makespan.total_cmp(&y.makespan))
    });
    c
}

/// The first candidate of `order` the full verifier accepts (a built-in dropped while another
/// led generated again), simulated in full, with its lower bound (copies counted where the
/// `levers` offload) and the frameworks that run it.
pub(crate) fn verify_winner(
    req: &TuneRequest,
    mut built: Vec<Built>,
    order: Vec<usize>,
    candidates: Vec<Candidate>,
    skipped: Vec<(String, String)>,
    levers: Levers,
) -> Result<Tuned, TuneError> {
    let limit = req.limit();
    for i in order {
        if built[i].program.is_none() {
            // A built-in kind dropped while another led: generated again, as before.
            let spec = built[i].spec.expect("only built-in kinds are dropped");
            let b = &built[i];
            let program = rebuild_builtin(req, &spec, &b.layout, &b.cand);
            built[i].program = Some(program.expect("it was generated before"));
        }
        let Some(program) = built[i].program.take() else {
            continue;
        };
        let mem = pipec_cost::memory::weights(&program, &built[i].layout, &req.model);
        let threads = pipec_ir::par::threads_for(program.len() as u64);
        let Ok(verified) = verify::verified_with(program, threads, &mem, None) else {
            continue;
        };
        let program = verified.program();
        // The bound with a whole backward's costs: a split that costs extra
        // (`split_extra`) is a plan's choice, and one that does not split pays none of it.
        let fused = pipec_cost::cost::CostModel {
            split_extra: None,
            ..req.model.clone()
        };
        let p = Problem::new(
            &fused,
            &built[i].layout,
            program.placement.clone(),
            req.microbatches,
            limit,
        );
        let costs = StageCosts::new(&req.model, &built[i].layout, program.num_stages());
        let copies: Vec<f64> = (0..program.num_stages())
            .map(|s| costs.copy(pipec_schedules::StageId(s)).unwrap_or(0.0))
            .collect();
        let lower_bound = bound::with_memory(&p, levers.offload.then_some(&copies[..]));
        // The winner simulated in full (the candidates had figures only), with the
        // verifier's matching.
        let Ok(sim) = simulate(&verified, &costs) else {
            continue;
        };
        let b = built.swap_remove(i);
        let copy_speed_assumed = !req.model.copy_speed_given()
            && (b.cand.levers.as_ref()).is_some_and(|l| l.offloaded.iter().any(|&n| n > 0));
        let mut runs_on = Vec::new();
        let mut not_runnable_on = Vec::new();
        for t in Target::FRAMEWORKS {
            match t.check(program) {
                Ok(()) => runs_on.push(t),
                Err(why) => not_runnable_on.push((t, why)),
            }
        }
        return Ok(Tuned {
            best: b.cand,
            candidates,
            layout: b.layout,
            spec: b.spec,
            verified,
            summary: sim.summary,
            peak_memory: b.peaks,
            host_peak_memory: b.host_peaks,
            lower_bound,
            planned_makespan: b.planned,
            bytes: bytes(req),
            target: req.target,
            runs_on,
            not_runnable_on,
            copy_speed_assumed,
            per_target: Vec::new(),
            skipped,
        });
    }
    Err(TuneError::Nothing(
        "every candidate failed verification".into(),
    ))
}
