//! D2: deadlock freedom under NCCL's stream order.
//!
//! torch's `ProcessGroupNCCL` runs the point-to-point ops of one communicator between two
//! ranks in issue order on one CUDA stream: an op starts only once every op issued before it
//! there has completed. Rendezvous (D1) treats ops independently, which is exact for blocking
//! batches (nothing is queued behind them) but not for batches left in flight, nor for calls
//! that issue their ops one by one (Megatron without `batch_p2p_comm`). So, whenever a program
//! has either, this check builds the op-level wait graph:
//!
//! - a send or receive completes once both it and its partner are posted (their ranks passed
//!   the blocking point before their batches) and the op before each of them on its stream has
//!   completed;
//! - a batch completes once its ops have; a blocking batch is also the next blocking point of
//!   its rank, and a `Wait` completes once the batch it names has;
//! - a batch posted as one NCCL group is one kernel on its communicator: a later op on one of
//!   its streams waits for the whole batch.
//!
//! Acyclic means deadlock-free under that order (the same induction as D1). Which ops share a
//! stream is the [`StreamRule`]: one communicator per pair of ranks (torch's default), or one
//! per direction (Megatron at pp = 2 sends odd-to-even traffic over WORLD, a second
//! communicator, for exactly this reason), and whether a batch's ops are one NCCL group
//! (unordered among themselves) or issued one by one. A program compiled with `--p2p-groups`
//! ([`P2pGroups`], the manifest's `p2p_groups`) names its communicators itself: `pair` is the
//! default above, `direction` puts every rank's downstream messages (activations) on one
//! communicator and its upstream ones (gradients) on another (pytorch #186173), `edge` gives
//! each directed pair of ranks its own (pytorch #196666). One analysis serves all three: only
//! the stream key of an op changes ([`StreamRule::stream`]), so on a rank the ops of one group
//! complete in posting order and ops of different groups are independent.
//!
//! Head-of-line waits (risk K2, [`head_of_line`]): an op posted on a group while an op of an
//! earlier batch on that group to another peer or in the other direction is still in flight
//! waits behind it. Without a cycle that is a delay, not a deadlock, so it is reported beside
//! the verdict: the #196666 example's `recv(0F3, R3->R0)` behind two sends to R1 under
//! `direction`. Under `edge` a group carries one peer in one direction, so there is none.
//!
//! Shape messages (Megatron's `_communicate_shapes`, `--megatron-variable-seq-lengths`) are
//! always one `batch_isend_irecv` on the pipeline group, whatever the mode: their batch is one
//! group, and at pp = 2 under the per-direction rule they share the pipeline group's stream,
//! which carries the even rank's sends and the odd rank's receives (`_p2p_ops` puts the other
//! direction on WORLD).

use super::deadlock::Graph;
use super::index::Index;
use super::risk::Risk;
use super::violation::Violation;
use crate::ir::{Instr, Matching, OptIdx, Program};
use pipec_schedules::{CommPolicy, MegatronP2p, P2pGroup, P2pGroups, Rank};

/// How a program's ops map onto NCCL streams.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct StreamRule {
    /// Each direction between two ranks is its own communicator (its own stream).
    pub per_direction: bool,
    /// A batch's ops are issued one by one in order (not one NCCL group).
    pub ops_in_order: bool,
    /// The program's communicators (`--p2p-groups`). Under [`P2pGroups::Pair`] the two flags
    /// above decide; `direction` and `edge` name every op's group themselves.
    pub groups: P2pGroups,
}

impl StreamRule {
    /// The rule `program` runs under, from the communicator model its lowering recorded.
    pub fn of(program: &Program) -> StreamRule {
        StreamRule {
            groups: program.p2p_groups,
            ..StreamRule::of_policy(program.comm, program.world())
        }
    }

    /// The stream of an op of one rank (its communicator as that rank sees it) with `peer`, a
    /// send or not, `downstream` (an activation or its shape), as a key below `2 * world`:
    /// under `pair` the peer, split by direction
    /// where [`StreamRule::per_direction`] says so (`pipeline_side`: Megatron's pipeline group
    /// at pp = 2, see [`stream_predecessors`]); under `edge` the peer and direction; under
    /// `direction` only whether the message flows downstream.
    fn stream(self, peer: usize, send: bool, downstream: bool, pipeline_side: bool) -> usize {
        match self.groups {
            P2pGroups::Pair => peer * 2 + usize::from(self.per_direction && pipeline_side),
            P2pGroups::Edge => peer * 2 + usize::from(send),
            P2pGroups::Direction => usize::from(downstream),
        }
    }

    /// The group of an op of rank `r`, for messages: the same on both ends of a message.
    pub fn group_of(self, r: Rank, ins: &Instr) -> Option<P2pGroup> {
        let (src, dst, payload) = match *ins {
            Instr::Send { peer, payload, .. } => (r, peer, payload),
            Instr::Recv { peer, payload, .. } => (peer, r, payload),
            _ => return None,
        };
        let downstream = payload.kind.data() == crate::ir::PayloadKind::Act;
        Some(self.groups.group(src, dst, downstream))
    }

