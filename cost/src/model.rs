//! Costs and memory from a model's shape: the `[model]` table of a cost file.
//!
//! Users know their model (hidden size, heads, sequence length, parallelism), not their
//! `K.act` in bytes. From the shape this module derives, per layer kind (`E t m L`):
//!
//! - `act`: activation bytes one microbatch keeps alive, by Korthikanti et al., "Reducing
//!   Activation Recomputation in Large Transformer Models" (2022), section 4 and Table 2,
//!   generalized to grouped-query attention and SwiGLU (docs/tune.md, "Model shape");
//! - `param`: parameter + gradient + optimizer bytes, as Megatron-LM's theoretical memory
//!   report counts them (`megatron/training/theoretical_memory_usage.py`,
//!   `compute_weight_and_optimizer_memory`; bytes per parameter from
//!   `docs/user-guide/features/dist_optimizer.md`);
//! - `f`, `b`, `w`: matmul FLOPs of the forward, input-gradient and weight-gradient passes,
//!   in units of one decoder layer's forward (Narayanan et al., 2021, appendix, for the
//!   counting).
//!
//! Explicit keys of the cost spec (`t.f`, `K.act`, `pipec calibrate` output) win over these.

use crate::layer::{LayerMemory, PassCost};
use serde::Serialize;

/// Activation and parameter precision.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    Bf16,
    Fp16,
    Fp32,
}

/// Activation recomputation granularity (Megatron's `--recompute-granularity`).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Recompute {
    None,
    Selective,
    Full,
}

/// Normalization layer (Megatron's `--normalization`): parameters per hidden unit.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Serialize)]
pub enum Norm {
    LayerNorm,
    RMSNorm,
}

/// A model description: the `[model]` table.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ModelShape {
    pub hidden: u64,
    pub ffn: u64,
    pub heads: u64,
    pub kv_heads: u64,
    pub seq: u64,
    pub micro_batch: u64,
    /// As given; [`ModelShape::padded_vocab`] is what the layers hold.
    pub vocab: u64,
    pub dtype: Dtype,
    pub tp: u64,
    pub cp: u64,
    pub dp: u64,
    pub sequence_parallel: bool,
    pub distributed_optimizer: bool,
    pub recompute: Recompute,
    pub swiglu: bool,
    pub normalization: Norm,
    /// `tflops`: the matmul throughput one GPU achieves, in TFLOP/s (10^12 FLOP/s). With it
    /// the derived times are absolute ([`ModelShape::derive_in`]); without it they are in
    /// decoder-layer forwards. Serialized only when given, so older outputs stay the same.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tflops: Option<f64>,
    /// `num_layers`: the model's decoder layers, when the table states them. `tune` and
    /// `compile` take them when no layer count or layout is asked for and refuse one that
    /// disagrees ([`ModelShape::check_layers`]); `pipec check` compares a directory's layout
    /// with this count, so costs of an 80-layer model are not taken for a plan compiled for 8
    /// (issue #40). Serialized only when given.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub num_layers: Option<u64>,
}

/// What the shape gives each layer kind, in `crate::cost::KINDS` order: the passes' linear
/// parts (`K.f`, `K.b`, `K.w`: the weight matmuls, linear in tokens), their attention-core
/// parts (`K.attn_*`: quadratic in each document's length), and the memory.
#[derive(Clone, Debug, PartialEq)]
pub struct Derived {
    pub layers: [PassCost; 4],
    pub attn: [PassCost; 4],
    pub memory: [LayerMemory; 4],
}

/// `total` split into a linear part and an attention part `attn` (both at least 0) whose
/// floating-point sum is `total` exactly, so that a uniform microbatch of `seq` tokens costs
/// bit for bit what the unsplit figure did. One of the two is taken as given and the other is
/// `total` minus it, which Sterbenz's lemma makes exact: `total - y` is exact for `y` in
/// `[total/2, total]`, and `x = fl(total - a)` lies there when `a <= total/2`.
pub fn split_exact(total: f64, attn: f64) -> (f64, f64) {
    let attn = attn.clamp(0.0, total);
    if attn >= total / 2.0 {
        (total - attn, attn)
    } else {
        let linear = total - attn;
        (linear, total - linear)
    }
}

/// The keys of the `[model]` table, in the order the error messages list them (exported to
/// Python as `pipec.MODEL_KEYS`).
pub const MODEL_KEYS: [&str; 18] = [
    "hidden",
    "ffn",
    "heads",
    "kv_heads",
    "seq",
    "micro_batch",
    "vocab",
    "dtype",
    "tp",
    "cp",
    "dp",
    "sequence_parallel",
    "distributed_optimizer",
    "recompute",
    "swiglu",
    "normalization",
    "tflops",
    "num_layers",
];

/// Keys that must be given (the others have Megatron's defaults).
pub const REQUIRED: [&str; 5] = ["hidden", "ffn", "heads", "seq", "vocab"];

