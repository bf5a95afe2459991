//! Instruction files: a compiled schedule as a directory of `manifest.json` and
//! `rank-<r>.json` (format documented in `docs/format.md`).
//!
//! Files are deterministic (same input, same bytes: no timestamps, fixed key order, one
//! instruction per line), versioned (a reader refuses a version it does not know), and
//! self-checking: the manifest holds each rank file's SHA-256 and a schedule hash over the
//! spec, layout, placement and every instruction, which each rank file repeats.

use crate::layout::Layout;
use crate::program::{Instr, Payload, PayloadKind, Program};
use pipec_schedules::{
    CommPolicy, Compute, Microbatch, Placement, Rank, ScheduleSpec, StageId, Task,
};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use thiserror::Error;

pub const MANIFEST_FORMAT: &str = "pipec-schedule";
pub const RANK_FORMAT: &str = "pipec-rank";
/// The only version this build reads and writes.
pub const FORMAT_VERSION: u32 = 1;
pub const MANIFEST_FILE: &str = "manifest.json";

/// How rank files are encoded. JSON is the default; postcard is the compact binary form for
/// large schedules (about 10x smaller, see the README's benchmark figures).
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Encoding {
    #[default]
    Json,
    Postcard,
}

impl Encoding {
    fn extension(self) -> &'static str {
        match self {
            Encoding::Json => "json",
            Encoding::Postcard => "bin",
        }
    }
}

pub fn rank_file_name(rank: u32, encoding: Encoding) -> String {
    format!("rank-{rank}.{}", encoding.extension())
}

/// `manifest.json`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    pub format: String,
    pub version: u32,
    pub compiler: String,
    /// Where the schedule came from: `generated`, or `torch-csv` for imports.
    pub source: String,
    /// The generating spec; absent for imported schedules.
    pub schedule: Option<ScheduleSpec>,
    pub comm_policy: Option<CommPolicy>,
    pub layout: Layout,
    pub placement: Placement,
    pub world_size: u32,
    pub num_stages: u32,
    pub microbatches: u32,
    pub forward_only: bool,
    /// Encoding of the rank files.
    pub encoding: Encoding,
    pub schedule_hash: String,
    pub ranks: Vec<RankEntry>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RankEntry {
    pub rank: u32,
    pub file: String,
    pub sha256: String,
    pub instructions: u64,
}

/// One instruction as stored. Flat and explicit so files read well and diff line by line.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", deny_unknown_fields)]
enum InstrJson {
    #[serde(rename = "fwd")]
    Fwd { stage: u32, mb: u32 },
    #[serde(rename = "bwd")]
    Bwd { stage: u32, mb: u32 },
    #[serde(rename = "bwd_D")]
    BwdD { stage: u32, mb: u32 },
    #[serde(rename = "bwd_W")]
    BwdW { stage: u32, mb: u32 },
    #[serde(rename = "fwd_bwd")]
    FwdBwd {
        fwd_stage: u32,
        fwd_mb: u32,
        bwd_stage: u32,
        bwd_mb: u32,
    },
    #[serde(rename = "send")]
    Send {
        peer: u32,
        payload: PayloadKind,
        stage: u32,
        mb: u32,
        batch: u32,
    },
    #[serde(rename = "recv")]
    Recv {
        peer: u32,
        payload: PayloadKind,
        stage: u32,
        mb: u32,
        batch: u32,
    },
    #[serde(rename = "wait")]
    Wait { batch: u32 },
}

