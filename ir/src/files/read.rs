//! Reading a directory back: every check a loader makes (format, version, file hashes,
//! the manifest's fields, the schedule hash) before a program is handed out.

use super::format::*;
use crate::ir::{Instr, Program};
use std::path::{Path, PathBuf};
use thiserror::Error;

/// Everything a reader gets back.
#[derive(Clone, Debug)]
pub struct Loaded {
    pub manifest: Manifest,
    pub program: Program,
}

/// Why a directory was refused. Every variant names the file, and the field where one is at fault.
#[derive(Debug, Error)]
pub enum LoadError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: not a valid pipec file: {msg}")]
    Json { path: PathBuf, msg: String },
    #[error("{path}: field `format` is `{found}`, expected `{expected}`")]
    Format {
        path: PathBuf,
        found: String,
        expected: &'static str,
    },
    #[error("{path}: format version {found} is not supported by this pipec (it reads version {supported})")]
    Version {
        path: PathBuf,
        found: u32,
        supported: u32,
    },
    #[error("{path}: content hash {actual} does not match the manifest's `sha256` {expected}; the file was changed or corrupted after compilation (if it was edited on purpose, `pipec seal {}` re-hashes the directory so that its content is checked)", parent_of(.path).display())]
    FileHash {
        path: PathBuf,
        expected: String,
        actual: String,
    },
    #[error("{path}: field `{field}` is {found}, but the manifest says {expected}")]
    Mismatch {
        path: PathBuf,
        field: &'static str,
        found: String,
        expected: String,
    },
    #[error("{path}: the manifest lists {listed} rank files for a world size of {world}")]
    RankList {
        path: PathBuf,
        listed: usize,
        world: u32,
    },
    #[error(
        "{path}: the recomputed schedule hash {actual} does not match `schedule_hash` {expected} (if the files were edited on purpose, `pipec seal {}` re-hashes them so that their content is checked)", parent_of(.path).display()
    )]
    ScheduleHash {
        path: PathBuf,
        expected: String,
        actual: String,
    },
    /// A file where a schedule directory was expected: one of pipec's own files (`found`),
    /// whose directory was meant, or anything else (a torch CSV, say, which is imported first).
    #[error("{}", not_a_directory(.path, .found))]
    NotADirectory {
        path: PathBuf,
        found: Option<FileKind>,
    },
    /// A directory without a manifest that holds compiled schedules (a sweep's output): one of
    /// them was meant.
    #[error("{path}: not a compiled schedule (no manifest.json), but it holds {count} (e.g. {example}): pass one of them")]
    HoldsSchedules {
        path: PathBuf,
        count: usize,
        example: PathBuf,
    },
}

/// Which of pipec's instruction files some bytes are ([`sniff`]).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum FileKind {
    Manifest,
    Rank(u32),
}

impl std::fmt::Display for FileKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FileKind::Manifest => write!(f, "the manifest"),
            FileKind::Rank(r) => write!(f, "rank {r}'s instructions"),
        }
    }
}

