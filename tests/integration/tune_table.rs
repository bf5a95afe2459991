//! `pipec tune`'s report table and filters on the command line (issue #40): `--kinds` and
//! `--exclude-kinds` hold under a memory limit on a `[model]` case; the table's rows are the
//! `--json` candidates (every plan once, the winner first, by default the best of each kind
//! and placement, every one with `--all`); `--help` names every cost key; the tune examples
//! of docs/tune.md and docs/memory.md are run and every line they show checked.

use crate::harness::pipec;
use assert_cmd::prelude::*;

/// docs/tune.md's `llama3-70b.toml` (Llama-3 70B at tp=8, dp=8), taken from the page itself.
pub(crate) fn llama70b(dir: &std::path::Path) -> std::path::PathBuf {
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/tune.md"))
        .expect("docs/tune.md");
    let start = doc.find("$ cat llama3-70b.toml\n").expect("the example") + 22;
    let end = start + doc[start..].find("$ pipec tune").unwrap();
    let file = dir.join("llama3-70b.toml");
    std::fs::write(&file, &doc[start..end]).unwrap();
    file
}

/// `pipec tune --pp 8 --microbatches 64 --num-layers 80 --cost-file FILE ARGS...`, which must
/// succeed.
pub(crate) fn tune(file: &std::path::Path, args: &[&str]) -> std::process::Output {
    let mut cmd = pipec();
    cmd.args([
        "tune",
        "--pp",
        "8",
        "--microbatches",
        "64",
        "--num-layers",
        "80",
    ])
    .arg("--cost-file")
    .arg(file)
    .args(args);
    cmd.assert().success().get_output().clone()
}

fn json(out: &std::process::Output) -> serde_json::Value {
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn kinds_hold_under_a_memory_limit_on_a_model_table() {
    let dir = tempfile::tempdir().unwrap();
    let file = llama70b(dir.path());
    // Unfiltered, the winner is one of pipec's own orders (the filters have teeth).
    for limit in ["60GiB", "30GiB"] {
        let j = json(&tune(&file, &["--memory-limit", limit, "--json"]));
        assert_eq!(j["schedule"]["kind"], "tuned", "{limit}");
    }
    // --kinds 1f1b: 1F1B (it fits 60 GiB as it is), and only 1F1B is weighed.
    let out = tune(&file, &["--kinds", "1f1b", "--memory-limit", "60GiB"]);
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("\nschedule: 1f1b\n"), "{text}");
    let j = json(&tune(
        &file,
        &["--kinds", "1f1b", "--memory-limit", "60GiB", "--json"],
    ));
    assert_eq!(j["schedule"]["kind"], "1f1b");
    assert!(j["candidates"]
        .as_array()
        .unwrap()
        .iter()
        .all(|c| c["schedule"] == "1f1b"));
    // --exclude-kinds tuned: never a tuned plan, with or without a target. At 60 GiB a
    // built-in kind fits as it is; at 30 GiB none does (1F1B's 33.61 GiB is the least): for
    // Megatron the levers fit a built-in kind, while the default target pulls no lever, so
    // there the request is refused rather than answered with a tuned plan.
    for (limit, target) in [
        ("60GiB", &[][..]),
        ("60GiB", &["--target", "megatron"][..]),
        ("30GiB", &["--target", "megatron"][..]),
    ] {
        let args = [
            &[
                "--exclude-kinds",
                "tuned",
                "--memory-limit",
                limit,
                "--json",
            ][..],
            target,
        ]
        .concat();
        let j = json(&tune(&file, &args));
        assert_ne!(j["schedule"]["kind"], "tuned", "{args:?}");
        assert!(
            j["candidates"]
                .as_array()
                .unwrap()
                .iter()
                .all(|c| c["schedule"] != "tuned"),
            "{args:?}"
        );
    }
    let out = pipec()
        .args([
            "tune",
            "--pp",
            "8",
            "--microbatches",
            "64",
            "--num-layers",
            "80",
        ])
        .arg("--cost-file")
        .arg(&file)
        .args(["--exclude-kinds", "tuned", "--memory-limit", "30GiB"])
        .assert()
        .code(1);
    let err = String::from_utf8(out.get_output().stderr.clone()).unwrap();
    assert!(
        err.contains("no schedule fits the memory limit 30.00GiB") && err.contains("(1f1b)"),
        "{err}"
    );
}

/// A row of the text table: name, makespan, bubble, peak and layout as printed.
#[derive(Debug, PartialEq)]
struct Row {
    name: String,
    rest: String,
}

