//! What a user is told about bad input and by `pipec check`.
//!
//! The bad-input catalogue: layouts, parameters, instruction files and output directories a
//! real job can meet (hand-edited configs, truncated CI artifacts, files mixed from two
//! compiles, read-only targets). Every case must end in a clear message and exit code 1
//! (input invalid) or 2 (usage / I/O), never a panic or a hang, and never leave a half-written
//! output directory.
//!
//! What `pipec check` (and every command that takes a schedule directory) tells a user: the
//! compute-only CSV caveat, a pipec file where its directory is expected, a bounded risk
//! summary with `--strict`, JSON on stdout whatever happens, and `pipec seal`.

use crate::harness::{compile, compiled, pipec_run_on, pipec_with};
use pipec_compiler::compile::CompileRequest;
use pipec_ir::files::{self, Encoding, Header, Manifest, COMPUTE_ONLY_CAVEAT};
use pipec_ir::ir::{Instr, Payload, Program};
use pipec_schedules::layout::Layout;
use pipec_schedules::{Compute, Rank, ScheduleKind, Task};
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// What a failed command said (stderr, then stdout).
struct Refusal {
    code: i32,
    stderr: String,
}

/// Run `cmd`; it must fail with one of `codes`, say something on stderr, and not panic.
fn refuses(mut cmd: Command, codes: &[i32]) -> Refusal {
    let out: Output = cmd.output().expect("spawn");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let code = out.status.code().expect("exited, not killed by a signal");
    assert!(
        codes.contains(&code),
        "{cmd:?}: exit {code}, expected one of {codes:?}\nstdout: {stdout}\nstderr: {stderr}"
    );
    assert!(!stderr.contains("panicked"), "{cmd:?} panicked: {stderr}");
    // `pipec check` prints its verdict on stdout, errors go to stderr; a message in either.
    assert!(
        !(stderr.trim().is_empty() && stdout.trim().is_empty()),
        "{cmd:?}: no message"
    );
    Refusal {
        code,
        stderr: format!("{stderr}\n{stdout}"),
    }
}

fn ok(mut cmd: Command) -> String {
    let out = cmd.output().expect("spawn");
    assert!(
        out.status.success(),
        "{cmd:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Every file of a directory, name -> bytes (to prove a directory was left exactly as it was).
fn snapshot(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            (
                e.file_name().to_string_lossy().into_owned(),
                std::fs::read(e.path()).unwrap(),
            )
        })
        .collect()
}

// ---- layouts ---------------------------------------------------------------------------------

/// `pipec layout` and `pipec compile --layout` refuse a layout with exit 1 and a message
/// containing `why`; the compile writes nothing.
fn layout_refused(layout: &str, pp: &str, why: &str) {
    let r = refuses(pipec_with(["layout", layout, "--pp", pp]), &[1]);
    assert!(r.stderr.contains(why), "layout {layout:?}: {}", r.stderr);
    // The echo of the layout comes right after the headline.
    assert!(
        r.stderr
            .starts_with(&format!("error: invalid layout:\n  {layout}\n")),
        "layout {layout:?}: {}",
        r.stderr
    );
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let mut c = pipec_with(["compile", "--schedule", "1f1b", "--microbatches", "4"]);
    c.args(["--pp", pp, "--layout", layout, "-o"]).arg(&out);
    let r = refuses(c, &[1]);
    assert!(r.stderr.contains(why), "compile {layout:?}: {}", r.stderr);
    assert!(!out.exists(), "a refused compile wrote {}", out.display());
}

/// As [`layout_refused`], and the caret sits under character `at` of the layout.
fn layout_refused_at(layout: &str, pp: &str, at: usize, why: &str) {
    layout_refused(layout, pp, why);
    let r = refuses(pipec_with(["layout", layout, "--pp", pp]), &[1]);
    let caret = r.stderr.lines().nth(2).unwrap_or_default();
    assert_eq!(
        caret,
        format!("  {}^", " ".repeat(at)),
        "layout {layout:?}: {}",
        r.stderr
    );
}

const NO_LAYERS: &str =
    "the layout has no layers; it needs at least the embedding `E` and the loss `L`";

#[test]
fn empty_layout_is_refused() {
    layout_refused("", "1", NO_LAYERS);
}

#[test]
fn layout_of_only_separators_is_refused() {
    layout_refused("|||", "2", NO_LAYERS);
    layout_refused(",,,", "1", NO_LAYERS);
}

#[test]
fn unknown_layout_symbol_is_refused_with_its_position() {
    let r = refuses(pipec_with(["layout", "Etx|L", "--pp", "2"]), &[1]);
    assert!(r.stderr.contains('x'), "{}", r.stderr);
    layout_refused("Etx|L", "2", "x");
}

#[test]
fn unbalanced_parentheses_are_refused() {
    layout_refused_at("E(t|L", "2", 1, "`(` is never closed");
    layout_refused_at("Et)|L", "2", 2, "`)` without a matching `(`");
    layout_refused_at("E|((t|)*2|L", "2", 2, "`(` is never closed");
}

