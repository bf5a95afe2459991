//! Subcommands. Each module owns one command: its arguments and its output.
//! Exit codes: 0 ok, 1 the input is invalid (violations found), 2 usage or I/O error.

mod args;
mod calibrate;
mod check;
mod compare;
mod compile;
mod export;
mod import;
mod layout;
mod schedules;
mod seal;
mod show;
mod simulate;
mod tune;
mod window;

use clap::{Parser, Subcommand};
use pipec_ir::files;
use std::fmt;
use std::process::ExitCode;

#[derive(Parser, Debug)]
#[command(
    name = "pipec",
    version,
    about = "Pipeline-parallel schedule compiler: generate, lower, verify and emit per-rank instruction streams"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Generate a schedule, lower it to per-rank instructions, verify it and write a directory.
    Compile(compile::Args),
    /// Verify a compiled directory or a torch CSV schedule; prints every violation.
    Check(check::Args),
    /// Terminal timeline of a compiled schedule, one row per rank.
    Show(show::Args),
    /// Simulate a compiled schedule under a cost model: makespan, bubble, peak memory.
    Simulate(simulate::Args),
    /// Compare schedules side by side under one cost model.
    Compare(compare::Args),
    /// Write a compiled schedule in another format.
    Export(export::Args),
    /// Import a torch.distributed.pipelining CSV schedule into a compiled directory.
    Import(import::Args),
    /// Recompute the hashes of a directory another tool wrote or edited, so `check` judges its content.
    Seal(seal::Args),
    /// Expand a Megatron layout string into its stage table.
    Layout(layout::Args),
    /// List the schedule kinds and their parameters.
    Schedules(schedules::Args),
    /// Find the fastest verified schedule and layer split for a model's costs and memory.
    Tune(tune::Args),
    /// Fit per-layer-kind costs to a measured trace; writes a cost file for tune/simulate.
    Calibrate(calibrate::Args),
}

impl Cli {
    /// Whether the command was asked for JSON and does not report its own errors as JSON
    /// (`check` does, with its input named): then `main` prints the error document.
    pub fn json_errors_from_main(&self) -> bool {
        match &self.command {
            Command::Simulate(a) => a.json,
            Command::Compare(a) => a.json,
            Command::Layout(a) => a.json,
            Command::Tune(a) => a.json,
            Command::Calibrate(a) => a.json,
            _ => false,
        }
    }
}

/// What stdout holds under `--json` when a command fails: one document with the message and
/// the exit code, so a JSON consumer never parses an empty stream.
pub fn print_json_error(e: &CliError) {
    let (code, msg) = match e {
        CliError::Invalid(m) => (1, m),
        CliError::Usage(m) => (2, m),
    };
    print_json(&serde_json::json!({ "error": msg, "exit_code": code }));
}

pub fn run(cli: Cli) -> Result<ExitCode, CliError> {
    match cli.command {
        Command::Compile(a) => compile::run(a),
        Command::Check(a) => check::run(a),
        Command::Show(a) => show::run(a),
        Command::Simulate(a) => simulate::run(a),
        Command::Compare(a) => compare::run(a),
        Command::Export(a) => export::run(a),
        Command::Import(a) => import::run(a),
        Command::Seal(a) => seal::run(a),
        Command::Layout(a) => layout::run(a),
        Command::Schedules(a) => schedules::run(a),
        Command::Tune(a) => tune::run(a),
        Command::Calibrate(a) => calibrate::run(a),
    }
}

/// An error at the CLI edge, already worded for a person.
#[derive(Debug)]
pub enum CliError {
    /// The input is invalid (exit 1).
    Invalid(String),
    /// Usage or I/O error (exit 2).
    Usage(String),
}

impl CliError {
    pub fn exit_code(&self) -> ExitCode {
        match self {
            CliError::Invalid(_) => ExitCode::from(1),
            CliError::Usage(_) => ExitCode::from(2),
        }
    }
}

impl fmt::Display for CliError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CliError::Invalid(m) | CliError::Usage(m) => write!(f, "error: {m}"),
        }
    }
}

/// `1 rank`, `4 ranks`, `1 microbatch`, `8 microbatches` ([`pipec_ir::human::count`]).
pub fn count(n: usize, noun: &str) -> String {
    pipec_ir::human::count(n as u64, noun)
}

/// `--memory-limit` of every command: bytes with a unit (`80GiB`) or a plain number in the
/// unit memory is reported in ([`pipec_cost::memory::Limit`]). A negative value gets its own reason
/// instead of clap's "unexpected argument" (it took `-5` for a flag).
pub fn parse_limit(s: &str) -> Result<pipec_cost::memory::Limit, String> {
    pipec_cost::memory::Limit::parse(s)
}

/// The limit in the unit of `model`'s memory ([`pipec_cost::memory::Limit::resolve_for`], which
/// Python calls too); bytes against a cost model without byte memory is invalid input (exit
/// 1, as any other bad value) that says what to add.
pub fn resolve_limit(
    limit: Option<pipec_cost::memory::Limit>,
    model: &pipec_cost::cost::CostModel,
) -> Result<Option<f64>, CliError> {
    limit
        .map(|l| l.resolve_for(model))
        .transpose()
        .map_err(|e| CliError::Invalid(format!("--memory-limit: {e}")))
}

