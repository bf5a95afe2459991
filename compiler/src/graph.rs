//! One dependency graph over all ranks, as a petgraph [`DiGraph`]: a node per instruction, an
//! edge for program order, for each data dependency (a pass feeding a pass or a send on its
//! rank, a receive feeding the pass that consumes it) and for each matched send -> receive.
//!
//! The verifier's hot checks run on dense vectors ([`mod@crate::verify`]); this graph is the same
//! relation in a form that exports (DOT) and answers queries (reachability, topological order).
//! Only petgraph's iterative algorithms are used (`toposort`, `has_path_connecting`):
//! `is_cyclic_directed` and `tarjan_scc` recurse and overflow the stack at millions of nodes.
//!
//! Note that acyclicity of this graph is necessary, not sufficient, for deadlock freedom:
//! rendezvous sends and comm batches add waits that are not data dependencies. The verifier's
//! [`crate::verify::deadlock`] models those.

use crate::program::{Instr, InstrRef, Payload, Program};
use crate::verify::index::{slot, Index, NONE};
use crate::verify::matching;
use petgraph::algo::{has_path_connecting, toposort};
use petgraph::graph::{DiGraph, NodeIndex};
use pipec_schedules::{Pass, Rank, StageId, Task};
use std::fmt::Write as _;

/// Why one instruction comes before another.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum Edge {
    /// The next instruction on the same rank.
    Order,
    /// A tensor made or received on a rank feeds a pass or a send there.
    Data,
    /// A send delivers to its matched receive.
    Message,
}

/// The graph. Node `i` is the `i`-th instruction with ranks concatenated in order.
pub struct DepGraph {
    pub graph: DiGraph<InstrRef, Edge, u32>,
    offsets: Vec<u32>,
}

impl DepGraph {
    /// Build the graph. Ids out of range contribute nodes and order edges only.
    pub fn build(program: &Program) -> DepGraph {
        let mut ignored = Vec::new();
        let mut graph = DiGraph::with_capacity(program.len(), 3 * program.len());
        let Some(ix) = Index::build(program, &mut ignored) else {
            return DepGraph {
                graph,
                offsets: vec![0],
            };
        };
        // Program order. The ops of one comm batch are posted together, so none orders
        // another: each follows what precedes the batch, and what follows the batch follows
        // each of them.
        for (r, instrs) in program.ranks.iter().enumerate() {
            let mut seg = 0usize; // start of the batch holding instruction i - 1
            for i in 0..instrs.len() {
                let n = graph.add_node(InstrRef {
                    rank: Rank(r as u32),
                    index: i as u32,
                });
                if i == 0 {
                    continue;
                }
                let id = instrs[i].batch();
                let node = |k: usize| NodeIndex::new(n.index() - i + k);
                if id.is_some() && instrs[i - 1].batch() == id {
                    if seg > 0 {
                        graph.add_edge(node(seg - 1), n, Edge::Order);
                    }
                } else {
                    let from = if instrs[i - 1].batch().is_some() {
                        seg
                    } else {
                        i - 1
                    };
                    for k in from..i {
                        graph.add_edge(node(k), n, Edge::Order);
                    }
                    seg = i;
                }
            }
        }
        let m = matching::match_messages(&ix, &mut ignored);
        for (g, &q) in m.partner.iter().enumerate() {
            if q != NONE && matches!(ix.instr(g as u32), Instr::Send { .. }) {
                graph.add_edge(NodeIndex::new(g), NodeIndex::new(q as usize), Edge::Message);
            }
        }
        if ix.dense {
            let mut data = Vec::new();
            data_edges(&ix, &mut data);
            for (a, b) in data {
                graph.add_edge(
                    NodeIndex::new(a as usize),
                    NodeIndex::new(b as usize),
                    Edge::Data,
                );
            }
        }
        DepGraph {
            graph,
            offsets: ix.offsets.clone(),
        }
    }

    /// The node of an instruction.
    pub fn node(&self, at: InstrRef) -> Option<NodeIndex> {
        let r = at.rank.index();
        let start = *self.offsets.get(r)?;
        let end = *self.offsets.get(r + 1)?;
        let g = start.checked_add(at.index)?;
        (g < end).then(|| NodeIndex::new(g as usize))
    }

    /// Whether the dependency relation has no cycle (iterative topological sort).
    pub fn is_acyclic(&self) -> bool {
        toposort(&self.graph, None).is_ok()
    }

    /// Whether `to` depends, directly or not, on `from`.
    pub fn reaches(&self, from: InstrRef, to: InstrRef) -> bool {
        match (self.node(from), self.node(to)) {
            (Some(a), Some(b)) => has_path_connecting(&self.graph, a, b, None),
            _ => false,
        }
    }

