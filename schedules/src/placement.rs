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
    /// DualPipe's two directions: the table is the first direction (stage `s` on rank `s`);
    /// microbatches from the second half on run the mirrored pipeline (stage `s` on rank
    /// `pp-1-s`).
    Bidirectional,
}

impl fmt::Display for PlacementKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            PlacementKind::Looped => "loop",
            PlacementKind::V => "v",
            PlacementKind::Custom => "custom",
            PlacementKind::Bidirectional => "bidirectional",
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
    /// Bidirectional placements: the first microbatch of the second direction. A task with
    /// `mb >= mirror_from` runs on `pp - 1 - table[stage]`. Absent (and not written) otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    mirror_from: Option<u32>,
}

impl Placement {
    /// `pp * vpp` stages, stage `s` on rank `s % pp`.
    pub fn looped(pp: u32, vpp: u32) -> Self {
        let stage_rank = (0..pp * vpp).map(|s| Rank(s % pp)).collect();
        Placement {
            kind: PlacementKind::Looped,
            pp,
            stage_rank,
            mirror_from: None,
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
            mirror_from: None,
        }
    }

    /// An explicit table. Every rank in `0..pp` must own at least one stage; callers check ids.
    pub fn custom(pp: u32, stage_rank: Vec<Rank>) -> Self {
        Placement {
            kind: PlacementKind::Custom,
            pp,
            stage_rank,
            mirror_from: None,
        }
    }

    /// DualPipe (DeepSeek-V3 report; deepseek-ai/DualPipe `dualpipe.py`): `pp` stages, the
    /// microbatches `0..half` enter at rank 0 (stage `s` on rank `s`), the microbatches
    /// `half..` enter at rank `pp-1` (stage `s` on rank `pp-1-s`). Every rank therefore holds
    /// two stages' parameters, `s` and `pp-1-s` (DualPipe's README: "2x" parameters).
    pub fn bidirectional(pp: u32, half: u32) -> Self {
        Placement {
            kind: PlacementKind::Bidirectional,
            pp,
            stage_rank: (0..pp).map(Rank).collect(),
            mirror_from: Some(half),
        }
    }

    /// The first microbatch of the second direction, for bidirectional placements.
    pub fn mirror_from(&self) -> Option<u32> {
        self.mirror_from
    }

    pub fn num_stages(&self) -> u32 {
        self.stage_rank.len() as u32
    }

    /// The rank that runs `stage` for microbatches of the first direction (for every
    /// microbatch unless the placement is bidirectional). Panics on an out-of-range stage:
    /// callers validate ids first. Use [`Placement::rank_of`] for tasks.
    #[inline]
    pub fn rank_of_stage(&self, stage: StageId) -> Rank {
        self.stage_rank[stage.index()]
    }

    /// The rank that runs a task: the table's rank, mirrored (`pp-1-r`) for the second
    /// direction of a bidirectional placement.
    #[inline]
    pub fn rank_of(&self, task: Task) -> Rank {
        let r = self.rank_of_stage(task.stage);
        match self.mirror_from {
            // Wrapping: a corrupt table entry (>= pp) stays out of range for the verifier to
            // report instead of panicking here.
            Some(h) if task.mb.0 >= h => Rank(self.pp.wrapping_sub(1).wrapping_sub(r.0)),
            _ => r,
        }
    }

    /// [`Placement::rank_of`] for untrusted ids: `None` when the stage is out of range.
    pub fn get_task(&self, task: Task) -> Option<Rank> {
        self.get(task.stage)?;
        Some(self.rank_of(task))
    }

    pub fn get(&self, stage: StageId) -> Option<Rank> {
        self.stage_rank.get(stage.index()).copied()
    }

    /// The stages of one rank in model order; the position is the chunk (Megatron's vpp rank).
    /// For a bidirectional placement these are the first direction's stages; the rank also
    /// runs the mirrored stage `pp-1-s` for the second direction.
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

    #[test]
    fn bidirectional_mirrors_the_second_half() {
        let b = Placement::bidirectional(4, 3);
        assert_eq!(b.rank_of(Task::new(1, 0)), Rank(1));
        assert_eq!(b.rank_of(Task::new(1, 2)), Rank(1));
        assert_eq!(b.rank_of(Task::new(1, 3)), Rank(2));
        assert_eq!(b.rank_of(Task::new(0, 5)), Rank(3));
        assert_eq!(b.rank_of_stage(StageId(0)), Rank(0));
        assert_eq!(b.get_task(Task::new(4, 0)), None);
        // Files written without the field read back as unidirectional.
        let l = Placement::looped(2, 1);
        let json = serde_json::to_string(&l).unwrap();
        assert!(!json.contains("mirror_from"));
        let back: Placement = serde_json::from_str(&json).unwrap();
        assert_eq!(back, l);
        let json = serde_json::to_string(&b).unwrap();
        let back: Placement = serde_json::from_str(&json).unwrap();
        assert_eq!(back, b);
    }
}
