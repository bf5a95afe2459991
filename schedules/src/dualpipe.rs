//! DualPipe and DualPipeV (DeepSeek-V3 technical report, 2024; deepseek-ai/DualPipe
//! `dualpipe.py` and `dualpipev.py`; torch `ScheduleDualPipeV`).
//!
//! Both run the same eight steps on every rank, with two "phases" per rank:
//! phase 0 is the pipeline in which the rank is early, phase 1 the one in which it is late.
//!
//! - DualPipe (`pp` even): microbatches `0..M/2` enter at rank 0 (stage `s` on rank `s`),
//!   microbatches `M/2..M` enter at rank `pp-1` (stage `s` on rank `pp-1-s`,
//!   `Placement::bidirectional`). On the first half of the ranks phase 0 is the first
//!   direction; on the second half it is the reverse one (`phase ^= is_in_second_half`). The
//!   step counts use the half rank `min(r, pp-1-r)` and `pp/2` ranks per half.
//! - DualPipeV: the second direction folded back onto the same ranks, i.e. the V placement
//!   with `2pp` stages (phase 0 = stage `r`, phase 1 = stage `2pp-1-r`), `pp` ranks and `M`
//!   microbatches in the step counts.
//!
//! Steps (names from `dualpipe.py`): 1 `nF0`, 2 `nF0F1`, 3 `nB1W1F1` (split backward),
//! 4 `nF0B1F1B0` (overlapped pairs; the middle rank's first pair is not overlapped),
//! 5 `nB1F1B0`, 6 `nB1B0` (the second half of its backwards split), 7 `nWB0`, 8 `nW`.
//! Split backwards queue their `W`; `W` steps run the oldest queued one.

use crate::op::{Compute, Task};
use crate::order::rank_orders;
use crate::order::RankOrder;
use crate::placement::Placement;
use crate::spec::{ScheduleSpec, SpecError};
use std::collections::VecDeque;

/// Builds one rank's ops from the step program, given how a (phase, index) becomes a task.
struct Rank8<F: Fn(usize, u32) -> Task> {
    task: F,
    next_f: [u32; 2],
    next_b: [u32; 2],
    pending_w: VecDeque<Task>,
    ops: Vec<Compute>,
}

impl<F: Fn(usize, u32) -> Task> Rank8<F> {
    fn f_task(&mut self, phase: usize) -> Task {
        let t = (self.task)(phase, self.next_f[phase]);
        self.next_f[phase] += 1;
        t
    }

    fn b_task(&mut self, phase: usize) -> Task {
        let t = (self.task)(phase, self.next_b[phase]);
        self.next_b[phase] += 1;
        t
    }

    fn forward(&mut self, phase: usize) {
        let t = self.f_task(phase);
        self.ops.push(Compute::Fwd(t));
    }

    /// `_backward_chunk(phase, enable_zb)`: split when zero bubble is enabled.
    fn backward(&mut self, phase: usize, zb: bool) {
        let t = self.b_task(phase);
        if zb {
            self.ops.push(Compute::BwdD(t));
            self.pending_w.push_back(t);
        } else {
            self.ops.push(Compute::Bwd(t));
        }
    }

    /// `_forward_backward_chunk(phase0, phase1)`: one overlapped op, full backward.
    fn forward_backward(&mut self, f_phase: usize, b_phase: usize) {
        let fwd = self.f_task(f_phase);
        let bwd = self.b_task(b_phase);
        self.ops.push(Compute::FwdBwd { fwd, bwd });
    }

    /// `_weight_chunk`: the oldest pending `W` (torch: skipped when none is pending).
    fn weight(&mut self) {
        if let Some(t) = self.pending_w.pop_front() {
            self.ops.push(Compute::BwdW(t));
        }
    }
}

