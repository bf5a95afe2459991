//! Megatron's partial activation recompute: which forwards megatron-core checkpoints fully.
//!
//! megatron-core's `ModelParallelConfig.num_microbatches_with_partial_activation_checkpoints`
//! (N, default `None`) is read by `forward_backward_pipelining_without_interleaving` (1F1B) and
//! `forward_backward_pipelining_with_interleaving` (`megatron/core/pipeline_parallel/
//! schedules.py`). When it is set, each of them computes, on every pipeline rank,
//!
//! ```text
//! max_outstanding_backprops = num_warmup_microbatches + 1
//! checkpoint_activations_microbatch = (k % max_outstanding_backprops) >= N
//! ```
//!
//! before the rank's k-th forward (k = 0, 1, ... counts the rank's forwards in its order: the
//! microbatch in 1F1B, where the warmup loop uses `i` and the steady loop
//! `i + num_warmup_microbatches`; the virtual microbatch id `k` / `forward_k` when
//! interleaved), and passes it to `forward_step`, which hands it to the user's
//! `forward_step_func` as a third argument: `True` means "checkpoint all of this forward's
//! layers" (keep only its input, recompute before the backward). `num_warmup_microbatches` is
//! the rank's own:
//!
//! - 1F1B: `min(pp - r - 1, M)`, forward-only included (that function computes it itself and
//!   does not look at `forward_only`);
//! - interleaved: `get_pp_rank_microbatches`: `M * vpp` with `forward_only`, else
//!   `min(2 (pp - r - 1) + (vpp - 1) g, M * vpp)` (g = `microbatch_group_size_per_vp_stage`).
//!
//! So the window is `w_r = min(pp - r - 1, M) + 1` (1F1B) or `min(2 (pp - r - 1) + (vpp - 1) g,
//! M vpp) + 1` (interleaved; `M vpp + 1` forward-only), and forward k is checkpointed iff
//! `k mod w_r >= N`: N = 0 checkpoints every forward, N >= w_r none on rank r. Megatron's order
//! of compute and P2P calls is the same for every N (and for N unset).
//! `tests/golden/megatron/record_recompute.py` recorded all of this from megatron-core 0.19.2's
//! own functions; `tests/integration/megatron_recompute.rs` checks [`megatron_partial_recompute`]
//! against that recording.
//!
//! Not covered, because Megatron never passes the flag there (it reaches `forward_step_func`
//! as "not given"): `forward_backward_no_pipelining` (pp = 1), and combined 1F1B
//! (`overlap_moe_expert_parallel_comm`: `forward_backward_helper_wrapper` drops the flag and
//! `combined_forward_backward_step` asserts it is `None`).

use crate::ids::Rank;
use crate::kind::{MegatronLoop, ScheduleKind};
use crate::megatron::{rank_microbatches, schedule_table};
use crate::op::Task;
use crate::spec::{Limits, ScheduleSpec, SpecError};
use thiserror::Error;

/// One rank's forwards under Megatron's partial recompute.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankCheckpoints {
    pub rank: Rank,
    /// Megatron's `max_outstanding_backprops` on this rank: its `num_warmup_microbatches + 1`.
    pub window: u32,
    /// Every forward of the rank in Megatron's order (position k is the index), with
    /// `checkpoint_activations_microbatch`: `true` when Megatron checkpoints it fully.
    pub forwards: Vec<(Task, bool)>,
}

impl RankCheckpoints {
    /// The forwards Megatron checkpoints fully, in the rank's order.
    pub fn checkpointed(&self) -> impl Iterator<Item = Task> + '_ {
        self.forwards.iter().filter(|f| f.1).map(|f| f.0)
    }
}

/// Why [`megatron_partial_recompute`] has no answer.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum PartialRecomputeError {
    /// megatron-core accepts a negative N and then checkpoints every forward, exactly as N = 0.
    #[error("num_microbatches_with_partial_activation_checkpoints must be 0 or more (got {n}); megatron-core treats a negative value as 0 (every forward checkpointed): pass 0")]
    NegativeN { n: i64 },
    #[error(transparent)]
    Spec(#[from] SpecError),
    #[error("{kind}: num_microbatches_with_partial_activation_checkpoints is read only by Megatron's own schedules, 1f1b (forward_backward_pipelining_without_interleaving) and interleaved-1f1b (forward_backward_pipelining_with_interleaving)")]
    NotMegatron { kind: ScheduleKind },
    #[error("combined 1F1B (overlap_moe_expert_parallel_comm): megatron-core never passes checkpoint_activations_microbatch there (combined_forward_backward_step asserts it is None); use partial recompute without combined 1F1B")]
    Combined,
    #[error("pp = 1: megatron-core runs forward_backward_no_pipelining, which never passes checkpoint_activations_microbatch; partial recompute needs pp >= 2")]
    NoPipelining,
}

