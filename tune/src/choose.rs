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
    // The first rejection's first finding, for the refusal when none verifies.
    let mut first_rejection: Option<String> = None;
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
        let verified = match verify::verified_with(program, threads, &mem, None) {
            Ok(v) => v,
            Err(r) => {
                if first_rejection.is_none() {
                    // Its heading and first line (a cycle's first op), on one line.
                    first_rejection = r.report.violations.first().map(|v| {
                        let text = v.to_string();
                        let lines: Vec<&str> = text.lines().take(2).map(str::trim).collect();
                        lines.join(" ")
                    });
                }
                continue;
            }
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
    Err(TuneError::Nothing(match req.p2p_groups {
        // The default's words, unchanged.
        pipec_schedules::P2pGroups::Pair => "every candidate failed verification".into(),
        // Under chosen groups their stream rule (D2) can refuse what the default accepts: the
        // refusal names them, and the first finding shows whether that was the reason.
        g => format!(
            "every candidate failed verification under --p2p-groups {g}, which other groups \
             may pass: NCCL runs the ops of one communicator in issue order, so sends and \
             receives left in flight on one can deadlock there{}",
            first_rejection.map_or(String::new(), |w| format!("; the first finding: {w}"))
        ),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::build::with_groups;
    use pipec_cost::cost::CostModel;
    use pipec_ir::ir::{Instr, Payload, Program};
    use pipec_schedules::{Compute, P2pGroups, Rank, Task};

    fn fwd(s: u32) -> Instr {
        Instr::Compute(Compute::Fwd(Task::new(s, 0)))
    }
    fn send(peer: u32, stage: u32, batch: u32) -> Instr {
        Instr::message(true, Rank(peer), Payload::act(stage, 0), batch)
    }
    fn recv(peer: u32, stage: u32, batch: u32) -> Instr {
        Instr::message(false, Rank(peer), Payload::act(stage, 0), batch)
    }

    /// Three ranks, six looped stages (stage s on rank s mod 3), one microbatch, forwards
    /// only. Rank 1 posts its receive of act(3) and leaves it in flight, then sends act(1) to
    /// rank 2 (blocking). Derived by hand: act(3) comes from rank 0 only after rank 0 has
    /// received act(2) from rank 2, which rank 2 computes from act(1). Under `pair` rank 1's
    /// receive (communicator R0-R1) and send (R1-R2) are on two communicators: it runs.
    /// Under `direction` both are activations, on the one downstream communicator, so the
    /// send queues behind the receive that waits for it: a cycle. Under `edge` they are on
    /// R0->R1 and R1->R2: it runs.
    fn queued_behind_wraparound() -> Program {
        Program {
            placement: pipec_schedules::Placement::looped(3, 2),
            microbatches: 1,
            forward_only: true,
            comm: None,
            ranks: vec![
                vec![fwd(0), send(1, 0, 0), recv(2, 2, 1), fwd(3), send(1, 3, 2)],
                vec![
                    recv(0, 0, 0),
                    fwd(1),
                    recv(0, 3, 1),
                    send(2, 1, 2),
                    Instr::Wait { batch: 1 },
                    fwd(4),
                    send(2, 4, 3),
                ],
                vec![recv(1, 1, 0), fwd(2), send(0, 2, 1), recv(1, 4, 2), fwd(5)],
            ],
            lengths: None,
            p2p_groups: P2pGroups::Pair,
            buffer_slots: None,
        }
    }

    /// A candidate that deadlocks only under the request's groups is not taken, and when it
    /// is the only one the refusal names the groups; the same candidate verifies under the
    /// default and under `edge` (the hand derivation above).
    #[test]
    fn a_candidate_that_deadlocks_under_the_groups_is_refused_naming_them() {
        let verdicts: Vec<(P2pGroups, bool)> = P2pGroups::ALL
            .into_iter()
            .map(|g| {
                let mut req = TuneRequest::new(3, 1, CostModel::default());
                req.p2p_groups = g;
                let p = with_groups(&req, queued_behind_wraparound());
                assert_eq!(p.p2p_groups, g);
                (
                    g,
                    verify::verify(&p, &verify::VerifyOptions::default()).is_valid(),
                )
            })
            .collect();
        assert_eq!(
            verdicts,
            vec![
                (P2pGroups::Pair, true),
                (P2pGroups::Direction, false),
                (P2pGroups::Edge, true)
            ]
        );
        let mut req = TuneRequest::new(3, 1, CostModel::default());
        req.p2p_groups = P2pGroups::Direction;
        let cand = crate::request::Candidate::unmeasured(
            CandidateKind::Tuned,
            2,
            None,
            "loop".into(),
            None,
        );
        let built = vec![Built {
            cand: cand.clone(),
            layout: Layout::uniform(6),
            spec: None,
            program: Some(with_groups(&req, queued_behind_wraparound())),
            peaks: vec![0.0; 3],
            planned: None,
            host_peaks: vec![0.0; 3],
        }];
        let err = verify_winner(&req, built, vec![0], vec![cand], Vec::new(), Levers::NONE)
            .expect_err("its only candidate deadlocks under direction");
        let text = err.to_string();
        assert!(text.contains("under --p2p-groups direction"), "{text}");
        assert!(text.contains("deadlock"), "{text}");
    }
}
