//! The single-thread reference: the same model, no pipelining. For each microbatch in order,
//! the forward through every stage, then the backward through every stage in reverse, adding
//! each stage's weight gradients in microbatch order. `pipec-run --check` compares a pipelined
//! step against it.

use crate::model::{
    self, Ctx, GradAccum, LayoutUnfit, ModelConfig, ModelError, Stage, StageGrads, Tensor,
};

/// One reference step's results.
#[derive(Clone, Debug)]
pub struct RefStep {
    /// Each microbatch's mean loss.
    pub losses: Vec<f32>,
    /// The step's loss ([`model::step_loss_of`]).
    pub loss: f32,
    /// Per stage, the sum over microbatches of its weight gradients (empty when forward-only).
    pub grads: Vec<StageGrads<f32>>,
}

/// Run step `step` of the whole model over `microbatches` microbatches of `cfg.seq` tokens.
pub fn step(
    stages: &[Stage<f32>],
    cfg: &ModelConfig,
    step: u32,
    microbatches: u32,
    forward_only: bool,
) -> Result<RefStep, ModelError> {
    step_with(stages, cfg, step, microbatches, forward_only, None)
}

/// [`step`] with each microbatch its own number of tokens (`lengths`, by microbatch index,
/// from the plan's `microbatch_lengths`): each runs alone with its own length, in index order,
/// and the loss is the per-token mean ([`model::step_loss_of`]).
pub fn step_with(
    stages: &[Stage<f32>],
    cfg: &ModelConfig,
    step: u32,
    microbatches: u32,
    forward_only: bool,
    lengths: Option<&[u32]>,
) -> Result<RefStep, ModelError> {
    let ctx = Ctx {
        cfg,
        step,
        microbatches,
        lengths,
    };
    let mut accum: Vec<GradAccum<f32>> = stages.iter().map(GradAccum::new).collect();
    let mut losses = Vec::with_capacity(microbatches as usize);
    for mb in 0..microbatches {
        let mut v = Tensor::Tokens(ctx.tokens(mb));
        let mut stashes = Vec::with_capacity(stages.len());
        for st in stages {
            let (out, stash) = model::stage_fwd(st, v, &ctx, mb)?;
            v = out;
            stashes.push(stash);
        }
        match v {
            Tensor::Loss(l) => losses.push(l),
            other => {
                return Err(ModelError::Other {
                    stage: stages.len().saturating_sub(1) as u32,
                    msg: format!("the model ends in {}, not a loss", other.what()),
                })
            }
        }
        if forward_only {
            continue;
        }
        let mut g = Tensor::LossGrad;
        for (st, stash) in stages.iter().zip(&stashes).rev() {
            let (din, partial) = model::stage_bwd_d(st, stash, g, &ctx)?;
            let grads = model::stage_bwd_w(st, stash, &partial)?;
            accum[st.index as usize].add(mb, grads);
            g = din;
        }
    }
    Ok(RefStep {
        loss: model::step_loss_of(&losses, lengths),
        losses,
        grads: if forward_only {
            Vec::new()
        } else {
            accum.into_iter().map(|a| a.sum().clone()).collect()
        },
    })
}

/// Build the reference's copy of the model (same construction as the ranks').
pub fn build(
    layout: &pipec_schedules::layout::Layout,
    cfg: &ModelConfig,
) -> Result<Vec<Stage<f32>>, LayoutUnfit> {
    model::build(layout, cfg)
}
