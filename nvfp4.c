/* vLLM's NVFP4 write of float32 blocks of 16, one pass a block, the bits nvfp4.py's torch `quantize` gives
   (nvfp4.py states the arithmetic and calls this through ctypes). Every product, quotient and sum is one float32
   operation rounded to nearest, in torch's order: built without contraction into fused multiply-adds and without
   fast-math, which would round otherwise. A block is one vector of 16 floats (GCC's vector extension: one register
   with AVX-512, two with AVX2); __builtin_shufflevector needs GCC 12 or clang, and an older compiler's failed build
   leaves the write to torch. */

#include <stdint.h>
#include <string.h>

#define BLOCK 16
#define E4M3_MAX 448.0f
#define E4M3_NAN 0x7F
#define E4M3_SMALLEST_NORMAL 0x1p-6f
#define E2M1_MAX 6.0f
#define SIGN 0x80000000
#define INF_BITS 0x7F800000

typedef float vf __attribute__((vector_size(BLOCK * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(BLOCK * sizeof(int32_t))));
typedef float vf8 __attribute__((vector_size(BLOCK / 2 * sizeof(float))));
typedef int32_t vi8 __attribute__((vector_size(BLOCK / 2 * sizeof(int32_t))));
typedef uint8_t vb8 __attribute__((vector_size(BLOCK / 2)));

#define EVEN(v) __builtin_shufflevector(v, v, 0, 2, 4, 6, 8, 10, 12, 14)
#define ODD(v) __builtin_shufflevector(v, v, 1, 3, 5, 7, 9, 11, 13, 15)

static inline uint32_t bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

/* a where mask, else b (masks as comparisons give them: all ones or zero) */
static inline vf select(vi mask, vf a, vf b) { return (vf)((mask & (vi)a) | (~mask & (vi)b)); }
static inline vf larger(vf a, vf b) { return select(a > b, a, b); }

/* e4m3fn byte of v clamped to ±448, to nearest even; NaN as 0x7F, as to_fp8(..., saturate=True) stores it */
static inline uint8_t e4m3(float v) {
    if (v != v) return E4M3_NAN;
    uint8_t sign = (bits(v) >> 24) & 0x80;
    float a = __builtin_fabsf(v);
    a = a < E4M3_MAX ? a : E4M3_MAX;
    if (a < E4M3_SMALLEST_NORMAL) return sign | (uint8_t)__builtin_rintf(a * 512.0f); /* steps of 2**-9: exact */
    uint32_t u = bits(a);
    u += 0x7FFFF + ((u >> 20) & 1); /* 23 mantissa bits to 3, to nearest even; a carry moves the exponent */
    return sign | (uint8_t)((u >> 20) - (120u << 3)); /* float32's exponent bias 127 to e4m3's 7 */
}

/* y with NaN as +inf, as e2m1_codes reads it */
static inline vf finite_or_inf(vf y) { return select(y != y, (vf)((vi){} + INF_BITS), y); }

/* e2m1 magnitude code (0..7) of |y|, to nearest even (ties 0.25, 1.25, 2.5, 5 down; 0.75, 1.75, 3.5 up), 7 past
   5: what the three roundings of e2m1_codes give, by comparisons, which are exact */
static inline vi magnitude_code(vf y) {
    vf a = (vf)((vi)y & ~SIGN);
    return -((a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) + (a >= 3.5f) + (a > 5.0f));
}

/* e2m1 values of magnitude codes, with y's sign: 2c - 8, c - 2 and c / 2, whichever is largest, as e2m1_rounded */
static inline vf e2m1_value(vi code, vf y) {
    vf c = __builtin_convertvector(code, vf);
    vf value = larger(larger(c * 0.5f, c - 2.0f), c * 2.0f - 8.0f);
    return (vf)((vi)value | ((vi)y & SIGN));
}

typedef struct {
    float wanted, scale, output_scale;
    uint8_t byte;
} candidate;

static inline candidate choose(float bmax, float g, float inv_g, float rcp_target, const float *e4m3_values) {
    candidate c;
    c.wanted = g * (bmax * rcp_target);
    c.byte = e4m3(c.wanted);
    c.scale = e4m3_values[c.byte];
    c.output_scale = c.scale == 0.0f ? 0.0f : 1.0f / (c.scale * inv_g);
    return c;
}

/* _squared_error: (e2m1 value of x * m, times 1/m, minus x) squared, pairs summed, then the pairs in turn */
static inline float squared_error(vf x, float m) {
    float read_back = m == 0.0f ? 0.0f : 1.0f / m;
    vf y = finite_or_inf(x * m);
    vf d = e2m1_value(magnitude_code(y), y) * read_back - x;
    vf error = d * d;
    vf8 pairs = EVEN(error) + ODD(error);
    float total = pairs[0];
    for (int i = 1; i < BLOCK / 2; i++) total = total + pairs[i];
    return total;
}

/* the largest |x| of a block, NaN where it holds one: non-negative floats order as their bits, NaNs above inf */
static inline float block_max(vf x) {
    vi a = (vi)x & ~SIGN;
    vi8 m8 = __builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7);
    vi8 h8 = __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15);
    m8 = (vi8)((m8 > h8) & m8) | (~(m8 > h8) & h8);
    int32_t m = m8[0];
    for (int i = 1; i < BLOCK / 2; i++) m = m8[i] > m ? m8[i] : m;
    if (m > INF_BITS) return __builtin_nanf("");
    float f;
    memcpy(&f, &m, sizeof f);
    return f;
}

