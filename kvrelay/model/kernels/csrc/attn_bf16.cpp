// Attention over a bfloat16 cache with AVX-512 BF16, head_dim 64 or 128, blocks a
// multiple of 16 positions: one kernel, prefill() below, for every tile, a decode
// row's included. A query's scores are then the same vdpbf16ps chain whatever tile it
// came in, so a position's output does not depend on whether it was decoded, prefilled
// whole, or prefilled after a cached prefix (docs/model.md, "One answer per request").
// A decode kernel of its own (16 keys' products reduced by a shuffle tree, 3.5x fewer
// instructions per position than the generic kernel) summed in another order and was
// removed for that. The probabilities stay float32 (torch's bfloat16 path rounds them
// to bfloat16 before multiplying by V).
// No torch and no OpenMP here: bindings.cpp runs the tiles in parallel.
#include "kernels.h"
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")
// GCC 12 warns that its own intrinsics' "undefined" vectors (`__Y = __Y`) may be used
// uninitialized once inlined here; they are not.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

namespace kvr {
namespace {

#include "softmax.h"
#include "transpose.h"

// Two bfloat16 values read or written as one 32-bit unit (vdpbf16ps' pair), over
// memory that also holds uint16_t or float: may_alias keeps that defined.
typedef uint32_t pair __attribute__((may_alias));

inline __m512 widen(const uint16_t* p) {  // 16 bfloat16 -> float32
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

// Prefill tiles (n query tokens x the G heads of KV head kvh, up to 64 rows): the
// scores of a 16-key chunk are a small GEMM. The chunk's K rows are transposed once
// into vdpbf16ps' pair layout (kt[d / 2] = the 16 keys' (k[d], k[d + 1])), then four
// query rows at a time accumulate their 16 scores in four registers, one vdpbf16ps per
// pair of dimensions: no reduction, 32 multiply-adds per instruction. Scores a row
// must not see (later positions) are stored as 0 and the softmax stops before them, so
// the V pass needs no mask: V rows widened to float32 once per chunk, then RB rows at
// a time accumulate in registers.
template <int D>
void prefill(const uint16_t* qb, uint16_t* ob, const uint16_t* cache, const AttnGeom& g,
             const AttnTile& t, float* scratch) {
  constexpr int NP = D / 2;                   // 32-bit pairs of a head
  constexpr int NV = D / 16;                  // float32 vectors of a head
  constexpr int RB = NV >= 16 ? 1 : 16 / NV;  // rows whose V sums fit 16 registers
  const int G = g.H / g.KVH, rows = t.n * G, ctx = t.pos0 + t.n;
  const int64_t row = int64_t(g.KVH) * D, v_off = int64_t(g.bs) * row;
  float* s = scratch;                           // rows x ctx
  float* acc = s + int64_t(rows) * ctx;         // rows x D
  pair* kt = (pair*)(acc + int64_t(rows) * D);  // NP x 16
  float* vf = (float*)(kt + NP * 16);           // 16 x D
  const uint16_t* base = cache + g.layer_off + int64_t(t.kvh) * D;
  auto q_row = [&](int r) {  // row r: token r / G, head kvh * G + r % G
    return (const pair*)(qb + int64_t(t.tok0 + r / G) * g.q_stride +
                         int64_t(t.kvh * G + r % G) * D);
  };
  const __m512 scale = _mm512_set1_ps(g.scale);
  for (int p = 0; p < ctx; p += 16) {
    if (t.fetch) t.fetch->step();
    const int nk = ctx - p < 16 ? ctx - p : 16, rel = p - t.pos0;
    const uint16_t* k = base + t.table[p / g.bs] * g.block_stride + (p % g.bs) * row;
    for (int d0 = 0; d0 < NP; d0 += 16) {  // 16 keys x 16 pairs at a time
      __m512i r[16];
      for (int j = 0; j < 16; ++j)
        r[j] = j < nk ? _mm512_loadu_si512(k + j * row + 2 * d0) : _mm512_setzero_si512();
      transpose16(r);
      for (int d = 0; d < 16; ++d) _mm512_storeu_si512(kt + (d0 + d) * 16, r[d]);
    }
    for (int r = (rel > 0 ? rel : 0) * G; r < rows; r += 4) {
      const int nr = rows - r < 4 ? rows - r : 4;
      const pair* qr[4];
      for (int i = 0; i < 4; ++i) qr[i] = q_row(r + (i < nr ? i : 0));
      __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                     _mm512_setzero_ps()};
      for (int d = 0; d < NP; ++d) {
        const __m512bh kv = (__m512bh)_mm512_loadu_si512(kt + d * 16);
        for (int i = 0; i < 4; ++i)
          a[i] = _mm512_dpbf16_ps(a[i], kv, (__m512bh)_mm512_set1_epi32(int(qr[i][d])));
      }
      for (int i = 0; i < nr; ++i) {
        int lim = (r + i) / G - rel + 1;  // keys of the chunk this row sees
        lim = lim < nk ? lim : nk;
        _mm512_mask_storeu_ps(s + int64_t(r + i) * ctx + p, __mmask16((1u << nk) - 1),
                              _mm512_maskz_mul_ps(__mmask16((1u << lim) - 1), a[i], scale));
      }
    }
  }
  for (int r = 0; r < rows; ++r) softmax_row(s + int64_t(r) * ctx, t.pos0 + r / G + 1);
  for (int64_t i = 0; i < int64_t(rows) * D; i += 16)
    _mm512_storeu_ps(acc + i, _mm512_setzero_ps());
  for (int p = 0; p < ctx; p += 16) {
    if (t.fetch) t.fetch->step();
    const int nk = ctx - p < 16 ? ctx - p : 16, rel = p - t.pos0;
    const uint16_t* v = base + t.table[p / g.bs] * g.block_stride + v_off + (p % g.bs) * row;
    for (int j = 0; j < nk; ++j)
      for (int c = 0; c < NV; ++c)
        _mm512_storeu_ps(vf + j * D + c * 16, widen(v + j * row + c * 16));
    for (int r = (rel > 0 ? rel : 0) * G; r < rows; r += RB) {
      const int nr = rows - r < RB ? rows - r : RB;
      __m512 a[RB][NV];
      for (int i = 0; i < RB; ++i)
        for (int c = 0; c < NV; ++c)
          a[i][c] = i < nr ? _mm512_loadu_ps(acc + (r + i) * D + c * 16) : _mm512_setzero_ps();
      for (int j = 0; j < nk; ++j) {
        __m512 x[NV];
        for (int c = 0; c < NV; ++c) x[c] = _mm512_loadu_ps(vf + j * D + c * 16);
        for (int i = 0; i < RB; ++i) {
          if (i >= nr) break;
          const __m512 w = _mm512_set1_ps(s[int64_t(r + i) * ctx + p + j]);
          for (int c = 0; c < NV; ++c) a[i][c] = _mm512_fmadd_ps(w, x[c], a[i][c]);
        }
      }
      for (int i = 0; i < nr; ++i)
        for (int c = 0; c < NV; ++c) _mm512_storeu_ps(acc + (r + i) * D + c * 16, a[i][c]);
    }
  }
  for (int r = 0; r < rows; ++r) {
    uint16_t* dst =
        ob + int64_t(t.tok0 + r / G) * g.out_stride + int64_t(t.kvh * G + r % G) * D;
    for (int c = 0; c < NV; ++c)
      _mm256_storeu_si256((__m256i*)(dst + c * 16),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(acc + r * D + c * 16)));
  }
}

}  // namespace

