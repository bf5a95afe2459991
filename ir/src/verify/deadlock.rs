//! Deadlock freedom under rendezvous semantics, with comm batches as units.
//!
//! The model (the strictest NCCL behaviour): all ops of a batch are posted together; a send
//! or receive completes only once its matched peer op is posted too, whatever the message
//! size; a batch completes when all its ops have; compute never waits. So a batch `B`
//! completes exactly when it is posted and, for each of its ops, the batch `C` holding the
//! matched op has been posted as well. `C` is posted once the batch before it on its rank has
//! completed. That is an AND-wait graph over batches with an edge `pred(B) -> B` (program
//! order) and `pred(C) -> B` for every matched op of `B` whose partner sits in `C`. The
//! program is deadlock-free exactly when every op is matched and this graph is acyclic (by
//! induction along a topological order every batch completes; a batch on a cycle would have
//! to complete strictly after itself).
//!
//! docs/design.md phrases the rule as merging each batch with its matched peers' batches and
//! checking the merged graph. The two agree whenever a merged group holds at most one batch
//! per rank, which is the case for every schedule pipec generates; where a group would chain
//! two batches of one rank through a peer (`b1 ~ c ~ b2`), merging reports a deadlock that does
//! not happen (`b1` completes as soon as `c` is posted), so we check the per-batch graph.
//!
//! Batches left in flight (named by a later `Wait`, Megatron's `overlap_p2p_comm`) are
//! posted without holding their rank: program order runs from blocking point to blocking
//! point (a blocking batch or a `Wait`), and a `Wait` node completes after the batch it names.
//! So the graph's nodes are batches and waits, with `pred` the last blocking node before.
//!
//! Most programs are deadlock-free, so the check first runs the ranks against each other
//! (`completes`): the same fixpoint as Kahn's algorithm on this graph, without building it.
//! Only a program that gets stuck pays for the graph, to find and explain its cycles.
//!
//! Both graph passes are iterative (Kahn's algorithm, then an explicit-stack Tarjan on what Kahn
//! could not release): recursive graph algorithms overflow the stack at millions of nodes.

use super::index::Index;
use super::violation::{Site, Violation, WaitStep};
use crate::ir::{Matching, OptIdx};
use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};

/// The wait graph in compressed rows: `targets[start[u]..start[u + 1]]` are the batches that
/// wait for `u`; `labels` holds the waiting op (global position) of a matched edge, none for
/// program order.
pub(crate) struct Graph {
    pub start: Vec<u32>,
    pub targets: Vec<u32>,
    pub labels: Vec<OptIdx>,
}

impl Graph {
    fn out(&self, u: u32) -> std::ops::Range<usize> {
        self.start[u as usize] as usize..self.start[u as usize + 1] as usize
    }
}

/// Calls `f(from, to, label)` for every edge.
fn edges(ix: &Index<'_>, m: &Matching, f: &mut dyn FnMut(u32, u32, OptIdx)) {
    for b in 0..ix.batch_start.len() as u32 {
        if let Some(a) = ix.pred(b) {
            f(a, b, OptIdx::NONE);
        }
        // A wait completes when the batch it names does.
        if let Some(w) = ix.wait_of[b as usize].get() {
            f(w, b, OptIdx::NONE);
        }
        let s = ix.batch_start[b as usize];
        for g in s..s + ix.batch_len[b as usize] {
            let Some(q) = m.partner_of(g) else {
                continue;
            };
            let Some(c) = ix.node_of[q as usize].get() else {
                continue;
            };
            if let Some(pc) = ix.pred(c) {
                f(pc, b, OptIdx::some(g));
            }
        }
    }
}

impl Graph {
    /// Compressed rows of `n` nodes from an edge lister, called twice (count, then fill) so
    /// no edge list is held.
    pub(crate) fn from_edges(n: usize, edges: impl Fn(&mut dyn FnMut(u32, u32, OptIdx))) -> Graph {
        let mut start = vec![0u32; n + 1];
        edges(&mut |a, _, _| start[a as usize + 1] += 1);
        for i in 0..n {
            start[i + 1] += start[i];
        }
        let e = start[n] as usize;
        let mut fill = start.clone();
        let mut targets = vec![0u32; e];
        let mut labels = vec![OptIdx::NONE; e];
        edges(&mut |a, b, l| {
            let k = fill[a as usize] as usize;
            targets[k] = b;
            labels[k] = l;
            fill[a as usize] += 1;
        });
        Graph {
            start,
            targets,
            labels,
        }
    }

