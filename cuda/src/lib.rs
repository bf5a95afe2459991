//! pipec-cuda: pipec-run's CUDA + NCCL backend (its device code behind the cargo feature `cuda`).
//!
//! Pure parts, compiled and tested everywhere: [`probe`] (finding the CUDA and NCCL libraries
//! before cudarc would panic on their absence), [`launch`] (torchrun/Slurm variables and the TCP
//! rendezvous that shares NCCL's unique ids), [`groups`] (the NCCL communicators of a program's
//! P2P groups and the order they are created in), [`kernels`] (the NVRTC source) and [`gemm`]
//! (the row-major to column-major mapping of cuBLAS calls). The device code
//! needs the `cuda` feature; cudarc loads every library at run time, so `cargo build --features
//! cuda` succeeds on machines without CUDA.

pub mod calibrate;
pub mod gemm;
pub mod graph;
pub mod groups;
pub mod kernels;
pub mod launch;
pub mod nvrtc;
pub mod poll;
pub mod probe;

#[cfg(feature = "cuda")]
pub mod capture;
#[cfg(feature = "cuda")]
pub mod comm;
#[cfg(feature = "cuda")]
pub mod copy;
#[cfg(feature = "cuda")]
pub mod device;
#[cfg(feature = "cuda")]
pub mod model;
#[cfg(feature = "cuda")]
pub mod run;

/// Set in the environment of the process [`reexec_for_nccl`] starts, so it happens once.
pub const REEXEC_ENV: &str = "PIPEC_NCCL_REEXEC";

/// cudarc dlopens NCCL by the name `libnccl.so` only, while the NCCL pip wheel
/// (`nvidia-nccl-cu12`) and some system packages ship only `libnccl.so.2`. When
/// [`probe::find_nccl`] finds only such a file, make a per-user directory holding a
/// `libnccl.so` link to it ([`probe::link_dir`], under the temp dir) and replace this process
/// by the same binary with the same arguments and that directory first on `LD_LIBRARY_PATH`
/// ([`probe::reexec_env`]); the dynamic loader reads `LD_LIBRARY_PATH` only at start-up, so
/// setting it in-process would not help. [`REEXEC_ENV`] marks the child so it never loops.
///
/// Returns `Ok(())` when nothing is to be done (NCCL loads, or this is already the
/// re-executed process); on success it does not return.
#[cfg(all(feature = "cuda", unix))]
pub fn reexec_for_nccl() -> Result<(), String> {
    use std::os::unix::process::CommandExt;
    // SAFETY: only tries to dlopen the candidate names.
    if unsafe { cudarc::nccl::sys::is_culib_present() } || std::env::var_os(REEXEC_ENV).is_some() {
        return Ok(());
    }
    let lib = probe::find_nccl(&probe::NcclSearch::from_env()).map_err(|e| e.to_string())?;
    if !lib.needs_link {
        return Ok(());
    }
    let dir = probe::link_dir(&lib.path, &std::env::temp_dir()).map_err(|e| {
        format!(
            "NCCL: cannot make a libnccl.so link to {} under {}: {e}",
            lib.path.display(),
            std::env::temp_dir().display()
        )
    })?;
    let exe = std::env::current_exe().map_err(|e| format!("cannot re-execute pipec-run: {e}"))?;
    let env = probe::reexec_env(&dir, std::env::var_os("LD_LIBRARY_PATH").as_ref());
    let e = std::process::Command::new(exe)
        .args(std::env::args_os().skip(1))
        .env("LD_LIBRARY_PATH", env)
        .env(REEXEC_ENV, "1")
        .exec();
    Err(format!(
        "cannot re-execute pipec-run with {} on LD_LIBRARY_PATH: {e}",
        dir.display()
    ))
}

