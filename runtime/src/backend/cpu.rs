//! The CPU reference backend: one thread per rank, the model of [`crate::model`] in `f32`
//! through ndarray, point-to-point through the in-process rendezvous [`Transport`].

use super::{Backend, BackendError, CommError, CommOp};
use crate::model::{
    self, Ctx, GradAccum, LayerPartial, LayerStash, ModelConfig, Stage, StageGrads, Tensor,
};
use crate::transport::Transport;
use pipec::front::layout::LayerKind;
use pipec_schedules::{Rank, Task};
use std::sync::Arc;

pub type CpuTensor = Tensor<f32>;

/// One rank's share of the model and of the step's results.
pub struct CpuBackend {
    rank: Rank,
    cfg: ModelConfig,
    microbatches: u32,
    step: u32,
    /// Indexed by global stage; `Some` for the stages this rank runs.
    stages: Vec<Option<Stage<f32>>>,
    accum: Vec<Option<GradAccum<f32>>>,
    /// Each microbatch's mean loss, recorded where the `L` layer runs.
    losses: Vec<Option<f32>>,
    transport: Arc<Transport<CpuTensor>>,
}

impl CpuBackend {
    /// `stages` holds the whole model; this rank keeps the ones listed in `mine`.
    pub fn new(
        rank: Rank,
        cfg: ModelConfig,
        microbatches: u32,
        model: &[Stage<f32>],
        mine: &[u32],
        transport: Arc<Transport<CpuTensor>>,
    ) -> Self {
        let mut stages: Vec<Option<Stage<f32>>> = vec![None; model.len()];
        let mut accum = vec![None; model.len()];
        for &s in mine {
            let st = model[s as usize].clone();
            accum[s as usize] = Some(GradAccum::new(&st));
            stages[s as usize] = Some(st);
        }
        CpuBackend {
            rank,
            cfg,
            microbatches,
            step: 0,
            stages,
            accum,
            losses: vec![None; microbatches as usize],
            transport,
        }
    }

    /// Start step `step`: clear gradients and losses.
    pub fn begin_step(&mut self, step: u32) {
        self.step = step;
        self.accum.iter_mut().flatten().for_each(GradAccum::clear);
        self.losses.iter_mut().for_each(|l| *l = None);
    }

    /// (microbatch, loss) recorded on this rank this step.
    pub fn losses(&self) -> impl Iterator<Item = (u32, f32)> + '_ {
        self.losses
            .iter()
            .enumerate()
            .filter_map(|(m, l)| l.map(|l| (m as u32, l)))
    }

    /// The step's summed gradients per local stage, with how many microbatches were summed.
    pub fn grads(&self) -> impl Iterator<Item = (u32, &StageGrads<f32>, u32)> + '_ {
        self.accum
            .iter()
            .enumerate()
            .filter_map(|(s, a)| a.as_ref().map(|a| (s as u32, a.sum(), a.complete())))
    }

    pub fn stages(&self) -> impl Iterator<Item = &Stage<f32>> + '_ {
        self.stages.iter().flatten()
    }

    /// Apply SGD with the step's gradients.
    /// This rank's gradient accumulator of `stage`, if it runs that stage.
    pub fn accum_mut(&mut self, stage: u32) -> Option<&mut GradAccum<f32>> {
        self.accum.get_mut(stage as usize)?.as_mut()
    }

    pub fn sgd(&mut self, lr: f32) {
        for (st, acc) in self.stages.iter_mut().zip(&self.accum) {
            if let (Some(st), Some(acc)) = (st.as_mut(), acc.as_ref()) {
                model::sgd(st, acc.sum(), lr);
            }
        }
    }

    fn ctx(&self) -> Ctx<'_> {
        Ctx {
            cfg: &self.cfg,
            step: self.step,
            microbatches: self.microbatches,
        }
    }

    fn stage(&self, task: Task) -> Result<&Stage<f32>, BackendError> {
        self.stages
            .get(task.stage.index())
            .and_then(Option::as_ref)
            .ok_or_else(|| {
                BackendError(format!(
                    "{} does not hold the weights of {}",
                    self.rank, task.stage
                ))
            })
    }

    fn err(task: Task, e: model::ModelError) -> BackendError {
        BackendError(format!("{task}: {e}"))
    }
}

impl Backend for CpuBackend {
    type Tensor = CpuTensor;
    type Saved = Vec<LayerStash<f32>>;
    type Partial = Vec<LayerPartial<f32>>;

    fn fwd(
        &mut self,
        task: Task,
        input: Option<CpuTensor>,
        save: bool,
    ) -> Result<(CpuTensor, Option<Self::Saved>), BackendError> {
        let input = match input {
            Some(t) => t,
            None => Tensor::Tokens(model::tokens(&self.cfg, self.step, task.mb.0)),
        };
        let stage = self.stage(task)?;
        let holds_loss = stage.layers.iter().any(|l| l.kind == LayerKind::Loss);
        let (out, stash) = model::stage_fwd(stage, input, &self.ctx(), task.mb.0)
            .map_err(|e| Self::err(task, e))?;
        if holds_loss {
            if let (Tensor::Loss(l), Some(slot)) = (&out, self.losses.get_mut(task.mb.index())) {
                *slot = Some(*l);
            }
        }
        Ok((out, save.then_some(stash)))
    }

    fn bwd(
        &mut self,
        task: Task,
        saved: Self::Saved,
        grad: Option<CpuTensor>,
    ) -> Result<CpuTensor, BackendError> {
        let (din, partial) = self.bwd_d(task, &saved, grad)?;
        self.bwd_w(task, saved, partial)?;
        Ok(din)
    }

    fn bwd_d(
        &mut self,
        task: Task,
        saved: &Self::Saved,
        grad: Option<CpuTensor>,
    ) -> Result<(CpuTensor, Self::Partial), BackendError> {
        let stage = self.stage(task)?;
        model::stage_bwd_d(stage, saved, grad.unwrap_or(Tensor::LossGrad), &self.ctx())
            .map_err(|e| Self::err(task, e))
    }

    fn bwd_w(
        &mut self,
        task: Task,
        saved: Self::Saved,
        partial: Self::Partial,
    ) -> Result<(), BackendError> {
        let stage = self.stage(task)?;
        let grads = model::stage_bwd_w(stage, &saved, &partial).map_err(|e| Self::err(task, e))?;
        if let Some(acc) = self.accum[task.stage.index()].as_mut() {
            acc.add(task.mb.0, grads);
        }
        Ok(())
    }

    fn exchange(&mut self, ops: &mut [CommOp<CpuTensor>]) -> Result<(), CommError> {
        self.transport.exchange(self.rank, ops)
    }

    fn post(&mut self, ops: &mut [CommOp<CpuTensor>]) -> Result<(), CommError> {
        self.transport.post(self.rank, ops)
    }

    fn complete(&mut self, ops: &mut [CommOp<CpuTensor>]) -> Result<(), CommError> {
        self.transport.complete(self.rank, ops)
    }

    fn finish(&mut self) {
        self.transport.finish(self.rank);
    }
}
