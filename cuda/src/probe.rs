//! Finding the CUDA libraries before cudarc touches them.
//!
//! cudarc (with `dynamic-loading`) `dlopen`s each library by bare name on first use and
//! **panics** when none of its candidate names loads, so the backend probes first
//! (`cudarc::{driver,cublas,nvrtc,nccl}::sys::is_culib_present`) and turns absence into an error.
//!
//! NCCL needs more: cudarc 0.19's candidates for `nccl` are `libnccl.so`, `libnccl.so.12`,
//! `.11`, `.10`, `.9`, `.1` (see `cudarc::get_lib_name_candidates`), never `libnccl.so.2`, the
//! only name the NCCL pip wheel (`nvidia-nccl-cu12`, `nvidia/nccl/lib/`) and the Debian package
//! `libnccl2` ship. glibc reads `LD_LIBRARY_PATH` once at process start, and a loaded
//! `libnccl.so.2` does not answer to the name `libnccl.so` (its SONAME is `libnccl.so.2`), so the
//! only fixes are a `libnccl.so` link on the loader path before the process starts. This module
//! finds the library ([`find_nccl`], pure over [`NcclSearch`]) and builds such a link in a
//! private directory ([`link_dir`]); `pipec-run` then re-executes itself once with that directory
//! prepended to `LD_LIBRARY_PATH` ([`reexec_env`]).

use std::ffi::OsString;
use std::fmt;
use std::path::{Path, PathBuf};

/// Environment variable naming the NCCL library file explicitly.
pub const NCCL_ENV: &str = "PIPEC_NCCL_LIB";
/// Set in the re-executed process, so it does not re-execute again.
pub const REEXEC_ENV: &str = "PIPEC_NCCL_REEXEC";
/// The names tried in each directory, best first.
pub const NCCL_NAMES: [&str; 2] = ["libnccl.so", "libnccl.so.2"];

/// Where to look for NCCL, gathered from the environment by [`NcclSearch::from_env`] or written
/// out by a test.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NcclSearch {
    /// `PIPEC_NCCL_LIB`: a file (or a directory holding one of [`NCCL_NAMES`]).
    pub explicit: Option<PathBuf>,
    /// `LD_LIBRARY_PATH`, as set.
    pub ld_library_path: Option<OsString>,
    /// System directories, searched after `LD_LIBRARY_PATH`.
    pub system_dirs: Vec<PathBuf>,
    /// Python prefixes (`$VIRTUAL_ENV`, `$CONDA_PREFIX`, `~/.local`, `/usr`, `/usr/local`):
    /// their `lib/python3.*/{site,dist}-packages/nvidia/nccl/lib` are searched last.
    pub python_prefixes: Vec<PathBuf>,
}

/// The usual places of a system NCCL (Debian/Ubuntu `libnccl2`, the CUDA toolkit, RHEL).
pub fn default_system_dirs() -> Vec<PathBuf> {
    [
        "/usr/lib/x86_64-linux-gnu",
        "/usr/lib/aarch64-linux-gnu",
        "/usr/local/cuda/lib64",
        "/usr/local/cuda/targets/x86_64-linux/lib",
        "/usr/lib64",
        "/usr/local/lib",
    ]
    .iter()
    .map(PathBuf::from)
    .collect()
}

impl NcclSearch {
    /// Read `PIPEC_NCCL_LIB`, `LD_LIBRARY_PATH`, `VIRTUAL_ENV`, `CONDA_PREFIX` and `HOME`.
    pub fn from_env() -> Self {
        let var = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty());
        let mut python_prefixes: Vec<PathBuf> = ["VIRTUAL_ENV", "CONDA_PREFIX"]
            .iter()
            .filter_map(|k| var(k).map(PathBuf::from))
            .collect();
        if let Some(home) = var("HOME") {
            python_prefixes.push(PathBuf::from(home).join(".local"));
        }
        python_prefixes.push("/usr/local".into());
        python_prefixes.push("/usr".into());
        NcclSearch {
            explicit: var(NCCL_ENV).map(PathBuf::from),
            ld_library_path: var("LD_LIBRARY_PATH"),
            system_dirs: default_system_dirs(),
            python_prefixes,
        }
    }

    /// Every directory searched, in order (the explicit path is handled separately).
    pub fn dirs(&self) -> Vec<PathBuf> {
        let mut dirs: Vec<PathBuf> = Vec::new();
        if let Some(p) = &self.ld_library_path {
            dirs.extend(std::env::split_paths(p).filter(|d| !d.as_os_str().is_empty()));
        }
        dirs.extend(self.system_dirs.iter().cloned());
        for prefix in &self.python_prefixes {
            dirs.extend(
                python_site_dirs(prefix)
                    .into_iter()
                    .map(|d| d.join("nvidia").join("nccl").join("lib")),
            );
        }
        let mut seen = std::collections::HashSet::new();
        dirs.retain(|d| seen.insert(d.clone()));
        dirs
    }
}

