//! `pipec tune`: the fastest verified schedule and layer split for a model's costs and memory.

use super::args::CostArgs;
use super::compile::FileFormat;
use super::{print_json, CliError};
use pipec_compiler::target::{Target, TargetChoice};
use pipec_ir::files;
use pipec_ir::human::num;
use pipec_schedules::{Limits, SpecError};
use pipec_tune::{describe, fmt_mem, tune, TuneError, TuneRequest, Tuned};
use std::path::PathBuf;
use std::process::ExitCode;

/// What a byte peak counts, said beside it: the figures are parameters, gradients, optimizer
/// state and live activations; the rest of a device's memory goes to what no cost model sees.
const MEMORY_COUNTS: &str = "parameters, gradients, optimizer state and live activations; not the CUDA context, NCCL buffers, workspaces or fragmentation: leave about 10% of the device and a few GiB free (docs/memory.md, \"Margin\")";

/// The most memory a common accelerator holds (B200, MI300X: 192 GB): a plan whose peak is
/// above it, planned without a limit, gets a note.
const LARGEST_DEVICE_BYTES: f64 = 192e9;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Pipeline-parallel size (ranks).
    #[arg(long)]
    pub pp: u32,
    /// Number of microbatches (may be left out with --microbatch-lengths).
    #[arg(long, required_unless_present = "microbatch_lengths")]
    pub microbatches: Option<u32>,
    /// With lengths, tune also chooses the order microbatches enter the pipeline (index,
    /// ascending, descending, short-long-short by cost; `microbatch_order` in --json).
    #[command(flatten)]
    pub lengths: super::args::LengthsArgs,
    /// Decoder layers to split over the stages (default 2 x pp without --layout; refused
    /// with it, which gives the layers).
    #[arg(long)]
    pub num_layers: Option<u32>,
    /// MTP layers (on the last stage; refused with --layout).
    #[arg(long)]
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
    /// Memory every rank may use (parameters + live activations): bytes with a unit (40GiB,
    /// 500MB) when the cost model gives memory in bytes (t.act=1.5GiB), or a plain number of
    /// layer-activations (one decoder layer's activations of one microbatch).
    #[arg(long, value_name = "SIZE")]
    pub memory_limit: Option<String>,
    /// The framework that will run the schedule: only candidates it runs are eligible
    /// (megatron, torch, torchtitan, pipec-run, deepspeed, or any). Default: a schedule every
    /// framework pipec has an adapter for runs (one stage per rank, stage s on rank s).
    #[arg(long, value_parser = parse_target)]
    pub target: Option<Target>,
    /// Weigh only these kinds (comma-separated: `tuned` for pipec's own scheduler, `1f1b`,
    /// `zb-v`, ...).
    #[arg(long, value_delimiter = ',', value_name = "KINDS")]
    pub kinds: Option<Vec<String>>,
    /// Never weigh these kinds (comma-separated, as --kinds).
    #[arg(long, value_delimiter = ',', value_name = "KINDS")]
    pub exclude_kinds: Vec<String>,
    /// Never fit a candidate over --memory-limit by offloading activations to host memory.
    #[arg(long)]
    pub no_offload: bool,
    /// Never fit a candidate over --memory-limit by checkpointing forwards (recompute).
    #[arg(long)]
    pub no_recompute: bool,
    /// Print one JSON object instead of the report.
    #[arg(long)]
    pub json: bool,
    /// Print every candidate in the report's table (by default a table of more than 20 rows
    /// shows the best of each schedule kind and placement; --json always has every one).
    #[arg(long)]
    pub all: bool,
    /// Write the winner's compiled, verified instruction files here (as `pipec compile`).
    #[arg(short = 'o', long = "out")]
    pub out: Option<PathBuf>,
    /// Encoding of the rank files: json (default) or bin.
    #[arg(long = "format", value_enum, default_value_t = FileFormat::Json)]
    pub format: FileFormat,
    /// Refuse requests with more compute ops than this.
    #[arg(long, default_value_t = Limits::DEFAULT.max_compute_ops,
          value_parser = clap::value_parser!(u64).range(1..=pipec_schedules::MAX_COMPUTE_OPS))]
    pub max_ops: u64,
    /// Host memory every rank may hold for activations offloaded under --memory-limit (a size
    /// as --memory-limit takes): a plan whose offloads hold more on some rank is not taken.
    #[arg(long, value_name = "SIZE")]
    pub host_memory_limit: Option<String>,
    /// Which communicator carries each send and receive, as `pipec compile --p2p-groups`:
    /// pair (default; one per pair of ranks, torch's lazy per-pair communicators), direction
    /// (one for downstream activations, one for upstream gradients, over all ranks: pytorch
    /// #186173) or edge (one per directed pair of ranks: pytorch #196666). Every candidate is
    /// verified under them (one that deadlocks there is not taken) and the written manifest
    /// records them; pipec.torch and the CUDA runtime create them.
    #[arg(long, value_name = "GROUPS", value_parser = super::compile::parse_groups, default_value = "pair")]
    pub p2p_groups: pipec_schedules::P2pGroups,
}

