//! Running a loaded program on the CPU backend: one thread per rank per step, the optional
//! check against the single-thread reference, SGD between steps, and the measurements.

use crate::backend::cpu::{CpuBackend, CpuTensor};
use crate::error::RunError;
use crate::interp::{run_rank, static_peak_activations, RankRun};
use crate::model::{self, ModelConfig, Stage, StageGrads};
use crate::reference;
use crate::trace;
use crate::transport::Transport;
use crate::watchdog::{Failure, FailureKind, Watch};
use pipec::back::files::MANIFEST_FILE;
use pipec::front::layout::Layout;
use pipec::ir::{Instr, InstrRef, Program};
use pipec::simulate::timeline::Timeline;
use pipec_schedules::{Rank, Task};
use serde::Serialize;
use std::sync::{Arc, Barrier, OnceLock};
use std::time::{Duration, Instant};

/// What to run and how.
#[derive(Clone, Debug)]
pub struct RunOptions {
    pub model: ModelConfig,
    pub steps: u32,
    /// SGD learning rate.
    pub lr: f32,
    /// How long a rank may wait on one comm batch before the watchdog reports a hang.
    pub timeout: Duration,
    /// Compare every step with the single-thread reference.
    pub check: bool,
    /// Keep the measured timelines of these steps (0-based, inclusive) in
    /// [`RunReport::traced`]; the last step's is always in [`RunReport::timeline`].
    pub trace_steps: Option<(u32, u32)>,
}

impl Default for RunOptions {
    fn default() -> Self {
        RunOptions {
            model: ModelConfig::default(),
            steps: 1,
            lr: 0.1,
            timeout: Duration::from_secs(30),
            check: false,
            trace_steps: None,
        }
    }
}

/// One rank's measurements in one step (microseconds).
#[derive(Clone, Debug, Serialize)]
pub struct RankStats {
    /// Time in compute instructions.
    pub busy_us: f64,
    /// The step's wall time minus `busy_us`: waiting on messages, the real bubble.
    pub idle_us: f64,
    /// Peak live activation stashes, measured.
    pub peak_activations: u32,
}

/// What the check compared.
#[derive(Clone, Debug, Serialize)]
pub struct CheckSummary {
    /// Weight-gradient tensors compared (0 when forward-only).
    pub tensors: usize,
    /// Float values compared, losses included.
    pub values: usize,
    /// Largest absolute difference seen; 0 when bitwise equal.
    pub max_abs_diff: f64,
}

#[derive(Clone, Debug, Serialize)]
pub struct StepReport {
    pub step: u32,
    pub loss: f32,
    pub wall_us: f64,
    pub ranks: Vec<RankStats>,
    pub check: Option<CheckSummary>,
}

#[derive(Clone, Debug, Serialize)]
pub struct RunReport {
    pub steps: Vec<StepReport>,
    /// Peak live activations per rank computed from the program alone (the verifier's figure).
    pub static_peak_activations: Vec<u32>,
    /// Measured timeline of the last step.
    pub timeline: Timeline,
    /// (step, measured timeline) of each step of [`RunOptions::trace_steps`].
    pub traced: Vec<(u32, Timeline)>,
}

/// The global stages a rank runs compute ops of.
fn stages_of(program: &Program, rank: usize) -> Vec<u32> {
    let mut v: Vec<u32> = program.ranks[rank]
        .iter()
        .filter_map(Instr::as_compute)
        .flat_map(|c| c.parts().map(|(_, t)| t.stage.0))
        .collect();
    v.sort_unstable();
    v.dedup();
    v
}

/// Every microbatch's loss of a step, or a check error naming the first one no rank computed.
pub(crate) fn complete_losses(step: u32, losses: Vec<Option<f32>>) -> Result<Vec<f32>, RunError> {
    losses
        .into_iter()
        .enumerate()
        .map(|(mb, l)| {
            l.ok_or_else(|| RunError::Check {
                step,
                msg: format!("no loss was computed for mb {mb}"),
            })
        })
        .collect()
}

/// Stages that run on more than one rank (DualPipe's bidirectional placement keeps a copy of
/// every stage on rank `s` and rank `pp-1-s`) hold gradients of disjoint microbatches; like
/// DualPipe's post-step all-reduce, sum them so every copy applies the same update. The copy
/// that ran microbatch 0 absorbs the others' contributions in microbatch order (bitwise equal
/// to an unpipelined step), then the sum is copied back to every replica.
fn reduce_replicas(program: &Program, backends: &mut [CpuBackend]) {
    for r in replicated_stages(program) {
        let (s, first) = (r.stage, r.first as usize);
        for &o in &r.others {
            let (a, b) = pair_mut(backends, first, o as usize);
            if let (Some(into), Some(from)) = (a.accum_mut(s), b.accum_mut(s)) {
                from.drain_into(into);
            }
        }
        for &o in &r.others {
            let (a, b) = pair_mut(backends, first, o as usize);
            if let (Some(src), Some(dst)) = (a.accum_mut(s), b.accum_mut(s)) {
                dst.copy_from(src);
            }
        }
    }
}

