// Kernel bodies, included once per ISA after a `#pragma GCC target`: plain loops
// that gcc vectorizes for that target. Deliberately no standard-library templates
// here: their instantiations would be merged across translation units by the
// linker and could carry this TU's ISA into code that runs everywhere.
#ifndef KVR_ISA
#error "define KVR_ISA before including kernels_impl.h"
#endif
#include <immintrin.h>
// GCC 12 warns that its own intrinsics' "undefined" vectors (`__Y = __Y`) may be used
// uninitialized once inlined here (transpose.h); they are not.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace kvr {
namespace KVR_ISA {

typedef uint16_t bf16;

static inline float to_f(float x) { return x; }
static inline float to_f(bf16 x) {
  return __builtin_bit_cast(float, uint32_t(x) << 16);
}
template <typename T> static inline T from_f(float x);
template <> inline float from_f<float>(float x) { return x; }
template <> inline bf16 from_f<bf16>(float x) {
  // Round to nearest even, as torch does; NaN stays a (quiet) NaN.
  uint32_t u = __builtin_bit_cast(uint32_t, x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return bf16(u >> 16);
}
// What the torch path rounds to between ops: identity for float32.
template <typename T> static inline float round_t(float x) { return to_f(from_f<T>(x)); }

// --kv-cache-dtype fp8_e4m3: a head's row is D e4m3fn codes (1 sign, 4 exponent bits of
// bias 7, 3 mantissa bits; no infinities, 0x7f NaN, largest 448) and a float16 scale
// s = fp16(amax / 448), code = e4m3(x / s) rounded to nearest even and saturated, as
// torch's `(x / s).clamp(-448, 448).to(torch.float8_e4m3fn)`: the write and
// tests/unit/model/test_kv_fp8.py's reference agree bit for bit.
typedef uint8_t f8;
template <typename C> constexpr bool is_f8 = sizeof(C) == 1;

static inline uint8_t f8_encode(float y) {
  const uint8_t sign = uint8_t((__builtin_bit_cast(uint32_t, y) >> 24) & 0x80u);
  const float a = __builtin_fabsf(y);
  if (!(a < 448.f)) return sign | 0x7e;
  if (a < 0.015625f) return sign | uint8_t(__builtin_nearbyintf(a * 512.f));  // 2^-9 steps
  uint32_t v = __builtin_bit_cast(uint32_t, a);
  v += 0x7ffffu + ((v >> 20) & 1u);  // round to 3 mantissa bits, nearest even
  const uint32_t code = ((((v >> 23) - 120u) << 3) | ((v >> 20) & 7u));
  return sign | uint8_t(code > 0x7e ? 0x7e : code);
}

// One head's D values (float32, as rounded to the model's dtype) to its fp8 row.
static inline void f8_store_head(const float* __restrict x, int D, uint8_t* __restrict dst) {
  float amax = 0.f;
  for (int d = 0; d < D; ++d) amax = __builtin_fmaxf(amax, __builtin_fabsf(x[d]));
  const uint16_t sb = uint16_t(_cvtss_sh(amax / 448.f, _MM_FROUND_TO_NEAREST_INT));
  const float s = _cvtsh_ss(sb);
  for (int d = 0; d < D; ++d) dst[d] = s > 0.f ? f8_encode(x[d] / s) : uint8_t(0);
  __builtin_memcpy(dst + D, &sb, 2);
}

static inline float f8_scale(const uint8_t* head_row, int D) {
  uint16_t sb;
  __builtin_memcpy(&sb, head_row + D, 2);
  return _cvtsh_ss(sb);
}

// dst[d] = e4m3(src[d]) * s for one head's row, exactly (as `code.float() * s` in
// float32): each code's sign and 7 magnitude bits, moved into a float16's (sign << 8,
// magnitude << 7), are the value times 2^-8, subnormals included; F16C widens them.
static inline void f8_load_head(const uint8_t* __restrict src, float* __restrict dst, int D,
                                float s) {
#if KVR_ATTN_LANES == 16
  const __m512 sv = _mm512_set1_ps(s * 256.f);
  const __m256i sg = _mm256_set1_epi16(0x80), mg = _mm256_set1_epi16(0x7f);
  for (int d = 0; d < D; d += 16) {
    const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)(src + d)));
    const __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(w, sg), 8),
                                      _mm256_slli_epi16(_mm256_and_si256(w, mg), 7));
    _mm512_storeu_ps(dst + d, _mm512_mul_ps(_mm512_cvtph_ps(h), sv));
  }
