// GGUF-quantized decode GEMM (Q8_0, Q4_1, Q4_K, Q6_K) with 8-bit activations, llama.cpp's
// route on CPUs; included once per ISA after gemm_f32_impl.h (whose vectors, epilogue and
// tile walk it shares): y (M, N) = x (M, K) W^T + b, W kept as its integer codes.
//
// Activations: each row's 32-value groups are quantized to int8 with one float scale
// per group (quantize_rows: d = max |x| / 127, q = round(x / d)), as llama.cpp's Q8_0
// and Q8_1. Integer dot products of the codes then replace the float FMAs:
//   sum_k (dw qw_k + m) (dx qx_k) = dw dx sum_k qw_k qx_k + m (dx sum_k qx_k),
// the min term for Q4_1 and Q4_K, with the per-row group sums sx = dx sum qx (Q6_K: two
// scales a group, and the sums sh of each half).
//
// Layout (pack_gguf_blocks): [N/16][K/32 groups][group], a group being the 32 k x 16
// columns of one column block, its codes in chunks of [16 columns][4 k] bytes (one
// 32-bit lane per column: what vpdpbusd / maddubs sum). Q8_0: [16 f16 scales][8 chunks
// for k 0-31] (544 bytes); Q4_1: [16 f16 scales][16 f16 mins][4 chunks, byte (c, t) of
// chunk i holding k = 4i + t in its low and k = 16 + 4i + t in its high nibble] (320
// bytes): the file's bits per weight (8.5 and 5). Q4_K: as Q4_1 with float32 scales
// and mins (384 bytes: 6 bits a weight where the file has 4.5), each sub-block's d sc
// and -dmin m, exact. Q6_K: see the struct.
//
// Dot products: AVX-512 VNNI (KVR_Q_VNNI) vpdpbusd, unsigned codes x signed
// activations, 4 products a lane; Q8_0's signed codes are flipped to code + 128 on
// load and the 128 * sum qx added back through the min term (m = -128 dw). AVX2:
// maddubs + madd (llama.cpp's AVX2 path; Q8_0 by |qw| x sign(qx, qw), never saturating).
#ifndef KVR_F32_LANES
#error "include gemm_f32_impl.h first"
#endif