/// The `[model]` table's `num_layers` and the decoder layers a plan is asked for disagree
/// (issue #40): a plan for 8 layers costed as an 80-layer model's would describe neither.
/// `from` says where the plan's count came from, in words no caller's flags are named in.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{from} gives {given} decoder layers, but the cost model's [model] table says num_layers = {table}: give one count (or leave the layers to the table)")]
pub struct LayersDisagree {
    pub table: u64,
    pub given: u64,
    pub from: &'static str,
}

impl ModelShape {
    /// The table's `num_layers` as a layer count (saturated at `u32::MAX`: a count that large
    /// is refused by the callers' layer cap).
    pub fn layer_count(&self) -> Option<u32> {
        self.num_layers
            .map(|n| u32::try_from(n).unwrap_or(u32::MAX))
    }

    /// `given` decoder layers (from `from`) against the table's `num_layers`, when it states
    /// one: the one comparison `tune` and `compile` make.
    pub fn check_layers(&self, given: u64, from: &'static str) -> Result<(), LayersDisagree> {
        match self.num_layers {
            Some(table) if table != given => Err(LayersDisagree { table, given, from }),
            _ => Ok(()),
        }
    }

    /// Bytes of one activation element: 2 for bf16/fp16 (the paper's assumption), 4 for fp32.
    pub fn element_bytes(&self) -> f64 {
        match self.dtype {
            Dtype::Bf16 | Dtype::Fp16 => 2.0,
            Dtype::Fp32 => 4.0,
        }
    }

    /// Megatron pads the vocabulary to a multiple of 128 * tp
    /// (`make_vocab_size_divisible_by`, `vocab_size_with_padding`).
    pub fn padded_vocab(&self) -> u64 {
        let m = 128 * self.tp;
        self.vocab.div_ceil(m) * m
    }

    /// Parameter + gradient + optimizer bytes per parameter, Megatron's table
    /// (dist_optimizer.md): bf16 18 or `6 + 12/d`, fp16 20 or `4 + 16/d`, fp32 16 or
    /// `8 + 8/d`, `d` the ranks the distributed optimizer shards over (dp * cp: Megatron's
    /// gradient buffers use the data-parallel group with context parallelism).
    pub fn bytes_per_param(&self) -> f64 {
        let d = (self.dp * self.cp) as f64;
        let (plain, fixed, sharded) = match self.dtype {
            Dtype::Bf16 => (18.0, 6.0, 12.0),
            Dtype::Fp16 => (20.0, 4.0, 16.0),
            Dtype::Fp32 => (16.0, 8.0, 8.0),
        };
        if self.distributed_optimizer {
            fixed + sharded / d
        } else {
            plain
        }
    }

    /// Parameters of one normalization layer.
    fn norm_params(&self) -> f64 {
        let per = match self.normalization {
            Norm::LayerNorm => 2.0,
            Norm::RMSNorm => 1.0,
        };
        per * self.hidden as f64
    }

    /// Parameters of one decoder layer held by one tensor-parallel rank: attention
    /// `2h^2 (1 + g/a)`, MLP `2 h ffn` (x 3/2 with SwiGLU), divided by tp; two norms,
    /// replicated (Megatron's `compute_weight_and_optimizer_memory`; biases not counted).
    pub fn layer_params(&self) -> f64 {
        let h = self.hidden as f64;
        let (a, g) = (self.heads as f64, self.kv_heads as f64);
        let attn = 2.0 * h * h * (1.0 + g / a);
        let gated = if self.swiglu { 1.5 } else { 1.0 };
        let mlp = 2.0 * h * self.ffn as f64 * gated;
        (attn + mlp) / self.tp as f64 + 2.0 * self.norm_params()
    }

    /// Activation bytes of one decoder layer for one microbatch on one rank.
    ///
    /// Korthikanti et al. 2022, section 4.1, per element of `sbh` (`e` bytes per element,
    /// 1 per dropout-mask element): kept whole by tensor parallelism (split by sequence
    /// parallelism): the two norm inputs `2e`, the QKV input `e`, the MLP input `e`, two
    /// dropout masks `2`; split by tensor parallelism: Q `e`, K and V `2e g/a` (grouped-query
    /// attention stores `g` heads of keys and values), the attention projection's input `e`,
    /// the MLP's intermediates `2e ffn/h` (GeLU's input and output) or `3e ffn/h` (SwiGLU:
    /// the gate and up projections' outputs and the product); the attention core
    /// `(2e + 1) a s / h` (softmax output, dropout mask, dropout output). With `e = 2`, MHA
    /// and `ffn = 4h` these are the paper's `10 + 24/t + 5as/(ht)`. Selective recompute
    /// drops the core term; full recompute keeps the layer input, `e sbh` (split by sequence
    /// parallelism). Context parallelism divides `s` (the core: local queries against every
    /// key).
    pub fn layer_activation(&self) -> f64 {
        let e = self.element_bytes();
        let (h, t) = (self.hidden as f64, self.tp as f64);
        let s = self.seq as f64 / self.cp as f64;
        let sbh = s * self.micro_batch as f64 * h;
        let sp = self.sp_divisor();
        if self.recompute == Recompute::Full {
            return e * sbh / sp;
        }
        let r = self.kv_heads as f64 / self.heads as f64;
        let ffn = self.ffn as f64 / h;
        let whole = sbh * (4.0 * e + 2.0);
        let mlp = if self.swiglu {
            3.0 * e * ffn
        } else {
            2.0 * e * ffn
        };
        let split = sbh * (e * (2.0 + 2.0 * r) + mlp);
        let core =
            (2.0 * e + 1.0) * self.heads as f64 * s * self.seq as f64 * self.micro_batch as f64;
        let core = if self.recompute == Recompute::None {
            core
        } else {
            0.0
        };
        whole / sp + (split + core) / t
    }

