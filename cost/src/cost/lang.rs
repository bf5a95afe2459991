//! The cost language: `key=value` entries separated by `,` or newlines, `#` comments, and an
//! optional `[model]` table, parsed with byte positions so that every error points at its
//! text (line, column and a caret). The keys and their meaning are in [`super`].

use super::units::parse_bytes;
use crate::model::{Dtype, ModelShape, Norm, Recompute, MODEL_KEYS, REQUIRED};
use pipec_schedules::layout::LayerKind;
use thiserror::Error;

/// The largest cost or size a spec may give. Sums over a billion ops of this size stay far
/// from overflow and keep printable, meaningful figures; larger means a wrong unit.
pub const MAX_VALUE: f64 = 1e12;

/// The smallest nonzero cost or size: below it, sums of a billion ops lose their meaning.
pub const MIN_VALUE: f64 = 1e-9;

/// The keys a spec may hold, for error messages.
pub const KEYS: &str =
    "f, b, w, E.f, E.b, E.w, t.f, t.b, t.w, m.f, m.b, m.w, L.f, L.b, L.w, K.attn_f, K.attn_b, K.attn_w, seq, floor, p2p, msg, bw, rendezvous, overlap, K.act, K.act_w, K.param, offload, K.offload (K in E t m L), pcie, offload_pair, time_unit, split_extra, rank.R (R a rank)";

#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(super) enum Key {
    /// `f`, `b`, `w` as 0, 1, 2.
    Base(usize),
    Kind(LayerKind, usize),
    /// `K.act` (0), `K.param` (1) and `K.act_w` (2).
    Mem(LayerKind, usize),
    Floor,
    P2p,
    Msg,
    Bw,
    Rendezvous,
    Overlap,
    /// `offload` (decoder and MTP layers) or `K.offload`: copy time per layer and microbatch.
    Offload(Option<LayerKind>),
    Pcie,
    OffloadPair,
    TimeUnit,
    /// `rank.R`: rank R's compute time factor.
    Rank(u32),
    /// `K.attn_f`, `K.attn_b`, `K.attn_w` as 0, 1, 2: the attention core's part of a pass.
    Attn(LayerKind, usize),
    /// `seq`: the tokens per microbatch the per-layer keys describe.
    Seq,
    /// `split_extra`: the extra share a split backward's halves take over their `b` and `w`.
    SplitExtra,
}

fn key(s: &str) -> Option<Key> {
    let pass = |p: &str| match p {
        "f" => Some(0),
        "b" => Some(1),
        "w" => Some(2),
        _ => None,
    };
    Some(match s {
        "floor" => Key::Floor,
        "p2p" => Key::P2p,
        "msg" => Key::Msg,
        "bw" => Key::Bw,
        "rendezvous" => Key::Rendezvous,
        "overlap" => Key::Overlap,
        "offload" => Key::Offload(None),
        "pcie" => Key::Pcie,
        "offload_pair" => Key::OffloadPair,
        "time_unit" => Key::TimeUnit,
        "seq" => Key::Seq,
        "split_extra" => Key::SplitExtra,
        _ => {
            if let Some(r) = s.strip_prefix("rank.") {
                if r.is_empty() || !r.chars().all(|c| c.is_ascii_digit()) {
                    return None;
                }
                return Some(Key::Rank(r.parse().ok()?));
            }
            if let Some((k, p)) = s.split_once('.') {
                let mut chars = k.chars();
                let kind = LayerKind::from_symbol(chars.next()?)?;
                if chars.next().is_some() {
                    return None;
                }
                match p {
                    "act" => Key::Mem(kind, 0),
                    "param" => Key::Mem(kind, 1),
                    "act_w" => Key::Mem(kind, 2),
                    "offload" => Key::Offload(Some(kind)),
                    _ => match p.strip_prefix("attn_") {
                        Some(a) => Key::Attn(kind, pass(a)?),
                        None => Key::Kind(kind, pass(p)?),
                    },
                }
            } else {
                Key::Base(pass(s)?)
            }
        }
    })
}

/// One `key=value` entry: the parsed key and the byte ranges of key and value.
pub(super) struct Entry {
    pub(super) key: Key,
    pub(super) value: (usize, usize),
}

