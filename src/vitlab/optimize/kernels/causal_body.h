/* The causal prompt attention kernel, included once per instruction set by ops.cpp after simd.h (VW, RB, the
 * vector type, exp, softmax row and weighted values), inside the same namespace and `#pragma GCC target` region.
 *
 * causal_attention: softmax(q k^T * scale + causal mask) v for a prompt written from position 0: query i attends to
 *   keys 0 .. i. A decoder's prefill, batch x heads items of a few hundred tokens with heads of 64 or 128 channels:
 *   PyTorch's CPU flash kernel runs them in small query blocks (32 rows at 128 tokens) through small GEMM calls,
 *   with an online softmax. Here a block of R query rows against every key it may see (logits, masked softmax,
 *   weighted values) runs in registers, the logits of the block in a scratch row buffer, and the keys above the
 *   diagonal are never touched.
 *
 * Work is split in chunks of QC query rows per (batch, head) item, largest first, dynamically scheduled: a causal
 * chunk's cost grows with its position. Each chunk transposes the (scaled) keys it needs once; that copy costs
 * 1 / (2 QC) of the chunk's multiply-adds. Grouped-query attention: query head h reads key / value head
 * h / (Hq / Hkv). */

constexpr int QC = 64;           /* query rows per work item */
constexpr int CAUSAL_MAXN = 1024; /* most tokens: a chunk streams all its keys and values through the L2 cache, past a
                                    * thousand tokens (AVX2) slower than the flash kernel's blocks */

/* Logits of R query rows against the key vectors j0 .. j0 + JB - 1 into p (row stride MP); kt holds the keys in
 * blocks of VW, each block D x VW (channel-major): a block's loads walk one contiguous run of memory. */
template <int R, int JB>
INLINE void qk_packed(const float *const *qr, int D, const float *kt, int j0, float *p, int MP) {
    vec s[R][JB];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < JB; j++) s[r][j] = splat(0.0f);
    const float *kb = kt + (long)j0 * D * VW;
    for (int d = 0; d < D; d++) {
        vec kv[JB];
        for (int j = 0; j < JB; j++) kv[j] = load(kb + (long)j * D * VW + d * VW);
        for (int r = 0; r < R; r++) {
            vec qb = splat(qr[r][d]);
            for (int j = 0; j < JB; j++) s[r][j] += qb * kv[j];
        }
    }
    for (int r = 0; r < R; r++)
        for (int j = 0; j < JB; j++) store(p + r * MP + VW * (j0 + j), s[r][j]);
}

/* Query rows n_begin .. n_end - 1 of one (batch, head) item; keys and values 0 .. n_end - 1. kt: scratch for
 * D * MP floats, vc: for MP * D, p: for RMAX * MP, MP >= n_end rounded up to VW. */
template <int DV>
INLINE void causal_chunk(const float *q, long qn, const float *k, long kn, const float *v, long vn, float *o, long on,
                         int n_begin, int n_end, float scale, float *kt, float *vc, float *p, int MP) {
    constexpr int D = DV * VW;
    constexpr int C = cmin(4, DV);                    /* vectors per register block */
    constexpr int R = cmax(1, cmin(RMAX, RB / C));    /* query rows per register block */
    const int J = (n_end + VW - 1) / VW;
    for (int m = 0; m < J * VW; m++) { /* scaled keys, transposed in blocks of VW (qk_packed), zero past the last */
        const float *km = k + (long)m * kn;
        float *kd = kt + (long)(m / VW) * D * VW + m % VW;
        for (int d = 0; d < D; d++) kd[d * VW] = m < n_end ? km[d] * scale : 0.0f;
    }
    /* the values, contiguous: a (batch, head) item's rows lie heads x channels apart, a page or more in a packed
     * projection; every register block of query rows reads all of them again */
    for (int m = 0; m < n_end; m++)
        for (int j = 0; j < DV; j++) store(vc + m * D + VW * j, load(v + (long)m * vn + VW * j));
    for (int n0 = n_begin; n0 < n_end; n0 += R) {
        const int rows = n_end - n0 < R ? n_end - n0 : R;
        const int keys = n0 + rows; /* the block's last row sees keys 0 .. keys - 1 */
        const int JR = (keys + VW - 1) / VW;
        const float *qr[R];
        for (int r = 0; r < R; r++) qr[r] = q + (long)(n0 + (r < rows ? r : 0)) * qn;
        int j0 = 0;
        for (; j0 + C <= JR; j0 += C) qk_packed<R, C>(qr, D, kt, j0, p, MP);
        switch (JR - j0) { /* the remaining 0 .. C - 1 vectors of keys */
            case 1: qk_packed<R, 1>(qr, D, kt, j0, p, MP); break;
            case 2: qk_packed<R, cmin(2, C)>(qr, D, kt, j0, p, MP); break;
            case 3: qk_packed<R, cmin(3, C)>(qr, D, kt, j0, p, MP); break;
            default: break;
        }
        float inv[R];
        for (int r = 0; r < R; r++) { /* masked softmax numerators in place, 1 / their sum */
            float *pr = p + r * MP;
            const int valid = n0 + (r < rows ? r : 0) + 1; /* keys 0 .. valid - 1 */
            const int JV = (valid + VW - 1) / VW;
            inv[r] = softmax_row(pr, JV, first_lanes(valid - (JV - 1) * VW));
            for (int j = JV; j < JR; j++) store(pr + VW * j, splat(0.0f)); /* above the diagonal */
        }
        float *orow = o + (long)n0 * on;
        constexpr int DC = cmin(C, DV);
        for (int j = 0; j + DC <= DV; j += DC) pv_block<R, DC>(p, MP, vc, D, keys, j, inv, orow, on, rows);
        if constexpr (DV % DC != 0) pv_block<R, DV % DC>(p, MP, vc, D, keys, DV - DV % DC, inv, orow, on, rows);
    }
}

