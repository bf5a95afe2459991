//! The crate layout's promises: only the `pipec-cli` crate, which holds the binaries, compiles
//! clap, indicatif and mimalloc (ripgrep's layout); the crates depend along the flow of data;
//! no crate re-exports another's code; no two files of a crate import each other.

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
        "pipec-cost",
        "pipec-compiler",
        "pipec-tune",
        "pipec-runtime",
        "pipec-cuda",
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

/// `cargo metadata` of the workspace (no dependencies resolved beyond the members).
fn metadata() -> serde_json::Value {
    let out = std::process::Command::new(env!("CARGO"))
        .args([
            "metadata",
            "--format-version",
            "1",
            "--offline",
            "--locked",
            "--no-deps",
        ])
        .current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
        .output()
        .expect("run cargo metadata");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// The crates follow the flow of data (issue #41): each depends, in any kind of dependency
/// (normal, build or dev), on exactly the pipec crates listed, so the runtime builds without
/// the compiler or the tuner, and the cost model without lowering.
#[test]
fn crates_depend_along_the_flow_of_data() {
    const S: &str = "pipec-schedules";
    const IR: &str = "pipec-ir";
    const COST: &str = "pipec-cost";
    const COMPILER: &str = "pipec-compiler";
    const TUNE: &str = "pipec-tune";
    const RUNTIME: &str = "pipec-runtime";
    const CUDA: &str = "pipec-cuda";
    let want: &[(&str, &[&str])] = &[
        (S, &[]),
        (IR, &[S]),
        (COST, &[S, IR]),
        (COMPILER, &[S, IR, COST]),
        (TUNE, &[S, IR, COST, COMPILER]),
        (RUNTIME, &[S, IR, COST]),
        (CUDA, &[S, IR, COST, RUNTIME]),
        ("pipec-cli", &[S, IR, COST, COMPILER, TUNE, RUNTIME, CUDA]),
        ("pipec-python", &[S, IR, COST, COMPILER, TUNE, RUNTIME]),
        ("pipec-tests", &[S, IR, COST, COMPILER, TUNE, RUNTIME, CUDA]),
    ];
    let meta = metadata();
    let packages = meta["packages"].as_array().unwrap();
    for (name, deps) in want {
        let p = packages
            .iter()
            .find(|p| p["name"] == *name)
            .unwrap_or_else(|| panic!("{name} is not a workspace member"));
        let mut got: Vec<&str> = p["dependencies"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|d| d["name"].as_str())
            .filter(|d| d.starts_with("pipec"))
            .collect();
        got.sort_unstable();
        got.dedup();
        let mut want = deps.to_vec();
        want.sort_unstable();
        assert_eq!(got, want, "the pipec crates {name} depends on");
    }
    let members: Vec<&str> = packages.iter().filter_map(|p| p["name"].as_str()).collect();
    assert_eq!(
        members.len(),
        want.len(),
        "a member without an expected row: {members:?}"
    );
}

/// One crate's source files (tests, benches and examples apart): path relative to the
/// repository, and the text with comments and `#[cfg(test)]` modules taken out.
fn sources(dir: &std::path::Path, out: &mut Vec<(std::path::PathBuf, String)>) {
    let mut entries: Vec<_> = std::fs::read_dir(dir).unwrap().flatten().collect();
    entries.sort_by_key(|e| e.path());
    for e in entries {
        let p = e.path();
        if p.is_dir() {
            sources(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            let text = std::fs::read_to_string(&p).unwrap();
            let code = text.split("#[cfg(test)]\nmod tests").next().unwrap();
            let code = code
                .lines()
                .filter(|l| !l.trim_start().starts_with("//"))
                .collect::<Vec<_>>()
                .join("\n");
            out.push((p, code));
        }
    }
}

/// The crate roots: each workspace member's `src` (whose `lib.rs` or `main.rs` roots a
/// module tree, as do `src/bin/NAME/main.rs`).
fn crate_sources() -> Vec<(String, Vec<(std::path::PathBuf, String)>)> {
    let root = std::path::Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/.."));
    let mut out = Vec::new();
    for dir in [
        "schedules",
        "ir",
        "cost",
        "compiler",
        "tune",
        "runtime",
        "cuda",
        "cli",
        "python",
    ] {
        let mut files = Vec::new();
        sources(&root.join(dir).join("src"), &mut files);
        out.push((dir.to_string(), files));
    }
    out
}

/// Nothing re-exports another crate's items: every import names the crate that owns the
/// code, so a reader sees the real dependency.
#[test]
fn no_crate_re_exports_another() {
    let mut found = Vec::new();
    for (krate, files) in crate_sources() {
        for (path, code) in files {
            for (i, line) in code.lines().enumerate() {
                let l = line.trim_start();
                let reexport = ["pub use ", "pub(crate) use "]
                    .iter()
                    .any(|p| l.starts_with(p))
                    && l.contains("pipec_");
                if reexport || l.starts_with("pub extern crate") {
                    found.push(format!("{krate}: {}:{}: {l}", path.display(), i + 1));
                }
            }
        }
    }
    assert!(
        found.is_empty(),
        "re-exports of other crates:\n{}",
        found.join("\n")
    );
}

/// The module a file defines, as a path from its crate root (`[]` for `lib.rs`/`main.rs`).
fn module_of(roots: &[std::path::PathBuf], file: &std::path::Path) -> (usize, Vec<String>) {
    let (r, root) = roots
        .iter()
        .enumerate()
        .filter(|(_, r)| file.starts_with(r))
        .max_by_key(|(_, r)| r.components().count())
        .expect("a file under a crate root");
    let rel = file.strip_prefix(root).unwrap().with_extension("");
    let mut parts: Vec<String> = rel
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    if matches!(
        parts.last().map(String::as_str),
        Some("mod" | "lib" | "main")
    ) {
        parts.pop();
    }
    (r, parts)
}

/// The paths a file's code names through `crate::`, `super::`, `self::` or a child module, as
/// module paths from the crate root (the leaf may be an item: the resolver takes the longest
/// prefix that is a file).
fn named_paths(code: &str, me: &[String]) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    // `use` trees, braces expanded.
    fn expand(prefix: &str, tree: &str, out: &mut Vec<String>) {
        let tree = tree.trim();
        if let Some(open) = tree.find('{') {
            let head = format!("{prefix}{}", &tree[..open]);
            let close = tree.rfind('}').filter(|&c| c > open).unwrap_or(tree.len());
            let body = &tree[open + 1..close];
            let mut depth = 0;
            let mut start = 0;
            for (i, c) in body.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        expand(&head, &body[start..i], out);
                        start = i + 1;
                    }
                    _ => {}
                }
            }
            expand(&head, &body[start..], out);
        } else if !tree.is_empty() {
            out.push(format!(
                "{prefix}{}",
                tree.split(" as ").next().unwrap().trim()
            ));
        }
    }
    let mut paths = Vec::new();
    // `use` declarations start a line. A `pub use` is a module's facade (its children's items
    // offered under its name), not something the module itself depends on: not an edge.
    let mut offset = 0;
    for line in code.split_inclusive('\n') {
        let t = line.trim_start();
        if let Some(decl) = t.strip_prefix("use ") {
            let start = offset + (line.len() - decl.len());
            if let Some(end) = code[start..].find(';') {
                expand("", &code[start..start + end], &mut paths);
            }
        }
        offset += line.len();
    }
    // Inline paths (`super::write::digits(..)`).
    for start in ["crate::", "super::", "self::"] {
        let mut rest = code;
        while let Some(i) = rest.find(start) {
            let ok = rest[..i]
                .chars()
                .last()
                .is_none_or(|c| !(c.is_alphanumeric() || c == '_' || c == ':'));
            let tail = &rest[i..];
            let end = tail
                .find(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':'))
                .unwrap_or(tail.len());
            if ok {
                paths.push(tail[..end].trim_end_matches(':').to_string());
            }
            rest = &rest[i + start.len()..];
        }
    }
    // `super` of `a/b.rs` (module a::b) is `a`; of `a/b/mod.rs` (module a::b) also `a`.
    for p in paths {
        let segs: Vec<&str> = p.split("::").filter(|s| !s.is_empty()).collect();
        let Some(first) = segs.first() else { continue };
        let mut m: Vec<String> = match *first {
            "crate" => Vec::new(),
            "self" => me.to_vec(),
            "super" => {
                let mut m = me.to_vec();
                let mut k = 0;
                while segs.get(k) == Some(&"super") {
                    m.pop();
                    k += 1;
                }
                m.extend(segs[k..].iter().map(|s| s.to_string()));
                out.push(m);
                continue;
            }
            // A child module of this one (`use lang::entries`), judged by the resolver.
            _ => {
                let mut m = me.to_vec();
                m.extend(segs.iter().map(|s| s.to_string()));
                out.push(m);
                continue;
            }
        };
        m.extend(segs[1..].iter().map(|s| s.to_string()));
        out.push(m);
    }
    out
}

