//! The cost model the simulator and the views use: how long each pass of each stage takes and
//! what a message costs.
//!
//! # Keys
//!
//! A cost spec is a list of `key=value` entries separated by `,` or newlines; `#` starts a
//! comment that runs to the end of the line; spaces around keys and values are ignored. The
//! same text is accepted inline (`--cost f=1,b=1,w=1,p2p=0.05`) and in a file
//! (`--cost-file costs.toml`); a file written one entry per line is also valid TOML.
//!
//! | key | meaning | default |
//! |---|---|---|
//! | `f` | forward of one decoder layer (`t`) and one MTP layer (`m`) | `1` |
//! | `b` | input-gradient backward (`bwd_D`, torch `I`) of a `t` / `m` layer | `1` |
//! | `w` | weight-gradient backward (`bwd_W`, torch `W`) of a `t` / `m` layer | `1` |
//! | `K.f`, `K.b`, `K.w` for `K` in `E t m L` | the same for one layer kind; wins over `f`/`b`/`w` | `E`, `L`: `0`; `t`, `m`: as `f`/`b`/`w` |
//! | `floor` | time of any pass of a stage that holds no layers | `0` |
//! | `p2p` | latency of one point-to-point message | `0` |
//! | `msg` | size of one message (the activation or gradient of one microbatch at a stage boundary), in any unit | `1` |
//! | `bw` | bandwidth, in `msg` units per time unit; `inf` means transfers are free | `inf` |
//! | `rendezvous` | `true`: a send completes only once its recv is posted (NCCL's strictest behaviour); `false`: eager, a send completes when posted | `true` |
//! | `overlap` | how much of an overlapped `fwd_bwd` pair hides: the pair costs `max(F, B) + (1 - overlap) * min(F, B)` | `0` |
//! | `K.act` for `K` in `E t m L` | memory one microbatch's activations of one such layer keep alive from forward to weight gradient; a number, or bytes with a unit (`1.5GiB`, `300MB`) | `t`, `m`: `1`; `E`, `L`: `0` |
//! | `K.param` for `K` in `E t m L` | parameter plus optimizer memory of one such layer (same units as `act`) | `0` |
//!
//! A `[model]` table after the keys (hidden, ffn, heads, kv_heads, seq, micro_batch, vocab,
//! dtype, tp, cp, dp, sequence_parallel, distributed_optimizer, recompute, swiglu,
//! normalization) derives every kind's `f`/`b`/`w`/`act`/`param` from the model's shape
//! ([`super::model`]); keys given explicitly win.
//!
//! `act` and `param` are read by `pipec tune` only: a rank's peak memory is the `param` of
//! the layers of its stages plus the most `act`-weighted live activations at any instant.
//! A stage's pass costs the sum over its layers (the manifest's layout), so uneven layouts
//! cost what they should. A full `bwd` costs `bwd_D + bwd_W`. A message takes
//! `p2p + msg / bw`. Times are in "cost units": pick the unit you like (say milliseconds) and
//! give every key in it.
//!
//! Why these defaults: `F = B = W` per layer is the assumption of "Zero Bubble Pipeline
//! Parallelism" (Qi et al., 2024), which makes a full backward twice a forward as in the
//! Megatron-LM paper (Narayanan et al., 2021). `E` and `L` are free so that pipec's default
//! layout (one `t` per stage, `E` on the first, `L` on the last) gives identical stages, where
//! the published bubble formulas hold exactly. Communication is free by default for the same
//! reason. `overlap = 0` (a pair costs the sum of its parts) is the honest default: two passes
//! on one GPU share its compute; raise it for the communication the pair hides (DualPipe).

use super::model::{Dtype, ModelShape, Norm, Recompute, MODEL_KEYS, REQUIRED};
use crate::front::layout::{LayerKind, Layout};
use pipec_schedules::{Compute, Pass, StageId};
use serde::Serialize;
use std::fmt;
use thiserror::Error;

/// Cost of the three passes of one layer.
#[derive(Copy, Clone, Debug, PartialEq, Serialize)]
pub struct PassCost {
    /// Forward.
    pub f: f64,
    /// Input-gradient backward (`bwd_D`).
    pub b: f64,
    /// Weight-gradient backward (`bwd_W`).
    pub w: f64,
}

/// Memory of one layer: activations one microbatch keeps alive, and parameters + optimizer.
#[derive(Copy, Clone, Debug, PartialEq, Serialize)]
pub struct LayerMemory {
    pub act: f64,
    pub param: f64,
}

impl PassCost {
    pub const ZERO: PassCost = PassCost {
        f: 0.0,
        b: 0.0,
        w: 0.0,
    };
}

/// The four layer kinds in a fixed order, for dense per-kind tables.
pub const KINDS: [LayerKind; 4] = [
    LayerKind::Embedding,
    LayerKind::Decoder,
    LayerKind::Mtp,
    LayerKind::Loss,
];

