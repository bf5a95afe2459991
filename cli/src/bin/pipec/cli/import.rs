//! `pipec import FILE.csv [--pp N] [--placement loop|v] -o DIR`: read a
//! torch.distributed.pipelining schedule CSV (either form) and write it as a pipec
//! instruction directory. Exit 1 when the CSV is invalid (the message echoes the line with a
//! caret under the cell), 2 for usage and I/O errors.

use super::CliError;
use pipec_compiler::torch::{
    import_csv_bytes, CsvErrorKind, CsvForm, ImportOptions, Imported, PlacementChoice,
    PlacementSource,
};
use pipec_ir::files::{self, Header};
use pipec_ir::verify::Unverified;
use pipec_schedules::layout::Layout;
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
    #[arg(long, value_parser = super::args::parse_placement)]
    pub placement: Option<PlacementChoice>,
    /// Megatron layout of the model (its stage count must be the file's), so that costs and
    /// comparisons after a CSV round trip see the model the schedule was compiled for.
    #[arg(long, conflicts_with = "layout_file")]
    pub layout: Option<String>,
    /// Read the layout string from a file.
    #[arg(long, value_name = "FILE")]
    pub layout_file: Option<PathBuf>,
    /// Most memory a rank may hold (parameters + live activations): bytes with a unit
    /// (80GiB) when the cost model gives memory in bytes, or a plain number of
    /// layer-activations.
    #[arg(long, value_parser = super::parse_limit, allow_hyphen_values = true)]
    pub memory_limit: Option<pipec_cost::memory::Limit>,
    /// The cost model memory is counted with (K.act, K.param); recorded in the manifest.
    #[command(flatten)]
    pub cost: super::args::CostArgs,
    /// Write the schedule without verifying it (not recommended).
    #[arg(long)]
    pub no_verify: bool,
    /// Output directory.
    #[arg(short = 'o', long = "out")]
    pub out: PathBuf,
}

pub use files::COMPUTE_ONLY_CAVEAT;

/// Read a file given as a torch CSV. One of pipec's own instruction files (a manifest or a
/// rank file, known by its content) is a usage error naming its directory, which the viewers
/// (`importing` false) read as it is; `import` says the directory is already a schedule.
fn read_input(path: &std::path::Path, importing: bool) -> Result<Vec<u8>, CliError> {
    let already = |dir: &std::path::Path| {
        format!(
            "{} is already a compiled schedule; `pipec export {} --format torch-csv` writes it as a torch CSV",
            dir.display(),
            dir.display()
        )
    };
    if path.is_dir() {
        let why = if path.join(files::MANIFEST_FILE).is_file() {
            already(path)
        } else {
            "import reads a torch CSV file".to_string()
        };
        return Err(CliError::Usage(format!(
            "{}: a directory, not a torch CSV file: {why}",
            path.display()
        )));
    }
    let bytes = std::fs::read(path)
        .map_err(|e| CliError::Usage(format!("cannot read {}: {e}", path.display())))?;
    if let Some(found) = files::sniff(&bytes) {
        if importing {
            let dir = match path.parent() {
                Some(p) if !p.as_os_str().is_empty() => p,
                _ => std::path::Path::new("."),
            };
            return Err(CliError::Usage(format!(
                "{}: this is a pipec instruction file ({found}), not a torch CSV: {}",
                path.display(),
                already(dir)
            )));
        }
        let e = files::LoadError::NotADirectory {
            path: path.to_path_buf(),
            found: Some(found),
        };
        return Err(CliError::Usage(e.to_string()));
    }
    Ok(bytes)
}

/// Read and import a torch CSV: unreadable file -> exit 2, invalid CSV -> exit 1.
pub fn read_csv(
    path: &std::path::Path,
    pp: Option<u32>,
    placement: Option<PlacementChoice>,
) -> Result<Imported, CliError> {
    read_csv_bytes(path, read_input(path, false)?, pp, placement)
}

