//! `pipec export`: a compiled schedule in another format. Each format is one arm of
//! [`render`] returning the file's bytes; views that need times simulate under the cost model.

use super::args::CostArgs;
use super::simulate::{run_sim, sim_error, title};
use super::CliError;
use pipec_compiler::torch::{export_csv_unverified, CsvForm};
use pipec_compiler::view::{chrome, dot, svg, Filter};
use pipec_ir::files::Loaded;
use pipec_ir::verify::Unverified;
use std::io::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;

/// Output formats.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// torch.distributed.pipelining CSV.
    TorchCsv,
    /// Chrome / Perfetto Trace Event Format JSON.
    ChromeTrace,
    /// Standalone SVG timeline.
    Svg,
    /// Graphviz dependency graph.
    Dot,
    /// Each rank's CUDA-graph capture order in Transformer Engine's `_order` encoding (JSON,
    /// one list per rank; docs/format.md, "Capture order").
    CaptureOrder,
}

/// How much `--format dot` condenses.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum CondenseArg {
    /// Full graph up to 400 instructions, per stage above.
    Auto,
    /// Every instruction.
    None,
    /// One node per stage.
    Stage,
    /// One node per (rank, microbatch).
    RankMb,
}

#[derive(clap::Args, Debug)]
pub struct Args {
    /// A compiled schedule directory or a torch CSV schedule.
    pub input: PathBuf,
    /// Pipeline-parallel size of a torch CSV schedule (CSV input only, as for `check`).
    #[arg(long)]
    pub pp: Option<u32>,
    /// Stage placement of a torch CSV schedule (CSV input only, as for `check`).
    #[arg(long, value_parser = super::args::parse_placement)]
    pub placement: Option<pipec_compiler::torch::PlacementChoice>,
    /// Output format.
    #[arg(long, value_enum)]
    pub format: Format,
    /// Output file; standard output when absent or `-`.
    #[arg(short = 'o', long = "out")]
    pub out: Option<PathBuf>,
    #[command(flatten)]
    pub cost: CostArgs,
    /// Graph size for --format dot (default auto); a graph of more than 20000 nodes needs
    /// --full.
    #[arg(long, value_enum)]
    pub condense: Option<CondenseArg>,
    /// Only the compute actions: torch's compute-only CSV form, or a trace without
    /// communication (an SVG draws compute only anyway).
    #[arg(long)]
    pub compute_only: bool,
    /// Picture width in pixels for --format svg, 300 to 32768 (default 1200).
    #[arg(long, value_name = "PX", allow_negative_numbers = true, value_parser = parse_svg_width)]
    pub svg_width: Option<f64>,
    /// For --format svg: every op, or an overview per rank and time bucket (auto: the
    /// overview above 20000 ops, which browsers cannot open at once).
    #[arg(long, value_enum, value_name = "MODE")]
    pub svg_detail: Option<SvgDetail>,
    /// For a trace or SVG.
    #[command(flatten)]
    pub window: super::window::WindowArgs,
    /// Write the whole trace, SVG (every op) or graph even when it is too big for viewers
    /// to open.
    #[arg(long)]
    pub full: bool,
}

/// What `--format svg` draws.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum SvgDetail {
    /// Every op up to 20000 ops, the overview above.
    Auto,
    /// Every op.
    Ops,
    /// One cell per rank and time bucket.
    Overview,
}

/// Narrower than this, the SVG's legend and axis do not fit.
pub const MIN_SVG_WIDTH: f64 = 300.0;
/// Browsers refuse to draw an image wider than about 32767 pixels.
pub const MAX_SVG_WIDTH: f64 = 32768.0;

/// `--svg-width`: pixels in [`MIN_SVG_WIDTH`]..=[`MAX_SVG_WIDTH`]; clap reports the refusal as
/// a usage error (exit 2) naming the flag.
pub fn parse_svg_width(text: &str) -> Result<f64, String> {
    let why = format!(
        "must be {MIN_SVG_WIDTH} to {MAX_SVG_WIDTH} pixels: narrower leaves no room for the legend and axis, and browsers do not draw images wider than about 32767 pixels"
    );
    match text.trim().parse::<f64>() {
        Ok(w) if (MIN_SVG_WIDTH..=MAX_SVG_WIDTH).contains(&w) => Ok(w),
        Ok(_) => Err(why),
        Err(_) => Err(format!("not a number; {why}")),
    }
}

/// Graphviz does not lay out bigger graphs in useful time, and the text of a large schedule's
/// every instruction is far too big to hand it (bench/HISTORY.md has a size).
pub const DOT_MAX_NODES: usize = 20_000;

