//! What the tuner is asked and what it answers: [`TuneRequest`], [`TuneError`], the
//! [`Candidate`]s it weighs (named by [`CandidateKind`]) and the winner, [`Tuned`].

use crate::bound;
use pipec_compiler::target::{Levers, Target, TargetChoice};
use pipec_cost::cost::CostModel;
use pipec_cost::memory::{Limit, MemoryError};
use pipec_cost::model::LayersDisagree;
use pipec_cost::simulate::Summary;
use pipec_ir::verify::Verified;
use pipec_schedules::layout::{LayerKind, Layout, MAX_LAYERS};
use pipec_schedules::{Lengths, LengthsError, Limits, P2pGroups, ScheduleKind, ScheduleSpec};
use serde::Serialize;
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
    /// Per-rank memory limit as given: a plain number in the units of `K.act` / `K.param`, or
    /// a byte size, which needs byte costs. [`TuneRequest::limit`] is it in the model's unit.
    pub memory_limit: Option<Limit>,
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
    pub levers: Levers,
    /// The tokens of each microbatch's sequences (`--microbatch-lengths`, Python `lengths=`,
    /// issue #38): every schedule weighed is then also weighed in the orders of
    /// [`crate::order::candidates`], and the winner carries the lengths.
    pub lengths: Option<Lengths>,
    /// Host memory every rank may hold for offloaded activations (`--host-memory-limit`,
    /// Python `host_memory_limit=`, issue #40), as `memory_limit` is given: a fitted plan
    /// whose host peak ([`pipec_ir::memory::RankPeak::host`]) is above it is not taken.
    pub host_memory_limit: Option<Limit>,
    /// Which communicator carries each message (`--p2p-groups`, Python `p2p_groups=`), as
    /// [`pipec_compiler::compile::CompileRequest::p2p_groups`]: every candidate's program
    /// records it before anything verifies it, so the stream rule (D2) judges each candidate
    /// under the user's communicators and the winner is verified and written under them. A
    /// candidate that deadlocks there is dropped like any other that does not verify.
    pub p2p_groups: P2pGroups,
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
            levers: Levers::ALL,
            lengths: None,
            host_memory_limit: None,
            p2p_groups: P2pGroups::Pair,
        }
    }

    /// The host memory limit in the unit of the model's memory, as [`TuneRequest::limit`].
    pub fn host_limit(&self) -> Option<f64> {
        self.host_memory_limit
            .and_then(|l| l.resolve_for(&self.model).ok())
    }

    /// The memory limit in the unit of the model's memory ([`Limit::resolve_for`], the rule
    /// every caller shares); [`tune`](crate::tune) refuses a limit that does not resolve before
    /// anything reads this.
    pub fn limit(&self) -> Option<f64> {
        self.memory_limit
            .and_then(|l| l.resolve_for(&self.model).ok())
    }

    /// The request checked before anything is planned, in this order: pp and microbatches,
    /// the memory limit against the cost model's unit,
    /// [`TuneRequest::check_size`], a kept layout's stage count against pp, the compute ops
    /// against the limit. The stage count of the user's layout when it is kept.
    pub(crate) fn check(&self) -> Result<Option<usize>, TuneError> {
        if self.pp == 0 || self.microbatches == 0 {
            return Err(TuneError::Zero);
        }
        if let TargetChoice::One(t) = self.target {
            if let (false, Some(why)) = (self.p2p_groups.is_pair(), t.own_communicators()) {
                return Err(TuneError::P2pGroups {
                    target: t,
                    groups: self.p2p_groups,
                    why,
                });
            }
        }
        if let Some(l) = self.memory_limit {
            l.resolve_for(&self.model)?;
        }
        if let Some(l) = self.host_memory_limit {
            l.resolve_for(&self.model).map_err(TuneError::HostLimit)?;
        }
        if let Some(l) = &self.lengths {
            if l.microbatches() != self.microbatches {
                return Err(TuneError::LengthsCount {
                    given: l.microbatches(),
                    microbatches: self.microbatches,
                });
            }
            if let Some(shape) = &self.model.shape {
                l.check_seq(shape.seq)?;
            }
        }
        self.check_layers()?;
        self.check_size()?;
        let user_stages = match (&self.layout, self.rebalance) {
            (Some(l), false) => {
                if l.stages.len() % self.pp as usize != 0 {
                    return Err(TuneError::Stages {
                        stages: l.stages.len(),
                        pp: self.pp,
                    });
                }
                Some(l.stages.len())
            }
            _ => None,
        };
        let ops = 3 * self.pp as u64 * 2 * self.microbatches as u64;
        if ops > self.limits.max_compute_ops {
            return Err(TuneError::TooBig(ops, self.limits.max_compute_ops));
        }
        Ok(user_stages)
    }

    /// The bounds checked before anything proportional to the request is allocated: pp as the
    /// spec caps it, the layer count as layout strings cap it, and a model every rank has a layer
    /// of (a model without decoder layers is refused, not tuned to a makespan of nothing; one
    /// with fewer layers than stages is tuned, and the report names its empty stages).
    fn check_size(&self) -> Result<(), TuneError> {
        if self.pp > pipec_schedules::MAX_PP {
            return Err(pipec_schedules::SpecError::TooManyRanks { pp: self.pp }.into());
        }
        if self.layout.is_none() {
            let layers = u64::from(self.num_layers.or(self.table_layers()).unwrap_or(0))
                + u64::from(self.mtp_num_layers.unwrap_or(0));
            if layers > MAX_LAYERS {
                return Err(TuneError::TooManyLayers {
                    layers,
                    max: MAX_LAYERS,
                });
            }
        }
        let (n, _) = self.model_size();
        if n == 0 {
            return Err(TuneError::NoLayers);
        }
        Ok(())
    }

    /// The decoder and MTP layer counts of the model: the layout's, else `num_layers`, else
    /// the `[model]` table's `num_layers`, else two per rank.
    pub(crate) fn model_size(&self) -> (u32, u32) {
        match (&self.layout, self.num_layers) {
            (Some(l), _) => (
                l.count(LayerKind::Decoder) as u32,
                l.count(LayerKind::Mtp) as u32,
            ),
            (None, n) => (
                n.or(self.table_layers()).unwrap_or(2 * self.pp),
                self.mtp_num_layers.unwrap_or(0),
            ),
        }
    }

    /// The `[model]` table's `num_layers` (at most `u32::MAX`; larger ones are refused by
    /// [`TuneRequest::check_size`] through the layer cap).
    fn table_layers(&self) -> Option<u32> {
        self.model.shape.as_ref()?.layer_count()
    }

    /// The `[model]` table's `num_layers` against the layers the request gives, when it gives
    /// any ([`ModelShape::check_layers`]).
    fn check_layers(&self) -> Result<(), TuneError> {
        let Some(shape) = &self.model.shape else {
            return Ok(());
        };
        match (&self.layout, self.num_layers) {
            (Some(l), _) => shape.check_layers(l.count(LayerKind::Decoder) as u64, "the layout")?,
            (None, Some(n)) => shape.check_layers(u64::from(n), "the layer count asked for")?,
            (None, None) => {}
        }
        Ok(())
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
    /// A byte limit without byte costs.
    #[error(transparent)]
    Limit(#[from] MemoryError),
    /// A byte host memory limit without byte costs.
    #[error("{0}")]
    HostLimit(MemoryError),
    /// Offloading fitted some plan under the device limit, but none within the host memory
    /// limit (and nothing fitted without offloading).
    #[error("no schedule fits the memory limit {limit} with at most {host_limit} of host memory per rank: offloading brings {by} under the memory limit, but its offloaded activations take {host_best} of host memory on a rank; raise the host memory limit or the memory limit")]
    HostMemory {
        limit: String,
        host_limit: String,
        host_best: String,
        by: String,
    },
    /// The target posts on communicators other than the requested P2P groups.
    #[error("{why}, which a plan verified under the P2P groups `{groups}` does not cover: plan for {target} with the default groups, `pair` (pipec.torch, pipec.deepspeed and pipec-run create `{groups}`)")]
    P2pGroups {
        target: pipec_compiler::target::Target,
        groups: pipec_schedules::P2pGroups,
        /// How the target posts instead ([`Target::own_communicators`]).
        why: &'static str,
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
    /// The `[model]` table's `num_layers` and the layers asked for disagree.
    #[error(transparent)]
    LayersDisagree(#[from] LayersDisagree),
    /// No decoder layer: every schedule would run nothing but the embedding and the loss.
    #[error("the model has no decoder layers: there is nothing to split over the stages")]
    NoLayers,
    /// The lengths name another number of microbatches than the request.
    #[error("the microbatch lengths give {given} microbatches, but {microbatches} were asked for (one line of lengths per microbatch)")]
    LengthsCount { given: u32, microbatches: u32 },
    /// A sequence longer than the `[model]` table's `seq`, naming where it was given.
    #[error(transparent)]
    Lengths(#[from] LengthsError),
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
    pub schedule: CandidateKind,
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
    /// With lengths: the order microbatches enter the pipeline (the user's ids, the one that
    /// enters first first), the fastest fitting one of [`crate::order::candidates`].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub microbatch_order: Option<Vec<u32>>,
    /// Which rule gave `microbatch_order` (`index`, `ascending`, `descending`,
    /// `short-long-short`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub microbatch_order_rule: Option<String>,
    /// With lengths and a limit none of the orders fits: the smallest peak among them and its
    /// rule, for the refusal's "smallest peak reached" (the fastest order is the one kept).
    #[serde(skip)]
    pub least_order_peak: Option<(f64, String)>,
    /// The largest per-rank host memory its offloaded activations hold at once (the one
    /// memory rule's `host`, [`pipec_ir::memory::RankPeak`]); absent when it offloads nothing.
    #[serde(skip_serializing_if = "is_zero")]
    pub host_peak_memory: f64,
}

fn is_zero(x: &f64) -> bool {
    *x == 0.0
}

/// How a candidate was fitted into the memory limit ([`crate::levers::fit`]).
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
    /// for the build to measure.
    pub(crate) fn unmeasured(
        schedule: CandidateKind,
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
            microbatch_order: None,
            microbatch_order_rule: None,
            least_order_peak: None,
            host_peak_memory: 0.0,
        }
    }
}

/// What a candidate is: an order of pipec's own list scheduler (`tuned`) or a built-in kind.
/// Printed and serialized as its name.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum CandidateKind {
    /// The tuned scheduler's order (pipec's list scheduler, `greedy`).
    Tuned,
    Builtin(ScheduleKind),
}

impl CandidateKind {
    /// Every kind a request may name, `tuned` first, then the built-in kinds in table order.
    pub fn all() -> Vec<CandidateKind> {
        std::iter::once(CandidateKind::Tuned)
            .chain(ScheduleKind::ALL.iter().map(|&k| CandidateKind::Builtin(k)))
            .collect()
    }

    /// `tuned`, or the built-in kind's name.
    pub fn name(self) -> &'static str {
        match self {
            CandidateKind::Tuned => "tuned",
            CandidateKind::Builtin(k) => k.name(),
        }
    }
}

