//! `pipec tune` with microbatch lengths (issue #38): the microbatch order it chooses, checked
//! against every schedule it reports compiled by `pipec compile`'s path in each of the four
//! orders (written out here, not taken from the tuner) and simulated; the plan it writes, its
//! memory limit by the verifier, and the CLI's errors.

use crate::harness::pipec;
use assert_cmd::prelude::*;
use pipec_compiler::compile::{compile, CompileRequest};
use pipec_compiler::target::{Target, TargetChoice};
use pipec_cost::cost::{CostModel, StageCosts};
use pipec_schedules::{Lengths, ScheduleKind};
use pipec_tune::{tune, CandidateKind, TuneRequest};

/// Lengths by distribution, M microbatches: uniform, a skewed long tail, bimodal chat plus
/// long context, and packed lines (several documents per microbatch).
fn distributions(m: usize) -> Vec<(&'static str, Lengths)> {
    let uniform: Vec<Vec<i128>> = (0..m).map(|_| vec![2048]).collect();
    // A long tail: most short, every fifth four to eight times longer.
    let tail: Vec<Vec<i128>> = (0..m)
        .map(|i| {
            vec![if i % 5 == 3 {
                8192 - 512 * (i as i128 % 4)
            } else {
                512 + 64 * (i as i128 % 3)
            }]
        })
        .collect();
    // Chat (a few hundred tokens) and long context (8k), interleaved unevenly.
    let bimodal: Vec<Vec<i128>> = (0..m)
        .map(|i| {
            vec![if i % 3 == 0 {
                8192
            } else {
                300 + 37 * i as i128
            }]
        })
        .collect();
    // Packed to at most 8k: documents of varied lengths per line.
    let packed: Vec<Vec<i128>> = (0..m)
        .map(|i| match i % 4 {
            0 => vec![4096, 4096],
            1 => vec![8000],
            2 => vec![1000, 700, 300],
            _ => vec![2000, 100, 100, 50],
        })
        .collect();
    [
        ("uniform", uniform),
        ("long-tail", tail),
        ("bimodal", bimodal),
        ("packed", packed),
    ]
    .into_iter()
    .map(|(n, l)| (n, Lengths::from_lists(l).unwrap()))
    .collect()
}

/// The four orders as the issue defines them, written out independently of the tuner: the
/// sort key is a microbatch's compute cost, linear in its tokens plus `attn` times the sum of
/// its sequences' squared lengths; ties by index.
fn four_orders(l: &Lengths, attn: f64) -> Vec<Vec<u32>> {
    let m = l.microbatches();
    let key = |i: u32| {
        let lin = l.tokens(i).unwrap() as f64;
        let quad: f64 = l.sequences(i).iter().map(|&s| (s as f64).powi(2)).sum();
        lin + attn * quad
    };
    let mut asc: Vec<u32> = (0..m).collect();
    asc.sort_by(|&a, &b| key(a).total_cmp(&key(b)).then(a.cmp(&b)));
    let mut desc: Vec<u32> = (0..m).collect();
    desc.sort_by(|&a, &b| key(b).total_cmp(&key(a)).then(a.cmp(&b)));
    // Dealt alternately to the front and the back.
    let mut sls = vec![0; m as usize];
    let (mut front, mut back) = (0usize, m as usize);
    for (k, &x) in asc.iter().enumerate() {
        if k % 2 == 0 {
            sls[front] = x;
            front += 1;
        } else {
            back -= 1;
            sls[back] = x;
        }
    }
    vec![(0..m).collect(), asc, desc, sls]
}

fn is_permutation(o: &[u32], m: u32) -> bool {
    let mut s = o.to_vec();
    s.sort();
    s == (0..m).collect::<Vec<_>>()
}

/// A built-in kind compiled as `pipec compile` does, in `order`, and simulated; with
/// whether `target` runs the compiled program.
fn compiled_makespan(
    kind: ScheduleKind,
    c: &pipec_tune::Candidate,
    pp: u32,
    l: &Lengths,
    order: &[u32],
    model: &CostModel,
    target: TargetChoice,
) -> (f64, bool) {
    let compiled = compile(&CompileRequest {
        vpp: Some(c.vpp),
        group_size: c.group_size,
        layout: Some(c.layout.clone()),
        lengths: Some(l.clone()),
        microbatch_order: Some(order.to_vec()),
        ..CompileRequest::new(kind, pp, l.microbatches())
    })
    .unwrap();
    let p = &compiled.program;
    let costs = StageCosts::new(model, &compiled.layout, p.num_stages());
    let makespan = pipec_cost::simulate::simulate_unverified(&pipec_tests::unverified(p), &costs)
        .unwrap()
        .summary
        .makespan;
    (makespan, target.refusal(p).is_none())
}

