//! Sealing: recompute every hash of a directory whose files another tool wrote or edited, so
//! that readers judge its content instead of refusing it as changed after compilation.
//!
//! The hashes exist to catch files that changed by accident after pipec wrote them (a
//! truncated copy, rank files of two compiles mixed). A tool that writes or edits instruction
//! files on purpose cannot produce them without reimplementing `docs/format.md`'s hashing;
//! sealing does it for it and records that it did (`sealed_by` in the manifest), so a verdict
//! on a sealed directory is a verdict on its content, kept apart from the integrity check of
//! pipec's own output. Every other check is the loader's: a malformed file is refused with the
//! loader's message (file, field, line), and the content is never judged here (`pipec check`
//! does that).

use super::format::*;
use super::read::{
    check_format_version, check_manifest, decode_rank, json_err, read_file, read_manifest_of,
    LoadError,
};
use super::write::{prepare, threads_for, write_prepared, Gated, Warrant, WriteError};
use crate::ir::Program;
use crate::verify::Unverified;
use pipec_schedules::layout::Layout;
use pipec_schedules::{CommPolicy, Placement, ScheduleSpec};
use serde::Deserialize;
use std::path::Path;
use thiserror::Error;

/// What [`seal_dir`] did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Sealed {
    /// Rank files read.
    pub ranks: u32,
    pub instructions: u64,
    /// The rank files whose bytes no longer matched the `sha256` the manifest recorded, in
    /// rank order.
    pub changed: Vec<String>,
    /// Every hash already matched its file: nothing was written.
    pub unchanged: bool,
}