namespace kvr {
namespace KVR_ISA {
namespace q {

using f32::Ahead;
using f32::ahead_step;
using f32::kCols;
using f32::kVecs;
using f32::store_tile;
using f32::vf;

constexpr int kGroup = 32;

#if KVR_F32_LANES == 16
typedef __m512i vi;
static inline vi iload(const uint8_t* p) { return _mm512_loadu_si512((const void*)p); }
static inline vi iset1(const int8_t* p4) { return _mm512_set1_epi32(*(const int32_t*)p4); }
static inline vi izero() { return _mm512_setzero_si512(); }
static inline vi nib_lo(vi v) { return _mm512_and_si512(v, _mm512_set1_epi8(0x0f)); }
static inline vi nib_hi(vi v) {
  return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0f));
}
static inline vf to_f(vi v) { return _mm512_cvtepi32_ps(v); }
static inline vf fmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
#if KVR_Q_VNNI
// acc + per lane the sum of 4 products u8 x s8
static inline vi dot_u(vi acc, vi u, vi s) { return _mm512_dpbusd_epi32(acc, u, s); }
static inline vi dot_q8(vi acc, vi w, vi s) {
  return _mm512_dpbusd_epi32(acc, _mm512_xor_si512(w, _mm512_set1_epi8(char(0x80))), s);
}
constexpr int kQ8Bias = 128;  // dot_q8 sums (qw + 128) qx
// Q4_1: a chunk's low and high nibbles against their activations, summed in int32.
static inline vi q4_dots(vi s, vi lo, vi xl, vi hi, vi xh) {
  return dot_u(dot_u(s, lo, xl), hi, xh);
}
static inline vi q4_widen(vi s) { return s; }
static inline vi iadd32(vi a, vi b) { return _mm512_add_epi32(a, b); }
#else
#error "the AVX-512 quantized GEMM needs VNNI (KVR_Q_VNNI=1); without it the AVX2 one runs"
#endif
static inline void scales(const uint8_t* h, vf out[kVecs]) {
  out[0] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)h));
}
static inline void scales32(const uint8_t* h, vf out[kVecs]) {
  out[0] = _mm512_loadu_ps((const float*)h);
}
constexpr int kTileRows = 8;
constexpr int blocks_per_tile(int mr) { return mr <= 2 ? 4 : mr <= 4 ? 2 : 1; }
#else
typedef __m256i vi;
static inline vi iload(const uint8_t* p) { return _mm256_loadu_si256((const __m256i*)p); }
static inline vi iset1(const int8_t* p4) { return _mm256_set1_epi32(*(const int32_t*)p4); }
static inline vi izero() { return _mm256_setzero_si256(); }
static inline vi nib_lo(vi v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0f)); }
static inline vi nib_hi(vi v) {
  return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0f));
}
static inline vf to_f(vi v) { return _mm256_cvtepi32_ps(v); }
static inline vf fmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
// Pairs of u8 x s8 products in int16 (at most 2 * 15 * 127 for Q4_1 codes, 2 * 128 *
// 127 for |Q8_0 codes|: below saturation), then the pairs of pairs in int32.
static inline vi dot_u(vi acc, vi u, vi s) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s),
                                                 _mm256_set1_epi16(1)));
}
static inline vi dot_q8(vi acc, vi w, vi s) { return dot_u(acc, _mm256_sign_epi8(w, w), _mm256_sign_epi8(s, w)); }
constexpr int kQ8Bias = 0;
// Q4_1: maddubs gives int16 pair sums of at most 2 * 15 * 128 = 3,840; a group's 8 of
// them add up in int16 without saturating (30,720 < 32,767), so one madd per group, not
// one per chunk, widens them to int32 (each 32 bytes and row took maddubs, madd and an
// int32 add before).
static inline vi q4_dots(vi s, vi lo, vi xl, vi hi, vi xh) {
  return _mm256_add_epi16(s, _mm256_add_epi16(_mm256_maddubs_epi16(lo, xl),
                                              _mm256_maddubs_epi16(hi, xh)));
}
static inline vi q4_widen(vi s) { return _mm256_madd_epi16(s, _mm256_set1_epi16(1)); }
static inline vi iadd32(vi a, vi b) { return _mm256_add_epi32(a, b); }
static inline void scales(const uint8_t* h, vf out[kVecs]) {
  out[0] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)h));
  out[1] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(h + 16)));
}
static inline void scales32(const uint8_t* h, vf out[kVecs]) {
  out[0] = _mm256_loadu_ps((const float*)h);
  out[1] = _mm256_loadu_ps((const float*)(h + 32));
}
// 16 ymm: MR * 2 int sums + MR * 2 float sums + 4 codes + broadcasts.
#ifndef KVR_Q_AVX2_ROWS
#define KVR_Q_AVX2_ROWS 4
#endif
constexpr int kTileRows = KVR_Q_AVX2_ROWS;
constexpr int blocks_per_tile(int) { return 1; }
#endif

