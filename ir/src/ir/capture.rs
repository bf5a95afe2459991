//! The capture order: in which order one rank captures its per-chunk CUDA graphs, in
//! Transformer Engine's `_order` encoding, the list megatron-core hands
//! `te.make_graphed_callables(..., _order=...)` (`TECudaGraphHelper._get_cuda_graph_input_data`
//! in `megatron/core/transformer/cuda_graphs.py`, made by `convert_schedule_table_to_order` from
//! `get_schedule_table` and `get_pp_rank_microbatches`).
//!
//! The encoding, Megatron's and TE's: the forward of the rank's model chunk `c` (1-based, the
//! rank's stages in ascending order, as `pipec.megatron.stage_indices` builds the `model` list)
//! is `c`, its backward `-c`. TE pairs the k-th backward of a chunk with the k-th forward of
//! that chunk (both capture microbatch k's graph), so the list names no microbatch. What pipec
//! adds for the schedules Megatron has no table for, with the same rules:
//!
//! - a weight-gradient backward (`bwd_W`) is the half step `-(c + 0.5)`: Megatron's own
//!   convention for a delayed weight gradient captured as its own graph
//!   (`get_overlap_moe_expert_parallel_comm_order` with `capture_wgrad_graph`, which writes
//!   `layer_id - 0.5` after the layer's backward `-layer_id`); the input-gradient backward
//!   (`bwd_D`) is then the plain `-c`, as Megatron's backward graph is under delayed wgrad.
//!   On a chunk that splits any backward, a fused `bwd` is its two halves back to back,
//!   `-c, -(c + 0.5)`: TE captures a weight-gradient graph for every backward of a layer or
//!   for none (Megatron's order gives each backward its W), and a W right after its backward
//!   is what the fused pass computes. DualPipe fuses some backwards and splits others.
//! - weight gradients are not matched to microbatches: delayed weight gradients wait in a
//!   first-in, first-out queue (the zero-bubble authors' `WeightGradStore`, a `queue.Queue`
//!   popped oldest first, and TE's delayed-wgrad store after it), so the k-th W of a chunk is
//!   the k-th backward's. A program that runs a chunk's Ws in another
//!   microbatch order (ZB-H1 computes W of microbatch 0 after the fused backwards of 1 and 2)
//!   has the same list: the same number of Ws pending at every point (the same memory), the
//!   weight gradient summed in another order.
//! - an overlapped forward+backward pair (`fwd_bwd`, DualPipe's and Megatron's combined 1F1B)
//!   is its forward then its backward, as Megatron orders the two graphs of one overlapped
//!   step ("always forward graph before backward graph" in that same function).
//! - a V placement: chunk 1 is stage `r`, chunk 2 stage `2pp-1-r` (ascending stages).
//! - a bidirectional placement (DualPipe): the rank's first-direction stages are chunks
//!   `1..=n`, its mirrored stages (microbatches from `mirror_from` on) chunks `n+1..`: the
//!   two parameter copies DualPipe keeps are two model chunks.
//! - a checkpointed forward is its forward; memory instructions (`offload`, `reload`,
//!   `wait_offload`, `recompute`) are not graphs of the list and are left out.
//!
//! What the encoding cannot say is refused ([`CaptureError`]): a forward-only program (TE's
//! `_order` pairs every forward with a backward), a chunk whose backwards run its
//! microbatches in another order than its forwards (the k-th backward would be captured for
//! another microbatch's graph, whose static buffers a later forward may already reuse: looped
//! BFS and other last-in, first-out orders), and a task the placement does not put on the
//! rank.

use super::program::{Instr, Program};
use pipec_schedules::{Compute, Pass, PlacementKind, Rank, StageId, Task};
use std::collections::HashMap;
use std::fmt;

/// One entry of a capture order.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum CaptureStep {
    /// The forward graph of chunk `c` (1-based): `c`.
    Fwd(u32),
    /// The backward graph (fused, or the input gradient of a split one) of chunk `c`: `-c`.
    Bwd(u32),
    /// The weight-gradient graph of chunk `c`: `-(c + 0.5)`.
    Wgrad(u32),
}

impl CaptureStep {
    /// The number TE reads.
    pub fn value(self) -> f64 {
        match self {
            CaptureStep::Fwd(c) => f64::from(c),
            CaptureStep::Bwd(c) => -f64::from(c),
            CaptureStep::Wgrad(c) => -(f64::from(c) + 0.5),
        }
    }
}

