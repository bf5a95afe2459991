//! Running a loaded program on the CPU backend ([`run_cpu`], through the step [`crate::driver`]
//! every backend shares), what a run reports, and the bitwise check against the reference.

use crate::backend::cpu::{CpuBackend, CpuTensor};
use crate::driver::{build_model, check_layout, drive, stages_of, Device, Setup, StepCheck};
use crate::error::RunError;
use crate::interp::run_rank;
use crate::model::{self, Stage, StageGrads};
use crate::reference;
use crate::report::{CheckSummary, RunOptions, RunReport};
use crate::transport::Transport;
use crate::watchdog::Watch;
use pipec_cost::cost::CostModel;
use pipec_ir::ir::Program;
use pipec_ir::memory::MemoryModel;
use pipec_ir::verify::Checked;
use pipec_schedules::layout::Layout;
use pipec_schedules::Rank;
use std::sync::Arc;
use std::time::{Duration, Instant};

pub use crate::driver::{replicated_stages, Replicated};

/// The CPU backend as the driver's device: every rank in this process, talking through one
/// in-process transport.
struct Cpu {
    transport: Arc<Transport<CpuTensor>>,
}

impl Device for Cpu {
    type Rank = CpuBackend;
    type Plan = ();
    type Worst = ();
    const SHARED_CLOCK: bool = true;

    fn open(&self, rank: u32, (): (), s: &Setup<'_>) -> Result<CpuBackend, String> {
        Ok(CpuBackend::new(
            Rank(rank),
            s.model,
            s.program.microbatches,
            s.full,
            &stages_of(s.program, rank as usize),
            self.transport.clone(),
        )
        .with_lengths(s.program.lengths.as_ref()))
    }

    fn reset(&self) {
        self.transport.reset();
    }

    fn compare(&self, c: &StepCheck<'_>) -> Result<(CheckSummary, ()), RunError> {
        compare(c).map(|s| (s, ()))
    }
}

/// Run `program` (verified, or structurally checked for `--no-verify`) with the model built
/// from `layout`; memory is measured in the default cost model's weights of `layout` (what
/// `pipec check` counts a directory that records no cost model in).
pub fn run_cpu(
    program: &impl Checked,
    layout: &Layout,
    opts: &RunOptions,
) -> Result<RunReport, RunError> {
    run_cpu_unchecked(program.program(), layout, opts)
}

/// [`run_cpu`] with memory measured in `memory`'s weights (`pipec-run` passes those of the
/// cost model the manifest records, as `pipec check` counts).
pub fn run_cpu_with_memory(
    program: &impl Checked,
    layout: &Layout,
    opts: &RunOptions,
    memory: &MemoryModel,
) -> Result<RunReport, RunError> {
    run_unchecked(program.program(), layout, opts, memory)
}

/// The memory model of a schedule: [`pipec_cost::memory::weights`] of `layout` under `cost` (the
/// default cost model when `None`).
pub fn memory_model(program: &Program, layout: &Layout, cost: Option<&CostModel>) -> MemoryModel {
    let default = CostModel::default();
    pipec_cost::memory::weights(program, layout, cost.unwrap_or(&default))
}

/// [`run_cpu`] on a program nobody checked, not even its structure. Only for the test that
/// holds the verifier's verdicts against what the runtime does with thousands of mutated
/// programs (`tests/integration/verify_vs_run.rs`), where reaching the interpreter unchecked
/// is the point; `pipec-run` and the Python package never call it.
#[doc(hidden)]
pub fn run_cpu_unchecked(
    program: &Program,
    layout: &Layout,
    opts: &RunOptions,
) -> Result<RunReport, RunError> {
    run_unchecked(program, layout, opts, &memory_model(program, layout, None))
}

fn run_unchecked(
    program: &Program,
    layout: &Layout,
    opts: &RunOptions,
    memory: &MemoryModel,
) -> Result<RunReport, RunError> {
    if opts.steps == 0 {
        return Err(RunError::ZeroSteps);
    }
    let world = program.ranks.len();
    check_layout(program, layout)?;
    let full = build_model(layout, &opts.model, "CPU")?;
    let watch = Arc::new(Watch::new(world, opts.timeout));
    let cpu = Cpu {
        transport: Transport::new(world, watch.clone()),
    };
    let setup = Setup {
        program,
        layout,
        model: opts.model,
        full: &full,
        watch,
        memory,
    };
    let plan = (0..world as u32).map(|r| (r, ())).collect();
    drive(setup, opts, &cpu, plan, false).map(|(report, _)| report)
}

/// Bitwise comparison of a pipelined step with the reference (the gradients of the stages in
/// `mine`); the first difference is an error naming the tensor and the element.
pub fn compare(c: &StepCheck<'_>) -> Result<CheckSummary, RunError> {
    let StepCheck {
        step,
        losses,
        loss,
        grads,
        mine,
        r,
        model,
    } = *c;
    let mut sum = CheckSummary {
        tensors: 0,
        values: 0,
        max_abs_diff: 0.0,
    };
    let mismatch = |what: String, a: f32, b: f32| {
        RunError::Check {
        step,
        msg: format!(
            "{what}: pipelined {a:e} vs reference {b:e} (difference {:e}); expected bitwise equality",
            (a as f64 - b as f64).abs()
        ),
    }
    };
    for (mb, (&a, &b)) in losses.iter().zip(&r.losses).enumerate() {
        sum.values += 1;
        if a.to_bits() != b.to_bits() {
            return Err(mismatch(format!("loss of mb {mb}"), a, b));
        }
    }
    sum.values += 1;
    if loss.to_bits() != r.loss.to_bits() {
        return Err(mismatch("step loss".into(), loss, r.loss));
    }
    for_each_gradient(
        step,
        grads,
        r,
        model,
        |s| mine.get(s).copied().unwrap_or(false),
        |what, gt, rt| {
            sum.tensors += 1;
            for ((idx, &a), &b) in gt.indexed_iter().zip(rt.iter()) {
                sum.values += 1;
                let d = (a as f64 - b as f64).abs();
                sum.max_abs_diff = sum.max_abs_diff.max(d);
                if a.to_bits() != b.to_bits() {
                    return Err(mismatch(format!("{what}[{}, {}]", idx.0, idx.1), a, b));
                }
            }
            Ok(())
        },
    )?;
    Ok(sum)
}

