//! The model the CPU backend trains: built from the manifest's layout, one layer per symbol.
//!
//! - `E` embedding: token ids -> hidden rows of a `[vocab, hidden]` table.
//! - `t` residual MLP block: `y = x + gelu(x·W1 + b1)·W2 + b2` (row-vector form of
//!   `x + W2·gelu(W1·x + b1) + b2`), gelu in its tanh form (Hendrycks & Gimpel, 2016).
//! - `m` the same block: a stand-in for Megatron's multi-token-prediction layer, which in
//!   Megatron is a decoder layer on a shifted target; for pipeline scheduling only its cost and
//!   the fact that it runs after the decoder layers matter, so it shares the block's math.
//! - `L` head: `logits = x·W + b` over the vocabulary, mean cross-entropy over the
//!   microbatch's tokens. The backward seed is scaled by `1/M`, so the step's gradient is the
//!   gradient of the mean loss over microbatches.
//!
//! Microbatches of different lengths (a plan with `microbatch_lengths`, issue #38): microbatch
//! `mb` holds the plan's `tokens(mb)` tokens instead of `seq`, and its loss is weighted by its
//! share of the step's tokens, `n_mb / T` instead of `1/M`: the step's objective is then the
//! per-token mean cross-entropy over every token of the step, `sum CE / T`, the loss of
//! Megatron's `calculate_per_token_loss` (each token weighs the same whatever microbatch it is
//! packed into; a per-microbatch mean would weigh a short microbatch's tokens more). The
//! layers act on each token alone (no attention), so sequences packed into one microbatch are
//! its rows, one after the other.
//!
//! Every layer's backward is written out and split the way zero-bubble schedules split it
//! ("Zero Bubble Pipeline Parallelism", Qi et al., 2024): [`stage_bwd_d`] computes input
//! gradients only and keeps what the weight gradients need ([`LayerPartial`]);
//! [`stage_bwd_w`] computes weight gradients only. A full backward is the two in sequence, so
//! split and unsplit runs do the same floating-point operations.
//!
//! Layer math is generic over the float type: the runtime trains in `f32`, the finite-difference
//! tests run in `f64`.

use ndarray::{Array2, Axis, NdFloat};
use pipec_schedules::layout::{LayerKind, Layout};
use std::collections::BTreeMap;
use thiserror::Error;

/// Sizes and seed of the synthetic model and data.
#[derive(Copy, Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct ModelConfig {
    pub hidden: usize,
    pub ffn: usize,
    pub vocab: usize,
    /// Tokens per microbatch.
    pub seq: usize,
    pub seed: u64,
}

impl Default for ModelConfig {
    fn default() -> Self {
        ModelConfig {
            hidden: 16,
            ffn: 32,
            vocab: 32,
            seq: 8,
            seed: 0,
        }
    }
}

/// splitmix64 (Steele, Lea & Flood, "Fast splittable pseudorandom number generators", 2014):
/// tiny, deterministic on every platform, good enough for weights and synthetic tokens.
#[derive(Clone, Debug)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    pub fn new(seed: u64) -> Self {
        SplitMix64(seed)
    }

    /// A stream for one named purpose, so that each tensor's values do not depend on which
    /// rank builds it or in which order.
    pub fn stream(seed: u64, parts: &[u64]) -> Self {
        let mut g = SplitMix64(seed ^ 0x5049_5045_4352_554e);
        for &p in parts {
            g.0 ^= p.wrapping_mul(0x9e37_79b9_7f4a_7c15);
            g.next_u64();
        }
        g
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `[-1, 1)`.
    pub fn next_signed(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 52) as f64 - 1.0
    }

    pub fn below(&mut self, n: u64) -> u64 {
        // Plain modulo: the bias is irrelevant for synthetic data.
        self.next_u64() % n
    }
}

/// A float constant in `F`.
#[inline]
pub fn c<F: NdFloat>(x: f64) -> F {
    <F as num_traits::NumCast>::from(x).expect("finite constant fits the float type")
}

/// One layer's parameters (or gradients, which have the same shapes). Biases are `[1, n]`
/// rows so that all tensors share one type.
#[derive(Clone, Debug, PartialEq)]
pub struct Layer<F> {
    pub kind: LayerKind,
    pub tensors: Vec<Array2<F>>,
}