    /// The rule a program lowered with `policy` for `world` ranks runs under: Megatron's
    /// unbatched and overlapped calls issue ops one by one (`_p2p_ops`), on one communicator
    /// per direction at pp = 2; everything else posts each batch as one group.
    fn of_policy(policy: Option<CommPolicy>, world: u32) -> StreamRule {
        match policy.and_then(CommPolicy::megatron_loop) {
            Some((_, mode)) if mode != MegatronP2p::Batched => StreamRule {
                per_direction: world == 2,
                ops_in_order: true,
                groups: P2pGroups::Pair,
            },
            _ => StreamRule::default(),
        }
    }
}

/// Adds D2's violations. Call only when D1 found no deadlock (every D1 cycle is one here too).
pub(crate) fn check(ix: &Index<'_>, m: &Matching, rule: StreamRule, out: &mut Vec<Violation>) {
    if !rule.ops_in_order && !ix.in_flight.iter().any(|&f| f) {
        return;
    }
    let total = ix.node_of.len();
    let nodes = total + ix.batch_start.len();
    // Node of a batch's completion (for a blocking batch also its rank's blocking point) or
    // of a wait: after the op positions.
    let point = |b: u32| total as u32 + b;
    // What each op waits for on its stream (an op, or a whole earlier batch: see below).
    let before = stream_predecessors(ix, rule, point);
    let g = Graph::from_edges(nodes, |f| {
        for b in 0..ix.batch_start.len() {
            let bu = b as u32;
            if let Some(p) = ix.pred(bu) {
                f(point(p), point(bu), OptIdx::NONE);
            }
            if let Some(w) = ix.wait_of[b].get() {
                // A wait completes when the batch it names has (one edge, however many waits).
                f(point(w), point(bu), OptIdx::NONE);
                continue;
            }
            let s = ix.batch_start[b];
            for o in s..s + ix.batch_len[b] {
                f(o, point(bu), OptIdx::NONE);
                // Posted: this rank and the partner's passed their previous blocking points.
                if let Some(p) = ix.pred(bu) {
                    f(point(p), o, OptIdx::NONE);
                }
                let Some(q) = m.partner_of(o) else {
                    continue;
                };
                if let Some(p) = ix.node_of[q as usize].get().and_then(|c| ix.pred(c)) {
                    f(point(p), o, OptIdx::NONE);
                }
                // Both ends wait for what is before them on their streams. The edge through
                // the partner's stream is labelled with the partner, queued there: the cycle's
                // words name it under `--p2p-groups`.
                for (x, queued) in [
                    (before[o as usize], OptIdx::NONE),
                    (before[q as usize], OptIdx::some(q)),
                ] {
                    if let Some(x) = x.get() {
                        f(x, o, queued);
                    }
                }
            }
        }
    });
    for cycle in g.stuck_cycles() {
        // Edges point from what is waited for to the waiter: reversed, each waits for the next.
        // Under chosen groups, an op that waits because its partner is queued on the partner's
        // communicator is followed by that partner (it waits for its partner, which waits for
        // what it is queued behind); the default keeps its words.
        let k = cycle.len();
        let mut seq: Vec<u32> = Vec::with_capacity(k);
        for j in (0..k).rev() {
            let n = cycle[j].0;
            if (n as usize) < total {
                seq.push(n);
            }
            if !rule.groups.is_pair() {
                // The label of the edge into n_j (from n_{j-1}): why n_j waits.
                if let Some(x) = cycle[(j + k - 1) % k].1.get() {
                    if x != n {
                        seq.push(x);
                    }
                }
            }
        }
        let ops: Vec<_> = seq.into_iter().map(|n| ix.site(n)).collect();
        if let Some(first) = (0..ops.len()).min_by_key(|&k| ops[k].at) {
            let mut ops = ops;
            ops.rotate_left(first);
            // Name each op's communicator where the program chose them (`--p2p-groups`);
            // under the default the header says it (one per pair), as before.
            let on = if rule.groups.is_pair() {
                Vec::new()
            } else {
                ops.iter()
                    .filter_map(|s| rule.group_of(s.at.rank, &s.instr))
                    .map(|g| g.to_string())
                    .collect()
            };
            out.push(Violation::StreamDeadlock {
                cycle: ops,
                groups: rule.groups,
                on,
            });
        }
    }
}