/// A stage that runs on more than one rank, and who sums its gradients.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Replicated {
    pub stage: u32,
    /// The rank that runs microbatch 0: it absorbs the others' gradients in microbatch order.
    pub first: u32,
    /// The other ranks holding a copy, ascending.
    pub others: Vec<u32>,
}

/// Every stage whose microbatches run on more than one rank (DualPipe's two directions).
pub fn replicated_stages(program: &Program) -> Vec<Replicated> {
    let placement = &program.placement;
    (0..program.num_stages())
        .filter_map(|s| {
            let first = placement.rank_of(Task::new(s, 0)).0;
            let mut others: Vec<u32> = (0..program.microbatches)
                .map(|mb| placement.rank_of(Task::new(s, mb)).0)
                .filter(|&r| r != first)
                .collect();
            others.sort_unstable();
            others.dedup();
            (!others.is_empty()).then_some(Replicated {
                stage: s,
                first,
                others,
            })
        })
        .collect()
}

/// Two distinct elements of a slice, mutably.
fn pair_mut<T>(v: &mut [T], i: usize, j: usize) -> (&mut T, &mut T) {
    assert_ne!(i, j);
    if i < j {
        let (lo, hi) = v.split_at_mut(j);
        (&mut lo[i], &mut hi[0])
    } else {
        let (lo, hi) = v.split_at_mut(i);
        (&mut hi[0], &mut lo[j])
    }
}

/// Stops everyone if a rank thread panics, so no peer waits for it until the timeout.
struct PanicGuard<'a> {
    watch: &'a Watch,
    rank: Rank,
}

impl Drop for PanicGuard<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.watch.fail(Failure {
                kind: FailureKind::Compute,
                at: InstrRef {
                    rank: self.rank,
                    index: 0,
                },
                report: format!("{} panicked (a bug in pipec-run)", self.rank),
            });
        }
    }
}

