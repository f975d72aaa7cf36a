/* The residual step of a dense tanh layer and its adjoint, for narrow layers on a CPU.
 *
 * For `count` layers n, each with its weight W_n (d, d), bias b_n (d) and `rows` states
 * u_n (rows, d):
 *
 *   step:  out_n = g_n + u_n + h tanh(u_n W_n^T + b_n)         (keeps y_n = tanh(...))
 *   vjp:   out_n = g_n + w_n + h s_n W_n,  s_n = w_n * (1 - y_n^2)
 *          and, for the parameters, gw_n = s_n^T x_n, gb_n = sum of the rows of s_n
 *          (x_n: the states the forward step started from; not scaled by h)
 *          A layer whose w_n is all zeros (NaN is not zero) gets out_n = g_n (zero
 *          without g) and zero parameter cotangents without reading y_n and x_n: the
 *          adjoint's zero check (much of a first backward cycle is zero), made here.
 *
 * g (and keep, gw, gb) may be null. Layer n's data starts n times its stride after the
 * first layer's (strides in elements, any sign): a batch of layers is a strided view of a
 * stacked parameter tensor. Each layer's own rows are contiguous. A step's result may be
 * written over its input (out == u): each row is computed in full before it is stored. The
 * `_one` variants take one layer with contiguous operands.
 *
 * At width 32 and one state a step is about a thousand multiply-adds, less work than one
 * call of torch's CPU dispatcher: these kernels replace four or five torch calls with one.
 * Built by mgrit/native.py with the system C compiler; GCC/Clang vector extensions. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_WIDTH 1024   /* d above this: refused (a row is kept on the stack) */

/* tanh over d values: glibc's vector tanh (libmvec, AVX2: 4 doubles or 8 floats a call)
 * where the build links it (MGRIT_LIBMVEC), the C library's scalar one for the rest and
 * elsewhere. A step's d values are a fixed split of vector and scalar calls, so every path
 * through these kernels gives the same bits for the same operands. */
#if defined(MGRIT_LIBMVEC) && defined(__AVX2__) && defined(__x86_64__)
#include <immintrin.h>
__m256d _ZGVdN4v_tanh(__m256d);
__m256 _ZGVdN8v_tanhf(__m256);
static inline void tanh_all_f64(double *y, int64_t d) {
    int64_t i = 0;
    for (; i + 4 <= d; i += 4) _mm256_storeu_pd(y + i, _ZGVdN4v_tanh(_mm256_loadu_pd(y + i)));
    for (; i < d; ++i) y[i] = tanh(y[i]);
}
static inline void tanh_all_f32(float *y, int64_t d) {
    int64_t i = 0;
    for (; i + 8 <= d; i += 8) _mm256_storeu_ps(y + i, _ZGVdN8v_tanhf(_mm256_loadu_ps(y + i)));
    for (; i < d; ++i) y[i] = tanhf(y[i]);
}
#else
static inline void tanh_all_f64(double *y, int64_t d) {
    for (int64_t i = 0; i < d; ++i) y[i] = tanh(y[i]);
}
static inline void tanh_all_f32(float *y, int64_t d) {
    for (int64_t i = 0; i < d; ++i) y[i] = tanhf(y[i]);
}
#endif

/* whether the vector tanh was built in (the layer kernels choose batch sizes by it) */
int mgrit_dense_vector_tanh(void) {
#if defined(MGRIT_LIBMVEC) && defined(__AVX2__) && defined(__x86_64__)
    return 1;
#else
    return 0;
#endif
}

#define DEFINE_DENSE(T, SUFFIX)                                                            \
typedef T dvec_##SUFFIX __attribute__((vector_size(32)));                                  \
enum { DLANES_##SUFFIX = 32 / sizeof(T) };                                                 \
                                                                                           \
/* the dot product of a and b, d values each */                                            \
static inline T dot_##SUFFIX(const T *a, const T *b, int64_t d) {                          \
    dvec_##SUFFIX acc = {0}, x, y;                                                         \
    int64_t j = 0;                                                                         \
    for (; j + DLANES_##SUFFIX <= d; j += DLANES_##SUFFIX) {                               \
        memcpy(&x, a + j, sizeof x);                                                       \
        memcpy(&y, b + j, sizeof y);                                                       \
        acc += x * y;                                                                      \
    }                                                                                      \
    T sum = 0;                                                                             \
    for (int k = 0; k < DLANES_##SUFFIX; ++k) sum += acc[k];                               \
    for (; j < d; ++j) sum += a[j] * b[j];                                                 \
    return sum;                                                                            \
}                                                                                          \
                                                                                           \
/* o = g + base + h inc over d values (g may be null; o may be base) */                    \
static inline void residual_##SUFFIX(T *o, const T *base, const T *inc, const T *g, T h,   \
                                     int64_t d) {                                          \
    for (int64_t i = 0; i < d; ++i) {                                                      \
        T v = base[i] + h * inc[i];                                                        \
        o[i] = g ? g[i] + v : v;                                                           \
    }                                                                                      \
}                                                                                          \
                                                                                           \