/// The eight steps for one rank: `half_ranks` ranks per half pipeline, this rank's `half_rank`,
/// `chunks` microbatches per direction.
fn steps<F: Fn(usize, u32) -> Task>(
    half_ranks: u32,
    half_rank: u32,
    chunks: u32,
    task: F,
) -> Vec<Compute> {
    let (n, h) = (half_ranks, half_rank);
    let mut k = Rank8 {
        task,
        next_f: [0; 2],
        next_b: [0; 2],
        pending_w: VecDeque::new(),
        ops: Vec::with_capacity(6 * chunks as usize),
    };
    let middle = h == n - 1;
    for _ in 0..(n - h - 1) * 2 {
        k.forward(0);
    }
    for _ in 0..h + 1 {
        k.forward(0);
        k.forward(1);
    }
    for _ in 0..n - h - 1 {
        k.backward(1, true);
        k.weight();
        k.forward(1);
    }
    // chunks >= 2 * half_ranks is validated, so this is at least h + 1.
    let step4 = (chunks + h + 1).saturating_sub(2 * n);
    for i in 0..step4 {
        if i == 0 && middle {
            // "We don't overlap these two chunks to further reduce bubble size."
            k.forward(0);
            k.backward(1, false);
        } else {
            k.forward_backward(0, 1);
        }
        k.forward_backward(1, 0);
    }
    for _ in 0..n - h - 1 {
        k.backward(1, false);
        k.forward_backward(1, 0);
    }
    let step6 = h + 1;
    let mut zb = false;
    for i in 0..step6 {
        if i == step6 / 2 && h % 2 == 1 {
            zb = true;
        }
        k.backward(1, zb);
        if i == step6 / 2 && h % 2 == 0 {
            zb = true;
        }
        k.backward(0, zb);
    }
    for _ in 0..n - h - 1 {
        k.weight();
        k.backward(0, true);
    }
    for _ in 0..h + 1 {
        k.weight();
    }
    debug_assert!(k.pending_w.is_empty());
    k.ops
}

/// DualPipe's placement: the first half of the microbatches enter at rank 0, the second at
/// rank `pp - 1`.
pub(crate) fn placement(spec: &ScheduleSpec) -> Placement {
    Placement::bidirectional(spec.pp, spec.microbatches / 2)
}

/// DualPipe's rules: even pp and M, and `M >= 2 pp`.
pub(crate) fn dualpipe_rules(spec: &ScheduleSpec) -> Result<(), SpecError> {
    let (pp, m) = (spec.pp, spec.microbatches);
    if pp % 2 != 0 {
        return Err(SpecError::OddPp {
            kind: spec.kind,
            pp,
        });
    }
    if m % 2 != 0 {
        return Err(SpecError::OddMicrobatches { kind: spec.kind, m });
    }
    if (m as u64) < 2 * pp as u64 {
        return Err(SpecError::TooFewMicrobatches {
            kind: spec.kind,
            m,
            min: pp.saturating_mul(2),
            source_rule: "DualPipe.step asserts num_chunks >= num_ranks * 2",
        });
    }
    Ok(())
}

/// DualPipeV's rule: `M >= 2 pp` (odd M allowed).
pub(crate) fn dualpipe_v_rules(spec: &ScheduleSpec) -> Result<(), SpecError> {
    let (pp, m) = (spec.pp, spec.microbatches);
    if (m as u64) < 2 * pp as u64 {
        return Err(SpecError::TooFewMicrobatches {
            kind: spec.kind,
            m,
            min: pp.saturating_mul(2),
            source_rule: "DualPipeV.step asserts num_chunks >= num_ranks * 2; torch ScheduleDualPipeV needs microbatches >= stages",
        });
    }
    Ok(())
}

/// DualPipe on `pp` (even) ranks and `M` (even) microbatches.
pub(crate) fn dualpipe(spec: &ScheduleSpec) -> Vec<RankOrder> {
    let (pp, m) = (spec.pp, spec.microbatches);
    let half = m / 2;
    let per_rank = (0..pp).map(|r| {
        let second_half = (r >= pp / 2) as usize;
        let task = |phase: usize, k: u32| {
            let direction = phase ^ second_half;
            if direction == 0 {
                Task::new(r, k)
            } else {
                Task::new(pp - 1 - r, half + k)
            }
        };
        steps(pp / 2, r.min(pp - 1 - r), half, task)
    });
    rank_orders(spec, per_rank)
}