fn parse_target(s: &str) -> Result<Target, String> {
    s.parse()
}

fn request(a: &Args) -> Result<TuneRequest, CliError> {
    // A usage error, as clap's conflicts are, in the words Python uses too.
    if a.layout.is_some() {
        for (given, flag) in [
            (a.num_layers.is_some(), "--num-layers"),
            (a.mtp_num_layers.is_some(), "--mtp-num-layers"),
        ] {
            if given {
                return Err(CliError::Usage(pipec_tune::layers_with_layout(
                    flag, "--layout",
                )));
            }
        }
    }
    let model = a.cost.model()?;
    let layout = match &a.layout {
        Some(text) => {
            let l = pipec_schedules::layout::parse(text)
                .map_err(|e| CliError::Invalid(super::layout::render_error(&e)))?;
            if !a.rebalance {
                pipec_schedules::layout::check_against(&l, a.pp.max(1), None, None, None)
                    .map_err(|e| CliError::Invalid(super::layout::render_error(&e)))?;
            }
            Some(l)
        }
        None => None,
    };
    let memory_limit = match &a.memory_limit {
        Some(s) => Some(
            pipec_cost::memory::Limit::parse(s)
                .map_err(|e| CliError::Invalid(format!("--memory-limit: {e}")))?,
        ),
        None => None,
    };
    // A byte limit needs byte costs: 40GiB against 1-unit activations would be met by anything.
    super::resolve_limit(memory_limit, &model)?;
    let host_memory_limit = match &a.host_memory_limit {
        Some(s) => {
            let l = pipec_cost::memory::Limit::parse(s)
                .map_err(|e| CliError::Invalid(format!("--host-memory-limit: {e}")))?;
            l.resolve_for(&model)
                .map_err(|e| CliError::Invalid(format!("--host-memory-limit: {e}")))?;
            Some(l)
        }
        None => None,
    };
    // In the words `compile` uses for the same values.
    if a.pp == 0 {
        return Err(CliError::Invalid(SpecError::ZeroPp.to_string()));
    }
    let lengths = a.lengths.load()?;
    let microbatches =
        super::args::LengthsArgs::microbatches(lengths.as_ref(), a.microbatches)?.unwrap_or(0);
    if microbatches == 0 {
        return Err(CliError::Invalid(SpecError::ZeroMicrobatches.to_string()));
    }
    if let (Some(l), Some(shape)) = (&lengths, &model.shape) {
        l.check_seq(shape.seq).map_err(|e| {
            let path = a.lengths.microbatch_lengths.as_ref();
            let path = path.map(|p| p.display().to_string()).unwrap_or_default();
            CliError::Invalid(format!("{path}: {e}"))
        })?;
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
        target: a.target.map_or(TargetChoice::Every, TargetChoice::One),
        kinds: a.kinds.clone(),
        exclude_kinds: a.exclude_kinds.clone(),
        levers: pipec_compiler::target::Levers {
            offload: !a.no_offload,
            recompute: !a.no_recompute,
        },
        lengths,
        host_memory_limit,
        p2p_groups: a.p2p_groups,
        // The target's costs (Megatron's split backward), as tune plans with and the
        // manifest records.
        ..TuneRequest::new(
            a.pp,
            microbatches,
            pipec_tune::target_model(
                &model,
                a.target.map_or(TargetChoice::Every, TargetChoice::One),
            ),
        )
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
        | TuneError::Nothing(_)
        | TuneError::Kind(..)
        | TuneError::Spec(_)
        | TuneError::TooManyLayers { .. }
        | TuneError::NoLayers
        | TuneError::NotRunnable { .. }
        | TuneError::LengthsCount { .. }
        | TuneError::Lengths(_)
        | TuneError::HostMemory { .. }
        | TuneError::P2pGroups { .. }
        | TuneError::LayersDisagree(_) => CliError::Invalid(e.to_string()),
        TuneError::Limit(e) => CliError::Invalid(format!("--memory-limit: {e}")),
        TuneError::HostLimit(e) => CliError::Invalid(format!("--host-memory-limit: {e}")),
    })?;
    progress.finish_and_clear();
    let seconds = t0.elapsed().as_secs_f64();
    if let Some(out) = &a.out {
        write(&t, out, a.format, &req.model, a.cost.given())?;
    }
    let dir = a.out.as_ref().map(|o| o.display().to_string());
    if a.json {
        print_json(&t.json_for(seconds, dir.as_deref()));
    } else {
        print_report(&t, &req, seconds, a.out.as_deref(), a.all);
    }
    Ok(ExitCode::SUCCESS)
}

