//! Views of a program and a [`Timeline`](pipec_cost::timeline::Timeline): the terminal timeline,
//! Chrome/Perfetto traces, SVG pictures and Graphviz graphs. Every renderer takes the program
//! and a timeline, simulated or measured, so the runtime's measurements render the same way.
//! Renderers are pure (text in memory, deterministic); the CLI writes the files.

pub mod chrome;
pub mod dot;
pub mod report;
pub mod svg;
pub mod timeline_text;

use pipec_ir::ir::{Instr, Program};
use pipec_schedules::{Compute, Pass};

/// Which part of a timeline a trace or picture shows: some ranks, a time window (in the
/// timeline's unit, from its origin), with or without communication. The default is all of it.
/// Large schedules need this: a whole trace at pp=64, M=1024 is too big for any viewer.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Filter {
    /// Ranks to keep, in order; all when `None`.
    pub ranks: Option<Vec<usize>>,
    /// Keep spans that end at or after this time.
    pub from: Option<f64>,
    /// Keep spans that start at or before this time.
    pub to: Option<f64>,
    /// Drop sends, receives, waits and message arrows.
    pub compute_only: bool,
}

impl Filter {
    /// The ranks kept, in drawing order, of a world of `world` ranks.
    pub fn rows(&self, world: usize) -> Vec<usize> {
        match &self.ranks {
            Some(r) => r.iter().copied().filter(|&r| r < world).collect(),
            None => (0..world).collect(),
        }
    }

    /// Whether a span, given relative to the origin, meets the window.
    pub fn keeps(&self, start: f64, end: f64) -> bool {
        self.from.is_none_or(|f| end >= f) && self.to.is_none_or(|t| start <= t)
    }

    /// Whether this filter keeps everything.
    pub fn is_all(&self) -> bool {
        *self == Filter::default()
    }
}

/// What a compute op looks like in every view: its kind, letter and label.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum OpKind {
    /// Forward: `F`.
    Fwd,
    /// Full backward: `B`.
    Bwd,
    /// Input-gradient backward (`bwd_D`, torch `I`): `I`.
    BwdD,
    /// Weight-gradient backward (`bwd_W`, torch `W`): `W`.
    BwdW,
    /// Overlapped forward + backward pair: `X`.
    Pair,
}

impl OpKind {
    pub const ALL: [OpKind; 5] = [
        OpKind::Fwd,
        OpKind::Bwd,
        OpKind::BwdD,
        OpKind::BwdW,
        OpKind::Pair,
    ];

    pub fn of(op: &Compute) -> Self {
        match op {
            Compute::Fwd(_) => OpKind::Fwd,
            Compute::Bwd(_) => OpKind::Bwd,
            Compute::BwdD(_) => OpKind::BwdD,
            Compute::BwdW(_) => OpKind::BwdW,
            Compute::FwdBwd { .. } => OpKind::Pair,
        }
    }

    pub fn letter(self) -> char {
        match self {
            OpKind::Fwd => 'F',
            OpKind::Bwd => 'B',
            OpKind::BwdD => 'I',
            OpKind::BwdW => 'W',
            OpKind::Pair => 'X',
        }
    }

    /// The word the legends use.
    pub fn word(self) -> &'static str {
        match self {
            OpKind::Fwd => "forward",
            OpKind::Bwd => "backward",
            OpKind::BwdD => "backward (input, bwd_D)",
            OpKind::BwdW => "backward (weight, bwd_W)",
            OpKind::Pair => "overlapped forward + backward",
        }
    }
}

/// The short label views print inside an op: the letter and the microbatch (`F5`), or for a
/// pair the forward and backward microbatches (`X5/2`).
pub fn op_label(op: &Compute) -> String {
    let k = OpKind::of(op).letter();
    match op {
        Compute::FwdBwd { fwd, bwd } => format!("{k}{}/{}", fwd.mb.0, bwd.mb.0),
        _ => {
            let (_, t) = op.parts().next().expect("one part");
            format!("{k}{}", t.mb.0)
        }
    }
}

/// A longer name for tooltips and traces: `F s3 mb5`, `X s3 mb5 + B s6 mb2`.
pub fn op_name(op: &Compute) -> String {
    match op {
        Compute::FwdBwd { fwd, bwd } => format!(
            "X s{} mb{} + B s{} mb{}",
            fwd.stage.0, fwd.mb.0, bwd.stage.0, bwd.mb.0
        ),
        _ => {
            let (p, t) = op.parts().next().expect("one part");
            let k = match p {
                Pass::Fwd => 'F',
                Pass::Bwd => 'B',
                Pass::BwdD => 'I',
                Pass::BwdW => 'W',
            };
            format!("{k} s{} mb{}", t.stage.0, t.mb.0)
        }
    }
}

