//! `pipec compare`: schedules side by side under one cost model: makespan, bubble and peak
//! activations. Inputs are compiled directories and/or `--schedule` kinds compiled in memory
//! with one `--pp`, `--vpp`, `--microbatches`.
//!
//! A makespan only compares on the same model: without `--layout` or `--num-layers`, every
//! `--schedule` is built with the same decoder layers (the least common multiple of the
//! candidates' stage counts) split evenly over its own stages, and rows whose models differ
//! are flagged rather than ranked.
//!
//! The cost model is the same for every row too: `--cost`/`--cost-file` when given, else the one
//! the directories' manifests record (`pipec tune` writes the model it planned with; `simulate`
//! reads it the same way, [`CostArgs::model_for`]). Directories whose recorded models differ are
//! refused, naming two of them, rather than ranked under a model one of them was not planned
//! with (issue #40: an offload plan re-costed at unit costs ranked first).

use super::args::CostArgs;
use super::compile::{compile_error, parse_kind};
use super::simulate::{run_sim, title};
use super::{print_json, CliError};
use pipec_compiler::compile::{compile, CompileRequest};
use pipec_cost::cost::{CostModel, StageCosts};
use pipec_cost::simulate::{simulate_unverified, SimError, Simulation, BUBBLE};
use pipec_ir::verify::Unverified;
use pipec_schedules::layout::{LayerKind, Layout};
use pipec_schedules::{ChunkRule, ScheduleKind};
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Compiled schedule directories.
    pub dirs: Vec<PathBuf>,
    /// A schedule kind to compile in memory (repeatable).
    #[arg(long, value_parser = parse_kind)]
    pub schedule: Vec<ScheduleKind>,
    /// Pipeline-parallel size for --schedule.
    #[arg(long)]
    pub pp: Option<u32>,
    /// Chunks per rank for --schedule kinds that take several (others use 1).
    #[arg(long)]
    pub vpp: Option<u32>,
    /// Microbatches for --schedule (may be left out with --microbatch-lengths).
    #[arg(long)]
    pub microbatches: Option<u32>,
    /// Microbatch lengths for every --schedule (index order; `pipec tune` chooses orders).
    #[command(flatten)]
    pub lengths: super::args::LengthsArgs,
    /// The group size, for interleaved-1f1b and group-interleaved only.
    #[arg(long)]
    pub group_size: Option<u32>,
    /// One Megatron layout for every --schedule (each must fit its stage count).
    #[arg(long, conflicts_with = "layout_file")]
    pub layout: Option<String>,
    /// Read the layout string from a file.
    #[arg(long, value_name = "FILE")]
    pub layout_file: Option<PathBuf>,
    /// Decoder layers of the model, split evenly over each --schedule's stages (default: the
    /// least common multiple of their stage counts, so every candidate gets the same model).
    #[arg(long)]
    pub num_layers: Option<u32>,
    /// MTP layers of the model (on the last stage without --layout).
    #[arg(long)]
    pub mtp_num_layers: Option<u32>,
    #[command(flatten)]
    pub cost: CostArgs,
    /// Machine-readable output.
    #[arg(long)]
    pub json: bool,
}

struct Row {
    name: String,
    instructions: usize,
    /// Decoder and MTP layers the row's costs were computed on.
    model: (usize, usize),
    result: Result<Simulation, SimError>,
}

/// The decoder and MTP layers a simulation costs: the layout's when it was used, else one
/// decoder layer per stage (see [`StageCosts::new`]).
fn model_of(layout: &Layout, num_stages: u32) -> (usize, usize) {
    if layout.num_stages() == num_stages {
        (
            layout.count(LayerKind::Decoder),
            layout.count(LayerKind::Mtp),
        )
    } else {
        (num_stages as usize, 0)
    }
}