/// The directory a file sits in, as a user would type it (`.` for a bare file name).
fn parent_of(path: &Path) -> PathBuf {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

fn not_a_directory(path: &Path, found: &Option<FileKind>) -> String {
    let p = path.display();
    match found {
        Some(kind) => format!(
            "{p}: this is a pipec instruction file ({kind}), not a schedule directory: pass its directory, {}",
            parent_of(path).display()
        ),
        None => format!(
            "{p}: a file, not a compiled schedule directory (manifest.json and rank files); a torch CSV schedule becomes one with `pipec import {p} -o DIR`"
        ),
    }
}

/// Whether `bytes` are one of pipec's instruction files, by content (a renamed file too):
/// a JSON object whose `format` is pipec's, or a binary rank file's postcard prefix. A torch
/// CSV never starts with `{` or with that prefix, so this never mistakes one.
pub fn sniff(bytes: &[u8]) -> Option<FileKind> {
    // `rank-<r>.bin`: the length of "pipec-rank" (a varint), the name, the version, the rank.
    let bin = [&[RANK_FORMAT.len() as u8][..], RANK_FORMAT.as_bytes()].concat();
    if let Some(rest) = bytes.strip_prefix(&bin[..]) {
        // Then the version and the rank, varints.
        let rank = postcard::take_from_bytes::<(u32, u32)>(rest).map_or(0, |((_, r), _)| r);
        return Some(FileKind::Rank(rank));
    }
    let first = bytes.iter().find(|b| !b.is_ascii_whitespace())?;
    if *first != b'{' {
        return None;
    }
    #[derive(serde::Deserialize)]
    struct Probe {
        format: Option<String>,
        rank: Option<u32>,
    }
    let p: Probe = serde_json::from_slice(bytes).ok()?;
    match p.format.as_deref() {
        Some(MANIFEST_FORMAT) => Some(FileKind::Manifest),
        Some(RANK_FORMAT) => Some(FileKind::Rank(p.rank.unwrap_or(0))),
        _ => None,
    }
}

/// Why `dir`'s manifest could not be read, when a better reason than the I/O error exists:
/// `dir` is missing (named itself), a file ([`LoadError::NotADirectory`]), or a directory of
/// schedules ([`LoadError::HoldsSchedules`]).
fn misplaced(dir: &Path) -> Option<LoadError> {
    if dir.as_os_str().is_empty() {
        return None;
    }
    let meta = match std::fs::metadata(dir) {
        Ok(m) => m,
        // The path the user gave, not the manifest inside it.
        Err(source) => {
            return Some(LoadError::Io {
                path: dir.to_path_buf(),
                source,
            })
        }
    };
    if meta.is_file() {
        let found = std::fs::read(dir).ok().and_then(|b| sniff(&b));
        return Some(LoadError::NotADirectory {
            path: dir.to_path_buf(),
            found,
        });
    }
    if !meta.is_dir() || dir.join(MANIFEST_FILE).exists() {
        return None;
    }
    let mut found: Vec<PathBuf> = std::fs::read_dir(dir)
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.join(MANIFEST_FILE).is_file())
        .collect();
    found.sort();
    let example = found.first()?.clone();
    Some(LoadError::HoldsSchedules {
        path: dir.to_path_buf(),
        count: found.len(),
        example,
    })
}

/// [`read`] of `dir`'s manifest, with [`misplaced`]'s reason when it fails.
pub(crate) fn read_manifest_of(
    dir: &Path,
    read: impl Fn(&Path, &mut Vec<u8>) -> Result<(), LoadError>,
    buf: &mut Vec<u8>,
) -> Result<(), LoadError> {
    read(&dir.join(MANIFEST_FILE), buf).map_err(|e| match e {
        LoadError::Io { .. } => misplaced(dir).unwrap_or(e),
        e => e,
    })
}

pub(crate) fn read(path: &Path) -> Result<Vec<u8>, LoadError> {
    std::fs::read(path).map_err(|source| LoadError::Io {
        path: path.to_path_buf(),
        source,
    })
}

pub(crate) fn json_err(path: &Path, e: serde_json::Error) -> LoadError {
    LoadError::Json {
        path: path.to_path_buf(),
        msg: e.to_string(),
    }
}

/// Read and check `manifest.json` alone.
pub fn load_manifest(dir: &Path) -> Result<Manifest, LoadError> {
    let path = dir.join(MANIFEST_FILE);
    let mut bytes = Vec::new();
    read_manifest_of(dir, read_file, &mut bytes)?;
    parse_manifest(&path, &bytes)
}

/// Check the bytes of a `manifest.json` (read from `path`, which only names it in errors).
/// Pure: the entry point the fuzzers drive.
pub fn parse_manifest(path: &Path, bytes: &[u8]) -> Result<Manifest, LoadError> {
    let path = path.to_path_buf();
    // Check format and version before the full schema, so a newer file gets the right message.
    let probe: serde_json::Value = serde_json::from_slice(bytes).map_err(|e| json_err(&path, e))?;
    check_format_version(&path, &probe, MANIFEST_FORMAT)?;
    let m: Manifest = serde_json::from_value(probe).map_err(|e| json_err(&path, e))?;
    check_manifest(path, m)
}