impl<F: NdFloat> Layer<F> {
    /// Names of the tensors of a layer kind, in storage order.
    pub fn names(kind: LayerKind) -> &'static [&'static str] {
        match kind {
            LayerKind::Embedding => &["table"],
            LayerKind::Decoder | LayerKind::Mtp => &["W1", "b1", "W2", "b2"],
            LayerKind::Loss => &["W", "b"],
        }
    }

    /// Deterministic initialization: uniform in `±1/sqrt(fan_in)` for matrices, `±0.1` for
    /// biases, `±1` for the embedding table; each tensor from its own splitmix stream keyed by
    /// (seed, stage, layer, tensor).
    pub fn init(kind: LayerKind, cfg: &ModelConfig, stage: u32, index: usize) -> Self {
        let (h, f, v) = (cfg.hidden, cfg.ffn, cfg.vocab);
        let shapes: Vec<((usize, usize), f64)> = match kind {
            LayerKind::Embedding => vec![((v, h), 1.0)],
            LayerKind::Decoder | LayerKind::Mtp => vec![
                ((h, f), 1.0 / (h as f64).sqrt()),
                ((1, f), 0.1),
                ((f, h), 1.0 / (f as f64).sqrt()),
                ((1, h), 0.1),
            ],
            LayerKind::Loss => vec![((h, v), 1.0 / (h as f64).sqrt()), ((1, v), 0.1)],
        };
        let tensors = shapes
            .into_iter()
            .enumerate()
            .map(|(t, (shape, scale))| {
                let mut g =
                    SplitMix64::stream(cfg.seed, &[1, stage as u64, index as u64, t as u64]);
                Array2::from_shape_simple_fn(shape, || c::<F>(g.next_signed() * scale))
            })
            .collect();
        Layer { kind, tensors }
    }

    pub fn zeros_like(&self) -> Self {
        Layer {
            kind: self.kind,
            tensors: self
                .tensors
                .iter()
                .map(|t| Array2::zeros(t.raw_dim()))
                .collect(),
        }
    }
}

/// Synthetic data: microbatch `mb` of step `step`. Targets are a fixed function of the token
/// (`(3·tok + 1) mod vocab`), so the model can learn it and the loss falls over steps.
pub fn tokens(cfg: &ModelConfig, step: u32, mb: u32) -> Vec<u32> {
    tokens_n(cfg, step, mb, cfg.seq)
}

pub fn targets(cfg: &ModelConfig, step: u32, mb: u32) -> Vec<u32> {
    targets_n(cfg, step, mb, cfg.seq)
}

/// [`tokens`] for a microbatch of `n` tokens (its length in a plan with lengths): the first
/// `n` of the same stream.
pub fn tokens_n(cfg: &ModelConfig, step: u32, mb: u32, n: usize) -> Vec<u32> {
    let mut g = SplitMix64::stream(cfg.seed, &[2, step as u64, mb as u64]);
    (0..n).map(|_| g.below(cfg.vocab as u64) as u32).collect()
}

/// [`targets`] for a microbatch of `n` tokens.
pub fn targets_n(cfg: &ModelConfig, step: u32, mb: u32, n: usize) -> Vec<u32> {
    tokens_n(cfg, step, mb, n)
        .into_iter()
        .map(|t| ((3 * t as u64 + 1) % cfg.vocab as u64) as u32)
        .collect()
}

/// What flows between stages: forward values and backward gradients.
#[derive(Clone, Debug, PartialEq)]
pub enum Tensor<F> {
    /// Token ids, before the embedding (flows through empty stages ahead of `E`).
    Tokens(Vec<u32>),
    /// A `[seq, hidden]` activation, or its gradient.
    Hidden(Array2<F>),
    /// The microbatch's mean loss (flows through empty stages after `L`).
    Loss(F),
    /// The gradient of the loss with respect to itself: the backward seed.
    LossGrad,
    /// The (absent) gradient with respect to token ids, sent back through stages ahead of `E`.
    TokenGrad,
}

impl<F> Tensor<F> {
    pub fn what(&self) -> &'static str {
        match self {
            Tensor::Tokens(_) => "token ids",
            Tensor::Hidden(_) => "a hidden tensor",
            Tensor::Loss(_) => "a loss",
            Tensor::LossGrad => "the loss gradient",
            Tensor::TokenGrad => "the token-id gradient",
        }
    }
}

/// What a layer's forward keeps for its backward.
#[derive(Clone, Debug)]
pub enum LayerStash<F> {
    Embedding {
        tokens: Vec<u32>,
    },
    Block {
        x: Array2<F>,
        h: Array2<F>,
        a: Array2<F>,
    },
    Head {
        x: Array2<F>,
        probs: Array2<F>,
        targets: Vec<u32>,
    },
}

impl<F: NdFloat> LayerStash<F> {
    /// Drop what only the input gradient reads, once it ran ([`stage_bwd_d`]): the block's
    /// GeLU input `h` and the head's probabilities and targets. What stays is what
    /// [`stage_bwd_w`] reads, the weight GEMMs' inputs (the block's `x` and `a`, the head's
    /// `x`) and the embedding's token ids, the split Korthikanti et al. 2022 name for a
    /// transformer layer (`pipec_cost::model`, `layer_activation_w`).
    pub fn keep_for_w(&mut self) {
        match self {
            LayerStash::Embedding { .. } => {}
            LayerStash::Block { h, .. } => *h = Array2::zeros((0, 0)),
            LayerStash::Head { probs, targets, .. } => {
                *probs = Array2::zeros((0, 0));
                *targets = Vec::new();
            }
        }
    }

