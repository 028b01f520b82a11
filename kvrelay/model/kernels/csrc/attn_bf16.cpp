// Attention over a bfloat16 cache with AVX-512 BF16, head_dim 64 or 128, blocks a
// multiple of 16 positions: decode tiles (one query token) and prefill tiles.
// Decode: the generic tile kernel (kernels_impl.h) converts every K and V row to
// float32 and reduces each score with a horizontal sum; here the score of a K row is
// vdpbf16ps over the bfloat16 row as it sits in the block (q . k, float32 sums), 16
// scores are reduced together by one shuffle tree, and V rows are widened in
// registers and accumulated into float32 registers: about 3.5x fewer instructions
// per context position, which leaves the kernel bound by reading the cache (a
// software prefetch of the next block, as the generic kernel does, made it slower).
// Prefill: see prefill() below. The probabilities stay float32 in both (torch's
// bfloat16 path rounds them to bfloat16 before multiplying by V).
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

// Two bfloat16 values read or written as one 32-bit unit (vdpbf16ps' pair), over
// memory that also holds uint16_t or float: may_alias keeps that defined.
typedef uint32_t pair __attribute__((may_alias));

// out[j] = the sum of a[j]'s 16 lanes, for 16 vectors: 15 adds, 30 shuffles.
inline __m512 sum16(const __m512 (&a)[16]) {
  __m512 b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i)  // lanes of 128 bits: [a2i 0+2, a2i+1 0+2, a2i 1+3, a2i+1 1+3]
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                         _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // each 128-bit lane: a part of a4i .. a4i+3
    const __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
    c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int i = 0; i < 2; ++i)  // lanes 0+1 and 2+3 of c2i, then of c2i+1
    d[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d[0], d[1], 0x88),
                       _mm512_shuffle_f32x4(d[0], d[1], 0xDD));
}

