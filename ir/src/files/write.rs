//! Writing a compiled program: the rank files (a hand-written JSON writer, the hot loop of
//! emission), the manifest, and the atomic directory write.

use super::bytes::{digits, push_u32, Chunk, CHUNK, LINE_MAX};
use super::format::*;
use super::schema::{instructions, json_op, Field};
use crate::ir::{Instr, MemKind, MemOp, Payload, PayloadKind, Program};
use crate::verify::{Report, Unverified, Verified};
use pipec_schedules::{Compute, Microbatch, Rank, StageId, Task};
use std::borrow::Borrow;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;
use thiserror::Error;

/// One rank file, exactly as written: a fixed header, then one instruction per line. Written by
/// hand (no serde, no `fmt`) because it is the hot loop of emission at millions of
/// instructions; the loader's fast path (`canonical_parse.rs`) parses exactly this form, and tests
/// check both agree with serde.
pub(crate) fn rank_file_json(rank: u32, world: u32, hash: &str, instrs: &[Instr]) -> Vec<u8> {
    let mut out = Vec::with_capacity(json_size(rank, world, hash, instrs) as usize);
    let _ = stream_rank_json(&mut Chunk::new(), rank, world, hash, instrs, |b| {
        out.extend_from_slice(b);
        Ok(())
    });
    out
}

/// One rank's instructions as the JSON array its rank file holds (the same records, one per
/// line), without the header or the schedule hash that needs every rank: what a caller
/// asking for one rank pays for that rank alone.
pub fn instructions_json(instrs: &[Instr]) -> Vec<u8> {
    let mut out = Vec::with_capacity(64 * instrs.len() + 4);
    let mut chunk = Chunk::new();
    out.extend_from_slice(b"[\n");
    for (i, ins) in instrs.iter().enumerate() {
        chunk.n = 0;
        chunk.instr(ins);
        out.extend_from_slice(chunk.bytes());
        out.extend_from_slice(if i + 1 < instrs.len() { b",\n" } else { b"\n" });
    }
    out.push(b']');
    out
}

/// Emit rank `rank`'s JSON file through `chunk`, handing `flush` the bytes whenever about
/// [`CHUNK`] of them are ready, and the rest at the end.
pub(crate) fn stream_rank_json(
    chunk: &mut Chunk,
    rank: u32,
    world: u32,
    hash: &str,
    instrs: &[Instr],
    mut flush: impl FnMut(&[u8]) -> std::io::Result<()>,
) -> std::io::Result<()> {
    let mut head = Vec::with_capacity(200 + hash.len());
    head.extend_from_slice(b"{\n  \"format\": \"");
    head.extend_from_slice(RANK_FORMAT.as_bytes());
    head.extend_from_slice(b"\",\n  \"version\": ");
    push_u32(&mut head, FORMAT_VERSION);
    head.extend_from_slice(b",\n  \"rank\": ");
    push_u32(&mut head, rank);
    head.extend_from_slice(b",\n  \"world_size\": ");
    push_u32(&mut head, world);
    head.extend_from_slice(b",\n  \"schedule_hash\": \"");
    head.extend_from_slice(hash.as_bytes());
    head.extend_from_slice(b"\",\n  \"instructions\": [\n");
    chunk.n = 0;
    if head.len() > LINE_MAX {
        flush(&head)?;
    } else {
        chunk.s(&head);
    }
    for (i, ins) in instrs.iter().enumerate() {
        chunk.s(b"    ");
        chunk.instr(ins);
        chunk.s(if i + 1 < instrs.len() { b",\n" } else { b"\n" });
        if chunk.n >= CHUNK {
            flush(chunk.bytes())?;
            chunk.n = 0;
        }
    }
    chunk.s(b"  ]\n}\n");
    flush(chunk.bytes())
}

