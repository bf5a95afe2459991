//! Fitting a candidate into the memory limit with offload and recompute (issue #30).
//!
//! A candidate whose peak is over the limit keeps its compute order and gets memory
//! instructions instead:
//! 1. offload alone: [`super::offload::plan`] fits copies into the candidate's own timeline
//!    (PipeOffload's principle: no compute moves, so the makespan is unchanged when it fits);
//! 2. recompute: forwards are checkpointed by Belady's rule at the first position over the
//!    limit (among the live activations, the one needed furthest ahead), until every rank
//!    fits; each costs a forward before its backward;
//! 3. both: the shortest prefix of that checkpoint order after which offloading fits the rest
//!    (binary search; fewer checkpoints cost less time).
//!
//! Every result is simulated and counted by the one memory rule ([`pipec_ir::memory`]); the
//! fastest that fits is kept.

use super::offload::{self, CopyOp};
use pipec_compiler::lower::recompute::checkpoint_tasks;
use pipec_compiler::target::Levers;
use pipec_cost::cost::{CostModel, StageCosts};
use pipec_cost::simulate::{figures, simulate_unverified};
use pipec_ir::ir::{Instr, MemKind, MemOp, Program};
use pipec_ir::verify::Unverified;
use pipec_schedules::layout::Layout;
use pipec_schedules::{Compute, Pass, Task};
use std::collections::HashSet;

/// A candidate fitted under the limit.
#[derive(Clone, Debug)]
pub struct Fitted {
    pub program: Program,
    pub makespan: f64,
    /// Per rank: activations offloaded, forwards recomputed.
    pub offloaded: Vec<u64>,
    pub recomputed: Vec<u64>,
}

/// A program larger than this is not fitted: the planner recounts a rank's profile after
/// every copy it places (quadratic in the rank's ops), and every fit simulates the program.
/// Offload alone is one plan and one simulation (its time at this size: bench/HISTORY.md).
pub const MAX_INSTRUCTIONS: usize = 60_000;

/// A program larger than this gets no recompute: the checkpoint search simulates the program
/// once per probe (a binary search over Belady's order), which at pp=16, M=128 made a limited
/// `tune` many times slower (bench/HISTORY.md).
pub const MAX_RECOMPUTE_INSTRUCTIONS: usize = 20_000;

/// Why [`fit`] found nothing: `host` is the least host peak (the largest rank's) among the
/// plans that met the device limit but held more than the host limit in offloaded
/// activations; `None` when no plan met the device limit at all.
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct NoFit {
    pub host: Option<f64>,
}

/// Fit `program` (laid out as `layout`, costed by `model`) under `limit` with `levers`, each
/// rank's offloaded activations within `host_limit` of host memory when one is given (a plan
/// over it is not taken: recompute, which holds nothing on the host, may fit instead).
pub fn fit(
    program: &Program,
    layout: &Layout,
    model: &CostModel,
    limit: f64,
    host_limit: Option<f64>,
    levers: Levers,
) -> Result<Fitted, NoFit> {
    let none = NoFit { host: None };
    if !levers.any() || program.len() > MAX_INSTRUCTIONS {
        return Err(none);
    }
    let costs = StageCosts::new(model, layout, program.num_stages());
    let mem = pipec_cost::memory::weights(program, layout, model);
    // The least host peak among plans the host limit alone refused.
    let over_host = std::cell::Cell::new(None::<f64>);
    let fits = |q: &Program| {
        let peaks = pipec_ir::memory::peaks(q, &mem);
        if !peaks.iter().all(|p| p.peak <= limit * (1.0 + 1e-12)) {
            return false;
        }
        let host = peaks.iter().map(|p| p.host).fold(0.0, f64::max);
        if host_limit.is_some_and(|h| host > h * (1.0 + 1e-12)) {
            over_host.set(Some(over_host.get().map_or(host, |x: f64| x.min(host))));
            return false;
        }
        true
    };
    let makespan = |q: &Program| {
        figures(&Unverified::unchecked(q), &costs)
            .ok()
            .map(|f| f.makespan)
    };
    let mut best: Option<(f64, Program)> = None;
    let consider = |best: &mut Option<(f64, Program)>, q: Program| {
        if !fits(&q) {
            return;
        }
        if let Some(t) = makespan(&q) {
            if best.as_ref().is_none_or(|(b, _)| t < *b) {
                *best = Some((t, q));
            }
        }
    };
    let offloaded = |q: &Program| {
        if levers.offload {
            with_offload(q, &costs, &mem, model.offload_pair, limit)
        } else {
            None
        }
    };
    if let Some(q) = offloaded(program) {
        consider(&mut best, q);
    }
    // Copies that cost no time leave nothing to gain: recomputes only add work.
    let unfitted = makespan(program);
    let lossless = matches!((&best, unfitted), (Some((t, _)), Some(u)) if *t <= u);
    if levers.recompute && !lossless && program.len() <= MAX_RECOMPUTE_INSTRUCTIONS {
        let order = belady_order(program, &mem, limit);
        if let Some(order) = order {
            let upto = |k: usize| {
                let mut sets = vec![HashSet::new(); program.ranks.len()];
                for &(r, t) in &order[..k] {
                    sets[r].insert(t);
                }
                let mut q = program.clone();
                checkpoint_tasks(&mut q, &sets).ok()?;
                Some(q)
            };
            if let Some(q) = upto(order.len()) {
                consider(&mut best, q);
            }
            if levers.offload && !order.is_empty() {
                // The fewest checkpoints after which the copies fit the rest.
                let (mut lo, mut hi) = (1, order.len());
                let mut found = None;
                while lo <= hi {
                    let mid = (lo + hi) / 2;
                    match upto(mid).and_then(|q| offloaded(&q)) {
                        Some(q) => {
                            found = Some(q);
                            if mid == 1 {
                                break;
                            }
                            hi = mid - 1;
                        }
                        None => lo = mid + 1,
                    }
                }
                if let Some(q) = found {
                    consider(&mut best, q);
                }
            }
        }
    }
    let Some((makespan, program)) = best else {
        return Err(NoFit {
            host: over_host.get(),
        });
    };
    let count = |f: &dyn Fn(&Instr) -> bool| -> Vec<u64> {
        program
            .ranks
            .iter()
            .map(|r| r.iter().filter(|i| f(i)).count() as u64)
            .collect()
    };
    let offloaded = count(&|i| matches!(i, Instr::Memory(m) if m.kind == MemKind::Offload));
    let recomputed = count(&|i| matches!(i, Instr::FwdCheckpoint(_)));
    Ok(Fitted {
        program,
        makespan,
        offloaded,
        recomputed,
    })
}

