//! A generated schedule: each rank's compute order, before any communication is placed.

use crate::order::RankOrder;
use crate::placement::Placement;
use crate::spec::{Limits, MegatronP2p, ScheduleSpec, SpecError};
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
    /// Megatron `forward_backward_pipelining_with_interleaving` with `batch_p2p_comm`: its
    /// P2P calls one for one, each one batch (`recv_tensor_from_previous_stage` decides what a
    /// call receives: the first and last ranks receive as soon as the far end has produced).
    MegatronInterleaved,
    /// [`CommPolicy::Megatron1F1B`]'s calls with `batch_p2p_comm=False`: each call's ops posted
    /// in `_p2p_ops`' even/odd order and waited together.
    #[serde(rename = "megatron_1f1b_unbatched")]
    Megatron1F1BUnbatched,
    /// [`CommPolicy::MegatronInterleaved`]'s calls with `batch_p2p_comm=False`.
    MegatronInterleavedUnbatched,
    /// Megatron's interleaved loop with `overlap_p2p_comm`: overlapped calls post each op as
    /// its own batch and wait for it just before use (`Instr::Wait`).
    MegatronInterleavedOverlap,
    /// The same with `overlap_p2p_comm_warmup_flush`.
    MegatronInterleavedOverlapFlush,
    /// [`CommPolicy::MegatronInterleavedOverlap`] with `deallocate_pipeline_outputs=False`.
    MegatronInterleavedOverlapKeepOutputs,
    /// [`CommPolicy::MegatronInterleavedOverlapFlush`] with `deallocate_pipeline_outputs=False`.
    MegatronInterleavedOverlapFlushKeepOutputs,
    /// The same rule with every compute op its own step: a batch between consecutive ops sends
    /// the outputs of the first and receives the inputs of the second.
    FusedPerOp,
    /// Compute is timed by a list schedule of the per-rank orders (each op as soon as its rank
    /// is free and its inputs exist, `F = B = W = 1` per stage); each message passes at an
    /// instant when neither end is inside an op where one exists before its consumer starts,
    /// and each rank posts one batch per instant, before the compute starting then. A
    /// message's send and recv always sit in batches of the same instant, so the
    /// program is deadlock-free under rendezvous semantics by construction for any order that
    /// respects dependencies; the price is that a tensor may wait in a receive buffer until it
    /// is used.
    /// Schedules whose consumer runs long after the producer (looped BFS) need this: with late
    /// receives and blocking sends they deadlock.
    Lockstep,
    /// `pipec tune`'s own orders: ops timed by a list schedule under the real costs, every
    /// message its own batch left in flight, posted by both ends no later than the producer's
    /// end and waited for (`Instr::Wait`) just before its consumer, the sender's before its
    /// first op after the transfer (`pipec_compiler::Lowering::TimedInFlight`). Needs the costs, so orders alone
    /// cannot be lowered with it.
    TimedInFlight,
}

impl CommPolicy {
    /// The Megatron placement for a loop (`interleaved`, or the non-interleaved one) and mode.
    pub fn megatron(interleaved: bool, mode: MegatronP2p) -> CommPolicy {
        match (interleaved, mode) {
            (false, MegatronP2p::Batched) => CommPolicy::Megatron1F1B,
            (false, _) => CommPolicy::Megatron1F1BUnbatched,
            (true, MegatronP2p::Batched) => CommPolicy::MegatronInterleaved,
            (true, MegatronP2p::Unbatched) => CommPolicy::MegatronInterleavedUnbatched,
            (true, MegatronP2p::Overlap) => CommPolicy::MegatronInterleavedOverlap,
            (true, MegatronP2p::OverlapFlush) => CommPolicy::MegatronInterleavedOverlapFlush,
            (true, MegatronP2p::OverlapKeepOutputs) => {
                CommPolicy::MegatronInterleavedOverlapKeepOutputs
            }
            (true, MegatronP2p::OverlapFlushKeepOutputs) => {
                CommPolicy::MegatronInterleavedOverlapFlushKeepOutputs
            }
        }
    }

    /// For the Megatron placements: whether it is the interleaved loop's, and its mode.
    pub fn megatron_loop(self) -> Option<(bool, MegatronP2p)> {
        Some(match self {
            CommPolicy::Megatron1F1B => (false, MegatronP2p::Batched),
            CommPolicy::Megatron1F1BUnbatched => (false, MegatronP2p::Unbatched),
            CommPolicy::MegatronInterleaved => (true, MegatronP2p::Batched),
            CommPolicy::MegatronInterleavedUnbatched => (true, MegatronP2p::Unbatched),
            CommPolicy::MegatronInterleavedOverlap => (true, MegatronP2p::Overlap),
            CommPolicy::MegatronInterleavedOverlapFlush => (true, MegatronP2p::OverlapFlush),
            CommPolicy::MegatronInterleavedOverlapKeepOutputs => {
                (true, MegatronP2p::OverlapKeepOutputs)
            }
            CommPolicy::MegatronInterleavedOverlapFlushKeepOutputs => {
                (true, MegatronP2p::OverlapFlushKeepOutputs)
            }
            CommPolicy::FusedPerOp | CommPolicy::Lockstep | CommPolicy::TimedInFlight => {
                return None
            }
        })
    }
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

/// Generate the schedule a spec asks for, by its kind's row of the kinds table. Pure;
/// validates the spec first.
pub fn generate(spec: &ScheduleSpec, limits: &Limits) -> Result<Schedule, SpecError> {
    spec.validate(limits)?;
    let row = spec.kind.row();
    let (placement, comm, ranks) = (
        (row.placement)(spec),
        (row.comm)(spec),
        (row.generate)(spec),
    );
    Ok(Schedule {
        spec: *spec,
        placement,
        comm,
        ranks,
    })
}

#[cfg(test)]
mod props {
    use super::*;
    use crate::op::{Pass, Task};
    use crate::ScheduleKind;
    use proptest::prelude::*;