/// On every distribution and under `--target any`, `torch` and the default (every
/// framework), each built-in kind tune reports (1F1B, interleaved, ZB-V, ...) is at least as
/// fast as that kind compiled in each of the four orders the target runs and simulated; the
/// winner is at least as fast as every fitting candidate; every order is a permutation and
/// the winner carries the lengths. torch runs every order (`pipec.torch` renumbers the
/// microbatches for torch's runtime, #38), so tune reorders there as under `any`; with
/// lengths the default means every framework that runs them (megatron, torch, pipec-run:
/// torchtitan and DeepSpeed size receives once), which run every order too.
#[test]
fn tune_is_never_slower_than_the_four_orders() {
    let pp = 4;
    let m = 8;
    let model = CostModel::parse("f=1,b=1.2,w=0.8,p2p=0.05").unwrap();
    for target in [
        TargetChoice::One(Target::Any),
        TargetChoice::One(Target::Torch),
        TargetChoice::Every,
    ] {
        let label = target.label();
        let mut compared = 0;
        let mut refused = 0;
        let mut reordered = 0;
        for (name, l) in distributions(m) {
            let req = TuneRequest {
                kinds: Some(vec![
                    "1f1b".into(),
                    "interleaved-1f1b".into(),
                    "zb-v".into(),
                    "tuned".into(),
                ]),
                lengths: Some(l.clone()),
                target,
                ..TuneRequest::new(pp, m as u32, model.clone())
            };
            let t = tune(&req).unwrap();
            let best = &t.best;
            let o = best
                .microbatch_order
                .as_ref()
                .expect("an order with lengths");
            assert!(is_permutation(o, m as u32), "{label} {name}: {o:?}");
            assert_eq!(t.program().lengths.as_ref(), Some(&l), "{label} {name}");
            assert_eq!(target.refusal(t.program()), None, "{label} {name}");
            if *o != (0..m as u32).collect::<Vec<_>>() {
                reordered += 1;
            }
            for c in &t.candidates {
                let co = c
                    .microbatch_order
                    .as_ref()
                    .expect("every row has its order");
                assert!(is_permutation(co, m as u32), "{label} {name}: {co:?}");
                if c.fits && c.not_runnable.is_none() {
                    assert!(best.makespan <= c.makespan * (1.0 + 1e-9), "{label} {name}");
                }
                let CandidateKind::Builtin(kind) = c.schedule else {
                    continue;
                };
                if c.levers.is_some() || kind.row().tune.timed || c.not_runnable.is_some() {
                    continue;
                }
                for order in four_orders(&l, 0.0) {
                    let (want, runs) = compiled_makespan(kind, c, pp, &l, &order, &model, target);
                    if !runs {
                        refused += 1;
                        continue;
                    }
                    assert!(
                        c.makespan <= want * (1.0 + 1e-9),
                        "{label} {name} {kind}: tune {} > {want} in order {order:?}",
                        c.makespan
                    );
                    compared += 1;
                }
            }
        }
        // Every order runs there, and some distribution gains by one.
        assert_eq!(refused, 0, "{label}");
        assert!(reordered > 0, "{label}");
        assert!(compared >= 4 * 4 * 3, "{label}: {compared}");
    }
}

/// Lengths without a cost model: the default costs, an order chosen, the winner verified.
#[test]
fn lengths_without_a_cost_model() {
    let l = Lengths::from_lists(vec![vec![100], vec![900], vec![300, 200], vec![50]]).unwrap();
    let req = TuneRequest {
        lengths: Some(l.clone()),
        ..TuneRequest::new(2, 4, CostModel::default())
    };
    let t = tune(&req).unwrap();
    assert!(t.report().is_valid());
    assert!(is_permutation(t.best.microbatch_order.as_ref().unwrap(), 4));
    assert_eq!(t.program().lengths, Some(l));
}

/// Lengths that name another microbatch count are refused.
#[test]
fn lengths_must_match_the_microbatches() {
    let l = Lengths::from_lists(vec![vec![100], vec![200]]).unwrap();
    let req = TuneRequest {
        lengths: Some(l),
        ..TuneRequest::new(2, 3, CostModel::default())
    };
    assert!(matches!(
        tune(&req),
        Err(pipec_tune::TuneError::LengthsCount {
            given: 2,
            microbatches: 3
        })
    ));
}

