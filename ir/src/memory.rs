//! Peak memory per rank, one rule for every command (docs/design.md "Correctness rules" 5):
//! the parameters (+ gradients + optimizer state) of every stage a rank holds, plus the most
//! live activations at once, each weighted by its stage's weight, under the one rule of
//! [`crate::ir::activations`]. `compile`, `check`, `show`, `simulate`, `compare`, `tune` and
//! Python all report this figure, in one [`Unit`]. The weights come in as numbers
//! ([`MemoryModel`]); turning a cost model and a layout into them is the compiler's
//! (`pipec_cost::memory::weights`).

use crate::human::num;
use crate::ir::activations::{Activations, Peak};
use crate::ir::Program;
use serde::{Serialize, Serializer};

/// What memory figures count.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Unit {
    /// One microbatch's activations of one decoder (or MTP) layer: the default `t.act = 1`,
    /// parameters free. With the default layout (one `t` per stage) it is the published
    /// unit, one microbatch on one stage (GPipe holds `M`, 1F1B `p - r` on rank `r`).
    #[default]
    LayerActivations,
    /// Bytes: some `K.act` / `K.param` was given with a byte unit.
    Bytes,
}

impl Unit {
    /// `bytes` or `layer-activations`, the word reports label figures with.
    pub fn label(self) -> &'static str {
        match self {
            Unit::Bytes => "bytes",
            Unit::LayerActivations => "layer-activations",
        }
    }

    /// One figure for a person: `40.00GiB` / `512.0MiB` in bytes, the plain number otherwise
    /// (the caller labels a list once with [`Unit::label`], or uses [`Unit::list`]).
    pub fn fmt(self, x: f64) -> String {
        match self {
            Unit::LayerActivations => num(x),
            Unit::Bytes => {
                let gib = x / (1u64 << 30) as f64;
                if gib >= 1.0 {
                    format!("{gib:.2}GiB")
                } else if x >= (1u64 << 20) as f64 || x == 0.0 {
                    format!("{:.1}MiB", x / (1u64 << 20) as f64)
                } else {
                    format!("{}B", num(x))
                }
            }
        }
    }

    /// A figure with its unit: `40.00GiB` or `16 layer-activations`.
    pub fn with_unit(self, x: f64) -> String {
        match self {
            Unit::Bytes => self.fmt(x),
            Unit::LayerActivations => format!("{} layer-activations", self.fmt(x)),
        }
    }

    /// Figures with their unit once: `4 3 2 1 layer-activations` or `40.00GiB 39.80GiB`.
    pub fn list(self, xs: impl IntoIterator<Item = f64>) -> String {
        let v: Vec<String> = xs.into_iter().map(|x| self.fmt(x)).collect();
        match self {
            Unit::Bytes => v.join(" "),
            Unit::LayerActivations => format!("{} layer-activations", v.join(" ")),
        }
    }
}

/// The weights the rule counts with: per stage, one microbatch's activations; per rank, the
/// parameters of the stages it holds; with microbatches of different lengths (issue #38), per
/// microbatch the factor its activations weigh by.
#[derive(Clone, Debug, PartialEq)]
pub struct MemoryModel {
    pub act: Vec<f64>,
    pub param: Vec<f64>,
    pub unit: Unit,
    /// Per microbatch id: what its activations weigh against the `act` of a microbatch of the
    /// costs' `seq` tokens (its tokens / `seq`: activations are linear in tokens;
    /// `pipec_cost::lengths`). `None`: every microbatch weighs `act`. Ids it does not name
    /// weigh 1. The host copies of offloaded activations weigh the same.
    pub mb_scale: Option<Vec<f64>>,
    /// One message's size (the activation or gradient of a microbatch of the costs' `seq`
    /// tokens at a stage boundary) in `unit`, scaled per microbatch like `act`; what a buffer
    /// plan's slots are sized by (issue #39, `pipec_cost::memory::message_size`). `None`:
    /// slot sizes are not checked.
    pub msg: Option<f64>,
    /// Per stage: the part of `act` kept from `bwd_D` to `bwd_W` (`K.act_w`, the inputs of
    /// the weight-gradient GEMMs; [`crate::ir::activations`]); `None`: all of `act`, which
    /// is what a model without `K.act_w` keeps. Scaled by `mb_scale` as `act` is.
    pub act_w: Option<Vec<f64>>,
}

impl MemoryModel {
    /// Every stage one layer-activation, no parameters: what a program without a layout or a
    /// cost model is counted in (the verifier's default).
    pub fn units(program: &Program) -> Self {
        MemoryModel {
            act: vec![1.0; program.num_stages() as usize],
            param: vec![0.0; program.world() as usize],
            unit: Unit::LayerActivations,
            mb_scale: None,
            msg: None,
            act_w: None,
        }
    }

