//! Compiling the kernels with NVRTC for the GPU at hand.
//!
//! PTX has to be JIT-compiled by the driver, and a driver refuses PTX from an NVRTC newer than
//! itself (`CUDA_ERROR_UNSUPPORTED_PTX_VERSION`): common when NVRTC comes from a pip wheel
//! (`nvidia-cuda-nvrtc-cu12`) and the driver is older. A CUBIN (SASS for one `sm_XY`) needs no
//! JIT. So, as PyTorch's NVRTC path does (`at::cuda::jit` / `codegenOutputQuery`), compile
//! straight to a CUBIN when NVRTC knows the device's architecture, and to PTX for the newest
//! architecture NVRTC knows below it otherwise (a GPU newer than the NVRTC).

use std::fmt;

/// What to ask NVRTC for; architectures as `10 * major + minor` (H100/H200: 90).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target {
    /// `--gpu-architecture=sm_XY`, read back with `nvrtcGetCUBIN`.
    Cubin(u32),
    /// `--gpu-architecture=compute_XY`, read back with `nvrtcGetPTX`.
    Ptx(u32),
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Target::Cubin(a) => write!(f, "CUBIN for sm_{a}"),
            Target::Ptx(a) => write!(f, "PTX for compute_{a}"),
        }
    }
}

impl Target {
    /// NVRTC's `--gpu-architecture` option.
    pub fn option(&self) -> String {
        match self {
            Target::Cubin(a) => format!("--gpu-architecture=sm_{a}"),
            Target::Ptx(a) => format!("--gpu-architecture=compute_{a}"),
        }
    }
}

/// The target for a GPU of compute capability `device`, given NVRTC's supported architectures
/// (`nvrtcGetSupportedArchs`). `Err` names both when NVRTC cannot produce code the GPU runs
/// (a GPU older than everything this NVRTC knows).
pub fn choose_target(device: u32, supported: &[u32]) -> Result<Target, String> {
    if supported.contains(&device) {
        return Ok(Target::Cubin(device));
    }
    match supported.iter().copied().filter(|&a| a < device).max() {
        Some(a) => Ok(Target::Ptx(a)),
        None => Err(format!(
            "NVRTC supports {}; this GPU is sm_{device}: install an NVRTC of the GPU's generation",
            archs_text(supported)
        )),
    }
}

fn archs_text(supported: &[u32]) -> String {
    match (supported.iter().min(), supported.iter().max()) {
        (Some(lo), Some(hi)) => format!("sm_{lo} to sm_{hi}"),
        _ => "no architecture".into(),
    }
}

/// NVRTC's version and supported architectures. Call only after the library was probed.
#[cfg(feature = "cuda")]
pub fn info() -> Result<((i32, i32), Vec<u32>), String> {
    use cudarc::nvrtc::sys;
    let (mut major, mut minor, mut n) = (0, 0, 0);
    // SAFETY: plain out-parameters; the library is loaded (probed by the caller).
    unsafe {
        sys::nvrtcVersion(&mut major, &mut minor)
            .result()
            .map_err(|e| format!("nvrtcVersion: {e:?}"))?;
        sys::nvrtcGetNumSupportedArchs(&mut n)
            .result()
            .map_err(|e| format!("nvrtcGetNumSupportedArchs: {e:?}"))?;
    }
    let mut archs = vec![0i32; n.max(0) as usize];
    // SAFETY: `archs` holds the `n` entries NVRTC said it will write.
    unsafe { sys::nvrtcGetSupportedArchs(archs.as_mut_ptr()) }
        .result()
        .map_err(|e| format!("nvrtcGetSupportedArchs: {e:?}"))?;
    Ok((
        (major, minor),
        archs.into_iter().map(|a| a.max(0) as u32).collect(),
    ))
}

/// What NVRTC produced.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Image {
    Cubin(Vec<u8>),
    Ptx(String),
}

#[cfg(feature = "cuda")]
impl Image {
    /// The form `CudaContext::load_module` takes.
    pub fn into_module_source(self) -> cudarc::nvrtc::Ptx {
        match self {
            Image::Cubin(b) => cudarc::nvrtc::Ptx::from_binary(b),
            Image::Ptx(s) => cudarc::nvrtc::Ptx::from_src(s),
        }
    }
}