/// Write the tuned schedule as `pipec compile` writes one (the same bytes, streamed).
fn write(
    t: &Tuned,
    out: &std::path::Path,
    format: FileFormat,
    model: &pipec_cost::cost::CostModel,
    record_cost: bool,
) -> Result<(), CliError> {
    let layout = t.file_layout();
    let header = t.header(&layout);
    // The manifest keeps the cost model tune planned with, so `show` draws tune's timeline.
    // A plan no spec names (the tuner's own, or a built-in kind fitted with levers): the
    // manifest names it, so viewers title it by its kind and chunks per rank.
    let prepared = files::prepare(&header, t.program(), format.encoding())
        .with_cost(record_cost.then(|| model.spec()))
        .with_plan(t.plan_name());
    let threads = files::threads_for(t.program().len() as u64);
    super::warn_big_write(prepared.bytes(), out);
    // tune's winner is a Verified value (memory counted under `model`): its verdict is the
    // writer's warrant, so nothing unverified can reach the disk.
    files::write_verified(out, &prepared, threads, &t.verified)
        .map_err(|e| CliError::Usage(e.to_string()))
}

fn print_report(
    t: &Tuned,
    req: &TuneRequest,
    seconds: f64,
    out: Option<&std::path::Path>,
    all: bool,
) {
    let b = &t.best;
    println!(
        "tuned pp={} microbatches={} in {:.2}s: {} candidates weighed",
        req.pp,
        req.microbatches,
        seconds,
        t.candidates.len()
    );
    match t.target {
        TargetChoice::Every => println!(
            "target:   every framework ({}; --target names one, for plans only it runs)",
            Target::FRAMEWORKS.map(|t| t.name()).join(", ")
        ),
        TargetChoice::One(x) => println!("target:   {x}"),
    }
    println!("schedule: {}", describe(b));
    if let (Some(h), Some(words)) = (&b.heuristic, t.heuristic_description()) {
        // The zero-bubble authors' rules (`zb,...`) are theirs, reimplemented: not pipec's own.
        let whose = if h.starts_with("zb") {
            ""
        } else {
            "pipec's own list scheduler: "
        };
        println!("order:    {whose}{words} (heuristic {h})");
    }
    println!("layout:   {}", b.layout);
    if let (Some(o), Some(rule)) = (&b.microbatch_order, &b.microbatch_order_rule) {
        println!("microbatch order: {rule} ({})", short_order(o));
    }
    let empty = t.empty_stages();
    if empty > 0 {
        println!(
            "note:     {empty} of {} stages hold no layer (fewer decoder layers than stages): their ranks only pass tensors on",
            t.layout.stages.len()
        );
    }
    let lb = t.lower_bound.value;
    // With `[model]` `tflops` the times are absolute: the report names their unit. Without
    // it the line stays as it was (the `cost:` header of `show` says "decoder-layer
    // forwards").
    let unit = match (&req.model.shape, req.model.time_unit) {
        (Some(s), Some(u)) if s.tflops.is_some() => match u {
            1.0 => " s",
            1e-3 => " ms",
            _ => " us",
        },
        _ => "",
    };
    println!(
        "makespan: {}{unit} (lower bound {}, {:.1}% above; bubble {:.1}%)",
        num(b.makespan),
        num(lb),
        if lb > 0.0 {
            ((b.makespan / lb - 1.0) * 100.0).max(0.0)
        } else {
            0.0
        },
        t.summary.mean_bubble() * 100.0
    );
    let unit = pipec_cost::memory::unit_of(&req.model);
    println!(
        "peak memory per rank: {}{}",
        unit.list(t.peak_memory.iter().copied()),
        req.limit()
            .map(|l| format!(" (limit {})", unit.with_unit(l)))
            .unwrap_or_default()
    );
    if unit == pipec_ir::memory::Unit::Bytes {
        // What the byte figures count, and what they do not (#40 point 6).
        println!("          ({MEMORY_COUNTS})");
        let max = t.peak_memory.iter().copied().fold(0.0, f64::max);
        if req.limit().is_none() && max > LARGEST_DEVICE_BYTES {
            println!(
                "note:     the peak, {}, is more than any common accelerator holds (192 GB: B200, MI300X; H200 141 GB, H100 80 GB); give --memory-limit with your device's memory, less the margin",
                unit.with_unit(max)
            );
        }
    }
    // Offloaded activations live in host memory (#40 point 2): each rank's most at once.
    let host_max = t.host_peak_memory.iter().copied().fold(0.0, f64::max);
    if host_max > 0.0 || req.host_limit().is_some() {
        println!(
            "host memory per rank (offloaded activations): {}{}",
            unit.list(t.host_peak_memory.iter().copied()),
            req.host_limit()
                .map(|l| format!(" (limit {})", unit.with_unit(l)))
                .unwrap_or_default()
        );
    }
    if t.copy_speed_assumed {
        println!("copies:   {}", pipec_tune::COPY_ASSUMED);
    }
    if let Some(l) = &b.levers {
        println!(
            "fitting:  offloaded per rank {}; recomputed per rank {}; makespan {} without them (+{:.1}%)",
            l.offloaded.iter().map(u64::to_string).collect::<Vec<_>>().join(" "),
            l.recomputed.iter().map(u64::to_string).collect::<Vec<_>>().join(" "),
            num(l.unfitted_makespan),
            if l.unfitted_makespan > 0.0 {
                (b.makespan / l.unfitted_makespan - 1.0) * 100.0
            } else {
                0.0
            }
        );
    }
    println!("verdict:  {}", t.report().verdict_line());
    let groups = t.program().p2p_groups;
    if !groups.is_pair() {
        // The default (`pair`) leaves the runtime's communicators unknown: no line.
        println!("groups:   {groups} (the P2P communicators every candidate is verified on)");
    }
    if let Some(o) = out {
        println!("wrote {}", o.display());
    }
    print_per_target(t, unit);
    println!();
    let dir = out.map(|o| o.display().to_string());
    println!(
        "run it{}:",
        if dir.is_none() {
            " (write it with -o DIR)"
        } else {
            ""
        }
    );
    for target in t.run_targets() {
        for (i, line) in t.how_to_run(target, dir.as_deref()).iter().enumerate() {
            let head = if i == 0 {
                format!("{}:", target.name())
            } else {
                String::new()
            };
            println!("  {head:<12}{line}");
        }
    }
    if matches!(
        t.target,
        TargetChoice::One(Target::Any) | TargetChoice::Every
    ) {
        for (target, why) in &t.not_runnable_on {
            println!("  {:<12}not runnable: {why}", format!("{}:", target.name()));
        }
    }
    println!();
    let table = t.table_rows(all);
    let names: Vec<String> = table
        .rows
        .iter()
        .map(|c| {
            let mut name = describe(c);
            if let Some(why) = &c.not_runnable {
                let on = why.split(':').next().unwrap_or(why);
                name.push_str(&format!(" ({on})"));
            } else if !c.fits {
                name.push_str(" (over limit)");
            }
            // With lengths, each row names the microbatch order it was measured in.
            if let Some(rule) = &c.microbatch_order_rule {
                name.push_str(&format!(" [{rule}]"));
            }
            name
        })
        .collect();
    let w = names.iter().map(|n| n.len()).max().unwrap_or(9).max(9);
    println!(
        "{:<w$} {:>10} {:>7} {:>10}  layout",
        "candidate", "makespan", "bubble", "peak mem"
    );
    for (c, name) in table.rows.iter().zip(names) {
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
    if table.merged > 0 {
        println!(
            "({} {} the same plan as a row above, shown once)",
            table.merged,
            if table.merged == 1 {
                "row was"
            } else {
                "rows were"
            }
        );
    }
    if table.hidden > 0 {
        println!(
            "({} more candidates: the best of each schedule kind and placement is shown; --all prints every one)",
            table.hidden
        );
    }
    // Why the marked candidates cannot run, one line per reason.
    let mut reasons: Vec<(String, Vec<String>)> = Vec::new();
    let marked = t
        .candidates
        .iter()
        .filter_map(|c| c.not_runnable.clone().map(|w| (describe(c), w)))
        .chain(
            t.skipped
                .iter()
                .map(|(n, w)| (format!("{n} (not planned)"), w.clone())),
        );
    for (name, why) in marked {
        match reasons.iter_mut().find(|(w, _)| *w == why) {
            Some((_, names)) => names.push(name),
            None => reasons.push((why, vec![name])),
        }
    }
    if !reasons.is_empty() {
        println!();
        for (why, names) in reasons {
            let (on, rest) = why.split_once(": ").unwrap_or((&why, ""));
            println!("{on}: {}: {rest}", names.join(", "));
        }
    }
}

/// Without --target (#40 point 11): each framework's own best plan (what `--target T`
/// returns) beside the common plan above, and what the common plan gives up against it.
fn print_per_target(t: &Tuned, unit: pipec_ir::memory::Unit) {
    if t.per_target.is_empty() {
        return;
    }
    println!();
    println!("each framework's own best (--target NAME; the plan above is the one every framework runs):");
    for (target, r) in &t.per_target {
        let head = format!("{}:", target.name());
        match r {
            Ok(b) => {
                let up = t.gives_up(b);
                let against = if up > 5e-13 {
                    format!("; the common plan is {:.1}% slower", up * 100.0)
                } else {
                    "; as fast as the common plan".to_string()
                };
                println!(
                    "  {head:<12}{}: makespan {}{against}",
                    describe(&b.best),
                    num(b.best.makespan)
                );
                let host = if b.host_peak_memory.iter().any(|&h| h > 0.0) {
                    format!("; host {}", unit.list(b.host_peak_memory.iter().copied()))
                } else {
                    String::new()
                };
                println!(
                    "  {:<12}peak {}{host}",
                    "",
                    unit.list(b.peak_memory.iter().copied())
                );
            }
            Err(e) => println!(
                "  {head:<12}no plan: {}",
                e.lines().next().unwrap_or_default()
            ),
        }
    }
    if !t.copy_speed_assumed
        && t.per_target
            .iter()
            .any(|(_, r)| r.as_ref().is_ok_and(|b| b.copy_speed_assumed))
    {
        println!("  {:<12}{}", "copies:", pipec_tune::COPY_ASSUMED);
    }
}

/// An order for people: every id up to 16, else the first 12 and how many more.
fn short_order(o: &[u32]) -> String {
    let shown: Vec<String> = o.iter().take(16).map(u32::to_string).collect();
    if o.len() > 16 {
        let head: Vec<String> = o.iter().take(12).map(u32::to_string).collect();
        format!("{}, ... {} more", head.join(", "), o.len() - 12)
    } else {
        shown.join(", ")
    }
}
