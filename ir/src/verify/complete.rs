//! Completeness (docs/design.md "Correctness rules" 1): every (stage, microbatch) has exactly one
//! forward and exactly one backward, either a full `bwd` or a `bwd_D` + `bwd_W` pair (the split
//! of "Zero Bubble Pipeline Parallelism", Qi et al., 2024), on the rank that owns it. A
//! forward-only program has no backward at all. Duplicates, wrong ranks, out-of-range ids and
//! backward passes in forward-only programs are found while indexing; this pass reports what
//! is missing or mixed.

use super::index::{slot, Index};
use super::violation::{Part, Violation};
use pipec_schedules::{Pass, Rank};

pub(crate) fn check(ix: &Index<'_>, out: &mut Vec<Violation>) {
    if !ix.dense {
        return;
    }
    let count = |p: Pass, ti: usize| ix.count[slot(p)][ti];
    let first = |p: Pass, ti: usize| ix.site(ix.first[slot(p)][ti]);
    for ti in 0..ix.tasks {
        let task = ix.task_of(ti);
        let Some(owner) = ix.owner(task) else {
            continue; // the placement is at fault, reported once per stage
        };
        let owner = Rank(owner);
        if count(Pass::Fwd, ti) == 0 {
            out.push(Violation::Missing {
                part: Part {
                    pass: Pass::Fwd,
                    task,
                },
                owner,
            });
        }
        if ix.p.forward_only {
            continue;
        }
        let (b, d, w) = (
            count(Pass::Bwd, ti),
            count(Pass::BwdD, ti),
            count(Pass::BwdW, ti),
        );
        if b > 0 && (d > 0 || w > 0) {
            let split = if d > 0 { Pass::BwdD } else { Pass::BwdW };
            out.push(Violation::MixedBackward {
                task,
                bwd: first(Pass::Bwd, ti),
                split: first(split, ti),
            });
        } else if b == 0 && d == 0 && w == 0 {
            out.push(Violation::Missing {
                part: Part {
                    pass: Pass::Bwd,
                    task,
                },
                owner,
            });
        } else if b == 0 && (d == 0) != (w == 0) {
            let pass = if d > 0 { Pass::BwdD } else { Pass::BwdW };
            out.push(Violation::UnpairedSplit {
                site: first(pass, ti),
                part: Part { pass, task },
            });
        }
    }
}
