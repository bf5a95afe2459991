//! Peak live activations per rank (DESIGN.md "Correctness rules" 5), in units of one
//! microbatch's activations on one stage, the unit the published formulas use (GPipe holds
//! `M`, 1F1B `p - r` on rank `r`: Narayanan et al., "Efficient Large-Scale Language Model
//! Training on GPU Clusters Using Megatron-LM", 2021).
//!
//! The activation of `(s, m)` is allocated by `fwd(s, m)` and freed by its `bwd`, or by
//! `bwd_W` when the backward is split (the weight gradient still needs the stashed input).
//! Within one instruction allocation comes before freeing, so the forward half of a `fwd_bwd`
//! pair counts while the backward half still holds its activation. In a forward-only program
//! nothing is stashed: an activation lives only during its forward.

use super::index::Index;
use super::report::{RankMemory, Violation};
use crate::ir::{Instr, InstrRef};
use pipec_schedules::{Pass, Rank};

pub(crate) fn check(
    ix: &Index<'_>,
    limit: Option<u64>,
    out: &mut Vec<Violation>,
) -> Vec<RankMemory> {
    // holder[task] = rank + 1 while the activation is live on that rank. Ranks are walked one
    // after another, so a value left by an earlier rank never equals the current one.
    let mut holder = if ix.dense {
        vec![0u32; ix.tasks]
    } else {
        Vec::new()
    };
    let forward_only = ix.p.forward_only;
    let mut result = Vec::with_capacity(ix.world as usize);
    for (r, instrs) in ix.p.ranks.iter().enumerate() {
        let tag = r as u32 + 1;
        let (mut live, mut peak) = (0u64, 0u64);
        let mut peak_at: Option<u32> = None;
        let mut over_at: Option<u32> = None;
        for (i, ins) in instrs.iter().enumerate() {
            let Instr::Compute(c) = ins else { continue };
            let mut frees = 0u64;
            for (pass, t) in c.parts() {
                let tracked = ix.dense && ix.in_range(t);
                match pass {
                    Pass::Fwd => {
                        live += 1;
                        if forward_only {
                            frees += 1;
                        } else if tracked {
                            holder[ix.task_index(t)] = tag;
                        }
                    }
                    Pass::Bwd | Pass::BwdW if !forward_only => {
                        if tracked {
                            let h = &mut holder[ix.task_index(t)];
                            if *h == tag {
                                *h = 0;
                                frees += 1;
                            }
                        } else if !ix.dense {
                            frees += 1;
                        }
                    }
                    _ => {}
                }
            }
            if live > peak {
                peak = live;
                peak_at = Some(i as u32);
            }
            if let Some(l) = limit {
                if live > l && over_at.is_none() {
                    over_at = Some(i as u32);
                }
            }
            live = live.saturating_sub(frees);
        }
        let rank = Rank(r as u32);
        let at = |index: u32| InstrRef { rank, index };
        // Over the limit means past a peak, so both are set.
        if let (Some(over_at), Some(peak_at)) = (over_at, peak_at) {
            let site = |i: u32| ix.site(ix.pos.base(r) + i);
            out.push(Violation::MemoryLimit {
                rank,
                limit: limit.unwrap_or(0),
                first_over: site(over_at),
                peak,
                peak_at: site(peak_at),
            });
        }
        result.push(RankMemory {
            rank,
            peak,
            at: peak_at.map(at),
        });
    }
    result
}

/// Peak memory per rank with each stage's activation weighted: `param[r]` plus the most
/// `act[stage]`-weighted activations live at once, under exactly the rules of [`check`]
/// (allocated by `fwd`, freed by `bwd` or `bwd_W` on the same rank, allocation before freeing
/// within an instruction, nothing stashed in a forward-only program). With every weight 1 and
/// no parameters it is the verifier's peak. `pipec tune` reports and limits this figure.
/// Stages or microbatches out of range count with weight 0.
pub fn weighted_peaks(program: &crate::ir::Program, act: &[f64], param: &[f64]) -> Vec<f64> {
    let m = program.microbatches as usize;
    let cells = act.len().saturating_mul(m);
    let mut holder = vec![0u32; cells];
    let forward_only = program.forward_only;
    let mut out = Vec::with_capacity(program.ranks.len());
    for (r, instrs) in program.ranks.iter().enumerate() {
        let tag = r as u32 + 1;
        let (mut live, mut peak) = (0.0f64, 0.0f64);
        for ins in instrs {
            let Instr::Compute(c) = ins else { continue };
            let mut frees = 0.0;
            for (pass, t) in c.parts() {
                let (s, mb) = (t.stage.index(), t.mb.index());
                if s >= act.len() || mb >= m {
                    continue;
                }
                let wgt = act[s];
                let cell = s * m + mb;
                match pass {
                    Pass::Fwd => {
                        live += wgt;
                        if forward_only {
                            frees += wgt;
                        } else {
                            holder[cell] = tag;
                        }
                    }
                    Pass::Bwd | Pass::BwdW if !forward_only && holder[cell] == tag => {
                        holder[cell] = 0;
                        frees += wgt;
                    }
                    _ => {}
                }
            }
            peak = peak.max(live);
            live -= frees;
        }
        out.push(peak + param.get(r).copied().unwrap_or(0.0));
    }
    out
}
