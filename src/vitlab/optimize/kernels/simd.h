/* vitlab's CPU kernels' vector primitives, included once per instruction set by ops.cpp inside a namespace and
 * a `#pragma GCC target` region that define VW (floats per vector register: 8 for AVX2, 16 for AVX-512) and RB
 * (accumulator registers a register block may hold: 12 of AVX2's 16, 24 of AVX-512's 32): GCC vector types,
 * an exp, a softmax row and the register-blocked weighted sum of values that the kernels in hilo_body.h and
 * causal_body.h share (each computes its logits in a key layout of its own). No headers here: they are included once,
 * outside the target regions. */

typedef float vec __attribute__((vector_size(VW * 4)));
typedef float vecu __attribute__((vector_size(VW * 4), aligned(4)));
typedef int32_t ivec __attribute__((vector_size(VW * 4)));

#define INLINE static inline __attribute__((always_inline))

INLINE vec load(const float *p) { return *(const vecu *)p; }
INLINE void store(float *p, vec x) { *(vecu *)p = x; }
INLINE vec splat(float x) { /* one broadcast; `(vec){} + x` adds a zeroing and an add (-0 + 0 is +0) */
    const vec v = {x};
    return __builtin_shuffle(v, (ivec){});
}
INLINE vec vmax(vec a, vec b) { return a > b ? a : b; }

INLINE vec fold(vec x, bool add) { /* max or sum of all lanes, in every lane (butterfly) */
    for (int half = VW / 2; half >= 1; half /= 2) {
        ivec perm;
        for (int i = 0; i < VW; i++) perm[i] = i ^ half;
        vec y = __builtin_shuffle(x, perm);
        x = add ? x + y : vmax(x, y);
    }
    return x;
}

/* exp(x) for x <= 0 (logits minus their max): 2^n * P(r) with Cephes' expf polynomial, rel. error ~1e-7 */
INLINE vec vexp(vec x) {
    const ivec low = x < splat(-87.0f); /* clamp above exp's underflow; a NaN compares false and stays NaN */
    x = (vec)(((ivec)x & ~low) | ((ivec)splat(-87.0f) & low));
    const vec magic = splat(12582912.0f); /* 1.5 * 2^23: adding it rounds to the nearest integer */
    vec t = x * splat(1.44269504088896341f) + magic;
    vec n = t - magic;
    vec r = x - n * splat(0.693359375f) + n * splat(2.12194440e-4f);
    vec p = splat(1.9875691500e-4f);
    p = p * r + splat(1.3981999507e-3f);
    p = p * r + splat(8.3334519073e-3f);
    p = p * r + splat(4.1665795894e-2f);
    p = p * r + splat(1.6666665459e-1f);
    p = p * r + splat(5.0000001201e-1f);
    p = p * r * r + r + splat(1.0f);
    const ivec nan = x != x; /* a NaN's payload bits would corrupt the exponent arithmetic: pass x through */
    return (vec)((((ivec)p + (((ivec)t - (ivec)magic) << 23)) & ~nan) | ((ivec)x & nan));
}

constexpr int RMAX = 6; /* most query rows in a register block */

constexpr int cmax(int a, int b) { return a > b ? a : b; }
constexpr int cmin(int a, int b) { return a < b ? a : b; }

/* All-ones in the first n lanes (1 <= n <= VW), zeros in the others. */
INLINE ivec first_lanes(int n) {
    ivec lane;
    for (int i = 0; i < VW; i++) lane[i] = i;
    return lane < (ivec){} + n;
}

/* Softmax numerators of one row of logits, in place, over J vectors of which the last holds real logits only in
 * the lanes of `keep` (those beyond: padding or masked keys, set to exactly 0 and left out of the max); returns
 * 1 / their sum. */
INLINE float softmax_row(float *pr, int J, ivec keep) {
    float *tail = pr + VW * (J - 1);
    store(tail, (vec)(((ivec)load(tail) & keep) | ((ivec)splat(-3.0e38f) & ~keep)));
    vec mx = load(pr);
    for (int j = 1; j < J; j++) mx = vmax(mx, load(pr + VW * j));
    mx = fold(mx, false);
    vec sum = splat(0.0f);
    for (int j = 0; j < J; j++) {
        vec e = vexp(load(pr + VW * j) - mx);
        if (j == J - 1) e = (vec)((ivec)e & keep);
        store(pr + VW * j, e);
        sum += e;
    }
    return 1.0f / fold(sum, true)[0];
}

/* Weighted values of R rows for the value vectors j0 .. j0 + DB - 1, scaled by inv[r], into o (row stride on). */
template <int R, int DB>
INLINE void pv_block(const float *p, int MP, const float *v, long kn, int M, int j0, const float *inv, float *o,
                     long on, int rows) {
    vec acc[R][DB];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < DB; j++) acc[r][j] = splat(0.0f);
    for (int m = 0; m < M; m++) {
        vec vv[DB];
        for (int j = 0; j < DB; j++) vv[j] = load(v + m * kn + VW * (j0 + j));
        for (int r = 0; r < R; r++) {
            vec pb = splat(p[r * MP + m]);
            for (int j = 0; j < DB; j++) acc[r][j] += pb * vv[j];
        }
    }
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < DB; j++) store(o + r * on + VW * (j0 + j), acc[r][j] * splat(inv[r]));
}

