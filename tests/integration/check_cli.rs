//! What `pipec check` (and every command that takes a schedule directory) tells a user: the
//! compute-only CSV caveat, a pipec file where its directory is expected, a bounded risk
//! summary with `--strict`, JSON on stdout whatever happens, and `pipec seal`.

use crate::harness::{compile, pipec_run_on, pipec_with};
use pipec::back::files::{self, COMPUTE_ONLY_CAVEAT};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// Run `c`; its exit code, stdout and stderr. Never a panic of the binary.
fn run(mut c: Command) -> (i32, String, String) {
    let o: Output = c.output().expect("run");
    let (out, err) = (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    );
    assert!(!err.contains("panicked"), "panic: {err}");
    (o.status.code().expect("exit code"), out, err)
}

// ---------------------------------------------------------------------------------------------
// The compute-only CSV caveat.

/// check, show, simulate and import of a compute-only CSV (and of a directory imported from
/// one) say, in one sentence, that the communication checked is pipec's own; a compute+comms
/// CSV (whose communication is the file's) and a compiled directory do not.
#[test]
fn check_compute_only_csv_says_torch_places_its_own_comms() {
    let tmp = tempfile::tempdir().unwrap();
    // GPipe's order at pp=2, M=2, compute only (no SEND/RECV cell: torch lowers it itself).
    let csv = tmp.path().join("gpipe.csv");
    std::fs::write(&csv, "0F0,0F1,0B1,0B0\n1F0,1F1,1B1,1B0\n").unwrap();
    // The same schedule with its communication written out (compute+comms).
    let comms = tmp.path().join("comms.csv");
    std::fs::write(
        &comms,
        "0F0,0SEND_F0,0F1,0SEND_F1,0RECV_B1,0B1,0RECV_B0,0B0\n\
         1RECV_F0,1F0,1RECV_F1,1F1,1B1,1SEND_B1,1B0,1SEND_B0\n",
    )
    .unwrap();
    let imported = tmp.path().join("imported");
    let mut c = pipec_with(["import"]);
    c.arg(&csv).arg("-o").arg(&imported);
    let (code, out, err) = run(c);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains(&format!("note: {COMPUTE_ONLY_CAVEAT}")),
        "{out}"
    );
    let compiled = tmp.path().join("compiled");
    compile(&compiled, "--schedule gpipe --pp 2 --microbatches 2");
    for (input, has) in [
        (&csv, true),
        (&imported, true),
        (&comms, false),
        (&compiled, false),
    ] {
        let note = format!("note: {COMPUTE_ONLY_CAVEAT}");
        for cmd in ["check", "show", "simulate"] {
            let mut c = pipec_with([cmd]);
            c.arg(input);
            if cmd == "show" {
                c.arg("--no-color");
            }
            let (code, out, err) = run(c);
            assert_eq!(code, 0, "{cmd} {}: {err}", input.display());
            assert_eq!(out.contains(&note), has, "{cmd} {}: {out}", input.display());
            // Exactly once.
            assert!(out.matches(COMPUTE_ONLY_CAVEAT).count() <= 1, "{out}");
        }
        for cmd in ["check", "simulate"] {
            let mut c = pipec_with([cmd, "--json"]);
            c.arg(input);
            let (code, out, err) = run(c);
            assert_eq!(code, 0, "{err}");
            let v: Value = serde_json::from_str(&out).unwrap();
            let want = if has {
                Value::from(COMPUTE_ONLY_CAVEAT)
            } else {
                Value::Null
            };
            assert_eq!(v.get("caveat").unwrap_or(&Value::Null), &want, "{cmd}");
        }
    }
    assert!(COMPUTE_ONLY_CAVEAT.contains("_add_send_recv"));
    assert!(COMPUTE_ONLY_CAVEAT.contains("torchtitan"));
}

// ---------------------------------------------------------------------------------------------
// A file where a directory is expected, and the reverse.

