//! The CUDA backend's kernels, run on the CPU and checked against the CPU model.
//!
//! The exact text of `pipec_cuda::kernels::source(bf16)` is compiled by the
//! host C++ compiler together with `tests/cuda_emu/emu.hpp`, a documented emulation of the CUDA
//! subset the kernels use: every thread of a block is a real thread and `__syncthreads` is a real
//! barrier. `tests/cuda_emu/driver.cpp` runs one launch per process, with the buffers sent over a
//! pipe. Each layer is composed the way `cuda/src/model.rs` composes it: the same
//! kernels, argument lists and launch configurations, with ndarray in place of cuBLAS for the
//! GEMMs (fp32 accumulation, the product stored in the element type). The result is compared with
//! the layer function of `pipec_runtime::model`, which the GPU backend must match.
//!
//! This covers the kernels' index arithmetic, how far the grid-stride loops reach, the block
//! reductions and their barriers, the argument order and types, and the bf16 encoding. It says
//! nothing about CUDA's own float math (ulps, FMA contraction: see emu.hpp) or about cuBLAS.
//!
//! The driver is built once per element type into `target/<profile>/cuda_emu/`, under a key made
//! of its inputs, so later test runs reuse it. Without a C++ compiler (`CXX`, `c++`, `g++` or
//! `clang++`) the emulated tests print a skip line and pass, except under `CI=true`, where they
//! fail.
//!
//! model.rs launches each kernel through a typed function generated, with the kernel's C
//! prototype, from its row of `kernels::kernel_table!`; pipec-cuda's unit tests check every
//! prototype against the source, so no test here reads model.rs as text.

use ndarray::{Array2, ArrayView2};
use pipec_cuda::kernels;
use pipec_runtime::model::{self, GradAccum, Layer, ModelConfig, SplitMix64, Stage};
use pipec_schedules::layout::LayerKind;
use sha2::{Digest, Sha256};
use std::collections::BTreeSet;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;

// ---- the emulator -------------------------------------------------------------------------

/// `-ffp-contract=off`: the host must not fuse multiply-adds on its own (see emu.hpp).
const CXXFLAGS: &[&str] = &["-std=c++20", "-O1", "-ffp-contract=off", "-pthread"];

/// The element type `T` of the kernels' parameters and activations.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum Ty {
    F32,
    Bf16,
}

const TYS: [Ty; 2] = [Ty::F32, Ty::Bf16];

/// A built driver for one element type.
struct Emu {
    ty: Ty,
    exe: PathBuf,
}

fn emu_src_dir() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/cuda_emu"))
}

/// The host C++ compiler: `CXX`, else the first of `c++`, `g++`, `clang++` that runs.
fn compiler() -> Option<&'static str> {
    static CXX: OnceLock<Option<String>> = OnceLock::new();
    CXX.get_or_init(|| {
        std::env::var("CXX")
            .ok()
            .into_iter()
            .chain(["c++", "g++", "clang++"].map(String::from))
            .find(|c| {
                Command::new(c)
                    .arg("--version")
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .status()
                    .is_ok_and(|s| s.success())
            })
    })
    .as_deref()
}

/// The driver for `ty`, built on first use. `None` (after printing why) when there is no
/// compiler.
fn emu(ty: Ty) -> Option<&'static Emu> {
    static F32: OnceLock<Option<Emu>> = OnceLock::new();
    static BF16: OnceLock<Option<Emu>> = OnceLock::new();
    let cell = match ty {
        Ty::F32 => &F32,
        Ty::Bf16 => &BF16,
    };
    let e = cell
        .get_or_init(|| compiler().map(|cxx| build(cxx, ty)))
        .as_ref();
    if e.is_none() {
        // CI must not pass having skipped the emulated kernels.
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "cuda_kernels: no C++ compiler under CI=true (set CXX or put c++, g++ or clang++ on PATH)"
        );
        println!(
            "cuda_kernels: skipped: no C++ compiler (set CXX or put c++, g++ or clang++ on PATH)"
        );
    }
    e
}

fn build(cxx: &str, ty: Ty) -> Emu {
    let src = kernels::source(ty == Ty::Bf16);
    let read = |name: &str| {
        let p = emu_src_dir().join(name);
        std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
    };
    let version = Command::new(cxx)
        .arg("--version")
        .output()
        .expect("run the C++ compiler")
        .stdout;
    let mut key = Sha256::new();
    for part in [
        cxx.as_bytes(),
        &version,
        CXXFLAGS.join(" ").as_bytes(),
        &read("emu.hpp"),
        &read("driver.cpp"),
        src.as_bytes(),
    ] {
        key.update((part.len() as u64).to_le_bytes());
        key.update(part);
    }
    let key: String = key.finalize()[..8]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    // target/<profile>/deps/integration-<hash> -> target/<profile>/cuda_emu/
    let exe_path = std::env::current_exe().expect("test executable");
    let cache = exe_path
        .parent()
        .and_then(Path::parent)
        .expect("target dir")
        .join("cuda_emu");
    let name = format!("{}-{key}", if ty == Ty::Bf16 { "bf16" } else { "f32" });
    let dir = cache.join(&name);
    let exe = dir.join("driver");
    if !exe.is_file() {
        std::fs::create_dir_all(&cache).expect("create target/<profile>/cuda_emu");
        let tmp = tempfile::Builder::new()
            .prefix(&format!("{name}."))
            .tempdir_in(&cache)
            .expect("temp dir");
        std::fs::write(tmp.path().join("pipec_kernels.cu"), &src).expect("write the kernels");
        let out = Command::new(cxx)
            .args(CXXFLAGS)
            .arg("-I")
            .arg(tmp.path())
            .arg(emu_src_dir().join("driver.cpp"))
            .arg("-o")
            .arg(tmp.path().join("driver"))
            .output()
            .expect("run the C++ compiler");
        assert!(
            out.status.success(),
            "{cxx} could not build the CUDA emulation driver ({ty:?}):\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let tmp = tmp.keep();
        // Another test process may have won the race to the same (identical) build.
        if std::fs::rename(&tmp, &dir).is_err() {
            let _ = std::fs::remove_dir_all(&tmp);
        }
    }
    assert!(exe.is_file(), "{} missing after the build", exe.display());
    Emu { ty, exe }
}

/// One kernel argument, as the driver's protocol carries it.
#[derive(Clone, Debug, PartialEq)]
enum Arg {
    /// A `float*` buffer (`T*` in f32).
    F32(Vec<f32>),
    /// An `unsigned short*` buffer of bf16 bits (`T*` in bf16).
    Bf16(Vec<u16>),
    /// An `unsigned int*` buffer (token ids, targets).
    U32(Vec<u32>),
    /// An `int` scalar.
    I32(i32),
    /// A `float` scalar.
    Scalar(f32),
}

impl Arg {
    fn kind(&self) -> u8 {
        match self {
            Arg::F32(_) => b'f',
            Arg::Bf16(_) => b'h',
            Arg::U32(_) => b'u',
            Arg::I32(_) => b'i',
            Arg::Scalar(_) => b's',
        }
    }
}

/// A launch configuration (x dimensions only: the kernels use no others).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
struct Cfg {
    grid: u32,
    block: u32,
}

impl Cfg {
    /// model.rs's `grid(n)`, restated here because it is private there and behind the `cuda`
    /// feature: 256 threads per block, `ceil(n / 256)` blocks clamped to `1..=4096`.
    fn model(n: usize) -> Cfg {
        Cfg {
            grid: n.div_ceil(256).clamp(1, 4096) as u32,
            block: 256,
        }
    }

    /// model.rs's softmax launch: one block per row, with `vocab` rounded up to a power of two
    /// and clamped to `32..=1024` threads.
    fn softmax(rows: usize, vocab: usize) -> Cfg {
        Cfg {
            grid: rows as u32,
            block: vocab.next_power_of_two().clamp(32, 1024) as u32,
        }
    }
}

/// How a run launches the grid-stride kernels: as model.rs does, or on a deliberately tiny
/// grid of 2 blocks of 3 threads, so that every thread loops over many elements.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum Grids {
    Model,
    Tiny,
}

