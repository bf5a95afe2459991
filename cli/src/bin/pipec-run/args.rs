//! `pipec-run`'s command line: the flags, and the checks of the flags and the launch
//! environment that need no schedule.

use clap::{Parser, ValueEnum};
use pipec_runtime::{LaunchWorld, RunError};
use std::path::PathBuf;

#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum BackendKind {
    /// One thread per rank, in-process rendezvous transport, f32 model on ndarray.
    Cpu,
    /// CUDA + NCCL (needs the `cuda` feature).
    Cuda,
}

/// Element type of the CUDA backend.
#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum DtypeArg {
    F32,
    Bf16,
}

#[derive(Parser, Debug)]
#[command(
    name = "pipec-run",
    version,
    about = "Execute a compiled pipec schedule: train a small model with one rank per thread, measure the bubble, check against a single-thread reference"
)]
pub(crate) struct Args {
    /// A directory written by `pipec compile` or `pipec import` (manifest.json +
    /// rank-<r>.json); a torch CSV is imported into one first.
    #[arg(required_unless_present = "cuda_info")]
    pub(crate) dir: Option<PathBuf>,
    /// Report the CUDA driver, cuBLAS, NVRTC and NCCL libraries this binary loads (versions,
    /// NVRTC's GPU architectures) and exit: 0 when all load, 2 otherwise. Needs no GPU.
    #[arg(long, conflicts_with = "dir")]
    pub(crate) cuda_info: bool,
    #[arg(long, value_enum, default_value = "cpu")]
    pub(crate) backend: BackendKind,
    /// Weights and activations on the GPU (`--backend cuda` only; the CPU backend is f32).
    #[arg(long, value_enum)]
    pub(crate) dtype: Option<DtypeArg>,
    /// Compare the loss and every weight gradient with the same model run without pipelining
    /// on one thread (bitwise).
    #[arg(long)]
    pub(crate) check: bool,
    /// Training steps (forward + backward over all microbatches, then SGD).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    pub(crate) steps: u32,
    /// Seconds a rank may wait on one comm batch before the watchdog reports a hang.
    #[arg(long, default_value_t = 30.0)]
    pub(crate) timeout: f64,
    /// Write the measured timeline of the last step as a Chrome trace (JSON).
    #[arg(long)]
    pub(crate) trace: Option<PathBuf>,
    /// Steps to trace (cpu backend): `N`, `A..B` (1-based, inclusive) or `all`, one trace
    /// process per step; default the last.
    #[arg(long, requires = "trace")]
    pub(crate) trace_steps: Option<String>,
    /// Seed of the weights and the synthetic data.
    #[arg(long, default_value_t = 0)]
    pub(crate) seed: u64,
    /// Hidden size.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..=65536))]
    pub(crate) hidden: u32,
    /// Feed-forward size of the `t`/`m` blocks.
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u32).range(1..=65536))]
    pub(crate) ffn: u32,
    /// Vocabulary size.
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u32).range(1..=65536))]
    pub(crate) vocab: u32,
    /// Tokens per microbatch (a plan with `microbatch_lengths` gives each microbatch its own,
    /// and this is not used).
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=65536))]
    pub(crate) seq: u32,
    /// SGD learning rate.
    #[arg(long, default_value_t = 0.1)]
    pub(crate) lr: f32,
    /// Ranks of the launch; must equal the schedule's world size (default: `WORLD_SIZE` if set).
    #[arg(long)]
    pub(crate) world_size: Option<u32>,
    /// Print the report as one JSON object on stdout instead of text (for scripts and CI);
    /// errors still go to stderr with the same exit codes.
    #[arg(long)]
    pub(crate) json: bool,
    /// Run without the full verifier (structural checks only), to watch what a broken
    /// schedule does; the watchdog reports the hang. Not for training.
    #[arg(long)]
    pub(crate) no_verify: bool,
    /// `--backend cuda`: run step 1 eagerly, capture step 2 in a CUDA graph and replay it for
    /// every later step (needs --steps 2 or more); a plan that cannot be captured is refused
    /// with the reason.
    #[arg(long)]
    pub(crate) cuda_graph: bool,
}

pub(crate) fn world(args: &Args) -> Result<Option<LaunchWorld>, RunError> {
    if let Some(n) = args.world_size {
        return Ok(Some(LaunchWorld {
            size: n,
            from: "--world-size",
        }));
    }
    match std::env::var("WORLD_SIZE") {
        Ok(v) => v
            .trim()
            .parse()
            .map(|size| {
                Some(LaunchWorld {
                    size,
                    from: "WORLD_SIZE",
                })
            })
            .map_err(|_| RunError::Usage(format!("WORLD_SIZE=`{v}` is not a rank count"))),
        Err(_) => Ok(None),
    }
}

/// `--trace-steps`: `N`, `A..B` (1-based, inclusive) or `all`, within `--steps`; 0-based.
pub(crate) fn trace_steps(args: &Args) -> Result<Option<(u32, u32)>, RunError> {
    let Some(spec) = args.trace_steps.as_deref() else {
        return Ok(None);
    };
    let bad = || {
        RunError::Usage(format!(
            "--trace-steps `{spec}`: expected N, A..B (1-based, within --steps {}) or all",
            args.steps
        ))
    };
    let num = |t: &str| t.trim().parse::<u32>().map_err(|_| bad());
    let (a, b) = match spec.trim() {
        "all" => (1, args.steps),
        s => match s.split_once("..") {
            Some((a, b)) => (num(a)?, num(b)?),
            None => (num(s)?, num(s)?),
        },
    };
    if a == 0 || a > b || b > args.steps {
        return Err(bad());
    }
    Ok(Some((a - 1, b - 1)))
}