impl fmt::Display for CaptureStep {
    /// As JSON and Python write the number: `2`, `-2`, `-2.5`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            CaptureStep::Fwd(c) => write!(f, "{c}"),
            CaptureStep::Bwd(c) => write!(f, "-{c}"),
            CaptureStep::Wgrad(c) => write!(f, "-{c}.5"),
        }
    }
}

/// Why a rank's program has no capture order.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CaptureError {
    #[error("rank {rank} is out of range (the program has {world} ranks)")]
    NoSuchRank { rank: u32, world: u32 },
    #[error("a forward-only program has no capture order: Transformer Engine's _order pairs every forward graph with a backward graph")]
    ForwardOnly,
    #[error("{rank}: {op} is not placed on this rank, so it is no model chunk of it")]
    NotOnRank { rank: Rank, op: String },
    #[error("{rank}: chunk {chunk} (stage {stage}) runs {pass} of microbatch {got} as its #{k} where its forwards ran microbatch {want}; Transformer Engine pairs the k-th {pass} of a chunk with its k-th forward, so the capture order cannot express this program (a chunk's backwards must run its microbatches in the order of its forwards)")]
    OutOfOrder {
        rank: Rank,
        chunk: u32,
        stage: u32,
        pass: &'static str,
        k: usize,
        got: u32,
        want: String,
    },
}

/// The chunk numbers of one rank: (stage, mirrored direction) -> 1-based chunk.
fn chunks(p: &Program, rank: Rank) -> HashMap<(StageId, bool), u32> {
    let pl = &p.placement;
    let mut out = HashMap::new();
    let own = pl.stages_of(rank);
    for (i, s) in own.iter().enumerate() {
        out.insert((*s, false), i as u32 + 1);
    }
    if pl.kind == PlacementKind::Bidirectional {
        // The second direction runs stage `s` on rank `pp-1-table[s]`.
        let mirror = Rank(pl.pp.wrapping_sub(1).wrapping_sub(rank.0));
        for (i, s) in pl.stages_of(mirror).iter().enumerate() {
            out.insert((*s, true), (own.len() + i) as u32 + 1);
        }
    }
    out
}

/// Rank `rank`'s capture order (module doc: the encoding and what is refused).
pub fn capture_order(p: &Program, rank: u32) -> Result<Vec<CaptureStep>, CaptureError> {
    let instrs = p.ranks.get(rank as usize).ok_or(CaptureError::NoSuchRank {
        rank,
        world: p.world(),
    })?;
    if p.forward_only {
        return Err(CaptureError::ForwardOnly);
    }
    let r = Rank(rank);
    let table = chunks(p, r);
    let mirrored = |t: Task| p.placement.mirror_from().is_some_and(|h| t.mb.0 >= h);
    let chunk_of = |t: Task, op: &Compute| -> Result<u32, CaptureError> {
        if p.placement.get_task(t) != Some(r) {
            return Err(CaptureError::NotOnRank {
                rank: r,
                op: op.to_string(),
            });
        }
        table
            .get(&(t.stage, mirrored(t)))
            .copied()
            .ok_or_else(|| CaptureError::NotOnRank {
                rank: r,
                op: op.to_string(),
            })
    };
    let computes = || {
        instrs.iter().filter_map(|ins| match ins {
            Instr::Memory(_) => None,
            other => other.as_compute(),
        })
    };
    // Chunks with a split backward: there a fused backward is its two halves back to back.
    let mut split = std::collections::HashSet::new();
    for c in computes() {
        for (pass, t) in c.parts() {
            if matches!(pass, Pass::BwdD | Pass::BwdW) {
                split.insert(chunk_of(t, &c)?);
            }
        }
    }
    // Per chunk: its stage and the microbatches of its forwards and backwards (fused or input
    // gradient), in the rank's order.
    #[derive(Default)]
    struct Seen {
        stage: u32,
        fwd: Vec<u32>,
        bwd: Vec<u32>,
    }
    let mut seen: HashMap<u32, Seen> = HashMap::new();
    let mut out = Vec::new();
    for c in computes() {
        for (pass, t) in c.parts() {
            let k = chunk_of(t, &c)?;
            let e = seen.entry(k).or_default();
            e.stage = t.stage.0;
            match pass {
                Pass::Fwd => {
                    e.fwd.push(t.mb.0);
                    out.push(CaptureStep::Fwd(k));
                }
                Pass::BwdD => {
                    e.bwd.push(t.mb.0);
                    out.push(CaptureStep::Bwd(k));
                }
                Pass::BwdW => {
                    out.push(CaptureStep::Wgrad(k));
                }
                Pass::Bwd => {
                    e.bwd.push(t.mb.0);
                    out.push(CaptureStep::Bwd(k));
                    if split.contains(&k) {
                        out.push(CaptureStep::Wgrad(k));
                    }
                }
            }
        }
    }
    let mut ks: Vec<_> = seen.keys().copied().collect();
    ks.sort_unstable();
    for k in ks {
        let e = &seen[&k];
        // Only the backwards: a chunk's delayed weight gradients wait in a first-in, first-out
        // queue, so its k-th W is the k-th backward's whatever microbatch the program names
        // (module doc).
        let got = &e.bwd;
        if let Some(i) = (0..got.len()).find(|&i| e.fwd.get(i) != Some(&got[i])) {
            return Err(CaptureError::OutOfOrder {
                rank: r,
                chunk: k,
                stage: e.stage,
                pass: "backward",
                k: i + 1,
                got: got[i],
                want: e
                    .fwd
                    .get(i)
                    .map_or_else(|| "none".to_string(), |m| m.to_string()),
            });
        }
    }
    Ok(out)
}

