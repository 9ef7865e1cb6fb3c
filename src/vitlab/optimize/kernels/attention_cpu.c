/* Fused fp32 CPU attention kernels for HiLo's two branches (vitlab.attention.hilo), for inference.
 *
 * lofi_attention: softmax(q k^T * scale) v where all N query rows of a (batch, head) item attend to the same few
 *   keys (M <= 64: the s x s average-pooled map). PyTorch's CPU flash kernel runs such rows as 64 x 49 x 64 GEMM
 *   calls at ~30 GMAC/s on the 2-core AVX-512 machine of docs/benchmarks.md; here a block of R query rows
 *   against all keys (logits, softmax, weighted values) stays in registers.
 * hifi_attention: self-attention inside the non-overlapping s x s windows of an H x W map, read straight from
 *   the projected (B, H, W, 3 * heads * D) tokens and written in raster order: no window partition or reverse
 *   copies, and no per-window kernel launch. A window cut by the border holds only its real tokens, which is
 *   what padding the map and masking the padded keys computes.
 *
 * Head width D: a multiple of 16 up to 64. Strides are in elements; the last dimension is contiguous. Work is
 * split over (batch, head) items or windows with OpenMP; built against the libgomp that PyTorch has loaded, the
 * kernels share PyTorch's worker threads. Written with GCC vector extensions: a v16 is one AVX-512 register
 * (two AVX2 ones, four NEON ones), whatever -march=native offers.
 */
#include <stdint.h>
#include <stdlib.h>

typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));
typedef int32_t i16v __attribute__((vector_size(64)));

#define INLINE static inline __attribute__((always_inline))
#define R 6 /* query rows per register block of the Lo-Fi kernel: 6 x 4 accumulators + 4 + 1 of 32 registers */
#define MAXW 64 /* most tokens in a Hi-Fi window (s <= 8) */

INLINE v16 load(const float *p) { return *(const v16u *)p; }
INLINE void store(float *p, v16 x) { *(v16u *)p = x; }
INLINE v16 splat(float x) { return (v16){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }
INLINE v16 vmax(v16 a, v16 b) { i16v m = a > b; return (v16)(((i16v)a & m) | ((i16v)b & ~m)); }

INLINE v16 fold(v16 x, int add) { /* pairwise max or sum of the 16 lanes, result in every lane */
    static const i16v perm[4] = {{8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7},
                                 {4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11},
                                 {2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13},
                                 {1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14}};
    for (int i = 0; i < 4; i++) {
        v16 y = __builtin_shuffle(x, perm[i]);
        x = add ? x + y : vmax(x, y);
    }
    return x;
}

/* exp(x) for x <= 0 (logits minus their max): 2^n * P(r) with Cephes' expf polynomial, rel. error ~1e-7 */
INLINE v16 vexp(v16 x) {
    const i16v low = x < splat(-87.0f); /* clamp above exp's underflow; a NaN compares false and stays NaN */
    x = (v16)(((i16v)x & ~low) | ((i16v)splat(-87.0f) & low));
    const v16 magic = splat(12582912.0f); /* 1.5 * 2^23: adding it rounds to the nearest integer */
    v16 t = x * splat(1.44269504088896341f) + magic;
    v16 n = t - magic;
    v16 r = x - n * splat(0.693359375f) + n * splat(2.12194440e-4f);
    v16 p = splat(1.9875691500e-4f);
    p = p * r + splat(1.3981999507e-3f);
    p = p * r + splat(8.3334519073e-3f);
    p = p * r + splat(4.1665795894e-2f);
    p = p * r + splat(1.6666665459e-1f);
    p = p * r + splat(5.0000001201e-1f);
    p = p * r * r + r + splat(1.0f);
    const i16v nan = x != x; /* a NaN's payload bits would corrupt the exponent arithmetic: pass x through */
    return (v16)((((i16v)p + (((i16v)t - (i16v)magic) << 23)) & ~nan) | ((i16v)x & nan));
}

/* One (batch, head) item of the Lo-Fi attention: N queries (row stride qn), M keys / values (row stride kn). */
INLINE void lofi_item(const int DV, const int J, const float *q, long qn, const float *k, const float *v, long kn,
                      int M, float *o, long on, int N, float scale, float *kt, float *p) {
    const int D = DV * 16, MP = J * 16;
    for (int d = 0; d < D; d++) /* scaled keys, transposed: kt[d][m], zero-padded to MP keys */
        for (int m = 0; m < MP; m++) kt[d * MP + m] = m < M ? k[m * kn + d] * scale : 0.0f;
    v16 pad = splat(0.0f); /* pushes the padded keys' logits to ~-inf */
    for (int i = 0; i < 16; i++) pad[i] = MP - 16 + i < M ? 0.0f : -1e30f;
    for (int n0 = 0; n0 < N; n0 += R) {
        const int rows = N - n0 < R ? N - n0 : R;
        const float *qr[R];
        for (int r = 0; r < R; r++) qr[r] = q + (long)(n0 + (r < rows ? r : 0)) * qn;
        v16 s[R][4];
        for (int r = 0; r < R; r++)
            for (int j = 0; j < J; j++) s[r][j] = splat(0.0f);
        for (int d = 0; d < D; d++) {
            v16 kv[4];
            for (int j = 0; j < J; j++) kv[j] = load(kt + d * MP + 16 * j);
            for (int r = 0; r < R; r++) {
                v16 qb = splat(qr[r][d]);
                for (int j = 0; j < J; j++) s[r][j] += qb * kv[j];
            }
        }
        v16 inv[R];
        for (int r = 0; r < R; r++) {
            s[r][J - 1] += pad;
            v16 mx = s[r][0];
            for (int j = 1; j < J; j++) mx = vmax(mx, s[r][j]);
            mx = fold(mx, 0);
            v16 sum = splat(0.0f);
            for (int j = 0; j < J; j++) {
                v16 e = vexp(s[r][j] - mx);
                store(p + r * MP + 16 * j, e);
                sum += e;
            }
            inv[r] = splat(1.0f) / fold(sum, 1);
        }
        v16 acc[R][4];
        for (int r = 0; r < R; r++)
            for (int j = 0; j < DV; j++) acc[r][j] = splat(0.0f);
        for (int m = 0; m < M; m++) {
            v16 vv[4];
            for (int j = 0; j < DV; j++) vv[j] = load(v + m * kn + 16 * j);
            for (int r = 0; r < R; r++) {
                v16 pb = splat(p[r * MP + m]);
                for (int j = 0; j < DV; j++) acc[r][j] += pb * vv[j];
            }
        }
        for (int r = 0; r < rows; r++)
            for (int j = 0; j < DV; j++) store(o + (long)(n0 + r) * on + 16 * j, acc[r][j] * inv[r]);
    }
}

#define LOFI(DV, J) \
    case (DV - 1) * 4 + J - 1: lofi_item(DV, J, qi, qn, ki, vi, kn, M, oi, on, N, scale, kt, p); break;

/* All B * H (batch, head) items on `threads` threads. q: (B, H, N, D) with strides qb, qh, qn; k and v: (B, H, M, D)
 * sharing the strides kb, kh, kn; o: strides ob, oh, on. Returns 0, 1 for an unsupported shape, 2 when out of
 * memory. */
int lofi_attention(const float *q, long qb, long qh, long qn, const float *k, const float *v, long kb, long kh,
                   long kn, float *o, long ob, long oh, long on, int B, int H, int N, int M, int D, float scale,
                   int threads) {
    if (D <= 0 || D > 64 || D % 16 || M <= 0 || M > 64) return 1;
    const int J = (M + 15) / 16;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        float *kt = malloc(sizeof(float) * (D + R) * J * 16);
        float *p = kt ? kt + D * J * 16 : NULL;
        if (!kt) {
#pragma omp atomic write
            failed = 2;
        }
#pragma omp for schedule(static)
        for (long i = 0; i < (long)B * H; i++) {
            if (!kt) continue;
            const long b = i / H, h = i % H;
            const float *qi = q + b * qb + h * qh, *ki = k + b * kb + h * kh, *vi = v + b * kb + h * kh;
            float *oi = o + b * ob + h * oh;
            switch ((D / 16 - 1) * 4 + J - 1) {
                LOFI(1, 1) LOFI(1, 2) LOFI(1, 3) LOFI(1, 4) LOFI(2, 1) LOFI(2, 2) LOFI(2, 3) LOFI(2, 4)
                LOFI(3, 1) LOFI(3, 2) LOFI(3, 3) LOFI(3, 4) LOFI(4, 1) LOFI(4, 2) LOFI(4, 3) LOFI(4, 4)
            }
        }
        free(kt);
    }
    return failed;
}