/// Byte range of `s[lo..hi]` with surrounding whitespace removed.
fn trim(text: &str, lo: usize, hi: usize) -> (usize, usize) {
    let s = &text[lo..hi];
    let start = lo + (s.len() - s.trim_start().len());
    let end = hi - (s.len() - s.trim_end().len());
    (start, end.max(start))
}

/// The inside of a TOML string, `"..."` or `'...'`: what a TOML writer makes of a size
/// (`t.act = "1.5GiB"`), a bandwidth (`pcie = "25GB/s"`), a unit or `"inf"`, and of a key
/// holding a dot (`"t.act" = 1`). The value then reads as its unquoted form, and errors
/// point inside the quotes. A span that is not one whole string is returned as it is (an
/// unmatched quote then fails as the value it is). Escapes are not decoded: no value pipec
/// reads contains a backslash, so one fails as the bad value it is.
fn unquote(text: &str, (lo, hi): (usize, usize)) -> (usize, usize) {
    let s = &text[lo..hi];
    for q in ['"', '\''] {
        if s.len() >= 2 && s.starts_with(q) && s.ends_with(q) && !s[1..s.len() - 1].contains(q) {
            return (lo + 1, hi - 1);
        }
    }
    (lo, hi)
}

/// The `[model]` table: where its header is, and its raw `key = value` entries (key and
/// value byte ranges), checked by [`parse_shape`].
pub(super) struct Section {
    pub(super) header: (usize, usize),
    entries: Vec<((usize, usize), (usize, usize))>,
}

pub(super) fn entries(
    text: &str,
    source: Option<&str>,
) -> Result<(Vec<Entry>, Option<Section>), CostError> {
    let mut out: Vec<(Entry, (usize, usize))> = Vec::new();
    let mut section: Option<Section> = None;
    let mut line_start = 0;
    for line in text.split_inclusive('\n') {
        let line_end = line_start + line.len();
        let content_end = line_start + line.find('#').unwrap_or(line.len());
        let mut lo = line_start;
        while lo <= content_end {
            let hi = text[lo..content_end]
                .find(',')
                .map_or(content_end, |i| lo + i);
            let (a, b) = trim(text, lo, hi);
            if a < b && text[a..b].starts_with('[') {
                // A table header: `[model]` (TOML's form; also an item of an inline spec).
                let item = &text[a..b];
                let name = item
                    .strip_prefix('[')
                    .and_then(|x| x.strip_suffix(']'))
                    .map(str::trim);
                if name != Some("model") {
                    return Err(err(
                        text,
                        source,
                        (a, b),
                        CostErrorKind::UnknownSection(item.to_string()),
                    ));
                }
                if section.is_some() {
                    return Err(err(text, source, (a, b), CostErrorKind::ModelTwice));
                }
                section = Some(Section {
                    header: (a, b),
                    entries: Vec::new(),
                });
            } else if a < b {
                let item = &text[a..b];
                let Some(eq) = item.find('=') else {
                    return Err(err(text, source, (a, b), CostErrorKind::MissingEquals));
                };
                let k = unquote(text, trim(text, a, a + eq));
                let v = trim(text, a + eq + 1, b);
                // `[model]` values keep their quotes: its string keys read them themselves,
                // and its errors quote the value as written.
                let v = if section.is_some() {
                    v
                } else {
                    unquote(text, v)
                };
                if k.0 == k.1 {
                    return Err(err(text, source, (a, a + 1), CostErrorKind::EmptyKey));
                }
                let name = &text[k.0..k.1];
                if v.0 == v.1 {
                    if section.is_some() {
                        if !MODEL_KEYS.contains(&name) {
                            return Err(err(
                                text,
                                source,
                                k,
                                CostErrorKind::UnknownModelKey(name.to_string()),
                            ));
                        }
                    } else if key(name).is_none() {
                        return Err(err(
                            text,
                            source,
                            k,
                            CostErrorKind::UnknownKey(name.to_string()),
                        ));
                    }
                    return Err(err(
                        text,
                        source,
                        (v.0, v.0),
                        CostErrorKind::EmptyValue(name.to_string()),
                    ));
                }
                if let Some(sec) = &mut section {
                    sec.entries.push((k, v));
                    lo = hi + 1;
                    continue;
                }
                let Some(parsed) = key(name) else {
                    let kind = if MODEL_KEYS.contains(&name) {
                        CostErrorKind::ModelKeyOutside(name.to_string())
                    } else {
                        CostErrorKind::UnknownKey(name.to_string())
                    };
                    return Err(err(text, source, k, kind));
                };
                if let Some((_, first)) = out.iter().find(|(e, _)| e.key == parsed) {
                    let (line, col) = line_col(text, first.0);
                    return Err(err(
                        text,
                        source,
                        k,
                        CostErrorKind::Duplicate {
                            key: name.to_string(),
                            line,
                            col,
                        },
                    ));
                }
                out.push((
                    Entry {
                        key: parsed,
                        value: v,
                    },
                    k,
                ));
            }
            lo = hi + 1;
        }
        line_start = line_end;
    }
    Ok((out.into_iter().map(|(e, _)| e).collect(), section))
}