#else
  const __m256 sv = _mm256_set1_ps(s * 256.f);
  const __m128i sg = _mm_set1_epi16(0x80), mg = _mm_set1_epi16(0x7f);
  for (int d = 0; d < D; d += 8) {
    const __m128i w = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i*)(src + d)));
    const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(w, sg), 8),
                                   _mm_slli_epi16(_mm_and_si128(w, mg), 7));
    _mm256_storeu_ps(dst + d, _mm256_mul_ps(_mm256_cvtph_ps(h), sv));
  }
#endif
}

#include "softmax.h"
#include "transpose.h"

template <typename T>
static float sum_squares(const T* __restrict x, int n) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int i = 0; i < n; ++i) acc += to_f(x[i]) * to_f(x[i]);
  return acc;
}

// As transformers' LlamaRMSNorm: normalize in float32, round to the dtype, then
// multiply by the weight (rounded again).
template <typename T>
static void normalize(const T* __restrict x, const T* __restrict w, T* __restrict out, int n,
                      float eps) {
  float inv = 1.0f / __builtin_sqrtf(sum_squares(x, n) / float(n) + eps);
#pragma omp simd
  for (int i = 0; i < n; ++i) out[i] = from_f<T>(to_f(w[i]) * round_t<T>(to_f(x[i]) * inv));
}

template <typename T>
static void rms_norm_row(const void* x, const void* w, void* out, int n, float eps) {
  normalize((const T*)x, (const T*)w, (T*)out, n, eps);
}

template <typename T>
static void add_rms_norm_row(void* hv, const void* rv, const void* w, void* out, int n,
                             float eps) {
  T* __restrict h = (T*)hv;
  const T* __restrict r = (const T*)rv;
#pragma omp simd
  for (int i = 0; i < n; ++i) h[i] = from_f<T>(to_f(h[i]) + to_f(r[i]));
  normalize((const T*)h, (const T*)w, (T*)out, n, eps);
}

template <typename T>
static void silu_mul_row(const void* xv, void* outv, int n) {
  const T* g = (const T*)xv;
  const T* u = g + n;
  T* out = (T*)outv;
  float a[256], e[256];
  for (int i0 = 0; i0 < n; i0 += 256) {
    const int m = n - i0 < 256 ? n - i0 : 256;
#pragma omp simd
    for (int i = 0; i < m; ++i) a[i] = to_f(g[i0 + i]);
    // silu(a) = a * sigmoid(a), from exp(-|a|) (exp_neg needs a non-positive argument).
#pragma omp simd
    for (int i = 0; i < m; ++i) e[i] = exp_neg(-__builtin_fabsf(a[i]));
#pragma omp simd
    for (int i = 0; i < m; ++i) {
      // one division (the two quotients of a select cost two): the same values
      float s = (a[i] > 0 ? a[i] : a[i] * e[i]) / (1.0f + e[i]);
      out[i0 + i] = from_f<T>(round_t<T>(s) * to_f(u[i0 + i]));
    }
  }
}

template <typename T>
static inline void load_f32(const T* __restrict src, float* __restrict dst, int D) {
#pragma omp simd
  for (int d = 0; d < D; ++d) dst[d] = to_f(src[d]);
}