#[test]
fn huge_repeat_count_is_refused_without_expanding() {
    let layers = "the layout expands to more than 1048576 layers";
    layout_refused_at("Et*1000000000000|L", "1", 3, layers);
    layout_refused_at("E|(t|)*1000000000000,L", "2", 7, layers);
    // Nested repeats whose product is huge.
    layout_refused_at(
        "E|((((t|)*1000)*1000)*1000)*1000,L",
        "2",
        16,
        "the layout expands to more than 65536 stages",
    );
}

#[test]
fn non_ascii_digits_are_refused() {
    // Arabic-Indic three and fullwidth two: `char::is_numeric` but not repeat counts.
    layout_refused_at("Et*\u{663}|L", "2", 3, "'\u{663}' is not an ASCII digit");
    layout_refused_at("Et*\u{ff12}|L", "2", 3, "'\u{ff12}' is not an ASCII digit");
}

#[test]
fn zero_repeat_count_is_handled() {
    // `t*0` expands to nothing, textually, as in Megatron; what remains decides. Either way:
    // no panic, a decision.
    let out = pipec_with(["layout", "E|t*0|t|L", "--pp", "4"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(matches!(out.status.code(), Some(0 | 1)), "{stderr}");
    layout_refused_at(
        "E|(t|)*0",
        "1",
        7,
        "count of 0: Megatron would silently delete the item before `*0`",
    );
}

#[test]
fn megabyte_layout_from_a_file_is_refused_quickly() {
    let tmp = tempfile::tempdir().unwrap();
    let f = tmp.path().join("big.layout");
    let text = format!("E{}|L\n", "t".repeat(1 << 20));
    std::fs::write(&f, text).unwrap();
    let mut c = pipec_with(["layout", "--pp", "2", "--layout-file"]);
    c.arg(&f);
    refuses(c, &[1]);
    let out = tmp.path().join("out");
    let mut c = pipec_with(["compile", "--schedule", "1f1b", "--pp", "2"]);
    c.args(["--microbatches", "2", "--layout-file"])
        .arg(&f)
        .arg("-o")
        .arg(&out);
    refuses(c, &[1]);
    assert!(!out.exists());
}

#[test]
fn layout_file_with_invalid_utf8_names_the_byte_offset() {
    let tmp = tempfile::tempdir().unwrap();
    let f = tmp.path().join("bad.layout");
    std::fs::write(&f, b"Et|t\xff|L\n").unwrap();
    let mut c = pipec_with(["layout", "--pp", "2", "--layout-file"]);
    c.arg(&f);
    let r = refuses(c, &[1]);
    assert!(
        r.stderr.contains("UTF-8") && r.stderr.contains("offset 4"),
        "{}",
        r.stderr
    );
    let out = tmp.path().join("out");
    let mut c = pipec_with(["compile", "--schedule", "1f1b", "--pp", "2"]);
    c.args(["--microbatches", "2", "--layout-file"])
        .arg(&f)
        .arg("-o")
        .arg(&out);
    let r = refuses(c, &[1]);
    assert!(r.stderr.contains("offset 4"), "{}", r.stderr);
    assert!(!out.exists());
}

#[test]
fn layout_file_round_trips_and_missing_file_is_an_io_error() {
    let tmp = tempfile::tempdir().unwrap();
    let f = tmp.path().join("ok.layout");
    std::fs::write(&f, "Et|(t|)*2,L\r\n").unwrap();
    let mut c = pipec_with(["layout", "--pp", "2", "--json", "--layout-file"]);
    c.arg(&f);
    let from_file: serde_json::Value = serde_json::from_str(&ok(c)).unwrap();
    let inline: serde_json::Value = serde_json::from_str(&ok(pipec_with([
        "layout",
        "Et|(t|)*2,L",
        "--pp",
        "2",
        "--json",
    ])))
    .unwrap();
    assert_eq!(from_file, inline);
    let mut c = pipec_with(["layout", "--pp", "2", "--layout-file"]);
    c.arg(tmp.path().join("missing.layout"));
    let r = refuses(c, &[2]);
    assert!(r.stderr.contains("missing.layout"), "{}", r.stderr);
}

// ---- parameters ------------------------------------------------------------------------------

/// `pipec compile` with these arguments is refused with one of `codes` and a message
/// containing `why`, and writes nothing.
fn compile_refused(args: &[&str], codes: &[i32], why: &str) -> Refusal {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let mut c = pipec_with(["compile"]);
    c.args(args).arg("-o").arg(&out);
    let r = refuses(c, codes);
    assert!(r.stderr.contains(why), "{args:?}: {}", r.stderr);
    assert!(!out.exists(), "{args:?} wrote {}", out.display());
    r
}

#[test]
fn zero_pp_and_zero_microbatches_are_refused() {
    compile_refused(
        &["--schedule", "1f1b", "--pp", "0", "--microbatches", "4"],
        &[1],
        "pp must be at least 1",
    );
    compile_refused(
        &["--schedule", "1f1b", "--pp", "2", "--microbatches", "0"],
        &[1],
        "microbatches must be at least 1",
    );
    // `layout --pp 0` in the same words and with the same exit code as `compile --pp 0`.
    let r = refuses(pipec_with(["layout", "E|t|L", "--pp", "0"]), &[1]);
    assert!(r.stderr.contains("pp must be at least 1"), "{}", r.stderr);
}

#[test]
fn pp_larger_than_the_stages_is_refused() {
    compile_refused(
        &[
            "--schedule",
            "1f1b",
            "--pp",
            "4",
            "--microbatches",
            "4",
            "--layout",
            "E|t|L",
        ],
        &[1],
        "error",
    );
}

#[test]
fn microbatches_beyond_u32_is_a_usage_error() {
    compile_refused(
        &[
            "--schedule",
            "1f1b",
            "--pp",
            "2",
            "--microbatches",
            "1000000000000",
        ],
        &[2],
        "--microbatches",
    );
}

#[test]
fn vpp_that_does_not_divide_the_stages_is_refused() {
    compile_refused(
        &[
            "--schedule",
            "interleaved-1f1b",
            "--pp",
            "2",
            "--vpp",
            "3",
            "--microbatches",
            "4",
            "--layout",
            "E|t|t|L",
        ],
        &[1],
        "error",
    );
}

#[test]
fn group_size_out_of_range_is_refused() {
    for g in ["1", "0", "4000000000"] {
        compile_refused(
            &[
                "--schedule",
                "interleaved-1f1b",
                "--pp",
                "2",
                "--vpp",
                "2",
                "--microbatches",
                "4",
                "--group-size",
                g,
            ],
            &[1],
            "group size",
        );
    }
}

/// Sizes that would need gigabytes are refused up front by the `--max-ops` limit, whose
/// message names the flag; the limit is configurable both ways.
#[test]
fn huge_schedules_are_refused_by_the_op_limit_before_allocating() {
    for args in [
        &[
            "--schedule",
            "gpipe",
            "--pp",
            "4096",
            "--microbatches",
            "4000000000",
        ][..],
        &[
            "--schedule",
            "1f1b",
            "--pp",
            "64",
            "--microbatches",
            "4000000000",
        ],
        &[
            "--schedule",
            "interleaved-1f1b",
            "--pp",
            "4096",
            "--vpp",
            "16",
            "--microbatches",
            "65536",
        ],
        &[
            "--schedule",
            "1f1b",
            "--pp",
            "2",
            "--microbatches",
            "4",
            "--max-ops",
            "10",
        ],
    ] {
        compile_refused(args, &[1], "--max-ops");
    }
    // The same small schedule passes with the default limit.
    let tmp = tempfile::tempdir().unwrap();
    let mut c = pipec_with(["compile", "--schedule", "1f1b", "--pp", "2"]);
    c.args(["--microbatches", "4", "-o"])
        .arg(tmp.path().join("o"));
    ok(c);
}

/// Regression (#29): `compile --pp 100000` and `--vpp 100000` wrote 415 MB and 1.3 GB with
/// only a size warning; now refused at once (exit 1), naming the bound, writing nothing.
#[test]
fn compile_pp_and_vpp_are_bounded() {
    let deep = [
        "--schedule",
        "1f1b",
        "--pp",
        "100000",
        "--microbatches",
        "1",
    ];
    compile_refused(&deep, &[1], "over the limit of 4096 ranks");
    let wide = [
        "--schedule",
        "interleaved-1f1b",
        "--pp",
        "2",
        "--vpp",
        "100000",
        "--microbatches",
        "2",
    ];
    compile_refused(&wide, &[1], "stages is over the limit of 65536 stages");
    // `compare --schedule` compiles in memory through the same check.
    let r = refuses(
        pipec_with([
            "compare",
            "--schedule",
            "1f1b",
            "--pp",
            "100000",
            "--microbatches",
            "1",
        ]),
        &[1],
    );
    assert!(r.stderr.contains("4096 ranks"), "{}", r.stderr);
}

/// Regression (#29): `--schedule interleaved-1f1b` without `--vpp` silently compiled vpp=1
/// (1F1B's makespan with nearly twice its activations); looped-bfs the same.
#[test]
fn interleaved_without_vpp_is_refused() {
    for kind in ["interleaved-1f1b", "looped-bfs"] {
        let args = ["--schedule", kind, "--pp", "4", "--microbatches", "8"];
        let r = compile_refused(&args, &[1], "needs the number of model chunks per rank");
        assert!(r.stderr.contains("--vpp"), "{}", r.stderr);
    }
    // With --vpp, or a layout that gives it, it compiles.
    let tmp = tempfile::tempdir().unwrap();
    let mut c = pipec_with(["compile", "--schedule", "interleaved-1f1b", "--pp", "2"]);
    c.args(["--vpp", "2", "--microbatches", "4", "-o"])
        .arg(tmp.path().join("a"));
    ok(c);
    let mut c = pipec_with(["compile", "--schedule", "interleaved-1f1b", "--pp", "2"]);
    c.args(["--layout", "Et|t|t|tL", "--microbatches", "4", "-o"])
        .arg(tmp.path().join("b"));
    ok(c);
}

/// Regression (#29): the same mistake exited differently and `--memory-limit -5GiB` was read
/// as an unknown flag; an unknown kind printed clap's usage footer; `-1GiB` in a cost was
/// "not a number".
#[test]
fn bad_values_exit_1_with_their_reason() {
    let m = ["--schedule", "1f1b", "--pp", "2", "--microbatches", "4"];
    let neg = [&m[..], &["--memory-limit", "-5GiB"]].concat();
    compile_refused(&neg, &[1], "--memory-limit: `-5GiB` is negative");
    let bytes = [&m[..], &["--memory-limit", "40GiB"]].concat();
    compile_refused(
        &bytes,
        &[1],
        "is in bytes, but the cost model gives memory in layer-activations",
    );
    let r = compile_refused(
        &[
            "--schedule",
            "ZBVZeroBubble",
            "--pp",
            "2",
            "--microbatches",
            "4",
        ],
        &[1],
        "did you mean `zb-v`?",
    );
    assert!(!r.stderr.contains("Usage:"), "{}", r.stderr);
    assert!(!r.stderr.contains("--help"), "{}", r.stderr);
    let (_t, dir) = compiled_dir();
    let mut c = pipec_with(["simulate"]);
    c.arg(&dir).args(["--cost", "t.act=-1GiB"]);
    let r = refuses(c, &[1]);
    assert!(r.stderr.contains("`-1GiB` is negative"), "{}", r.stderr);
}

/// Regression (#29): a permission error named pipec's hidden staging directory
/// (`.x.pipec-tmp-3646`) rather than the path the user gave.
#[cfg(unix)]
#[test]
fn write_errors_name_the_users_path() {
    use std::os::unix::fs::PermissionsExt;
    let tmp = tempfile::tempdir().unwrap();
    let ro = tmp.path().join("ro");
    std::fs::create_dir(&ro).unwrap();
    std::fs::set_permissions(&ro, std::fs::Permissions::from_mode(0o555)).unwrap();
    // root ignores permission bits: nothing to observe there.
    if std::fs::write(ro.join("probe"), b"").is_ok() {
        std::fs::remove_file(ro.join("probe")).unwrap();
        std::fs::set_permissions(&ro, std::fs::Permissions::from_mode(0o755)).unwrap();
        // Make the parent a file instead: creating the output then fails for everyone.
        std::fs::remove_dir(&ro).unwrap();
        std::fs::write(&ro, b"not a directory").unwrap();
    }
    let out = ro.join("out");
    let mut c = pipec_with(["compile", "--schedule", "1f1b", "--pp", "2"]);
    c.args(["--microbatches", "4", "-o"]).arg(&out);
    let r = refuses(c, &[2]);
    assert!(
        r.stderr.contains(&out.display().to_string()),
        "{}",
        r.stderr
    );
    assert!(!r.stderr.contains("pipec-tmp"), "{}", r.stderr);
}

// ---- instruction files -----------------------------------------------------------------------

fn request(kind: ScheduleKind, pp: u32, vpp: u32, m: u32) -> CompileRequest {
    CompileRequest {
        vpp: Some(vpp),
        ..CompileRequest::new(kind, pp, m)
    }
}

/// A valid compiled directory (1F1B, pp 2, 4 microbatches) in a fresh temp dir.
fn compiled_dir() -> (tempfile::TempDir, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = compiled(
        tmp.path(),
        "sched",
        "--schedule 1f1b --pp 2 --microbatches 4",
    );
    (tmp, dir)
}

/// Write a program as a sealed directory: correct hashes, whatever the content.
fn write_sealed(p: &Program, dir: &Path) {
    let layout = Layout::uniform(p.num_stages());
    let header = Header {
        source: "hand-written",
        schedule: None,
        layout: &layout,
    };
    pipec_ir::files::write_unverified(dir, &header, &pipec_tests::unverified(p), Encoding::Json)
        .unwrap();
}

fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn manifest(dir: &Path) -> Manifest {
    serde_json::from_slice(&std::fs::read(dir.join("manifest.json")).unwrap()).unwrap()
}

fn write_manifest(dir: &Path, m: &Manifest) {
    std::fs::write(
        dir.join("manifest.json"),
        serde_json::to_string_pretty(m).unwrap(),
    )
    .unwrap();
}

/// `pipec check`, `pipec show` and `pipec-run` (verified and `--no-verify`) all refuse `dir`
/// with one of `codes` and a message containing `why`.
fn all_readers_refuse(dir: &Path, codes: &[i32], why: &str) {
    let mut check = pipec_with(["check"]);
    check.arg(dir);
    let mut show = pipec_with(["show"]);
    show.arg(dir).arg("--no-color");
    for (what, cmd) in [
        ("check", check),
        ("show", show),
        ("pipec-run", pipec_run_on(dir, &[])),
        ("pipec-run --no-verify", pipec_run_on(dir, &["--no-verify"])),
    ] {
        let r = refuses(cmd, codes);
        assert!(r.stderr.contains(why), "{what}: {}", r.stderr);
    }
}

#[test]
fn truncated_rank_file_is_refused() {
    let (_t, dir) = compiled_dir();
    let f = dir.join("rank-1.json");
    let bytes = std::fs::read(&f).unwrap();
    std::fs::write(&f, &bytes[..bytes.len() / 2]).unwrap();
    all_readers_refuse(&dir, &[1, 2], "rank-1.json");
    // With the manifest's sha256 updated to the truncated bytes, the JSON parser refuses it.
    let mut m = manifest(&dir);
    m.ranks[1].sha256 = sha256_hex(&bytes[..bytes.len() / 2]);
    write_manifest(&dir, &m);
    all_readers_refuse(&dir, &[1, 2], "not a valid pipec file");
}

#[test]
fn truncated_or_non_json_manifest_is_refused() {
    let (_t, dir) = compiled_dir();
    let f = dir.join("manifest.json");
    let bytes = std::fs::read(&f).unwrap();
    std::fs::write(&f, &bytes[..bytes.len() / 3]).unwrap();
    all_readers_refuse(&dir, &[1, 2], "manifest.json");
    std::fs::write(&f, b"\x00\x01PK binary garbage \xff\xfe").unwrap();
    all_readers_refuse(&dir, &[1, 2], "not a valid pipec file");
    std::fs::write(&f, b"").unwrap();
    all_readers_refuse(&dir, &[1, 2], "manifest.json");
}

#[test]
fn unknown_format_version_names_both_versions() {
    let (_t, dir) = compiled_dir();
    let f = dir.join("manifest.json");
    let text = std::fs::read_to_string(&f).unwrap();
    std::fs::write(&f, text.replace("\"version\": 1,", "\"version\": 7,")).unwrap();
    all_readers_refuse(&dir, &[1, 2], "version 7");
    all_readers_refuse(&dir, &[1, 2], "version 1");
}

#[test]
fn edited_rank_file_fails_its_content_hash() {
    let (_t, dir) = compiled_dir();
    let f = dir.join("rank-0.json");
    let text = std::fs::read_to_string(&f).unwrap();
    std::fs::write(&f, text.replacen("\"mb\":0", "\"mb\":1", 1)).unwrap();
    all_readers_refuse(&dir, &[1, 2], "content hash");
}

/// A tamperer who also recomputes the file's sha256 in the manifest is still caught: the
/// schedule hash covers every instruction.
#[test]
fn tampered_rank_file_with_resealed_sha256_fails_the_schedule_hash() {
    let (_t, dir) = compiled_dir();
    let f = dir.join("rank-0.json");
    let text = std::fs::read_to_string(&f).unwrap();
    let edited = text.replacen("\"mb\":0", "\"mb\":1", 1);
    assert_ne!(edited, text);
    std::fs::write(&f, &edited).unwrap();
    let mut m = manifest(&dir);
    m.ranks[0].sha256 = sha256_hex(edited.as_bytes());
    write_manifest(&dir, &m);
    all_readers_refuse(&dir, &[1, 2], "schedule hash");
}

#[test]
fn rank_file_from_another_compile_is_refused() {
    let (_t, dir) = compiled_dir();
    let tmp = tempfile::tempdir().unwrap();
    let other = tmp.path().join("other");
    let mut c = pipec_with(["compile", "--schedule", "gpipe", "--pp", "2"]);
    c.args(["--microbatches", "4", "-o"]).arg(&other);
    ok(c);
    let foreign = std::fs::read(other.join("rank-1.json")).unwrap();
    std::fs::write(dir.join("rank-1.json"), &foreign).unwrap();
    all_readers_refuse(&dir, &[1, 2], "content hash");
    let mut m = manifest(&dir);
    m.ranks[1].sha256 = sha256_hex(&foreign);
    write_manifest(&dir, &m);
    all_readers_refuse(&dir, &[1, 2], "different compile");
}

#[test]
fn missing_rank_file_is_an_io_error() {
    let (_t, dir) = compiled_dir();
    std::fs::remove_file(dir.join("rank-1.json")).unwrap();
    all_readers_refuse(&dir, &[2], "rank-1.json");
}

#[test]
fn missing_directory_is_an_io_error() {
    let tmp = tempfile::tempdir().unwrap();
    all_readers_refuse(&tmp.path().join("nope"), &[2], "nope");
}

#[test]
fn manifest_listing_another_world_size_is_refused() {
    let (_t, dir) = compiled_dir();
    let mut m = manifest(&dir);
    m.world_size = 3;
    write_manifest(&dir, &m);
    all_readers_refuse(&dir, &[1, 2], "world size of 3");
    // A consistent-looking manifest for 1 rank whose rank list was cut: placement disagrees.
    let mut m = manifest(&dir);
    m.world_size = 1;
    m.ranks.truncate(1);
    write_manifest(&dir, &m);
    all_readers_refuse(&dir, &[1, 2], "placement");
}

#[test]
fn launch_world_size_mismatch_is_refused() {
    let (_t, dir) = compiled_dir();
    let r = refuses(pipec_run_on(&dir, &["--world-size", "3"]), &[1]);
    assert!(r.stderr.contains("world_size"), "{}", r.stderr);
}

fn one_f_one_b() -> Program {
    pipec_compiler::compile::compile(&request(ScheduleKind::OneFOneB, 2, 1, 2))
        .unwrap()
        .program
}

/// Sealed (all hashes right) but broken programs: `check` reports the violation (exit 1),
/// `show` does not panic, `pipec-run` refuses with or without the full verifier (exit 1).
fn sealed_broken(p: &Program, class: &str) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("broken");
    write_sealed(p, &dir);
    let mut check = pipec_with(["check"]);
    check.arg(&dir);
    let r = refuses(check, &[1]);
    assert!(r.stderr.contains(class) || r.code == 1, "{}", r.stderr);
    let out = pipec_with(["show"])
        .arg(&dir)
        .arg("--no-color")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("panicked"), "show panicked: {stderr}");
    assert!(
        matches!(out.status.code(), Some(0..=2)),
        "show: {:?} {stderr}",
        out.status
    );
    refuses(pipec_run_on(&dir, &[]), &[1]);
    refuses(pipec_run_on(&dir, &["--no-verify"]), &[1]);
}