// n values of x as float32 vectors: float32, or bfloat16 (the top half of a float's bits)
#if KVR_F32_LANES == 16
static inline vf xload(const float* p) { return _mm512_loadu_ps(p); }
static inline vf xload(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
#else
static inline vf xload(const float* p) { return _mm256_loadu_ps(p); }
static inline vf xload(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(
      _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
#endif

// Row m's int8 codes of x (M, K; float32 or bfloat16 T), its scale per group dx (M, K/32),
// sx = dx * sum of the group's codes, and sh (M, K/16) the same of each half group (Q6_K's
// sub-blocks of 16). Round to nearest (even), like llama.cpp's vector paths.
template <typename T>
static void quantize_rows(const T* x, int64_t ldx, int64_t M, int64_t K, int8_t* xq,
                          float* dx, float* sx, float* sh) {
  const int64_t G = K / kGroup;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < G; ++g) {
      const T* p = x + m * ldx + g * kGroup;
      int8_t* q = xq + m * K + g * kGroup;
#if KVR_F32_LANES == 16
      const __m512 a = xload(p), b = xload(p + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
      const float d = amax / 127.f, id = amax > 0.f ? 127.f / amax : 0.f;
      const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(id)));
      const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, _mm512_set1_ps(id)));
      _mm_storeu_si128((__m128i*)q, _mm512_cvtsepi32_epi8(qa));
      _mm_storeu_si128((__m128i*)(q + 16), _mm512_cvtsepi32_epi8(qb));
      const int sum_a = _mm512_reduce_add_epi32(qa), sum_b = _mm512_reduce_add_epi32(qb);
      const int sum = int(uint32_t(sum_a) + uint32_t(sum_b));  // wraps (NaN x) as before
#else
      __m256 v[4];
      __m256 mx = _mm256_setzero_ps();
      const __m256 sign = _mm256_set1_ps(-0.f);
      for (int i = 0; i < 4; ++i) {
        v[i] = xload(p + 8 * i);
        mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[i]));
      }
      __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
      h = _mm_max_ps(h, _mm_movehl_ps(h, h));
      h = _mm_max_ss(h, _mm_movehdup_ps(h));
      const float amax = _mm_cvtss_f32(h);
      const float d = amax / 127.f, id = amax > 0.f ? 127.f / amax : 0.f;
      __m256i qi[4];
      for (int i = 0; i < 4; ++i)
        qi[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(id)));
      const auto hsum = [](__m256i v) {
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
        return _mm_cvtsi128_si32(s4);
      };
      const int sum_a = hsum(_mm256_add_epi32(qi[0], qi[1]));
      const int sum_b = hsum(_mm256_add_epi32(qi[2], qi[3]));
      const int sum = int(uint32_t(sum_a) + uint32_t(sum_b));  // wraps (NaN x) as before
      // int32 -> int8 in order: the packs interleave 128-bit lanes, the permute undoes it
      const __m256i p16 = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]),
                                             _mm256_packs_epi32(qi[2], qi[3]));
      _mm256_storeu_si256((__m256i*)q, _mm256_permutevar8x32_epi32(
                                           p16, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
#endif
      dx[m * G + g] = d;
      sx[m * G + g] = d * float(sum);
      sh[(m * G + g) * 2] = d * float(sum_a);
      sh[(m * G + g) * 2 + 1] = d * float(sum_b);
    }
}

// quantize_rows of x as bf16 says: bfloat16 or float32 values (the ISA entry points')
static void quantize_any(const void* x, bool bf16, int64_t ldx, int64_t M, int64_t K,
                         int8_t* xq, float* dx, float* sx, float* sh) {
  if (bf16)
    quantize_rows((const uint16_t*)x, ldx, M, K, xq, dx, sx, sh);
  else
    quantize_rows((const float*)x, ldx, M, K, xq, dx, sx, sh);
}

// acc += chunks [C0, C1) of byte codes (4 k each) from byte `head` of each group, against
// x's codes: int8 (Q8_0; Q6_K, a half at a time), or with U unsigned (Q5_1, Q5_K: 0-31,
// whose pairs of products stay in int16 under AVX2's maddubs)
template <int MR, int NB, int C0, int C1, bool U = false>
static inline void int8_chunks(const uint8_t* const base[NB], int head, const int8_t* xq,
                               int64_t ldq, vi (&acc)[MR][NB * kVecs]) {
  for (int c = C0; c < C1; ++c) {
    vi w[NB * kVecs];
    for (int j = 0; j < NB; ++j)
      for (int v = 0; v < kVecs; ++v)
        w[j * kVecs + v] = iload(base[j] + head + c * 64 + v * (64 / kVecs));
    for (int m = 0; m < MR; ++m) {
      const vi xb = iset1(xq + m * ldq + 4 * c);
      for (int j = 0; j < NB * kVecs; ++j)
        acc[m][j] = U ? dot_u(acc[m][j], w[j], xb) : dot_q8(acc[m][j], w[j], xb);
    }
  }
}

