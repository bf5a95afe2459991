//! The crate layout's promise (issue #27, ripgrep's layout): only the `pipec-cli` crate, which
//! holds the binaries, compiles clap, indicatif and mimalloc; the libraries and the Python
//! wheel do not.

/// The crates `package` compiles (normal dependencies), one `name version` per line.
fn tree(package: &str) -> String {
    let out = std::process::Command::new(env!("CARGO"))
        .args([
            "tree",
            "--offline",
            "--locked",
            "-e",
            "normal",
            "--prefix",
            "none",
        ])
        .args(["-p", package])
        .current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
        .output()
        .expect("run cargo tree");
    assert!(
        out.status.success(),
        "cargo tree -p {package}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

const CLI_ONLY: [&str; 3] = ["clap ", "indicatif ", "mimalloc "];

#[test]
fn only_the_cli_crate_depends_on_clap_indicatif_and_mimalloc() {
    for package in [
        "pipec-schedules",
        "pipec-ir",
        "pipec",
        "pipec-runtime",
        "pipec-python",
    ] {
        let tree = tree(package);
        for dep in CLI_ONLY {
            assert!(
                !tree.lines().any(|l| l.starts_with(dep)),
                "{package} depends on {dep}"
            );
        }
    }
    // And the binaries' crate does (the check above would pass on any name otherwise).
    let tree = tree("pipec-cli");
    for dep in CLI_ONLY {
        assert!(
            tree.lines().any(|l| l.starts_with(dep)),
            "pipec-cli lacks {dep}"
        );
    }
}