impl From<&Instr> for InstrJson {
    fn from(i: &Instr) -> Self {
        let sm = |t: Task| (t.stage.0, t.mb.0);
        match *i {
            Instr::Compute(Compute::Fwd(t)) => InstrJson::Fwd {
                stage: sm(t).0,
                mb: sm(t).1,
            },
            Instr::Compute(Compute::Bwd(t)) => InstrJson::Bwd {
                stage: sm(t).0,
                mb: sm(t).1,
            },
            Instr::Compute(Compute::BwdD(t)) => InstrJson::BwdD {
                stage: sm(t).0,
                mb: sm(t).1,
            },
            Instr::Compute(Compute::BwdW(t)) => InstrJson::BwdW {
                stage: sm(t).0,
                mb: sm(t).1,
            },
            Instr::Compute(Compute::FwdBwd { fwd, bwd }) => InstrJson::FwdBwd {
                fwd_stage: fwd.stage.0,
                fwd_mb: fwd.mb.0,
                bwd_stage: bwd.stage.0,
                bwd_mb: bwd.mb.0,
            },
            Instr::Send {
                peer,
                payload,
                batch,
            } => InstrJson::Send {
                peer: peer.0,
                payload: payload.kind,
                stage: payload.stage.0,
                mb: payload.mb.0,
                batch,
            },
            Instr::Recv {
                peer,
                payload,
                batch,
            } => InstrJson::Recv {
                peer: peer.0,
                payload: payload.kind,
                stage: payload.stage.0,
                mb: payload.mb.0,
                batch,
            },
            Instr::Wait { batch } => InstrJson::Wait { batch },
        }
    }
}

impl From<InstrJson> for Instr {
    fn from(j: InstrJson) -> Self {
        let t = |s, m| Task {
            stage: StageId(s),
            mb: Microbatch(m),
        };
        let p = |kind, s, m| Payload {
            kind,
            stage: StageId(s),
            mb: Microbatch(m),
        };
        match j {
            InstrJson::Fwd { stage, mb } => Instr::Compute(Compute::Fwd(t(stage, mb))),
            InstrJson::Bwd { stage, mb } => Instr::Compute(Compute::Bwd(t(stage, mb))),
            InstrJson::BwdD { stage, mb } => Instr::Compute(Compute::BwdD(t(stage, mb))),
            InstrJson::BwdW { stage, mb } => Instr::Compute(Compute::BwdW(t(stage, mb))),
            InstrJson::FwdBwd {
                fwd_stage,
                fwd_mb,
                bwd_stage,
                bwd_mb,
            } => Instr::Compute(Compute::FwdBwd {
                fwd: t(fwd_stage, fwd_mb),
                bwd: t(bwd_stage, bwd_mb),
            }),
            InstrJson::Send {
                peer,
                payload,
                stage,
                mb,
                batch,
            } => Instr::Send {
                peer: Rank(peer),
                payload: p(payload, stage, mb),
                batch,
            },
            InstrJson::Recv {
                peer,
                payload,
                stage,
                mb,
                batch,
            } => Instr::Recv {
                peer: Rank(peer),
                payload: p(payload, stage, mb),
                batch,
            },
            InstrJson::Wait { batch } => Instr::Wait { batch },
        }
    }
}

/// One instruction in the binary encoding (postcard, externally tagged: the variant index is a
/// varint, then the fields in order as varints). The variant order is part of format version 1
/// (`docs/format.md`); it also defines the canonical bytes the schedule hash covers.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
enum InstrBin {
    Fwd(u32, u32),
    Bwd(u32, u32),
    BwdD(u32, u32),
    BwdW(u32, u32),
    FwdBwd(u32, u32, u32, u32),
    /// peer, payload (0 act, 1 grad), stage, mb, batch
    Send(u32, u8, u32, u32, u32),
    Recv(u32, u8, u32, u32, u32),
    /// batch (appended: the variants above keep their indices and bytes)
    Wait(u32),
}

impl From<&Instr> for InstrBin {
    fn from(i: &Instr) -> Self {
        let k = |p: &Payload| match p.kind {
            PayloadKind::Act => 0u8,
            PayloadKind::Grad => 1u8,
        };
        match *i {
            Instr::Compute(Compute::Fwd(t)) => InstrBin::Fwd(t.stage.0, t.mb.0),
            Instr::Compute(Compute::Bwd(t)) => InstrBin::Bwd(t.stage.0, t.mb.0),
            Instr::Compute(Compute::BwdD(t)) => InstrBin::BwdD(t.stage.0, t.mb.0),
            Instr::Compute(Compute::BwdW(t)) => InstrBin::BwdW(t.stage.0, t.mb.0),
            Instr::Compute(Compute::FwdBwd { fwd, bwd }) => {
                InstrBin::FwdBwd(fwd.stage.0, fwd.mb.0, bwd.stage.0, bwd.mb.0)
            }
            Instr::Send {
                peer,
                payload,
                batch,
            } => InstrBin::Send(peer.0, k(&payload), payload.stage.0, payload.mb.0, batch),
            Instr::Recv {
                peer,
                payload,
                batch,
            } => InstrBin::Recv(peer.0, k(&payload), payload.stage.0, payload.mb.0, batch),
            Instr::Wait { batch } => InstrBin::Wait(batch),
        }
    }
}

