//! One memory model for every command (issue 28): the same schedule reports the same peak, in
//! the same unit, from `compile`, `check`, `simulate`, `show`, `compare` and `tune`; byte
//! limits work where the costs are in bytes and are refused (saying what to add) where they
//! are not; the manifest keeps the cost model a schedule was planned with. Expected peaks are
//! computed here by brute force from the written rank files: walk each rank's instructions,
//! hold `(stage, mb)` from its forward to its `bwd` (or `bwd_W`), weigh it by the layers of
//! its stage, add the parameters of every stage the rank holds (both directions' copies for a
//! bidirectional placement).

use serde_json::Value;
use std::collections::HashSet;
use std::path::Path;
use std::process::Output;

const GIB: f64 = 1073741824.0;

/// Per layer kind: bytes (or layer-activations) of one layer.
type Table<'a> = Vec<(&'a str, f64)>;

fn pipec_output(args: &[&str]) -> Output {
    crate::harness::pipec_with(args)
        .output()
        .expect("pipec runs")
}

fn ok(args: &[&str]) -> String {
    let o = pipec_output(args);
    assert!(
        o.status.success(),
        "pipec {args:?}: {}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8(o.stdout).unwrap()
}

fn json(args: &[&str]) -> Value {
    serde_json::from_str(&ok(args)).expect("JSON")
}

fn read(p: &Path) -> Value {
    serde_json::from_slice(&std::fs::read(p).unwrap()).unwrap()
}

/// Per-kind (act, param) of a layer, as the test's own table.
fn layer(kind: &str, act: &[(&str, f64)], param: &[(&str, f64)]) -> (f64, f64) {
    let get = |t: &[(&str, f64)]| t.iter().find(|(k, _)| *k == kind).map_or(0.0, |x| x.1);
    (get(act), get(param))
}

/// Brute-force peak memory per rank of a written directory.
fn brute(dir: &Path, act: &[(&str, f64)], param: &[(&str, f64)]) -> Vec<f64> {
    let m = read(&dir.join("manifest.json"));
    let stages: Vec<(f64, f64)> = m["layout"]["stages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            s.as_array().unwrap().iter().fold((0.0, 0.0), |acc, k| {
                let (a, p) = layer(k.as_str().unwrap(), act, param);
                (acc.0 + a, acc.1 + p)
            })
        })
        .collect();
    let pl = &m["placement"];
    let pp = pl["pp"].as_u64().unwrap() as usize;
    let table: Vec<usize> = pl["stage_rank"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as usize)
        .collect();
    // Parameters: every rank that runs some microbatch of a stage holds a copy.
    let mut params = vec![0.0; pp];
    for (s, &r) in table.iter().enumerate() {
        let mut holders = HashSet::from([r]);
        if pl.get("mirror_from").is_some_and(|x| !x.is_null()) {
            holders.insert(pp - 1 - r);
        }
        for h in holders {
            params[h] += stages[s].1;
        }
    }
    (0..pp)
        .map(|r| {
            let f = read(&dir.join(format!("rank-{r}.json")));
            let mut live: HashSet<(u64, u64)> = HashSet::new();
            let (mut cur, mut peak) = (0.0f64, 0.0f64);
            for ins in f["instructions"].as_array().unwrap() {
                let g = |k: &str| ins[k].as_u64().unwrap();
                let mut frees = Vec::new();
                match ins["op"].as_str().unwrap() {
                    "fwd" => {
                        live.insert((g("stage"), g("mb")));
                        cur += stages[g("stage") as usize].0;
                    }
                    "bwd" | "bwd_W" => frees.push((g("stage"), g("mb"))),
                    "fwd_bwd" => {
                        live.insert((g("fwd_stage"), g("fwd_mb")));
                        cur += stages[g("fwd_stage") as usize].0;
                        frees.push((g("bwd_stage"), g("bwd_mb")));
                    }
                    _ => continue,
                }
                peak = peak.max(cur);
                for t in frees {
                    if live.remove(&t) {
                        cur -= stages[t.0 as usize].0;
                    }
                }
            }
            params[r] + peak
        })
        .collect()
}