/// `--vpp` goes to the kinds that take any chunk count; the V kinds keep their fixed 2.
fn vpp_for(a: &Args, kind: ScheduleKind) -> Option<u32> {
    if kind.chunk_rule() == ChunkRule::Any {
        a.vpp
    } else {
        None
    }
}

/// The default model of `--schedule` rows: the least common multiple of their stage counts,
/// so each splits it evenly. `None` when the multiple overflows.
fn common_layers(a: &Args, pp: u32) -> Option<u32> {
    let gcd = |mut x: u64, mut y: u64| {
        while y != 0 {
            (x, y) = (y, x % y);
        }
        x
    };
    let mut l: u64 = 1;
    for &k in &a.schedule {
        let stages = u64::from(pp) * u64::from(vpp_for(a, k).unwrap_or(k.default_vpp()).max(1));
        l = l / gcd(l, stages) * stages;
        if l > u64::from(u32::MAX) {
            return None;
        }
    }
    u32::try_from(l).ok()
}

fn in_memory(
    a: &Args,
    kind: ScheduleKind,
    model: &CostModel,
    num_layers: Option<u32>,
    lengths: Option<&pipec_schedules::Lengths>,
) -> Result<Row, CliError> {
    let (Some(pp), Some(m)) = (a.pp, a.microbatches) else {
        return Err(CliError::Usage(
            "--schedule needs --pp and --microbatches".to_string(),
        ));
    };
    let vpp = if a.layout.is_some() {
        None
    } else {
        vpp_for(a, kind)
    };
    let group_size = if kind.takes_group_size() {
        a.group_size
    } else {
        None
    };
    let c = compile(&CompileRequest {
        vpp,
        group_size,
        layout: a.layout.clone(),
        num_layers,
        mtp_num_layers: a.mtp_num_layers,
        lengths: lengths.cloned(),
        ..CompileRequest::new(kind, pp, m)
    })
    .map_err(|e| match compile_error(e) {
        CliError::Invalid(msg) => CliError::Invalid(format!("{kind}: {msg}")),
        other => other,
    })?;
    let costs = StageCosts::new(model, &c.layout, c.program.num_stages());
    Ok(Row {
        name: c.spec.label(),
        instructions: c.program.len(),
        model: model_of(&c.layout, c.program.num_stages()),
        // Compared as compiled: a kind that deadlocks shows as such in its row.
        result: simulate_unverified(&Unverified::unchecked(&c.program), &costs),
    })
}

/// `16 t` or `16 t + 1 m`.
fn model_name((t, m): (usize, usize)) -> String {
    if m == 0 {
        format!("{t} t")
    } else {
        format!("{t} t + {m} m")
    }
}