fn write_lengths(dir: &std::path::Path, text: &str) -> std::path::PathBuf {
    let f = dir.join("lengths.txt");
    std::fs::write(&f, text).unwrap();
    f
}

/// The CLI: `--microbatch-lengths` without `--microbatches`, `microbatch_order` in --json
/// (the winner's and every row's), the written plan verified by `pipec check` (under the
/// limit) with `tokens` on its messages and the lengths in its manifest.
#[test]
fn cli_writes_an_ordered_plan_that_checks() {
    let tmp = tempfile::tempdir().unwrap();
    let f = write_lengths(tmp.path(), "512\n4096\n1024, 1024\n8000\n300\n2000 2000\n");
    let out = tmp.path().join("plan");
    let a = pipec()
        .args(["tune", "--pp", "2", "--cost", "f=1,b=1,w=1,t.act=1,p2p=0.1"])
        .arg("--microbatch-lengths")
        .arg(&f)
        .args(["--memory-limit", "6", "--json", "-o"])
        .arg(&out)
        .assert()
        .success();
    let j: serde_json::Value = serde_json::from_slice(&a.get_output().stdout).unwrap();
    let o: Vec<u32> = serde_json::from_value(j["microbatch_order"].clone()).unwrap();
    assert!(is_permutation(&o, 6), "{o:?}");
    assert!(j["microbatch_order_rule"].is_string());
    for c in j["candidates"].as_array().unwrap() {
        let co: Vec<u32> = serde_json::from_value(c["microbatch_order"].clone()).unwrap();
        assert!(is_permutation(&co, 6));
    }
    pipec()
        .arg("check")
        .arg(&out)
        .args(["--memory-limit", "6"])
        .args(["--cost", "f=1,b=1,w=1,t.act=1,p2p=0.1"])
        .assert()
        .success();
    let manifest = std::fs::read_to_string(out.join("manifest.json")).unwrap();
    assert!(manifest.contains("microbatch_lengths"), "{manifest}");
    let rank0 = std::fs::read_to_string(out.join("rank-0.json")).unwrap();
    assert!(rank0.contains("\"tokens\""));
    // The human report names the order.
    let a = pipec()
        .args(["tune", "--pp", "2", "--microbatch-lengths"])
        .arg(&f)
        .assert()
        .success();
    let text = String::from_utf8_lossy(&a.get_output().stdout).to_string();
    assert!(text.contains("microbatch order: "), "{text}");
}

/// A bad lengths file is exit 1 naming its line; a disagreeing --microbatches is exit 1.
#[test]
fn cli_refuses_bad_lengths() {
    let tmp = tempfile::tempdir().unwrap();
    let f = write_lengths(tmp.path(), "512\n40\n0\n8\n");
    let a = pipec()
        .args(["tune", "--pp", "2", "--microbatch-lengths"])
        .arg(&f)
        .assert()
        .code(1);
    let err = String::from_utf8_lossy(&a.get_output().stderr).to_string();
    assert!(err.contains("line 3"), "{err}");
    let f = write_lengths(tmp.path(), "512\n40\n8\n");
    let a = pipec()
        .args([
            "tune",
            "--pp",
            "2",
            "--microbatches",
            "4",
            "--microbatch-lengths",
        ])
        .arg(&f)
        .assert()
        .code(1);
    let err = String::from_utf8_lossy(&a.get_output().stderr).to_string();
    assert!(err.contains("--microbatches 4 disagrees"), "{err}");
    let a = pipec()
        .args([
            "compare",
            "--schedule",
            "1f1b",
            "--pp",
            "2",
            "--microbatches",
            "4",
        ])
        .arg("--microbatch-lengths")
        .arg(&f)
        .assert()
        .code(1);
    let err = String::from_utf8_lossy(&a.get_output().stderr).to_string();
    assert!(err.contains("disagrees"), "{err}");
}