fn compute_at(p: &Program, rank: usize, pred: impl Fn(&Compute) -> bool) -> usize {
    p.ranks[rank]
        .iter()
        .position(|i| matches!(i, Instr::Compute(c) if pred(c)))
        .unwrap()
}

#[test]
fn out_of_range_stage_microbatch_and_peer_are_refused() {
    let base = one_f_one_b();
    let mut p = base.clone();
    let i = compute_at(&p, 0, |c| matches!(c, Compute::Fwd(_)));
    p.ranks[0][i] = Instr::Compute(Compute::Fwd(Task::new(7, 0)));
    sealed_broken(&p, "stage 7");
    let mut p = base.clone();
    p.ranks[0][i] = Instr::Compute(Compute::Fwd(Task::new(0, u32::MAX)));
    sealed_broken(&p, "mb");
    let mut p = base.clone();
    let s = p.ranks[0]
        .iter()
        .position(|i| matches!(i, Instr::Send { .. }))
        .unwrap();
    if let Instr::Send { peer, .. } = &mut p.ranks[0][s] {
        *peer = Rank(u32::MAX);
    }
    sealed_broken(&p, "rank");
    let mut p = base.clone();
    if let Instr::Send { payload, .. } = &mut p.ranks[0][s] {
        *payload = Payload::act(u32::MAX, 0);
    }
    sealed_broken(&p, "stage");
}

