/* Sums as vLLM CPU's AMX tiles form them (amx_tiles.py states the order and calls this through ctypes).

   out[b, m, n] = the sum over t of a[b, m, t] * w[b, t, n], float32, with w scaled so that the tiles' flush floor
   is float32's smallest normal: each tile of `depth` terms is summed as two chains from zero, the even terms and the
   odd ones; each fused multiply-add of a chain, the chains' sum and the running total is rounded once, and the
   CPU's flush-to-zero mode turns every result below the smallest normal into zero. x86 detects that after
   rounding, as the tiles' flush of a rounded sum does, so one instruction does a step's add, rounding and flush.
   The mode is this thread's own (MXCSR) and is restored before returning. Subnormal inputs are read as they are.
   Four rows run together: eight independent chains keep the CPU's pipelines busy where one chain would wait on
   each step's latency. */

#if !(defined(__x86_64__) || defined(__i386__)) || !defined(__FMA__)
#error "the flush-to-zero sums need x86 with fused multiply-add"
#endif

#include <immintrin.h>
#include <string.h>

/* one vector register of floats: wider vectors than the CPU's are split into slow pieces */
#if defined(__AVX512F__)
#define LANES 16
#else
#define LANES 8
#endif

typedef float vf __attribute__((vector_size(LANES * sizeof(float))));

/* x * w + c rounded once */
static inline vf fused(float x, vf w, vf c) {
#if LANES == 16
    return (vf)_mm512_fmadd_ps(_mm512_set1_ps(x), (__m512)w, (__m512)c);
#else
    return (vf)_mm256_fmadd_ps(_mm256_set1_ps(x), (__m256)w, (__m256)c);
#endif
}

static inline vf columns(const float *w, long count) {
    vf v = {0};
    memcpy(&v, w, (count < LANES ? count : LANES) * sizeof(float));
    return v;
}

/* ROWS rows of a (stride T) against COUNT (at most LANES) columns of w (stride `stride`), into sums[0..ROWS) */
#define ROW_SUMS(NAME, ROWS, COUNT)                                                                             \
    static inline void NAME(const float *a, long T, const float *w, long stride, long count, long depth,       \
                            vf *sums) {                                                                         \
        (void)count; /* the whole-vector kernels know it */                                                     \
        vf total[ROWS] = {{0}};                                                                                 \
        for (long t0 = 0; t0 < T; t0 += depth) {                                                               \
            long t1 = t0 + depth < T ? t0 + depth : T;                                                          \
            vf even[ROWS] = {{0}}, odd[ROWS] = {{0}};                                                           \
            long t = t0;                                                                                        \
            for (; t + 1 < t1; t += 2) {                                                                        \
                vf w0 = columns(w + t * stride, COUNT), w1 = columns(w + (t + 1) * stride, COUNT);              \
                for (int r = 0; r < ROWS; r++) {                                                                \
                    even[r] = fused(a[r * T + t], w0, even[r]);                                                 \
                    odd[r] = fused(a[r * T + t + 1], w1, odd[r]);                                               \
                }                                                                                               \
            }                                                                                                   \
            if (t < t1) {                                                                                       \
                vf w0 = columns(w + t * stride, COUNT);                                                         \
                for (int r = 0; r < ROWS; r++) even[r] = fused(a[r * T + t], w0, even[r]);                     \
            }                                                                                                   \
            for (int r = 0; r < ROWS; r++) total[r] += even[r] + odd[r];                                        \
        }                                                                                                       \
        for (int r = 0; r < ROWS; r++) sums[r] = total[r];                                                      \
    }

/* whole vectors of columns, with a count the compiler knows, and the last few */
ROW_SUMS(four_rows, 4, LANES)
ROW_SUMS(one_row, 1, LANES)
ROW_SUMS(four_rows_last, 4, count)
ROW_SUMS(one_row_last, 1, count)

/* out [B, M, N], each sum times `unscale` (a power of two: exact), tiles of `depth` terms; a is [B, M, T];
   w[b, t, n] lies at w + b * batch_stride + t * row_stride + n. */
void tile_matmul(const float *a, const float *w, float *out, long B, long M, long T, long N, long batch_stride,
                 long row_stride, long depth, float unscale) {
    unsigned int mode = _mm_getcsr();
    _mm_setcsr(mode | _MM_FLUSH_ZERO_ON);
    long last = B * M;
    for (long row = 0; row < last;) {
        long batch = row / M;
        long end = (batch + 1) * M < last ? (batch + 1) * M : last;
        const float *wb = w + batch * batch_stride;
        for (long n = 0; n < N; n += LANES) {
            long count = N - n < LANES ? N - n : LANES;
            size_t bytes = count * sizeof(float);
            vf sums[4];
            long r = row;
            for (; r + 4 <= end; r += 4) {
                (count == LANES ? four_rows : four_rows_last)(a + r * T, T, wb + n, row_stride, count, depth,
                                                              sums);
                for (int i = 0; i < 4; i++) {
                    sums[i] *= unscale;
                    memcpy(out + (r + i) * N + n, &sums[i], bytes);
                }
            }
            for (; r < end; r++) {
                (count == LANES ? one_row : one_row_last)(a + r * T, T, wb + n, row_stride, count, depth, sums);
                sums[0] *= unscale;
                memcpy(out + r * N + n, &sums[0], bytes);
            }
        }
        row = end;
    }
    _mm_setcsr(mode);
}