/// `pipec compare --microbatch-lengths`: each --schedule row is the kind compiled with the
/// lengths (index order) and simulated, as `compile` then `simulate` give it.
#[test]
fn compare_takes_lengths() {
    let tmp = tempfile::tempdir().unwrap();
    let f = write_lengths(tmp.path(), "512\n4096\n1024\n8000\n");
    let cost = "f=1,b=1,w=1,p2p=0.1";
    let a = pipec()
        .args([
            "compare",
            "--schedule",
            "1f1b",
            "--pp",
            "2",
            "--json",
            "--cost",
            cost,
        ])
        .arg("--microbatch-lengths")
        .arg(&f)
        .assert()
        .success();
    let j: serde_json::Value = serde_json::from_slice(&a.get_output().stdout).unwrap();
    let got = j["schedules"][0]["makespan"].as_f64().expect("a makespan");
    let l = Lengths::parse(&std::fs::read_to_string(&f).unwrap()).unwrap();
    let compiled = compile(&CompileRequest {
        num_layers: Some(2),
        lengths: Some(l),
        ..CompileRequest::new(ScheduleKind::OneFOneB, 2, 4)
    })
    .unwrap();
    let model = CostModel::parse(cost).unwrap();
    let costs = StageCosts::new(&model, &compiled.layout, compiled.program.num_stages());
    let want = pipec_cost::simulate::simulate_unverified(
        &pipec_tests::unverified(&compiled.program),
        &costs,
    )
    .unwrap()
    .summary
    .makespan;
    assert!(
        (got - want).abs() <= 1e-9 * want.max(1.0),
        "{got} vs {want}"
    );
}

/// Under a memory limit, with every live activation weighed by its microbatch's tokens: the
/// winner's peak, measured again by the one memory rule on its program, is within the limit,
/// and no fitting candidate is faster.
#[test]
fn the_winner_fits_the_limit_by_the_memory_rule() {
    let (pp, m) = (4u32, 8usize);
    let model = CostModel::parse("f=1,b=1.2,w=0.8,t.act=1,p2p=0.05").unwrap();
    let (_, l) = distributions(m).swap_remove(2);
    let free = tune(&TuneRequest {
        lengths: Some(l.clone()),
        ..TuneRequest::new(pp, m as u32, model.clone())
    })
    .unwrap();
    // A limit below the unlimited winner's peak, above the smallest candidate's.
    let least = free
        .candidates
        .iter()
        .map(|c| c.peak_memory)
        .fold(f64::INFINITY, f64::min);
    let limit = (least + free.best.peak_memory) / 2.0;
    assert!(
        limit < free.best.peak_memory,
        "{limit} {}",
        free.best.peak_memory
    );
    let t = tune(&TuneRequest {
        lengths: Some(l.clone()),
        memory_limit: Some(pipec_cost::memory::Limit::parse(&format!("{limit}")).unwrap()),
        ..TuneRequest::new(pp, m as u32, model.clone())
    })
    .unwrap();
    let program = t.program();
    assert_eq!(program.lengths.as_ref(), Some(&l));
    let mem = pipec_cost::memory::weights(program, &t.layout, &model);
    let peak = pipec_ir::memory::peaks(program, &mem)
        .iter()
        .map(|p| p.peak)
        .fold(0.0, f64::max);
    assert!(peak <= limit * (1.0 + 1e-9), "{peak} > {limit}");
    for c in t
        .candidates
        .iter()
        .filter(|c| c.fits && c.not_runnable.is_none())
    {
        assert!(t.best.makespan <= c.makespan * (1.0 + 1e-9));
    }
}

/// The CLI under `--target torch` reorders (torch runs every order through `pipec.torch`'s
/// renumbering, #38), and so does the default, which with lengths means the frameworks that
/// run them (torchtitan and DeepSpeed refuse lengths); torch's winner is no slower than the
/// default's (it allows as much or more). Both plans check.
#[test]
fn cli_target_torch_and_the_default_reorder() {
    let tmp = tempfile::tempdir().unwrap();
    let f = write_lengths(tmp.path(), "8000\n512\n4096\n300\n1024 1024\n2000 2000\n");
    let cost = "f=1,b=1,w=1,p2p=0.1";
    let run = |target: Option<&str>| {
        let out = tmp
            .path()
            .join(format!("plan-{}", target.unwrap_or("default")));
        let mut cmd = pipec();
        cmd.args(["tune", "--pp", "2", "--cost", cost, "--json"])
            .arg("--microbatch-lengths")
            .arg(&f)
            .arg("-o")
            .arg(&out);
        if let Some(t) = target {
            cmd.args(["--target", t]);
        }
        let a = cmd.assert().success();
        pipec().arg("check").arg(&out).assert().success();
        let j: serde_json::Value = serde_json::from_slice(&a.get_output().stdout).unwrap();
        let o: Vec<u32> = serde_json::from_value(j["microbatch_order"].clone()).unwrap();
        (o, j["makespan"].as_f64().unwrap())
    };
    let (torch, torch_time) = run(Some("torch"));
    let (default, default_time) = run(None);
    assert!(is_permutation(&torch, 6), "{torch:?}");
    assert_ne!(torch, (0..6).collect::<Vec<u32>>());
    assert!(is_permutation(&default, 6), "{default:?}");
    assert_ne!(default, (0..6).collect::<Vec<u32>>());
    assert!(torch_time <= default_time, "{torch_time} vs {default_time}");
}