/// The manifest's checks after its schema: its rank list and its placement agree with its
/// world size.
pub(crate) fn check_manifest(path: PathBuf, m: Manifest) -> Result<Manifest, LoadError> {
    if m.ranks.len() != m.world_size as usize {
        return Err(LoadError::RankList {
            path,
            listed: m.ranks.len(),
            world: m.world_size,
        });
    }
    for (i, e) in m.ranks.iter().enumerate() {
        let want = rank_file_name(i as u32, m.encoding);
        if e.rank != i as u32 || e.file != want {
            return Err(LoadError::Mismatch {
                path,
                field: "ranks",
                found: format!("entry {i} for rank {} in `{}`", e.rank, e.file),
                expected: format!("rank {i} in `{want}`"),
            });
        }
    }
    if m.placement.pp != m.world_size || m.placement.num_stages() != m.num_stages {
        return Err(LoadError::Mismatch {
            path,
            field: "placement",
            found: format!(
                "pp {} with {} stages",
                m.placement.pp,
                m.placement.num_stages()
            ),
            expected: format!("world size {} with {} stages", m.world_size, m.num_stages),
        });
    }
    if let Some(p) = &m.buffer_slots {
        if p.0.len() != m.world_size as usize {
            return Err(LoadError::Mismatch {
                path,
                field: "buffer_slots",
                found: format!("{} ranks", p.0.len()),
                expected: format!("{} (`world_size`)", m.world_size),
            });
        }
        if let Some((r, x)) = p.0.iter().enumerate().find_map(|(r, v)| {
            v.iter()
                .find(|x| !x.is_finite() || **x < 0.0)
                .map(|x| (r, x))
        }) {
            return Err(LoadError::Mismatch {
                path,
                field: "buffer_slots",
                found: format!("a slot of size {x} on rank {r}"),
                expected: "sizes that are finite and at least 0".to_string(),
            });
        }
    }
    if let Some(l) = &m.microbatch_lengths {
        if l.microbatches() != m.microbatches {
            return Err(LoadError::Mismatch {
                path,
                field: "microbatch_lengths",
                found: format!("{} microbatches", l.microbatches()),
                expected: format!("{} (`microbatches`)", m.microbatches),
            });
        }
    }
    Ok(m)
}

pub(crate) fn check_format_version(
    path: &Path,
    v: &serde_json::Value,
    expected: &'static str,
) -> Result<(), LoadError> {
    let found = v
        .get("format")
        .and_then(|f| f.as_str())
        .unwrap_or("<missing>");
    if found != expected {
        return Err(LoadError::Format {
            path: path.to_path_buf(),
            found: found.to_string(),
            expected,
        });
    }
    match v.get("version").and_then(|f| f.as_u64()) {
        Some(n) if n == FORMAT_VERSION as u64 => Ok(()),
        other => Err(LoadError::Version {
            path: path.to_path_buf(),
            found: other.map(|n| n.min(u32::MAX as u64) as u32).unwrap_or(0),
            supported: FORMAT_VERSION,
        }),
    }
}

/// Read one rank's instructions, checked against the manifest.
pub fn load_rank(dir: &Path, manifest: &Manifest, rank: u32) -> Result<Vec<Instr>, LoadError> {
    let entry = manifest
        .ranks
        .get(rank as usize)
        .ok_or_else(|| LoadError::Mismatch {
            path: dir.join(MANIFEST_FILE),
            field: "world_size",
            found: manifest.world_size.to_string(),
            expected: format!("a rank {rank}"),
        })?;
    let path = dir.join(&entry.file);
    let bytes = read(&path)?;
    parse_rank(&path, &bytes, manifest, rank)
}

/// Check the bytes of rank `rank`'s file (read from `path`, which only names it in errors)
/// against `manifest`. Pure: the entry point the fuzzers drive.
pub fn parse_rank(
    path: &Path,
    bytes: &[u8],
    manifest: &Manifest,
    rank: u32,
) -> Result<Vec<Instr>, LoadError> {
    parse_rank_at(path, bytes, manifest, rank).map(|(instrs, _)| instrs)
}