/// The exact size of [`rank_file_json`]'s output, without writing it.
pub(crate) fn json_size(rank: u32, world: u32, hash: &str, instrs: &[Instr]) -> u64 {
    let d = |v: u32| digits(v) as u64;
    // The header and footer around the numbers and the hash (see `stream_rank_json`).
    let fixed = 15 + RANK_FORMAT.len() as u64 + 16 + 12 + 18 + 22 + 23 + 6;
    let mut n = fixed + d(FORMAT_VERSION) + d(rank) + d(world) + hash.len() as u64;
    for ins in instrs {
        // Indent, `}`, newline: 6; the comma is added below.
        n += 6 + instr_json_len(ins);
    }
    n + instrs.len().saturating_sub(1) as u64
}

macro_rules! gen_json {
    ($( $idx:literal $op:ident $(as $json:ident)? $(+ $flag:ident)? { $f0:ident : $t0:ty $(, $f:ident : $t:ty)* $(,)? } => [$($ir:tt)+]; )*) => {
        impl Chunk {
            /// `{"op":"<op>","<key>":<value>...}`, keys in the schema's order: the op and the
            /// first key are one copy, then a copy per key and the values.
            #[inline(always)]
            fn instr(&mut self, ins: &Instr) {
                match *ins {
                    $( $($ir)+ => {
                        self.s(concat!("{\"op\":\"", json_op!($op $(as $json)?), "\",\"", stringify!($f0), "\":").as_bytes());
                        <$t0 as Field>::write_json($f0, self);
                        $(
                            self.s(concat!(",\"", stringify!($f), "\":").as_bytes());
                            <$t as Field>::write_json($f, self);
                        )*
                        $( self.s(concat!(",\"", stringify!($flag), "\":true").as_bytes()); )?
                    } )*
                }
                self.s(b"}");
            }
        }

        /// The length of [`Chunk::instr`]'s bytes but its closing `}`.
        #[inline]
        fn instr_json_len(ins: &Instr) -> u64 {
            match *ins {
                $( $($ir)+ => {
                    concat!("{\"op\":\"", json_op!($op $(as $json)?), "\",\"", stringify!($f0), "\":").len() as u64
                        + <$t0 as Field>::json_len($f0)
                        $( + concat!(",\"", stringify!($f), "\":").len() as u64
                           + <$t as Field>::json_len($f) )*
                        $( + concat!(",\"", stringify!($flag), "\":true").len() as u64 )?
                } )*
            }
        }
    };
}
instructions!(gen_json);

/// One instruction as its JSON object (no indent, no comma).
#[cfg(test)]
pub(crate) fn write_instr(out: &mut Vec<u8>, ins: &Instr) {
    let mut line = Chunk::new();
    line.instr(ins);
    out.extend_from_slice(line.bytes());
}

/// Rank `r`'s file in the binary encoding.
fn rank_file_bin(r: u32, world: u32, hash: &str, canonical: &[u8]) -> Vec<u8> {
    let mut bytes = bin_prefix(r, world, hash);
    bytes.extend_from_slice(canonical);
    bytes
}

/// The files of a compiled schedule, in memory: (file name, bytes), manifest first; the bytes
/// [`write_program`] writes. For callers that want them in memory (Python's
/// `Schedule.render`, the viewers reading a torch CSV); writing streams instead.
pub fn render<P: Borrow<Program>>(
    header: &Header<'_>,
    program: &Verified<P>,
    encoding: Encoding,
) -> Vec<(String, Vec<u8>)> {
    render_program(header, program.program(), encoding)
}

/// [`render`] for `--no-verify` (an imported torch CSV the user asked not to verify).
pub fn render_unverified<P: Borrow<Program>>(
    header: &Header<'_>,
    program: &Unverified<P>,
    encoding: Encoding,
) -> Vec<(String, Vec<u8>)> {
    render_program(header, program.program(), encoding)
}

fn render_program(
    header: &Header<'_>,
    program: &Program,
    encoding: Encoding,
) -> Vec<(String, Vec<u8>)> {
    let p = prepare(header, program, encoding);
    let mut files = Vec::with_capacity(program.ranks.len() + 1);
    let mut shas = Vec::with_capacity(program.ranks.len());
    for (r, instrs) in program.ranks.iter().enumerate() {
        let r32 = r as u32;
        let bytes = match encoding {
            Encoding::Json => rank_file_json(r32, p.world, &p.hash, instrs),
            Encoding::Postcard => rank_file_bin(r32, p.world, &p.hash, &p.canonical[r]),
        };
        shas.push(sha256_hex(&bytes));
        files.push((rank_file_name(r32, encoding), bytes));
    }
    files.insert(0, (MANIFEST_FILE.to_string(), p.manifest(shas)));
    files
}

