//! The `pipec` command line. Parsing and printing live here; the work is in the library.

mod cli;

use clap::Parser;
use std::process::ExitCode;

fn main() -> ExitCode {
    pipec::sigpipe::restore_default();
    let args = cli::Cli::parse();
    match cli::run(args) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("{e}");
            e.exit_code()
        }
    }
}
