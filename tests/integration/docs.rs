//! The documentation's examples are what pipec actually writes.

use pipec::back::files::{render, Encoding, Header};
use pipec::compile::{compile, CompileRequest};
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
        comm_policy: Some(c.schedule.comm),
        layout: &c.layout,
    };
    let files = render(&header, &c.program, Encoding::Json);
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
    let out = pipec_tests::pipec().arg("schedules").output().unwrap();
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    for k in ScheduleKind::ALL {
        assert!(
            text.lines().any(|l| l.starts_with(k.name())),
            "{} missing from `pipec schedules`:\n{text}",
            k.name()
        );
    }
    let out = pipec_tests::pipec()
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

/// The README's schedule table has a row for every kind.
#[test]
fn readme_schedule_table_lists_every_kind() {
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../README.md"))
        .expect("README.md");
    for k in ScheduleKind::ALL {
        assert!(
            readme.contains(&format!("| `{}` |", k.name())),
            "README's schedule table has no row for {}",
            k.name()
        );
    }
}
