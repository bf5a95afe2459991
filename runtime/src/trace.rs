//! The measured timeline, and how copies overlapped compute in it.

use crate::interp::RankRun;
use pipec_cost::timeline::{TimeUnit, Timeline};
use pipec_ir::ir::Program;

/// One span per instruction per rank, in microseconds, from the runs of (rank, run); a rank
/// of the `world` with no run (another process's) has none.
pub fn timeline(world: usize, runs: &[(u32, RankRun)]) -> Timeline {
    let mut ranks = vec![Vec::new(); world];
    for (r, run) in runs {
        ranks[*r as usize] = run.spans.clone();
    }
    Timeline {
        unit: TimeUnit::Micros,
        ranks,
    }
}

/// How one rank's copies (`offload`, `reload`) overlapped its compute in a measured timeline
/// (microseconds): what the copy stream hid under compute and what it left exposed.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
pub struct CopyOverlap {
    pub rank: u32,
    pub offloads: u32,
    pub reloads: u32,
    /// Time the copy stream was busy: the union of the copy spans.
    pub copy_us: f64,
    /// The part of `copy_us` during which the compute stream ran a compute op (forward,
    /// backward, overlapped pair, checkpointed forward, recompute).
    pub hidden_us: f64,
    /// `copy_us - hidden_us`: copy time with no compute beside it.
    pub exposed_us: f64,
    /// Time the compute stream spent in `wait_offload`s (stalled on an offload).
    pub wait_offload_us: f64,
}

/// The [`CopyOverlap`] of every rank with copies and with one span per instruction.
pub fn copy_overlap(program: &Program, timeline: &Timeline) -> Vec<CopyOverlap> {
    use pipec_ir::ir::{Instr, MemKind};
    let mut out = Vec::new();
    for (r, (instrs, spans)) in program.ranks.iter().zip(&timeline.ranks).enumerate() {
        if spans.len() != instrs.len() {
            continue;
        }
        let mut o = CopyOverlap {
            rank: r as u32,
            ..CopyOverlap::default()
        };
        let (mut copy, mut compute) = (Vec::new(), Vec::new());
        for (ins, s) in instrs.iter().zip(spans) {
            let iv = (s.start, s.end.max(s.start));
            match ins {
                Instr::Memory(m) => match m.kind {
                    MemKind::Offload => {
                        o.offloads += 1;
                        copy.push(iv);
                    }
                    MemKind::Reload => {
                        o.reloads += 1;
                        copy.push(iv);
                    }
                    MemKind::WaitOffload => o.wait_offload_us += iv.1 - iv.0,
                    MemKind::Recompute => compute.push(iv),
                },
                Instr::Compute(_) | Instr::FwdCheckpoint(_) => compute.push(iv),
                Instr::Send { .. } | Instr::Recv { .. } | Instr::Wait { .. } => {}
            }
        }
        if copy.is_empty() {
            continue;
        }
        let (copy, compute) = (union(copy), union(compute));
        o.copy_us = copy.iter().map(|(a, b)| b - a).sum();
        o.hidden_us = intersection(&copy, &compute);
        o.exposed_us = (o.copy_us - o.hidden_us).max(0.0);
        out.push(o);
    }
    out
}

/// Disjoint sorted intervals covering the same points as `v`.
fn union(mut v: Vec<(f64, f64)>) -> Vec<(f64, f64)> {
    v.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut out: Vec<(f64, f64)> = Vec::with_capacity(v.len());
    for (a, b) in v {
        match out.last_mut() {
            Some(last) if a <= last.1 => last.1 = last.1.max(b),
            _ => out.push((a, b)),
        }
    }
    out
}

/// The length of the intersection of two disjoint sorted interval lists.
fn intersection(x: &[(f64, f64)], y: &[(f64, f64)]) -> f64 {
    let (mut i, mut j, mut len) = (0, 0, 0.0);
    while i < x.len() && j < y.len() {
        let (a, b) = (x[i].0.max(y[j].0), x[i].1.min(y[j].1));
        if b > a {
            len += b - a;
        }
        if x[i].1 < y[j].1 {
            i += 1;
        } else {
            j += 1;
        }
    }
    len
}