    /// One shortest cycle per strongly connected group of nodes that can never complete
    /// (Kahn's algorithm releases everything else), in edge direction.
    pub(crate) fn stuck_cycles(&self) -> Vec<Vec<(u32, OptIdx)>> {
        let n = self.start.len() - 1;
        let mut indeg = vec![0u32; n];
        for &t in &self.targets {
            indeg[t as usize] += 1;
        }
        let mut ready: Vec<u32> = (0..n as u32).filter(|&v| indeg[v as usize] == 0).collect();
        let mut released = 0usize;
        while let Some(u) = ready.pop() {
            released += 1;
            for k in self.out(u) {
                let t = self.targets[k] as usize;
                indeg[t] -= 1;
                if indeg[t] == 0 {
                    ready.push(t as u32);
                }
            }
        }
        if released == n {
            return Vec::new();
        }
        let stuck: Vec<bool> = indeg.iter().map(|&d| d > 0).collect();
        cyclic_sccs(self, &stuck)
            .iter()
            .map(|scc| shortest_cycle(self, scc))
            .collect()
    }
}

/// Report one wait cycle per strongly connected group of batches that can never complete.
/// Unmatched ops are reported by matching; here they add no edge, so what remains after
/// Kahn's algorithm is exactly what sits on or behind a cycle.
pub(crate) fn check(ix: &Index<'_>, m: &Matching, out: &mut Vec<Violation>) {
    let n = ix.batch_start.len();
    if n == 0 || completes(ix, m) {
        return;
    }
    let g = Graph::from_edges(n, |f| edges(ix, m, f));
    for cycle in g.stuck_cycles() {
        out.push(Violation::Deadlock {
            cycle: describe(ix, m, &cycle),
        });
    }
}

/// Whether every node of the wait graph completes, found by running the ranks: each rank
/// passes its nodes in order while it can (an in-flight batch is passed when posted; a
/// blocking batch, or a `Wait` for the batch it names, once every matched op's partner is
/// posted, i.e. the partner's rank has reached the partner's node); a rank that cannot go on
/// waits, keyed by that node, on the partner's rank, which wakes it when it gets there. This
/// computes exactly what Kahn's algorithm releases on [`Graph`] (every edge into a node is
/// from its rank's earlier blocking node or from the blocking node before a partner), in
/// linear time and with per-rank state only; when ranks are left waiting, their waits close a
/// cycle of the graph.
fn completes(ix: &Index<'_>, m: &Matching) -> bool {
    let world = ix.rank_nodes.len() - 1;
    // cursor[r]: rank r's first node not passed. Every node before it has completed (or, in
    // flight, been posted), so every node up to and including it is posted.
    let mut cursor = ix.rank_nodes[..world].to_vec();
    // Where in its current node's ops a waiting rank resumes.
    let mut resume = vec![0u32; world];
    // Per rank: (node, waiting rank) pairs, woken once the rank's cursor reaches the node.
    let mut waiters: Vec<BinaryHeap<Reverse<(u32, u32)>>> = vec![BinaryHeap::new(); world];
    let mut ready: Vec<u32> = (0..world as u32).rev().collect();
    while let Some(r) = ready.pop() {
        let r = r as usize;
        let (from, end) = (cursor[r], ix.rank_nodes[r + 1]);
        'run: while cursor[r] < end {
            let k = cursor[r] as usize;
            // The batch whose ops must all meet posted partners before k is passed.
            let needs = match ix.wait_of[k].get() {
                Some(b) => Some(b as usize),
                None if ix.in_flight[k] || ix.batch_len[k] == 0 => None,
                None => Some(k),
            };
            if let Some(b) = needs {
                let s = ix.batch_start[b];
                for j in resume[r]..ix.batch_len[b] {
                    let Some(c) = m
                        .partner_of(s + j)
                        .and_then(|q| ix.node_of[q as usize].get())
                    else {
                        continue;
                    };
                    let rc = ix.batch_rank[c as usize] as usize;
                    if cursor[rc] < c {
                        resume[r] = j;
                        waiters[rc].push(Reverse((c, r as u32)));
                        break 'run;
                    }
                }
                resume[r] = 0;
            }
            cursor[r] += 1;
        }
        if cursor[r] > from {
            while let Some(&Reverse((c, w))) = waiters[r].peek() {
                if c > cursor[r] {
                    break;
                }
                waiters[r].pop();
                ready.push(w);
            }
        }
    }
    (0..world).all(|r| cursor[r] == ix.rank_nodes[r + 1])
}

