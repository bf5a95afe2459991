//! Looped breadth-first schedule ("Breadth-First Pipeline Parallelism", Lamy-Poirier, 2022),
//! in the order of torch's `ScheduleLoopedBFS`: each local stage runs all microbatches forward
//! in model order, then the local stages run backward in reverse model order, each over the
//! microbatches in reverse.

use crate::ids::Rank;
use crate::op::{Compute, Task};
use crate::order::RankOrder;
use crate::spec::ScheduleSpec;

pub(crate) fn orders(spec: &ScheduleSpec) -> Vec<RankOrder> {
    let (pp, vpp, m) = (spec.pp, spec.vpp, spec.microbatches);
    (0..pp)
        .map(|r| {
            let stages: Vec<u32> = (0..vpp).map(|c| c * pp + r).collect();
            let mut ops = Vec::with_capacity((2 * vpp * m) as usize);
            for &s in &stages {
                ops.extend((0..m).map(|mb| Compute::Fwd(Task::new(s, mb))));
            }
            if !spec.forward_only {
                for &s in stages.iter().rev() {
                    ops.extend((0..m).rev().map(|mb| Compute::Bwd(Task::new(s, mb))));
                }
            }
            RankOrder {
                rank: Rank(r),
                ops,
                warmup: vpp * m,
            }
        })
        .collect()
}
