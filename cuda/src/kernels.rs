//! The CUDA C source of the backend's elementwise and reduction kernels, compiled at run time by
//! NVRTC, once per element type: `float`, and bf16 stored as `unsigned short` (the upper half of
//! an IEEE `float`, round-to-nearest-even on store, as `__float2bfloat16_rn` does). Writing bf16
//! by hand keeps the source free of `#include`s, so NVRTC needs no header path. Arithmetic is in
//! `float` for both types.
//!
//! The math is [`pipec_runtime::model`]'s: tanh-form GELU (Hendrycks & Gimpel, 2016), residual MLP
//! block, embedding gather and scatter-add, softmax cross-entropy. Reductions whose order is
//! visible in the result (bias gradients, the embedding scatter-add, the mean loss) run one
//! thread per output element over rows in order, so they are deterministic and add in the same
//! order as the CPU backend. The GEMMs are cuBLAS's.

/// The kernels, declared once: each row is a kernel of [`SOURCE`], in the order it defines
/// them, with its parameters in Rust types. `c_type!` maps each type to its C type; from the
/// rows come [`NAMES`], [`PROTOTYPES`] (checked against [`SOURCE`] by the unit tests) and, with
/// the `cuda` feature, one typed launch function per kernel on `model::Kernels`.
///
/// Parameter types: `&mut [E]` a buffer the kernel writes (`E*`), `&[E]` one it only reads
/// (`const E*`), for `E` the element type `T`, `f32` or `u32`; `i32` (`int`) and `f32` (`float`)
/// scalars.
macro_rules! kernel_table {
    ($then:ident) => {
        $then! {
            /// `h = h + b` (in place, `h` holds `x W1`), `a = gelu(h)`. `h`, `a`: `[rows, cols]`;
            /// `b`: `[cols]`.
            bias_gelu_fwd(h: &mut [T], a: &mut [T], b: &[T], rows: i32, cols: i32);
            /// `y = y + b`.
            add_bias(y: &mut [T], b: &[T], rows: i32, cols: i32);
            /// `y = x + (y + b)`: `y` holds `a W2` on entry.
            add_bias_residual(y: &mut [T], x: &[T], b: &[T], rows: i32, cols: i32);
            /// `dh = dh * gelu'(h)`.
            gelu_bwd(dh: &mut [T], h: &[T], n: i32);
            /// `dx = dy + dx` (`dx` holds `dh W1^T` on entry).
            add_into(dx: &mut [T], dy: &[T], n: i32);
            /// `out[c]` = the sum over rows, in order, of `a[r, c]`.
            col_sums(a: &[T], out: &mut [T], rows: i32, cols: i32);
            /// `out[i, :] = table[tok[i], :]`.
            embed_fwd(table: &[T], tok: &[u32], out: &mut [T], seq: i32, hidden: i32);
            /// The embedding weight gradient into the zeroed `g`, over an [`crate::kernels::EmbedPlan`]
            /// (`order`, `starts`, `segs` distinct tokens).
            embed_bwd(g: &mut [T], tok: &[u32], order: &[u32], starts: &[u32], dy: &[T], segs: i32, hidden: i32);
            /// One block per row (a power of two, at most 1024 threads): logits `z` in, softmax
            /// probabilities out, and each row's loss.
            softmax_xent_fwd(z: &mut [T], tgt: &[u32], row_loss: &mut [f32], rows: i32, vocab: i32);
            /// `out[0]` = the mean of `row_loss`, added in row order. One thread.
            loss_mean(row_loss: &[f32], out: &mut [f32], rows: i32);
            /// `dl = (probs - onehot(tgt)) * k`.
            xent_bwd(probs: &[T], tgt: &[u32], dl: &mut [T], k: f32, rows: i32, vocab: i32);
            /// `sum += g` (the step's gradient sum is kept in f32).
            accum(sum: &mut [f32], g: &[T], n: i32);
            /// `w -= lr * g`.
            sgd(w: &mut [T], g: &[f32], lr: f32, n: i32);
            /// `y = f32(x)`, for reading results back.
            to_f32(x: &[T], y: &mut [f32], n: i32);
        }
    };
}
#[cfg(feature = "cuda")]
pub(crate) use kernel_table;

