/* The keep masks of mgrit's keyed dropout (mgrit/nn/engine/randomness.py) on a CPU.
 *
 * Element i of a draw is kept where mix((i * G + k) mod 2^32) >= threshold, with k the
 * draw's mixed key and site (computed in Python, once per draw) and `mix` the module's
 * 32-bit xor-shift-multiply hash. The module computes the same on int64 tensors, where
 * each of its twenty-odd operations reads and writes the whole mask's worth of 64-bit
 * integers; here the products are unsigned 32-bit ones, whose wrap-around is the module's
 * "& 0xFFFFFFFF", so one pass keeps to 32-bit lanes and vectorises, and its bits are the
 * module's (docs/performance.md has the figures).
 * Built by mgrit/kernels/build.py with conv2d.c and dense.c. */
#include <stdint.h>

static inline uint32_t mix(uint32_t h) {
    h ^= h >> 16;
    h *= 0x7FEB352Du;
    h ^= h >> 15;
    h *= 0x2C1B3C6Du;
    h ^= h >> 16;
    h *= 0x297A2D39u;
    return h ^ (h >> 15);
}

/* out[i] = 1 where element i of `count` is kept, else 0 (a torch bool tensor's bytes);
 * threshold is at most 2^32 (then nothing is kept). */
int mgrit_keep_mask(uint32_t key, int64_t count, uint64_t threshold, uint8_t *out) {
    if (count < 0 || threshold > ((uint64_t)1 << 32))
        return 2;
    const uint32_t g = 0x61C88647u;
    for (int64_t i = 0; i < count; i++)
        out[i] = (uint64_t)mix((uint32_t)i * g + key) >= threshold;
    return 0;
}