/// `<prefix>/lib/python3.*/{site,dist}-packages`, sorted (newest Python last, deterministic).
pub fn python_site_dirs(prefix: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let Ok(rd) = std::fs::read_dir(prefix.join("lib")) else {
        return out;
    };
    let mut pys: Vec<PathBuf> = rd
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("python3"))
        .map(|e| e.path())
        .collect();
    pys.sort();
    for py in pys {
        for sub in ["site-packages", "dist-packages"] {
            let d = py.join(sub);
            if d.is_dir() {
                out.push(d);
            }
        }
    }
    out
}

/// Where NCCL was found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NcclLib {
    /// The library file.
    pub path: PathBuf,
    /// Its file name is not `libnccl.so`: cudarc cannot load it by name without a link.
    pub needs_link: bool,
}

/// NCCL could not be found or the explicit path is wrong; the message says where we looked.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ProbeError {
    /// `PIPEC_NCCL_LIB` names something that holds no NCCL library.
    ExplicitMissing(PathBuf),
    /// Nowhere: lists the directories searched.
    NcclNotFound { looked: Vec<PathBuf> },
    /// A CUDA library cudarc needs is not loadable.
    Missing {
        what: &'static str,
        names: &'static str,
        hint: &'static str,
    },
}

impl fmt::Display for ProbeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ProbeError::ExplicitMissing(p) => write!(
                f,
                "NCCL not found: {NCCL_ENV}={} is neither a file nor a directory holding {}",
                p.display(),
                NCCL_NAMES.join(" or ")
            ),
            ProbeError::NcclNotFound { looked } => {
                write!(
                    f,
                    "NCCL not found: looked for {} in {}",
                    NCCL_NAMES.join(" and "),
                    if looked.is_empty() {
                        "no directory".to_string()
                    } else {
                        looked
                            .iter()
                            .map(|d| d.display().to_string())
                            .collect::<Vec<_>>()
                            .join(", ")
                    }
                )?;
                write!(
                    f,
                    "; install it (`pip install nvidia-nccl-cu12` or the `libnccl2` package) or set {NCCL_ENV} to the library file"
                )
            }
            ProbeError::Missing { what, names, hint } => {
                write!(f, "{what} not found: cannot load {names}; {hint}")
            }
        }
    }
}

impl std::error::Error for ProbeError {}

fn lib_in(dir: &Path) -> Option<NcclLib> {
    NCCL_NAMES.iter().find_map(|name| {
        let p = dir.join(name);
        p.is_file().then(|| NcclLib {
            needs_link: *name != "libnccl.so",
            path: p,
        })
    })
}

/// Find NCCL: `PIPEC_NCCL_LIB` first (a file, or a directory), then `LD_LIBRARY_PATH`, the
/// system directories and Python's `nvidia/nccl/lib`; in each directory `libnccl.so` before
/// `libnccl.so.2`.
pub fn find_nccl(search: &NcclSearch) -> Result<NcclLib, ProbeError> {
    if let Some(p) = &search.explicit {
        if p.is_file() {
            let name = p.file_name().map(|n| n.to_string_lossy().into_owned());
            return Ok(NcclLib {
                needs_link: name.as_deref() != Some("libnccl.so"),
                path: p.clone(),
            });
        }
        return lib_in(p).ok_or_else(|| ProbeError::ExplicitMissing(p.clone()));
    }
    let dirs = search.dirs();
    dirs.iter()
        .find_map(|d| lib_in(d))
        .ok_or(ProbeError::NcclNotFound { looked: dirs })
}

