//! A parser for rank files exactly as pipec writes them ([`super::write`]'s fixed header, one
//! instruction per line, fields in a fixed order, numbers without sign, exponent or leading
//! zero). It is the loader's fast path: it skips the generic work of serde's parse of the same
//! bytes (bench/HISTORY.md has the speedup). It accepts a subset of what serde accepts and yields the same values for it
//! (a differential test below checks); anything else, a hand-edited file say, returns `None`
//! and the loader parses the file with serde as before, so errors and their messages are
//! serde's.

use super::bytes::{Bin, Cursor};
use super::format::*;
use super::schema::{instructions, json_op, Field};
use crate::ir::{Instr, MemKind, MemOp, Payload, PayloadKind};
use pipec_schedules::{Compute, Microbatch, Rank, StageId, Task};

/// A rank file's fields, as [`RankFile`] holds them.
pub(crate) struct Parsed {
    pub(crate) version: u32,
    pub(crate) rank: u32,
    pub(crate) world_size: u32,
    pub(crate) schedule_hash: String,
    pub(crate) instructions: Vec<Instr>,
    /// Where the bytes from here to the end are exactly [`canonical`]`(&instructions)` (a
    /// binary file as pipec writes it), so the loader hashes them instead of encoding the
    /// instructions again; `None` for JSON.
    pub(crate) canonical_at: Option<usize>,
}

macro_rules! gen_parse {
    ($( $idx:literal $op:ident $(as $json:ident)? $(+ $flag:ident)? { $($f:ident : $t:ty),+ $(,)? } => [$($ir:tt)+]; )*) => {
        impl Cursor<'_> {
            /// One instruction object, after `{"op":"`, through its closing `}`. Rows of one
            /// op (`fwd`, and `fwd` with `"checkpoint":true`) are tried in table order.
            #[inline]
            fn instr(&mut self) -> Option<Instr> {
                let rest = self.b.get(self.i..)?;
                let end = rest.iter().take(OP_MAX + 1).position(|&c| c == b'"')?;
                let op = &rest[..end];
                self.i += end + 1;
                let at = self.i;
                $( if op == json_op!($op $(as $json)?).as_bytes() {
                    #[inline(always)]
                    fn row(c: &mut Cursor<'_>) -> Option<Instr> {
                        $(
                            c.lit(concat!(",\"", stringify!($f), "\":").as_bytes())?;
                            let $f = <$t as Field>::parse_json(c)?;
                        )+
                        $( c.lit(concat!(",\"", stringify!($flag), "\":true").as_bytes())?; )?
                        c.lit(b"}")?;
                        Some($($ir)+)
                    }
                    if let Some(ins) = row(self) {
                        return Some(ins);
                    }
                    self.i = at;
                } )*
                None
            }
        }

        /// The longest op name.
        const OP_MAX: usize = {
            let mut n = 0;
            $( if json_op!($op $(as $json)?).len() > n { n = json_op!($op $(as $json)?).len(); } )*
            n
        };

        /// One instruction of a binary file, exactly as [`canonical`] writes it.
        #[inline]
        fn bin_instr(c: &mut Bin<'_>) -> Option<Instr> {
            Some(match c.u32()? {
                $( $idx => {
                    $( let $f = <$t as Field>::parse_bin(c)?; )+
                    $($ir)+
                } )*
                _ => return None,
            })
        }
    };
}
instructions!(gen_parse);

/// Parse `bytes` when they are a rank file in exactly the form pipec writes; `None` otherwise
/// (the caller then parses with serde). `expected`: how many instructions the manifest
/// lists, a capacity hint only (the file decides).
pub(crate) fn parse(bytes: &[u8], expected: Option<u64>) -> Option<Parsed> {
    let mut c = Cursor { b: bytes, i: 0 };
    c.lit(b"{\n  \"format\": \"")?;
    c.lit(RANK_FORMAT.as_bytes())?;
    c.lit(b"\",\n  \"version\": ")?;
    let version = c.num()?;
    c.lit(b",\n  \"rank\": ")?;
    let rank = c.num()?;
    c.lit(b",\n  \"world_size\": ")?;
    let world_size = c.num()?;
    c.lit(b",\n  \"schedule_hash\": \"")?;
    let schedule_hash = c.hex_string()?;
    c.lit(b",\n  \"instructions\": [\n")?;
    // The shortest line, `    {"op":"wait","batch":0},`, is 29 bytes: no more than that
    // many, and no more than listed (a typical line is twice as long, and capacity past the
    // end is pages touched for nothing once the allocator hands out huge pages).
    let most = bytes.len().saturating_sub(c.i) / 29;
    let cap = expected.map_or(most, |n| most.min(usize::try_from(n).unwrap_or(most)));
    let mut instructions = Vec::with_capacity(cap);
    if c.lit(b"  ]\n}\n").is_none() {
        loop {
            c.lit(b"    {\"op\":\"")?;
            instructions.push(c.instr()?);
            if c.lit(b",\n").is_none() {
                c.lit(b"\n  ]\n}\n")?;
                break;
            }
        }
    }
    (c.i == bytes.len()).then_some(Parsed {
        version,
        rank,
        world_size,
        schedule_hash,
        instructions,
        canonical_at: None,
    })
}