/// Check the `[model]` table and build the shape: every key known and given once, the
/// required ones present, integers positive, strings and booleans from their lists, and the
/// shape consistent (Megatron's own checks: heads divisible by kv_heads and tp, hidden by
/// heads, kv_heads by tp).
pub(super) fn parse_shape(
    text: &str,
    source: Option<&str>,
    sec: &Section,
) -> Result<ModelShape, CostError> {
    type Span = (usize, usize);
    let mut seen: Vec<(&str, Span, Span)> = Vec::new();
    for &(k, v) in &sec.entries {
        let name = &text[k.0..k.1];
        if !MODEL_KEYS.contains(&name) {
            return Err(err(
                text,
                source,
                k,
                CostErrorKind::UnknownModelKey(name.to_string()),
            ));
        }
        if let Some(&(_, first, _)) = seen.iter().find(|(n, _, _)| *n == name) {
            let (line, col) = line_col(text, first.0);
            return Err(err(
                text,
                source,
                k,
                CostErrorKind::Duplicate {
                    key: name.to_string(),
                    line,
                    col,
                },
            ));
        }
        seen.push((name, k, v));
    }
    let get = |name: &str| seen.iter().find(|(n, _, _)| *n == name).map(|&(_, _, v)| v);
    let bad = |name: &str, v: (usize, usize), want: &str| {
        let value = &text[v.0..v.1];
        err(
            text,
            source,
            v,
            CostErrorKind::BadModelValue(format!("`{name}` must be {want}, not `{value}`")),
        )
    };

    let int = |name: &str, default: u64| -> Result<u64, CostError> {
        let Some(v) = get(name) else {
            return Ok(default);
        };
        let s = text[v.0..v.1].replace('_', "");
        match s.parse::<u64>() {
            Ok(x) if (1..=MAX_DIM).contains(&x) && s.chars().all(|c| c.is_ascii_digit()) => Ok(x),
            _ => Err(bad(name, v, &format!("an integer from 1 to {MAX_DIM}"))),
        }
    };
    let boolean = |name: &str| -> Result<Option<bool>, CostError> {
        let Some(v) = get(name) else {
            return Ok(None);
        };
        match &text[v.0..v.1] {
            "true" => Ok(Some(true)),
            "false" => Ok(Some(false)),
            _ => Err(bad(name, v, "`true` or `false`")),
        }
    };
    // A string, quoted as TOML wants or bare.
    let choice = |name: &str, options: &[&str]| -> Result<Option<usize>, CostError> {
        let Some(v) = get(name) else {
            return Ok(None);
        };
        let raw = &text[v.0..v.1];
        let s = raw
            .strip_prefix('"')
            .and_then(|x| x.strip_suffix('"'))
            .unwrap_or(raw);
        match options.iter().position(|o| *o == s) {
            Some(i) => Ok(Some(i)),
            None => {
                let list: Vec<String> = options.iter().map(|o| format!("\"{o}\"")).collect();
                Err(bad(name, v, &format!("one of {}", list.join(", "))))
            }
        }
    };
    // `tflops`: a positive decimal number of TFLOP/s, at most [`MAX_TFLOPS`].
    let tflops = match get("tflops") {
        None => None,
        Some(v) => {
            let s = text[v.0..v.1].replace('_', "");
            let plain = !s.is_empty()
                && s.chars()
                    .all(|c| c.is_ascii_digit() || matches!(c, '.' | 'e' | 'E' | '+' | '-'));
            match s.parse::<f64>() {
                Ok(x) if plain && x > 0.0 && x <= MAX_TFLOPS => Some(x),
                _ => {
                    return Err(bad(
                        "tflops",
                        v,
                        &format!("the TFLOP/s one GPU achieves, a number greater than 0 and at most {MAX_TFLOPS:e}"),
                    ))
                }
            }
        }
    };
    let hidden = int("hidden", 0)?;
    let heads = int("heads", 0)?;
    let tp = int("tp", 1)?;
    let shape = ModelShape {
        hidden,
        ffn: int("ffn", 0)?,
        heads,
        kv_heads: int("kv_heads", heads)?,
        seq: int("seq", 0)?,
        micro_batch: int("micro_batch", 1)?,
        vocab: int("vocab", 0)?,
        dtype: match choice("dtype", &["bf16", "fp16", "fp32"])? {
            None | Some(0) => Dtype::Bf16,
            Some(1) => Dtype::Fp16,
            _ => Dtype::Fp32,
        },
        tp,
        cp: int("cp", 1)?,
        dp: int("dp", 1)?,
        // Megatron recommends sequence parallelism with tensor parallelism.
        sequence_parallel: boolean("sequence_parallel")?.unwrap_or(tp > 1),
        distributed_optimizer: boolean("distributed_optimizer")?.unwrap_or(false),
        recompute: match choice("recompute", &["none", "selective", "full"])? {
            None | Some(0) => Recompute::None,
            Some(1) => Recompute::Selective,
            _ => Recompute::Full,
        },
        swiglu: boolean("swiglu")?.unwrap_or(false),
        normalization: match choice("normalization", &["LayerNorm", "RMSNorm"])? {
            None | Some(0) => Norm::LayerNorm,
            _ => Norm::RMSNorm,
        },
        tflops,
        num_layers: get("num_layers")
            .map(|_| int("num_layers", 0))
            .transpose()?,
    };
    // Values first (each error at its value), then what is missing (at the header).
    let missing: Vec<&str> = REQUIRED
        .iter()
        .copied()
        .filter(|r| get(r).is_none())
        .collect();
    if !missing.is_empty() {
        return Err(err(
            text,
            source,
            sec.header,
            CostErrorKind::MissingModelKeys(missing.join(", ")),
        ));
    }
    let at = |name: &str| get(name).unwrap_or(sec.header);
    let inconsistent = |name: &str, why: String| {
        err(
            text,
            source,
            at(name),
            CostErrorKind::InconsistentModel(why),
        )
    };
    if !shape.hidden.is_multiple_of(shape.heads) {
        return Err(inconsistent(
            "heads",
            format!(
                "hidden ({}) is not a multiple of heads ({})",
                shape.hidden, shape.heads
            ),
        ));
    }
    if !shape.heads.is_multiple_of(shape.kv_heads) {
        return Err(inconsistent(
            "kv_heads",
            format!(
                "heads ({}) is not a multiple of kv_heads ({})",
                shape.heads, shape.kv_heads
            ),
        ));
    }
    if !shape.heads.is_multiple_of(shape.tp) || !shape.kv_heads.is_multiple_of(shape.tp) {
        return Err(inconsistent(
            "tp",
            format!(
                "tp ({}) does not divide heads ({}) and kv_heads ({}): Megatron splits attention heads over tensor-parallel ranks",
                shape.tp, shape.heads, shape.kv_heads
            ),
        ));
    }
    if !shape.seq.is_multiple_of(shape.cp) {
        return Err(inconsistent(
            "cp",
            format!("cp ({}) does not divide seq ({})", shape.cp, shape.seq),
        ));
    }
    Ok(shape)
}