fn kind_index(k: LayerKind) -> usize {
    match k {
        LayerKind::Embedding => 0,
        LayerKind::Decoder => 1,
        LayerKind::Mtp => 2,
        LayerKind::Loss => 3,
    }
}

/// A parsed cost model. See the module documentation for the keys and defaults. Serializes
/// with the spec's key names: `{"E": {"f":..,"b":..,"w":..}, "t": .., "m": .., "L": ..,
/// "floor", "p2p", "msg", "bw" (a number or "inf"), "rendezvous", "overlap"}`.
#[derive(Clone, Debug, PartialEq)]
pub struct CostModel {
    /// Per layer kind, in [`KINDS`] order (`E t m L`).
    pub layers: [PassCost; 4],
    pub floor: f64,
    pub p2p: f64,
    pub msg: f64,
    /// `f64::INFINITY` for free transfers.
    pub bw: f64,
    pub rendezvous: bool,
    pub overlap: f64,
    /// Per layer kind, in [`KINDS`] order: `K.act` and `K.param`.
    pub memory: [LayerMemory; 4],
    /// Whether `memory` is in bytes: some `K.act`/`K.param` was given with a byte unit
    /// (`1GiB`); plain numbers then count bytes too. Otherwise memory is counted in
    /// layer-activations ([`crate::memory`]).
    pub memory_bytes: bool,
    /// The `[model]` table the per-kind figures were derived from, if any.
    pub shape: Option<ModelShape>,
}

/// The default memory of the layer kinds: one unit of activations per decoder or MTP layer,
/// nothing for the embedding and the loss, no parameters.
pub const DEFAULT_MEMORY: [LayerMemory; 4] = [
    LayerMemory {
        act: 0.0,
        param: 0.0,
    },
    LayerMemory {
        act: 1.0,
        param: 0.0,
    },
    LayerMemory {
        act: 1.0,
        param: 0.0,
    },
    LayerMemory {
        act: 0.0,
        param: 0.0,
    },
];

impl Serialize for CostModel {
    fn serialize<S: serde::Serializer>(&self, ser: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut m = ser.serialize_map(Some(10))?;
        for k in KINDS {
            m.serialize_entry(&k.symbol().to_string(), &self.layer(k))?;
        }
        m.serialize_entry("floor", &self.floor)?;
        m.serialize_entry("p2p", &self.p2p)?;
        m.serialize_entry("msg", &self.msg)?;
        if self.bw.is_infinite() {
            m.serialize_entry("bw", "inf")?;
        } else {
            m.serialize_entry("bw", &self.bw)?;
        }
        m.serialize_entry("rendezvous", &self.rendezvous)?;
        m.serialize_entry("overlap", &self.overlap)?;
        // Only when given, so the output of specs without memory keys is unchanged.
        if self.memory != DEFAULT_MEMORY {
            let mem: std::collections::BTreeMap<String, LayerMemory> = KINDS
                .iter()
                .map(|&k| (k.symbol().to_string(), self.memory[kind_index(k)]))
                .collect();
            m.serialize_entry("memory", &mem)?;
        }
        if self.memory_bytes {
            m.serialize_entry("memory_unit", "bytes")?;
        }
        if let Some(shape) = &self.shape {
            m.serialize_entry("model", shape)?;
        }
        m.end()
    }
}

impl Default for CostModel {
    fn default() -> Self {
        let t = PassCost {
            f: 1.0,
            b: 1.0,
            w: 1.0,
        };
        CostModel {
            layers: [PassCost::ZERO, t, t, PassCost::ZERO],
            floor: 0.0,
            p2p: 0.0,
            msg: 1.0,
            bw: f64::INFINITY,
            rendezvous: true,
            overlap: 0.0,
            memory: DEFAULT_MEMORY,
            memory_bytes: false,
            shape: None,
        }
    }
}

impl CostModel {
    /// The costs of one layer kind.
    pub fn layer(&self, k: LayerKind) -> PassCost {
        self.layers[kind_index(k)]
    }

    /// The memory of one layer kind (`K.act`, `K.param`).
    pub fn layer_memory(&self, k: LayerKind) -> LayerMemory {
        self.memory[kind_index(k)]
    }

    /// Time of one message: `p2p + msg / bw`.
    pub fn transfer(&self) -> f64 {
        if self.bw.is_infinite() {
            self.p2p
        } else {
            self.p2p + self.msg / self.bw
        }
    }

    /// Parse an inline spec (`--cost`), starting from the defaults.
    pub fn parse(text: &str) -> Result<Self, CostError> {
        let mut m = CostModel::default();
        m.apply(text, None)?;
        Ok(m)
    }

