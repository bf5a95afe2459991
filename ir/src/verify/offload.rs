//! The memory instructions' rules (issue 30; docs/format.md, "Memory instructions"): per rank,
//! in program order, what `offload`, `reload`, `wait_offload`, `recompute` and a checkpointed
//! `fwd` may do to the activations of one forward. Their memory is counted with every other
//! activation by the one rule of [`crate::ir::activations`] (R1).
//!
//! Why the copy stream adds no deadlock (D1, D2 stand as they are): a copy waits only for
//! what comes before it in its own rank's program order (the forward it copies, and the copies
//! posted before it on the rank's one copy stream), and the compute stream waits for a copy
//! only when that copy is earlier in program order (a backward for its reload, which O3 below
//! requires before it, a `wait_offload` for its offload, O4). So every wait the copies add
//! points backwards within one rank: none is an edge between ranks, and none can close a cycle
//! with the rank's own order. A rank whose compute stream reaches a copy wait finds the copy
//! posted, and the copy can finish without any other rank moving.

use super::index::Index;
use super::violation::{Field, Part, Violation};
use crate::ir::{Instr, MemKind};
use pipec_schedules::{Pass, Task};
use std::collections::HashMap;

/// What one rank has done so far to one (stage, microbatch), as positions in its stream.
#[derive(Copy, Clone, Default)]
struct Seen {
    /// The forward, and whether it was checkpointed.
    fwd: Option<(u32, bool)>,
    offload: Option<u32>,
    reload: Option<u32>,
    recompute: Option<u32>,
    /// The backward that needs the activations (`bwd` or `bwd_D`).
    backward: Option<u32>,
}

pub(crate) fn check(ix: &Index<'_>, out: &mut Vec<Violation>) {
    if ix.memory_ops == 0 {
        return;
    }
    for r in 0..ix.world as usize {
        rank(ix, r, out);
    }
}