/// The C type of a parameter type of `kernel_table!`.
macro_rules! c_type {
    (&mut [T]) => {
        "T*"
    };
    (&[T]) => {
        "const T*"
    };
    (&mut [f32]) => {
        "float*"
    };
    (&[f32]) => {
        "const float*"
    };
    (&mut [u32]) => {
        "unsigned int*"
    };
    (&[u32]) => {
        "const unsigned int*"
    };
    (i32) => {
        "int"
    };
    (f32) => {
        "float"
    };
}

/// A row's parameter list `p: ty, ...` as C text (`"T* y, const T* b, int rows"`), one
/// parameter at a time: the tokens of a type are gathered up to the next comma.
macro_rules! c_params {
    (@ [$($out:expr),*] [$p:ident : $($ty:tt)+]) => {
        concat!($($out,)* c_type!($($ty)+), " ", stringify!($p))
    };
    (@ [$($out:expr),*] [$p:ident : $($ty:tt)+] , $($rest:tt)+) => {
        c_params!(@ [$($out,)* c_type!($($ty)+), " ", stringify!($p), ", "] [] $($rest)+)
    };
    (@ [$($out:expr),*] [$($cur:tt)*] $t:tt $($rest:tt)*) => {
        c_params!(@ [$($out),*] [$($cur)* $t] $($rest)*)
    };
    ($($t:tt)+) => {
        c_params!(@ [] [] $($t)+)
    };
}

