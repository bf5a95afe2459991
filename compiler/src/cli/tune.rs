//! `pipec tune`: the fastest verified schedule and layer split for a model's costs and memory.

use super::compile::FileFormat;
use super::simulate::CostArgs;
use super::{print_json, CliError};
use pipec::back::files;
use pipec::simulate::cost::{num, parse_memory};
use pipec::tune::{describe, fmt_mem, tune, TuneError, TuneRequest, Tuned};
use pipec_schedules::Limits;
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Pipeline-parallel size (ranks).
    #[arg(long)]
    pub pp: u32,
    /// Number of microbatches.
    #[arg(long)]
    pub microbatches: u32,
    /// Decoder layers to split over the stages (default 2 x pp without --layout).
    #[arg(long, conflicts_with = "layout")]
    pub num_layers: Option<u32>,
    /// MTP layers (on the last stage).
    #[arg(long, conflicts_with = "layout")]
    pub mtp_num_layers: Option<u32>,
    /// Keep this Megatron layout's split (e.g. "Et*3|(tt|)*29,m|L"); with --rebalance, only
    /// its layer counts.
    #[arg(long)]
    pub layout: Option<String>,
    /// Re-split the layers of --layout instead of keeping its split.
    #[arg(long, requires = "layout")]
    pub rebalance: bool,
    #[command(flatten)]
    pub cost: CostArgs,
    /// Memory every rank may use: bytes with a unit (40GiB, 500MB) or a plain number in the
    /// units of the cost file's K.act / K.param (default: one decoder layer's activations of
    /// one microbatch = 1).
    #[arg(long, value_name = "SIZE")]
    pub memory_limit: Option<String>,
    /// Print one JSON object instead of the report.
    #[arg(long)]
    pub json: bool,
    /// Write the winner's compiled, verified instruction files here (as `pipec compile`).
    #[arg(short = 'o', long = "out")]
    pub out: Option<PathBuf>,
    /// Encoding of the rank files: json (default) or bin.
    #[arg(long = "format", value_enum, default_value_t = FileFormat::Json)]
    pub format: FileFormat,
    /// Refuse requests with more compute ops than this.
    #[arg(long, default_value_t = Limits::DEFAULT.max_compute_ops)]
    pub max_ops: u64,
}

fn request(a: &Args) -> Result<TuneRequest, CliError> {
    let model = a.cost.model()?;
    let layout = match &a.layout {
        Some(text) => {
            let l = pipec::front::layout::parse(text)
                .map_err(|e| CliError::Invalid(super::layout::render_error(&e)))?;
            if !a.rebalance {
                pipec::front::layout::check_against(&l, a.pp.max(1), None, None, None)
                    .map_err(|e| CliError::Invalid(super::layout::render_error(&e)))?;
            }
            Some(l)
        }
        None => None,
    };
    let memory_limit = match &a.memory_limit {
        Some(s) => Some(
            parse_memory(s)
                .map_err(|e| CliError::Invalid(format!("--memory-limit: {e}")))?
                .0,
        ),
        None => None,
    };
    if a.pp == 0 || a.microbatches == 0 {
        return Err(CliError::Invalid(
            "--pp and --microbatches must be at least 1".into(),
        ));
    }
    Ok(TuneRequest {
        layout,
        rebalance: a.rebalance,
        num_layers: a.num_layers,
        mtp_num_layers: a.mtp_num_layers,
        memory_limit,
        limits: Limits {
            max_compute_ops: a.max_ops,
        },
        ..TuneRequest::new(a.pp, a.microbatches, model)
    })
}

pub fn run(a: Args) -> Result<ExitCode, CliError> {
    let req = request(&a)?;
    let t0 = std::time::Instant::now();
    let progress = super::spinner("weighing schedules");
    let t = tune(&req).map_err(|e| match e {
        TuneError::Memory { .. }
        | TuneError::Stages { .. }
        | TuneError::Zero
        | TuneError::TooBig(..)
        | TuneError::Nothing(_) => CliError::Invalid(e.to_string()),
    })?;
    progress.finish_and_clear();
    let seconds = t0.elapsed().as_secs_f64();
    if let Some(out) = &a.out {
        write(&t, out, a.format)?;
    }
    if a.json {
        print_json(&t.json(seconds));
    } else {
        print_report(&t, &req, seconds, a.out.as_deref());
    }
    Ok(ExitCode::SUCCESS)
}

/// Write the tuned schedule as `pipec compile` writes one (the same bytes, streamed).
fn write(t: &Tuned, out: &std::path::Path, format: FileFormat) -> Result<(), CliError> {
    let layout = t.file_layout();
    let header = t.header(&layout);
    let prepared = files::prepare(&header, &t.program, format.encoding());
    let threads = files::threads_for(t.program.len() as u64);
    super::write_gated(out, &prepared, threads, || {
        // tune verified the program already (memory included); verify again as compile
        // does, so nothing unverified can reach the disk whatever changes upstream.
        super::verify_before_write(&t.program, None, Some(t.comm), out)?;
        super::warn_big_write(prepared.bytes(), out);
        Ok(())
    })
}

fn print_report(t: &Tuned, req: &TuneRequest, seconds: f64, out: Option<&std::path::Path>) {
    let b = &t.best;
    println!(
        "tuned pp={} microbatches={} in {:.2}s: {} candidates weighed",
        req.pp,
        req.microbatches,
        seconds,
        t.candidates.len()
    );
    println!(
        "schedule: {}{}",
        describe(b),
        b.heuristic
            .as_ref()
            .map(|h| format!(" (heuristic {h})"))
            .unwrap_or_default()
    );
    println!("layout:   {}", b.layout);
    let lb = t.lower_bound.value;
    println!(
        "makespan: {} (lower bound {}, {:.1}% above; bubble {:.1}%)",
        num(b.makespan),
        num(lb),
        if lb > 0.0 {
            ((b.makespan / lb - 1.0) * 100.0).max(0.0)
        } else {
            0.0
        },
        t.summary.mean_bubble() * 100.0
    );
    println!(
        "peak memory per rank: {}{}",
        t.peak_memory
            .iter()
            .map(|&x| fmt_mem(x, t.bytes))
            .collect::<Vec<_>>()
            .join(" "),
        req.memory_limit
            .map(|l| format!(" (limit {})", fmt_mem(l, t.bytes)))
            .unwrap_or_default()
    );
    println!("verdict:  {}", t.report.verdict_line());
    if let Some(o) = out {
        println!("wrote {}", o.display());
    }
    println!();
    let names: Vec<String> = t
        .candidates
        .iter()
        .map(|c| {
            let mut name = describe(c);
            if !c.fits {
                name.push_str(" (over limit)");
            }
            name
        })
        .collect();
    let w = names.iter().map(|n| n.len()).max().unwrap_or(9).max(9);
    println!(
        "{:<w$} {:>10} {:>7} {:>10}  layout",
        "candidate", "makespan", "bubble", "peak mem"
    );
    for (c, name) in t.candidates.iter().zip(names) {
        let lay = if c.layout.len() > 40 {
            format!("{}...", &c.layout[..37])
        } else {
            c.layout.clone()
        };
        println!(
            "{:<w$} {:>10} {:>6.1}% {:>10}  {}",
            name,
            num(c.makespan),
            c.bubble * 100.0,
            fmt_mem(c.peak_memory, t.bytes),
            lay
        );
    }
}
