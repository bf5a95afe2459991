//! `pipec check DIR|FILE.csv [--pp N] [--memory-limit K] [--json]`: verify a compiled
//! directory or a torch CSV schedule and print the
//! verdict, every violation and the peak live activations of each rank.
//! Exit 0 valid, 1 invalid, 2 usage or I/O error (missing directory, refused files).

use super::CliError;
use pipec::verify::{verify, Report, StreamRule, VerifyOptions};
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// A compiled schedule directory (manifest.json + rank-<r>.json).
    input: PathBuf,
    /// Pipeline-parallel size of a torch CSV schedule (CSV input only).
    #[arg(long)]
    pp: Option<u32>,
    /// Stage placement of a torch CSV schedule (default: read off the file).
    #[arg(long, value_parser = super::import::parse_placement)]
    placement: Option<pipec::back::torch::PlacementChoice>,
    /// Most live activations (microbatch x stage units) a rank may hold.
    #[arg(long)]
    memory_limit: Option<u64>,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
}

pub fn run(a: Args) -> Result<ExitCode, CliError> {
    // A file is a torch CSV whatever its name; the importer judges its content.
    let is_csv = a.input.is_file();
    let mut opts = VerifyOptions {
        memory_limit: a.memory_limit,
        ..VerifyOptions::default()
    };
    if is_csv {
        // torch's CSV: compute-only files are lowered by pipec, compute+comms files are
        // verified as written (each P2P action its own batch: see the README).
        let imported = super::import::read_csv(&a.input, a.pp, a.placement)?;
        let r = verify(&imported.program, &opts);
        print(&r, &a.input, a.json);
        return Ok(exit(&r));
    }
    if a.pp.is_some() {
        return Err(CliError::Usage(
            "--pp applies to torch CSV input only; a compiled directory records its own placement"
                .to_string(),
        ));
    }
    if !a.input.is_dir() {
        return Err(CliError::Usage(format!(
            "{}: not a directory (expected a compiled schedule directory, or a torch .csv file)",
            a.input.display()
        )));
    }
    if a.placement.is_some() {
        return Err(CliError::Usage(
            "--placement applies to torch CSV input only".to_string(),
        ));
    }
    // The verifier runs while the loader checks the schedule hash (see `load_dir_then`).
    let (_, r) = super::load_then(&a.input, |loaded| {
        opts.streams = StreamRule::of_policy(loaded.manifest.comm_policy, loaded.program.world());
        verify(&loaded.program, &opts)
    })?;
    print(&r, &a.input, a.json);
    Ok(exit(&r))
}

fn exit(r: &Report) -> ExitCode {
    if r.is_valid() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}

fn print(r: &Report, input: &std::path::Path, json: bool) {
    if json {
        super::print_json(r);
        return;
    }
    // One buffered write for what can be hundreds of thousands of lines (every risk of a big
    // schedule): stdout alone flushes at each line.
    use std::io::Write;
    let mut out = std::io::BufWriter::with_capacity(1 << 16, std::io::stdout().lock());
    let result = (|| -> std::io::Result<()> {
        writeln!(out, "{}: {}", input.display(), r.verdict_line())?;
        for v in &r.violations {
            writeln!(out, "  [{}] {v}", v.class())?;
        }
        for k in &r.risks {
            writeln!(out, "  [risk] {k}")?;
        }
        writeln!(out, "peak live activations:")?;
        for m in &r.memory {
            match m.at {
                Some(at) => writeln!(out, "  {}: {} (first at #{})", m.rank, m.peak, at.index)?,
                None => writeln!(out, "  {}: 0", m.rank)?,
            }
        }
        out.flush()
    })();
    // As println! does.
    if let Err(e) = result {
        panic!("failed printing to stdout: {e}");
    }
}