    /// Elements the stash holds (token ids count one each): what it keeps in memory.
    pub fn elements(&self) -> usize {
        match self {
            LayerStash::Embedding { tokens } => tokens.len(),
            LayerStash::Block { x, h, a } => x.len() + h.len() + a.len(),
            LayerStash::Head { x, probs, targets } => x.len() + probs.len() + targets.len(),
        }
    }
}

/// What a layer's input-gradient pass keeps for its weight-gradient pass.
#[derive(Clone, Debug)]
pub enum LayerPartial<F> {
    Embedding { dy: Array2<F> },
    Block { dy: Array2<F>, dh: Array2<F> },
    Head { dlogits: Array2<F> },
}

#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum ModelError {
    #[error("layer {layer} ({kind}) of stage {stage} expects {expected} but got {got}")]
    Input {
        stage: u32,
        layer: usize,
        kind: char,
        expected: &'static str,
        got: &'static str,
    },
    #[error("stage {stage}: {msg}")]
    Other { stage: u32, msg: String },
}

const GELU_C: f64 = 0.797_884_560_802_865_4; // sqrt(2 / pi)
const GELU_K: f64 = 0.044_715;

fn gelu<F: NdFloat>(x: F) -> F {
    let t = (c::<F>(GELU_C) * (x + c::<F>(GELU_K) * x * x * x)).tanh();
    c::<F>(0.5) * x * (F::one() + t)
}

fn gelu_grad<F: NdFloat>(x: F) -> F {
    let t = (c::<F>(GELU_C) * (x + c::<F>(GELU_K) * x * x * x)).tanh();
    let dinner = c::<F>(GELU_C) * (F::one() + c::<F>(3.0 * GELU_K) * x * x);
    c::<F>(0.5) * (F::one() + t) + c::<F>(0.5) * x * (F::one() - t * t) * dinner
}

fn row_sums<F: NdFloat>(a: &Array2<F>) -> Array2<F> {
    a.sum_axis(Axis(0)).insert_axis(Axis(0))
}

// ---- layer kernels -------------------------------------------------------------------------

pub fn embed_fwd<F: NdFloat>(table: &Array2<F>, tokens: &[u32]) -> Array2<F> {
    let h = table.ncols();
    let mut out = Array2::zeros((tokens.len(), h));
    for (i, &t) in tokens.iter().enumerate() {
        out.row_mut(i).assign(&table.row(t as usize));
    }
    out
}

/// Scatter-add of the output gradient rows into the table's gradient, in token order.
pub fn embed_bwd_w<F: NdFloat>(shape: (usize, usize), tokens: &[u32], dy: &Array2<F>) -> Array2<F> {
    let mut g = Array2::zeros(shape);
    for (i, &t) in tokens.iter().enumerate() {
        let mut row = g.row_mut(t as usize);
        row.zip_mut_with(&dy.row(i), |a, &b| *a += b);
    }
    g
}

/// Returns `(y, h, a)` with `h = x·W1 + b1`, `a = gelu(h)`, `y = x + a·W2 + b2`.
pub fn block_fwd<F: NdFloat>(p: &[Array2<F>], x: &Array2<F>) -> (Array2<F>, Array2<F>, Array2<F>) {
    let h = x.dot(&p[0]) + &p[1];
    let a = h.mapv(gelu);
    let y = x + &a.dot(&p[2]) + &p[3];
    (y, h, a)
}

/// Input gradient only: `dh = (dy·W2ᵀ) ⊙ gelu'(h)`, `dx = dy + dh·W1ᵀ`. Returns `(dx, dh)`.
pub fn block_bwd_d<F: NdFloat>(
    p: &[Array2<F>],
    h: &Array2<F>,
    dy: &Array2<F>,
) -> (Array2<F>, Array2<F>) {
    let mut dh = dy.dot(&p[2].t());
    dh.zip_mut_with(h, |d, &hv| *d *= gelu_grad(hv));
    let dx = dy + &dh.dot(&p[0].t());
    (dx, dh)
}

/// Weight gradients only: `[dW1, db1, dW2, db2]`.
pub fn block_bwd_w<F: NdFloat>(
    x: &Array2<F>,
    a: &Array2<F>,
    dy: &Array2<F>,
    dh: &Array2<F>,
) -> Vec<Array2<F>> {
    vec![x.t().dot(dh), row_sums(dh), a.t().dot(dy), row_sums(dy)]
}

/// Returns `(mean cross-entropy, softmax probabilities)`.
pub fn head_fwd<F: NdFloat>(p: &[Array2<F>], x: &Array2<F>, targets: &[u32]) -> (F, Array2<F>) {
    let mut probs = x.dot(&p[0]) + &p[1];
    let mut total = F::zero();
    for (mut row, &y) in probs.rows_mut().into_iter().zip(targets) {
        let mx = row.fold(F::neg_infinity(), |m, &v| m.max(v));
        let zy = row[y as usize] - mx;
        row.mapv_inplace(|v| (v - mx).exp());
        let s = row.sum();
        total += s.ln() - zy;
        row.mapv_inplace(|v| v / s);
    }
    (total / c::<F>(targets.len() as f64), probs)
}