/// No two files of one crate import each other, directly or round a longer circle: each crate
/// reads top-down, from files that use others to the leaves they use.
#[test]
fn no_import_circle_inside_a_crate() {
    let mut circles = Vec::new();
    for (krate, files) in crate_sources() {
        let roots: Vec<std::path::PathBuf> = files
            .iter()
            .map(|(p, _)| p)
            .filter(|p| {
                p.file_name()
                    .is_some_and(|n| n == "lib.rs" || n == "main.rs")
            })
            .map(|p| p.parent().unwrap().to_path_buf())
            .collect();
        let modules: Vec<(usize, Vec<String>)> =
            files.iter().map(|(p, _)| module_of(&roots, p)).collect();
        let index = |root: usize, path: &[String]| {
            (1..=path.len())
                .rev()
                .find_map(|n| modules.iter().position(|m| m.0 == root && m.1 == path[..n]))
        };
        let mut edges = vec![Vec::new(); files.len()];
        for (i, (_, code)) in files.iter().enumerate() {
            let (root, me) = &modules[i];
            for p in named_paths(code, me) {
                if let Some(j) = index(*root, &p) {
                    if j != i && !p.is_empty() && !edges[i].contains(&j) {
                        edges[i].push(j);
                    }
                }
            }
        }
        // Files that reach themselves, by depth-first search from each.
        for (start, _) in files.iter().enumerate() {
            let mut stack = vec![(start, vec![start])];
            let mut seen = vec![false; files.len()];
            while let Some((at, trail)) = stack.pop() {
                for &next in &edges[at] {
                    if next == start {
                        let names: Vec<String> = trail
                            .iter()
                            .map(|&k| files[k].0.display().to_string())
                            .collect();
                        circles.push(format!("{krate}: {}", names.join(" -> ")));
                    } else if !seen[next] {
                        seen[next] = true;
                        let mut t = trail.clone();
                        t.push(next);
                        stack.push((next, t));
                    }
                }
            }
        }
    }
    circles.sort();
    circles.dedup();
    assert!(
        circles.is_empty(),
        "import circles:\n{}",
        circles.join("\n")
    );
}
