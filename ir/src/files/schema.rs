//! The rank file's instruction schema: one table, from which every encoding is generated.
//!
//! Each row of [`instructions!`] names an op, its postcard variant index, its fields in file
//! order, and the [`Instr`] it stands for, written once and used both as a pattern (to
//! encode) and as an expression (to decode). The encodings are macros over the table, each
//! next to its helpers: the serde types and the canonical (hashed) bytes in `format.rs`, the
//! fast JSON writer and its size in `write.rs`, the fast JSON and binary parsers in `canonical_parse.rs`.
//! A field's type says how it is written in each encoding ([`Field`]). So adding an
//! instruction is one row here (and its `Instr` variant, the docs, and the code that gives
//! it meaning); the compiler refuses a variant of [`Instr`] that no row covers.

use super::bytes::{digits, push_varint, Bin, Chunk, Cursor};
use crate::ir::{Instr, MemKind, MemOp, Payload, PayloadKind, Tokens};
use pipec_schedules::{Compute, Microbatch, Rank, StageId, Task};
use serde::de::DeserializeOwned;
use serde::Serialize;

/// The table. `$m!` receives the rows: `index op { field: Type, ... } => [Instr form]`.
/// The index is the postcard variant index, part of format version 1 (`docs/format.md`):
/// rows are only ever appended. Op and field names are the JSON keys and values, and the
/// field order is the file's. Every op has at least one field (the JSON writer writes the op
/// and the first key as one copy); a field type is any [`Field`].
///
/// A row `index name as op + key { ... }` is a variant of an earlier row `op`: the same JSON
/// op with one more key, `"key":true`, last (a forward with `"checkpoint":true`), and no byte
/// of its own in the binary form, where its index tells it apart. So a file without the key
/// keeps the bytes it had, and readers pick the row by the key's presence. A row
/// `index name as op { ... }` is likewise a variant of `op` with one more valued field, last
/// (a send or receive with its `tokens`, issue #38), or two (`tokens` and `slot`, issue #39):
/// readers take the row whose keys are there.
macro_rules! instructions {
    ($m:ident) => {
        $m! {
            0 fwd { stage: u32, mb: u32 }
                => [Instr::Compute(Compute::Fwd(Task { stage: StageId(stage), mb: Microbatch(mb) }))];
            1 bwd { stage: u32, mb: u32 }
                => [Instr::Compute(Compute::Bwd(Task { stage: StageId(stage), mb: Microbatch(mb) }))];
            2 bwd_D { stage: u32, mb: u32 }
                => [Instr::Compute(Compute::BwdD(Task { stage: StageId(stage), mb: Microbatch(mb) }))];
            3 bwd_W { stage: u32, mb: u32 }
                => [Instr::Compute(Compute::BwdW(Task { stage: StageId(stage), mb: Microbatch(mb) }))];
            4 fwd_bwd { fwd_stage: u32, fwd_mb: u32, bwd_stage: u32, bwd_mb: u32 }
                => [Instr::Compute(Compute::FwdBwd {
                    fwd: Task { stage: StageId(fwd_stage), mb: Microbatch(fwd_mb) },
                    bwd: Task { stage: StageId(bwd_stage), mb: Microbatch(bwd_mb) },
                })];
            5 send { peer: u32, payload: PayloadKind, stage: u32, mb: u32, batch: u32 }
                => [Instr::Send {
                    peer: Rank(peer),
                    payload: Payload { kind: payload, stage: StageId(stage), mb: Microbatch(mb) },
                    batch,
                    tokens: None,
                    slot: None,
                }];
            6 recv { peer: u32, payload: PayloadKind, stage: u32, mb: u32, batch: u32 }
                => [Instr::Recv {
                    peer: Rank(peer),
                    payload: Payload { kind: payload, stage: StageId(stage), mb: Microbatch(mb) },
                    batch,
                    tokens: None,
                    slot: None,
                }];
            7 wait { batch: u32 } => [Instr::Wait { batch }];
            8 fwd_checkpoint as fwd + checkpoint { stage: u32, mb: u32 }
                => [Instr::FwdCheckpoint(Task { stage: StageId(stage), mb: Microbatch(mb) })];
            9 offload { stage: u32, mb: u32 }
                => [Instr::Memory(MemOp {
                    kind: MemKind::Offload,
                    task: Task { stage: StageId(stage), mb: Microbatch(mb) },
                })];
            10 reload { stage: u32, mb: u32 }
                => [Instr::Memory(MemOp {
                    kind: MemKind::Reload,
                    task: Task { stage: StageId(stage), mb: Microbatch(mb) },
                })];
            11 wait_offload { stage: u32, mb: u32 }
                => [Instr::Memory(MemOp {
                    kind: MemKind::WaitOffload,
                    task: Task { stage: StageId(stage), mb: Microbatch(mb) },
                })];
            12 recompute { stage: u32, mb: u32 }
                => [Instr::Memory(MemOp {
                    kind: MemKind::Recompute,
                    task: Task { stage: StageId(stage), mb: Microbatch(mb) },
                })];
            13 sized_send as send { peer: u32, payload: PayloadKind, stage: u32, mb: u32, batch: u32, tokens: crate::ir::Tokens }
                => [Instr::Send {
                    peer: Rank(peer),
                    payload: Payload { kind: payload, stage: StageId(stage), mb: Microbatch(mb) },
                    batch,
                    tokens: Some(tokens),
                    slot: None,
                }];
            14 sized_recv as recv { peer: u32, payload: PayloadKind, stage: u32, mb: u32, batch: u32, tokens: crate::ir::Tokens }
                => [Instr::Recv {
                    peer: Rank(peer),
                    payload: Payload { kind: payload, stage: StageId(stage), mb: Microbatch(mb) },
                    batch,
                    tokens: Some(tokens),
                    slot: None,
                }];
            15 slotted_send as send { peer: u32, payload: PayloadKind, stage: u32, mb: u32, batch: u32, slot: u32 }
                => [Instr::Send {
                    peer: Rank(peer),
                    payload: Payload { kind: payload, stage: StageId(stage), mb: Microbatch(mb) },
                    batch,
                    tokens: None,
                    slot: Some(slot),
                }];
            16 slotted_recv as recv { peer: u32, payload: PayloadKind, stage: u32, mb: u32, batch: u32, slot: u32 }
                => [Instr::Recv {
                    peer: Rank(peer),
                    payload: Payload { kind: payload, stage: StageId(stage), mb: Microbatch(mb) },
                    batch,
                    tokens: None,
                    slot: Some(slot),
                }];
            17 sized_slotted_send as send { peer: u32, payload: PayloadKind, stage: u32, mb: u32, batch: u32, tokens: crate::ir::Tokens, slot: u32 }
                => [Instr::Send {
                    peer: Rank(peer),
                    payload: Payload { kind: payload, stage: StageId(stage), mb: Microbatch(mb) },
                    batch,
                    tokens: Some(tokens),
                    slot: Some(slot),
                }];
            18 sized_slotted_recv as recv { peer: u32, payload: PayloadKind, stage: u32, mb: u32, batch: u32, tokens: crate::ir::Tokens, slot: u32 }
                => [Instr::Recv {
                    peer: Rank(peer),
                    payload: Payload { kind: payload, stage: StageId(stage), mb: Microbatch(mb) },
                    batch,
                    tokens: Some(tokens),
                    slot: Some(slot),
                }];
        }
    };
}
pub(crate) use instructions;

