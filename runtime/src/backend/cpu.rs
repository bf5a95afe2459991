//! The CPU reference backend: one thread per rank, the model of [`crate::model`] in `f32`
//! through ndarray, point-to-point through the in-process rendezvous [`Transport`].

use super::{Backend, BackendError, CommError, CommOp};
use crate::driver::{LocalGrads, StepBackend, StepError};
use crate::interp::RankRun;
use crate::model::{
    self, Ctx, GradAccum, LayerPartial, LayerStash, ModelConfig, Stage, StageGrads, Tensor,
};
use crate::transport::Transport;
use pipec_ir::ir::Instr;
use pipec_schedules::layout::LayerKind;
use pipec_schedules::{Rank, Task};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

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
    /// Tokens of each microbatch when the plan carries `microbatch_lengths` ([`Ctx::lengths`]).
    lengths: Option<Vec<u32>>,
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
            lengths: None,
            transport,
        }
    }

    /// Give each microbatch its own number of tokens: a plan's `microbatch_lengths`.
    pub fn with_lengths(mut self, lengths: Option<&pipec_schedules::Lengths>) -> Self {
        self.lengths = lengths.map(|l| l.all_tokens().to_vec());
        self
    }

    /// Each op with `tokens` (a plan with lengths) holds, or received, a tensor of that many
    /// rows. There is no shape exchange: a device backend allocates the receive from the
    /// instruction, and here the moved array must fit that allocation exactly. Token ids
    /// count one row per id; the scalars past the loss (a loss, its seed, the token-id
    /// gradient) have no rows to size.
    fn check_tokens(ops: &[CommOp<CpuTensor>], dir: super::Dir) -> Result<(), CommError> {
        for op in ops.iter().filter(|o| o.dir == dir) {
            let (Some(tokens), Some(t)) = (op.tokens, op.tensor.as_ref()) else {
                continue;
            };
            let rows = match t {
                Tensor::Hidden(a) => a.nrows(),
                Tensor::Tokens(v) => v.len(),
                Tensor::Loss(_) | Tensor::LossGrad | Tensor::TokenGrad => continue,
            };
            if rows != tokens as usize {
                return Err(CommError::WrongTokens {
                    at: op.at,
                    dir,
                    tokens,
                    rows,
                });
            }
        }
        Ok(())
    }

    fn accum_mut(&mut self, stage: u32) -> Result<&mut GradAccum<f32>, BackendError> {
        let rank = self.rank;
        self.accum
            .get_mut(stage as usize)
            .and_then(Option::as_mut)
            .ok_or_else(|| no_stage(rank, stage))
    }

    fn ctx(&self) -> Ctx<'_> {
        Ctx {
            cfg: &self.cfg,
            step: self.step,
            microbatches: self.microbatches,
            lengths: self.lengths.as_deref(),
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

fn no_stage(rank: Rank, stage: u32) -> BackendError {
    BackendError(format!("{rank} holds no gradients of stage {stage}"))
}

/// Host tensors: the step ends with the interpreter, replicas hand each other arrays.
impl StepBackend for CpuBackend {
    type Parked = BTreeMap<u32, StageGrads<f32>>;
    type Sum = StageGrads<f32>;

    fn begin_step(&mut self, step: u32) -> Result<(), BackendError> {
        self.step = step;
        self.accum.iter_mut().flatten().for_each(GradAccum::clear);
        self.losses.iter_mut().for_each(|l| *l = None);
        Ok(())
    }

    fn end_step(&mut self, _: &[Instr], run: RankRun, _: Duration) -> Result<RankRun, StepError> {
        Ok(run)
    }

    fn losses(&self, _: Duration) -> Result<Vec<Option<f32>>, BackendError> {
        Ok(self.losses.clone())
    }

    fn grads(&self, copy: bool) -> Result<LocalGrads, BackendError> {
        Ok(self
            .accum
            .iter()
            .enumerate()
            .filter_map(|(s, a)| {
                a.as_ref()
                    .map(|a| (s as u32, a.complete(), copy.then(|| a.sum().clone())))
            })
            .collect())
    }

    fn sgd(&mut self, lr: f32) -> Result<(), BackendError> {
        for (st, acc) in self.stages.iter_mut().zip(&self.accum) {
            if let (Some(st), Some(acc)) = (st.as_mut(), acc.as_ref()) {
                model::sgd(st, acc.sum(), lr);
            }
        }
        Ok(())
    }

    fn park(&mut self, stage: u32) -> Self::Parked {
        self.accum_mut(stage)
            .map(GradAccum::take_pending)
            .unwrap_or_default()
    }

    fn absorb(&mut self, stage: u32, parked: Self::Parked) -> Result<(), BackendError> {
        let acc = self.accum_mut(stage)?;
        for (mb, g) in parked {
            acc.add(mb, g);
        }
        Ok(())
    }

    fn sum_copy(&self, stage: u32) -> Result<(Self::Sum, u32), BackendError> {
        let acc = self
            .accum
            .get(stage as usize)
            .and_then(Option::as_ref)
            .ok_or_else(|| no_stage(self.rank, stage))?;
        Ok((acc.sum().clone(), acc.complete()))
    }

    fn replace_sum(&mut self, stage: u32, sum: &Self::Sum, next: u32) -> Result<(), BackendError> {
        self.accum_mut(stage)?.set_sum(sum, next);
        Ok(())
    }
}

impl Backend for CpuBackend {
    type Tensor = CpuTensor;
    type Saved = Vec<LayerStash<f32>>;
    type Partial = Vec<LayerPartial<f32>>;
    /// One memory: the host store holds the stash itself.
    type Host = Vec<LayerStash<f32>>;

    fn fwd(
        &mut self,
        task: Task,
        input: Option<CpuTensor>,
        save: bool,
    ) -> Result<(CpuTensor, Option<Self::Saved>), BackendError> {
        let input = match input {
            Some(t) => t,
            None => Tensor::Tokens(self.ctx().tokens(task.mb.0)),
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

    fn keep_for_w(&mut self, _: Task, saved: &mut Self::Saved) -> Result<bool, BackendError> {
        for st in saved.iter_mut() {
            st.keep_for_w();
        }
        Ok(true)
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
        Self::check_tokens(ops, super::Dir::Send)?;
        self.transport.exchange(self.rank, ops)?;
        Self::check_tokens(ops, super::Dir::Recv)
    }

    fn keep(&mut self, input: &CpuTensor) -> Result<CpuTensor, BackendError> {
        Ok(input.clone())
    }

    /// The copy ends at once; the interpreter still meters the device copy until the
    /// program knows it has ended, where a device would free it.
    fn offload(&mut self, _: Task, saved: Self::Saved) -> Result<Self::Host, BackendError> {
        Ok(saved)
    }

    fn wait_offload(&mut self, _: Task) -> Result<(), BackendError> {
        Ok(())
    }

    fn reload(&mut self, _: Task, host: Self::Host) -> Result<Self::Saved, BackendError> {
        Ok(host)
    }

    fn post(&mut self, ops: &mut [CommOp<CpuTensor>]) -> Result<(), CommError> {
        Self::check_tokens(ops, super::Dir::Send)?;
        self.transport.post(self.rank, ops)
    }

    fn complete(&mut self, ops: &mut [CommOp<CpuTensor>]) -> Result<(), CommError> {
        self.transport.complete(self.rank, ops)?;
        Self::check_tokens(ops, super::Dir::Recv)
    }

    fn finish(&mut self) {
        self.transport.finish(self.rank);
    }
}
