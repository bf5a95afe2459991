//! The CPU runtime executes memory instructions (issue 30): offload to a host store, reload,
//! wait_offload, checkpointed forwards and recompute, with real tensors. Judged by
//! - the single-thread reference (`pipec_runtime::reference`, the model run without
//!   pipelining): a run with memory instructions must match it bitwise (`check`), as the same
//!   program without them does, so their gradients are bitwise equal; the step losses of both
//!   runs are compared bit for bit too (later steps depend on every earlier gradient);
//! - the brute-force buffer replay of `offload.rs` (shares no code with the runtime or with
//!   `pipec::ir::activations`) and the verifier's `pipec::memory::walk`: the measured device and
//!   host peaks of every rank must equal both;
//! - the offload planner's own profile (`pipec::tune::offload::plan`) for its inserts;
//! - `pipec check --json` for the `pipec-run` CLI.

use crate::harness::pipec_run;
use crate::offload::{
    every_memory_op_1f1b, has, insert, kinds, mem, program, replay, with_memory_ops, Rng,
};
use pipec::front::layout::Layout;
use pipec::ir::{Instr, InstrRef, MemKind, Program};
use pipec::memory::{MemoryModel, Unit};
use pipec::verify::{verified, VerifyOptions};
use pipec_runtime::model::ModelConfig;
use pipec_runtime::run::{run_cpu_unchecked, run_cpu_with_memory};
use pipec_runtime::watchdog::FailureKind;
use pipec_runtime::{RunError, RunOptions, RunReport};
use pipec_schedules::{Compute, Pass, Rank, ScheduleKind, Task};
use std::time::Duration;

fn opts(steps: u32) -> RunOptions {
    RunOptions {
        model: ModelConfig {
            hidden: 4,
            ffn: 8,
            vocab: 8,
            seq: 3,
            seed: 3,
        },
        steps,
        check: true,
        timeout: Duration::from_secs(20),
        ..RunOptions::default()
    }
}

/// Run `p` (verified first) with memory metered in `mm`; every step checked bitwise against
/// the reference.
fn run(p: &Program, mm: &MemoryModel, steps: u32) -> RunReport {
    let v = verified(p.clone(), &VerifyOptions::default())
        .unwrap_or_else(|r| panic!("does not verify: {}", r.report));
    let r = run_cpu_with_memory(&v, &Layout::uniform(p.num_stages()), &opts(steps), mm)
        .unwrap_or_else(|e| panic!("{e}"));
    for s in &r.steps {
        let c = s.check.as_ref().expect("checked");
        assert_eq!(c.max_abs_diff, 0.0);
    }
    r
}

/// The measured peaks of every step and rank equal the replay's (parameters added) and the
/// verifier's.
fn assert_measured(what: &str, q: &Program, mm: &MemoryModel, r: &RunReport) {
    let walk = pipec::memory::peaks(q, mm);
    assert_eq!(r.static_memory, walk, "{what}");
    for s in &r.steps {
        for (rank, st) in s.ranks.iter().enumerate() {
            let (device, host) = replay(&q.ranks[rank], |t| mm.act[t.stage.index()]);
            let params = mm.param[rank];
            let at = format!("{what}: step {} rank {rank}", s.step);
            assert_eq!(st.peak_memory, params + device, "{at}: device, replay");
            assert_eq!(st.host_memory, host, "{at}: host, replay");
            assert_eq!(st.peak_memory, walk[rank].peak, "{at}: device, verifier");
            assert_eq!(st.host_memory, walk[rank].host, "{at}: host, verifier");
        }
        let counted: Vec<u32> = s.ranks.iter().map(|x| x.peak_activations).collect();
        assert_eq!(
            counted, r.static_peak_activations,
            "{what}: activation count"
        );
    }
}

fn losses(r: &RunReport) -> Vec<u32> {
    r.steps.iter().map(|s| s.loss.to_bits()).collect()
}

fn memory_ops(q: &Program) -> usize {
    q.ranks
        .iter()
        .flatten()
        .filter(|i| matches!(i, Instr::Memory(_) | Instr::FwdCheckpoint(_)))
        .count()
}

