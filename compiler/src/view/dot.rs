//! The dependency graph for Graphviz (`dot -Tsvg`).
//!
//! Full view: one node per instruction in one cluster per rank (left to right in program
//! order); grey edges for program order, red dashed edges from each send to its matching recv,
//! blue dotted edges for data dependencies on one rank (forward to its backward, a V-shape
//! turnaround, `bwd_D` to `bwd_W`); dependencies across ranks travel the send -> recv edges.
//! Big programs are unreadable that way, so two condensed views exist: `Stage` (one node per
//! stage, edges counting the messages between stages) and `RankMb` (one node per rank and
//! microbatch, edges counting the messages between them).

use super::{comm_name, op_name, OpKind};
use pipec_ir::ir::Matching;
use pipec_ir::ir::{Instr, InstrRef, Program};
use pipec_schedules::{Pass, Rank, StageId, Task};
use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;

/// Which graph to draw.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Condense {
    /// Every instruction.
    None,
    /// One node per stage.
    Stage,
    /// One node per (rank, microbatch).
    RankMb,
}

/// Programs with more instructions than this get [`Condense::Stage`] by default.
pub const FULL_LIMIT: usize = 400;

impl Condense {
    /// The view used when none is asked for: full for small programs, per stage otherwise.
    pub fn auto(program: &Program) -> Self {
        if program.len() <= FULL_LIMIT {
            Condense::None
        } else {
            Condense::Stage
        }
    }
}

fn esc(s: &str) -> String {
    s.replace('\\', "\\\\").replace('"', "\\\"")
}

fn fill(kind: OpKind) -> &'static str {
    match kind {
        OpKind::Fwd => "#4e79a7",
        OpKind::Bwd => "#59a14f",
        OpKind::BwdD => "#f28e2b",
        OpKind::BwdW => "#b07aa1",
        OpKind::Pair => "#76b7b2",
    }
}

fn header(out: &mut String, title: Option<&str>) {
    out.push_str("digraph pipec {\n");
    out.push_str("  graph [rankdir=LR, fontname=\"Helvetica\", fontsize=12, newrank=true");
    if let Some(t) = title {
        let _ = write!(out, ", label=\"{}\", labelloc=t", esc(t));
    }
    out.push_str("];\n");
    out.push_str("  node [shape=box, style=\"rounded,filled\", fontname=\"Helvetica\", fontsize=10, fillcolor=\"#eeeeee\"];\n");
    out.push_str("  edge [fontname=\"Helvetica\", fontsize=9];\n");
}

/// The graph as DOT text.
pub fn render(program: &Program, condense: Condense, title: Option<&str>) -> String {
    let mut out = String::new();
    header(&mut out, title);
    match condense {
        Condense::None => full(program, &mut out),
        Condense::Stage => by_stage(program, &mut out),
        Condense::RankMb => by_rank_mb(program, &mut out),
    }
    out.push_str("}\n");
    out
}

fn node(at: InstrRef) -> String {
    format!("r{}_{}", at.rank.0, at.index)
}

fn full(program: &Program, out: &mut String) {
    // Where each (pass, task) runs, for local data dependencies.
    let mut at_of: HashMap<(Pass, Task), InstrRef> = HashMap::new();
    for (r, instrs) in program.ranks.iter().enumerate() {
        let _ = writeln!(out, "  subgraph cluster_rank{r} {{");
        let _ = writeln!(
            out,
            "    label=\"rank {r}\"; style=rounded; color=\"#999999\";"
        );
        for (i, ins) in instrs.iter().enumerate() {
            let at = InstrRef {
                rank: Rank(r as u32),
                index: i as u32,
            };
            match ins {
                Instr::Compute(_) | Instr::FwdCheckpoint(_) => {
                    let op = &ins.as_compute().expect("a compute op");
                    for part in op.parts() {
                        at_of.insert(part, at);
                    }
                    let _ = writeln!(
                        out,
                        "    {} [label=\"{}\", fillcolor=\"{}\", fontcolor=white];",
                        node(at),
                        esc(&op_name(op)),
                        fill(OpKind::of(op))
                    );
                }
                _ => {
                    let _ = writeln!(
                        out,
                        "    {} [label=\"{}\\nbatch {}\", shape=box, style=\"rounded,dashed\"];",
                        node(at),
                        esc(&comm_name(ins)),
                        ins.batch().unwrap_or(0)
                    );
                }
            }
        }
        for i in 1..instrs.len() {
            let _ = writeln!(out, "    r{r}_{} -> r{r}_{i} [color=\"#999999\"];", i - 1);
        }
        out.push_str("  }\n");
    }
    // A program too large to number has no views anyway (it would not fit in memory).
    let m = Matching::of(program);
    for (s, r) in m.iter().flat_map(|m| m.messages(program)) {
        let _ = writeln!(
            out,
            "  {} -> {} [style=dashed, color=\"#e15759\", constraint=false];",
            node(s),
            node(r)
        );
    }
    // Local data dependencies, in program order of the consumer.
    let last = program.num_stages().saturating_sub(1);
    for (r, instrs) in program.ranks.iter().enumerate() {
        for (i, ins) in instrs.iter().enumerate() {
            let Some(op) = &ins.as_compute() else {
                continue;
            };
            let at = InstrRef {
                rank: Rank(r as u32),
                index: i as u32,
            };
            let mut deps: Vec<(Pass, Task)> = Vec::new();
            for (p, t) in op.parts() {
                let s = t.stage.0;
                let prev = |st: u32| Task {
                    stage: StageId(st),
                    mb: t.mb,
                };
                match p {
                    Pass::Fwd if s > 0 => deps.push((Pass::Fwd, prev(s - 1))),
                    Pass::Bwd | Pass::BwdD => {
                        deps.push((Pass::Fwd, t));
                        if s < last {
                            deps.push((Pass::Bwd, prev(s + 1)));
                            deps.push((Pass::BwdD, prev(s + 1)));
                        }
                    }
                    Pass::BwdW => deps.push((Pass::BwdD, t)),
                    _ => {}
                }
            }
            for d in deps {
                if let Some(&from) = at_of.get(&d) {
                    if from.rank == at.rank && from != at {
                        let _ = writeln!(
                            out,
                            "  {} -> {} [style=dotted, color=\"#4e79a7\", constraint=false];",
                            node(from),
                            node(at)
                        );
                    }
                }
            }
        }
    }
}

