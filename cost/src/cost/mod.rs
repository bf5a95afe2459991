//! The cost model the simulator and the views use: how long each pass of each stage takes and
//! what a message costs.
//!
//! # Keys
//!
//! A cost spec is a list of `key=value` entries separated by `,` or newlines; `#` starts a
//! comment that runs to the end of the line; spaces around keys and values are ignored. The
//! same text is accepted inline (`--cost f=1,b=1,w=1,p2p=0.05`) and in a file
//! (`--cost-file costs.toml`). Keys and values may be TOML strings (`"t.act" = "1.5GiB"`,
//! `pcie = "25GB/s"`), read as their bare forms, so a file a TOML library writes from a map
//! of these keys is a cost file, and a file written one entry per line with quoted sizes is
//! valid TOML.
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
//! | `K.act_w` for `K` in `E t m L` | the part of `K.act` kept from `bwd_D` to `bwd_W` (the inputs of the layer's weight-gradient GEMMs): `bwd_D` frees `act - act_w`, `bwd_W` the rest, a fused `bwd` all of it; at most `K.act` | `K.act`; a `[model]` table derives it (Korthikanti et al. 2022's list) |
//! | `K.param` for `K` in `E t m L` | parameter plus optimizer memory of one such layer (same units as `act`) | `0` |
//! | `offload`, `K.offload` | time to copy one layer's activations of one microbatch to or from host memory, one way (`offload`: `t` and `m`) | `K.act / pcie` when `pcie` is given, else one forward of the layer |
//! | `pcie` | host-link bandwidth: activation units per time unit, or bytes per second (`25GB/s`, with activations in bytes and `time_unit`; with a `[model]` table, its `tflops` or every pass time given) | none |
//! | `offload_pair` | `true`: ranks `2k` and `2k+1` share one host link, as PipeOffload assumes: a copy takes `offload / 0.7` while the partner copies too, and pipec gives every copy that time (an upper bound) | `false` |
//! | `time_unit` | what one cost unit is, `s`, `ms` or `us` (needed for `pcie` per second); the unit `[model]` `tflops` times are derived in | none (`s` with `tflops`) |
//! | `split_extra` | a split backward's halves (`bwd_D`, `bwd_W`) each take `1 + split_extra` times their `b` and `w`; a whole `bwd` keeps `b + w`: a framework whose split recomputes work pays it (Megatron's linear layers compute both gradients in one autograd function, so pipec's split runs them twice, docs/megatron.md) | `0`; `pipec tune --target megatron` takes [`MEGATRON_SPLIT_EXTRA`] unless given |
//! | `rank.R` | rank `R`'s compute takes this many times its layers' costs (a slower or busier device; PipeOffload's heavy first and last ranks); copies and messages keep their time | `1` |
//! | `K.attn_f`, `K.attn_b`, `K.attn_w` for `K` in `E t m L` | the attention core's part of each pass for one causal sequence of `seq` tokens: a pass of a `seq`-token microbatch costs `K.f + K.attn_f`; with lengths it scales by the sum of each sequence's `(length / seq)^2` (the `lengths` module) | `0`; a `[model]` table derives them |
//! | `seq` | tokens per microbatch that the per-layer keys describe (a whole number, at least 1); with lengths the linear parts scale by `tokens / seq` | the `[model]` table's `seq`, else the longest microbatch |
//!
//! A `[model]` table after the keys (hidden, ffn, heads, kv_heads, seq, micro_batch, vocab,
//! dtype, tp, cp, dp, sequence_parallel, distributed_optimizer, recompute, swiglu,
//! normalization, tflops) derives every kind's `f`/`b`/`w`/`attn_*`/`act`/`param` from the
//! model's shape ([`super::model`]): times in decoder-layer forwards, or with `tflops` (the
//! TFLOP/s one GPU achieves) in seconds or `time_unit`; keys given explicitly win (a pass given without its `attn_*`
//! key is the whole pass: the derived attention part is dropped).
//!
//! `act` and `param` are read by every peak-memory figure (`crate::memory::weights` turns them
//! into the verifier's weights: `compile`, `check`, `show`, `simulate`, `compare`, `tune`,
//! `pipec-run`'s static figure and Python), never by the timing: a rank's peak memory is the
//! `param` of the layers of its stages plus the most `act`-weighted live activations at any
//! instant.
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

mod lang;
mod units;

pub use lang::{CostError, CostErrorKind, KEYS, MAX_VALUE, MIN_VALUE};
pub use units::{bytes, parse_memory, MAX_MEMORY};