fn floats(v: &Value) -> Vec<f64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect()
}

/// 1F1B and ZB-V on the same 16-layer model at pp = 4: every command gives the brute-force
/// peak per rank, in layer-activations by default and in bytes under `t.act=1GiB`, and
/// `compare` no longer says 4 against 8 for two schedules that both hold 16 layers.
#[test]
fn every_command_reports_the_brute_force_peak_in_one_unit() {
    let tmp = tempfile::tempdir().unwrap();
    let cases = [
        ("1f1b", "Et*4|t*4|t*4|t*4L"),
        ("zb-v", "Ett|tt|tt|tt|tt|tt|tt|ttL"),
    ];
    for (cost, unit, scale) in [
        (None, "layer-activations", 1.0),
        (Some("t.act=1GiB,t.param=0.5GiB"), "bytes", GIB),
    ] {
        let (act, param): (Table, Table) = match cost {
            None => (vec![("t", 1.0)], vec![]),
            Some(_) => (vec![("t", GIB)], vec![("t", 0.5 * GIB)]),
        };
        let mut worst = Vec::new();
        for (kind, layout) in cases {
            let dir = tmp.path().join(format!("{kind}-{unit}"));
            let d = dir.to_str().unwrap();
            let mut args = vec![
                "compile",
                "--schedule",
                kind,
                "--pp",
                "4",
                "--microbatches",
                "8",
                "--layout",
                layout,
                "-o",
                d,
            ];
            let mut c = vec![];
            if let Some(spec) = cost {
                c = vec!["--cost", spec];
            }
            args.extend(&c);
            let compiled = ok(&args);
            let want = brute(&dir, &act, &param);
            let mut check = vec!["check", d, "--json"];
            check.extend(&c);
            let r = json(&check);
            assert_eq!(r["memory_unit"], unit);
            let got: Vec<f64> = r["memory"]
                .as_array()
                .unwrap()
                .iter()
                .map(|m| m["peak"].as_f64().unwrap())
                .collect();
            assert_eq!(got, want, "{kind} {unit}: check --json memory[r].peak");
            // The manifest recorded the cost model: show/simulate use it without --cost.
            let s = json(&["simulate", d, "--json"]);
            assert_eq!(s["memory_unit"], unit);
            let sim: Vec<f64> = s["ranks"]
                .as_array()
                .unwrap()
                .iter()
                .map(|r| r["peak_memory"].as_f64().unwrap())
                .collect();
            assert_eq!(sim, want, "{kind} {unit}: simulate --json");
            let w = want.iter().cloned().fold(0.0, f64::max);
            worst.push(w);
            // Text: every command labels the figure with its unit.
            let label = if scale == 1.0 {
                format!("{} layer-activations", w)
            } else {
                format!("{:.2}GiB", w / GIB)
            };
            let show = ok(&["show", d]);
            assert!(
                show.contains(&format!("peak memory {label} (worst rank)")),
                "{show}"
            );
            let text = ok(&["simulate", d]);
            assert!(text.contains(&format!("peak memory {label}")), "{text}");
            let first = if scale == 1.0 {
                format!("{}", want[0])
            } else {
                format!("{:.2}GiB", want[0] / GIB)
            };
            assert!(
                compiled.contains(&format!("peak memory per rank: {first} ")),
                "{compiled}"
            );
            assert!(!compiled.contains("peak activations"), "{compiled}");
        }
        // compare: both schedules side by side, the same figures as above.
        let mut args = vec![
            "compare",
            "--schedule",
            "1f1b",
            "--schedule",
            "zb-v",
            "--pp",
            "4",
            "--microbatches",
            "8",
            "--num-layers",
            "16",
            "--json",
        ];
        if let Some(spec) = cost {
            args.extend(["--cost", spec]);
        }
        let c = json(&args);
        let peaks: Vec<f64> = c["schedules"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| {
                assert_eq!(s["memory_unit"], unit);
                s["peak_memory"].as_f64().unwrap()
            })
            .collect();
        assert_eq!(peaks, worst, "compare --json under {cost:?}");
    }
}