    /// Apply the entries of `text` on top of this model. `source` names a file in errors.
    /// Per-kind keys win over `f`/`b`/`w` whatever their order; a key given twice in one text
    /// is an error.
    ///
    /// A `[model]` table derives every kind's `f`/`b`/`w`/`act`/`param` from the model's
    /// shape ([`super::model`]) before the text's own keys apply, so explicit keys win.
    pub fn apply(&mut self, text: &str, source: Option<&str>) -> Result<(), CostError> {
        let (entries, section) = entries(text, source)?;
        if let Some(sec) = section {
            if self.shape.is_some() {
                return Err(err(text, source, sec.header, CostErrorKind::ModelTwice));
            }
            let shape = parse_shape(text, source, &sec)?;
            let d = shape.derive();
            self.layers = d.layers;
            self.memory = d.memory;
            self.shape = Some(shape);
            // The shape gives memory in bytes.
            self.memory_bytes = true;
        }
        // Base keys first, then per-kind ones, so `t.f=2,f=1` means what it says.
        let mut base: [Option<f64>; 3] = [None; 3];
        for e in &entries {
            if let Key::Base(p) = e.key {
                base[p] = Some(number(text, source, e, false)?);
            }
        }
        for k in [LayerKind::Decoder, LayerKind::Mtp] {
            let c = &mut self.layers[kind_index(k)];
            for (p, v) in base.iter().enumerate() {
                if let Some(v) = *v {
                    *pass_mut(c, p) = v;
                }
            }
        }
        for e in &entries {
            match e.key {
                Key::Base(_) => {}
                Key::Kind(k, p) => {
                    *pass_mut(&mut self.layers[kind_index(k)], p) = number(text, source, e, false)?
                }
                Key::Mem(k, p) => {
                    let v = memory_value(text, source, e)?;
                    if parse_memory(&text[e.value.0..e.value.1]).is_ok_and(|(_, unit)| unit) {
                        self.memory_bytes = true;
                    }
                    let c = &mut self.memory[kind_index(k)];
                    if p == 0 {
                        c.act = v;
                    } else {
                        c.param = v;
                    }
                }
                Key::Floor => self.floor = number(text, source, e, false)?,
                Key::P2p => self.p2p = number(text, source, e, false)?,
                Key::Msg => self.msg = number(text, source, e, false)?,
                Key::Bw => {
                    let v = number(text, source, e, true)?;
                    if v == 0.0 {
                        return Err(err(text, source, e.value, CostErrorKind::ZeroBandwidth));
                    }
                    self.bw = v;
                }
                Key::Overlap => {
                    let v = number(text, source, e, false)?;
                    if v > 1.0 {
                        return Err(err(text, source, e.value, CostErrorKind::OverlapRange));
                    }
                    self.overlap = v;
                }
                Key::Rendezvous => {
                    let v = &text[e.value.0..e.value.1];
                    self.rendezvous = match v {
                        "true" => true,
                        "false" => false,
                        _ => {
                            return Err(err(
                                text,
                                source,
                                e.value,
                                CostErrorKind::BadBool(v.to_string()),
                            ))
                        }
                    };
                }
            }
        }
        // In bytes, an MTP layer not given keeps what a decoder layer keeps (as its f/b/w
        // do), not the 1-byte default of the unit-less model.
        let mtp = kind_index(LayerKind::Mtp);
        if self.memory_bytes
            && self.memory[mtp] == DEFAULT_MEMORY[mtp]
            && !entries
                .iter()
                .any(|e| matches!(e.key, Key::Mem(LayerKind::Mtp, _)))
        {
            self.memory[mtp] = self.memory[kind_index(LayerKind::Decoder)];
        }
        Ok(())
    }

    /// Every entry of this model as a spec [`CostModel::parse`] reads back to the same model
    /// (numbers in Rust's shortest round-trip form; memory in bytes carries the unit `B`).
    /// What a manifest records as the cost model a schedule was planned with.
    pub fn spec(&self) -> String {
        let mut parts = Vec::new();
        for k in KINDS {
            let c = self.layer(k);
            let y = k.symbol();
            parts.push(format!("{y}.f={},{y}.b={},{y}.w={}", c.f, c.b, c.w));
        }
        let unit = if self.memory_bytes { "B" } else { "" };
        for k in KINDS {
            let m = self.layer_memory(k);
            let y = k.symbol();
            parts.push(format!(
                "{y}.act={}{unit},{y}.param={}{unit}",
                m.act, m.param
            ));
        }
        parts.push(format!(
            "floor={},p2p={},msg={},bw={},rendezvous={},overlap={}",
            self.floor,
            self.p2p,
            self.msg,
            if self.bw.is_infinite() {
                "inf".to_string()
            } else {
                self.bw.to_string()
            },
            self.rendezvous,
            self.overlap
        ));
        parts.join(",")
    }