/// A program ready to be written: its schedule hash (which every rank file repeats, so it
/// comes first) and, for the binary encoding, each rank's canonical bytes, which are also the
/// body of its file.
pub struct Prepared<'a> {
    header: &'a Header<'a>,
    program: &'a Program,
    encoding: Encoding,
    world: u32,
    hash: String,
    canonical: Vec<Vec<u8>>,
    /// For `pipec seal`: the `compiler` the files named (kept, since pipec did not write
    /// them), and the manifest records [`SEALED_BY`].
    sealed: Option<String>,
    /// The manifest's `cost` ([`Prepared::with_cost`]).
    cost: Option<String>,
    /// The manifest's `plan` ([`Prepared::with_plan`]).
    plan: Option<String>,
}

/// Compute what every file of `program` needs before any is written (the schedule hash).
pub fn prepare<'a>(
    header: &'a Header<'a>,
    program: &'a Program,
    encoding: Encoding,
) -> Prepared<'a> {
    let mut hasher = ScheduleHasher::new(header, program);
    let mut canonical = Vec::new();
    let mut buf = Vec::new();
    for (r, instrs) in program.ranks.iter().enumerate() {
        if encoding == Encoding::Postcard {
            // Sized up front: kept, so no doubling slack (or its copies) per rank.
            let bytes = super::format::canonical(instrs);
            hasher.rank(r, &bytes);
            canonical.push(bytes);
        } else {
            buf.clear();
            push_canonical(&mut buf, instrs);
            hasher.rank(r, &buf);
        }
    }
    Prepared {
        header,
        program,
        encoding,
        world: program.world(),
        hash: hasher.finish(),
        canonical,
        sealed: None,
        cost: None,
        plan: None,
    }
}