struct Q8_0 {
  static constexpr int kBytes = 32 + kGroup * kCols;
  static constexpr bool kMin = kQ8Bias != 0;  // VNNI: m = -128 dw
  static constexpr bool kHalves = false;
  static inline void d(const uint8_t* g, vf out[kVecs]) { scales(g, out); }
  template <int MR, int NB>
  static inline void dots(const uint8_t* const base[NB], const int8_t* xq, int64_t ldq,
                          vi (&acc)[MR][NB * kVecs]) {
    int8_chunks<MR, NB, 0, kGroup / 4>(base, 32, xq, ldq, acc);
  }
  static inline void mins(const uint8_t* g, const vf d[kVecs], vf out[kVecs]) {
    for (int v = 0; v < kVecs; ++v) out[v] = fmul(d[v], f32::vset1(-float(kQ8Bias)));
    (void)g;
  }
};

// Q4_1, or with F32 (Q4_K) float32 scales and mins
template <bool F32>
struct Q4 {
  static constexpr int kHead = F32 ? 128 : 64;  // scales and mins, then the codes
  static constexpr int kBytes = kHead + kGroup * kCols / 2;
  static constexpr bool kMin = true;
  static constexpr bool kHalves = false;
  static inline void d(const uint8_t* g, vf out[kVecs]) {
    if constexpr (F32)
      scales32(g, out);
    else
      scales(g, out);
  }
  template <int MR, int NB>
  static inline void dots(const uint8_t* const base[NB], const int8_t* xq, int64_t ldq,
                          vi (&acc)[MR][NB * kVecs]) {
    vi s[MR][NB * kVecs];  // the group's sums (int16 under AVX2: q4_dots)
    for (int m = 0; m < MR; ++m)
      for (int j = 0; j < NB * kVecs; ++j) s[m][j] = izero();
    for (int c = 0; c < kGroup / 8; ++c) {
      vi lo[NB * kVecs], hi[NB * kVecs];
      for (int j = 0; j < NB; ++j)
        for (int v = 0; v < kVecs; ++v) {
          const vi raw = iload(base[j] + kHead + c * 64 + v * (64 / kVecs));
          lo[j * kVecs + v] = nib_lo(raw);
          hi[j * kVecs + v] = nib_hi(raw);
        }
      for (int m = 0; m < MR; ++m) {
        const vi xl = iset1(xq + m * ldq + 4 * c), xh = iset1(xq + m * ldq + 16 + 4 * c);
        for (int j = 0; j < NB * kVecs; ++j) s[m][j] = q4_dots(s[m][j], lo[j], xl, hi[j], xh);
      }
    }
    for (int m = 0; m < MR; ++m)
      for (int j = 0; j < NB * kVecs; ++j) acc[m][j] = iadd32(acc[m][j], q4_widen(s[m][j]));
  }
  static inline void mins(const uint8_t* g, const vf[kVecs], vf out[kVecs]) {
    if constexpr (F32)
      scales32(g + 64, out);
    else
      scales(g + 32, out);
  }
};
using Q4_1 = Q4<false>;
using Q4_K = Q4<true>;