/// Strongly connected components of the stuck subgraph that contain a cycle (more than one
/// node, or a self-loop), by an iterative Tarjan. Each is returned with its members sorted.
fn cyclic_sccs(g: &Graph, stuck: &[bool]) -> Vec<Vec<u32>> {
    let n = stuck.len();
    // Tarjan's visit number of each node (none until visited) and its low-link.
    let mut index = vec![OptIdx::NONE; n];
    let mut low = vec![0u32; n];
    let mut on_stack = vec![false; n];
    let mut stack: Vec<u32> = Vec::new();
    // The explicit call stack: (node, next out-edge to look at).
    let mut call: Vec<(u32, usize)> = Vec::new();
    let mut counter = 0u32;
    let mut found = Vec::new();
    for root in 0..n as u32 {
        if !stuck[root as usize] || index[root as usize].is_some() {
            continue;
        }
        let mut next = Some(root);
        loop {
            if let Some(v) = next.take() {
                index[v as usize] = OptIdx::some(counter);
                low[v as usize] = counter;
                counter += 1;
                stack.push(v);
                on_stack[v as usize] = true;
                call.push((v, g.start[v as usize] as usize));
            }
            let Some(&(v, e)) = call.last() else {
                break;
            };
            if e < g.start[v as usize + 1] as usize {
                call.last_mut().expect("non-empty").1 += 1;
                let w = g.targets[e];
                if !stuck[w as usize] {
                    continue;
                }
                match index[w as usize].get() {
                    None => next = Some(w),
                    Some(iw) if on_stack[w as usize] => {
                        low[v as usize] = low[v as usize].min(iw);
                    }
                    Some(_) => {}
                }
                continue;
            }
            call.pop();
            if let Some(&(u, _)) = call.last() {
                low[u as usize] = low[u as usize].min(low[v as usize]);
            }
            if index[v as usize].get() == Some(low[v as usize]) {
                let mut scc = Vec::new();
                loop {
                    let w = stack.pop().expect("tarjan stack holds the component");
                    on_stack[w as usize] = false;
                    scc.push(w);
                    if w == v {
                        break;
                    }
                }
                let self_loop = g.out(v).any(|k| g.targets[k] == v);
                if scc.len() > 1 || self_loop {
                    scc.sort_unstable();
                    found.push(scc);
                }
            }
        }
    }
    found.sort();
    found
}

/// A shortest cycle through the first member of a strongly connected component, by breadth-
/// first search: `(node, label of the edge from it to the next node)`, in edge direction.
fn shortest_cycle(g: &Graph, scc: &[u32]) -> Vec<(u32, OptIdx)> {
    let v = scc[0];
    let member = |w: u32| scc.binary_search(&w).is_ok();
    // parent[w] = (node before w, label of that edge), local to the component.
    let mut parent: std::collections::HashMap<u32, (u32, OptIdx)> = Default::default();
    let mut queue = VecDeque::from([v]);
    let mut last: Option<(u32, OptIdx)> = None;
    'bfs: while let Some(u) = queue.pop_front() {
        for k in g.out(u) {
            let w = g.targets[k];
            if w == v {
                last = Some((u, g.labels[k]));
                break 'bfs;
            }
            if member(w) && !parent.contains_key(&w) {
                parent.insert(w, (u, g.labels[k]));
                queue.push_back(w);
            }
        }
    }
    let (mut u, mut label) = last.expect("a cyclic component has a cycle through each member");
    let mut rev = Vec::new();
    loop {
        rev.push((u, label));
        if u == v {
            break;
        }
        let (p, l) = parent[&u];
        label = l;
        u = p;
        // The pair pushed next is (p, label of p -> u).
    }
    // rev holds (u_k, l_k: u_k -> v), (u_{k-1}, l: u_{k-1} -> u_k), ...: reverse it.
    rev.reverse();
    rev
}