// x * cos + swap_halves(x) * signed_sin, as RotaryTable.apply (sin arrives signed):
// rounded to T, then stored as O (the KV cache's dtype for k: as torch's .to()).
template <typename T, typename O = T>
static void rotate(const T* x, O* out, const float* __restrict cos,
                   const float* __restrict sin, int D) {
  const int h = D / 2;
  float tmp[512];
#pragma omp simd
  for (int i = 0; i < h; ++i) {
    float a = to_f(x[i]), b = to_f(x[i + h]);
    tmp[i] = round_t<T>(a * cos[i]) + round_t<T>(b * sin[i]);
    tmp[i + h] = round_t<T>(b * cos[i + h]) + round_t<T>(a * sin[i + h]);
  }
#pragma omp simd
  for (int i = 0; i < D; ++i) out[i] = from_f<O>(round_t<T>(tmp[i]));
}

// T: qkv's dtype, C: the KV cache's (kd and vd rows).
template <typename T, typename C>
static void rope_write_token(void* qkvv, const float* cos, const float* sin, int H, int KVH,
                             int D, void* kd, void* vd) {
  T* qkv = (T*)qkvv;
  for (int h = 0; h < H; ++h) rotate(qkv + h * D, qkv + h * D, cos, sin, D);
  T* k = qkv + H * D;
  const T* v = k + KVH * D;
  if constexpr (is_f8<C>) {  // per head: D codes and the scale (kFp8ScaleBytes)
    float f[512];
    const int hs = D + kFp8ScaleBytes;
    for (int h = 0; h < KVH; ++h) {
      rotate(k + h * D, f, cos, sin, D);
      f8_store_head(f, D, (f8*)kd + h * hs);
      load_f32(v + h * D, f, D);
      f8_store_head(f, D, (f8*)vd + h * hs);
    }
  } else {
    for (int h = 0; h < KVH; ++h) rotate(k + h * D, (C*)kd + h * D, cos, sin, D);
    if constexpr (sizeof(T) == sizeof(C)) {
      __builtin_memcpy(vd, v, sizeof(T) * KVH * D);
    } else {
      C* out = (C*)vd;
#pragma omp simd
      for (int i = 0; i < KVH * D; ++i) out[i] = from_f<C>(to_f(v[i]));
    }
  }
}

// Vectors of one register: 16 floats (zmm) or, under AVX2 (KVR_ATTN_LANES 8), 8 (ymm).
// A 64-byte vector type under AVX2 left gcc two halves it kept on the stack: the
// 1,024-token prefill's attention ran at about 1.7 GMAC/s, 8.7x slower than torch's
// SDPA (docs/model.md).
#ifndef KVR_ATTN_LANES
#define KVR_ATTN_LANES 16
#endif
constexpr int kW = KVR_ATTN_LANES;
constexpr int kP = 16 / kW;  // vectors per 16 floats
typedef float vw __attribute__((vector_size(kW * 4)));


// Scores of query rows [r0, rows) against a chunk of `nk` <= 16 key rows kf (float32,
// D each, `ks` floats apart): row r sees the chunk's keys [0, lim(r)). DT: head_dim
// known at compile time (64, 128) or 0 (runtime, a multiple of 16). The chunk is
// transposed once (kT, D x 16) and each row accumulates its 16 scores in one vector,
// one lane a key: every score is the same FMA chain over d = 0 .. D-1, whatever the
// number of rows, the tile the query came in or the vector width (ISA). A decode
// row's score then equals a prompt row's bit for bit, so a prompt gives the same KV
// cold, after a cached prefix, chunked or batched (docs/model.md, "One answer per
// request"); a horizontal sum for few rows (decode), as before, made the score depend
// on the tile's row count.
// kT[d * 16 + j] = kf[j * ks + d]: the chunk's nk keys (0 for the lanes past them) as
// 16-wide columns, d < D (a multiple of 16), transposed in registers.
static inline void transpose_keys(const float* __restrict kf, int64_t ks, int nk, int D,
                                  float* __restrict kT) {
#if KVR_ATTN_LANES == 16
  for (int d0 = 0; d0 < D; d0 += 16) {
    __m512i r[16];
    for (int j = 0; j < 16; ++j)
      r[j] = j < nk ? _mm512_loadu_si512((const void*)(kf + j * ks + d0)) : _mm512_setzero_si512();
    transpose16(r);
    for (int d = 0; d < 16; ++d) _mm512_storeu_si512((void*)(kT + (d0 + d) * 16), r[d]);
  }
#else
  for (int d0 = 0; d0 < D; d0 += 8)
    for (int j0 = 0; j0 < 16; j0 += 8) {
      __m256 r[8];
      for (int j = 0; j < 8; ++j)
        r[j] = j0 + j < nk ? _mm256_loadu_ps(kf + (j0 + j) * ks + d0) : _mm256_setzero_ps();
      transpose8(r);
      for (int d = 0; d < 8; ++d) _mm256_storeu_ps(kT + (d0 + d) * 16 + j0, r[d]);
    }
#endif
}

