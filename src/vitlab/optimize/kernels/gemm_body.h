/* A linear layer's product against a prepacked weight, included once per instruction set by ops.cpp after
 * simd.h (VW, RB, the vector type), inside the same namespace and `#pragma GCC target` region.
 *
 * packed_linear: y = x W^T + bias for x (M, K) with rows `lda` apart, W (N, K) packed once by the Python side
 *   (vitlab.optimize.kernels.pack_linear_weight) into panels of NR = 2 VW output features, each K x NR with the
 *   features innermost (panel j holds W[j NR + c][k] at (j K + k) NR + c; zero past N): the loads of a panel walk
 *   one contiguous run of memory. The register block is MR = RB / 2 rows of x against one panel: 2 MR accumulators,
 *   two weight vectors and one broadcast per step of k, so the loop is bound by the FMA units (12 of AVX2's 16
 *   registers, 24 of AVX-512's 32), the classic outer-product micro-kernel (Goto & van de Geijn, 2008, "Anatomy of
 *   High-Performance Matrix Multiplication"). x is read in place (no packing): a block of MR rows x KC columns
 *   stays in the near caches (L1 for AVX2's 6 rows, L2 for AVX-512's 12) while it meets the panels of a column
 *   group, whose KC x NR slices stay in L2.
 *
 * Work items are (column group, row block) pairs, column-group major, split into contiguous ranges per thread:
 * a thread's consecutive items reuse the same weight panels. Long rows are cut into K blocks of at most KC
 * columns (the first block writes y, the others add to it).
 *
 * glu: SwiGLU's first layer (Shazeer, 2020, "GLU Variants Improve Transformer") with its gate applied in the
 *   epilogue: W stacks the gate's h rows over the value's h, packed so that panel j holds gate features
 *   j VW .. j VW + VW - 1 in its first VW lanes and the same value features in the others; the block's two
 *   accumulators are then gate and value of the same VW features, and y (M, h) = silu(gate) * value is written
 *   without the (M, 2h) pre-activations ever reaching memory. One K block (the sum must be whole before the gate). */

constexpr int NR = 2 * VW;     /* output features per panel */
constexpr int MR = RB / 2;     /* rows of x per register block */
constexpr int MB = 8 * MR;     /* rows of x per work item */
constexpr int KC = 1024;       /* most columns of x per K block */
constexpr int GP = 4;          /* panels per column group (when there are items enough for every thread) */

/* silu(g) * v = g v / (1 + exp(-g)), exp taken of -|g| only (vexp's domain): sigmoid(g) = 1 / (1 + e) for g >= 0,
 * e / (1 + e) below, e = exp(-|g|) */
INLINE vec silu_times(vec g, vec v) {
    const ivec neg = g < splat(0.0f);
    const vec e = vexp((vec)((ivec)g | (ivec)splat(-0.0f)));
    const vec num = (vec)(((ivec)e & neg) | ((ivec)splat(1.0f) & ~neg));
    return g * v * num / (splat(1.0f) + e);
}

/* R rows of x (from a, row stride lda) against one panel's k-slice b (kc x NR) into c (row stride ldc), the first
 * `cols` features: started from `init` (NR floats: the bias, or zeros) when `first`, else added to c. With `glu`
 * (one K block), the VW features silu(gate) * value instead, `cols` <= VW of them. */
