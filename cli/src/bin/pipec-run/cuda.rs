//! `--backend cuda`: run, then print what this process ran and the calibration.

use crate::args::{Args, DtypeArg};
use crate::report::{json_head, ms, print_json, print_memory, print_steps, write_trace, Interp};
use pipec_cuda::calibrate::{calibrate, layer_flops, tflops};
use pipec_cuda::launch;
use pipec_cuda::run::{run_cuda, CudaRunOptions, Dtype};
use pipec_ir::verify::Checked;
use pipec_runtime::load::Runnable;
use pipec_runtime::model::ModelConfig;
use pipec_runtime::RunError;
use std::time::Duration;

pub fn run(
    args: &Args,
    dir: &std::path::Path,
    loaded: &Runnable<impl Checked>,
    cfg: ModelConfig,
    header: &str,
    model_line: &str,
) -> Result<(), RunError> {
    let launch =
        launch::from_vars(|k| std::env::var(k).ok()).map_err(|e| RunError::Usage(e.to_string()))?;
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
        cuda_graph: args.cuda_graph,
    };
    let (program, layout) = (loaded.program.program(), &loaded.manifest.layout);
    let report = run_cuda(&loaded.program, layout, &opts)?;
    if args.json {
        let timeline = &report.run.timeline;
        write_trace(args, program, timeline)?;
        let mut out = json_head(args, dir, &loaded.manifest, cfg, "cuda", dtype.name());
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
        let overlap = pipec_runtime::trace::copy_overlap(program, timeline);
        if !overlap.is_empty() {
            out["copy_overlap"] = serde_json::json!(overlap);
        }
        Interp::measure(program, &report.run.steps).add_to(&mut out);
        if let Some(g) = graph_summary(&report.run.steps) {
            out["cuda_graph"] = serde_json::json!({
                "eager_us": g.0, "replay_us_median": g.1, "replays": g.2,
            });
        }
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
    let ranks: Vec<(u32, Option<usize>)> = report
        .ranks
        .iter()
        .zip(&report.devices)
        .map(|(&r, &g)| (r, Some(g)))
        .collect();
    print_steps(
        &report.run.steps,
        &report.run.static_peak_activations,
        leader,
        &ranks,
        |i, s| {
            match (&s.check, report.worst.get(i)) {
            (Some(c), Some(Some((rel, what)))) => Some(format!(
                "losses and {} gradient tensors ({} values) within {:.0e} (normwise relative) of the single-thread reference; worst {rel:.2e} in {what}",
                c.tensors,
                c.values,
                dtype.tolerance()
            )),
            _ => None,
        }
        },
    );
    if leader {
        Interp::measure(program, &report.run.steps).print();
        if let Some((eager, replay, n)) = graph_summary(&report.run.steps) {
            println!(
                "cuda graph: step 1 (eager, warm-up) {}; {}",
                ms(eager),
                match replay {
                    Some(r) => format!("replayed steps (3..{}): median {} per step", n + 2, ms(r)),
                    None => "no replay (--steps 3 or more replays the captured step)".into(),
                }
            );
        }
    }
    if launch.is_none() {
        // Every rank ran here: the metered peaks line up with the verifier's.
        print_memory(&report.run);
    }
    print_gpu_memory(&report);
    let timeline = &report.run.timeline;
    for o in pipec_runtime::trace::copy_overlap(program, timeline) {
        let pct = |x: f64| {
            if o.copy_us > 0.0 {
                100.0 * x / o.copy_us
            } else {
                0.0
            }
        };
        println!(
            "  rank {} copies (last step): {} offloads, {} reloads, {} on the copy stream: {} ({:.1}%) beside compute, {} ({:.1}%) exposed; wait_offload stalls {}",
            o.rank,
            o.offloads,
            o.reloads,
            ms(o.copy_us),
            ms(o.hidden_us),
            pct(o.hidden_us),
            ms(o.exposed_us),
            pct(o.exposed_us),
            ms(o.wait_offload_us)
        );
    }
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
                "calibrated (last step, per decoder layer{}): fwd {} bwd_D {} bwd_W {}{}, p2p {}",
                if c.pure {
                    ""
                } else {
                    ", embedding and head included: no stage holds decoder layers alone"
                },
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

/// The last step's high watermark of each GPU's memory pool (every buffer the backend
/// allocates: weights, gradient sums, activations, reloads), the most over the ranks on it.
fn print_gpu_memory(report: &pipec_cuda::run::CudaRunReport) {
    let Some(last) = report.run.steps.last() else {
        return;
    };
    let mut per_gpu: std::collections::BTreeMap<usize, u64> = Default::default();
    for (st, &g) in last.ranks.iter().zip(&report.devices) {
        if let Some(b) = st.gpu_peak_bytes {
            let e = per_gpu.entry(g).or_default();
            *e = (*e).max(b);
        }
    }
    if per_gpu.is_empty() {
        return;
    }
    let list: Vec<String> = per_gpu
        .iter()
        .map(|(g, b)| format!("GPU {g} {}", pipec_ir::memory::Unit::Bytes.fmt(*b as f64)))
        .collect();
    println!(
        "GPU memory pool peak (last step, all ranks on a GPU together): {}",
        list.join(", ")
    );
}

/// `--cuda-graph`: the eager warm-up step's wall time, the median of the replayed steps' (the
/// first launch, step 2, also instantiated the graph and is left out) and how many replayed.
fn graph_summary(steps: &[pipec_runtime::report::StepReport]) -> Option<(f64, Option<f64>, usize)> {
    if !steps.iter().any(|s| s.graph) {
        return None;
    }
    let mut replays: Vec<f64> = steps
        .iter()
        .skip(2)
        .filter(|s| s.graph)
        .map(|s| s.wall_us)
        .collect();
    replays.sort_by(f64::total_cmp);
    let median = (!replays.is_empty()).then(|| replays[replays.len() / 2]);
    Some((steps[0].wall_us, median, replays.len()))
}