pub fn run(mut a: Args) -> Result<ExitCode, CliError> {
    if let Some(path) = &a.layout_file {
        a.layout = Some(super::layout::read_layout_file(path)?);
    }
    if a.dirs.is_empty() && a.schedule.is_empty() {
        return Err(CliError::Usage(
            "nothing to compare: give compiled directories and/or --schedule KIND".to_string(),
        ));
    }
    let model_flags = a.layout.is_some()
        || a.num_layers.is_some()
        || a.mtp_num_layers.is_some()
        || a.lengths.microbatch_lengths.is_some();
    if a.schedule.is_empty()
        && (a.pp.is_some() || a.microbatches.is_some() || a.vpp.is_some() || model_flags)
    {
        return Err(CliError::Usage(
            "--pp, --vpp, --microbatches, --microbatch-lengths, --layout and --num-layers apply to --schedule"
                .to_string(),
        ));
    }
    let lengths = a.lengths.load()?;
    a.microbatches = super::args::LengthsArgs::microbatches(lengths.as_ref(), a.microbatches)?;
    if a.layout.is_some() && a.vpp.is_some() {
        return Err(CliError::Usage(
            "--vpp comes from --layout (stages / pp); give one or the other".to_string(),
        ));
    }
    let loaded: Vec<_> = a
        .dirs
        .iter()
        .map(|d| super::load(d))
        .collect::<Result<_, _>>()?;
    let (model, model_source) = common_model(&a, &loaded)?;
    if let (Some(l), Some(shape)) = (&lengths, &model.shape) {
        l.check_seq(shape.seq).map_err(|e| {
            let path = a.lengths.microbatch_lengths.as_ref();
            let path = path.map(|p| p.display().to_string()).unwrap_or_default();
            CliError::Invalid(format!("{path}: {e}"))
        })?;
    }
    // The model every --schedule row is built on.
    let (num_layers, model_note) = match (&a.layout, a.num_layers, a.pp) {
        (Some(l), _, _) => (
            a.num_layers,
            format!("model: the layout {l} for every schedule"),
        ),
        (None, Some(n), _) => (
            Some(n),
            format!("model: {n} decoder layers, split evenly over each schedule's stages"),
        ),
        (None, None, Some(pp)) if !a.schedule.is_empty() => {
            let n = common_layers(&a, pp).ok_or_else(|| {
                CliError::Invalid("the candidates' stage counts have no common model below 2^32 layers; give --num-layers".to_string())
            })?;
            (
                Some(n),
                format!("model: {n} decoder layers (same for every schedule), split evenly over each schedule's stages; --num-layers or --layout to change"),
            )
        }
        _ => (None, String::new()),
    };
    let mut rows = Vec::new();
    for (d, loaded) in a.dirs.iter().zip(&loaded) {
        rows.push(Row {
            name: format!("{} ({})", d.display(), title(loaded)),
            instructions: loaded.program.len(),
            model: model_of(&loaded.manifest.layout, loaded.program.num_stages()),
            result: run_sim(loaded, &model),
        });
    }
    for &k in &a.schedule {
        rows.push(in_memory(&a, k, &model, num_layers, lengths.as_ref())?);
    }
    let failed = rows.iter().any(|r| r.result.is_err());
    let same_model = rows.iter().all(|r| r.model == rows[0].model);
    if a.json {
        let items: Vec<_> = rows
            .iter()
            .map(|r| match &r.result {
                Ok(s) => serde_json::json!({
                    "name": r.name,
                    "instructions": r.instructions,
                    "decoder_layers": r.model.0,
                    "mtp_layers": r.model.1,
                    "makespan": s.summary.makespan,
                    "mean_bubble_ratio": s.summary.mean_bubble(),
                    "max_bubble_ratio": s.summary.max_bubble(),
                    "peak_activations": pipec_cost::rounding::figure(s.summary.peak_activations()),
                    "peak_memory": pipec_cost::rounding::figure(s.summary.peak_memory()),
                    "memory_unit": s.summary.memory_unit,
                    "ranks": s.summary.ranks,
                }),
                Err(e) => serde_json::json!({
                    "name": r.name,
                    "instructions": r.instructions,
                    "error": e.to_string(),
                }),
            })
            .collect();
        print_json(&serde_json::json!({
            "cost": model,
            "same_model": same_model,
            "bubble": BUBBLE,
            "schedules": items,
        }));
    } else {
        let given = a.cost.given() || loaded.iter().any(|l| l.manifest.cost.is_some());
        println!("cost: {}{model_source}", model.describe_given(given));
        if !model_note.is_empty() {
            println!("{model_note}");
        }
        println!("bubble: {BUBBLE}");
        println!(
            "peak mem: the worst rank's parameters + live activations, in {}",
            pipec_cost::memory::unit_of(&model).label()
        );
        print!("{}", table(&rows));
        if !same_model {
            println!("* a different model from the first row: its makespan is not comparable");
        }
        for r in &rows {
            if let Err(e) = &r.result {
                eprintln!("{}: {e}", r.name);
            }
        }
    }
    Ok(if failed {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    })
}