/// [`parse_rank`], with where in `bytes` the instructions' [`canonical`] bytes begin when
/// the file holds them as they are (a binary file as pipec writes it): the loader hashes
/// that tail instead of encoding the instructions again.
fn parse_rank_at(
    path: &Path,
    bytes: &[u8],
    manifest: &Manifest,
    rank: u32,
) -> Result<(Vec<Instr>, Option<usize>), LoadError> {
    let entry = manifest
        .ranks
        .get(rank as usize)
        .ok_or_else(|| LoadError::Mismatch {
            path: path.to_path_buf(),
            field: "world_size",
            found: manifest.world_size.to_string(),
            expected: format!("a rank {rank}"),
        })?;
    let actual = sha256_hex(bytes);
    if actual != entry.sha256 {
        return Err(LoadError::FileHash {
            path: path.to_path_buf(),
            expected: entry.sha256.clone(),
            actual,
        });
    }
    let d = decode_rank(path, bytes, manifest, rank, Some(entry.instructions), false)?;
    let found = d.schedule_hash.unwrap_or_default();
    if found != manifest.schedule_hash {
        return Err(LoadError::Mismatch {
            path: path.to_path_buf(),
            field: "schedule_hash",
            found,
            expected: format!(
                "{} (the rank file comes from a different compile)",
                manifest.schedule_hash
            ),
        });
    }
    Ok((d.instructions, d.canonical_at))
}

/// A rank file decoded and checked against the manifest in everything but its hashes.
pub(crate) struct Decoded {
    pub(crate) instructions: Vec<Instr>,
    /// Where [`canonical`] bytes begin, as [`super::canonical_parse::Parsed::canonical_at`].
    pub(crate) canonical_at: Option<usize>,
    /// The file's `schedule_hash`; `None` only when `lenient` and the file has none.
    pub(crate) schedule_hash: Option<String>,
}

/// Decode rank `rank`'s file in the manifest's encoding and check its `format`, `version`,
/// `rank` and `world_size`; the hashes are the caller's. `expected`: the instruction count
/// the manifest lists, a hint for the fast path. `lenient` (for `pipec seal`) lets a JSON file
/// omit `schedule_hash`, which sealing writes anyway.
pub(crate) fn decode_rank(
    path: &Path,
    bytes: &[u8],
    manifest: &Manifest,
    rank: u32,
    expected: Option<u64>,
    lenient: bool,
) -> Result<Decoded, LoadError> {
    let path = path.to_path_buf();
    let fast = match manifest.encoding {
        Encoding::Json => super::canonical_parse::parse(bytes, expected),
        Encoding::Postcard => super::canonical_parse::parse_bin(bytes),
    };
    let mut canonical_at = None;
    let (f, instructions) = match (fast, manifest.encoding) {
        // The form pipec writes: the fast path.
        (Some(p), _) => {
            canonical_at = p.canonical_at;
            (
                RankFileLoose {
                    format: RANK_FORMAT.to_string(),
                    version: p.version,
                    rank: p.rank,
                    world_size: p.world_size,
                    schedule_hash: Some(p.schedule_hash),
                    instructions: Vec::new(),
                },
                p.instructions,
            )
        }
        // Anything else serde or postcard judges, as they always did.
        (None, Encoding::Json) => {
            let mut f: RankFileLoose = if lenient {
                serde_json::from_slice(bytes).map_err(|e| json_err(&path, e))?
            } else {
                let f: RankFile = serde_json::from_slice(bytes).map_err(|e| json_err(&path, e))?;
                RankFileLoose {
                    format: f.format,
                    version: f.version,
                    rank: f.rank,
                    world_size: f.world_size,
                    schedule_hash: Some(f.schedule_hash),
                    instructions: f.instructions,
                }
            };
            let instrs: Vec<Instr> = std::mem::take(&mut f.instructions)
                .into_iter()
                .map(Instr::from)
                .collect();
            (f, instrs)
        }
        (None, Encoding::Postcard) => {
            let mut f: RankFileBin = postcard::from_bytes(bytes).map_err(|e| LoadError::Json {
                path: path.clone(),
                msg: format!("not a valid postcard rank file: {e}"),
            })?;
            let wire = std::mem::take(&mut f.instructions);
            let mut instrs = Vec::with_capacity(wire.len());
            for (i, w) in wire.into_iter().enumerate() {
                instrs.push(Instr::try_from(w).map_err(|msg| LoadError::Json {
                    path: path.clone(),
                    msg: format!("instruction #{i}: {msg}"),
                })?);
            }
            (
                RankFileLoose {
                    format: f.format,
                    version: f.version,
                    rank: f.rank,
                    world_size: f.world_size,
                    schedule_hash: Some(f.schedule_hash),
                    instructions: Vec::new(),
                },
                instrs,
            )
        }
    };
    if f.format != RANK_FORMAT {
        return Err(LoadError::Format {
            path,
            found: f.format,
            expected: RANK_FORMAT,
        });
    }
    if f.version != FORMAT_VERSION {
        return Err(LoadError::Version {
            path,
            found: f.version,
            supported: FORMAT_VERSION,
        });
    }
    let mismatch = |field, found: String, expected: String| LoadError::Mismatch {
        path: path.clone(),
        field,
        found,
        expected,
    };
    if f.rank != rank {
        return Err(mismatch("rank", f.rank.to_string(), rank.to_string()));
    }
    if f.world_size != manifest.world_size {
        return Err(mismatch(
            "world_size",
            f.world_size.to_string(),
            manifest.world_size.to_string(),
        ));
    }
    Ok(Decoded {
        instructions,
        canonical_at,
        schedule_hash: f.schedule_hash,
    })
}