/// Why a directory could not be sealed.
#[derive(Debug, Error)]
pub enum SealError {
    /// A file is missing, unreadable or malformed (the loader's message).
    #[error(transparent)]
    Load(#[from] LoadError),
    /// The sealed directory could not be written.
    #[error(transparent)]
    Write(#[from] WriteError),
}

/// `manifest.json` as sealing reads it: the fields the hashes fill in may be absent.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ManifestLoose {
    format: String,
    version: u32,
    #[serde(default)]
    compiler: Option<String>,
    source: String,
    schedule: Option<ScheduleSpec>,
    comm_policy: Option<CommPolicy>,
    layout: Layout,
    placement: Placement,
    world_size: u32,
    num_stages: u32,
    microbatches: u32,
    forward_only: bool,
    encoding: Encoding,
    #[serde(default)]
    schedule_hash: Option<String>,
    ranks: Vec<RankEntryLoose>,
    #[serde(default)]
    sealed_by: Option<String>,
    #[serde(default)]
    cost: Option<String>,
    #[serde(default)]
    plan: Option<String>,
    #[serde(default)]
    microbatch_lengths: Option<pipec_schedules::Lengths>,
    #[serde(default)]
    p2p_groups: pipec_schedules::P2pGroups,
    buffer_slots: Option<crate::ir::Pools>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RankEntryLoose {
    rank: u32,
    file: String,
    #[serde(default)]
    sha256: Option<String>,
    #[serde(default)]
    instructions: Option<u64>,
}

/// Read `dir`'s manifest with every check of the loader's but the hashes it records.
fn read_manifest(dir: &Path) -> Result<Manifest, LoadError> {
    let path = dir.join(MANIFEST_FILE);
    let mut bytes = Vec::new();
    read_manifest_of(dir, read_file, &mut bytes)?;
    // Format and version first, so a newer file gets the right message (as the loader).
    let probe: serde_json::Value =
        serde_json::from_slice(&bytes).map_err(|e| json_err(&path, e))?;
    check_format_version(&path, &probe, MANIFEST_FORMAT)?;
    // From the bytes rather than the value: serde's messages then carry line and column.
    let m: ManifestLoose = serde_json::from_slice(&bytes).map_err(|e| json_err(&path, e))?;
    let m = Manifest {
        format: m.format,
        version: m.version,
        compiler: m.compiler.unwrap_or_else(|| "unknown".to_string()),
        source: m.source,
        schedule: m.schedule,
        comm_policy: m.comm_policy,
        layout: m.layout,
        placement: m.placement,
        world_size: m.world_size,
        num_stages: m.num_stages,
        microbatches: m.microbatches,
        forward_only: m.forward_only,
        encoding: m.encoding,
        schedule_hash: m.schedule_hash.unwrap_or_default(),
        ranks: m
            .ranks
            .into_iter()
            .map(|e| RankEntry {
                rank: e.rank,
                file: e.file,
                sha256: e.sha256.unwrap_or_default(),
                instructions: e.instructions.unwrap_or(u64::MAX),
            })
            .collect(),
        sealed_by: m.sealed_by,
        cost: m.cost,
        microbatch_lengths: m.microbatch_lengths,
        plan: m.plan,
        p2p_groups: m.p2p_groups,
        buffer_slots: m.buffer_slots,
    };
    check_manifest(path, m)
}

/// Seal `dir`: read its manifest and every rank file with the loader's checks except the
/// hashes, then, unless every hash already matches, write the directory again (atomically,
/// as `pipec compile` writes: the rank files in pipec's own form, the same instructions)
/// with fresh hashes and `sealed_by` set. The manifest keeps its `compiler` (who wrote the
/// files). `schedule_hash`, each rank's `sha256` and `instructions`, and a JSON rank file's
/// `schedule_hash` may be absent: they are what sealing writes.
pub fn seal_dir(dir: &Path) -> Result<Sealed, SealError> {
    let m = read_manifest(dir)?;
    let mut ranks = Vec::with_capacity(m.world_size as usize);
    let mut changed = Vec::new();
    let mut hashes = Vec::with_capacity(m.world_size as usize);
    let mut bytes = Vec::new();
    for (r, entry) in m.ranks.iter().enumerate() {
        let path = dir.join(&entry.file);
        read_file(&path, &mut bytes)?;
        if sha256_hex(&bytes) != entry.sha256 {
            changed.push(entry.file.clone());
        }
        let d = decode_rank(&path, &bytes, &m, r as u32, None, true)?;
        hashes.push(d.schedule_hash);
        ranks.push(d.instructions);
    }
    let program = Program {
        placement: m.placement.clone(),
        microbatches: m.microbatches,
        forward_only: m.forward_only,
        comm: m.comm_policy,
        lengths: m.microbatch_lengths.clone(),
        ranks,
        p2p_groups: m.p2p_groups,
        buffer_slots: m.buffer_slots.clone(),
    };
    let header = Header {
        source: &m.source,
        schedule: m.schedule,
        layout: &m.layout,
    };
    let prepared = prepare(&header, &program, m.encoding);
    let hash = prepared.hash();
    let instructions = program.len() as u64;
    let unchanged = changed.is_empty()
        && m.schedule_hash == hash
        && hashes.iter().all(|h| h.as_deref() == Some(hash))
        && m.ranks
            .iter()
            .zip(&program.ranks)
            .all(|(e, instrs)| e.instructions == instrs.len() as u64);
    let sealed = Sealed {
        ranks: m.world_size,
        instructions,
        changed,
        unchanged,
    };
    if unchanged {
        return Ok(sealed);
    }
    let prepared = prepared
        .sealed(m.compiler.clone())
        .with_cost(m.cost.clone())
        .with_plan(m.plan.clone());
    let threads = threads_for(instructions);
    // Sealing vouches for the hashes, not the schedule: the loader verifies what it reads.
    write_prepared(dir, &prepared, threads, || {
        Ok::<_, std::convert::Infallible>(Warrant::Unverified(Unverified::unchecked(&program)))
    })
    .map_err(|e| match e {
        Gated::Write(e) => SealError::Write(e),
        Gated::Gate(never) => match never {},
    })?;
    Ok(sealed)
}