/* All B * Hq items on `threads` threads. q: (B, Hq, N, D) with strides qb, qh, qn; k: (B, Hkv, N, D) with strides
 * kb, kh, kn; v likewise with vb, vh, vn; o: strides ob, oh, on. Returns 0, 1 for an unsupported shape, 2 when out
 * of memory. */
int causal_attention(const float *q, long qb, long qh, long qn, const float *k, long kb, long kh, long kn,
                     const float *v, long vb, long vh, long vn, float *o, long ob, long oh, long on, int B, int Hq,
                     int Hkv, int N, int D, float scale, int threads) {
    if (D <= 0 || D > 128 || D % 16 || N <= 0 || N > CAUSAL_MAXN || Hkv <= 0 || Hq % Hkv) return 1;
    const int MP = (N + VW - 1) / VW * VW, chunks = (N + QC - 1) / QC, G = Hq / Hkv;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        float *kt = (float *)malloc(sizeof(float) * (2 * D + RMAX) * MP);
        float *vc = kt ? kt + (long)D * MP : nullptr, *p = kt ? vc + (long)D * MP : nullptr;
        if (!kt) {
#pragma omp atomic write
            failed = 2;
        }
#pragma omp for schedule(dynamic, 1)
        for (long i = 0; i < (long)B * Hq * chunks; i++) {
            if (!kt) continue;
            const int c = chunks - 1 - (int)(i % chunks); /* the costliest chunks first */
            const long item = i / chunks, b = item / Hq, h = item % Hq, hk = h / G;
            const int n0 = c * QC, n1 = n0 + QC < N ? n0 + QC : N;
            const float *qi = q + b * qb + h * qh, *ki = k + b * kb + hk * kh, *vi = v + b * vb + hk * vh;
            float *oi = o + b * ob + h * oh;
            switch (D / 16) {
                case 1: causal_chunk<16 / VW>(qi, qn, ki, kn, vi, vn, oi, on, n0, n1, scale, kt, vc, p, MP); break;
                case 2: causal_chunk<32 / VW>(qi, qn, ki, kn, vi, vn, oi, on, n0, n1, scale, kt, vc, p, MP); break;
                case 3: causal_chunk<48 / VW>(qi, qn, ki, kn, vi, vn, oi, on, n0, n1, scale, kt, vc, p, MP); break;
                case 4: causal_chunk<64 / VW>(qi, qn, ki, kn, vi, vn, oi, on, n0, n1, scale, kt, vc, p, MP); break;
                case 5: causal_chunk<80 / VW>(qi, qn, ki, kn, vi, vn, oi, on, n0, n1, scale, kt, vc, p, MP); break;
                case 6: causal_chunk<96 / VW>(qi, qn, ki, kn, vi, vn, oi, on, n0, n1, scale, kt, vc, p, MP); break;
                case 7: causal_chunk<112 / VW>(qi, qn, ki, kn, vi, vn, oi, on, n0, n1, scale, kt, vc, p, MP); break;
                default: causal_chunk<128 / VW>(qi, qn, ki, kn, vi, vn, oi, on, n0, n1, scale, kt, vc, p, MP); break;
            }
        }
        free(kt);
    }
    return failed;
}
