//! The `pipec` command line. Parsing and printing live here; the work is in the library.

mod cli;

/// mimalloc instead of the system allocator: on a large compile glibc's allocator faults in
/// fresh 4 KiB pages one by one, a large share of `compile --format bin`'s CPU time on a
/// virtual machine; mimalloc commits its arenas in large pieces, so far fewer faults. The price
/// is peak RSS rounded up to those pieces (bench/HISTORY.md, fourth pass, has the figures).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

use clap::Parser as _;
use std::process::ExitCode;

fn main() -> ExitCode {
    pipec_cli::sigpipe::restore_default();
    let args = match cli::Cli::try_parse() {
        Ok(a) => a,
        Err(e) => {
            let code = parse_exit(&e);
            if code != 0 && std::env::args().any(|a| a == "--json") {
                // clap's first line, the one that names the argument.
                let rendered = e.render().to_string();
                let first = rendered.lines().next().unwrap_or("invalid command line");
                let msg = first.strip_prefix("error: ").unwrap_or(first).to_string();
                let e = invalid_value(&e).unwrap_or(msg);
                let err = match code {
                    1 => cli::CliError::Invalid(e),
                    _ => cli::CliError::Usage(e),
                };
                cli::print_json_error(&err);
            }
            match (code, invalid_value(&e)) {
                // A value the library refused: its reason alone, as every other invalid input
                // is reported (no usage footer: the command line was well formed).
                (1, Some(msg)) => eprintln!("error: {msg}"),
                _ => {
                    let _ = e.print();
                }
            }
            return ExitCode::from(code);
        }
    };
    let json_errors = args.json_errors_from_main();
    match cli::run(args) {
        Ok(code) => code,
        Err(e) => {
            if json_errors {
                cli::print_json_error(&e);
            }
            eprintln!("{e}");
            e.exit_code()
        }
    }
}

/// A value the library refuses (an unknown schedule kind, a bad placement) is invalid input,
/// exit 1 as docs/cli.md says; every other parse error is usage (2), and help or version 0.
fn parse_exit(e: &clap::Error) -> u8 {
    use clap::error::{ContextKind, ContextValue, ErrorKind};
    match e.kind() {
        ErrorKind::DisplayHelp | ErrorKind::DisplayVersion => 0,
        ErrorKind::ValueValidation | ErrorKind::InvalidValue => {
            let arg = match e.get(ContextKind::InvalidArg) {
                Some(ContextValue::String(s)) => s.as_str(),
                _ => "",
            };
            if [
                "--schedule",
                "--placement",
                "--megatron-p2p",
                "--memory-limit",
            ]
            .iter()
            .any(|f| arg.starts_with(f))
            {
                1
            } else {
                2
            }
        }
        _ => 2,
    }
}

/// `--flag VALUE: reason` for a value its parser refused, or None for other parse errors.
fn invalid_value(e: &clap::Error) -> Option<String> {
    use clap::error::{ContextKind, ContextValue};
    let arg = match e.get(ContextKind::InvalidArg) {
        Some(ContextValue::String(s)) => s.split_whitespace().next()?.to_string(),
        _ => return None,
    };
    let reason = std::error::Error::source(e)?.to_string();
    Some(format!("{arg}: {reason}"))
}
