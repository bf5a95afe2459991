//! An executor of NCCL's stream order, written apart from the verifier's rule (D2) so that the
//! two can be compared: every op of a comm batch is its own call, queued on its rank's stream
//! of its communicator; an op completes when it and its partner both head their streams. A
//! rank blocks on a batch until it completes, unless a later `wait` names it (then it goes on
//! and blocks at the `wait`). Which communicator a message uses, and what its partner is
//! matched by, are the caller's: `p2p_groups.rs` (torch's pair, direction and edge layouts)
//! and `megatron_p2p.rs` (Megatron's pipeline group and its pp = 2 WORLD group).

use pipec_ir::ir::{Instr, Payload, Program};
use std::collections::{HashMap, VecDeque};
use std::fmt::Debug;
use std::hash::Hash;

/// Runs `p`; `Err` says where it hangs. `comm(from, to, payload)` is the communicator of a
/// message from rank `from` to rank `to` (each rank has a stream per communicator);
/// `channel(from, to, payload)` what, besides the ordered pair of ranks, a send and a receive
/// are matched in FIFO order by (a constant: per ordered pair, torch's tag 0).
pub(crate) fn run_in_stream_order<C, K>(
    p: &Program,
    comm: impl Fn(usize, usize, Payload) -> C,
    channel: impl Fn(usize, usize, Payload) -> K,
) -> Result<(), String>
where
    C: Copy + Eq + Hash + Debug,
    K: Copy + Eq + Hash,
{
    let w = p.ranks.len();
    // A channel: the ordered pair of ranks and the caller's key.
    type Channel<K> = (usize, usize, K);
    // Per op (rank, index): its stream (rank, communicator), its channel, its sequence number
    // on that channel, whether it sends.
    struct Op<C, K> {
        stream: (usize, C),
        channel: Channel<K>,
        n: usize,
        send: bool,
    }
    let mut seq: HashMap<(Channel<K>, bool), usize> = HashMap::new();
    let mut ops: HashMap<(usize, usize), Op<C, K>> = HashMap::new();
    let mut by_channel: HashMap<(Channel<K>, bool, usize), (usize, usize)> = HashMap::new();
    for (r, instrs) in p.ranks.iter().enumerate() {
        for (i, ins) in instrs.iter().enumerate() {
            let (peer, send, payload) = match *ins {
                Instr::Send { peer, payload, .. } => (peer.index(), true, payload),
                Instr::Recv { peer, payload, .. } => (peer.index(), false, payload),
                _ => continue,
            };
            let (from, to) = if send { (r, peer) } else { (peer, r) };
            let channel = (from, to, channel(from, to, payload));
            let n = seq.entry((channel, send)).or_default();
            by_channel.insert((channel, send, *n), (r, i));
            ops.insert(
                (r, i),
                Op {
                    stream: (r, comm(from, to, payload)),
                    channel,
                    n: *n,
                    send,
                },
            );
            *n += 1;
        }
    }
    let mut streams: HashMap<(usize, C), VecDeque<usize>> = HashMap::new();
    let mut done: Vec<Vec<bool>> = p.ranks.iter().map(|r| vec![false; r.len()]).collect();
    let mut pc = vec![0usize; w];
    // Ops a rank blocks on: the ops of its current blocking batch, or of the batch it waits for.
    let mut blocked: Vec<Vec<usize>> = vec![Vec::new(); w];
    loop {
        let mut progress = false;
        for r in 0..w {
            let instrs = &p.ranks[r];
            if blocked[r].iter().any(|&i| !done[r][i]) {
                continue;
            }
            blocked[r].clear();
            let before = pc[r];
            while pc[r] < instrs.len() {
                let i = pc[r];
                match instrs[i] {
                    Instr::Wait { batch } => {
                        blocked[r] = (0..i)
                            .filter(|&k| instrs[k].batch() == Some(batch))
                            .collect();
                        pc[r] += 1;
                        break;
                    }
                    Instr::Send { .. } | Instr::Recv { .. } => {
                        let b = instrs[i].batch();
                        let mut end = i;
                        while end < instrs.len() && instrs[end].batch() == b {
                            streams
                                .entry(ops[&(r, end)].stream)
                                .or_default()
                                .push_back(end);
                            end += 1;
                        }
                        let in_flight = instrs[end..]
                            .iter()
                            .any(|x| matches!(x, Instr::Wait { batch } if Some(*batch) == b));
                        pc[r] = end;
                        if !in_flight {
                            blocked[r] = (i..end).collect();
                            break;
                        }
                    }
                    _ => pc[r] += 1,
                }
            }
            progress |= pc[r] != before;
        }
        // Complete every pair whose two ops head their streams.
        let heads: Vec<(usize, usize)> = streams
            .iter()
            .filter_map(|(k, q)| q.front().map(|&i| (k.0, i)))
            .collect();
        for (r, i) in heads {
            if done[r][i] {
                continue;
            }
            let op = &ops[&(r, i)];
            let Some(&(pr, pi)) = by_channel.get(&(op.channel, !op.send, op.n)) else {
                return Err(format!("rank {r} #{i} has no partner"));
            };
            let (mine, theirs) = (op.stream, ops[&(pr, pi)].stream);
            if streams.get(&theirs).and_then(|q| q.front()) == Some(&pi) {
                streams.get_mut(&mine).unwrap().pop_front();
                streams.get_mut(&theirs).unwrap().pop_front();
                done[r][i] = true;
                done[pr][pi] = true;
                progress = true;
            }
        }
        let finished = (0..w)
            .all(|r| pc[r] == p.ranks[r].len() && blocked[r].iter().all(|&i| done[r][i]))
            && streams.values().all(VecDeque::is_empty);
        if finished {
            return Ok(());
        }
        if !progress {
            let at: Vec<String> = (0..w).map(|r| format!("rank {r} at #{}", pc[r])).collect();
            let mut heads: Vec<String> = streams
                .iter()
                .filter_map(|(k, q)| q.front().map(|i| format!("{k:?} head #{i}")))
                .collect();
            heads.sort();
            return Err(format!(
                "hangs: {}; streams: {}",
                at.join(", "),
                heads.join(", ")
            ));
        }
    }
}