template <int DT>
static inline void scores_chunk(const float* __restrict q, const float* __restrict kf,
                                int64_t ks, int nk, int r0, int rows, int G,
                                int first_pos_minus_pos0, int Drt, float* __restrict s,
                                int s_stride, float* __restrict kT) {
  const int D = DT ? DT : Drt;
  transpose_keys(kf, ks, nk, D, kT);
  // Four rows at a time: four independent FMA chains share each kT load.
  for (int r = r0; r < rows; r += 4) {
    const int nr = rows - r < 4 ? rows - r : 4;
    const float* q0 = q + r * D;
    const float* q1 = q + (r + (nr > 1 ? 1 : 0)) * D;
    const float* q2 = q + (r + (nr > 2 ? 2 : 0)) * D;
    const float* q3 = q + (r + (nr > 3 ? 3 : 0)) * D;
    vw a0[kP] = {}, a1[kP] = {}, a2[kP] = {}, a3[kP] = {};
    for (int d = 0; d < D; ++d) {
      for (int p = 0; p < kP; ++p) {
        vw k;
        __builtin_memcpy(&k, kT + d * 16 + p * kW, kW * 4);
        a0[p] += q0[d] * k;
        a1[p] += q1[d] * k;
        a2[p] += q2[d] * k;
        a3[p] += q3[d] * k;
      }
    }
    float acc[4][16];
    for (int p = 0; p < kP; ++p) {
      __builtin_memcpy(acc[0] + p * kW, &a0[p], kW * 4);
      __builtin_memcpy(acc[1] + p * kW, &a1[p], kW * 4);
      __builtin_memcpy(acc[2] + p * kW, &a2[p], kW * 4);
      __builtin_memcpy(acc[3] + p * kW, &a3[p], kW * 4);
    }
    for (int i = 0; i < nr; ++i) {
      int lim = (r + i) / G - first_pos_minus_pos0 + 1;
      lim = lim < nk ? lim : nk;
      float* sr = s + (r + i) * s_stride;
      for (int j = 0; j < lim; ++j) sr[j] = acc[i][j];
    }
  }
}

// acc[r] += sum_j w[r][j] * vf[j] for the chunk. With head_dim known at compile time
// the accumulator row lives in DT / 16 vector registers (independent FMA chains).
template <int DT>
static inline void weighted_sum_chunk(const float* __restrict w, int w_stride,
                                      const float* __restrict vf, int64_t vs, int nk,
                                      int r0, int rows,
                                      int G, int first_pos_minus_pos0, int Drt,
                                      float* __restrict acc) {
  const int D = DT ? DT : Drt;
  for (int r = r0; r < rows; ++r) {
    int lim = r / G - first_pos_minus_pos0 + 1;
    lim = lim < nk ? lim : nk;
    const float* wr = w + r * w_stride;
    if constexpr (DT != 0) {
      constexpr int NV = DT / kW;
      vw a[NV];
      for (int v = 0; v < NV; ++v) __builtin_memcpy(&a[v], acc + r * D + v * kW, kW * 4);
      for (int j = 0; j < lim; ++j) {
        const float x = wr[j];
        for (int v = 0; v < NV; ++v) {
          vw b;
          __builtin_memcpy(&b, vf + j * vs + v * kW, kW * 4);
          a[v] += x * b;
        }
      }
      for (int v = 0; v < NV; ++v) __builtin_memcpy(acc + r * D + v * kW, &a[v], kW * 4);
    } else {
      float* ar = acc + r * D;
      for (int j = 0; j < lim; ++j) {
        const float x = wr[j];
        const float* vj = vf + j * vs;
#pragma omp simd
        for (int d = 0; d < D; ++d) ar[d] += x * vj[d];
      }
    }
  }
}

