//! R1: peak live activations per rank (docs/design.md "Correctness rules" 5), counted by the one
//! rule of [`crate::ir::activations`], which the simulator and the runtime count by too.

use super::index::Index;
use super::report::RankMemory;
use super::violation::Violation;
use crate::ir::{InstrRef, Program};
use crate::memory::MemoryModel;
use pipec_schedules::Rank;

pub(crate) fn check(
    ix: &Index<'_>,
    mem: &MemoryModel,
    limit: Option<f64>,
    out: &mut Vec<Violation>,
) -> Vec<RankMemory> {
    let mut result = Vec::with_capacity(ix.world as usize);
    for (p, over_at) in crate::memory::walk(ix.p, mem, limit) {
        let rank = Rank(p.rank);
        let r = p.rank as usize;
        if let Some(over_at) = over_at {
            let site = |i: u32| ix.site(ix.pos.base(r) + i);
            // Parameters alone over the limit: reported at the rank's first instruction.
            let peak_at = p.at.unwrap_or(over_at);
            if !ix.p.ranks[r].is_empty() {
                out.push(Violation::MemoryLimit {
                    rank,
                    limit: limit.unwrap_or(0.0),
                    first_over: site(over_at),
                    peak: p.peak,
                    peak_at: site(peak_at),
                    unit: mem.unit,
                });
            }
        }
        result.push(RankMemory {
            rank,
            peak: p.peak,
            params: p.params,
            at: p.at.map(|index| InstrRef { rank, index }),
            host: p.host,
            buffers: p.buffers,
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
    weighted_peaks_split(program, act, None, param)
}

/// [`weighted_peaks`] with the part of each stage's `act` kept from `bwd_D` to `bwd_W`
/// (`None`: all of it).
pub fn weighted_peaks_split(
    program: &Program,
    act: &[f64],
    act_w: Option<&[f64]>,
    param: &[f64],
) -> Vec<f64> {
    let mem = MemoryModel {
        act: act.to_vec(),
        param: param.to_vec(),
        unit: crate::memory::Unit::LayerActivations,
        mb_scale: None,
        msg: None,
        act_w: act_w.map(<[f64]>::to_vec),
    };
    crate::memory::peaks(program, &mem)
        .iter()
        .map(|p| p.peak)
        .collect()
}
