//! The byte-level pieces every encoding of a rank file is made of: the buffer the JSON
//! writer fills ([`Chunk`]), the cursors the fast parsers read with ([`Cursor`] for JSON,
//! [`Bin`] for postcard), and the numbers both write (varints, decimal digits). Nothing here
//! knows an instruction: the per-op code is generated from `schema.rs`'s table next to its
//! users (`write.rs`, `canonical_parse.rs`, `format.rs`), which all build on this file.

/// `v` as a minimal LEB128 varint (postcard's).
#[inline]
pub(crate) fn push_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

#[inline]
pub(crate) fn digits(v: u32) -> u32 {
    // Ids are mostly small: comparisons before the general case.
    match v {
        0..=9 => 1,
        10..=99 => 2,
        100..=999 => 3,
        _ => v.ilog10() + 1,
    }
}

pub(crate) fn push_u32(out: &mut Vec<u8>, v: u32) {
    out.extend_from_slice(itoa::Buffer::new().format(v).as_bytes());
}

/// The longest instruction line (a `send` with every number at `u32::MAX` is 115 bytes).
pub(super) const LINE_MAX: usize = 256;

/// A buffer rank files are assembled in, [`CHUNK`] bytes at a time: each line is written
/// straight into it (the literals as fixed-size copies), never through a growing `Vec`.
pub(crate) struct Chunk {
    pub(super) b: Box<[u8]>,
    pub(super) n: usize,
}

impl Chunk {
    pub(crate) fn new() -> Self {
        Chunk {
            b: vec![0; CHUNK + LINE_MAX].into_boxed_slice(),
            n: 0,
        }
    }

    pub(super) fn bytes(&self) -> &[u8] {
        &self.b[..self.n]
    }

    #[inline(always)]
    pub(crate) fn s(&mut self, s: &[u8]) {
        self.b[self.n..self.n + s.len()].copy_from_slice(s);
        self.n += s.len();
    }

    #[inline(always)]
    pub(crate) fn u(&mut self, v: u32) {
        const PAIRS: &[u8; 200] = b"0001020304050607080910111213141516171819\
              2021222324252627282930313233343536373839\
              4041424344454647484950515253545556575859\
              6061626364656667686970717273747576777879\
              8081828384858687888990919293949596979899";
        if v < 10 {
            self.b[self.n] = b'0' + v as u8;
            self.n += 1;
        } else if v < 100 {
            let i = v as usize * 2;
            self.s(&PAIRS[i..i + 2]);
        } else if v < 10_000 {
            let (hi, lo) = (v as usize / 100 * 2, v as usize % 100 * 2);
            if v < 1000 {
                self.s(&PAIRS[hi + 1..hi + 2]);
            } else {
                self.s(&PAIRS[hi..hi + 2]);
            }
            self.s(&PAIRS[lo..lo + 2]);
        } else {
            self.s(itoa::Buffer::new().format(v).as_bytes());
        }
    }
}

/// How much of a rank file is assembled before it is hashed and written: small enough to stay
/// in cache between the two, large enough that system calls are few.
pub(super) const CHUNK: usize = 256 << 10;

/// A JSON rank file being read, at byte `i` (`canonical_parse.rs`'s fast path).
pub(crate) struct Cursor<'a> {
    pub(super) b: &'a [u8],
    pub(super) i: usize,
}

impl Cursor<'_> {
    #[inline(always)]
    pub(crate) fn lit(&mut self, s: &[u8]) -> Option<()> {
        if self.b.get(self.i..self.i + s.len())? == s {
            self.i += s.len();
            Some(())
        } else {
            None
        }
    }

    /// A JSON number serde reads as this `u32`, in the form pipec writes: `0`, or a nonzero
    /// digit and at most nine more, at most `u32::MAX`.
    #[inline(always)]
    pub(crate) fn num(&mut self) -> Option<u32> {
        let b = self.b;
        let first = *b.get(self.i)?;
        if first == b'0' {
            self.i += 1;
            return (!b.get(self.i).is_some_and(u8::is_ascii_digit)).then_some(0);
        }
        if !first.is_ascii_digit() {
            return None;
        }
        let mut v = 0u64;
        let start = self.i;
        while let Some(&c) = b.get(self.i) {
            if !c.is_ascii_digit() {
                break;
            }
            v = v * 10 + (c - b'0') as u64;
            self.i += 1;
            if self.i - start > 10 {
                return None;
            }
        }
        u32::try_from(v).ok()
    }

    /// A string of lowercase hex digits (what a schedule hash is), after its opening quote.
    pub(super) fn hex_string(&mut self) -> Option<String> {
        let start = self.i;
        while let Some(&c) = self.b.get(self.i) {
            match c {
                b'0'..=b'9' | b'a'..=b'f' => self.i += 1,
                b'"' => {
                    let s = std::str::from_utf8(&self.b[start..self.i]).ok()?;
                    self.i += 1;
                    return Some(s.to_string());
                }
                _ => return None,
            }
        }
        None
    }
}

/// A binary (postcard) rank file being read, at byte `i`.
pub(crate) struct Bin<'a> {
    pub(super) b: &'a [u8],
    pub(super) i: usize,
}

impl<'a> Bin<'a> {
    /// A minimal LEB128 varint (postcard's) of at most `max`.
    #[inline]
    pub(super) fn varint(&mut self, max: u64) -> Option<u64> {
        let mut v = 0u64;
        for k in 0..10 {
            let byte = *self.b.get(self.i)?;
            self.i += 1;
            v |= ((byte & 0x7f) as u64) << (7 * k);
            if byte & 0x80 == 0 {
                // Minimal: no trailing zero group (except 0 itself), no overflow.
                if (k > 0 && byte == 0) || (k == 9 && byte > 1) {
                    return None;
                }
                return (v <= max).then_some(v);
            }
        }
        None
    }

    #[inline(always)]
    pub(crate) fn u32(&mut self) -> Option<u32> {
        // Fast path: one byte.
        let byte = *self.b.get(self.i)?;
        if byte < 0x80 {
            self.i += 1;
            return Some(byte as u32);
        }
        self.varint(u32::MAX as u64).map(|v| v as u32)
    }

    /// One byte, as it is.
    #[inline(always)]
    pub(crate) fn byte(&mut self) -> Option<u8> {
        let b = *self.b.get(self.i)?;
        self.i += 1;
        Some(b)
    }

    pub(super) fn str(&mut self) -> Option<&'a str> {
        let n = self.varint(u64::MAX)?;
        let end = self.i.checked_add(usize::try_from(n).ok()?)?;
        let s = std::str::from_utf8(self.b.get(self.i..end)?).ok()?;
        self.i = end;
        Some(s)
    }
}