    /// A short one-line description, for headers: `f=1 b=1 w=1, p2p free, rendezvous`.
    pub fn describe(&self) -> String {
        let t = self.layer(LayerKind::Decoder);
        let mut s = format!("t: f={} b={} w={}", num(t.f), num(t.b), num(t.w));
        // Kinds that cost nothing are named: the embedding and the loss are free by default,
        // and a reader of a timeline should not take an idle last rank for the real thing.
        let free: Vec<char> = KINDS
            .iter()
            .filter(|&&k| k != LayerKind::Decoder && self.layer(k) == PassCost::ZERO)
            .map(|k| k.symbol())
            .collect();
        for k in KINDS {
            let c = self.layer(k);
            let default = CostModel::default().layer(k);
            if k != LayerKind::Decoder
                && c != default
                && c != PassCost::ZERO
                && !(k == LayerKind::Mtp && c == t)
            {
                s.push_str(&format!(
                    "; {}: f={} b={} w={}",
                    k.symbol(),
                    num(c.f),
                    num(c.b),
                    num(c.w)
                ));
            }
        }
        if let Some(shape) = &self.shape {
            // Derived kinds are never free: say what the embedding and the output layer carry.
            let e = self.layer_memory(LayerKind::Embedding);
            let l = self.layer_memory(LayerKind::Loss);
            s.push_str(&format!(
                "; from [model] {} (times in decoder-layer forwards; E: no matmul, param {}, act {}; L: param {}, act {}; t: param {}, act {})",
                shape.describe(),
                bytes(e.param),
                bytes(e.act),
                bytes(l.param),
                bytes(l.act),
                bytes(self.layer_memory(LayerKind::Decoder).param),
                bytes(self.layer_memory(LayerKind::Decoder).act),
            ));
        } else if !free.is_empty() {
            let list = |suffix: &str| {
                free.iter()
                    .map(|c| format!("{c}{suffix}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            };
            s.push_str(&format!(
                "; {} free (no cost given: set {})",
                list(""),
                list(".f")
            ));
        }
        if self.floor > 0.0 {
            s.push_str(&format!("; empty stage {}", num(self.floor)));
        }
        let x = self.transfer();
        if x == 0.0 {
            s.push_str("; p2p free");
        } else {
            s.push_str(&format!("; p2p {}", num(x)));
        }
        s.push_str(if self.rendezvous {
            "; rendezvous"
        } else {
            "; eager"
        });
        if self.overlap > 0.0 {
            s.push_str(&format!("; overlap {}", num(self.overlap)));
        }
        s
    }
}

/// Bytes for people, as `pipec tune` prints them: GiB from 1 GiB up, else MiB.
pub fn bytes(x: f64) -> String {
    let gib = x / (1u64 << 30) as f64;
    if gib >= 1.0 {
        format!("{gib:.2}GiB")
    } else {
        format!("{:.1}MiB", x / (1u64 << 20) as f64)
    }
}

/// A number printed without a trailing `.0`, at most 4 decimals.
pub fn num(x: f64) -> String {
    if x.is_infinite() {
        return "inf".to_string();
    }
    let s = format!("{x:.4}");
    let s = s.trim_end_matches('0').trim_end_matches('.');
    if s == "-0" {
        "0".to_string()
    } else {
        s.to_string()
    }
}

fn pass_mut(c: &mut PassCost, p: usize) -> &mut f64 {
    match p {
        0 => &mut c.f,
        1 => &mut c.b,
        _ => &mut c.w,
    }
}

/// The dense per-stage table the simulator reads: the cost of each pass of each stage.
#[derive(Clone, Debug, PartialEq)]
pub struct StageCosts {
    pub model: CostModel,
    fwd: Vec<f64>,
    bwd_d: Vec<f64>,
    bwd_w: Vec<f64>,
    /// False when the layout's stage count did not match the program's, and every stage was
    /// costed as one decoder layer instead.
    pub layout_used: bool,
    /// Per stage: `K.act` and `K.param` summed over its layers ([`crate::memory`]).
    pub act: Vec<f64>,
    pub param: Vec<f64>,
}

impl StageCosts {
    /// Cost every stage of a program with `num_stages` stages from its layout. A layout whose
    /// stage count differs (e.g. an imported schedule without one) is replaced by one `t` per
    /// stage, and `layout_used` says so.
    pub fn new(model: &CostModel, layout: &Layout, num_stages: u32) -> Self {
        let n = num_stages as usize;
        let layout_used = layout.stages.len() == n;
        let one_t = [LayerKind::Decoder];
        let mut fwd = Vec::with_capacity(n);
        let mut bwd_d = Vec::with_capacity(n);
        let mut bwd_w = Vec::with_capacity(n);
        let mut act = Vec::with_capacity(n);
        let mut param = Vec::with_capacity(n);
        for s in 0..n {
            let layers: &[LayerKind] = if layout_used {
                &layout.stages[s]
            } else {
                &one_t
            };
            act.push(layers.iter().map(|&k| model.layer_memory(k).act).sum());
            param.push(layers.iter().map(|&k| model.layer_memory(k).param).sum());
            if layers.is_empty() {
                fwd.push(model.floor);
                bwd_d.push(model.floor);
                bwd_w.push(model.floor);
                continue;
            }
            let mut c = PassCost::ZERO;
            for &k in layers {
                let l = model.layer(k);
                c.f += l.f;
                c.b += l.b;
                c.w += l.w;
            }
            fwd.push(c.f);
            bwd_d.push(c.b);
            bwd_w.push(c.w);
        }
        StageCosts {
            model: model.clone(),
            fwd,
            bwd_d,
            bwd_w,
            layout_used,
            act,
            param,
        }
    }

    /// Every stage costs `f`, `b`, `w` exactly (a uniform layout of one `t` per stage).
    pub fn uniform(model: &CostModel, num_stages: u32) -> Self {
        StageCosts::new(model, &Layout::uniform(0), num_stages)
    }

    pub fn num_stages(&self) -> u32 {
        self.fwd.len() as u32
    }

    /// The cost of one pass of one stage; `None` for a stage out of range.
    #[inline]
    pub fn pass(&self, pass: Pass, stage: StageId) -> Option<f64> {
        let s = stage.index();
        Some(match pass {
            Pass::Fwd => *self.fwd.get(s)?,
            Pass::BwdD => *self.bwd_d.get(s)?,
            Pass::BwdW => *self.bwd_w.get(s)?,
            Pass::Bwd => *self.bwd_d.get(s)? + *self.bwd_w.get(s)?,
        })
    }

    /// The cost of a compute op; an overlapped pair costs
    /// `max(F, B) + (1 - overlap) * min(F, B)`. `None` when a stage is out of range.
    #[inline]
    pub fn compute(&self, op: &Compute) -> Option<f64> {
        match *op {
            Compute::Fwd(t) => self.pass(Pass::Fwd, t.stage),
            Compute::Bwd(t) => self.pass(Pass::Bwd, t.stage),
            Compute::BwdD(t) => self.pass(Pass::BwdD, t.stage),
            Compute::BwdW(t) => self.pass(Pass::BwdW, t.stage),
            Compute::FwdBwd { fwd, bwd } => {
                let f = self.pass(Pass::Fwd, fwd.stage)?;
                let b = self.pass(Pass::Bwd, bwd.stage)?;
                Some(f.max(b) + (1.0 - self.model.overlap) * f.min(b))
            }
        }
    }

    /// Time of one message.
    pub fn transfer(&self) -> f64 {
        self.model.transfer()
    }
}

/// The largest cost or size a spec may give. Sums over a billion ops of this size stay far
/// from overflow and keep printable, meaningful figures; larger means a wrong unit.
pub const MAX_VALUE: f64 = 1e12;

/// The smallest nonzero cost or size: below it, sums of a billion ops lose their meaning.
pub const MIN_VALUE: f64 = 1e-9;

/// The keys a spec may hold, for error messages.
pub const KEYS: &str =
    "f, b, w, E.f, E.b, E.w, t.f, t.b, t.w, m.f, m.b, m.w, L.f, L.b, L.w, floor, p2p, msg, bw, rendezvous, overlap, K.act, K.param (K in E t m L)";

#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum Key {
    /// `f`, `b`, `w` as 0, 1, 2.
    Base(usize),
    Kind(LayerKind, usize),
    /// `K.act` (0) and `K.param` (1).
    Mem(LayerKind, usize),
    Floor,
    P2p,
    Msg,
    Bw,
    Rendezvous,
    Overlap,
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
        _ => {
            if let Some((k, p)) = s.split_once('.') {
                let mut chars = k.chars();
                let kind = LayerKind::from_symbol(chars.next()?)?;
                if chars.next().is_some() {
                    return None;
                }
                match p {
                    "act" => Key::Mem(kind, 0),
                    "param" => Key::Mem(kind, 1),
                    _ => Key::Kind(kind, pass(p)?),
                }
            } else {
                Key::Base(pass(s)?)
            }
        }
    })
}