use crate::layer::{LayerMemory, PassCost};
use crate::model::ModelShape;
use lang::{entries, err, memory_value, number, parse_shape, Key};
use pipec_ir::human::num;
use pipec_schedules::layout::{LayerKind, Layout};
use pipec_schedules::{Compute, Pass, StageId};
use serde::Serialize;
use std::fmt;

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
    /// Per layer kind, in [`KINDS`] order (`E t m L`): the linear parts of the passes
    /// (`K.f`, `K.b`, `K.w`), which scale with a microbatch's tokens. [`CostModel::layer`]
    /// is a pass's whole time at `seq` tokens (these plus `attn`).
    pub layers: [PassCost; 4],
    /// Per layer kind: the attention core's parts (`K.attn_f`, `K.attn_b`, `K.attn_w`) for
    /// one causal sequence of `seq` tokens, which scale with the sum over a microbatch's
    /// sequences of `(length / seq)^2` (the `lengths` module).
    pub attn: [PassCost; 4],
    /// `seq`: the tokens per microbatch the per-layer keys describe, when given (else the
    /// `[model]` table's; see the `lengths` module's `Scale`).
    pub seq: Option<u64>,
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
    /// layer-activations ([`pipec_ir::memory`]).
    pub memory_bytes: bool,
    /// The `[model]` table the per-kind figures were derived from, if any.
    pub shape: Option<ModelShape>,
    /// Activation offload (issue #30): `K.offload` per kind in [`KINDS`] order, the time one
    /// layer's activations of one microbatch take to copy to or from the host.
    pub offload: [Option<f64>; 4],
    /// `pcie`: host-link bandwidth in memory units (bytes when `memory_bytes`) per time unit.
    pub pcie: Option<f64>,
    /// `offload_pair`: ranks `2k` and `2k+1` share one host link (PipeOffload's assumption).
    pub offload_pair: bool,
    /// `time_unit`: seconds per cost unit, when given (`s`, `ms`, `us`).
    pub time_unit: Option<f64>,
    /// `rank.R`: per rank, the factor its compute takes over its layers' costs (absent: 1).
    pub rank_factor: std::collections::BTreeMap<u32, f64>,
    /// Per layer kind ([`KINDS`] order) and pass (`f`, `b`, `w`): whether the time is still
    /// the one a `[model]` table without `tflops` derived, in decoder-layer forwards rather
    /// than in any time unit. A bandwidth per second cannot be set against such times.
    pub in_forwards: [[bool; 3]; 4],
    /// `split_extra`: a split backward's halves take `1 + split_extra` times `b` and `w`
    /// ([`StageCosts::pass`]); `None`: 0.
    pub split_extra: Option<f64>,
}

/// The `split_extra` `pipec tune --target megatron` costs split backward with when the costs
/// do not give one: pipec's split on Megatron's linear layers (whose autograd function computes
/// the input and the weight gradient together) runs each linear backward twice, once in
/// `bwd_D` and once in `bwd_W` (docs/megatron.md, "Split backward"). The figure is a GPT
/// layer's `(bwd_D + bwd_W) / fused backward - 1` measured with megatron-core's own linear
/// function on CPU by `bench/megatron_split_backward.py` (its result: bench/HISTORY.md); a GPU
/// job should measure its own and give `split_extra`.
pub const MEGATRON_SPLIT_EXTRA: f64 = 0.88;

/// The default memory of the layer kinds: one unit of activations per decoder or MTP layer,
/// nothing for the embedding and the loss, no parameters.
pub const DEFAULT_MEMORY: [LayerMemory; 4] = [
    LayerMemory {
        act: 0.0,
        param: 0.0,
        act_w: None,
    },
    LayerMemory {
        act: 1.0,
        param: 0.0,
        act_w: None,
    },
    LayerMemory {
        act: 1.0,
        param: 0.0,
        act_w: None,
    },
    LayerMemory {
        act: 0.0,
        param: 0.0,
        act_w: None,
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
        // Offload keys only when given, as memory: older outputs stay byte-identical.
        if self.offload.iter().any(Option::is_some) {
            let o: std::collections::BTreeMap<String, f64> = KINDS
                .iter()
                .filter_map(|&k| Some((k.symbol().to_string(), self.offload[kind_index(k)]?)))
                .collect();
            m.serialize_entry("offload", &o)?;
        }
        if let Some(p) = self.pcie {
            m.serialize_entry("pcie", &p)?;
        }
        if self.offload_pair {
            m.serialize_entry("offload_pair", &true)?;
        }
        if let Some(u) = self.time_unit {
            m.serialize_entry("time_unit_seconds", &u)?;
        }
        // Attention parts and `seq` only when given as keys (a `[model]` table's are its
        // own: the shape above derives them), so older outputs stay byte-identical.
        let derived = self
            .shape
            .as_ref()
            .map(|s| s.derive_in(self.time_unit).attn);
        if self.attn != derived.unwrap_or([PassCost::ZERO; 4]) {
            let a: std::collections::BTreeMap<String, PassCost> = KINDS
                .iter()
                .map(|&k| (k.symbol().to_string(), self.attention(k)))
                .collect();
            m.serialize_entry("attn", &a)?;
        }
        if let Some(seq) = self.seq {
            m.serialize_entry("seq", &seq)?;
        }
        if let Some(x) = self.split_extra {
            m.serialize_entry("split_extra", &x)?;
        }
        if !self.rank_factor.is_empty() {
            let r: std::collections::BTreeMap<String, f64> = self
                .rank_factor
                .iter()
                .map(|(r, f)| (r.to_string(), *f))
                .collect();
            m.serialize_entry("rank_factor", &r)?;
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
            attn: [PassCost::ZERO; 4],
            seq: None,
            floor: 0.0,
            p2p: 0.0,
            msg: 1.0,
            bw: f64::INFINITY,
            rendezvous: true,
            overlap: 0.0,
            memory: DEFAULT_MEMORY,
            memory_bytes: false,
            shape: None,
            offload: [None; 4],
            pcie: None,
            offload_pair: false,
            time_unit: None,
            rank_factor: std::collections::BTreeMap::new(),
            in_forwards: [[false; 3]; 4],
            split_extra: None,
        }
    }
}

