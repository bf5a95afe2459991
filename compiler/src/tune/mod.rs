//! `pipec tune`: the fastest verified schedule for a model's costs and memory, layer split
//! included.
//!
//! For every placement (loop with one or two chunks per rank, V) and every candidate layer
//! split ([`split`]), the cost-aware list scheduler ([`greedy`]) runs each of its heuristics
//! and keeps the best order; the order is lowered with the timed lockstep placement (so the
//! program keeps the order's time) and simulated. Every built-in kind (with its vpp and group
//! size choices) is compiled on the same model and simulated too. The fastest candidate whose
//! peak memory ([`crate::memory`], the rule every command reports) fits the limit wins, after the full
//! verifier has accepted it. [`bound`] gives the lower bound it is measured against; [`exact`]
//! the optimum of tiny instances.

pub mod bound;
pub mod calibrate;
pub mod exact;
pub mod greedy;
pub mod levers;
pub mod offload;
pub mod problem;
pub mod split;
pub mod target;
pub mod zb;

use crate::front::layout::{LayerKind, Layout, MAX_LAYERS};
use crate::ir::Program;
use crate::lower::{lower, Lowering};
use crate::simulate::cost::{CostModel, StageCosts};
use crate::simulate::{simulate, Summary};
use crate::verify::{self, Report, Verified};
use pipec_schedules::{
    generate, ChunkRule, Limits, Placement, PlacementKind, ScheduleKind, ScheduleSpec,
};
use problem::Problem;
use serde::Serialize;
pub use target::{Refusal, Target, TargetChoice};
use thiserror::Error;

/// What to tune.
#[derive(Clone, Debug)]
pub struct TuneRequest {
    pub pp: u32,
    pub microbatches: u32,
    pub model: CostModel,
    /// The user's split (`--layout`); kept unless `rebalance`.
    pub layout: Option<Layout>,
    pub rebalance: bool,
    /// Decoder and MTP layers to split (`--num-layers`, `--mtp-num-layers`) when no layout.
    pub num_layers: Option<u32>,
    pub mtp_num_layers: Option<u32>,
    /// Per-rank memory limit, in the units of `K.act` / `K.param`.
    pub memory_limit: Option<f64>,
    pub limits: Limits,
    /// Weigh the built-in kinds too (the CLI always does; benches may not).
    pub builtins: bool,
    /// Only candidates this target runs are eligible (the others are listed, marked). The
    /// library's default is [`Target::Any`]; the CLI and Python default to
    /// [`TargetChoice::Every`].
    pub target: TargetChoice,
    /// Weigh only these kinds (`1f1b`, ..., `tuned` for pipec's own scheduler); `None`: all.
    pub kinds: Option<Vec<String>>,
    /// Never weigh these kinds.
    pub exclude_kinds: Vec<String>,
    /// The memory levers a candidate over `memory_limit` may be fitted with (offload,
    /// recompute; `--no-offload`, `--no-recompute`), where the target runs them.
    pub levers: levers::Levers,
}

impl TuneRequest {
    pub fn new(pp: u32, microbatches: u32, model: CostModel) -> Self {
        TuneRequest {
            pp,
            microbatches,
            model,
            layout: None,
            rebalance: false,
            num_layers: None,
            mtp_num_layers: None,
            memory_limit: None,
            limits: Limits::DEFAULT,
            builtins: true,
            target: TargetChoice::One(Target::Any),
            kinds: None,
            exclude_kinds: Vec::new(),
            levers: levers::Levers::ALL,
        }
    }
}

#[derive(Debug, Error, Clone, PartialEq)]
pub enum TuneError {
    #[error("pp and microbatches must be at least 1")]
    Zero,
    #[error("the layout has {stages} stages, which pp = {pp} does not divide")]
    Stages { stages: usize, pp: u32 },
    #[error("no schedule fits the memory limit {limit}: the smallest peak memory pipec reached is {best} ({by})")]
    Memory {
        limit: String,
        best: String,
        by: String,
    },
    #[error("no candidate schedule could be built for this request ({0})")]
    Nothing(String),
    #[error("{0} compute ops exceed the limit of {1}")]
    TooBig(u64, u64),
    /// pp over [`pipec_schedules::MAX_PP`], in the spec's own words.
    #[error(transparent)]
    Spec(#[from] pipec_schedules::SpecError),
    /// More layers than a layout string may expand to ([`MAX_LAYERS`]): the split would
    /// allocate one entry per layer.
    #[error("{layers} layers are over the limit of {max} layers (the layout strings' cap)")]
    TooManyLayers { layers: u64, max: u64 },
    /// No decoder layer: every schedule would run nothing but the embedding and the loss.
    #[error("the model has no decoder layers: there is nothing to split over the stages")]
    NoLayers,
    #[error("unknown schedule kind `{0}` (expected `tuned` or one of: {1})")]
    Kind(String, String),
    #[error("no candidate runs on {target}{}", reasons.iter().map(|r| format!("\n  {r}")).collect::<String>())]
    NotRunnable {
        target: String,
        reasons: Vec<String>,
    },
}

/// One schedule weighed.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Candidate {
    /// `1f1b`, `interleaved-1f1b`, ..., or `tuned`.
    pub schedule: String,
    pub vpp: u32,
    pub group_size: Option<u32>,
    pub placement: String,
    /// The tuned scheduler's winning heuristic.
    pub heuristic: Option<String>,
    pub layout: String,
    /// Simulated makespan of the lowered program.
    pub makespan: f64,
    /// Mean idle share of the makespan over ranks.
    pub bubble: f64,
    /// The largest per-rank peak memory.
    pub peak_memory: f64,
    pub fits: bool,
    /// `not runnable on TARGET: why`, or `None` when the target runs it.
    pub not_runnable: Option<String>,
    /// Fitted under the memory limit with offload and recompute: what each rank offloads and
    /// recomputes, and the makespan before (absent for a candidate taken as it is).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub levers: Option<LeverReport>,
}