impl TryFrom<InstrBin> for Instr {
    type Error = String;
    fn try_from(b: InstrBin) -> Result<Self, String> {
        let t = Task::new;
        let p = |k: u8, s, m| -> Result<Payload, String> {
            match k {
                0 => Ok(Payload::act(s, m)),
                1 => Ok(Payload::grad(s, m)),
                other => Err(format!(
                    "payload kind {other} is neither 0 (act) nor 1 (grad)"
                )),
            }
        };
        Ok(match b {
            InstrBin::Fwd(s, m) => Instr::Compute(Compute::Fwd(t(s, m))),
            InstrBin::Bwd(s, m) => Instr::Compute(Compute::Bwd(t(s, m))),
            InstrBin::BwdD(s, m) => Instr::Compute(Compute::BwdD(t(s, m))),
            InstrBin::BwdW(s, m) => Instr::Compute(Compute::BwdW(t(s, m))),
            InstrBin::FwdBwd(a, b, c, d) => Instr::Compute(Compute::FwdBwd {
                fwd: t(a, b),
                bwd: t(c, d),
            }),
            InstrBin::Send(peer, k, s, m, batch) => Instr::Send {
                peer: Rank(peer),
                payload: p(k, s, m)?,
                batch,
            },
            InstrBin::Recv(peer, k, s, m, batch) => Instr::Recv {
                peer: Rank(peer),
                payload: p(k, s, m)?,
                batch,
            },
            InstrBin::Wait(batch) => Instr::Wait { batch },
        })
    }
}

/// `rank-<r>.bin`: the same fields as the JSON rank file, postcard-encoded.
#[derive(Debug, Serialize, Deserialize)]
struct RankFileBin {
    format: String,
    version: u32,
    rank: u32,
    world_size: u32,
    schedule_hash: String,
    instructions: Vec<InstrBin>,
}

/// Canonical bytes of one rank's instructions: the postcard encoding of its `InstrBin` list.
fn canonical(instrs: &[Instr]) -> Vec<u8> {
    let wire: Vec<InstrBin> = instrs.iter().map(InstrBin::from).collect();
    postcard::to_stdvec(&wire).expect("instructions encode")
}

/// `rank-<r>.json`, as read.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RankFile {
    format: String,
    version: u32,
    rank: u32,
    world_size: u32,
    schedule_hash: String,
    instructions: Vec<InstrJson>,
}

/// Everything a reader gets back.
#[derive(Clone, Debug)]
pub struct Loaded {
    pub manifest: Manifest,
    pub program: Program,
}

/// What the header of a schedule says, independent of how it was produced.
#[derive(Clone, Debug)]
pub struct Header<'a> {
    pub source: &'a str,
    pub schedule: Option<ScheduleSpec>,
    pub comm_policy: Option<CommPolicy>,
    pub layout: &'a Layout,
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
    #[error("{path}: content hash {actual} does not match the manifest's `sha256` {expected}; the file was changed or corrupted after compilation")]
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
        "{path}: the recomputed schedule hash {actual} does not match `schedule_hash` {expected}"
    )]
    ScheduleHash {
        path: PathBuf,
        expected: String,
        actual: String,
    },
}

fn sha256_hex(bytes: &[u8]) -> String {
    let d = Sha256::digest(bytes);
    let mut s = String::with_capacity(64);
    for b in d {
        let _ = write!(s, "{b:02x}");
    }
    s
}

