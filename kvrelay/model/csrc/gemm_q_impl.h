// GGUF-quantized decode GEMM (Q8_0, Q4_1), included once per ISA after gemm_f32_impl.h
// (whose vector helpers and tile shapes it shares): y (M, N) = x (M, K) W^T + b with x
// float32 and W kept as its integer codes, dequantized in registers.
//
// Layout (pack_gguf_blocks): [N/16][K/32 groups][group], a group being the 32 k x 16
// columns of one column block: Q8_0 [16 f16 scales][32 k x 16 int8] (544 bytes),
// Q4_1 [16 f16 scales][16 f16 mins][32 k x 8 bytes: byte c = col c | col c+8 << 4]
// (320 bytes), i.e. the file's bits per weight (8.5 and 5). At each k the 16 codes
// become one float vector (two under AVX2) that every row of the tile multiplies by
// its broadcast x; the scale (and for Q4_1 the min, times the sum of x over the group,
// computed once per call) are applied once per group:
//   sum_k (d q_k + m) x_k = d * sum_k q_k x_k + m * sum_k x_k.
#ifndef KVR_F32_LANES
#error "include gemm_f32_impl.h first"
#endif

namespace kvr {
namespace KVR_ISA {
namespace q {

using f32::vf;
using f32::vzero;
using f32::vset1;
using f32::vfma;
using f32::vadd;
using f32::vload;
using f32::vstore;
using f32::kCols;
using f32::kVecs;
using f32::kTileRows;
using f32::blocks_per_tile;

constexpr int kGroup = 32;

static inline void scales(const uint16_t* h, vf out[kVecs]) {
#if KVR_F32_LANES == 16
  out[0] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)h));
#else
  out[0] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)h));
  out[1] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(h + 8)));
#endif
}

struct Q8_0 {
  static constexpr int kBytes = 32 + kGroup * kCols;
  static constexpr bool kMin = false;
  static inline void codes(const uint8_t* g, int kk, vf out[kVecs]) {
    const int8_t* q = (const int8_t*)(g + 32) + kk * kCols;
#if KVR_F32_LANES == 16
    out[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)q)));
#else
    out[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)q)));
    out[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(q + 8))));
#endif
  }
};

struct Q4_1 {
  static constexpr int kBytes = 64 + kGroup * kCols / 2;
  static constexpr bool kMin = true;
  static inline void codes(const uint8_t* g, int kk, vf out[kVecs]) {
    const __m128i b = _mm_loadl_epi64((const __m128i*)(g + 64 + kk * 8));
    const __m128i mask = _mm_set1_epi8(0x0f);
    const __m128i lo = _mm_and_si128(b, mask);                     // columns 0-7
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);  // columns 8-15
#if KVR_F32_LANES == 16
    out[0] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi64(lo, hi)));
#else
    out[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
    out[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
#endif
  }
};