    /// What sequence parallelism splits the sequence-wise tensors by: `tp` under it, else 1.
    fn sp_divisor(&self) -> f64 {
        if self.sequence_parallel {
            self.tp as f64
        } else {
            1.0
        }
    }

    /// Bytes of the tensor a stage sends to the next (and of its gradient): the layer input,
    /// `e s b h` (`s` split by cp, and by tp under sequence parallelism), as Megatron's
    /// `tensor_shape` for its P2P calls (`(s / cp / (tp if sp)) , b, h`).
    pub fn boundary_bytes(&self) -> f64 {
        let s = self.seq as f64 / self.cp as f64;
        let sp = self.sp_divisor();
        self.element_bytes() * s * self.micro_batch as f64 * self.hidden as f64 / sp
    }

    /// The part of [`ModelShape::layer_activation`] a split backward keeps from the input
    /// gradient (`bwd_D`) to the weight gradient (`bwd_W`): the inputs of the layer's
    /// weight-gradient GEMMs, from Korthikanti et al. 2022's per-layer list (section 4.1):
    /// the QKV input `e` and the MLP's first input `e` (kept whole by tensor parallelism,
    /// split by sequence parallelism), the attention projection's input `e` and the MLP's
    /// second input `e ffn/h` (GeLU's output, or SwiGLU's product; split by tensor
    /// parallelism), per element of `sbh`. The rest (norm inputs, dropout masks, Q/K/V, the
    /// activation function's input, the attention core's softmax and dropout) only the input
    /// gradient reads, and `bwd_D` frees it. GPT-3 at `tp = 1`: `14 sbh` of `34 sbh + 5as
    /// sbh/h`. The zero-bubble authors' runtime assumes more stays, `32h` of `34h + 5as` per
    /// `sb` (`w_mem_approx` in their `zerobubble/runtime.py`: all but the core); this counts
    /// what the weight GEMMs read. Under full recompute the layer keeps only its input, which
    /// `bwd_W` recomputes from: all of it stays (`act_w = act`).
    pub fn layer_activation_w(&self) -> f64 {
        if self.recompute == Recompute::Full {
            return self.layer_activation();
        }
        let e = self.element_bytes();
        let (h, t) = (self.hidden as f64, self.tp as f64);
        let s = self.seq as f64 / self.cp as f64;
        let sbh = s * self.micro_batch as f64 * h;
        let sp = self.sp_divisor();
        let ffn = self.ffn as f64 / h;
        sbh * (2.0 * e / sp + e * (1.0 + ffn) / t)
    }

    /// The embedding's weight gradient reads the token ids only (`8sb`, split by tp under
    /// sequence parallelism); the dropout mask goes at `bwd_D`.
    pub fn embedding_activation_w(&self) -> f64 {
        let s = self.seq as f64 / self.cp as f64;
        let sb = s * self.micro_batch as f64;
        let sp = self.sp_divisor();
        8.0 * sb / sp
    }

    /// The output layer's weight gradient reads its input (`e sbh`, split by tp under
    /// sequence parallelism); the norm's input and the logits go at `bwd_D`.
    pub fn output_activation_w(&self) -> f64 {
        // The output layer's input is the layer input a stage sends on.
        self.boundary_bytes()
    }

    /// Activation bytes of the embedding for one microbatch: the token ids (int64, `8sb`)
    /// and the embedding dropout mask (`sbh`), Korthikanti et al. section 4.3 as Megatron's
    /// `compute_activation_memory` counts them; split by tp under sequence parallelism.
    pub fn embedding_activation(&self) -> f64 {
        let s = self.seq as f64 / self.cp as f64;
        let sb = s * self.micro_batch as f64;
        let sp = self.sp_divisor();
        (8.0 * sb + sb * self.hidden as f64) / sp
    }

    /// Activation bytes of the final norm, output layer and loss for one microbatch:
    /// Korthikanti et al. section 4.3, `4sbh/t (1 + v/h)`: the norm's and the output
    /// layer's inputs `2e sbh` (split by tp under sequence parallelism) and the fp32 logits
    /// `4sbv/t`.
    pub fn output_activation(&self) -> f64 {
        let e = self.element_bytes();
        let t = self.tp as f64;
        let s = self.seq as f64 / self.cp as f64;
        let sb = s * self.micro_batch as f64;
        let sp = self.sp_divisor();
        2.0 * e * sb * self.hidden as f64 / sp + 4.0 * sb * self.padded_vocab() as f64 / t
    }

