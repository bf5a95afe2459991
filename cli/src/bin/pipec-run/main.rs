//! `pipec-run`: execute a compiled pipec schedule. Parsing and printing live here; the work is
//! in the library. Exit codes: 0 ok, 1 the schedule failed (refused, hang, check mismatch),
//! 2 usage or I/O error.

/// mimalloc, as `pipec` uses (see its `main.rs`): loading a large directory faults in far fewer
/// fresh pages than under the system allocator (bench/HISTORY.md has the figures).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

mod args;
#[cfg(feature = "cuda")]
mod cuda;
mod report;

use args::{trace_steps, world, Args, BackendKind};
use clap::Parser;
use pipec_cost::cost::CostModel;
use pipec_ir::files::MANIFEST_FILE;
use pipec_ir::verify::Checked;
use pipec_runtime::load::Runnable;
use pipec_runtime::model::ModelConfig;
use pipec_runtime::run::{memory_model, run_cpu_with_memory};
use pipec_runtime::{load, load_unverified, RunError, RunOptions};
use report::{json_head, print_json, print_report, write_trace, Interp};
use std::path::Path;
use std::process::ExitCode;
use std::time::Duration;

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
    if args.cuda_graph && args.backend != BackendKind::Cuda {
        return Err(RunError::Usage(
            "--cuda-graph applies to --backend cuda only (it captures the step's GPU work)".into(),
        ));
    }
    if args.cuda_graph && args.steps < 2 {
        return Err(RunError::Usage(format!(
            "--cuda-graph needs --steps 2 or more (step 1 runs eagerly, step 2 is captured and every later step replays it); got --steps {}",
            args.steps
        )));
    }
    // With --cuda-graph the plan is checked for capture first (below), so that the reason a
    // plan cannot be captured is given wherever pipec-run was built.
    #[cfg(not(feature = "cuda"))]
    if args.backend == BackendKind::Cuda && !args.cuda_graph {
        return Err(RunError::Usage(
            "pipec-run was built without the `cuda` feature; rebuild with `cargo build -p pipec-cli --features cuda` (or use --backend cpu)".into(),
        ));
    }
    #[cfg(all(feature = "cuda", unix))]
    if args.backend == BackendKind::Cuda {
        // A multi-process launch needs NCCL as `libnccl.so`; with only `libnccl.so.2` this
        // re-executes pipec-run once with a link directory on LD_LIBRARY_PATH.
        let launch = pipec_cuda::launch::from_vars(|k| std::env::var(k).ok())
            .map_err(|e| RunError::Usage(e.to_string()))?;
        // --cuda-graph refuses a launch of several processes (below) before it needs NCCL.
        if launch.as_ref().is_some_and(|l| l.world_size > 1) && !args.cuda_graph {
            pipec_cuda::reexec_for_nccl().map_err(RunError::Usage)?;
        }
    }
    if !(args.timeout.is_finite() && args.timeout > 0.0 && args.timeout <= 1e6) {
        // Echoed short: `1e300`, not three hundred digits.
        let t = args.timeout;
        let shown = if t.abs() < 1e7 {
            t.to_string()
        } else {
            format!("{t:e}")
        };
        return Err(RunError::Usage(format!(
            "--timeout {shown} must be a number of seconds in (0, 1e6]"
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
    // Before the run, not after it: a trace path that is a directory would waste the run.
    if let Some(t) = args.trace.as_deref().filter(|t| t.is_dir()) {
        return Err(RunError::Usage(format!(
            "--trace {}: a directory; the trace is written to a file",
            t.display()
        )));
    }
    if args.no_verify {
        eprintln!("WARNING: --no-verify: the schedule was NOT verified; it may hang (the watchdog will report it) or compute on the wrong tensors");
        run_loaded(args, dir, &load_unverified(dir, world(args)?)?, cfg)
    } else {
        run_loaded(args, dir, &load(dir, world(args)?)?, cfg)
    }
}

/// Run a loaded directory: verified, or only structurally checked under `--no-verify`.
fn run_loaded<P: Checked>(
    args: &Args,
    dir: &Path,
    loaded: &Runnable<P>,
    cfg: ModelConfig,
) -> Result<(), RunError> {
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
    let lengths = loaded.program.program().lengths.as_ref();
    let seq = match lengths {
        // Each microbatch holds the tokens the plan gives it; `--seq` is not used.
        Some(l) => {
            let min = l.all_tokens().iter().copied().min().unwrap_or(0);
            format!(
                "seq per microbatch {min}..={} (microbatch_lengths)",
                l.max_tokens()
            )
        }
        None => format!("seq {}", cfg.seq),
    };
    let model_line = format!(
        "model: hidden {}, ffn {}, vocab {}, {seq}, seed {}, lr {}",
        cfg.hidden, cfg.ffn, cfg.vocab, cfg.seed, args.lr
    );
    if let Some(l) = lengths {
        if args.backend == BackendKind::Cuda {
            return Err(RunError::Usage(
                "the cuda backend runs microbatches of one length (--seq); this plan carries microbatch_lengths: run it with --backend cpu".into(),
            ));
        }
        let widest = cfg.hidden.max(cfg.ffn).max(cfg.vocab);
        if l.max_tokens() as usize * widest > 1 << 26 {
            return Err(RunError::Usage(format!(
                "the model is too large for the CPU reference backend (a microbatch of {} tokens makes a tensor over 2^26 values)",
                l.max_tokens()
            )));
        }
    }
    if args.backend == BackendKind::Cuda && args.trace_steps.is_some() {
        return Err(RunError::Usage(
            "--trace-steps applies to the cpu backend (the cuda backend traces the last step)"
                .into(),
        ));
    }
    if args.cuda_graph {
        let processes = pipec_cuda::launch::from_vars(|k| std::env::var(k).ok())
            .map_err(|e| RunError::Usage(e.to_string()))?
            .map_or(1, |l| l.world_size);
        pipec_cuda::graph::capturable(loaded.program.program(), processes)?;
        #[cfg(not(feature = "cuda"))]
        return Err(RunError::Usage(
            "pipec-run was built without the `cuda` feature; rebuild with `cargo build -p pipec-cli --features cuda`".into(),
        ));
    }
    if args.backend == BackendKind::Cuda {
        #[cfg(feature = "cuda")]
        return cuda::run(args, dir, loaded, cfg, &header, &model_line);
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
    // Memory is measured in the weights `pipec check` counts this directory in.
    let cost = match &m.cost {
        Some(spec) => Some(CostModel::parse(spec).map_err(|e| RunError::Refused {
            file: dir.join(MANIFEST_FILE).display().to_string(),
            field: "cost".into(),
            msg: e.render(),
        })?),
        None => None,
    };
    let memory = memory_model(loaded.program.program(), &m.layout, cost.as_ref());
    let report = run_cpu_with_memory(&loaded.program, &m.layout, &opts, &memory)?;
    if report.traced.is_empty() {
        write_trace(args, loaded.program.program(), &report.timeline)?;
    } else if let Some(p) = &args.trace {
        let mut b = pipec_compiler::view::chrome::TraceBuilder::new();
        for (step, t) in &report.traced {
            b.add(
                &format!("measured (pipec-run) step {}", step + 1),
                loaded.program.program(),
                t,
            );
        }
        std::fs::write(p, b.finish())
            .map_err(|e| RunError::Usage(format!("cannot write {}: {e}", p.display())))?;
    }
    let interp = Interp::measure(loaded.program.program(), &report.steps);
    if args.json {
        let mut out = json_head(args, dir, &loaded.manifest, cfg, "cpu", "f32");
        out["steps"] = serde_json::json!(report.steps);
        out["static_peak_activations"] = serde_json::json!(report.static_peak_activations);
        out["memory_unit"] = serde_json::json!(report.memory_unit);
        out["static_memory"] = serde_json::json!(report.static_memory);
        interp.add_to(&mut out);
        print_json(&out);
    } else {
        print_report(args, &report);
        interp.print();
    }
    Ok(())
}

/// `--cuda-info`: one line per library; NCCL is looked up as a launch would (re-executing
/// with a `libnccl.so` link when only `libnccl.so.2` exists).
fn cuda_info() -> Result<(), RunError> {
    #[cfg(not(feature = "cuda"))]
    return Err(RunError::Usage(
        "pipec-run was built without the `cuda` feature; rebuild with `cargo build -p pipec-cli --features cuda`"
            .into(),
    ));
    #[cfg(feature = "cuda")]
    {
        // When NCCL is nowhere, the report below says where it looked.
        #[cfg(unix)]
        let _ = pipec_cuda::reexec_for_nccl();
        let (lines, all) = pipec_cuda::library_report();
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

fn main() -> ExitCode {
    pipec_cli::sigpipe::restore_default();
    let args = Args::parse();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            // Under --json stdout always holds a document, an error too (as `pipec check`):
            // a consumer never parses an empty one.
            if args.json {
                print_json(&serde_json::json!({
                    "dir": args.dir.as_ref().map(|d| d.display().to_string()),
                    "error": e.to_string(),
                    "exit_code": e.exit_code(),
                }));
            }
            ExitCode::from(e.exit_code())
        }
    }
}