macro_rules! names_and_prototypes {
    ($($(#[$doc:meta])* $name:ident ($($params:tt)+);)+) => {
        /// Kernel names, in the order [`SOURCE`] defines them.
        pub const NAMES: [&str; [$(stringify!($name)),+].len()] = [$(stringify!($name)),+];

        /// Each kernel's C prototype as [`SOURCE`] writes it, generated from its row of
        /// `kernel_table!`; `PROTOTYPES[i]` is `NAMES[i]`'s.
        pub const PROTOTYPES: [&str; NAMES.len()] = [$(
            concat!("extern \"C\" __global__ void ", stringify!($name), "(", c_params!($($params)+), ")")
        ),+];
    };
}
kernel_table!(names_and_prototypes);

/// Defines selecting the element type: prepend to [`SOURCE`].
pub fn prelude(bf16: bool) -> &'static str {
    if bf16 {
        "#define PIPEC_BF16 1\n"
    } else {
        ""
    }
}

/// The whole source for one element type.
pub fn source(bf16: bool) -> String {
    format!("{}{}", prelude(bf16), SOURCE)
}

pub const SOURCE: &str = r#"
#ifdef PIPEC_BF16
typedef unsigned short T;
__device__ __forceinline__ float ld(T x) { return __uint_as_float(((unsigned int)x) << 16); }
__device__ __forceinline__ T st(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (T)((u >> 16) | 0x40u); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (T)(u >> 16);
}
#else
typedef float T;
__device__ __forceinline__ float ld(T x) { return x; }
__device__ __forceinline__ T st(float f) { return f; }
#endif

#define GELU_C 0.7978845608028654f
#define GELU_K 0.044715f
/* 3 * GELU_K rounded once from the exact product, as the CPU model's `c(3.0 * GELU_K)` is;
   `3.0f * GELU_K` in float rounds twice and is 1 ulp lower. */
#define GELU_3K 0.134145f
#define GRID_STRIDE(i, n) for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (long long)blockDim.x * gridDim.x)

__device__ __forceinline__ float gelu(float x) {
    float t = tanhf(GELU_C * (x + GELU_K * x * x * x));
    return 0.5f * x * (1.0f + t);
}

__device__ __forceinline__ float gelu_grad(float x) {
    float t = tanhf(GELU_C * (x + GELU_K * x * x * x));
    float dinner = GELU_C * (1.0f + GELU_3K * x * x);
    return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * dinner;
}

/* h = h + b (in place, h holds x W1), a = gelu(h). h, a: [rows, cols]; b: [cols]. */
extern "C" __global__ void bias_gelu_fwd(T* h, T* a, const T* b, int rows, int cols) {
    GRID_STRIDE(i, (long long)rows * cols) {
        float v = ld(h[i]) + ld(b[i % cols]);
        h[i] = st(v);
        a[i] = st(gelu(v));
    }
}

/* y = y + b. */
extern "C" __global__ void add_bias(T* y, const T* b, int rows, int cols) {
    GRID_STRIDE(i, (long long)rows * cols) { y[i] = st(ld(y[i]) + ld(b[i % cols])); }
}

/* y = x + (y + b): y holds a W2 on entry; the CPU adds (x + aW2) + b. */
extern "C" __global__ void add_bias_residual(T* y, const T* x, const T* b, int rows, int cols) {
    GRID_STRIDE(i, (long long)rows * cols) { y[i] = st((ld(x[i]) + ld(y[i])) + ld(b[i % cols])); }
}

/* dh = dh * gelu'(h). */
extern "C" __global__ void gelu_bwd(T* dh, const T* h, int n) {
    GRID_STRIDE(i, n) { dh[i] = st(ld(dh[i]) * gelu_grad(ld(h[i]))); }
}

/* dx = dy + dx (dx holds dh W1^T on entry). */
extern "C" __global__ void add_into(T* dx, const T* dy, int n) {
    GRID_STRIDE(i, n) { dx[i] = st(ld(dy[i]) + ld(dx[i])); }
}

/* out[c] = sum over rows r, in order, of a[r, c]. */
extern "C" __global__ void col_sums(const T* a, T* out, int rows, int cols) {
    GRID_STRIDE(c, cols) {
        float s = 0.0f;
        for (int r = 0; r < rows; r++) s += ld(a[(long long)r * cols + c]);
        out[c] = st(s);
    }
}

/* out[i, :] = table[tok[i], :]. */
extern "C" __global__ void embed_fwd(const T* table, const unsigned int* tok, T* out, int seq, int hidden) {
    GRID_STRIDE(i, (long long)seq * hidden) {
        long long r = i / hidden, c = i % hidden;
        out[i] = table[(long long)tok[r] * hidden + c];
    }
}

/* Embedding weight gradient. g (zeroed, [vocab, hidden]): row tok[p] is the sum of the dy
   rows at that token's positions p, added in position order in float and stored once (the
   CPU's order; one rounding in bf16). One thread per (distinct token, column): `order` holds
   the positions sorted by (token, position), the k-th distinct token's are
   order[starts[k] .. starts[k+1]], `segs` tokens in all (see `embed_plan`). */
extern "C" __global__ void embed_bwd(T* g, const unsigned int* tok, const unsigned int* order, const unsigned int* starts, const T* dy, int segs, int hidden) {
    GRID_STRIDE(i, (long long)segs * hidden) {
        long long k = i / hidden, c = i % hidden;
        if (starts[k] == starts[k + 1]) continue; /* a padded plan's empty run */
        float s = 0.0f;
        for (unsigned int j = starts[k]; j < starts[k + 1]; j++) s += ld(dy[(long long)order[j] * hidden + c]);
        g[(long long)tok[order[starts[k]]] * hidden + c] = st(s);
    }
}

/* One block (blockDim.x a power of two, at most 1024) per row: z = logits in, softmax
   probabilities out; row_loss[r] = log(sum exp(z - max)) - (z[target] - max). */
extern "C" __global__ void softmax_xent_fwd(T* z, const unsigned int* tgt, float* row_loss, int rows, int vocab) {
    __shared__ float red[1024];
    int r = blockIdx.x;
    if (r >= rows) return;
    T* row = z + (long long)r * vocab;
    int tid = threadIdx.x;
    float m = __int_as_float(0xff800000); /* -inf */
    for (int c = tid; c < vocab; c += blockDim.x) m = fmaxf(m, ld(row[c]));
    red[tid] = m;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (tid < s) red[tid] = fmaxf(red[tid], red[tid + s]);
        __syncthreads();
    }
    m = red[0];
    float zy = ld(row[tgt[r]]) - m;
    __syncthreads(); /* everyone has read the max from red[0] before red is reused */
    float sum = 0.0f;
    for (int c = tid; c < vocab; c += blockDim.x) sum += expf(ld(row[c]) - m);
    red[tid] = sum;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (tid < s) red[tid] += red[tid + s];
        __syncthreads();
    }
    sum = red[0];
    for (int c = tid; c < vocab; c += blockDim.x) row[c] = st(expf(ld(row[c]) - m) / sum);
    if (tid == 0) row_loss[r] = logf(sum) - zy;
}