/// Random valid memory instructions in compiled schedules of every kind: the run with them
/// trains bitwise as the run without them, and measures the replay's and the verifier's
/// peaks, device and host, under random stage weights and parameters.
#[test]
fn random_memory_ops_run_bitwise_and_measure_the_verifiers_peaks() {
    let mut rng = Rng(0x30);
    let mut executed = 0;
    for (kind, vpp) in kinds() {
        for (pp, m) in [(2, 4), (4, 4)] {
            let Some(p) = program(kind, pp, vpp, m) else {
                continue;
            };
            let mm = MemoryModel {
                act: (0..p.num_stages())
                    .map(|_| (1 + rng.below(5)) as f64)
                    .collect(),
                param: (0..p.world()).map(|_| rng.below(3) as f64).collect(),
                unit: Unit::LayerActivations,
            };
            let base = run(&p, &mm, 2);
            assert_measured(&format!("{kind:?} pp {pp} plain"), &p, &mm, &base);
            for seed in 0..2 {
                let q = with_memory_ops(&p, &mut rng);
                let what = format!("{kind:?} pp {pp} seed {seed}");
                let got = run(&q, &mm, 2);
                assert_eq!(losses(&got), losses(&base), "{what}: step losses");
                assert_measured(&what, &q, &mm, &got);
                executed += memory_ops(&q);
            }
        }
    }
    assert!(executed > 200, "{executed} memory instructions ran");
}

/// The offload planner's inserts (PipeOffload's planning) under a limit below the plain peak:
/// the run trains bitwise as without them and measures the peak the planner planned.
#[test]
fn planned_offloads_run_at_the_planned_peak() {
    use pipec::simulate::cost::{CostModel, StageCosts};
    use pipec::tune::offload::{plan, RankInput};
    let mut runs = Vec::new();
    for ((kind, vpp), (pp, m)) in kinds().into_iter().flat_map(|k| [(k, (2, 4)), (k, (4, 8))]) {
        let Some(p) = program(kind, pp, vpp, m) else {
            continue;
        };
        let costs = StageCosts::uniform(&CostModel::default(), p.num_stages());
        let sim =
            pipec::simulate::simulate_unverified(&pipec::verify::Unverified::unchecked(&p), &costs)
                .unwrap();
        let inputs: Vec<RankInput> = pipec::tune::offload::inputs(&p, &sim.timeline, |_| 0.0);
        let act = |t: Task| 1.0 + (t.stage.0 % 3) as f64;
        let mm = MemoryModel {
            act: (0..p.num_stages()).map(|s| 1.0 + (s % 3) as f64).collect(),
            param: vec![0.0; p.world() as usize],
            unit: Unit::LayerActivations,
        };
        let top = pipec::memory::peaks(&p, &mm)
            .iter()
            .map(|w| w.peak)
            .fold(0.0, f64::max);
        let f = costs.compute(&Compute::Fwd(Task::new(0, 0))).unwrap();
        let Some((limit, plans)) = [(0.5, 0.5), (0.75, 0.25), (0.75, 0.05), (0.9, 0.05)]
            .into_iter()
            .filter_map(|(l, c)| {
                plan(&inputs, l * top, act, |_| c * f)
                    .ok()
                    .map(|x| (l * top, x))
            })
            .find(|(_, plans)| plans.iter().any(|rp| !rp.inserts.is_empty()))
        else {
            continue;
        };
        // The tuner's own placement of the inserts (what `tune` writes).
        let q = pipec::tune::levers::insert(&p, &plans);
        assert!(memory_ops(&q) > 0, "{kind:?} pp {pp}: nothing planned");
        let base = run(&p, &mm, 1);
        let got = run(&q, &mm, 1);
        let what = format!("{kind:?} pp {pp} m {m} planned");
        assert_eq!(losses(&got), losses(&base), "{what}");
        assert_measured(&what, &q, &mm, &got);
        for (r, rp) in plans.iter().enumerate() {
            let peak = got.steps[0].ranks[r].peak_memory;
            assert_eq!(peak, rp.peak, "{what} rank {r}: the planner's peak");
            assert!(peak <= limit, "{what} rank {r}: over the limit");
        }
        // The limit is below the plain run's worst rank, which the offloads brought under it.
        let worst = |r: &RunReport| {
            r.steps[0]
                .ranks
                .iter()
                .map(|x| x.peak_memory)
                .fold(0.0, f64::max)
        };
        assert!(worst(&got) < worst(&base), "{what}");
        runs.push(what);
    }
    assert!(runs.len() >= 6, "{runs:?}");
}

/// 1F1B, 2 ranks, 2 microbatches, and where rank 0 runs each pass of `t`.
fn small() -> (Program, impl Fn(&Program, Task, Pass) -> usize) {
    let p = program(ScheduleKind::OneFOneB, 2, 1, 2).unwrap();
    let at = |q: &Program, t: Task, pass: Pass| {
        q.ranks[0]
            .iter()
            .position(|i| {
                has(i, t, &[pass]) || (pass == Pass::Fwd && *i == Instr::FwdCheckpoint(t))
            })
            .unwrap()
    };
    (p, at)
}