#[test]
fn duplicated_or_missing_instructions_are_refused() {
    let base = one_f_one_b();
    let mut p = base.clone();
    let i = compute_at(&p, 1, |c| matches!(c, Compute::Bwd(_)));
    let dup = p.ranks[1][i];
    p.ranks[1].insert(i, dup);
    sealed_broken(&p, "incomplete");
    let mut p = base.clone();
    p.ranks[1].remove(i);
    sealed_broken(&p, "incomplete");
    let mut p = base.clone();
    p.ranks[0].clear();
    sealed_broken(&p, "incomplete");
}

#[test]
fn placement_for_another_world_is_refused() {
    let mut p = one_f_one_b();
    p.ranks.push(Vec::new());
    // The files take the world from the rank streams: 3 streams, placement for pp 2.
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("w");
    write_sealed(&p, &dir);
    all_readers_refuse(&dir, &[1, 2], "placement");
}

// ---- output ----------------------------------------------------------------------------------

fn compile_into(dir: &Path, args: &[&str]) -> Output {
    let mut c = pipec_with(["compile"]);
    c.args(args).arg("-o").arg(dir);
    c.output().unwrap()
}

const A: &[&str] = &["--schedule", "1f1b", "--pp", "4", "--microbatches", "4"];
const B: &[&str] = &["--schedule", "gpipe", "--pp", "2", "--microbatches", "3"];