/// Input gradient only. `scale` multiplies the loss (here `1/M`). Returns `(dx, dlogits)`.
pub fn head_bwd_d<F: NdFloat>(
    p: &[Array2<F>],
    probs: &Array2<F>,
    targets: &[u32],
    scale: F,
) -> (Array2<F>, Array2<F>) {
    let k = scale / c::<F>(targets.len() as f64);
    let mut dlogits = probs.clone();
    for (mut row, &y) in dlogits.rows_mut().into_iter().zip(targets) {
        row[y as usize] -= F::one();
        row.mapv_inplace(|v| v * k);
    }
    let dx = dlogits.dot(&p[0].t());
    (dx, dlogits)
}

pub fn head_bwd_w<F: NdFloat>(x: &Array2<F>, dlogits: &Array2<F>) -> Vec<Array2<F>> {
    vec![x.t().dot(dlogits), row_sums(dlogits)]
}

// ---- stages --------------------------------------------------------------------------------

/// One virtual stage's layers. A stage without layers is the identity.
#[derive(Clone, Debug, PartialEq)]
pub struct Stage<F> {
    pub index: u32,
    pub layers: Vec<Layer<F>>,
}

/// Per-layer gradients of one stage (same shapes as its parameters).
pub type StageGrads<F> = Vec<Layer<F>>;

/// Everything a microbatch's forward needs besides the stage: the data source and the step.
#[derive(Copy, Clone, Debug)]
pub struct Ctx<'a> {
    pub cfg: &'a ModelConfig,
    pub step: u32,
    pub microbatches: u32,
    /// Tokens of each microbatch, by index, when the plan carries `microbatch_lengths`;
    /// `None`: every microbatch holds `cfg.seq`.
    pub lengths: Option<&'a [u32]>,
}

impl Ctx<'_> {
    /// Tokens of microbatch `mb`.
    pub fn len(&self, mb: u32) -> usize {
        match self.lengths {
            Some(l) => l.get(mb as usize).map_or(0, |&n| n as usize),
            None => self.cfg.seq,
        }
    }

    /// Microbatch `mb`'s token ids.
    pub fn tokens(&self, mb: u32) -> Vec<u32> {
        tokens_n(self.cfg, self.step, mb, self.len(mb))
    }

    /// Microbatch `mb`'s targets.
    pub fn targets(&self, mb: u32) -> Vec<u32> {
        targets_n(self.cfg, self.step, mb, self.len(mb))
    }

    /// Scale of the mean loss of a microbatch of `n` tokens in the step's objective: `1/M`,
    /// or with lengths its share of the step's tokens, `n / T` (the per-token mean; see the
    /// module's note).
    pub fn loss_scale<F: NdFloat>(&self, n: usize) -> F {
        match self.lengths {
            Some(l) => {
                let total: u64 = l.iter().map(|&n| n as u64).sum();
                c::<F>(n as f64) / c::<F>(total.max(1) as f64)
            }
            None => F::one() / c::<F>(self.microbatches as f64),
        }
    }
}

impl<F: NdFloat> Stage<F> {
    fn bad_input(&self, layer: usize, expected: &'static str, got: &Tensor<F>) -> ModelError {
        ModelError::Input {
            stage: self.index,
            layer,
            kind: self.layers[layer].kind.symbol(),
            expected,
            got: got.what(),
        }
    }
}

/// Forward of one stage on microbatch `mb`. Returns the output and, per layer, its stash. When
/// the stage holds `L`, the output is [`Tensor::Loss`] with the microbatch's mean loss.
pub fn stage_fwd<F: NdFloat>(
    stage: &Stage<F>,
    input: Tensor<F>,
    ctx: &Ctx<'_>,
    mb: u32,
) -> Result<(Tensor<F>, Vec<LayerStash<F>>), ModelError> {
    let mut v = input;
    let mut stash = Vec::with_capacity(stage.layers.len());
    for (i, layer) in stage.layers.iter().enumerate() {
        let p = &layer.tensors;
        v = match (layer.kind, v) {
            (LayerKind::Embedding, Tensor::Tokens(tok)) => {
                let y = embed_fwd(&p[0], &tok);
                stash.push(LayerStash::Embedding { tokens: tok });
                Tensor::Hidden(y)
            }
            (LayerKind::Decoder | LayerKind::Mtp, Tensor::Hidden(x)) => {
                let (y, h, a) = block_fwd(p, &x);
                stash.push(LayerStash::Block { x, h, a });
                Tensor::Hidden(y)
            }
            (LayerKind::Loss, Tensor::Hidden(x)) => {
                let t = ctx.targets(mb);
                let (loss, probs) = head_fwd(p, &x, &t);
                stash.push(LayerStash::Head {
                    x,
                    probs,
                    targets: t,
                });
                Tensor::Loss(loss)
            }
            (LayerKind::Embedding, other) => return Err(stage.bad_input(i, "token ids", &other)),
            (_, other) => return Err(stage.bad_input(i, "a hidden tensor", &other)),
        };
    }
    Ok((v, stash))
}

