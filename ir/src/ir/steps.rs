//! A rank's stream as the units it executes: compute ops, comm batches and waits.
//!
//! A comm batch is a maximal run of consecutive sends and receives with one batch id: it is
//! posted as a whole (one NCCL group, `batch_isend_irecv`) and completes as a whole. A wait or
//! a compute op ends a run, so two runs with one id are two batches (the verifier reports a
//! `Wait` that would be ambiguous between them). Every consumer of a program (verifier,
//! simulator, interpreter, exporters, calibration) cuts streams with these two functions.

use super::Instr;
use std::ops::Range;

/// One unit of a rank's stream.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    /// The compute op at this index.
    Compute(usize),
    /// The sends and receives at `ops`, all with batch id `id`.
    Batch { id: u32, ops: Range<usize> },
    /// The wait at `at` for the batch with id `batch`.
    Wait { at: usize, batch: u32 },
    /// The memory instruction (`offload`, `reload`, `wait_offload`, `recompute`) at this
    /// index. A checkpointed `fwd` is a [`Step::Compute`]: it is the forward.
    Memory(usize),
}

/// End (exclusive) of the comm batch that starts at `first`; `first` itself when the
/// instruction there is not a send or receive.
#[inline]
pub fn batch_end(instrs: &[Instr], first: usize) -> usize {
    let Some(id) = instrs.get(first).and_then(Instr::batch) else {
        return first;
    };
    let mut end = first + 1;
    while end < instrs.len() && instrs[end].batch() == Some(id) {
        end += 1;
    }
    end
}

/// The batch ids some `Wait` of this stream names: the batches it leaves in flight.
pub fn waited_batches(instrs: &[Instr]) -> std::collections::HashSet<u32> {
    instrs
        .iter()
        .filter_map(|i| match i {
            Instr::Wait { batch } => Some(*batch),
            _ => None,
        })
        .collect()
}

/// The stream's units in order.
pub fn steps(instrs: &[Instr]) -> Steps<'_> {
    Steps { instrs, pc: 0 }
}

/// Iterator of [`steps`].
pub struct Steps<'a> {
    instrs: &'a [Instr],
    pc: usize,
}

impl Iterator for Steps<'_> {
    type Item = Step;

    fn next(&mut self) -> Option<Step> {
        let i = self.pc;
        let step = match *self.instrs.get(i)? {
            Instr::Compute(_) | Instr::FwdCheckpoint(_) => Step::Compute(i),
            Instr::Memory(_) => Step::Memory(i),
            Instr::Wait { batch } => Step::Wait { at: i, batch },
            Instr::Send { batch, .. } | Instr::Recv { batch, .. } => Step::Batch {
                id: batch,
                ops: i..batch_end(self.instrs, i),
            },
        };
        self.pc = match &step {
            Step::Batch { ops, .. } => ops.end,
            _ => i + 1,
        };
        Some(step)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::Payload;
    use pipec_schedules::{Compute, Rank, Task};

    #[test]
    fn runs_with_one_id_are_batches_and_waits_and_compute_cut_them() {
        let send = |b| Instr::Send {
            peer: Rank(1),
            payload: Payload::act(0, 0),
            batch: b,
            tokens: None,
            slot: None,
        };
        let recv = |b| Instr::Recv {
            peer: Rank(1),
            payload: Payload::grad(1, 0),
            batch: b,
            tokens: None,
            slot: None,
        };
        let f = Instr::Compute(Compute::Fwd(Task::new(0, 0)));
        let s = [
            f,
            send(0),
            recv(0),
            send(1),
            Instr::Wait { batch: 0 },
            send(1),
            recv(1),
            f,
        ];
        let got: Vec<Step> = steps(&s).collect();
        assert_eq!(
            got,
            vec![
                Step::Compute(0),
                Step::Batch { id: 0, ops: 1..3 },
                Step::Batch { id: 1, ops: 3..4 },
                Step::Wait { at: 4, batch: 0 },
                Step::Batch { id: 1, ops: 5..7 },
                Step::Compute(7),
            ]
        );
        assert_eq!(batch_end(&s, 0), 0);
        assert_eq!(batch_end(&s, 5), 7);
    }
}