/// `program` with the offload planner's copies, or `None` when they cannot fit it.
fn with_offload(
    program: &Program,
    costs: &StageCosts,
    mem: &pipec_ir::memory::MemoryModel,
    pair: bool,
    limit: f64,
) -> Option<Program> {
    let sim = simulate_unverified(&Unverified::unchecked(program), costs).ok()?;
    let act = |t: Task| mem.act.get(t.stage.index()).copied().unwrap_or(0.0);
    // A recompute runs on the compute stream: the planner does not see it (its activations
    // are needed at once, never a candidate).
    let mut inputs = offload::inputs(program, &sim.timeline, |r| {
        mem.param.get(r).copied().unwrap_or(0.0)
    });
    // A checkpointed forward keeps nothing to offload (its activations are rebuilt by the
    // recompute right before the backward): the planner sees a placeholder at its position
    // (positions, hence the inserts' places, stay the program's), on no task it knows. A
    // recompute holds act(s) from just before its backward to its release: the largest of
    // the rank's is added to its base (a guide only: the result is counted by the one rule).
    let nothing = Task::new(u32::MAX, u32::MAX);
    for (instrs, input) in program.ranks.iter().zip(&mut inputs) {
        let checkpointed: HashSet<Task> = instrs
            .iter()
            .filter_map(|x| match x {
                Instr::FwdCheckpoint(t) => Some(*t),
                _ => None,
            })
            .collect();
        input.base += checkpointed.iter().map(|&t| act(t)).fold(0.0, f64::max);
        for o in &mut input.ops {
            if matches!(o.op, Compute::Fwd(t) if checkpointed.contains(&t)) {
                o.op = Compute::BwdW(nothing);
            }
        }
    }
    let plans = offload::plan(&inputs, limit, act, |t| copy_time(costs, pair, t)).ok()?;
    Some(insert(program, &plans))
}

/// One copy's time: the lone time, or with a host link shared by a rank pair the time while
/// both copy (a lone copy takes 0.7 of it), so that no planned copy runs late.
fn copy_time(costs: &StageCosts, pair: bool, t: Task) -> f64 {
    let lone = costs.copy(t.stage).unwrap_or(0.0);
    if pair {
        lone / pipec_cost::simulate::PAIRED_RATE
    } else {
        lone
    }
}

