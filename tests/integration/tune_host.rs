//! Issue #40: what `tune` says about host memory (point 2), each framework's own best plan
//! without `--target` (point 11), Megatron's split-backward cost (point 8) and `check`'s
//! layer count against a `[model]` table (point 12).
//!
//! References: host memory against a brute-force reading of each rank's instruction stream
//! (an offloaded activation is certainly on the host from its offload until its reload is
//! posted, and at most until its backward); `per_target` against `tune` run with each
//! `--target` on its own; `split_extra` against the same program costed with `b` and `w`
//! scaled by hand; the layer count against the layout the directory was compiled with.

use crate::harness::pipec;
use pipec_compiler::target::{Levers, Target, TargetChoice};
use pipec_cost::cost::CostModel;
use pipec_cost::memory::Limit;
use pipec_ir::ir::{Instr, MemKind, Program};
use pipec_schedules::{Compute, Pass};
use pipec_tune::{describe, tune, TuneRequest};

/// PipeOffload's units (tests/golden/pipeoffload/README.md): 12 layers a rank, one forward of
/// a rank = 1, activations of a rank's layers for one microbatch = 1; no copy speed given.
fn units() -> String {
    let u = 1.0 / 12.0;
    format!("t.f={u},t.b={u},t.w={u},t.act={u}")
}

/// PipeOffload's pp=4, M=8 case at half of 1F1B's memory (1F1B holds 4 on rank 0).
fn pipeoffload(target: TargetChoice) -> TuneRequest {
    TuneRequest {
        num_layers: Some(48),
        memory_limit: Some(Limit::plain(2.0)),
        target,
        levers: Levers::ALL,
        ..TuneRequest::new(4, 8, CostModel::parse(&units()).unwrap())
    }
}

/// Per rank: (least, most) host memory the offloads of `program` can hold at once, read off
/// the instruction stream by brute force: an activation is on the host from its `offload` at
/// least until its `reload` is posted, and at most until the backward that needs it.
fn host_bounds(program: &Program, act: &[f64]) -> Vec<(f64, f64)> {
    program
        .ranks
        .iter()
        .map(|instrs| {
            let (mut sure, mut maybe) = (Vec::new(), Vec::new());
            let (mut lo, mut hi) = (0.0f64, 0.0f64);
            for ins in instrs {
                match ins {
                    Instr::Memory(m) if m.kind == MemKind::Offload => {
                        sure.push(m.task);
                        maybe.push(m.task);
                    }
                    Instr::Memory(m) if m.kind == MemKind::Reload => {
                        sure.retain(|t| *t != m.task);
                    }
                    Instr::Compute(c) => {
                        for (pass, t) in c.parts() {
                            if matches!(pass, Pass::Bwd | Pass::BwdD) {
                                maybe.retain(|x| *x != t);
                            }
                        }
                    }
                    _ => {}
                }
                let sum = |v: &Vec<pipec_schedules::Task>| -> f64 {
                    v.iter().map(|t| act[t.stage.index()]).sum()
                };
                lo = lo.max(sum(&sure));
                hi = hi.max(sum(&maybe));
            }
            (lo, hi)
        })
        .collect()
}

