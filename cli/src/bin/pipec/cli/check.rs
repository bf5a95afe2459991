//! `pipec check DIR|FILE.csv [--pp N] [--cost SPEC] [--cost-file F] [--memory-limit 80GiB] [--all-risks] [--strict] [--json]`:
//! verify a compiled directory or a torch CSV schedule and print the verdict, every
//! violation, a summary of the risks and the peak memory of each rank ([`pipec_ir::memory`]).
//! Exit 0 valid, 1 invalid (or risks under `--strict`), 2 usage or I/O error (missing
//! directory, refused files). Under `--json` stdout always holds one JSON document, an error
//! too, so a consumer never reads an empty one.

use super::CliError;
use pipec_ir::verify::risk::Risk;
use pipec_ir::verify::{verify_with, Level, Report};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// A compiled schedule directory (manifest.json + rank-<r>.json), or a torch CSV schedule
    /// file (compute-only or compute+comms).
    input: PathBuf,
    /// Pipeline-parallel size of a torch CSV schedule (CSV input only).
    #[arg(long)]
    pp: Option<u32>,
    /// Stage placement of a torch CSV schedule (default: read off the file).
    #[arg(long, value_parser = super::args::parse_placement)]
    placement: Option<pipec_compiler::torch::PlacementChoice>,
    /// Most memory a rank may hold (parameters + live activations): bytes with a unit
    /// (80GiB) when the cost model gives memory in bytes, or a plain number of
    /// layer-activations.
    #[arg(long, value_parser = super::parse_limit, allow_hyphen_values = true)]
    memory_limit: Option<pipec_cost::memory::Limit>,
    /// The cost model memory is counted with (K.act, K.param); default: the one the
    /// manifest records, else one layer-activation per decoder layer.
    #[command(flatten)]
    cost: super::args::CostArgs,
    /// List every risk (default: the count of each kind and the first few).
    #[arg(long)]
    all_risks: bool,
    /// Fail (exit 1) when the schedule has risks, not only when it is invalid.
    #[arg(long)]
    strict: bool,
    /// Print the report as JSON (also on errors: `error` and `exit_code`).
    #[arg(long)]
    json: bool,
    /// The model's decoder layers: a directory whose layout holds another number is refused
    /// (exit 1), as it is when the cost file's `[model]` table gives `num_layers` (costs of
    /// an 80-layer model do not describe a plan compiled for 8).
    #[arg(long)]
    num_layers: Option<u32>,
}

/// How many risks are printed without `--all-risks` (as many as `pipec compile` warns about).
pub const RISKS_SHOWN: usize = 5;

/// A verdict and what the input was.
struct Checked {
    report: Report,
    /// [`super::import::COMPUTE_ONLY_CAVEAT`] for a compute-only torch CSV.
    caveat: Option<&'static str>,
    /// The manifest's `sealed_by` (`pipec seal` re-hashed the files).
    sealed_by: Option<String>,
    /// The buffer plan's pools (`buffer_slots`, issue #39), when the program has one.
    pools: Option<pipec_ir::ir::Pools>,
}

pub fn run(a: Args) -> Result<ExitCode, CliError> {
    let (json, input) = (a.json, a.input.clone());
    let (all, strict) = (a.all_risks, a.strict);
    let checked = match judge(a) {
        Ok(c) => c,
        Err(e) => {
            if json {
                let (code, msg) = match &e {
                    CliError::Invalid(m) => (1, m),
                    CliError::Usage(m) => (2, m),
                };
                super::print_json(&serde_json::json!({
                    "input": input.display().to_string(),
                    "valid": false,
                    "passed": false,
                    "error": msg,
                    "exit_code": code,
                }));
            }
            return Err(e);
        }
    };
    let risky = strict && !checked.report.risks.is_empty();
    let code: u8 = if !checked.report.is_valid() || risky {
        1
    } else {
        0
    };
    if json {
        print_json(checked, &input, all, (strict, risky), code);
    } else {
        print(&checked, &input, all, strict);
    }
    Ok(ExitCode::from(code))
}

