//! R1: peak live activations per rank (docs/design.md "Correctness rules" 5), counted by the one
//! rule of [`crate::ir::activations`], which the simulator and the runtime count by too.

use super::index::Index;
use super::report::{RankMemory, Violation};
use crate::ir::activations::{Activations, Peak};
use crate::ir::{InstrRef, Program};
use pipec_schedules::Rank;

pub(crate) fn check(
    ix: &Index<'_>,
    limit: Option<u64>,
    out: &mut Vec<Violation>,
) -> Vec<RankMemory> {
    let mut walk = Activations::new(ix.p);
    let mut result = Vec::with_capacity(ix.world as usize);
    for r in 0..ix.p.ranks.len() {
        let mut peak = Peak::default();
        let mut over_at: Option<u32> = None;
        for (i, live) in walk.live(r, |_| 1u64) {
            peak.see(i, live);
            if over_at.is_none() && limit.is_some_and(|l| live > l) {
                over_at = Some(i);
            }
        }
        let rank = Rank(r as u32);
        // Over the limit means past a peak, so both are set.
        if let (Some(over_at), Some(peak_at)) = (over_at, peak.at) {
            let site = |i: u32| ix.site(ix.pos.base(r) + i);
            out.push(Violation::MemoryLimit {
                rank,
                limit: limit.unwrap_or(0),
                first_over: site(over_at),
                peak: peak.peak,
                peak_at: site(peak_at),
            });
        }
        result.push(RankMemory {
            rank,
            peak: peak.peak,
            at: peak.at.map(|index| InstrRef { rank, index }),
        });
    }
    result
}

/// Peak memory per rank with each stage's activation weighted: `param[r]` plus the most
/// `act[stage]`-weighted activations live at once under the rule of
/// [`crate::ir::activations`]. With every weight 1 and no parameters it is the verifier's
/// peak. `pipec tune` reports and limits this figure. Stages or microbatches out of range
/// count with weight 0.
pub fn weighted_peaks(program: &Program, act: &[f64], param: &[f64]) -> Vec<f64> {
    let m = program.microbatches;
    let weight = |t: pipec_schedules::Task| match act.get(t.stage.index()) {
        Some(&w) if t.mb.0 < m => w,
        _ => 0.0,
    };
    let mut walk = Activations::new(program);
    (0..program.ranks.len())
        .map(|r| Peak::of(walk.live(r, weight)).peak + param.get(r).copied().unwrap_or(0.0))
        .collect()
}