impl Grids {
    const ALL: [Grids; 2] = [Grids::Model, Grids::Tiny];

    fn cfg(self, n: usize) -> Cfg {
        match self {
            Grids::Model => Cfg::model(n),
            Grids::Tiny => Cfg { grid: 2, block: 3 },
        }
    }
}

/// A request being built: `emu.launch(name, cfg).t(..).i32(..).run()`.
struct Launch<'e> {
    emu: &'e Emu,
    name: &'static str,
    cfg: Cfg,
    args: Vec<Arg>,
}

/// The arguments after a launch, buffers as the kernel left them. Index `i` is the kernel's
/// `i`-th parameter.
struct Out {
    ty: Ty,
    args: Vec<Arg>,
}

fn bf16_to_f32(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

fn round_bf16(x: f32) -> f32 {
    bf16_to_f32(kernels::bf16_bits(x))
}

impl Emu {
    fn launch(&self, name: &'static str, cfg: Cfg) -> Launch<'_> {
        Launch {
            emu: self,
            name,
            cfg,
            args: Vec::new(),
        }
    }

    /// A value as the device holds it in `T` (bf16: rounded to nearest even).
    fn round(&self, a: &Array2<f32>) -> Array2<f32> {
        match self.ty {
            Ty::F32 => a.clone(),
            Ty::Bf16 => a.mapv(round_bf16),
        }
    }

    fn round_all(&self, p: &[Array2<f32>]) -> Vec<Array2<f32>> {
        p.iter().map(|t| self.round(t)).collect()
    }

    /// cuBLAS's GEMM as model.rs calls it: fp32 accumulation, the product stored in `T`. The
    /// operands are passed exactly as the CPU model's expressions pass them, so in f32 the
    /// product is the CPU model's, bit for bit.
    fn mm(&self, a: ArrayView2<f32>, b: ArrayView2<f32>) -> Array2<f32> {
        self.round(&a.dot(&b))
    }

    /// Where the CPU model and the kernel do the same float operations in the same order:
    /// bitwise in f32; in bf16 the f32 model is the reference, so [`BF16_TOL`].
    fn exact(&self) -> Tol {
        match self.ty {
            Ty::F32 => Tol::Bits,
            Ty::Bf16 => BF16_TOL,
        }
    }

    /// Where they do different float work (transcendentals, softmax sums): [`F32_TOL`] or
    /// [`BF16_TOL`].
    fn approx(&self) -> Tol {
        match self.ty {
            Ty::F32 => F32_TOL,
            Ty::Bf16 => BF16_TOL,
        }
    }
}

impl Launch<'_> {
    fn arg(mut self, a: Arg) -> Self {
        self.args.push(a);
        self
    }

    /// A `T*` buffer holding `v` (bf16: rounded to nearest even, as the backend uploads).
    fn t<'a>(self, v: impl IntoIterator<Item = &'a f32>) -> Self {
        let v = v.into_iter().copied();
        let a = match self.emu.ty {
            Ty::F32 => Arg::F32(v.collect()),
            Ty::Bf16 => Arg::Bf16(v.map(kernels::bf16_bits).collect()),
        };
        self.arg(a)
    }

    fn t_zeros(self, n: usize) -> Self {
        self.t(&vec![0.0; n])
    }

    /// A `float*` buffer (the loss and the step's gradient sums are f32 in both types).
    fn f32s(self, v: &[f32]) -> Self {
        self.arg(Arg::F32(v.to_vec()))
    }

    fn u32s(self, v: &[u32]) -> Self {
        self.arg(Arg::U32(v.to_vec()))
    }

    fn i32(self, n: usize) -> Self {
        self.arg(Arg::I32(i32::try_from(n).expect("fits i32")))
    }

    fn f32(self, x: f32) -> Self {
        self.arg(Arg::Scalar(x))
    }

    fn run(self) -> Out {
        let name = self.name;
        self.try_run()
            .unwrap_or_else(|e| panic!("launch of {name}: {e}"))
    }

    /// Run the launch; `Err` carries the driver's exit status and message.
    fn try_run(self) -> Result<Out, String> {
        let mut req = b"PKRQ".to_vec();
        let u32le = |req: &mut Vec<u8>, x: u32| req.extend_from_slice(&x.to_le_bytes());
        u32le(&mut req, self.name.len() as u32);
        req.extend_from_slice(self.name.as_bytes());
        for x in [self.cfg.grid, 1, 1, self.cfg.block, 1, 1] {
            u32le(&mut req, x);
        }
        u32le(&mut req, self.args.len() as u32);
        for a in &self.args {
            req.push(a.kind());
            match a {
                Arg::F32(v) => {
                    u32le(&mut req, v.len() as u32);
                    v.iter()
                        .for_each(|x| req.extend_from_slice(&x.to_le_bytes()));
                }
                Arg::Bf16(v) => {
                    u32le(&mut req, v.len() as u32);
                    v.iter()
                        .for_each(|x| req.extend_from_slice(&x.to_le_bytes()));
                }
                Arg::U32(v) => {
                    u32le(&mut req, v.len() as u32);
                    v.iter()
                        .for_each(|x| req.extend_from_slice(&x.to_le_bytes()));
                }
                Arg::I32(x) => req.extend_from_slice(&x.to_le_bytes()),
                Arg::Scalar(x) => req.extend_from_slice(&x.to_le_bytes()),
            }
        }
        let mut child = Command::new(&self.emu.exe)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start the driver");
        // The driver reads the whole request before it writes anything.
        child
            .stdin
            .take()
            .expect("stdin")
            .write_all(&req)
            .expect("send the request");
        let out = child.wait_with_output().expect("driver output");
        if !out.status.success() {
            return Err(format!(
                "{}: {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        Ok(Out {
            ty: self.emu.ty,
            args: decode_reply(&out.stdout, self.args),
        })
    }
}

/// Put the reply's buffers back in place of the request's.
fn decode_reply(reply: &[u8], mut args: Vec<Arg>) -> Vec<Arg> {
    let mut at = 0;
    let mut take = |n: usize| {
        let s = &reply[at..at + n];
        at += n;
        s
    };
    assert_eq!(take(4), b"PKRS", "reply magic");
    let word = |s: &[u8]| u32::from_le_bytes(s.try_into().unwrap());
    let nbuf = word(take(4)) as usize;
    let mut seen = 0;
    for a in args.iter_mut() {
        let len = match a {
            Arg::F32(v) => v.len(),
            Arg::Bf16(v) => v.len(),
            Arg::U32(v) => v.len(),
            Arg::I32(_) | Arg::Scalar(_) => continue,
        };
        seen += 1;
        assert_eq!(take(1)[0], a.kind(), "reply buffer kind");
        assert_eq!(word(take(4)) as usize, len, "reply buffer length");
        match a {
            Arg::F32(v) => {
                let bytes = take(4 * len);
                for (x, c) in v.iter_mut().zip(bytes.chunks_exact(4)) {
                    *x = f32::from_le_bytes(c.try_into().unwrap());
                }
            }
            Arg::Bf16(v) => {
                let bytes = take(2 * len);
                for (x, c) in v.iter_mut().zip(bytes.chunks_exact(2)) {
                    *x = u16::from_le_bytes(c.try_into().unwrap());
                }
            }
            Arg::U32(v) => {
                let bytes = take(4 * len);
                for (x, c) in v.iter_mut().zip(bytes.chunks_exact(4)) {
                    *x = u32::from_le_bytes(c.try_into().unwrap());
                }
            }
            Arg::I32(_) | Arg::Scalar(_) => unreachable!(),
        }
    }
    assert_eq!(seen, nbuf, "reply buffer count");
    assert_eq!(at, reply.len(), "reply length");
    args
}

impl Out {
    /// A `T*` or `float*` buffer as f32 values.
    fn vals(&self, i: usize) -> Vec<f32> {
        match &self.args[i] {
            Arg::F32(v) => v.clone(),
            Arg::Bf16(v) => v.iter().map(|&b| bf16_to_f32(b)).collect(),
            other => panic!("argument {i} is not a float buffer: {other:?}"),
        }
    }

    fn mat(&self, i: usize, rows: usize, cols: usize) -> Array2<f32> {
        Array2::from_shape_vec((rows, cols), self.vals(i)).expect("buffer length")
    }

    /// A bf16 `T*` buffer's bits.
    fn bits(&self, i: usize) -> &[u16] {
        assert_eq!(self.ty, Ty::Bf16);
        match &self.args[i] {
            Arg::Bf16(v) => v,
            other => panic!("argument {i} is not a bf16 buffer: {other:?}"),
        }
    }
}

// ---- comparisons --------------------------------------------------------------------------

#[derive(Copy, Clone, Debug)]
enum Tol {
    /// Bit for bit.
    Bits,
    /// `|got - want| <= r * max|want|` for every element.
    Scaled(f32),
}

/// f32 where the kernel's float work differs from the CPU model's: transcendentals (CUDA's
/// `expf`/`tanhf` are within 2 ulps and `logf` within 1 ulp, per the CUDA C++ Programming
/// Guide's table of single-precision functions; the host libm differs from them by as much),
/// the softmax block's tree sum against ndarray's 8-way unrolled sum, and a 1-ulp different
/// `3·GELU_K` constant in `gelu_grad` (the kernel multiplies `3.0f * 0.044715f` in float; the
/// CPU rounds `3 * 0.044715` from f64). A later GEMM spreads such differences over at most 13
/// products of numbers below the tensor's scale. 16 ulps of the tensor's largest magnitude
/// covers all of that with room to spare. Measured on the host (glibc): at most 1.3 ulps, from
/// the softmax sums and the `gelu_grad` constant; everything else is bitwise.
const F32_TOL: Tol = Tol::Scaled(16.0 * f32::EPSILON);

/// bf16 results against the f32 CPU model. bf16 keeps 8 significant bits, so each store is off
/// by at most u = 2^-8 of the value. Between a layer's f32 inputs and its output there are at
/// most about four stores (rounding the inputs and weights, the GEMM's product, the bias or
/// activation store, the residual store), plus three in the embedding gradient's repeated-token
/// sum. A GEMM sums products whose own errors are relative to them, not to the result. 8u of
/// the tensor's largest magnitude allows for that (the errors measured so far are well inside
/// it; bench/HISTORY.md).
const BF16_TOL: Tol = Tol::Scaled(8.0 / 256.0);

fn within(got: &[f32], want: &[f32], tol: Tol) -> Result<(), String> {
    if got.len() != want.len() {
        return Err(format!("{} elements, want {}", got.len(), want.len()));
    }
    match tol {
        Tol::Bits => match got
            .iter()
            .zip(want)
            .position(|(g, w)| g.to_bits() != w.to_bits())
        {
            Some(i) => Err(format!(
                "element {i}: {:e} ({:#010x}), want {:e} ({:#010x}) bit for bit",
                got[i],
                got[i].to_bits(),
                want[i],
                want[i].to_bits()
            )),
            None => Ok(()),
        },
        Tol::Scaled(r) => {
            let scale = want.iter().fold(0.0f32, |m, w| m.max(w.abs()));
            let bound = r * scale;
            let (i, err) = got
                .iter()
                .zip(want)
                .map(|(g, w)| (g - w).abs())
                .enumerate()
                .fold((0, 0.0f32), |(bi, be), (i, e)| {
                    if e > be || e.is_nan() {
                        (i, e)
                    } else {
                        (bi, be)
                    }
                });
            if err.is_nan() || err > bound {
                Err(format!(
                    "element {i}: {:e}, want {:e}: error {err:e} over {bound:e} \
                     ({r:e} of the largest magnitude {scale:e})",
                    got[i], want[i]
                ))
            } else {
                Ok(())
            }
        }
    }
}

fn check(got: &[f32], want: &[f32], tol: Tol, what: &str) {
    if let Err(e) = within(got, want, tol) {
        panic!("{what}: {e}");
    }
}

fn check2(got: &Array2<f32>, want: &Array2<f32>, tol: Tol, what: &str) {
    assert_eq!(got.dim(), want.dim(), "{what}: shape");
    let g: Vec<f32> = got.iter().copied().collect();
    let w: Vec<f32> = want.iter().copied().collect();
    check(&g, &w, tol, what);
}

/// Grid-stride kernels compute each element in exactly one thread with the same arithmetic,
/// so the launch configuration must not change a single bit: a skipped element would keep its
/// initial value, and an in-place kernel that reached an element twice would apply itself twice.
fn same_bits_across_grids(first: &mut Option<Vec<Vec<f32>>>, now: Vec<Vec<f32>>, what: &str) {
    match first {
        None => *first = Some(now),
        Some(f) => {
            for (k, (a, b)) in f.iter().zip(&now).enumerate() {
                if let Err(e) = within(b, a, Tol::Bits) {
                    panic!("{what}: output {k} on the tiny grid differs from model.rs's grid: {e}");
                }
            }
        }
    }
}

fn flat(a: &Array2<f32>) -> Vec<f32> {
    a.iter().copied().collect()
}

// ---- shapes and data ----------------------------------------------------------------------

/// Small odd sizes. Tokens repeat (up to three times) and include 0 and `vocab - 1`.
struct Shape {
    seq: usize,
    hidden: usize,
    ffn: usize,
    vocab: usize,
    tokens: &'static [u32],
    targets: &'static [u32],
}

const SHAPES: [Shape; 3] = [
    Shape {
        seq: 5,
        hidden: 7,
        ffn: 11,
        vocab: 13,
        tokens: &[4, 12, 4, 0, 4],
        targets: &[12, 0, 5, 7, 12],
    },
    Shape {
        seq: 7,
        hidden: 9,
        ffn: 13,
        vocab: 40,
        tokens: &[39, 2, 17, 2, 39, 0, 2],
        targets: &[0, 39, 3, 3, 21, 8, 39],
    },
    Shape {
        seq: 3,
        hidden: 5,
        ffn: 7,
        vocab: 11,
        tokens: &[10, 10, 1],
        targets: &[1, 10, 0],
    },
];

impl Shape {
    fn cfg(&self) -> ModelConfig {
        ModelConfig {
            hidden: self.hidden,
            ffn: self.ffn,
            vocab: self.vocab,
            seq: self.seq,
            seed: 17,
        }
    }

    /// The CPU model's own initial parameters of a layer.
    fn layer(&self, kind: LayerKind) -> Vec<Array2<f32>> {
        Layer::<f32>::init(kind, &self.cfg(), 1, 0).tensors
    }

    fn name(&self) -> String {
        format!(
            "seq {} hidden {} ffn {} vocab {}",
            self.seq, self.hidden, self.ffn, self.vocab
        )
    }
}

/// Uniform in `[-scale, scale)`.
fn uniform(rows: usize, cols: usize, seed: u64, scale: f64) -> Array2<f32> {
    let mut g = SplitMix64::new(seed);
    Array2::from_shape_simple_fn((rows, cols), || (g.next_signed() * scale) as f32)
}

/// Values spread over 2^-8 .. 2^8 in magnitude, so that sums depend on their order.
fn spread(rows: usize, cols: usize, seed: u64) -> Array2<f32> {
    let mut g = SplitMix64::new(seed);
    Array2::from_shape_simple_fn((rows, cols), || {
        let e = g.below(17) as i32 - 8;
        (g.next_signed() * 2f64.powi(e)) as f32
    })
}

// ---- model.rs's recipes, with ndarray in place of cuBLAS -----------------------------------
//
// Each takes the values the device holds (already in `T`) and launches exactly what model.rs
// launches, with the same argument lists; `grids` replaces model.rs's `grid(n)` when Tiny.

/// `stage_fwd`, `E`.
fn dev_embed_fwd(e: &Emu, grids: Grids, table: &Array2<f32>, tok: &[u32]) -> Array2<f32> {
    let (s, h) = (tok.len(), table.ncols());
    e.launch("embed_fwd", grids.cfg(s * h))
        .t(table)
        .u32s(tok)
        .t_zeros(s * h)
        .i32(s)
        .i32(h)
        .run()
        .mat(2, s, h)
}

/// `stage_bwd_w`, `E`: one thread per (distinct token, column) (`grid(segs * h)`), over the
/// host-built [`kernels::EmbedPlan`].
fn dev_embed_bwd(
    e: &Emu,
    grids: Grids,
    shape: (usize, usize),
    tok: &[u32],
    dy: &Array2<f32>,
) -> Array2<f32> {
    dev_embed_bwd_over(e, grids, shape, tok, dy, kernels::EmbedPlan::new(tok))
}

/// As [`dev_embed_bwd`], over a given plan (a captured step's padded one).
fn dev_embed_bwd_over(
    e: &Emu,
    grids: Grids,
    shape: (usize, usize),
    tok: &[u32],
    dy: &Array2<f32>,
    plan: kernels::EmbedPlan,
) -> Array2<f32> {
    let h = shape.1;
    e.launch("embed_bwd", grids.cfg(plan.segs() * h))
        .t_zeros(shape.0 * h)
        .u32s(tok)
        .u32s(&plan.order)
        .u32s(&plan.starts)
        .t(dy)
        .i32(plan.segs())
        .i32(h)
        .run()
        .mat(0, shape.0, h)
}

/// `stage_fwd`, `t`/`m`: returns `(y, h, a)`.
fn dev_block_fwd(
    e: &Emu,
    grids: Grids,
    p: &[Array2<f32>],
    x: &Array2<f32>,
) -> (Array2<f32>, Array2<f32>, Array2<f32>) {
    let (s, f) = (x.nrows(), p[0].ncols());
    let hh = e.mm(x.view(), p[0].view());
    let o = e
        .launch("bias_gelu_fwd", grids.cfg(s * f))
        .t(&hh)
        .t_zeros(s * f)
        .t(&p[1])
        .i32(s)
        .i32(f)
        .run();
    let (hh, a) = (o.mat(0, s, f), o.mat(1, s, f));
    let y = e.mm(a.view(), p[2].view());
    let y = dev_add_bias_residual(e, grids, &y, x, &p[3]);
    (y, hh, a)
}

fn dev_add_bias_residual(
    e: &Emu,
    grids: Grids,
    y: &Array2<f32>,
    x: &Array2<f32>,
    b: &Array2<f32>,
) -> Array2<f32> {
    let (s, h) = y.dim();
    e.launch("add_bias_residual", grids.cfg(s * h))
        .t(y)
        .t(x)
        .t(b)
        .i32(s)
        .i32(h)
        .run()
        .mat(0, s, h)
}

/// `stage_bwd_d`, `t`/`m`: returns `(dx, dh)`.
fn dev_block_bwd_d(
    e: &Emu,
    grids: Grids,
    p: &[Array2<f32>],
    hh: &Array2<f32>,
    dy: &Array2<f32>,
) -> (Array2<f32>, Array2<f32>) {
    let (s, f) = hh.dim();
    let dh = e.mm(dy.view(), p[2].t());
    let dh = e
        .launch("gelu_bwd", grids.cfg(s * f))
        .t(&dh)
        .t(hh)
        .i32(s * f)
        .run()
        .mat(0, s, f);
    let dx = e.mm(dh.view(), p[0].t());
    (dev_add_into(e, grids, &dx, dy), dh)
}

fn dev_add_into(e: &Emu, grids: Grids, dx: &Array2<f32>, dy: &Array2<f32>) -> Array2<f32> {
    let (s, h) = dx.dim();
    e.launch("add_into", grids.cfg(s * h))
        .t(dx)
        .t(dy)
        .i32(s * h)
        .run()
        .mat(0, s, h)
}

/// model.rs's `col_sums` (the bias gradients of `stage_bwd_w`): `grid(cols)`. Returns `[1, cols]`.
fn dev_col_sums(e: &Emu, grids: Grids, a: &Array2<f32>) -> Array2<f32> {
    let (r, c) = a.dim();
    e.launch("col_sums", grids.cfg(c))
        .t(a)
        .t_zeros(c)
        .i32(r)
        .i32(c)
        .run()
        .mat(1, 1, c)
}

/// What the head's forward leaves on the device.
struct HeadFwd {
    loss: f32,
    probs: Array2<f32>,
    row_loss: Vec<f32>,
}

/// `stage_fwd`, `L`, with the softmax launched as `softmax` says.
fn dev_head_fwd(
    e: &Emu,
    grids: Grids,
    softmax: Cfg,
    p: &[Array2<f32>],
    x: &Array2<f32>,
    tgt: &[u32],
) -> HeadFwd {
    let (s, v) = (x.nrows(), p[0].ncols());
    let z = e.mm(x.view(), p[0].view());
    let z = dev_add_bias(e, grids, &z, &p[1]);
    let o = e
        .launch("softmax_xent_fwd", softmax)
        .t(&z)
        .u32s(tgt)
        .f32s(&vec![0.0; s])
        .i32(s)
        .i32(v)
        .run();
    let (probs, row_loss) = (o.mat(0, s, v), o.vals(2));
    let loss = e
        .launch("loss_mean", grids.cfg(1))
        .f32s(&row_loss)
        .f32s(&[0.0])
        .i32(s)
        .run()
        .vals(1)[0];
    HeadFwd {
        loss,
        probs,
        row_loss,
    }
}

fn dev_add_bias(e: &Emu, grids: Grids, y: &Array2<f32>, b: &Array2<f32>) -> Array2<f32> {
    let (s, v) = y.dim();
    e.launch("add_bias", grids.cfg(s * v))
        .t(y)
        .t(b)
        .i32(s)
        .i32(v)
        .run()
        .mat(0, s, v)
}

/// `stage_bwd_d`, `L`, for a step of `microbatches`: returns `(dx, dlogits)`.
fn dev_head_bwd_d(
    e: &Emu,
    grids: Grids,
    p: &[Array2<f32>],
    probs: &Array2<f32>,
    tgt: &[u32],
    microbatches: u32,
) -> (Array2<f32>, Array2<f32>) {
    let (s, v) = probs.dim();
    // model.rs: "The CPU's `scale / rows` with `scale = 1 / M`, in f32."
    let k = (1.0f32 / microbatches as f32) / s as f32;
    let dl = e
        .launch("xent_bwd", grids.cfg(s * v))
        .t(probs)
        .u32s(tgt)
        .t_zeros(s * v)
        .f32(k)
        .i32(s)
        .i32(v)
        .run()
        .mat(2, s, v);
    (e.mm(dl.view(), p[0].t()), dl)
}

/// `accumulate`: the step's f32 sum of one tensor over microbatches, in microbatch order.
fn dev_accum(e: &Emu, grids: Grids, per_mb: &[Array2<f32>]) -> Vec<f32> {
    let n = per_mb[0].len();
    let mut sum = vec![0.0f32; n];
    for g in per_mb {
        sum = e
            .launch("accum", grids.cfg(n))
            .f32s(&sum)
            .t(g)
            .i32(n)
            .run()
            .vals(0);
    }
    sum
}

/// `sgd`: `w -= lr * sum`.
fn dev_sgd(e: &Emu, grids: Grids, w: &Array2<f32>, sum: &[f32], lr: f32) -> Vec<f32> {
    let n = w.len();
    e.launch("sgd", grids.cfg(n))
        .t(w)
        .f32s(sum)
        .f32(lr)
        .i32(n)
        .run()
        .vals(0)
}

// ---- the driver against the kernel table -----------------------------------------------------

#[test]
fn the_driver_dispatches_every_kernel_of_names_and_nothing_else() {
    for ty in TYS {
        let Some(e) = emu(ty) else { return };
        let out = Command::new(&e.exe).arg("--names").output().unwrap();
        assert!(out.status.success());
        let table: BTreeSet<String> = String::from_utf8(out.stdout)
            .unwrap()
            .lines()
            .map(String::from)
            .collect();
        let names: BTreeSet<String> = kernels::NAMES.iter().map(|n| n.to_string()).collect();
        assert_eq!(
            table, names,
            "driver.cpp's TABLE must list exactly kernels::NAMES"
        );
    }
}

// ---- layers against the CPU model -----------------------------------------------------------

#[test]
fn embedding_forward_and_weight_gradient_match_the_cpu_model() {
    for ty in TYS {
        let Some(e) = emu(ty) else { return };
        for sh in &SHAPES {
            let table = sh.layer(LayerKind::Embedding).remove(0);
            let dy = spread(sh.seq, sh.hidden, 11);
            let want_y = model::embed_fwd(&table, sh.tokens);
            let want_g = model::embed_bwd_w(table.dim(), sh.tokens, &dy);
            let mut first = None;
            for grids in Grids::ALL {
                let what = format!("{ty:?} {} {grids:?}", sh.name());
                let y = dev_embed_fwd(e, grids, &e.round(&table), sh.tokens);
                // Gather: a copy, exact in both types relative to the rounded table.
                check2(&y, &want_y, e.exact(), &format!("embed_fwd {what}"));
                // Scatter-add: each row's positions added in position order, as the CPU adds.
                let g = dev_embed_bwd(e, grids, table.dim(), sh.tokens, &e.round(&dy));
                check2(&g, &want_g, e.exact(), &format!("embed_bwd {what}"));
                // A captured step's plan, padded to twice the positions with empty runs (the
                // kernel skips them): the same bits.
                let padded = kernels::EmbedPlan::padded(sh.tokens, 2 * sh.tokens.len());
                let gp =
                    dev_embed_bwd_over(e, grids, table.dim(), sh.tokens, &e.round(&dy), padded);
                assert_eq!(flat(&gp), flat(&g), "padded embed_bwd {what}");
                same_bits_across_grids(&mut first, vec![flat(&y), flat(&g)], &what);
            }
        }
    }
}

/// Regression: `embed_bwd` added each repeated token's rows into the bf16 table, rounding after
/// every add, where every other reduction adds in float and rounds once. A token repeated 40
/// times now gets exactly the bf16 rounding of the CPU's f32 sum (of the bf16 inputs, in
/// position order), in both types.
#[test]
fn embedding_gradient_of_a_repeated_token_is_rounded_once() {
    for ty in TYS {
        let Some(e) = emu(ty) else { return };
        let (vocab, hidden, seq) = (5, 7, 40);
        let tokens: Vec<u32> = (0..seq as u32)
            .map(|p| if p % 8 == 5 { 1 } else { 3 })
            .collect();
        let dy = e.round(&uniform(seq, hidden, 77, 1.0));
        let want = e.round(&model::embed_bwd_w((vocab, hidden), &tokens, &dy));
        let got = dev_embed_bwd(e, Grids::ALL[0], (vocab, hidden), &tokens, &dy);
        check2(
            &got,
            &want,
            Tol::Bits,
            &format!("{ty:?} embed_bwd, token 3 x35"),
        );
    }
}

#[test]
fn block_forward_matches_the_cpu_model() {
    for ty in TYS {
        let Some(e) = emu(ty) else { return };
        for (si, sh) in SHAPES.iter().enumerate() {
            let p = sh.layer(LayerKind::Decoder);
            let x = uniform(sh.seq, sh.hidden, 20 + si as u64, 1.5);
            let (want_y, want_h, want_a) = model::block_fwd(&p, &x);
            let mut first = None;
            for grids in Grids::ALL {
                let what = format!("{ty:?} {} {grids:?}", sh.name());
                let (y, h, a) = dev_block_fwd(e, grids, &e.round_all(&p), &e.round(&x));
                // h = x W1 + b1: the same GEMM call and one add.
                check2(&h, &want_h, e.exact(), &format!("h {what}"));
                check2(&a, &want_a, e.approx(), &format!("gelu(h) {what}"));
                check2(&y, &want_y, e.approx(), &format!("y {what}"));
                same_bits_across_grids(&mut first, vec![flat(&y), flat(&h), flat(&a)], &what);
                if ty == Ty::F32 {
                    // With the CPU's own a, the residual kernel adds (x + aW2) + b2 as the CPU
                    // does: bit for bit.
                    let y = dev_add_bias_residual(e, grids, &want_a.dot(&p[2]), &x, &p[3]);
                    check2(&y, &want_y, Tol::Bits, &format!("add_bias_residual {what}"));
                }
            }
        }
    }
}

#[test]
fn block_input_gradient_matches_the_cpu_model() {
    for ty in TYS {
        let Some(e) = emu(ty) else { return };
        for (si, sh) in SHAPES.iter().enumerate() {
            let p = sh.layer(LayerKind::Mtp);
            let x = uniform(sh.seq, sh.hidden, 30 + si as u64, 1.5);
            let dy = uniform(sh.seq, sh.hidden, 40 + si as u64, 1.0);
            let (_, h, _) = model::block_fwd(&p, &x);
            let (want_dx, want_dh) = model::block_bwd_d(&p, &h, &dy);
            let mut first = None;
            for grids in Grids::ALL {
                let what = format!("{ty:?} {} {grids:?}", sh.name());
                let (dx, dh) =
                    dev_block_bwd_d(e, grids, &e.round_all(&p), &e.round(&h), &e.round(&dy));
                check2(&dh, &want_dh, e.approx(), &format!("dh {what}"));
                check2(&dx, &want_dx, e.approx(), &format!("dx {what}"));
                same_bits_across_grids(&mut first, vec![flat(&dx), flat(&dh)], &what);
                if ty == Ty::F32 {
                    // With the CPU's own dh, `add_into` is the CPU's dy + dh W1ᵀ bit for bit.
                    let dx = dev_add_into(e, grids, &want_dh.dot(&p[0].t()), &dy);
                    check2(&dx, &want_dx, Tol::Bits, &format!("add_into {what}"));
                }
            }
        }
    }
}

/// Regression (found by this harness): given the CPU's own `h` and `dy W2ᵀ`, `gelu_bwd` gives
/// the CPU's `dh` bit for bit on a host where C's `tanhf` and Rust's `f32::tanh` are the same
/// libm function (glibc, macOS). It did not while the kernel computed `3.0f * GELU_K` in float
/// (0x3e095d4e, rounded twice); the CPU's `c::<F>(3.0 * GELU_K)` rounds the product once
/// (0x3e095d4f), and so does the kernel's `GELU_3K` now.
#[test]
fn gelu_bwd_matches_the_cpu_bit_for_bit_given_the_same_inputs() {
    let Some(e) = emu(Ty::F32) else { return };
    for (si, sh) in SHAPES.iter().enumerate() {
        let p = sh.layer(LayerKind::Decoder);
        let x = uniform(sh.seq, sh.hidden, 30 + si as u64, 1.5);
        let dy = uniform(sh.seq, sh.hidden, 40 + si as u64, 1.0);
        let (_, h, _) = model::block_fwd(&p, &x);
        let (_, want_dh) = model::block_bwd_d(&p, &h, &dy);
        let (s, f) = h.dim();
        let dh = e
            .launch("gelu_bwd", Cfg::model(s * f))
            .t(&dy.dot(&p[2].t()))
            .t(&h)
            .i32(s * f)
            .run()
            .mat(0, s, f);
        check2(&dh, &want_dh, Tol::Bits, &format!("gelu_bwd {}", sh.name()));
    }
}

/// `col_sums` over more rows than the model shapes above have (they have fewer than eight,
/// where a compiler's unrolled loop would never run): still each column's rows added in order
/// from zero, bit for bit in f32. Written for an eight-rows-ahead version of the kernel, which
/// was no faster and was dropped (bench/HISTORY.md); the test stays as coverage.
#[test]
fn col_sums_of_many_rows_add_in_row_order() {
    for ty in TYS {
        let Some(e) = emu(ty) else { return };
        for (k, rows) in [8usize, 9, 16, 23, 64].into_iter().enumerate() {
            let a = e.round(&spread(rows, 6, 900 + k as u64));
            let mut want = Array2::<f32>::zeros((1, 6));
            for c in 0..6 {
                want[[0, c]] = a.column(c).iter().fold(0.0f32, |s, &v| s + v);
            }
            let want = e.round(&want);
            for grids in Grids::ALL {
                let got = dev_col_sums(e, grids, &a);
                check2(
                    &got,
                    &want,
                    e.exact(),
                    &format!("{ty:?} rows {rows} {grids:?}"),
                );
            }
        }
    }
}

/// The bias gradients of `bwd_W` (`col_sums`; the weight gradients are cuBLAS's). ndarray's
/// `sum_axis(Axis(0))` on a row-major `[rows, cols]` array (cols > 1) adds whole rows in row
/// order starting from zero, exactly the kernel's loop, so f32 must agree bit for bit.
#[test]
fn bias_gradients_match_the_cpu_model_bit_for_bit() {
    for ty in TYS {
        let Some(e) = emu(ty) else { return };
        let mut order_matters = false;
        for (si, sh) in SHAPES.iter().enumerate() {
            let seed = 50 + 10 * si as u64;
            let x = uniform(sh.seq, sh.hidden, seed, 1.0);
            let a = uniform(sh.seq, sh.ffn, seed + 1, 1.0);
            let dy = spread(sh.seq, sh.hidden, seed + 2);
            let dh = spread(sh.seq, sh.ffn, seed + 3);
            let dl = spread(sh.seq, sh.vocab, seed + 4);
            let block = model::block_bwd_w(&x, &a, &dy, &dh);
            let head = model::head_bwd_w(&x, &dl);
            let cases = [
                (&dh, &block[1], "db1"),
                (&dy, &block[3], "db2"),
                (&dl, &head[1], "b"),
            ];
            let mut first = None;
            for grids in Grids::ALL {
                let mut outs = Vec::new();
                for (src, want, name) in cases {
                    let got = dev_col_sums(e, grids, &e.round(src));
                    let what = format!("{name} {ty:?} {} {grids:?}", sh.name());
                    check2(&got, want, e.exact(), &what);
                    outs.push(flat(&got));
                }
                same_bits_across_grids(&mut first, outs, &format!("{ty:?} {}", sh.name()));
            }
            for (src, want, _) in cases {
                for c in 0..src.ncols() {
                    let rev = src.column(c).iter().rev().fold(0.0f32, |s, &v| s + v);
                    order_matters |= rev.to_bits() != want[[0, c]].to_bits();
                }
            }
        }
        // Not vacuous: on these data the reverse order gives other bits somewhere.
        assert!(
            order_matters,
            "the data do not make the sums order-dependent"
        );
    }
}

/// Logits `x W + b` (`add_bias`), softmax and row losses in one block per row, and the mean
/// (`loss_mean`), with model.rs's block size and with forced smaller blocks so that each thread
/// strides over several columns (vocab 11 and 13: 32 threads, more than the row; vocab 40: 64).
#[test]
fn head_forward_matches_the_cpu_model() {
    for ty in TYS {
        let Some(e) = emu(ty) else { return };
        for (si, sh) in SHAPES.iter().enumerate() {
            let p = sh.layer(LayerKind::Loss);
            let x = uniform(sh.seq, sh.hidden, 60 + si as u64, 2.0);
            let (want_loss, want_probs) = model::head_fwd(&p, &x, sh.targets);
            let model_cfg = Cfg::softmax(sh.seq, sh.vocab);
            assert!(model_cfg.block >= 32 && model_cfg.block.is_power_of_two());
            let mut first = None;
            for (grids, block) in [
                (Grids::Model, model_cfg.block),
                (Grids::Tiny, model_cfg.block),
                (Grids::Model, 8),
                (Grids::Model, 1),
            ] {
                let what = format!("{ty:?} {} {grids:?} block {block}", sh.name());
                let softmax = Cfg {
                    grid: sh.seq as u32,
                    block,
                };
                let (rp, rx) = (e.round_all(&p), e.round(&x));
                let out = dev_head_fwd(e, grids, softmax, &rp, &rx, sh.targets);
                check2(
                    &out.probs,
                    &want_probs,
                    e.approx(),
                    &format!("probs {what}"),
                );
                check(
                    &[out.loss],
                    &[want_loss],
                    e.approx(),
                    &format!("loss {what}"),
                );
                if block == model_cfg.block {
                    same_bits_across_grids(&mut first, vec![flat(&out.probs)], &what);
                }
                if ty == Ty::F32 {
                    // `loss_mean` adds the row losses in row order and divides, as head_fwd's
                    // `total += ..; total / rows` does.
                    let mut total = 0.0f32;
                    for &l in &out.row_loss {
                        total += l;
                    }
                    let mean = total / sh.seq as f32;
                    check(
                        &[out.loss],
                        &[mean],
                        Tol::Bits,
                        &format!("loss_mean {what}"),
                    );
                    // `add_bias` is the CPU's x W + b.
                    let z = dev_add_bias(e, grids, &x.dot(&p[0]), &p[1]);
                    check2(&z, &(x.dot(&p[0]) + &p[1]), Tol::Bits, &format!("z {what}"));
                }
            }
        }
    }
}

/// `xent_bwd` with `k = (1/M)/seq` as model.rs computes it: from the CPU's probabilities, the
/// logits' gradient and the GEMM after it equal `head_bwd_d` bit for bit in f32.
#[test]
fn head_input_gradient_matches_the_cpu_model() {
    for ty in TYS {
        let Some(e) = emu(ty) else { return };
        for (si, sh) in SHAPES.iter().enumerate() {
            let p = sh.layer(LayerKind::Loss);
            let x = uniform(sh.seq, sh.hidden, 70 + si as u64, 2.0);
            let (_, probs) = model::head_fwd(&p, &x, sh.targets);
            for m in [1u32, 3, 7] {
                let scale = 1.0f32 / m as f32; // `Ctx::loss_scale`
                let (want_dx, want_dl) = model::head_bwd_d(&p, &probs, sh.targets, scale);
                let mut first = None;
                for grids in Grids::ALL {
                    let what = format!("{ty:?} {} M {m} {grids:?}", sh.name());
                    let (dx, dl) =
                        dev_head_bwd_d(e, grids, &e.round_all(&p), &e.round(&probs), sh.targets, m);
                    check2(&dl, &want_dl, e.exact(), &format!("dlogits {what}"));
                    check2(&dx, &want_dx, e.exact(), &format!("dx {what}"));
                    same_bits_across_grids(&mut first, vec![flat(&dl)], &what);
                }
            }
        }
    }
}

/// The step: `accum` sums each microbatch's gradient into f32 in microbatch order (the device
/// code orders them as `GradAccum` does), then `sgd` applies `w -= lr * sum`. In f32 both equal
/// the CPU bit for bit here. On a GPU, NVRTC's default `--fmad=true` may fuse `w - lr * g` into
/// one FMA, which can change the last bit; the emulation does two roundings, like the CPU.
#[test]
fn gradient_accumulation_and_sgd_match_the_cpu_model() {
    let sh = &SHAPES[0];
    let p = sh.layer(LayerKind::Decoder);
    let stage = Stage {
        index: 0,
        layers: vec![Layer {
            kind: LayerKind::Decoder,
            tensors: p.clone(),
        }],
    };
    let grads: Vec<Vec<Array2<f32>>> = (0..3)
        .map(|mb| {
            p.iter()
                .enumerate()
                .map(|(t, w)| spread(w.nrows(), w.ncols(), 80 + 10 * mb + t as u64))
                .collect()
        })
        .collect();
    let mut acc = GradAccum::new(&stage);
    for mb in [2u32, 0, 1] {
        acc.add(
            mb,
            vec![Layer {
                kind: LayerKind::Decoder,
                tensors: grads[mb as usize].clone(),
            }],
        );
    }
    let lr = 0.05f32; // not a power of two: the product rounds
    let mut stepped = stage.clone();
    model::sgd(&mut stepped, acc.sum(), lr);
    for ty in TYS {
        let Some(e) = emu(ty) else { return };
        for grids in Grids::ALL {
            for t in 0..p.len() {
                let what = format!("{ty:?} {grids:?} tensor {t}");
                let per_mb: Vec<Array2<f32>> = grads.iter().map(|g| e.round(&g[t])).collect();
                let sum = dev_accum(e, grids, &per_mb);
                let want_sum = &acc.sum()[0].tensors[t];
                check(&sum, &flat(want_sum), e.exact(), &format!("accum {what}"));
                let w = dev_sgd(e, grids, &e.round(&p[t]), &sum, lr);
                let want_w = &stepped.layers[0].tensors[t];
                check(&w, &flat(want_w), e.exact(), &format!("sgd {what}"));
            }
        }
    }
}

// ---- bf16 encoding ------------------------------------------------------------------------

/// f32 `to_f32` copies every bit pattern, NaNs and signed zeros included.
#[test]
fn f32_to_f32_copies_bits() {
    let Some(e) = emu(Ty::F32) else { return };
    let mut g = SplitMix64::new(5);
    let mut x: Vec<f32> = (0..200)
        .map(|_| f32::from_bits(g.next_u64() as u32))
        .collect();
    x.extend([0.0, -0.0, f32::INFINITY, f32::MIN_POSITIVE / 3.0, f32::NAN]);
    let n = x.len();
    for cfg in [Cfg::model(n), Grids::Tiny.cfg(n)] {
        let y = e
            .launch("to_f32", cfg)
            .f32s(&x)
            .f32s(&vec![0.0; n])
            .i32(n)
            .run()
            .vals(1);
        check(&y, &x, Tol::Bits, &format!("to_f32 {cfg:?}"));
    }
}

/// The bf16 kernels' `ld` is the host's decoding (`bits << 16`), for all 65536 patterns.
#[test]
fn bf16_loads_decode_every_bit_pattern_like_the_host() {
    let Some(e) = emu(Ty::Bf16) else { return };
    let bits: Vec<u16> = (0..=u16::MAX).collect();
    let n = bits.len();
    let y = e
        .launch("to_f32", Cfg { grid: 4, block: 64 })
        .arg(Arg::Bf16(bits.clone()))
        .f32s(&vec![0.0; n])
        .i32(n)
        .run()
        .vals(1);
    let want: Vec<f32> = bits.iter().map(|&b| bf16_to_f32(b)).collect();
    check(&y, &want, Tol::Bits, "to_f32 over every bf16 pattern");
}

fn is_bf16_nan(b: u16) -> bool {
    (b & 0x7f80) == 0x7f80 && (b & 0x7f) != 0
}

/// The bf16 kernels' `st` agrees with `kernels::bf16_bits` (the host twin, which the runtime's
/// unit tests check against the `half` crate): `sgd` with `w = -0.0` and `lr = -1` stores
/// `-0 - (-1 · g) = g` exactly, so it stores an arbitrary f32. Swept: every upper half with
/// lower halves at the rounding edges (0, 1, just below, at and above the halfway point, all
/// ones). NaNs need only stay NaN: a GPU may return its canonical NaN instead of the input's.
#[test]
fn bf16_stores_round_every_pattern_like_bf16_bits() {
    let Some(e) = emu(Ty::Bf16) else { return };
    let lows = [0x0000u32, 0x0001, 0x7fff, 0x8000, 0x8001, 0xffff];
    let g: Vec<f32> = (0..=0xffffu32)
        .flat_map(|hi| lows.map(|lo| f32::from_bits(hi << 16 | lo)))
        .collect();
    let n = g.len();
    let out = e
        .launch("sgd", Cfg { grid: 8, block: 64 })
        .arg(Arg::Bf16(vec![0x8000; n]))
        .f32s(&g)
        .f32(-1.0)
        .i32(n)
        .run();
    let mut nans = 0;
    for (i, (&got, &x)) in out.bits(0).iter().zip(&g).enumerate() {
        if x.is_nan() {
            nans += 1;
            assert!(is_bf16_nan(got), "element {i}: {x:e} stored as {got:#06x}");
        } else {
            let want = kernels::bf16_bits(x);
            assert_eq!(got, want, "element {i}: {x:e} ({:#010x})", x.to_bits());
        }
    }
    // Exponent all ones: NaN unless the whole mantissa is zero (the two infinities).
    assert_eq!(
        nans,
        2 * 127 * lows.len() + 2 * (lows.len() - 1),
        "NaN patterns in the sweep"
    );

    // Values that are already bf16 store unchanged (add_bias with a -0.0 bias: y + -0 = y,
    // signed zeros included).
    let bits: Vec<u16> = (0..=u16::MAX).collect();
    let out = e
        .launch("add_bias", Cfg { grid: 4, block: 64 })
        .arg(Arg::Bf16(bits.clone()))
        .arg(Arg::Bf16(vec![0x8000; 256]))
        .i32(256)
        .i32(256)
        .run();
    for (&got, &b) in out.bits(0).iter().zip(&bits) {
        if is_bf16_nan(b) {
            assert!(is_bf16_nan(got), "{b:#06x} stored as {got:#06x}");
        } else {
            assert_eq!(got, b, "{b:#06x} does not survive ld/st");
        }
    }
}

// ---- negative controls: the harness can fail -------------------------------------------------

/// `add_bias_residual` with `x` and `b` swapped (a plausible slip in a launch list) is caught:
/// the bias vector is read as the full input (into the driver's NaN canary zone) and vice versa.
#[test]
fn a_launch_with_swapped_arguments_does_not_match() {
    let Some(e) = emu(Ty::F32) else { return };
    let sh = &SHAPES[0];
    let p = sh.layer(LayerKind::Decoder);
    let x = uniform(sh.seq, sh.hidden, 90, 1.5);
    let (want_y, _, want_a) = model::block_fwd(&p, &x);
    let aw2 = want_a.dot(&p[2]);
    let right = dev_add_bias_residual(e, Grids::Model, &aw2, &x, &p[3]);
    check2(
        &right,
        &want_y,
        Tol::Bits,
        "the launch as model.rs writes it",
    );
    let (s, h) = (sh.seq, sh.hidden);
    let swapped = e
        .launch("add_bias_residual", Cfg::model(s * h))
        .t(&aw2)
        .t(&p[3])
        .t(&x)
        .i32(s)
        .i32(h)
        .run()
        .mat(0, s, h);
    let err = within(&flat(&swapped), &flat(&want_y), F32_TOL);
    assert!(err.is_err(), "swapped x and b still match the CPU model");
}

/// The driver rejects what a GPU would silently misread: an argument of the wrong type or a
/// missing argument, and reports a write past the end of a buffer.
#[test]
fn the_driver_reports_bad_launches() {
    let Some(e) = emu(Ty::F32) else { return };
    let err = e
        .launch("xent_bwd", Cfg::model(6))
        .t(&[0.5; 6])
        .u32s(&[0, 1])
        .t_zeros(6)
        .i32(1) // k must be an f32
        .i32(2)
        .i32(3)
        .try_run()
        .err()
        .expect("an i32 where the kernel takes a float");
    assert!(
        err.contains("argument 3 of xent_bwd: the kernel takes an f32 scalar"),
        "{err}"
    );
    let err = e
        .launch("gelu_bwd", Cfg::model(4))
        .t(&[1.0; 4])
        .i32(4)
        .try_run()
        .err()
        .expect("a missing argument");
    assert!(err.contains("gelu_bwd takes 3 arguments"), "{err}");
    // `col_sums` told there are 5 columns writes 5 sums into a 4-element buffer.
    let err = e
        .launch("col_sums", Cfg::model(5))
        .t(&[1.0; 10])
        .t_zeros(4)
        .i32(2)
        .i32(5)
        .try_run()
        .err()
        .expect("an out-of-bounds write");
    assert!(err.contains("wrote past the end of argument 1"), "{err}");
    let err = e
        .launch("no_such_kernel", Cfg::model(1))
        .try_run()
        .err()
        .expect("an unknown kernel");
    assert!(err.contains("no kernel named `no_such_kernel`"), "{err}");
}