/// Load and verify the input: a file is a torch CSV whatever its name (the importer judges
/// its content; pipec's own files are told apart and refused with their directory named).
fn judge(a: Args) -> Result<Checked, CliError> {
    // The verifier with memory counted under `model` against the limit in its unit.
    let run = |program: &pipec_ir::Program,
               layout: &pipec_schedules::layout::Layout,
               model: &pipec_cost::cost::CostModel|
     -> Result<Report, CliError> {
        let mem = pipec_cost::memory::weights(program, layout, model);
        let limit = super::resolve_limit(a.memory_limit, model)?;
        let threads = pipec_ir::par::threads_for(program.len() as u64);
        Ok(verify_with(program, Level::Full, threads, &mem, limit))
    };
    if a.input.is_file() {
        if a.num_layers.is_some() {
            return Err(CliError::Usage(
                "--num-layers applies to a compiled directory only; a torch CSV holds no layout"
                    .to_string(),
            ));
        }
        // torch's CSV: compute-only files are lowered by pipec, compute+comms files are
        // verified as written (each P2P action its own batch: see docs/torch.md).
        let model = a.cost.model()?;
        let imported = super::import::read_csv(&a.input, a.pp, a.placement)?;
        let layout = pipec_schedules::layout::Layout::uniform(imported.program.num_stages());
        let report = run(&imported.program, &layout, &model)?;
        let caveat = (imported.form == pipec_compiler::torch::CsvForm::ComputeOnly)
            .then_some(super::import::COMPUTE_ONLY_CAVEAT);
        return Ok(Checked {
            report,
            caveat,
            sealed_by: None,
            pools: imported.program.buffer_slots.clone(),
        });
    }
    if a.pp.is_some() {
        return Err(CliError::Usage(
            "--pp applies to torch CSV input only; a compiled directory records its own placement"
                .to_string(),
        ));
    }
    if a.placement.is_some() {
        return Err(CliError::Usage(
            "--placement applies to torch CSV input only".to_string(),
        ));
    }
    // The verifier runs while the loader checks the schedule hash (see `load_dir_then`).
    // The loader words a missing path, a file, or a directory of schedules itself.
    let (loaded, report) = super::load_then(&a.input, |loaded| {
        let model = a.cost.model_for(loaded)?;
        same_layers(loaded, &model, a.num_layers)?;
        run(&loaded.program, &loaded.manifest.layout, &model)
    })?;
    Ok(Checked {
        report: report?,
        caveat: loaded.manifest.caveat(),
        sealed_by: loaded.manifest.sealed_by,
        pools: loaded.program.buffer_slots,
    })
}

/// The directory's decoder layers against the model's, where `--num-layers` or the cost
/// model's `[model]` table (`num_layers`) gives them (issue #40): memory and times counted
/// with an 80-layer model's per-layer figures on a plan compiled for 8 layers would describe
/// neither, so a mismatch is invalid input (exit 1). The plan's layers are its layout's `t`
/// (one per stage for a directory without a layout, as the costs count it).
fn same_layers(
    loaded: &pipec_ir::files::Loaded,
    model: &pipec_cost::cost::CostModel,
    num_layers: Option<u32>,
) -> Result<(), CliError> {
    let layout = &loaded.manifest.layout;
    let stages = loaded.program.num_stages() as usize;
    let plan = if layout.stages.len() == stages {
        layout.count(pipec_schedules::layout::LayerKind::Decoder) as u64
    } else {
        stages as u64
    };
    let given = [
        (num_layers.map(u64::from), "--num-layers".to_string()),
        (
            model.shape.as_ref().and_then(|s| s.num_layers),
            "the cost model's [model] table (`num_layers`)".to_string(),
        ),
    ];
    for (n, from) in given {
        if let Some(n) = n.filter(|&n| n != plan) {
            let how = match &layout.text {
                Some(t) if layout.stages.len() == stages => format!("its layout `{t}`"),
                _ => format!("one per stage, {stages} stages"),
            };
            return Err(CliError::Invalid(format!(
                "{from} gives {n} decoder layers, but this directory was compiled for {plan} ({how}): its memory and times would be counted for a model it does not hold; compile or tune it with --num-layers {n}, or check it with the costs of the model it was compiled for"
            )));
        }
    }
    Ok(())
}

/// The JSON `kind` of a risk, which the summary counts by.
fn kind(r: &Risk) -> &'static str {
    match r {
        Risk::SamePeerTwice { .. } => "same_peer_twice",
        Risk::HeadOfLine { .. } => "head_of_line",
    }
}

