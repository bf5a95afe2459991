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
//! (unordered among themselves) or issued one by one.
//!
//! Shape messages (Megatron's `_communicate_shapes`, `--megatron-variable-seq-lengths`) are
//! always one `batch_isend_irecv` on the pipeline group, whatever the mode: their batch is one
//! group, and at pp = 2 under the per-direction rule they share the pipeline group's stream,
//! which carries the even rank's sends and the odd rank's receives (`_p2p_ops` puts the other
//! direction on WORLD).

use super::deadlock::Graph;
use super::index::Index;
use super::violation::Violation;
use crate::ir::{Matching, OptIdx, Program};
use pipec_schedules::{CommPolicy, MegatronP2p};

/// How a program's ops map onto NCCL streams.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct StreamRule {
    /// Each direction between two ranks is its own communicator (its own stream).
    pub per_direction: bool,
    /// A batch's ops are issued one by one in order (not one NCCL group).
    pub ops_in_order: bool,
}

impl StreamRule {
    /// The rule `program` runs under, from the communicator model its lowering recorded.
    pub fn of(program: &Program) -> StreamRule {
        StreamRule::of_policy(program.comm, program.world())
    }

    /// The rule a program lowered with `policy` for `world` ranks runs under: Megatron's
    /// unbatched and overlapped calls issue ops one by one (`_p2p_ops`), on one communicator
    /// per direction at pp = 2; everything else posts each batch as one group.
    fn of_policy(policy: Option<CommPolicy>, world: u32) -> StreamRule {
        match policy.and_then(CommPolicy::megatron_loop) {
            Some((_, mode)) if mode != MegatronP2p::Batched => StreamRule {
                per_direction: world == 2,
                ops_in_order: true,
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
                // Both ends wait for what is before them on their streams.
                for x in [before[o as usize], before[q as usize]] {
                    if let Some(x) = x.get() {
                        f(x, o, OptIdx::NONE);
                    }
                }
            }
        }
    });
    for cycle in g.stuck_cycles() {
        // Edges point from what is waited for to the waiter: reversed, each waits for the next.
        let ops: Vec<_> = cycle
            .iter()
            .rev()
            .map(|&(n, _)| n as usize)
            .filter(|&n| n < total)
            .map(|n| ix.site(n as u32))
            .collect();
        if let Some(first) = (0..ops.len()).min_by_key(|&k| ops[k].at) {
            let mut ops = ops;
            ops.rotate_left(first);
            out.push(Violation::StreamDeadlock { cycle: ops });
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
            let (peer, send, shape) = match *ins {
                crate::ir::Instr::Send { peer, payload, .. } => {
                    (peer.index(), true, payload.kind.is_shape())
                }
                crate::ir::Instr::Recv { peer, payload, .. } => {
                    (peer.index(), false, payload.kind.is_shape())
                }
                _ => continue,
            };
            if peer >= world {
                continue;
            }
            let g = base + i as u32;
            let b = ix.node_of[g as usize];
            // The pipeline group's stream at pp = 2: the even rank's send side, the odd
            // rank's receive side.
            let pipeline_side = if shape { r % 2 == 0 } else { send };
            let key = peer * 2 + usize::from(rule.per_direction && pipeline_side);
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
