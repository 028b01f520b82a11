// Prompt attention with AMX tiles (head_dim 64 or 128; bfloat16 q, cache and output):
// the flash-attention loop, with both products on the tiles and the softmax on AVX-512.
//
// Why: torch's SDPA ran the prompts' attention at 480 GFLOP/s on the AMX Xeon (2,000
// causal tokens, 9 heads), a quarter of the AMX GEMMs' rate, and at 2,000-token prompts
// attention was 63% of a prefill (docs/model.md, "Prompt attention on AMX tiles").
//
// One unit is 16 queries of one head (rows i0..i0 + nq of a chunk whose queries follow
// `start` cached positions; query i sees keys [0, start + i]). Per 32 keys:
//   S^T (keys x queries) = K Q^T: K's rows are A tiles as packed (32 dims a tile), Q^T
//     the B tiles (16 dim pairs x 16 queries), built once a unit;
//   softmax on S^T's rows: a row is one key's 16 queries, one vector, so the running
//     max and sum are lane-wise (no reductions across lanes);
//   O^T (dims x queries) += V^T P^T: V^T's rows (16 dims x 32 keys) are A tiles, P^T in
//     pairs of keys the B tile; O^T's 64 dims stay in four C tiles for the whole unit.
// The running max moves only when a block's max passes it by more than 2^8 (the
// "lazy rescale" of FlashAttention-4): only then are the O^T tiles stored, scaled and
// reloaded. Until then P may reach 2^8, which bfloat16 and the float32 sums hold.
// At head_dim 128 the second 64 dims replay the kept P^T blocks and rescales on the
// tiles alone: S and P are computed once.
//
// Tiles: 0 A, 1 B, 2-3 C S^T (keys 0-15, 16-31 of the block), 4-7 C O^T (dims 16 g..).
#include "kernels.h"
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,amx-tile,amx-bf16")
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // as gemm_bf16_amx.cpp
#include <immintrin.h>

#include <cmath>

namespace kvr {
namespace {

constexpr int kD = 64;          // dims of O^T in a unit (head_dim 64, or half of 128)
constexpr int kKeys = 32;       // keys a block
constexpr float kLazy = 8.0f;   // log2 of how far P may exceed 1 before a rescale

// 2^x for finite x: f = x - floor(x) in one vreduceps, 2^f on [0, 1) by a degree-4
// polynomial (a least-max relative fit: error below 3e-6; P is rounded to bfloat16
// after, 4e-3), times 2^floor(x) by vscalefps (0 far below -126, inf far above 128).
inline __m512 exp2v(__m512 x) {
  const __m512 f = _mm512_reduce_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 p = _mm512_set1_ps(1.3534167550e-2f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.2011463866e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4144275287e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9300383593e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0000025932e+0f));
  return _mm512_scalef_ps(p, x);
}

inline void zero_o() {  // O^T's tiles, 4-7
  _tile_zero(4);
  _tile_zero(5);
  _tile_zero(6);
  _tile_zero(7);
}

inline void store_o(float* obuf) {  // O^T's tiles into obuf, for vector loads after
  _tile_stored(4, obuf, 64);
  _tile_stored(5, obuf + 256, 64);
  _tile_stored(6, obuf + 512, 64);
  _tile_stored(7, obuf + 768, 64);
  asm volatile("" ::: "memory");
}

// O^T's tiles (4-7) times alpha, lane (query) by lane, through memory.
inline void rescale(__m512 alpha, float* obuf) {
  store_o(obuf);
  for (int d = 0; d < kD; ++d)
    _mm512_store_ps(obuf + 16 * d, _mm512_mul_ps(_mm512_load_ps(obuf + 16 * d), alpha));
  asm volatile("" ::: "memory");
  _tile_loadd(4, obuf, 64);
  _tile_loadd(5, obuf + 256, 64);
  _tile_loadd(6, obuf + 512, 64);
  _tile_loadd(7, obuf + 768, 64);
}

// r[i][j] -> r[j][i] for 16 vectors of 16 32-bit values.
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
  }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
  }
}

