// bfloat16 GEMM for the few rows of a decode step, with AVX-512 BF16 (vdpbf16ps):
// y (M, N) = x (M, K) W^T + b, float32 accumulation, rounded to bfloat16 once.
// The weight is packed once at load into the instruction's pair layout,
// [N/16][K/2][16 columns][2 k], so one 64-byte load feeds 16 columns x 2 k of
// every row, and each weight byte is read from memory once per call (decode is
// weight-bandwidth bound: at 8 rows the arithmetic is small next to the stream).
// No torch and no OpenMP here: bindings.cpp splits the column blocks across threads.
#include "kernels.h"
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")
#include <immintrin.h>

namespace kvr {
namespace {

constexpr int kLanes = 16;

// Lines of weights to fetch into L2 while a tile computes from L2 (see gemm_bf16_pairs):
// `per_step` 64-byte lines from `next` at each k pair, until `end`.
struct Ahead {
  const char* next = nullptr;
  const char* end = nullptr;
  int per_step = 0;
};

// MR rows x NB column blocks of 16, over every k pair.
template <int MR, int NB>
inline void tile(const uint16_t* __restrict x, int64_t ldx, const uint16_t* __restrict wp,
                 int64_t kpairs, int64_t blk, const float* __restrict bias,
                 uint16_t* __restrict y, int64_t ldy, int64_t N, Ahead& ahead) {
  __m512 acc[MR][NB];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_setzero_ps();
  const uint16_t* w[NB];
  for (int j = 0; j < NB; ++j) w[j] = wp + (blk + j) * kpairs * 2 * kLanes;
  typedef int32_t pair __attribute__((may_alias));  // x's k pairs, read as one unit
  const pair* xr[MR];
  for (int m = 0; m < MR; ++m) xr[m] = (const pair*)(x + m * ldx);
  for (int64_t kp = 0; kp < kpairs; ++kp) {
    for (int i = 0; i < ahead.per_step && ahead.next < ahead.end; ++i, ahead.next += 64)
      _mm_prefetch(ahead.next, _MM_HINT_T1);
    __m512bh wv[NB];
    for (int j = 0; j < NB; ++j) {
      _mm_prefetch((const char*)(w[j] + (kp + 16) * 2 * kLanes), _MM_HINT_T0);
      wv[j] = (__m512bh)_mm512_loadu_si512(w[j] + kp * 2 * kLanes);
    }
    for (int m = 0; m < MR; ++m) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(xr[m][kp]);
      for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], wv[j], xb);
    }
  }
  for (int j = 0; j < NB; ++j) {
    const int64_t col = (blk + j) * kLanes;
    const int64_t left = N - col;
    const __mmask16 mask = left >= kLanes ? __mmask16(0xffff) : __mmask16((1u << left) - 1);
    const __m512 b = bias != nullptr ? _mm512_maskz_loadu_ps(mask, bias + col) : _mm512_setzero_ps();
    for (int m = 0; m < MR; ++m) {
      const __m256bh r = _mm512_cvtneps_pbh(_mm512_add_ps(acc[m][j], b));
      _mm256_mask_storeu_epi16(y + m * ldy + col, mask, (__m256i)r);
    }
  }
}

// Column blocks per tile of mr rows: the MR * NB accumulators take at most 16 of the
// 32 vector registers, leaving room for NB weights.
constexpr int blocks_per_tile(int64_t mr) { return mr <= 4 ? 4 : 2; }

template <int MR>
void rows(const uint16_t* x, int64_t ldx, const uint16_t* wp, int64_t kpairs, int64_t blk0,
          int64_t blk1, const float* bias, uint16_t* y, int64_t ldy, int64_t N, Ahead& ahead) {
  constexpr int NB = blocks_per_tile(MR);
  int64_t b = blk0;
  for (; b + NB <= blk1; b += NB) tile<MR, NB>(x, ldx, wp, kpairs, b, bias, y, ldy, N, ahead);
  for (; b < blk1; ++b) tile<MR, 1>(x, ldx, wp, kpairs, b, bias, y, ldy, N, ahead);
}

using RowsFn = void (*)(const uint16_t*, int64_t, const uint16_t*, int64_t, int64_t, int64_t,
                        const float*, uint16_t*, int64_t, int64_t, Ahead&);
constexpr RowsFn kRows[kGemmRows + 1] = {nullptr,  rows<1>, rows<2>, rows<3>, rows<4>,
                                          rows<5>,  rows<6>, rows<7>, rows<8>};

}  // namespace

void pack_bf16_pairs(const uint16_t* w, int64_t N, int64_t K, uint16_t* out) {
  const int64_t kpairs = (K + 1) / 2, nblk = (N + kLanes - 1) / kLanes;
  for (int64_t b = 0; b < nblk; ++b)
    for (int64_t kp = 0; kp < kpairs; ++kp)
      for (int c = 0; c < kLanes; ++c)
        for (int i = 0; i < 2; ++i) {
          const int64_t n = b * kLanes + c, k = 2 * kp + i;
          out[((b * kpairs + kp) * kLanes + c) * 2 + i] = n < N && k < K ? w[n * K + k] : 0;
        }
}

void gemm_bf16_pairs(const uint16_t* x, int64_t ldx, int64_t M, const uint16_t* wp, int64_t K,
                     int64_t blk0, int64_t blk1, const float* bias, uint16_t* y, int64_t ldy,
                     int64_t N) {
  const int64_t kpairs = K / 2;  // K even: checked by the caller
  Ahead none;
  if (M <= kGemmRows) {
    kRows[M](x, ldx, wp, kpairs, blk0, blk1, bias, y, ldy, N, none);
    return;
  }
  // Beyond kGemmRows rows: row groups inside a span of kSpan blocks, so the span's
  // weights, streamed from memory for the first group, come from L2 for the others.
  // While the later groups compute from L2, the next span's weights are fetched into
  // L2 a few lines per k pair: the memory stream then overlaps all the arithmetic
  // instead of only the first group's (at 16-32 rows the first group's share is too
  // small to hide it).
  constexpr int64_t kSpan = 8;
  const int64_t span_bytes = kSpan * kpairs * 2 * kLanes * 2;
  int64_t steps = 0;  // k-pair steps of the later groups' tiles in one span (rows<MR>)
  for (int64_t m = kGemmRows; m < M; m += kGemmRows) {
    const int64_t nb = blocks_per_tile(M - m < kGemmRows ? M - m : kGemmRows);
    steps += (kSpan + nb - 1) / nb * kpairs;
  }
  const int per_step = int((span_bytes / 64 + steps - 1) / steps);
  for (int64_t b = blk0; b < blk1; b += kSpan) {
    const int64_t e = blk1 - b < kSpan ? blk1 : b + kSpan;
    const int64_t e2 = blk1 - e < kSpan ? blk1 : e + kSpan;
    Ahead ahead{(const char*)(wp + e * kpairs * 2 * kLanes),
                (const char*)(wp + e2 * kpairs * 2 * kLanes), per_step};
    for (int64_t m = 0; m < M; m += kGemmRows) {
      const int64_t mr = M - m < kGemmRows ? M - m : kGemmRows;
      kRows[mr](x + m * ldx, ldx, wp, kpairs, b, e, bias, y + m * ldy, ldy, N,
                m == 0 ? none : ahead);
    }
  }
}

}  // namespace kvr
