//! A cost model calibrated from a measured timeline, and the simulated figures under it next
//! to the measured ones: how far the real run is from what the schedule alone predicts.
//!
//! The per-layer-kind costs come from pipec's one calibrator, [`pipec_cost::calibrate::fit`]
//! (a non-negative least-squares fit of each pass's duration to the layer counts of its
//! stage), fed with this run's compute spans; `f`, `b`, `w` report the decoder layer's. When a
//! program has no split backward, `b` and `w` are each half of the fitted full backward (the
//! `B = W` assumption of "Zero Bubble Pipeline Parallelism", Qi et al., 2024). Overlapped
//! `fwd_bwd` pairs are not used. The message latency `p2p` is the lower quartile of the
//! measured comm batch spans: a span also holds the time waiting for the peer to post, which
//! the simulator adds itself, so the fastest batches are the closest to the transfer alone.
//! Checkpointed forwards and recomputes are forward samples; the copy stream's offloads and
//! reloads of decoder-only stages give `offload` (the median per layer), so the simulated
//! makespan charges the copies what they took.
//!
//! Pure (no GPU): tested on simulated timelines, where it must recover the costs it was given.

use pipec_cost::calibrate::{fit, Measured, Sample};
use pipec_cost::cost::{CostModel, StageCosts};
use pipec_cost::simulate::{simulate_unverified, summarize};
use pipec_cost::timeline::Timeline;
use pipec_ir::ir::{Instr, MemKind, Program};
use pipec_ir::verify::Unverified;
use pipec_schedules::layout::{LayerKind, Layout};
use pipec_schedules::Compute;
use serde::Serialize;

/// The calibrated model and the figures it gives.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Calibration {
    /// Forward of one decoder layer (the timeline's unit).
    pub f: f64,
    /// `bwd_D` of one decoder layer.
    pub b: f64,
    /// `bwd_W` of one decoder layer.
    pub w: f64,
    /// Message latency.
    pub p2p: f64,
    /// `b` and `w` were measured separately (the program splits its backward).
    pub split: bool,
    /// Some measured stage holds decoder layers alone; `false` when every one also holds the
    /// embedding, the head or the loss (the fit then cannot tell their time from the layers').
    pub pure: bool,
    /// The cost spec handed to [`CostModel::parse`]: every layer kind the fit informs.
    pub spec: String,
    pub measured_makespan: f64,
    pub measured_bubble: f64,
    pub simulated_makespan: f64,
    pub simulated_bubble: f64,
}