/// The largest `tflops` a `[model]` table takes: a million TFLOP/s per GPU is far beyond any
/// device, so a larger figure is a wrong unit (FLOP/s given for TFLOP/s).
pub const MAX_TFLOPS: f64 = 1e6;

/// The largest size or parallel degree a `[model]` key takes: 2^40.
pub const MAX_DIM: u64 = 1 << 40;

pub(super) fn number(
    text: &str,
    source: Option<&str>,
    e: &Entry,
    allow_inf: bool,
) -> Result<f64, CostError> {
    let s = &text[e.value.0..e.value.1];
    let bad = || {
        err(
            text,
            source,
            e.value,
            CostErrorKind::BadNumber(s.to_string()),
        )
    };
    if allow_inf && (s == "inf" || s == "+inf") {
        return Ok(f64::INFINITY);
    }
    // Rust's float parser accepts `inf` and `NaN`; a cost must be a plain decimal number.
    if !s
        .chars()
        .all(|c| c.is_ascii_digit() || matches!(c, '.' | '-' | '+' | 'e' | 'E' | '_'))
    {
        return Err(bad());
    }
    let v: f64 = s.replace('_', "").parse().map_err(|_| bad())?;
    if !v.is_finite() {
        return Err(err(
            text,
            source,
            e.value,
            CostErrorKind::NotFinite(s.to_string()),
        ));
    }
    if v < 0.0 {
        return Err(err(
            text,
            source,
            e.value,
            CostErrorKind::Negative(s.to_string()),
        ));
    }
    if v > MAX_VALUE || (v != 0.0 && v < MIN_VALUE) {
        return Err(err(
            text,
            source,
            e.value,
            CostErrorKind::OutOfRange(s.to_string()),
        ));
    }
    Ok(v)
}