/// The table's rows and the notes under it (the lines in parentheses).
fn table(text: &str) -> (Vec<Row>, Vec<String>) {
    let mut lines = text.lines().skip_while(|l| !l.starts_with("candidate "));
    let header = lines.next().expect("the table");
    // `{name:<w} {makespan:>10}`: "makespan" ends 11 characters after the name column.
    let w = header.find("makespan").unwrap() + "makespan".len() - 11;
    let (mut rows, mut notes) = (Vec::new(), Vec::new());
    for l in lines.take_while(|l| !l.is_empty()) {
        if l.starts_with('(') {
            notes.push(l.to_string());
        } else {
            rows.push(Row {
                name: l[..w].trim_end().to_string(),
                rest: l[w..].split_whitespace().collect::<Vec<_>>().join(" "),
            });
        }
    }
    (rows, notes)
}

/// A `--json` candidate's name as the report's rows print it (docs/tune.md, "Output"): the
/// kind; `tuned` adds placement and vpp, a looped built-in its vpp above 1; `g=`; the levers'
/// totals; the target's or the limit's mark.
fn name_of(c: &serde_json::Value) -> String {
    let kind = c["schedule"].as_str().unwrap();
    let (vpp, placement) = (c["vpp"].as_u64().unwrap(), c["placement"].as_str().unwrap());
    let mut s = kind.to_string();
    if kind == "tuned" {
        s += &format!(" {placement} vpp={vpp}");
    } else if vpp > 1 && placement == "loop" {
        s += &format!(" vpp={vpp}");
    }
    if let Some(g) = c["group_size"].as_u64() {
        s += &format!(" g={g}");
    }
    let total = |k: &str| -> u64 {
        c["levers"][k]
            .as_array()
            .map_or(0, |a| a.iter().map(|x| x.as_u64().unwrap()).sum())
    };
    if total("offloaded") > 0 {
        s += &format!(" + offload {}", total("offloaded"));
    }
    if total("recomputed") > 0 {
        s += &format!(" + recompute {}", total("recomputed"));
    }
    if let Some(why) = c["not_runnable"].as_str() {
        s += &format!(" ({})", why.split(':').next().unwrap());
    } else if c["fits"] == false {
        s += " (over limit)";
    }
    s
}

/// The fields that name a plan.
fn plan(c: &serde_json::Value) -> String {
    let f = |k: &str| c[k].to_string();
    [
        "schedule",
        "vpp",
        "group_size",
        "placement",
        "heuristic",
        "layout",
        "levers",
        "microbatch_order",
    ]
    .map(f)
    .join(" ")
}