/// A row's JSON op: its name, or the op it is a variant of (`name as op + key`).
macro_rules! json_op {
    ($op:ident) => {
        stringify!($op)
    };
    ($op:ident as $json:ident) => {
        stringify!($json)
    };
}
pub(crate) use json_op;

/// The value of a variant row's extra key (`"checkpoint":true`): only `true`, the key absent
/// otherwise, and nothing in the binary form.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct True;

impl Serialize for True {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_bool(true)
    }
}

impl<'de> serde::Deserialize<'de> for True {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        if <bool as serde::Deserialize>::deserialize(d)? {
            Ok(True)
        } else {
            Err(serde::de::Error::custom(
                "this key is `true` or absent (`false` is written by leaving it out)",
            ))
        }
    }
}

/// How a field's type is written in each encoding. Everything is inlined into the generated
/// per-op code, so the fast paths stay what they were when written by hand.
pub(crate) trait Field: Copy + Sized {
    /// How the field is held in postcard's serde type (`InstrBin`): its bytes there are
    /// [`Field::push_canonical`]'s.
    type Bin: Serialize + DeserializeOwned + std::fmt::Debug + Clone + PartialEq + Eq;
    /// The values a field takes, as the schema reports them (Python, docs).
    const KIND: &'static str;
    /// The value, as [`fields_of`] gives it (Python's typed instructions).
    fn value(self) -> FieldValue;
    fn to_bin(self) -> Self::Bin;
    /// The value postcard's serde decoding gave, or why it is not one.
    fn from_bin(b: Self::Bin) -> Result<Self, String>;
    /// The JSON value, after its key.
    fn write_json(self, c: &mut Chunk);
    /// The length of [`Field::write_json`]'s bytes.
    fn json_len(self) -> u64;
    /// The JSON value exactly as [`Field::write_json`] writes it; `None` for any other form.
    fn parse_json(c: &mut Cursor<'_>) -> Option<Self>;
    /// The canonical (postcard) bytes.
    fn push_canonical(self, out: &mut Vec<u8>);
    /// The canonical bytes exactly as [`Field::push_canonical`] writes them.
    fn parse_bin(c: &mut Bin<'_>) -> Option<Self>;
}

impl Field for u32 {
    type Bin = u32;
    const KIND: &'static str = "int";
    fn value(self) -> FieldValue {
        FieldValue::Int(self)
    }
    #[inline(always)]
    fn to_bin(self) -> u32 {
        self
    }
    #[inline(always)]
    fn from_bin(b: u32) -> Result<Self, String> {
        Ok(b)
    }
    #[inline(always)]
    fn write_json(self, c: &mut Chunk) {
        c.u(self)
    }
    #[inline(always)]
    fn json_len(self) -> u64 {
        digits(self) as u64
    }
    #[inline(always)]
    fn parse_json(c: &mut Cursor<'_>) -> Option<Self> {
        c.num()
    }
    #[inline(always)]
    fn push_canonical(self, out: &mut Vec<u8>) {
        push_varint(out, self as u64)
    }
    #[inline(always)]
    fn parse_bin(c: &mut Bin<'_>) -> Option<Self> {
        c.u32()
    }
}

/// A message's tokens: an integer above 0, written as a `u32`.
impl Field for Tokens {
    type Bin = u32;
    const KIND: &'static str = "int";
    fn value(self) -> FieldValue {
        FieldValue::Int(self.get())
    }
    #[inline(always)]
    fn to_bin(self) -> u32 {
        self.get()
    }
    fn from_bin(b: u32) -> Result<Self, String> {
        Tokens::new(b).ok_or_else(|| "tokens 0: a message carries at least one token".to_string())
    }
    #[inline(always)]
    fn write_json(self, c: &mut Chunk) {
        c.u(self.get())
    }
    #[inline(always)]
    fn json_len(self) -> u64 {
        digits(self.get()) as u64
    }
    #[inline(always)]
    fn parse_json(c: &mut Cursor<'_>) -> Option<Self> {
        Tokens::new(c.num()?)
    }
    #[inline(always)]
    fn push_canonical(self, out: &mut Vec<u8>) {
        push_varint(out, self.get() as u64)
    }
    #[inline(always)]
    fn parse_bin(c: &mut Bin<'_>) -> Option<Self> {
        Tokens::new(c.u32()?)
    }
}

/// `"act"` or `"grad"` in JSON; one byte, 0 or 1, in postcard. Megatron's shape messages
/// (`--megatron-variable-seq-lengths`) add `"act_shape"` (2) and `"grad_shape"` (3): appended
/// values, so every file without them keeps its bytes.
impl Field for PayloadKind {
    type Bin = u8;
    const KIND: &'static str = "act|grad|act_shape|grad_shape";
    fn value(self) -> FieldValue {
        FieldValue::Name(self.name())
    }
    #[inline(always)]
    fn to_bin(self) -> u8 {
        match self {
            PayloadKind::Act => 0,
            PayloadKind::Grad => 1,
            PayloadKind::ActShape => 2,
            PayloadKind::GradShape => 3,
        }
    }
    fn from_bin(b: u8) -> Result<Self, String> {
        match b {
            0 => Ok(PayloadKind::Act),
            1 => Ok(PayloadKind::Grad),
            2 => Ok(PayloadKind::ActShape),
            3 => Ok(PayloadKind::GradShape),
            other => Err(format!(
                "payload kind {other} is none of 0 (act), 1 (grad), 2 (act_shape), 3 (grad_shape)"
            )),
        }
    }
    #[inline(always)]
    fn write_json(self, c: &mut Chunk) {
        c.s(match self {
            PayloadKind::Act => b"\"act\"",
            PayloadKind::Grad => b"\"grad\"",
            PayloadKind::ActShape => b"\"act_shape\"",
            PayloadKind::GradShape => b"\"grad_shape\"",
        })
    }
    #[inline(always)]
    fn json_len(self) -> u64 {
        self.name().len() as u64 + 2
    }
    #[inline(always)]
    fn parse_json(c: &mut Cursor<'_>) -> Option<Self> {
        // Longest first: `"act"` is not a prefix of `"act_shape"` (the quote differs), but
        // keep the order obvious.
        if c.lit(b"\"act\"").is_some() {
            Some(PayloadKind::Act)
        } else if c.lit(b"\"grad\"").is_some() {
            Some(PayloadKind::Grad)
        } else if c.lit(b"\"act_shape\"").is_some() {
            Some(PayloadKind::ActShape)
        } else {
            c.lit(b"\"grad_shape\"")?;
            Some(PayloadKind::GradShape)
        }
    }
    #[inline(always)]
    fn push_canonical(self, out: &mut Vec<u8>) {
        out.push(self.to_bin())
    }
    #[inline(always)]
    fn parse_bin(c: &mut Bin<'_>) -> Option<Self> {
        PayloadKind::from_bin(c.byte()?).ok()
    }
}

/// A field's value as the rank file's JSON writes it: a number, or a name (`"act"`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FieldValue {
    Int(u32),
    Name(&'static str),
    /// A variant row's key (`"checkpoint": true`).
    True,
}

/// One op as the schema describes it: for Python (`pipec.instruction_schema()`), the docs
/// test, and anything else that must agree with the files without parsing them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OpSchema {
    /// The JSON `op`.
    pub name: &'static str,
    /// The row's own name, unique (`fwd_checkpoint` for the forward with `"checkpoint":true`;
    /// `name` for every other row).
    pub row: &'static str,
    /// The postcard variant index.
    pub index: u32,
    /// (key, [`Field::KIND`]) in file order.
    pub fields: &'static [(&'static str, &'static str)],
}

macro_rules! gen_schema {
    ($( $idx:literal $op:ident $(as $json:ident)? $(+ $flag:ident)? { $($f:ident : $t:ty),+ $(,)? } => [$($ir:tt)+]; )*) => {
        /// Every op of the rank file, in variant-index order (an op with an optional key,
        /// `fwd`, once without it and once with it).
        pub const OPS: &[OpSchema] = &[$(OpSchema {
            name: json_op!($op $(as $json)?),
            row: stringify!($op),
            index: $idx,
            fields: &[$((stringify!($f), <$t as Field>::KIND),)+ $((stringify!($flag), "true"))?],
        }),*];

        // Indices are postcard's variant indices, which are declaration order: 0, 1, 2, ...
        const _: () = {
            let mut i = 0u32;
            $( assert!($idx == i, "instruction indices must count up from 0"); i += 1; )*
            let _ = i;
        };

        /// The JSON `op` of an instruction.
        #[allow(unused_variables)]
        pub fn op_name(ins: &Instr) -> &'static str {
            match *ins {
                $( $($ir)+ => json_op!($op $(as $json)?), )*
            }
        }

        /// An instruction's op and its fields in file order, as the JSON writer writes them:
        /// for readers that want the record without parsing a file (Python's `Instruction`).
        pub fn fields_of(ins: &Instr) -> (&'static str, Vec<(&'static str, FieldValue)>) {
            match *ins {
                $( $($ir)+ => (
                    json_op!($op $(as $json)?),
                    vec![$((stringify!($f), Field::value($f)),)+ $((stringify!($flag), FieldValue::True))?],
                ), )*
            }
        }

