/* The body of vitlab's HiLo attention kernels, included once per instruction set by ops.cpp after simd.h
 * (VW, RB, the vector type, exp, softmax row and weighted values), inside the same namespace and
 * `#pragma GCC target` region.
 *
 * lofi_attention: softmax(q k^T * scale) v where every query row of a (batch, head) item attends to the same few
 *   keys (M <= 64: the s x s average-pooled map). PyTorch's CPU flash kernel runs such rows as small GEMM calls;
 *   here a block of query rows against all keys (logits, softmax, weighted values) stays in registers.
 * hifi_attention: self-attention inside the non-overlapping s x s windows of an H x W map, read straight from the
 *   projected (B, H, W, 3 * heads * D) tokens and written in raster order: no window partition or reverse copies,
 *   and no per-window kernel launch. A window cut by the border holds only its real tokens, which is what padding
 *   the map and masking the padded keys computes.
 *
 * Head width D: a multiple of 16 up to 64. Strides are in elements; the last dimension is contiguous. No headers
 * here: they are included once, outside the target regions. */

/* Logits of R query rows against the key vectors j0 .. j0 + JB - 1 (JB * VW keys), into p (row stride MP); kt
 * holds the keys transposed, kt[d][m] with row stride MP. */
template <int R, int JB>
INLINE void qk_block(const float *const *qr, int D, const float *kt, int MP, int j0, float *p) {
    vec s[R][JB];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < JB; j++) s[r][j] = splat(0.0f);
    for (int d = 0; d < D; d++) {
        vec kv[JB];
        for (int j = 0; j < JB; j++) kv[j] = load(kt + d * MP + VW * (j0 + j));
        for (int r = 0; r < R; r++) {
            vec qb = splat(qr[r][d]);
            for (int j = 0; j < JB; j++) s[r][j] += qb * kv[j];
        }
    }
    for (int r = 0; r < R; r++)
        for (int j = 0; j < JB; j++) store(p + r * MP + VW * (j0 + j), s[r][j]);
}

/* One (batch, head) item of the Lo-Fi attention: N queries (row stride qn), M keys / values (row stride kn);
 * DV vectors per head row, J vectors of keys. kt: scratch for D * J * VW floats, p: for RMAX * J * VW.
 * Register blocks: R query rows against C vectors of keys (logits) or of values (outputs), R * C <= RB
 * accumulators, the rest in blocks of the remainder. */
template <int DV, int J>
INLINE void lofi_item(const float *q, long qn, const float *k, const float *v, long kn, int M, float *o, long on,
                      int N, float scale, float *kt, float *p) {
    constexpr int D = DV * VW, MP = J * VW;
    constexpr int C = cmin(4, cmax(J, DV));                    /* vectors per block */
    constexpr int R = cmax(1, cmin(RMAX, RB / C));             /* query rows per block */
    for (int d = 0; d < D; d++) /* scaled keys, transposed: kt[d][m], zero-padded to MP keys */
        for (int m = 0; m < MP; m++) kt[d * MP + m] = m < M ? k[m * kn + d] * scale : 0.0f;
    const ivec keep = first_lanes(M - (J - 1) * VW); /* the last vector's real keys */
    for (int n0 = 0; n0 < N; n0 += R) {
        const int rows = N - n0 < R ? N - n0 : R;
        const float *qr[R];
        for (int r = 0; r < R; r++) qr[r] = q + (long)(n0 + (r < rows ? r : 0)) * qn;
        constexpr int JC = cmin(C, J);
        for (int j0 = 0; j0 + JC <= J; j0 += JC) qk_block<R, JC>(qr, D, kt, MP, j0, p);
        if constexpr (J % JC != 0) qk_block<R, J % JC>(qr, D, kt, MP, J - J % JC, p);
        float inv[R];
        for (int r = 0; r < R; r++) inv[r] = softmax_row(p + r * MP, J, keep); /* numerators in place */
        float *orow = o + (long)n0 * on;
        constexpr int DC = cmin(C, DV);
        for (int j0 = 0; j0 + DC <= DV; j0 += DC) pv_block<R, DC>(p, MP, v, kn, M, j0, inv, orow, on, rows);
        if constexpr (DV % DC != 0) pv_block<R, DV % DC>(p, MP, v, kn, M, DV - DV % DC, inv, orow, on, rows);
    }
}

constexpr int MAXV = 64 / VW; /* most vectors in a head row (D <= 64) or in a row of keys (M <= 64) */

/* lofi_item<dv, j> for the runtime (dv, j): a chain of compile-time cases, head widths a multiple of 16 only */
template <int DV, int J>
static void lofi_dispatch(int dv, int j, const float *q, long qn, const float *k, const float *v, long kn, int M,
                          float *o, long on, int N, float scale, float *kt, float *p) {
    if constexpr (DV > MAXV) {
        return;
    } else if constexpr (J > MAXV || (DV * VW) % 16 != 0) {
        lofi_dispatch<DV + 1, 1>(dv, j, q, qn, k, v, kn, M, o, on, N, scale, kt, p);
    } else if (dv == DV && j == J) {
        lofi_item<DV, J>(q, qn, k, v, kn, M, o, on, N, scale, kt, p);
    } else {
        lofi_dispatch<DV, J + 1>(dv, j, q, qn, k, v, kn, M, o, on, N, scale, kt, p);
    }
}