/// `check --cost-file F --memory-limit 80GiB --json` in CI: under the limit exit 0, over it
/// exit 1 with a memory violation that names both figures in GiB; `compile` refuses to
/// write the same schedule over the limit.
#[test]
fn byte_limits_work_in_check_and_compile() {
    let tmp = tempfile::tempdir().unwrap();
    let cost = tmp.path().join("model.toml");
    std::fs::write(&cost, "t.act = 2GiB\nt.param = 1GiB\n").unwrap();
    let c = cost.to_str().unwrap();
    let dir = tmp.path().join("s");
    let d = dir.to_str().unwrap();
    ok(&[
        "compile",
        "--schedule",
        "1f1b",
        "--pp",
        "4",
        "--microbatches",
        "8",
        "--num-layers",
        "16",
        "-o",
        d,
    ]);
    let want = brute(&dir, &[("t", 2.0 * GIB)], &[("t", GIB)]);
    // Rank 0: 4 layers of parameters + 4 microbatches x 4 layers x 2 GiB = 36 GiB.
    assert_eq!(want[0], 36.0 * GIB);
    let r = json(&[
        "check",
        d,
        "--cost-file",
        c,
        "--memory-limit",
        "80GiB",
        "--json",
    ]);
    assert_eq!(r["valid"], true);
    assert_eq!(r["memory"][0]["peak"].as_f64().unwrap(), want[0]);
    let o = pipec_output(&[
        "check",
        d,
        "--cost-file",
        c,
        "--memory-limit",
        "30GiB",
        "--json",
    ]);
    assert_eq!(o.status.code(), Some(1));
    let r: Value = serde_json::from_slice(&o.stdout).unwrap();
    let v = &r["violations"][0];
    assert_eq!(v["kind"], "memory_limit");
    assert_eq!(v["peak"].as_f64().unwrap(), want[0]);
    assert!(
        v["message"]
            .as_str()
            .unwrap()
            .contains("more than 30.00GiB"),
        "{v}"
    );
    // Ranks under the limit are not reported.
    let over: Vec<u64> = r["violations"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["rank"].as_u64().unwrap())
        .collect();
    let expect: Vec<u64> = (0..4).filter(|&i| want[i as usize] > 30.0 * GIB).collect();
    assert_eq!(over, expect);
    // compile refuses to write it.
    let out = tmp.path().join("refused");
    let o = pipec_output(&[
        "compile",
        "--schedule",
        "1f1b",
        "--pp",
        "4",
        "--microbatches",
        "8",
        "--num-layers",
        "16",
        "--cost-file",
        c,
        "--memory-limit",
        "30GiB",
        "-o",
        out.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(1));
    assert!(!out.exists());
    // A plain number is in the report's unit: layer-activations without byte costs.
    let o = pipec_output(&["check", d, "--memory-limit", "15"]);
    assert_eq!(
        o.status.code(),
        Some(1),
        "rank 0 holds 16 layer-activations"
    );
    assert_eq!(
        pipec_output(&["check", d, "--memory-limit", "16"])
            .status
            .code(),
        Some(0)
    );
}

/// A byte limit against costs without bytes is refused by every command that takes one, and
/// the message says what to add, instead of comparing 40 GiB with 1-byte activations.
#[test]
fn a_byte_limit_without_byte_costs_says_what_to_add() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("s");
    let d = dir.to_str().unwrap();
    ok(&[
        "compile",
        "--schedule",
        "1f1b",
        "--pp",
        "2",
        "--microbatches",
        "4",
        "-o",
        d,
    ]);
    let out = tmp.path().join("o");
    let o = out.to_str().unwrap();
    for args in [
        vec!["check", d, "--memory-limit", "40GiB"],
        vec![
            "compile",
            "--schedule",
            "1f1b",
            "--pp",
            "2",
            "--microbatches",
            "4",
            "--memory-limit",
            "40GiB",
            "-o",
            o,
        ],
        vec![
            "tune",
            "--pp",
            "2",
            "--microbatches",
            "4",
            "--memory-limit",
            "40GiB",
        ],
    ] {
        let r = pipec_output(&args);
        assert_eq!(r.status.code(), Some(1), "{args:?}");
        let err = String::from_utf8_lossy(&r.stderr);
        assert!(err.contains("t.act="), "{args:?}: {err}");
        assert!(!err.contains("0.0MiB"), "{err}");
    }
}