fn by_stage(program: &Program, out: &mut String) {
    let n = program.num_stages();
    // Per stage: compute op counts by kind; per (from stage, to stage, kind): message count.
    let mut ops: Vec<BTreeMap<char, u64>> = vec![BTreeMap::new(); n as usize];
    let mut msgs: BTreeMap<(u32, u32, &str), u64> = BTreeMap::new();
    for instrs in &program.ranks {
        for ins in instrs {
            match ins {
                Instr::Compute(_) | Instr::FwdCheckpoint(_) => {
                    let op = ins.as_compute().expect("a compute op");
                    for (p, t) in op.parts() {
                        if let Some(m) = ops.get_mut(t.stage.index()) {
                            let k = match p {
                                Pass::Fwd => 'F',
                                Pass::Bwd => 'B',
                                Pass::BwdD => 'I',
                                Pass::BwdW => 'W',
                            };
                            *m.entry(k).or_default() += 1;
                        }
                    }
                }
                Instr::Send { payload, .. } => {
                    if let Some(to) = payload.consumer() {
                        let k = payload.kind.name();
                        *msgs.entry((payload.stage.0, to.0, k)).or_default() += 1;
                    }
                }
                Instr::Recv { .. } | Instr::Wait { .. } | Instr::Memory(_) => {}
            }
        }
    }
    for r in 0..program.ranks.len() {
        let _ = writeln!(out, "  subgraph cluster_rank{r} {{");
        let _ = writeln!(
            out,
            "    label=\"rank {r}\"; style=rounded; color=\"#999999\";"
        );
        for s in program.placement.stages_of(Rank(r as u32)) {
            let counts: Vec<String> = ops[s.index()]
                .iter()
                .map(|(k, c)| format!("{k}×{c}"))
                .collect();
            let _ = writeln!(
                out,
                "    s{} [label=\"stage {}\\n{}\"];",
                s.0,
                s.0,
                counts.join(" ")
            );
        }
        out.push_str("  }\n");
    }
    for ((from, to, kind), c) in &msgs {
        let color = if *kind == "act" { "#4e79a7" } else { "#59a14f" };
        let _ = writeln!(
            out,
            "  s{from} -> s{to} [label=\"{kind} ×{c}\", color=\"{color}\"{}];",
            if *kind == "grad" {
                ", constraint=false"
            } else {
                ""
            }
        );
    }
    // Hand-offs between stages on one rank carry no message.
    for s in 1..n {
        let (a, b) = (
            program.placement.get(StageId(s - 1)),
            program.placement.get(StageId(s)),
        );
        if a.is_some() && a == b {
            let _ = writeln!(
                out,
                "  s{} -> s{s} [label=\"local\", style=dashed, color=\"#999999\"];",
                s - 1
            );
        }
    }
}

fn by_rank_mb(program: &Program, out: &mut String) {
    // Per (rank, mb): the compute parts in program order.
    let mut nodes: BTreeMap<(u32, u32), Vec<String>> = BTreeMap::new();
    let mut msgs: BTreeMap<(u32, u32, u32, &str), u64> = BTreeMap::new();
    let m = Matching::of(program);
    for (r, instrs) in program.ranks.iter().enumerate() {
        for ins in instrs {
            if let Some(op) = ins.as_compute() {
                for (p, t) in op.parts() {
                    let k = match p {
                        Pass::Fwd => 'F',
                        Pass::Bwd => 'B',
                        Pass::BwdD => 'I',
                        Pass::BwdW => 'W',
                    };
                    nodes
                        .entry((r as u32, t.mb.0))
                        .or_default()
                        .push(format!("{k}{}", t.stage.0));
                }
            }
        }
    }
    for (s, r) in m.iter().flat_map(|m| m.messages(program)) {
        if let Some(Instr::Send { payload, .. }) = program.get(s) {
            let k = payload.kind.name();
            *msgs
                .entry((s.rank.0, r.rank.0, payload.mb.0, k))
                .or_default() += 1;
        }
    }
    let mut current = None;
    for ((r, mb), parts) in &nodes {
        if current != Some(*r) {
            if current.is_some() {
                out.push_str("  }\n");
            }
            let _ = writeln!(out, "  subgraph cluster_rank{r} {{");
            let _ = writeln!(
                out,
                "    label=\"rank {r}\"; style=rounded; color=\"#999999\";"
            );
            current = Some(*r);
        }
        let _ = writeln!(
            out,
            "    r{r}_mb{mb} [label=\"mb {mb}\\n{}\"];",
            parts.join(" ")
        );
    }
    if current.is_some() {
        out.push_str("  }\n");
    }
    for ((from, to, mb, kind), c) in &msgs {
        let color = if *kind == "act" { "#4e79a7" } else { "#59a14f" };
        let _ = writeln!(
            out,
            "  r{from}_mb{mb} -> r{to}_mb{mb} [label=\"{kind} ×{c}\", color=\"{color}\"{}];",
            if *kind == "grad" {
                ", constraint=false"
            } else {
                ""
            }
        );
    }
}
