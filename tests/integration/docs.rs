//! The documentation's examples are what pipec actually writes.

use crate::harness::{pipec, pipec_run};
use pipec_compiler::compile::{compile, CompileRequest};
use pipec_ir::files::{render, Encoding, Header};
use pipec_schedules::ScheduleKind;

/// The code blocks of `docs/format.md`'s example section, in order.
fn example_blocks() -> Vec<String> {
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/format.md"))
        .expect("docs/format.md");
    let example = &doc[doc.find("## Example").expect("an Example section")..];
    example
        .split("```json\n")
        .skip(1)
        .map(|b| b[..b.find("```").unwrap()].to_string())
        .collect()
}

#[test]
fn format_doc_example_is_current() {
    let c = compile(&CompileRequest::new(ScheduleKind::OneFOneB, 2, 2)).unwrap();
    let header = Header {
        source: "generated",
        schedule: Some(c.spec),
        layout: &c.layout,
    };
    let files = render(&header, &pipec_tests::verified(&c.program), Encoding::Json);
    let blocks = example_blocks();
    assert_eq!(blocks.len(), 2, "manifest and rank-1 examples");
    assert_eq!(blocks[0], String::from_utf8(files[0].1.clone()).unwrap(), "manifest.json example is stale: regenerate with `pipec compile --schedule 1f1b --pp 2 --microbatches 2`");
    assert_eq!(files[2].0, "rank-1.json");
    assert_eq!(
        blocks[1],
        String::from_utf8(files[2].1.clone()).unwrap(),
        "rank-1.json example is stale"
    );
}

/// `pipec schedules` lists every kind pipec generates, in text and JSON, and each listed name
/// compiles.
#[test]
fn schedules_command_lists_every_kind() {
    let out = crate::harness::pipec().arg("schedules").output().unwrap();
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    for k in ScheduleKind::ALL {
        assert!(
            text.lines().any(|l| l.starts_with(k.name())),
            "{} missing from `pipec schedules`:\n{text}",
            k.name()
        );
    }
    let out = crate::harness::pipec()
        .args(["schedules", "--json"])
        .output()
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let names: Vec<&str> = v
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["kind"].as_str().unwrap())
        .collect();
    let want: Vec<&str> = ScheduleKind::ALL.iter().map(|k| k.name()).collect();
    assert_eq!(names, want);
    for n in names {
        assert_eq!(n.parse::<ScheduleKind>().unwrap().name(), n);
    }
}

/// A documentation file, read from the repository root (`README.md`, `docs/cli.md`).
fn doc(path: &str) -> String {
    let full = format!("{}/../{path}", env!("CARGO_MANIFEST_DIR"));
    std::fs::read_to_string(&full).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// docs/schedules.md's schedule table has a row for every kind.
#[test]
fn schedules_doc_table_lists_every_kind() {
    let doc = doc("docs/schedules.md");
    for k in ScheduleKind::ALL {
        assert!(
            doc.contains(&format!("| `{}` |", k.name())),
            "docs/schedules.md's schedule table has no row for {}",
            k.name()
        );
    }
}

/// The long flags of `--help` output (`-o, --out <OUT>` gives `--out`), less help/version.
fn help_flags(help: &str) -> std::collections::BTreeSet<String> {
    help.lines()
        .filter_map(|l| {
            let l = l.trim_start();
            // `-o, --out <OUT>`: the long form follows the short one.
            let l = match l.as_bytes() {
                [b'-', c, b',', b' ', ..] if *c != b'-' => &l[4..],
                _ => l,
            };
            let flag = l.strip_prefix("--")?;
            let name: String = flag
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '-')
                .collect();
            (!name.is_empty() && name != "help" && name != "version").then(|| format!("--{name}"))
        })
        .collect()
}