// S^T of keys kr[0, 32) (packed K rows of D values) against Q^T (D / 32 parts of 16 dim
// pairs x 16 queries), into tiles 2 (keys 0-15) and 3.
inline void scores(const uint16_t* kr, const uint32_t (*qt)[16][16], int D) {
  _tile_zero(2);
  _tile_zero(3);
  asm volatile("" ::: "memory");
  for (int j = 0; j < D / 32; ++j) {
    _tile_loadd(1, &qt[j][0][0], 64);
    _tile_loadd(0, kr + 32 * j, D * 2);
    _tile_dpbf16ps(2, 0, 1);
    _tile_loadd(0, kr + 16 * D + 32 * j, D * 2);
    _tile_dpbf16ps(3, 0, 1);
  }
}

// Keys kb + r (rows r of S^T in sbuf) that the 16 queries see: key <= limit lane by lane.
inline __mmask16 seen(int64_t key, __m512i limit) {
  return _mm512_cmp_epi32_mask(_mm512_set1_epi32(int(key)), limit, _MM_CMPINT_LE);
}

// The max over a block's keys, lane by lane (MASKED: over the keys each query sees), as a
// tree: a chain of 32 maxes would wait 4 cycles a step.
template <bool MASKED>
inline __m512 block_max(const float* sbuf, int64_t kb, __m512i limit) {
  __m512 b[8];
#pragma GCC unroll 8
  for (int j = 0; j < 8; ++j) b[j] = _mm512_set1_ps(-INFINITY);
#pragma GCC unroll 32
  for (int r = 0; r < kKeys; ++r) {
    const __m512 x = _mm512_load_ps(sbuf + 16 * r);
    b[r % 8] = MASKED ? _mm512_mask_max_ps(b[r % 8], seen(kb + r, limit), b[r % 8], x)
                      : _mm512_max_ps(b[r % 8], x);
  }
  b[0] = _mm512_max_ps(_mm512_max_ps(b[0], b[4]), _mm512_max_ps(b[1], b[5]));
  b[2] = _mm512_max_ps(_mm512_max_ps(b[2], b[6]), _mm512_max_ps(b[3], b[7]));
  return _mm512_max_ps(b[0], b[2]);
}

// P^T = 2^(S^T c - m) (0 for keys a query does not see) into pbuf as the B tile of
// O^T += V^T P^T: row t holds keys 2t and 2t + 1 of each query, interleaved. Returns
// the block's sums of P, lane by lane.
template <bool MASKED>
inline __m512 probs(const float* sbuf, int64_t kb, __m512i limit, __m512 c, __m512 m,
                    uint16_t* pbuf) {
  const __m512i pairs = _mm512_setr_epi32(
      0 | 16 << 16, 1 | 17 << 16, 2 | 18 << 16, 3 | 19 << 16, 4 | 20 << 16, 5 | 21 << 16,
      6 | 22 << 16, 7 | 23 << 16, 8 | 24 << 16, 9 | 25 << 16, 10 | 26 << 16, 11 | 27 << 16,
      12 | 28 << 16, 13 | 29 << 16, 14 | 30 << 16, 15 | 31 << 16);
  __m512 l0 = _mm512_setzero_ps(), l1 = _mm512_setzero_ps();
#pragma GCC unroll 16
  for (int t = 0; t < kKeys / 2; ++t) {
    __m512 a = exp2v(_mm512_fmsub_ps(_mm512_load_ps(sbuf + 32 * t), c, m));
    __m512 b = exp2v(_mm512_fmsub_ps(_mm512_load_ps(sbuf + 32 * t + 16), c, m));
    if (MASKED) {
      a = _mm512_maskz_mov_ps(seen(kb + 2 * t, limit), a);
      b = _mm512_maskz_mov_ps(seen(kb + 2 * t + 1, limit), b);
    }
    const __m512i two = _mm512_permutexvar_epi16(pairs, (__m512i)_mm512_cvtne2ps_pbh(b, a));
    _mm512_store_si512(pbuf + 32 * t, two);
    // the sums of P as rounded: O's weights then sum to 1 exactly (a key that takes
    // most of the weight, as a prompt's first token often does, would otherwise leave
    // its rounding in the output)
    l0 = _mm512_add_ps(l0, _mm512_castsi512_ps(_mm512_slli_epi32(two, 16)));
    l1 = _mm512_add_ps(l1, _mm512_castsi512_ps(
                               _mm512_and_si512(two, _mm512_set1_epi32(int(0xffff0000u)))));
  }
  return _mm512_add_ps(l0, l1);
}