    /// Matmul FLOPs of one decoder layer's forward on one rank, split into the weight
    /// matmuls (QKV `2sbh^2(1 + 2g/a)`, projection `2sbh^2`, MLP `4sbh ffn`, SwiGLU `6sbh
    /// ffn`) and the attention core (`QK^T` and attention over V, `4 b s s_kv h`).
    fn layer_flops(&self) -> (f64, f64) {
        let h = self.hidden as f64;
        let s = self.seq as f64 / self.cp as f64;
        let b = self.micro_batch as f64;
        let r = self.kv_heads as f64 / self.heads as f64;
        let mlp = if self.swiglu { 6.0 } else { 4.0 };
        let weights = 2.0 * s * b * h * h * (2.0 + 2.0 * r) + mlp * s * b * h * self.ffn as f64;
        let core = 4.0 * b * s * self.seq as f64 * h;
        let t = self.tp as f64;
        (weights / t, core / t)
    }

    /// Per layer kind: `f`, `b`, `w` in units of one decoder layer's forward, `act` and
    /// `param` in bytes (as [`ModelShape::derive_in`] without `tflops`).
    pub fn derive(&self) -> Derived {
        self.derive_per(self.layer_flops_total())
    }

    /// The FLOPs of one decoder layer's forward on one rank.
    fn layer_flops_total(&self) -> f64 {
        let (wt, core) = self.layer_flops();
        wt + core
    }

    /// FLOPs one time unit holds: `tflops * 1e12 * time_unit` (seconds per unit, `None`:
    /// seconds), when `tflops` is given.
    pub fn flops_per_unit(&self, time_unit: Option<f64>) -> Option<f64> {
        self.tflops.map(|t| t * 1e12 * time_unit.unwrap_or(1.0))
    }

    /// As [`ModelShape::derive`], with times in `time_unit` (seconds per unit, `None`:
    /// seconds) when `tflops` is given: each pass's FLOPs over `tflops * 1e12` FLOP/s.
    /// Without `tflops`, times in decoder-layer forwards, bit for bit [`ModelShape::derive`].
    pub fn derive_in(&self, time_unit: Option<f64>) -> Derived {
        match self.flops_per_unit(time_unit) {
            Some(per) => self.derive_per(per),
            None => self.derive(),
        }
    }

    /// The derivation with times in units of `per` FLOPs (one decoder layer's forward
    /// FLOPs: times in forwards).
    ///
    /// Times: a weight matmul `Y = XW` costs its forward's FLOPs once more for the input
    /// gradient (`b`) and once for the weight gradient (`w`); the attention core has no
    /// weights, its backward (twice its forward) is input gradient. Selective recompute adds
    /// the core's forward to `b`, full recompute the whole forward (recomputation runs
    /// before the input gradient). The output layer (`2sbhv/t`) costs the same in all three
    /// passes; the embedding lookup has no matmul (0). An MTP layer is costed as a decoder
    /// layer, as Megatron's memory report counts it (its projection and its pass through
    /// the shared output layer are not counted).
    fn derive_per(&self, per: f64) -> Derived {
        let (wt, core) = self.layer_flops();
        let unit = wt + core;
        let extra = match self.recompute {
            Recompute::None => 0.0,
            Recompute::Selective => core,
            Recompute::Full => unit,
        };
        // `unit / per` is exactly 1 in forwards, as before `tflops` existed.
        let t = PassCost {
            f: unit / per,
            b: (wt + 2.0 * core + extra) / per,
            w: wt / per,
        };
        // The attention core's share of each pass: its forward, its backward (twice the
        // forward) plus what recomputation runs of it again; the weight gradient has none.
        let recomputed = match self.recompute {
            Recompute::None => 0.0,
            Recompute::Selective | Recompute::Full => core,
        };
        let (tf, af) = split_exact(t.f, core / per);
        let (tb, ab) = split_exact(t.b, (2.0 * core + recomputed) / per);
        let t_attn = PassCost {
            f: af,
            b: ab,
            w: 0.0,
        };
        let t = PassCost {
            f: tf,
            b: tb,
            w: t.w,
        };
        let s = self.seq as f64 / self.cp as f64;
        let out =
            2.0 * s * self.micro_batch as f64 * self.hidden as f64 * self.padded_vocab() as f64
                / self.tp as f64
                / per;
        let l = PassCost {
            f: out,
            b: out,
            w: out,
        };
        let bpp = self.bytes_per_param();
        let embed = self.hidden as f64 * self.padded_vocab() as f64 / self.tp as f64;
        let layer = LayerMemory {
            act: self.layer_activation(),
            param: self.layer_params() * bpp,
            act_w: Some(self.layer_activation_w()),
        };
        Derived {
            layers: [PassCost::ZERO, t, t, l],
            attn: [PassCost::ZERO, t_attn, t_attn, PassCost::ZERO],
            memory: [
                LayerMemory {
                    act: self.embedding_activation(),
                    param: embed * bpp,
                    act_w: Some(self.embedding_activation_w()),
                },
                layer,
                layer,
                LayerMemory {
                    act: self.output_activation(),
                    // The output layer and the final norm; Megatron keeps the output weight
                    // on the last stage even when it is tied to the embedding.
                    param: (embed + self.norm_params()) * bpp,
                    act_w: Some(self.output_activation_w()),
                },
            ],
        }
    }

