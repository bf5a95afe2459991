//! `pipec export`: a compiled schedule in another format. Each format is one arm of
//! [`render`] returning the file's bytes; views that need times simulate under the cost model.

use super::simulate::{run_sim, sim_error, title, CostArgs};
use super::CliError;
use pipec::emit::{chrome, dot, svg};
use pipec::files::Loaded;
use pipec::torch::{export_csv, CsvForm};
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
    #[arg(long, value_parser = super::import::parse_placement)]
    pub placement: Option<pipec::torch::PlacementChoice>,
    /// Output format.
    #[arg(long, value_enum)]
    pub format: Format,
    /// Output file; standard output when absent or `-`.
    #[arg(short = 'o', long = "out")]
    pub out: Option<PathBuf>,
    #[command(flatten)]
    pub cost: CostArgs,
    /// Graph size for --format dot.
    #[arg(long, value_enum, default_value_t = CondenseArg::Auto)]
    pub condense: CondenseArg,
    /// For --format torch-csv: only the compute actions (torch's compute-only form).
    #[arg(long)]
    pub compute_only: bool,
    /// Picture width in pixels for --format svg.
    #[arg(long, default_value_t = 1200.0)]
    pub svg_width: f64,
}

/// The bytes of the export.
fn render(a: &Args, loaded: &Loaded) -> Result<Vec<u8>, CliError> {
    let name = title(&loaded.manifest);
    let model = a.cost.model()?;
    let timed = || run_sim(loaded, &model).map_err(sim_error);
    Ok(match a.format {
        Format::TorchCsv => {
            let form = if a.compute_only {
                CsvForm::ComputeOnly
            } else {
                CsvForm::ComputeComms
            };
            export_csv(&loaded.program, form)
                .map_err(|e| CliError::Invalid(format!("{}: {e}", a.input.display())))?
                .into_bytes()
        }
        Format::ChromeTrace => {
            let sim = timed()?;
            chrome::chrome_trace(&name, &loaded.program, &sim.timeline).into_bytes()
        }
        Format::Svg => {
            let sim = timed()?;
            let opts = svg::SvgOptions {
                width: a.svg_width,
                title: Some(format!("{name}   ·   cost {}", model.describe())),
            };
            svg::render(&loaded.program, &sim.timeline, &opts).into_bytes()
        }
        Format::Dot => {
            let c = match a.condense {
                CondenseArg::Auto => dot::Condense::auto(&loaded.program),
                CondenseArg::None => dot::Condense::None,
                CondenseArg::Stage => dot::Condense::Stage,
                CondenseArg::RankMb => dot::Condense::RankMb,
            };
            dot::render(&loaded.program, c, Some(&name)).into_bytes()
        }
    })
}

pub fn run(a: Args) -> Result<ExitCode, CliError> {
    if !(a.svg_width.is_finite() && a.svg_width > 0.0) {
        return Err(CliError::Usage(
            "--svg-width must be a positive number".to_string(),
        ));
    }
    let loaded = super::load_any(&a.input, a.pp, a.placement)?;
    let bytes = render(&a, &loaded)?;
    match a.out.as_deref() {
        None => write_stdout(&bytes),
        Some(p) if p.as_os_str() == "-" => write_stdout(&bytes),
        Some(p) => {
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
