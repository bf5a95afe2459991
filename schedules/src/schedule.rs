//! A generated schedule: each rank's compute order, before any communication is placed.

use crate::ids::Rank;
use crate::op::Compute;
use crate::placement::Placement;
use crate::spec::{Limits, ScheduleKind, ScheduleSpec, SpecError};
use serde::{Deserialize, Serialize};

/// How lowering should group a rank's sends and receives into comm batches. Each variant is
/// the placement a framework uses, so that emitted programs post P2P exactly like it does.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CommPolicy {
    /// Megatron `forward_backward_pipelining_without_interleaving`: unfused `recv_forward` /
    /// `send_forward` in warmup, `send_forward_recv_backward` and `send_backward_recv_forward`
    /// in the steady state, unfused `recv_backward` / `send_backward` in cooldown.
    #[serde(rename = "megatron_1f1b")]
    Megatron1F1B,
    /// Megatron `forward_backward_pipelining_with_interleaving` (without `overlap_p2p_comm`):
    /// after every step (a warmup forward, a steady forward+backward pair, a cooldown backward)
    /// one batch sends what the step produced and receives what the next step needs.
    MegatronInterleaved,
    /// The same rule with every compute op its own step: a batch between consecutive ops sends
    /// the outputs of the first and receives the inputs of the second.
    FusedPerOp,
    /// Compute runs in unit-time rounds, each op as soon as its inputs exist (a list schedule
    /// of the per-rank orders); after every round each rank posts one batch with the sends of
    /// the tensors it produced in that round and the receives of the tensors produced for it.
    /// A message's send and recv always sit in batches of the same round, so the program is
    /// deadlock-free under rendezvous semantics by construction for any order that respects
    /// dependencies; the price is that a tensor may wait in a receive buffer until it is used.
    /// Schedules whose consumer runs long after the producer (looped BFS) need this: with late
    /// receives and blocking sends they deadlock.
    Lockstep,
}

/// One rank's compute order.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankOrder {
    pub rank: Rank,
    pub ops: Vec<Compute>,
    /// Leading forwards before the first backward (Megatron's `num_warmup_microbatches`); the
    /// Megatron comm policies derive their steps from it.
    pub warmup: u32,
}

/// Per-rank compute orders plus the facts lowering and verification need.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Schedule {
    pub spec: ScheduleSpec,
    pub placement: Placement,
    pub comm: CommPolicy,
    pub ranks: Vec<RankOrder>,
}

impl Schedule {
    pub fn num_stages(&self) -> u32 {
        self.placement.num_stages()
    }
}

/// Generate the schedule a spec asks for. Pure; validates the spec first.
pub fn generate(spec: &ScheduleSpec, limits: &Limits) -> Result<Schedule, SpecError> {
    spec.validate(limits)?;
    let (placement, comm, ranks) = match spec.kind {
        ScheduleKind::Gpipe => (
            Placement::looped(spec.pp, 1),
            CommPolicy::Lockstep,
            crate::gpipe::orders(spec),
        ),
        ScheduleKind::OneFOneB => (
            Placement::looped(spec.pp, 1),
            CommPolicy::Megatron1F1B,
            crate::megatron::one_f_one_b(spec),
        ),
        ScheduleKind::Interleaved1F1B => (
            Placement::looped(spec.pp, spec.vpp),
            CommPolicy::MegatronInterleaved,
            crate::megatron::interleaved(spec),
        ),
        ScheduleKind::LoopedBfs => (
            Placement::looped(spec.pp, spec.vpp),
            CommPolicy::Lockstep,
            crate::looped_bfs::orders(spec),
        ),
    };
    Ok(Schedule {
        spec: *spec,
        placement,
        comm,
        ranks,
    })
}