/// Regression (#29): the synopsis (then in the README, now docs/cli.md) omitted `compile
/// --num-layers/--mtp-num-layers/--max-ops`, `show --cost-file/--color/--pp/--placement`,
/// `export --cost/--svg-width/--condense`. Each command's synopsis names exactly the flags its
/// `--help` lists.
#[test]
fn cli_doc_synopsis_matches_help() {
    use std::collections::{BTreeMap, BTreeSet};
    let cli = doc("docs/cli.md");
    let section = &cli[cli.find("## Synopsis").expect("synopsis section")..];
    let block = &section[section.find("```\n").unwrap() + 4..];
    let block = &block[..block.find("```").unwrap()];
    let mut documented: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut current = String::new();
    for line in block.lines() {
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.first() {
            Some(&"pipec") => current = words[1].to_string(),
            Some(&"pipec-run") => current = "pipec-run".to_string(),
            _ => {}
        }
        let flags = documented.entry(current.clone()).or_default();
        for w in line.split(|c: char| !(c.is_ascii_alphanumeric() || c == '-')) {
            if let Some(name) = w.strip_prefix("--") {
                if !name.is_empty() {
                    flags.insert(format!("--{name}"));
                }
            }
            if w == "-o" {
                flags.insert("--out".to_string());
            }
        }
    }
    let out = pipec().arg("--help").output().unwrap();
    let top = String::from_utf8(out.stdout).unwrap();
    let commands: Vec<String> = top
        .lines()
        .skip_while(|l| !l.starts_with("Commands:"))
        .skip(1)
        .take_while(|l| l.starts_with("  "))
        .filter_map(|l| l.split_whitespace().next().map(str::to_string))
        .filter(|c| c != "help")
        .collect();
    assert!(commands.len() >= 10, "{top}");
    let mut wrong = Vec::new();
    for c in commands.iter().map(String::as_str).chain(["pipec-run"]) {
        let out = if c == "pipec-run" {
            pipec_run().arg("--help").output()
        } else {
            pipec().args([c, "--help"]).output()
        }
        .unwrap();
        let help = help_flags(&String::from_utf8(out.stdout).unwrap());
        let doc = documented.get(c).cloned().unwrap_or_default();
        let missing: Vec<_> = help.difference(&doc).collect();
        let extra: Vec<_> = doc.difference(&help).collect();
        if !missing.is_empty() || !extra.is_empty() {
            wrong.push(format!(
                "{c}: docs/cli.md lacks {missing:?}; docs/cli.md has but --help lacks {extra:?}"
            ));
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

/// Regression (#29): the Python section (then in the README, now docs/python.md) listed 4 of
/// the 6 Megatron P2P modes.
#[test]
fn python_doc_lists_every_p2p_mode() {
    let python = doc("docs/python.md");
    let start = python
        .find("`pipec.compile(schedule, pp, microbatches")
        .expect("compile()'s paragraph");
    let para = &python[start..start + python[start..].find("\n\n").unwrap()];
    for m in pipec_schedules::MegatronP2p::ALL {
        assert!(
            para.contains(&format!("`\"{m}\"`")),
            "{m} missing from: {para}"
        );
    }
}

/// The serialized name of an enum value, as the files write it.
fn wire<T: serde::Serialize>(v: T) -> String {
    serde_json::to_value(v)
        .unwrap()
        .as_str()
        .unwrap()
        .to_string()
}

/// Regression (#27): docs/format.md's value lists missed `bidirectional`, `mirror_from`, two
/// Megatron P2P modes and two comm policies. Each list names every value the code writes.
#[test]
fn format_doc_lists_every_value() {
    use pipec_schedules::{CommPolicy, MegatronP2p, PlacementKind};
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/format.md"))
        .expect("docs/format.md");
    let row = |field: &str| -> String {
        doc.lines()
            .find(|l| l.starts_with(&format!("| `{field}` |")))
            .unwrap_or_else(|| panic!("no `{field}` row in docs/format.md"))
            .to_string()
    };
    // Exhaustive matches: a new variant fails to compile here until it is listed.
    let placement = |k: PlacementKind| match k {
        PlacementKind::Looped | PlacementKind::V | PlacementKind::Custom => k,
        PlacementKind::Bidirectional => k,
    };
    let policy = |p: CommPolicy| match p {
        CommPolicy::Megatron1F1B
        | CommPolicy::MegatronInterleaved
        | CommPolicy::Megatron1F1BUnbatched
        | CommPolicy::MegatronInterleavedUnbatched
        | CommPolicy::MegatronInterleavedOverlap
        | CommPolicy::MegatronInterleavedOverlapFlush
        | CommPolicy::MegatronInterleavedOverlapKeepOutputs
        | CommPolicy::MegatronInterleavedOverlapFlushKeepOutputs
        | CommPolicy::FusedPerOp
        | CommPolicy::Lockstep
        | CommPolicy::TimedInFlight => p,
    };
    let placement_row = row("placement");
    for k in [
        PlacementKind::Looped,
        PlacementKind::V,
        PlacementKind::Custom,
        PlacementKind::Bidirectional,
    ] {
        let name = wire(placement(k));
        assert!(
            placement_row.contains(&format!("`{name}`")),
            "{name}: {placement_row}"
        );
    }
    assert!(placement_row.contains("`mirror_from`"), "{placement_row}");
    let policy_row = row("comm_policy");
    for p in [
        CommPolicy::Megatron1F1B,
        CommPolicy::MegatronInterleaved,
        CommPolicy::Megatron1F1BUnbatched,
        CommPolicy::MegatronInterleavedUnbatched,
        CommPolicy::MegatronInterleavedOverlap,
        CommPolicy::MegatronInterleavedOverlapFlush,
        CommPolicy::MegatronInterleavedOverlapKeepOutputs,
        CommPolicy::MegatronInterleavedOverlapFlushKeepOutputs,
        CommPolicy::FusedPerOp,
        CommPolicy::Lockstep,
        CommPolicy::TimedInFlight,
    ] {
        let name = wire(policy(p));
        assert!(
            policy_row.contains(&format!("`{name}`")),
            "{name}: {policy_row}"
        );
    }
    let schedule_row = row("schedule");
    for m in MegatronP2p::ALL.into_iter().filter(|m| !m.is_default()) {
        let name = wire(m);
        assert!(
            schedule_row.contains(&format!("`{name}`")),
            "{name}: {schedule_row}"
        );
    }
}

/// Issue #41: the README is a landing page. At most about 300 lines, and its first screen (40
/// lines) names the two commands, every framework pipec runs on, and a working example.
#[test]
fn readme_is_a_landing_page() {
    let readme = doc("README.md");
    let lines = readme.lines().count();
    assert!(
        lines <= 300,
        "README.md has {lines} lines; the manual lives in docs/"
    );
    let first: String = readme.lines().take(40).collect::<Vec<_>>().join("\n");
    for want in [
        "./demo.sh",
        "./test.sh",
        "Megatron-LM",
        "torch.distributed.pipelining",
        "torchtitan",
        "DeepSpeed",
        "pipec-run",
        "CUDA",
        "pipec compile --schedule",
    ] {
        assert!(
            first.contains(want),
            "README's first 40 lines lack {want:?}"
        );
    }
}

/// The README's shell examples run as written: every `pipec` and `pipec-run` command of its
/// ```sh blocks, in order, in one directory (each later example reads what an earlier one
/// wrote). Other lines (`./demo.sh`, `torchrun`) need more than this test has.
#[test]
fn readme_shell_examples_run() {
    let readme = doc("README.md");
    let dir = tempfile::tempdir().unwrap();
    let mut ran = Vec::new();
    for block in readme.split("```sh\n").skip(1) {
        let block = &block[..block.find("```").unwrap()];
        let joined = block.replace("\\\n", " ");
        for line in joined.lines() {
            let line = line.split(" #").next().unwrap().trim();
            let words: Vec<String> = line
                .split_whitespace()
                .map(|w| w.trim_matches('"').to_string())
                .collect();
            let mut cmd = match words.first().map(String::as_str) {
                Some("pipec") => pipec(),
                Some("pipec-run") => pipec_run(),
                _ => continue,
            };
            let out = cmd
                .args(&words[1..])
                .current_dir(dir.path())
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "README: `{line}` exited {:?}:\n{}{}",
                out.status.code(),
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            ran.push(words[..2].join(" "));
        }
    }
    // `pipec tune` is a `text` example (it reads a file of the repository), run by
    // tune_table::readme_tune_example_is_current.
    for want in [
        "pipec compile",
        "pipec-run out/zbv",
        "pipec check",
        "pipec export",
        "pipec import",
    ] {
        assert!(
            ran.iter().any(|r| r.starts_with(want)),
            "no `{want}` example ran: {ran:?}"
        );
    }
}

/// GitHub's anchor of a heading: lower case, spaces to `-`, punctuation other than `-` and
/// `_` dropped.
fn anchor(heading: &str) -> String {
    heading
        .trim()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c.to_ascii_lowercase()),
            _ => None,
        })
        .collect()
}