#[test]
fn host_peaks_are_what_the_offloads_hold_and_the_host_limit_holds() {
    let t = tune(&pipeoffload(TargetChoice::One(Target::Torch))).unwrap();
    let model = CostModel::parse(&units()).unwrap();
    let program = t.program();
    let act = pipec_cost::memory::weights(program, &t.layout, &model).act;
    let bounds = host_bounds(program, &act);
    assert!(
        t.host_peak_memory.iter().any(|&h| h > 0.0),
        "the winner offloads: {}",
        describe(&t.best)
    );
    for (r, (&h, &(lo, hi))) in t.host_peak_memory.iter().zip(&bounds).enumerate() {
        assert!(
            lo - 1e-9 <= h && h <= hi + 1e-9,
            "rank {r}: host {h} outside [{lo}, {hi}]"
        );
        // The verifier's report of the written plan says the same.
        assert_eq!(t.report().memory[r].host, h, "rank {r}");
    }
    let most = t.host_peak_memory.iter().copied().fold(0.0, f64::max);
    assert_eq!(t.best.host_peak_memory, most);
    let json = t.json(0.0);
    assert_eq!(
        json["host_peak_memory"],
        serde_json::json!(t.host_peak_memory)
    );
    // No copy speed given: the report says what was assumed.
    assert!(t.copy_speed_assumed);
    assert_eq!(json["copy_speed"], pipec_tune::COPY_ASSUMED);
    // Half the host memory, then none: every rank within it (by the brute-force least, which
    // the rule may not undercut), never faster than with host memory to spare.
    for cap in [most / 2.0, 0.0] {
        let req = TuneRequest {
            host_memory_limit: Some(Limit::plain(cap)),
            ..pipeoffload(TargetChoice::One(Target::Torch))
        };
        let c = tune(&req).unwrap();
        let act = pipec_cost::memory::weights(c.program(), &c.layout, &model).act;
        for (r, &(lo, _)) in host_bounds(c.program(), &act).iter().enumerate() {
            assert!(lo <= cap + 1e-9, "cap {cap}, rank {r}: {lo} on the host");
            assert!(c.host_peak_memory[r] <= cap + 1e-9, "cap {cap}, rank {r}");
        }
        assert!(c.best.makespan >= t.best.makespan - 1e-9, "cap {cap}");
        assert!(c.best.peak_memory <= 2.0 + 1e-9);
    }
    // With offload as the only lever (Megatron's) and no host memory, a device limit only
    // offloading reaches is refused, and the refusal names the host limit.
    let req = TuneRequest {
        memory_limit: Some(Limit::plain(0.5)),
        host_memory_limit: Some(Limit::plain(0.0)),
        ..pipeoffload(TargetChoice::One(Target::Megatron))
    };
    let e = tune(&req).unwrap_err().to_string();
    assert!(
        e.contains("with at most 0 layer-activations of host memory per rank")
            && e.contains("raise the host memory limit"),
        "{e}"
    );
}

#[test]
fn cli_shows_host_memory_and_the_copy_assumption() {
    let base = |extra: &[&str]| {
        let o = pipec()
            .args(["tune", "--pp", "4", "--microbatches", "8", "--num-layers"])
            .args(["48", "--memory-limit", "2", "--target", "torch", "--cost"])
            .args(extra)
            .output()
            .unwrap();
        assert_eq!(
            o.status.code(),
            Some(0),
            "{}",
            String::from_utf8_lossy(&o.stderr)
        );
        String::from_utf8(o.stdout).unwrap()
    };
    let text = base(&[&units()]);
    let json: serde_json::Value = serde_json::from_str(&base(&[&units(), "--json"])).unwrap();
    let host: Vec<f64> = serde_json::from_value(json["host_peak_memory"].clone()).unwrap();
    let unit = pipec_ir::memory::Unit::LayerActivations;
    let line = format!(
        "host memory per rank (offloaded activations): {}\n",
        unit.list(host.iter().copied())
    );
    assert!(text.contains(&line), "{line}\n{text}");
    assert!(text.contains("copies:   assumed: no `pcie` or `offload` cost given"));
    // A copy speed given: nothing assumed, nothing said.
    let timed = format!("{},t.offload=0.02", units());
    assert!(!base(&[&timed]).contains("copies:"));
    // A byte host limit against unit costs is refused in its flag's name.
    let o = pipec()
        .args([
            "tune",
            "--pp",
            "4",
            "--microbatches",
            "8",
            "--memory-limit",
            "2",
        ])
        .args(["--host-memory-limit", "3GiB"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("--host-memory-limit: the memory limit 3.00GiB is in bytes"),
        "{err}"
    );
}

/// Point 11: without a target, `per_target` gives each framework's own best, which is what
/// `tune` with that target returns (run here on its own), and the common plan is the one
/// written with `-o`.
#[test]
fn per_target_is_what_each_target_returns() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("common");
    let o = pipec()
        .args(["tune", "--pp", "4", "--microbatches", "8", "--num-layers"])
        .args([
            "48",
            "--memory-limit",
            "2",
            "--cost",
            &units(),
            "--json",
            "-o",
        ])
        .arg(&out)
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(0));
    let j: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let common = j["makespan"].as_f64().unwrap();
    let per = j["per_target"].as_object().unwrap();
    assert_eq!(per.len(), Target::FRAMEWORKS.len());
    for t in Target::FRAMEWORKS {
        let own = tune(&pipeoffload(TargetChoice::One(t))).unwrap();
        let p = &per[t.name()];
        // `--json` prints figures rounded (pipec_cost::rounding): equal to 1e-9.
        let close = |a: &serde_json::Value, b: &[f64]| {
            let a: Vec<f64> = serde_json::from_value(a.clone()).unwrap();
            a.len() == b.len()
                && a.iter()
                    .zip(b)
                    .all(|(x, y)| (x - y).abs() <= 1e-9 * y.max(1.0))
        };
        assert_eq!(p["schedule"], describe(&own.best), "{t}");
        assert!(
            close(&serde_json::json!([p["makespan"]]), &[own.best.makespan]),
            "{t}: {p}"
        );
        assert!(close(&p["peak_memory"], &own.peak_memory), "{t}: {p}");
        assert!(
            close(&p["host_peak_memory"], &own.host_peak_memory),
            "{t}: {p}"
        );
        let up = p["gives_up"].as_f64().unwrap();
        assert!(
            (up - (common / own.best.makespan - 1.0)).abs() < 1e-9,
            "{t}"
        );
    }
    // The figures: the common plan is no faster than any framework's own, and torch's
    // and Megatron's own plans offload (they pull the lever the default cannot).
    assert!(per
        .values()
        .all(|p| p["makespan"].as_f64().unwrap() <= common + 1e-9));
    for t in ["torch", "megatron"] {
        assert!(per[t]["makespan"].as_f64().unwrap() < common, "{t}");
        assert!(
            per[t]["schedule"].as_str().unwrap().contains("+ offload"),
            "{t}"
        );
    }
    // -o writes the common plan.
    let manifest: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("manifest.json")).unwrap()).unwrap();
    let loaded = pipec_ir::files::load_dir(&out).unwrap();
    let layout = loaded.manifest.layout.text.clone().unwrap_or_default();
    assert_eq!(layout, j["layout"].as_str().unwrap(), "{manifest}");
    // With a target, no per_target.
    let one = tune(&pipeoffload(TargetChoice::One(Target::Torch))).unwrap();
    assert!(one.json(0.0).get("per_target").is_none());
}