impl Prepared<'_> {
    /// The schedule hash every file will carry.
    pub(crate) fn hash(&self) -> &str {
        &self.hash
    }

    /// Mark the manifest as sealed by `pipec seal`, keeping `compiler` (who wrote the files).
    pub(crate) fn sealed(mut self, compiler: String) -> Self {
        self.sealed = Some(compiler);
        self
    }

    /// Record the cost model the schedule was planned with (the spec text of
    /// `pipec_cost::cost::CostModel::spec`) in the manifest's `cost`.
    pub fn with_cost(mut self, cost: Option<String>) -> Self {
        self.cost = cost;
        self
    }

    /// Record the name of the plan `pipec tune` chose in the manifest's `plan` (see
    /// [`super::format::Manifest::plan`]).
    pub fn with_plan(mut self, plan: Option<String>) -> Self {
        self.plan = plan;
        self
    }

    /// The manifest, given each rank file's SHA-256.
    fn manifest(&self, shas: Vec<String>) -> Vec<u8> {
        let entries = shas
            .into_iter()
            .enumerate()
            .map(|(r, sha256)| RankEntry {
                rank: r as u32,
                file: rank_file_name(r as u32, self.encoding),
                sha256,
                instructions: self.program.ranks[r].len() as u64,
            })
            .collect();
        let manifest = Manifest {
            format: MANIFEST_FORMAT.to_string(),
            version: FORMAT_VERSION,
            compiler: match &self.sealed {
                Some(c) => c.clone(),
                None => format!("pipec {}", env!("CARGO_PKG_VERSION")),
            },
            source: self.header.source.to_string(),
            schedule: self.header.schedule,
            comm_policy: self.program.comm,
            layout: self.header.layout.clone(),
            placement: self.program.placement.clone(),
            world_size: self.world,
            num_stages: self.program.num_stages(),
            microbatches: self.program.microbatches,
            forward_only: self.program.forward_only,
            encoding: self.encoding,
            schedule_hash: self.hash.clone(),
            ranks: entries,
            sealed_by: self.sealed.as_ref().map(|_| SEALED_BY.to_string()),
            cost: self.cost.clone(),
            microbatch_lengths: self.program.lengths.clone(),
            plan: self.plan.clone(),
            p2p_groups: self.program.p2p_groups,
            buffer_slots: self.program.buffer_slots.clone(),
        };
        let mut m = serde_json::to_string_pretty(&manifest).expect("manifest serializes");
        m.push('\n');
        m.into_bytes()
    }

    /// The total size of the files [`write_prepared`] writes, in bytes (exact).
    pub fn bytes(&self) -> u64 {
        // A SHA-256 in hex is 64 characters whatever it is.
        let manifest = self
            .manifest(vec!["0".repeat(64); self.world as usize])
            .len() as u64;
        let ranks: u64 = match self.encoding {
            Encoding::Json => self
                .program
                .ranks
                .iter()
                .enumerate()
                .map(|(r, instrs)| json_size(r as u32, self.world, &self.hash, instrs))
                .sum(),
            Encoding::Postcard => (0..self.world)
                .map(|r| {
                    (bin_prefix(r, self.world, &self.hash).len() + self.canonical[r as usize].len())
                        as u64
                })
                .sum(),
        };
        manifest + ranks
    }

    /// Write rank `r`'s file to `path`, streaming; returns its SHA-256.
    fn write_rank(
        &self,
        r: usize,
        path: &Path,
        chunk: &mut Option<Chunk>,
    ) -> std::io::Result<String> {
        use sha2::{Digest, Sha256};
        use std::io::Write;
        let mut file = std::fs::File::create(path)?;
        let mut sha = Sha256::new();
        let r32 = r as u32;
        match self.encoding {
            Encoding::Json => {
                stream_rank_json(
                    chunk.get_or_insert_with(Chunk::new),
                    r32,
                    self.world,
                    &self.hash,
                    &self.program.ranks[r],
                    |b| {
                        sha.update(b);
                        file.write_all(b)
                    },
                )?;
            }
            Encoding::Postcard => {
                // The file is the prefix then the canonical bytes, hashed and written in place
                // rather than joined first: a copy of each rank's body into fresh pages would
                // touch as many bytes again for nothing.
                let prefix = bin_prefix(r32, self.world, &self.hash);
                for part in [&prefix[..], &self.canonical[r]] {
                    sha.update(part);
                    file.write_all(part)?;
                }
            }
        }
        Ok(hex(&sha.finalize()))
    }
}

/// What lets a directory [`write_prepared`] staged take its place: the verifier's verdict on
/// the very program prepared, or the caller's explicit `--no-verify`.
#[derive(Debug)]
pub enum Warrant<'p> {
    Verified(Verified<&'p Program>),
    Unverified(Unverified<&'p Program>),
}

impl<'p> Warrant<'p> {
    pub fn program(&self) -> &'p Program {
        match self {
            Warrant::Verified(v) => v.borrowed(),
            Warrant::Unverified(u) => u.borrowed(),
        }
    }

    /// The verifier's report, when it verified.
    pub fn report(&self) -> Option<&Report> {
        match self {
            Warrant::Verified(v) => Some(v.report()),
            Warrant::Unverified(_) => None,
        }
    }
}

/// Why [`write_prepared`] did not write: its `gate` refused, or the write failed.
#[derive(Debug)]
pub enum Gated<E> {
    Gate(E),
    Write(WriteError),
}

