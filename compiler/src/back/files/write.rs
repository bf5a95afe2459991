//! Writing a compiled program: the rank files (a hand-written JSON writer, the hot loop of
//! emission), the manifest, and the atomic directory write.

use super::format::*;
use crate::ir::{Instr, Payload, PayloadKind, Program};
use pipec_schedules::{Compute, Rank, Task};
use std::path::{Path, PathBuf};
use thiserror::Error;

/// One rank file, exactly as written: a fixed header, then one instruction per line. Written by
/// hand into one buffer (no serde, no `fmt`) because it is the hot loop of emission at
/// millions of instructions; the reader parses it with serde, and a test checks both agree.
pub(crate) fn rank_file_json(rank: u32, world: u32, hash: &str, instrs: &[Instr]) -> Vec<u8> {
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

pub(crate) fn push_u32(out: &mut Vec<u8>, v: u32) {
    out.extend_from_slice(itoa::Buffer::new().format(v).as_bytes());
}

/// `{"op":"<op>"` followed by `,"<key>":<value>` pairs and `}`.
pub(crate) fn push_obj(out: &mut Vec<u8>, op: &str, fields: &[(&str, u32)], payload: Option<&str>) {
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

pub(crate) fn write_instr(out: &mut Vec<u8>, ins: &Instr) {
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

pub(crate) fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> WriteError + '_ {
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
