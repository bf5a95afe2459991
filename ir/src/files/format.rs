//! The instruction-file format: versions, the manifest and rank-file types (JSON and
//! postcard), and the hashes that make a directory self-checking.

use super::bytes::push_varint;
use super::schema::{instructions, json_op, Field, True};
use crate::ir::{Instr, MemKind, MemOp, Payload, PayloadKind, Program, Tokens};
use pipec_schedules::layout::Layout;
use pipec_schedules::{
    CommPolicy, Compute, Microbatch, Placement, Rank, ScheduleSpec, StageId, Task,
};
use pipec_schedules::{Lengths, P2pGroups};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

pub const MANIFEST_FORMAT: &str = "pipec-schedule";
pub const RANK_FORMAT: &str = "pipec-rank";
/// The only version this build reads and writes.
pub const FORMAT_VERSION: u32 = 1;
pub const MANIFEST_FILE: &str = "manifest.json";
/// What [`Manifest::sealed_by`] says of a directory `pipec seal` re-hashed.
pub const SEALED_BY: &str = "pipec seal";

/// How rank files are encoded. JSON is the default; postcard is the compact binary form for
/// large schedules (much smaller; docs/testing.md and bench/HISTORY.md have the figures).
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
    /// `"pipec seal"` when the hashes were recomputed from files another tool wrote or edited
    /// ([`super::seal_dir`]): a reader then judges their content, not that pipec wrote them.
    /// Absent from what `pipec compile` writes, so its bytes are unchanged.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sealed_by: Option<String>,
    /// The cost model the schedule was planned with (`pipec tune`, or `pipec compile
    /// --cost`), as the full spec `pipec_cost::cost::CostModel::spec` writes;
    /// `show`, `simulate` and `check` use it unless given `--cost`/`--cost-file`. Absent
    /// without one, so those files are unchanged.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cost: Option<String>,
    /// The tokens of the sequences in each microbatch (issue #38), as given; every send and
    /// receive then carries its `tokens`. Absent when the microbatches are alike.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub microbatch_lengths: Option<Lengths>,
    /// The plan `pipec tune` chose, as its report names it (`tuned loop vpp=2`, `1f1b + offload
    /// 3`), when `schedule` cannot name it (a plan of the tuner's own, or a built-in kind whose
    /// levers added instructions the kind does not generate), so viewers title it by its kind
    /// and chunks per rank rather than "tuned schedule".
    /// Not hashed (the instructions are), like `cost`. Absent otherwise, so those files are
    /// unchanged.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub plan: Option<String>,
    /// Which communicator carries each send and receive (`--p2p-groups`: `pair`, `direction`,
    /// `edge`; [`pipec_schedules::P2pGroups`]). Hashed, since the verifier's stream rule reads
    /// it. Absent for the default, one communicator per pair of ranks, so those files are
    /// unchanged.
    #[serde(default, skip_serializing_if = "P2pGroups::is_pair")]
    pub p2p_groups: P2pGroups,
    /// The message-buffer pools of a static buffer plan (issue #39, `--buffer-plan`): per
    /// rank, each slot's size in the cost model's memory unit (bytes when its costs are).
    /// Every send and receive of a tensor then names its `slot`. Not hashed (the slots on the
    /// instructions are), like `cost`: the verifier checks the sizes against the messages.
    /// Absent without a plan, so those files are unchanged.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub buffer_slots: Option<crate::ir::Pools>,
}

/// The one sentence `pipec check`, `show`, `simulate` and `import` say of a compute-only
/// torch CSV (and `--json` carries as `caveat`): pipec placed its communication itself, while
/// the frameworks that run such a file (torchtitan's `pipeline_parallel_schedule_csv`, NeMo
/// AutoModel's `pp_schedule_csv`) place it with torch's `_add_send_recv`.
pub const COMPUTE_ONLY_CAVEAT: &str = "compute-only torch CSV: its sends and receives are pipec's own placement (lockstep), which is what pipec verifies, simulates and draws; torchtitan and NeMo AutoModel run the file with torch's `_add_send_recv` placement instead, which pipec does not check";