#[test]
fn output_directory_holding_other_files_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("out");
    std::fs::create_dir(&dir).unwrap();
    std::fs::write(dir.join("notes.txt"), "mine").unwrap();
    let before = snapshot(&dir);
    let mut c = pipec_with(["compile"]);
    c.args(A).arg("-o").arg(&dir);
    let r = refuses(c, &[2]);
    assert!(r.stderr.contains("notes.txt"), "{}", r.stderr);
    assert_eq!(snapshot(&dir), before);
}

#[test]
fn output_under_a_regular_file_is_an_io_error() {
    // Tests run as root, which bypasses permission bits; a path under a regular file fails for
    // everyone (ENOTDIR).
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("somefile");
    std::fs::write(&file, "x").unwrap();
    let mut c = pipec_with(["compile"]);
    c.args(A).arg("-o").arg(file.join("out"));
    let r = refuses(c, &[2]);
    assert!(r.stderr.contains("somefile"), "{}", r.stderr);
    assert_eq!(std::fs::read(&file).unwrap(), b"x");
    let mut c = pipec_with(["compile"]);
    c.args(A).arg("-o").arg(&file);
    refuses(c, &[2]);
    assert_eq!(std::fs::read(&file).unwrap(), b"x");
}

/// Compiling B over A replaces the whole directory: A had 4 rank files, B has 2, and no rank
/// file of A survives. Then a failing compile leaves B's directory byte for byte.
#[test]
fn recompiling_replaces_every_rank_file_and_a_failed_compile_changes_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("out");
    assert!(compile_into(&dir, A).status.success());
    assert_eq!(snapshot(&dir).len(), 5);
    assert!(compile_into(&dir, B).status.success());
    let files = snapshot(&dir);
    let b_hash = manifest(&dir).schedule_hash;
    assert_eq!(
        files.keys().cloned().collect::<Vec<_>>(),
        ["manifest.json", "rank-0.json", "rank-1.json"]
    );
    for (name, bytes) in &files {
        if name.starts_with("rank-") {
            let v: serde_json::Value = serde_json::from_slice(bytes).unwrap();
            assert_eq!(v["schedule_hash"], b_hash.as_str(), "{name}");
        }
    }
    pipec_runtime::load(&dir, None).expect("B loads and verifies");
    // Binary encoding over JSON: only .bin rank files remain.
    let mut bin = B.to_vec();
    bin.extend(["--format", "bin"]);
    assert!(compile_into(&dir, &bin).status.success());
    let names: Vec<String> = snapshot(&dir).into_keys().collect();
    assert_eq!(names, ["manifest.json", "rank-0.bin", "rank-1.bin"]);
    let before = snapshot(&dir);
    for bad in [
        &["--schedule", "1f1b", "--pp", "2", "--microbatches", "0"][..],
        &[
            "--schedule",
            "1f1b",
            "--pp",
            "2",
            "--microbatches",
            "2",
            "--layout",
            "E|(t|L",
        ],
        &[
            "--schedule",
            "1f1b",
            "--pp",
            "2",
            "--microbatches",
            "2",
            "--memory-limit",
            "0",
        ],
    ] {
        let out = compile_into(&dir, bad);
        assert_eq!(out.status.code(), Some(1), "{bad:?}");
        assert_eq!(snapshot(&dir), before, "{bad:?} changed the directory");
    }
    // No temporary directories were left beside it.
    let siblings: Vec<_> = std::fs::read_dir(tmp.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(siblings, [std::ffi::OsString::from("out")]);
}