/// Check that the CUDA driver, cuBLAS and NVRTC can be loaded, before any cudarc call (cudarc
/// panics on a missing library). `need_nccl`: also NCCL (multi-process launches).
#[cfg(feature = "cuda")]
pub fn probe_libraries(need_nccl: bool) -> Result<(), probe::ProbeError> {
    use probe::ProbeError::Missing;
    // SAFETY: these only try to dlopen the candidate names.
    unsafe {
        if !cudarc::driver::sys::is_culib_present() {
            return Err(Missing {
                what: "CUDA driver",
                names: "libcuda.so (or libcuda.so.1)",
                hint: "install the NVIDIA driver, or run on a machine with a GPU (the dynamic loader path is LD_LIBRARY_PATH, /etc/ld.so.cache)",
            });
        }
        if !cudarc::cublas::sys::is_culib_present() {
            return Err(Missing {
                what: "cuBLAS",
                names: "libcublas.so or libcublas.so.12",
                hint: "install the CUDA toolkit or `pip install nvidia-cublas-cu12` and add its lib directory to LD_LIBRARY_PATH",
            });
        }
        if !cudarc::nvrtc::sys::is_culib_present() {
            return Err(Missing {
                what: "NVRTC",
                names: "libnvrtc.so or libnvrtc.so.12",
                hint: "install the CUDA toolkit or `pip install nvidia-cuda-nvrtc-cu12` and add its lib directory to LD_LIBRARY_PATH",
            });
        }
        if need_nccl && !cudarc::nccl::sys::is_culib_present() {
            // Not loadable by cudarc's names: say where it is (it then needs the link) or
            // where we looked.
            let found = probe::find_nccl(&probe::NcclSearch::from_env())?;
            return Err(Missing {
                what: "NCCL (as libnccl.so)",
                names: if found.needs_link {
                    "libnccl.so (found only a versioned file; pipec-run links it and re-executes itself)"
                } else {
                    "libnccl.so"
                },
                hint: "set PIPEC_NCCL_LIB to the library file",
            });
        }
    }
    Ok(())
}

/// One line per library the backend loads, with its version where it loads (`pipec-run
/// --cuda-info`), and whether all of them load. Reads versions through the libraries' own
/// calls (`cuDriverGetVersion`, `cublasGetProperty`, `nvrtcVersion`, `ncclGetVersion`), so it
/// tells what the dynamic loader really found; none of them needs a GPU.
#[cfg(feature = "cuda")]
pub fn library_report() -> (Vec<String>, bool) {
    let mut lines = Vec::new();
    let mut all = true;
    let mut line = |ok: bool, text: String| {
        all &= ok;
        lines.push(format!("{} {text}", if ok { "ok     " } else { "missing" }));
    };
    // SAFETY: each sys call runs only after its library's presence check; out-parameters
    // are plain integers.
    unsafe {
        if cudarc::driver::sys::is_culib_present() {
            let mut v = 0;
            let _ = cudarc::driver::sys::cuDriverGetVersion(&mut v);
            let gpus = cudarc::driver::CudaContext::device_count()
                .map(|n| format!("{n} GPU(s)"))
                .unwrap_or_else(|e| format!("no usable GPU ({e:?})"));
            line(
                true,
                format!("CUDA driver {}.{}: {gpus}", v / 1000, (v % 1000) / 10),
            );
        } else {
            line(false, "CUDA driver (libcuda.so, libcuda.so.1)".into());
        }
        if cudarc::cublas::sys::is_culib_present() {
            use cudarc::cublas::sys::{cublasGetProperty, libraryPropertyType};
            let (mut a, mut b, mut c) = (0, 0, 0);
            let _ = cublasGetProperty(libraryPropertyType::MAJOR_VERSION, &mut a);
            let _ = cublasGetProperty(libraryPropertyType::MINOR_VERSION, &mut b);
            let _ = cublasGetProperty(libraryPropertyType::PATCH_LEVEL, &mut c);
            line(true, format!("cuBLAS {a}.{b}.{c}"));
        } else {
            line(false, "cuBLAS (libcublas.so, libcublas.so.12)".into());
        }
        if cudarc::nvrtc::sys::is_culib_present() {
            match nvrtc::info() {
                Ok(((a, b), archs)) => line(
                    true,
                    format!(
                        "NVRTC {a}.{b}: {}",
                        archs
                            .iter()
                            .map(|a| format!("sm_{a}"))
                            .collect::<Vec<_>>()
                            .join(" ")
                    ),
                ),
                Err(e) => line(false, format!("NVRTC: {e}")),
            }
        } else {
            line(false, "NVRTC (libnvrtc.so, libnvrtc.so.12)".into());
        }
        if cudarc::nccl::sys::is_culib_present() {
            let mut v = 0;
            let _ = cudarc::nccl::sys::ncclGetVersion(&mut v);
            line(
                true,
                format!("NCCL {}.{}.{}", v / 10000, (v % 10000) / 100, v % 100),
            );
        } else {
            match probe::find_nccl(&probe::NcclSearch::from_env()) {
                Ok(l) => line(
                    false,
                    format!(
                        "NCCL as libnccl.so (found {}; pipec-run links it when a launch needs it)",
                        l.path.display()
                    ),
                ),
                Err(e) => line(false, format!("NCCL: {e}")),
            }
        }
    }
    (lines, all)
}