// sx: (M, G) sums of x over each group (Q4_1's min term); G = K / 32.
template <class Q, int MR, int NB>
static inline void tile(const float* __restrict x, int64_t ldx, const float* __restrict sx,
                        const uint8_t* __restrict wp, int64_t G, int64_t blk,
                        const float* __restrict bias, float* __restrict y, int64_t ldy,
                        int64_t N) {
  constexpr int NV = NB * kVecs;
  vf sum[MR][NV];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NV; ++j) sum[m][j] = vzero();
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* base[NB];
    for (int j = 0; j < NB; ++j) {
      base[j] = wp + ((blk + j) * G + g) * Q::kBytes;
      // the group after next, while this one computes
      for (int l = 0; l < Q::kBytes; l += 64)
        _mm_prefetch((const char*)(base[j] + 2 * Q::kBytes + l), _MM_HINT_T0);
    }
    vf acc[MR][NV];
    for (int m = 0; m < MR; ++m)
      for (int j = 0; j < NV; ++j) acc[m][j] = vzero();
    const float* xg = x + g * kGroup;
    for (int kk = 0; kk < kGroup; ++kk) {
      vf wv[NV];
      for (int j = 0; j < NB; ++j) Q::codes(base[j], kk, wv + j * kVecs);
      for (int m = 0; m < MR; ++m) {
        const vf xb = vset1(xg[m * ldx + kk]);
        for (int j = 0; j < NV; ++j) acc[m][j] = vfma(wv[j], xb, acc[m][j]);
      }
    }
    for (int j = 0; j < NB; ++j) {
      vf d[kVecs];
      scales((const uint16_t*)base[j], d);
      for (int m = 0; m < MR; ++m)
        for (int v = 0; v < kVecs; ++v)
          sum[m][j * kVecs + v] = vfma(acc[m][j * kVecs + v], d[v], sum[m][j * kVecs + v]);
      if constexpr (Q::kMin) {
        vf mn[kVecs];
        scales((const uint16_t*)(base[j] + 32), mn);
        for (int m = 0; m < MR; ++m) {
          const vf s = vset1(sx[m * G + g]);
          for (int v = 0; v < kVecs; ++v)
            sum[m][j * kVecs + v] = vfma(mn[v], s, sum[m][j * kVecs + v]);
        }
      }
    }
  }
  for (int j = 0; j < NB; ++j) {
    const int64_t col = (blk + j) * kCols;
    const int64_t left = N - col;
    float bb[kCols] = {};
    if (bias != nullptr)
      for (int c = 0; c < kCols && c < left; ++c) bb[c] = bias[col + c];
    for (int m = 0; m < MR; ++m) {
      float out[kCols];
      for (int v = 0; v < kVecs; ++v)
        vstore(out + v * KVR_F32_LANES,
               vadd(sum[m][j * kVecs + v], vload(bb + v * KVR_F32_LANES)));
      float* dst = y + m * ldy + col;
      const int64_t n = left < kCols ? left : kCols;
      for (int c = 0; c < n; ++c) dst[c] = out[c];
    }
  }
}

template <class Q, int MR>
static void rows(const float* x, int64_t ldx, const float* sx, const uint8_t* wp, int64_t G,
                 int64_t blk0, int64_t blk1, const float* bias, float* y, int64_t ldy,
                 int64_t N) {
  constexpr int NB = blocks_per_tile(MR);
  int64_t b = blk0;
  for (; b + NB <= blk1; b += NB) tile<Q, MR, NB>(x, ldx, sx, wp, G, b, bias, y, ldy, N);
  for (; b < blk1; ++b) tile<Q, MR, 1>(x, ldx, sx, wp, G, b, bias, y, ldy, N);
}

typedef void (*RowsFn)(const float*, int64_t, const float*, const uint8_t*, int64_t, int64_t,
                       int64_t, const float*, float*, int64_t, int64_t);

template <class Q, int MR>
static RowsFn rows_fn(int mr) {
  if constexpr (MR == 0) {
    return nullptr;
  } else {
    return mr == MR ? rows<Q, MR> : rows_fn<Q, MR - 1>(mr);
  }
}

// Columns of blocks [blk0, blk1) for all M rows; more rows than a tile: row groups
// inside spans of ~192 KiB of codes, which the later groups read from L2.
template <class Q>
static void gemm(const float* x, int64_t ldx, const float* sx, int64_t M, const uint8_t* wp,
                 int64_t K, int64_t blk0, int64_t blk1, const float* bias, float* y,
                 int64_t ldy, int64_t N) {
  const int64_t G = K / kGroup;
  int64_t span = (192 << 10) / (G * Q::kBytes);
  span = span < 1 ? 1 : span;
  for (int64_t b = blk0; b < blk1; b += span) {
    const int64_t e = blk1 - b < span ? blk1 : b + span;
    for (int64_t m = 0; m < M; m += kTileRows) {
      const int64_t mr = M - m < kTileRows ? M - m : kTileRows;
      rows_fn<Q, kTileRows>(int(mr))(x + m * ldx, ldx, sx + m * G, wp, G, b, e, bias,
                                     y + m * ldy, ldy, N);
    }
  }
}

static void gemm_any(int type, const float* x, int64_t ldx, const float* sx, int64_t M,
                     const uint8_t* wp, int64_t K, int64_t blk0, int64_t blk1,
                     const float* bias, float* y, int64_t ldy, int64_t N) {
  if (type == int(QType::Q8_0))
    gemm<Q8_0>(x, ldx, sx, M, wp, K, blk0, blk1, bias, y, ldy, N);
  else
    gemm<Q4_1>(x, ldx, sx, M, wp, K, blk0, blk1, bias, y, ldy, N);
}

}  // namespace q
}  // namespace KVR_ISA
}  // namespace kvr