/// The layer cap of layout strings, as `pipec layout` reports it (2^20): the same number
/// every `--num-layers` / `--mtp-num-layers` bound must name.
fn layout_layer_cap() -> String {
    let r = refuses(pipec_with(["layout", "E,t*1048577,L", "--pp", "1"]), &[1]);
    assert!(r.stderr.contains("1048576"), "{}", r.stderr);
    "over the limit of 1048576 layers".to_string()
}

/// Regression (#28): `compile --num-layers 4000000000` aborted on a failed allocation (the
/// even split built one entry per layer); `--mtp-num-layers` the same. Now refused (exit 1)
/// at the layout strings' cap, before anything is allocated.
#[test]
fn compile_num_layers_is_capped() {
    let why = layout_layer_cap();
    let base = ["--schedule", "1f1b", "--pp", "4", "--microbatches", "8"];
    for extra in [
        &["--num-layers", "4000000000"][..],
        &["--num-layers", "1048580"],
        &["--num-layers", "4", "--mtp-num-layers", "4000000000"],
    ] {
        let args: Vec<&str> = base.iter().chain(extra).copied().collect();
        compile_refused(&args, &[1], &why);
    }
    // The cap itself is accepted (4 x 2^18 decoder layers split evenly).
    let tmp = tempfile::tempdir().unwrap();
    let mut c = pipec_with(["compile"]);
    c.args(base)
        .args(["--num-layers", "1048576", "-o"])
        .arg(tmp.path().join("o"));
    ok(c);
}