/// The compute work an instruction draws on its rank's compute row: a compute op, a
/// checkpointed forward as its forward, and a `recompute` as the forward it repeats.
pub fn drawn_compute(ins: &Instr) -> Option<Compute> {
    match ins {
        Instr::Memory(m) if m.kind == pipec_ir::ir::MemKind::Recompute => {
            Some(Compute::Fwd(m.task))
        }
        _ => ins.as_compute(),
    }
}

/// The copies of a rank (offloads, reloads) with their spans, for the copy-stream row.
pub fn copies<'a>(
    instrs: &'a [Instr],
    spans: &'a [pipec_cost::timeline::Span],
) -> impl Iterator<Item = (usize, pipec_ir::ir::MemOp, pipec_cost::timeline::Span)> + 'a {
    instrs
        .iter()
        .zip(spans)
        .enumerate()
        .filter_map(|(i, (ins, sp))| match ins {
            Instr::Memory(m) if m.kind.is_copy() && sp.start.is_finite() && sp.end.is_finite() => {
                Some((i, *m, *sp))
            }
            _ => None,
        })
}

/// A message's name: `send act s3 mb5 -> r1`.
pub fn comm_name(i: &Instr) -> String {
    let (dir, arrow, peer, p) = match i {
        Instr::Send { peer, payload, .. } => ("send", "->", peer, payload),
        Instr::Recv { peer, payload, .. } => ("recv", "<-", peer, payload),
        Instr::Compute(c) => return op_name(c),
        Instr::FwdCheckpoint(t) => return op_name(&Compute::Fwd(*t)) + " (checkpoint)",
        Instr::Memory(m) => {
            return format!("{} s{} mb{}", m.kind.op(), m.task.stage.0, m.task.mb.0)
        }
        Instr::Wait { batch } => return format!("wait batch {batch}"),
    };
    let kind = p.kind.name();
    format!(
        "{dir} {kind} s{} mb{} {arrow} r{}",
        p.stage.0, p.mb.0, peer.0
    )
}

/// For each stage, its chunk: its position among the stages of its rank (Megatron's vpp
/// rank for looped placements). Views shade odd chunks so interleaving is visible.
pub fn chunks(program: &Program) -> Vec<u32> {
    let mut seen = vec![0u32; program.ranks.len().max(program.placement.pp as usize)];
    program
        .placement
        .table()
        .iter()
        .map(|r| match seen.get_mut(r.index()) {
            Some(c) => {
                *c += 1;
                *c - 1
            }
            None => 0,
        })
        .collect()
}

/// The chunk of the stage an op works on (the forward's, for a pair).
pub fn chunk_of(op: &Compute, chunks: &[u32]) -> u32 {
    let (_, t) = op.parts().next().expect("one part");
    chunks.get(t.stage.index()).copied().unwrap_or(0)
}

/// A round step for axis ticks: the smallest of 1, 2, 5 x 10^k at least `min`.
pub fn nice_step(min: f64) -> f64 {
    if min.is_nan() || min <= 0.0 || !min.is_finite() {
        return 1.0;
    }
    let mut p = 10f64.powi(min.log10().floor() as i32);
    loop {
        for m in [1.0, 2.0, 5.0] {
            if m * p >= min * (1.0 - 1e-9) {
                return m * p;
            }
        }
        p *= 10.0;
    }
}

/// A number for a label: integers without a decimal point, others with up to 2 decimals.
pub fn fmt_num(x: f64) -> String {
    let s = format!("{x:.2}");
    let s = s.trim_end_matches('0').trim_end_matches('.');
    if s == "-0" {
        "0".to_string()
    } else {
        s.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pipec_schedules::{Placement, Task};

    #[test]
    fn labels_and_steps() {
        assert_eq!(op_label(&Compute::Fwd(Task::new(3, 5))), "F5");
        assert_eq!(
            op_label(&Compute::FwdBwd {
                fwd: Task::new(1, 5),
                bwd: Task::new(2, 2)
            }),
            "X5/2"
        );
        assert_eq!(op_name(&Compute::BwdW(Task::new(3, 5))), "W s3 mb5");
        assert_eq!(nice_step(3.2), 5.0);
        assert_eq!(nice_step(0.3), 0.5);
        assert_eq!(nice_step(10.0), 10.0);
        assert_eq!(fmt_num(2.50), "2.5");
        assert_eq!(fmt_num(3.0), "3");
    }

    #[test]
    fn chunk_table() {
        let p = Program {
            placement: Placement::looped(2, 3),
            microbatches: 1,
            forward_only: false,
            comm: None,
            ranks: vec![vec![], vec![]],
            lengths: None,
            p2p_groups: Default::default(),
            buffer_slots: None,
        };
        assert_eq!(chunks(&p), vec![0, 0, 1, 1, 2, 2]);
        let p = Program {
            placement: Placement::v_shape(2),
            ..p
        };
        assert_eq!(chunks(&p), vec![0, 0, 1, 1]);
    }
}