impl Manifest {
    /// [`COMPUTE_ONLY_CAVEAT`] when this is a compute-only torch CSV, read directly or written
    /// by `pipec import` (source `torch-csv`, communication placed by pipec's lockstep).
    pub fn caveat(&self) -> Option<&'static str> {
        (self.source == "torch-csv" && self.comm_policy == Some(CommPolicy::Lockstep))
            .then_some(COMPUTE_ONLY_CAVEAT)
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RankEntry {
    pub rank: u32,
    pub file: String,
    pub sha256: String,
    pub instructions: u64,
}

/// Every key of every row of the schema, each optional: serde's path (a file not in pipec's
/// own form) reads an instruction into this in one derived pass, then [`InstrJson`] picks the
/// row. The rows name their fields here (`a.stage`), so a row with a key missing below does
/// not compile.
macro_rules! any_row {
    ($($k:ident: $t:ty),* $(,)?) => {
        #[derive(Deserialize)]
        #[serde(deny_unknown_fields)]
        pub(crate) struct AnyRow {
            op: String,
            $( #[serde(default)] $k: Option<$t>, )*
        }

        impl AnyRow {
            /// A key present here that `fields` lacks.
            fn extra(&self, fields: &[&str]) -> Option<&'static str> {
                $( if self.$k.is_some() && !fields.contains(&stringify!($k)) {
                    return Some(stringify!($k));
                } )*
                None
            }
        }
    };
}
any_row! {
    stage: u32,
    mb: u32,
    fwd_stage: u32,
    fwd_mb: u32,
    bwd_stage: u32,
    bwd_mb: u32,
    peer: u32,
    payload: PayloadKind,
    batch: u32,
    checkpoint: True,
    tokens: Tokens,
    slot: u32,
}

macro_rules! gen_format {
    ($( $idx:literal $op:ident $(as $json:ident)? $(+ $flag:ident)? { $($f:ident : $t:ty),+ $(,)? } => [$($ir:tt)+]; )*) => {
        /// Each row's JSON fields.
        #[allow(non_camel_case_types)]
        pub(crate) mod json_rows {
            use super::*;
            $(
                #[derive(Clone, Debug, PartialEq, Eq)]
                pub(crate) struct $op {
                    $( pub(crate) $f: $t, )+
                    $( #[allow(dead_code)] pub(crate) $flag: True, )?
                }
            )*
        }

        /// One instruction as stored in JSON: flat and explicit, so files read well and diff
        /// line by line: `{"op":"<op>",<fields>}`, one variant per row of the schema.
        #[allow(non_camel_case_types)]
        #[derive(Clone, Debug, PartialEq, Eq)]
        pub(crate) enum InstrJson {
            $( $op(json_rows::$op), )*
        }

        impl Serialize for InstrJson {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                use serde::ser::SerializeStruct;
                match self {
                    $( InstrJson::$op(r) => {
                        let mut st = s.serialize_struct("instr", 1 + [$(stringify!($f)),+].len() $(+ stringify!($flag).len().min(1))?)?;
                        st.serialize_field("op", json_op!($op $(as $json)?))?;
                        $( st.serialize_field(stringify!($f), &r.$f)?; )+
                        $( st.serialize_field(stringify!($flag), &True)?; )?
                        st.end()
                    } )*
                }
            }
        }

        impl<'de> Deserialize<'de> for InstrJson {
            /// Read into [`AnyRow`], then take the row of the op (the variant row when its key
            /// is there) with serde's messages for its fields (`missing field`, `unknown
            /// field`).
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                use serde::de::Error;
                let a = AnyRow::deserialize(d)?;
                // The row of the op whose keys these are (`fwd` with `checkpoint` is its
                // variant row); a field it lacks is serde's `missing field`.
                $( if a.op == json_op!($op $(as $json)?) $(&& a.$flag.is_some())? {
                    const FIELDS: &[&str] = &[$(stringify!($f),)+ $(stringify!($flag))?];
                    if a.extra(FIELDS).is_none() {
                        $( let $f = a.$f.ok_or_else(|| D::Error::missing_field(stringify!($f)))?; )+
                        return Ok(InstrJson::$op(json_rows::$op { $($f,)+ $($flag: True,)? }));
                    }
                } )*
                // A key no row of the op has: named against the op's first row.
                $( if a.op == json_op!($op $(as $json)?) {
                    const FIELDS: &[&str] = &[$(stringify!($f),)+ $(stringify!($flag))?];
                    let k = a.extra(FIELDS).unwrap_or("op");
                    return Err(D::Error::unknown_field(k, FIELDS));
                } )*
                let mut names: Vec<&str> = super::schema::OPS.iter().map(|o| o.name).collect();
                names.dedup();
                let names: Vec<String> = names.iter().map(|n| format!("`{n}`")).collect();
                Err(D::Error::custom(format!(
                    "unknown variant `{}`, expected one of {}",
                    a.op,
                    names.join(", ")
                )))
            }
        }

        impl From<&Instr> for InstrJson {
            fn from(i: &Instr) -> Self {
                match *i {
                    $( $($ir)+ => InstrJson::$op(json_rows::$op { $($f,)+ $($flag: True,)? }), )*
                }
            }
        }

        impl From<InstrJson> for Instr {
            fn from(j: InstrJson) -> Self {
                match j {
                    $( InstrJson::$op(json_rows::$op { $($f,)+ .. }) => $($ir)+, )*
                }
            }
        }

        /// One instruction in the binary encoding (postcard, externally tagged: the variant
        /// index is a varint, then the fields in order). The variant order is part of format
        /// version 1 (`docs/format.md`); it also defines the canonical bytes the schedule hash
        /// covers.
        #[allow(non_camel_case_types)]
        #[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
        pub(crate) enum InstrBin {
            $( $op($(<$t as Field>::Bin),+), )*
        }

        impl From<&Instr> for InstrBin {
            fn from(i: &Instr) -> Self {
                match *i {
                    $( $($ir)+ => InstrBin::$op($(<$t as Field>::to_bin($f)),+), )*
                }
            }
        }

        impl TryFrom<InstrBin> for Instr {
            type Error = String;
            fn try_from(b: InstrBin) -> Result<Self, String> {
                Ok(match b {
                    $( InstrBin::$op($($f),+) => {
                        $( let $f = <$t as Field>::from_bin($f)?; )+
                        $($ir)+
                    } )*
                })
            }
        }

        /// One instruction's canonical bytes: its `InstrBin` variant index, then its fields.
        #[inline]
        fn push_canonical_instr(out: &mut Vec<u8>, ins: &Instr) {
            match *ins {
                $( $($ir)+ => {
                    push_varint(out, $idx);
                    $( <$t as Field>::push_canonical($f, out); )+
                } )*
            }
        }
    };
}
instructions!(gen_format);