/// Bigger than this, Perfetto and browsers fail to open a trace or an SVG: by default the
/// export keeps less, and says what.
pub const OPENABLE_BYTES: usize = 100 << 20;

/// The filter the flags ask for.
fn filter(a: &Args, world: usize) -> Result<Filter, CliError> {
    a.window.check()?;
    Ok(Filter {
        ranks: a.window.ranks(world)?,
        from: a.window.from,
        to: a.window.to,
        compute_only: a.compute_only,
    })
}

/// Render a view under `base`, or, when that would pass [`OPENABLE_BYTES`] and the user did
/// not ask for `--full`, a smaller part: first without communication (traces), then the
/// first ranks only. Sizes are estimated from rank 0 alone, so the whole view is never built
/// in memory. Returns the text and the note saying what was left out.
fn capped(
    render: impl Fn(&Filter) -> String,
    base: &Filter,
    world: usize,
    full: bool,
    drops_comm: bool,
) -> (String, Option<String>) {
    if full {
        return (render(base), None);
    }
    let rows = base.rows(world);
    let per_rank = |f: &Filter| {
        let probe = Filter {
            ranks: Some(vec![rows.first().copied().unwrap_or(0)]),
            ..f.clone()
        };
        render(&probe).len().max(1)
    };
    let estimate = per_rank(base).saturating_mul(rows.len());
    if estimate <= OPENABLE_BYTES {
        return (render(base), None);
    }
    let mut f = base.clone();
    let mut kept = Vec::new();
    if drops_comm && !f.compute_only {
        f.compute_only = true;
        kept.push("compute ops only".to_string());
    }
    let each = per_rank(&f);
    if each.saturating_mul(rows.len()) > OPENABLE_BYTES {
        let k = (OPENABLE_BYTES / each).clamp(1, rows.len());
        kept.push(format!("the first {k} of {} ranks", rows.len()));
        f.ranks = Some(rows[..k].to_vec());
    }
    let note = format!(
        "note: the whole view would be about {} MB, too big to open; kept {} (--ranks/--from/--to pick another part, --full writes everything)",
        estimate >> 20,
        kept.join(" and ")
    );
    (render(&f), Some(note))
}

/// The bytes of the export.
fn render(a: &Args, loaded: &Loaded) -> Result<Vec<u8>, CliError> {
    let name = title(loaded);
    let model = a.cost.model_for(loaded)?;
    let timed = || run_sim(loaded, &model).map_err(sim_error);
    let world = loaded.program.ranks.len();
    Ok(match a.format {
        Format::TorchCsv => {
            let form = if a.compute_only {
                CsvForm::ComputeOnly
            } else {
                CsvForm::ComputeComms
            };
            // As loaded, unverified: the views show what the files hold.
            export_csv_unverified(&Unverified::unchecked(&loaded.program), form)
                .map_err(|e| CliError::Invalid(format!("{}: {e}", a.input.display())))?
                .into_bytes()
        }
        Format::ChromeTrace => {
            let sim = timed()?;
            let base = filter(a, world)?;
            let (text, note) = capped(
                |f| chrome::chrome_trace_filtered(&name, &loaded.program, &sim.timeline, f),
                &base,
                world,
                a.full,
                true,
            );
            if let Some(n) = note {
                eprintln!("{n}");
            }
            text.into_bytes()
        }
        Format::Svg => {
            let sim = timed()?;
            let base = filter(a, world)?;
            let mut opts = svg::SvgOptions {
                width: a.svg_width.unwrap_or(1200.0),
                title: Some(format!(
                    "{name}   ·   cost {}",
                    model.describe_for(loaded.program.lengths.as_ref(), a.cost.given_for(loaded))
                )),
                filter: base.clone(),
                detail: match (a.svg_detail, a.full) {
                    (Some(SvgDetail::Ops), _) | (None, true) => svg::Detail::Ops,
                    (Some(SvgDetail::Overview), _) => svg::Detail::Overview,
                    (Some(SvgDetail::Auto), _) | (None, false) => svg::Detail::Auto,
                },
                ..Default::default()
            };
            // Decided on the whole view, so the size probe of one rank draws the same way.
            if svg::is_overview(&loaded.program, &sim.timeline, &opts) {
                if opts.detail == svg::Detail::Auto {
                    eprintln!(
                        "note: {} ops are too many for a browser to open at once: wrote an overview per rank and time bucket (--svg-detail ops draws every op)",
                        svg::ops_drawn(&loaded.program, &sim.timeline, &opts)
                    );
                }
                opts.detail = svg::Detail::Overview;
                opts.title = opts.title.map(|t| format!("{t}   ·   overview"));
            } else {
                opts.detail = svg::Detail::Ops;
            }
            let (text, note) = capped(
                |f| {
                    let opts = svg::SvgOptions {
                        filter: f.clone(),
                        ..opts.clone()
                    };
                    svg::render(&loaded.program, &sim.timeline, &opts)
                },
                &base,
                world,
                a.full,
                false,
            );
            if let Some(n) = note {
                eprintln!("{n}");
            }
            text.into_bytes()
        }
        Format::Dot => {
            let c = match a.condense.unwrap_or(CondenseArg::Auto) {
                CondenseArg::Auto => dot::Condense::auto(&loaded.program),
                CondenseArg::None => dot::Condense::None,
                CondenseArg::Stage => dot::Condense::Stage,
                CondenseArg::RankMb => dot::Condense::RankMb,
            };
            let nodes = match c {
                dot::Condense::None => loaded.program.len(),
                dot::Condense::Stage => loaded.program.num_stages() as usize,
                dot::Condense::RankMb => world.saturating_mul(loaded.program.microbatches as usize),
            };
            if nodes > DOT_MAX_NODES && !a.full {
                return Err(CliError::Usage(format!(
                    "--condense {}: a graph of about {nodes} nodes; at most {DOT_MAX_NODES} are drawn, since Graphviz does not lay out bigger graphs in useful time (--condense stage draws {} nodes; --full writes it anyway)",
                    clap::ValueEnum::to_possible_value(&a.condense.unwrap_or(CondenseArg::Auto))
                        .map_or(String::new(), |v| v.get_name().to_string()),
                    loaded.program.num_stages()
                )));
            }
            dot::render(&loaded.program, c, Some(&name)).into_bytes()
        }
        Format::CaptureOrder => pipec_ir::ir::capture_order_json(&loaded.program)
            .map_err(|e| CliError::Invalid(format!("{}: {e}", a.input.display())))?
            .into_bytes(),
    })
}