template <int R>
static __attribute__((noinline)) void gemm_block(const float *a, long lda, const float *b, int kc, const float *init,
                                                 bool first, float *c, long ldc, int cols, bool glu) {
    vec acc[R][2];
    if (first) {
        const vec i0 = load(init), i1 = load(init + VW);
#pragma GCC unroll 16
        for (int r = 0; r < R; r++) acc[r][0] = i0, acc[r][1] = i1;
    } else if (cols == NR) {
#pragma GCC unroll 16
        for (int r = 0; r < R; r++) acc[r][0] = load(c + r * ldc), acc[r][1] = load(c + r * ldc + VW);
    } else {
        float tmp[NR] = {};
#pragma GCC unroll 16
        for (int r = 0; r < R; r++) {
            for (int j = 0; j < cols; j++) tmp[j] = c[r * ldc + j];
            acc[r][0] = load(tmp), acc[r][1] = load(tmp + VW);
        }
    }
#pragma GCC unroll 4
    for (int k = 0; k < kc; k++) {
        const vec b0 = load(b + k * NR), b1 = load(b + k * NR + VW);
#pragma GCC unroll 16
        for (int r = 0; r < R; r++) {
            const vec x = splat(a[r * lda + k]);
            acc[r][0] += x * b0;
            acc[r][1] += x * b1;
        }
    }
    if (glu) {
#pragma GCC unroll 16
        for (int r = 0; r < R; r++) acc[r][0] = silu_times(acc[r][0], acc[r][1]);
        if (cols == VW) {
#pragma GCC unroll 16
            for (int r = 0; r < R; r++) store(c + r * ldc, acc[r][0]);
        } else {
            for (int r = 0; r < R; r++)
                for (int j = 0; j < cols; j++) c[r * ldc + j] = acc[r][0][j];
        }
    } else if (cols == NR) {
#pragma GCC unroll 16
        for (int r = 0; r < R; r++) store(c + r * ldc, acc[r][0]), store(c + r * ldc + VW, acc[r][1]);
    } else { /* the last panel of a layer whose features are not a multiple of NR */
        float tmp[NR];
        for (int r = 0; r < R; r++) {
            store(tmp, acc[r][0]), store(tmp + VW, acc[r][1]);
            for (int j = 0; j < cols; j++) c[r * ldc + j] = tmp[j];
        }
    }
}

/* gemm_block for 1 .. R rows (the last rows of a row block may be fewer than MR) */
template <int R>
INLINE void gemm_rows(int rows, const float *a, long lda, const float *b, int kc, const float *init, bool first,
                      float *c, long ldc, int cols, bool glu) {
    if (rows == R) {
        gemm_block<R>(a, lda, b, kc, init, first, c, ldc, cols, glu);
    } else if constexpr (R > 1) {
        gemm_rows<R - 1>(rows, a, lda, b, kc, init, first, c, ldc, cols, glu);
    }
}

/* y = x (M, K; row stride lda) W^T + bias, W packed as above into `panels` panels, on `threads` threads: y (M, N),
 * contiguous; with `glu`, y (M, N) = silu(gate) * value of the N gate and N value features. `bias`: null, or the
 * panels' NR-wide slices of it, padded (panels x NR floats). Returns 0, or 1 for an unsupported shape. */
int packed_linear(const float *x, long lda, const float *packed, const float *bias, float *y, long M, int K, int N,
                  bool glu, int threads) {
    if (M < 0 || K <= 0 || N <= 0) return 1;
    const int width = glu ? VW : NR; /* output features per panel */
    const int panels = (N + width - 1) / width, kblocks = glu ? 1 : (K + KC - 1) / KC;
    const int kc_max = (K + kblocks - 1) / kblocks;
    const long row_blocks = (M + MB - 1) / MB;
    /* wide groups keep a thread on the same panels; one panel each where that leaves threads idle */
    const int gp = (long)(panels + GP - 1) / GP * row_blocks >= 4L * threads ? GP : 1;
    const long groups = (panels + gp - 1) / gp;
    static const float zeros[NR] = {};
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long item = 0; item < groups * row_blocks; item++) {
        const int p0 = (int)(item / row_blocks) * gp, p1 = p0 + gp < panels ? p0 + gp : panels;
        const long m0 = item % row_blocks * MB, m1 = m0 + MB < M ? m0 + MB : M;
        for (int k0 = 0; k0 < K; k0 += kc_max) {
            const int kc = K - k0 < kc_max ? K - k0 : kc_max;
            for (long m = m0; m < m1; m += MR) {
                const int rows = m1 - m < MR ? (int)(m1 - m) : MR;
                for (int p = p0; p < p1; p++) {
                    const int cols = N - p * width < width ? N - p * width : width;
                    gemm_rows<MR>(rows, x + m * lda + k0, lda, packed + ((long)p * K + k0) * NR, kc,
                                  bias ? bias + (long)p * NR : zeros, k0 == 0, y + m * N + p * width, N, cols, glu);
                }
            }
        }
    }
    return 0;
}