/// Every command that takes DIR, given one of pipec's own files (known by content, so a
/// renamed copy too), answers with its directory and exit 2, not a CSV parse error.
#[test]
fn check_manifest_file_says_pass_directory() {
    let tmp = tempfile::tempdir().unwrap();
    let json = tmp.path().join("zbv");
    compile(&json, "--schedule zb-v --pp 2 --microbatches 4");
    let bin = tmp.path().join("zbvbin");
    compile(&bin, "--schedule zb-v --pp 2 --microbatches 4 --format bin");
    let renamed = tmp.path().join("schedule.csv");
    std::fs::copy(json.join("manifest.json"), &renamed).unwrap();
    let cases: [(PathBuf, &str, &Path); 4] = [
        (json.join("manifest.json"), "the manifest", &json),
        (json.join("rank-1.json"), "rank 1's instructions", &json),
        (bin.join("rank-1.bin"), "rank 1's instructions", &bin),
        (renamed.clone(), "the manifest", tmp.path()),
    ];
    for (file, what, dir) in &cases {
        let want = format!(
            "{}: this is a pipec instruction file ({what}), not a schedule directory: pass its directory, {}",
            file.display(),
            dir.display()
        );
        let out = tmp.path().join("out.dot");
        let mut cmds: Vec<(String, Command)> = Vec::new();
        for cmd in ["check", "show", "simulate"] {
            let mut c = pipec_with([cmd]);
            c.arg(file);
            cmds.push((cmd.to_string(), c));
        }
        let mut c = pipec_with(["export"]);
        c.arg(file).args(["--format", "dot", "-o"]).arg(&out);
        cmds.push(("export".into(), c));
        cmds.push(("pipec-run".into(), pipec_run_on(file, &[])));
        cmds.push(("seal".into(), {
            let mut c = pipec_with(["seal"]);
            c.arg(file);
            c
        }));
        for (name, c) in cmds {
            let (code, _, err) = run(c);
            assert_eq!(code, 2, "{name} {}: {err}", file.display());
            assert!(err.contains(&want), "{name}: {err}\nwant: {want}");
            assert!(!err.contains("stage number"), "{name}: {err}");
        }
        // import reads CSVs only: the directory is already a schedule.
        let mut c = pipec_with(["import"]);
        c.arg(file).arg("-o").arg(tmp.path().join("x"));
        let (code, _, err) = run(c);
        assert_eq!(code, 2, "{err}");
        assert!(err.contains("--format torch-csv"), "{err}");
    }
    let mut c = pipec_with(["import"]);
    c.arg(&json).arg("-o").arg(tmp.path().join("x"));
    let (code, _, err) = run(c);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains(&format!(
            "{}: a directory, not a torch CSV file: {} is already a compiled schedule",
            json.display(),
            json.display()
        )),
        "{err}"
    );
    // A directory of schedules (a sweep's output) names one of them.
    let (code, _, err) = run({
        let mut c = pipec_with(["check"]);
        c.arg(tmp.path());
        c
    });
    assert_eq!(code, 2);
    assert!(
        err.contains("not a compiled schedule (no manifest.json), but it holds 2")
            && err.contains(&format!("{}", json.display())),
        "{err}"
    );
    // A missing path is named as given, not as the manifest inside it.
    let nope = tmp.path().join("nope");
    let (code, _, err) = run({
        let mut c = pipec_with(["check"]);
        c.arg(&nope);
        c
    });
    assert_eq!(code, 2);
    assert!(err.contains(&format!("{}: ", nope.display())), "{err}");
    assert!(!err.contains("manifest.json"), "{err}");
}

/// `pipec-run x.csv` (and `pipec.load`, tested in Python) say to import a torch CSV first:
/// running needs the placement choices only `import` takes, made once and written down.
#[test]
fn pipec_run_csv_says_import_it() {
    let tmp = tempfile::tempdir().unwrap();
    let csv = tmp.path().join("x.csv");
    std::fs::write(&csv, "0F0,0B0\n").unwrap();
    let (code, out, err) = run(pipec_run_on(&csv, &[]));
    assert_eq!(code, 2, "{err}");
    assert!(out.is_empty(), "{out}");
    assert!(
        err.contains(&format!(
            "{}: a file, not a compiled schedule directory (manifest.json and rank files); a torch CSV schedule becomes one with `pipec import {} -o DIR`",
            csv.display(),
            csv.display()
        )),
        "{err}"
    );
    // Doing what it says works.
    let dir = tmp.path().join("dir");
    let mut c = pipec_with(["import"]);
    c.arg(&csv).args(["--pp", "1", "-o"]).arg(&dir);
    assert_eq!(run(c).0, 0);
    let (code, _, err) = run(pipec_run_on(&dir, &[]));
    assert_eq!(code, 0, "{err}");
}