    /// The size in `unit` of a message carrying `payload` in a program of `microbatches`
    /// microbatches, when the model sizes messages.
    pub fn message_size(&self, payload: &crate::ir::Payload, microbatches: u32) -> Option<f64> {
        let m = self.msg?;
        Some(match &self.mb_scale {
            Some(f) if payload.mb.0 < microbatches => {
                m * f.get(payload.mb.index()).copied().unwrap_or(1.0)
            }
            _ => m,
        })
    }

    /// The weight of task `t`'s activations in a program of `microbatches` microbatches:
    /// its stage's `act` times its microbatch's factor; 0 for a stage or microbatch out of
    /// range.
    #[inline]
    pub fn weight(&self, t: pipec_schedules::Task, microbatches: u32) -> f64 {
        self.weights(t, microbatches).0
    }

    /// `(act, act_w)` of task `t`, each times its microbatch's factor: what its forward
    /// allocates and what of it its `bwd_D` leaves for its `bwd_W`
    /// ([`crate::ir::activations`]); `(0, 0)` out of range.
    #[inline]
    pub fn weights(&self, t: pipec_schedules::Task, microbatches: u32) -> (f64, f64) {
        match self.act.get(t.stage.index()) {
            Some(&w) if t.mb.0 < microbatches => {
                let kept = match &self.act_w {
                    Some(k) => k.get(t.stage.index()).copied().unwrap_or(w).min(w),
                    None => w,
                };
                match &self.mb_scale {
                    None => (w, kept),
                    Some(f) => {
                        let x = f.get(t.mb.index()).copied().unwrap_or(1.0);
                        (w * x, kept * x)
                    }
                }
            }
            _ => (0.0, 0.0),
        }
    }
}

/// One rank's peak: `peak = params + activations`, reached first at instruction `at`.
#[derive(Copy, Clone, Debug, PartialEq, Serialize)]
pub struct RankPeak {
    pub rank: u32,
    #[serde(serialize_with = "figure")]
    pub peak: f64,
    #[serde(serialize_with = "figure")]
    pub params: f64,
    #[serde(serialize_with = "figure")]
    pub activations: f64,
    /// Index in the rank's stream of the first instruction at the peak; `None` when the rank
    /// never holds an activation.
    pub at: Option<u32>,
    /// The most host memory the rank's offloads hold at once (issue 30); absent when 0.
    #[serde(serialize_with = "figure", skip_serializing_if = "is_zero")]
    pub host: f64,
    /// The rank's message-buffer pool of a buffer plan (issue #39), allocated for the whole
    /// step and so included in `peak` (and counted against the limit from the start); absent
    /// when 0.
    #[serde(serialize_with = "figure", skip_serializing_if = "is_zero")]
    pub buffers: f64,
}

fn is_zero(x: &f64) -> bool {
    *x == 0.0
}

/// A whole figure as a JSON integer (so the default unit's output is what it always was),
/// others as floats.
pub fn figure<S: Serializer>(x: &f64, s: S) -> Result<S::Ok, S::Error> {
    if x.fract() == 0.0 && x.abs() < 9.0e15 {
        s.serialize_i64(*x as i64)
    } else {
        s.serialize_f64(*x)
    }
}

/// Walk every rank of `program` under `mem`: its peak, and with a `limit` the first
/// instruction at which the rank holds more (`None` when it never does). Stages or
/// microbatches out of range weigh 0.
pub fn walk(
    program: &Program,
    mem: &MemoryModel,
    limit: Option<f64>,
) -> Vec<(RankPeak, Option<u32>)> {
    let m = program.microbatches;
    let weight = |t: pipec_schedules::Task| mem.weights(t, m);
    let mut w = Activations::new(program);
    (0..program.ranks.len())
        .map(|r| {
            let buffers = program.buffer_slots.as_ref().map_or(0.0, |p| p.bytes(r));
            let params = mem.param.get(r).copied().unwrap_or(0.0);
            // The pool is held all step long, like the parameters.
            let fixed = params + buffers;
            let mut peak = Peak::<f64>::default();
            let mut over = None;
            // Tolerance for sums of binary fractions (`0.1GiB` layers): a plan at the limit fits.
            let cap = limit.map(|l| l * (1.0 + 1e-12));
            if cap.is_some_and(|c| fixed > c) {
                over = Some(0);
            }
            let mut host = 0.0f64;
            let mut live_at = w.live(r, weight);
            while let Some((i, live)) = live_at.next() {
                peak.see(i, live);
                host = host.max(live_at.host());
                if over.is_none() && cap.is_some_and(|c| fixed + live > c) {
                    over = Some(i);
                }
            }
            let p = RankPeak {
                rank: r as u32,
                peak: fixed + peak.peak,
                params,
                activations: peak.peak,
                at: peak.at,
                host,
                buffers,
            };
            (p, over)
        })
        .collect()
}

/// Peak memory of every rank of `program` under `mem`.
pub fn peaks(program: &Program, mem: &MemoryModel) -> Vec<RankPeak> {
    walk(program, mem, None)
        .into_iter()
        .map(|(p, _)| p)
        .collect()
}
