/* Direct 'same' stride-1 2-D convolution for narrow layers on a CPU.
 *
 * y[n, o] = b[o] + sum_{c, ky, kx} w[o, c, ky, kx] * x[n, c, . + ky - kh/2, . + kx - kw/2]
 *
 * with zero padding; x (N, Ci, H, W), w (Co, Ci, KH, KW) with odd KH, KW, y (N, Co, H, W),
 * all contiguous. For few channels (W1 has 3) torch's default CPU convolution is far from
 * the arithmetic it needs: this kernel copies each image into a zero-padded buffer, so that
 * every tap becomes a shifted read of one flat array, and computes the output in rows of the
 * padded width (the extra columns are dropped at the end). A tile of outputs for a block of
 * output channels stays in vector registers while all taps are added in.
 *
 * The weight gradient of the same convolution, for an output cotangent g (N, Co, H, W),
 *
 * gw[o, c, ky, kx] = sum_{n, i, j} g[n, o, i, j] * x[n, c, i + ky - kh/2, j + kx - kw/2],
 *
 * reads the same padded images against g laid out in rows of the padded width (zeros in the
 * extra columns); sums over images are kept in double.
 *
 * Built by mgrit/native.py with the system C compiler; GCC/Clang vector extensions. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define TILE_VECTORS 2   /* vectors of outputs per tile */
#define CHANNEL_BLOCK 4  /* output channels per block */

/* offset[k] of tap k = (c, ky, kx) in a padded image of `plane` values, rows of wp */
static void tap_offsets(int64_t *offset, int64_t ci, int64_t kh, int64_t kw, int64_t plane,
                        int64_t wp) {
    for (int64_t c = 0, k = 0; c < ci; ++c)
        for (int64_t ky = 0; ky < kh; ++ky)
            for (int64_t kx = 0; kx < kw; ++kx) offset[k++] = c * plane + ky * wp + kx;
}

/* copy `channels` dense planes of h rows of wd values from src into dst, where planes start
 * `plane` values apart and rows wp values apart (a statement; dst and src of one type) */
#define TO_ROWS(dst, plane, wp, src, channels, h, wd)                                      \
    for (int64_t c_ = 0; c_ < (channels); ++c_)                                            \
        for (int64_t r_ = 0; r_ < (h); ++r_)                                               \
            memcpy((dst) + c_ * (plane) + r_ * (wp), (src) + (c_ * (h) + r_) * (wd),       \
                   (wd) * sizeof *(src))

/* the sizes both kernels share: vector lanes and tile, the padded row width wp and image
 * plane, outputs per channel in rows of wp (rounded up to whole tiles), output channels
 * rounded up to whole blocks, and taps per output channel (a declaration list) */
#define GEOMETRY(SUFFIX)                                                                   \
    typedef vec_##SUFFIX vec;                                                              \
    const int64_t lanes = LANES_##SUFFIX, tile = TILE_VECTORS * LANES_##SUFFIX;            \
    const int64_t wp = wd + kw - 1, plane = (h + kh - 1) * wp;                             \
    const int64_t rows = (h * wp + tile - 1) / tile * tile;                                \
    const int64_t cob = (co + CHANNEL_BLOCK - 1) / CHANNEL_BLOCK * CHANNEL_BLOCK;          \
    const int64_t taps = ci * kh * kw

#define DEFINE_CONV2D(T, SUFFIX)                                                           \
typedef T vec_##SUFFIX __attribute__((vector_size(64)));                                   \
enum { LANES_##SUFFIX = 64 / sizeof(T) };                                                  \
                                                                                           \
int mgrit_conv2d_##SUFFIX(const T *x, const T *w, const T *b, T *y, int64_t n, int64_t ci, \
                          int64_t co, int64_t h, int64_t wd, int64_t kh, int64_t kw) {     \
    GEOMETRY(SUFFIX);                                                                      \
    T *pad = calloc(ci * plane + rows + plane, sizeof(T));                                 \
    T *out = malloc(cob * rows * sizeof(T));                                               \
    T *wt = calloc(cob * taps, sizeof(T));                                                 \
    int64_t *offset = malloc(taps * sizeof(int64_t));                                      \
    if (!pad || !out || !wt || !offset) {                                                  \
        free(pad); free(out); free(wt); free(offset);                                      \
        return 1;                                                                          \
    }                                                                                      \
    memcpy(wt, w, co * taps * sizeof(T));                                                  \
    tap_offsets(offset, ci, kh, kw, plane, wp);                                            \
    for (int64_t s = 0; s < n; ++s) {                                                      \
        const T *xs = x + s * ci * h * wd;                                                 \
        TO_ROWS(pad + kh / 2 * wp + kw / 2, plane, wp, xs, ci, h, wd);                     \
        for (int64_t o0 = 0; o0 < cob; o0 += CHANNEL_BLOCK) {                              \
            const T *wb = wt + o0 * taps;                                                  \
            for (int64_t i0 = 0; i0 < rows; i0 += tile) {                                  \
                vec acc[CHANNEL_BLOCK][TILE_VECTORS];                                      \
                for (int o = 0; o < CHANNEL_BLOCK; ++o) {                                  \
                    T bias = (b && o0 + o < co) ? b[o0 + o] : (T)0;                        \
                    for (int v = 0; v < TILE_VECTORS; ++v) acc[o][v] = (vec){0} + bias;    \
                }                                                                          \
                for (int64_t k = 0; k < taps; ++k) {                                       \
                    const T *src = pad + offset[k] + i0;                                   \
                    vec in[TILE_VECTORS];                                                  \
                    for (int v = 0; v < TILE_VECTORS; ++v)                                 \
                        memcpy(&in[v], src + v * lanes, sizeof(vec));                      \
                    for (int o = 0; o < CHANNEL_BLOCK; ++o) {                              \
                        T weight = wb[o * taps + k];                                       \
                        for (int v = 0; v < TILE_VECTORS; ++v) acc[o][v] += weight * in[v]; \
                    }                                                                      \
                }                                                                          \
                for (int o = 0; o < CHANNEL_BLOCK; ++o)                                    \
                    memcpy(out + (o0 + o) * rows + i0, acc[o], sizeof acc[o]);             \
            }                                                                              \
        }                                                                                  \
        T *ys = y + s * co * h * wd;                                                       \
        for (int64_t o = 0; o < co; ++o)                                                   \
            for (int64_t r = 0; r < h; ++r)                                                \
                memcpy(ys + (o * h + r) * wd, out + o * rows + r * wp, wd * sizeof(T));    \
    }                                                                                      \
    free(pad); free(out); free(wt); free(offset);                                          \
    return 0;                                                                              \
}