/* whether the n values at x are all zero (-0.0 is; NaN is not) */                         \
static inline int is_zero_##SUFFIX(const T *x, int64_t n) {                                \
    for (int64_t i = 0; i < n; ++i)                                                        \
        if (x[i] != 0) return 0;                                                           \
    return 1;                                                                              \
}                                                                                          \
                                                                                           \
int mgrit_dense_tanh_##SUFFIX(const T *u, int64_t su, const T *w, int64_t sw, const T *b, \
                              int64_t sb, const T *g, int64_t sg, T *out, int64_t so,      \
                              T *keep, int64_t sk, T h, int64_t count, int64_t rows,       \
                              int64_t d) {                                                 \
    if (d > MAX_WIDTH) return 2;                                                           \
    T y[MAX_WIDTH];                                                                        \
    for (int64_t n = 0; n < count; ++n) {                                                  \
        const T *wn = w + n * sw, *bn = b ? b + n * sb : NULL;                             \
        for (int64_t r = 0; r < rows; ++r) {                                               \
            const T *ur = u + n * su + r * d;                                              \
            for (int64_t i = 0; i < d; ++i)                                                \
                y[i] = dot_##SUFFIX(wn + i * d, ur, d) + (bn ? bn[i] : (T)0);              \
            tanh_all_##SUFFIX(y, d);                                                       \
            if (keep) memcpy(keep + n * sk + r * d, y, d * sizeof(T));                     \
            residual_##SUFFIX(out + n * so + r * d, ur, y, g ? g + n * sg + r * d : NULL,  \
                              h, d);                                                       \
        }                                                                                  \
    }                                                                                      \
    return 0;                                                                              \
}                                                                                          \
                                                                                           \
int mgrit_dense_tanh_vjp_##SUFFIX(const T *w, int64_t sw, const T *a, int64_t sa,          \
                                  const T *y, int64_t sy, const T *g, int64_t sg, T *out,  \
                                  int64_t so, const T *x, int64_t sx, T *gw, int64_t sgw,  \
                                  T *gb, int64_t sgb, T h, int64_t count, int64_t rows,    \
                                  int64_t d) {                                             \
    if (d > MAX_WIDTH) return 2;                                                           \
    T s[MAX_WIDTH], acc[MAX_WIDTH];                                                        \
    for (int64_t n = 0; n < count; ++n) {                                                  \
        const T *wn = w + n * sw;                                                          \
        T *gwn = gw ? gw + n * sgw : NULL, *gbn = gb ? gb + n * sgb : NULL;                \
        if (gwn) memset(gwn, 0, d * d * sizeof(T));                                        \
        if (gbn) memset(gbn, 0, d * sizeof(T));                                            \
        if (is_zero_##SUFFIX(a + n * sa, rows * d)) {                                      \
            /* the adjoint is linear in a: zero maps to zero, and y and x are not read */  \
            if (out) {                                                                     \
                T *on = out + n * so;                                                      \
                const T *gn = g ? g + n * sg : NULL;                                       \
                if (!gn) memset(on, 0, rows * d * sizeof(T));                              \
                else if (on != gn) memmove(on, gn, rows * d * sizeof(T));                  \
            }                                                                              \
            continue;                                                                      \
        }                                                                                  \
        for (int64_t r = 0; r < rows; ++r) {                                               \
            const T *ar = a + n * sa + r * d, *yr = y + n * sy + r * d;                    \
            for (int64_t i = 0; i < d; ++i) s[i] = ar[i] * (1 - yr[i] * yr[i]);            \
            if (gwn) {                                                                     \
                const T *xr = x + n * sx + r * d;                                          \
                for (int64_t i = 0; i < d; ++i)                                            \
                    for (int64_t j = 0; j < d; ++j) gwn[i * d + j] += s[i] * xr[j];        \
            }                                                                              \
            if (gbn)                                                                       \
                for (int64_t i = 0; i < d; ++i) gbn[i] += s[i];                            \
            if (!out) continue;                                                            \
            for (int64_t j = 0; j < d; ++j) acc[j] = 0;                                    \
            for (int64_t i = 0; i < d; ++i)                                                \
                for (int64_t j = 0; j < d; ++j) acc[j] += s[i] * wn[i * d + j];            \
            residual_##SUFFIX(out + n * so + r * d, ar, acc, g ? g + n * sg + r * d : NULL, \
                              h, d);                                                       \
        }                                                                                  \
    }                                                                                      \
    return 0;                                                                              \
}                                                                                          \
                                                                                           \
