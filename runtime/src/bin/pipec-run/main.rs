//! `pipec-run`: execute a compiled pipec schedule. Parsing and printing live here; the work is
//! in the library. Exit codes: 0 ok, 1 the schedule failed (refused, hang, check mismatch),
//! 2 usage or I/O error.

/// The same `SIGPIPE` reset as `pipec`'s: a binary's concern, so no library exports it.
#[path = "../../../../compiler/src/cli/sigpipe.rs"]
mod sigpipe;

use clap::{Parser, ValueEnum};
use pipec_runtime::model::ModelConfig;
use pipec_runtime::{load, load_unverified, run_cpu, LaunchWorld, RunError, RunOptions, RunReport};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
enum BackendKind {
    /// One thread per rank, in-process rendezvous transport, f32 model on ndarray.
    Cpu,
    /// CUDA + NCCL (needs the `cuda` feature).
    Cuda,
}

/// Element type of the CUDA backend.
#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
enum DtypeArg {
    F32,
    Bf16,
}

#[derive(Parser, Debug)]
#[command(
    name = "pipec-run",
    version,
    about = "Execute a compiled pipec schedule: train a small model with one rank per thread, measure the bubble, check against a single-thread reference"
)]
struct Args {
    /// A directory written by `pipec compile` (manifest.json + rank-<r>.json).
    #[arg(required_unless_present = "cuda_info")]
    dir: Option<PathBuf>,
    /// Report the CUDA driver, cuBLAS, NVRTC and NCCL libraries this binary loads (versions,
    /// NVRTC's GPU architectures) and exit: 0 when all load, 2 otherwise. Needs no GPU.
    #[arg(long, conflicts_with = "dir")]
    cuda_info: bool,
    #[arg(long, value_enum, default_value = "cpu")]
    backend: BackendKind,
    /// Weights and activations on the GPU (`--backend cuda` only; the CPU backend is f32).
    #[arg(long, value_enum)]
    dtype: Option<DtypeArg>,
    /// Compare the loss and every weight gradient with the same model run without pipelining
    /// on one thread (bitwise).
    #[arg(long)]
    check: bool,
    /// Training steps (forward + backward over all microbatches, then SGD).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    steps: u32,
    /// Seconds a rank may wait on one comm batch before the watchdog reports a hang.
    #[arg(long, default_value_t = 30.0)]
    timeout: f64,
    /// Write the measured timeline of the last step as a Chrome trace (JSON).
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Steps to trace (cpu backend): `N`, `A..B` (1-based, inclusive) or `all`, one trace
    /// process per step; default the last.
    #[arg(long, requires = "trace")]
    trace_steps: Option<String>,
    /// Seed of the weights and the synthetic data.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Hidden size.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..=65536))]
    hidden: u32,
    /// Feed-forward size of the `t`/`m` blocks.
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u32).range(1..=65536))]
    ffn: u32,
    /// Vocabulary size.
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u32).range(1..=65536))]
    vocab: u32,
    /// Tokens per microbatch.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=65536))]
    seq: u32,
    /// SGD learning rate.
    #[arg(long, default_value_t = 0.1)]
    lr: f32,
    /// Ranks of the launch; must equal the schedule's world size (default: `WORLD_SIZE` if set).
    #[arg(long)]
    world_size: Option<u32>,
    /// Print the report as one JSON object on stdout instead of text (for scripts and CI);
    /// errors still go to stderr with the same exit codes.
    #[arg(long)]
    json: bool,
    /// Run without the full verifier (structural checks only), to watch what a broken
    /// schedule does; the watchdog reports the hang. Not for training.
    #[arg(long)]
    no_verify: bool,
}