/// DualPipeV on `pp` ranks (V placement, `2pp` stages) and `M >= 2pp` microbatches.
pub(crate) fn dualpipe_v(spec: &ScheduleSpec) -> Vec<RankOrder> {
    let (pp, m) = (spec.pp, spec.microbatches);
    let per_rank = (0..pp).map(|r| {
        let task = |phase: usize, k: u32| {
            if phase == 0 {
                Task::new(r, k)
            } else {
                Task::new(2 * pp - 1 - r, k)
            }
        };
        steps(pp, r, m, task)
    });
    rank_orders(spec, per_rank)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ScheduleKind;

    fn spec(kind: ScheduleKind, pp: u32, vpp: u32, m: u32) -> ScheduleSpec {
        ScheduleSpec::new(kind, pp, vpp, m)
    }

    /// Each task's passes appear exactly once: one forward, and either one backward (alone or
    /// in a pair) or a split `I` + `W`, with the `W` after the `I`.
    fn assert_complete(orders: &[RankOrder], tasks: impl Fn(u32) -> Vec<Task>) {
        for o in orders {
            let mut f = Vec::new();
            let mut b = Vec::new();
            let mut d = Vec::new();
            let mut w = Vec::new();
            for op in &o.ops {
                match *op {
                    Compute::Fwd(t) => f.push(t),
                    Compute::Bwd(t) => b.push(t),
                    Compute::BwdD(t) => d.push(t),
                    Compute::BwdW(t) => {
                        assert!(d.contains(&t), "W before its I: {t}");
                        w.push(t)
                    }
                    Compute::FwdBwd { fwd, bwd } => {
                        f.push(fwd);
                        b.push(bwd)
                    }
                }
            }
            let mut want = tasks(o.rank.0);
            want.sort();
            f.sort();
            assert_eq!(f, want, "{}", o.rank);
            let mut all_b: Vec<Task> = b.iter().chain(&d).copied().collect();
            all_b.sort();
            assert_eq!(all_b, want, "{}", o.rank);
            d.sort();
            w.sort();
            assert_eq!(d, w);
        }
    }

    #[test]
    fn dualpipe_covers_both_directions() {
        for pp in [2u32, 4, 6, 8] {
            for m in [2 * pp, 2 * pp + 2, 4 * pp] {
                let orders = dualpipe(&spec(ScheduleKind::DualPipe, pp, 1, m));
                assert_complete(&orders, |r| {
                    (0..m)
                        .map(|mb| {
                            if mb < m / 2 {
                                Task::new(r, mb)
                            } else {
                                Task::new(pp - 1 - r, mb)
                            }
                        })
                        .collect()
                });
            }
        }
    }

    #[test]
    fn dualpipe_v_covers_the_v() {
        for pp in 1..=8u32 {
            for m in [2 * pp, 2 * pp + 1, 3 * pp + 2] {
                let orders = dualpipe_v(&spec(ScheduleKind::DualPipeV, pp, 2, m));
                assert_complete(&orders, |r| {
                    (0..m)
                        .flat_map(|mb| [Task::new(r, mb), Task::new(2 * pp - 1 - r, mb)])
                        .collect()
                });
            }
        }
    }

    /// The DualPipe README's example shape: 8 ranks, 20 microbatches. Rank 0 starts with
    /// `(4-0-1)*2 = 6` forwards of its own direction, then alternates with the reverse one.
    #[test]
    fn dualpipe_pp8_m20_warmup() {
        let orders = dualpipe(&spec(ScheduleKind::DualPipe, 8, 1, 20));
        let first: Vec<Compute> = orders[0].ops[..8].to_vec();
        let mut want: Vec<Compute> = (0..7).map(|k| Compute::Fwd(Task::new(0, k))).collect();
        want.push(Compute::Fwd(Task::new(7, 10)));
        assert_eq!(first, want);
        // Rank 7 mirrors rank 0: stage 0 of the reverse direction, then stage 7 forward.
        assert_eq!(orders[7].ops[0], Compute::Fwd(Task::new(0, 10)));
        assert_eq!(orders[7].ops[7], Compute::Fwd(Task::new(7, 0)));
        assert_eq!(orders[7].warmup, 8);
    }
}