/// One rank file, exactly as written: a fixed header, then one instruction per line. Written by
/// hand into one buffer (no serde, no `fmt`) because it is the hot loop of emission at
/// millions of instructions; the reader parses it with serde, and a test checks both agree.
fn rank_file_json(rank: u32, world: u32, hash: &str, instrs: &[Instr]) -> Vec<u8> {
    let mut out = Vec::with_capacity(200 + instrs.len() * 64);
    out.extend_from_slice(b"{\n  \"format\": \"");
    out.extend_from_slice(RANK_FORMAT.as_bytes());
    out.extend_from_slice(b"\",\n  \"version\": ");
    push_u32(&mut out, FORMAT_VERSION);
    out.extend_from_slice(b",\n  \"rank\": ");
    push_u32(&mut out, rank);
    out.extend_from_slice(b",\n  \"world_size\": ");
    push_u32(&mut out, world);
    out.extend_from_slice(b",\n  \"schedule_hash\": \"");
    out.extend_from_slice(hash.as_bytes());
    out.extend_from_slice(b"\",\n  \"instructions\": [\n");
    for (i, ins) in instrs.iter().enumerate() {
        out.extend_from_slice(b"    ");
        write_instr(&mut out, ins);
        if i + 1 < instrs.len() {
            out.push(b',');
        }
        out.push(b'\n');
    }
    out.extend_from_slice(b"  ]\n}\n");
    out
}

fn push_u32(out: &mut Vec<u8>, v: u32) {
    out.extend_from_slice(itoa::Buffer::new().format(v).as_bytes());
}

/// `{"op":"<op>"` followed by `,"<key>":<value>` pairs and `}`.
fn push_obj(out: &mut Vec<u8>, op: &str, fields: &[(&str, u32)], payload: Option<&str>) {
    out.extend_from_slice(b"{\"op\":\"");
    out.extend_from_slice(op.as_bytes());
    out.push(b'"');
    for (i, (k, v)) in fields.iter().enumerate() {
        // The payload kind sits after the peer, as the serde form orders the fields.
        if i == 1 {
            if let Some(p) = payload {
                out.extend_from_slice(b",\"payload\":\"");
                out.extend_from_slice(p.as_bytes());
                out.push(b'"');
            }
        }
        out.extend_from_slice(b",\"");
        out.extend_from_slice(k.as_bytes());
        out.extend_from_slice(b"\":");
        push_u32(out, *v);
    }
    out.push(b'}');
}

fn write_instr(out: &mut Vec<u8>, ins: &Instr) {
    let single = |out: &mut Vec<u8>, op: &str, t: Task| {
        push_obj(out, op, &[("stage", t.stage.0), ("mb", t.mb.0)], None)
    };
    let msg = |out: &mut Vec<u8>, op: &str, peer: Rank, p: &Payload, batch: u32| {
        let kind = match p.kind {
            PayloadKind::Act => "act",
            PayloadKind::Grad => "grad",
        };
        let fields = [
            ("peer", peer.0),
            ("stage", p.stage.0),
            ("mb", p.mb.0),
            ("batch", batch),
        ];
        push_obj(out, op, &fields, Some(kind))
    };
    match ins {
        Instr::Compute(Compute::Fwd(t)) => single(out, "fwd", *t),
        Instr::Compute(Compute::Bwd(t)) => single(out, "bwd", *t),
        Instr::Compute(Compute::BwdD(t)) => single(out, "bwd_D", *t),
        Instr::Compute(Compute::BwdW(t)) => single(out, "bwd_W", *t),
        Instr::Compute(Compute::FwdBwd { fwd, bwd }) => push_obj(
            out,
            "fwd_bwd",
            &[
                ("fwd_stage", fwd.stage.0),
                ("fwd_mb", fwd.mb.0),
                ("bwd_stage", bwd.stage.0),
                ("bwd_mb", bwd.mb.0),
            ],
            None,
        ),
        Instr::Send {
            peer,
            payload,
            batch,
        } => msg(out, "send", *peer, payload, *batch),
        Instr::Recv {
            peer,
            payload,
            batch,
        } => msg(out, "recv", *peer, payload, *batch),
        Instr::Wait { batch } => push_obj(out, "wait", &[("batch", *batch)], None),
    }
}