/* out[0] = (sum of row_loss in row order) / rows. One thread. */
extern "C" __global__ void loss_mean(const float* row_loss, float* out, int rows) {
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        float s = 0.0f;
        for (int r = 0; r < rows; r++) s += row_loss[r];
        out[0] = s / (float)rows;
    }
}

/* dlogits = (probs - onehot(target)) * k, k = loss scale / rows. */
extern "C" __global__ void xent_bwd(const T* probs, const unsigned int* tgt, T* dl, float k, int rows, int vocab) {
    GRID_STRIDE(i, (long long)rows * vocab) {
        long long r = i / vocab, c = i % vocab;
        float v = ld(probs[i]);
        if ((unsigned int)c == tgt[r]) v -= 1.0f;
        dl[i] = st(v * k);
    }
}

/* sum += g (the step's gradient sum is kept in float). */
extern "C" __global__ void accum(float* sum, const T* g, int n) {
    GRID_STRIDE(i, n) { sum[i] += ld(g[i]); }
}

/* w -= lr * g. */
extern "C" __global__ void sgd(T* w, const float* g, float lr, int n) {
    GRID_STRIDE(i, n) { w[i] = st(ld(w[i]) - lr * g[i]); }
}

/* y = float(x), for reading results back. */
extern "C" __global__ void to_f32(const T* x, float* y, int n) {
    GRID_STRIDE(i, n) { y[i] = ld(x[i]); }
}
"#;

/// The grouping `embed_bwd` reads: token positions sorted by (token, position), and where each
/// distinct token's run starts (`starts` ends with the position count). Built on the host from
/// the microbatch's tokens, which the host knows (`model::tokens`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EmbedPlan {
    pub order: Vec<u32>,
    pub starts: Vec<u32>,
}

impl EmbedPlan {
    pub fn new(tokens: &[u32]) -> EmbedPlan {
        let mut order: Vec<u32> = (0..tokens.len() as u32).collect();
        // Stable: equal tokens keep position order, the order the CPU adds them in.
        order.sort_by_key(|&p| tokens[p as usize]);
        let mut starts: Vec<u32> = (0..order.len())
            .filter(|&j| j == 0 || tokens[order[j] as usize] != tokens[order[j - 1] as usize])
            .map(|j| j as u32)
            .collect();
        starts.push(order.len() as u32);
        EmbedPlan { order, starts }
    }

    /// The plan with `starts` padded by empty runs to `len + 1` entries (`len` >= the
    /// positions): `segs()` is then `len` whatever the tokens, so a launch over it has the same
    /// grid and arguments every step, as a CUDA graph replays it (`embed_bwd` skips empty runs).
    pub fn padded(tokens: &[u32], len: usize) -> EmbedPlan {
        let mut p = EmbedPlan::new(tokens);
        let end = p.order.len() as u32;
        p.starts.resize(len.max(tokens.len()) + 1, end);
        p
    }

    /// Distinct tokens (runs, empty ones of a padded plan included).
    pub fn segs(&self) -> usize {
        self.starts.len() - 1
    }
}

