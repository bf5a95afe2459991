//! Lowering that keeps an order's time under real costs ("timed in-flight" placement).
//!
//! The order's list schedule under the real per-stage costs (each op as soon as its rank is
//! free and its inputs exist, a tensor between ranks taking the transfer time) gives every op
//! a start and an end. Every message then becomes its own comm batch left in flight
//! (`isend`/`irecv`), so that no rank blocks on a peer's post:
//! - the sender posts the send right after the op that produces the tensor, at its end `e`;
//! - the receiver posts the receive at its last op boundary at or before `e` (before the op
//!   it is running at `e`, or in the idle gap that contains `e`);
//! - the receiver waits for the receive right before the op that consumes it; the sender waits
//!   for the send before its first op that starts after the send has completed (`e +
//!   transfer`), or at the end of its stream.
//!
//! Both ends post no later than `e`, so under rendezvous a message completes at `e + transfer`,
//! exactly when the list schedule lets its consumer start: no wait ever blocks, and the
//! program simulates to the order's makespan. On every rank the sends and receives are posted
//! in order of `e` (ties by sender, op, payload), which is the same order on both ends of every
//! pair of ranks: FIFO matching pairs the right tensors, and NCCL's per-pair stream order holds
//! no op behind one its peer posts later, so the program is deadlock-free.

use super::{op_io, Endpoint, LowerError};
use pipec_ir::ir::{Instr, Payload};
use pipec_schedules::{Placement, Rank, RankOrder};

/// One message: produced at `e` by op `op` of rank `from`, consumed by op `use_at` of `to`.
struct Msg {
    e: f64,
    from: usize,
    op: usize,
    to: usize,
    use_at: usize,
    payload: Payload,
    /// Position of the payload among the op's sends (tie break).
    k: usize,
}