/// [`read_csv`] of bytes already read from `path`.
fn read_csv_bytes(
    path: &std::path::Path,
    bytes: Vec<u8>,
    pp: Option<u32>,
    placement: Option<PlacementChoice>,
) -> Result<Imported, CliError> {
    import_csv_bytes(&bytes, &ImportOptions { pp, placement }).map_err(|e| {
        let hint = match e.kind {
            CsvErrorKind::RankWithoutStage { .. } => " (pass --placement loop|v)",
            CsvErrorKind::LineCount { .. } => " (--pp)",
            _ => "",
        };
        CliError::Invalid(format!("{}: {e}{hint}", path.display()))
    })
}

/// The header of an imported schedule's files (the program records how it was lowered:
/// lockstep from a compute-only file, as written from a compute+comms one).
fn header(layout: &Layout) -> Header<'_> {
    Header {
        source: "torch-csv",
        schedule: None,
        layout,
    }
}

/// The files of an imported schedule in memory, as `import` writes them: what the viewers
/// load a torch CSV as.
pub fn render_imported(imported: &Imported, layout: &Layout) -> Vec<(String, Vec<u8>)> {
    // Read as found: `check` judges it, the viewers show what it does.
    let program = Unverified::unchecked(&imported.program);
    files::render_unverified(&header(layout), &program, files::Encoding::Json)
}

pub fn run(mut a: Args) -> Result<ExitCode, CliError> {
    if let Some(path) = &a.layout_file {
        a.layout = Some(super::layout::read_layout_file(path)?);
    }
    let bytes = read_input(&a.input, true)?;
    let imported = read_csv_bytes(&a.input, bytes, a.pp, a.placement)?;
    let program = &imported.program;
    let layout = match &a.layout {
        None => Layout::uniform(program.num_stages()),
        Some(text) => {
            let l = pipec_schedules::layout::parse(text)
                .map_err(|e| CliError::Invalid(super::layout::render_error(&e)))?;
            if l.num_stages() != program.num_stages() {
                return Err(CliError::Invalid(format!(
                    "--layout has {} stages but {} has {}",
                    l.num_stages(),
                    a.input.display(),
                    program.num_stages()
                )));
            }
            l
        }
    };
    if a.no_verify {
        eprintln!("WARNING: --no-verify: this schedule was NOT verified; it may deadlock, hang or compute on the wrong tensors");
    }
    // Written as `pipec compile` writes (streamed), in place only once verified.
    let model = a.cost.model()?;
    let limit = super::resolve_limit(a.memory_limit, &model)?;
    let mem = pipec_cost::memory::weights(program, &layout, &model);
    let header = header(&layout);
    let prepared = files::prepare(&header, program, files::Encoding::Json)
        .with_cost(a.cost.given().then(|| model.spec()));
    let threads = files::threads_for(program.len() as u64);
    super::write_gated(&a.out, &prepared, threads, || {
        if a.no_verify {
            return Ok(files::Warrant::Unverified(Unverified::unchecked(program)));
        }
        super::verify_before_write(program, super::MemoryCheck { model: &mem, limit }, &a.out)
            .map(files::Warrant::Verified)
    })?;
    let placement = match imported.placement_source {
        PlacementSource::File => format!("{} (read off the file)", program.placement.kind),
        PlacementSource::Given(c) => format!("{} (--placement)", c.name()),
    };
    println!(
        "imported {} ({} form): {}, {}, {}{}, placement {placement}",
        a.input.display(),
        imported.form,
        super::count(program.world() as usize, "rank"),
        super::count(program.num_stages() as usize, "stage"),
        super::count(program.microbatches as usize, "microbatch"),
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
    if imported.form == CsvForm::ComputeComms {
        notes.push("each SEND/RECV is its own comm batch".to_string());
    }
    if !notes.is_empty() {
        println!("  {}", notes.join("; "));
    }
    if imported.form == CsvForm::ComputeOnly {
        println!("note: {COMPUTE_ONLY_CAVEAT}");
    }
    println!("wrote {} ({} instructions)", a.out.display(), program.len());
    Ok(ExitCode::SUCCESS)
}