#[cfg(test)]
mod tests {
    use super::*;
    use pipec_cost::timeline::Span;
    use pipec_ir::ir::{Instr, MemKind, MemOp};
    use pipec_schedules::{Compute, Placement, Task};

    fn mem(kind: MemKind, t: Task) -> Instr {
        Instr::Memory(MemOp { kind, task: t })
    }

    /// One rank: fwd [0, 10), offload [10, 16) beside fwd [10, 14), wait_offload [14, 16),
    /// reload [16, 20) with nothing beside it, recompute [20, 25), bwd [25, 30): 10 µs of
    /// copies, 4 hidden, 6 exposed, 2 waited for.
    #[test]
    fn copy_overlap_of_a_hand_timeline() {
        let (a, b) = (Task::new(0, 0), Task::new(0, 1));
        let instrs = vec![
            Instr::Compute(Compute::Fwd(a)),
            mem(MemKind::Offload, a),
            Instr::FwdCheckpoint(b),
            mem(MemKind::WaitOffload, a),
            mem(MemKind::Reload, a),
            mem(MemKind::Recompute, b),
            Instr::Compute(Compute::Bwd(b)),
        ];
        let spans = [
            (0., 10.),
            (10., 16.),
            (10., 14.),
            (14., 16.),
            (16., 20.),
            (20., 25.),
            (25., 30.),
        ]
        .map(|(start, end)| Span { start, end })
        .to_vec();
        let p = Program {
            placement: Placement::looped(1, 1),
            microbatches: 2,
            forward_only: false,
            comm: None,
            ranks: vec![instrs],
            lengths: None,
            p2p_groups: Default::default(),
            buffer_slots: None,
        };
        let t = Timeline {
            unit: TimeUnit::Micros,
            ranks: vec![spans],
        };
        assert_eq!(
            copy_overlap(&p, &t),
            vec![CopyOverlap {
                rank: 0,
                offloads: 1,
                reloads: 1,
                copy_us: 10.0,
                hidden_us: 4.0,
                exposed_us: 6.0,
                wait_offload_us: 2.0,
            }]
        );
        // No copies, or spans that are not the program's: nothing to report.
        let t = Timeline {
            unit: TimeUnit::Micros,
            ranks: vec![t.ranks[0][..3].to_vec()],
        };
        assert!(copy_overlap(&p, &t).is_empty());
    }

    /// Union and intersection against counting unit cells on random integer intervals.
    #[test]
    fn interval_measures_match_counting_cells() {
        struct Rng(u64);
        impl Rng {
            fn below(&mut self, n: u64) -> u64 {
                self.0 ^= self.0 << 13;
                self.0 ^= self.0 >> 7;
                self.0 ^= self.0 << 17;
                self.0 % n
            }
            fn intervals(&mut self) -> Vec<(f64, f64)> {
                let k = 1 + self.below(6);
                (0..k)
                    .map(|_| {
                        let a = self.below(40);
                        (a as f64, (a + self.below(12)) as f64)
                    })
                    .collect()
            }
        }
        let mut rng = Rng(0x9e37_79b9);
        for _ in 0..500 {
            let (x, y) = (rng.intervals(), rng.intervals());
            let cover = |v: &[(f64, f64)], c: f64| v.iter().any(|&(a, b)| a <= c && c + 1.0 <= b);
            let cells = |f: &dyn Fn(f64) -> bool| (0..60).filter(|&c| f(c as f64)).count() as f64;
            let (ux, uy) = (union(x.clone()), union(y.clone()));
            let len = |v: &[(f64, f64)]| v.iter().map(|(a, b)| b - a).sum::<f64>();
            assert_eq!(len(&ux), cells(&|c| cover(&x, c)), "{x:?}");
            assert!(ux.windows(2).all(|w| w[0].1 < w[1].0), "{ux:?}");
            assert_eq!(
                intersection(&ux, &uy),
                cells(&|c| cover(&x, c) && cover(&y, c)),
                "{x:?} {y:?}"
            );
        }
    }
}
