//! `pipec show`.

use super::CliError;
use std::process::ExitCode;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Input.
    input: std::path::PathBuf,
}

pub fn run(a: Args) -> Result<ExitCode, CliError> {
    Err(CliError::Usage(format!(
        "`pipec show` is not built yet ({})",
        a.input.display()
    )))
}