/* One window of the Hi-Fi attention, all heads: T tokens, the t-th at offset xt[t] in x and ot[t] in o. */
INLINE void hifi_window(const int DV, const float *x, long qo, long ko, long vo, float *o, const long *xt,
                        const long *ot, int T, int heads, float scale) {
    const int D = DV * 16;
    float logit[MAXW];
    for (int h = 0; h < heads; h++) {
        for (int t = 0; t < T; t++) {
            const float *qt = x + xt[t] + qo + h * D;
            v16 qv[4];
            for (int j = 0; j < DV; j++) qv[j] = load(qt + 16 * j) * splat(scale);
            float mx = -3.0e38f;
            for (int u = 0; u < T; u++) {
                const float *ku = x + xt[u] + ko + h * D;
                v16 a = qv[0] * load(ku);
                for (int j = 1; j < DV; j++) a += qv[j] * load(ku + 16 * j);
                const float l = fold(a, 1)[0];
                logit[u] = l;
                mx = l > mx ? l : mx;
            }
            float sum = 0.0f;
            for (int u0 = 0; u0 < T; u0 += 16) {
                v16 l = splat(-87.0f);
                for (int i = 0; i < 16 && u0 + i < T; i++) l[i] = logit[u0 + i] - mx;
                v16 e = vexp(l);
                for (int i = 0; i < 16 && u0 + i < T; i++) logit[u0 + i] = e[i], sum += e[i];
            }
            v16 acc[4];
            for (int j = 0; j < DV; j++) acc[j] = splat(0.0f);
            for (int u = 0; u < T; u++) {
                const float *vu = x + xt[u] + vo + h * D;
                const v16 pu = splat(logit[u] / sum);
                for (int j = 0; j < DV; j++) acc[j] += pu * load(vu + 16 * j);
            }
            float *out = o + ot[t] + h * D;
            for (int j = 0; j < DV; j++) store(out + 16 * j, acc[j]);
        }
    }
}

/* All B * ceil(H / s) * ceil(W / s) windows on `threads` threads. x: (B, H, W, C) projected tokens with
 * strides xb, xr (row), xc (column); q, k, v of head h at channels qo + h D, ko + h D, vo + h D. o: (B, H, W,
 * heads * D) with strides ob, or, oc. Returns 0, or 1 for an unsupported shape. */
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
            case 1: hifi_window(1, x, qo, ko, vo, o, xt, ot, T, heads, scale); break;
            case 2: hifi_window(2, x, qo, ko, vo, o, xt, ot, T, heads, scale); break;
            case 3: hifi_window(3, x, qo, ko, vo, o, xt, ot, T, heads, scale); break;
            default: hifi_window(4, x, qo, ko, vo, o, xt, ot, T, heads, scale); break;
        }
    }
    return 0;
}