/// Compile `src` (named `name` in diagnostics) for `target`. `Err` carries NVRTC's log.
#[cfg(feature = "cuda")]
pub fn compile(src: &str, name: &str, target: Target) -> Result<Image, String> {
    use cudarc::nvrtc::{result, sys};
    use std::ffi::CString;
    let src_c = CString::new(src).map_err(|_| "kernel source holds a NUL byte".to_string())?;
    let name_c = CString::new(name).map_err(|_| "kernel name holds a NUL byte".to_string())?;
    let prog = result::create_program(&src_c, Some(&name_c))
        .map_err(|e| format!("nvrtcCreateProgram: {e:?}"))?;
    // Frees the program on every path out.
    struct Prog(sys::nvrtcProgram);
    impl Drop for Prog {
        fn drop(&mut self) {
            // SAFETY: created above, destroyed once.
            let _ = unsafe { result::destroy_program(self.0) };
        }
    }
    let prog = Prog(prog);
    // No multiply-add contraction (NVRTC's default is `--fmad=true`): the kernels then round
    // every product and sum as the CPU model does, leaving the GEMMs and the transcendental
    // functions as the only sources of difference under `--check`.
    let opts = [target.option(), "--fmad=false".to_string()];
    // SAFETY: `prog` is a live program.
    if let Err(e) = unsafe { result::compile_program(prog.0, &opts) } {
        let log = unsafe { result::get_program_log(prog.0) }
            .map(|l| c_text(&l))
            .unwrap_or_default();
        return Err(format!(
            "NVRTC compile of {name} ({target}) failed: {e:?}\n{log}"
        ));
    }
    match target {
        Target::Ptx(_) => unsafe { result::get_ptx(prog.0) }
            .map(|image| Image::Ptx(c_text(&image)))
            .map_err(|e| format!("nvrtcGetPTX: {e:?}")),
        Target::Cubin(_) => {
            let mut size = 0usize;
            // SAFETY: `prog` compiled; `bin` holds the size NVRTC reported.
            unsafe { sys::nvrtcGetCUBINSize(prog.0, &mut size) }
                .result()
                .map_err(|e| format!("nvrtcGetCUBINSize: {e:?}"))?;
            let mut bin = vec![0u8; size];
            unsafe { sys::nvrtcGetCUBIN(prog.0, bin.as_mut_ptr().cast()) }
                .result()
                .map_err(|e| format!("nvrtcGetCUBIN: {e:?}"))?;
            Ok(Image::Cubin(bin))
        }
    }
}