/// The planner's copies as instructions: each before the compute op it names.
pub fn insert(program: &Program, plans: &[offload::RankPlan]) -> Program {
    let mut q = program.clone();
    for (r, plan) in plans.iter().enumerate() {
        let instrs = &program.ranks[r];
        let compute: Vec<usize> = (0..instrs.len())
            .filter(|&i| instrs[i].as_compute().is_some())
            .collect();
        let mut at: Vec<(usize, Instr)> = plan
            .inserts
            .iter()
            .map(|x| {
                // Boundary `a` is reached when compute op `a - 1` ends: the inserts go right
                // after it, before the receives and waits that lead to op `a` (a copy posted
                // after them would start when they end, later than planned).
                let pos = match x.at {
                    0 => 0,
                    a => compute.get(a - 1).map_or(instrs.len(), |&i| i + 1),
                };
                let kind = match x.op {
                    CopyOp::Offload => MemKind::Offload,
                    CopyOp::WaitOffload => MemKind::WaitOffload,
                    CopyOp::Reload => MemKind::Reload,
                };
                (pos, Instr::Memory(MemOp { kind, task: x.task }))
            })
            .collect();
        // Stable: the planner's order among inserts at one position is program order.
        at.sort_by_key(|&(p, _)| p);
        let mut out = Vec::with_capacity(instrs.len() + at.len());
        let mut k = 0;
        for (i, ins) in instrs.iter().enumerate() {
            while k < at.len() && at[k].0 == i {
                out.push(at[k].1);
                k += 1;
            }
            out.push(*ins);
        }
        out.extend(at[k..].iter().map(|x| x.1));
        q.ranks[r] = out;
    }
    q
}

/// Forwards to checkpoint, in the order Belady's rule picks them on each rank (ranks taken in
/// turn), until every rank's peak (params included) is at most `limit`; `None` when
/// checkpointing cannot get a rank there.
fn belady_order(
    program: &Program,
    mem: &pipec_ir::memory::MemoryModel,
    limit: f64,
) -> Option<Vec<(usize, Task)>> {
    let act = |t: Task| mem.act.get(t.stage.index()).copied().unwrap_or(0.0);
    let mut per_rank: Vec<Vec<Task>> = Vec::new();
    for (r, instrs) in program.ranks.iter().enumerate() {
        let mut order = Vec::new();
        let base = mem.param.get(r).copied().unwrap_or(0.0);
        let ops: Vec<Compute> = instrs.iter().filter_map(Instr::as_compute).collect();
        // Per forward: its position, the backward that needs it, the op that frees it.
        let mut fwd = std::collections::HashMap::new();
        let mut need = std::collections::HashMap::new();
        let mut free = std::collections::HashMap::new();
        for (i, op) in ops.iter().enumerate() {
            for (pass, t) in op.parts() {
                match pass {
                    Pass::Fwd if matches!(op, Compute::Fwd(_)) => {
                        fwd.insert(t, i);
                    }
                    Pass::Bwd | Pass::BwdD => {
                        need.entry(t).or_insert(i);
                    }
                    _ => {}
                }
                if matches!(pass, Pass::Bwd | Pass::BwdW) {
                    free.insert(t, i);
                }
            }
        }
        let mut chosen: HashSet<Task> = HashSet::new();
        loop {
            // The positional profile: at op i, what is live after it allocates.
            let mut over = None;
            let mut live: Vec<Task> = Vec::new();
            for (i, op) in ops.iter().enumerate() {
                // Allocate: plain forwards at their op, checkpointed ones at their recompute
                // (right before the op that needs them), a checkpointed forward's own run.
                let mut transient = 0.0;
                for (pass, t) in op.parts() {
                    if pass == Pass::Fwd {
                        if chosen.contains(&t) {
                            transient += act(t);
                        } else {
                            live.push(t);
                        }
                    }
                    if matches!(pass, Pass::Bwd | Pass::BwdD)
                        && chosen.contains(&t)
                        && need.get(&t) == Some(&i)
                    {
                        live.push(t);
                    }
                }
                let now: f64 = base + transient + live.iter().map(|&t| act(t)).sum::<f64>();
                if now > limit * (1.0 + 1e-12) && over.is_none() {
                    over = Some((i, live.clone()));
                }
                live.retain(|t| free.get(t) != Some(&i));
            }
            let Some((i, live)) = over else { break };
            // Belady: of the activations held across op i (allocated before it, needed
            // after it), the one needed furthest ahead.
            let pick = live
                .iter()
                .filter(|t| {
                    !chosen.contains(t)
                        && fwd.get(t).is_some_and(|&f| f < i)
                        && need.get(t).is_some_and(|&n| n > i)
                })
                .max_by_key(|t| (need[t], std::cmp::Reverse((t.stage.0, t.mb.0))))
                .copied()?;
            chosen.insert(pick);
            order.push(pick);
        }
        per_rank.push(order);
    }
    // Round robin over the ranks: a prefix checkpoints each rank's first choices.
    let longest = per_rank.iter().map(Vec::len).max().unwrap_or(0);
    Some(
        (0..longest)
            .flat_map(|k| {
                per_rank
                    .iter()
                    .enumerate()
                    .filter_map(move |(r, o)| o.get(k).map(|&t| (r, t)))
            })
            .collect(),
    )
}
