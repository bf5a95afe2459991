//! The one CLI harness of the integration tests: the `pipec` and `pipec-run` binaries, and
//! `pipec compile` from a command line. Every test that runs `pipec` or `pipec-run` gets the
//! binary here.
//!
//! The commands are `std::process::Command`s: `.output()`, `.spawn()` with pipes, and, with
//! `assert_cmd::prelude::*` in scope, `.assert()`.

use std::path::{Path, PathBuf};
use std::process::Command;

/// A workspace binary (`pipec`, `pipec-run`), built if needed. Cargo builds a dependency's
/// binaries only for that package's own tests, so `CARGO_BIN_EXE_*` is not set in this crate
/// (and `assert_cmd::Command::cargo_bin` may find a stale binary of an earlier build): we
/// build the binary once per test process with the same profile as the test executable.
pub fn workspace_bin(package: &str, name: &str) -> Command {
    use std::collections::HashMap;
    use std::sync::{Mutex, OnceLock};
    static BUILT: OnceLock<Mutex<HashMap<String, PathBuf>>> = OnceLock::new();
    let mut built = BUILT.get_or_init(Default::default).lock().unwrap();
    let path = built
        .entry(name.to_string())
        .or_insert_with(|| {
            let exe = std::env::current_exe().expect("test executable");
            // target/<profile>/deps/integration-<hash>
            let profile_dir = exe.parent().and_then(Path::parent).expect("target dir");
            let mut build = Command::new(env!("CARGO"));
            build
                .args(["build", "--quiet", "-p", package, "--bin", name])
                .current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/.."));
            if profile_dir.ends_with("release") {
                build.arg("--release");
            }
            let status = build.status().expect("run cargo build");
            assert!(
                status.success(),
                "cargo build -p {package} --bin {name} failed"
            );
            profile_dir.join(format!("{name}{}", std::env::consts::EXE_SUFFIX))
        })
        .clone();
    Command::new(path)
}

/// The `pipec` binary, with `NO_COLOR` and `COLUMNS` removed from its environment so that its
/// output does not depend on the terminal the tests were started from.
pub fn pipec() -> Command {
    let mut c = workspace_bin("pipec-cli", "pipec");
    c.env_remove("NO_COLOR").env_remove("COLUMNS");
    c
}

/// `pipec ARGS`.
pub fn pipec_with<I, S>(args: I) -> Command
where
    I: IntoIterator<Item = S>,
    S: AsRef<std::ffi::OsStr>,
{
    let mut c = pipec();
    c.args(args);
    c
}

/// The `pipec-run` binary (the default build: CPU backend).
pub fn pipec_run() -> Command {
    workspace_bin("pipec-cli", "pipec-run")
}

/// `pipec-run DIR --timeout 5 EXTRA`: a run that cannot hang a test.
pub fn pipec_run_on(dir: &Path, extra: &[&str]) -> Command {
    let mut c = pipec_run();
    c.arg(dir).args(["--timeout", "5"]).args(extra);
    c
}

/// `pipec-run` as the CUDA tests use it: built with `--features cuda` when this crate has the
/// `cuda` feature ([`cuda_bin`]), else the default build.
pub fn pipec_run_cuda() -> Command {
    #[cfg(feature = "cuda")]
    {
        cuda_bin()
    }
    #[cfg(not(feature = "cuda"))]
    {
        pipec_run()
    }
}

/// `pipec-run` built with `--features cuda` (into its own target dir, so the default build's
/// binary used by the other tests is not replaced), or the prebuilt one named by
/// `PIPEC_CUDA_RUN_BIN` (a GPU machine without a Rust toolchain).
#[cfg(feature = "cuda")]
pub fn cuda_bin() -> Command {
    use std::sync::OnceLock;
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    let bin = BIN.get_or_init(|| {
        if let Some(prebuilt) = std::env::var_os("PIPEC_CUDA_RUN_BIN") {
            return prebuilt.into();
        }
        let root = concat!(env!("CARGO_MANIFEST_DIR"), "/..");
        let target = Path::new(root).join("target").join("cuda-tests");
        let status = Command::new(env!("CARGO"))
            .args([
                "build",
                "--quiet",
                "-p",
                "pipec-cli",
                "--features",
                "cuda",
                "--bin",
                "pipec-run",
                "--target-dir",
            ])
            .arg(&target)
            .current_dir(root)
            .status()
            .expect("run cargo build");
        assert!(status.success(), "cargo build --features cuda failed");
        target.join("debug").join("pipec-run")
    });
    Command::new(bin)
}

/// `pipec compile LINE -o DIR` (LINE split at whitespace, e.g.
/// `"--schedule 1f1b --pp 4 --microbatches 8"`), which must succeed; what it printed.
pub fn compile(dir: &Path, line: &str) -> String {
    let out = pipec_with(["compile"])
        .args(line.split_whitespace())
        .arg("-o")
        .arg(dir)
        .output()
        .expect("run pipec compile");
    assert!(
        out.status.success(),
        "pipec compile {line} -o {}: exit {:?}\n{}",
        dir.display(),
        out.status.code(),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf-8")
}

/// [`compile`] into `tmp/name`; that directory.
pub fn compiled(tmp: &Path, name: &str, line: &str) -> PathBuf {
    let dir = tmp.join(name);
    compile(&dir, line);
    dir
}