/// How a candidate was fitted into the memory limit ([`levers::fit`]).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct LeverReport {
    /// Per rank: activations offloaded to host memory (and reloaded).
    pub offloaded: Vec<u64>,
    /// Per rank: forwards checkpointed and recomputed.
    pub recomputed: Vec<u64>,
    /// The same schedule's makespan without them (over the limit).
    pub unfitted_makespan: f64,
}

impl Candidate {
    /// A candidate named, its figures (layout, makespan, bubble, memory, fit, target) left
    /// for [`finish`] to measure.
    fn unmeasured(
        schedule: String,
        vpp: u32,
        group_size: Option<u32>,
        placement: String,
        heuristic: Option<String>,
    ) -> Self {
        Candidate {
            schedule,
            vpp,
            group_size,
            placement,
            heuristic,
            layout: String::new(),
            makespan: 0.0,
            bubble: 0.0,
            peak_memory: 0.0,
            fits: false,
            not_runnable: None,
            levers: None,
        }
    }
}

/// Everything about the winner.
#[derive(Clone, Debug)]
pub struct Tuned {
    pub best: Candidate,
    pub candidates: Vec<Candidate>,
    pub layout: Layout,
    /// The built-in spec, or `None` for the tuned scheduler's order.
    pub spec: Option<ScheduleSpec>,
    /// The winner's program, verified (memory counted under the request's cost model).
    pub verified: Verified,
    pub summary: Summary,
    pub peak_memory: Vec<f64>,
    pub lower_bound: bound::Bound,
    /// The tuned scheduler's own (list schedule) makespan of the winning order, when it won.
    pub planned_makespan: Option<f64>,
    /// Whether memory figures are bytes (a model or limit given in bytes).
    pub bytes: bool,
    /// What the winner had to run on.
    pub target: TargetChoice,
    /// Every framework that runs the winner, and why the others do not.
    pub runs_on: Vec<Target>,
    pub not_runnable_on: Vec<(Target, String)>,
    /// Tuned placements not planned on because the target cannot run them: (name, reason).
    pub skipped: Vec<(String, String)>,
}

/// A candidate with its program, before the winner is chosen.
struct Built {
    cand: Candidate,
    layout: Layout,
    spec: Option<ScheduleSpec>,
    /// `None` for a built-in kind dropped as not the best (rebuilt from `spec` if needed).
    program: Option<Program>,
    peaks: Vec<f64>,
    planned: Option<f64>,
}

/// A candidate to build: the tuned scheduler's plan on a problem and split, or a built-in
/// kind on its split.
enum Task {
    Tuned(Box<(Problem, Layout, greedy::Plan, greedy::Heuristic)>),
    Builtin(ScheduleSpec, Layout),
}

/// The program of `orders` on `p` that keeps their list-schedule time under `p`'s costs
/// ([`Lowering::TimedInFlight`]); `None` when the orders wait on each other or send a tensor
/// they never consume.
pub fn lower_timed(p: &Problem, orders: &[pipec_schedules::RankOrder]) -> Option<Program> {
    let times = greedy::list_times(p, orders)?;
    let how = Lowering::TimedInFlight {
        times: &times,
        transfer: p.comm,
    };
    crate::lower::lower_with(&p.placement, p.microbatches, false, orders, how).ok()
}

/// A built-in kind's program as the tuner weighs it: the kind's own lowering, except
/// `group-interleaved`, which PipeOffload's runtime runs as their `add_time` list schedule
/// under the real costs, i.e. pipec's timed in-flight lowering (lockstep batches are timed at
/// unit costs and lose time on heavier ranks); the lockstep program where that one does not
/// verify.
fn lower_builtin(
    req: &TuneRequest,
    schedule: &pipec_schedules::Schedule,
    layout: &Layout,
) -> Program {
    if schedule.spec.kind == ScheduleKind::GroupInterleaved {
        let p = Problem::new(
            &req.model,
            layout,
            schedule.placement.clone(),
            schedule.spec.microbatches,
            None,
        );
        if let Some(q) = lower_timed(&p, &schedule.ranks) {
            if verify::verify(&q, &verify::VerifyOptions::default()).is_valid() {
                return q;
            }
        }
    }
    lower(schedule)
}

