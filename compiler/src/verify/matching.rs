//! Send/recv matching. NCCL delivers point-to-point messages between an ordered pair of
//! ranks in the order they are posted (FIFO per peer and communicator; torch's
//! `_PipelineScheduleRuntime` relies on the same with tag 0), so the k-th send from `a` to `b`
//! meets the k-th receive that `b` posts from `a`, whatever the two sides think they carry.

use super::index::{Index, NONE};
use super::report::Violation;
use crate::ir::{Instr, Payload};
use std::collections::HashMap;

/// Who meets whom.
pub(crate) struct Matching {
    /// Per global position: the matched peer op, `NONE` for compute and unmatched ops.
    pub partner: Vec<u32>,
}

fn endpoint(i: &Instr) -> Option<(bool, u32, Payload)> {
    match *i {
        Instr::Send { peer, payload, .. } => Some((true, peer.0, payload)),
        Instr::Recv { peer, payload, .. } => Some((false, peer.0, payload)),
        Instr::Compute(_) | Instr::Wait { .. } => None,
    }
}

/// Pair sends and receives per channel; report wrong tensors and unmatched ops.
///
/// On a channel whose send and receive counts differ, the ops whose payload has no
/// counterpart are reported as unmatched (the likely culprit: a dropped or extra message),
/// and the shifted pairs behind them are not also reported as wrong tensors: the channel hangs
/// anyway, and the shift is a consequence, not a second defect.
pub(crate) fn match_messages(ix: &Index<'_>, out: &mut Vec<Violation>) -> Matching {
    let world = ix.world as usize;
    let mut partner = vec![NONE; ix.node_of.len()];
    // Channel ids, assigned on first use per rank so that hashing is per channel, not per op.
    let mut ids: HashMap<(u32, u32), u32> = HashMap::new();
    let mut sends: Vec<Vec<(u32, Payload)>> = Vec::new();
    let mut recvs: Vec<Vec<(u32, Payload)>> = Vec::new();
    let mut send_slot = vec![NONE; world];
    let mut recv_slot = vec![NONE; world];
    let mut touched: Vec<usize> = Vec::new();
    for (r, instrs) in ix.p.ranks.iter().enumerate() {
        let base = ix.offsets[r];
        for &p in &touched {
            send_slot[p] = NONE;
            recv_slot[p] = NONE;
        }
        touched.clear();
        for (i, ins) in instrs.iter().enumerate() {
            let Some((is_send, peer, payload)) = endpoint(ins) else {
                continue;
            };
            if peer as usize >= world {
                continue; // reported as out of range; it can never be matched
            }
            let p = peer as usize;
            let table = if is_send {
                &mut send_slot
            } else {
                &mut recv_slot
            };
            if table[p] == NONE {
                let key = if is_send {
                    (r as u32, peer)
                } else {
                    (peer, r as u32)
                };
                let next = sends.len() as u32;
                let id = *ids.entry(key).or_insert_with(|| {
                    sends.push(Vec::new());
                    recvs.push(Vec::new());
                    next
                });
                table[p] = id;
                touched.push(p);
            }
            let id = table[p] as usize;
            let g = base + i as u32;
            if is_send {
                sends[id].push((g, payload));
            } else {
                recvs[id].push((g, payload));
            }
        }
    }
    let mut found = Vec::new();
    for (s, r) in sends.iter().zip(&recvs) {
        for (&(a, _), &(b, _)) in s.iter().zip(r) {
            partner[a as usize] = b;
            partner[b as usize] = a;
        }
        if s.len() == r.len() {
            for (&(a, pa), &(b, pb)) in s.iter().zip(r) {
                if pa != pb {
                    found.push(Violation::WrongTensor {
                        recv: ix.site(b),
                        send: ix.site(a),
                    });
                }
            }
        } else {
            unbalanced(ix, s, r, &mut found);
        }
    }
    found.sort_by_key(|v| v.at());
    out.extend(found);
    Matching { partner }
}

/// Report the ops of an unbalanced channel whose payloads the other side does not carry (as
/// often): of several equal payloads, the later ones are the extra.
fn unbalanced(
    ix: &Index<'_>,
    s: &[(u32, Payload)],
    r: &[(u32, Payload)],
    out: &mut Vec<Violation>,
) {
    let mut balance: HashMap<Payload, i64> = HashMap::new();
    for &(_, p) in s {
        *balance.entry(p).or_default() += 1;
    }
    for &(_, p) in r {
        *balance.entry(p).or_default() -= 1;
    }
    let (ns, nr) = (s.len() as u32, r.len() as u32);
    for (ops, sign) in [(s, 1i64), (r, -1i64)] {
        let mut left = balance.clone();
        for &(g, p) in ops.iter().rev() {
            let e = left.entry(p).or_default();
            if *e * sign > 0 {
                *e -= sign;
                out.push(Violation::Unmatched {
                    site: ix.site(g),
                    sends: ns,
                    recvs: nr,
                });
            }
        }
    }
}