/// What the verifier rejects, the runtime stops at (run unchecked, as `pipec-run
/// --no-verify` may reach it): a schedule error naming the rank and instruction, never a
/// panic.
#[test]
fn misused_memory_instructions_stop_with_a_schedule_error() {
    let (p, at) = small();
    let t = Task::new(0, 0);
    let (fwd, bwd) = (at(&p, t, Pass::Fwd), at(&p, t, Pass::Bwd));
    let with = |ins: Vec<(usize, Instr)>, checkpoint: bool| {
        let mut q = p.clone();
        q.ranks[0] = insert(&p.ranks[0], ins);
        if checkpoint {
            let f = at(&q, t, Pass::Fwd);
            q.ranks[0][f] = Instr::FwdCheckpoint(t);
        }
        q
    };
    let cases: Vec<(Program, &str)> = vec![
        (
            with(vec![(fwd + 1, mem(MemKind::Offload, t))], false),
            "bwd(stage 0, mb 0): the saved activation of stage 0, mb 0 is on the host: offloaded and not reloaded",
        ),
        (
            with(vec![], true),
            "bwd(stage 0, mb 0): the activation of stage 0, mb 0 was checkpointed and is not recomputed yet",
        ),
        (
            with(vec![(bwd, mem(MemKind::Recompute, t))], false),
            "recompute(stage 0, mb 0): nothing to recompute: fwd(stage 0, mb 0) was not checkpointed",
        ),
        (
            with(vec![(bwd, mem(MemKind::Reload, t))], false),
            "reload(stage 0, mb 0): nothing to reload: the activation of stage 0, mb 0 is not on the host",
        ),
        (
            with(vec![(fwd, mem(MemKind::Offload, t))], false),
            "offload(stage 0, mb 0): nothing to offload: the saved activation of stage 0, mb 0 is not here",
        ),
        (
            with(vec![(bwd, mem(MemKind::WaitOffload, t))], false),
            "wait_offload(stage 0, mb 0): no offload of stage 0, mb 0 was posted before",
        ),
    ];
    for (q, want) in cases {
        let report = pipec::verify::verify(&q, &VerifyOptions::default());
        assert!(!report.is_valid(), "the verifier accepts {want}");
        let layout = Layout::uniform(q.num_stages());
        let f = match run_cpu_unchecked(&q, &layout, &opts(1)) {
            Err(RunError::Failed(f)) => f,
            other => panic!("{want}: {:?}", other.map(|r| r.steps.len())),
        };
        assert_eq!(f.kind, FailureKind::Schedule, "{}", f.report);
        let index = q.ranks[0]
            .iter()
            .position(|i| want.starts_with(&i.to_string()))
            .unwrap() as u32;
        assert_eq!(
            f.at,
            InstrRef {
                rank: Rank(0),
                index
            },
            "{}",
            f.report
        );
        let head = format!("schedule error at rank 0, #{index} {want}");
        assert!(f.report.starts_with(&head), "{}\nwant {head}", f.report);
    }
}

/// `pipec-run` on a written directory with every memory instruction: exit 0, the check
/// passes, and the measured peaks it prints (text and JSON) are `pipec check --json`'s.
/// `--no-verify` on a directory whose backward finds its activation on the host stops with
/// exit 1 naming the instruction.
#[test]
fn pipec_run_executes_memory_instructions_and_prints_the_verifiers_peaks() {
    use pipec::back::files::{write_program, write_unverified, Encoding, Header};
    let (c, q) = every_memory_op_1f1b();
    let header = Header {
        source: "generated",
        schedule: Some(c.spec),
        layout: &c.layout,
    };
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("mem");
    let v = verified(q.clone(), &VerifyOptions::default()).unwrap();
    write_program(&dir, &header, &v, Encoding::Json).unwrap();
    let out = crate::harness::pipec()
        .args(["check", "--json"])
        .arg(&dir)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0));
    let check: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let figure = |m: &serde_json::Value, k: &str| m.get(k).and_then(|x| x.as_f64()).unwrap_or(0.0);
    let want: Vec<(f64, f64)> = check["memory"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| (figure(m, "peak"), figure(m, "host")))
        .collect();
    assert_eq!(want[0].1, 1.0, "rank 0 offloads: {check}");

    let out = pipec_run()
        .args(["--check", "--steps", "2", "--json"])
        .arg(&dir)
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    for s in j["steps"].as_array().unwrap() {
        let got: Vec<(f64, f64)> = s["ranks"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| (figure(r, "peak_memory"), figure(r, "host_memory")))
            .collect();
        assert_eq!(got, want, "{j}");
        assert_eq!(s["check"]["max_abs_diff"], 0.0);
    }
    assert_eq!(j["memory_unit"], check["memory_unit"]);

    let out = pipec_run().arg("--check").arg(&dir).output().unwrap();
    assert_eq!(out.status.code(), Some(0));
    let text = String::from_utf8_lossy(&out.stdout);
    let list = |f: &dyn Fn(&(f64, f64)) -> f64| {
        want.iter()
            .map(|x| Unit::LayerActivations.fmt(f(x)))
            .collect::<Vec<_>>()
            .join(" ")
    };
    let (peaks, hosts) = (list(&|x| x.0), list(&|x| x.1));
    let line = format!(
        "peak memory per rank (layer-activations): {peaks} measured, verifier {peaks}; host {hosts} measured, verifier {hosts}\n"
    );
    assert!(text.contains(&line), "{text}\nwant {line}");

    // Without the reload, the backward finds its activation on the host.
    let mut broken = q.clone();
    let reload = broken.ranks[0]
        .iter()
        .position(|i| *i == mem(MemKind::Reload, Task::new(0, 0)))
        .unwrap();
    broken.ranks[0].remove(reload);
    let bad = tmp.path().join("bad");
    let unverified = pipec::verify::Unverified::unchecked(&broken);
    write_unverified(&bad, &header, &unverified, Encoding::Json).unwrap();
    // `--no-verify` keeps the structural level, which already names it (the runtime's own
    // error on the same program: `misused_memory_instructions_stop_with_a_schedule_error`).
    let out = pipec_run().arg("--no-verify").arg(&bad).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains(&format!("rank 0, #{reload} bwd(stage 0, mb 0)"))
            && err.contains("while its activations are on the host"),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
}