/// The one cost model of the table and where it came from (printed after the model): the flags
/// when given; else the model the directories' manifests record, which must be the same for
/// all (a directory that records none counts as the defaults, as `simulate` costs it); else the
/// defaults. `--schedule` rows are costed on the same model.
fn common_model(
    a: &Args,
    loaded: &[pipec_ir::files::Loaded],
) -> Result<(CostModel, String), CliError> {
    if a.cost.given() || loaded.is_empty() {
        return Ok((a.cost.model()?, String::new()));
    }
    let what = |i: usize, m: &CostModel| match &loaded[i].manifest.cost {
        Some(_) => format!("  {}: {}", a.dirs[i].display(), m.describe_given(true)),
        None => format!("  {}: none recorded (default costs)", a.dirs[i].display()),
    };
    let mut first: Option<(usize, CostModel)> = None;
    for (i, l) in loaded.iter().enumerate() {
        let m = a.cost.model_for(l).map_err(|e| match e {
            CliError::Invalid(msg) => CliError::Invalid(format!("{}: {msg}", a.dirs[i].display())),
            other => other,
        })?;
        match &first {
            None => first = Some((i, m)),
            Some((i0, m0)) if *m0 != m => {
                return Err(CliError::Invalid(format!(
                    "the directories were planned with different cost models:\n{}\n{}\ngive --cost or --cost-file to compare them on one",
                    what(*i0, m0),
                    what(i, &m)
                )));
            }
            Some(_) => {}
        }
    }
    let recorded = loaded.iter().any(|l| l.manifest.cost.is_some());
    let (_, m) = first.expect("at least one directory");
    let source = if recorded {
        " (recorded in the directories' manifests)".to_string()
    } else {
        String::new()
    };
    Ok((m, source))
}

fn table(rows: &[Row]) -> String {
    let base = rows.iter().find_map(|r| {
        r.result
            .as_ref()
            .ok()
            .map(|s| (s.summary.makespan, r.model))
    });
    let head = [
        "schedule",
        "model",
        "instrs",
        "makespan",
        "vs first",
        "bubble mean",
        "bubble max",
        "peak mem",
    ];
    let cells: Vec<[String; 8]> = rows
        .iter()
        .map(|r| match &r.result {
            Ok(s) => {
                let m = s.summary.makespan;
                [
                    r.name.clone(),
                    model_name(r.model),
                    r.instructions.to_string(),
                    pipec_ir::human::num(m),
                    match base {
                        Some((b, bm)) if bm != r.model => {
                            format!("{:.2}x*", m / b.max(f64::MIN_POSITIVE))
                        }
                        Some((b, _)) if b > 0.0 => format!("{:.2}x", m / b),
                        _ => "-".to_string(),
                    },
                    format!("{:.1}%", s.summary.mean_bubble() * 100.0),
                    format!("{:.1}%", s.summary.max_bubble() * 100.0),
                    s.summary.memory_unit.fmt(s.summary.peak_memory()),
                ]
            }
            Err(e) => {
                let what = match e {
                    SimError::Deadlock(_) => "DEADLOCK",
                    _ => "INVALID",
                };
                [
                    r.name.clone(),
                    model_name(r.model),
                    r.instructions.to_string(),
                    what.to_string(),
                    "-".into(),
                    "-".into(),
                    "-".into(),
                    "-".into(),
                ]
            }
        })
        .collect();
    let w: Vec<usize> = (0..8)
        .map(|j| {
            cells
                .iter()
                .map(|c| c[j].chars().count())
                .chain([head[j].len()])
                .max()
                .unwrap_or(0)
        })
        .collect();
    let mut out = String::new();
    let mut line = |c: &[&str]| {
        let mut s = format!("{:<w0$}", c[0], w0 = w[0]);
        for j in 1..8 {
            s.push_str(&format!("  {:>wj$}", c[j], wj = w[j]));
        }
        out.push_str(s.trim_end());
        out.push('\n');
    };
    line(&head);
    for c in &cells {
        let refs: Vec<&str> = c.iter().map(String::as_str).collect();
        line(&refs);
    }
    out
}