impl CostModel {
    /// The costs of one layer kind for a microbatch of `seq` tokens (one sequence): the
    /// linear part plus the attention part of each pass.
    pub fn layer(&self, k: LayerKind) -> PassCost {
        let (l, a) = (self.layers[kind_index(k)], self.attn[kind_index(k)]);
        PassCost {
            f: l.f + a.f,
            b: l.b + a.b,
            w: l.w + a.w,
        }
    }

    /// The linear parts of one layer kind's passes (`K.f`, `K.b`, `K.w`).
    pub fn linear(&self, k: LayerKind) -> PassCost {
        self.layers[kind_index(k)]
    }

    /// The attention parts of one layer kind's passes (`K.attn_f`, `K.attn_b`, `K.attn_w`).
    pub fn attention(&self, k: LayerKind) -> PassCost {
        self.attn[kind_index(k)]
    }

    /// The tokens per microbatch the per-layer keys describe, when the model says: the `seq`
    /// key, else the `[model]` table's `seq`.
    pub fn given_seq(&self) -> Option<u64> {
        self.seq.or(self.shape.as_ref().map(|s| s.seq))
    }

    /// The memory of one layer kind (`K.act`, `K.param`, `K.act_w`).
    pub fn layer_memory(&self, k: LayerKind) -> LayerMemory {
        self.memory[kind_index(k)]
    }

    /// This model with every kind keeping all of its activations until `bwd_W` (`K.act_w`
    /// dropped): for a runtime whose split backward frees nothing at `bwd_D`.
    pub fn without_act_w(&self) -> CostModel {
        let mut m = self.clone();
        for k in m.memory.iter_mut() {
            k.act_w = None;
        }
        m
    }

    /// Whether some kind keeps less than all its activations from `bwd_D` to `bwd_W`
    /// (`K.act_w` given or derived below `K.act`). Without, every figure is as before the
    /// key existed.
    pub fn has_act_w(&self) -> bool {
        self.memory.iter().any(|m| m.kept_for_w() < m.act)
    }

    /// Time of one message: `p2p + msg / bw`.
    pub fn transfer(&self) -> f64 {
        if self.bw.is_infinite() {
            self.p2p
        } else {
            self.p2p + self.msg / self.bw
        }
    }

    /// Time to copy one layer's activations of one microbatch between device and host, one
    /// way: `K.offload` when given; else `K.act / pcie` when the link's bandwidth is; else one
    /// forward of the layer (PipeOffload's experiments span 0.25 to 3 forwards).
    pub fn offload_time(&self, k: LayerKind) -> f64 {
        match (self.offload[kind_index(k)], self.pcie) {
            (Some(t), _) => t,
            (None, Some(bw)) => self.layer_memory(k).act / bw,
            (None, None) => self.layer(k).f,
        }
    }

    /// Whether a copy's speed is stated (`pcie`, `offload` or some `K.offload`); without one,
    /// [`CostModel::offload_time`] takes a copy to last one forward, and `tune` says so.
    pub fn copy_speed_given(&self) -> bool {
        self.pcie.is_some() || self.offload.iter().any(Option::is_some)
    }

