//! `pipec calibrate`: per-layer-kind costs from a measured timeline, as a cost file.

use super::{print_json, CliError};
use pipec_cost::calibrate::{cost_file, fit, samples};
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// A Chrome trace: `pipec-run --trace` output, or a torch profiler trace of
    /// torch.distributed.pipelining (actions recorded as `PP:<stage><F|I|W|B><mb>`).
    pub trace: PathBuf,
    /// The compiled directory that was run (its layout says which layers each stage holds).
    #[arg(long, conflicts_with = "layout")]
    pub schedule: Option<PathBuf>,
    /// The layout of the stages the trace names (Megatron layout string).
    #[arg(long)]
    pub layout: Option<String>,
    /// Where to write the cost file (TOML, milliseconds: it says `time_unit = "ms"`); `-` or
    /// absent: stdout. A fit whose rms error exceeds 10% of the mean fitted pass is warned
    /// about on stderr (and in the file).
    #[arg(short = 'o', long = "out")]
    pub out: Option<PathBuf>,
    /// Print the fit as JSON.
    #[arg(long)]
    pub json: bool,
}

pub fn run(a: Args) -> Result<ExitCode, CliError> {
    let layout = match (&a.schedule, &a.layout) {
        (Some(dir), _) => super::load(dir)?.manifest.layout,
        (None, Some(text)) => pipec_schedules::layout::parse(text)
            .map_err(|e| CliError::Invalid(super::layout::render_error(&e)))?,
        (None, None) => {
            return Err(CliError::Usage(
                "give --schedule DIR (the compiled directory that was run) or --layout STR".into(),
            ))
        }
    };
    let text = super::read_text("trace", &a.trace)?;
    let s = samples(&text).map_err(|e| CliError::Invalid(format!("{}: {e}", a.trace.display())))?;
    let f = fit(&s, &layout).map_err(CliError::Invalid)?;
    let file = cost_file(&f, &a.trace.display().to_string());
    // On stderr, so the cost file on stdout and `--json` stay what they are.
    if let Some(w) = f.warning() {
        eprintln!("warning: {w}");
    }
    match &a.out {
        Some(p) if p.as_os_str() != "-" => {
            std::fs::write(p, &file)
                .map_err(|e| CliError::Usage(format!("{}: {e}", p.display())))?;
            if !a.json {
                println!(
                    "fitted {} passes (rms error {} ms) -> {}",
                    f.samples,
                    pipec_ir::human::num(f.rms_ms),
                    p.display()
                );
            }
        }
        _ if !a.json => print!("{file}"),
        _ => {}
    }
    if a.json {
        print_json(&f);
    }
    Ok(ExitCode::SUCCESS)
}