/// Write `prepared` into `dir` atomically on `threads` threads, each rank file streamed from
/// the program (no whole-output buffer), while `gate` runs on a thread of its own (a verifier,
/// say). Atomically: everything goes to a fresh sibling directory that is renamed into place,
/// so a reader never sees a mix of old and new rank files; an existing `dir` is replaced only
/// when it is empty or itself a pipec schedule. The directory is put in place only when
/// `gate` returns a [`Warrant`] for the program prepared (the verifier's [`Verified`], or an
/// explicit [`Unverified`]); otherwise what was written is removed and `gate`'s error
/// returned, whatever happened to the write. With `threads <= 1`, `gate` runs first and then
/// the files are written on the calling thread.
///
/// Panics if the warrant is for another program than the one prepared (a caller's bug).
pub fn write_prepared<'p, E: Send>(
    dir: &Path,
    prepared: &Prepared<'p>,
    threads: usize,
    gate: impl FnOnce() -> Result<Warrant<'p>, E> + Send,
) -> Result<Warrant<'p>, Gated<E>> {
    let program = prepared.program;
    let gate = move || {
        let w = gate()?;
        assert!(
            std::ptr::eq(w.program(), program),
            "a warrant for another program than the one prepared"
        );
        Ok(w)
    };
    let world = prepared.world as usize;
    let next = AtomicUsize::new(0);
    let stop = AtomicBool::new(false);
    let shas: Mutex<Vec<Option<String>>> = Mutex::new(vec![None; world]);
    let failed: Mutex<Option<(usize, WriteError)>> = Mutex::new(None);
    let staged = refuse_foreign(dir).and_then(|()| Staging::create(dir));
    let work = || {
        let Ok(staging) = &staged else { return };
        let mut chunk = None;
        while !stop.load(Ordering::Relaxed) {
            let r = next.fetch_add(1, Ordering::Relaxed);
            if r >= world {
                break;
            }
            let name = rank_file_name(r as u32, prepared.encoding);
            match prepared.write_rank(r, &staging.tmp.join(&name), &mut chunk) {
                Ok(sha) => lock(&shas)[r] = Some(sha),
                Err(source) => {
                    stop.store(true, Ordering::Relaxed);
                    let mut f = lock(&failed);
                    if f.as_ref().is_none_or(|(at, _)| r < *at) {
                        // Named as the user will find it, not by the staging directory.
                        let path = staging.dir.join(name);
                        *f = Some((r, WriteError::Io { path, source }));
                    }
                }
            }
        }
    };
    let verdict = if threads <= 1 {
        let v = gate();
        if v.is_ok() {
            work();
        }
        v
    } else {
        std::thread::scope(|s| {
            let gated = s.spawn(|| {
                let v = gate();
                if v.is_ok() {
                    work();
                } else {
                    stop.store(true, Ordering::Relaxed);
                }
                v
            });
            for _ in 2..threads {
                s.spawn(work);
            }
            work();
            gated
                .join()
                .unwrap_or_else(|p| std::panic::resume_unwind(p))
        })
    };
    let staging = match (verdict, staged) {
        (Err(e), Ok(staging)) => {
            staging.abandon_all();
            return Err(Gated::Gate(e));
        }
        (Err(e), Err(_)) => return Err(Gated::Gate(e)),
        (Ok(_), Err(e)) => return Err(Gated::Write(e)),
        (Ok(v), Ok(staging)) => (v, staging),
    };
    let (v, staging) = staging;
    if let Some((_, e)) = failed.into_inner().unwrap_or_else(|p| p.into_inner()) {
        staging.abandon();
        return Err(Gated::Write(e));
    }
    let shas = shas
        .into_inner()
        .unwrap_or_else(|p| p.into_inner())
        .into_iter()
        .map(|s| s.expect("every rank written"))
        .collect();
    let result = staging.put(MANIFEST_FILE, &prepared.manifest(shas));
    match result.and_then(|()| staging.commit()) {
        Ok(()) => Ok(v),
        Err(e) => Err(Gated::Write(e)),
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

pub use crate::par::threads_for;

/// Write a verified program: [`write_prepared`] with nothing to wait for, on every core when
/// the program is big.
pub fn write_program<P: Borrow<Program>>(
    dir: &Path,
    header: &Header<'_>,
    program: &Verified<P>,
    encoding: Encoding,
) -> Result<(), WriteError> {
    write_now(dir, header, program.program(), encoding)
}

/// [`write_prepared`] of a program verified before (Python's `Schedule.save`, whose schedule
/// was verified when it was made): nothing to wait for.
pub fn write_verified<'p, P: Borrow<Program>>(
    dir: &Path,
    prepared: &Prepared<'p>,
    threads: usize,
    program: &'p Verified<P>,
) -> Result<(), WriteError> {
    // The verdict is `program`'s; write_prepared checks it is the program prepared.
    let program: &'p Program = program.program();
    let warrant =
        || Ok::<_, std::convert::Infallible>(Warrant::Unverified(Unverified::unchecked(program)));
    write_prepared(dir, prepared, threads, warrant)
        .map(drop)
        .map_err(|e| match e {
            Gated::Write(e) => e,
            Gated::Gate(never) => match never {},
        })
}

