//! The lockstep comm placement ([`CommPolicy::Lockstep`]): deadlock-free for any valid compute
//! order, whatever its shape.
//!
//! Why: fusing an op's sends with the next op's receives ([`CommPolicy::FusedPerOp`]) is only
//! safe when the two ranks of every message pair up their batches the same way. Split-backward
//! and V / bidirectional orders break that as early as pp = 2, M = 1: rank 0 runs `fwd`, then
//! posts {send act, recv grad}; rank 1 receives the act before its `fwd` and sends the grad after
//! its `bwd`, two different batches, and under rendezvous both ranks wait forever.
//!
//! The rule: replay the orders in rounds, the way torch's `_simulate_comms_compute` does. In a
//! round every rank runs its next op if the messages it needs arrived in an earlier round. After
//! the round each rank posts one batch: the sends of the op it just ran and the receives of
//! everything its peers produced for it in that round. The batches after round `t` match only
//! batches after round `t`, so the merged batches of one round form one node per rank and the
//! rounds are totally ordered: no cycle, no deadlock. Between two ranks messages keep their
//! production order, so the k-th send meets the k-th recv. The price: a message is received
//! right after it is produced, possibly long before it is consumed (ZB-H2's and DualPipe's
//! extra warmup forwards hold their inputs a little longer on the receiving side).

use crate::lower::{op_io, Endpoint};
use crate::program::{Instr, Payload, PayloadKind, Program};
use pipec_schedules::{Placement, RankOrder};

/// Dense index of a payload, or `None` when its ids are out of range.
fn slot(p: &Payload, stages: usize, m: usize) -> Option<usize> {
    let (s, mb) = (p.stage.index(), p.mb.index());
    if s >= stages || mb >= m {
        return None;
    }
    let k = match p.kind {
        PayloadKind::Act => 0,
        PayloadKind::Grad => 1,
    };
    Some((k * stages + s) * m + mb)
}

/// Lower per-rank compute orders with the lockstep placement. Orders must satisfy
/// [`crate::lower::lower_orders`]'s preconditions. An order whose data dependencies cannot be
/// met (imported, invalid) stops the replay; its remaining ops are emitted with unfused
/// receives before and sends after each op, for the verifier to report.
pub fn lower(
    placement: &Placement,
    microbatches: u32,
    forward_only: bool,
    orders: &[RankOrder],
) -> Program {
    let w = orders.len();
    let stages = placement.num_stages() as usize;
    let m = microbatches as usize;
    // Round after which each payload is received (u32::MAX: not yet produced).
    let mut arrives = vec![u32::MAX; 2 * stages * m];
    let mut pc = vec![0usize; w];
    let mut instrs: Vec<Vec<Instr>> = orders
        .iter()
        .map(|o| Vec::with_capacity(o.ops.len() * 3))
        .collect();
    let mut next_batch = vec![0u32; w];
    let (mut recvs, mut sends): (Vec<Endpoint>, Vec<Endpoint>) = (Vec::new(), Vec::new());
    // Per rank, this round: sends posted, receives posted (by sender rank, in send order).
    let mut round_sends: Vec<Vec<Endpoint>> = vec![Vec::new(); w];
    let mut round_recvs: Vec<Vec<Endpoint>> = vec![Vec::new(); w];
    // Position in `orders` of each rank id (orders need not be sorted or dense).
    let max_rank = orders.iter().map(|o| o.rank.index()).max().unwrap_or(0);
    let mut index_of = vec![None; max_rank + 1];
    for (i, o) in orders.iter().enumerate() {
        index_of[o.rank.index()] = Some(i);
    }
    let mut round: u32 = 0;
    loop {
        let mut ran = false;
        for (r, order) in orders.iter().enumerate() {
            let Some(op) = order.ops.get(pc[r]) else {
                continue;
            };
            recvs.clear();
            sends.clear();
            op_io(op, placement, order.rank, &mut recvs, &mut sends);
            let ready = recvs
                .iter()
                .all(|e| slot(&e.payload, stages, m).is_some_and(|i| arrives[i] < round));
            if !ready {
                continue;
            }
            instrs[r].push(Instr::Compute(*op));
            pc[r] += 1;
            ran = true;
            for e in &sends {
                if let Some(i) = slot(&e.payload, stages, m) {
                    arrives[i] = round;
                }
                round_sends[r].push(*e);
                if let Some(q) = index_of.get(e.peer.index()).copied().flatten() {
                    round_recvs[q].push(Endpoint {
                        peer: order.rank,
                        payload: e.payload,
                    });
                }
            }
        }
        for r in 0..w {
            if round_sends[r].is_empty() && round_recvs[r].is_empty() {
                continue;
            }
            let batch = next_batch[r];
            next_batch[r] += 1;
            for e in round_sends[r].drain(..) {
                instrs[r].push(Instr::Send {
                    peer: e.peer,
                    payload: e.payload,
                    batch,
                });
            }
            for e in round_recvs[r].drain(..) {
                instrs[r].push(Instr::Recv {
                    peer: e.peer,
                    payload: e.payload,
                    batch,
                });
            }
        }
        if (0..w).all(|r| pc[r] == orders[r].ops.len()) || !ran {
            break;
        }
        round += 1;
    }
    // Unreachable for valid orders: emit what is left, unfused, for the verifier to judge.
    for (r, order) in orders.iter().enumerate() {
        for op in &order.ops[pc[r]..] {
            recvs.clear();
            sends.clear();
            op_io(op, placement, order.rank, &mut recvs, &mut sends);
            push_batch(&mut instrs[r], &mut next_batch[r], &[], &recvs);
            instrs[r].push(Instr::Compute(*op));
            push_batch(&mut instrs[r], &mut next_batch[r], &sends, &[]);
        }
    }
    Program {
        placement: placement.clone(),
        microbatches,
        forward_only,
        ranks: instrs,
    }
}