/// Each kind of risk present and how many, in order of first appearance.
fn per_kind(risks: &[Risk]) -> Vec<(&'static str, usize)> {
    let mut counts: Vec<(&'static str, usize)> = Vec::new();
    for r in risks {
        let k = kind(r);
        match counts.iter_mut().find(|(c, _)| *c == k) {
            Some((_, n)) => *n += 1,
            None => counts.push((k, 1)),
        }
    }
    counts
}

/// What the sealed line says (and `--json`'s `sealed_by` stands for).
fn sealed_note(by: &str) -> String {
    format!(
        "sealed by `{by}`: the hashes were recomputed from these files as they are, so this verdict judges their content; it does not attest that pipec wrote them"
    )
}

/// `valid` is the verifier's verdict on the program (a program with risks is valid: it runs);
/// `passed` is the check's verdict, which agrees with the exit code (`--strict` fails a valid
/// program with risks), and `strict_failed` says that is why it failed (issue #40).
fn print_json(
    mut c: Checked,
    input: &Path,
    all: bool,
    (strict, strict_failed): (bool, bool),
    code: u8,
) {
    let total = c.report.risks.len();
    let by_kind: serde_json::Map<String, serde_json::Value> = per_kind(&c.report.risks)
        .into_iter()
        .map(|(k, n)| (k.to_string(), n.into()))
        .collect();
    let shown = if all { total } else { total.min(RISKS_SHOWN) };
    c.report.risks.truncate(shown);
    let mut v = serde_json::to_value(&c.report).expect("serializable");
    if let Some(o) = v.as_object_mut() {
        o.insert("input".into(), input.display().to_string().into());
        o.insert("caveat".into(), c.caveat.into());
        o.insert("sealed_by".into(), c.sealed_by.into());
        if let Some(p) = &c.pools {
            o.insert("buffer_pools".into(), pools_json(p));
        }
        o.insert(
            "risk_summary".into(),
            serde_json::json!({"total": total, "shown": shown, "by_kind": by_kind}),
        );
        o.insert("strict".into(), strict.into());
        o.insert("strict_failed".into(), strict_failed.into());
        o.insert("passed".into(), (code == 0).into());
        o.insert("exit_code".into(), code.into());
    }
    super::print_json(&v);
}

/// `buffer_pools` of `--json`: per rank its slot count and the pool's size (in the report's
/// `memory_unit`).
fn pools_json(p: &pipec_ir::ir::Pools) -> serde_json::Value {
    let figure = |x: f64| serde_json::to_value(Figure(x)).unwrap_or_default();
    p.0.iter()
        .enumerate()
        .map(|(r, slots)| {
            serde_json::json!({"rank": r, "slots": slots.len(), "size": figure(p.bytes(r))})
        })
        .collect()
}

/// A figure as the report writes it (a whole number as a JSON integer).
struct Figure(f64);

impl serde::Serialize for Figure {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        pipec_ir::memory::figure(&self.0, s)
    }
}

fn print(c: &Checked, input: &Path, all: bool, strict: bool) {
    let r = &c.report;
    // One buffered write for what can be many lines: stdout alone flushes at each line.
    use std::io::Write;
    let mut out = std::io::BufWriter::with_capacity(1 << 16, std::io::stdout().lock());
    let result = (|| -> std::io::Result<()> {
        let sealed = match &c.sealed_by {
            Some(by) => format!(" (sealed by {by})"),
            None => String::new(),
        };
        writeln!(out, "{}{sealed}: {}", input.display(), r.verdict_line())?;
        for v in &r.violations {
            writeln!(out, "  [{}] {v}", v.class())?;
        }
        if let Some(caveat) = c.caveat {
            writeln!(out, "note: {caveat}")?;
        }
        if let Some(by) = &c.sealed_by {
            writeln!(out, "note: {}", sealed_note(by))?;
        }
        if !r.risks.is_empty() {
            let kinds: Vec<String> = per_kind(&r.risks)
                .iter()
                .map(|(k, n)| format!("{n} {k}"))
                .collect();
            writeln!(
                out,
                "risks: {} ({}): valid, but fragile on NCCL (README, \"Risks\")",
                r.risks.len(),
                kinds.join(", ")
            )?;
            let shown = if all { r.risks.len() } else { RISKS_SHOWN };
            for k in r.risks.iter().take(shown) {
                writeln!(out, "  [risk] {k}")?;
            }
            if r.risks.len() > shown {
                writeln!(
                    out,
                    "  ... and {} more (pipec check {} --all-risks lists them all; --strict fails on any)",
                    r.risks.len() - shown,
                    input.display()
                )?;
            }
        }
        let u = r.memory_unit;
        writeln!(
            out,
            "peak memory per rank (parameters + live activations, in {}):",
            u.label()
        )?;
        for m in &r.memory {
            let mut params = if m.params > 0.0 {
                format!(", parameters {}", u.fmt(m.params))
            } else {
                String::new()
            };
            // The buffer plan's pool (issue #39), included in the peak.
            if m.buffers > 0.0 {
                params.push_str(&format!(", buffers {}", u.fmt(m.buffers)));
            }
            // Offloaded activations (issue 30): what the rank holds in host memory at most.
            if m.host > 0.0 {
                params.push_str(&format!(", host {}", u.fmt(m.host)));
            }
            match m.at {
                Some(at) => writeln!(
                    out,
                    "  {}: {} (first at #{}{params})",
                    m.rank,
                    u.fmt(m.peak),
                    at.index
                )?,
                None => writeln!(out, "  {}: {}{params}", m.rank, u.fmt(m.peak))?,
            }
        }
        if let Some(p) = &c.pools {
            writeln!(
                out,
                "buffer pools (slots, size in {}; counted in the peaks above):",
                u.label()
            )?;
            for (rank, slots) in p.0.iter().enumerate() {
                writeln!(
                    out,
                    "  rank {rank}: {} slots, {}",
                    slots.len(),
                    u.fmt(p.bytes(rank))
                )?;
            }
        }
        if strict && !r.risks.is_empty() {
            writeln!(
                out,
                "{}: FAILED under --strict: {} risks",
                input.display(),
                r.risks.len()
            )?;
        }
        out.flush()
    })();
    // As println! does.
    if let Err(e) = result {
        panic!("failed printing to stdout: {e}");
    }
}