#[test]
fn table_rows_are_the_json_candidates_winner_first() {
    let dir = tempfile::tempdir().unwrap();
    let file = llama70b(dir.path());
    for target in ["megatron", "any"] {
        let base = ["--memory-limit", "20GiB", "--target", target];
        let j = json(&tune(&file, &[&base[..], &["--json"]].concat()));
        let cands = j["candidates"].as_array().unwrap();
        let winner = cands
            .iter()
            .find(|c| {
                c["schedule"] == j["schedule"]["kind"]
                    && c["vpp"] == j["schedule"]["vpp"]
                    && c["placement"] == j["schedule"]["placement"]
                    && c["heuristic"] == j["schedule"]["heuristic"]
                    && c["layout"] == j["layout"]
            })
            .expect("the winner among the candidates");
        let mut plans: Vec<&serde_json::Value> = vec![winner];
        for c in cands {
            if !plans.iter().any(|p| plan(p) == plan(c)) {
                plans.push(c);
            }
        }
        let merged = cands.len() - plans.len();
        // --all: every plan once, the winner first, then the JSON's order.
        let text =
            String::from_utf8(tune(&file, &[&base[..], &["--all"]].concat()).stdout).unwrap();
        let (rows, notes) = table(&text);
        let names: Vec<String> = rows.iter().map(|r| r.name.clone()).collect();
        let want: Vec<String> = plans.iter().map(|c| name_of(c)).collect();
        assert_eq!(names, want, "{target}");
        assert!(
            !rows.iter().enumerate().any(|(i, r)| rows[..i].contains(r)),
            "{target}: a row twice"
        );
        // The winner's row carries its layout (cut at 40 characters).
        let layout = j["layout"].as_str().unwrap();
        let shown = if layout.len() > 40 {
            format!("{}...", &layout[..37])
        } else {
            layout.to_string()
        };
        assert!(rows[0].rest.ends_with(&shown), "{:?} {shown}", rows[0]);
        let merged_note = notes
            .iter()
            .any(|n| n.contains("the same plan as a row above"));
        assert_eq!(merged_note, merged > 0, "{target}: {notes:?}");
        assert!(!notes.iter().any(|n| n.contains("--all")), "{notes:?}");
        // By default the table is long (over 20 plans): the best of each kind and placement.
        assert!(plans.len() > 20, "{target}: {}", plans.len());
        let text = String::from_utf8(tune(&file, &base).stdout).unwrap();
        let (cut, notes) = table(&text);
        let mut best: Vec<&serde_json::Value> = Vec::new();
        for c in &plans {
            if !best
                .iter()
                .any(|b| b["schedule"] == c["schedule"] && b["placement"] == c["placement"])
            {
                best.push(c);
            }
        }
        let names: Vec<String> = cut.iter().map(|r| r.name.clone()).collect();
        let want: Vec<String> = best.iter().map(|c| name_of(c)).collect();
        assert_eq!(names, want, "{target}");
        let hidden = format!(
            "({} more candidates: the best of each schedule kind and placement is shown; --all prints every one)",
            plans.len() - best.len()
        );
        assert!(notes.contains(&hidden), "{target}: {notes:?}");
    }
    // A short table whose own order (makespan alone) does not lead with the winner: pp=2,
    // M=4, uniform costs, where ZB-H1 ties pipec's own order and wins on its smaller peak.
    let args = ["tune", "--pp", "2", "--microbatches", "4"];
    let out = pipec().args(args).arg("--json").assert().success();
    let j: serde_json::Value = serde_json::from_slice(&out.get_output().stdout).unwrap();
    assert_eq!(j["schedule"]["kind"], "zb-h1");
    assert_ne!(j["candidates"][0]["schedule"], "zb-h1");
    let out = pipec().args(args).arg("--all").assert().success();
    let (rows, notes) = table(&String::from_utf8(out.get_output().stdout.clone()).unwrap());
    assert_eq!(rows[0].name, "zb-h1");
    let mut plans: Vec<String> = j["candidates"]
        .as_array()
        .unwrap()
        .iter()
        .map(plan)
        .collect();
    plans.sort();
    plans.dedup();
    assert_eq!(rows.len(), plans.len());
    assert!(notes.is_empty(), "{notes:?}");
}

/// `tune --help` names every key a cost spec may hold (`pipec_cost::cost::KEYS`, the list the
/// parser's own error gives) and where they are described.
#[test]
fn tune_help_names_every_cost_key() {
    let out = pipec().args(["tune", "--help"]).assert().success();
    let help = String::from_utf8(out.get_output().stdout.clone()).unwrap();
    let help = help.split_whitespace().collect::<Vec<_>>().join(" ");
    for key in pipec_cost::cost::KEYS.split(", ") {
        assert!(help.contains(key), "`{key}` missing in\n{help}");
    }
    for key in ["t.act", "pcie", "time_unit", "[model]", "docs/costs.md"] {
        assert!(help.contains(key), "`{key}` missing in\n{help}");
    }
    // A key the parser refuses names the same list.
    let out = pipec()
        .args(["tune", "--pp", "2", "--microbatches", "4", "--cost", "zz=1"])
        .assert()
        .code(1);
    let err = String::from_utf8(out.get_output().stderr.clone()).unwrap();
    assert!(err.contains(pipec_cost::cost::KEYS), "{err}");
}

/// The example of `doc` that begins `$ pipec tune ` + `head`, run in `dir`: every line the
/// page shows is a line of the report, in order (a line ending in `...` is a line's
/// beginning, a line `...` the rest left out; the first line, with the seconds taken, is not
/// shown). Returns how many lines were checked.
fn doc_example_holds(doc: &str, head: &str, dir: &std::path::Path) -> usize {
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../");
    let path = if doc == "README.md" {
        root.to_string()
    } else {
        format!("{root}docs/")
    };
    let text = std::fs::read_to_string(format!("{path}{doc}")).expect(doc);
    // A fenced block (plain or `text`) whose first line is the command.
    let marker = format!("\n$ pipec tune {head}");
    let start = text.find(&marker).expect("the example") + 3;
    let end = start + text[start..].find("```").unwrap();
    let block = text[start..end].replace("\\\n", " ");
    let mut lines = block.lines();
    let command: Vec<&str> = lines.next().unwrap().split_whitespace().collect();
    assert_eq!(command[..2], ["pipec", "tune"]);
    // Paths into the repository (`bench/...`) are read from its root; the run writes in `dir`.
    let args: Vec<String> = command[1..]
        .iter()
        .map(|a| match a.strip_prefix("bench/") {
            Some(_) => format!("{root}{a}"),
            None => a.to_string(),
        })
        .collect();
    let out = pipec().args(&args).current_dir(dir).assert().success();
    let report = String::from_utf8(out.get_output().stdout.clone()).unwrap();
    let mut got = report.lines();
    let mut shown = 0;
    for want in lines {
        if want == "..." {
            continue;
        }
        let hit = match want.strip_suffix("...") {
            Some(head) => got.any(|l| l.starts_with(head)),
            None => got.any(|l| l == want),
        };
        assert!(
            hit,
            "docs/{doc}'s example shows `{want}`, not (in this order) in\n{report}"
        );
        shown += 1;
    }
    shown
}

