//! The crate layout's promise (issue #27, ripgrep's layout): only the `pipec-cli` crate, which
//! holds the binaries, compiles clap, indicatif and mimalloc; the libraries and the Python
//! wheel do not.

#[test]
fn only_the_cli_crate_depends_on_clap_indicatif_and_mimalloc() {
    for package in ["pipec-schedules", "pipec", "pipec-runtime", "pipec-python"] {
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
        let tree = String::from_utf8(out.stdout).unwrap();
        for dep in ["clap ", "indicatif ", "mimalloc "] {
            assert!(
                !tree.lines().any(|l| l.starts_with(dep)),
                "{package} depends on {dep}"
            );
        }
    }
    // And the binaries' crate does (the check above would pass on any name otherwise).
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
        .args(["-p", "pipec-cli"])
        .current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
        .output()
        .expect("run cargo tree");
    let tree = String::from_utf8(out.stdout).unwrap();
    for dep in ["clap ", "indicatif ", "mimalloc "] {
        assert!(
            tree.lines().any(|l| l.starts_with(dep)),
            "pipec-cli lacks {dep}"
        );
    }
}