fn push_batch(out: &mut Vec<Instr>, next: &mut u32, sends: &[Endpoint], recvs: &[Endpoint]) {
    if sends.is_empty() && recvs.is_empty() {
        return;
    }
    let batch = *next;
    *next += 1;
    out.extend(sends.iter().map(|e| Instr::Send {
        peer: e.peer,
        payload: e.payload,
        batch,
    }));
    out.extend(recvs.iter().map(|e| Instr::Recv {
        peer: e.peer,
        payload: e.payload,
        batch,
    }));
}

#[cfg(test)]
mod tests {
    use super::*;
    use pipec_schedules::{Compute, Rank, Task};

    fn computes(p: &Program, r: Rank) -> Vec<Compute> {
        p.ranks[r.index()]
            .iter()
            .filter_map(Instr::as_compute)
            .copied()
            .collect()
    }

    /// pp = 2, M = 1 with fwd then bwd on both ranks: rank 0 sends the activation after round 0
    /// and receives the gradient after round 2, each in its own round's batch.
    #[test]
    fn two_ranks_one_microbatch() {
        let placement = Placement::looped(2, 1);
        let orders = vec![
            RankOrder {
                rank: Rank(0),
                ops: vec![Compute::Fwd(Task::new(0, 0)), Compute::Bwd(Task::new(0, 0))],
                warmup: 1,
            },
            RankOrder {
                rank: Rank(1),
                ops: vec![Compute::Fwd(Task::new(1, 0)), Compute::Bwd(Task::new(1, 0))],
                warmup: 1,
            },
        ];
        let p = lower(&placement, 1, false, &orders);
        assert_eq!(
            p.ranks[0],
            vec![
                Instr::Compute(Compute::Fwd(Task::new(0, 0))),
                Instr::Send {
                    peer: Rank(1),
                    payload: Payload::act(0, 0),
                    batch: 0
                },
                Instr::Recv {
                    peer: Rank(1),
                    payload: Payload::grad(1, 0),
                    batch: 1
                },
                Instr::Compute(Compute::Bwd(Task::new(0, 0))),
            ]
        );
        assert_eq!(
            p.ranks[1],
            vec![
                Instr::Recv {
                    peer: Rank(0),
                    payload: Payload::act(0, 0),
                    batch: 0
                },
                Instr::Compute(Compute::Fwd(Task::new(1, 0))),
                Instr::Compute(Compute::Bwd(Task::new(1, 0))),
                Instr::Send {
                    peer: Rank(0),
                    payload: Payload::grad(1, 0),
                    batch: 1
                },
            ]
        );
        assert_eq!(computes(&p, Rank(1)).len(), 2);
    }
}