/// Make `<base>/pipec-nccl-<uid>/libnccl.so` a link to `lib` (replacing a stale link) and
/// return the directory, to prepend to `LD_LIBRARY_PATH` of a process started afterwards.
pub fn link_dir(lib: &Path, base: &Path) -> std::io::Result<PathBuf> {
    let lib = std::fs::canonicalize(lib)?;
    // One directory per user and library, so concurrent runs of the same user share it and
    // other users cannot plant a library there.
    let tag = {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in lib.as_os_str().to_string_lossy().bytes() {
            h = (h ^ b as u64).wrapping_mul(0x100_0000_01b3);
        }
        h
    };
    let dir = base.join(format!("pipec-nccl-{}-{tag:016x}", user_id()));
    std::fs::create_dir_all(&dir)?;
    let link = dir.join("libnccl.so");
    match std::fs::read_link(&link) {
        Ok(t) if t == lib => return Ok(dir),
        Ok(_) => std::fs::remove_file(&link)?,
        Err(_) if link.exists() => std::fs::remove_file(&link)?,
        Err(_) => {}
    }
    #[cfg(unix)]
    {
        match std::os::unix::fs::symlink(&lib, &link) {
            Ok(()) => {}
            // Another process of the same user made the same link concurrently.
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(e),
        }
    }
    #[cfg(not(unix))]
    {
        std::fs::copy(&lib, &link)?;
    }
    Ok(dir)
}

fn user_id() -> String {
    std::env::var("USER")
        .ok()
        .filter(|u| {
            u.chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
        })
        .unwrap_or_else(|| "user".into())
}

