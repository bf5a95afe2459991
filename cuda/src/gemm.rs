//! How a row-major product becomes one column-major cuBLAS `gemm` call.
//!
//! The model keeps every matrix row-major (as ndarray does on the CPU); cuBLAS, like the
//! reference BLAS, is column-major. A row-major `X[r, c]` with row length `c` is, byte for byte,
//! the column-major `Xᵀ` with leading dimension `c`, so `C = op(A)·op(B)` is computed as
//! `Cᵀ = op(B)ᵀ·op(A)ᵀ`: the operands swap places and each keeps its own transpose flag.
//! This module is the arithmetic of that mapping, kept pure so it is tested without a GPU
//! against the BLAS definition of `gemm` ([`reference_gemm`]).

/// `op(X)` of the BLAS interface: `N` uses the matrix as stored, `T` its transpose.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    N,
    T,
}

impl Op {
    fn of(transposed: bool) -> Op {
        if transposed {
            Op::T
        } else {
            Op::N
        }
    }
}

/// The arguments of one column-major `gemm`: `C[m×n] = op(A)[m×k] · op(B)[k×n]`, where the
/// BLAS `A` argument is the row-major right operand and the BLAS `B` argument the left one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ColMajorGemm {
    pub transa: Op,
    pub transb: Op,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub lda: usize,
    pub ldb: usize,
    pub ldc: usize,
}

/// The call computing row-major `c[m, n] = op(a)[m, k] · op(b)[k, n]`, where `ta`/`tb` say the
/// operand is stored transposed (`a` as `[k, m]`, `b` as `[n, k]`). Pass `b` as the BLAS `A`
/// argument and `a` as the BLAS `B` argument.
pub fn row_major(ta: bool, tb: bool, m: usize, n: usize, k: usize) -> ColMajorGemm {
    ColMajorGemm {
        transa: Op::of(tb),
        transb: Op::of(ta),
        m: n,
        n: m,
        k,
        // `b` stored `[k, n]` is column-major `n×k` (ld n); stored `[n, k]` it is `k×n` (ld k).
        lda: if tb { k } else { n },
        ldb: if ta { m } else { k },
        ldc: n,
    }
}

impl ColMajorGemm {
    /// The argument checks cuBLAS makes before it runs (`CUBLAS_STATUS_INVALID_VALUE`
    /// otherwise): each leading dimension at least the stored row count, and at least 1.
    pub fn valid(&self) -> bool {
        let rows_a = if self.transa == Op::N { self.m } else { self.k };
        let rows_b = if self.transb == Op::N { self.k } else { self.n };
        self.lda >= rows_a.max(1) && self.ldb >= rows_b.max(1) && self.ldc >= self.m.max(1)
    }
}

/// `C = op(A)·op(B)` straight from the BLAS definition (`xGEMM`, alpha 1, beta 0): element
/// `(i, j)` of a column-major matrix with leading dimension `ld` is at `i + j·ld`. The test
/// oracle for [`row_major`]; never used on a hot path.
pub fn reference_gemm(g: &ColMajorGemm, a: &[f64], b: &[f64]) -> Vec<f64> {
    let at = |i: usize, l: usize| match g.transa {
        Op::N => a[i + l * g.lda],
        Op::T => a[l + i * g.lda],
    };
    let bt = |l: usize, j: usize| match g.transb {
        Op::N => b[l + j * g.ldb],
        Op::T => b[j + l * g.ldb],
    };
    let mut c = vec![0.0; g.ldc * g.n];
    for j in 0..g.n {
        for i in 0..g.m {
            c[i + j * g.ldc] = (0..g.k).map(|l| at(i, l) * bt(l, j)).sum();
        }
    }
    c
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Row-major `op(a)·op(b)` by the textbook triple loop, independent of any BLAS convention.
    fn naive(a: &[f64], ta: bool, b: &[f64], tb: bool, m: usize, n: usize, k: usize) -> Vec<f64> {
        let av = |i: usize, l: usize| if ta { a[l * m + i] } else { a[i * k + l] };
        let bv = |l: usize, j: usize| if tb { b[j * k + l] } else { b[l * n + j] };
        let mut c = vec![0.0; m * n];
        for i in 0..m {
            for j in 0..n {
                c[i * n + j] = (0..k).map(|l| av(i, l) * bv(l, j)).sum();
            }
        }
        c
    }

    proptest! {
        /// Every transpose combination and shape (ones included, where a wrong leading
        /// dimension hides) gives the row-major product, and passes cuBLAS's argument checks.
        #[test]
        fn row_major_plan_computes_the_row_major_product(
            ta in any::<bool>(), tb in any::<bool>(),
            m in 1usize..7, n in 1usize..7, k in 1usize..7, seed in any::<u64>(),
        ) {
            let mut s = seed | 1;
            let mut next = || {
                s ^= s << 13; s ^= s >> 7; s ^= s << 17;
                (s % 19) as f64 - 9.0
            };
            let a: Vec<f64> = (0..m * k).map(|_| next()).collect();
            let b: Vec<f64> = (0..k * n).map(|_| next()).collect();
            let g = row_major(ta, tb, m, n, k);
            prop_assert!(g.valid(), "{g:?}");
            // Integer-valued operands: both sums are exact, so equality is exact.
            prop_assert_eq!(reference_gemm(&g, &b, &a), naive(&a, ta, &b, tb, m, n, k));
        }
    }

    /// The calls the model makes, spelled out: forward `x·W1`, input gradient `dy·W2ᵀ`, weight
    /// gradient `xᵀ·dh` (model.rs `stage_fwd`, `stage_bwd_d`, `stage_bwd_w`).
    #[test]
    fn the_models_three_shapes() {
        let (s, h, f) = (3, 4, 5);
        let fwd = row_major(false, false, s, f, h);
        assert_eq!(
            (fwd.transa, fwd.transb, fwd.m, fwd.n, fwd.k),
            (Op::N, Op::N, f, s, h)
        );
        assert_eq!((fwd.lda, fwd.ldb, fwd.ldc), (f, h, f));
        let bwd_d = row_major(false, true, s, f, h);
        assert_eq!((bwd_d.transa, bwd_d.lda), (Op::T, h));
        let bwd_w = row_major(true, false, h, f, s);
        assert_eq!((bwd_w.transb, bwd_w.ldb, bwd_w.ldc), (Op::T, h, f));
    }

    /// The oracle itself is not trivially permissive: swapping the operands of a matrices that do not
    /// commute is caught.
    #[test]
    fn swapped_operands_are_caught() {
        let a = [1.0, 2.0, 3.0, 4.0];
        let b = [0.0, 1.0, 1.0, 0.0];
        let g = row_major(false, false, 2, 2, 2);
        let right = naive(&a, false, &b, false, 2, 2, 2);
        assert_eq!(reference_gemm(&g, &b, &a), right);
        assert_ne!(reference_gemm(&g, &a, &b), right);
    }
}