fn rank(ix: &Index<'_>, r: usize, out: &mut Vec<Violation>) {
    let base = ix.pos.base(r);
    let instrs = &ix.p.ranks[r];
    let site = |i: u32| ix.site(base + i);
    let mut seen: HashMap<Task, Seen> = HashMap::new();
    for (i, ins) in instrs.iter().enumerate() {
        let i = i as u32;
        match *ins {
            Instr::Compute(c) => {
                for (pass, t) in c.parts() {
                    match pass {
                        Pass::Fwd => {
                            seen.entry(t).or_default().fwd.get_or_insert((i, false));
                        }
                        Pass::Bwd | Pass::BwdD => {
                            let s = seen.entry(t).or_default();
                            let part = Part { pass, task: t };
                            if let (Some(off), None) = (s.offload, s.reload) {
                                out.push(Violation::BackwardWhileOffloaded {
                                    site: site(i),
                                    part,
                                    offload: site(off),
                                });
                            }
                            if let (Some((f, true)), None) = (s.fwd, s.recompute) {
                                out.push(Violation::BackwardWithoutRecompute {
                                    site: site(i),
                                    part,
                                    fwd: site(f),
                                });
                            }
                            s.backward.get_or_insert(i);
                        }
                        Pass::BwdW => {}
                    }
                }
            }
            Instr::FwdCheckpoint(t) => {
                seen.entry(t).or_default().fwd.get_or_insert((i, true));
            }
            Instr::Memory(op) => {
                let t = op.task;
                // S2 for memory instructions (the index range-checks the rest).
                let range = [
                    (Field::Stage, t.stage.0, ix.stages),
                    (Field::Microbatch, t.mb.0, ix.mbs),
                ];
                if let Some(&(field, value, bound)) = range.iter().find(|(_, v, b)| v >= b) {
                    out.push(Violation::OutOfRange {
                        site: site(i),
                        field,
                        value,
                        bound,
                    });
                    continue;
                }
                let s = seen.entry(t).or_default();
                let at = site(i);
                let twice = |first: Option<u32>| {
                    first.map(|f| Violation::MemoryOpTwice {
                        site: at,
                        first: site(f),
                    })
                };
                let after_backward = s.backward.map(|b| Violation::MemoryOpAfterBackward {
                    site: at,
                    backward: site(b),
                });
                match op.kind {
                    MemKind::Offload => {
                        // An offload of nothing is reported once, not again at the backward.
                        match s.fwd {
                            None => out.push(Violation::OffloadWithoutForward { site: at }),
                            Some((f, true)) => out.push(Violation::OffloadOfCheckpointed {
                                site: at,
                                fwd: site(f),
                            }),
                            Some((_, false)) => {
                                out.extend(twice(s.offload));
                                out.extend(after_backward);
                                s.offload.get_or_insert(i);
                            }
                        }
                    }
                    MemKind::Reload => {
                        if s.offload.is_none() {
                            out.push(Violation::ReloadWithoutOffload { site: at });
                        }
                        out.extend(twice(s.reload));
                        out.extend(after_backward);
                        s.reload.get_or_insert(i);
                    }
                    MemKind::WaitOffload => {
                        if s.offload.is_none() {
                            out.push(Violation::WaitOffloadWithoutOffload { site: at });
                        }
                    }
                    MemKind::Recompute => {
                        if !matches!(s.fwd, Some((_, true))) {
                            out.push(Violation::RecomputeWithoutCheckpoint { site: at });
                        }
                        out.extend(twice(s.recompute));
                        out.extend(after_backward);
                        s.recompute.get_or_insert(i);
                    }
                }
            }
            Instr::Send { .. } | Instr::Recv { .. } | Instr::Wait { .. } => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::ir::{Instr, InstrRef, MemKind, MemOp, Program};
    use crate::memory::{self, MemoryModel};
    use crate::verify::{verify, Class, VerifyOptions, Violation};
    use pipec_schedules::{Compute, Placement, Rank, Task};

    fn f(s: u32, m: u32) -> Instr {
        Instr::Compute(Compute::Fwd(Task::new(s, m)))
    }
    fn b(s: u32, m: u32) -> Instr {
        Instr::Compute(Compute::Bwd(Task::new(s, m)))
    }
    fn ck(s: u32, m: u32) -> Instr {
        Instr::FwdCheckpoint(Task::new(s, m))
    }
    fn mem(kind: MemKind, s: u32, m: u32) -> Instr {
        Instr::Memory(MemOp {
            kind,
            task: Task::new(s, m),
        })
    }
    fn off(s: u32, m: u32) -> Instr {
        mem(MemKind::Offload, s, m)
    }
    fn rel(s: u32, m: u32) -> Instr {
        mem(MemKind::Reload, s, m)
    }
    fn wait(s: u32, m: u32) -> Instr {
        mem(MemKind::WaitOffload, s, m)
    }
    fn rec(s: u32, m: u32) -> Instr {
        mem(MemKind::Recompute, s, m)
    }

    /// One rank holding two stages (no messages needed), one microbatch.
    fn one_rank(instrs: Vec<Instr>) -> Program {
        Program {
            placement: Placement::looped(1, 2),
            microbatches: 1,
            forward_only: false,
            comm: None,
            ranks: vec![instrs],
            lengths: None,
            p2p_groups: Default::default(),
            buffer_slots: None,
        }
    }

    fn violations(instrs: Vec<Instr>) -> Vec<Violation> {
        verify(&one_rank(instrs), &VerifyOptions::default()).violations
    }

    /// Each rule, broken once in an otherwise valid program: exactly that violation, at the
    /// instruction that breaks it, named `rank 0, #i` in its message.
    #[test]
    fn every_rule_names_its_rank_and_instruction() {
        type Check = fn(&Violation) -> bool;
        let cases: Vec<(Vec<Instr>, u32, Check)> = vec![
            (
                vec![off(0, 0), f(0, 0), f(1, 0), b(1, 0), b(0, 0)],
                0,
                |v| matches!(v, Violation::OffloadWithoutForward { .. }),
            ),
            (
                vec![ck(0, 0), off(0, 0), f(1, 0), b(1, 0), rec(0, 0), b(0, 0)],
                1,
                |v| matches!(v, Violation::OffloadOfCheckpointed { .. }),
            ),
            (
                vec![f(0, 0), rel(0, 0), f(1, 0), b(1, 0), b(0, 0)],
                1,
                |v| matches!(v, Violation::ReloadWithoutOffload { .. }),
            ),
            (
                vec![f(0, 0), wait(0, 0), f(1, 0), b(1, 0), b(0, 0)],
                1,
                |v| matches!(v, Violation::WaitOffloadWithoutOffload { .. }),
            ),
            (
                vec![f(0, 0), f(1, 0), rec(0, 0), b(1, 0), b(0, 0)],
                2,
                |v| matches!(v, Violation::RecomputeWithoutCheckpoint { .. }),
            ),
            (
                vec![
                    f(0, 0),
                    off(0, 0),
                    off(0, 0),
                    f(1, 0),
                    rel(0, 0),
                    b(1, 0),
                    b(0, 0),
                ],
                2,
                |v| matches!(v, Violation::MemoryOpTwice { .. }),
            ),
            (
                vec![ck(0, 0), f(1, 0), rec(0, 0), b(1, 0), rec(0, 0), b(0, 0)],
                4,
                |v| matches!(v, Violation::MemoryOpTwice { .. }),
            ),
            (
                vec![
                    f(0, 0),
                    f(1, 0),
                    off(1, 0),
                    rel(1, 0),
                    rel(1, 0),
                    b(1, 0),
                    b(0, 0),
                ],
                4,
                |v| matches!(v, Violation::MemoryOpTwice { .. }),
            ),
            (
                vec![f(0, 0), f(1, 0), b(1, 0), b(0, 0), off(0, 0)],
                4,
                |v| matches!(v, Violation::MemoryOpAfterBackward { .. }),
            ),
            (
                vec![f(0, 0), off(0, 0), f(1, 0), b(1, 0), b(0, 0)],
                4,
                |v| matches!(v, Violation::BackwardWhileOffloaded { .. }),
            ),
            (vec![ck(0, 0), f(1, 0), b(1, 0), b(0, 0)], 3, |v| {
                matches!(v, Violation::BackwardWithoutRecompute { .. })
            }),
            (
                vec![f(0, 0), f(1, 0), off(7, 0), b(1, 0), b(0, 0)],
                2,
                |v| matches!(v, Violation::OutOfRange { .. }),
            ),
        ];
        for (instrs, at, want) in cases {
            let shown: Vec<String> = instrs.iter().map(|i| i.to_string()).collect();
            let found = violations(instrs);
            assert_eq!(found.len(), 1, "{shown:?}: {found:?}");
            let v = &found[0];
            assert!(want(v), "{shown:?}: {v:?}");
            assert_eq!(
                v.at(),
                Some(InstrRef {
                    rank: Rank(0),
                    index: at
                })
            );
            assert!(v.to_string().contains(&format!("rank 0, #{at}")), "{v}");
            let class = v.class();
            assert!(
                class == Class::Memory || class == Class::Malformed,
                "{v}: {class}"
            );
        }
        // The same programs, each rule kept: no violation.
        for ok in [
            vec![f(0, 0), off(0, 0), f(1, 0), rel(0, 0), b(1, 0), b(0, 0)],
            vec![
                f(0, 0),
                off(0, 0),
                wait(0, 0),
                f(1, 0),
                b(1, 0),
                rel(0, 0),
                b(0, 0),
            ],
            vec![ck(0, 0), f(1, 0), b(1, 0), rec(0, 0), b(0, 0)],
        ] {
            assert_eq!(violations(ok.clone()), vec![], "{ok:?}");
        }
    }

    /// The count by hand, in program order: in-flight copies hold their memory, an offload
    /// frees the device only where it is known to have ended, a reload allocates when posted.
    #[test]
    fn device_and_host_by_hand() {
        // act(0) = 2, act(1) = 3.
        let mm = MemoryModel {
            act: vec![2.0, 3.0],
            param: vec![0.0],
            unit: memory::Unit::LayerActivations,
            mb_scale: None,
            msg: None,
            act_w: None,
        };
        let p = one_rank(vec![
            f(0, 0),    // 2
            off(0, 0),  // 2, host 2 (in flight: device still 2)
            f(1, 0),    // 5
            wait(0, 0), // 5, then device 3
            rel(0, 0),  // 3 + 2 = 5, host 2 until the backward syncs it
            b(1, 0),    // 5, frees 3 after
            b(0, 0),    // 2, frees 2 after; host freed after the backward that waited
        ]);
        let walk = memory::walk(&p, &mm, Some(4.0));
        let (peak, over) = walk[0];
        assert_eq!(peak.activations, 5.0);
        assert_eq!(peak.at, Some(2));
        assert_eq!(peak.host, 2.0);
        assert_eq!(over, Some(2));
        // Without the wait, the offload is known to have ended only at the backward that
        // waits for the reload posted after it: the device holds 7 at the reload.
        let p = one_rank(vec![
            f(0, 0),
            off(0, 0),
            f(1, 0),
            rel(0, 0),
            b(1, 0),
            b(0, 0),
        ]);
        let (peak, _) = memory::walk(&p, &mm, None)[0];
        assert_eq!((peak.activations, peak.at, peak.host), (7.0, Some(3), 2.0));
        // A checkpointed forward is live while it runs only; its recompute holds it again.
        let p = one_rank(vec![ck(0, 0), f(1, 0), b(1, 0), rec(0, 0), b(0, 0)]);
        let (peak, _) = memory::walk(&p, &mm, None)[0];
        assert_eq!((peak.activations, peak.at, peak.host), (3.0, Some(1), 0.0));
        // The verifier counts the same in its default unit (every stage 1).
        let report = verify(&p, &VerifyOptions::default());
        assert_eq!(report.memory[0].peak, 1.0);
    }
}