/// Decode `bytes` when they are a binary rank file exactly as pipec writes it (minimal
/// varints, known variants and payload kinds, nothing after the last instruction); `None`
/// otherwise, and the caller decodes with postcard as before.
pub(crate) fn parse_bin(bytes: &[u8]) -> Option<Parsed> {
    let mut c = Bin { b: bytes, i: 0 };
    if c.str()? != RANK_FORMAT {
        return None;
    }
    let version = c.u32()?;
    let rank = c.u32()?;
    let world_size = c.u32()?;
    let schedule_hash = c.str()?.to_string();
    // From here on the file is postcard's `Vec<InstrBin>`, which is what `canonical` writes;
    // every field below is read back in the one encoding it has there (minimal varints,
    // payload kind 0 or 1, nothing after the end), so these bytes are the canonical ones.
    let canonical_at = c.i;
    let n = c.varint(u64::MAX)?;
    // Every instruction takes at least two bytes.
    if n > (bytes.len() - c.i) as u64 / 2 {
        return None;
    }
    let mut instructions = Vec::with_capacity(n as usize);
    for _ in 0..n {
        let ins = bin_instr(&mut c)?;
        instructions.push(ins);
    }
    (c.i == bytes.len()).then_some(Parsed {
        version,
        rank,
        world_size,
        schedule_hash,
        instructions,
        canonical_at: Some(canonical_at),
    })
}

#[cfg(test)]
mod tests {
    use super::super::write::rank_file_json;
    use super::*;
    use proptest::prelude::*;

    /// What serde makes of the bytes, in the fast path's terms (`None`: serde refuses them).
    fn via_serde(bytes: &[u8]) -> Option<Parsed> {
        let f: RankFile = serde_json::from_slice(bytes).ok()?;
        (f.format == RANK_FORMAT).then(|| Parsed {
            version: f.version,
            rank: f.rank,
            world_size: f.world_size,
            schedule_hash: f.schedule_hash,
            instructions: f.instructions.into_iter().map(Instr::from).collect(),
            canonical_at: None,
        })
    }

    fn same(a: &Parsed, b: &Parsed) -> bool {
        (
            a.version,
            a.rank,
            a.world_size,
            &a.schedule_hash,
            &a.instructions,
        ) == (
            b.version,
            b.rank,
            b.world_size,
            &b.schedule_hash,
            &b.instructions,
        )
    }

    fn instr() -> impl Strategy<Value = Instr> {
        let n = prop_oneof![Just(0u32), 0u32..20, Just(u32::MAX), any::<u32>()];
        super::super::schema::arb_instr(n)
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        /// Every file pipec writes takes the fast path, with serde's values; the manifest's
        /// count is a capacity hint only (a wrong or absurd one changes nothing).
        #[test]
        fn written_files_parse_fast(instrs in proptest::collection::vec(instr(), 0..40),
                                    rank in any::<u32>(), world in any::<u32>(),
                                    hint in proptest::option::of(any::<u64>())) {
            let hash = "0123456789abcdef".repeat(4);
            let bytes = rank_file_json(rank, world, &hash, &instrs);
            let fast = parse(&bytes, hint).expect("canonical file");
            prop_assert!(same(&fast, &via_serde(&bytes).unwrap()));
            prop_assert_eq!(fast.instructions, instrs);
        }

        /// Damage anywhere: what the fast path accepts, serde accepts with the same values.
        #[test]
        fn damaged_files_agree_with_serde(instrs in proptest::collection::vec(instr(), 0..12),
                                          edits in proptest::collection::vec(
                                              (any::<prop::sample::Index>(), any::<u8>(), 0u8..3), 1..4)) {
            let mut bytes = rank_file_json(1, 4, &"ab".repeat(32), &instrs);
            // Bytes JSON is made of, so damage often still parses.
            damage(&mut bytes, &edits, |b| b"0123456789,:{}[]\" \nabdefgprstwDW_-.e+"[b as usize % 37]);
            if let Some(fast) = parse(&bytes, None) {
                let slow = via_serde(&bytes);
                prop_assert!(slow.as_ref().is_some_and(|s| same(&fast, s)),
                    "fast path accepted what serde reads differently: {}", String::from_utf8_lossy(&bytes));
            }
        }
    }

