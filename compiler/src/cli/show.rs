//! `pipec show`: the terminal timeline of a compiled schedule, one row per rank, drawn to
//! scale under the cost model, with the summary under it.

use super::simulate::{run_sim, sim_error, title, CostArgs};
use super::CliError;
use pipec::emit::timeline_text::{render, render_summary, TextOptions};
use pipec::timeline::TimeUnit;
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
    /// A compiled schedule directory.
    pub input: PathBuf,
    #[command(flatten)]
    pub cost: CostArgs,
    /// Total width in columns (default: $COLUMNS, else 100).
    #[arg(long)]
    pub width: Option<usize>,
    /// Colour: auto (a terminal and NO_COLOR unset), always, never.
    #[arg(long, value_enum, default_value_t = ColorChoice::Auto)]
    pub color: ColorChoice,
    /// Same as --color never.
    #[arg(long)]
    pub no_color: bool,
}

/// Width from the flag, then `COLUMNS`, then 100.
pub fn width(flag: Option<usize>) -> usize {
    flag.or_else(|| {
        std::env::var("COLUMNS")
            .ok()
            .and_then(|c| c.trim().parse().ok())
    })
    .filter(|&w| w > 0)
    .unwrap_or(100)
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

pub fn run(a: Args) -> Result<ExitCode, CliError> {
    let model = a.cost.model()?;
    let loaded = super::load(&a.input)?;
    let sim = run_sim(&loaded, &model).map_err(sim_error)?;
    let opts = TextOptions {
        width: width(a.width),
        color: use_color(a.color, a.no_color),
    };
    println!("{}", title(&loaded.manifest));
    println!("cost: {}", model.describe());
    println!();
    print!("{}", render(&loaded.program, &sim.timeline, &opts));
    println!();
    print!("{}", render_summary(&sim.summary, TimeUnit::Cost));
    Ok(ExitCode::SUCCESS)
}