    /// One line for cost headers: `model h=8192 ffn=28672 a=64/8 s=4096 b=1 v=128256 bf16
    /// tp=8 sp`.
    pub fn describe(&self) -> String {
        let mut s = format!("h={} ffn={} heads={}", self.hidden, self.ffn, self.heads);
        if self.kv_heads != self.heads {
            s.push_str(&format!("/{}kv", self.kv_heads));
        }
        s.push_str(&format!(
            " seq={} mb={} vocab={} {:?} tp={}",
            self.seq, self.micro_batch, self.vocab, self.dtype, self.tp
        ));
        if self.cp > 1 {
            s.push_str(&format!(" cp={}", self.cp));
        }
        if self.dp > 1 {
            s.push_str(&format!(" dp={}", self.dp));
        }
        if self.sequence_parallel && self.tp > 1 {
            s.push_str(" sp");
        }
        if self.distributed_optimizer {
            s.push_str(" dist-opt");
        }
        if self.recompute != Recompute::None {
            s.push_str(&format!(" recompute={:?}", self.recompute).to_lowercase());
        }
        let mut s = s.to_lowercase();
        if let Some(t) = self.tflops {
            s.push_str(&format!(" tflops={}", pipec_ir::human::num(t)));
        }
        s
    }
}

#[cfg(test)]
mod tests {
    //! The figures against independent transcriptions of the published formulas, written
    //! here from the papers, not from the code above.
    use crate::cost::{CostErrorKind, CostModel};
    use pipec_schedules::layout::LayerKind;

    const GPT3: &str = "hidden = 12288\nffn = 49152\nheads = 96\nseq = 2048\nvocab = 50257\n";
    const LLAMA3: &str = "hidden = 8192\nffn = 28672\nheads = 64\nkv_heads = 8\nseq = 8192\nvocab = 128256\nswiglu = true\nnormalization = \"RMSNorm\"\n";

    fn model(shape: &str, extra: &str) -> CostModel {
        CostModel::parse(&format!("[model]\n{shape}{extra}")).unwrap()
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-9 * b.abs().max(1.0)
    }

    /// A buffer plan's message (issue #39): Megatron's P2P tensor, `(s / cp / (tp if sp), b, h)`
    /// of the dtype, for GPT-3 175B (s=2048, b=1, h=12288, bf16): 2 * 2048 * 12288 bytes at
    /// tp=1, an eighth with sequence parallelism over tp=8, as much again without it.
    #[test]
    fn a_message_is_the_stage_boundary_tensor() {
        let whole = 2.0 * 2048.0 * 12288.0;
        for (extra, want) in [
            ("tp = 1", whole),
            ("tp = 8", whole / 8.0),
            ("tp = 8\nsequence_parallel = false", whole),
            ("tp = 8\ncp = 2", whole / 16.0),
        ] {
            let m = model(GPT3, extra);
            assert_eq!(crate::memory::message_size(&m), want, "{extra}");
        }
        // Without a `[model]` table, `msg`, in the memory unit.
        let m = CostModel::parse("msg=3").unwrap();
        assert_eq!(crate::memory::message_size(&m), 3.0);
    }

    /// Korthikanti et al. 2022, Table 2, every row, for GPT-3 175B (s=2048, b=1, h=12288,
    /// a=96) at t=8 (and t=1 for the row without parallelism).
    #[test]
    fn gpt3_activations_are_korthikanti_table_2() {
        let (s, b, h, a, t) = (2048.0, 1.0, 12288.0, 96.0, 8.0);
        let sbh = s * b * h;
        let rows = [
            ("tp = 1", sbh * (34.0 + 5.0 * a * s / h)),
            (
                "tp = 8\nsequence_parallel = false",
                sbh * (10.0 + 24.0 / t + 5.0 * a * s / (h * t)),
            ),
            ("tp = 8", sbh * (34.0 / t + 5.0 * a * s / (h * t))),
            (
                "tp = 8\nsequence_parallel = false\nrecompute = \"selective\"",
                sbh * (10.0 + 24.0 / t),
            ),
            ("tp = 8\nrecompute = \"selective\"", sbh * 34.0 / t),
            // The paper's full-recompute row (no sequence parallelism): the layer input.
            (
                "tp = 8\nsequence_parallel = false\nrecompute = \"full\"",
                2.0 * sbh,
            ),
        ];
        for (extra, want) in rows {
            let m = model(GPT3, extra);
            let got = m.layer_memory(LayerKind::Decoder).act;
            assert!(close(got, want), "{extra}: {got} != {want}");
        }
    }

