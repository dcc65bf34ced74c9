/* Decode attention for the embedded engine: one new query token per sequence, float32, on a CPU.

   out[b, h, j, :] = softmax_l(scale * q[b, h, j, :] . k[b, h, l, :], over l < length with mask[b, l] != 0)
                     @ v[b, h, l, :]
   for each row b, key/value head h and query head j of the `group` that share it (grouped-query attention).

   Why a kernel of our own: torch's CPU attention (SDPA's flash kernel) spends most of a decode step packing
   key/value blocks for tiny matrix products (2 queries x 32 dims per head); this reads each key and value row once
   for all the query heads that share it, in two streaming passes: 0.5 ms a layer where SDPA took 1.1 ms and
   reading the cache alone 0.3 ms (engine_bench's batch, one thread). Built by slimeflow.engine.decode_kernel
   with the machine's C compiler; strides are in elements and the last axis of k and v is contiguous; q and out
   are contiguous [batch, kv_heads, group, dim]. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Rows ahead to prefetch: a row is dim floats (128 bytes at dim 32); the hardware prefetcher alone left the
   loads waiting on memory (perf: a third of the kernel's samples on the key load). */
#define PREFETCH_ROWS 16

/* exp(x) for x <= 0 (scores minus their maximum), within 1 ulp of exp on [-87, 0] (checked on 2e7 points against
   double exp): Cody-Waite reduction and a degree-6 polynomial
   (Cephes' expf), as plain arithmetic so that the compiler vectorizes the loop (libm's expf is a scalar call).
   x = -inf (a masked key) gives exactly 0. */
static inline float exp_nonpositive(float x) {
  float c = x < -87.0f ? -87.0f : x;
  float n = (c * 1.44269504088896341f + 12582912.0f) - 12582912.0f; /* round to nearest, vectorizable */
  float r = c - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  int32_t bits = ((int32_t)n + 127) << 23;
  float two_n;
  memcpy(&two_n, &bits, sizeof two_n);
  return x == -INFINITY ? 0.0f : p * two_n;
}

/* One (row, key/value head): `scores` is scratch of group * length floats, `stats` of 2 * group. DIM is a
   constant for the common head sizes, so the loops over it unroll into whole vectors. */
#define HEAD_BODY(DIM)                                                                                        \
  do {                                                                                                        \
    float *maxs = stats, *sums = stats + group;                                                               \
    for (int64_t j = 0; j < group; j++) maxs[j] = -INFINITY;                                                  \
    for (int64_t l = 0; l < length; l++) {                                                                    \
      const float *kr = kp + l * k_sl;                                                                        \
      __builtin_prefetch(kr + PREFETCH_ROWS * k_sl);                                                          \
      __builtin_prefetch(kr + PREFETCH_ROWS * k_sl + 16);                                                     \
      if (!mp[l]) {                                                                                           \
        for (int64_t j = 0; j < group; j++) scores[j * length + l] = -INFINITY;                               \
        continue;                                                                                             \
      }                                                                                                       \
      for (int64_t j = 0; j < group; j++) {                                                                   \
        const float *qr = qp + j * (DIM);                                                                     \
        float s = 0.0f;                                                                                       \
        _Pragma("omp simd reduction(+:s)")                                                                    \
        for (int64_t d = 0; d < (DIM); d++) s += qr[d] * kr[d];                                               \
        s *= scale;                                                                                           \
        scores[j * length + l] = s;                                                                           \
        maxs[j] = s > maxs[j] ? s : maxs[j];                                                                  \
      }                                                                                                       \
    }                                                                                                         \
    for (int64_t j = 0; j < group; j++) {                                                                     \
      float m = maxs[j], total = 0.0f;                                                                        \
      float *sr = scores + j * length;                                                                        \
      _Pragma("omp simd reduction(+:total)")                                                                  \
      for (int64_t l = 0; l < length; l++) {                                                                  \
        float e = exp_nonpositive(sr[l] - m);                                                                 \
        sr[l] = e;                                                                                            \
        total += e;                                                                                           \
      }                                                                                                       \
      sums[j] = total;                                                                                        \
    }                                                                                                         \
    for (int64_t j = 0; j < group; j++) {                                                                     \
      float acc[DIM];                                                                                         \
      for (int64_t d = 0; d < (DIM); d++) acc[d] = 0.0f;                                                      \
      const float *sr = scores + j * length;                                                                  \
      for (int64_t l = 0; l < length; l++) {                                                                  \
        const float *vr = vp + l * v_sl;                                                                      \
        __builtin_prefetch(vr + PREFETCH_ROWS * v_sl);                                                        \
        __builtin_prefetch(vr + PREFETCH_ROWS * v_sl + 16);                                                   \
        float w = sr[l];                                                                                      \
        _Pragma("omp simd")                                                                                   \
        for (int64_t d = 0; d < (DIM); d++) acc[d] += w * vr[d];                                              \
      }                                                                                                       \
      float inv = 1.0f / sums[j];                                                                             \
      for (int64_t d = 0; d < (DIM); d++) op[j * (DIM) + d] = acc[d] * inv;                                   \
    }                                                                                                         \
  } while (0)