/// Input-gradient pass of one stage: `grad` is the gradient of the stage's output
/// ([`Tensor::LossGrad`] at the end of the model). Returns the gradient of its input and, per
/// layer, what the weight-gradient pass needs.
pub fn stage_bwd_d<F: NdFloat>(
    stage: &Stage<F>,
    stash: &[LayerStash<F>],
    grad: Tensor<F>,
    ctx: &Ctx<'_>,
) -> Result<(Tensor<F>, Vec<LayerPartial<F>>), ModelError> {
    if stash.len() != stage.layers.len() {
        return Err(ModelError::Other {
            stage: stage.index,
            msg: format!(
                "stash holds {} layers, the stage has {}",
                stash.len(),
                stage.layers.len()
            ),
        });
    }
    let mut g = grad;
    let mut partial = Vec::with_capacity(stash.len());
    for (i, (layer, st)) in stage.layers.iter().zip(stash).enumerate().rev() {
        let p = &layer.tensors;
        g = match (st, g) {
            (LayerStash::Head { probs, targets, .. }, Tensor::LossGrad) => {
                let (dx, dlogits) =
                    head_bwd_d(p, probs, targets, ctx.loss_scale::<F>(targets.len()));
                partial.push(LayerPartial::Head { dlogits });
                Tensor::Hidden(dx)
            }
            (LayerStash::Block { h, .. }, Tensor::Hidden(dy)) => {
                let (dx, dh) = block_bwd_d(p, h, &dy);
                partial.push(LayerPartial::Block { dy, dh });
                Tensor::Hidden(dx)
            }
            (LayerStash::Embedding { .. }, Tensor::Hidden(dy)) => {
                partial.push(LayerPartial::Embedding { dy });
                Tensor::TokenGrad
            }
            (LayerStash::Head { .. }, other) => {
                return Err(stage.bad_input(i, "the loss gradient", &other))
            }
            (_, other) => return Err(stage.bad_input(i, "a hidden gradient", &other)),
        };
    }
    partial.reverse();
    Ok((g, partial))
}

/// Weight-gradient pass of one stage.
pub fn stage_bwd_w<F: NdFloat>(
    stage: &Stage<F>,
    stash: &[LayerStash<F>],
    partial: &[LayerPartial<F>],
) -> Result<StageGrads<F>, ModelError> {
    let mut grads = Vec::with_capacity(stage.layers.len());
    for (layer, (st, pa)) in stage.layers.iter().zip(stash.iter().zip(partial)) {
        let tensors = match (st, pa) {
            (LayerStash::Embedding { tokens }, LayerPartial::Embedding { dy }) => {
                vec![embed_bwd_w(layer.tensors[0].dim(), tokens, dy)]
            }
            (LayerStash::Block { x, a, .. }, LayerPartial::Block { dy, dh }) => {
                block_bwd_w(x, a, dy, dh)
            }
            (LayerStash::Head { x, .. }, LayerPartial::Head { dlogits }) => head_bwd_w(x, dlogits),
            _ => {
                return Err(ModelError::Other {
                    stage: stage.index,
                    msg: "stash and partial gradients disagree on the layer kinds".into(),
                })
            }
        };
        grads.push(Layer {
            kind: layer.kind,
            tensors,
        });
    }
    if grads.len() != stage.layers.len() {
        return Err(ModelError::Other {
            stage: stage.index,
            msg: "partial gradients are missing layers".into(),
        });
    }
    Ok(grads)
}

/// The step's sum over microbatches of a stage's weight gradients, added in microbatch order
/// whatever order the schedule produced them in: out-of-order contributions wait in `pending`.
/// The reference adds in order too, so both do the same additions and agree bitwise.
#[derive(Clone, Debug)]
pub struct GradAccum<F> {
    next: u32,
    pending: BTreeMap<u32, StageGrads<F>>,
    sum: StageGrads<F>,
}

impl<F: NdFloat> GradAccum<F> {
    pub fn new(stage: &Stage<F>) -> Self {
        GradAccum {
            next: 0,
            pending: BTreeMap::new(),
            sum: stage.layers.iter().map(Layer::zeros_like).collect(),
        }
    }

    pub fn add(&mut self, mb: u32, g: StageGrads<F>) {
        if mb != self.next {
            self.pending.insert(mb, g);
            return;
        }
        add_into(&mut self.sum, &g);
        self.next += 1;
        while let Some(g) = self.pending.remove(&self.next) {
            add_into(&mut self.sum, &g);
            self.next += 1;
        }
    }