// ---------------------------------------------------------------------------------------------
// Risks: summarised, capped, `--all-risks`, `--strict`.

/// The risks of a directory counted from its files alone: each comm batch (a maximal run of
/// consecutive send/recv with one batch id, not left in flight by a later `wait`) with two
/// or more messages in one direction to one peer is one risk per (direction, peer).
fn count_risks(dir: &Path) -> usize {
    let m: Value =
        serde_json::from_slice(&std::fs::read(dir.join("manifest.json")).unwrap()).unwrap();
    let mut n = 0;
    for e in m["ranks"].as_array().unwrap() {
        let f: Value =
            serde_json::from_slice(&std::fs::read(dir.join(e["file"].as_str().unwrap())).unwrap())
                .unwrap();
        let ins = f["instructions"].as_array().unwrap();
        let waited: std::collections::HashSet<u64> = ins
            .iter()
            .filter(|i| i["op"] == "wait")
            .map(|i| i["batch"].as_u64().unwrap())
            .collect();
        let msg = |i: &Value| i["op"] == "send" || i["op"] == "recv";
        let mut k = 0;
        while k < ins.len() {
            if !msg(&ins[k]) {
                k += 1;
                continue;
            }
            let id = ins[k]["batch"].as_u64().unwrap();
            let mut end = k;
            while end < ins.len() && msg(&ins[end]) && ins[end]["batch"].as_u64() == Some(id) {
                end += 1;
            }
            if !waited.contains(&id) {
                let mut ways: Vec<(String, u64)> = ins[k..end]
                    .iter()
                    .map(|i| (i["op"].to_string(), i["peer"].as_u64().unwrap()))
                    .collect();
                ways.sort();
                let mut j = 0;
                while j < ways.len() {
                    let same = ways[j..].iter().take_while(|w| **w == ways[j]).count();
                    if same > 1 {
                        n += 1;
                    }
                    j += same;
                }
            }
            k = end;
        }
    }
    n
}

#[test]
fn check_risks_summarised_and_strict() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("dv");
    compile(&dir, "--schedule dualpipe-v --pp 8 --microbatches 32");
    let total = count_risks(&dir);
    assert!(total > 20, "{total}");
    let check = |extra: &[&str]| {
        let mut c = pipec_with(["check"]);
        c.arg(&dir).args(extra);
        run(c)
    };
    let (code, out, err) = check(&[]);
    assert_eq!(code, 0, "{err}");
    let shown = out.lines().filter(|l| l.starts_with("  [risk] ")).count();
    assert_eq!(shown, 5, "{out}");
    assert!(
        out.contains(&format!("risks: {total} ({total} same_peer_twice)")),
        "{out}"
    );
    assert!(
        out.contains(&format!(
            "  ... and {} more (pipec check {} --all-risks lists them all",
            total - 5,
            dir.display()
        )),
        "{out}"
    );
    // Bounded: the verdict, the summary, 5 risks, the tail, then one line per rank.
    assert_eq!(out.lines().count(), 1 + 1 + 5 + 1 + 1 + 8, "{out}");
    // Every risk on request, each naming its rank and instruction.
    let (code, all, _) = check(&["--all-risks"]);
    assert_eq!(code, 0);
    let listed: Vec<&str> = all.lines().filter(|l| l.starts_with("  [risk] ")).collect();
    assert_eq!(listed.len(), total);
    assert!(listed
        .iter()
        .all(|l| l.starts_with("  [risk] rank ") && l.contains(", #")));
    assert!(!all.contains("more (pipec check"));
    // --strict fails the job on risks, and says so.
    let (code, out, _) = check(&["--strict"]);
    assert_eq!(code, 1);
    assert!(
        out.contains(&format!(
            "{}: FAILED under --strict: {total} risks",
            dir.display()
        )),
        "{out}"
    );
    // JSON: the same cap, the summary, the exit code.
    let (code, out, _) = check(&["--json"]);
    assert_eq!(code, 0);
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["risks"].as_array().unwrap().len(), 5);
    assert_eq!(v["risk_summary"]["total"], total);
    assert_eq!(v["risk_summary"]["shown"], 5);
    assert_eq!(v["risk_summary"]["by_kind"]["same_peer_twice"], total);
    assert_eq!(v["exit_code"], 0);
    assert_eq!(v["valid"], true);
    let (code, out, _) = check(&["--json", "--all-risks", "--strict"]);
    assert_eq!(code, 1);
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["risks"].as_array().unwrap().len(), total);
    assert_eq!(v["exit_code"], 1);
    assert_eq!(v["strict"], true);
    // A schedule without risks passes --strict.
    let clean = tmp.path().join("1f1b");
    compile(&clean, "--schedule 1f1b --pp 4 --microbatches 8");
    assert_eq!(count_risks(&clean), 0);
    let mut c = pipec_with(["check", "--strict"]);
    c.arg(&clean);
    let (code, out, _) = run(c);
    assert_eq!(code, 0, "{out}");
    assert!(!out.contains("risks:"), "{out}");
}