/// A NUL-terminated C buffer as text.
#[cfg(feature = "cuda")]
fn c_text(buf: &[std::ffi::c_char]) -> String {
    let bytes: Vec<u8> = buf
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// NVRTC 12.9's list (`nvrtcGetSupportedArchs`, read off the real library).
    const NVRTC_12_9: [u32; 19] = [
        50, 52, 53, 60, 61, 62, 70, 72, 75, 80, 86, 87, 89, 90, 100, 101, 103, 120, 121,
    ];

    #[test]
    fn known_architecture_gets_a_cubin_newer_gets_ptx_older_is_refused() {
        assert_eq!(choose_target(90, &NVRTC_12_9), Ok(Target::Cubin(90)));
        assert_eq!(choose_target(80, &NVRTC_12_9), Ok(Target::Cubin(80)));
        // A GPU newer than this NVRTC: PTX of the newest older architecture, JIT by the driver.
        assert_eq!(choose_target(130, &NVRTC_12_9), Ok(Target::Ptx(121)));
        // NVRTC 12.4 did not know Blackwell.
        assert_eq!(choose_target(100, &[52, 80, 90]), Ok(Target::Ptx(90)));
        let e = choose_target(35, &NVRTC_12_9).unwrap_err();
        assert!(e.contains("sm_50 to sm_121") && e.contains("sm_35"), "{e}");
        assert!(choose_target(90, &[])
            .unwrap_err()
            .contains("no architecture"));
        assert_eq!(Target::Cubin(90).option(), "--gpu-architecture=sm_90");
        assert_eq!(Target::Ptx(121).option(), "--gpu-architecture=compute_121");
    }

    /// With the real NVRTC (no GPU needed: it is a compiler library). `.ci/run` fetches
    /// `nvidia-cuda-nvrtc-cu12` from PyPI, puts it on `LD_LIBRARY_PATH` and sets
    /// `PIPEC_REQUIRE_NVRTC=1`, so there a missing library fails instead of skipping.
    #[cfg(feature = "cuda")]
    mod with_nvrtc {
        use super::super::*;
        use crate::kernels;

        fn available() -> bool {
            // SAFETY: only tries to dlopen the candidate names.
            if unsafe { cudarc::nvrtc::sys::is_culib_present() } {
                return true;
            }
            assert!(
                std::env::var_os("PIPEC_REQUIRE_NVRTC").is_none(),
                "PIPEC_REQUIRE_NVRTC is set but libnvrtc cannot be loaded (LD_LIBRARY_PATH?)"
            );
            eprintln!("skipped: NVRTC not found (pip install nvidia-cuda-nvrtc-cu12 and add its lib/ to LD_LIBRARY_PATH)");
            false
        }

        /// Both element types compile for the H100/H200 architecture, as a CUBIN (an ELF
        /// image) and as PTX that defines every kernel the device code loads by name.
        #[test]
        fn kernels_compile_for_sm90_as_cubin_and_ptx() {
            if !available() {
                return;
            }
            let (version, archs) = info().unwrap();
            assert!(
                version.0 >= 11 && archs.contains(&80),
                "{version:?} {archs:?}"
            );
            for bf16 in [false, true] {
                let src = kernels::source(bf16);
                if archs.contains(&90) {
                    let Image::Cubin(cubin) = compile(&src, "k.cu", Target::Cubin(90)).unwrap()
                    else {
                        panic!("asked for a CUBIN")
                    };
                    assert_eq!(&cubin[..4], b"\x7fELF");
                }
                let Image::Ptx(ptx) = compile(&src, "k.cu", Target::Ptx(80)).unwrap() else {
                    panic!("asked for PTX")
                };
                assert!(
                    ptx.contains(".target sm_80"),
                    "{}",
                    &ptx[..ptx.len().min(400)]
                );
                for name in kernels::NAMES {
                    assert!(ptx.contains(&format!(".entry {name}(")), "{name} missing");
                }
                // `--fmad=false` reached NVRTC: `sgd`'s `w - lr * g` is `mul.rn` + `sub.rn`,
                // which ptxas may not fuse (with the default NVRTC emits `mul.f32`/`sub.f32`,
                // which it may).
                let sgd = ptx.split(".entry sgd(").nth(1).unwrap();
                let sgd = sgd.split(".entry ").next().unwrap();
                assert!(sgd.contains("mul.rn.f32"), "{sgd}");
                assert!(!sgd.contains("fma.rn.f32"), "{sgd}");
            }
        }

        /// `pipec-run --cuda-info` reads the version through the library itself.
        #[test]
        fn the_library_report_shows_nvrtc_and_its_architectures() {
            if !available() {
                return;
            }
            let (lines, _) = crate::library_report();
            let (major, minor) = info().unwrap().0;
            let nvrtc = lines.iter().find(|l| l.contains("NVRTC")).unwrap();
            assert!(
                nvrtc.starts_with(&format!("ok      NVRTC {major}.{minor}: sm_")),
                "{nvrtc}"
            );
            assert_eq!(lines.len(), 4, "{lines:?}");
        }

        /// A source error comes back as NVRTC's log, naming the file and the line.
        #[test]
        fn a_compile_error_carries_the_log() {
            if !available() {
                return;
            }
            let src = "extern \"C\" __global__ void k(float* x) {\n  x[0] = undefined_name;\n}\n";
            let e = compile(src, "broken.cu", Target::Ptx(80)).unwrap_err();
            assert!(
                e.contains("broken.cu") && e.contains("undefined_name"),
                "{e}"
            );
        }
    }
}