/// Random valid memory instructions, then one of them removed, moved or doubled, run
/// unchecked (as `pipec-run --no-verify` would, past the structural level): a program the
/// verifier accepts runs bitwise at the verifier's peaks; a run that stops does so with a
/// schedule error naming a rank and instruction, on a program the verifier rejects; nothing
/// panics.
#[test]
fn mutated_memory_instructions_stop_cleanly_or_run_as_verified() {
    let mut rng = Rng(0x5eed);
    let (mut valid, mut stopped) = (0, 0);
    let o = RunOptions {
        timeout: Duration::from_secs(5),
        ..opts(1)
    };
    for case in 0..80 {
        let (kind, vpp) = kinds()[case % kinds().len()];
        let Some(p) = program(kind, 2, vpp, 4) else {
            continue;
        };
        let mut q = with_memory_ops(&p, &mut rng);
        let sites: Vec<(usize, usize)> = q
            .ranks
            .iter()
            .enumerate()
            .flat_map(|(r, instrs)| {
                instrs
                    .iter()
                    .enumerate()
                    .filter(|(_, i)| matches!(i, Instr::Memory(_) | Instr::FwdCheckpoint(_)))
                    .map(move |(i, _)| (r, i))
            })
            .collect();
        if sites.is_empty() {
            continue;
        }
        let (r, i) = sites[rng.below(sites.len())];
        let ins = q.ranks[r][i];
        let what = format!("case {case} {kind:?}: {ins} at rank {r}, #{i}");
        match (ins, rng.below(3)) {
            // A checkpointed forward back to a plain one, or dropped with its output.
            (Instr::FwdCheckpoint(t), 0) => q.ranks[r][i] = Instr::Compute(Compute::Fwd(t)),
            (_, 0) => {
                q.ranks[r].remove(i);
            }
            (_, 1) => {
                q.ranks[r].remove(i);
                let to = rng.below(q.ranks[r].len() + 1);
                q.ranks[r].insert(to, ins);
            }
            _ => {
                let to = rng.below(q.ranks[r].len() + 1);
                q.ranks[r].insert(to, ins);
            }
        }
        let report = pipec::verify::verify(&q, &VerifyOptions::default());
        let layout = Layout::uniform(q.num_stages());
        match run_cpu_unchecked(&q, &layout, &o) {
            Ok(got) => {
                if report.is_valid() {
                    valid += 1;
                    assert_eq!(got.steps[0].check.as_ref().unwrap().max_abs_diff, 0.0);
                    let mm = pipec_runtime::run::memory_model(&q, &layout, None);
                    assert_measured(&what, &q, &mm, &got);
                }
            }
            Err(RunError::Failed(f)) => {
                stopped += 1;
                assert!(!report.is_valid(), "{what}: verified, but {}", f.report);
                assert_eq!(f.kind, FailureKind::Schedule, "{what}: {}", f.report);
                let head = format!("schedule error at {}, #{} ", f.at.rank, f.at.index);
                assert!(f.report.starts_with(&head), "{what}: {}", f.report);
            }
            Err(e) => panic!("{what}: {e}"),
        }
    }
    assert!(
        valid > 5 && stopped > 10,
        "{valid} valid, {stopped} stopped"
    );
}