#define MAX_DIM 512

static int attend_rows(const float *q, const float *k, const float *v, const int64_t *mask, float *out,
                       int64_t row_begin, int64_t row_end, int64_t kv_heads, int64_t group, int64_t dim,
                       int64_t length, int64_t k_sb, int64_t k_sh, int64_t k_sl, int64_t v_sb, int64_t v_sh,
                       int64_t v_sl, int64_t m_sb, float scale) {
  float *scores = malloc(sizeof(float) * (size_t)(group * length + 2 * group));
  if (!scores) return 1;
  float *stats = scores + group * length;
  for (int64_t b = row_begin; b < row_end; b++) {
    const int64_t *mp = mask + b * m_sb;
    for (int64_t h = 0; h < kv_heads; h++) {
      const float *qp = q + (b * kv_heads + h) * group * dim;
      const float *kp = k + b * k_sb + h * k_sh;
      const float *vp = v + b * v_sb + h * v_sh;
      float *op = out + (b * kv_heads + h) * group * dim;
      switch (dim) {
        case 32: HEAD_BODY(32); break;
        case 64: HEAD_BODY(64); break;
        case 128: HEAD_BODY(128); break;
        default: HEAD_BODY(dim); break;
      }
    }
  }
  free(scores);
  return 0;
}

/* The batch's rows in `threads` shares, one an OpenMP thread. Built with -fopenmp, the library needs libgomp.so.1,
   which resolves to the one torch has already loaded: its threads are torch's own pool, so the kernel does not
   compete with torch's spinning workers (pthreads of our own did: a decode step went from 4.6 to 6.5 ms with 2
   threads on 2 cores). Built without OpenMP, the pragma is ignored and one thread does all. Returns 0, 1 (no
   scratch memory) or 2 (dim too large). */
int slimeflow_decode_attention(const float *q, const float *k, const float *v, const int64_t *mask, float *out,
                               int64_t batch, int64_t kv_heads, int64_t group, int64_t dim, int64_t length,
                               int64_t k_sb, int64_t k_sh, int64_t k_sl,
                               int64_t v_sb, int64_t v_sh, int64_t v_sl,
                               int64_t m_sb, float scale, int64_t threads) {
  if (dim > MAX_DIM) return 2;
  if (threads > batch) threads = batch;
  if (threads < 1) threads = 1;
  int status = 0;
#pragma omp parallel for num_threads(threads) schedule(static) reduction(| : status)
  for (int64_t t = 0; t < threads; t++)
    status |= attend_rows(q, k, v, mask, out, batch * t / threads, batch * (t + 1) / threads, kv_heads, group,
                          dim, length, k_sb, k_sh, k_sl, v_sb, v_sh, v_sl, m_sb, scale);
  return status;
}