/// Put a cycle in words: who waits for whom, starting at the earliest waiting instruction.
/// `cycle` is in edge direction (`n_i -> n_{i+1}` means `n_{i+1}` waits for `n_i`).
fn describe(ix: &Index<'_>, m: &Matching, cycle: &[(u32, OptIdx)]) -> Vec<WaitStep> {
    let k = cycle.len();
    // Walk against the edges: the waiter of step j is the head of edge (k - 1 - j).
    let mut raw: Vec<(Option<(u32, u32)>, u32)> = Vec::with_capacity(k); // (Some((x, partner)) | None, waiter pos)
    for j in 0..k {
        let e = (k + k - 1 - j) % k; // edge index n_e -> n_{e+1}
        let head = cycle[(e + 1) % k].0;
        match cycle[e].1.get() {
            None => raw.push((None, ix.batch_start[head as usize])),
            Some(label) => {
                raw.push((Some((label, m.partner_of(label).unwrap_or(label))), label));
            }
        }
    }
    let first = (0..k).min_by_key(|&j| raw[j].1).unwrap_or(0);
    raw.rotate_left(first);
    let site = |g: u32| -> Site { ix.site(g) };
    let mut steps: Vec<WaitStep> = Vec::with_capacity(k);
    for j in 0..k {
        let until = site(raw[(j + 1) % k].1);
        match (raw[j].0, steps.last_mut()) {
            // A run of program-order waits on one rank says one thing: this batch cannot be
            // posted until an earlier one completes. Keep the run's two ends.
            (None, Some(WaitStep::Order { until: u, .. })) => *u = until,
            (None, _) => steps.push(WaitStep::Order {
                waiter: site(raw[j].1),
                until,
            }),
            (Some((x, y)), _) => steps.push(WaitStep::Peer {
                waiter: site(x),
                peer: site(y),
                until,
            }),
        }
    }
    steps
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{Instr, Payload, Program};
    use pipec_schedules::{Placement, Rank};
    use proptest::prelude::*;

    /// One op of a random stream: a send or receive with a peer offset, joining the previous
    /// op's batch or not; or a wait for the batch `k` back.
    #[derive(Clone, Debug)]
    enum Op {
        Msg { send: bool, peer: u32, join: bool },
        Wait(u32),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => (any::<bool>(), 1u32..3, any::<bool>())
                .prop_map(|(send, peer, join)| Op::Msg { send, peer, join }),
            1 => (0u32..4).prop_map(Op::Wait),
        ]
    }

    fn program(world: u32, streams: &[Vec<Op>]) -> Program {
        let ranks = streams
            .iter()
            .enumerate()
            .map(|(r, ops)| {
                let mut out = Vec::new();
                let mut batch = 0u32;
                for o in ops {
                    match *o {
                        Op::Msg { send, peer, join } => {
                            if !(join
                                && matches!(
                                    out.last(),
                                    Some(Instr::Send { .. } | Instr::Recv { .. })
                                ))
                            {
                                batch += 1;
                            }
                            let peer = Rank((r as u32 + peer) % world);
                            out.push(Instr::message(send, peer, Payload::act(0, 0), batch));
                        }
                        Op::Wait(k) => out.push(Instr::Wait {
                            batch: batch.saturating_sub(k),
                        }),
                    }
                }
                out
            })
            .collect();
        Program {
            placement: Placement::looped(world, 1),
            microbatches: 1,
            forward_only: true,
            comm: None,
            ranks,
            lengths: None,
            p2p_groups: Default::default(),
            buffer_slots: None,
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 3000, failure_persistence: None, ..ProptestConfig::default() })]

        /// Running the ranks completes exactly when Kahn's algorithm releases the whole graph,
        /// with blocking batches, batches left in flight, waits, self-messages and unmatched
        /// ops.
        #[test]
        fn running_the_ranks_agrees_with_kahn(
            world in 2u32..4,
            streams in prop::collection::vec(prop::collection::vec(op(), 0..10), 3),
        ) {
            let p = program(world, &streams[..world as usize]);
            let mut ignored = Vec::new();
            let ix = Index::build(&p, &mut ignored).expect("small");
            let m = Matching::new(&p, ix.pos.clone());
            let n = ix.batch_start.len();
            let acyclic = Graph::from_edges(n, |f| edges(&ix, &m, f)).stuck_cycles().is_empty();
            prop_assert_eq!(completes(&ix, &m), acyclic, "{:?}", p.ranks);
        }
    }
}
