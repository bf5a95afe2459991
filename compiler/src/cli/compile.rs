//! `pipec compile`: generate, lower, verify, write.

use super::CliError;
use pipec::compile::{compile, CompileError, CompileRequest};
use pipec::files::{self, Header};
use pipec_schedules::{Limits, ScheduleKind};
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Schedule kind (see `pipec schedules`).
    #[arg(long, value_parser = parse_kind)]
    pub schedule: ScheduleKind,
    /// Pipeline-parallel size (ranks).
    #[arg(long)]
    pub pp: u32,
    /// Model chunks per rank; derived from --layout when one is given.
    #[arg(long)]
    pub vpp: Option<u32>,
    /// Number of microbatches.
    #[arg(long)]
    pub microbatches: u32,
    /// Megatron layout string, e.g. "Et*3|(tt|)*29,m|L".
    #[arg(long, conflicts_with = "layout_file")]
    pub layout: Option<String>,
    /// Read the layout string from a file (one trailing newline is ignored).
    #[arg(long, value_name = "FILE")]
    pub layout_file: Option<PathBuf>,
    /// Megatron's microbatch_group_size_per_vp_stage (interleaved-1f1b; default pp).
    #[arg(long)]
    pub group_size: Option<u32>,
    /// Inference: forwards only.
    #[arg(long)]
    pub forward_only: bool,
    /// Check the layout's decoder layer count.
    #[arg(long)]
    pub num_layers: Option<u32>,
    /// Check the layout's MTP layer count.
    #[arg(long)]
    pub mtp_num_layers: Option<u32>,
    /// Refuse schedules with more compute ops than this.
    #[arg(long, default_value_t = Limits::DEFAULT.max_compute_ops)]
    pub max_ops: u64,
    /// Encoding of the rank files: json (default, readable) or bin (postcard, compact).
    #[arg(long = "format", value_enum, default_value_t = FileFormat::Json)]
    pub format: FileFormat,
    /// Most live activations (microbatch x stage units) a rank may hold; exceeding it is a violation.
    #[arg(long)]
    pub memory_limit: Option<u64>,
    /// Write the schedule without verifying it (not recommended).
    #[arg(long)]
    pub no_verify: bool,
    /// Output directory.
    #[arg(short = 'o', long = "out")]
    pub out: PathBuf,
}

#[derive(clap::ValueEnum, Copy, Clone, Debug, PartialEq, Eq)]
pub enum FileFormat {
    Json,
    Bin,
}

impl FileFormat {
    pub fn encoding(self) -> files::Encoding {
        match self {
            FileFormat::Json => files::Encoding::Json,
            FileFormat::Bin => files::Encoding::Postcard,
        }
    }
}

pub fn parse_kind(s: &str) -> Result<ScheduleKind, String> {
    s.parse::<ScheduleKind>().map_err(|e| e.to_string())
}

impl Args {
    pub fn request(&self) -> CompileRequest {
        CompileRequest {
            kind: self.schedule,
            pp: self.pp,
            vpp: self.vpp,
            microbatches: self.microbatches,
            group_size: self.group_size,
            forward_only: self.forward_only,
            layout: self.layout.clone(),
            num_layers: self.num_layers,
            mtp_num_layers: self.mtp_num_layers,
            limits: Limits {
                max_compute_ops: self.max_ops,
            },
        }
    }
}

/// Compile errors are the user's input being invalid: exit 1, with the layout caret if any.
pub fn compile_error(e: CompileError) -> CliError {
    match e {
        CompileError::Layout(l) => CliError::Invalid(super::layout::render_error(&l)),
        CompileError::Spec(s) => CliError::Invalid(s.to_string()),
    }
}

pub fn run(mut a: Args) -> Result<ExitCode, CliError> {
    if let Some(path) = &a.layout_file {
        a.layout = Some(super::layout::read_layout_file(path)?);
    }
    let c = compile(&a.request()).map_err(compile_error)?;
    // Verify before anything is written: an invalid schedule never reaches the disk unless
    // the user insists with --no-verify.
    let verdict = if a.no_verify {
        eprintln!(
            "WARNING: --no-verify: this schedule was NOT verified; it may deadlock, hang or compute on the wrong tensors{}",
            if a.memory_limit.is_some() { " (--memory-limit was not checked either)" } else { "" }
        );
        None
    } else {
        Some(super::verify_before_write(
            &c.program,
            a.memory_limit,
            &a.out,
        )?)
    };
    let header = Header {
        source: "generated",
        schedule: Some(c.spec),
        comm_policy: Some(c.schedule.comm),
        layout: &c.layout,
    };
    let rendered = files::render(&header, &c.program, a.format.encoding());
    files::write_dir(&a.out, &rendered).map_err(|e| CliError::Usage(e.to_string()))?;
    println!(
        "compiled {} pp={} vpp={} microbatches={}: {} ranks, {} stages, {} instructions -> {}",
        c.spec.kind,
        c.spec.pp,
        c.spec.vpp,
        c.spec.microbatches,
        c.program.world(),
        c.program.num_stages(),
        c.program.len(),
        a.out.display()
    );
    if let Some(r) = verdict {
        println!("{}", r.verdict_line());
    }
    Ok(ExitCode::SUCCESS)
}