/// Read a whole directory and check every file against the manifest and the schedule hash.
/// Rank files are read, hashed and parsed on every core; a refusal names the lowest rank at
/// fault, as a loader reading them in order would.
pub fn load_dir(dir: &Path) -> Result<Loaded, LoadError> {
    load_dir_then(dir, |_| ()).map(|(loaded, ())| loaded)
}

/// [`load_dir`], running `then` on the directory while its schedule hash is checked, and
/// returning both when every check passes. The schedule hash is SHA-256 over every rank's
/// canonical bytes in rank order (all of a large program's bytes): one thread's work, which
/// `pipec check` and `pipec-run` overlap with the verifier (their `then`) instead of waiting
/// for it. On a small directory, or one core, the hash is checked first and `then` runs only
/// if it matches. `then` sees a program whose schedule hash may still turn out wrong: it must
/// treat it as untrusted, as the verifier does; its result is dropped on a refusal.
pub fn load_dir_then<T: Send>(
    dir: &Path,
    then: impl FnOnce(&Loaded) -> T,
) -> Result<(Loaded, T), LoadError> {
    let (loaded, hashed, threads) = read_with(dir, None, read_file)?;
    if threads <= 1 {
        hashed.check(dir, &loaded)?;
        let t = then(&loaded);
        return Ok((loaded, t));
    }
    let (hash, t) = crate::par::join(threads, || hashed.check(dir, &loaded), || then(&loaded));
    hash?;
    Ok((loaded, t))
}

/// A directory loaded and judged: its manifest, and its program as the full verifier's
/// [`Verified`](crate::verify::Verified) value or the violations that refuse it.
pub struct LoadedVerdict {
    pub manifest: Manifest,
    pub verdict: Result<crate::verify::Verified, Box<crate::verify::Rejected>>,
}

/// [`load_dir_then`] with the full verifier beside the hash check: what a runtime loads
/// before it runs anything.
pub fn load_dir_verified(
    dir: &Path,
    opts: &crate::verify::VerifyOptions,
) -> Result<LoadedVerdict, LoadError> {
    let (loaded, checked) = load_dir_then(dir, |l| crate::verify::full_check(&l.program, opts))?;
    Ok(LoadedVerdict {
        manifest: loaded.manifest,
        verdict: crate::verify::Verified::seal(loaded.program, checked),
    })
}

/// Read `path` into `buf`, the reading thread's buffer of its previous rank: no fresh pages
/// to fault in per file.
pub(crate) fn read_file(path: &Path, buf: &mut Vec<u8>) -> Result<(), LoadError> {
    use std::io::Read;
    buf.clear();
    std::fs::File::open(path)
        .and_then(|mut f| f.read_to_end(buf))
        .map(drop)
        .map_err(|source| LoadError::Io {
            path: path.to_path_buf(),
            source,
        })
}