/// `tune -o DIR --cost ...` records its cost model; `show DIR` then draws tune's timeline
/// (the makespan tune reported), not the default model's, and `--cost` still overrides it.
#[test]
fn the_manifest_keeps_tunes_cost_model() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("t");
    let d = dir.to_str().unwrap();
    let spec = "t.f=1,t.b=2,t.w=1,E.f=1,L.f=3,t.act=1GiB";
    let t = json(&[
        "tune",
        "--pp",
        "4",
        "--microbatches",
        "8",
        "--num-layers",
        "8",
        "--cost",
        spec,
        "-o",
        d,
        "--json",
    ]);
    let makespan = t["makespan"].as_f64().expect("tune --json makespan");
    let s = json(&["simulate", d, "--json"]);
    let recorded = read(&dir.join("manifest.json"))["cost"].clone();
    assert!(recorded.is_string(), "manifest cost: {recorded}");
    assert_eq!(s["makespan"].as_f64().unwrap(), makespan);
    // The same figures as simulating under the spec itself.
    let direct = json(&["simulate", d, "--json", "--cost", spec]);
    assert_eq!(s["makespan"], direct["makespan"]);
    assert_eq!(s["ranks"], direct["ranks"]);
    let default = json(&["simulate", d, "--json", "--cost", "f=1"]);
    assert_ne!(s["makespan"], default["makespan"]);
    let show = ok(&["show", d]);
    assert!(show.contains(&format!(
        "makespan {} cost units",
        pipec::simulate::cost::num(s["makespan"].as_f64().unwrap())
    )));
    assert_eq!(s["memory_unit"], "bytes");
    assert_eq!(
        floats(&t["peak_memory"]),
        s["ranks"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["peak_memory"].as_f64().unwrap())
            .collect::<Vec<_>>()
    );
    // Without a cost model the manifest has no `cost` (files unchanged).
    let plain = tmp.path().join("p");
    ok(&[
        "compile",
        "--schedule",
        "1f1b",
        "--pp",
        "2",
        "--microbatches",
        "4",
        "-o",
        plain.to_str().unwrap(),
    ]);
    assert!(read(&plain.join("manifest.json")).get("cost").is_none());
}

/// DualPipe places every stage on two ranks: each rank holds both copies' parameters, which
/// the brute force adds up from the placement, and check and simulate agree with it.
#[test]
fn dualpipe_parameters_count_twice() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("d");
    let d = dir.to_str().unwrap();
    let spec = "t.act=1GiB,t.param=3GiB";
    ok(&[
        "compile",
        "--schedule",
        "dualpipe",
        "--pp",
        "4",
        "--microbatches",
        "8",
        "--num-layers",
        "8",
        "--cost",
        spec,
        "-o",
        d,
    ]);
    let want = brute(&dir, &[("t", GIB)], &[("t", 3.0 * GIB)]);
    let r = json(&["check", d, "--json"]);
    for (i, m) in r["memory"].as_array().unwrap().iter().enumerate() {
        // 4 stages of 2 layers on 4 ranks, two copies each: 2 stages x 2 layers x 3 GiB.
        assert_eq!(m["params"].as_f64().unwrap(), 12.0 * GIB, "rank {i}");
        assert_eq!(m["peak"].as_f64().unwrap(), want[i], "rank {i}");
    }
    let s = json(&["simulate", d, "--json"]);
    for (i, rk) in s["ranks"].as_array().unwrap().iter().enumerate() {
        assert_eq!(rk["peak_memory"].as_f64().unwrap(), want[i], "rank {i}");
    }
}
