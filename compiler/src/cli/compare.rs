//! `pipec compare`: schedules side by side under one cost model: makespan, bubble and peak
//! activations. Inputs are compiled directories and/or `--schedule` kinds compiled in memory
//! with one `--pp`, `--vpp`, `--microbatches`.

use super::compile::{compile_error, parse_kind};
use super::simulate::{run_sim, title, CostArgs};
use super::{print_json, CliError};
use pipec::compile::{compile, CompileRequest};
use pipec::cost::{CostModel, StageCosts};
use pipec::simulate::{simulate, SimError, Simulation};
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
    /// Microbatches for --schedule.
    #[arg(long)]
    pub microbatches: Option<u32>,
    /// Megatron's group size, for interleaved-1f1b only.
    #[arg(long)]
    pub group_size: Option<u32>,
    #[command(flatten)]
    pub cost: CostArgs,
    /// Machine-readable output.
    #[arg(long)]
    pub json: bool,
}

struct Row {
    name: String,
    instructions: usize,
    result: Result<Simulation, SimError>,
}

fn in_memory(a: &Args, kind: ScheduleKind, model: &CostModel) -> Result<Row, CliError> {
    let (Some(pp), Some(m)) = (a.pp, a.microbatches) else {
        return Err(CliError::Usage(
            "--schedule needs --pp and --microbatches".to_string(),
        ));
    };
    // --vpp goes to the kinds that take any chunk count; the V kinds keep their fixed 2.
    let vpp = if kind.chunk_rule() == ChunkRule::Any {
        a.vpp
    } else {
        None
    };
    let group_size = if kind == ScheduleKind::Interleaved1F1B {
        a.group_size
    } else {
        None
    };
    let c = compile(&CompileRequest {
        vpp,
        group_size,
        ..CompileRequest::new(kind, pp, m)
    })
    .map_err(compile_error)?;
    let costs = StageCosts::new(model, &c.layout, c.program.num_stages());
    Ok(Row {
        name: format!(
            "{} pp={} vpp={} microbatches={}",
            c.spec.kind, c.spec.pp, c.spec.vpp, c.spec.microbatches
        ),
        instructions: c.program.len(),
        result: simulate(&c.program, &costs),
    })
}

pub fn run(a: Args) -> Result<ExitCode, CliError> {
    if a.dirs.is_empty() && a.schedule.is_empty() {
        return Err(CliError::Usage(
            "nothing to compare: give compiled directories and/or --schedule KIND".to_string(),
        ));
    }
    if a.schedule.is_empty() && (a.pp.is_some() || a.microbatches.is_some() || a.vpp.is_some()) {
        return Err(CliError::Usage(
            "--pp, --vpp and --microbatches apply to --schedule".to_string(),
        ));
    }
    let model = a.cost.model()?;
    let mut rows = Vec::new();
    for d in &a.dirs {
        let loaded = super::load(d)?;
        rows.push(Row {
            name: format!("{} ({})", d.display(), title(&loaded.manifest)),
            instructions: loaded.program.len(),
            result: run_sim(&loaded, &model),
        });
    }
    for &k in &a.schedule {
        rows.push(in_memory(&a, k, &model)?);
    }
    let failed = rows.iter().any(|r| r.result.is_err());
    if a.json {
        let items: Vec<_> = rows
            .iter()
            .map(|r| match &r.result {
                Ok(s) => serde_json::json!({
                    "name": r.name,
                    "instructions": r.instructions,
                    "makespan": s.summary.makespan,
                    "mean_bubble_ratio": s.summary.mean_bubble(),
                    "max_bubble_ratio": s.summary.max_bubble(),
                    "peak_activations": s.summary.peak_activations(),
                    "ranks": s.summary.ranks,
                }),
                Err(e) => serde_json::json!({
                    "name": r.name,
                    "instructions": r.instructions,
                    "error": e.to_string(),
                }),
            })
            .collect();
        print_json(&serde_json::json!({ "cost": model, "schedules": items }));
    } else {
        println!("cost: {}", model.describe());
        print!("{}", table(&rows));
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

fn table(rows: &[Row]) -> String {
    let base = rows
        .iter()
        .find_map(|r| r.result.as_ref().ok().map(|s| s.summary.makespan));
    let head = [
        "schedule",
        "instrs",
        "makespan",
        "vs first",
        "bubble mean",
        "bubble max",
        "peak act",
    ];
    let cells: Vec<[String; 7]> = rows
        .iter()
        .map(|r| match &r.result {
            Ok(s) => {
                let m = s.summary.makespan;
                [
                    r.name.clone(),
                    r.instructions.to_string(),
                    pipec::cost::num(m),
                    match base {
                        Some(b) if b > 0.0 => format!("{:.2}x", m / b),
                        _ => "-".to_string(),
                    },
                    format!("{:.1}%", s.summary.mean_bubble() * 100.0),
                    format!("{:.1}%", s.summary.max_bubble() * 100.0),
                    s.summary.peak_activations().to_string(),
                ]
            }
            Err(e) => {
                let what = match e {
                    SimError::Deadlock(_) => "DEADLOCK",
                    _ => "INVALID",
                };
                [
                    r.name.clone(),
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
    let w: Vec<usize> = (0..7)
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
        for j in 1..7 {
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
