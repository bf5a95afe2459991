//! Loading a compiled directory for execution. Everything is checked before any rank starts:
//! the instruction-file checks of [`pipec_ir::files::load_dir`] (format, version, each rank
//! file's hash against the manifest, one schedule hash for all ranks), the world size of the
//! launch, the layout against the stage count, the structure of the schedule
//! ([`check_structure`], the verifier's structural level, naming the file and instruction at
//! fault), and then the full verifier
//! ([`pipec_ir::verify::verify`]: completeness, dependencies, matching, deadlock freedom).

use crate::error::RunError;
use pipec_ir::files::{
    load_dir, load_dir_verified, rank_file_name, Encoding, Loaded, Manifest, MANIFEST_FILE,
};
use pipec_ir::ir::{Instr, Program};
use pipec_ir::verify::{
    structural, verify_at, Level, Report, Structural, Verified, VerifyOptions, Violation,
};
use std::path::Path;

/// A directory ready to run: its manifest and its program, [`Verified`] ([`load`]) or only
/// [`Structural`] ([`load_unverified`], for `pipec-run --no-verify`). The runtimes take the
/// program as either ([`pipec_ir::verify::Checked`]), never as a bare [`Program`].
#[derive(Debug)]
pub struct Runnable<P> {
    pub manifest: Manifest,
    pub program: P,
}

/// Where the launch's world size came from, for messages.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct LaunchWorld {
    pub size: u32,
    /// `--world-size` or `WORLD_SIZE`.
    pub from: &'static str,
}

/// Load `dir`, check it is runnable by a launch of `world` ranks (when given), and verify it
/// (the full verifier, which includes the structural level of [`load_unverified`]).
pub fn load(dir: &Path, world: Option<LaunchWorld>) -> Result<Runnable<Verified>, RunError> {
    // The verifier runs while the loader checks the schedule hash; its verdict counts only
    // once the launch checks pass too, so refusals come in the same order as without it.
    let loaded = load_dir_verified(dir, &VerifyOptions::default())?;
    check_launchable(dir, &loaded.manifest, world)?;
    if let Ok(program) = &loaded.verdict {
        refuse_shape_messages(dir, program.program(), loaded.manifest.encoding)?;
    }
    match loaded.verdict {
        Ok(program) => Ok(Runnable {
            manifest: loaded.manifest,
            program,
        }),
        Err(rejected) => Err(RunError::NotVerified {
            dir: dir.display().to_string(),
            report: Box::new(rejected.report),
        }),
    }
}

/// [`load`] without the full verifier: file, launch and structural checks only. For
/// `pipec-run --no-verify`, which exists to watch what a broken schedule does (the watchdog).
pub fn load_unverified(
    dir: &Path,
    world: Option<LaunchWorld>,
) -> Result<Runnable<Structural>, RunError> {
    let loaded = load_launchable(dir, world)?;
    let encoding = loaded.manifest.encoding;
    match structural(loaded.program) {
        Ok(program) => Ok(Runnable {
            manifest: loaded.manifest,
            program,
        }),
        Err(rejected) => Err(match structure_refusal(&rejected.report, encoding) {
            RunError::Refused { file, field, msg } => RunError::Refused {
                file: dir.join(file).display().to_string(),
                field,
                msg,
            },
            e => e,
        }),
    }
}

/// The instruction-file checks, the launch's world size and the layout's stage count.
fn load_launchable(dir: &Path, world: Option<LaunchWorld>) -> Result<Loaded, RunError> {
    let loaded = load_dir(dir)?;
    check_launchable(dir, &loaded.manifest, world)?;
    refuse_shape_messages(dir, &loaded.program, loaded.manifest.encoding)?;
    Ok(loaded)
}

/// Megatron's shape messages (`pipec compile --megatron-variable-seq-lengths`) model
/// Megatron's `variable_seq_lengths` handshake for `pipec check`; a plan needs none (it knows
/// every receive's size), so there is nothing for a runtime to execute them as.
fn refuse_shape_messages(
    dir: &Path,
    program: &Program,
    encoding: Encoding,
) -> Result<(), RunError> {
    for (r, instrs) in program.ranks.iter().enumerate() {
        for (i, ins) in instrs.iter().enumerate() {
            if let Instr::Send { payload, .. } | Instr::Recv { payload, .. } = ins {
                if payload.kind.is_shape() {
                    return Err(RunError::Refused {
                        file: dir
                            .join(pipec_ir::files::rank_file_name(r as u32, encoding))
                            .display()
                            .to_string(),
                        field: "payload".into(),
                        msg: format!(
                            "#{i} {ins} is one of Megatron's shape messages: this program models Megatron's variable_seq_lengths handshake (compiled with --megatron-variable-seq-lengths) for pipec check, and is not run; compile without that flag (with --microbatch-lengths every receive is sized from the plan)"
                        ),
                    });
                }
            }
        }
    }
    Ok(())
}

/// The launch's world size and the layout's stage count, of a directory [`load_dir`] accepted.
fn check_launchable(dir: &Path, m: &Manifest, world: Option<LaunchWorld>) -> Result<(), RunError> {
    if let Some(w) = world {
        if w.size != m.world_size {
            return Err(RunError::Refused {
                file: dir.join(MANIFEST_FILE).display().to_string(),
                field: "world_size".into(),
                msg: format!(
                    "the schedule is compiled for {} ranks, but the launch has {} ({})",
                    m.world_size, w.size, w.from
                ),
            });
        }
    }
    if m.layout.num_stages() != m.num_stages {
        return Err(RunError::Refused {
            file: dir.join(MANIFEST_FILE).display().to_string(),
            field: "layout".into(),
            msg: format!(
                "the layout `{}` has {} stages, but `num_stages` is {}",
                m.layout.expanded(),
                m.layout.num_stages(),
                m.num_stages
            ),
        });
    }
    Ok(())
}

/// The verifier's structural level ([`Level::Structure`]: ids in range, every pass once on its
/// owner's rank, sends and receives paired with equal payloads, every message routed to the
/// consumer's rank) as a refusal naming the rank file and instruction of the first violation,
/// with every violation listed. What is left (deadlock freedom, dependency order) is the full
/// verifier's ([`load`] runs it next); under `--no-verify` the watchdog catches it.
pub fn check_structure(program: &Program, encoding: Encoding) -> Result<(), RunError> {
    let report = verify_at(program, &VerifyOptions::default(), Level::Structure);
    if report.is_valid() {
        return Ok(());
    }
    Err(structure_refusal(&report, encoding))
}

/// The refusal of a structural report with violations: the rank file and instruction of the
/// first, every one listed.
fn structure_refusal(report: &Report, encoding: Encoding) -> RunError {
    let Some(first) = report.violations.first() else {
        return RunError::Refused {
            file: MANIFEST_FILE.to_string(),
            field: "placement".to_string(),
            msg: "refused without a violation".to_string(),
        };
    };
    let (file, field) = match (first.at(), first) {
        (Some(at), _) => (
            rank_file_name(at.rank.0, encoding),
            format!("instructions[{}]", at.index),
        ),
        // A pass that never runs belongs in its owner's stream.
        (None, Violation::Missing { owner, .. }) => (
            rank_file_name(owner.0, encoding),
            "instructions".to_string(),
        ),
        (None, _) => (MANIFEST_FILE.to_string(), "placement".to_string()),
    };
    let mut msg = first.to_string();
    for v in &report.violations[1..] {
        msg.push_str(&format!("\n  [{}] {v}", v.class()));
    }
    RunError::Refused { file, field, msg }
}