/// Regression (#28): `compare --num-layers 4000000000` aborted the same way.
#[test]
fn compare_num_layers_is_capped() {
    let why = layout_layer_cap();
    for extra in [
        &["--num-layers", "4000000000"][..],
        &["--num-layers", "4", "--mtp-num-layers", "4000000000"],
    ] {
        let mut c = pipec_with([
            "compare",
            "--schedule",
            "1f1b",
            "--pp",
            "4",
            "--microbatches",
            "8",
        ]);
        c.args(extra);
        let r = refuses(c, &[1]);
        assert!(r.stderr.contains(&why), "{extra:?}: {}", r.stderr);
    }
}

/// Regression (#28): `tune --num-layers 100000000` ran 70 s and 5.1 GB; now refused at the
/// layout strings' cap like compile.
#[test]
fn tune_num_layers_is_capped() {
    let why = layout_layer_cap();
    for extra in [
        &["--num-layers", "100000000"][..],
        &["--num-layers", "4000000000"],
        &["--num-layers", "8", "--mtp-num-layers", "4000000000"],
    ] {
        let mut c = pipec_with(["tune", "--pp", "4", "--microbatches", "8"]);
        c.args(extra);
        let r = refuses(c, &[1]);
        assert!(r.stderr.contains(&why), "{extra:?}: {}", r.stderr);
    }
}