// ---------------------------------------------------------------------------------------------
// JSON on stdout whatever happens.

/// `check --json` (and `pipec-run --json`) print one JSON document on stdout on every error,
/// with the message and the exit code the process returns.
#[test]
fn check_json_on_load_error() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("s");
    compile(&dir, "--schedule 1f1b --pp 2 --microbatches 2");
    let garbled = tmp.path().join("garbled.csv");
    std::fs::write(&garbled, "0F0,0F1xyz\n").unwrap();
    let edited = tmp.path().join("edited");
    compile(&edited, "--schedule 1f1b --pp 2 --microbatches 2");
    let f = edited.join("rank-0.json");
    let t = std::fs::read_to_string(&f).unwrap();
    std::fs::write(&f, t.replacen("\"mb\":0", "\"mb\":1", 1)).unwrap();
    let cases: Vec<(Vec<std::ffi::OsString>, i32, String)> = vec![
        (vec![tmp.path().join("missing").into()], 2, "missing".into()),
        (
            vec![dir.join("manifest.json").into()],
            2,
            "pass its directory".into(),
        ),
        (vec![garbled.clone().into()], 1, "0F1xyz".into()),
        (vec![edited.clone().into()], 2, "pipec seal".into()),
        (
            vec![dir.clone().into(), "--pp".into(), "2".into()],
            2,
            "--pp applies to torch CSV input only".into(),
        ),
    ];
    for (args, want_code, want) in cases {
        let mut c = pipec_with(["check", "--json"]);
        c.args(&args);
        let (code, out, err) = run(c);
        assert_eq!(code, want_code, "{args:?}: {err}");
        let v: Value =
            serde_json::from_str(&out).unwrap_or_else(|e| panic!("{args:?}: {e}: {out:?}"));
        assert_eq!(v["exit_code"], want_code);
        assert_eq!(v["valid"], false);
        let msg = v["error"].as_str().unwrap();
        assert!(msg.contains(&want), "{msg}");
        // The same message on stderr, for a person reading the log.
        assert!(err.contains(msg), "{err}");
    }
    let (code, out, _) = run(pipec_run_on(&edited, &["--json"]));
    assert_eq!(code, 1);
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["exit_code"], 1);
    assert!(v["error"].as_str().unwrap().contains("content hash"));
}

// ---------------------------------------------------------------------------------------------
// `pipec seal`.

fn seal(dir: &Path) -> (i32, String, String) {
    let mut c = pipec_with(["seal"]);
    c.arg(dir);
    run(c)
}

/// Bytes of every file of `dir`, by name.
fn snapshot(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut v: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            (
                e.file_name().into_string().unwrap(),
                std::fs::read(e.path()).unwrap(),
            )
        })
        .collect();
    v.sort();
    v
}