    /// Take every microbatch this accumulator holds out of order (those it could not sum
    /// yet), for the replica that sums them. This is how two replicas of a stage (DualPipe's
    /// two directions) reduce their gradients: the replica that saw microbatch 0 [`add`]s the
    /// other's, so the total is still summed in microbatch order and equals the single-thread
    /// reference bitwise.
    ///
    /// [`add`]: Self::add
    pub fn take_pending(&mut self) -> BTreeMap<u32, StageGrads<F>> {
        std::mem::take(&mut self.pending)
    }

    /// Make `sum` (of `next` microbatches in order: the reduced one) this accumulator's, so
    /// every replica applies the same update.
    pub fn set_sum(&mut self, sum: &StageGrads<F>, next: u32) {
        self.next = next;
        self.pending.clear();
        self.sum.clone_from(sum);
    }

    /// Microbatches added in order so far.
    pub fn complete(&self) -> u32 {
        self.next
    }

    pub fn sum(&self) -> &StageGrads<F> {
        &self.sum
    }

    /// Reset for the next step, keeping the buffers.
    pub fn clear(&mut self) {
        self.next = 0;
        self.pending.clear();
        for l in &mut self.sum {
            for t in &mut l.tensors {
                t.fill(F::zero());
            }
        }
    }
}

fn add_into<F: NdFloat>(sum: &mut StageGrads<F>, g: &StageGrads<F>) {
    for (s, g) in sum.iter_mut().zip(g) {
        for (s, g) in s.tensors.iter_mut().zip(&g.tensors) {
            s.zip_mut_with(g, |a, &b| *a += b);
        }
    }
}

/// Plain SGD: `w -= lr · g`.
pub fn sgd<F: NdFloat>(stage: &mut Stage<F>, grads: &StageGrads<F>, lr: F) {
    for (l, g) in stage.layers.iter_mut().zip(grads) {
        for (w, g) in l.tensors.iter_mut().zip(&g.tensors) {
            w.zip_mut_with(g, |w, &g| *w -= lr * g);
        }
    }
}

/// The step's loss: the mean over microbatches of each microbatch's mean loss, summed in
/// microbatch order.
pub fn step_loss<F: NdFloat>(per_mb: &[F]) -> F {
    let mut s = F::zero();
    for &l in per_mb {
        s += l;
    }
    s / c::<F>(per_mb.len().max(1) as f64)
}

/// The step's loss of a plan: [`step_loss`] without lengths; with them (`tokens` per
/// microbatch) the per-token mean, `sum(loss_mb · n_mb) / T`, summed in microbatch order.
pub fn step_loss_of<F: NdFloat>(per_mb: &[F], tokens: Option<&[u32]>) -> F {
    let Some(tokens) = tokens else {
        return step_loss(per_mb);
    };
    let mut s = F::zero();
    let mut total = 0u64;
    for (&l, &n) in per_mb.iter().zip(tokens) {
        s += l * c::<F>(n as f64);
        total += n as u64;
    }
    s / c::<F>(total.max(1) as f64)
}

/// Why a layout cannot be trained.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
#[error("{0}")]
pub struct LayoutUnfit(pub String);