/// megatron-core 0.19.2's `checkpoint_activations_microbatch` for every forward of every rank,
/// given `num_microbatches_with_partial_activation_checkpoints = n` (see the module doc for the
/// rule and its source). `spec` is a `1f1b` or `interleaved-1f1b` spec with pp >= 2 and without
/// `combined`; its P2P mode does not matter. Every n >= 0 is what Megatron accepts: 0
/// checkpoints every forward, n at or above a rank's [`RankCheckpoints::window`] none of its
/// forwards.
pub fn megatron_partial_recompute(
    spec: &ScheduleSpec,
    limits: &Limits,
    n: i64,
) -> Result<Vec<RankCheckpoints>, PartialRecomputeError> {
    if n < 0 {
        return Err(PartialRecomputeError::NegativeN { n });
    }
    spec.validate(limits)?;
    let interleaved = match spec.kind.row().megatron {
        Some(l) => l == MegatronLoop::Interleaved,
        None => return Err(PartialRecomputeError::NotMegatron { kind: spec.kind }),
    };
    if spec.combined {
        return Err(PartialRecomputeError::Combined);
    }
    if spec.pp == 1 {
        return Err(PartialRecomputeError::NoPipelining);
    }
    let (pp, m) = (spec.pp, spec.microbatches);
    let (chunks, g) = if interleaved {
        (spec.vpp, spec.effective_group_size())
    } else {
        (1, m)
    };
    let table = schedule_table(m, chunks, g);
    Ok((0..pp)
        .map(|r| {
            // `get_pp_rank_microbatches`, as both Megatron functions compute it; the
            // non-interleaved one ignores `forward_only` there (module doc).
            let (vpp, forward_only) = if interleaved {
                (Some(chunks), spec.forward_only)
            } else {
                (None, false)
            };
            let warmup = rank_microbatches(pp, r, vpp, m, g, forward_only, false).warmup;
            let window = warmup + 1;
            let forwards = table
                .iter()
                .enumerate()
                .map(|(k, &(mb, c))| {
                    let task = Task::new(c * pp + r, mb);
                    (task, (k as u64 % u64::from(window)) as i64 >= n)
                })
                .collect();
            RankCheckpoints {
                rank: Rank(r),
                window,
                forwards,
            }
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::op::Compute;
    use crate::schedule::generate;
    use crate::spec::MegatronP2p;

    fn spec(kind: ScheduleKind, pp: u32, vpp: u32, m: u32, g: Option<u32>) -> ScheduleSpec {
        ScheduleSpec {
            kind,
            pp,
            vpp,
            microbatches: m,
            group_size: g,
            forward_only: false,
            combined: false,
            megatron_p2p: if kind == ScheduleKind::Interleaved1F1B {
                MegatronP2p::Overlap
            } else {
                MegatronP2p::Batched
            },
        }
    }

    fn run(s: &ScheduleSpec, n: i64) -> Vec<RankCheckpoints> {
        megatron_partial_recompute(s, &Limits::DEFAULT, n).unwrap()
    }

    fn flags(rc: &RankCheckpoints) -> Vec<bool> {
        rc.forwards.iter().map(|f| f.1).collect()
    }

    #[test]
    fn one_f_one_b_windows_and_flags() {
        let s = spec(ScheduleKind::OneFOneB, 4, 1, 8, None);
        let ranks = run(&s, 1);
        let windows: Vec<u32> = ranks.iter().map(|r| r.window).collect();
        assert_eq!(windows, vec![4, 3, 2, 1]);
        // Rank 0: k mod 4 >= 1.
        let mbs: Vec<u32> = ranks[0].checkpointed().map(|t| t.mb.0).collect();
        assert_eq!(mbs, vec![1, 2, 3, 5, 6, 7]);
        assert!(ranks[0].checkpointed().all(|t| t.stage.0 == 0));
        // The last rank's window is 1: k mod 1 = 0 < 1, nothing checkpointed.
        assert_eq!(ranks[3].checkpointed().count(), 0);
        // Forward-only 1F1B keeps the training windows (the function ignores forward_only).
        let fo = ScheduleSpec {
            forward_only: true,
            ..s
        };
        assert_eq!(run(&fo, 1), ranks);
    }

    #[test]
    fn n_zero_checkpoints_everything_and_large_n_nothing() {
        for s in [
            spec(ScheduleKind::OneFOneB, 4, 1, 8, None),
            spec(ScheduleKind::Interleaved1F1B, 4, 2, 8, None),
            spec(ScheduleKind::Interleaved1F1B, 3, 3, 7, Some(4)),
        ] {
            assert!(run(&s, 0).iter().all(|r| r.forwards.iter().all(|f| f.1)));
            let max = run(&s, 0).iter().map(|r| r.window).max().unwrap();
            assert!(run(&s, i64::from(max))
                .iter()
                .all(|r| r.checkpointed().count() == 0));
            assert!(run(&s, i64::MAX)
                .iter()
                .all(|r| r.checkpointed().count() == 0));
            assert!(run(&s, i64::from(max) - 1)
                .iter()
                .any(|r| r.checkpointed().count() > 0));
        }
    }

    #[test]
    fn fewer_microbatches_than_ranks_cap_the_window() {
        // 1F1B pp = 4, M = 2: warmup min(3, 2) = 2 on rank 0, window 3 > M.
        let ranks = run(&spec(ScheduleKind::OneFOneB, 4, 1, 2, None), 2);
        let windows: Vec<u32> = ranks.iter().map(|r| r.window).collect();
        assert_eq!(windows, vec![3, 3, 2, 1]);
        assert!(ranks.iter().all(|r| r.checkpointed().count() == 0));
    }

    #[test]
    fn interleaved_window_counts_positions_on_the_rank() {
        // pp = 2, vpp = 2, M = 4, g = 2 (recorded from megatron-core 0.19.2): rank 0 warms up
        // 2 (pp - 1) + g = 4 forwards, window 5; rank 1 warms up 2, window 3.
        let ranks = run(&spec(ScheduleKind::Interleaved1F1B, 2, 2, 4, None), 1);
        assert_eq!((ranks[0].window, ranks[1].window), (5, 3));
        let order: Vec<(u32, u32)> = ranks[0]
            .forwards
            .iter()
            .map(|f| (f.0.stage.0, f.0.mb.0))
            .collect();
        assert_eq!(
            order,
            vec![
                (0, 0),
                (0, 1),
                (2, 0),
                (2, 1),
                (0, 2),
                (0, 3),
                (2, 2),
                (2, 3)
            ]
        );
        let f = |v: &[u8]| v.iter().map(|&b| b == 1).collect::<Vec<bool>>();
        assert_eq!(flags(&ranks[0]), f(&[0, 1, 1, 1, 1, 0, 1, 1]));
        assert_eq!(flags(&ranks[1]), f(&[0, 1, 1, 0, 1, 1, 0, 1]));
        // Forward-only: every forward is a warmup forward, window M * vpp + 1.
        let fo = ScheduleSpec {
            forward_only: true,
            ..spec(ScheduleKind::Interleaved1F1B, 2, 2, 4, None)
        };
        for r in run(&fo, 3) {
            assert_eq!(r.window, 9);
            assert_eq!(flags(&r), f(&[0, 0, 0, 1, 1, 1, 1, 1]));
        }
    }

    /// The forwards, in order, are those of pipec's own Megatron schedules.
    #[test]
    fn forwards_are_the_generated_order() {
        for (kind, pp, vpp, m, g) in [
            (ScheduleKind::OneFOneB, 2, 1, 1, None),
            (ScheduleKind::OneFOneB, 5, 1, 13, None),
            (ScheduleKind::Interleaved1F1B, 2, 3, 8, Some(3)),
            (ScheduleKind::Interleaved1F1B, 4, 2, 14, Some(5)),
            (ScheduleKind::Interleaved1F1B, 4, 4, 12, None),
        ] {
            for fo in [false, true] {
                let s = ScheduleSpec {
                    forward_only: fo,
                    ..spec(kind, pp, vpp, m, g)
                };
                let sched = generate(&s, &Limits::DEFAULT).unwrap();
                for (rc, order) in run(&s, 2).iter().zip(&sched.ranks) {
                    let fwds: Vec<Task> = order
                        .ops
                        .iter()
                        .filter_map(|op| match op {
                            Compute::Fwd(t) => Some(*t),
                            _ => None,
                        })
                        .collect();
                    let ours: Vec<Task> = rc.forwards.iter().map(|f| f.0).collect();
                    assert_eq!(ours, fwds, "{s:?} rank {}", rc.rank.0);
                }
            }
        }
    }

    #[test]
    fn refusals_say_what_is_allowed() {
        let l = Limits::DEFAULT;
        let s = spec(ScheduleKind::OneFOneB, 4, 1, 8, None);
        let e = megatron_partial_recompute(&s, &l, -1).unwrap_err();
        assert_eq!(e, PartialRecomputeError::NegativeN { n: -1 });
        assert!(e.to_string().contains("pass 0"), "{e}");
        let zbv = ScheduleSpec {
            kind: ScheduleKind::ZbV,
            vpp: 2,
            ..s
        };
        assert!(matches!(
            megatron_partial_recompute(&zbv, &l, 1),
            Err(PartialRecomputeError::NotMegatron {
                kind: ScheduleKind::ZbV
            })
        ));
        let combined = ScheduleSpec {
            combined: true,
            ..spec(ScheduleKind::Interleaved1F1B, 4, 2, 8, None)
        };
        assert_eq!(
            megatron_partial_recompute(&combined, &l, 1),
            Err(PartialRecomputeError::Combined)
        );
        let pp1 = spec(ScheduleKind::OneFOneB, 1, 1, 8, None);
        assert_eq!(
            megatron_partial_recompute(&pp1, &l, 1),
            Err(PartialRecomputeError::NoPipelining)
        );
        let bad_group = spec(ScheduleKind::Interleaved1F1B, 4, 2, 9, Some(4));
        assert!(matches!(
            megatron_partial_recompute(&bad_group, &l, 1),
            Err(PartialRecomputeError::Spec(
                SpecError::PartialLastGroup { .. }
            ))
        ));
    }
}