#[test]
fn seal_then_check_judges_content() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("s");
    compile(&dir, "--schedule 1f1b --pp 2 --microbatches 2");
    // pipec's own output: nothing to seal, nothing written, not marked.
    let before = snapshot(&dir);
    let (code, out, _) = seal(&dir);
    assert_eq!(code, 0);
    assert!(out.contains("nothing to seal"), "{out}");
    assert_eq!(snapshot(&dir), before);
    // Rank 0 sends microbatch 1's activation before microbatch 0's: swap its two sends (and
    // their forwards, so that each send still follows its producer).
    let f = dir.join("rank-0.json");
    let text = std::fs::read_to_string(&f).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    let at = |needle: &str| lines.iter().position(|l| l.contains(needle)).unwrap();
    let (f0, s0) = (
        at(r#"{"op":"fwd","stage":0,"mb":0}"#),
        at(r#"{"op":"send","peer":1,"payload":"act","stage":0,"mb":0"#),
    );
    let (f1, s1) = (
        at(r#"{"op":"fwd","stage":0,"mb":1}"#),
        at(r#"{"op":"send","peer":1,"payload":"act","stage":0,"mb":1"#),
    );
    assert_eq!((f0, s0, f1, s1), (7, 8, 9, 10), "{text}");
    let mut edited: Vec<String> = lines.iter().map(|l| l.to_string()).collect();
    let swap_mb = |l: &str| {
        l.replace("\"mb\":0", "\"mb\":X")
            .replace("\"mb\":1", "\"mb\":0")
            .replace("\"mb\":X", "\"mb\":1")
    };
    for i in [f0, s0, f1, s1] {
        edited[i] = swap_mb(lines[i]);
    }
    std::fs::write(&f, edited.join("\n") + "\n").unwrap();
    // Before sealing: refused as changed, with the way out named.
    let mut c = pipec_with(["check"]);
    c.arg(&dir);
    let (code, _, err) = run(c);
    assert_eq!(code, 2);
    assert!(
        err.contains("content hash") && err.contains(&format!("pipec seal {}", dir.display())),
        "{err}"
    );
    let (code, out, err) = seal(&dir);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains(&format!("sealed {}: 2 rank files", dir.display())),
        "{out}"
    );
    assert!(
        out.contains("changed since their hashes were written: rank-0.json\n"),
        "{out}"
    );
    let m: files::Manifest =
        serde_json::from_slice(&std::fs::read(dir.join("manifest.json")).unwrap()).unwrap();
    assert_eq!(m.sealed_by.as_deref(), Some("pipec seal"));
    // Now the content is judged: rank 1 receives microbatch 1's activation where it expects
    // microbatch 0's (its recv #0), and the reverse (#2: after fwd(1, 0) and its send).
    let mut c = pipec_with(["check"]);
    c.arg(&dir);
    let (code, out, _) = run(c);
    assert_eq!(code, 1, "{out}");
    let first = out.lines().next().unwrap();
    assert!(
        first.starts_with(&format!(
            "{} (sealed by pipec seal): INVALID",
            dir.display()
        )),
        "{out}"
    );
    assert!(
        out.contains("[wrong tensor] rank 1, #0 recv(act of stage 0, mb 0 <- rank 0) would receive act of stage 0, mb 1 sent at rank 0, #1"),
        "{out}"
    );
    assert!(out.contains("note: sealed by `pipec seal`"), "{out}");
    let mut c = pipec_with(["check", "--json"]);
    c.arg(&dir);
    let v: Value = serde_json::from_str(&run(c).1).unwrap();
    assert_eq!(v["sealed_by"], "pipec seal");
    // Sealing again: nothing to do.
    let sealed = snapshot(&dir);
    assert!(seal(&dir).1.contains("nothing to seal"));
    assert_eq!(snapshot(&dir), sealed);

    // A tool writing its own files: no hashes at all, its own JSON layout (pretty-printed,
    // keys in another order). Sealed, they load as the program they hold.
    let c = pipec::compile::compile(&pipec::compile::CompileRequest::new(
        pipec_schedules::ScheduleKind::OneFOneB,
        2,
        3,
    ))
    .unwrap();
    let own = tmp.path().join("own");
    std::fs::create_dir(&own).unwrap();
    let header = files::Header {
        source: "generated",
        schedule: Some(c.spec),
        layout: &c.layout,
    };
    for (name, bytes) in files::render(
        &header,
        &pipec_tests::verified(&c.program),
        files::Encoding::Json,
    ) {
        let mut v: Value = serde_json::from_slice(&bytes).unwrap();
        let o = v.as_object_mut().unwrap();
        o.remove("schedule_hash");
        if name == "manifest.json" {
            for e in o["ranks"].as_array_mut().unwrap() {
                let e = e.as_object_mut().unwrap();
                e.remove("sha256");
                e.remove("instructions");
            }
            o.insert("compiler".into(), "mytool 1.0".into());
        }
        // serde_json's map is sorted: `instructions` before `rank` and friends.
        std::fs::write(own.join(name), serde_json::to_string_pretty(&v).unwrap()).unwrap();
    }
    let mut c2 = pipec_with(["check"]);
    c2.arg(&own);
    assert_eq!(run(c2).0, 2, "unsealed files of another tool are refused");
    let (code, out, err) = seal(&own);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("sealed"), "{out}");
    let loaded = files::load_dir(&own).unwrap();
    assert_eq!(loaded.program, c.program);
    assert_eq!(loaded.manifest.compiler, "mytool 1.0");
    assert_eq!(loaded.manifest.sealed_by.as_deref(), Some("pipec seal"));
    let mut c2 = pipec_with(["check"]);
    c2.arg(&own);
    let (code, out, _) = run(c2);
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains("(sealed by pipec seal): verified: 2 ranks"),
        "{out}"
    );
    // And it runs.
    let (code, _, err) = run(pipec_run_on(&own, &["--check"]));
    assert_eq!(code, 0, "{err}");
}