// Q5_1 and Q5_K: 5-bit codes as bytes (unsigned, Q8_0's chunks) with a float32 scale and
// min: [16 scales][16 mins][8 chunks] (640 bytes, 10 bits a weight where the files have
// 6 and 5.5).
struct Q5 {
  static constexpr int kBytes = 128 + kGroup * kCols;
  static constexpr bool kMin = true;
  static constexpr bool kHalves = false;
  static inline void d(const uint8_t* g, vf out[kVecs]) { scales32(g, out); }
  template <int MR, int NB>
  static inline void dots(const uint8_t* const base[NB], const int8_t* xq, int64_t ldq,
                          vi (&acc)[MR][NB * kVecs]) {
    int8_chunks<MR, NB, 0, kGroup / 4, true>(base, 128, xq, ldq, acc);
  }
  static inline void mins(const uint8_t* g, const vf[kVecs], vf out[kVecs]) {
    scales32(g + 64, out);
  }
};

// Q6_K: its 6-bit codes less 32 as int8, in Q8_0's chunks, and a float32 scale d sc for
// each half group (sub-blocks of 16): [16 scales, k 0-15][16 scales, k 16-31][8 chunks]
// (640 bytes, 10 bits a weight where the file has 6.56). The halves sum one after the
// other into the same registers, each scaled with its own d (Kern::tile); with VNNI each
// takes its own -128 d sh term (dot_q8's bias).
struct Q6_K {
  static constexpr int kBytes = 128 + kGroup * kCols;
  static constexpr bool kMin = false;
  static constexpr bool kHalves = true;
  static inline void d(const uint8_t* g, vf out[kVecs]) { scales32(g, out); }
  // half H's chunks (k 16 H .. 16 H + 15) into acc
  template <int MR, int NB, int H>
  static inline void half(const uint8_t* const base[NB], const int8_t* xq, int64_t ldq,
                          vi (&acc)[MR][NB * kVecs]) {
    int8_chunks<MR, NB, 4 * H, 4 * H + 4>(base, 128, xq, ldq, acc);
  }
};

template <class Q>
struct Kern {
  struct Args {
    const int8_t* xq;  // (M, K) codes
    const float* dx;   // (M, G) scales
    const float* sx;   // (M, G) dx * sum of codes
    const float* sh;   // (M, 2G) the same of each half group
    const uint8_t* wp;
    int64_t K, G;
    const float* bias;
    float* y;
    int64_t ldy, N;
    Args at_row(int64_t m) const {
      return {xq + m * K, dx + m * G, sx + m * G, sh + m * 2 * G, wp, K, G, bias,
              y + m * ldy, ldy, N};
    }
  };
  static constexpr int kTileRows = q::kTileRows;
  static constexpr int kStepK = kGroup;
  static constexpr int blocks_per_tile(int mr) { return q::blocks_per_tile(mr); }

  // Groups of a column block fetched ahead: the group after next (640 bytes of Q4_1)
  // arrived too late at 8 rows, where a group computes long enough for the stream to
  // fall behind: 3 KiB ahead made the 30 layers' GEMMs 15-25% faster at 8 rows with
  // VNNI (one core, in-process A/B over 2-20 groups; 8-20 alike) and changed nothing
  // at 1 row or under AVX2, whose 8 rows are compute-bound (docs/model.md).
  static constexpr int kAheadGroups = (3072 + Q::kBytes - 1) / Q::kBytes;

  // Q6_K: half H of group g into acc (zero), then into the sums with its own scales
  template <int MR, int NB, int H>
  static inline void half_group(const Args& a, const uint8_t* const base[NB], int64_t g,
                                vi (&acc)[MR][NB * kVecs], vf (&sum)[MR][NB * kVecs]) {
    const int64_t G = a.G;
    Q::template half<MR, NB, H>(base, a.xq + g * kGroup, a.K, acc);
    for (int j = 0; j < NB; ++j) {
      vf d[kVecs], mn[kVecs];
      Q::d(base[j] + 64 * H, d);
      for (int v = 0; v < kVecs; ++v) mn[v] = fmul(d[v], f32::vset1(-float(kQ8Bias)));
      for (int m = 0; m < MR; ++m) {
        const vf ddx = f32::vset1(a.dx[m * G + g]);
        for (int v = 0; v < kVecs; ++v) {
          vf& s = sum[m][j * kVecs + v];
          s = f32::vfma(to_f(acc[m][j * kVecs + v]), fmul(d[v], ddx), s);
          if constexpr (kQ8Bias != 0)
            s = f32::vfma(mn[v], f32::vset1(a.sh[(m * G + g) * 2 + H]), s);
        }
      }
    }
  }