/// Every flag applies to some formats; a flag given with another format is refused, never
/// silently ignored.
fn check_flags(a: &Args) -> Result<(), CliError> {
    let f = a.format;
    let views = matches!(f, Format::ChromeTrace | Format::Svg);
    let refuse = |flag: &str, formats: &str| {
        Err(CliError::Usage(format!(
            "{flag} applies to {formats}, not --format {}",
            clap::ValueEnum::to_possible_value(&f)
                .map_or(String::new(), |v| v.get_name().to_string())
        )))
    };
    if a.condense.is_some() && f != Format::Dot {
        return refuse("--condense", "--format dot");
    }
    if a.svg_width.is_some() && f != Format::Svg {
        return refuse("--svg-width", "--format svg");
    }
    if a.svg_detail.is_some() && f != Format::Svg {
        return refuse("--svg-detail", "--format svg");
    }
    if a.compute_only && matches!(f, Format::Dot | Format::CaptureOrder) {
        return refuse("--compute-only", "torch-csv, chrome-trace and svg");
    }
    for (flag, given) in [
        ("--ranks", a.window.ranks.is_some()),
        ("--from", a.window.from.is_some()),
        ("--to", a.window.to.is_some()),
    ] {
        if given && !views {
            return refuse(flag, "chrome-trace and svg");
        }
    }
    if a.full && matches!(f, Format::TorchCsv | Format::CaptureOrder) {
        return refuse("--full", "chrome-trace, svg and dot");
    }
    Ok(())
}

pub fn run(a: Args) -> Result<ExitCode, CliError> {
    check_flags(&a)?;
    let loaded = super::load_any(&a.input, a.pp, a.placement)?;
    let bytes = render(&a, &loaded)?;
    match a.out.as_deref() {
        None => write_stdout(&bytes),
        Some(p) if p.as_os_str() == "-" => write_stdout(&bytes),
        Some(p) => {
            super::warn_big_write(bytes.len() as u64, p);
            std::fs::write(p, &bytes).map_err(|e| CliError::Usage(format!("{}: {e}", p.display())))
        }
    }?;
    Ok(ExitCode::SUCCESS)
}

fn write_stdout(bytes: &[u8]) -> Result<(), CliError> {
    let mut out = std::io::stdout().lock();
    out.write_all(bytes)
        .and_then(|_| out.flush())
        .map_err(|e| CliError::Usage(format!("standard output: {e}")))
}