/// Point 8: `split_extra` makes each half of a split backward `1 + x` times its cost, which
/// is what scaling `b` and `w` by hand gives a program that only splits; a whole backward
/// keeps `b + w`.
#[test]
fn split_extra_costs_split_halves_only() {
    let dir = tempfile::tempdir().unwrap();
    let zb = crate::harness::compiled(dir.path(), "zb", "--schedule zb-h2 --pp 4 --microbatches 8");
    let program = &pipec_ir::files::load_dir(&zb).unwrap().program;
    let fused = program.ranks.iter().flatten().any(|i| {
        matches!(
            i,
            Instr::Compute(Compute::Bwd(_)) | Instr::Compute(Compute::FwdBwd { .. })
        )
    });
    assert!(!fused, "zb-h2 splits every backward");
    let sim = |spec: &str, p: &Program| {
        let costs = pipec_cost::cost::StageCosts::uniform(&CostModel::parse(spec).unwrap(), 4);
        pipec_cost::simulate::simulate_unverified(
            &pipec_ir::verify::Unverified::unchecked(p),
            &costs,
        )
        .unwrap()
        .summary
        .makespan
    };
    let x = 0.5;
    assert_eq!(
        sim(&format!("f=1,b=1,w=1,split_extra={x}"), program),
        sim("f=1,b=1.5,w=1.5", program)
    );
    // 1F1B runs whole backwards: split_extra changes nothing.
    let ofb =
        crate::harness::compiled(dir.path(), "ofb", "--schedule 1f1b --pp 4 --microbatches 8");
    let p = pipec_ir::files::load_dir(&ofb).unwrap().program;
    assert_eq!(
        sim("f=1,b=1,w=1,split_extra=0.5", &p),
        sim("f=1,b=1,w=1", &p)
    );
}

/// Point 8: tuned for Megatron, a split-backward plan pays `MEGATRON_SPLIT_EXTRA` (its makespan
/// is its program's under those costs), so it no longer reads as at the lower bound, which
/// keeps a whole backward's costs; other targets are costed as before.
#[test]
fn megatron_split_backward_costs_extra() {
    let model = CostModel::parse("f=1,b=1,w=1").unwrap();
    let req = |t: Target, kinds: &str| TuneRequest {
        num_layers: Some(8),
        kinds: Some(vec![kinds.to_string()]),
        target: TargetChoice::One(t),
        ..TuneRequest::new(4, 8, model.clone())
    };
    let split = |x: f64| CostModel {
        split_extra: Some(x),
        ..model.clone()
    };
    let simulate = |t: &pipec_tune::Tuned, m: &CostModel| {
        let costs = pipec_cost::cost::StageCosts::new(m, &t.layout, t.program().num_stages());
        pipec_cost::simulate::simulate(&t.verified, &costs)
            .unwrap()
            .summary
            .makespan
    };
    let torch = tune(&req(Target::Torch, "zb-h1")).unwrap();
    let mega = tune(&req(Target::Megatron, "zb-h1")).unwrap();
    assert_eq!(torch.best.makespan, simulate(&torch, &model));
    let x = pipec_cost::cost::MEGATRON_SPLIT_EXTRA;
    assert_eq!(mega.best.makespan, simulate(&mega, &split(x)));
    assert!(mega.best.makespan > torch.best.makespan);
    // The bound is a whole backward's, as for torch.
    assert_eq!(mega.lower_bound.value, torch.lower_bound.value);
    assert!(mega.best.makespan > mega.lower_bound.value * 1.05);
    // Given in the costs, the key wins (0: Megatron is costed as torch).
    let zero = TuneRequest {
        model: split(0.0),
        ..req(Target::Megatron, "zb-h1")
    };
    assert_eq!(tune(&zero).unwrap().best.makespan, torch.best.makespan);
}

