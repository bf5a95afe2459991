//! The CUDA + NCCL backend (cargo feature `cuda`).
//!
//! Pure parts, compiled and tested everywhere: [`probe`] (finding the CUDA and NCCL libraries
//! before cudarc would panic on their absence), [`launch`] (torchrun/Slurm variables and the TCP
//! rendezvous that shares NCCL's unique id) and [`kernels`] (the NVRTC source). The device code
//! needs the `cuda` feature; cudarc loads every library at run time, so `cargo build --features
//! cuda` succeeds on machines without CUDA.

pub mod kernels;
pub mod launch;
pub mod probe;

#[cfg(feature = "cuda")]
pub mod comm;
#[cfg(feature = "cuda")]
pub mod device;
#[cfg(feature = "cuda")]
pub mod model;

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
