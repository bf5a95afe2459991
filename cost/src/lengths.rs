//! Costs that follow the microbatches' lengths (issue #38): the one rule every reader of a
//! program with lengths costs it by (the simulator, the memory weights, the headers).
//!
//! The per-layer keys describe a microbatch of `seq` tokens holding one causal sequence. A
//! microbatch whose sequences have lengths `l_i` (tokens `T = sum l_i`) has the scale
//!
//! - `lin = T / seq` for the parts linear in tokens: `K.f`, `K.b`, `K.w` (the weight
//!   matmuls, the norms, the MLP), `K.act` (Korthikanti et al. 2022 count activations per
//!   token: `sbh` terms), `K.offload` (a copy moves the activations) and `msg` (a message is
//!   one activation or gradient tensor, `s b h`);
//! - `quad = sum_i (l_i / seq)^2` for the attention core (`K.attn_*`): with document masks
//!   each sequence attends only to itself, so `QK^T` and attention over `V` cost `4 b l_i^2 h`
//!   per sequence (Narayanan et al. 2021's `4 b s^2 h`, per document), as WLB-LLM (OSDI'25)
//!   and ByteScale model a packed microbatch's attention.
//!
//! A microbatch of `seq` tokens in one sequence has scale `(1, 1)` and costs exactly what the
//! keys say ([`scaled`]). `K.param` never scales: parameters do not depend on the data.
//!
//! `seq` is the cost key `seq`, else the `[model]` table's `seq`, else (lengths given but
//! neither) the longest microbatch's tokens, which headers say ([`Scale::describe`]).

use crate::cost::{CostModel, StageCosts};
use pipec_ir::ir::Program;
use pipec_schedules::Lengths;
use pipec_schedules::{Compute, Pass};

/// Where a [`Scale`]'s `seq` came from.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum SeqFrom {
    /// The cost key `seq`.
    Key,
    /// The `[model]` table's `seq`.
    Model,
    /// Neither was given: the longest microbatch's tokens.
    Longest,
}

/// Per microbatch (indexed by the program's microbatch ids), the factors its costs scale by.
#[derive(Clone, Debug, PartialEq)]
pub struct Scale {
    /// Tokens per microbatch that the per-layer keys describe.
    pub seq: u64,
    pub seq_from: SeqFrom,
    /// `tokens / seq`: the linear parts' factor.
    pub lin: Vec<f64>,
    /// `sum over sequences of (length / seq)^2`: the attention parts' factor.
    pub quad: Vec<f64>,
}

impl Scale {
    /// The scale of every microbatch of `lengths` under `model`.
    pub fn of(model: &CostModel, lengths: &Lengths) -> Scale {
        let (seq, seq_from) = match (model.seq, &model.shape) {
            (Some(s), _) => (s, SeqFrom::Key),
            (None, Some(shape)) => (shape.seq, SeqFrom::Model),
            (None, None) => (u64::from(lengths.max_tokens()), SeqFrom::Longest),
        };
        let s = seq as f64;
        let m = lengths.microbatches();
        let mut lin = Vec::with_capacity(m as usize);
        let mut quad = Vec::with_capacity(m as usize);
        for mb in 0..m {
            lin.push(f64::from(lengths.tokens(mb).unwrap_or(0)) / s);
            quad.push(
                lengths
                    .sequences(mb)
                    .iter()
                    .map(|&l| {
                        let x = f64::from(l) / s;
                        x * x
                    })
                    .sum(),
            );
        }
        Scale {
            seq,
            seq_from,
            lin,
            quad,
        }
    }

    /// The scale of `program`'s microbatches, `None` when it has no lengths (every
    /// microbatch then costs what the keys say).
    pub fn of_program(model: &CostModel, program: &Program) -> Option<Scale> {
        program.lengths.as_ref().map(|l| Scale::of(model, l))
    }

    /// `(lin, quad)` of microbatch `mb`; `(1, 1)` for one the lengths do not name.
    #[inline]
    pub fn factors(&self, mb: u32) -> (f64, f64) {
        match (self.lin.get(mb as usize), self.quad.get(mb as usize)) {
            (Some(&l), Some(&q)) => (l, q),
            _ => (1.0, 1.0),
        }
    }

    /// `lin` of microbatch `mb`; 1 for one the lengths do not name.
    #[inline]
    pub fn lin(&self, mb: u32) -> f64 {
        self.lin.get(mb as usize).copied().unwrap_or(1.0)
    }

    /// For headers: what the per-layer costs are per, and where that came from.
    pub fn describe(&self) -> String {
        let from = match self.seq_from {
            SeqFrom::Key => "the `seq` key",
            SeqFrom::Model => "the [model] seq",
            SeqFrom::Longest => {
                "the longest microbatch, as neither a `seq` key nor a [model] table gives one"
            }
        };
        format!(
            "{} microbatches of different lengths, costs per {} tokens ({from}): linear parts x tokens/seq, attention x sum (length/seq)^2",
            self.lin.len(),
            self.seq
        )
    }
}

pub use crate::layer::scaled;

impl CostModel {
    /// [`CostModel::describe_given`] for a program with `lengths`: the same line, and with
    /// lengths what the costs are per ([`Scale::describe`]); without, exactly
    /// `describe_given(given)`.
    pub fn describe_for(&self, lengths: Option<&Lengths>, given: bool) -> String {
        let mut s = self.describe_given(given);
        if let Some(l) = lengths {
            s.push_str("; ");
            s.push_str(&Scale::of(self, l).describe());
        }
        s
    }
}

impl Scale {
    /// [`StageCosts::compute`] with each part costed for its own microbatch under this scale
    /// (an overlapped pair: its forward by the forward's microbatch, its backward by the
    /// backward's). Microbatches the scale does not know cost what a `seq`-token one does.
    #[inline]
    pub fn compute(&self, costs: &StageCosts, op: &Compute) -> Option<f64> {
        let one = |pass: Pass, t: pipec_schedules::Task| {
            let (lin, quad) = self.factors(t.mb.0);
            costs.pass_scaled(pass, t.stage, lin, quad)
        };
        match *op {
            Compute::Fwd(t) => one(Pass::Fwd, t),
            Compute::Bwd(t) => one(Pass::Bwd, t),
            Compute::BwdD(t) => one(Pass::BwdD, t),
            Compute::BwdW(t) => one(Pass::BwdW, t),
            Compute::FwdBwd { fwd, bwd } => {
                let f = one(Pass::Fwd, fwd)?;
                let b = one(Pass::Bwd, bwd)?;
                Some(f.max(b) + (1.0 - costs.model.overlap) * f.min(b))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn factors_by_hand() {
        let l = Lengths::parse("8\n4 4\n2,2,2,2\n").unwrap();
        let s = Scale::of(&CostModel::default(), &l);
        assert_eq!((s.seq, s.seq_from), (8, SeqFrom::Longest));
        assert_eq!(s.lin, [1.0, 1.0, 1.0]);
        assert_eq!(s.quad, [1.0, 0.5, 0.25]);
        let s = Scale::of(&CostModel::parse("seq=16").unwrap(), &l);
        assert_eq!((s.seq, s.seq_from), (16, SeqFrom::Key));
        assert_eq!(s.factors(0), (0.5, 0.25));
        assert_eq!(s.factors(9), (1.0, 1.0));
        assert!(s.describe().contains("per 16 tokens (the `seq` key)"));
        assert_eq!(scaled(3.0, 1.0, 1.0, 1.0), 3.0);
        assert_eq!(scaled(3.0, 1.0, 0.5, 0.25), 1.25);
    }
}