/// Point 12: `check` compares a directory's decoder layers with the `[model]` table's
/// `num_layers` or `--num-layers`; `tune` takes the table's count and refuses another.
#[test]
fn check_and_tune_compare_the_model_layer_count() {
    let dir = tempfile::tempdir().unwrap();
    let d8 = crate::harness::compiled(
        dir.path(),
        "d8",
        "--schedule 1f1b --pp 4 --microbatches 8 --num-layers 8",
    );
    let layout = pipec_ir::files::load_dir(&d8).unwrap().manifest.layout;
    assert_eq!(layout.count(pipec_schedules::layout::LayerKind::Decoder), 8);
    let table = |n: u32| {
        let f = dir.path().join(format!("m{n}.toml"));
        std::fs::write(
            &f,
            format!(
                "[model]\nhidden = 1024\nffn = 4096\nheads = 16\nseq = 2048\nvocab = 32000\nnum_layers = {n}\n"
            ),
        )
        .unwrap();
        f
    };
    let check = |args: &[&str], file: Option<&std::path::Path>| {
        let mut c = pipec();
        c.arg("check").arg(&d8).args(args);
        if let Some(f) = file {
            c.arg("--cost-file").arg(f);
        }
        c.output().unwrap()
    };
    let o = check(&[], Some(&table(80)));
    assert_eq!(o.status.code(), Some(1));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains(
            "`num_layers`) gives 80 decoder layers, but this directory was compiled for 8"
        ),
        "{err}"
    );
    assert_eq!(check(&[], Some(&table(8))).status.code(), Some(0));
    let o = check(&["--num-layers", "80", "--json"], None);
    assert_eq!(o.status.code(), Some(1));
    let j: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(j["exit_code"], 1);
    assert!(j["error"]
        .as_str()
        .unwrap()
        .contains("--num-layers gives 80"));
    assert_eq!(check(&["--num-layers", "8"], None).status.code(), Some(0));
    // tune: the table's count is the default layer count, and another is refused.
    let o = pipec()
        .args([
            "tune",
            "--pp",
            "4",
            "--microbatches",
            "8",
            "--json",
            "--cost-file",
        ])
        .arg(table(80))
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(0));
    let j: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let l = pipec_schedules::layout::parse(j["layout"].as_str().unwrap()).unwrap();
    assert_eq!(l.count(pipec_schedules::layout::LayerKind::Decoder), 80);
    let o = pipec()
        .args([
            "tune",
            "--pp",
            "4",
            "--microbatches",
            "8",
            "--num-layers",
            "8",
        ])
        .arg("--cost-file")
        .arg(table(80))
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("num_layers = 80"));
    // compile alike: the table's 80 layers split over 4 stages without --num-layers, and a
    // directory of 8 layers costed as the 80-layer model refused before anything is written.
    let compile = |extra: &[&str], out: &str| {
        pipec()
            .args([
                "compile",
                "--schedule",
                "1f1b",
                "--pp",
                "4",
                "--microbatches",
                "8",
            ])
            .args(extra)
            .arg("--cost-file")
            .arg(table(80))
            .arg("-o")
            .arg(dir.path().join(out))
            .output()
            .unwrap()
    };
    let o = compile(&[], "c80");
    assert_eq!(
        o.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let layout = pipec_ir::files::load_dir(&dir.path().join("c80"))
        .unwrap()
        .manifest
        .layout;
    assert_eq!(
        layout.count(pipec_schedules::layout::LayerKind::Decoder),
        80
    );
    assert_eq!(check(&[], None).status.code(), Some(0));
    let o = compile(&["--num-layers", "8"], "c8");
    assert_eq!(o.status.code(), Some(1));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("the layer count asked for gives 8 decoder layers, but the cost model's [model] table says num_layers = 80"),
        "{err}"
    );
    assert!(!dir.path().join("c8").exists());
    let o = compile(&["--layout", "Et|tt|tt|tL"], "cl");
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("the layout gives 6 decoder layers"));
}
