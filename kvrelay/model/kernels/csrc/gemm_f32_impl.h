// float32 GEMM for the few rows of a decode step, included once per ISA (after
// kernels_impl.h, inside its `#pragma GCC target`) with KVR_F32_LANES 16 (AVX-512) or
// 8 (AVX2 + FMA): y (M, N) = x (M, K) W^T + b, float32 throughout.
//
// The weight is packed once at load (pack_f32_blocks, the same layout for both ISAs)
// into [N/16][K][16 columns]: a column block is one contiguous stream of K * 64 bytes,
// and at each k one 64-byte line (one zmm, two ymm) serves its 16 columns for every
// row of the tile. A tile of MR rows x NB blocks keeps its accumulators in registers
// over all of K and broadcasts x[m][k]; each weight byte then comes from memory once
// per call (decode is weight-bandwidth bound). More rows than a tile holds: row groups
// inside a span of blocks sized for L2, so the later groups read the span from L2.
#ifndef KVR_F32_LANES
#error "define KVR_F32_LANES (16 or 8) before including gemm_f32_impl.h"
#endif
#include <immintrin.h>

namespace kvr {
namespace KVR_ISA {
namespace f32 {

#if KVR_F32_LANES == 16
typedef __m512 vf;
static inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
static inline void vstore(float* p, vf v) { _mm512_storeu_ps(p, v); }
static inline vf vzero() { return _mm512_setzero_ps(); }
static inline vf vset1(float x) { return _mm512_set1_ps(x); }
static inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
// Rows per tile and column blocks per tile of mr rows: the MR * NB accumulators (one
// zmm per block) take at most 16 of the 32 registers, leaving room for NB weights.
constexpr int kTileRows = 16;
constexpr int kPassRows = 16;  // every tile in one pass
constexpr int blocks_per_tile(int mr) { return mr <= 4 ? 4 : mr <= 8 ? 2 : 1; }
#elif KVR_F32_LANES == 8
typedef __m256 vf;
static inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
static inline void vstore(float* p, vf v) { _mm256_storeu_ps(p, v); }
static inline vf vzero() { return _mm256_setzero_ps(); }
static inline vf vset1(float x) { return _mm256_set1_ps(x); }
static inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
// 16 ymm: up to 6 rows, MR * NB * 2 accumulators + NB * 2 weights + one broadcast,
// at most 15. 7-12 rows: two passes of up to 6 rows over each chunk of k (F32::tile).
constexpr int kTileRows = 12;
constexpr int kPassRows = 6;
constexpr int blocks_per_tile(int mr) { return mr <= 2 ? 2 : 1; }
#else
#error "KVR_F32_LANES must be 16 or 8"
#endif

constexpr int kCols = 16;                     // columns per packed block
constexpr int kVecs = kCols / KVR_F32_LANES;  // vectors per block row
constexpr int kAhead = 32;                    // k rows (2 KiB) prefetched ahead per block
// Under AVX2, a tile of 4 rows or more computes long enough per weight line that the
// prefetches into L1 (each holding one of the core's few fill buffers until its line
// arrives) let the memory stream fall behind the arithmetic: such tiles fetch kFar k
// rows (8 KiB) ahead into L2 and only kNear (1 KiB) into L1. The 120 layer GEMMs
// (float32 weights from memory, AVX2 forced on the AMX Xeon, 2 threads): 4 rows
// 22.0 -> 19.5 ms, 6 rows 24.0 -> 21.1-22.0, 8 rows 25.5-25.8 -> 22.8, 12 rows
// 27.7-28.3 -> 25.7-26.8; 1-2 rows 3-7% slower that way, and AVX-512 tiles no faster
// (docs/model.md, "Decode GEMMs (native, float32 ...)").
constexpr int kFar = 128, kNear = 16;
template <int MR>
constexpr bool fetch_far() {
  return KVR_F32_LANES == 8 && MR >= 4;
}
// The k sums run in chunks of kChunkK, each chunk's sums added to the total: the
// rounding error grows with K / kChunkK + kChunkK instead of K (oneDNN blocks K too).
constexpr int64_t kChunkK = 32;

// Lines of the next span's weights to fetch into L2 while a later row group computes
// from L2 (see gemm): `per_step` 64-byte lines from `next` at each k, until `end`.
struct Ahead {
  const char* next = nullptr;
  const char* end = nullptr;
  int per_step = 0;
};

// The epilogue of every tile (float32 and quantized): bias added, the MR rows of NB
// blocks stored, the last block of N possibly partial.
template <int MR, int NB>
static inline void store_tile(vf (&sum)[MR][NB * kVecs], int64_t blk,
                              const float* __restrict bias, float* __restrict y, int64_t ldy,
                              int64_t N) {
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

// The tile walk shared by the float32 and the quantized GEMMs. A kernel Kern has
// Args (its operands, `at_row(m)` moving them to row m), kTileRows, blocks_per_tile(mr),
// kStepK (k per `ahead` step of its tiles) and tile<MR, NB>(args, blk, ahead).
template <class Kern, int MR>
static void rows(const typename Kern::Args& a, int64_t blk0, int64_t blk1, Ahead& ahead) {
  constexpr int NB = Kern::blocks_per_tile(MR);
  int64_t b = blk0;
  for (; b + NB <= blk1; b += NB) Kern::template tile<MR, NB>(a, b, ahead);
  for (; b < blk1; ++b) Kern::template tile<MR, 1>(a, b, ahead);
}

// rows<Kern, mr> for a run-time mr in 1..MR.
template <class Kern, int MR = Kern::kTileRows>
static void rows_of(int mr, const typename Kern::Args& a, int64_t blk0, int64_t blk1,
                    Ahead& ahead) {
  if constexpr (MR > 1) {
    if (mr != MR) return rows_of<Kern, MR - 1>(mr, a, blk0, blk1, ahead);
  }
  rows<Kern, MR>(a, blk0, blk1, ahead);
}

// Columns of blocks [blk0, blk1) for all M rows; block_bytes: one column block's
// packed weight over all of K.
template <class Kern>
static void walk(const typename Kern::Args& a, int64_t M, int64_t K, int64_t blk0,
                 int64_t blk1, int64_t block_bytes) {
  constexpr int64_t TR = Kern::kTileRows;
  Ahead none;
  if (M <= TR) {
    rows_of<Kern>(int(M), a, blk0, blk1, none);
    return;
  }
  // Row groups of at most kTileRows (the widest tile) inside spans of ~192 KiB of
  // weights (at least one block), which stay in L2 while every group passes over
  // them. While the groups compute over one span, every group, the first included,
  // fetches the next span into L2 a few lines per step, so the memory stream runs
  // under all of the arithmetic.
  int64_t span = (192 << 10) / block_bytes;
  span = span < 1 ? 1 : span;
  // Groups of equal size (16 rows under AVX2: 8 + 8, not 12 + 4).
  const int64_t groups = (M + TR - 1) / TR, GR = (M + groups - 1) / groups;
  int64_t steps = 0;  // ahead steps of all the groups' tiles over one span
  for (int64_t m = 0; m < M; m += GR) {
    const int nb = Kern::blocks_per_tile(M - m < GR ? int(M - m) : int(GR));
    steps += (span + nb - 1) / nb * (K / Kern::kStepK);
  }
  const int per_step = int((span * block_bytes / 64 + steps - 1) / steps);
  const char* wp = (const char*)a.wp;
  for (int64_t b = blk0; b < blk1; b += span) {
    const int64_t e = blk1 - b < span ? blk1 : b + span;
    const int64_t e2 = blk1 - e < span ? blk1 : e + span;
    Ahead ahead{wp + e * block_bytes, wp + e2 * block_bytes, per_step};
    for (int64_t m = 0; m < M; m += GR) {
      const int64_t mr = M - m < GR ? M - m : GR;
      rows_of<Kern>(int(mr), a.at_row(m), b, e, ahead);
    }
  }
}

static inline void ahead_step(Ahead& ahead) {
  for (int i = 0; i < ahead.per_step && ahead.next < ahead.end; ++i, ahead.next += 64)
    _mm_prefetch(ahead.next, _MM_HINT_T1);
}

struct F32 {
  struct Args {
    const float* x;
    int64_t ldk;  // x is (K, rows) transposed: x[k * ldk + m], see gemm
    const float* wp;
    int64_t K;
    const float* bias;
    float* y;
    int64_t ldy, N;
    Args at_row(int64_t m) const { return {x + m, ldk, wp, K, bias, y + m * ldy, ldy, N}; }
  };
  static constexpr int kTileRows = f32::kTileRows;
  static constexpr int kStepK = 1;
  static constexpr int blocks_per_tile(int mr) { return f32::blocks_per_tile(mr); }

  // One chunk of k, [k0, k1), for R rows of x (R accumulators per vector of the NB
  // blocks), added to their totals; `ahead`: the pass that fetches ahead (the first).
  template <int R, int NB, bool FAR = false>
  static inline void chunk(const float* __restrict x, int64_t ldk, const float* const w[NB],
                           int64_t k0, int64_t k1,
                           float (*total)[NB * kVecs][KVR_F32_LANES], Ahead* ahead) {
    constexpr int NV = NB * kVecs;
    vf acc[R][NV];
    for (int m = 0; m < R; ++m)
      for (int j = 0; j < NV; ++j) acc[m][j] = vzero();
    for (int64_t k = k0; k < k1; ++k) {
      if (ahead != nullptr) ahead_step(*ahead);
      vf wv[NV];
      for (int j = 0; j < NB; ++j) {
        if (ahead != nullptr) {
          if constexpr (FAR) {
            _mm_prefetch((const char*)(w[j] + (k + kFar) * kCols), _MM_HINT_T1);
            _mm_prefetch((const char*)(w[j] + (k + kNear) * kCols), _MM_HINT_T0);
          } else {
            _mm_prefetch((const char*)(w[j] + (k + kAhead) * kCols), _MM_HINT_T0);
          }
        }
        for (int v = 0; v < kVecs; ++v)
          wv[j * kVecs + v] = vload(w[j] + k * kCols + v * KVR_F32_LANES);
      }
      for (int m = 0; m < R; ++m) {
        const vf xb = vset1(x[k * ldk + m]);
        for (int j = 0; j < NV; ++j) acc[m][j] = vfma(wv[j], xb, acc[m][j]);
      }
    }
    for (int m = 0; m < R; ++m)
      for (int j = 0; j < NV; ++j) vstore(total[m][j], vadd(vload(total[m][j]), acc[m][j]));
  }

  template <int MR, int NB>
  static inline void tile(const Args& a, int64_t blk, Ahead& ahead) {
    constexpr int NV = NB * kVecs;
    // More rows than kPassRows (AVX2, 7-12 rows): a full-width tile would need 2 * MR
    // accumulators, more than the 16 ymm hold; as row groups of 6 + 2 over L2 spans, 8
    // rows took 1.3-1.6x the time of 6. Each chunk of k then runs in two passes (8
    // rows: 4 + 4), the first bringing the chunk's weight lines into L1 and the second
    // reading them there.
    constexpr int kPasses = (MR + kPassRows - 1) / kPassRows;
    constexpr int P = (MR + kPasses - 1) / kPasses;  // rows of every pass but the last
    constexpr int kLast = MR - (kPasses - 1) * P;
    static_assert(kPasses <= 2 && kLast >= 1, "up to two passes");
    // The chunk totals live in memory, touched once per chunk (the asm below keeps
    // them there): held in registers beside the chunk's accumulators they left gcc
    // more live vectors than the 16 ymm, and it spilled an accumulator inside the k
    // loop, a store and a load on its FMA chain every k (under AVX2 the 2- and 4-row
    // tiles ran at half the FMA rate of the 6-row one).
    alignas(64) float total[MR][NV][KVR_F32_LANES] = {};
    const float* w[NB];
    for (int j = 0; j < NB; ++j) w[j] = a.wp + (blk + j) * a.K * kCols;
    for (int64_t k0 = 0; k0 < a.K; k0 += kChunkK) {
      const int64_t k1 = a.K - k0 < kChunkK ? a.K : k0 + kChunkK;
      chunk<P, NB, fetch_far<MR>()>(a.x, a.ldk, w, k0, k1, total, &ahead);
      if constexpr (kPasses == 2)
        chunk<kLast, NB>(a.x + P, a.ldk, w, k0, k1, total + P, nullptr);
      asm volatile("" : "+m"(total));  // keeps gcc from holding the totals in registers
    }
    vf sum[MR][NV];
    for (int m = 0; m < MR; ++m)
      for (int j = 0; j < NV; ++j) sum[m][j] = vload(total[m][j]);
    store_tile<MR, NB>(sum, blk, a.bias, a.y, a.ldy, a.N);
  }
};

// Columns of blocks [blk0, blk1) for all M rows; xt is x transposed, (K, M) (the
// caller copies it): a tile's broadcasts of x[m][k] are then at fixed offsets from one
// pointer that moves by M each k. With a pointer a row, gcc ran out of general
// registers at 8 rows and loaded each row's pointer from the stack before its broadcast.
static inline void gemm(const float* xt, int64_t M, const float* wp, int64_t K, int64_t blk0,
                        int64_t blk1, const float* bias, float* y, int64_t ldy, int64_t N) {
  walk<F32>(F32::Args{xt, M, wp, K, bias, y, ldy, N}, M, K, blk0, blk1,
            K * kCols * int64_t(sizeof(float)));
}

}  // namespace f32
}  // namespace KVR_ISA
}  // namespace kvr