/// Calibrate from `timeline` (one span per instruction; ranks with no spans are skipped) and
/// simulate `program` under the result. `None` when no forward of a stage with decoder layers
/// was measured.
pub fn calibrate(program: &Program, layout: &Layout, timeline: &Timeline) -> Option<Calibration> {
    let mut samples = Vec::new();
    let mut pure = false;
    let mut comm: Vec<f64> = Vec::new();
    let mut copies: Vec<f64> = Vec::new();
    for (instrs, spans) in program.ranks.iter().zip(&timeline.ranks) {
        if spans.len() != instrs.len() {
            continue;
        }
        let waited = pipec_ir::ir::waited_batches(instrs);
        let mut i = 0;
        while i < instrs.len() {
            let d = spans[i].end - spans[i].start;
            let pure_decoders = |stage: u32| -> Option<usize> {
                let layers = layout.stages.get(stage as usize)?;
                (!layers.is_empty()
                    && layers
                        .iter()
                        .all(|k| matches!(k, LayerKind::Decoder | LayerKind::Mtp)))
                .then_some(layers.len())
            };
            // A checkpointed forward and a recompute are forwards of their task.
            let pass = match &instrs[i] {
                Instr::Compute(Compute::Fwd(t)) | Instr::FwdCheckpoint(t) => {
                    Some((Measured::Fwd, *t))
                }
                Instr::Memory(m) if m.kind == MemKind::Recompute => Some((Measured::Fwd, m.task)),
                Instr::Compute(Compute::BwdD(t)) => Some((Measured::BwdD, *t)),
                Instr::Compute(Compute::BwdW(t)) => Some((Measured::BwdW, *t)),
                Instr::Compute(Compute::Bwd(t)) => Some((Measured::Bwd, *t)),
                _ => None,
            };
            if let Some((pass, t)) = pass {
                pure |= pass == Measured::Fwd && pure_decoders(t.stage.0).is_some();
                samples.push(Sample {
                    pass,
                    stage: t.stage.0,
                    mb: t.mb.0,
                    dur: d,
                });
                i += 1;
                continue;
            }
            match &instrs[i] {
                Instr::Memory(m) if m.kind.is_copy() => {
                    // The copy stream's own span: per layer where the stage holds decoder
                    // layers alone (the embedding's and the head's stashes differ).
                    if let Some(n) = pure_decoders(m.task.stage.0) {
                        copies.push(d.max(0.0) / n as f64);
                    }
                    i += 1;
                }
                Instr::Send { .. } | Instr::Recv { .. } => {
                    // One comm batch: its ops share one span. A batch left in flight spans
                    // its post to its wait, compute in between: not a transfer time.
                    let end = pipec_ir::ir::batch_end(instrs, i);
                    if !instrs[i].batch().is_some_and(|b| waited.contains(&b)) {
                        comm.push(d.max(0.0));
                    }
                    i = end;
                }
                // Overlapped pairs, `wait`, `wait_offload`: no time of one pass.
                _ => i += 1,
            }
        }
    }
    let fitted = fit(&samples, layout).ok()?;
    let decoder = fitted
        .kinds
        .iter()
        .find(|k| k.kind == LayerKind::Decoder.symbol())?;
    let f = decoder.f?;
    let split = !fitted.split_evenly;
    // Forward only: no backward cost.
    let (b, w) = (decoder.b.unwrap_or(0.0), decoder.w.unwrap_or(0.0));
    comm.sort_by(f64::total_cmp);
    let p2p = if comm.is_empty() {
        0.0
    } else {
        comm[(comm.len() - 1) / 4]
    };
    let mut spec = format!("{},p2p={p2p}", fitted.spec());
    // The median copy per decoder layer, one way: the simulator's `offload` (else it takes a
    // copy for a forward).
    copies.sort_by(f64::total_cmp);
    if let Some(o) = copies.get(copies.len() / 2) {
        spec.push_str(&format!(",offload={o}"));
    }
    let model = CostModel::parse(&spec).ok()?;
    let costs = StageCosts::new(&model, layout, program.num_stages());
    // A measured run of a program verified or not (`--no-verify`): the simulator judges it.
    let sim = simulate_unverified(&Unverified::unchecked(program), &costs).ok()?;
    let measured = summarize(program, timeline);
    Some(Calibration {
        f,
        b,
        w,
        p2p,
        split,
        pure,
        spec,
        measured_makespan: measured.makespan,
        measured_bubble: measured.mean_bubble(),
        simulated_makespan: sim.summary.makespan,
        simulated_bubble: sim.summary.mean_bubble(),
    })
}

/// FLOPs of one decoder layer's GEMMs in one pass: two `seq x hidden x ffn` products
/// (`2·s·h·f` each) in the forward (`x·W1`, `a·W2`), in `bwd_D` (`dy·W2ᵀ`, `dh·W1ᵀ`) and in
/// `bwd_W` (`aᵀ·dy`, `xᵀ·dh`): `4·s·h·f` for each pass.
pub fn layer_flops(seq: usize, hidden: usize, ffn: usize) -> f64 {
    4.0 * seq as f64 * hidden as f64 * ffn as f64
}

/// TFLOP/s of `flops` done in `us` microseconds (0 when no time was measured).
pub fn tflops(flops: f64, us: f64) -> f64 {
    if us > 0.0 {
        flops / (us * 1e-6) / 1e12
    } else {
        0.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The Megatron-LM paper's count (Narayanan et al., 2021): a `b x s x h` by `h x 4h`
    /// GEMM is `2·b·s·h·4h` FLOPs; two of them per pass with `ffn = 4h`.
    #[test]
    fn flops_per_layer_pass() {
        assert_eq!(
            layer_flops(4096, 4096, 16384),
            2.0 * 2.0 * 4096.0 * 4096.0 * 16384.0
        );
        assert_eq!(tflops(1e12, 1e6), 1.0);
        assert_eq!(tflops(1.0, 0.0), 0.0);
    }
}