        /// The schema row of an instruction ([`OPS`]`[i]`, its binary variant index).
        #[allow(unused_variables)]
        pub fn row_of(ins: &Instr) -> usize {
            match *ins {
                $( $($ir)+ => $idx, )*
            }
        }

        /// One instruction of every op, each field at `v` (tests walk every op with it).
        #[cfg(test)]
        pub(crate) fn every_op(v: u32, payload: PayloadKind) -> Vec<Instr> {
            trait Pick: Sized { fn pick(v: u32, p: PayloadKind) -> Self; }
            impl Pick for u32 { fn pick(v: u32, _: PayloadKind) -> u32 { v } }
            impl Pick for PayloadKind { fn pick(_: u32, p: PayloadKind) -> PayloadKind { p } }
            impl Pick for Tokens { fn pick(v: u32, _: PayloadKind) -> Tokens { Tokens::new(v.max(1)).unwrap_or(Tokens::MIN) } }
            vec![$({ $( let $f = <$t as Pick>::pick(v, payload); )+ $($ir)+ }),*]
        }

        /// Any instruction, every field drawn from `int` (tests).
        #[cfg(test)]
        pub(crate) fn arb_instr(
            int: impl proptest::strategy::Strategy<Value = u32> + 'static,
        ) -> proptest::strategy::BoxedStrategy<Instr> {
            use proptest::prelude::*;
            trait Arb: Sized { fn arb(int: BoxedStrategy<u32>) -> BoxedStrategy<Self>; }
            impl Arb for u32 { fn arb(int: BoxedStrategy<u32>) -> BoxedStrategy<u32> { int } }
            impl Arb for Tokens {
                fn arb(int: BoxedStrategy<u32>) -> BoxedStrategy<Tokens> {
                    int.prop_map(|v| Tokens::new(v.max(1)).unwrap_or(Tokens::MIN)).boxed()
                }
            }
            impl Arb for PayloadKind {
                fn arb(_: BoxedStrategy<u32>) -> BoxedStrategy<PayloadKind> {
                    prop_oneof![Just(PayloadKind::Act), Just(PayloadKind::Grad)].boxed()
                }
            }
            let int = int.boxed();
            proptest::strategy::Union::new(vec![$(
                ($(<$t as Arb>::arb(int.clone()),)+)
                    .prop_map(|($($f,)+)| $($ir)+)
                    .boxed()
            ),*])
            .boxed()
        }
    };
}
instructions!(gen_schema);