/* All B * H (batch, head) items on `threads` threads. q: (B, H, N, D) with strides qb, qh, qn; k and v: (B, H, M,
 * D) sharing the strides kb, kh, kn; o: strides ob, oh, on. Returns 0, 1 for an unsupported shape, 2 when out of
 * memory. */
int lofi_attention(const float *q, long qb, long qh, long qn, const float *k, const float *v, long kb, long kh,
                   long kn, float *o, long ob, long oh, long on, int B, int H, int N, int M, int D, float scale,
                   int threads) {
    if (D <= 0 || D > 64 || D % 16 || M <= 0 || M > 64) return 1;
    const int J = (M + VW - 1) / VW, DV = D / VW;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        float *kt = (float *)malloc(sizeof(float) * (D + RMAX) * J * VW);
        float *p = kt ? kt + D * J * VW : nullptr;
        if (!kt) {
#pragma omp atomic write
            failed = 2;
        }
#pragma omp for schedule(static)
        for (long i = 0; i < (long)B * H; i++) {
            if (!kt) continue;
            const long b = i / H, h = i % H;
            lofi_dispatch<1, 1>(DV, J, q + b * qb + h * qh, qn, k + b * kb + h * kh, v + b * kb + h * kh, kn, M,
                                o + b * ob + h * oh, on, N, scale, kt, p);
        }
        free(kt);
    }
    return failed;
}

#define MAXW 64 /* most tokens in a Hi-Fi window (s <= 8) */

/* One window of the Hi-Fi attention, all heads: T tokens, the t-th at offset xt[t] in x and ot[t] in o. */
template <int DV>
INLINE void hifi_window(const float *x, long qo, long ko, long vo, float *o, const long *xt, const long *ot, int T,
                        int heads, float scale) {
    constexpr int D = DV * VW;
    float logit[MAXW];
    for (int h = 0; h < heads; h++) {
        for (int t = 0; t < T; t++) {
            const float *qt = x + xt[t] + qo + h * D;
            vec qv[DV];
            for (int j = 0; j < DV; j++) qv[j] = load(qt + VW * j) * splat(scale);
            float mx = -3.0e38f;
            for (int u = 0; u < T; u++) {
                const float *ku = x + xt[u] + ko + h * D;
                vec a = qv[0] * load(ku);
                for (int j = 1; j < DV; j++) a += qv[j] * load(ku + VW * j);
                const float l = fold(a, true)[0];
                logit[u] = l;
                mx = l > mx ? l : mx;
            }
            float sum = 0.0f;
            for (int u0 = 0; u0 < T; u0 += VW) {
                vec l = splat(-87.0f);
                for (int i = 0; i < VW && u0 + i < T; i++) l[i] = logit[u0 + i] - mx;
                vec e = vexp(l);
                for (int i = 0; i < VW && u0 + i < T; i++) logit[u0 + i] = e[i], sum += e[i];
            }
            vec acc[DV];
            for (int j = 0; j < DV; j++) acc[j] = splat(0.0f);
            for (int u = 0; u < T; u++) {
                const float *vu = x + xt[u] + vo + h * D;
                const vec pu = splat(logit[u] / sum);
                for (int j = 0; j < DV; j++) acc[j] += pu * load(vu + VW * j);
            }
            float *out = o + ot[t] + h * D;
            for (int j = 0; j < DV; j++) store(out + VW * j, acc[j]);
        }
    }
}

/* All B * ceil(H / s) * ceil(W / s) windows on `threads` threads. x: (B, H, W, C) projected tokens with strides
 * xb, xr (row), xc (column); q, k, v of head h at channels qo + h D, ko + h D, vo + h D. o: (B, H, W, heads * D)
 * with strides ob, or, oc. Returns 0, or 1 for an unsupported shape. */
int hifi_attention(const float *x, long xb, long xr, long xc, long qo, long ko, long vo, float *o, long ob,
                   long or_, long oc, int B, int H, int W, int s, int heads, int D, float scale, int threads) {
    if (D <= 0 || D > 64 || D % 16 || s <= 0 || s * s > MAXW) return 1;
    const int nh = (H + s - 1) / s, nw = (W + s - 1) / s;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (long i = 0; i < (long)B * nh * nw; i++) {
        long xt[MAXW], ot[MAXW];
        const long b = i / ((long)nh * nw), wi = i / nw % nh, wj = i % nw;
        int T = 0;
        for (int r = wi * s; r < (wi + 1) * s && r < H; r++)
            for (int c = wj * s; c < (wj + 1) * s && c < W; c++, T++) {
                xt[T] = b * xb + r * xr + c * xc;
                ot[T] = b * ob + r * or_ + c * oc;
            }
        switch (D / 16) {
            case 1: hifi_window<16 / VW>(x, qo, ko, vo, o, xt, ot, T, heads, scale); break;
            case 2: hifi_window<32 / VW>(x, qo, ko, vo, o, xt, ot, T, heads, scale); break;
            case 3: hifi_window<48 / VW>(x, qo, ko, vo, o, xt, ot, T, heads, scale); break;
            default: hifi_window<64 / VW>(x, qo, ko, vo, o, xt, ot, T, heads, scale); break;
        }
    }
    return 0;
}

#undef MAXW