    /// Llama-3 70B: the paper's per-tensor accounting (section 4.1) redone for GQA and
    /// SwiGLU, tensor by tensor, at tp=8 with sequence parallelism.
    #[test]
    fn llama3_activations_count_gqa_and_swiglu() {
        let (s, b, h, a, g, f, t) = (8192.0, 1.0, 8192.0, 64.0, 8.0, 28672.0, 8.0);
        let d = h / a;
        // Sequence-parallel (split by t): 2 norm inputs, attention input, MLP input (bf16);
        // attention and MLP dropout masks (1 byte).
        let sp_part = 2.0 * (2.0 * s * b * h) + 2.0 * s * b * h + 2.0 * s * b * h + 2.0 * s * b * h;
        // Tensor-parallel: Q (a heads), K and V (g heads), projection input, SwiGLU's gate
        // and up outputs (2f) and their product (f).
        let tp_part = 2.0 * s * b * a * d
            + 2.0 * 2.0 * s * b * g * d
            + 2.0 * s * b * h
            + 2.0 * s * b * (2.0 * f)
            + 2.0 * s * b * f;
        let scores = 2.0 * a * s * s * b + a * s * s * b + 2.0 * a * s * s * b;
        let m = model(LLAMA3, "tp = 8\nrecompute = \"selective\"");
        let got = m.layer_memory(LayerKind::Decoder).act;
        assert!(close(got, (sp_part + tp_part) / t), "{got}");
        let m = model(LLAMA3, "tp = 8");
        let got = m.layer_memory(LayerKind::Decoder).act;
        assert!(close(got, (sp_part + tp_part + scores) / t), "{got}");
        // Context parallelism 2: half the sequence per rank; scores of local queries against
        // every key.
        let m = model(LLAMA3, "tp = 8\ncp = 2");
        let got = m.layer_memory(LayerKind::Decoder).act;
        assert!(close(got, (sp_part + tp_part + scores) / t / 2.0), "{got}");
        // The MTP kind is costed as a decoder layer.
        assert_eq!(
            m.layer_memory(LayerKind::Mtp),
            m.layer_memory(LayerKind::Decoder)
        );
    }

    /// Megatron-LM's `compute_weight_and_optimizer_memory` (theoretical_memory_usage.py),
    /// transcribed: per layer `2h^2(1 + g/a) + 2 h ffn (x 3/2 SwiGLU)` over tp plus the
    /// norms (`2h` per norm for LayerNorm, `h` for RMSNorm); the embedding `v h / tp`, `v`
    /// padded to a multiple of 128 tp; 18 bytes per parameter, `6 + 12/d` with the
    /// distributed optimizer.
    #[test]
    fn parameters_as_megatron_counts_them() {
        let gib = (1u64 << 30) as f64;
        // GPT-3 175B at tp=8, no distributed optimizer.
        let h = 12288.0;
        let m = model(GPT3, "tp = 8");
        let layer = (12.0 * h * h) / 8.0 + 2.0 * 2.0 * h;
        assert!(close(
            m.layer_memory(LayerKind::Decoder).param,
            layer * 18.0
        ));
        let vocab = 51200.0; // 50257 padded to a multiple of 1024
        assert!(close(
            m.layer_memory(LayerKind::Embedding).param,
            vocab * h / 8.0 * 18.0
        ));
        assert!(close(
            m.layer_memory(LayerKind::Loss).param,
            (vocab * h / 8.0 + 2.0 * h) * 18.0
        ));
        // 96 layers + embedding + output layer + final norm: 175B parameters as published.
        let total = 96.0 * (12.0 * h * h + 4.0 * h) + 2.0 * vocab * h + 2.0 * h;
        assert!((total / 1e9 - 175.0).abs() < 1.0, "{}", total / 1e9);
        // Llama-3 70B at tp=8, distributed optimizer over dp=8 x cp=2.
        let (h, f) = (8192.0, 28672.0);
        let m = model(
            LLAMA3,
            "tp = 8\ndp = 8\ncp = 2\ndistributed_optimizer = true",
        );
        let layer = (2.0 * h * h * (1.0 + 8.0 / 64.0) + 3.0 * h * f) / 8.0 + 2.0 * h;
        let bpp = 6.0 + 12.0 / 16.0;
        assert!(close(m.layer_memory(LayerKind::Decoder).param, layer * bpp));
        let vocab = 129024.0; // 128256 padded to a multiple of 1024
        assert!(close(
            m.layer_memory(LayerKind::Embedding).param,
            vocab * h / 8.0 * bpp
        ));
        let total = 80.0 * (2.0 * h * h * 1.125 + 3.0 * h * f + 2.0 * h) + 2.0 * 128256.0 * h;
        assert!((total / 1e9 - 70.6).abs() < 0.1, "{}", total / 1e9);
        // fp32 and fp16 rows of Megatron's table (dist_optimizer.md).
        let m32 = model(
            GPT3,
            "dtype = \"fp32\"\ndp = 4\ndistributed_optimizer = true",
        );
        let m16 = model(GPT3, "dtype = \"fp16\"");
        assert!(close(
            m32.layer_memory(LayerKind::Decoder).param / (8.0 + 8.0 / 4.0),
            m16.layer_memory(LayerKind::Decoder).param / 20.0
        ));
        assert!(m.layer_memory(LayerKind::Decoder).param < gib);
    }