/// One `key=value` entry: the parsed key and the byte ranges of key and value.
struct Entry {
    key: Key,
    value: (usize, usize),
}

/// Byte range of `s[lo..hi]` with surrounding whitespace removed.
fn trim(text: &str, lo: usize, hi: usize) -> (usize, usize) {
    let s = &text[lo..hi];
    let start = lo + (s.len() - s.trim_start().len());
    let end = hi - (s.len() - s.trim_end().len());
    (start, end.max(start))
}

/// The `[model]` table: where its header is, and its raw `key = value` entries (key and
/// value byte ranges), checked by [`parse_shape`].
struct Section {
    header: (usize, usize),
    entries: Vec<((usize, usize), (usize, usize))>,
}

fn entries(text: &str, source: Option<&str>) -> Result<(Vec<Entry>, Option<Section>), CostError> {
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
                let k = trim(text, a, a + eq);
                let v = trim(text, a + eq + 1, b);
                if k.0 == k.1 {
                    return Err(err(text, source, (a, a + 1), CostErrorKind::EmptyKey));
                }
                let name = &text[k.0..k.1];
                if v.0 == v.1 {
                    if section.is_some() {
                        if !MODEL_KEYS.split(", ").any(|x| x == name) {
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
                    let kind = if MODEL_KEYS.split(", ").any(|x| x == name) {
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
fn parse_shape(text: &str, source: Option<&str>, sec: &Section) -> Result<ModelShape, CostError> {
    type Span = (usize, usize);
    let mut seen: Vec<(&str, Span, Span)> = Vec::new();
    for &(k, v) in &sec.entries {
        let name = &text[k.0..k.1];
        if !MODEL_KEYS.split(", ").any(|x| x == name) {
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

/// The largest size or parallel degree a `[model]` key takes: 2^40.
pub const MAX_DIM: u64 = 1 << 40;

fn number(text: &str, source: Option<&str>, e: &Entry, allow_inf: bool) -> Result<f64, CostError> {
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

/// A memory value: a plain number, or bytes with a unit (`B`, `KB`, `MB`, `GB`, `TB`, `KiB`,
/// `MiB`, `GiB`, `TiB`).
fn memory_value(text: &str, source: Option<&str>, e: &Entry) -> Result<f64, CostError> {
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

/// The largest memory figure (bytes or units) a spec or limit may give: 1 EiB.
pub const MAX_MEMORY: f64 = 1.152921504606847e18;

/// Parse a memory figure: a plain non-negative number, or one followed by a byte unit (`B`,
/// `KB`, `MB`, `GB`, `TB` in powers of 1000, `KiB`, `MiB`, `GiB`, `TiB` in powers of 1024;
/// case of the letters ignored, a space allowed before the unit). Returns the value and
/// whether it had a unit.
pub fn parse_memory(s: &str) -> Result<(f64, bool), String> {
    let s = s.trim();
    if s.starts_with('-') {
        return Err(format!("`{s}` is negative; a memory size is at least 0"));
    }
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || matches!(c, '.' | '_' | 'e' | 'E' | '+')))
        .unwrap_or(s.len());
    // `1e3` is a number, `1EiB` a unit: an `e`/`E` followed by a letter starts the unit.
    let mut split = split;
    if let Some(i) = s[..split].find(['e', 'E']) {
        if s[i + 1..]
            .chars()
            .next()
            .is_some_and(|c| c.is_ascii_alphabetic())
        {
            split = i;
        }
    }
    let (num, unit) = (&s[..split], s[split..].trim());
    let bad =
        || format!("`{s}` is not a memory size (a number, or bytes with a unit such as 40GiB)");
    if num.is_empty() || !num.chars().next().unwrap().is_ascii_digit() && !num.starts_with('.') {
        return Err(bad());
    }
    let v: f64 = num.replace('_', "").parse().map_err(|_| bad())?;
    let scale = match unit.to_ascii_lowercase().as_str() {
        "" => 1.0,
        "b" => 1.0,
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "tb" => 1e12,
        "kib" => 1024.0,
        "mib" => 1024.0 * 1024.0,
        "gib" => 1024.0 * 1024.0 * 1024.0,
        "tib" => 1024.0 * 1024.0 * 1024.0 * 1024.0,
        _ => return Err(bad()),
    };
    let x = v * scale;
    if !x.is_finite() || !(0.0..=MAX_MEMORY).contains(&x) {
        return Err(bad());
    }
    Ok((x, !unit.is_empty()))
}

fn parse_bytes(s: &str) -> Result<f64, String> {
    parse_memory(s).map(|(v, _)| v)
}

/// 1-based line and column (in characters) of a byte offset.
fn line_col(text: &str, pos: usize) -> (usize, usize) {
    let before = &text[..pos.min(text.len())];
    let line = before.matches('\n').count() + 1;
    let line_start = before.rfind('\n').map_or(0, |i| i + 1);
    (line, before[line_start..].chars().count() + 1)
}

fn err(text: &str, source: Option<&str>, span: (usize, usize), kind: CostErrorKind) -> CostError {
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
    #[error("unknown key `{0}` in `[model]` (known: {MODEL_KEYS})")]
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

impl fmt::Display for PassCost {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "f={} b={} w={}", num(self.f), num(self.b), num(self.w))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn defaults_and_keys() {
        let m = CostModel::parse("").unwrap();
        assert_eq!(m, CostModel::default());
        let m = CostModel::parse("f=2, b=3 ,w=0.5,t.f=4,E.f=0.25,p2p=0.05,bw=10,msg=2").unwrap();
        assert_eq!(
            m.layer(LayerKind::Decoder),
            PassCost {
                f: 4.0,
                b: 3.0,
                w: 0.5
            }
        );
        assert_eq!(
            m.layer(LayerKind::Mtp),
            PassCost {
                f: 2.0,
                b: 3.0,
                w: 0.5
            }
        );
        assert_eq!(m.layer(LayerKind::Embedding).f, 0.25);
        assert_eq!(m.layer(LayerKind::Loss), PassCost::ZERO);
        assert!((m.transfer() - 0.25).abs() < 1e-12);
        // Per-kind keys win whatever the order.
        let m = CostModel::parse("t.f=4,f=2").unwrap();
        assert_eq!(m.layer(LayerKind::Decoder).f, 4.0);
        assert_eq!(m.layer(LayerKind::Mtp).f, 2.0);
        let m = CostModel::parse("rendezvous=false,overlap=1,bw=inf,floor=0.1").unwrap();
        assert!(!m.rendezvous);
        assert_eq!(m.overlap, 1.0);
        assert_eq!(m.transfer(), 0.0);
        assert_eq!(m.floor, 0.1);
    }

    #[test]
    fn memory_keys_take_numbers_and_byte_units() {
        let m = CostModel::parse("t.act=2, E.param=1.5GiB, L.act=300MB, t.param = 1e3").unwrap();
        assert_eq!(m.layer_memory(LayerKind::Decoder).act, 2.0);
        assert_eq!(m.layer_memory(LayerKind::Decoder).param, 1000.0);
        assert_eq!(
            m.layer_memory(LayerKind::Embedding).param,
            1.5 * 1024.0 * 1024.0 * 1024.0
        );
        assert_eq!(m.layer_memory(LayerKind::Loss).act, 3e8);
        // Bytes given: the model is in bytes, and an MTP layer keeps what a decoder layer does.
        assert!(m.memory_bytes);
        assert_eq!(
            m.layer_memory(LayerKind::Mtp),
            m.layer_memory(LayerKind::Decoder)
        );
        assert!(!CostModel::parse("t.act=2").unwrap().memory_bytes);
        // The manifest's spec reads back to the same model.
        for spec in [
            "t.act=2, E.param=1.5GiB, L.act=300MB, t.param = 1e3, bw=3, p2p=0.1",
            "f=1.1,E.f=2,overlap=0.5,rendezvous=false",
            "",
        ] {
            let a = CostModel::parse(spec).unwrap();
            assert_eq!(CostModel::parse(&a.spec()).unwrap(), a, "{spec}");
        }
        assert_eq!(
            CostModel::parse("t.act=lots").unwrap_err().kind,
            CostErrorKind::BadNumber("lots".into())
        );
        assert_eq!(
            parse_memory("40GiB"),
            Ok((40.0 * (1u64 << 30) as f64, true))
        );
        assert_eq!(parse_memory("12"), Ok((12.0, false)));
        assert_eq!(parse_memory("2 kb"), Ok((2000.0, true)));
        assert!(parse_memory("-1").is_err());
        assert!(parse_memory("4 parsecs").is_err());
        assert!(parse_memory("").is_err());
        // Without memory keys the JSON form is what it was.
        let j = serde_json::to_value(CostModel::default()).unwrap();
        assert!(j.get("memory").is_none());
        let j = serde_json::to_value(m).unwrap();
        assert_eq!(j["memory"]["t"]["act"], 2.0);
    }

    #[test]
    fn file_form_with_comments_and_lines() {
        let text =
            "# costs measured on H100\nf = 1.5   # ms\nb = 2\n\nt.w = 1\nrendezvous = false\n";
        let mut m = CostModel::default();
        m.apply(text, Some("c.toml")).unwrap();
        assert_eq!(m.layer(LayerKind::Decoder).f, 1.5);
        assert_eq!(m.layer(LayerKind::Decoder).w, 1.0);
        assert!(!m.rendezvous);
        let e = CostModel::default()
            .apply("f = 1\nq = 2\n", Some("c.toml"))
            .unwrap_err();
        assert_eq!((e.line, e.col), (2, 1));
        assert!(e
            .render()
            .starts_with("invalid cost file c.toml:2:1: unknown key `q`"));
    }

    #[test]
    fn errors_point_at_the_fault() {
        let e = CostModel::parse("f=1,x=2").unwrap_err();
        assert_eq!(e.kind, CostErrorKind::UnknownKey("x".into()));
        assert_eq!((e.start, e.col), (4, 5));
        assert_eq!(
            e.render().lines().skip(1).collect::<Vec<_>>(),
            vec!["  f=1,x=2", "      ^"]
        );
        let e = CostModel::parse("f=abc").unwrap_err();
        assert_eq!(e.kind, CostErrorKind::BadNumber("abc".into()));
        assert!(e.render().ends_with("  f=abc\n    ^^^"));
        assert_eq!(
            CostModel::parse("f=-1").unwrap_err().kind,
            CostErrorKind::Negative("-1".into())
        );
        assert_eq!(
            CostModel::parse("f=NaN").unwrap_err().kind,
            CostErrorKind::BadNumber("NaN".into())
        );
        assert_eq!(
            CostModel::parse("f=1e999").unwrap_err().kind,
            CostErrorKind::NotFinite("1e999".into())
        );
        assert_eq!(
            CostModel::parse("bw=0").unwrap_err().kind,
            CostErrorKind::ZeroBandwidth
        );
        assert_eq!(
            CostModel::parse("overlap=2").unwrap_err().kind,
            CostErrorKind::OverlapRange
        );
        assert_eq!(
            CostModel::parse("rendezvous=yes").unwrap_err().kind,
            CostErrorKind::BadBool("yes".into())
        );
        assert_eq!(
            CostModel::parse("f").unwrap_err().kind,
            CostErrorKind::MissingEquals
        );
        assert_eq!(
            CostModel::parse("=1").unwrap_err().kind,
            CostErrorKind::EmptyKey
        );
        assert_eq!(
            CostModel::parse("f=").unwrap_err().kind,
            CostErrorKind::EmptyValue("f".into())
        );
        let e = CostModel::parse("f=1, f=2").unwrap_err();
        assert_eq!(
            e.kind,
            CostErrorKind::Duplicate {
                key: "f".into(),
                line: 1,
                col: 1
            }
        );
        assert_eq!(e.col, 6);
        assert_eq!(
            CostModel::parse("X.f=1").unwrap_err().kind,
            CostErrorKind::UnknownKey("X.f".into())
        );
        assert_eq!(
            CostModel::parse("tt.f=1").unwrap_err().kind,
            CostErrorKind::UnknownKey("tt.f".into())
        );
    }

    #[test]
    fn stage_costs_follow_the_layout() {
        let m = CostModel::parse("f=1,b=2,w=1,E.f=0.5,L.f=0.25,L.b=0.5,floor=0.1").unwrap();
        let layout = crate::front::layout::parse("Ett|t||tL").unwrap();
        let c = StageCosts::new(&m, &layout, 4);
        assert!(c.layout_used);
        assert_eq!(c.pass(Pass::Fwd, StageId(0)), Some(2.5));
        assert_eq!(c.pass(Pass::Fwd, StageId(1)), Some(1.0));
        assert_eq!(c.pass(Pass::Fwd, StageId(2)), Some(0.1));
        assert_eq!(c.pass(Pass::Fwd, StageId(3)), Some(1.25));
        assert_eq!(c.pass(Pass::BwdD, StageId(3)), Some(2.5));
        assert_eq!(c.pass(Pass::Bwd, StageId(1)), Some(3.0));
        assert_eq!(c.pass(Pass::Fwd, StageId(4)), None);
        let pair = Compute::FwdBwd {
            fwd: pipec_schedules::Task::new(1, 0),
            bwd: pipec_schedules::Task::new(1, 1),
        };
        assert_eq!(c.compute(&pair), Some(4.0));
        let m = CostModel::parse("overlap=0.5").unwrap();
        let c = StageCosts::uniform(&m, 2);
        assert_eq!(c.compute(&pair), Some(2.0 + 0.5));
        // A layout that does not fit falls back to one `t` per stage.
        let c = StageCosts::new(&CostModel::default(), &layout, 6);
        assert!(!c.layout_used);
        assert_eq!(c.pass(Pass::Bwd, StageId(5)), Some(2.0));
    }

    proptest! {
        #[test]
        fn parse_never_panics(s in "\\PC{0,40}") {
            if let Err(e) = CostModel::parse(&s) {
                prop_assert!(e.start <= e.end && e.end <= s.len());
                prop_assert!(s.is_char_boundary(e.start) && s.is_char_boundary(e.end));
                let _ = e.render();
            }
        }

        #[test]
        fn parse_never_panics_on_near_misses(
            parts in proptest::collection::vec(
                ("(f|b|w|[EtmLx]\\.[fbwz]|p2p|bw|msg|floor|overlap|rendezvous| |)",
                 "( |=|==|)",
                 "(-?[0-9]{0,3}(\\.[0-9]{0,2})?|inf|true|false|1e400|#|\n| )"),
                0..6)
        ) {
            let s: String = parts.iter().map(|(k, e, v)| format!("{k}{e}{v}")).collect::<Vec<_>>().join(",");
            match CostModel::parse(&s) {
                Ok(m) => {
                    prop_assert!(m.layers.iter().all(|c| c.f >= 0.0 && c.b >= 0.0 && c.w >= 0.0));
                    prop_assert!(m.bw > 0.0 && (0.0..=1.0).contains(&m.overlap));
                }
                Err(e) => {
                    prop_assert!(e.end <= s.len());
                    let _ = e.render();
                }
            }
        }
    }
}