  template <int MR, int NB>
  static inline void tile(const Args& a, int64_t blk, Ahead& ahead) {
    constexpr int NV = NB * kVecs;
    const int64_t G = a.G;
    vf sum[MR][NV];
    for (int m = 0; m < MR; ++m)
      for (int j = 0; j < NV; ++j) sum[m][j] = f32::vzero();
    for (int64_t g = 0; g < G; ++g) {
      ahead_step(ahead);
      const uint8_t* base[NB];
      for (int j = 0; j < NB; ++j) {
        base[j] = a.wp + ((blk + j) * G + g) * Q::kBytes;
        // ~3 KiB ahead, while this group computes
        for (int l = 0; l < Q::kBytes; l += 64)
          _mm_prefetch((const char*)(base[j] + kAheadGroups * Q::kBytes + l), _MM_HINT_T0);
      }
      vi acc[MR][NV];
      for (int m = 0; m < MR; ++m)
        for (int j = 0; j < NV; ++j) acc[m][j] = izero();
      if constexpr (Q::kHalves) {
        half_group<MR, NB, 0>(a, base, g, acc, sum);
        for (int m = 0; m < MR; ++m)
          for (int j = 0; j < NV; ++j) acc[m][j] = izero();
        half_group<MR, NB, 1>(a, base, g, acc, sum);
        continue;
      } else {
        Q::template dots<MR, NB>(base, a.xq + g * kGroup, a.K, acc);
      }
      for (int j = 0; j < NB; ++j) {
        vf d[kVecs], mn[kVecs];
        Q::d(base[j], d);
        if constexpr (Q::kMin) Q::mins(base[j], d, mn);
        for (int m = 0; m < MR; ++m) {
          const vf ddx = f32::vset1(a.dx[m * G + g]);
          for (int v = 0; v < kVecs; ++v) {
            vf& s = sum[m][j * kVecs + v];
            s = f32::vfma(to_f(acc[m][j * kVecs + v]), fmul(d[v], ddx), s);
            if constexpr (Q::kMin) s = f32::vfma(mn[v], f32::vset1(a.sx[m * G + g]), s);
          }
        }
      }
    }
    store_tile<MR, NB>(sum, blk, a.bias, a.y, a.ldy, a.N);
  }
};

static void gemm_any(int type, const int8_t* xq, const float* dx, const float* sx,
                     const float* sh, int64_t M, const uint8_t* wp, int64_t K, int64_t blk0,
                     int64_t blk1, const float* bias, float* y, int64_t ldy, int64_t N) {
  const int64_t G = K / kGroup;
  const auto run = [&](auto kern, int64_t group_bytes) {
    using KernT = decltype(kern);
    f32::walk<KernT>({xq, dx, sx, sh, wp, K, G, bias, y, ldy, N}, M, K, blk0, blk1,
                     G * group_bytes);
  };
  if (type == int(QType::Q8_0))
    run(Kern<Q8_0>{}, Q8_0::kBytes);
  else if (type == int(QType::Q4_K))
    run(Kern<Q4_K>{}, Q4_K::kBytes);
  else if (type == int(QType::Q6_K))
    run(Kern<Q6_K>{}, Q6_K::kBytes);
  else if (type == int(QType::Q5_1) || type == int(QType::Q5_K))
    run(Kern<Q5>{}, Q5::kBytes);
  else
    run(Kern<Q4_1>{}, Q4_1::kBytes);
}

}  // namespace q
}  // namespace KVR_ISA
}  // namespace kvr