#[cfg(test)]
mod tests {
    use super::*;

    /// `docs/format.md` lists every op with its fields in file order, and its index.
    #[test]
    fn docs_list_the_schema() {
        let doc = include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/format.md"));
        // The rows of the table whose header starts with `head`.
        let rows = |head: &str| -> Vec<Vec<String>> {
            let mut lines = doc.lines().skip_while(|l| !l.starts_with(head)).skip(2);
            let mut out = Vec::new();
            for l in lines.by_ref().take_while(|l| l.starts_with('|')) {
                out.push(l.split('|').map(|c| c.trim().to_string()).collect());
            }
            out
        };
        let unticked = |s: &str| s.trim_matches('`').to_string();
        let json: Vec<(String, Vec<String>)> = rows("| `op` | fields |")
            .iter()
            .map(|c| (unticked(&c[1]), c[2].split(", ").map(unticked).collect()))
            .collect();
        let bin: Vec<(u32, String)> = rows("| index | variant | fields |")
            .iter()
            .map(|c| (c[1].parse().unwrap(), unticked(&c[2])))
            .collect();
        let want: Vec<_> = OPS
            .iter()
            .map(|o| {
                (
                    o.name.to_string(),
                    o.fields.iter().map(|f| f.0.to_string()).collect::<Vec<_>>(),
                )
            })
            .collect();
        assert_eq!(json, want, "docs/format.md's table of ops");
        let want: Vec<_> = OPS.iter().map(|o| (o.index, o.name.to_string())).collect();
        assert_eq!(bin, want, "docs/format.md's binary encoding table");
    }
}