    /// Times against Narayanan et al. 2021 (appendix, eq. 3): one iteration of `l` layers
    /// with full recompute is `96 B s l h^2 (1 + s/(6h) + V/(16 l h))` FLOPs, i.e. four
    /// forwards of the layers plus three passes of the output layer; without recompute three
    /// forwards (`72`).
    #[test]
    fn times_follow_the_flop_counts() {
        let (s, h, v, l) = (2048.0, 12288.0, 50304.0, 96.0); // 50257 padded to 128
        let layer_fwd = 24.0 * s * h * h * (1.0 + s / (6.0 * h));
        for (extra, passes) in [("recompute = \"full\"", 4.0), ("", 3.0)] {
            let m = model(GPT3, extra);
            let t = m.layer(LayerKind::Decoder);
            let o = m.layer(LayerKind::Loss);
            let total = (l * (t.f + t.b + t.w) + o.f + o.b + o.w) * layer_fwd;
            let want = passes * 24.0 * s * l * h * h * (1.0 + s / (6.0 * h)) + 6.0 * s * h * v;
            assert!(close(total, want), "{extra}: {total} != {want}");
            assert_eq!(t.f, 1.0);
        }
        // Weight gradient = the weight matmuls' forward; the attention core's backward is all
        // input gradient.
        let m = model(GPT3, "");
        let t = m.layer(LayerKind::Decoder);
        let core = 4.0 * s * s * h / layer_fwd;
        assert!(close(t.w, 1.0 - core) && close(t.b, 1.0 + core));
        assert_eq!(m.layer(LayerKind::Embedding).f, 0.0);
    }

    /// The split of a pass into linear and attention parts sums back to the pass exactly,
    /// whatever the share (Sterbenz's lemma, as `split_exact` says), on a grid of awkward
    /// binary fractions.
    #[test]
    fn splits_sum_back_exactly() {
        use crate::model::split_exact;
        let mut n = 0;
        for i in 1..200u32 {
            let total = 1.0 / f64::from(i) + f64::from(i) * 0.37;
            for j in 0..=60u32 {
                let a = total * f64::from(j) / 60.0 * 1.000_000_1;
                let (lin, attn) = split_exact(total, a);
                assert!(lin >= 0.0 && attn >= 0.0, "{total} {a}");
                assert_eq!(lin + attn, total, "{total} {a}");
                assert!((attn - a.min(total)).abs() <= 1e-15 * total, "{total} {a}");
                n += 1;
            }
        }
        assert_eq!(n, 199 * 61);
    }

    /// `K.act_w` against Korthikanti et al. 2022 section 4.1's list, transcribed per tensor:
    /// of the `34 sbh` (+ core) a GPT-3 layer keeps at tp = 1, the weight GEMMs read the QKV
    /// input (2 sbh), the projection input (2 sbh), the MLP input (2 sbh) and GeLU's output
    /// (8 sbh at ffn = 4h): 14 sbh. With tp = 8 and sequence parallelism all four split by 8.
    /// Full recompute keeps everything it keeps (the layer input). The embedding keeps the
    /// token ids (8sb), the output layer its input (2 sbh).
    #[test]
    fn act_w_is_the_weight_gemms_inputs() {
        let (s, b, h) = (2048.0, 1.0, 12288.0);
        let sbh = s * b * h;
        let m = model(GPT3, "");
        let d = m.layer_memory(LayerKind::Decoder);
        assert!(close(d.act_w.unwrap(), 14.0 * sbh));
        assert!(d.act_w.unwrap() < d.act);
        let sp = model(GPT3, "tp = 8\nsequence_parallel = true");
        assert!(close(
            sp.layer_memory(LayerKind::Decoder).act_w.unwrap(),
            14.0 * sbh / 8.0
        ));
        let full = model(GPT3, "recompute = \"full\"").layer_memory(LayerKind::Decoder);
        assert_eq!(full.act_w, Some(full.act));
        assert!(close(
            m.layer_memory(LayerKind::Embedding).act_w.unwrap(),
            8.0 * s * b
        ));
        assert!(close(
            m.layer_memory(LayerKind::Loss).act_w.unwrap(),
            2.0 * sbh
        ));
        // An explicit `t.act` keeps the derived share; an explicit `t.act_w` wins.
        let mut e = model(GPT3, "");
        e.apply("t.act=34", None).unwrap();
        let share = d.act_w.unwrap() / d.act;
        assert!(close(
            e.layer_memory(LayerKind::Decoder).kept_for_w(),
            34.0 * share
        ));
        e.apply("t.act_w=3", None).unwrap();
        assert_eq!(e.layer_memory(LayerKind::Decoder).act_w, Some(3.0));
    }