/// Read the text file a flag names (`what`: `--cost-file`, `trace`, ...). A directory there
/// gets its own reason instead of the OS's bare "Is a directory"; a read failure is I/O (exit
/// 2), invalid UTF-8 invalid input (exit 1).
pub fn read_text(what: &str, path: &std::path::Path) -> Result<String, CliError> {
    if path.is_dir() {
        return Err(CliError::Usage(format!(
            "{what} {}: is a directory; give a file",
            path.display()
        )));
    }
    let bytes = std::fs::read(path)
        .map_err(|e| CliError::Usage(format!("{what} {}: {e}", path.display())))?;
    String::from_utf8(bytes).map_err(|e| {
        CliError::Invalid(format!(
            "{what} {}: not valid UTF-8: invalid byte at offset {}",
            path.display(),
            e.utf8_error().valid_up_to()
        ))
    })
}

/// Print JSON to stdout with a trailing newline, floats rounded ([`pipec_cost::rounding`]).
pub fn print_json<T: serde::Serialize>(v: &T) {
    let v = pipec_cost::rounding::tidy(serde_json::to_value(v).expect("serializable"));
    println!(
        "{}",
        serde_json::to_string_pretty(&v).expect("serializable")
    );
}

/// Load a compiled directory, mapping refusal to exit 2 (I/O) as the CLI contract says.
pub fn load(dir: &std::path::Path) -> Result<pipec_ir::files::Loaded, CliError> {
    load_then(dir, |_| ()).map(|(loaded, ())| loaded)
}

/// [`load`], running `then` (the verifier) while the schedule hash is checked
/// ([`pipec_ir::files::load_dir_then`]).
pub fn load_then<T: Send>(
    dir: &std::path::Path,
    then: impl FnOnce(&pipec_ir::files::Loaded) -> T,
) -> Result<(pipec_ir::files::Loaded, T), CliError> {
    pipec_ir::files::load_dir_then(dir, then).map_err(|e| CliError::Usage(e.to_string()))
}

/// A compiled directory, or a torch CSV file recognised by being a file (its content decides,
/// not its extension), read as `check` reads it, so every viewer accepts what `check` accepts.
pub fn load_any(
    path: &std::path::Path,
    pp: Option<u32>,
    placement: Option<pipec_compiler::torch::PlacementChoice>,
) -> Result<pipec_ir::files::Loaded, CliError> {
    if path.is_file() {
        let imported = import::read_csv(path, pp, placement)?;
        let layout = pipec_schedules::layout::Layout::uniform(imported.program.num_stages());
        return pipec_ir::files::load_files(&import::render_imported(&imported, &layout))
            .map_err(|e| CliError::Usage(e.to_string()));
    }
    if pp.is_some() || placement.is_some() {
        return Err(CliError::Usage(
            "--pp and --placement apply to torch CSV input only; a compiled directory records its own placement"
                .to_string(),
        ));
    }
    load(path)
}

/// A spinner on stderr naming the phase a long command is in. indicatif draws nothing when
/// stderr is not a terminal, so pipes and logs stay clean.
pub fn spinner(msg: &str) -> indicatif::ProgressBar {
    let pb =
        indicatif::ProgressBar::with_draw_target(None, indicatif::ProgressDrawTarget::stderr());
    pb.set_style(
        indicatif::ProgressStyle::with_template("{spinner} {msg} ({elapsed})")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_spinner()),
    );
    pb.set_message(msg.to_string());
    pb.enable_steady_tick(std::time::Duration::from_millis(120));
    pb
}

/// Above this, a write gets a warning first: a user asking for a huge schedule should know
/// before the disk fills.
pub const BIG_WRITE_BYTES: u64 = 100 << 20;

/// Warn on stderr before writing `bytes` to `to` when that is big.
pub fn warn_big_write(bytes: u64, to: &std::path::Path) {
    if bytes > BIG_WRITE_BYTES {
        eprintln!("warning: writing {} MB to {}", bytes >> 20, to.display());
    }
}

/// Stream `prepared` into `out` as every command that writes a schedule does
/// ([`files::write_prepared`]): the output takes its place only once `gate` hands over its
/// warrant (the verifier's verdict, or `--no-verify`), so what `gate` refuses never reaches
/// it; a write error is a usage error (exit 2).
pub fn write_gated<'p>(
    out: &std::path::Path,
    prepared: &files::Prepared<'p>,
    threads: usize,
    gate: impl FnOnce() -> Result<files::Warrant<'p>, CliError> + Send,
) -> Result<files::Warrant<'p>, CliError> {
    files::write_prepared(out, prepared, threads, gate).map_err(|e| match e {
        files::Gated::Gate(e) => e,
        files::Gated::Write(e) => CliError::Usage(e.to_string()),
    })
}

/// What a written schedule's memory is checked against: the model and the limit in its unit.
pub struct MemoryCheck<'a> {
    pub model: &'a pipec_ir::memory::MemoryModel,
    pub limit: Option<f64>,
}

/// Verify a program that is about to be written; refuse (exit 1, every violation listed)
/// when it is invalid, so an invalid schedule never reaches the disk.
pub fn verify_before_write<'p>(
    program: &'p pipec_ir::Program,
    memory: MemoryCheck<'_>,
    out: &std::path::Path,
) -> Result<pipec_ir::verify::Verified<&'p pipec_ir::Program>, CliError> {
    let threads = pipec_ir::par::threads_for(program.len() as u64);
    pipec_ir::verify::verified_with(program, threads, memory.model, memory.limit)
        .map_err(|rejected| refusing_to_write(out, &rejected.report))
}

/// An invalid program kept from `out`: exit 1 with the verdict and every violation.
pub fn refusing_to_write(out: &std::path::Path, r: &pipec_ir::verify::Report) -> CliError {
    let mut msg = format!("refusing to write {}: {}", out.display(), r.verdict_line());
    for v in &r.violations {
        msg.push_str(&format!("\n  [{}] {v}", v.class()));
    }
    CliError::Invalid(msg)
}