// O^T (tiles 4-7) += V^T P^T for one block: vr, V^T's rows (tpad apart) from the
// block's first key; pb, its P^T.
inline void values(const uint16_t* vr, int64_t tpad, const uint16_t* pb) {
  _tile_loadd(1, pb, 64);
  _tile_loadd(0, vr, tpad * 2);
  _tile_dpbf16ps(4, 0, 1);
  _tile_loadd(0, vr + 16 * tpad, tpad * 2);
  _tile_dpbf16ps(5, 0, 1);
  _tile_loadd(0, vr + 32 * tpad, tpad * 2);
  _tile_dpbf16ps(6, 0, 1);
  _tile_loadd(0, vr + 48 * tpad, tpad * 2);
  _tile_dpbf16ps(7, 0, 1);
}

// O^T (tiles 4-7) times inv, lane by lane, as the rows of nq queries: out's 64 values
// from each row's first, ldo apart, rounded to bfloat16.
inline void write_out(float* obuf, __m512 inv, int nq, uint16_t* out, int64_t ldo) {
  store_o(obuf);
  for (int g = 0; g < kD / 16; ++g) {  // dims 16 g .. 16 g + 15, transposed to rows
    __m512i r[16];
    for (int i = 0; i < 16; ++i)
      r[i] = _mm512_castps_si512(_mm512_mul_ps(_mm512_load_ps(obuf + 256 * g + 16 * i), inv));
    transpose16(r);
    for (int n = 0; n < nq; ++n)
      _mm256_storeu_si256((__m256i*)(out + n * ldo + 16 * g),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_castsi512_ps(r[n])));
  }
}

}  // namespace

void prefill_amx_configure() {
  TileConfig c{};
  c.palette = 1;
  for (int t = 0; t < 8; ++t) c.rows[t] = 16, c.colsb[t] = 64;
  asm volatile("" ::: "memory");
  _tile_loadconfig(&c);
}

void prefill_amx_release() { _tile_release(); }

// Keys [k0, k0 + n) (n <= 32) of one KV head into a chunk's packed K ([tpad][D]) and
// V^T ([D][tpad]): row r of K is src_k[r], of V src_v[r]; keys past n are zeros up to
// k0 + 32 (tpad is a multiple of 32).
void prefill_amx_pack(const uint16_t* const* src_k, const uint16_t* const* src_v, int n,
                      int64_t k0, int64_t tpad, int D, uint16_t* kp, uint16_t* vt) {
  for (int r = 0; r < kKeys; ++r) {
    __m512i* dst = (__m512i*)(kp + (k0 + r) * D);
    for (int i = 0; i < D / 32; ++i)
      _mm512_storeu_si512(dst + i, r < n ? _mm512_loadu_si512(src_k[r] + 32 * i)
                                         : _mm512_setzero_si512());
  }
  // V's keys 2j and 2j + 1 interleaved, 16 dims a vector of pairs: w[g][j] holds dims
  // d0 + 16 g .. + 15; then each g transposed gives V^T's rows, 32 keys each.
  const __m512i lo_idx = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11);
  const __m512i hi_idx = _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15);
  for (int d0 = 0; d0 < D; d0 += 64) {
    __m512i w[4][16];
    for (int j = 0; j < 16; ++j)
      for (int h = 0; h < 2; ++h) {  // dims d0 + 32 h .. + 31
        const int r = 2 * j, d = d0 + 32 * h;
        const __m512i a = r < n ? _mm512_loadu_si512(src_v[r] + d) : _mm512_setzero_si512();
        const __m512i b =
            r + 1 < n ? _mm512_loadu_si512(src_v[r + 1] + d) : _mm512_setzero_si512();
        // per 128-bit lane l (dims 8 l ..): lo dims 8 l .. 8 l + 3, hi 8 l + 4 .. 8 l + 7
        const __m512i lo = _mm512_unpacklo_epi16(a, b), hi = _mm512_unpackhi_epi16(a, b);
        w[2 * h][j] = _mm512_permutex2var_epi64(lo, lo_idx, hi);
        w[2 * h + 1][j] = _mm512_permutex2var_epi64(lo, hi_idx, hi);
      }
    for (int g = 0; g < 4; ++g) {
      transpose16(w[g]);
      for (int i = 0; i < 16; ++i)
        _mm512_storeu_si512(vt + (d0 + 16 * g + i) * tpad + k0, w[g][i]);
    }
  }
}