#define DEFINE_CONV2D_WEIGHT(T, SUFFIX)                                                    \
int mgrit_conv2d_weight_##SUFFIX(const T *x, const T *g, T *gw, int64_t n, int64_t ci,     \
                                 int64_t co, int64_t h, int64_t wd, int64_t kh, int64_t kw) { \
    GEOMETRY(SUFFIX);                                                                      \
    T *pad = calloc(ci * plane + rows + plane, sizeof(T));                                 \
    T *gl = calloc(cob * rows, sizeof(T));                                                 \
    double *sum = calloc(co * taps, sizeof(double));                                       \
    int64_t *offset = malloc(taps * sizeof(int64_t));                                      \
    if (!pad || !gl || !sum || !offset) {                                                  \
        free(pad); free(gl); free(sum); free(offset);                                      \
        return 1;                                                                          \
    }                                                                                      \
    tap_offsets(offset, ci, kh, kw, plane, wp);                                            \
    for (int64_t s = 0; s < n; ++s) {                                                      \
        const T *xs = x + s * ci * h * wd, *gs = g + s * co * h * wd;                      \
        TO_ROWS(pad + kh / 2 * wp + kw / 2, plane, wp, xs, ci, h, wd);                     \
        TO_ROWS(gl, rows, wp, gs, co, h, wd);                                              \
        for (int64_t k = 0; k < taps; ++k) {                                               \
            for (int64_t o0 = 0; o0 < cob; o0 += CHANNEL_BLOCK) {                          \
                vec acc[CHANNEL_BLOCK][TILE_VECTORS] = {{{0}}};                            \
                for (int64_t i0 = 0; i0 < rows; i0 += tile) {                              \
                    const T *src = pad + offset[k] + i0;                                   \
                    vec in[TILE_VECTORS];                                                  \
                    for (int v = 0; v < TILE_VECTORS; ++v)                                 \
                        memcpy(&in[v], src + v * lanes, sizeof(vec));                      \
                    for (int o = 0; o < CHANNEL_BLOCK; ++o)                                \
                        for (int v = 0; v < TILE_VECTORS; ++v) {                           \
                            vec gv;                                                        \
                            memcpy(&gv, gl + (o0 + o) * rows + i0 + v * lanes, sizeof gv); \
                            acc[o][v] += gv * in[v];                                       \
                        }                                                                  \
                }                                                                          \
                for (int o = 0; o < CHANNEL_BLOCK && o0 + o < co; ++o) {                   \
                    vec total = acc[o][0];                                                 \
                    for (int v = 1; v < TILE_VECTORS; ++v) total += acc[o][v];             \
                    double part = 0.0;                                                     \
                    for (int64_t l = 0; l < lanes; ++l) part += total[l];                  \
                    sum[(o0 + o) * taps + k] += part;                                      \
                }                                                                          \
            }                                                                              \
        }                                                                                  \
    }                                                                                      \
    for (int64_t i = 0; i < co * taps; ++i) gw[i] = (T)sum[i];                             \
    free(pad); free(gl); free(sum); free(offset);                                          \
    return 0;                                                                              \
}

DEFINE_CONV2D(float, f32)
DEFINE_CONV2D(double, f64)
DEFINE_CONV2D_WEIGHT(float, f32)
DEFINE_CONV2D_WEIGHT(double, f64)
