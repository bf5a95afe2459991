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

/// Kernel names, in the order [`SOURCE`] defines them; the device code loads each by name.
pub const NAMES: [&str; 14] = [
    "bias_gelu_fwd",
    "add_bias",
    "add_bias_residual",
    "gelu_bwd",
    "add_into",
    "col_sums",
    "embed_fwd",
    "embed_bwd",
    "softmax_xent_fwd",
    "loss_mean",
    "xent_bwd",
    "accum",
    "sgd",
    "to_f32",
];

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

    /// Distinct tokens.
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

    #[test]
    fn every_named_kernel_is_defined_once_with_c_linkage() {
        for name in NAMES {
            let decl = format!("extern \"C\" __global__ void {name}(");
            assert_eq!(SOURCE.matches(&decl).count(), 1, "{name}");
        }
        assert_eq!(SOURCE.matches("__global__").count(), NAMES.len());
        assert!(!SOURCE.contains("#include"), "NVRTC must not need headers");
        assert!(source(true).starts_with("#define PIPEC_BF16 1\n"));
        assert_eq!(source(false), SOURCE);
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