/* one layer, everything contiguous: the same with fewer arguments, which a caller through \
 * ctypes converts one by one on every call */                                            \
int mgrit_dense_tanh_one_##SUFFIX(const T *u, const T *w, const T *b, const T *g, T *out,  \
                                  T *keep, T h, int64_t rows, int64_t d) {                 \
    return mgrit_dense_tanh_##SUFFIX(u, 0, w, 0, b, 0, g, 0, out, 0, keep, 0, h, 1, rows, d); \
}                                                                                          \
                                                                                           \
int mgrit_dense_tanh_vjp_one_##SUFFIX(const T *w, const T *a, const T *y, const T *g,      \
                                      T *out, T h, int64_t rows, int64_t d) {              \
    return mgrit_dense_tanh_vjp_##SUFFIX(w, 0, a, 0, y, 0, g, 0, out, 0, NULL, 0, NULL, 0,  \
                                         NULL, 0, h, 1, rows, d);                          \
}                                                                                          \
                                                                                           \
/* a program: `count` steps run in order in one call, step s taking its operands from      \
 * ops[5s..5s+4] (addresses; g may be 0): (u, w, b, g, out) for the step, (w, a, y, g,     \
 * out) for the adjoint. Each step is the one-layer kernel above, so a program gives the    \
 * same bits as its steps called one by one; a step may read what an earlier one wrote      \
 * (a sequential march), which is why they run in the order given. */                     \
int mgrit_dense_tanh_program_##SUFFIX(const int64_t *ops, int64_t count, T h, int64_t rows, \
                                      int64_t d) {                                         \
    for (int64_t s = 0; s < count; ++s) {                                                  \
        const int64_t *o = ops + 5 * s;                                                    \
        int rc = mgrit_dense_tanh_##SUFFIX((const T *)o[0], 0, (const T *)o[1], 0,         \
                                           (const T *)o[2], 0, (const T *)o[3], 0,         \
                                           (T *)o[4], 0, NULL, 0, h, 1, rows, d);          \
        if (rc) return rc;                                                                 \
    }                                                                                      \
    return 0;                                                                              \
}                                                                                          \
                                                                                           \
/* the same with a sixth operand per step, where the step keeps its tanh (the forward's      \
 * final sweep, whose op outputs the adjoint reads) */                                    \
int mgrit_dense_tanh_keep_program_##SUFFIX(const int64_t *ops, int64_t count, T h,         \
                                           int64_t rows, int64_t d) {                      \
    for (int64_t s = 0; s < count; ++s) {                                                  \
        const int64_t *o = ops + 6 * s;                                                    \
        int rc = mgrit_dense_tanh_##SUFFIX((const T *)o[0], 0, (const T *)o[1], 0,         \
                                           (const T *)o[2], 0, (const T *)o[3], 0,         \
                                           (T *)o[4], 0, (T *)o[5], 0, h, 1, rows, d);     \
        if (rc) return rc;                                                                 \
    }                                                                                      \
    return 0;                                                                              \
}                                                                                          \
                                                                                           \
int mgrit_dense_tanh_vjp_program_##SUFFIX(const int64_t *ops, int64_t count, T h,          \
                                          int64_t rows, int64_t d) {                       \
    for (int64_t s = 0; s < count; ++s) {                                                  \
        const int64_t *o = ops + 5 * s;                                                    \
        int rc = mgrit_dense_tanh_vjp_##SUFFIX((const T *)o[0], 0, (const T *)o[1], 0,     \
                                               (const T *)o[2], 0, (const T *)o[3], 0,     \
                                               (T *)o[4], 0, NULL, 0, NULL, 0, NULL, 0, h, \
                                               1, rows, d);                                \
        if (rc) return rc;                                                                 \
    }                                                                                      \
    return 0;                                                                              \
}                                                                                          \
                                                                                           \
/* the adjoint's with the parameter cotangents (the final sweep records them): eight       \
 * operands per step, (w, a, y, g, out, x, gw, gb) */                                       \
int mgrit_dense_tanh_vjp_record_program_##SUFFIX(const int64_t *ops, int64_t count, T h,   \
                                                 int64_t rows, int64_t d) {                \
    for (int64_t s = 0; s < count; ++s) {                                                  \
        const int64_t *o = ops + 8 * s;                                                    \
        int rc = mgrit_dense_tanh_vjp_##SUFFIX((const T *)o[0], 0, (const T *)o[1], 0,     \
                                               (const T *)o[2], 0, (const T *)o[3], 0,     \
                                               (T *)o[4], 0, (const T *)o[5], 0,           \
                                               (T *)o[6], 0, (T *)o[7], 0, h, 1, rows, d); \
        if (rc) return rc;                                                                 \
    }                                                                                      \
    return 0;                                                                              \
}

DEFINE_DENSE(float, f32)
DEFINE_DENSE(double, f64)