/// All stages of the model, initialized from the seed. Refuses layouts the model cannot run:
/// it needs exactly one `E`, as the very first layer, and exactly one `L`, as the very last.
pub fn build<F: NdFloat>(layout: &Layout, cfg: &ModelConfig) -> Result<Vec<Stage<F>>, LayoutUnfit> {
    let flat: Vec<LayerKind> = layout.stages.iter().flatten().copied().collect();
    let count = |k| flat.iter().filter(|&&l| l == k).count();
    if count(LayerKind::Embedding) != 1 || flat.first() != Some(&LayerKind::Embedding) {
        return Err(LayoutUnfit(format!(
            "layout `{}` must hold exactly one `E`, as its first layer",
            layout.expanded()
        )));
    }
    if count(LayerKind::Loss) != 1 || flat.last() != Some(&LayerKind::Loss) {
        return Err(LayoutUnfit(format!(
            "layout `{}` must hold exactly one `L`, as its last layer",
            layout.expanded()
        )));
    }
    Ok(layout
        .stages
        .iter()
        .enumerate()
        .map(|(s, kinds)| Stage {
            index: s as u32,
            layers: kinds
                .iter()
                .enumerate()
                .map(|(i, &k)| Layer::init(k, cfg, s as u32, i))
                .collect(),
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use ndarray::Array2;

    fn cfg() -> ModelConfig {
        ModelConfig {
            hidden: 4,
            ffn: 6,
            vocab: 5,
            seq: 3,
            seed: 7,
        }
    }

    /// Central finite difference of `f` with respect to every element of `t`.
    fn fd(t: &mut Array2<f64>, f: &mut dyn FnMut(&Array2<f64>) -> f64) -> Array2<f64> {
        let eps = 1e-6;
        let mut g = Array2::zeros(t.raw_dim());
        for idx in 0..t.len() {
            let (r, c) = (idx / t.ncols(), idx % t.ncols());
            let orig = t[[r, c]];
            t[[r, c]] = orig + eps;
            let up = f(t);
            t[[r, c]] = orig - eps;
            let down = f(t);
            t[[r, c]] = orig;
            g[[r, c]] = (up - down) / (2.0 * eps);
        }
        g
    }

    fn close(a: &Array2<f64>, b: &Array2<f64>, what: &str) {
        assert_eq!(a.dim(), b.dim(), "{what}");
        for (x, y) in a.iter().zip(b) {
            assert!(
                (x - y).abs() <= 1e-6 * (1.0 + y.abs()),
                "{what}: analytic {x} vs finite difference {y}"
            );
        }
    }

    fn rand(shape: (usize, usize), seed: u64) -> Array2<f64> {
        let mut g = SplitMix64::new(seed);
        Array2::from_shape_simple_fn(shape, || g.next_signed())
    }

    /// A fixed linear functional `sum(y ⊙ r)` turns a tensor output into a scalar objective
    /// whose gradient with respect to `y` is `r`.
    fn dotr(y: &Array2<f64>, r: &Array2<f64>) -> f64 {
        (y * r).sum()
    }

    /// Issue #39: after `bwd_D` a block keeps `x` and GeLU's output (`seq (hidden + ffn)` of
    /// its `seq (hidden + 2 ffn)` elements), a head its input only; `bwd_W` on the cut stash
    /// gives bitwise the weight gradients of the whole one.
    #[test]
    fn the_stash_cut_at_bwd_d_keeps_what_bwd_w_reads() {
        let cfg = cfg();
        let layout = pipec_schedules::layout::parse("EtL").unwrap();
        let stages = build::<f64>(&layout, &cfg).unwrap();
        let stage = &stages[0];
        let ctx = Ctx {
            cfg: &cfg,
            step: 0,
            microbatches: 1,
            lengths: None,
        };
        let tokens: Vec<u32> = ctx.tokens(0);
        let (_, stash) = stage_fwd(stage, Tensor::Tokens(tokens), &ctx, 0).unwrap();
        let (_, partial) = stage_bwd_d(stage, &stash, Tensor::LossGrad, &ctx).unwrap();
        let whole = stage_bwd_w(stage, &stash, &partial).unwrap();
        let mut cut = stash.clone();
        for st in &mut cut {
            st.keep_for_w();
        }
        let (s, h, f) = (cfg.seq, cfg.hidden, cfg.ffn);
        let got: Vec<usize> = cut.iter().map(LayerStash::elements).collect();
        let was: Vec<usize> = stash.iter().map(LayerStash::elements).collect();
        assert_eq!(was[1..], [s * (h + 2 * f), s * h + s * cfg.vocab + s]);
        assert_eq!(got, vec![was[0], s * (h + f), s * h]);
        let after = stage_bwd_w(stage, &cut, &partial).unwrap();
        for (a, b) in whole.iter().zip(&after) {
            for (x, y) in a.tensors.iter().zip(&b.tensors) {
                assert!(x.iter().zip(y).all(|(p, q)| p.to_bits() == q.to_bits()));
            }
        }
    }

    #[test]
    fn block_backward_matches_finite_differences() {
        for kind in [LayerKind::Decoder, LayerKind::Mtp] {
            let cfg = cfg();
            let layer = Layer::<f64>::init(kind, &cfg, 1, 0);
            let x = rand((cfg.seq, cfg.hidden), 3);
            let r = rand((cfg.seq, cfg.hidden), 4);
            let (_, h, a) = block_fwd(&layer.tensors, &x);
            let (dx, dh) = block_bwd_d(&layer.tensors, &h, &r);
            let dws = block_bwd_w(&x, &a, &r, &dh);
            let p = layer.tensors.clone();
            let mut xm = x.clone();
            let fdx = fd(&mut xm, &mut |x| dotr(&block_fwd(&p, x).0, &r));
            close(&dx, &fdx, "block dx");
            for (i, name) in Layer::<f64>::names(kind).iter().enumerate() {
                let mut ps = layer.tensors.clone();
                let mut t = ps[i].clone();
                let g = fd(&mut t, &mut |t| {
                    ps[i] = t.clone();
                    dotr(&block_fwd(&ps, &x).0, &r)
                });
                close(&dws[i], &g, name);
            }
        }
    }

    #[test]
    fn head_backward_matches_finite_differences() {
        let cfg = cfg();
        let layer = Layer::<f64>::init(LayerKind::Loss, &cfg, 2, 0);
        let x = rand((cfg.seq, cfg.hidden), 5);
        let tg: Vec<u32> = vec![0, 4, 2];
        let scale = 0.25;
        let (_, probs) = head_fwd(&layer.tensors, &x, &tg);
        let (dx, dl) = head_bwd_d(&layer.tensors, &probs, &tg, scale);
        let dws = head_bwd_w(&x, &dl);
        let p = layer.tensors.clone();
        let mut xm = x.clone();
        let fdx = fd(&mut xm, &mut |x| scale * head_fwd(&p, x, &tg).0);
        close(&dx, &fdx, "head dx");
        for (i, name) in ["W", "b"].iter().enumerate() {
            let mut ps = layer.tensors.clone();
            let mut t = ps[i].clone();
            let g = fd(&mut t, &mut |t| {
                ps[i] = t.clone();
                scale * head_fwd(&ps, &x, &tg).0
            });
            close(&dws[i], &g, name);
        }
    }

    #[test]
    fn embedding_backward_matches_finite_differences() {
        let cfg = cfg();
        let layer = Layer::<f64>::init(LayerKind::Embedding, &cfg, 0, 0);
        let tok: Vec<u32> = vec![1, 3, 1]; // a repeated token accumulates
        let r = rand((tok.len(), cfg.hidden), 6);
        let g = embed_bwd_w(layer.tensors[0].dim(), &tok, &r);
        let mut t = layer.tensors[0].clone();
        let fdg = fd(&mut t, &mut |t| dotr(&embed_fwd(t, &tok), &r));
        close(&g, &fdg, "embedding table");
    }

    /// A whole stage `E t m L` end to end: the stage-level split backward against finite
    /// differences of the loss, which also checks the plumbing between layers.
    #[test]
    fn stage_split_backward_matches_finite_differences() {
        let cfg = cfg();
        let layout = Layout {
            text: None,
            stages: vec![vec![
                LayerKind::Embedding,
                LayerKind::Decoder,
                LayerKind::Mtp,
                LayerKind::Loss,
            ]],
        };
        let stages = build::<f64>(&layout, &cfg).unwrap();
        let ctx = Ctx {
            cfg: &cfg,
            step: 0,
            microbatches: 2,
            lengths: None,
        };
        let loss =
            |st: &Stage<f64>| match stage_fwd(st, Tensor::Tokens(tokens(&cfg, 0, 1)), &ctx, 1)
                .unwrap()
                .0
            {
                Tensor::Loss(l) => l * ctx.loss_scale::<f64>(cfg.seq),
                _ => unreachable!(),
            };
        let st = &stages[0];
        let (_, stash) = stage_fwd(st, Tensor::Tokens(tokens(&cfg, 0, 1)), &ctx, 1).unwrap();
        let (din, partial) = stage_bwd_d(st, &stash, Tensor::LossGrad, &ctx).unwrap();
        assert_eq!(din, Tensor::TokenGrad);
        let grads = stage_bwd_w(st, &stash, &partial).unwrap();
        for (li, layer) in st.layers.iter().enumerate() {
            for ti in 0..layer.tensors.len() {
                let mut s2 = st.clone();
                let mut t = layer.tensors[ti].clone();
                let g = fd(&mut t, &mut |t| {
                    s2.layers[li].tensors[ti] = t.clone();
                    loss(&s2)
                });
                close(
                    &grads[li].tensors[ti],
                    &g,
                    &format!("layer {li} tensor {ti}"),
                );
            }
        }
    }

    #[test]
    fn accumulation_is_order_independent_bitwise() {
        let cfg = cfg();
        let stage = Stage::<f32> {
            index: 0,
            layers: vec![Layer::init(LayerKind::Decoder, &cfg, 0, 0)],
        };
        let gs: Vec<StageGrads<f32>> = (0..5)
            .map(|m| {
                let mut g = SplitMix64::new(m);
                vec![Layer {
                    kind: LayerKind::Decoder,
                    tensors: stage.layers[0]
                        .tensors
                        .iter()
                        .map(|t| {
                            Array2::from_shape_simple_fn(t.raw_dim(), || {
                                g.next_signed() as f32 * 1e3
                            })
                        })
                        .collect(),
                }]
            })
            .collect();
        let mut inorder = GradAccum::new(&stage);
        for (m, g) in gs.iter().enumerate() {
            inorder.add(m as u32, g.clone());
        }
        let mut shuffled = GradAccum::new(&stage);
        for m in [3u32, 1, 4, 0, 2] {
            shuffled.add(m, gs[m as usize].clone());
        }
        assert_eq!(shuffled.complete(), 5);
        assert_eq!(inorder.sum(), shuffled.sum());
    }

    #[test]
    fn layouts_without_embedding_first_or_loss_last_are_refused() {
        let l = |s: &str| pipec_schedules::layout::expand(s).unwrap();
        assert!(build::<f32>(&l("tE|L"), &cfg()).is_err());
        assert!(build::<f32>(&l("E|t"), &cfg()).is_err());
        assert!(build::<f32>(&l("|Et|tL|"), &cfg()).is_ok());
    }
}