/// `seq`: a whole number of tokens from 1 to [`MAX_DIM`] (`_` separators allowed, as in the
/// `[model]` table).
pub(super) fn seq_value(text: &str, source: Option<&str>, e: &Entry) -> Result<u64, CostError> {
    let raw = &text[e.value.0..e.value.1];
    let s = raw.replace('_', "");
    match s.parse::<u64>() {
        Ok(x) if (1..=MAX_DIM).contains(&x) && s.chars().all(|c| c.is_ascii_digit()) => Ok(x),
        _ => Err(err(
            text,
            source,
            e.value,
            CostErrorKind::BadSeq(raw.to_string()),
        )),
    }
}

/// A memory value: a plain number, or bytes with a unit (`B`, `KB`, `MB`, `GB`, `TB`, `KiB`,
/// `MiB`, `GiB`, `TiB`).
pub(super) fn memory_value(text: &str, source: Option<&str>, e: &Entry) -> Result<f64, CostError> {
    let s = &text[e.value.0..e.value.1];
    parse_bytes(s).map_err(|_| {
        let kind = if s.trim_start().starts_with('-') {
            CostErrorKind::Negative(s.to_string())
        } else {
            CostErrorKind::BadNumber(s.to_string())
        };
        err(text, source, e.value, kind)
    })
}

/// 1-based line and column (in characters) of a byte offset.
fn line_col(text: &str, pos: usize) -> (usize, usize) {
    let before = &text[..pos.min(text.len())];
    let line = before.matches('\n').count() + 1;
    let line_start = before.rfind('\n').map_or(0, |i| i + 1);
    (line, before[line_start..].chars().count() + 1)
}

pub(super) fn err(
    text: &str,
    source: Option<&str>,
    span: (usize, usize),
    kind: CostErrorKind,
) -> CostError {
    let (line, col) = line_col(text, span.0);
    CostError {
        file: source.map(str::to_string),
        input: text.to_string(),
        start: span.0,
        end: span.1,
        line,
        col,
        kind,
    }
}