bool attend_bf16_takes(const AttnGeom& g) { return g.bs % 16 == 0 && (g.D == 64 || g.D == 128); }

bool attend_bf16(const void* q, void* out, const void* cache, const AttnGeom& g,
                 const AttnTile& t, float* scratch) {
  if (!attend_bf16_takes(g)) return false;
  const auto* qb = (const uint16_t*)q;
  auto* ob = (uint16_t*)out;
  const auto* cb = (const uint16_t*)cache;
  // Every tile, a decode row's included, on the prefill kernel: a query's scores are
  // then the same vdpbf16ps chain over its pairs of dimensions whatever tile it came
  // in, so a position's output does not depend on whether it was decoded, prefilled
  // whole, or prefilled after a cached prefix (decode's horizontal sums did).
  // (a decode tile over every KV head, kvh < 0, runs them one after the other)
  const int h0 = t.kvh < 0 ? 0 : t.kvh, h1 = t.kvh < 0 ? g.KVH : t.kvh + 1;
  AttnTile one = t;
  for (int h = h0; h < h1; ++h) {
    one.kvh = h;
    if (g.D == 64) prefill<64>(qb, ob, cb, g, one, scratch);
    else prefill<128>(qb, ob, cb, g, one, scratch);
  }
  return true;
}

}  // namespace kvr