    #[test]
    fn numbers_serde_would_read_differently_fall_back() {
        let ok = rank_file_json(0, 1, "ab", &[Instr::Wait { batch: 7 }]);
        let text = String::from_utf8(ok.clone()).unwrap();
        assert!(parse(&ok, None).is_some());
        for bad in [
            "\"batch\":07",
            "\"batch\":7.0",
            "\"batch\":7e0",
            "\"batch\":-7",
            "\"batch\":4294967296",
            "\"batch\":99999999999",
            "\"batch\": 7",
        ] {
            let t = text.replace("\"batch\":7", bad);
            assert!(parse(t.as_bytes(), None).is_none(), "{bad}");
        }
        let t = text.replace("\"batch\":7", "\"batch\":4294967295");
        assert_eq!(
            parse(t.as_bytes(), None).unwrap().instructions,
            [Instr::Wait { batch: u32::MAX }]
        );
        assert!(parse(text.replace("}\n", "} \n").as_bytes(), None).is_none());
        assert!(parse(&[ok.as_slice(), b" "].concat(), None).is_none());
    }

    /// What postcard makes of the bytes, in the fast path's terms.
    fn via_postcard(bytes: &[u8]) -> Option<Parsed> {
        let f: RankFileBin = postcard::from_bytes(bytes).ok()?;
        let mut instructions = Vec::new();
        for w in f.instructions {
            instructions.push(Instr::try_from(w).ok()?);
        }
        (f.format == RANK_FORMAT).then_some(Parsed {
            version: f.version,
            rank: f.rank,
            world_size: f.world_size,
            schedule_hash: f.schedule_hash,
            instructions,
            canonical_at: None,
        })
    }

    /// Apply `edits` in order: (where, byte through `byte`, 0 overwrite / 1 insert / 2 remove).
    fn damage(
        bytes: &mut Vec<u8>,
        edits: &[(prop::sample::Index, u8, u8)],
        byte: impl Fn(u8) -> u8,
    ) {
        for (at, b, how) in edits {
            if bytes.is_empty() {
                break;
            }
            let i = at.index(bytes.len());
            match how {
                0 => bytes[i] = byte(*b),
                1 => bytes.insert(i, byte(*b)),
                _ => {
                    bytes.remove(i);
                }
            }
        }
    }

    fn bin_file(rank: u32, world: u32, hash: &str, instrs: &[Instr]) -> Vec<u8> {
        let mut b = bin_prefix(rank, world, hash);
        b.extend_from_slice(&canonical(instrs));
        b
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        #[test]
        fn written_bin_files_decode_fast(instrs in proptest::collection::vec(instr(), 0..40),
                                         rank in any::<u32>(), world in any::<u32>()) {
            let bytes = bin_file(rank, world, &"ab".repeat(32), &instrs);
            let fast = parse_bin(&bytes).expect("canonical file");
            prop_assert!(same(&fast, &via_postcard(&bytes).unwrap()));
            prop_assert_eq!(&bytes[fast.canonical_at.unwrap()..], &canonical(&fast.instructions)[..]);
            prop_assert_eq!(fast.instructions, instrs);
        }

        /// Damage anywhere: what the fast path accepts, postcard decodes to the same values.
        #[test]
        fn damaged_bin_files_agree_with_postcard(instrs in proptest::collection::vec(instr(), 0..12),
                                                 edits in proptest::collection::vec(
                                                     (any::<prop::sample::Index>(), any::<u8>(), 0u8..3), 1..4)) {
            let mut bytes = bin_file(1, 4, &"ab".repeat(32), &instrs);
            damage(&mut bytes, &edits, |b| b);
            if let Some(fast) = parse_bin(&bytes) {
                let slow = via_postcard(&bytes);
                prop_assert!(slow.as_ref().is_some_and(|s| same(&fast, s)), "{bytes:?}");
                // The loader hashes these bytes as the canonical ones.
                prop_assert_eq!(&bytes[fast.canonical_at.unwrap()..], &canonical(&fast.instructions)[..]);
            }
        }
    }

    #[test]
    fn overlong_varints_fall_back() {
        let ok = bin_file(0, 1, "ab", &[Instr::Wait { batch: 7 }]);
        assert!(parse_bin(&ok).is_some());
        let last = ok.len() - 1;
        // The batch `7` as two bytes: what postcard may accept, not what pipec writes.
        let mut long = ok[..last].to_vec();
        long.extend_from_slice(&[0x87, 0x00]);
        assert!(parse_bin(&long).is_none());
        assert!(parse_bin(&[ok.as_slice(), &[0]].concat()).is_none());
    }
}