void prefill_amx_pack_q(const uint16_t* q, int64_t ldq, int nq, int D, uint16_t* qt) {
  for (int j = 0; j < D / 32; ++j) {  // Q^T's part j: dims 32 j .. 32 j + 31, in pairs
    __m512i r[16];
    for (int c = 0; c < 16; ++c)
      r[c] = c < nq ? _mm512_loadu_si512(q + c * ldq + 32 * j) : _mm512_setzero_si512();
    transpose16(r);
    for (int i = 0; i < 16; ++i) _mm512_storeu_si512(qt + 512 * j + 32 * i, r[i]);
  }
}

void prefill_amx_unit(const uint16_t* qt_packed, const uint16_t* kp, int D, const uint16_t* vt,
                      int64_t tpad, int64_t start, int64_t i0, int nq, float scale,
                      uint16_t* out, int64_t ldo, uint16_t* ps, RescaleEvent* events) {
  const auto qt = (const uint32_t(*)[16][16])qt_packed;
  alignas(64) float sbuf[kKeys * 16];  // S^T of a block
  alignas(64) float obuf[kD * 16];     // O^T, when rescaled or at the end
  const float c = scale * 1.4426950408889634f;  // S to log2 units
  const __m512 cv = _mm512_set1_ps(c);
  // lane n (query i0 + n) sees keys up to start + i0 + n
  const __m512i limit = _mm512_add_epi32(
      _mm512_set1_epi32(int(start + i0)),
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  const int64_t n_keys = start + i0 + nq, unmasked = start + i0 + 1;  // keys all lanes see
  const int64_t blocks = (n_keys + kKeys - 1) / kKeys;
  // Every block's P^T (512 values) in ps, kept for the output dims past the first 64
  // (head_dim 128), which replay the products and the rescales (`events`) without
  // computing S and P again.
  int64_t n_events = 0;
  __m512 m = _mm512_setzero_ps(), l = _mm512_setzero_ps();
  zero_o();
  // Each block's S^T goes to the tiles a block ahead, and its O^T product a block
  // behind, so that the vector work of a block waits on neither: a tile store (here of
  // S^T, for the vector loads) retires only after every tile op before it.
  scores(kp, qt, D);  // block 0's S^T, in tiles 2-3
  for (int64_t kb = 0; kb < n_keys; kb += kKeys) {
    _tile_stored(2, sbuf, 64);
    _tile_stored(3, sbuf + 256, 64);
    asm volatile("" ::: "memory");
    if (kb + kKeys < n_keys) scores(kp + (kb + kKeys) * D, qt, D);
    if (kb > 0) values(vt + kb - kKeys, tpad, ps + 512 * (kb / kKeys - 1));
    const bool masked = kb + kKeys > unmasked;
    const __m512 bm = _mm512_mul_ps(masked ? block_max<true>(sbuf, kb, limit)
                                           : block_max<false>(sbuf, kb, limit), cv);
    if (kb == 0) {  // every lane has a key in block 0 (key 0)
      m = bm;
    } else if (_mm512_cmp_ps_mask(bm, _mm512_add_ps(m, _mm512_set1_ps(kLazy)), _CMP_GT_OQ)) {
      const __m512 mn = _mm512_max_ps(m, bm), alpha = exp2v(_mm512_sub_ps(m, mn));
      l = _mm512_mul_ps(l, alpha);
      rescale(alpha, obuf);  // after the block before's O^T (values above)
      m = mn;
      if (D > kD) {
        events[n_events].block = int32_t(kb / kKeys);
        _mm512_storeu_ps(events[n_events++].alpha, alpha);
      }
    }
    uint16_t* pb = ps + 512 * (kb / kKeys);
    l = _mm512_add_ps(l, masked ? probs<true>(sbuf, kb, limit, cv, m, pb)
                                : probs<false>(sbuf, kb, limit, cv, m, pb));
  }
  asm volatile("" ::: "memory");
  values(vt + (blocks - 1) * kKeys, tpad, ps + 512 * (blocks - 1));
  const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.0f), l);
  write_out(obuf, inv, nq, out, ldo);
  for (int d0 = kD; d0 < D; d0 += kD) {  // head_dim 128: the other 64 dims, from P as kept
    zero_o();
    int64_t e = 0;
    for (int64_t b = 0; b < blocks; ++b) {
      if (e < n_events && events[e].block == b) rescale(_mm512_loadu_ps(events[e++].alpha), obuf);
      values(vt + d0 * tpad + b * kKeys, tpad, ps + 512 * b);
    }
    write_out(obuf, inv, nq, out + d0, ldo);
  }
}

}  // namespace kvr