/// Every rank's capture order as JSON: an array with one array of numbers per rank, one rank
/// per line (docs/format.md, "Capture order").
pub fn capture_order_json(p: &Program) -> Result<String, CaptureError> {
    let mut s = String::from("[\n");
    for r in 0..p.world() {
        let order = capture_order(p, r)?;
        s.push_str("  [");
        for (i, step) in order.iter().enumerate() {
            if i > 0 {
                s.push_str(", ");
            }
            s.push_str(&step.to_string());
        }
        s.push(']');
        if r + 1 < p.world() {
            s.push(',');
        }
        s.push('\n');
    }
    s.push_str("]\n");
    Ok(s)
}

#[cfg(test)]
mod tests {
    use super::*;
    use pipec_schedules::Placement;

    fn prog(placement: Placement, ranks: Vec<Vec<Instr>>) -> Program {
        Program {
            placement,
            microbatches: 2,
            forward_only: false,
            comm: None,
            lengths: None,
            ranks,
            p2p_groups: Default::default(),
            buffer_slots: None,
        }
    }

    fn f(s: u32, m: u32) -> Instr {
        Instr::Compute(Compute::Fwd(Task::new(s, m)))
    }

    #[test]
    fn half_steps_by_hand() {
        // The fused encoding is checked against megatron-core's recordings in
        // tests/integration/megatron_capture.rs; here the half steps, derived by hand from the
        // module doc: chunk 2's backward then its W, chunk 1's backward then its W.
        let p = prog(
            Placement::looped(1, 2),
            vec![vec![
                f(0, 0),
                f(1, 0),
                Instr::Compute(Compute::BwdD(Task::new(1, 0))),
                Instr::Compute(Compute::BwdW(Task::new(1, 0))),
                Instr::Compute(Compute::BwdD(Task::new(0, 0))),
                Instr::Compute(Compute::BwdW(Task::new(0, 0))),
            ]],
        );
        let got: Vec<f64> = capture_order(&p, 0)
            .unwrap()
            .iter()
            .map(|s| s.value())
            .collect();
        assert_eq!(got, [1.0, 2.0, -2.0, -2.5, -1.0, -1.5]);
        assert_eq!(
            capture_order_json(&p).unwrap(),
            "[\n  [1, 2, -2, -2.5, -1, -1.5]\n]\n"
        );
    }

    #[test]
    fn refusals() {
        let mut p = prog(
            Placement::looped(1, 1),
            vec![vec![
                f(0, 0),
                f(0, 1),
                Instr::Compute(Compute::Bwd(Task::new(0, 1))),
                Instr::Compute(Compute::Bwd(Task::new(0, 0))),
            ]],
        );
        let e = capture_order(&p, 0).unwrap_err();
        assert!(
            matches!(e, CaptureError::OutOfOrder { got: 1, k: 1, .. }),
            "{e}"
        );
        assert!(matches!(
            capture_order(&p, 1),
            Err(CaptureError::NoSuchRank { rank: 1, world: 1 })
        ));
        p.ranks[0].swap(2, 3);
        assert!(capture_order(&p, 0).is_ok());
        // A fused backward on a chunk that splits another: its two halves back to back.
        p.ranks[0][3] = Instr::Compute(Compute::BwdD(Task::new(0, 1)));
        p.ranks[0].push(Instr::Compute(Compute::BwdW(Task::new(0, 1))));
        let got: Vec<String> = capture_order(&p, 0)
            .unwrap()
            .iter()
            .map(ToString::to_string)
            .collect();
        assert_eq!(got, ["1", "1", "-1", "-1.5", "-1", "-1.5"]);
        p.forward_only = true;
        assert_eq!(capture_order(&p, 0), Err(CaptureError::ForwardOnly));
    }
}
