//! Which rank owns each stage.

use crate::ids::{Rank, StageId};
use crate::op::Task;
use serde::{Deserialize, Serialize};
use std::fmt;

/// How stages are laid out over ranks; named so files and messages can say which rule made a table.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PlacementKind {
    /// Stage `s` on rank `s % pp` (Megatron's virtual pipeline, torch's looped schedules).
    Looped,
    /// Stage `s` on rank `s` for `s < pp`, else `2pp-1-s` (ZB-V, DualPipeV).
    V,
    /// Any other table (imported schedules).
    Custom,
}

impl fmt::Display for PlacementKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            PlacementKind::Looped => "loop",
            PlacementKind::V => "v",
            PlacementKind::Custom => "custom",
        })
    }
}

/// A dense stage -> rank table. Kept as a table (not a formula) so that imported schedules with
/// an arbitrary placement and generated ones are checked by the same code.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Placement {
    pub kind: PlacementKind,
    pub pp: u32,
    stage_rank: Vec<Rank>,
}

impl Placement {
    /// `pp * vpp` stages, stage `s` on rank `s % pp`.
    pub fn looped(pp: u32, vpp: u32) -> Self {
        let stage_rank = (0..pp * vpp).map(|s| Rank(s % pp)).collect();
        Placement {
            kind: PlacementKind::Looped,
            pp,
            stage_rank,
        }
    }

    /// `2 * pp` stages folded into a V: down the ranks, then back up.
    pub fn v_shape(pp: u32) -> Self {
        let stage_rank = (0..2 * pp)
            .map(|s| Rank(if s < pp { s } else { 2 * pp - 1 - s }))
            .collect();
        Placement {
            kind: PlacementKind::V,
            pp,
            stage_rank,
        }
    }

    /// An explicit table. Every rank in `0..pp` must own at least one stage; callers check ids.
    pub fn custom(pp: u32, stage_rank: Vec<Rank>) -> Self {
        Placement {
            kind: PlacementKind::Custom,
            pp,
            stage_rank,
        }
    }

    pub fn num_stages(&self) -> u32 {
        self.stage_rank.len() as u32
    }

    /// The rank that runs `stage`. Panics on an out-of-range stage: callers validate ids first.
    #[inline]
    pub fn rank_of_stage(&self, stage: StageId) -> Rank {
        self.stage_rank[stage.index()]
    }

    /// The rank that runs a task (kept separate from `rank_of_stage` so that bidirectional
    /// placements can later depend on the microbatch).
    #[inline]
    pub fn rank_of(&self, task: Task) -> Rank {
        self.rank_of_stage(task.stage)
    }

    pub fn get(&self, stage: StageId) -> Option<Rank> {
        self.stage_rank.get(stage.index()).copied()
    }

    /// The stages of one rank in model order; the position is the chunk (Megatron's vpp rank).
    pub fn stages_of(&self, rank: Rank) -> Vec<StageId> {
        (0..self.num_stages())
            .map(StageId)
            .filter(|&s| self.rank_of_stage(s) == rank)
            .collect()
    }

    pub fn table(&self) -> &[Rank] {
        &self.stage_rank
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn looped_and_v_tables() {
        let l = Placement::looped(4, 2);
        let got: Vec<u32> = l.table().iter().map(|r| r.0).collect();
        assert_eq!(got, vec![0, 1, 2, 3, 0, 1, 2, 3]);
        assert_eq!(l.stages_of(Rank(1)), vec![StageId(1), StageId(5)]);
        let v = Placement::v_shape(3);
        let got: Vec<u32> = v.table().iter().map(|r| r.0).collect();
        assert_eq!(got, vec![0, 1, 2, 2, 1, 0]);
    }
}