impl std::fmt::Display for CandidateKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl Serialize for CandidateKind {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
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
    /// Per rank: the most host memory its offloaded activations hold at once (0 without
    /// offloads), by the one memory rule ([`pipec_ir::memory::RankPeak::host`]).
    pub host_peak_memory: Vec<f64>,
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
    /// The winner offloads, and the cost model states no copy speed (`pcie`, `offload`,
    /// `K.offload`): each copy was taken to last one forward of the layers it copies
    /// ([`pipec_cost::cost::CostModel::offload_time`]), which the report says.
    pub copy_speed_assumed: bool,
    /// Without a target ([`TargetChoice::Every`]): each framework's own best plan, what
    /// `--target` that framework returns, or why it has none (#40 point 11); empty otherwise.
    pub per_target: Vec<(Target, Result<TargetBest, String>)>,
}

/// One framework's own best plan ([`Tuned::per_target`]): the winner of the same request
/// with `--target` that framework.
#[derive(Clone, Debug)]
pub struct TargetBest {
    pub best: Candidate,
    /// Per rank, as [`Tuned::peak_memory`] and [`Tuned::host_peak_memory`].
    pub peak_memory: Vec<f64>,
    pub host_peak_memory: Vec<f64>,
    /// As [`Tuned::copy_speed_assumed`].
    pub copy_speed_assumed: bool,
}
