//! A tuning instance: the per-stage costs and memory of one model split over one placement.

use pipec_cost::cost::{CostModel, StageCosts};
use pipec_cost::memory::{holders, rank_params, stage_memory};
use pipec_schedules::layout::Layout;
use pipec_schedules::{Pass, Placement, StageId, Task};

/// What the schedulers plan against: dense per-stage tables, the placement and the memory
/// each rank may fill with activations.
#[derive(Clone, Debug, PartialEq)]
pub struct Problem {
    pub placement: Placement,
    pub microbatches: u32,
    /// Per stage: forward, input-gradient backward (`bwd_D`), weight-gradient backward.
    pub f: Vec<f64>,
    pub b: Vec<f64>,
    pub w: Vec<f64>,
    /// Per stage: activation memory one microbatch keeps alive (allocated at the forward,
    /// freed at the end of `bwd_W`).
    pub act: Vec<f64>,
    /// Per rank: parameter + optimizer memory of the stages it holds.
    pub param: Vec<f64>,
    /// Per rank: the memory limit (`f64::INFINITY` without one).
    pub limit: Vec<f64>,
    /// Time a tensor takes between two ranks (`p2p + msg / bw`); 0 on one rank.
    pub comm: f64,
    /// Per stage: the part of `act` kept from `bwd_D` to `bwd_W` (`K.act_w`, the inputs of
    /// the weight-gradient GEMMs): `bwd_D` frees `act - act_w`, `bwd_W` the rest, a fused
    /// backward all of it (`pipec_ir::ir::activations`). Equal to `act` without `K.act_w`.
    pub act_w: Vec<f64>,
}

impl Problem {
    /// The instance of `layout` (one stage per entry) on `placement` under `model`, with a
    /// memory limit per rank in the units of `K.act` / `K.param`.
    pub fn new(
        model: &CostModel,
        layout: &Layout,
        placement: Placement,
        microbatches: u32,
        limit: Option<f64>,
    ) -> Self {
        let n = placement.num_stages();
        let costs = StageCosts::new(model, layout, n);
        // A rank's time factor (`rank.R`) scales the stages it runs; a stage on two ranks
        // (DualPipe) takes the smaller, so that plans and bounds stay optimistic (every
        // candidate's makespan is the simulator's, which runs each op on its own rank).
        let factor: Vec<f64> = (0..n)
            .map(|s| {
                holders(&placement, s)
                    .iter()
                    .map(|r| costs.rank_factor(r.index()))
                    .fold(f64::INFINITY, f64::min)
            })
            .collect();
        let get = |p: Pass| -> Vec<f64> {
            (0..n)
                .map(|s| costs.pass(p, StageId(s)).unwrap_or(0.0) * factor[s as usize])
                .collect()
        };
        let (act, sparam) = stage_memory(model, layout);
        let act_w = pipec_cost::memory::stage_act_w(model, layout)
            .map(|w| w.iter().zip(&act).map(|(w, a)| w.min(*a)).collect())
            .unwrap_or_else(|| act.clone());
        let param = rank_params(&placement, &sparam);
        let pp = placement.pp as usize;
        Problem {
            f: get(Pass::Fwd),
            b: get(Pass::BwdD),
            w: get(Pass::BwdW),
            act,
            param,
            limit: vec![limit.unwrap_or(f64::INFINITY); pp],
            comm: model.transfer(),
            placement,
            microbatches,
            act_w,
        }
    }

    /// An instance given directly by its tables (tests, the exact search); no parameters.
    pub fn from_tables(
        placement: Placement,
        microbatches: u32,
        f: Vec<f64>,
        b: Vec<f64>,
        w: Vec<f64>,
        limit: Option<f64>,
    ) -> Self {
        let n = f.len();
        let pp = placement.pp as usize;
        Problem {
            placement,
            microbatches,
            f,
            b,
            w,
            act: vec![1.0; n],
            param: vec![0.0; pp],
            limit: vec![limit.unwrap_or(f64::INFINITY); pp],
            comm: 0.0,
            act_w: vec![1.0; n],
        }
    }

    /// What `bwd_D` of stage `s` frees: `act - act_w`.
    pub fn freed_at_d(&self, s: usize) -> f64 {
        self.act[s] - self.act_w[s]
    }

    pub fn num_stages(&self) -> usize {
        self.f.len()
    }

    pub fn pp(&self) -> usize {
        self.placement.pp as usize
    }

    /// Rank of a stage (loop and V placements: one rank per stage).
    pub fn rank(&self, s: usize) -> usize {
        self.placement.rank_of_stage(StageId(s as u32)).index()
    }

    /// Stages of each rank, in stage order.
    pub fn local_stages(&self) -> Vec<Vec<usize>> {
        let mut out = vec![Vec::new(); self.pp()];
        for s in 0..self.num_stages() {
            out[self.rank(s)].push(s);
        }
        out
    }

    /// Activation memory rank `r` may fill: its limit less its parameters.
    pub fn budget(&self, r: usize) -> f64 {
        self.limit[r] - self.param[r]
    }

    /// Delay of a tensor from stage `a` to stage `b` (first direction).
    pub fn delay(&self, a: usize, b: usize) -> f64 {
        if self.rank(a) == self.rank(b) {
            0.0
        } else {
            self.comm
        }
    }

    /// Rank of the task (stage `s`, microbatch `mb`): the placement's, mirrored for the second
    /// direction of a bidirectional placement.
    #[inline]
    pub fn rank_of(&self, s: usize, mb: usize) -> usize {
        self.placement
            .rank_of(Task::new(s as u32, mb as u32))
            .index()
    }

    /// Delay of microbatch `mb`'s tensor from stage `a` to stage `b`.
    #[inline]
    pub fn delay_mb(&self, a: usize, b: usize, mb: usize) -> f64 {
        if self.rank_of(a, mb) == self.rank_of(b, mb) {
            0.0
        } else {
            self.comm
        }
    }

    /// The microbatch ranges of the directions: one, or two for a bidirectional placement.
    pub fn directions(&self) -> Vec<(usize, usize)> {
        let m = self.microbatches as usize;
        match self.placement.mirror_from() {
            Some(h) if (h as usize) < m && h > 0 => vec![(0, h as usize), (h as usize, m)],
            _ => vec![(0, m)],
        }
    }

    /// Every (stage, direction) lane with its rank, in stage order per direction.
    pub fn lanes(&self) -> Vec<Lane> {
        let mut out = Vec::new();
        for (d, &(lo, hi)) in self.directions().iter().enumerate() {
            for s in 0..self.num_stages() {
                out.push(Lane {
                    stage: s,
                    dir: d,
                    lo,
                    hi,
                    rank: self.rank_of(s, lo),
                });
            }
        }
        out
    }
}

/// The microbatches `lo..hi` of one direction on one stage, run by `rank`.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Lane {
    pub stage: usize,
    pub dir: usize,
    pub lo: usize,
    pub hi: usize,
    pub rank: usize,
}