/// Every relative link of the README and of docs/*.md names a file that exists and, with a
/// `#fragment`, a heading of that file (the manual moved out of the README in issue #41).
#[test]
fn doc_links_resolve() {
    let root = std::path::Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/.."));
    let mut files = vec![root.join("README.md")];
    for e in std::fs::read_dir(root.join("docs")).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "md") {
            files.push(p);
        }
    }
    let anchors = |p: &std::path::Path| -> Vec<String> {
        let text = std::fs::read_to_string(p).unwrap();
        let mut fenced = false;
        let mut out = Vec::new();
        for l in text.lines() {
            if l.starts_with("```") {
                fenced = !fenced;
            } else if !fenced && l.starts_with('#') {
                out.push(anchor(l.trim_start_matches('#')));
            }
        }
        out
    };
    let mut broken = Vec::new();
    let mut checked = 0;
    for file in &files {
        let text = std::fs::read_to_string(file).unwrap();
        for part in text.split("](").skip(1) {
            let Some(end) = part.find(')') else { continue };
            let target = &part[..end];
            if target.contains("://") || target.contains(' ') {
                continue;
            }
            let (path, frag) = target.split_once('#').unwrap_or((target, ""));
            let dest = if path.is_empty() {
                file.clone()
            } else {
                file.parent().unwrap().join(path)
            };
            checked += 1;
            if !dest.exists() {
                broken.push(format!("{}: {target} (no such file)", file.display()));
            } else if !frag.is_empty()
                && dest.extension().is_some_and(|x| x == "md")
                && !anchors(&dest).iter().any(|a| a == frag)
            {
                broken.push(format!("{}: {target} (no such heading)", file.display()));
            }
        }
    }
    assert!(checked > 50, "only {checked} links found");
    assert!(broken.is_empty(), "{}", broken.join("\n"));
}
