//! The model of [`pipec_runtime::model`] on one GPU: parameters and activations in device memory,
//! GEMMs through cuBLAS (row-major operands mapped onto column-major `gemm` by
//! [`super::gemm`]), everything else through the NVRTC kernels of [`super::kernels`].
//! The backward is split exactly as on the CPU: [`Dev::stage_bwd_d`] computes input gradients
//! and keeps `dy`/`dh`/`dlogits`; [`Dev::stage_bwd_w`] computes weight gradients only.

use super::{gemm, kernels, nvrtc};
use cudarc::cublas::{sys::cublasOperation_t, CudaBlas, Gemm, GemmConfig};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DeviceRepr, LaunchConfig, PushKernelArg,
    ValidAsZeroBits,
};
use cudarc::nccl::NcclType;
use pipec_runtime::backend::BackendError;
use pipec_runtime::model::{self, ModelConfig, Stage};
use pipec_schedules::layout::LayerKind;
use std::sync::Arc;

/// Turn any CUDA-side error into a backend error naming what was being done.
pub fn err<E: std::fmt::Debug>(what: &str) -> impl FnOnce(E) -> BackendError + '_ {
    move |e| BackendError(format!("CUDA: {what}: {e:?}"))
}

/// An element type of parameters and activations: `f32`, or `bf16` (cuBLAS `GemmEx` with
/// bf16 operands and fp32 accumulation, via cudarc's `Gemm<bf16>`).
pub trait Elem:
    DeviceRepr + ValidAsZeroBits + NcclType + Copy + Default + Send + Sync + Unpin + 'static
{
    const BF16: bool;
    const NAME: &'static str;
    fn from_f32(x: f32) -> Self;
    /// # Safety
    /// `cfg` must describe matrices that fit the slices.
    unsafe fn gemm(
        blas: &CudaBlas,
        cfg: GemmConfig<Self>,
        a: &CudaSlice<Self>,
        b: &CudaSlice<Self>,
        c: &mut CudaSlice<Self>,
    ) -> Result<(), cudarc::cublas::result::CublasError>;
}

impl Elem for f32 {
    const BF16: bool = false;
    const NAME: &'static str = "fp32";
    fn from_f32(x: f32) -> Self {
        x
    }
    unsafe fn gemm(
        blas: &CudaBlas,
        cfg: GemmConfig<f32>,
        a: &CudaSlice<f32>,
        b: &CudaSlice<f32>,
        c: &mut CudaSlice<f32>,
    ) -> Result<(), cudarc::cublas::result::CublasError> {
        blas.gemm(cfg, a, b, c)
    }
}

impl Elem for half::bf16 {
    const BF16: bool = true;
    const NAME: &'static str = "bf16";
    fn from_f32(x: f32) -> Self {
        half::bf16::from_f32(x)
    }
    unsafe fn gemm(
        blas: &CudaBlas,
        cfg: GemmConfig<half::bf16>,
        a: &CudaSlice<half::bf16>,
        b: &CudaSlice<half::bf16>,
        c: &mut CudaSlice<half::bf16>,
    ) -> Result<(), cudarc::cublas::result::CublasError> {
        blas.gemm(cfg, a, b, c)
    }
}

/// The Rust type a launch function takes for a parameter type of `kernels::kernel_table!`.
macro_rules! rust_type {
    (&mut [$e:ident]) => { &mut CudaSlice<$e> };
    (&[$e:ident]) => { &CudaSlice<$e> };
    (i32) => { i32 };
    (f32) => { f32 };
}

/// How a launch function pushes a parameter: buffers as they come, scalars by reference.
macro_rules! kernel_arg {
    ($p:ident, i32) => {
        &$p
    };
    ($p:ident, f32) => {
        &$p
    };
    ($p:ident, $($buffer:tt)+) => {
        $p
    };
}