/// Sealing refuses malformed files with the loader's precise message (file, field or line),
/// exit 2, and leaves the directory as it was; no input makes it panic.
#[test]
fn seal_refuses_malformed_files_precisely() {
    let tmp = tempfile::tempdir().unwrap();
    let base = tmp.path().join("base");
    compile(&base, "--schedule 1f1b --pp 2 --microbatches 2");
    let cases: [(&str, &str, &str, &str); 7] = [
        (
            "rank-0.json",
            r#""op":"recv""#,
            r#""op":"recvv""#,
            "rank-0.json: not a valid pipec file: unknown variant `recvv`",
        ),
        (
            "rank-0.json",
            r#""stage":0,"mb":0},"#,
            r#""stage":0,"mb":0}"#,
            "rank-0.json: not a valid pipec file: expected `,` or `]` at line 9 column 5",
        ),
        (
            "rank-1.json",
            "\"rank\": 1,",
            "\"rank\": 0,",
            "rank-1.json: field `rank` is 0, but the manifest says 1",
        ),
        (
            "rank-0.json",
            "\"world_size\": 2",
            "\"world_size\": 3",
            "rank-0.json: field `world_size` is 3, but the manifest says 2",
        ),
        (
            "manifest.json",
            "\"version\": 1",
            "\"version\": 9",
            "manifest.json: format version 9 is not supported",
        ),
        (
            "manifest.json",
            "\"world_size\": 2",
            "\"world_size\": 3",
            "manifest.json: the manifest lists 2 rank files for a world size of 3",
        ),
        (
            "manifest.json",
            "\"encoding\": \"json\",",
            "\"encoding\": \"json\", \"extra\": 1,",
            "manifest.json: not a valid pipec file: unknown field `extra`",
        ),
    ];
    for (i, (file, from, to, want)) in cases.iter().enumerate() {
        let dir = tmp.path().join(format!("c{i}"));
        compile(&dir, "--schedule 1f1b --pp 2 --microbatches 2");
        let p = dir.join(file);
        let text = std::fs::read_to_string(&p).unwrap();
        assert!(text.contains(from), "{file}: {from}");
        std::fs::write(&p, text.replacen(from, to, 1)).unwrap();
        let before = snapshot(&dir);
        let (code, out, err) = seal(&dir);
        assert_eq!(code, 2, "{want}: {out}{err}");
        assert!(err.contains(want), "{err}\nwant: {want}");
        assert_eq!(snapshot(&dir), before, "a refused seal wrote nothing");
    }
    // Damage anywhere: an error or a seal, never a panic; a refusal writes nothing.
    let originals = snapshot(&base);
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    let mut next = || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    let dir = tmp.path().join("fuzz");
    for _ in 0..300 {
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir(&dir).unwrap();
        for (n, b) in &originals {
            std::fs::write(dir.join(n), b).unwrap();
        }
        let (name, bytes) = &originals[(next() % originals.len() as u64) as usize];
        let mut b = bytes.clone();
        for _ in 0..1 + next() % 3 {
            let at = (next() % b.len() as u64) as usize;
            match next() % 3 {
                0 => b[at] = next() as u8,
                1 => b.insert(at, next() as u8),
                _ => {
                    b.remove(at);
                }
            }
        }
        std::fs::write(dir.join(name), &b).unwrap();
        let before = snapshot(&dir);
        match files::seal_dir(&dir) {
            Ok(_) => {
                // Whatever was sealed loads (the hashes are right); its content is check's.
                files::load_dir(&dir).unwrap();
            }
            Err(e) => {
                assert!(e.to_string().contains(&dir.display().to_string()), "{e}");
                assert_eq!(snapshot(&dir), before);
            }
        }
    }
    // Missing directory: exit 2, named.
    let (code, _, err) = seal(&tmp.path().join("none"));
    assert_eq!(code, 2);
    assert!(err.contains("none"), "{err}");
}