fn world(args: &Args) -> Result<Option<LaunchWorld>, RunError> {
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

fn ms(us: f64) -> String {
    format!("{:.3} ms", us / 1000.0)
}

fn print_report(args: &Args, report: &RunReport) {
    for s in &report.steps {
        println!(
            "step {}: loss {:.6}  wall {}",
            s.step + 1,
            s.loss,
            ms(s.wall_us)
        );
        for (r, st) in s.ranks.iter().enumerate() {
            let pct = if s.wall_us > 0.0 {
                100.0 * st.idle_us / s.wall_us
            } else {
                0.0
            };
            println!(
                "  rank {r}: busy {}  idle {} ({pct:.1}%)  peak activations {} (static {})",
                ms(st.busy_us),
                ms(st.idle_us),
                st.peak_activations,
                report.static_peak_activations.get(r).copied().unwrap_or(0)
            );
        }
        if let Some(c) = &s.check {
            println!(
                "  check: losses and {} gradient tensors ({} values) equal the single-thread reference bitwise",
                c.tensors, c.values
            );
        }
    }
    if let Some(p) = &args.trace {
        match args.trace_steps.as_deref() {
            None => println!("trace: {} (last step)", p.display()),
            Some(s) => println!("trace: {} (steps {s}, one process each)", p.display()),
        }
    }
}

/// `--trace-steps`: `N`, `A..B` (1-based, inclusive) or `all`, within `--steps`; 0-based.
fn trace_steps(args: &Args) -> Result<Option<(u32, u32)>, RunError> {
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

fn run(args: &Args) -> Result<(), RunError> {
    if args.cuda_info {
        return cuda_info();
    }
    let Some(dir) = args.dir.as_deref() else {
        return Err(RunError::Usage("a compiled directory is required".into()));
    };
    if args.dtype.is_some() && args.backend != BackendKind::Cuda {
        return Err(RunError::Usage(
            "--dtype applies to --backend cuda only (the CPU backend computes in f32)".into(),
        ));
    }
    #[cfg(not(feature = "cuda"))]
    if args.backend == BackendKind::Cuda {
        return Err(RunError::Usage(
            "pipec-run was built without the `cuda` feature; rebuild with `cargo build --features cuda` (or use --backend cpu)".into(),
        ));
    }
    #[cfg(all(feature = "cuda", unix))]
    if args.backend == BackendKind::Cuda {
        // A multi-process launch needs NCCL as `libnccl.so`; with only `libnccl.so.2` this
        // re-executes pipec-run once with a link directory on LD_LIBRARY_PATH.
        let launch = pipec_runtime::backend::cuda::launch::from_vars(|k| std::env::var(k).ok())
            .map_err(|e| RunError::Usage(e.to_string()))?;
        if launch.as_ref().is_some_and(|l| l.world_size > 1) {
            pipec_runtime::backend::cuda::reexec_for_nccl().map_err(RunError::Usage)?;
        }
    }
    if !(args.timeout.is_finite() && args.timeout > 0.0 && args.timeout <= 1e6) {
        return Err(RunError::Usage(format!(
            "--timeout {} must be a number of seconds in (0, 1e6]",
            args.timeout
        )));
    }
    if !(args.lr.is_finite()) {
        return Err(RunError::Usage("--lr must be finite".into()));
    }
    let cfg = ModelConfig {
        hidden: args.hidden as usize,
        ffn: args.ffn as usize,
        vocab: args.vocab as usize,
        seq: args.seq as usize,
        seed: args.seed,
    };
    let widest = cfg.hidden.max(cfg.ffn).max(cfg.vocab);
    let cpu_math = args.backend == BackendKind::Cpu || args.check;
    if cpu_math && (cfg.seq * widest > 1 << 26 || cfg.hidden * cfg.ffn.max(cfg.vocab) > 1 << 26) {
        return Err(RunError::Usage(
            "the model is too large for the CPU reference backend (a tensor over 2^26 values)"
                .into(),
        ));
    }
    let loaded = if args.no_verify {
        eprintln!("WARNING: --no-verify: the schedule was NOT verified; it may hang (the watchdog will report it) or compute on the wrong tensors");
        load_unverified(dir, world(args)?)?
    } else {
        load(dir, world(args)?)?
    };
    let m = &loaded.manifest;
    let kind = m
        .schedule
        .map(|s| format!("{}, pp {}, vpp {}", s.kind, s.pp, s.vpp))
        .unwrap_or_else(|| format!("{} schedule, pp {}", m.source, m.world_size));
    let header = format!(
        "pipec-run: {} ({kind}, {} microbatches{}; layout {})",
        dir.display(),
        m.microbatches,
        if m.forward_only { ", forward only" } else { "" },
        m.layout.expanded(),
    );
    let model_line = format!(
        "model: hidden {}, ffn {}, vocab {}, seq {}, seed {}, lr {}",
        cfg.hidden, cfg.ffn, cfg.vocab, cfg.seq, cfg.seed, args.lr
    );
    if args.backend == BackendKind::Cuda && args.trace_steps.is_some() {
        return Err(RunError::Usage(
            "--trace-steps applies to the cpu backend (the cuda backend traces the last step)"
                .into(),
        ));
    }
    if args.backend == BackendKind::Cuda {
        #[cfg(feature = "cuda")]
        return cuda_main::run(args, dir, &loaded, cfg, &header, &model_line);
    }
    if !args.json {
        println!("{header}, cpu backend, {} rank threads", m.world_size);
        println!("{model_line}");
    }
    let opts = RunOptions {
        model: cfg,
        steps: args.steps,
        lr: args.lr,
        timeout: Duration::from_secs_f64(args.timeout),
        check: args.check,
        trace_steps: trace_steps(args)?,
    };
    let report = run_cpu(&loaded.program, &m.layout, &opts)?;
    if report.traced.is_empty() {
        write_trace(args, &loaded.program, &report.timeline)?;
    } else if let Some(p) = &args.trace {
        let mut b = pipec::back::view::chrome::TraceBuilder::new();
        for (step, t) in &report.traced {
            b.add(
                &format!("measured (pipec-run) step {}", step + 1),
                &loaded.program,
                t,
            );
        }
        std::fs::write(p, b.finish())
            .map_err(|e| RunError::Usage(format!("cannot write {}: {e}", p.display())))?;
    }
    let interp = Interp::measure(&loaded.program, &report.steps);
    if args.json {
        let mut out = json_head(args, dir, &loaded, cfg, "cpu", "f32");
        out["steps"] = serde_json::json!(report.steps);
        out["static_peak_activations"] = serde_json::json!(report.static_peak_activations);
        interp.add_to(&mut out);
        print_json(&out);
    } else {
        print_report(args, &report);
        interp.print();
    }
    Ok(())
}

/// The interpreter's own overhead ([`pipec_runtime::run::interpreter_us`]) against the
/// measured steps.
struct Interp {
    per_rank_us: Option<Vec<f64>>,
    share: Option<f64>,
    instrs: usize,
}

impl Interp {
    fn measure(program: &pipec::ir::Program, steps: &[pipec_runtime::run::StepReport]) -> Self {
        let per_rank_us = pipec_runtime::run::interpreter_us(program);
        let mean_wall = steps.iter().map(|s| s.wall_us).sum::<f64>() / steps.len().max(1) as f64;
        let share = per_rank_us
            .as_deref()
            .and_then(|u| pipec_runtime::run::interpreter_share(u, mean_wall));
        let instrs = program.ranks.iter().map(Vec::len).max().unwrap_or(0);
        Interp {
            per_rank_us,
            share,
            instrs,
        }
    }

    fn print(&self) {
        if let (Some(us), Some(share)) = (&self.per_rank_us, self.share) {
            println!(
                "interpreter: {} per step on the busiest rank (up to {} instructions; no-op backend) = {:.2}% of the mean step wall time",
                ms(us.iter().copied().fold(0.0, f64::max)),
                self.instrs,
                100.0 * share
            );
        }
    }

    fn add_to(&self, out: &mut serde_json::Value) {
        out["interpreter_us"] = serde_json::json!(self.per_rank_us);
        out["interpreter_share"] = serde_json::json!(self.share);
    }
}

/// The fields every `--json` report starts with: what ran, on what, with which model.
fn json_head(
    args: &Args,
    dir: &std::path::Path,
    loaded: &pipec::back::files::Loaded,
    cfg: ModelConfig,
    backend: &str,
    dtype: &str,
) -> serde_json::Value {
    let m = &loaded.manifest;
    serde_json::json!({
        "program": dir.display().to_string(),
        "schedule": m.schedule.map(|s| serde_json::json!({
            "kind": s.kind.to_string(), "pp": s.pp, "vpp": s.vpp,
        })),
        "source": m.source.to_string(),
        "world_size": m.world_size,
        "microbatches": m.microbatches,
        "forward_only": m.forward_only,
        "layout": m.layout.expanded(),
        "backend": backend,
        "dtype": dtype,
        "model": cfg,
        // Through its shortest decimal form, so 0.1 reads 0.1 and not 0.10000000149011612.
        "lr": args.lr.to_string().parse::<f64>().unwrap_or(f64::NAN),
        "trace": args.trace.as_ref().map(|p| p.display().to_string()),
    })
}

/// `--trace FILE`: the measured timeline as a Chrome trace.
fn write_trace(
    args: &Args,
    program: &pipec::ir::Program,
    timeline: &pipec::simulate::timeline::Timeline,
) -> Result<(), RunError> {
    if let Some(p) = &args.trace {
        let text = pipec_runtime::trace::chrome_trace(program, timeline);
        std::fs::write(p, text)
            .map_err(|e| RunError::Usage(format!("cannot write {}: {e}", p.display())))?;
    }
    Ok(())
}

fn print_json(v: &serde_json::Value) {
    println!(
        "{}",
        serde_json::to_string_pretty(v).expect("a JSON value always serializes")
    );
}

/// `--cuda-info`: one line per library; NCCL is looked up as a launch would (re-executing
/// with a `libnccl.so` link when only `libnccl.so.2` exists).
fn cuda_info() -> Result<(), RunError> {
    #[cfg(not(feature = "cuda"))]
    return Err(RunError::Usage(
        "pipec-run was built without the `cuda` feature; rebuild with `cargo build --features cuda`"
            .into(),
    ));
    #[cfg(feature = "cuda")]
    {
        // When NCCL is nowhere, the report below says where it looked.
        #[cfg(unix)]
        let _ = pipec_runtime::backend::cuda::reexec_for_nccl();
        let (lines, all) = pipec_runtime::backend::cuda::library_report();
        for l in &lines {
            println!("{l}");
        }
        if all {
            Ok(())
        } else {
            Err(RunError::Usage(
                "some CUDA libraries are missing (see above)".into(),
            ))
        }
    }
}

/// `--backend cuda`: run, then print what this process ran and the calibration.
#[cfg(feature = "cuda")]
mod cuda_main {
    use super::{json_head, ms, print_json, write_trace, Args, DtypeArg, Interp};
    use pipec::back::files::Loaded;
    use pipec_runtime::backend::cuda::calibrate::{calibrate, layer_flops, tflops};
    use pipec_runtime::backend::cuda::launch;
    use pipec_runtime::backend::cuda::run::{run_cuda, CudaRunOptions, Dtype};
    use pipec_runtime::model::ModelConfig;
    use pipec_runtime::RunError;
    use std::time::Duration;

    pub fn run(
        args: &Args,
        dir: &std::path::Path,
        loaded: &Loaded,
        cfg: ModelConfig,
        header: &str,
        model_line: &str,
    ) -> Result<(), RunError> {
        let launch = launch::from_vars(|k| std::env::var(k).ok())
            .map_err(|e| RunError::Usage(e.to_string()))?;
        let dtype = match args.dtype.unwrap_or(DtypeArg::F32) {
            DtypeArg::F32 => Dtype::F32,
            DtypeArg::Bf16 => Dtype::Bf16,
        };
        let opts = CudaRunOptions {
            model: cfg,
            steps: args.steps,
            lr: args.lr,
            timeout: Duration::from_secs_f64(args.timeout),
            check: args.check,
            dtype,
            launch: launch.clone(),
        };
        let (program, layout) = (&loaded.program, &loaded.manifest.layout);
        let report = run_cuda(program, layout, &opts)?;
        if args.json {
            let timeline = &report.run.timeline;
            write_trace(args, program, timeline)?;
            let mut out = json_head(args, dir, loaded, cfg, "cuda", dtype.name());
            out["ranks"] = serde_json::json!(report.ranks);
            out["devices"] = serde_json::json!(report.devices);
            out["device_count"] = serde_json::json!(report.device_count);
            out["launch"] = serde_json::json!(launch.as_ref().map(|l| l.from));
            out["steps"] = serde_json::json!(report.run.steps);
            out["static_peak_activations"] = serde_json::json!(report.run.static_peak_activations);
            out["check_worst"] = serde_json::json!(report
                .worst
                .iter()
                .map(|w| w.as_ref().map(|(rel, what)| serde_json::json!({
                    "normwise_relative": rel, "tensor": what,
                })))
                .collect::<Vec<_>>());
            // Calibration needs every rank's timeline: single-process runs only.
            let cal = launch
                .is_none()
                .then(|| calibrate(program, layout, timeline))
                .flatten();
            out["calibration"] = serde_json::json!(cal);
            if let Some(c) = &cal {
                let fl = layer_flops(cfg.seq, cfg.hidden, cfg.ffn);
                out["layer_gemm_tflops"] = serde_json::json!({
                    "fwd": tflops(fl, c.f), "bwd_d": tflops(fl, c.b), "bwd_w": tflops(fl, c.w),
                    "flop_per_layer_pass": fl,
                });
            }
            Interp::measure(program, &report.run.steps).add_to(&mut out);
            print_json(&out);
            return Ok(());
        }
        // Only rank 0 of a multi-process launch prints what every rank shares.
        let leader = match &launch {
            None => true,
            Some(l) => l.rank == 0,
        };
        if leader {
            println!(
                "{header}, cuda backend ({}), {}",
                dtype.name(),
                match &launch {
                    None => format!(
                        "{} rank threads on {} of {} GPUs",
                        program.ranks.len(),
                        {
                            let mut d = report.devices.clone();
                            d.sort_unstable();
                            d.dedup();
                            d.len()
                        },
                        report.device_count
                    ),
                    Some(l) => format!("{} processes ({})", l.world_size, l.from),
                }
            );
            println!("{model_line}");
        }
        let static_peak = &report.run.static_peak_activations;
        for (i, s) in report.run.steps.iter().enumerate() {
            if leader {
                println!(
                    "step {}: loss {:.6}  wall {}",
                    s.step + 1,
                    s.loss,
                    ms(s.wall_us)
                );
            }
            for (st, (&r, &gpu)) in s.ranks.iter().zip(report.ranks.iter().zip(&report.devices)) {
                let pct = if s.wall_us > 0.0 {
                    100.0 * st.idle_us / s.wall_us
                } else {
                    0.0
                };
                println!(
                    "  rank {r} (GPU {gpu}): busy {}  idle {} ({pct:.1}%)  peak activations {} (static {})",
                    ms(st.busy_us),
                    ms(st.idle_us),
                    st.peak_activations,
                    static_peak.get(r as usize).copied().unwrap_or(0)
                );
            }
            if let (Some(c), Some(Some((rel, what)))) = (&s.check, report.worst.get(i)) {
                println!(
                    "  check: losses and {} gradient tensors ({} values) within {:.0e} (normwise relative) of the single-thread reference; worst {rel:.2e} in {what}",
                    c.tensors,
                    c.values,
                    dtype.tolerance()
                );
            }
        }
        if leader {
            Interp::measure(program, &report.run.steps).print();
        }
        let timeline = &report.run.timeline;
        write_trace(args, program, timeline)?;
        if let Some(p) = &args.trace {
            println!("trace: {} (last step, CUDA event times)", p.display());
        }
        if launch.is_some() {
            // The timeline holds this process's rank only: no global calibration.
            return Ok(());
        }
        match calibrate(program, layout, timeline) {
            Some(c) => {
                println!(
                    "calibrated (last step, per decoder layer): fwd {} bwd_D {} bwd_W {}{}, p2p {}",
                    ms(c.f),
                    ms(c.b),
                    ms(c.w),
                    if c.split {
                        ""
                    } else {
                        " (half of each full bwd)"
                    },
                    ms(c.p2p)
                );
                let fl = layer_flops(cfg.seq, cfg.hidden, cfg.ffn);
                println!(
                    "layer GEMMs: {:.1} / {:.1} / {:.1} TFLOP/s (fwd / bwd_D / bwd_W; {:.3e} FLOP per layer pass)",
                    tflops(fl, c.f),
                    tflops(fl, c.b),
                    tflops(fl, c.w),
                    fl
                );
                println!(
                    "makespan: measured {}  simulated {} (--cost {} in µs)",
                    ms(c.measured_makespan),
                    ms(c.simulated_makespan),
                    c.spec
                );
                println!(
                    "bubble (mean over ranks): measured {:.1}%  simulated {:.1}%",
                    100.0 * c.measured_bubble,
                    100.0 * c.simulated_bubble
                );
            }
            None => println!("calibration: no forward of a decoder layer was measured"),
        }
        Ok(())
    }
}

fn main() -> ExitCode {
    sigpipe::restore_default();
    let args = Args::parse();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(e.exit_code())
        }
    }
}