/// Regression (#28): `tune --num-layers 0` returned "gpipe, makespan 0" with exit 0; now
/// refused. A model with fewer decoder layers than stages is tuned, and when the winner has
/// stages with no layer at all (counted here from its own layout string, parsed back) the
/// report says how many.
#[test]
fn tune_zero_layers_refused() {
    let r = refuses(
        pipec_with([
            "tune",
            "--pp",
            "4",
            "--microbatches",
            "8",
            "--num-layers",
            "0",
        ]),
        &[1],
    );
    assert!(r.stderr.contains("no decoder layers"), "{}", r.stderr);
    let out = ok(pipec_with([
        "tune",
        "--pp",
        "8",
        "--microbatches",
        "8",
        "--num-layers",
        "2",
        "--target",
        "any",
    ]));
    let layout = out
        .lines()
        .find_map(|l| l.strip_prefix("layout:"))
        .expect("a layout line")
        .trim();
    let stages = pipec_schedules::layout::parse(layout).unwrap().stages;
    let empty = stages.iter().filter(|s| s.is_empty()).count();
    assert!(empty > 0, "{out}");
    assert!(
        out.contains(&format!(
            "note:     {empty} of {} stages hold no layer",
            stages.len()
        )),
        "{out}"
    );
}

/// Regression (#28): `tune --pp 4000` aborted on a failed allocation under 6 GB; pp is
/// capped as the schedule spec caps it, in compile's words.
#[test]
fn tune_pp_is_capped() {
    let c = compile_refused(
        &["--schedule", "1f1b", "--pp", "4097", "--microbatches", "1"],
        &[1],
        "4096 ranks",
    );
    let r = refuses(
        pipec_with(["tune", "--pp", "4097", "--microbatches", "1"]),
        &[1],
    );
    let line = |s: &str| {
        s.lines()
            .find(|l| l.contains("4096"))
            .unwrap_or("")
            .to_string()
    };
    assert_eq!(line(&r.stderr), line(&c.stderr), "{}", r.stderr);
}

/// Regression (#28): `--max-ops` took any value, so the op limit that guards every
/// allocation could be switched off. Now 1 to 2^28 (a usage error, exit 2, outside it).
#[test]
fn max_ops_is_capped() {
    for cmd in ["compile", "tune"] {
        for bad in ["0", "268435457", "18446744073709551615"] {
            let mut c = pipec_with([cmd, "--pp", "2", "--microbatches", "4", "--max-ops", bad]);
            if cmd == "compile" {
                c.args(["--schedule", "1f1b", "-o", "/nonexistent/never-written"]);
            }
            let r = refuses(c, &[2]);
            assert!(r.stderr.contains("--max-ops"), "{cmd} {bad}: {}", r.stderr);
        }
    }
    let tmp = tempfile::tempdir().unwrap();
    let mut c = pipec_with([
        "compile",
        "--schedule",
        "1f1b",
        "--pp",
        "2",
        "--microbatches",
        "4",
    ]);
    c.args(["--max-ops", "268435456", "-o"])
        .arg(tmp.path().join("o"));
    ok(c);
}

// ---------------------------------------------------------------------------------------------
// `pipec check` and every command that takes a schedule directory.

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
    assert_eq!(v["passed"], true);
    assert_eq!(v["strict_failed"], false);
    let (code, out, _) = check(&["--json", "--all-risks", "--strict"]);
    assert_eq!(code, 1);
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["risks"].as_array().unwrap().len(), total);
    assert_eq!(v["exit_code"], 1);
    assert_eq!(v["strict"], true);
    // The program is valid (it runs); the check failed, and `passed` says so as the exit code
    // does (issue #40: `"valid": true` alone read as a pass).
    assert_eq!(v["valid"], true);
    assert_eq!(v["passed"], false);
    assert_eq!(v["strict_failed"], true);
    // A schedule without risks passes --strict.
    let clean = tmp.path().join("1f1b");
    compile(&clean, "--schedule 1f1b --pp 4 --microbatches 8");
    assert_eq!(count_risks(&clean), 0);
    let mut c = pipec_with(["check", "--strict"]);
    c.arg(&clean);
    let (code, out, _) = run(c);
    assert_eq!(code, 0, "{out}");
    assert!(!out.contains("risks:"), "{out}");
    let mut c = pipec_with(["check", "--strict", "--json"]);
    c.arg(&clean);
    let (code, out, _) = run(c);
    assert_eq!(code, 0, "{out}");
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        (&v["passed"], &v["strict_failed"]),
        (&true.into(), &false.into())
    );
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
    let c = pipec_compiler::compile::compile(&pipec_compiler::compile::CompileRequest::new(
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
        let (name, bytes) = originals
            .iter()
            .nth((next() % originals.len() as u64) as usize)
            .unwrap();
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
    // A model given: L is free at its default 0, which the line says by its key (issue #40:
    // "no cost given" was false of a tuned directory whose manifest records `E.f=0`).
    let (_, out, _) = run(pipec_with(["simulate", d, "--cost", "E.f=0.5"]));
    assert!(out.contains("E: f=0.5 b=0 w=0; L free (L.f=0)"), "{out}");
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