    /// `pcie`'s value in memory units per time unit: a plain number as it is, or bytes per
    /// second (`25GB/s`, `/ms`, `/us` also) through `time_unit`, with activations in bytes.
    fn bandwidth(
        &self,
        text: &str,
        source: Option<&str>,
        e: &lang::Entry,
    ) -> Result<f64, CostError> {
        let s = &text[e.value.0..e.value.1];
        let fail = |kind| Err(err(text, source, e.value, kind));
        let v = match s.split_once('/') {
            None => number(text, source, e, false)?,
            Some((size, per)) => {
                let Ok((bytes, _)) = parse_memory(size) else {
                    return fail(CostErrorKind::BadBandwidth(s.to_string()));
                };
                let per = match per.trim() {
                    "s" => 1.0,
                    "ms" => 1e-3,
                    "us" => 1e-6,
                    _ => return fail(CostErrorKind::BadBandwidth(s.to_string())),
                };
                if !self.memory_bytes {
                    return fail(CostErrorKind::PcieNeedsBytes(s.to_string()));
                }
                if self.in_forwards.iter().flatten().any(|&x| x) {
                    return fail(CostErrorKind::PcieNeedsTflops(s.to_string()));
                }
                let Some(unit) = self.time_unit else {
                    return fail(CostErrorKind::PcieNeedsTimeUnit(s.to_string()));
                };
                bytes / per * unit
            }
        };
        if v == 0.0 {
            return fail(CostErrorKind::ZeroPcie);
        }
        Ok(v)
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
        // `time_unit` first: a `[model]` table with `tflops` derives its times in it.
        for e in &entries {
            if e.key == Key::TimeUnit {
                let v = &text[e.value.0..e.value.1];
                let unit = match v {
                    "s" => 1.0,
                    "ms" => 1e-3,
                    "us" => 1e-6,
                    _ => {
                        return Err(err(
                            text,
                            source,
                            e.value,
                            CostErrorKind::BadTimeUnit(v.to_string()),
                        ))
                    }
                };
                // Times an earlier text derived from `tflops` are in the unit they were
                // derived in; a later text cannot change it under them.
                let earlier = self.shape.as_ref().and_then(|s| s.tflops);
                if earlier.is_some() && self.time_unit != Some(unit) {
                    return Err(err(
                        text,
                        source,
                        e.value,
                        CostErrorKind::TimeUnitAfterTflops(v.to_string()),
                    ));
                }
                self.time_unit = Some(unit);
            }
        }
        if let Some(sec) = section {
            if self.shape.is_some() {
                return Err(err(text, source, sec.header, CostErrorKind::ModelTwice));
            }
            let shape = parse_shape(text, source, &sec)?;
            let d = shape.derive_in(self.time_unit);
            if shape.tflops.is_some() {
                // Absolute times: seconds unless the text says otherwise.
                self.time_unit = self.time_unit.or(Some(1.0));
            } else {
                for k in KINDS {
                    let (l, a) = (d.layers[kind_index(k)], d.attn[kind_index(k)]);
                    self.in_forwards[kind_index(k)] =
                        [l.f + a.f != 0.0, l.b + a.b != 0.0, l.w + a.w != 0.0];
                }
            }
            self.layers = d.layers;
            self.attn = d.attn;
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
                    self.in_forwards[kind_index(k)][p] = false;
                }
            }
        }
        let mut pcie: Option<&lang::Entry> = None;
        for e in &entries {
            match e.key {
                Key::Base(_) => {}
                Key::Offload(None) => {
                    let v = number(text, source, e, false)?;
                    for k in [LayerKind::Decoder, LayerKind::Mtp] {
                        // A per-kind key wins whatever the order.
                        if !entries.iter().any(|x| x.key == Key::Offload(Some(k))) {
                            self.offload[kind_index(k)] = Some(v);
                        }
                    }
                }
                Key::Offload(Some(k)) => {
                    self.offload[kind_index(k)] = Some(number(text, source, e, false)?)
                }
                Key::Pcie => pcie = Some(e),
                Key::OffloadPair => self.offload_pair = boolean(text, source, e)?,
                Key::Rank(r) => {
                    let v = number(text, source, e, false)?;
                    if v == 0.0 {
                        let s = text[e.value.0..e.value.1].to_string();
                        return Err(err(text, source, e.value, CostErrorKind::ZeroRankFactor(s)));
                    }
                    self.rank_factor.insert(r, v);
                }
                // Read before the `[model]` table, above.
                Key::TimeUnit => {}
                Key::Kind(k, p) => {
                    *pass_mut(&mut self.layers[kind_index(k)], p) = number(text, source, e, false)?;
                    self.in_forwards[kind_index(k)][p] = false;
                }
                Key::Attn(k, p) => {
                    *pass_mut(&mut self.attn[kind_index(k)], p) = number(text, source, e, false)?
                }
                Key::Seq => self.seq = Some(lang::seq_value(text, source, e)?),
                Key::Mem(k, p) => {
                    let v = memory_value(text, source, e)?;
                    if parse_memory(&text[e.value.0..e.value.1]).is_ok_and(|(_, unit)| unit) {
                        self.memory_bytes = true;
                    }
                    let c = &mut self.memory[kind_index(k)];
                    match p {
                        0 => {
                            // A `[model]` table's derived `act_w` keeps its share of the
                            // activations when `K.act` is given without `K.act_w`.
                            let given_w = entries.iter().any(|x| x.key == Key::Mem(k, 2));
                            if !given_w {
                                c.act_w = c.act_w.filter(|_| c.act > 0.0).map(|w| v * (w / c.act));
                            }
                            c.act = v;
                        }
                        1 => c.param = v,
                        _ => c.act_w = Some(v),
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
                Key::Rendezvous => self.rendezvous = boolean(text, source, e)?,
                Key::SplitExtra => self.split_extra = Some(number(text, source, e, false)?),
            }
        }
        if let Some(e) = pcie {
            self.pcie = Some(self.bandwidth(text, source, e)?);
        }
        // `K.act_w` is a part of `K.act`: `bwd_D` frees `act - act_w`, never a negative amount.
        for k in KINDS {
            let m = self.memory[kind_index(k)];
            if m.act_w.is_some_and(|w| w > m.act) {
                let at = entries
                    .iter()
                    .rev()
                    .find(|e| e.key == Key::Mem(k, 2))
                    .or_else(|| entries.iter().rev().find(|e| e.key == Key::Mem(k, 0)));
                let span = at.map_or((0, 0), |e| e.value);
                return Err(err(
                    text,
                    source,
                    span,
                    CostErrorKind::ActWAboveAct(format!(
                        "`{y}.act_w` ({}) is more than `{y}.act` ({})",
                        num(m.kept_for_w()),
                        num(m.act),
                        y = k.symbol()
                    )),
                ));
            }
        }
        // With a `[model]` table, a pass given explicitly (`t.f`, or `f` for `t` and `m`)
        // without its attention key is the whole pass, as measured: the attention part the
        // shape derived is dropped, so `t.f = 2.5` still costs 2.5 at `seq` tokens.
        if self.shape.is_some() {
            for k in KINDS {
                for p in 0..3 {
                    let given = entries.iter().any(|e| {
                        e.key == Key::Kind(k, p)
                            || (e.key == Key::Base(p)
                                && matches!(k, LayerKind::Decoder | LayerKind::Mtp))
                    });
                    if given && !entries.iter().any(|e| e.key == Key::Attn(k, p)) {
                        *pass_mut(&mut self.attn[kind_index(k)], p) = 0.0;
                    }
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
            let c = self.linear(k);
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
        // Offload keys only when given (a manifest written without them is unchanged).
        for k in KINDS {
            if let Some(o) = self.offload[kind_index(k)] {
                parts.push(format!("{}.offload={o}", k.symbol()));
            }
        }
        if let Some(u) = self.time_unit {
            parts.push(format!("time_unit={}", unit_name(u)));
        }
        if let Some(p) = self.pcie {
            parts.push(format!("pcie={p}"));
        }
        if self.offload_pair {
            parts.push("offload_pair=true".to_string());
        }
        for (r, f) in &self.rank_factor {
            parts.push(format!("rank.{r}={}", num(*f)));
        }
        if let Some(x) = self.split_extra {
            parts.push(format!("split_extra={x}"));
        }
        // `K.act_w` only when given or derived (a spec without it is unchanged).
        for k in KINDS {
            if let Some(w) = self.layer_memory(k).act_w {
                parts.push(format!("{}.act_w={w}{unit}", k.symbol()));
            }
        }
        // Lengths (issue #38) only when given or derived, at the end: a spec without them
        // is unchanged. A `[model]` table's `seq` is written as the key, since the spec
        // carries the derived figures, not the table.
        if let Some(seq) = self.given_seq() {
            parts.push(format!("seq={seq}"));
        }
        for k in KINDS {
            let a = self.attention(k);
            let y = k.symbol();
            for (name, v) in [("f", a.f), ("b", a.b), ("w", a.w)] {
                if v != 0.0 {
                    parts.push(format!("{y}.attn_{name}={v}"));
                }
            }
        }
        parts.join(",")
    }

    /// A short one-line description, for headers: `f=1 b=1 w=1, p2p free, rendezvous`, as
    /// of a model built from no costs at all ([`CostModel::describe_given`] with `false`).
    pub fn describe(&self) -> String {
        self.describe_given(false)
    }

    /// [`CostModel::describe`], knowing whether a cost model was given (`--cost`,
    /// `--cost-file`, or a manifest's recorded `cost`). A free embedding or loss then reads
    /// `E free (E.f=0)`: its cost was given as 0, or left 0 beside others given; only without
    /// any model does it read `E free (no cost given: set E.f)` (issue #40: a tuned directory
    /// whose manifest records `E.f=0` from a `[model]` table read "no cost given").
    pub fn describe_given(&self, given: bool) -> String {
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
            // Without `tflops` the times are relative: one decoder layer's forward is 1.
            let times = match (shape.tflops, self.time_unit) {
                (Some(t), u) => format!(
                    "times in {} at {} TFLOP/s per GPU",
                    unit_name(u.unwrap_or(1.0)),
                    num(t)
                ),
                (None, _) => "times in decoder-layer forwards".to_string(),
            };
            s.push_str(&format!(
                "; from [model] {} ({times}; E: no matmul, param {}, act {}; L: param {}, act {}; t: param {}, act {})",
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
            if given {
                s.push_str(&format!("; {} free ({})", list(""), list(".f=0")));
            } else {
                s.push_str(&format!(
                    "; {} free (no cost given: set {})",
                    list(""),
                    list(".f")
                ));
            }
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
        for (r, f) in &self.rank_factor {
            s.push_str(&format!("; rank {r} x{}", num(*f)));
        }
        if self.shape.is_none() {
            // Attention parts given as keys (a `[model]` table's are named by the table).
            for k in KINDS {
                let a = self.attention(k);
                if a != PassCost::ZERO {
                    s.push_str(&format!(
                        "; {} attention f={} b={} w={}",
                        k.symbol(),
                        num(a.f),
                        num(a.b),
                        num(a.w)
                    ));
                }
            }
        }
        if self.offload.iter().any(Option::is_some) || self.pcie.is_some() {
            s.push_str(&format!(
                "; offload {} per t layer{}",
                num(self.offload_time(LayerKind::Decoder)),
                if self.offload_pair {
                    ", host links shared by rank pairs"
                } else {
                    ""
                }
            ));
        }
        s
    }
}

/// The name of a time unit given in seconds (`time_unit` takes `s`, `ms`, `us`).
fn unit_name(u: f64) -> &'static str {
    if u == 1.0 {
        "s"
    } else if u == 1e-3 {
        "ms"
    } else {
        "us"
    }
}

fn boolean(text: &str, source: Option<&str>, e: &lang::Entry) -> Result<bool, CostError> {
    let v = &text[e.value.0..e.value.1];
    match v {
        "true" => Ok(true),
        "false" => Ok(false),
        _ => Err(err(
            text,
            source,
            e.value,
            CostErrorKind::BadBool(v.to_string()),
        )),
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
    /// Per stage, each pass's whole time at `seq` tokens (linear plus attention parts).
    fwd: Vec<f64>,
    bwd_d: Vec<f64>,
    bwd_w: Vec<f64>,
    /// Per stage, the attention parts of those times (`K.attn_*` summed over the layers).
    attn_fwd: Vec<f64>,
    attn_bwd_d: Vec<f64>,
    attn_bwd_w: Vec<f64>,
    /// False when the layout's stage count did not match the program's, and every stage was
    /// costed as one decoder layer instead.
    pub layout_used: bool,
    /// Per stage: `K.act` and `K.param` summed over its layers ([`pipec_ir::memory`]).
    pub act: Vec<f64>,
    pub param: Vec<f64>,
    /// Per stage: one microbatch's activations copied one way ([`CostModel::offload_time`]
    /// summed over its layers).
    pub offload: Vec<f64>,
    /// `1 + split_extra`: what a split backward's halves take over `b` and `w`.
    split: f64,
    /// Per stage: `K.act_w` summed over its layers, when some kind has one (else `None`:
    /// `bwd_W` keeps all of `act`).
    pub act_w: Option<Vec<f64>>,
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
        let mut attn_fwd = Vec::with_capacity(n);
        let mut attn_bwd_d = Vec::with_capacity(n);
        let mut attn_bwd_w = Vec::with_capacity(n);
        let mut act = Vec::with_capacity(n);
        let mut param = Vec::with_capacity(n);
        let mut offload = Vec::with_capacity(n);
        for s in 0..n {
            let layers: &[LayerKind] = if layout_used {
                &layout.stages[s]
            } else {
                &one_t
            };
            act.push(layers.iter().map(|&k| model.layer_memory(k).act).sum());
            param.push(layers.iter().map(|&k| model.layer_memory(k).param).sum());
            offload.push(layers.iter().map(|&k| model.offload_time(k)).sum());
            if layers.is_empty() {
                fwd.push(model.floor);
                bwd_d.push(model.floor);
                bwd_w.push(model.floor);
                attn_fwd.push(0.0);
                attn_bwd_d.push(0.0);
                attn_bwd_w.push(0.0);
                continue;
            }
            let mut c = PassCost::ZERO;
            let mut a = PassCost::ZERO;
            for &k in layers {
                let l = model.layer(k);
                c.f += l.f;
                c.b += l.b;
                c.w += l.w;
                let x = model.attention(k);
                a.f += x.f;
                a.b += x.b;
                a.w += x.w;
            }
            fwd.push(c.f);
            bwd_d.push(c.b);
            bwd_w.push(c.w);
            attn_fwd.push(a.f);
            attn_bwd_d.push(a.b);
            attn_bwd_w.push(a.w);
        }
        StageCosts {
            model: model.clone(),
            fwd,
            bwd_d,
            bwd_w,
            attn_fwd,
            attn_bwd_d,
            attn_bwd_w,
            layout_used,
            act_w: model.has_act_w().then(|| {
                (0..n)
                    .map(|s| {
                        let layers: &[LayerKind] = if layout_used {
                            &layout.stages[s]
                        } else {
                            &one_t
                        };
                        layers
                            .iter()
                            .map(|&k| model.layer_memory(k).kept_for_w())
                            .sum()
                    })
                    .collect()
            }),
            act,
            param,
            offload,
            split: 1.0 + model.split_extra.unwrap_or(0.0),
        }
    }

    /// Every stage costs `f`, `b`, `w` exactly (a uniform layout of one `t` per stage).
    pub fn uniform(model: &CostModel, num_stages: u32) -> Self {
        StageCosts::new(model, &Layout::uniform(0), num_stages)
    }

    pub fn num_stages(&self) -> u32 {
        self.fwd.len() as u32
    }

    /// The cost of one pass of one stage; `None` for a stage out of range. A split
    /// backward's halves take `1 + split_extra` times `b` and `w`; a whole `bwd` costs `b + w`.
    #[inline]
    pub fn pass(&self, pass: Pass, stage: StageId) -> Option<f64> {
        let s = stage.index();
        Some(match pass {
            Pass::Fwd => *self.fwd.get(s)?,
            Pass::BwdD => *self.bwd_d.get(s)? * self.split,
            Pass::BwdW => *self.bwd_w.get(s)? * self.split,
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

    /// The cost of one pass of one stage for a microbatch of scale `(lin, quad)`
    /// (the `lengths` module's `Scale`): the linear part times `lin`, the attention part times
    /// `quad`. At `(1, 1)` it is [`StageCosts::pass`] exactly.
    #[inline]
    pub fn pass_scaled(&self, pass: Pass, stage: StageId, lin: f64, quad: f64) -> Option<f64> {
        let s = stage.index();
        let part = |total: &[f64], attn: &[f64]| -> Option<f64> {
            Some(crate::layer::scaled(*total.get(s)?, attn[s], lin, quad))
        };
        Some(match pass {
            Pass::Fwd => part(&self.fwd, &self.attn_fwd)?,
            Pass::BwdD => part(&self.bwd_d, &self.attn_bwd_d)? * self.split,
            Pass::BwdW => part(&self.bwd_w, &self.attn_bwd_w)? * self.split,
            Pass::Bwd => {
                part(&self.bwd_d, &self.attn_bwd_d)? + part(&self.bwd_w, &self.attn_bwd_w)?
            }
        })
    }

    /// Rank `r`'s compute time factor (`rank.R`, default 1).
    #[inline]
    pub fn rank_factor(&self, r: usize) -> f64 {
        if self.model.rank_factor.is_empty() {
            return 1.0;
        }
        u32::try_from(r)
            .ok()
            .and_then(|r| self.model.rank_factor.get(&r))
            .copied()
            .unwrap_or(1.0)
    }

    /// Time of one message.
    pub fn transfer(&self) -> f64 {
        self.model.transfer()
    }

    /// Time to copy one microbatch's activations of `stage` one way (offload or reload), on
    /// a link of its own; `None` for a stage out of range.
    pub fn copy(&self, stage: StageId) -> Option<f64> {
        self.offload.get(stage.index()).copied()
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

    /// `K.act_w`: absent, all of `K.act` (nothing in the spec or the JSON, so older outputs
    /// stay as they were); given, a part of it that the spec round-trips; above `K.act`, an
    /// error at its value.
    #[test]
    fn act_w_defaults_to_act_and_round_trips() {
        let d = CostModel::default();
        assert!(!d.has_act_w());
        assert_eq!(d.layer_memory(LayerKind::Decoder).kept_for_w(), 1.0);
        assert!(!d.spec().contains("act_w"));
        assert!(!serde_json::to_string(&d).unwrap().contains("act_w"));
        let m = CostModel::parse("t.act=2,t.act_w=0.5").unwrap();
        assert!(m.has_act_w());
        assert_eq!(m.layer_memory(LayerKind::Decoder).kept_for_w(), 0.5);
        assert_eq!(m.layer_memory(LayerKind::Mtp).kept_for_w(), 1.0);
        assert_eq!(CostModel::parse(&m.spec()).unwrap(), m);
        let b = CostModel::parse("\"t.act\" = \"2GiB\"\n\"t.act_w\" = \"1GiB\"").unwrap();
        assert_eq!(
            b.layer_memory(LayerKind::Decoder).act_w,
            Some((1u64 << 30) as f64)
        );
        assert_eq!(CostModel::parse(&b.spec()).unwrap(), b);
        let e = CostModel::parse("t.act_w=3").unwrap_err();
        assert_eq!(
            e.kind,
            CostErrorKind::ActWAboveAct("`t.act_w` (3) is more than `t.act` (1)".into())
        );
        assert_eq!(e.start, "t.act_w=".len());
    }

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
        let layout = pipec_schedules::layout::parse("Ett|t||tL").unwrap();
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

    /// The offload keys (issue #30): per-kind copy times, the link's bandwidth in either
    /// form, and what each refusal says.
    #[test]
    fn split_extra_key() {
        // Each half of a split backward takes 1 + x times its cost; a whole backward b + w.
        let m = CostModel::parse("t.b=2,t.w=1,split_extra=0.5").unwrap();
        let c = StageCosts::uniform(&m, 2);
        assert_eq!(c.pass(Pass::BwdD, StageId(0)), Some(3.0));
        assert_eq!(c.pass(Pass::BwdW, StageId(1)), Some(1.5));
        assert_eq!(c.pass(Pass::Bwd, StageId(0)), Some(3.0));
        assert_eq!(c.pass_scaled(Pass::BwdD, StageId(0), 1.0, 1.0), Some(3.0));
        // Recorded in the spec (a manifest's costs) and read back the same.
        assert!(m.spec().ends_with(",split_extra=0.5"));
        assert_eq!(CostModel::parse(&m.spec()).unwrap().split_extra, Some(0.5));
        // Absent: nothing written, nothing scaled.
        let d = CostModel::default();
        assert!(!d.spec().contains("split_extra"));
        assert!(!serde_json::to_string(&d).unwrap().contains("split_extra"));
        assert_eq!(
            StageCosts::uniform(&d, 1).pass(Pass::BwdD, StageId(0)),
            Some(1.0)
        );
        assert!(CostModel::parse("split_extra=-1").is_err());
        assert!(KEYS.contains("split_extra"));
    }

    #[test]
    fn model_num_layers() {
        let table = "[model]\nhidden = 1024\nffn = 4096\nheads = 16\nseq = 2048\nvocab = 32000\n";
        let m = CostModel::parse(table).unwrap();
        assert_eq!(m.shape.unwrap().num_layers, None);
        let m = CostModel::parse(&format!("{table}num_layers = 80\n")).unwrap();
        assert_eq!(m.shape.unwrap().num_layers, Some(80));
        let e = CostModel::parse(&format!("{table}num_layers = 0\n")).unwrap_err();
        assert!(
            e.render()
                .contains("`num_layers` must be an integer from 1"),
            "{}",
            e.render()
        );
    }

    #[test]
    fn offload_keys() {
        let d = CostModel::parse("f=2").unwrap();
        // Nothing given: a copy takes one forward of the layer, and nothing is serialized.
        assert_eq!(d.offload_time(LayerKind::Decoder), 2.0);
        assert!(!serde_json::to_string(&d).unwrap().contains("offload"));
        assert!(!d.spec().contains("offload"));
        let m = CostModel::parse("offload=0.5,E.offload=0.1,t.offload=0.25").unwrap();
        assert_eq!(
            m.offload_time(LayerKind::Decoder),
            0.25,
            "the per-kind key wins"
        );
        assert_eq!(m.offload_time(LayerKind::Mtp), 0.5);
        assert_eq!(m.offload_time(LayerKind::Embedding), 0.1);
        // 1 GiB of activations per layer over 25 GB/s with times in ms: 42.9 ms.
        let b = CostModel::parse("t.act=1GiB,time_unit=ms,pcie=25GB/s,offload_pair=true").unwrap();
        let want = (1u64 << 30) as f64 / 25e9 * 1e3;
        assert!((b.offload_time(LayerKind::Decoder) - want).abs() < 1e-9);
        assert!(b.offload_pair);
        // The spec reads back to the same model.
        assert_eq!(CostModel::parse(&b.spec()).unwrap(), b);
        assert_eq!(CostModel::parse(&m.spec()).unwrap(), m);
        let costs = StageCosts::new(&m, &pipec_schedules::layout::parse("Et|tt|tL").unwrap(), 3);
        assert_eq!(costs.copy(StageId(1)), Some(0.5));
        assert_eq!(costs.copy(StageId(0)), Some(0.35));
        for (spec, want) in [
            ("pcie=25GB/s", "is in bytes, but the activations are not"),
            ("t.act=1GiB,pcie=25GB/s", "add `time_unit = \"ms\"`"),
            ("pcie=0", "`pcie` must be greater than 0"),
            ("pcie=fast", "is not a number"),
            ("t.act=1GiB,time_unit=ms,pcie=25GB/h", "is not a bandwidth"),
            ("time_unit=min", "is not a time unit"),
            ("offload_pair=yes", "is not a boolean"),
            ("t.offload=-1", "is negative"),
        ] {
            let e = CostModel::parse(spec).unwrap_err().to_string();
            assert!(e.contains(want), "{spec}: {e}");
        }
    }

    #[test]
    fn rank_factor_keys() {
        let d = CostModel::parse("f=2").unwrap();
        assert!(!serde_json::to_string(&d).unwrap().contains("rank"));
        assert!(!d.spec().contains("rank"));
        let m = CostModel::parse("rank.0=1.5,rank.7=2").unwrap();
        let c = StageCosts::uniform(&m, 8);
        assert_eq!(
            (0..9).map(|r| c.rank_factor(r)).collect::<Vec<_>>(),
            [1.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 2.0, 1.0]
        );
        // Stage costs stay the layers' (the factor applies where a rank runs them).
        assert_eq!(c.pass(Pass::Fwd, StageId(0)), Some(1.0));
        assert_eq!(CostModel::parse(&m.spec()).unwrap(), m);
        assert!(m.describe().contains("rank 0 x1.5; rank 7 x2"));
        assert!(serde_json::to_string(&m)
            .unwrap()
            .contains(r#""rank_factor":{"0":1.5,"7":2.0}"#));
        for (spec, want) in [
            ("rank.1=0", "must be greater than 0"),
            ("rank.1=-2", "is negative"),
            ("rank.x=2", "unknown key `rank.x`"),
            ("rank.=2", "unknown key `rank.`"),
            ("rank.1=2,rank.1=3", "is given twice"),
        ] {
            let e = CostModel::parse(spec).unwrap_err().to_string();
            assert!(e.contains(want), "{spec}: {e}");
        }
    }
}