    /// Every task once forward and (training) once backward, on its placement rank; on each
    /// rank a backward after its forward and a `bwd_W` after its `bwd_D`; and the orders run to
    /// the end when each op waits only for its inputs (no cross-rank cycle).
    fn check(s: &Schedule) -> Result<(), String> {
        let (stages, m) = (s.num_stages() as usize, s.spec.microbatches as usize);
        let idx = |t: Task| t.stage.index() * m + t.mb.index();
        let (mut f, mut b, mut d, mut w) = (
            vec![0u8; stages * m],
            vec![0u8; stages * m],
            vec![0u8; stages * m],
            vec![0u8; stages * m],
        );
        for o in &s.ranks {
            for op in &o.ops {
                for (pass, t) in op.parts() {
                    if s.placement.rank_of(t) != o.rank {
                        return Err(format!("{op} on {}", o.rank));
                    }
                    let i = idx(t);
                    match pass {
                        Pass::Fwd => f[i] += 1,
                        Pass::Bwd | Pass::BwdD => {
                            if f[i] == 0 {
                                return Err(format!("{op} before its forward"));
                            }
                            b[i] += 1;
                            d[i] += (pass == Pass::BwdD) as u8;
                        }
                        Pass::BwdW => {
                            if d[i] == 0 {
                                return Err(format!("{op} before its bwd_D"));
                            }
                            w[i] += 1;
                        }
                    }
                }
            }
        }
        let want_b = if s.spec.forward_only { 0 } else { 1 };
        for i in 0..stages * m {
            if f[i] != 1 || b[i] != want_b || w[i] != d[i] {
                return Err(format!(
                    "task #{i}: {} fwd, {} bwd, {} bwd_W",
                    f[i], b[i], w[i]
                ));
            }
        }
        // Replay: fwd(s) needs fwd(s-1); a backward needs bwd(s+1); same-rank order otherwise.
        let (mut fd, mut gd) = (vec![false; stages * m], vec![false; stages * m]);
        let mut pc = vec![0usize; s.ranks.len()];
        loop {
            let mut progress = false;
            for (r, o) in s.ranks.iter().enumerate() {
                while let Some(op) = o.ops.get(pc[r]) {
                    let ready = op.parts().all(|(pass, t)| {
                        let st = t.stage.0 as usize;
                        match pass {
                            Pass::Fwd => st == 0 || fd[idx(Task::new(t.stage.0 - 1, t.mb.0))],
                            Pass::Bwd | Pass::BwdD => {
                                st + 1 == stages || gd[idx(Task::new(t.stage.0 + 1, t.mb.0))]
                            }
                            Pass::BwdW => true,
                        }
                    });
                    if !ready {
                        break;
                    }
                    for (pass, t) in op.parts() {
                        match pass {
                            Pass::Fwd => fd[idx(t)] = true,
                            Pass::Bwd | Pass::BwdD => gd[idx(t)] = true,
                            Pass::BwdW => {}
                        }
                    }
                    pc[r] += 1;
                    progress = true;
                }
            }
            if pc.iter().zip(&s.ranks).all(|(p, o)| *p == o.ops.len()) {
                return Ok(());
            }
            if !progress {
                return Err(format!("orders wait on each other at {pc:?}"));
            }
        }
    }

    fn kinds() -> impl Strategy<Value = (ScheduleKind, bool)> {
        prop_oneof![
            Just((ScheduleKind::ZbH1, false)),
            Just((ScheduleKind::ZbH2, false)),
            Just((ScheduleKind::Zb1P, false)),
            Just((ScheduleKind::ZbV, false)),
            Just((ScheduleKind::VHalf, false)),
            Just((ScheduleKind::VMin, false)),
            Just((ScheduleKind::DualPipe, false)),
            Just((ScheduleKind::DualPipeV, false)),
            Just((ScheduleKind::OneFOneB, true)),
            Just((ScheduleKind::Interleaved1F1B, true)),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(400))]
        #[test]
        fn generated_orders_are_complete_and_executable(
            (kind, combined) in kinds(),
            pp in 1u32..=12,
            m in 1u32..=40,
            vpp_extra in 0u32..=2,
            forward_only in any::<bool>(),
        ) {
            let vpp = if kind == ScheduleKind::Interleaved1F1B { 2 + vpp_extra } else { kind.default_vpp() };
            // DualPipe needs even pp and M: round up so most cases are valid.
            let (pp, m) = if kind == ScheduleKind::DualPipe { (pp + pp % 2, m + m % 2) } else { (pp, m) };
            let spec = ScheduleSpec {
                kind, pp, vpp, microbatches: m, group_size: None, forward_only, combined,
                megatron_p2p: Default::default(),
            };
            prop_assume!(spec.validate(&Limits::DEFAULT).is_ok());
            let s = generate(&spec, &Limits::DEFAULT).unwrap();
            prop_assert_eq!(s.ranks.len() as u32, pp);
            if let Err(e) = check(&s) {
                prop_assert!(false, "{:?}: {}", spec, e);
            }
        }
    }
}