    /// Graphviz text: one cluster per rank, data edges solid, messages dashed, program order
    /// dotted. Deterministic.
    pub fn to_dot(&self, program: &Program) -> String {
        let mut s =
            String::from("digraph pipec {\n  rankdir=LR;\n  node [shape=box, fontsize=10];\n");
        for (r, instrs) in program.ranks.iter().enumerate() {
            let _ = writeln!(s, "  subgraph cluster_rank{r} {{\n    label=\"rank {r}\";");
            for (i, ins) in instrs.iter().enumerate() {
                let g = self.offsets[r] as usize + i;
                let _ = writeln!(
                    s,
                    "    n{g} [label=\"#{i} {}\"];",
                    ins.to_string().replace('"', "'")
                );
            }
            s.push_str("  }\n");
        }
        for e in self.graph.raw_edges() {
            let style = match e.weight {
                Edge::Order => "dotted",
                Edge::Data => "solid",
                Edge::Message => "dashed",
            };
            let _ = writeln!(
                s,
                "  n{} -> n{} [style={style}];",
                e.source().index(),
                e.target().index()
            );
        }
        s.push_str("}\n");
        s
    }
}

/// (producer, consumer) position pairs of the data dependencies that the program satisfies
/// or names: producer pass -> consumer pass or send on one rank; receive -> consumer pass.
fn data_edges(ix: &Index<'_>, out: &mut Vec<(u32, u32)>) {
    let first = |p: Pass, t: Task| {
        let ti = ix.task_index(t);
        (ix.count[slot(p)][ti] > 0).then(|| ix.first[slot(p)][ti])
    };
    let backward = |t: Task| first(Pass::Bwd, t).or_else(|| first(Pass::BwdD, t));
    // The source of an input on rank r: the producer when it runs there, else the first
    // receive of the payload on r.
    let source = |r: u32, producer: Option<u32>, payload: Payload| -> Option<u32> {
        if let Some(f) = producer {
            if ix.on_rank(f, r) {
                return Some(f);
            }
        }
        let pi = ix.payload_index(payload);
        match ix.recv_count[pi] {
            0 => None,
            1 => Some(ix.recv_first[pi]).filter(|&j| ix.on_rank(j, r)),
            _ => ix.multi_recv[&(pi as u32)]
                .iter()
                .copied()
                .find(|&j| ix.on_rank(j, r)),
        }
    };
    for (r, instrs) in ix.p.ranks.iter().enumerate() {
        let r = r as u32;
        for (i, ins) in instrs.iter().enumerate() {
            let g = ix.offsets[r as usize] + i as u32;
            match *ins {
                Instr::Compute(c) => {
                    for (pass, t) in c.parts() {
                        if !ix.in_range(t) {
                            continue;
                        }
                        let (s, mb) = (t.stage.0, t.mb);
                        let mut inputs: [Option<u32>; 2] = [None, None];
                        match pass {
                            Pass::Fwd if s > 0 => {
                                let prev = Task {
                                    stage: StageId(s - 1),
                                    mb,
                                };
                                inputs[0] =
                                    source(r, first(Pass::Fwd, prev), Payload::act(s - 1, mb.0));
                            }
                            Pass::Bwd | Pass::BwdD => {
                                inputs[0] = first(Pass::Fwd, t).filter(|&f| ix.on_rank(f, r));
                                if s + 1 < ix.stages {
                                    let next = Task {
                                        stage: StageId(s + 1),
                                        mb,
                                    };
                                    inputs[1] =
                                        source(r, backward(next), Payload::grad(s + 1, mb.0));
                                }
                            }
                            Pass::BwdW => {
                                inputs[0] = first(Pass::BwdD, t).filter(|&f| ix.on_rank(f, r));
                            }
                            Pass::Fwd => {}
                        }
                        out.extend(
                            inputs
                                .into_iter()
                                .flatten()
                                .filter(|&a| a != g)
                                .map(|a| (a, g)),
                        );
                    }
                }
                Instr::Send { payload, .. } => {
                    let t = Task {
                        stage: payload.stage,
                        mb: payload.mb,
                    };
                    if !ix.in_range(t) {
                        continue;
                    }
                    let producer = match payload.kind {
                        crate::program::PayloadKind::Act => first(Pass::Fwd, t),
                        crate::program::PayloadKind::Grad => backward(t),
                    };
                    if let Some(f) = producer.filter(|&f| ix.on_rank(f, r)) {
                        out.push((f, g));
                    }
                }
                Instr::Recv { .. } | Instr::Wait { .. } => {}
            }
        }
    }
}
