//! A generated schedule: each rank's compute order, before any communication is placed.

use crate::ids::Rank;
use crate::op::{Compute, Pass};
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
    /// Rounds of a replay in which every rank runs its next op once its inputs have arrived;
    /// after each round one batch per rank sends what the round produced and receives what
    /// peers produced for it (torch `_simulate_comms_compute`'s rounds). Deadlock-free for any
    /// valid order; used where `FusedPerOp` is not (split backward, V, bidirectional orders).
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

/// Megatron's interleaved P2P placement, except when a rank runs every microbatch in warmup
/// (`are_all_microbatches_in_warmup`, e.g. M = pp): then that rank's last forward send and
/// first gradient receive pair with two different batches of its neighbour, which deadlocks
/// under rendezvous, and the lockstep rounds are used instead.
fn megatron_interleaved_policy(spec: &ScheduleSpec, orders: &[RankOrder]) -> CommPolicy {
    let all_in_warmup = |o: &RankOrder| {
        let forwards = o
            .ops
            .iter()
            .flat_map(Compute::parts)
            .filter(|p| p.0 == Pass::Fwd);
        o.warmup as usize >= forwards.count()
    };
    if !spec.forward_only && spec.pp > 1 && orders.iter().any(all_in_warmup) {
        CommPolicy::Lockstep
    } else {
        CommPolicy::MegatronInterleaved
    }
}

/// Generate the schedule a spec asks for. Pure; validates the spec first.
pub fn generate(spec: &ScheduleSpec, limits: &Limits) -> Result<Schedule, SpecError> {
    spec.validate(limits)?;
    let (placement, comm, ranks) = match spec.kind {
        // GPipe and looped BFS send a stage's last forward output and then need its first
        // gradient back, while the last rank receives that input before its forward and sends
        // the gradient after its backward: fused per op they deadlock under rendezvous for
        // every pp >= 2, so they use the lockstep rounds.
        ScheduleKind::Gpipe => (
            Placement::looped(spec.pp, 1),
            CommPolicy::Lockstep,
            crate::gpipe::orders(spec),
        ),
        // Megatron runs combined 1F1B only from its interleaved loop; on the non-interleaved
        // order (adjacent warmups differ by one) that step fusion deadlocks, so lockstep.
        ScheduleKind::OneFOneB => (
            Placement::looped(spec.pp, 1),
            if spec.combined {
                CommPolicy::Lockstep
            } else {
                CommPolicy::Megatron1F1B
            },
            crate::megatron::one_f_one_b(spec),
        ),
        ScheduleKind::Interleaved1F1B => {
            let orders = crate::megatron::interleaved(spec);
            (
                Placement::looped(spec.pp, spec.vpp),
                megatron_interleaved_policy(spec, &orders),
                orders,
            )
        }
        ScheduleKind::LoopedBfs => (
            Placement::looped(spec.pp, spec.vpp),
            CommPolicy::Lockstep,
            crate::looped_bfs::orders(spec),
        ),
        ScheduleKind::ZbH1 => (
            Placement::looped(spec.pp, 1),
            CommPolicy::Lockstep,
            crate::zero_bubble::zb_h1(spec),
        ),
        ScheduleKind::ZbH2 => (
            Placement::looped(spec.pp, 1),
            CommPolicy::Lockstep,
            crate::zero_bubble::zb_h2(spec),
        ),
        ScheduleKind::Zb1P => (
            Placement::looped(spec.pp, 1),
            CommPolicy::Lockstep,
            crate::zero_bubble::zb_1p(spec),
        ),
        ScheduleKind::ZbV => (
            Placement::v_shape(spec.pp),
            CommPolicy::Lockstep,
            crate::v_shape::zb_v(spec),
        ),
        ScheduleKind::VHalf => (
            Placement::v_shape(spec.pp),
            CommPolicy::Lockstep,
            crate::v_shape::v_half(spec),
        ),
        ScheduleKind::VMin => (
            Placement::v_shape(spec.pp),
            CommPolicy::Lockstep,
            crate::v_shape::v_min(spec),
        ),
        ScheduleKind::DualPipe => (
            Placement::bidirectional(spec.pp, spec.microbatches / 2),
            CommPolicy::Lockstep,
            crate::dualpipe::dualpipe(spec),
        ),
        ScheduleKind::DualPipeV => (
            Placement::v_shape(spec.pp),
            CommPolicy::Lockstep,
            crate::dualpipe::dualpipe_v(spec),
        ),
    };
    Ok(Schedule {
        spec: *spec,
        placement,
        comm,
        ranks,
    })
}
