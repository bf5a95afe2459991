//! A rank's compute order: what every generator produces and lowering consumes. Its own module
//! so that generators depend on it and [`crate::schedule`] on them, never back.

use crate::ids::Rank;
use crate::op::Compute;
use crate::spec::ScheduleSpec;
use serde::{Deserialize, Serialize};

/// One rank's compute order.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankOrder {
    pub rank: Rank,
    pub ops: Vec<Compute>,
    /// Leading forwards before the first backward (Megatron's `num_warmup_microbatches`); the
    /// Megatron comm policies derive their steps from it.
    pub warmup: u32,
}

/// Each rank's ops (rank `r` at index `r`) as [`RankOrder`]s: `warmup` is the number of
/// leading forwards, and a forward-only spec keeps only the forwards of the training order
/// (the forward half of an overlapped pair included). The tail every V-shape and DualPipe
/// generator shares.
pub(crate) fn rank_orders(
    spec: &ScheduleSpec,
    per_rank: impl IntoIterator<Item = Vec<Compute>>,
) -> Vec<RankOrder> {
    per_rank
        .into_iter()
        .enumerate()
        .map(|(r, ops)| {
            let ops: Vec<Compute> = if spec.forward_only {
                ops.into_iter()
                    .filter_map(|op| match op {
                        Compute::Fwd(t) => Some(Compute::Fwd(t)),
                        Compute::FwdBwd { fwd, .. } => Some(Compute::Fwd(fwd)),
                        _ => None,
                    })
                    .collect()
            } else {
                ops
            };
            RankOrder {
                rank: Rank(r as u32),
                warmup: ops.iter().take_while(|o| o.is_forward()).count() as u32,
                ops,
            }
        })
        .collect()
}
