//! GPipe (Huang et al., 2019): every forward, then every backward. torch's `ScheduleGPipe`
//! runs the backwards in microbatch order, and so do we.

use crate::ids::Rank;
use crate::op::{Compute, Task};
use crate::order::RankOrder;
use crate::spec::ScheduleSpec;

pub(crate) fn orders(spec: &ScheduleSpec) -> Vec<RankOrder> {
    let m = spec.microbatches;
    (0..spec.pp)
        .map(|r| {
            let mut ops = Vec::with_capacity(2 * m as usize);
            ops.extend((0..m).map(|mb| Compute::Fwd(Task::new(r, mb))));
            if !spec.forward_only {
                ops.extend((0..m).map(|mb| Compute::Bwd(Task::new(r, mb))));
            }
            RankOrder {
                rank: Rank(r),
                ops,
                warmup: m,
            }
        })
        .collect()
}
