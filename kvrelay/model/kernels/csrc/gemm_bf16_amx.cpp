// bfloat16 GEMM with AMX tiles (Intel Xeon from Sapphire Rapids on) for prefill-sized
// calls: y (M, N) = x (M, K) W^T + b, over the weight gemm_bf16.cpp packs for decode.
// That layout, [N/16][K/2][16 columns][2 k], is AMX's B tile as it is: a 16-column
// block's 16 k pairs from kp on are one tile of 16 rows 64 bytes apart. x's rows are
// A tiles read in place (32 k of 16 rows, ldx apart), so nothing is packed per call.
// float32 sums in the C tiles, rounded to bfloat16 once (with the bias) per element.
//
// Why: oneDNN's packed GEMM (torch.ops.mkldnn._linear_pointwise) picks one thread for
// some shapes on two: at M = 1,024 the SmolLM2 layers' qkv (N 960, K 576) and down
// (N 576, K 1536) ran at one thread's speed, o (N 576) did so at 384-768 rows
// (docs/model.md, "The AMX GEMM"). Here the column blocks are split evenly across the
// threads. With up > 0 (gemm_bf16_amx) the gate/up GEMM also applies SiLU.
//
// Tiles: 0-1 A (two groups of up to 16 rows), 2-3 B (two column blocks), 4-7 C.
#include "kernels.h"
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,amx-tile,amx-bf16")
// GCC 12 warns that its own intrinsics' "undefined" vectors may be used uninitialized
// once inlined here; they are not (as in attn_bf16.cpp).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace kvr {
namespace {

#include "softmax.h"  // exp_neg, compiled for this file's target

constexpr int kLanes = 16;
constexpr int64_t kChunkBytes = 256 << 10;  // x rows per chunk: this much of x, in L2
constexpr int64_t kSpanBytes = 1 << 20;  // weights per span of column blocks, in L2

// r0 rows in A tile 0 and its C tiles (4, 5); r1 in A tile 1 and C tiles 6, 7 (0: unused).
void configure(int r0, int r1) {
  TileConfig c{};
  c.palette = 1;
  const int rows[8] = {r0, r1, kLanes, kLanes, r0, r0, r1, r1};
  for (int t = 0; t < 8; ++t)
    if (rows[t] > 0) c.rows[t] = uint8_t(rows[t]), c.colsb[t] = 64;
  asm volatile("" ::: "memory");  // ldtilecfg reads all 64 bytes of c
  _tile_loadconfig(&c);
}

// A block's C tiles, stored, waiting to be written out as y: rows [0, r0 + r1) x the
// 16-column blocks [blk, blk + nb). Written a few rows at a time while the next block's
// tile multiplies run (the AMX unit works beside the vector units): written after the
// multiplies instead, it left the tiles idle for a fifth of the time.
struct Pending {
  const float* c = nullptr;  // 4 tiles of 16 x 16 floats: C00 C01 C10 C11
  uint16_t* y = nullptr;     // row 0 of the block, column 0
  int64_t blk = 0;
  int r0 = 0, r1 = 0, nb = 0;
  int done = 0, units = 0;  // rows written, of r0 + r1
  bool silu = false;        // C0 is gate, C1 up: y = silu(gate) * up, 16 columns
};

struct Out {
  const float* bias;
  int64_t ldy, N;
  int64_t up;  // silu: the up half's first block (bias: gate's N values, then up's)
};

// x rounded to bfloat16 and back, as the unfused path stores and reloads it.
inline __m512 round_bf16(__m512 x) {
  const __m256i h = (__m256i)_mm512_cvtneps_pbh(x);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// silu(g) * u for one row of 16 columns, op for op as the gate/up GEMM's bfloat16
// output followed by silu_mul_row (kernels_impl.h): g and u rounded to bfloat16,
// silu(g) rounded, the product rounded once by the store.
inline __m256bh silu_mul16(__m512 g, __m512 u) {
  alignas(64) float a[kLanes], out[kLanes];
  _mm512_store_ps(a, round_bf16(g));
#pragma omp simd
  for (int i = 0; i < kLanes; ++i) {
    const float e = exp_neg(-__builtin_fabsf(a[i]));
    out[i] = (a[i] > 0 ? a[i] : a[i] * e) / (1.0f + e);
  }
  return _mm512_cvtneps_pbh(_mm512_mul_ps(round_bf16(_mm512_load_ps(out)), round_bf16(u)));
}

// y = C (+ bias), rounded to bfloat16, for p's rows [p.done, upto): a row's 32 columns
// (both blocks) with one store, so its cache line is written whole at once.
inline void drain(Pending& p, int upto, const Out& o) {
  if (p.silu) {
    const int64_t col = p.blk * kLanes, left = o.N - col;
    const __mmask16 mask = left >= kLanes ? __mmask16(0xffff) : __mmask16((1u << left) - 1);
    const bool b = o.bias != nullptr;
    const __m512 bg = b ? _mm512_maskz_loadu_ps(mask, o.bias + col) : _mm512_setzero_ps();
    const __m512 bu = b ? _mm512_maskz_loadu_ps(mask, o.bias + o.N + col) : _mm512_setzero_ps();
    for (; p.done < upto && p.done < p.units; ++p.done) {
      const int r = p.done;
      const float* c = p.c + (r < kLanes ? 0 : 512) + (r % kLanes) * kLanes;
      const __m256bh v = silu_mul16(_mm512_add_ps(_mm512_load_ps(c), bg),
                                    _mm512_add_ps(_mm512_load_ps(c + 256), bu));
      _mm256_mask_storeu_epi16(p.y + r * o.ldy + col, mask, (__m256i)v);
    }
    return;
  }
  const int64_t col = p.blk * kLanes, left = o.N - col;
  const int64_t width = left < p.nb * kLanes ? left : p.nb * kLanes;
  const __mmask32 mask = width >= 32 ? __mmask32(~0u) : __mmask32((1u << width) - 1);
  const __mmask16 m0 = __mmask16(mask), m1 = __mmask16(mask >> 16);
  const __m512 b0 = o.bias != nullptr ? _mm512_maskz_loadu_ps(m0, o.bias + col) : _mm512_setzero_ps();
  const __m512 b1 =
      o.bias != nullptr ? _mm512_maskz_loadu_ps(m1, o.bias + col + kLanes) : _mm512_setzero_ps();
  for (; p.done < upto && p.done < p.units; ++p.done) {
    const int r = p.done;
    const float* c = p.c + (r < kLanes ? 0 : 512) + (r % kLanes) * kLanes;
    const __m256bh lo = _mm512_cvtneps_pbh(_mm512_add_ps(_mm512_load_ps(c), b0));
    const __m256bh hi = _mm512_cvtneps_pbh(_mm512_add_ps(_mm512_load_ps(c + 256), b1));
    const __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512((__m256i)lo), (__m256i)hi, 1);
    _mm512_mask_storeu_epi16(p.y + r * o.ldy + col, mask, v);
  }
}

// Rows [0, r0 + r1) of x (r1 > 0 with TWO) x column blocks blk (and blk + 1 with NB 2),
// over every k: the tiles as configure(r0, r1) set them. The C tiles go to cbuf, and
// `pending` (an earlier block's, in the other buffer) is written out meanwhile; on
// return, `pending` is this block's.
//
// The weights come from memory for the first rows to take these blocks. With `end`
// (a prefill call's first rows), the next pair's weights, up to end, are fetched into
// L2 meanwhile, a step's share per step. With `near` (a decode-sized call: fewer than 32
// rows, each block taken once), each of this pair's blocks is fetched into L1 two tiles
// ahead of its multiplies instead: at 8-16 rows it streamed the weights 5-10% faster
// (SmolLM2's shapes, in-process A/B; a batch-8 bfloat16 decode step 3-5% shorter),
// where in prefill calls it was no better than the next pair into L2.
//
// SILU: B1 is the up half's block blk + o.up beside gate block blk, and the pending
// write gives silu(gate) * up (bindings' gate/up fusion).
template <bool TWO, int NB, bool SILU = false>
void block(const uint16_t* x, int64_t ldx, const uint16_t* wp, int64_t kpairs, int64_t blk,
           int r0, int r1, uint16_t* y, const Out& o, float* cbuf, Pending& pending,
           const char* end, bool near) {
  _tile_zero(4);
  if constexpr (NB > 1) _tile_zero(5);
  if constexpr (TWO) {
    _tile_zero(6);
    if constexpr (NB > 1) _tile_zero(7);
  }
  const int64_t bsize = kpairs * 2 * kLanes;  // one column block's weights
  const uint16_t* b0 = wp + blk * bsize;
  const uint16_t* b1 = b0 + (SILU ? o.up : 1) * bsize;
  const uint16_t* x1 = x + kLanes * ldx;
  const int64_t stride = ldx * 2, steps = kpairs / kLanes;
  const int per_step = int((pending.units + steps - 1) / steps);
  int upto = 0;
  // the next pair (SILU: the next gate block, and the up block beside it)
  const char* ahead = (const char*)(b0 + (SILU ? 1 : NB) * bsize);
  const char* ahead_up = (const char*)(b1 + bsize);
  asm volatile("" ::: "memory");  // tileloadd (an asm without a memory clobber) reads x
  constexpr int64_t kNear = 2 * kLanes;  // k pairs ahead: two tiles
  for (int64_t kp = 0; kp < kpairs; kp += kLanes) {
    if (near && kp + kNear < kpairs)
      for (int i = 0; i < 16; ++i) {
        _mm_prefetch((const char*)(b0 + (kp + kNear) * 2 * kLanes) + 64 * i, _MM_HINT_T0);
        if constexpr (NB > 1)
          _mm_prefetch((const char*)(b1 + (kp + kNear) * 2 * kLanes) + 64 * i, _MM_HINT_T0);
      }
    for (int i = 0; i < (SILU ? 1 : NB) * 16 && ahead < end; ++i, ahead += 64) {
      _mm_prefetch(ahead, _MM_HINT_T1);
      if constexpr (SILU) _mm_prefetch(ahead_up + 64 * i + 1024 * (kp / kLanes), _MM_HINT_T1);
    }
    _tile_loadd(0, x + 2 * kp, stride);
    _tile_loadd(2, b0 + kp * 2 * kLanes, 64);
    if constexpr (NB > 1) _tile_loadd(3, b1 + kp * 2 * kLanes, 64);
    if constexpr (TWO) _tile_loadd(1, x1 + 2 * kp, stride);
    _tile_dpbf16ps(4, 0, 2);
    if constexpr (NB > 1) _tile_dpbf16ps(5, 0, 3);
    if constexpr (TWO) {
      _tile_dpbf16ps(6, 1, 2);
      if constexpr (NB > 1) _tile_dpbf16ps(7, 1, 3);
    }
    upto += per_step;
    drain(pending, upto, o);
  }
  drain(pending, pending.units, o);
  asm volatile("" ::: "memory");  // the stores below overwrite what drain read
  _tile_stored(4, cbuf, 64);
  if constexpr (NB > 1) _tile_stored(5, cbuf + 256, 64);
  if constexpr (TWO) {
    _tile_stored(6, cbuf + 512, 64);
    if constexpr (NB > 1) _tile_stored(7, cbuf + 768, 64);
  }
  asm volatile("" ::: "memory");  // drain's vector loads read what tilestored wrote
  pending = Pending{cbuf, y, blk, r0, r1, NB, 0, r0 + r1, SILU};
}

// Rows [0, r0 + r1) x the column blocks [blk0, blk1), in pairs; the C buffers alternate.
// `end`, `near`: see block (end nullptr where these rows are not the first to read the
// blocks).
void rows(const uint16_t* x, int64_t ldx, const uint16_t* wp, int64_t kpairs, int64_t blk0,
          int64_t blk1, int r0, int r1, uint16_t* y, const Out& o, float* cbufs,
          Pending& pending, const char* end, bool near) {
  if (o.up > 0) {  // gate blocks one at a time, each with its up block
    for (int64_t b = blk0; b < blk1; ++b) {
      float* c = pending.c == cbufs ? cbufs + 1024 : cbufs;
      r1 > 0 ? block<true, 2, true>(x, ldx, wp, kpairs, b, r0, r1, y, o, c, pending, end, near)
             : block<false, 2, true>(x, ldx, wp, kpairs, b, r0, r1, y, o, c, pending, end, near);
    }
    return;
  }
  for (int64_t b = blk0; b < blk1; b += 2) {
    float* c = pending.c == cbufs ? cbufs + 1024 : cbufs;
    if (r1 > 0)
      b + 2 <= blk1 ? block<true, 2>(x, ldx, wp, kpairs, b, r0, r1, y, o, c, pending, end, near)
                    : block<true, 1>(x, ldx, wp, kpairs, b, r0, r1, y, o, c, pending, end, near);
    else
      b + 2 <= blk1 ? block<false, 2>(x, ldx, wp, kpairs, b, r0, r1, y, o, c, pending, end, near)
                    : block<false, 1>(x, ldx, wp, kpairs, b, r0, r1, y, o, c, pending, end, near);
  }
}

}  // namespace