/// `rank-<r>.bin`: the same fields as the JSON rank file, postcard-encoded.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct RankFileBin {
    pub(crate) format: String,
    pub(crate) version: u32,
    pub(crate) rank: u32,
    pub(crate) world_size: u32,
    pub(crate) schedule_hash: String,
    pub(crate) instructions: Vec<InstrBin>,
}

/// Canonical bytes of one rank's instructions: the postcard encoding of its `InstrBin` list.
pub(crate) fn canonical(instrs: &[Instr]) -> Vec<u8> {
    let mut out = Vec::with_capacity(5 + instrs.len() * 8);
    push_canonical(&mut out, instrs);
    out
}

/// Append [`canonical`]'s bytes to `out`, encoded by hand (postcard's varints, the variant
/// index first): the same bytes as `postcard::to_stdvec(&Vec<InstrBin>)`, a test checks,
/// without the intermediate `Vec<InstrBin>`.
pub(crate) fn push_canonical(out: &mut Vec<u8>, instrs: &[Instr]) {
    push_varint(out, instrs.len() as u64);
    for ins in instrs {
        push_canonical_instr(out, ins);
    }
}

/// The bytes of `rank-<r>.bin` before its instruction list: postcard's encoding of
/// [`RankFileBin`]'s other fields. The file is this prefix followed by [`canonical`].
pub(crate) fn bin_prefix(rank: u32, world: u32, hash: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(96);
    let s = |out: &mut Vec<u8>, x: &str| {
        push_varint(out, x.len() as u64);
        out.extend_from_slice(x.as_bytes());
    };
    s(&mut out, RANK_FORMAT);
    push_varint(&mut out, FORMAT_VERSION as u64);
    push_varint(&mut out, rank as u64);
    push_varint(&mut out, world as u64);
    s(&mut out, hash);
    out
}

/// `rank-<r>.json`, as read.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RankFile {
    pub(crate) format: String,
    pub(crate) version: u32,
    pub(crate) rank: u32,
    pub(crate) world_size: u32,
    pub(crate) schedule_hash: String,
    pub(crate) instructions: Vec<InstrJson>,
}