/// When no order of any schedule fits the limit, the refusal's "smallest peak reached" is the
/// least peak over the orders weighed, not the fastest order's: here 1F1B alone, whose peak in
/// each of the four orders is measured independently (compiled in that order and weighed by
/// the memory rule).
#[test]
fn no_fit_names_the_least_peak_over_the_orders() {
    let (pp, m) = (4u32, 8usize);
    let (_, l) = distributions(m)
        .into_iter()
        .find(|(n, _)| *n == "bimodal")
        .expect("a bimodal distribution");
    let model = CostModel::parse("f=1,b=1,w=1,t.act=1,p2p=0.05").unwrap();
    let req = TuneRequest {
        kinds: Some(vec!["1f1b".into()]),
        lengths: Some(l.clone()),
        target: TargetChoice::One(Target::Any),
        levers: pipec_compiler::target::Levers::NONE,
        ..TuneRequest::new(pp, m as u32, model.clone())
    };
    // The layer split tune weighs 1F1B on (without a limit).
    let layout = tune(&req).unwrap().best.layout;
    let peaks: Vec<f64> = four_orders(&l, 0.0)
        .iter()
        .map(|order| {
            let p = compile(&CompileRequest {
                lengths: Some(l.clone()),
                microbatch_order: Some(order.clone()),
                layout: Some(layout.clone()),
                ..CompileRequest::new(ScheduleKind::OneFOneB, pp, m as u32)
            })
            .unwrap();
            let w = pipec_cost::memory::weights(&p.program, &p.layout, &model);
            pipec_ir::memory::peaks(&p.program, &w)
                .iter()
                .map(|r| r.peak)
                .fold(0.0, f64::max)
        })
        .collect();
    let least = peaks.iter().copied().fold(f64::INFINITY, f64::min);
    let req = TuneRequest {
        memory_limit: Some(pipec_cost::memory::Limit::plain(least * 0.5)),
        ..req
    };
    let e = tune(&req).unwrap_err().to_string();
    let shown = pipec_ir::memory::Unit::LayerActivations.fmt(least);
    assert!(
        e.contains(&format!("reached is {shown}")),
        "{e} (orders' peaks {peaks:?})"
    );
}

/// The default (every framework) with lengths gives run instructions only where a framework
/// runs such a plan: torchtitan (torch's CSV carries no shapes) and DeepSpeed (one receive
/// size) are "not runnable" lines with the reason, pipec-run's line says the cuda backend
/// refuses lengths, and `--json`'s `run` has no entry for the two.
#[test]
fn default_run_lines_leave_out_frameworks_that_cannot_run_lengths() {
    let tmp = tempfile::tempdir().unwrap();
    let f = write_lengths(tmp.path(), "512\n4096\n1024, 1024\n8000\n");
    let run = |json: bool| {
        let mut c = pipec();
        c.args([
            "tune",
            "--pp",
            "2",
            "--num-layers",
            "4",
            "--microbatch-lengths",
        ])
        .arg(&f);
        if json {
            c.arg("--json");
        }
        let o = c.output().unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        String::from_utf8(o.stdout).unwrap()
    };
    let text = run(false);
    let section = &text[text.find("\nrun it").expect("run section")..];
    let section = &section[..section[1..].find("\n\n").map_or(section.len(), |e| e + 1)];
    for t in ["torchtitan", "deepspeed"] {
        let line = section
            .lines()
            .find(|l| l.trim_start().starts_with(&format!("{t}:")))
            .unwrap_or_else(|| panic!("{t}\n{section}"));
        assert!(
            line.contains("not runnable: its microbatches have different lengths"),
            "{line}"
        );
    }
    assert!(
        !section.contains("--parallelism.pipeline_parallel_schedule_csv"),
        "{section}"
    );
    assert!(
        section.contains("not on NVIDIA GPUs: the cuda backend runs microbatches of one length")
    );
    assert!(!section.contains("--backend cuda"), "{section}");
    let json: serde_json::Value = serde_json::from_str(&run(true)).unwrap();
    let keys: Vec<&String> = json["run"].as_object().unwrap().keys().collect();
    assert_eq!(keys, ["megatron", "pipec-run", "torch"], "{json}");
}