// Asks Linux for the AMX tile state (given to a process on request) once; false where
// the CPU lacks AMX-BF16 or the kernel refuses it.
bool amx_bf16_usable() {
  static const bool ok = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    const bool bf16 = d & (1u << 22), tile = d & (1u << 24);
    if (!tile || !bf16) return false;
    constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  }();
  return ok;
}

// The columns of blocks [blk0, blk1) for all M rows (K a multiple of 32, checked by the
// caller), blocked for L2: spans of column blocks (up to kSpanBytes of weights) each
// stay in L2 while x passes over them in chunks of rows (up to kChunkBytes); in a chunk,
// each pair of column blocks (its weights in L1) takes every 32 rows in turn. Rows past
// the last whole 32 go in a last pass, under their own tile configuration. The
// configuration is loaded by each call on the calling thread (oneDNN's AMX kernels
// configure tiles their own way).
//
// up > 0: the fused gate/up projection, y (M, N) = silu(x G^T) * (x U^T), where the
// packed weight's blocks [0, up) are G's and [up, 2 up) U's (N = 16 up; bias, if any,
// 2N values); [blk0, blk1) are then gate blocks.
void gemm_bf16_amx(const uint16_t* x, int64_t ldx, int64_t M, const uint16_t* wp, int64_t K,
                   int64_t blk0, int64_t blk1, const float* bias, uint16_t* y, int64_t ldy,
                   int64_t N, int64_t up) {
  alignas(64) float cbufs[2 * 1024];  // two blocks' C tiles: one stored, one written out
  Pending pending;
  const Out o{bias, ldy, N, up};
  const int64_t kpairs = K / 2;
  const int64_t full = M / 32 * 32;  // rows in whole 32-row groups; the rest after
  int64_t chunk = kChunkBytes / (K * 2) / 32 * 32;
  chunk = chunk < 32 ? 32 : chunk;
  int64_t span = kSpanBytes / (kLanes * K * 2) / 2 * 2;
  span = span < 2 ? 2 : span;
  if (full > 0) {
    configure(kLanes, kLanes);
    for (int64_t s = blk0; s < blk1; s += span) {
      const int64_t se = blk1 - s < span ? blk1 : s + span;
      const char* span_end = (const char*)(wp + se * kpairs * 2 * kLanes);
      for (int64_t c = 0; c < full; c += chunk) {
        const int64_t ce = full - c < chunk ? full : c + chunk;
        for (int64_t b = s; b < se; b += 2) {
          const int64_t be = se - b < 2 ? se : b + 2;
          for (int64_t m = c; m < ce; m += 32)
            rows(x + m * ldx, ldx, wp, kpairs, b, be, kLanes, kLanes, y + m * ldy, o, cbufs,
                 pending, m == 0 ? span_end : nullptr, false);
        }
      }
    }
  }
  if (full < M) {  // full == 0: a decode-sized call, fetching near (see block)
    const int r = int(M - full), r0 = r < kLanes ? r : kLanes, r1 = r - r0;
    configure(r0, r1);
    rows(x + full * ldx, ldx, wp, kpairs, blk0, blk1, r0, r1, y + full * ldy, o, cbufs,
         pending, nullptr, full == 0);
  }
  drain(pending, pending.units, o);
  _tile_release();
}

}  // namespace kvr
