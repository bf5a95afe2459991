//! `pipec compile --config FILE`: many schedules in one call.

use crate::harness::pipec;
use assert_cmd::prelude::*;

const SWEEP: &str = r#"
[[schedule]]
name = "bad-group"
schedule = "interleaved-1f1b"
pp = 4
vpp = 2
microbatches = 6

[[grid]]
schedule = ["gpipe", "1f1b", "interleaved-1f1b", "looped-bfs"]
pp = [2, 4]
vpp = [2]
microbatches = [8]
"#;

/// One invalid configuration fails the run (exit 1) with its reason, and every other
/// configuration is still compiled, verified and written.
#[test]
fn one_invalid_config_fails_the_run_without_losing_the_others() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = tmp.path().join("sweep.toml");
    std::fs::write(&cfg, SWEEP).unwrap();
    let out = tmp.path().join("out");
    let res = pipec()
        .args(["compile", "--config"])
        .arg(&cfg)
        .arg("-o")
        .arg(&out)
        .assert()
        .code(1);
    let stdout = String::from_utf8(res.get_output().stdout.clone()).unwrap();
    let stderr = String::from_utf8(res.get_output().stderr.clone()).unwrap();
    assert!(stderr.contains("bad-group: microbatches = 6"), "{stderr}");
    assert!(
        stdout.contains("9 configurations, 8 ok, 1 failed"),
        "{stdout}"
    );
    assert!(!out.join("bad-group").exists());
    let mut written: Vec<String> = std::fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    written.sort();
    assert_eq!(written.len(), 8, "{written:?}");
    for name in &written {
        let loaded = pipec_ir::files::load_dir(&out.join(name)).unwrap();
        let r = pipec_ir::verify::verify(&loaded.program, &Default::default());
        assert!(r.is_valid(), "{name}: {r}");
        // The directory holds what its name says.
        let spec = loaded.manifest.schedule.unwrap();
        assert!(name.starts_with(spec.kind.name()), "{name}");
        assert!(name.contains(&format!("-pp{}-", spec.pp)), "{name}");
    }
}

#[test]
fn malformed_sweep_files_are_usage_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    // 11 pp values x 920 microbatch counts = 10,120 configurations: refused before expansion.
    let ms: Vec<String> = (1..=920).map(|m| m.to_string()).collect();
    let huge = format!(
        "[[grid]]\nschedule=[\"1f1b\"]\npp=[1,2,3,4,5,6,7,8,9,10,11]\nmicrobatches=[{}]\n",
        ms.join(",")
    );
    for (text, needle) in [
        ("[[grid]]\nschedule = 1\n", "invalid type"),
        ("", "no configurations"),
        (huge.as_str(), "over the limit of 10000"),
    ] {
        let cfg = tmp.path().join("s.toml");
        std::fs::write(&cfg, text).unwrap();
        let res = pipec()
            .args(["compile", "--config"])
            .arg(&cfg)
            .arg("-o")
            .arg(&out)
            .assert()
            .code(2);
        let stderr = String::from_utf8(res.get_output().stderr.clone()).unwrap();
        assert!(stderr.contains(needle), "{needle}: {stderr}");
    }
    // --config excludes the single-schedule flags.
    pipec()
        .args(["compile", "--config", "x.toml", "--pp", "2", "-o"])
        .arg(&out)
        .assert()
        .code(2);
}