/// The streams of `orders` keeping the times of their list schedule: `times[r][i]` the
/// (start, end) of op `i` of rank `r` ([`super::list::schedule`] under the real costs),
/// `transfer` the time of one message. Reached through [`super::lower_with`].
pub(super) fn lower_timed(
    placement: &Placement,
    microbatches: u32,
    orders: &[RankOrder],
    times: &[Vec<(f64, f64)>],
    transfer: f64,
) -> Result<Vec<Vec<Instr>>, LowerError> {
    let world = orders.len();
    if times.len() != world {
        return Err(LowerError::TimedRanks {
            times: times.len(),
            ranks: world,
        });
    }
    if let Some((r, (t, o))) = times
        .iter()
        .zip(orders)
        .enumerate()
        .find(|(_, (t, o))| t.len() != o.ops.len())
    {
        return Err(LowerError::TimedOps {
            rank: Rank(r as u32),
            times: t.len(),
            ops: o.ops.len(),
        });
    }
    // Consumer of each payload on its rank: (rank, op index), dense over (kind, stage, mb).
    let m = microbatches as usize;
    let cells = placement.num_stages() as usize * m;
    let slot = |pl: &Payload| -> usize {
        let k = if pl.kind.data() == pipec_ir::ir::PayloadKind::Act {
            0
        } else {
            cells
        };
        k + pl.stage.index() * m + pl.mb.index()
    };
    const NO: (usize, usize) = (usize::MAX, usize::MAX);
    let mut consumer: Vec<(usize, usize)> = vec![NO; 2 * cells];
    let (mut recvs, mut sends): (Vec<Endpoint>, Vec<Endpoint>) = (Vec::new(), Vec::new());
    for (r, o) in orders.iter().enumerate() {
        for (i, op) in o.ops.iter().enumerate() {
            recvs.clear();
            sends.clear();
            op_io(op, placement, Rank(r as u32), &mut recvs, &mut sends);
            for ep in &recvs {
                consumer[slot(&ep.payload)] = (r, i);
            }
        }
    }
    let mut msgs: Vec<Msg> = Vec::new();
    for (r, o) in orders.iter().enumerate() {
        for (i, op) in o.ops.iter().enumerate() {
            recvs.clear();
            sends.clear();
            op_io(op, placement, Rank(r as u32), &mut recvs, &mut sends);
            for (k, ep) in sends.iter().enumerate() {
                let (to, use_at) = consumer[slot(&ep.payload)];
                if to == usize::MAX {
                    return Err(LowerError::Unconsumed {
                        rank: Rank(r as u32),
                        op: i,
                        payload: ep.payload,
                    });
                }
                msgs.push(Msg {
                    e: times[r][i].1,
                    from: r,
                    op: i,
                    to,
                    use_at,
                    payload: ep.payload,
                    k,
                });
            }
        }
    }
    // Global order of messages: by production instant, then sender, op, payload.
    msgs.sort_by(|a, b| {
        a.e.total_cmp(&b.e)
            .then(a.from.cmp(&b.from))
            .then(a.op.cmp(&b.op))
            .then(a.k.cmp(&b.k))
    });
    // Slot j of a rank is the stream position before its op j (slot n: after the last op);
    // slots are numbered across ranks (`base`). Posts and waits are bucketed by slot (a
    // counting sort that keeps message order), not kept in a vector per slot.
    let mut base = Vec::with_capacity(world + 1);
    base.push(0usize);
    for o in orders {
        base.push(base.last().copied().unwrap_or(0) + o.ops.len() + 1);
    }
    let slots = base[world];
    // Per message: the slots of its send's post and wait, and of its receive's post and wait.
    let mut at: Vec<[usize; 4]> = Vec::with_capacity(msgs.len());
    for msg in &msgs {
        // Sender: post right after op `op`, i.e. in slot op + 1.
        // Its wait: before the first op starting at or after completion, else at the end
        // (starts never decrease along a rank, so the first is found by bisection).
        let done = msg.e + transfer;
        let t = &times[msg.from];
        let tol = done - 1e-9 * done.abs().max(1.0);
        let j = msg.op + 1 + t[msg.op + 1..].partition_point(|&(start, _)| start < tol);
        // Receiver: the slot before the first op that ends after e (the op running at e, or
        // the next one when e falls in an idle gap).
        let r = &times[msg.to];
        let k = r.partition_point(|&(_, end)| end <= msg.e).min(msg.use_at);
        at.push([
            base[msg.from] + msg.op + 1,
            base[msg.from] + j,
            base[msg.to] + k,
            base[msg.to] + msg.use_at,
        ]);
    }
    // (message, is_send) per slot, in message order: posts, then waits.
    let bucket = |post: bool| -> (Vec<usize>, Vec<(u32, bool)>) {
        let (s, r) = if post { (0, 2) } else { (1, 3) };
        let mut start = vec![0usize; slots + 1];
        for a in &at {
            start[a[s] + 1] += 1;
            start[a[r] + 1] += 1;
        }
        for i in 0..slots {
            start[i + 1] += start[i];
        }
        let mut fill = start.clone();
        let mut items = vec![(0u32, false); 2 * at.len()];
        for (mi, a) in at.iter().enumerate() {
            for (slot, is_send) in [(a[s], true), (a[r], false)] {
                items[fill[slot]] = (mi as u32, is_send);
                fill[slot] += 1;
            }
        }
        (start, items)
    };
    let (post_start, posts) = bucket(true);
    let (wait_start, waits) = bucket(false);
    drop(at);
    let mut send_batch = vec![0u32; msgs.len()];
    let mut recv_batch = vec![0u32; msgs.len()];
    let mut ranks = Vec::with_capacity(world);
    for (r, o) in orders.iter().enumerate() {
        let mut out = Vec::with_capacity(o.ops.len() * 4);
        let mut next = 0u32;
        for j in 0..=o.ops.len() {
            let g = base[r] + j;
            // Posts of a slot in global message order.
            for &(mi, is_send) in &posts[post_start[g]..post_start[g + 1]] {
                let mi = mi as usize;
                let m = &msgs[mi];
                let b = next;
                next += 1;
                if is_send {
                    send_batch[mi] = b;
                } else {
                    recv_batch[mi] = b;
                }
                let peer = Rank(if is_send { m.to } else { m.from } as u32);
                out.push(Instr::message(is_send, peer, m.payload, b));
            }
            for &(mi, is_send) in &waits[wait_start[g]..wait_start[g + 1]] {
                let b = if is_send {
                    send_batch[mi as usize]
                } else {
                    recv_batch[mi as usize]
                };
                out.push(Instr::Wait { batch: b });
            }
            if let Some(op) = o.ops.get(j) {
                out.push(Instr::Compute(*op));
            }
        }
        ranks.push(out);
    }
    Ok(ranks)
}