/* x [rows, blocks * 16]; g = 1/s per row; four_over_six: also the block scale mapping bmax to 4, kept where its
   squared error is strictly lower. Out: codes [rows, blocks * 8] (even value in the low nibble), block-scale bytes
   [rows, blocks], counts {saturated scales, subnormal scales, zeroed blocks, clipped values, values whose e2m1 *
   block scale passes 448} added to, and where
   `values` is not NULL each value's e2m1 * block scale, or e2m1 * (block scale * s[row]) where `s` is not NULL.
   e4m3_values: the 256 e4m3 bytes as float32. */
void nvfp4_write(const float *x, const float *g, const float *s, long rows, long blocks, int four_over_six,
                 const float *e4m3_values, uint8_t *codes, uint8_t *scales, float *values, int64_t *counts) {
    const float rcp_six = 1.0f / 6.0f, rcp_four = 1.0f / 4.0f;
    for (long r = 0; r < rows; r++) {
        float inv_g = 1.0f / g[r];
        vi clipped = {};
        for (long b = 0; b < blocks; b++) {
            long at = r * blocks + b;
            vf xb;
            memcpy(&xb, x + at * BLOCK, sizeof xb);
            float bmax = block_max(xb);
            candidate c = choose(bmax, g[r], inv_g, rcp_six, e4m3_values);
            if (four_over_six) {
                candidate four = choose(bmax, g[r], inv_g, rcp_four, e4m3_values);
                if (squared_error(xb, four.output_scale) < squared_error(xb, c.output_scale)) c = four;
            }
            scales[at] = c.byte;
            counts[0] += c.wanted > E4M3_MAX;
            counts[1] += c.scale > 0.0f && c.scale < E4M3_SMALLEST_NORMAL;
            counts[2] += c.scale == 0.0f && bmax > 0.0f;
            vf y = xb * c.output_scale;
            clipped -= (vf)((vi)y & ~SIGN) > E2M1_MAX;
            y = finite_or_inf(y);
            vi magnitude = magnitude_code(y);
            if (c.scale > E4M3_MAX / E2M1_MAX) { /* below, no e2m1 value times the scale passes 448 */
                vf block = e2m1_value(magnitude, y) * c.scale;
                for (int i = 0; i < BLOCK; i++) counts[4] += __builtin_fabsf(block[i]) > E4M3_MAX;
            }
            vi code = magnitude | (vi)(((uint32_t __attribute__((vector_size(sizeof(vi)))))y >> 28) & 0x8);
            vb8 packed = __builtin_convertvector(EVEN(code) | (ODD(code) << 4), vb8);
            memcpy(codes + at * (BLOCK / 2), &packed, sizeof packed);
            if (values) {
                vf v = e2m1_value(magnitude, y) * (s ? c.scale * s[r] : c.scale);
                memcpy(values + at * BLOCK, &v, sizeof v);
            }
        }
        for (int i = 0; i < BLOCK; i++) counts[3] += clipped[i]; /* one a block: no lane overflows */
    }
}