/// The reverse fault: an existing file where a directory is written (`compile -o`, `seal`'s
/// and `Schedule.save`'s writer), and a directory where `pipec-run --trace` writes a file,
/// refused before any work with a message naming what was expected.
#[test]
fn output_file_where_directory_expected_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("afile");
    std::fs::write(&file, "mine").unwrap();
    let mut c = pipec_with([
        "compile",
        "--schedule",
        "1f1b",
        "--pp",
        "2",
        "--microbatches",
        "2",
    ]);
    c.arg("-o").arg(&file);
    let (code, _, err) = run(c);
    assert_eq!(code, 2);
    assert!(
        err.contains(&format!(
            "{} is a file; a schedule is written as a directory",
            file.display()
        )),
        "{err}"
    );
    assert_eq!(std::fs::read(&file).unwrap(), b"mine");
    let dir = tmp.path().join("s");
    compile(&dir, "--schedule 1f1b --pp 2 --microbatches 2");
    let (code, out, err) = run(pipec_run_on(
        &dir,
        &["--trace", tmp.path().to_str().unwrap()],
    ));
    assert_eq!(code, 2, "{err}");
    assert!(out.is_empty(), "the run started: {out}");
    assert!(
        err.contains("a directory; the trace is written to a file"),
        "{err}"
    );
}

/// Regression (#29, found beside `check --json`): `simulate`, `compare`, `layout`, `tune` and
/// `calibrate` printed nothing on stdout under `--json` when they failed, nor did any command
/// on a malformed command line. Each prints one document with the message and exit code.
#[test]
fn json_errors_are_documents_everywhere() {
    let tmp = tempfile::tempdir().unwrap();
    let missing = tmp.path().join("missing");
    let m = missing.to_str().unwrap();
    let cases: Vec<(Vec<&str>, i32)> = vec![
        (vec!["simulate", m, "--json"], 2),
        (vec!["compare", m, "--json"], 2),
        (vec!["layout", "E|X|L", "--pp", "3", "--json"], 1),
        (
            vec!["tune", "--pp", "0", "--microbatches", "4", "--json"],
            1,
        ),
        (vec!["calibrate", m, "--layout", "E|L", "--json"], 2),
        (vec!["simulate", "--json", "--bogus"], 2),
        (
            vec![
                "compile",
                "--schedule",
                "nope",
                "--pp",
                "2",
                "--microbatches",
                "2",
                "-o",
                m,
                "--json",
            ],
            1,
        ),
    ];
    for (args, want) in cases {
        let (code, out, err) = run(pipec_with(&args));
        assert_eq!(code, want, "{args:?}: {err}");
        let v: Value =
            serde_json::from_str(&out).unwrap_or_else(|e| panic!("{args:?}: {e}: {out:?}"));
        assert_eq!(v["exit_code"], want, "{args:?}: {v}");
        let msg = v["error"].as_str().unwrap();
        assert!(
            !msg.is_empty() && err.contains(msg.lines().next().unwrap()),
            "{args:?}: {msg} / {err}"
        );
    }
}

/// Regression (#29, found beside the file-for-directory fault): `--cost-file DIR`,
/// `--layout-file DIR`, `--config DIR` and a trace that is a directory answered with the bare
/// OS error "Is a directory".
#[test]
fn flag_file_that_is_a_directory_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let d = dir.to_str().unwrap();
    let sched = dir.join("s");
    compile(&sched, "--schedule 1f1b --pp 2 --microbatches 4");
    let s = sched.to_str().unwrap();
    for (args, flag) in [
        (vec!["simulate", s, "--cost-file", d], "--cost-file"),
        (
            vec!["layout", "--layout-file", d, "--pp", "2"],
            "--layout-file",
        ),
        (vec!["compile", "--config", d, "-o", s], "--config"),
        (vec!["calibrate", d, "--layout", "E|L"], "trace"),
    ] {
        let (code, _, err) = run(pipec_with(&args));
        assert_eq!(code, 2, "{args:?}: {err}");
        assert!(
            err.contains(&format!("{flag} {d}: is a directory; give a file")),
            "{args:?}: {err}"
        );
    }
}