/// Pair every weight-gradient tensor of the stages `include` accepts with the reference's and
/// hand both to `f` with the tensor's name (`gradient of stage 1, layer 0 (t), W1`): the walk
/// the bitwise (CPU) and normwise (CUDA) checks share. A stage no rank produced is an error.
pub fn for_each_gradient(
    step: u32,
    grads: &[Option<&StageGrads<f32>>],
    r: &reference::RefStep,
    model: &[Stage<f32>],
    include: impl Fn(usize) -> bool,
    mut f: impl FnMut(String, &ndarray::Array2<f32>, &ndarray::Array2<f32>) -> Result<(), RunError>,
) -> Result<(), RunError> {
    for (s, rg) in r.grads.iter().enumerate() {
        if !include(s) {
            continue;
        }
        let Some(g) = grads.get(s).copied().flatten() else {
            return Err(RunError::Check {
                step,
                msg: format!("no rank produced the gradients of stage {s}"),
            });
        };
        for (li, (gl, rl)) in g.iter().zip(rg).enumerate() {
            let names = model::Layer::<f32>::names(model[s].layers[li].kind);
            for (ti, (gt, rt)) in gl.tensors.iter().zip(&rl.tensors).enumerate() {
                let what = format!(
                    "gradient of stage {s}, layer {li} ({}), {}",
                    gl.kind.symbol(),
                    names.get(ti).copied().unwrap_or("?")
                );
                f(what, gt, rt)?;
            }
        }
    }
    Ok(())
}

/// The interpreter's own time for one step of `program`, per rank, in microseconds: each rank
/// run alone with the [`NoopBackend`](crate::backend::noop::NoopBackend) (compute returns at
/// once, receives complete at once), best of three. What remains is the interpreter's work
/// (tensor tables, batching, status publishing, span timing): the overhead it adds on top of a
/// real backend's step, which `pipec-run` reports as a share of the measured step time. `None`
/// when a rank cannot run alone to the end (an unverified, broken program).
pub fn interpreter_us(program: &Program) -> Option<Vec<f64>> {
    let watch = Watch::new(program.ranks.len(), Duration::from_secs(30));
    (0..program.ranks.len())
        .map(|r| {
            let mut best = f64::INFINITY;
            for _ in 0..3 {
                let mut be = crate::backend::noop::NoopBackend;
                let t = Instant::now();
                run_rank(program, Rank(r as u32), &mut be, &watch, t).ok()?;
                best = best.min(t.elapsed().as_secs_f64() * 1e6);
            }
            Some(best)
        })
        .collect()
}

/// The busiest rank's interpreter time as a share of a step's wall time.
pub fn interpreter_share(interp_us: &[f64], step_wall_us: f64) -> Option<f64> {
    let worst = interp_us.iter().copied().fold(0.0, f64::max);
    (step_wall_us > 0.0).then(|| worst / step_wall_us)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::ModelConfig;

    /// The check is only worth something if it can fail: one ulp off in one gradient element,
    /// or in one microbatch's loss, is reported with its name.
    #[test]
    fn compare_reports_a_one_ulp_difference() {
        let cfg = ModelConfig {
            hidden: 3,
            ffn: 4,
            vocab: 5,
            seq: 2,
            seed: 1,
        };
        let layout = pipec_schedules::layout::parse("Et|tL").unwrap();
        let stages = model::build::<f32>(&layout, &cfg).unwrap();
        let r = reference::step(&stages, &cfg, 0, 3, false).unwrap();
        let same: Vec<Option<&StageGrads<f32>>> = r.grads.iter().map(Some).collect();
        let check = |losses, grads| StepCheck {
            step: 0,
            losses,
            loss: r.loss,
            grads,
            mine: &[true; 2],
            r: &r,
            model: &stages,
        };
        let ok = compare(&check(&r.losses, &same)).unwrap();
        assert_eq!(ok.max_abs_diff, 0.0);
        assert_eq!(ok.tensors, 1 + 4 + 4 + 2);

        let mut nudged = r.grads.clone();
        let x = &mut nudged[1][0].tensors[2][[1, 2]];
        *x = f32::from_bits(x.to_bits() + 1);
        let g: Vec<Option<&StageGrads<f32>>> = nudged.iter().map(Some).collect();
        let e = compare(&check(&r.losses, &g)).unwrap_err();
        assert!(
            e.to_string().contains("stage 1, layer 0 (t), W2[1, 2]"),
            "{e}"
        );

        let mut losses = r.losses.clone();
        losses[2] = f32::from_bits(losses[2].to_bits() + 1);
        let e = compare(&check(&losses, &same)).unwrap_err();
        assert!(e.to_string().contains("loss of mb 2"), "{e}");
    }
}