/// docs/tune.md's worked example (its `model.toml` written from the keys the page lists) and
/// docs/memory.md's offload example cannot go stale: each is run and every line shown checked.
#[test]
fn tune_doc_examples_are_current() {
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/tune.md"))
        .expect("docs/tune.md");
    let dir = tempfile::tempdir().unwrap();
    // "(`model.toml`: `t.f=1 t.b=1.5 t.w=0.7`, `E.f=2 ...`, ...):"
    let start = doc.find("(`model.toml`: ").expect("the model's keys") + 15;
    let end = start + doc[start..].find("):\n").unwrap();
    let keys: Vec<&str> = doc[start..end]
        .split('`')
        .skip(1)
        .step_by(2)
        .flat_map(str::split_whitespace)
        .collect();
    assert!(keys.len() >= 10, "{keys:?}");
    std::fs::write(dir.path().join("model.toml"), keys.join("\n") + "\n").unwrap();
    let shown = doc_example_holds(
        "tune.md",
        "--pp 8 --microbatches 64 --num-layers 62",
        dir.path(),
    );
    assert!(shown >= 15, "only {shown} lines checked");
    let shown = doc_example_holds("memory.md", "--pp 4 --microbatches 8", dir.path());
    assert!(shown >= 5, "only {shown} lines checked");
}

/// #40's Done-when: the README's 70B example (its `bench/llama3-70b.toml`) shows the host
/// memory, the margin note and the Megatron caveat, and every line it shows is what tune prints.
#[test]
fn readme_tune_example_is_current() {
    let dir = tempfile::tempdir().unwrap();
    let shown = doc_example_holds(
        "README.md",
        "--pp 8 --microbatches 64 --num-layers 80",
        dir.path(),
    );
    assert!(shown >= 9, "only {shown} lines checked");
    let readme =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../README.md")).unwrap();
    for want in [
        "host memory per rank",
        "not the CUDA context",
        "not run with:",
    ] {
        assert!(
            readme.contains(want),
            "the README's tune example lacks {want:?}"
        );
    }
    // The README's model is docs/tune.md's: the repository's file is the page's table.
    let bench = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../bench/llama3-70b.toml"
    ))
    .unwrap();
    let page = std::fs::read_to_string(llama70b(dir.path())).unwrap();
    let table: Vec<&str> = bench.lines().filter(|l| !l.starts_with('#')).collect();
    assert_eq!(table, page.lines().collect::<Vec<_>>());
    assert!(dir.path().join("tuned/manifest.json").exists());
}

/// #40 point 6: a byte peak is said with what it counts, and a plan for the 70B model planned
/// without a limit, whose peak (from `--json`) is above the 192 GB of the largest common
/// accelerators, gets the note; under a limit it does not.
#[test]
fn byte_peaks_say_what_they_count_and_a_peak_above_any_device_is_noted() {
    let tmp = tempfile::tempdir().unwrap();
    let file = llama70b(tmp.path());
    let peak = json(&tune(&file, &["--json"]))["peak_memory"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .fold(0.0, f64::max);
    let text = String::from_utf8(tune(&file, &[]).stdout).unwrap();
    assert!(
        text.contains("not the CUDA context, NCCL buffers"),
        "{text}"
    );
    assert_eq!(
        text.contains("is more than any common accelerator holds"),
        peak > 192e9,
        "peak {peak}: {text}"
    );
    assert!(peak > 192e9, "the unlimited 70B plan peaks at {peak} bytes");
    let text = String::from_utf8(tune(&file, &["--memory-limit", "70GiB"]).stdout).unwrap();
    assert!(
        text.contains("not the CUDA context, NCCL buffers"),
        "{text}"
    );
    assert!(!text.contains("more than any common accelerator"), "{text}");
}