/// `rank-<r>.json` as `pipec seal` reads it: `schedule_hash` may be absent (sealing writes it).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RankFileLoose {
    pub(crate) format: String,
    pub(crate) version: u32,
    pub(crate) rank: u32,
    pub(crate) world_size: u32,
    #[serde(default)]
    pub(crate) schedule_hash: Option<String>,
    pub(crate) instructions: Vec<InstrJson>,
}

/// What the header of a schedule says beside the program (whose placement, shape and
/// communicator model the manifest records too), independent of how it was produced.
#[derive(Clone, Debug)]
pub struct Header<'a> {
    pub source: &'a str,
    pub schedule: Option<ScheduleSpec>,
    pub layout: &'a Layout,
}

pub(crate) fn sha256_hex(bytes: &[u8]) -> String {
    hex(&Sha256::digest(bytes))
}

#[derive(Serialize)]
pub(crate) struct HashedHeader<'a> {
    source: &'a str,
    schedule: &'a Option<ScheduleSpec>,
    comm_policy: &'a Option<CommPolicy>,
    layout: &'a Layout,
    placement: &'a Placement,
    microbatches: u32,
    forward_only: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    microbatch_lengths: &'a Option<Lengths>,
    #[serde(skip_serializing_if = "P2pGroups::is_pair")]
    p2p_groups: P2pGroups,
}

#[cfg(test)]
pub(crate) fn schedule_hash(header: &Header<'_>, program: &Program) -> String {
    let mut h = ScheduleHasher::new(header, program);
    let mut buf = Vec::new();
    for (r, instrs) in program.ranks.iter().enumerate() {
        buf.clear();
        push_canonical(&mut buf, instrs);
        h.rank(r, &buf);
    }
    h.finish()
}

/// The schedule hash, fed one rank's canonical bytes at a time in rank order (so callers
/// that already hold them, or encode them in parallel, hash each byte once).
pub(crate) struct ScheduleHasher(Sha256);

impl ScheduleHasher {
    pub(crate) fn new(header: &Header<'_>, program: &Program) -> Self {
        let h = HashedHeader {
            source: header.source,
            schedule: &header.schedule,
            comm_policy: &program.comm,
            layout: header.layout,
            placement: &program.placement,
            microbatches: program.microbatches,
            forward_only: program.forward_only,
            microbatch_lengths: &program.lengths,
            p2p_groups: program.p2p_groups,
        };
        let mut hasher = Sha256::new();
        hasher.update(b"pipec-schedule-v1\n");
        hasher.update(serde_json::to_vec(&h).expect("header serializes"));
        ScheduleHasher(hasher)
    }

    /// Rank `r`'s [`canonical`] bytes; ranks must come in order 0, 1, ...
    pub(crate) fn rank(&mut self, r: usize, canonical: &[u8]) {
        self.0.update(format!("\nrank {r}\n").as_bytes());
        self.0.update(canonical);
    }

    pub(crate) fn finish(self) -> String {
        hex(&self.0.finalize())
    }
}

pub(crate) fn hex(digest: &[u8]) -> String {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(digest.len() * 2);
    for &b in digest {
        s.push(HEX[(b >> 4) as usize] as char);
        s.push(HEX[(b & 15) as usize] as char);
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Values whose varints change length, and their neighbours.
    fn edgy() -> impl Strategy<Value = u32> {
        let edges: Vec<u32> = (0..=4)
            .flat_map(|k| {
                let b = 1u64 << (7 * k);
                [b - 1, b, b + 1]
            })
            .map(|v| v.min(u64::from(u32::MAX)) as u32)
            .chain([u32::MAX - 1, u32::MAX, 1 << 31])
            .collect();
        prop_oneof![prop::sample::select(edges), any::<u32>(), 0u32..300]
    }

    fn instr() -> impl Strategy<Value = Instr> {
        super::super::schema::arb_instr(edgy())
    }

    proptest! {
        /// The hand-written encoder gives postcard's bytes for every field value, across the
        /// chunk boundary (up to 600 instructions of at most 22 bytes).
        #[test]
        fn canonical_is_postcard(instrs in prop::collection::vec(instr(), 0..600)) {
            let wire: Vec<InstrBin> = instrs.iter().map(InstrBin::from).collect();
            prop_assert_eq!(canonical(&instrs), postcard::to_stdvec(&wire).unwrap());
        }
    }
}