#[derive(Serialize)]
struct HashedHeader<'a> {
    source: &'a str,
    schedule: &'a Option<ScheduleSpec>,
    comm_policy: &'a Option<CommPolicy>,
    layout: &'a Layout,
    placement: &'a Placement,
    microbatches: u32,
    forward_only: bool,
}

fn schedule_hash(header: &Header<'_>, program: &Program) -> String {
    let h = HashedHeader {
        source: header.source,
        schedule: &header.schedule,
        comm_policy: &header.comm_policy,
        layout: header.layout,
        placement: &program.placement,
        microbatches: program.microbatches,
        forward_only: program.forward_only,
    };
    let mut hasher = Sha256::new();
    hasher.update(b"pipec-schedule-v1\n");
    hasher.update(serde_json::to_vec(&h).expect("header serializes"));
    for (r, instrs) in program.ranks.iter().enumerate() {
        hasher.update(format!("\nrank {r}\n").as_bytes());
        hasher.update(canonical(instrs));
    }
    hasher.finalize().iter().fold(String::new(), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

/// The files of a compiled schedule, in memory: (file name, bytes), manifest first.
pub fn render(
    header: &Header<'_>,
    program: &Program,
    encoding: Encoding,
) -> Vec<(String, Vec<u8>)> {
    let world = program.world();
    let hash = schedule_hash(header, program);
    let mut files = Vec::with_capacity(program.ranks.len() + 1);
    let mut entries = Vec::with_capacity(program.ranks.len());
    for (r, instrs) in program.ranks.iter().enumerate() {
        let r32 = r as u32;
        let bytes = match encoding {
            Encoding::Json => rank_file_json(r32, world, &hash, instrs),
            Encoding::Postcard => postcard::to_stdvec(&RankFileBin {
                format: RANK_FORMAT.to_string(),
                version: FORMAT_VERSION,
                rank: r32,
                world_size: world,
                schedule_hash: hash.clone(),
                instructions: instrs.iter().map(InstrBin::from).collect(),
            })
            .expect("rank file encodes"),
        };
        entries.push(RankEntry {
            rank: r32,
            file: rank_file_name(r32, encoding),
            sha256: sha256_hex(&bytes),
            instructions: instrs.len() as u64,
        });
        files.push((rank_file_name(r32, encoding), bytes));
    }
    let manifest = Manifest {
        format: MANIFEST_FORMAT.to_string(),
        version: FORMAT_VERSION,
        compiler: format!("pipec {}", env!("CARGO_PKG_VERSION")),
        source: header.source.to_string(),
        schedule: header.schedule,
        comm_policy: header.comm_policy,
        layout: header.layout.clone(),
        placement: program.placement.clone(),
        world_size: world,
        num_stages: program.num_stages(),
        microbatches: program.microbatches,
        forward_only: program.forward_only,
        encoding,
        schedule_hash: hash,
        ranks: entries,
    };
    let mut m = serde_json::to_string_pretty(&manifest).expect("manifest serializes");
    m.push('\n');
    files.insert(0, (MANIFEST_FILE.to_string(), m.into_bytes()));
    files
}

/// Why a directory could not be written.
#[derive(Debug, Error)]
pub enum WriteError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path} exists and holds files that are not a pipec schedule (e.g. `{example}`); refusing to replace it")]
    NotASchedule { path: PathBuf, example: String },
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> WriteError + '_ {
    move |source| WriteError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Write the files into `dir` atomically: everything goes to a fresh sibling directory that is
/// renamed into place, so a reader never sees a mix of old and new rank files. An existing
/// `dir` is replaced only when it is empty or itself a pipec schedule.
pub fn write_dir(dir: &Path, files: &[(String, Vec<u8>)]) -> Result<(), WriteError> {
    if dir.exists() {
        let entries = std::fs::read_dir(dir).map_err(io_err(dir))?;
        for e in entries {
            let e = e.map_err(io_err(dir))?;
            let name = e.file_name().to_string_lossy().into_owned();
            let ours = name == MANIFEST_FILE
                || (name.starts_with("rank-")
                    && (name.ends_with(".json") || name.ends_with(".bin")));
            if !ours {
                return Err(WriteError::NotASchedule {
                    path: dir.to_path_buf(),
                    example: name,
                });
            }
        }
    }
    let parent = match dir.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let base = dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "out".to_string());
    let tmp = parent.join(format!(".{base}.pipec-tmp-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).map_err(io_err(&tmp))?;
    let result = (|| {
        for (name, bytes) in files {
            let p = tmp.join(name);
            std::fs::write(&p, bytes).map_err(io_err(&p))?;
        }
        if dir.exists() {
            let old = parent.join(format!(".{base}.pipec-old-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&old);
            std::fs::rename(dir, &old).map_err(io_err(dir))?;
            std::fs::rename(&tmp, dir).map_err(io_err(dir))?;
            let _ = std::fs::remove_dir_all(&old);
        } else {
            std::fs::rename(&tmp, dir).map_err(io_err(dir))?;
        }
        Ok(())
    })();
    if result.is_err() {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    result
}

fn read(path: &Path) -> Result<Vec<u8>, LoadError> {
    std::fs::read(path).map_err(|source| LoadError::Io {
        path: path.to_path_buf(),
        source,
    })
}

fn json_err(path: &Path, e: serde_json::Error) -> LoadError {
    LoadError::Json {
        path: path.to_path_buf(),
        msg: e.to_string(),
    }
}

/// Read and check `manifest.json` alone.
pub fn load_manifest(dir: &Path) -> Result<Manifest, LoadError> {
    let path = dir.join(MANIFEST_FILE);
    let bytes = read(&path)?;
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
    Ok(m)
}

fn check_format_version(
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
    let path = path.to_path_buf();
    let entry = manifest
        .ranks
        .get(rank as usize)
        .ok_or_else(|| LoadError::Mismatch {
            path: path.clone(),
            field: "world_size",
            found: manifest.world_size.to_string(),
            expected: format!("a rank {rank}"),
        })?;
    let actual = sha256_hex(bytes);
    if actual != entry.sha256 {
        return Err(LoadError::FileHash {
            path,
            expected: entry.sha256.clone(),
            actual,
        });
    }
    let (f, instructions) = match manifest.encoding {
        Encoding::Json => {
            let f: RankFile = serde_json::from_slice(bytes).map_err(|e| json_err(&path, e))?;
            let instrs: Vec<Instr> = f.instructions.iter().cloned().map(Instr::from).collect();
            (
                RankFileBin {
                    format: f.format,
                    version: f.version,
                    rank: f.rank,
                    world_size: f.world_size,
                    schedule_hash: f.schedule_hash,
                    instructions: Vec::new(),
                },
                instrs,
            )
        }
        Encoding::Postcard => {
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
            (f, instrs)
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
    if f.schedule_hash != manifest.schedule_hash {
        return Err(mismatch(
            "schedule_hash",
            f.schedule_hash,
            format!(
                "{} (the rank file comes from a different compile)",
                manifest.schedule_hash
            ),
        ));
    }
    Ok(instructions)
}

/// Read a whole directory and check every file against the manifest and the schedule hash.
pub fn load_dir(dir: &Path) -> Result<Loaded, LoadError> {
    load_with(dir, read)
}

/// [`load_dir`] over files held in memory, as [`render`] returns them: (file name, bytes).
/// A file the manifest names but `files` lacks is reported as a missing file. Pure: this is
/// what the `files` fuzz target drives.
pub fn load_files(files: &[(String, Vec<u8>)]) -> Result<Loaded, LoadError> {
    load_with(Path::new(""), |path| {
        let name = path.to_string_lossy();
        files
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, b)| b.clone())
            .ok_or_else(|| LoadError::Io {
                path: path.to_path_buf(),
                source: std::io::Error::new(std::io::ErrorKind::NotFound, "no such file"),
            })
    })
}

fn load_with(
    dir: &Path,
    mut read: impl FnMut(&Path) -> Result<Vec<u8>, LoadError>,
) -> Result<Loaded, LoadError> {
    let manifest_path = dir.join(MANIFEST_FILE);
    let manifest = parse_manifest(&manifest_path, &read(&manifest_path)?)?;
    let mut ranks = Vec::with_capacity(manifest.world_size as usize);
    for r in 0..manifest.world_size {
        let path = dir.join(&manifest.ranks[r as usize].file);
        ranks.push(parse_rank(&path, &read(&path)?, &manifest, r)?);
    }
    let program = Program {
        placement: manifest.placement.clone(),
        microbatches: manifest.microbatches,
        forward_only: manifest.forward_only,
        ranks,
    };
    let header = Header {
        source: &manifest.source,
        schedule: manifest.schedule,
        comm_policy: manifest.comm_policy,
        layout: &manifest.layout,
    };
    let actual = schedule_hash(&header, &program);
    if actual != manifest.schedule_hash {
        return Err(LoadError::ScheduleHash {
            path: dir.join(MANIFEST_FILE),
            expected: manifest.schedule_hash.clone(),
            actual,
        });
    }
    Ok(Loaded { manifest, program })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compile::{compile, CompileRequest};
    use pipec_schedules::ScheduleKind;

    fn compiled() -> crate::compile::Compiled {
        compile(&CompileRequest {
            vpp: Some(2),
            ..CompileRequest::new(ScheduleKind::Interleaved1F1B, 4, 8)
        })
        .unwrap()
    }

    fn header(c: &crate::compile::Compiled) -> Header<'_> {
        Header {
            source: "generated",
            schedule: Some(c.spec),
            comm_policy: Some(c.schedule.comm),
            layout: &c.layout,
        }
    }

    /// The hand-written writer and serde's reader agree on every instruction shape.
    #[test]
    fn hand_written_lines_equal_serde_form() {
        let t = Task::new(3, 7);
        let u = Task::new(1, 2);
        let all = [
            Instr::Compute(Compute::Fwd(t)),
            Instr::Compute(Compute::Bwd(t)),
            Instr::Compute(Compute::BwdD(t)),
            Instr::Compute(Compute::BwdW(t)),
            Instr::Compute(Compute::FwdBwd { fwd: t, bwd: u }),
            Instr::Send {
                peer: Rank(2),
                payload: Payload::act(3, 7),
                batch: 9,
            },
            Instr::Recv {
                peer: Rank(0),
                payload: Payload::grad(4, 1),
                batch: 0,
            },
        ];
        for ins in all {
            let mut line = Vec::new();
            write_instr(&mut line, &ins);
            let line = String::from_utf8(line).unwrap();
            let via_serde = serde_json::to_string(&InstrJson::from(&ins)).unwrap();
            assert_eq!(line, via_serde);
            let back: InstrJson = serde_json::from_str(&line).unwrap();
            assert_eq!(Instr::from(back), ins);
        }
    }

    #[test]
    fn round_trip_and_determinism() {
        let c = compiled();
        for enc in [Encoding::Json, Encoding::Postcard] {
            let a = render(&header(&c), &c.program, enc);
            let b = render(&header(&c), &c.program, enc);
            assert_eq!(a, b);
            let dir = std::env::temp_dir()
                .join(format!("pipec-files-test-{}-{enc:?}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            write_dir(&dir, &a).unwrap();
            let loaded = load_dir(&dir).unwrap();
            assert_eq!(loaded.program, c.program);
            // Rewriting over a previous schedule is allowed, in either encoding.
            write_dir(&dir, &render(&header(&c), &c.program, Encoding::Json)).unwrap();
            std::fs::remove_dir_all(&dir).unwrap();
        }
    }

    /// The schedule hash does not depend on the file encoding.
    #[test]
    fn schedule_hash_is_encoding_independent() {
        let c = compiled();
        let json = render(&header(&c), &c.program, Encoding::Json);
        let bin = render(&header(&c), &c.program, Encoding::Postcard);
        let hash = |f: &[(String, Vec<u8>)]| {
            let m: Manifest = serde_json::from_slice(&f[0].1).unwrap();
            m.schedule_hash
        };
        assert_eq!(hash(&json), hash(&bin));
        let size = |f: &[(String, Vec<u8>)]| f[1..].iter().map(|x| x.1.len()).sum::<usize>();
        assert!(
            size(&json) > 5 * size(&bin),
            "json {} bin {}",
            size(&json),
            size(&bin)
        );
    }
}