    #[test]
    fn explicit_keys_win_over_the_model() {
        let text = format!("t.f = 2.5\nL.param = 1GiB\nf = 3\n[model]\n{GPT3}tp = 8\n");
        let mut m = CostModel::default();
        m.apply(&text, Some("m.toml")).unwrap();
        let derived = model(GPT3, "tp = 8");
        assert_eq!(m.layer(LayerKind::Decoder).f, 2.5);
        // The base `f` applies to MTP layers (no per-kind key for them).
        assert_eq!(m.layer(LayerKind::Mtp).f, 3.0);
        assert_eq!(
            m.layer(LayerKind::Decoder).b,
            derived.layer(LayerKind::Decoder).b
        );
        assert_eq!(m.layer_memory(LayerKind::Loss).param, (1u64 << 30) as f64);
        assert_eq!(
            m.layer_memory(LayerKind::Loss).act,
            derived.layer_memory(LayerKind::Loss).act
        );
        // Inline entries applied after the file win too.
        m.apply("t.act=5", None).unwrap();
        assert_eq!(m.layer_memory(LayerKind::Decoder).act, 5.0);
        // A second model is an error.
        let e = m.apply("[model],hidden=1", None).unwrap_err();
        assert_eq!(e.kind, CostErrorKind::ModelTwice);
        // The header says the embedding and the output layer are not free.
        let d = derived.describe();
        assert!(
            d.contains("from [model]") && !d.contains("free (no cost"),
            "{d}"
        );
        // The JSON form carries the shape.
        let j = serde_json::to_value(&derived).unwrap();
        assert_eq!(j["model"]["hidden"], 12288);
        assert_eq!(j["model"]["sequence_parallel"], true);
    }

    #[test]
    fn bad_model_keys_and_values_are_positioned() {
        let parse = |s: &str| {
            let mut m = CostModel::default();
            m.apply(s, Some("m.toml")).unwrap_err()
        };
        let e = parse("[model]\nhidden = 8\nhiden = 2\n");
        assert_eq!(e.kind, CostErrorKind::UnknownModelKey("hiden".into()));
        assert_eq!((e.line, e.col), (3, 1));
        let e = parse("hidden = 8\n");
        assert_eq!(e.kind, CostErrorKind::ModelKeyOutside("hidden".into()));
        let e = parse(&format!("[model]\n{GPT3}tp = two\n"));
        assert_eq!((e.line, e.col), (7, 6));
        assert!(
            e.render().contains("`tp` must be an integer"),
            "{}",
            e.render()
        );
        let e = parse(&format!("[model]\n{GPT3}dtype = \"bf8\"\n"));
        assert!(matches!(e.kind, CostErrorKind::BadModelValue(_)));
        assert_eq!((e.line, e.col), (7, 9));
        let e = parse(&format!("[model]\n{GPT3}recompute = \"some\"\n"));
        assert!(e
            .render()
            .contains("one of \"none\", \"selective\", \"full\""));
        let e = parse(&format!("[model]\n{GPT3}sequence_parallel = yes\n"));
        assert!(matches!(e.kind, CostErrorKind::BadModelValue(_)));
        let e = parse(&format!("[model]\n{GPT3}seq = 0\n"));
        assert!(matches!(e.kind, CostErrorKind::Duplicate { .. }));
        let e = parse("[model]\nhidden = 0\n");
        assert!(matches!(e.kind, CostErrorKind::BadModelValue(_)));
        let e = parse("# shape\n[model]\nhidden = 8\n");
        assert_eq!(
            e.kind,
            CostErrorKind::MissingModelKeys("ffn, heads, seq, vocab".into())
        );
        assert_eq!((e.line, e.col), (2, 1));
        let e = parse(&format!("[model]\n{GPT3}kv_heads = 7\n"));
        assert!(matches!(e.kind, CostErrorKind::InconsistentModel(_)));
        assert_eq!((e.line, e.col), (7, 12));
        let e = parse(&format!("[model]\n{GPT3}tp = 64\n"));
        assert!(e.render().contains("tp (64) does not divide heads (96)"));
        let e = parse("[costs]\nf = 1\n");
        assert_eq!(e.kind, CostErrorKind::UnknownSection("[costs]".into()));
        let e = parse(&format!("[model]\n{GPT3}[model]\n"));
        assert_eq!(e.kind, CostErrorKind::ModelTwice);
        // Inline form: the header is an item.
        let m = CostModel::parse(
            "p2p=0.1,[model],hidden=1024,ffn=4096,heads=16,seq=2048,vocab=32000,tp=2",
        )
        .unwrap();
        assert!(m.shape.is_some() && m.p2p == 0.1);
    }
}
