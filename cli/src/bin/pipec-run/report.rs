//! What `pipec-run` prints: one report for both backends (text or `--json`), the trace file,
//! the interpreter's overhead and the CUDA calibration.

use crate::args::Args;
use pipec_runtime::model::ModelConfig;
use pipec_runtime::report::StepReport;
use pipec_runtime::{RunError, RunReport};

pub(crate) fn ms(us: f64) -> String {
    format!("{:.3} ms", us / 1000.0)
}

/// Every step of a run in text, the same for both backends: the loss and wall time (from the
/// `leader`, the process that speaks for all), a line per rank this process ran (labelled with
/// its GPU on CUDA), and what the check found (`check(i, step)`, worded by the backend: bitwise
/// on the CPU, a normwise tolerance on GPUs).
pub(crate) fn print_steps(
    steps: &[StepReport],
    static_peak: &[u32],
    leader: bool,
    ranks: &[(u32, Option<usize>)],
    check: impl Fn(usize, &StepReport) -> Option<String>,
) {
    for (i, s) in steps.iter().enumerate() {
        if leader {
            println!(
                "step {}: loss {:.6}  wall {}{}",
                s.step + 1,
                s.loss,
                ms(s.wall_us),
                match (s.graph, i) {
                    (false, _) => "",
                    (true, 1) => "  (captured in a CUDA graph, first launch)",
                    (true, _) => "  (CUDA graph replay)",
                }
            );
        }
        for (st, &(r, gpu)) in s.ranks.iter().zip(ranks) {
            let label = match gpu {
                Some(g) => format!("rank {r} (GPU {g})"),
                None => format!("rank {r}"),
            };
            // A graph step is one launch for every rank: no per-rank busy and idle times.
            let times = if s.graph {
                String::new()
            } else {
                let pct = if s.wall_us > 0.0 {
                    100.0 * st.idle_us / s.wall_us
                } else {
                    0.0
                };
                format!(
                    "busy {}  idle {} ({pct:.1}%)  ",
                    ms(st.busy_us),
                    ms(st.idle_us)
                )
            };
            println!(
                "  {label}: {times}peak activations {} (static {})",
                st.peak_activations,
                static_peak.get(r as usize).copied().unwrap_or(0)
            );
        }
        if let Some(c) = check(i, s) {
            println!("  check: {c}");
        }
    }
}

/// The CPU backend's report: every rank runs in this process, the check is bitwise.
pub(crate) fn print_report(args: &Args, report: &RunReport) {
    let ranks: Vec<(u32, Option<usize>)> = (0..report.static_peak_activations.len() as u32)
        .map(|r| (r, None))
        .collect();
    print_steps(
        &report.steps,
        &report.static_peak_activations,
        true,
        &ranks,
        |_, s| {
            s.check.as_ref().map(|c| {
                format!(
                    "losses and {} gradient tensors ({} values) equal the single-thread reference bitwise",
                    c.tensors, c.values
                )
            })
        },
    );
    print_memory(report);
    if let Some(p) = &args.trace {
        match args.trace_steps.as_deref() {
            None => println!("trace: {} (last step)", p.display()),
            Some(s) => println!("trace: {} (steps {s}, one process each)", p.display()),
        }
    }
}

/// The last step's peak memory per rank (parameters plus what the device store held, and the
/// host store when a rank offloads) beside the verifier's count. These are modelled bytes, not
/// allocations: the run counts each tensor its stores hold at the size the manifest's cost
/// model gives it (the synthetic model's tensors are far smaller), so the line says "held in
/// the run" and the unit is marked "modelled" (issue #40: it read "measured"). The GPU pool's
/// real high watermark is a separate line on CUDA ([`crate::cuda`]).
pub(crate) fn print_memory(report: &RunReport) {
    let Some(last) = report.steps.last() else {
        return;
    };
    let unit = report.memory_unit;
    let figures =
        |xs: &mut dyn Iterator<Item = f64>| xs.map(|x| unit.fmt(x)).collect::<Vec<_>>().join(" ");
    let mut line = format!(
        "peak memory per rank ({}, modelled: each held tensor at its cost-model size): {} held in the run, verifier {}",
        unit.label(),
        figures(&mut last.ranks.iter().map(|r| r.peak_memory)),
        figures(&mut report.static_memory.iter().map(|p| p.peak)),
    );
    if last.ranks.iter().any(|r| r.host_memory > 0.0)
        || report.static_memory.iter().any(|p| p.host > 0.0)
    {
        line.push_str(&format!(
            "; host {} held in the run, verifier {}",
            figures(&mut last.ranks.iter().map(|r| r.host_memory)),
            figures(&mut report.static_memory.iter().map(|p| p.host)),
        ));
    }
    println!("{line}");
}

/// The interpreter's own overhead ([`pipec_runtime::run::interpreter_us`]) against the
/// measured steps.
pub(crate) struct Interp {
    per_rank_us: Option<Vec<f64>>,
    share: Option<f64>,
    instrs: usize,
}

impl Interp {
    pub(crate) fn measure(
        program: &pipec_ir::ir::Program,
        steps: &[pipec_runtime::report::StepReport],
    ) -> Self {
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

    pub(crate) fn print(&self) {
        if let (Some(us), Some(share)) = (&self.per_rank_us, self.share) {
            println!(
                "interpreter: {} per step on the busiest rank (up to {} instructions; no-op backend) = {:.2}% of the mean step wall time",
                ms(us.iter().copied().fold(0.0, f64::max)),
                self.instrs,
                100.0 * share
            );
        }
    }

    pub(crate) fn add_to(&self, out: &mut serde_json::Value) {
        out["interpreter_us"] = serde_json::json!(self.per_rank_us);
        out["interpreter_share"] = serde_json::json!(self.share);
    }
}

/// The fields every `--json` report starts with: what ran, on what, with which model.
pub(crate) fn json_head(
    args: &Args,
    dir: &std::path::Path,
    m: &pipec_ir::files::Manifest,
    cfg: ModelConfig,
    backend: &str,
    dtype: &str,
) -> serde_json::Value {
    let mut head = serde_json::json!({
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
    });
    // Only with lengths (each microbatch's tokens replace `model.seq`), so a plan without
    // them reports what it did before.
    if let Some(l) = &m.microbatch_lengths {
        head["microbatch_lengths"] = serde_json::json!(l);
    }
    head
}

/// `--trace FILE`: the measured timeline as a Chrome trace.
pub(crate) fn write_trace(
    args: &Args,
    program: &pipec_ir::ir::Program,
    timeline: &pipec_cost::timeline::Timeline,
) -> Result<(), RunError> {
    if let Some(p) = &args.trace {
        let text =
            pipec_compiler::view::chrome::chrome_trace("measured (pipec-run)", program, timeline);
        std::fs::write(p, text)
            .map_err(|e| RunError::Usage(format!("cannot write {}: {e}", p.display())))?;
    }
    Ok(())
}

pub(crate) fn print_json(v: &serde_json::Value) {
    println!(
        "{}",
        serde_json::to_string_pretty(v).expect("a JSON value always serializes")
    );
}