/// `LD_LIBRARY_PATH` for the re-executed process: `dir` first, then what was set.
pub fn reexec_env(dir: &Path, old: Option<&OsString>) -> OsString {
    let mut paths = vec![dir.to_path_buf()];
    if let Some(old) = old {
        paths.extend(std::env::split_paths(old).filter(|d| !d.as_os_str().is_empty()));
    }
    std::env::join_paths(paths).unwrap_or_else(|_| dir.as_os_str().to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn touch(p: &Path) {
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, b"not really a library").unwrap();
    }

    fn empty_search() -> NcclSearch {
        NcclSearch::default()
    }

    #[test]
    fn ld_library_path_wins_and_plain_name_is_preferred() {
        let t = tempfile::tempdir().unwrap();
        let (a, b) = (t.path().join("a"), t.path().join("b"));
        touch(&a.join("libnccl.so.2"));
        touch(&b.join("libnccl.so"));
        touch(&b.join("libnccl.so.2"));
        let s = NcclSearch {
            ld_library_path: Some(std::env::join_paths([&a, &b]).unwrap()),
            ..empty_search()
        };
        // `a` comes first on the path: its versioned file is found and needs a link.
        assert_eq!(
            find_nccl(&s).unwrap(),
            NcclLib {
                path: a.join("libnccl.so.2"),
                needs_link: true
            }
        );
        // Within one directory the plain name wins.
        let s = NcclSearch {
            ld_library_path: Some(b.clone().into_os_string()),
            ..empty_search()
        };
        assert_eq!(
            find_nccl(&s).unwrap(),
            NcclLib {
                path: b.join("libnccl.so"),
                needs_link: false
            }
        );
    }

    #[test]
    fn pip_wheel_layout_is_found_under_site_packages() {
        let t = tempfile::tempdir().unwrap();
        let venv = t.path().join("venv");
        let lib = venv.join("lib/python3.11/site-packages/nvidia/nccl/lib/libnccl.so.2");
        touch(&lib);
        // A distracting Python without NCCL, and a system dir that exists but is empty.
        std::fs::create_dir_all(venv.join("lib/python3.10/site-packages")).unwrap();
        let sys = t.path().join("usr/lib");
        std::fs::create_dir_all(&sys).unwrap();
        let s = NcclSearch {
            system_dirs: vec![sys.clone()],
            python_prefixes: vec![venv.clone()],
            ..empty_search()
        };
        let dirs = s.dirs();
        assert_eq!(dirs[0], sys);
        assert_eq!(dirs.len(), 3, "{dirs:?}");
        let found = find_nccl(&s).unwrap();
        assert_eq!(found.path, lib);
        assert!(found.needs_link);
        // Debian's dist-packages works too.
        let deb = t.path().join("deb");
        let lib2 = deb.join("lib/python3.12/dist-packages/nvidia/nccl/lib/libnccl.so.2");
        touch(&lib2);
        let s = NcclSearch {
            python_prefixes: vec![deb],
            ..empty_search()
        };
        assert_eq!(find_nccl(&s).unwrap().path, lib2);
    }

    #[test]
    fn explicit_path_overrides_and_a_wrong_one_is_an_error() {
        let t = tempfile::tempdir().unwrap();
        let custom = t.path().join("custom/libnccl-custom.so");
        touch(&custom);
        touch(&t.path().join("ld/libnccl.so"));
        let s = NcclSearch {
            explicit: Some(custom.clone()),
            ld_library_path: Some(t.path().join("ld").into_os_string()),
            ..empty_search()
        };
        assert_eq!(
            find_nccl(&s).unwrap(),
            NcclLib {
                path: custom,
                needs_link: true
            }
        );
        // A directory holding the library is accepted too.
        let dir = t.path().join("ld");
        let s = NcclSearch {
            explicit: Some(dir.clone()),
            ..empty_search()
        };
        assert_eq!(find_nccl(&s).unwrap().path, dir.join("libnccl.so"));
        let missing = t.path().join("nope/libnccl.so.2");
        let s = NcclSearch {
            explicit: Some(missing.clone()),
            ..empty_search()
        };
        let e = find_nccl(&s).unwrap_err();
        assert_eq!(e, ProbeError::ExplicitMissing(missing.clone()));
        let msg = e.to_string();
        assert!(msg.starts_with("NCCL not found: PIPEC_NCCL_LIB="), "{msg}");
        assert!(msg.contains(&missing.display().to_string()), "{msg}");
    }

    #[test]
    fn absence_lists_every_directory_searched() {
        let t = tempfile::tempdir().unwrap();
        let (a, b, sys) = (t.path().join("a"), t.path().join("b"), t.path().join("sys"));
        std::fs::create_dir_all(&a).unwrap();
        touch(&b.join("libnccl.so.1.bak")); // a near miss is not a match
        let py = t.path().join("py");
        std::fs::create_dir_all(py.join("lib/python3.11/site-packages")).unwrap();
        let s = NcclSearch {
            ld_library_path: Some(std::env::join_paths([&a, &b, &a]).unwrap()),
            system_dirs: vec![sys.clone()],
            python_prefixes: vec![py.clone()],
            ..empty_search()
        };
        let e = find_nccl(&s).unwrap_err();
        let want = vec![
            a.clone(),
            b.clone(),
            sys.clone(),
            py.join("lib/python3.11/site-packages/nvidia/nccl/lib"),
        ];
        assert_eq!(
            e,
            ProbeError::NcclNotFound {
                looked: want.clone()
            }
        );
        let msg = e.to_string();
        assert!(
            msg.starts_with("NCCL not found: looked for libnccl.so and libnccl.so.2 in "),
            "{msg}"
        );
        for d in &want {
            assert!(msg.contains(&d.display().to_string()), "{msg} lacks {d:?}");
        }
        assert!(msg.contains("PIPEC_NCCL_LIB"), "{msg}");
        let none = find_nccl(&empty_search()).unwrap_err().to_string();
        assert!(none.contains("in no directory"), "{none}");
    }

    #[cfg(unix)]
    #[test]
    fn link_dir_makes_libnccl_so_point_at_the_versioned_file_and_is_idempotent() {
        let t = tempfile::tempdir().unwrap();
        let lib = t.path().join("wheel/libnccl.so.2");
        touch(&lib);
        let base = t.path().join("tmp");
        let d1 = link_dir(&lib, &base).unwrap();
        let link = d1.join("libnccl.so");
        assert_eq!(
            std::fs::read_link(&link).unwrap(),
            std::fs::canonicalize(&lib).unwrap()
        );
        assert_eq!(std::fs::read(&link).unwrap(), b"not really a library");
        assert_eq!(link_dir(&lib, &base).unwrap(), d1);
        // A stale link in the same directory is replaced.
        std::fs::remove_file(&link).unwrap();
        std::os::unix::fs::symlink(t.path().join("gone"), &link).unwrap();
        link_dir(&lib, &base).unwrap();
        assert_eq!(std::fs::read(&link).unwrap(), b"not really a library");
        // The loader path of the re-executed process starts with the link directory.
        let old: OsString = "/x:/y".into();
        let env = reexec_env(&d1, Some(&old));
        let parts: Vec<PathBuf> = std::env::split_paths(&env).collect();
        assert_eq!(parts, vec![d1.clone(), "/x".into(), "/y".into()]);
        assert_eq!(reexec_env(&d1, None), d1.into_os_string());
    }
}