/// Round-to-nearest-even float -> bf16 bits, the host twin of the kernels' `st`.
pub fn bf16_bits(f: f32) -> u16 {
    let u = f.to_bits();
    if (u & 0x7fff_ffff) > 0x7f80_0000 {
        return ((u >> 16) | 0x40) as u16;
    }
    (u.wrapping_add(0x7fff + ((u >> 16) & 1)) >> 16) as u16
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The names of the `__global__` functions [`SOURCE`] defines, in its order.
    fn globals_in_source() -> Vec<&'static str> {
        SOURCE
            .split("__global__")
            .skip(1)
            .map(|rest| {
                let rest = rest
                    .trim_start()
                    .strip_prefix("void ")
                    .expect("returns void");
                rest.split('(').next().unwrap().trim()
            })
            .collect()
    }

    /// The table is [`SOURCE`]'s: each generated prototype is written there exactly once,
    /// opening its kernel's body, and every `__global__` function of the source has its row, in
    /// the same order. So a typed launch passes what its kernel declares, in its order.
    #[test]
    fn every_prototype_of_the_table_is_in_the_source_and_every_kernel_has_a_row() {
        assert_eq!(PROTOTYPES.len(), NAMES.len());
        for (name, proto) in NAMES.iter().zip(PROTOTYPES) {
            assert!(
                proto.starts_with(&format!("extern \"C\" __global__ void {name}(")),
                "{proto}"
            );
            assert_eq!(
                SOURCE.matches(&format!("{proto} {{")).count(),
                1,
                "the source does not define `{proto} {{` exactly once"
            );
            assert_eq!(SOURCE.matches(&format!(" {name}(")).count(), 1, "{name}");
        }
        assert_eq!(
            globals_in_source(),
            NAMES,
            "the source's kernels and the table's rows"
        );
        assert!(!SOURCE.contains("#include"), "NVRTC must not need headers");
        assert!(source(true).starts_with("#define PIPEC_BF16 1\n"));
        assert_eq!(source(false), SOURCE);
    }

    /// The mapping of the table's Rust types to C, in one prototype per kind of parameter, and
    /// the check is not vacuous: a prototype with two parameters swapped, or a buffer that
    /// loses its `const`, is not in the source.
    #[test]
    fn the_table_writes_c_types_and_a_changed_prototype_is_not_in_the_source() {
        let at = |name: &str| PROTOTYPES[NAMES.iter().position(|n| *n == name).unwrap()];
        assert_eq!(
            at("xent_bwd"),
            "extern \"C\" __global__ void xent_bwd(const T* probs, const unsigned int* tgt, \
             T* dl, float k, int rows, int vocab)"
        );
        assert_eq!(
            at("sgd"),
            "extern \"C\" __global__ void sgd(T* w, const float* g, float lr, int n)"
        );
        assert_eq!(
            at("softmax_xent_fwd"),
            "extern \"C\" __global__ void softmax_xent_fwd(T* z, const unsigned int* tgt, \
             float* row_loss, int rows, int vocab)"
        );
        let slips = [
            at("embed_fwd").replace("int seq, int hidden", "int hidden, int seq"),
            at("col_sums").replace("const T* a", "T* a"),
            at("xent_bwd").replace("float k, int rows", "int rows, float k"),
        ];
        for slip in slips {
            assert_eq!(SOURCE.matches(&format!("{slip} {{")).count(), 0, "{slip}");
        }
    }

    /// Every position appears once, grouped by token, in position order within a token; one
    /// run per distinct token.
    #[test]
    fn embed_plan_groups_positions_by_token_in_order() {
        let tokens = [5u32, 2, 5, 9, 2, 5];
        let p = EmbedPlan::new(&tokens);
        assert_eq!(p.order, [1, 4, 0, 2, 5, 3]);
        assert_eq!(p.starts, [0, 2, 5, 6]);
        assert_eq!(p.segs(), 3);
        let padded = EmbedPlan::padded(&tokens, 8);
        assert_eq!(padded.order, p.order);
        assert_eq!(padded.starts, [0, 2, 5, 6, 6, 6, 6, 6, 6]);
        assert_eq!(padded.segs(), 8);
        let empty = EmbedPlan::new(&[]);
        assert_eq!((empty.order.len(), empty.segs()), (0, 0));
        assert_eq!(empty.starts, [0]);
    }

    /// The host twin of the bf16 store agrees with the `half` crate's rounding on ties, NaN,
    /// infinities and ordinary values.
    #[test]
    fn bf16_rounding_is_round_to_nearest_even() {
        let cases = [
            1.0f32,
            -2.5,
            f32::from_bits(0x3f80_8000), // exactly halfway, even below: rounds down
            f32::from_bits(0x3f81_8000), // halfway, odd below: rounds up
            f32::from_bits(0x3f80_8001),
            f32::INFINITY,
            f32::NEG_INFINITY,
            1e-40,
            3.402_823_5e38,
        ];
        let want = [
            0x3f80, 0xc020, 0x3f80, 0x3f82, 0x3f81, 0x7f80, 0xff80, 0x0001, 0x7f80,
        ];
        for (f, w) in cases.iter().zip(want) {
            assert_eq!(bf16_bits(*f), w, "{f:e}");
        }
        assert_eq!(bf16_bits(f32::NAN) & 0x7fc0, 0x7fc0);
    }
}