/// One launch function from a row of `kernels::kernel_table!`, gathering the parameters
/// `p: ty` one at a time (a type's tokens run up to the next comma).
macro_rules! launch_fn {
    (@ $(#[$doc:meta])* $name:ident [$($decl:tt)*] [$($arg:expr),*] [$p:ident : $($ty:tt)+]) => {
        $(#[$doc])*
        ///
        /// # Safety
        ///
        /// The sizes must describe the buffers: the kernel reads and writes as many elements as
        /// they say, unchecked. `cfg` must be a launch configuration the kernel supports.
        // The parameters are the kernel's.
        #[allow(clippy::too_many_arguments)]
        pub unsafe fn $name(
            &self,
            stream: &CudaStream,
            cfg: LaunchConfig,
            $($decl)*
            $p: rust_type!($($ty)+),
        ) -> Result<(), BackendError> {
            let mut b = stream.launch_builder(&self.$name);
            $( b.arg($arg); )*
            b.arg(kernel_arg!($p, $($ty)+));
            // SAFETY: the arguments are the kernel's parameters in its order and C types
            // (`kernels::PROTOTYPES`, checked against the source); the sizes are the caller's.
            unsafe { b.launch(cfg) }.map_err(err(stringify!($name)))?;
            Ok(())
        }
    };
    (@ $(#[$doc:meta])* $name:ident [$($decl:tt)*] [$($arg:expr),*] [$p:ident : $($ty:tt)+] , $($rest:tt)+) => {
        launch_fn!(@ $(#[$doc])* $name [$($decl)* $p: rust_type!($($ty)+),] [$($arg,)* kernel_arg!($p, $($ty)+)] [] $($rest)+);
    };
    (@ $(#[$doc:meta])* $name:ident [$($decl:tt)*] [$($arg:expr),*] [$($cur:tt)*] $t:tt $($rest:tt)*) => {
        launch_fn!(@ $(#[$doc])* $name [$($decl)*] [$($arg),*] [$($cur)* $t] $($rest)*);
    };
}

macro_rules! kernels_struct {
    ($($(#[$doc:meta])* $name:ident ($($params:tt)+);)+) => {
        /// The compiled kernels of one element type `T`, with one typed launch function per
        /// kernel, generated from `kernels::kernel_table!`: `k.add_bias(&stream, cfg, &mut y,
        /// &b, rows, cols)`.
        pub struct Kernels<T> {
            $($name: CudaFunction,)+
            _t: std::marker::PhantomData<T>,
        }

        impl<T: Elem> Kernels<T> {
            /// Compile [`kernels::source`] with NVRTC for this GPU ([`nvrtc::choose_target`]: a
            /// CUBIN when NVRTC knows its architecture) and load it into `ctx`.
            pub fn compile(ctx: &Arc<CudaContext>) -> Result<Kernels<T>, BackendError> {
                let (major, minor) = ctx
                    .compute_capability()
                    .map_err(err("read the compute capability"))?;
                let (_, archs) = nvrtc::info().map_err(|e| BackendError(format!("NVRTC: {e}")))?;
                let target = nvrtc::choose_target((10 * major + minor).max(0) as u32, &archs)
                    .map_err(|e| BackendError(format!("NVRTC: {e}")))?;
                let name = if T::BF16 {
                    "pipec_bf16.cu"
                } else {
                    "pipec_f32.cu"
                };
                let image = nvrtc::compile(&kernels::source(T::BF16), name, target)
                    .map_err(BackendError)?;
                let module = ctx
                    .load_module(image.into_module_source())
                    .map_err(err(&format!("load the kernel module ({target})")))?;
                Ok(Kernels {
                    $($name: module
                        .load_function(stringify!($name))
                        .map_err(err(stringify!($name)))?,)+
                    _t: std::marker::PhantomData,
                })
            }

            $(launch_fn!(@ $(#[$doc])* $name [] [] [] $($params)+);)+
        }
    };
}
kernels::kernel_table!(kernels_struct);

/// A tensor that travels between stages (the GPU twin of [`model::Tensor`]).
pub enum GTensor<T> {
    Tokens(CudaSlice<u32>),
    Hidden(CudaSlice<T>),
    /// The microbatch's mean loss, one float.
    Loss(CudaSlice<f32>),
    LossGrad,
    TokenGrad,
}

impl<T> GTensor<T> {
    pub fn what(&self) -> &'static str {
        match self {
            GTensor::Tokens(_) => "token ids",
            GTensor::Hidden(_) => "a hidden tensor",
            GTensor::Loss(_) => "a loss",
            GTensor::LossGrad => "the loss gradient",
            GTensor::TokenGrad => "the token-id gradient",
        }
    }
}

pub enum GStash<T> {
    /// The token ids, and the step and microbatch they are `model::tokens` of: the weight
    /// gradient builds its [`kernels::EmbedPlan`] from those on the host (a forward-only run
    /// never needs it).
    Embedding {
        tokens: CudaSlice<u32>,
        step: u32,
        mb: u32,
    },
    /// `h` (the GeLU input) only until the input gradient ran ([`GStash::keep_for_w`]).
    Block {
        x: CudaSlice<T>,
        h: Option<CudaSlice<T>>,
        a: CudaSlice<T>,
    },
    /// `probs` and `targets` only until the input gradient ran.
    Head {
        x: CudaSlice<T>,
        probs: Option<CudaSlice<T>>,
        targets: Option<CudaSlice<u32>>,
    },
}

impl<T> GStash<T> {
    /// Free what only the input gradient reads, once it ran: the block's GeLU input `h` and
    /// the head's probabilities and targets. What stays is what [`Dev::stage_bwd_w`] reads
    /// (the block's `x` and `a`, the head's `x`, the embedding's token ids): the CPU model's
    /// `LayerStash::keep_for_w`, the split of Korthikanti et al. 2022 that the cost model's
    /// `act_w` counts.
    pub fn keep_for_w(&mut self) {
        match self {
            GStash::Embedding { .. } => {}
            GStash::Block { h, .. } => *h = None,
            GStash::Head { probs, targets, .. } => {
                *probs = None;
                *targets = None;
            }
        }
    }
}

pub enum GPartial<T> {
    Embedding { dy: CudaSlice<T> },
    Block { dy: CudaSlice<T>, dh: CudaSlice<T> },
    Head { dlogits: CudaSlice<T> },
}

pub struct GLayer<T> {
    pub kind: LayerKind,
    pub tensors: Vec<CudaSlice<T>>,
    pub shapes: Vec<(usize, usize)>,
}

pub struct GStage<T> {
    pub index: u32,
    pub layers: Vec<GLayer<T>>,
}

/// Per-layer weight gradients of one stage.
pub type GGrads<T> = Vec<Vec<CudaSlice<T>>>;

/// A stage's gradient sums (fp32 whatever the element type).
pub type GSums = GGrads<f32>;

/// A replica's gradients of one stage, by microbatch.
pub type ByMicrobatch<T> = Vec<(u32, GGrads<T>)>;

/// One stream with its cuBLAS handle: a backend has two (the second runs the forward of an
/// overlapped pair) and a communication stream.
pub struct Dev<T> {
    pub stream: Arc<CudaStream>,
    pub blas: CudaBlas,
    pub k: Arc<Kernels<T>>,
    pub cfg: ModelConfig,
    _t: std::marker::PhantomData<T>,
}

fn grid(n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(256).clamp(1, 4096) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn i32of(n: usize, what: &str) -> Result<i32, BackendError> {
    i32::try_from(n)
        .map_err(|_| BackendError(format!("{what} = {n} exceeds the kernels' i32 range")))
}

impl<T: Elem> Dev<T> {
    pub fn new(
        stream: Arc<CudaStream>,
        k: Arc<Kernels<T>>,
        cfg: ModelConfig,
    ) -> Result<Self, BackendError> {
        let blas = CudaBlas::new(stream.clone()).map_err(err("create a cuBLAS handle"))?;
        Ok(Dev {
            stream,
            blas,
            k,
            cfg,
            _t: std::marker::PhantomData,
        })
    }

    pub fn zeros<U: DeviceRepr + ValidAsZeroBits>(
        &self,
        n: usize,
    ) -> Result<CudaSlice<U>, BackendError> {
        self.stream
            .alloc_zeros::<U>(n.max(1))
            .map_err(err("allocate"))
    }

    /// Give this handle a workspace of its own (`cublasSetWorkspace`), so that cuBLAS allocates
    /// nothing while a step is captured (cuBLAS docs, "CUDA Graphs Support"). The caller keeps
    /// the buffer as long as the handle.
    pub fn own_cublas_workspace(&self) -> Result<CudaSlice<u8>, BackendError> {
        use cudarc::driver::DevicePtr;
        let n = CUBLAS_WORKSPACE;
        let ws = self.stream.alloc_zeros::<u8>(n).map_err(err("allocate"))?;
        {
            let (ptr, _guard) = ws.device_ptr(&self.stream);
            // SAFETY: `ptr` is `n` bytes on this handle's device, alive as long as the caller
            // keeps `ws` (at least as long as the handle).
            unsafe {
                cudarc::cublas::sys::cublasSetWorkspace_v2(
                    *self.blas.handle(),
                    ptr as *mut std::ffi::c_void,
                    n,
                )
            }
            .result()
            .map_err(|e| BackendError(format!("cuBLAS: set a workspace: {e:?}")))?;
        }
        Ok(ws)
    }

    pub fn upload_u32(&self, v: &[u32]) -> Result<CudaSlice<u32>, BackendError> {
        self.stream.clone_htod(v).map_err(err("copy to the device"))
    }

    /// Upload a CPU stage (the same initial weights as the CPU backend), converted to `T`.
    pub fn upload_stage(&self, st: &Stage<f32>) -> Result<GStage<T>, BackendError> {
        let mut layers = Vec::with_capacity(st.layers.len());
        for l in &st.layers {
            let mut tensors = Vec::new();
            let mut shapes = Vec::new();
            for t in &l.tensors {
                let host: Vec<T> = t.iter().map(|&x| T::from_f32(x)).collect();
                tensors.push(
                    self.stream
                        .clone_htod(&host)
                        .map_err(err("upload weights"))?,
                );
                shapes.push(t.dim());
            }
            layers.push(GLayer {
                kind: l.kind,
                tensors,
                shapes,
            });
        }
        Ok(GStage {
            index: st.index,
            layers,
        })
    }

    /// Row-major `c[m, n] = op(a)[m, k] · op(b)[k, n]` (`ta`/`tb`: the operand is stored
    /// transposed), as one column-major cuBLAS call planned by [`gemm::row_major`].
    #[allow(clippy::too_many_arguments)]
    fn mm(
        &self,
        a: &CudaSlice<T>,
        ta: bool,
        b: &CudaSlice<T>,
        tb: bool,
        m: usize,
        n: usize,
        k: usize,
    ) -> Result<CudaSlice<T>, BackendError> {
        let mut c = self.zeros::<T>(m * n)?;
        let plan = gemm::row_major(ta, tb, m, n, k);
        let op = |o: gemm::Op| match o {
            gemm::Op::N => cublasOperation_t::CUBLAS_OP_N,
            gemm::Op::T => cublasOperation_t::CUBLAS_OP_T,
        };
        let cfg = GemmConfig {
            transa: op(plan.transa),
            transb: op(plan.transb),
            m: i32of(plan.m, "gemm m")?,
            n: i32of(plan.n, "gemm n")?,
            k: i32of(plan.k, "gemm k")?,
            alpha: T::from_f32(1.0),
            lda: i32of(plan.lda, "gemm lda")?,
            ldb: i32of(plan.ldb, "gemm ldb")?,
            beta: T::from_f32(0.0),
            ldc: i32of(plan.ldc, "gemm ldc")?,
        };
        // The BLAS `A` argument is the row-major right operand (see `gemm`).
        unsafe { T::gemm(&self.blas, cfg, b, a, &mut c) }.map_err(err("cuBLAS gemm"))?;
        Ok(c)
    }

    fn col_sums(
        &self,
        a: &CudaSlice<T>,
        rows: usize,
        cols: usize,
    ) -> Result<CudaSlice<T>, BackendError> {
        let mut out = self.zeros::<T>(cols)?;
        let (r, c) = (i32of(rows, "rows")?, i32of(cols, "cols")?);
        // SAFETY: `a` holds `rows * cols` elements, `out` `cols`.
        unsafe { self.k.col_sums(&self.stream, grid(cols), a, &mut out, r, c) }?;
        Ok(out)
    }

    fn bad(
        stage: u32,
        layer: usize,
        kind: LayerKind,
        expected: &str,
        got: &'static str,
    ) -> BackendError {
        BackendError(format!(
            "layer {layer} ({}) of stage {stage} expects {expected} but got {got}",
            kind.symbol()
        ))
    }

    /// Forward of one stage; when it holds `L` the output is the microbatch's mean loss.
    ///
    /// `staged`: while a step is captured (`--cuda-graph`), the targets come from the fixed
    /// buffers refilled before each launch, not from an upload of this step's values.
    pub fn stage_fwd(
        &self,
        stage: &GStage<T>,
        input: GTensor<T>,
        step: u32,
        mb: u32,
        staged: Option<&Staged>,
    ) -> Result<(GTensor<T>, Vec<GStash<T>>), BackendError> {
        let (s, h, f, v) = (self.cfg.seq, self.cfg.hidden, self.cfg.ffn, self.cfg.vocab);
        let (si, hi, vi) = (i32of(s, "seq")?, i32of(h, "hidden")?, i32of(v, "vocab")?);
        let fi = i32of(f, "ffn")?;
        let mut x = input;
        let mut stash = Vec::with_capacity(stage.layers.len());
        for (i, l) in stage.layers.iter().enumerate() {
            let p = &l.tensors;
            x = match (l.kind, x) {
                (LayerKind::Embedding, GTensor::Tokens(tok)) => {
                    let mut out = self.zeros::<T>(s * h)?;
                    // SAFETY: `tok` holds `s` ids below `vocab`, `out` `s * h` elements.
                    unsafe {
                        self.k
                            .embed_fwd(&self.stream, grid(s * h), &p[0], &tok, &mut out, si, hi)
                    }?;
                    stash.push(GStash::Embedding {
                        tokens: tok,
                        step,
                        mb,
                    });
                    GTensor::Hidden(out)
                }
                (LayerKind::Decoder | LayerKind::Mtp, GTensor::Hidden(xin)) => {
                    let mut hh = self.mm(&xin, false, &p[0], false, s, f, h)?;
                    let mut a = self.zeros::<T>(s * f)?;
                    // SAFETY: `hh` and `a` hold `s * f` elements, `p[1]` `f`.
                    unsafe {
                        self.k.bias_gelu_fwd(
                            &self.stream,
                            grid(s * f),
                            &mut hh,
                            &mut a,
                            &p[1],
                            si,
                            fi,
                        )
                    }?;
                    let mut y = self.mm(&a, false, &p[2], false, s, h, f)?;
                    // SAFETY: `y` and `xin` hold `s * h` elements, `p[3]` `h`.
                    unsafe {
                        self.k.add_bias_residual(
                            &self.stream,
                            grid(s * h),
                            &mut y,
                            &xin,
                            &p[3],
                            si,
                            hi,
                        )
                    }?;
                    stash.push(GStash::Block {
                        x: xin,
                        h: Some(hh),
                        a,
                    });
                    GTensor::Hidden(y)
                }
                (LayerKind::Loss, GTensor::Hidden(xin)) => {
                    let mut z = self.mm(&xin, false, &p[0], false, s, v, h)?;
                    // SAFETY: `z` holds `s * v` elements, `p[1]` `v`.
                    unsafe {
                        self.k
                            .add_bias(&self.stream, grid(s * v), &mut z, &p[1], si, vi)
                    }?;
                    let targets = match staged {
                        Some(st) => self
                            .stream
                            .clone_dtod(&st.targets[mb as usize])
                            .map_err(err("copy the targets"))?,
                        None => self.upload_u32(&model::targets(&self.cfg, step, mb))?,
                    };
                    let mut row_loss = self.zeros::<f32>(s)?;
                    let threads = v.next_power_of_two().clamp(32, 1024) as u32;
                    let rows = LaunchConfig {
                        grid_dim: (s as u32, 1, 1),
                        block_dim: (threads, 1, 1),
                        shared_mem_bytes: 0,
                    };
                    // SAFETY: one block of a power of two, at most 1024, threads per row; `z`
                    // holds `s * v` elements, `targets` and `row_loss` `s`.
                    unsafe {
                        self.k.softmax_xent_fwd(
                            &self.stream,
                            rows,
                            &mut z,
                            &targets,
                            &mut row_loss,
                            si,
                            vi,
                        )
                    }?;
                    let mut loss = self.zeros::<f32>(1)?;
                    // SAFETY: `row_loss` holds `s` elements, `loss` one.
                    unsafe {
                        self.k
                            .loss_mean(&self.stream, grid(1), &row_loss, &mut loss, si)
                    }?;
                    stash.push(GStash::Head {
                        x: xin,
                        probs: Some(z),
                        targets: Some(targets),
                    });
                    GTensor::Loss(loss)
                }
                (LayerKind::Embedding, other) => {
                    return Err(Self::bad(stage.index, i, l.kind, "token ids", other.what()))
                }
                (_, other) => {
                    return Err(Self::bad(
                        stage.index,
                        i,
                        l.kind,
                        "a hidden tensor",
                        other.what(),
                    ))
                }
            };
        }
        Ok((x, stash))
    }

    /// Input-gradient pass (`bwd_D`). `loss_scale` is `1/M`.
    pub fn stage_bwd_d(
        &self,
        stage: &GStage<T>,
        stash: &[GStash<T>],
        grad: GTensor<T>,
        microbatches: u32,
    ) -> Result<(GTensor<T>, Vec<GPartial<T>>), BackendError> {
        let (s, h, f, v) = (self.cfg.seq, self.cfg.hidden, self.cfg.ffn, self.cfg.vocab);
        let (si, vi) = (i32of(s, "seq")?, i32of(v, "vocab")?);
        if stash.len() != stage.layers.len() {
            return Err(BackendError(format!(
                "stage {}: stash holds {} layers, the stage has {}",
                stage.index,
                stash.len(),
                stage.layers.len()
            )));
        }
        let mut g = grad;
        let mut partial = Vec::with_capacity(stash.len());
        for (i, (l, st)) in stage.layers.iter().zip(stash).enumerate().rev() {
            let p = &l.tensors;
            g = match (st, g) {
                (
                    GStash::Head {
                        probs: Some(probs),
                        targets: Some(targets),
                        ..
                    },
                    GTensor::LossGrad,
                ) => {
                    // The CPU's `scale / rows` with `scale = 1 / M`, in f32.
                    let k = (1.0f32 / microbatches as f32) / s as f32;
                    let mut dl = self.zeros::<T>(s * v)?;
                    // SAFETY: `probs` and `dl` hold `s * v` elements, `targets` `s`.
                    unsafe {
                        self.k.xent_bwd(
                            &self.stream,
                            grid(s * v),
                            probs,
                            targets,
                            &mut dl,
                            k,
                            si,
                            vi,
                        )
                    }?;
                    let dx = self.mm(&dl, false, &p[0], true, s, h, v)?;
                    partial.push(GPartial::Head { dlogits: dl });
                    GTensor::Hidden(dx)
                }
                (GStash::Block { h: Some(hh), .. }, GTensor::Hidden(dy)) => {
                    let mut dh = self.mm(&dy, false, &p[2], true, s, f, h)?;
                    let n = i32of(s * f, "seq*ffn")?;
                    // SAFETY: `dh` and `hh` hold `s * f` elements.
                    unsafe { self.k.gelu_bwd(&self.stream, grid(s * f), &mut dh, hh, n) }?;
                    let mut dx = self.mm(&dh, false, &p[0], true, s, h, f)?;
                    let n = i32of(s * h, "seq*hidden")?;
                    // SAFETY: `dx` and `dy` hold `s * h` elements.
                    unsafe { self.k.add_into(&self.stream, grid(s * h), &mut dx, &dy, n) }?;
                    partial.push(GPartial::Block { dy, dh });
                    GTensor::Hidden(dx)
                }
                (GStash::Embedding { .. }, GTensor::Hidden(dy)) => {
                    partial.push(GPartial::Embedding { dy });
                    GTensor::TokenGrad
                }
                (GStash::Block { h: None, .. }, _)
                | (GStash::Head { probs: None, .. } | GStash::Head { targets: None, .. }, _) => {
                    return Err(BackendError(format!(
                        "stage {}, layer {i}: the stash was cut for the weight gradient before \
                         its input gradient ran",
                        stage.index
                    )))
                }
                (GStash::Head { .. }, other) => {
                    return Err(Self::bad(
                        stage.index,
                        i,
                        l.kind,
                        "the loss gradient",
                        other.what(),
                    ))
                }
                (_, other) => {
                    return Err(Self::bad(
                        stage.index,
                        i,
                        l.kind,
                        "a hidden gradient",
                        other.what(),
                    ))
                }
            };
        }
        partial.reverse();
        Ok((g, partial))
    }

    /// Weight-gradient pass (`bwd_W`).
    ///
    /// `staged`: while a step is captured, the embedding gradient reads the padded grouping
    /// of the fixed buffers (the same launch every step), not one uploaded for this step.
    pub fn stage_bwd_w(
        &self,
        stage: &GStage<T>,
        stash: &[GStash<T>],
        partial: &[GPartial<T>],
        staged: Option<&Staged>,
    ) -> Result<GGrads<T>, BackendError> {
        let (s, h, f, v) = (self.cfg.seq, self.cfg.hidden, self.cfg.ffn, self.cfg.vocab);
        let hi = i32of(h, "hidden")?;
        if partial.len() != stage.layers.len() || stash.len() != stage.layers.len() {
            return Err(BackendError(format!(
                "stage {}: partial gradients are missing layers",
                stage.index
            )));
        }
        let mut grads = Vec::with_capacity(stage.layers.len());
        for (st, pa) in stash.iter().zip(partial) {
            grads.push(match (st, pa) {
                (GStash::Embedding { tokens, step, mb }, GPartial::Embedding { dy }) => {
                    let uploaded;
                    let (order, starts, segs) = match staged {
                        Some(st) => (&st.order[*mb as usize], &st.starts[*mb as usize], s),
                        None => {
                            let plan =
                                kernels::EmbedPlan::new(&model::tokens(&self.cfg, *step, *mb));
                            uploaded = (
                                self.upload_u32(&plan.order)?,
                                self.upload_u32(&plan.starts)?,
                            );
                            (&uploaded.0, &uploaded.1, plan.segs())
                        }
                    };
                    let mut g = self.zeros::<T>(v * h)?;
                    let segi = i32of(segs, "distinct tokens")?;
                    // SAFETY: `g` holds `v * h` elements and `dy` `s * h`; `order`, `starts`
                    // are `tokens`' plan (`segs` runs over its `s` positions).
                    unsafe {
                        self.k.embed_bwd(
                            &self.stream,
                            grid(segs * h),
                            &mut g,
                            tokens,
                            order,
                            starts,
                            dy,
                            segi,
                            hi,
                        )
                    }?;
                    vec![g]
                }
                (GStash::Block { x, a, .. }, GPartial::Block { dy, dh }) => vec![
                    self.mm(x, true, dh, false, h, f, s)?,
                    self.col_sums(dh, s, f)?,
                    self.mm(a, true, dy, false, f, h, s)?,
                    self.col_sums(dy, s, h)?,
                ],
                (GStash::Head { x, .. }, GPartial::Head { dlogits }) => vec![
                    self.mm(x, true, dlogits, false, h, v, s)?,
                    self.col_sums(dlogits, s, v)?,
                ],
                _ => {
                    return Err(BackendError(format!(
                        "stage {}: stash and partial gradients disagree on the layer kinds",
                        stage.index
                    )))
                }
            });
        }
        Ok(grads)
    }

    /// `sum += g` for every tensor (the step's sums are f32 on the device).
    pub fn accumulate(
        &self,
        sum: &mut [Vec<CudaSlice<f32>>],
        g: &GGrads<T>,
    ) -> Result<(), BackendError> {
        for (sl, gl) in sum.iter_mut().zip(g) {
            for (s, g) in sl.iter_mut().zip(gl) {
                let n = i32of(g.len(), "gradient size")?;
                let len = g.len();
                // SAFETY: `s` and `g` are the same tensor's, of `len` elements.
                unsafe { self.k.accum(&self.stream, grid(len), s, g, n) }?;
            }
        }
        Ok(())
    }

    /// `w -= lr · g`.
    pub fn sgd(
        &self,
        stage: &mut GStage<T>,
        sum: &[Vec<CudaSlice<f32>>],
        lr: f32,
    ) -> Result<(), BackendError> {
        for (l, gl) in stage.layers.iter_mut().zip(sum) {
            for (w, g) in l.tensors.iter_mut().zip(gl) {
                let n = i32of(w.len(), "weight size")?;
                let len = w.len();
                // SAFETY: `w` and `g` are the same tensor's, of `len` elements.
                unsafe { self.k.sgd(&self.stream, grid(len), w, g, lr, n) }?;
            }
        }
        Ok(())
    }
}

/// cuBLAS's recommended workspace on Hopper (cuBLAS docs, `cublasSetWorkspace`).
pub const CUBLAS_WORKSPACE: usize = 32 << 20;

/// The inputs a captured step reads that change from step to step, per microbatch, in buffers
/// allocated before capture; [`Staged::fill`] writes a step's values before its launch.
pub struct Staged {
    pub tokens: Vec<CudaSlice<u32>>,
    pub targets: Vec<CudaSlice<u32>>,
    /// `kernels::EmbedPlan::padded(tokens, seq)`: `order` has `seq` entries, `starts` `seq + 1`.
    pub order: Vec<CudaSlice<u32>>,
    pub starts: Vec<CudaSlice<u32>>,
}

impl Staged {
    pub fn new(
        stream: &Arc<CudaStream>,
        microbatches: u32,
        seq: usize,
    ) -> Result<Self, BackendError> {
        let bufs = |n: usize| -> Result<Vec<CudaSlice<u32>>, BackendError> {
            (0..microbatches)
                .map(|_| stream.alloc_zeros::<u32>(n.max(1)).map_err(err("allocate")))
                .collect()
        };
        Ok(Staged {
            tokens: bufs(seq)?,
            targets: bufs(seq)?,
            order: bufs(seq)?,
            starts: bufs(seq + 1)?,
        })
    }

    /// Step `step`'s values (`model::tokens`, `model::targets`, the padded plan) on `stream`.
    pub fn fill(
        &mut self,
        stream: &Arc<CudaStream>,
        cfg: &ModelConfig,
        step: u32,
    ) -> Result<(), BackendError> {
        let up = || err("copy inputs to the device");
        for mb in 0..self.tokens.len() {
            let tokens = model::tokens(cfg, step, mb as u32);
            let plan = crate::kernels::EmbedPlan::padded(&tokens, cfg.seq);
            stream
                .memcpy_htod(&tokens, &mut self.tokens[mb])
                .map_err(up())?;
            stream
                .memcpy_htod(&model::targets(cfg, step, mb as u32), &mut self.targets[mb])
                .map_err(up())?;
            stream
                .memcpy_htod(&plan.order, &mut self.order[mb])
                .map_err(up())?;
            stream
                .memcpy_htod(&plan.starts, &mut self.starts[mb])
                .map_err(up())?;
        }
        Ok(())
    }
}
