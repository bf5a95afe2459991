//! `pipec seal DIR`: recompute the hashes of a directory whose files another tool wrote or
//! edited, so that `pipec check` judges their content ([`pipec_ir::files::seal_dir`]).
//! Exit 0 sealed (or nothing to seal), 2 a file missing, unreadable or malformed (the
//! loader's message, naming the file and the field or line), as `check` reports a refused
//! directory.

use super::CliError;
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// The directory to seal (manifest.json + rank-<r>.json or .bin), written or edited by
    /// another tool.
    dir: PathBuf,
}

/// How many changed files are named before the rest are counted.
const NAMED: usize = 5;

pub fn run(a: Args) -> Result<ExitCode, CliError> {
    let s = pipec_ir::files::seal_dir(&a.dir).map_err(|e| CliError::Usage(e.to_string()))?;
    let dir = a.dir.display();
    if s.unchanged {
        println!(
            "{dir}: every hash already matches its file; nothing to seal (pipec check {dir} verifies it)"
        );
        return Ok(ExitCode::SUCCESS);
    }
    println!(
        "sealed {dir}: {}, {}; manifest marked `sealed_by: {}`",
        super::count(s.ranks as usize, "rank file"),
        super::count(s.instructions as usize, "instruction"),
        pipec_ir::files::SEALED_BY
    );
    if !s.changed.is_empty() {
        let named: Vec<&str> = s.changed.iter().take(NAMED).map(|c| c.as_str()).collect();
        let more = s.changed.len().saturating_sub(NAMED);
        let more = if more > 0 {
            format!(" and {more} more")
        } else {
            String::new()
        };
        println!(
            "  changed since their hashes were written: {}{more}",
            named.join(", ")
        );
    }
    println!(
        "  the content is not judged here: pipec check {dir} verifies it (its verdict says it was sealed)"
    );
    Ok(ExitCode::SUCCESS)
}
