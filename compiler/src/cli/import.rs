//! `pipec import FILE.csv [--pp N] [--placement loop|v] -o DIR`: read a
//! torch.distributed.pipelining schedule CSV (either form) and write it as a pipec
//! instruction directory. Exit 1 when the CSV is invalid (the message echoes the line with a
//! caret under the cell), 2 for usage and I/O errors.

use super::CliError;
use pipec::files::{self, Header};
use pipec::layout::Layout;
use pipec::torch::{import_csv_bytes, CsvForm, ImportOptions, PlacementChoice, PlacementSource};
use pipec_schedules::CommPolicy;
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// The torch CSV schedule (compute-only or compute+comms; the form is detected).
    pub input: PathBuf,
    /// Number of ranks; the file must have exactly this many lines.
    #[arg(long)]
    pub pp: Option<u32>,
    /// Stage -> rank placement (`loop`: s % pp; `v`: V-shape over 2*pp stages). Default: read
    /// off the file (each stage on the rank whose line names it).
    #[arg(long, value_parser = parse_placement)]
    pub placement: Option<PlacementChoice>,
    /// Output directory.
    #[arg(short = 'o', long = "out")]
    pub out: PathBuf,
}

fn parse_placement(s: &str) -> Result<PlacementChoice, String> {
    s.parse()
}

pub fn run(a: Args) -> Result<ExitCode, CliError> {
    let bytes = std::fs::read(&a.input)
        .map_err(|e| CliError::Usage(format!("cannot read {}: {e}", a.input.display())))?;
    let opts = ImportOptions {
        pp: a.pp,
        placement: a.placement,
    };
    let imported = import_csv_bytes(&bytes, &opts)
        .map_err(|e| CliError::Invalid(format!("{}: {e}", a.input.display())))?;
    let program = &imported.program;
    let layout = Layout::uniform(program.num_stages());
    let header = Header {
        source: "torch-csv",
        schedule: None,
        comm_policy: match imported.form {
            CsvForm::ComputeOnly => Some(CommPolicy::Lockstep),
            CsvForm::ComputeComms => None,
        },
        layout: &layout,
    };
    // TODO(lead): verify `program` here once the verifier lands, and refuse to write (exit 1,
    // every violation printed) when it is invalid, as `pipec compile` does.
    let rendered = files::render(&header, program, files::Encoding::Json);
    files::write_dir(&a.out, &rendered).map_err(|e| CliError::Usage(e.to_string()))?;
    let placement = match imported.placement_source {
        PlacementSource::File => format!("{} (read off the file)", program.placement.kind),
        PlacementSource::Given(c) => format!("{} (--placement)", c.name()),
    };
    println!(
        "imported {} ({} form): {} ranks, {} stages, {} microbatches{}, placement {placement}",
        a.input.display(),
        imported.form,
        program.world(),
        program.num_stages(),
        program.microbatches,
        if program.forward_only {
            " (forward only: the file has no backward)"
        } else {
            ""
        },
    );
    let mut notes = Vec::new();
    if imported.bookkeeping > 0 {
        notes.push(format!(
            "{} bookkeeping actions (UNSHARD/RESHARD/REDUCE_GRAD/WAIT_*) dropped",
            imported.bookkeeping
        ));
    }
    if imported.idle_cells > 0 {
        notes.push(format!("{} idle cells dropped", imported.idle_cells));
    }
    if imported.form == CsvForm::ComputeOnly {
        notes.push("communication placed by pipec (fused-per-op)".to_string());
    } else {
        notes.push("each SEND/RECV is its own comm batch".to_string());
    }
    println!("  {}", notes.join("; "));
    println!("wrote {} ({} instructions)", a.out.display(), program.len());
    Ok(ExitCode::SUCCESS)
}