/// Regression (#29): compiling stock dualpipe / dualpipe-v warned about each same-peer batch,
/// which the user cannot act on (DualPipe's own loop posts them so); now one line says what
/// they are and when to care. Other kinds' risks still print one by one.
#[test]
fn compile_dualpipe_explains_same_peer_batches_in_one_line() {
    let tmp = tempfile::tempdir().unwrap();
    for kind in ["dualpipe", "dualpipe-v"] {
        let out = tmp.path().join(kind);
        let mut c = pipec_with([
            "compile",
            "--schedule",
            kind,
            "--pp",
            "4",
            "--microbatches",
            "8",
        ]);
        c.arg("-o").arg(&out);
        let (code, _, err) = run(c);
        assert_eq!(code, 0, "{err}");
        assert_eq!(err.lines().count(), 1, "{kind}: {err}");
        assert!(err.starts_with("note: "), "{err}");
        assert!(err.contains("as DeepSeek's DualPipe posts them"), "{err}");
        // The count is what check counts.
        let (_, json, _) = run(pipec_with(["check", out.to_str().unwrap(), "--json"]));
        let v: Value = serde_json::from_str(&json).unwrap();
        let total = v["risk_summary"]["total"].as_u64().unwrap();
        assert!(total > 0);
        assert!(
            err.contains(&format!("note: {total} comm batch postings")),
            "{err}"
        );
    }
}

/// Regression (#29): cost headers said `t: f=1 b=1 w=1` and hid that the embedding and the
/// loss cost nothing by default.
#[test]
fn cost_header_names_free_kinds() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("s");
    compile(
        &dir,
        "--schedule 1f1b --pp 2 --microbatches 4 --layout Et|tL",
    );
    let d = dir.to_str().unwrap();
    let (_, out, _) = run(pipec_with(["simulate", d]));
    assert!(
        out.contains("; E, L free (no cost given: set E.f, L.f)"),
        "{out}"
    );
    let (_, out, _) = run(pipec_with(["simulate", d, "--cost", "E.f=0.5"]));
    assert!(
        out.contains("E: f=0.5 b=0 w=0; L free (no cost given: set L.f)"),
        "{out}"
    );
    let (_, out, _) = run(pipec_with(["simulate", d, "--cost", "E.f=0.5,L.f=2"]));
    assert!(!out.contains("free (no cost"), "{out}");
}

/// Regression (#29): `compare` rows did not show the P2P mode, `--combined` or the group size,
/// so five interleaved variants printed under one name.
#[test]
fn compare_rows_name_variants() {
    let tmp = tempfile::tempdir().unwrap();
    let layout = ["--layout", "Et|t|t|tL"];
    let variants: [(&str, &[&str], &str); 4] = [
        ("a", &[], "(interleaved-1f1b pp=2 vpp=2 microbatches=4)"),
        ("b", &["--combined"], "microbatches=4 combined"),
        (
            "c",
            &["--megatron-p2p", "overlap-flush"],
            "microbatches=4 p2p=overlap-flush",
        ),
        ("d", &["--group-size", "4"], "microbatches=4 group=4"),
    ];
    let mut args = vec!["compare".to_string()];
    for (name, extra, _) in &variants {
        let dir = tmp.path().join(name);
        let mut e: Vec<&str> = layout.to_vec();
        e.extend_from_slice(extra);
        compile(
            &dir,
            &format!(
                "--schedule interleaved-1f1b --pp 2 --microbatches 4 {}",
                e.join(" ")
            ),
        );
        args.push(dir.to_str().unwrap().to_string());
    }
    let (code, out, err) = run(pipec_with(&args));
    assert_eq!(code, 0, "{err}");
    for (_, _, want) in &variants {
        assert!(out.contains(want), "{want}: {out}");
    }
}

/// Regression (found beside #29's unbounded inputs): `pipec-run --timeout 1e300` echoed a
/// 300-digit number.
#[test]
fn pipec_run_timeout_is_echoed_short() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("s");
    compile(&dir, "--schedule 1f1b --pp 2 --microbatches 2");
    let mut c = crate::harness::pipec_run();
    c.arg(&dir).args(["--timeout", "1e300"]);
    let (code, _, err) = run(c);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--timeout 1e300 must be"), "{err}");
    assert!(err.len() < 200, "{err}");
}