/// Build one candidate: its program (returned apart), simulated and measured.
fn build(req: &TuneRequest, task: &Task, limit: Option<f64>) -> Option<(Built, Program)> {
    let (cand, layout, spec, program, planned) = match task {
        Task::Tuned(t) => {
            let (p, layout, plan, h) = &**t;
            let program = lower_timed(p, &plan.orders)?;
            let cand = Candidate::unmeasured(
                "tuned".into(),
                p.placement.num_stages() / req.pp,
                None,
                placement_name(&p.placement),
                Some(h.name()),
            );
            let planned = Some(plan.makespan);
            (cand, layout, None, program, planned)
        }
        Task::Builtin(spec, layout) => {
            let schedule = generate(spec, &req.limits).ok()?;
            let program = lower_builtin(req, &schedule, layout);
            let cand = Candidate::unmeasured(
                spec.kind.name().to_string(),
                spec.vpp,
                spec.group_size,
                placement_name(&schedule.placement),
                None,
            );
            (cand, layout, Some(*spec), program, None)
        }
    };
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

/// The decoder and MTP layer counts of the model.
fn model_size(req: &TuneRequest) -> (u32, u32) {
    match (&req.layout, req.num_layers) {
        (Some(l), _) => (
            l.count(LayerKind::Decoder) as u32,
            l.count(LayerKind::Mtp) as u32,
        ),
        (None, n) => (n.unwrap_or(2 * req.pp), req.mtp_num_layers.unwrap_or(0)),
    }
}

/// The placements the tuned scheduler tries, and the stage count they need.
fn tuned_placements(pp: u32, microbatches: u32, stages: Option<usize>) -> Vec<Placement> {
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
fn layouts_for(req: &TuneRequest, placement: &Placement) -> Vec<Layout> {
    if let (Some(l), false) = (&req.layout, req.rebalance) {
        return if l.stages.len() == placement.num_stages() as usize {
            vec![l.clone()]
        } else {
            Vec::new()
        };
    }
    let (n, mtp) = model_size(req);
    split::candidates(&req.model, placement, n, mtp)
        .into_iter()
        .map(|c| split::layout_of(&c, mtp))
        .collect()
}

/// A placement and split to plan, with the best plan of the quick heuristics on it (large
/// instances) and its heuristic.
type Job = (Placement, Layout, Option<(greedy::Plan, greedy::Heuristic)>);

/// Run `f` over `jobs` on up to `threads` threads, results in job order.
fn par_map<T: Sync, R: Send>(jobs: &[T], f: impl Fn(&T) -> R + Sync) -> Vec<R> {
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(jobs.len())
        .max(1);
    if threads == 1 {
        return jobs.iter().map(f).collect();
    }
    let next = std::sync::atomic::AtomicUsize::new(0);
    let results: Vec<std::sync::Mutex<Option<R>>> =
        jobs.iter().map(|_| std::sync::Mutex::new(None)).collect();
    std::thread::scope(|sc| {
        for _ in 0..threads {
            sc.spawn(|| loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some(job) = jobs.get(i) else { break };
                let r = f(job);
                *results[i].lock().expect("no panics while held") = Some(r);
            });
        }
    });
    results
        .into_iter()
        .map(|m| {
            m.into_inner()
                .expect("not poisoned")
                .expect("every job ran")
        })
        .collect()
}

/// [`greedy::schedule_within`] of every heuristic of `hs` with its cutoffs (`None`: not run,
/// no plan), on up to as many threads as [`par_map`]. One run of the list scheduler stands
/// for every heuristic with the same cutoffs that decides alike at each of its events
/// ([`greedy::run`]); a heuristic that decides otherwise is handed back and runs on its own
/// (another thread may take it at once). Each result is exactly its heuristic's own run, so
/// how the runs were shared never shows.
fn run_all(
    p: &Problem,
    hs: &[greedy::Heuristic],
    cuts: &[Option<(f64, f64)>],
) -> Vec<Option<greedy::Plan>> {
    use std::sync::{Condvar, Mutex};
    enum St {
        Todo,
        Taken,
        Done(Option<greedy::Plan>),
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
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(hs.len())
        .max(1);
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

impl Tuned {
    /// The winner's program.
    pub fn program(&self) -> &Program {
        self.verified.program()
    }

    /// The verifier's report on it.
    pub fn report(&self) -> &Report {
        self.verified.report()
    }

    /// What `pipec tune --json` prints and `pipec.tune` returns: the choice, its layout
    /// string, makespan against the lower bound, bubble, peak memory per rank, every
    /// candidate weighed, the verdict, and `seconds` (how long the search took).
    pub fn json(&self, seconds: f64) -> serde_json::Value {
        self.json_for(seconds, None)
    }

    /// [`Tuned::json`] with the run instructions naming `dir` (the `-o` directory).
    pub fn json_for(&self, seconds: f64, dir: Option<&str>) -> serde_json::Value {
        let run: serde_json::Map<String, serde_json::Value> = self
            .run_targets()
            .into_iter()
            .map(|t| {
                (
                    t.name().to_string(),
                    serde_json::json!(self.how_to_run(t, dir)),
                )
            })
            .collect();
        serde_json::json!({
            "schedule": {
                "kind": self.best.schedule,
                "vpp": self.best.vpp,
                "group_size": self.best.group_size,
                "placement": self.best.placement,
                "heuristic": self.best.heuristic,
                "heuristic_description": self.heuristic_description(),
            },
            "layout": self.best.layout,
            "makespan": self.best.makespan,
            "planned_makespan": self.planned_makespan,
            "lower_bound": self.lower_bound.value,
            "lower_bound_parts": self.lower_bound,
            "bubble": self.summary.mean_bubble(),
            "bubble_per_rank": self.summary.ranks.iter().map(|r| r.bubble_ratio).collect::<Vec<_>>(),
            "peak_memory": self.peak_memory,
            "target": match self.target {
                TargetChoice::One(t) => serde_json::json!(t.name()),
                TargetChoice::Every => serde_json::Value::Null,
            },
            "runs_on": self.runs_on.iter().map(|t| t.name()).collect::<Vec<_>>(),
            "not_runnable_on": self
                .not_runnable_on
                .iter()
                .map(|(t, why)| (t.name().to_string(), serde_json::json!(why)))
                .collect::<serde_json::Map<_, _>>(),
            "run": run,
            "not_planned": self
                .skipped
                .iter()
                .map(|(n, why)| serde_json::json!({"schedule": n, "reason": why}))
                .collect::<Vec<_>>(),
            "candidates": self.candidates,
            "verdict": self.report().verdict_line(),
            "seconds": seconds,
        })
    }

    /// The targets whose run instructions the report gives: the one asked for; every
    /// framework for the default; every framework that runs the winner for `any`.
    pub fn run_targets(&self) -> Vec<Target> {
        match self.target {
            TargetChoice::One(Target::Any) => self.runs_on.clone(),
            TargetChoice::One(t) => vec![t],
            TargetChoice::Every => Target::FRAMEWORKS.to_vec(),
        }
    }

    /// How to run the winner on `t`, one line per step; `dir` is where its files are.
    pub fn how_to_run(&self, t: Target, dir: Option<&str>) -> Vec<String> {
        target::how_to_run(
            t,
            &target::Winner {
                spec: self.spec.as_ref(),
                placement: &self.program().placement,
                microbatches: self.program().microbatches,
                layout: &self.best.layout,
                dir: dir.unwrap_or("DIR"),
            },
        )
    }

    /// The winning heuristic of the tuned scheduler, in words.
    pub fn heuristic_description(&self) -> Option<String> {
        let name = self.best.heuristic.as_ref()?;
        greedy::heuristics()
            .into_iter()
            .flat_map(|h| [h, greedy::Heuristic { w_next: true, ..h }])
            .find(|h| &h.name() == name)
            .map(|h| h.describe())
    }

    /// Stages of the winner's layout that hold no layer at all (fewer decoder layers than
    /// stages): the report says so, since such a stage's rank only passes tensors on.
    pub fn empty_stages(&self) -> usize {
        self.layout.stages.iter().filter(|s| s.is_empty()).count()
    }

    /// The layout the written files carry: the chosen split, with its Megatron string.
    pub fn file_layout(&self) -> Layout {
        Layout {
            text: Some(self.best.layout.clone()),
            stages: self.layout.stages.clone(),
        }
    }

    /// The header of the written files (`layout` from [`Tuned::file_layout`]): a built-in
    /// kind that won is `generated` with its spec; a plan of the tuner's own is `tuned`.
    pub fn header<'a>(&self, layout: &'a Layout) -> crate::back::files::Header<'a> {
        crate::back::files::Header {
            source: if self.spec.is_some() {
                "generated"
            } else {
                "tuned"
            },
            schedule: self.spec,
            layout,
        }
    }
}

/// The best plan of the tuned scheduler on one problem over every heuristic.
pub fn best_plan(p: &Problem) -> Option<(greedy::Plan, greedy::Heuristic)> {
    best_plan_with(p, greedy::heuristics_for(p))
}

/// The best plan over the heuristics `hs`.
pub fn best_plan_with(
    p: &Problem,
    hs: Vec<greedy::Heuristic>,
) -> Option<(greedy::Plan, greedy::Heuristic)> {
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
) -> Option<(greedy::Plan, greedy::Heuristic)> {
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
fn margin(x: f64) -> f64 {
    x + 1e-6 * x.abs().max(1.0)
}

/// [`best_plan_with`] on a large instance whose quick heuristics have already run: `quick`
/// is their best plan, by `hq`, one of `hs`. It stands in for their runs: the other quick
/// heuristics lost to it, so they are not run again. The heuristics before `hq` stop as in
/// [`best_plan_within`]; those after it must beat it, not tie, so when it meets the lower
/// bound they stop once their peak is no longer below its own (most plans tie at the bound
/// and differ only there). The result is the one of [`best_plan_with`].
fn best_plan_after(
    p: &Problem,
    hs: Vec<greedy::Heuristic>,
    quick: greedy::Plan,
    hq: greedy::Heuristic,
) -> Option<(greedy::Plan, greedy::Heuristic)> {
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
fn pick(
    p: &Problem,
    hs: Vec<greedy::Heuristic>,
    plans: Vec<Option<greedy::Plan>>,
) -> Option<(greedy::Plan, greedy::Heuristic)> {
    let mut best: Option<(greedy::Plan, greedy::Heuristic)> = None;
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

fn placement_name(p: &Placement) -> String {
    match p.kind {
        PlacementKind::Looped => "loop".into(),
        PlacementKind::V => "v".into(),
        PlacementKind::Bidirectional => "bidirectional".into(),
        PlacementKind::Custom => "custom".into(),
    }
}

#[allow(clippy::too_many_arguments)]
fn finish(
    mut cand: Candidate,
    layout: Layout,
    spec: Option<ScheduleSpec>,
    program: &Program,
    model: &CostModel,
    limit: Option<f64>,
    planned: Option<f64>,
    target: TargetChoice,
) -> Option<Built> {
    cand.not_runnable = target.refusal(program);
    let costs = StageCosts::new(model, &layout, program.num_stages());
    // Makespan and bubble only: the winner is verified and simulated in full once chosen.
    let sim =
        crate::simulate::figures(&crate::verify::Unverified::unchecked(program), &costs).ok()?;
    // The one memory rule every command reports ([`crate::memory`]).
    let mem = crate::memory::weights(program, &layout, model);
    let peaks: Vec<f64> = crate::memory::peaks(program, &mem)
        .iter()
        .map(|p| p.peak)
        .collect();
    cand.makespan = sim.makespan;
    cand.bubble = sim.mean_bubble();
    cand.peak_memory = peaks.iter().fold(0.0, |a: f64, &x| a.max(x));
    cand.fits = limit.is_none_or(|l| cand.peak_memory <= l * (1.0 + 1e-12));
    cand.layout = split::layout_string(&layout);
    Some(Built {
        cand,
        layout,
        spec,
        program: None,
        peaks,
        planned,
    })
}

/// The built-in specs to weigh: every kind with its vpp and group-size choices.
fn builtin_specs(req: &TuneRequest, stages: Option<usize>) -> Vec<ScheduleSpec> {
    let (pp, m) = (req.pp, req.microbatches);
    let mut out = Vec::new();
    for kind in ScheduleKind::ALL {
        // Large instances weigh the common choices only (vpp 2, Megatron's group size), to
        // stay within seconds; small ones every vpp up to 4 and the group size M too.
        let big = pp as u64 * m as u64 > 16_384;
        // PipeOffload's schedule is weighed for what it saves in memory: without a limit
        // large instances skip it (its timed lowering is verified, seconds at pp=64, M=1024).
        if kind == ScheduleKind::GroupInterleaved && big && req.memory_limit.is_none() {
            continue;
        }
        let vpps: Vec<u32> = match kind.chunk_rule() {
            ChunkRule::One => vec![1],
            ChunkRule::TwoV => vec![2],
            ChunkRule::Any if big => vec![2],
            ChunkRule::Any => vec![2, 3, 4],
        };
        for vpp in vpps {
            let mut groups = vec![None];
            if kind == ScheduleKind::Interleaved1F1B && m > pp && !big {
                groups.push(Some(m));
            }
            // PipeOffload's schedule trades time for memory by its group size: under a limit
            // every group (their code takes 1..=pp), spread over at most 8 for deep pipelines.
            if kind == ScheduleKind::GroupInterleaved && req.memory_limit.is_some() && !big {
                groups.extend(group_sizes(pp).into_iter().filter(|&g| g != pp).map(Some));
            }
            for g in groups {
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

/// `x` to 12 significant digits: a total order that ties values equal but for float
/// rounding.
fn significant(x: f64) -> f64 {
    if !x.is_finite() || x == 0.0 {
        return x;
    }
    let scale = 10f64.powi(11 - x.abs().log10().floor() as i32);
    (x * scale).round() / scale
}

/// Group sizes weighed for `group-interleaved` under a memory limit: all of `1..=pp` up to
/// pp = 8, else eight spread from 1 to pp.
fn group_sizes(pp: u32) -> Vec<u32> {
    if pp <= 8 {
        return (1..=pp).collect();
    }
    let mut out: Vec<u32> = (0..8).map(|i| 1 + i * (pp - 1) / 7).collect();
    out.dedup();
    out
}

/// A memory figure for people: GiB/MiB when the model's memory is in bytes, else a number.
pub fn fmt_mem(x: f64, bytes: bool) -> String {
    let unit = if bytes {
        crate::memory::Unit::Bytes
    } else {
        crate::memory::Unit::LayerActivations
    };
    unit.with_unit(x)
}

/// Tune: weigh every candidate, verify the winner, or say why nothing fits.
pub fn tune(req: &TuneRequest) -> Result<Tuned, TuneError> {
    if req.pp == 0 || req.microbatches == 0 {
        return Err(TuneError::Zero);
    }
    check_size(req)?;
    let user_stages = match (&req.layout, req.rebalance) {
        (Some(l), false) => {
            if l.stages.len() % req.pp as usize != 0 {
                return Err(TuneError::Stages {
                    stages: l.stages.len(),
                    pp: req.pp,
                });
            }
            Some(l.stages.len())
        }
        _ => None,
    };
    let ops = 3 * req.pp as u64 * 2 * req.microbatches as u64;
    if ops > req.limits.max_compute_ops {
        return Err(TuneError::TooBig(ops, req.limits.max_compute_ops));
    }
    let limit = req.memory_limit;
    let allowed = allowed_kinds(req)?;
    // Tuned candidates: every placement the target runs x split.
    let mut jobs: Vec<(Placement, Layout)> = Vec::new();
    let mut skipped: Vec<(String, String)> = Vec::new();
    if allowed.iter().any(|k| k == "tuned") {
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
    // Large instances: rank the splits of each placement with a few heuristics first, and run
    // every heuristic on the best split only.
    let per_job_ops = 3 * 2 * req.pp as u64 * req.microbatches as u64;
    let selected: Vec<Job> = if per_job_ops > 60_000 {
        let mut keep: Vec<Job> = Vec::new();
        for (pl, layout) in &jobs {
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
    } else {
        jobs.iter()
            .map(|(p, l)| (p.clone(), l.clone(), None))
            .collect()
    };
    // Every candidate's program, built, simulated and measured in one pool: the tuned
    // scheduler's best plan per placement and split, then the built-in kinds.
    let mut tasks: Vec<Task> = Vec::new();
    let levers = req.target.levers(req.levers);
    let lever_search = limit.is_some() && levers.any();
    for (pl, layout, quick) in selected {
        let p = Problem::new(&req.model, &layout, pl.clone(), req.microbatches, limit);
        let hs = greedy::heuristics_for(&p);
        let best = match quick {
            // The quick heuristics are among these: their best plan bounds the others.
            Some((plan, h)) => best_plan_after(&p, hs, plan, h),
            None => best_plan_with(&p, hs),
        };
        if let Some((plan, h)) = best {
            tasks.push(Task::Tuned(Box::new((p, layout, plan, h))));
        }
    }
    let tuned_tasks = tasks.len();
    if req.builtins {
        let mut specs = builtin_specs(req, user_stages);
        specs.retain(|s| allowed.iter().any(|k| k == s.kind.name()));
        tasks.extend(specs.into_iter().filter_map(|spec| {
            let pl = match spec.kind.chunk_rule() {
                ChunkRule::TwoV => Placement::v_shape(req.pp),
                _ => Placement::looped(req.pp, spec.vpp),
            };
            // The first candidate split (the balanced one) for the kind's placement.
            layouts_for(req, &pl)
                .into_iter()
                .next()
                .map(|l| Task::Builtin(spec, l))
        }));
    }
    // A built-in kind's program is kept only while it is the best eligible built-in so far
    // (the others are rebuilt if ever needed): the programs of a large request would
    // otherwise all be in memory at once. The tuned ones are few and always kept.
    let programs: Vec<std::sync::Mutex<Option<Program>>> =
        tasks.iter().map(|_| std::sync::Mutex::new(None)).collect();
    let leader: std::sync::Mutex<Option<(f64, f64, usize)>> = std::sync::Mutex::new(None);
    let indices: Vec<usize> = (0..tasks.len()).collect();
    let results = par_map(&indices, |&i| {
        let (built, program) = build(req, &tasks[i], limit)?;
        let keep = |program| *programs[i].lock().expect("no panics while held") = Some(program);
        match tasks[i] {
            Task::Tuned(_) => keep(program),
            Task::Builtin(..) => {
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
        if i < tuned_tasks {
            built.push(b);
        } else {
            builtins.push(b);
        }
    }
    // Keep the best split per tuned placement only: the table stays short.
    built = keep_best_per(built);
    built.extend(builtins);
    if let (Some(l), true) = (limit, lever_search) {
        let extra = lever_plans(req, user_stages, l);
        fit_over_limit(req, &mut built, extra, l, levers);
    }
    let bytes = crate::memory::unit_of(&req.model) == crate::memory::Unit::Bytes;
    let runnable = |b: &Built| b.cand.not_runnable.is_none();
    let mut order: Vec<usize> = (0..built.len())
        .filter(|&i| built[i].cand.fits && runnable(&built[i]))
        .collect();
    if order.is_empty() && (!built.iter().any(runnable) || limit.is_none()) {
        if built.is_empty() && skipped.is_empty() {
            return Err(TuneError::Nothing(
                "no placement fits the layout and pp, or the kinds asked for exclude them all"
                    .into(),
            ));
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
        return Err(TuneError::NotRunnable {
            target: req.target.label(),
            reasons,
        });
    }
    if order.is_empty() {
        let limit = limit.unwrap_or(f64::INFINITY);
        // The smallest peak: the built-ins' and the tuned scheduler's least (bisection over
        // the limit it plans under), among what the target runs.
        let mut best: Option<(f64, String)> = built
            .iter()
            .filter(|b| runnable(b))
            .min_by(|a, b| a.cand.peak_memory.total_cmp(&b.cand.peak_memory))
            .map(|b| (b.cand.peak_memory, describe(&b.cand)));
        for (pl, layout) in &jobs {
            let p = Problem::new(&req.model, layout, pl.clone(), req.microbatches, None);
            if let Some(x) = min_peak(&p) {
                if best.as_ref().is_none_or(|(b, _)| x < *b) {
                    let vpp = pl.num_stages() / req.pp;
                    best = Some((x, format!("tuned {} vpp={vpp}", placement_name(pl))));
                }
            }
        }
        let (peak, by) = best.unwrap_or((f64::INFINITY, "nothing".into()));
        return Err(TuneError::Memory {
            limit: fmt_mem(limit, bytes),
            best: fmt_mem(peak, bytes),
            by,
        });
    }
    order.sort_by(|&a, &b| {
        let (x, y) = (&built[a].cand, &built[b].cand);
        // Makespans equal but for rounding (two orders with the same critical path summed in
        // another order) are a tie: the smaller peak wins it.
        significant(x.makespan)
            .total_cmp(&significant(y.makespan))
            .then(x.peak_memory.total_cmp(&y.peak_memory))
            // A built-in kind before the tuned order on a tie: it is the known schedule.
            .then((x.schedule == "tuned").cmp(&(y.schedule == "tuned")))
    });
    let candidates: Vec<Candidate> = {
        let mut c: Vec<Candidate> = built.iter().map(|b| b.cand.clone()).collect();
        c.sort_by(|x, y| {
            (x.not_runnable.is_some())
                .cmp(&y.not_runnable.is_some())
                .then((!x.fits).cmp(&!y.fits))
                .then(x.makespan.total_cmp(&y.makespan))
        });
        c
    };
    for i in order {
        if built[i].program.is_none() {
            // A built-in kind dropped while another led: generated again, as before.
            let spec = built[i].spec.expect("only built-in kinds are dropped");
            let schedule = generate(&spec, &req.limits).expect("it was generated before");
            built[i].program = Some(lower_builtin(req, &schedule, &built[i].layout));
        }
        let Some(program) = built[i].program.take() else {
            continue;
        };
        let mem = crate::memory::weights(&program, &built[i].layout, &req.model);
        let threads = crate::par::threads_for(program.len() as u64);
        let Ok(verified) = verify::verified_with(program, threads, &mem, None) else {
            continue;
        };
        let program = verified.program();
        let p = Problem::new(
            &req.model,
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
            lower_bound,
            planned_makespan: b.planned,
            bytes,
            target: req.target,
            runs_on,
            not_runnable_on,
            skipped,
        });
    }
    Err(TuneError::Nothing(
        "every candidate failed verification".into(),
    ))
}

/// The bounds checked before anything proportional to the request is allocated: pp as the
/// spec caps it, the layer count as layout strings cap it, and a model every rank has a layer
/// of (a model without decoder layers is refused, not tuned to a makespan of nothing; one
/// with fewer layers than stages is tuned, and the report names its empty stages).
fn check_size(req: &TuneRequest) -> Result<(), TuneError> {
    if req.pp > pipec_schedules::MAX_PP {
        return Err(pipec_schedules::SpecError::TooManyRanks { pp: req.pp }.into());
    }
    if req.layout.is_none() {
        let layers =
            u64::from(req.num_layers.unwrap_or(0)) + u64::from(req.mtp_num_layers.unwrap_or(0));
        if layers > MAX_LAYERS {
            return Err(TuneError::TooManyLayers {
                layers,
                max: MAX_LAYERS,
            });
        }
    }
    let (n, _) = model_size(req);
    if n == 0 {
        return Err(TuneError::NoLayers);
    }
    Ok(())
}

/// The kind names a request weighs (`tuned` and the built-in kinds), after `kinds` and
/// `exclude_kinds`; an unknown name is an error.
fn allowed_kinds(req: &TuneRequest) -> Result<Vec<String>, TuneError> {
    let all: Vec<String> = std::iter::once("tuned".to_string())
        .chain(ScheduleKind::ALL.iter().map(|k| k.name().to_string()))
        .collect();
    for k in req.kinds.iter().flatten().chain(&req.exclude_kinds) {
        if !all.contains(k) {
            return Err(TuneError::Kind(k.clone(), all.join(", ")));
        }
    }
    Ok(all
        .into_iter()
        .filter(|k| req.kinds.as_ref().is_none_or(|ks| ks.contains(k)))
        .filter(|k| !req.exclude_kinds.contains(k))
        .collect())
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

/// `zb-v`, `interleaved-1f1b vpp=2 g=16`, `tuned loop vpp=1`.
pub fn describe(c: &Candidate) -> String {
    let mut s = c.schedule.clone();
    if c.schedule == "tuned" {
        s.push_str(&format!(" {} vpp={}", c.placement, c.vpp));
    } else if c.vpp > 1 && c.placement == "loop" {
        s.push_str(&format!(" vpp={}", c.vpp));
    }
    if let Some(g) = c.group_size {
        s.push_str(&format!(" g={g}"));
    }
    if let Some(l) = &c.levers {
        let (o, r): (u64, u64) = (l.offloaded.iter().sum(), l.recomputed.iter().sum());
        if o > 0 {
            s.push_str(&format!(" + offload {o}"));
        }
        if r > 0 {
            s.push_str(&format!(" + recompute {r}"));
        }
    }
    s
}

/// The tuned scheduler's plans for fitting with levers (small instances only,
/// [`LEVER_PLAN_OPS`]): on every
/// placement it plans (the loops with 3 and 4 chunks too, as PipeOffload's grouped schedule
/// uses), on the balanced split, without the limit and under 1.5 and 2 times it. An order
/// planned against the real limit is slow; one planned without a limit is the fastest but
/// defers weight gradients, and activations waiting for theirs cannot leave the device; the
/// budgets between give the planner orders that hold fewer (on PipeOffload's grid they are
/// the ones fitted at copies of 2 forwards).
fn lever_plans(req: &TuneRequest, user_stages: Option<usize>, limit: f64) -> Vec<Built> {
    if 3 * 2 * req.pp as u64 * req.microbatches as u64 > LEVER_PLAN_OPS {
        return Vec::new();
    }
    let mut placements = tuned_placements(req.pp, req.microbatches, user_stages);
    if user_stages.is_none() {
        placements.extend([Placement::looped(req.pp, 3), Placement::looped(req.pp, 4)]);
    }
    let mut tasks: Vec<Task> = Vec::new();
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
                    tasks.push(Task::Tuned(Box::new((p.clone(), layout.clone(), plan, h))));
                }
            }
        }
    }
    // Verified here, as they may win without passing through the levers: an order a timed
    // lowering cannot post without a stream deadlock (two directions between the same pair
    // of ranks at pp = 2) is dropped.
    par_map(&tasks, |t| {
        let (mut b, program) = build(req, t, Some(limit))?;
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
/// is, faster, is added too.
fn fit_over_limit(
    req: &TuneRequest,
    built: &mut Vec<Built>,
    extra: Vec<Built>,
    limit: f64,
    levers: levers::Levers,
) {
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
    // The fastest few, and every PipeOffload schedule: the order their offload is built for
    // (each bwd_W right after its bwd_D) is often the one that fits, while slower unfitted.
    let offload_kind = |i: &usize| {
        built[*i]
            .spec
            .is_some_and(|s| s.kind == ScheduleKind::GroupInterleaved)
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
    let fit_one = |i: usize, levers: levers::Levers| -> Option<Built> {
        let b = &built[i];
        // The kept program as it is; a built-in kind dropped while another led, generated again.
        let program = match (&b.program, b.spec) {
            (Some(p), _) => std::borrow::Cow::Borrowed(p),
            (None, Some(spec)) => std::borrow::Cow::Owned(lower_builtin(
                req,
                &generate(&spec, &req.limits).ok()?,
                &b.layout,
            )),
            (None, None) => return None,
        };
        let f = levers::fit(&program, &b.layout, &req.model, limit, levers)?;
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
    let copies_only = levers::Levers {
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
            let out = par_map(&live, |&k| fit_one(todo[k], lv));
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
}

/// The most compute ops ([`lever_plans`] plans 18 orders) for which the tuned scheduler plans
/// extra orders for the levers.
const LEVER_PLAN_OPS: u64 = 6_000;

/// How many candidates over the limit [`fit_over_limit`] tries.
const LEVER_CANDIDATES: usize = 8;

/// Candidates [`fit_over_limit`] fits at once between two checks of the best so far.
const FIT_BATCH: usize = 4;

/// Of the tuned candidates, the fastest fitting one per placement and vpp; built-ins untouched.
fn keep_best_per(built: Vec<Built>) -> Vec<Built> {
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

#[cfg(test)]
mod tests {
    use super::*;

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