/// [`write_program`] for `--no-verify` and for files meant to be refused (tests of the loader).
pub fn write_unverified<P: Borrow<Program>>(
    dir: &Path,
    header: &Header<'_>,
    program: &Unverified<P>,
    encoding: Encoding,
) -> Result<(), WriteError> {
    write_now(dir, header, program.program(), encoding)
}

fn write_now(
    dir: &Path,
    header: &Header<'_>,
    program: &Program,
    encoding: Encoding,
) -> Result<(), WriteError> {
    let threads = threads_for(program.len() as u64);
    let p = prepare(header, program, encoding);
    let warrant =
        || Ok::<_, std::convert::Infallible>(Warrant::Unverified(Unverified::unchecked(program)));
    write_prepared(dir, &p, threads, warrant)
        .map(drop)
        .map_err(|e| match e {
            Gated::Write(e) => e,
            Gated::Gate(never) => match never {},
        })
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
    /// The output path is an existing file: a schedule is a directory.
    #[error("{path} is a file; a schedule is written as a directory (manifest.json and rank files): name a directory")]
    IsAFile { path: PathBuf },
}

pub(crate) fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> WriteError + '_ {
    move |source| WriteError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// An existing `dir` that holds anything but a pipec schedule is not ours to replace.
fn refuse_foreign(dir: &Path) -> Result<(), WriteError> {
    if dir.is_file() {
        return Err(WriteError::IsAFile {
            path: dir.to_path_buf(),
        });
    }
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
    Ok(())
}

/// The fresh sibling directory files are written into before it replaces `dir`.
struct Staging {
    dir: PathBuf,
    parent: PathBuf,
    base: String,
    tmp: PathBuf,
    /// The parent directories that did not exist before (innermost first).
    created: Vec<PathBuf>,
}

impl Staging {
    fn create(dir: &Path) -> Result<Self, WriteError> {
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
        let created = parent
            .ancestors()
            .take_while(|a| !a.as_os_str().is_empty() && !a.exists())
            .map(Path::to_path_buf)
            .collect();
        // Errors name the path the user gave: the staging directory is ours, not theirs.
        std::fs::create_dir_all(&tmp).map_err(io_err(dir))?;
        Ok(Staging {
            dir: dir.to_path_buf(),
            parent,
            base,
            tmp,
            created,
        })
    }

    fn put(&self, name: &str, bytes: &[u8]) -> Result<(), WriteError> {
        std::fs::write(self.tmp.join(name), bytes).map_err(io_err(&self.dir.join(name)))
    }

    /// Put the staged directory in place of `dir` (the old one, if any, is removed).
    fn commit(self) -> Result<(), WriteError> {
        let dir = &self.dir;
        let result = (|| {
            if dir.exists() {
                let old =
                    self.parent
                        .join(format!(".{}.pipec-old-{}", self.base, std::process::id()));
                let _ = std::fs::remove_dir_all(&old);
                std::fs::rename(dir, &old).map_err(io_err(dir))?;
                std::fs::rename(&self.tmp, dir).map_err(io_err(dir))?;
                let _ = std::fs::remove_dir_all(&old);
            } else {
                std::fs::rename(&self.tmp, dir).map_err(io_err(dir))?;
            }
            Ok(())
        })();
        if result.is_err() {
            self.abandon();
        }
        result
    }

    fn abandon(&self) {
        let _ = std::fs::remove_dir_all(&self.tmp);
    }

    /// [`Staging::abandon`], and the parent directories made for it too: as if nothing had
    /// been attempted (a refused schedule leaves no trace).
    fn abandon_all(&self) {
        self.abandon();
        for d in &self.created {
            if std::fs::remove_dir(d).is_err() {
                break;
            }
        }
    }
}