/// For each op, the node it waits for on its stream: with ops issued one by one, the op
/// issued before it on that stream; with each batch one NCCL group (one kernel on the
/// communicator), the whole earlier batch that used the stream (its completion node).
fn stream_predecessors(
    ix: &Index<'_>,
    rule: StreamRule,
    point: impl Fn(u32) -> u32,
) -> Vec<OptIdx> {
    let mut before = vec![OptIdx::NONE; ix.node_of.len()];
    let world = ix.world as usize;
    // Per stream key (peer, direction): (last op, its batch node, last earlier batch node).
    let none = (OptIdx::NONE, OptIdx::NONE, OptIdx::NONE);
    let mut last = vec![none; world * 2];
    // Per stream key: whether its last op was a shape message (one group: a later op waits for
    // the whole batch, even where ops are otherwise issued one by one).
    let mut last_group = vec![false; world * 2];
    let mut touched: Vec<usize> = Vec::new();
    for (r, instrs) in ix.p.ranks.iter().enumerate() {
        for &k in &touched {
            last[k] = none;
            last_group[k] = false;
        }
        touched.clear();
        let base = ix.pos.base(r);
        for (i, ins) in instrs.iter().enumerate() {
            let (peer, send, kind) = match *ins {
                Instr::Send { peer, payload, .. } => (peer.index(), true, payload.kind),
                Instr::Recv { peer, payload, .. } => (peer.index(), false, payload.kind),
                _ => continue,
            };
            let (shape, downstream) = (kind.is_shape(), kind.data() == crate::ir::PayloadKind::Act);
            if peer >= world {
                continue;
            }
            let g = base + i as u32;
            let b = ix.node_of[g as usize];
            // The pipeline group's stream at pp = 2: the even rank's send side, the odd
            // rank's receive side.
            let pipeline_side = if shape { r % 2 == 0 } else { send };
            let key = rule.stream(peer, send, downstream, pipeline_side);
            let (lg, lb, earlier) = last[key];
            let earlier = if lb != b { lb } else { earlier };
            let group = shape || !rule.ops_in_order;
            before[g as usize] = if group && lb == b {
                // Another op of one group on this stream: behind what its sibling is behind.
                lg.get().map_or(OptIdx::NONE, |s| before[s as usize])
            } else if !rule.ops_in_order || last_group[key] {
                // Behind the whole earlier group on this stream (one kernel).
                earlier.get().map(&point).into()
            } else {
                // Issued one by one: behind the op issued before it.
                lg
            };
            last_group[key] = group;
            last[key] = (OptIdx::some(g), b, earlier);
            touched.push(key);
        }
    }
    before
}

/// K2: head-of-line waits. Per rank, in posting order, the ops of earlier batches still in
/// flight on each stream (a batch left in flight until the `Wait` naming it is passed; a
/// blocking batch completes at its own blocking point, and with it, by the stream order,
/// everything before it on its streams). An op posted behind an in-flight op on its stream
/// that goes to another peer or the other way waits for an unrelated transfer. One risk per
/// rank and stream: the first such op, what it is behind, and how many more there are. Linear
/// in the program times the ops in flight on one stream at once.
pub(crate) fn head_of_line(ix: &Index<'_>, rule: StreamRule) -> Vec<Risk> {
    let mut out = Vec::new();
    if !ix.in_flight.iter().any(|&f| f) {
        return out;
    }
    let world = ix.world as usize;
    // Per stream key: in-flight (batch node, position, peer, send).
    let mut flying: Vec<Vec<(u32, u32, usize, bool)>> = vec![Vec::new(); world * 2];
    // Per stream key: the index in `out` of this rank's risk for it.
    let mut risk_of: Vec<Option<usize>> = vec![None; world * 2];
    for r in 0..world {
        for f in &mut flying {
            f.clear();
        }
        risk_of.fill(None);
        let base = ix.pos.base(r);
        for node in ix.rank_nodes[r]..ix.rank_nodes[r + 1] {
            let k = node as usize;
            if let Some(b) = ix.wait_of[k].get() {
                for f in &mut flying {
                    f.retain(|e| e.0 != b);
                }
                continue;
            }
            let s = ix.batch_start[k];
            let mut used: Vec<usize> = Vec::new();
            for g in s..s + ix.batch_len[k] {
                let ins = &ix.p.ranks[r][(g - base) as usize];
                let (peer, send, kind) = match *ins {
                    Instr::Send { peer, payload, .. } => (peer.index(), true, payload.kind),
                    Instr::Recv { peer, payload, .. } => (peer.index(), false, payload.kind),
                    _ => continue,
                };
                if peer >= world {
                    continue;
                }
                let pipeline_side = if kind.is_shape() { r % 2 == 0 } else { send };
                let downstream = kind.data() == crate::ir::PayloadKind::Act;
                let key = rule.stream(peer, send, downstream, pipeline_side);
                let behind = flying[key]
                    .iter()
                    .find(|e| e.0 != node && (e.2, e.3) != (peer, send));
                if let Some(&(_, q, _, _)) = behind {
                    match risk_of[key] {
                        Some(i) => {
                            if let Risk::HeadOfLine { more, .. } = &mut out[i] {
                                *more += 1;
                            }
                        }
                        None => {
                            risk_of[key] = Some(out.len());
                            out.push(Risk::HeadOfLine {
                                site: ix.site(g),
                                behind: ix.site(q),
                                group: rule
                                    .group_of(Rank(r as u32), ins)
                                    .map(|x| x.to_string())
                                    .unwrap_or_default(),
                                groups: rule.groups,
                                more: 0,
                            });
                        }
                    }
                }
                if ix.in_flight[k] {
                    flying[key].push((node, g, peer, send));
                } else {
                    used.push(key);
                }
            }
            // A blocking batch has completed before the rank goes on, and so has everything
            // before it on the streams it used.
            for key in used {
                flying[key].clear();
            }
        }
    }
    out
}
