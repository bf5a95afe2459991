//! Compute operations: what a rank does between its messages.

use crate::ids::{Microbatch, StageId};
use serde::{Deserialize, Serialize};
use std::fmt;

/// One unit of work: a stage applied to a microbatch.
#[derive(Copy, Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Task {
    pub stage: StageId,
    pub mb: Microbatch,
}

impl Task {
    pub fn new(stage: u32, mb: u32) -> Self {
        Task {
            stage: StageId(stage),
            mb: Microbatch(mb),
        }
    }
}

impl fmt::Display for Task {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}, {}", self.stage, self.mb)
    }
}

/// The passes a stage runs on a microbatch. Split backward follows "Zero Bubble Pipeline
/// Parallelism" (Qi et al., 2024): `BwdD` computes the input gradient (torch's `I`), on the
/// critical path; `BwdW` the weight gradient (torch's `W`), which can be deferred.
#[derive(Copy, Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Pass {
    Fwd,
    Bwd,
    #[serde(rename = "bwd_D")]
    BwdD,
    #[serde(rename = "bwd_W")]
    BwdW,
}

impl Pass {
    pub fn name(self) -> &'static str {
        match self {
            Pass::Fwd => "fwd",
            Pass::Bwd => "bwd",
            Pass::BwdD => "bwd_D",
            Pass::BwdW => "bwd_W",
        }
    }

    /// torch.distributed.pipelining's action letter.
    pub fn torch_letter(self) -> &'static str {
        match self {
            Pass::Fwd => "F",
            Pass::Bwd => "B",
            Pass::BwdD => "I",
            Pass::BwdW => "W",
        }
    }
}

/// A compute instruction. `FwdBwd` is one op that runs the forward of one microbatch together
/// with the (full) backward of another, as Megatron's combined 1F1B
/// (`combined_1f1b_schedule_for_interleaved_pipelining`) and DualPipe's overlapped chunks do.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Compute {
    Fwd(Task),
    Bwd(Task),
    BwdD(Task),
    BwdW(Task),
    FwdBwd { fwd: Task, bwd: Task },
}

impl Compute {
    pub fn single(pass: Pass, task: Task) -> Self {
        match pass {
            Pass::Fwd => Compute::Fwd(task),
            Pass::Bwd => Compute::Bwd(task),
            Pass::BwdD => Compute::BwdD(task),
            Pass::BwdW => Compute::BwdW(task),
        }
    }

    /// The (pass, task) parts this op performs: one, or two for an overlapped pair.
    pub fn parts(&self) -> Parts {
        match *self {
            Compute::Fwd(t) => Parts([(Pass::Fwd, t), (Pass::Fwd, t)], 1, 0),
            Compute::Bwd(t) => Parts([(Pass::Bwd, t), (Pass::Bwd, t)], 1, 0),
            Compute::BwdD(t) => Parts([(Pass::BwdD, t), (Pass::BwdD, t)], 1, 0),
            Compute::BwdW(t) => Parts([(Pass::BwdW, t), (Pass::BwdW, t)], 1, 0),
            Compute::FwdBwd { fwd, bwd } => Parts([(Pass::Fwd, fwd), (Pass::Bwd, bwd)], 2, 0),
        }
    }

    /// The same op with `f` applied to each of its tasks (renumbering microbatches).
    pub fn map_tasks(self, mut f: impl FnMut(Task) -> Task) -> Compute {
        match self {
            Compute::Fwd(t) => Compute::Fwd(f(t)),
            Compute::Bwd(t) => Compute::Bwd(f(t)),
            Compute::BwdD(t) => Compute::BwdD(f(t)),
            Compute::BwdW(t) => Compute::BwdW(f(t)),
            Compute::FwdBwd { fwd, bwd } => Compute::FwdBwd {
                fwd: f(fwd),
                bwd: f(bwd),
            },
        }
    }

    pub fn is_forward(&self) -> bool {
        matches!(self, Compute::Fwd(_))
    }
}

/// Iterator over the parts of a [`Compute`], allocation free.
#[derive(Clone, Debug)]
pub struct Parts([(Pass, Task); 2], u8, u8);

impl Iterator for Parts {
    type Item = (Pass, Task);
    fn next(&mut self) -> Option<Self::Item> {
        if self.2 < self.1 {
            self.2 += 1;
            Some(self.0[self.2 as usize - 1])
        } else {
            None
        }
    }
}

impl fmt::Display for Compute {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Compute::FwdBwd { fwd, bwd } => write!(f, "fwd_bwd(fwd {fwd}; bwd {bwd})"),
            _ => {
                let (p, t) = self.parts().next().expect("single op has one part");
                write!(f, "{}({t})", p.name())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_of_pair_are_forward_then_backward() {
        let op = Compute::FwdBwd {
            fwd: Task::new(1, 4),
            bwd: Task::new(5, 0),
        };
        let parts: Vec<_> = op.parts().collect();
        assert_eq!(
            parts,
            vec![(Pass::Fwd, Task::new(1, 4)), (Pass::Bwd, Task::new(5, 0))]
        );
        assert_eq!(
            op.to_string(),
            "fwd_bwd(fwd stage 1, mb 4; bwd stage 5, mb 0)"
        );
        assert_eq!(
            Compute::BwdD(Task::new(2, 3)).to_string(),
            "bwd_D(stage 2, mb 3)"
        );
    }
}
