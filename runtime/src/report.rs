//! What a run is asked and what it reports: the options of a run, each rank's measurements per
//! step, the check against the reference, and the whole run's report. The step driver fills
//! them and every backend's front (`run_cpu`, the CUDA run) hands them back.

use crate::model::ModelConfig;
use pipec_cost::timeline::Timeline;
use pipec_ir::memory::{RankPeak, Unit};
use serde::Serialize;
use std::time::Duration;

/// What to run and how.
#[derive(Clone, Debug)]
pub struct RunOptions {
    pub model: ModelConfig,
    pub steps: u32,
    /// SGD learning rate.
    pub lr: f32,
    /// How long a rank may wait on one comm batch before the watchdog reports a hang.
    pub timeout: Duration,
    /// Compare every step with the single-thread reference.
    pub check: bool,
    /// Keep the measured timelines of these steps (0-based, inclusive) in
    /// [`RunReport::traced`]; the last step's is always in [`RunReport::timeline`].
    pub trace_steps: Option<(u32, u32)>,
}

impl Default for RunOptions {
    fn default() -> Self {
        RunOptions {
            model: ModelConfig::default(),
            steps: 1,
            lr: 0.1,
            timeout: Duration::from_secs(30),
            check: false,
            trace_steps: None,
        }
    }
}

/// One rank's measurements in one step (microseconds).
#[derive(Clone, Debug, Serialize)]
pub struct RankStats {
    /// Time in compute instructions.
    pub busy_us: f64,
    /// The step's wall time minus `busy_us`: waiting on messages, the real bubble.
    pub idle_us: f64,
    /// Peak live activation stashes, counted in the run.
    pub peak_activations: u32,
    /// The rank's parameters plus the most its device store held at once, counted in the
    /// run's memory model (each tensor at its modelled size, not the bytes allocated) ([`run_cpu_with_memory`]): the verifier's `memory[r].peak`.
    pub peak_memory: f64,
    /// The most its host store (offloaded activations) held at once: the verifier's
    /// `memory[r].host`.
    pub host_memory: f64,
    /// CUDA: the high watermark of the GPU's memory pool over the step, in bytes (every
    /// buffer cudarc allocates comes from it: weights, gradients, activations, reloads). The
    /// pool is the GPU's: with several ranks on one GPU it is theirs together. Absent on the
    /// CPU.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gpu_peak_bytes: Option<u64>,
}

/// What the check compared.
#[derive(Clone, Debug, Serialize)]
pub struct CheckSummary {
    /// Weight-gradient tensors compared (0 when forward-only).
    pub tensors: usize,
    /// Float values compared, losses included.
    pub values: usize,
    /// Largest absolute difference seen; 0 when bitwise equal.
    pub max_abs_diff: f64,
}

#[derive(Clone, Debug, Serialize)]
pub struct StepReport {
    pub step: u32,
    pub loss: f32,
    pub wall_us: f64,
    pub ranks: Vec<RankStats>,
    pub check: Option<CheckSummary>,
    /// The step was a replay (or the first launch) of a captured CUDA graph: `wall_us` is the
    /// graph's GPU time, and the ranks' `busy_us`/`idle_us` are not measured (0).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub graph: bool,
}

#[derive(Clone, Debug, Serialize)]
pub struct RunReport {
    pub steps: Vec<StepReport>,
    /// Peak live activations per rank computed from the program alone (the verifier's figure).
    pub static_peak_activations: Vec<u32>,
    /// The verifier's memory per rank under the run's memory model
    /// ([`pipec_ir::memory::peaks`]), which each step's measured `peak_memory` and
    /// `host_memory` are held against.
    pub static_memory: Vec<RankPeak>,
    pub memory_unit: Unit,
    /// Measured timeline of the last step.
    pub timeline: Timeline,
    /// (step, measured timeline) of each step of [`RunOptions::trace_steps`].
    pub traced: Vec<(u32, Timeline)>,
}
