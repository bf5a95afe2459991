//! `pipec show`: the terminal timeline of a compiled schedule, one row per rank, drawn to
//! scale under the cost model, with the summary under it.

use super::args::CostArgs;
use super::simulate::{run_sim, sim_error, title};
use super::CliError;
use pipec_compiler::view::timeline_text::{render, render_summary, TextOptions};
use pipec_cost::timeline::TimeUnit;
use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;

/// When to colour.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum ColorChoice {
    /// When stdout is a terminal and NO_COLOR is unset.
    Auto,
    Always,
    Never,
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
    #[command(flatten)]
    pub cost: CostArgs,
    /// Total width in columns, 20 to 10000 (default: $COLUMNS within that range, else 100).
    #[arg(long, value_name = "N", allow_negative_numbers = true, value_parser = parse_width)]
    pub width: Option<usize>,
    #[command(flatten)]
    pub window: super::window::WindowArgs,
    /// Colour: auto (a terminal and NO_COLOR unset), always, never.
    #[arg(long, value_enum, default_value_t = ColorChoice::Auto)]
    pub color: ColorChoice,
    /// Same as --color never.
    #[arg(long)]
    pub no_color: bool,
}

/// Width from the flag, then `COLUMNS` (a terminal's hint, brought within
/// [`MIN_WIDTH`]..=[`MAX_WIDTH`]), then 100.
pub fn width(flag: Option<usize>) -> usize {
    flag.or_else(|| {
        std::env::var("COLUMNS")
            .ok()
            .and_then(|c| c.trim().parse::<usize>().ok())
            .filter(|&w| w > 0)
            .map(|w| w.clamp(MIN_WIDTH, MAX_WIDTH))
    })
    .unwrap_or(100)
}

/// `--width`: a whole number of columns in [`MIN_WIDTH`]..=[`MAX_WIDTH`]; clap reports the
/// refusal as a usage error (exit 2) naming the flag.
pub fn parse_width(text: &str) -> Result<usize, String> {
    let why = format!(
        "must be {MIN_WIDTH} to {MAX_WIDTH} columns: narrower leaves no room for the timeline beside the rank labels, and wider is no terminal's width but costs memory and time for every rank"
    );
    match text.trim().parse::<i128>() {
        Ok(w) if (MIN_WIDTH as i128..=MAX_WIDTH as i128).contains(&w) => Ok(w as usize),
        Ok(_) => Err(why),
        Err(_) => Err(format!("not a whole number; {why}")),
    }
}

/// Whether to colour: flags first, then NO_COLOR (no-color.org: set and non-empty), then
/// whether stdout is a terminal.
pub fn use_color(choice: ColorChoice, no_color: bool) -> bool {
    if no_color {
        return false;
    }
    match choice {
        ColorChoice::Always => true,
        ColorChoice::Never => false,
        ColorChoice::Auto => {
            !matches!(std::env::var_os("NO_COLOR"), Some(v) if !v.is_empty())
                && std::io::stdout().is_terminal()
        }
    }
}

/// Narrower than this leaves no room for the timeline next to the rank labels.
pub const MIN_WIDTH: usize = 20;
/// Wider than any terminal; the rows are built in memory, so the width must be bounded.
pub const MAX_WIDTH: usize = 10_000;

pub fn run(a: Args) -> Result<ExitCode, CliError> {
    a.window.check()?;
    let loaded = super::load_any(&a.input, a.pp, a.placement)?;
    // The manifest's cost model (tune's) unless --cost / --cost-file is given.
    let model = a.cost.model_for(&loaded)?;
    let sim = run_sim(&loaded, &model).map_err(sim_error)?;
    let ranks = a.window.ranks(loaded.program.ranks.len())?;
    let makespan = sim.summary.makespan;
    if a.window.from.is_some_and(|f| f >= makespan) {
        return Err(CliError::Usage(format!(
            "--from is past the end of the schedule (makespan {})",
            pipec_ir::human::num(makespan)
        )));
    }
    let opts = TextOptions {
        width: width(a.width),
        color: use_color(a.color, a.no_color),
        ranks: ranks.clone(),
        from: a.window.from,
        to: a.window.to,
    };
    println!("{}", title(&loaded));
    if let Some(c) = loaded.manifest.caveat() {
        println!("note: {c}");
    }
    println!(
        "cost: {}",
        model.describe_for(loaded.program.lengths.as_ref(), a.cost.given_for(&loaded))
    );
    if a.window.any() {
        let shown = match &ranks {
            Some(r) => format!("{} of {} ranks", r.len(), loaded.program.ranks.len()),
            None => format!("all {} ranks", loaded.program.ranks.len()),
        };
        println!(
            "window: {shown}, time {} to {} of {}",
            pipec_ir::human::num(a.window.from.unwrap_or(0.0)),
            pipec_ir::human::num(a.window.to.unwrap_or(makespan).min(makespan)),
            pipec_ir::human::num(makespan)
        );
    }
    println!();
    print!("{}", render(&loaded.program, &sim.timeline, &opts));
    println!();
    print!("{}", render_summary(&sim.summary, TimeUnit::Cost));
    Ok(ExitCode::SUCCESS)
}