inline __m512 widen(const uint16_t* p) {  // 16 bfloat16 -> float32
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

// The unscaled scores of a query head (qv: its NQ bfloat16 vectors) against the nk <= 16
// K rows from k, `row` elements apart: lane j, q . k_j (0 past nk).
template <int NQ>
inline __m512 scores16(const __m512bh (&qv)[NQ], const uint16_t* k, int64_t row, int nk) {
  __m512 acc[16];
  for (int j = 0; j < 16; ++j) {
    acc[j] = _mm512_setzero_ps();
    if (j < nk)
      for (int v = 0; v < NQ; ++v)
        acc[j] = _mm512_dpbf16_ps(acc[j], qv[v],
                                  (__m512bh)_mm512_loadu_si512(k + j * row + v * 32));
  }
  return sum16(acc);
}

template <int D>
void decode(const uint16_t* qb, uint16_t* ob, const uint16_t* cache, const AttnGeom& g,
            const AttnTile& t, float* s) {
  constexpr int NQ = D / 32;                  // bfloat16 vectors of a head
  constexpr int NV = D / 16;                  // float32 vectors of a head
  constexpr int RB = NV >= 16 ? 1 : 16 / NV;  // query rows whose V sums fit 16 registers
  const int G = g.H / g.KVH, ctx = t.pos0 + 1;
  const int64_t row = int64_t(g.KVH) * D, v_off = int64_t(g.bs) * row;
  const uint16_t* q = qb + int64_t(t.tok0) * g.q_stride;
  uint16_t* o = ob + int64_t(t.tok0) * g.out_stride;
  const __m512 scale = _mm512_set1_ps(g.scale);
  const int h = t.kvh;
  const uint16_t* base = cache + g.layer_off + int64_t(h) * D;
  for (int r = 0; r < G; ++r) {
    __m512bh qv[NQ];
    for (int v = 0; v < NQ; ++v)
      qv[v] = (__m512bh)_mm512_loadu_si512(q + int64_t(h * G + r) * D + v * 32);
    float* sr = s + r * ctx;
    for (int p = 0; p < ctx; p += 16) {
      if (t.fetch) t.fetch->step();
      const int nk = ctx - p < 16 ? ctx - p : 16;
      const uint16_t* k = base + t.table[p / g.bs] * g.block_stride + (p % g.bs) * row;
      _mm512_mask_storeu_ps(sr + p, __mmask16((1u << nk) - 1),
                            _mm512_mul_ps(scores16(qv, k, row, nk), scale));
    }
    softmax_row(sr, ctx);
  }
  for (int r0 = 0; r0 < G; r0 += RB) {
    const int nr = G - r0 < RB ? G - r0 : RB;
    __m512 acc[RB][NV];
    for (int i = 0; i < RB; ++i)
      for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_setzero_ps();
    for (int p = 0; p < ctx; ++p) {
      if (t.fetch && p % 16 == 0) t.fetch->step();
      const uint16_t* vr =
          base + t.table[p / g.bs] * g.block_stride + v_off + (p % g.bs) * row;
      __m512 vf[NV];
      for (int v = 0; v < NV; ++v) vf[v] = widen(vr + v * 16);
      for (int i = 0; i < RB; ++i) {
        if (i >= nr) break;
        const __m512 w = _mm512_set1_ps(s[(r0 + i) * ctx + p]);
        for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_fmadd_ps(w, vf[v], acc[i][v]);
      }
    }
    for (int i = 0; i < nr; ++i) {
      uint16_t* dst = o + int64_t(h * G + r0 + i) * D;
      for (int v = 0; v < NV; ++v)
        _mm256_storeu_si256((__m256i*)(dst + v * 16), (__m256i)_mm512_cvtneps_pbh(acc[i][v]));
    }
  }
}

// A decode tile over every KV head of the sequence (t.kvh < 0): the same scores,
// softmax and sums as decode() for each head, bit for bit, with the loops turned
// inside out: each 16-position chunk of K (then of V) is taken by all heads in turn
// while it is in L1. Head by head, the tiles read a head's 128 bytes of each K/V row
// and leave the rest of the row's lines (the other heads', fetched with it by the
// hardware) to be evicted before their tiles come at a long context: 3x the reads.
// The V sums of the heads' rows stay in scratch between chunks.
template <int D>
void decode_all(const uint16_t* qb, uint16_t* ob, const uint16_t* cache, const AttnGeom& g,
                const AttnTile& t, float* s) {
  constexpr int NQ = D / 32;
  constexpr int NV = D / 16;
  const int H = g.H, G = H / g.KVH, ctx = t.pos0 + 1;
  const int64_t row = int64_t(g.KVH) * D, v_off = int64_t(g.bs) * row;
  const uint16_t* q = qb + int64_t(t.tok0) * g.q_stride;
  uint16_t* o = ob + int64_t(t.tok0) * g.out_stride;
  const __m512 scale = _mm512_set1_ps(g.scale);
  const uint16_t* base = cache + g.layer_off;
  float* acc = s + ((int64_t(H) * ctx + 15) & ~int64_t(15));  // H x D
  for (int p = 0; p < ctx; p += 16) {
    const int nk = ctx - p < 16 ? ctx - p : 16;
    const uint16_t* k0 = base + t.table[p / g.bs] * g.block_stride + (p % g.bs) * row;
    for (int h = 0; h < g.KVH; ++h) {
      const uint16_t* k = k0 + int64_t(h) * D;
      for (int r = 0; r < G; ++r) {
        if (t.fetch) t.fetch->step();
        __m512bh qv[NQ];
        for (int v = 0; v < NQ; ++v)
          qv[v] = (__m512bh)_mm512_loadu_si512(q + int64_t(h * G + r) * D + v * 32);
        _mm512_mask_storeu_ps(s + int64_t(h * G + r) * ctx + p, __mmask16((1u << nk) - 1),
                              _mm512_mul_ps(scores16(qv, k, row, nk), scale));
      }
    }
  }
  for (int r = 0; r < H; ++r) {
    softmax_row(s + int64_t(r) * ctx, ctx);
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(acc + r * D + v * 16, _mm512_setzero_ps());
  }
  for (int p = 0; p < ctx; p += 16) {
    const int nk = ctx - p < 16 ? ctx - p : 16;
    const uint16_t* v0 = base + t.table[p / g.bs] * g.block_stride + v_off + (p % g.bs) * row;
    for (int h = 0; h < g.KVH; ++h) {
      if (t.fetch) t.fetch->step();
      // the G rows of head h, RB at a time in registers (decode()'s RB)
      constexpr int RB = NV >= 16 ? 1 : 16 / NV;
      for (int r0 = 0; r0 < G; r0 += RB) {
        const int nr = G - r0 < RB ? G - r0 : RB;
        float* ar = acc + int64_t(h * G + r0) * D;
        __m512 a[RB][NV];
        for (int i = 0; i < RB; ++i)
          for (int v = 0; v < NV; ++v)
            a[i][v] = i < nr ? _mm512_loadu_ps(ar + i * D + v * 16) : _mm512_setzero_ps();
        for (int j = 0; j < nk; ++j) {
          const uint16_t* vr = v0 + j * row + int64_t(h) * D;
          __m512 vf[NV];
          for (int v = 0; v < NV; ++v) vf[v] = widen(vr + v * 16);
          for (int i = 0; i < RB; ++i) {
            if (i >= nr) break;
            const __m512 w = _mm512_set1_ps(s[int64_t(h * G + r0 + i) * ctx + p + j]);
            for (int v = 0; v < NV; ++v) a[i][v] = _mm512_fmadd_ps(w, vf[v], a[i][v]);
          }
        }
        for (int i = 0; i < nr; ++i)
          for (int v = 0; v < NV; ++v) _mm512_storeu_ps(ar + i * D + v * 16, a[i][v]);
      }
    }
  }
  for (int r = 0; r < H; ++r)
    for (int v = 0; v < NV; ++v)
      _mm256_storeu_si256((__m256i*)(o + int64_t(r) * D + v * 16),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(acc + r * D + v * 16)));
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
    const int nk = ctx - p < 16 ? ctx - p : 16, rel = p - t.pos0;
    const uint16_t* k = base + t.table[p / g.bs] * g.block_stride + (p % g.bs) * row;
    for (int j = 0; j < 16; ++j) {
      const pair* kj = (const pair*)(k + j * row);
      for (int d = 0; d < NP; ++d) kt[d * 16 + j] = j < nk ? kj[d] : pair(0);
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
  if (t.n == 1 && t.kvh < 0) {
    if (g.D == 64) decode_all<64>(qb, ob, cb, g, t, scratch);
    else decode_all<128>(qb, ob, cb, g, t, scratch);
  } else if (t.n == 1) {
    if (g.D == 64) decode<64>(qb, ob, cb, g, t, scratch);
    else decode<128>(qb, ob, cb, g, t, scratch);
  } else {
    if (g.D == 64) prefill<64>(qb, ob, cb, g, t, scratch);
    else prefill<128>(qb, ob, cb, g, t, scratch);
  }
  return true;
}

}  // namespace kvr