/// [`load_dir`] over files held in memory, as [`render`] returns them: (file name, bytes).
/// A file the manifest names but `files` lacks is reported as a missing file. Pure: this is
/// what the `files` fuzz target drives.
pub fn load_files(files: &[(String, Vec<u8>)]) -> Result<Loaded, LoadError> {
    load_with(Path::new(""), Some(1), |path, buf| {
        let name = path.to_string_lossy();
        files
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, b)| {
                buf.clear();
                buf.extend_from_slice(b)
            })
            .ok_or_else(|| LoadError::Io {
                path: path.to_path_buf(),
                source: std::io::Error::new(std::io::ErrorKind::NotFound, "no such file"),
            })
    })
}

/// The canonical bytes of every rank, in order, waiting to be hashed (see [`load_dir_then`]).
struct Canonicals(Vec<Vec<u8>>);

impl Canonicals {
    /// Whether the schedule hash of `loaded` (its header and these bytes) is the manifest's.
    fn check(self, dir: &Path, loaded: &Loaded) -> Result<(), LoadError> {
        let manifest = &loaded.manifest;
        let header = Header {
            source: &manifest.source,
            schedule: manifest.schedule,
            layout: &manifest.layout,
        };
        let mut hasher = ScheduleHasher::new(&header, &loaded.program);
        for (r, c) in self.0.iter().enumerate() {
            hasher.rank(r, c);
        }
        drop(self);
        let actual = hasher.finish();
        if actual != manifest.schedule_hash {
            return Err(LoadError::ScheduleHash {
                path: dir.join(MANIFEST_FILE),
                expected: manifest.schedule_hash.clone(),
                actual,
            });
        }
        Ok(())
    }
}

/// `threads`: how many to read rank files on; `None`: as many as their size warrants.
pub(crate) fn load_with(
    dir: &Path,
    threads: Option<usize>,
    read: impl Fn(&Path, &mut Vec<u8>) -> Result<(), LoadError> + Sync,
) -> Result<Loaded, LoadError> {
    let (loaded, hashed, _) = read_with(dir, threads, read)?;
    hashed.check(dir, &loaded)?;
    Ok(loaded)
}

/// Every check of [`load_with`] but the schedule hash, whose input comes back; with the
/// number of threads the files were read on.
fn read_with(
    dir: &Path,
    threads: Option<usize>,
    read: impl Fn(&Path, &mut Vec<u8>) -> Result<(), LoadError> + Sync,
) -> Result<(Loaded, Canonicals, usize), LoadError> {
    let manifest_path = dir.join(MANIFEST_FILE);
    let mut buf = Vec::new();
    read_manifest_of(dir, &read, &mut buf)?;
    let manifest = parse_manifest(&manifest_path, &buf)?;
    let threads = threads.unwrap_or_else(|| {
        let listed = manifest.ranks.iter().map(|e| e.instructions);
        super::write::threads_for(listed.fold(0, u64::saturating_add))
    });
    // Each rank: its instructions and their canonical bytes (what the schedule hash covers).
    let per_rank = crate::par::try_map(
        manifest.world_size as usize,
        threads,
        |r, buf: &mut Vec<u8>| {
            let path = dir.join(&manifest.ranks[r].file);
            read(&path, buf)?;
            let (instrs, at) = parse_rank_at(&path, buf, &manifest, r as u32)?;
            let canonical = match at {
                Some(at) => buf[at..].to_vec(),
                None => canonical(&instrs),
            };
            Ok((instrs, canonical))
        },
    )?;
    let mut ranks = Vec::with_capacity(per_rank.len());
    let mut canonicals = Vec::with_capacity(per_rank.len());
    for (instrs, canonical) in per_rank {
        ranks.push(instrs);
        canonicals.push(canonical);
    }
    let program = Program {
        placement: manifest.placement.clone(),
        microbatches: manifest.microbatches,
        forward_only: manifest.forward_only,
        comm: manifest.comm_policy,
        lengths: manifest.microbatch_lengths.clone(),
        ranks,
        p2p_groups: manifest.p2p_groups,
        buffer_slots: manifest.buffer_slots.clone(),
    };
    Ok((
        Loaded { manifest, program },
        Canonicals(canonicals),
        threads,
    ))
}