constexpr int kChunk = 16;  // key/value rows converted to float32 at a time

// Scores, softmax and the weighted sum for one tile: rows r = i * G + j are query
// token i, head kvh * G + j. Two passes over the context in chunks of up to 16
// positions within a block (scores of every row, then V); each K or V row is read
// from the cache once (bfloat16 converted to float32 once; float32 read in place) and
// used by all query rows of the tile that see it. A decode tile over every KV head
// (t.kvh < 0, one query token: rows r = h * G + j, head h * G + j) takes each chunk's
// whole K/V rows for all heads in turn, as attn_bf16.cpp's decode_all does and why.
template <typename T, typename C, int DT>
static void attend_d(const void* qv, void* outv, const void* cachev, const AttnGeom& g,
                     const AttnTile& t, float* scratch) {
  const bool all = t.kvh < 0;
  const int G = g.H / g.KVH, D = DT ? DT : g.D, heads = all ? g.KVH : 1;
  const int hrows = t.n * G, rows = hrows * heads, h0 = all ? 0 : t.kvh;
  const int ctx = t.pos0 + t.n;  // context of the tile's last query
  const int hs = is_f8<C> ? D + kFp8ScaleBytes : D;  // a head's elements in a cache row
  const int64_t row_elems = int64_t(g.KVH) * hs;
  const int width = heads * D;         // elements of a token's K (or V) row the tile reads
  float* q = scratch;                  // rows x D, scaled
  float* acc = q + rows * D;           // rows x D
  float* kT = acc + rows * D;          // D x kChunk
  float* s = kT + kChunk * D;          // rows x ctx
  float* kf = s + int64_t(rows) * ctx; // kChunk x width
  const T* qb = (const T*)qv;
  for (int i = 0; i < t.n; ++i)
    for (int j = 0; j < G * heads; ++j) {
      const T* src = qb + int64_t(t.tok0 + i) * g.q_stride + int64_t(h0 * G + j) * D;
      float* dst = q + (i * G * heads + j) * D;
#pragma omp simd
      for (int d = 0; d < D; ++d) dst[d] = to_f(src[d]) * g.scale;
    }
  const C* cache = (const C*)cachev + g.layer_off + int64_t(h0) * hs;
  const int64_t v_off = int64_t(g.bs) * row_elems;
  for (int pass = 0; pass < 2; ++pass) {
    for (int p = 0; p < ctx;) {
      const int b = p / g.bs, off = p - b * g.bs;
      int nk = g.bs - off < kChunk ? g.bs - off : kChunk;
      nk = ctx - p < nk ? ctx - p : nk;
      const C* src = cache + t.table[b] * g.block_stride + (pass ? v_off : 0) + off * row_elems;
      if (p + nk < ctx && (!t.fetch || t.fetch->own)) {
        // The next chunk sits in another block whose address the hardware prefetcher
        // cannot guess: ask for its rows now, they arrive while this chunk computes.
        const int pn = p + nk, bn = pn / g.bs, offn = pn - bn * g.bs;
        const bool whole = t.whole_rows || all;
        const C* head0 = whole ? cache - int64_t(h0) * hs : cache;
        const char* nxt = (const char*)(head0 + t.table[bn] * g.block_stride +
                                        (pass ? v_off : 0) + offn * row_elems);
        const int lines = int((whole ? row_elems : hs) * int64_t(sizeof(C)) + 63) / 64;
        for (int j = 0; j < kChunk && pn + j < ctx && offn + j < g.bs; ++j)
          for (int l = 0; l < lines; ++l)
            __builtin_prefetch(nxt + (j * row_elems) * int64_t(sizeof(C)) + l * 64);
      }
      // float32 rows are read where they lie; bfloat16 ones converted once, to kf
      const float* rows_f = kf;
      int64_t stride = width;
      if constexpr (sizeof(C) == sizeof(float)) {
        rows_f = (const float*)src;
        stride = row_elems;
      } else if constexpr (is_f8<C>) {  // each head's codes times its own scale
        for (int j = 0; j < nk; ++j)
          for (int h = 0; h < heads; ++h) {
            const f8* hr = (const f8*)src + j * row_elems + h * hs;
            f8_load_head(hr, kf + j * width + h * D, D, f8_scale(hr, D));
          }
      } else {
        for (int j = 0; j < nk; ++j) load_f32(src + j * row_elems, kf + j * width, width);
      }
      const int rel = p - t.pos0;  // token i sees chunk key j iff j <= i - rel
      const int r0 = (rel > 0 ? rel : 0) * G;
      for (int h = 0; h < heads; ++h) {
        if (t.fetch) t.fetch->step();
        const float* qh = q + h * hrows * D;
        float* sh = s + int64_t(h) * hrows * ctx + p;
        if (pass == 0)
          scores_chunk<DT>(qh, rows_f + h * D, stride, nk, r0, hrows, G, rel, D, sh, ctx, kT);
        else
          weighted_sum_chunk<DT>(sh, ctx, rows_f + h * D, stride, nk, r0, hrows, G, rel, D,
                                 acc + h * hrows * D);
      }
      p += nk;
    }
    if (pass == 1) break;
    for (int r = 0; r < rows; ++r) {
      softmax_row(s + r * ctx, t.pos0 + (r % hrows) / G + 1);
#pragma omp simd
      for (int d = 0; d < D; ++d) acc[r * D + d] = 0.f;
    }
  }
  T* ob = (T*)outv;
  for (int i = 0; i < t.n; ++i)
    for (int j = 0; j < G * heads; ++j) {
      T* dst = ob + int64_t(t.tok0 + i) * g.out_stride + int64_t(h0 * G + j) * D;
      const float* a = acc + (i * G * heads + j) * D;
#pragma omp simd
      for (int d = 0; d < D; ++d) dst[d] = from_f<T>(a[d]);
    }
}

template <typename T, typename C>
static void attend(const void* q, void* out, const void* cache, const AttnGeom& g,
                   const AttnTile& t, float* scratch) {
  if (g.D == 64) return attend_d<T, C, 64>(q, out, cache, g, t, scratch);
  if (g.D == 128) return attend_d<T, C, 128>(q, out, cache, g, t, scratch);
  attend_d<T, C, 0>(q, out, cache, g, t, scratch);
}

template <typename T, typename C>
static const Kernels* make_table() {
  static const Kernels k = {rms_norm_row<T>, add_rms_norm_row<T>, silu_mul_row<T>,
                            rope_write_token<T, C>, attend<T, C>};
  return &k;
}

// dt: the activations' dtype, cache: the KV cache's (--kv-cache-dtype: the model's,
// bfloat16 under float32, or fp8_e4m3 under either; bindings.cpp checks).
static const Kernels* table(DType dt, DType cache) {
  if (cache == DType::FP8)
    return dt == DType::BF16 ? make_table<bf16, f8>() : make_table<float, f8>();
  if (dt == DType::BF16) return make_table<bf16, bf16>();
  return cache == DType::BF16 ? make_table<float, bf16>() : make_table<float, float>();
}

}  // namespace KVR_ISA
}  // namespace kvr