/// Run `program` (already loaded and checked) with the model built from `layout`.
pub fn run_cpu(
    program: &Program,
    layout: &Layout,
    opts: &RunOptions,
) -> Result<RunReport, RunError> {
    if opts.steps == 0 {
        return Err(RunError::ZeroSteps);
    }
    let world = program.ranks.len();
    let m = program.microbatches;
    let unfit = |e: model::LayoutUnfit| RunError::Refused {
        file: MANIFEST_FILE.into(),
        field: "layout".into(),
        msg: format!("the CPU backend's model cannot run it: {e}"),
    };
    if layout.num_stages() != program.num_stages() {
        return Err(RunError::Refused {
            file: MANIFEST_FILE.into(),
            field: "layout".into(),
            msg: format!(
                "the layout has {} stages, the program {}",
                layout.num_stages(),
                program.num_stages()
            ),
        });
    }
    let full: Vec<Stage<f32>> = model::build(layout, &opts.model).map_err(unfit)?;
    let mut ref_model = opts.check.then(|| full.clone());
    let watch = Arc::new(Watch::new(world, opts.timeout));
    let transport = Transport::<CpuTensor>::new(world, watch.clone());
    let mut backends: Vec<CpuBackend> = (0..world)
        .map(|r| {
            CpuBackend::new(
                Rank(r as u32),
                opts.model,
                m,
                &full,
                &stages_of(program, r),
                transport.clone(),
            )
        })
        .collect();
    drop(full);
    let static_peak = static_peak_activations(program);
    let mut steps = Vec::with_capacity(opts.steps as usize);
    let mut last_runs = Vec::new();
    let mut traced = Vec::new();
    for step in 0..opts.steps {
        transport.reset();
        watch.reset();
        backends.iter_mut().for_each(|b| b.begin_step(step));
        // Every rank thread starts its clock at the same instant, once all are running, so
        // thread start-up does not count as idle time.
        let start = Barrier::new(world);
        let origin: OnceLock<Instant> = OnceLock::new();
        let results: Vec<Result<RankRun, _>> = std::thread::scope(|s| {
            let handles: Vec<_> = backends
                .iter_mut()
                .enumerate()
                .map(|(r, be)| {
                    let watch = &*watch;
                    let (start, origin) = (&start, &origin);
                    std::thread::Builder::new()
                        .name(format!("rank-{r}"))
                        .spawn_scoped(s, move || {
                            let _guard = PanicGuard {
                                watch,
                                rank: Rank(r as u32),
                            };
                            start.wait();
                            let t0 = *origin.get_or_init(Instant::now);
                            run_rank(program, Rank(r as u32), be, watch, t0)
                        })
                        .expect("spawn a rank thread")
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or(Err(crate::interp::Stopped)))
                .collect()
        });
        let mut runs = Vec::with_capacity(world);
        for res in results {
            match res {
                Ok(run) => runs.push(run),
                Err(_) => {
                    return Err(RunError::Failed(watch.failure().unwrap_or_else(|| {
                        Failure {
                            kind: FailureKind::Compute,
                            at: InstrRef {
                                rank: Rank(0),
                                index: 0,
                            },
                            report: "a rank stopped without a report".into(),
                        }
                    })))
                }
            }
        }
        if !program.forward_only {
            reduce_replicas(program, &mut backends);
        }
        // Gather the step's losses and gradients.
        let mut losses: Vec<Option<f32>> = vec![None; m as usize];
        for be in &backends {
            for (mb, l) in be.losses() {
                losses[mb as usize] = Some(l);
            }
        }
        let losses = complete_losses(step, losses)?;
        let loss = model::step_loss(&losses);
        let mut grads: Vec<Option<&StageGrads<f32>>> = vec![None; program.num_stages() as usize];
        if !program.forward_only {
            for be in &backends {
                for (s, g, done) in be.grads() {
                    if done != m {
                        return Err(RunError::Check {
                            step,
                            msg: format!(
                                "stage {s} summed the gradients of {done} microbatches in order, not {m}"
                            ),
                        });
                    }
                    grads[s as usize] = Some(g);
                }
            }
        }
        let check = match ref_model.as_mut() {
            Some(rm) => {
                let r = reference::step(rm, &opts.model, step, m, program.forward_only).map_err(
                    |e| RunError::Check {
                        step,
                        msg: format!("the reference failed: {e}"),
                    },
                )?;
                let summary = compare(step, &losses, loss, &grads, &r, rm)?;
                if !program.forward_only {
                    for (st, g) in rm.iter_mut().zip(&r.grads) {
                        model::sgd(st, g, opts.lr);
                    }
                }
                Some(summary)
            }
            None => None,
        };
        if !program.forward_only {
            backends.iter_mut().for_each(|b| b.sgd(opts.lr));
        }
        let wall = runs.iter().map(|r| r.end_us).fold(0.0, f64::max);
        steps.push(StepReport {
            step,
            loss,
            wall_us: wall,
            ranks: runs
                .iter()
                .map(|r| RankStats {
                    busy_us: r.busy_us,
                    idle_us: (wall - r.busy_us).max(0.0),
                    peak_activations: r.peak_activations,
                })
                .collect(),
            check,
        });
        if opts
            .trace_steps
            .is_some_and(|(a, b)| (a..=b).contains(&step))
        {
            traced.push((step, trace::timeline(&runs)));
        }
        last_runs = runs;
    }
    Ok(RunReport {
        steps,
        static_peak_activations: static_peak,
        timeline: trace::timeline(&last_runs),
        traced,
    })
}

/// Bitwise comparison of a pipelined step with the reference; the first difference is an
/// error naming the tensor and the element.
fn compare(
    step: u32,
    losses: &[f32],
    loss: f32,
    grads: &[Option<&StageGrads<f32>>],
    r: &reference::RefStep,
    model: &[Stage<f32>],
) -> Result<CheckSummary, RunError> {
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
        |_| true,
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
pub(crate) fn for_each_gradient(
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
        let layout = pipec::front::layout::parse("Et|tL").unwrap();
        let stages = model::build::<f32>(&layout, &cfg).unwrap();
        let r = reference::step(&stages, &cfg, 0, 3, false).unwrap();
        let same: Vec<Option<&StageGrads<f32>>> = r.grads.iter().map(Some).collect();
        let ok = compare(0, &r.losses, r.loss, &same, &r, &stages).unwrap();
        assert_eq!(ok.max_abs_diff, 0.0);
        assert_eq!(ok.tensors, 1 + 4 + 4 + 2);

        let mut nudged = r.grads.clone();
        let x = &mut nudged[1][0].tensors[2][[1, 2]];
        *x = f32::from_bits(x.to_bits() + 1);
        let g: Vec<Option<&StageGrads<f32>>> = nudged.iter().map(Some).collect();
        let e = compare(0, &r.losses, r.loss, &g, &r, &stages).unwrap_err();
        assert!(
            e.to_string().contains("stage 1, layer 0 (t), W2[1, 2]"),
            "{e}"
        );

        let mut losses = r.losses.clone();
        losses[2] = f32::from_bits(losses[2].to_bits() + 1);
        let e = compare(0, &losses, r.loss, &same, &r, &stages).unwrap_err();
        assert!(e.to_string().contains("loss of mb 2"), "{e}");
    }
}