/// Why a cost spec was refused.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum CostErrorKind {
    #[error("expected `key=value`")]
    MissingEquals,
    #[error("missing key before `=`")]
    EmptyKey,
    #[error("unknown key `{0}` (known: {KEYS})")]
    UnknownKey(String),
    #[error("missing value for `{0}`")]
    EmptyValue(String),
    #[error("`{0}` is not a number")]
    BadNumber(String),
    #[error("`{0}` is not finite; costs are finite numbers (only `bw` may be `inf`)")]
    NotFinite(String),
    #[error("`{0}` is negative; costs and sizes are at least 0")]
    Negative(String),
    #[error("`{0}` is out of range; a cost or size is at most {MAX_VALUE:e} (pick a larger time unit), and a nonzero one at least {MIN_VALUE:e}")]
    OutOfRange(String),
    #[error("`bw` must be greater than 0 (use `inf` for free transfers)")]
    ZeroBandwidth,
    #[error("`overlap` must lie between 0 and 1")]
    OverlapRange,
    #[error("`{0}` is not a boolean; use `true` or `false`")]
    BadBool(String),
    #[error("unknown table `{0}`; the only table is `[model]`")]
    UnknownSection(String),
    #[error("the model is described twice (one `[model]` table per cost model)")]
    ModelTwice,
    #[error("unknown key `{0}` in `[model]` (known: {known})", known = MODEL_KEYS.join(", "))]
    UnknownModelKey(String),
    #[error("`{0}` describes the model: put it under a `[model]` line, after the cost keys")]
    ModelKeyOutside(String),
    #[error("`[model]` lacks {0} (required: hidden, ffn, heads, seq, vocab)")]
    MissingModelKeys(String),
    /// `` `KEY` must be WANT, not `VALUE` `` (one string keeps the error small).
    #[error("{0}")]
    BadModelValue(String),
    #[error("inconsistent model: {0}")]
    InconsistentModel(String),
    #[error("`{0}` is not a bandwidth: give activation units per time unit (`pcie = 2.5`), or bytes per second with a unit (`pcie = 25GB/s`)")]
    BadBandwidth(String),
    #[error("`pcie` must be greater than 0")]
    ZeroPcie,
    #[error("`{0}` is not a rank's time factor: it must be greater than 0 (1 is the costs as given, 1.5 a rank half again as slow)")]
    ZeroRankFactor(String),
    #[error("`pcie = {0}` is per second, but the costs' time unit is not known: add `time_unit = \"ms\"` (or `s`, `us`): what one cost unit is")]
    PcieNeedsTimeUnit(String),
    #[error("`pcie = {0}` is in bytes, but the activations are not: give `K.act` in bytes (`t.act = 1GiB`) or a `[model]` table, or `pcie` in activation units per time unit")]
    PcieNeedsBytes(String),
    #[error("`pcie = {0}` is per second, but the `[model]` table's times are in decoder-layer forwards, not in `time_unit`: add `tflops` (the TFLOP/s one GPU achieves) to `[model]` so its times are absolute, or give every pass time explicitly (`t.f`, `t.b`, `t.w`, `L.f`, ...), or give `pcie` in bytes per decoder-layer forward (a plain number)")]
    PcieNeedsTflops(String),
    #[error("`time_unit = {0}` comes after a `[model]` table with `tflops` whose times were derived in another unit: give `time_unit` in the same text as the table")]
    TimeUnitAfterTflops(String),
    #[error("`{0}` is not a time unit; use `s`, `ms` or `us`")]
    BadTimeUnit(String),
    #[error("`seq = {0}` is not a token count: `seq` is the whole number of tokens per microbatch the per-layer costs describe, at least 1")]
    BadSeq(String),
    /// `` `t.act_w` (3) is more than `t.act` (1) `` (one string keeps the error small).
    #[error("{0}: `act_w` is the part of a layer's activations kept from bwd_D to bwd_W, at most all of them")]
    ActWAboveAct(String),
    #[error("`{key}` is given twice (first at line {line}, column {col})")]
    Duplicate {
        key: String,
        line: usize,
        col: usize,
    },
}

/// A refused cost spec: where (byte range, line and column) and why.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
#[error("{}", self.render())]
pub struct CostError {
    /// The file the text came from, if any.
    pub file: Option<String>,
    pub input: String,
    /// Byte range of the offending text.
    pub start: usize,
    pub end: usize,
    /// 1-based line and column (characters) of `start`.
    pub line: usize,
    pub col: usize,
    pub kind: CostErrorKind,
}

impl CostError {
    /// The message, then the offending line with a caret under the fault:
    ///
    /// ```text
    /// invalid cost spec at column 5: unknown key `x` (known: ...)
    ///   f=1,x=2
    ///       ^
    /// ```
    pub fn render(&self) -> String {
        let whr = match &self.file {
            Some(path) => format!("invalid cost file {path}:{}:{}", self.line, self.col),
            None if self.input.contains('\n') => {
                format!(
                    "invalid cost spec at line {}, column {}",
                    self.line, self.col
                )
            }
            None => format!("invalid cost spec at column {}", self.col),
        };
        let line_text = self
            .input
            .split('\n')
            .nth(self.line - 1)
            .unwrap_or("")
            .trim_end_matches('\r');
        let shown: String = line_text
            .chars()
            .map(|c| if c.is_control() { ' ' } else { c })
            .collect();
        let width = self.input[self.start..self.end.max(self.start)]
            .chars()
            .take_while(|&c| c != '\n')
            .count()
            .max(1);
        format!(
            "{whr}: {}\n  {shown}\n  {}{}",
            self.kind,
            " ".repeat(self.col - 1),
            "^".repeat(width)
        )
    }
}
