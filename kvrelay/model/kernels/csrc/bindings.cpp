// Python bindings and the parallel regions. Each entry point is one OpenMP
// parallel region (attention: rope + KV write, then the tiles, in one region), so
// a layer wakes the thread pool a few times instead of once per ATen op. Small
// inputs run on the calling thread: waking a sleeping thread costs more than they do.
#include <omp.h>
#include <torch/extension.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <unistd.h>

#include "kernels.h"

namespace kvr {

// Generic code (this file has no target pragma): runs once per weight at load.
void pack_f32_blocks(const float* w, int64_t N, int64_t K, float* out) {
  const int64_t nblk = (N + 15) / 16;
  for (int64_t b = 0; b < nblk; ++b)
    for (int64_t k = 0; k < K; ++k)
      for (int c = 0; c < 16; ++c) {
        const int64_t n = b * 16 + c;
        out[(b * K + k) * 16 + c] = n < N ? w[n * K + k] : 0.f;
      }
}

int64_t gguf_block_values(int type) {
  return type == int(QType::Q4_K) || type == int(QType::Q5_K) || type == int(QType::Q6_K)
             ? 256
             : 32;
}
int64_t gguf_row_bytes(int type, int64_t K) {
  const int64_t blocks = K / gguf_block_values(type);
  switch (QType(type)) {
    case QType::Q8_0: return blocks * 34;
    case QType::Q4_1: return blocks * 20;
    case QType::Q5_1: return blocks * 24;
    case QType::Q4_K: return blocks * 144;
    case QType::Q5_K: return blocks * 176;
    case QType::Q6_K: return blocks * 210;
  }
  return 0;
}
int64_t gguf_group_bytes(int type) {
  switch (QType(type)) {
    case QType::Q8_0: return 544;
    case QType::Q4_1: return 320;
    case QType::Q4_K: return 384;
    case QType::Q5_1:
    case QType::Q5_K:
    case QType::Q6_K: return 640;
  }
  return 0;
}

// The f16 at p (little-endian), as float.
static float f16_at(const uint8_t* p) {
  return float(c10::Half(uint16_t(p[0] | p[1] << 8), c10::Half::from_bits()));
}

// A Q4_K or Q5_K super-block's sub-block j (0-7): scale d sc and min -dmin m, from f16 d
// and dmin and the 6-bit sc and m packed in its 12 bytes (ggml's get_scale_min_k4).
static void k_scale_min(const uint8_t* sb, int j, float& scale, float& min) {
  const uint8_t* q = sb + 4;
  const int sc = j < 4 ? q[j] & 63 : (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
  const int m = j < 4 ? q[j + 4] & 63 : (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  scale = f16_at(sb) * float(sc), min = -f16_at(sb + 2) * float(m);
}

// GGUF rows (N rows of K / 32 blocks: Q8_0 f16 d + 32 int8; Q4_1 f16 d, f16 m + 16
// bytes, k < 16 in the low nibbles; Q4_K super-blocks of 256: f16 d, f16 dmin, 12 bytes
// of 6-bit scales and mins, 128 bytes of nibbles; Q6_K super-blocks of 256: 128 bytes of
// low nibbles, 64 of high bit pairs, 16 int8 scales, f16 d) -> the groups of
// gemm_q_impl.h, codes in chunks of [16 columns][4 k]. A Q4_K sub-block of 32 is a group
// as Q4_1's, value d sc q - dmin m, with its scale d sc and min -dmin m in float32
// (exact: an f16 times a 6-bit integer) where Q4_1 has f16. A Q6_K group holds its codes
// less 32 (int8, as Q8_0's) and the float32 d sc of each half (exact: f16 times int8).
// Q5_1 (f16 d, f16 m, 4 bytes of fifth bits, 16 of nibbles) and Q5_K (Q4_K's with 32
// bytes of fifth bits before the nibbles) groups hold the 5-bit codes as bytes, with a
// float32 scale and min (Q5_K's d sc and -dmin m, exact).
// Columns past N get zero scales, mins and codes. Generic code, once per weight at load.
void pack_gguf_blocks(int type, const uint8_t* raw, int64_t N, int64_t K, uint8_t* out) {
  const int64_t G = K / 32, nblk = (N + 15) / 16, bb = gguf_row_bytes(type, 32);
  const int64_t gb = gguf_group_bytes(type), row = gguf_row_bytes(type, K);
  std::memset(out, 0, size_t(nblk * G * gb));
  // column c's code of k in a group's chunks: a byte, or a nibble (k < 16 in the low
  // nibbles, as Q4_1 stores them)
  const auto put8 = [](uint8_t* codes, int64_t c, int k, uint8_t code) {
    codes[(k / 4) * 64 + c * 4 + k % 4] = code;
  };
  const auto put4 = [](uint8_t* codes, int64_t c, int k, uint8_t code) {
    codes[(k % 16 / 4) * 64 + c * 4 + k % 4] |= uint8_t(code << (k < 16 ? 0 : 4));
  };
  // column c's two float32 scales (or scale and min) of the K types' groups
  const auto put_f32 = [](uint8_t* dst, int64_t c, float a, float b) {
    std::memcpy(dst + 4 * c, &a, 4);
    std::memcpy(dst + 64 + 4 * c, &b, 4);
  };
  for (int64_t n = 0; n < N; ++n) {
    const int64_t b = n / 16, c = n % 16;
    for (int64_t g = 0; g < G; ++g) {
      uint8_t* dst = out + (b * G + g) * gb;
      const int j = int(g % 8);  // the K types' sub-block of 32 in its super-block
      if (type == int(QType::Q6_K)) {
        const uint8_t* sb = raw + n * row + g / 8 * 210;
        const int half = j / 4, t = j % 4;  // ggml's loop
        const uint8_t* ql = sb + 64 * half + (t % 2) * 32;
        const uint8_t* qh = sb + 128 + 32 * half;
        const int8_t* sc = (const int8_t*)(sb + 192) + 8 * half + 2 * t;
        const float d = f16_at(sb + 208);
        put_f32(dst, c, d * float(sc[0]), d * float(sc[1]));  // k 0-15, k 16-31
        for (int k = 0; k < 32; ++k) {
          const int lo = t < 2 ? ql[k] & 0x0f : ql[k] >> 4, hi = (qh[k] >> (2 * t)) & 3;
          put8(dst + 128, c, k, uint8_t(int8_t((lo | hi << 4) - 32)));
        }
      } else if (type == int(QType::Q5_K)) {
        const uint8_t* sb = raw + n * row + g / 8 * 176;
        float scale, min;
        k_scale_min(sb, j, scale, min);
        put_f32(dst, c, scale, min);
        // the nibbles of sub-blocks 2i and 2i + 1 share bytes 32 i ..: low and high; the
        // fifth bit of each is bit j of the same 32 bytes
        for (int k = 0; k < 32; ++k) {
          const uint8_t q = sb[48 + 32 * (j / 2) + k];
          put8(dst + 128, c, k, uint8_t((j % 2 == 0 ? q & 0x0f : q >> 4) |
                                        ((sb[16 + k] >> j) & 1) << 4));
        }
      } else if (type == int(QType::Q5_1)) {
        const uint8_t* src = raw + n * row + g * 24;
        put_f32(dst, c, f16_at(src), f16_at(src + 2));
        const uint32_t qh = uint32_t(src[4]) | uint32_t(src[5]) << 8 |
                            uint32_t(src[6]) << 16 | uint32_t(src[7]) << 24;  // bit k: k's
        for (int k = 0; k < 32; ++k) {
          const uint8_t q = src[8 + k % 16];
          put8(dst + 128, c, k, uint8_t((k < 16 ? q & 0x0f : q >> 4) | ((qh >> k) & 1) << 4));
        }
      } else if (type == int(QType::Q4_K)) {
        const uint8_t* sb = raw + n * row + g / 8 * 144;
        float scale, min;
        k_scale_min(sb, j, scale, min);
        put_f32(dst, c, scale, min);
        const uint8_t* qs = sb + 16 + 32 * (j / 2);  // as Q5_K's nibbles
        for (int k = 0; k < 32; ++k)
          put4(dst + 128, c, k, uint8_t(j % 2 == 0 ? qs[k] & 0x0f : qs[k] >> 4));
      } else {
        const uint8_t* src = raw + (n * G + g) * bb;
        std::memcpy(dst + 2 * c, src, 2);  // the scale d, f16
        if (type == int(QType::Q8_0)) {
          for (int k = 0; k < 32; ++k) put8(dst + 32, c, k, src[2 + k]);
        } else {
          std::memcpy(dst + 32 + 2 * c, src + 2, 2);  // the min m, f16
          for (int k = 0; k < 32; ++k)
            put4(dst + 64, c, k, uint8_t(k < 16 ? src[4 + k] & 0x0f : src[4 + k - 16] >> 4));
        }
      }
    }
  }
}

namespace {

bool env_is(const char* name, const char* value) {
  const char* v = std::getenv(name);
  return v != nullptr && std::strcmp(v, value) == 0;
}

// The widest kernels this CPU runs; KVRELAY_NATIVE_ISA=avx2 forces the AVX2 path
// (tests run every path the machine has).
std::string detect_isa() {
  __builtin_cpu_init();
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (avx512 && !env_is("KVRELAY_NATIVE_ISA", "avx2")) return "avx512";
  if (avx2) return "avx2";
  return "none";
}

std::string& isa_slot() {
  static std::string name = detect_isa();
  return name;
}

const std::string& isa() { return isa_slot(); }

// Tests run every path the CPU has: "avx2" on an AVX-512 machine is allowed, a path
// the CPU lacks is refused. Not thread-safe: call between steps, not during one.
bool set_isa(const std::string& name) {
  const std::string best = detect_isa();
  const bool ok = name == best || (name == "avx2" && best == "avx512");
  if (ok) isa_slot() = name;
  return ok;
}

DType dtype_of(const torch::Tensor& t) {
  if (t.scalar_type() == torch::kFloat32) return DType::F32;
  TORCH_CHECK(t.scalar_type() == torch::kBFloat16,
              "kvrelay native kernels take float32 or bfloat16, got ", t.scalar_type());
  return DType::BF16;
}

// The kernels for activations like t and, for attention, a KV cache like cache.
const Kernels* kernels_for(const torch::Tensor& t, const torch::Tensor* cache = nullptr) {
  const DType dt = dtype_of(t);
  const DType ct = cache == nullptr ? dt
                   : cache->scalar_type() == torch::kByte ? DType::FP8 : dtype_of(*cache);
  if (isa() == "avx512") return kernels_avx512(dt, ct);
  TORCH_CHECK(isa() == "avx2", "kvrelay native kernels need AVX2 or AVX-512");
  return kernels_avx2(dt, ct);
}

void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 2 && t.stride(1) == 1, name,
              " must be a CPU matrix with contiguous rows");
}

constexpr int64_t kParallelElems = 1 << 16;  // below this, one thread

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  check_rows(x, "x");
  TORCH_CHECK(w.is_contiguous() && w.numel() == x.size(1) && w.dtype() == x.dtype(),
              "weight must match x's last dimension and dtype");
  const Kernels* k = kernels_for(x);
  auto out = torch::empty({x.size(0), x.size(1)}, x.options());
  const int64_t T = x.size(0), n = x.size(1), es = x.element_size();
  const char* xp = (const char*)x.data_ptr();
  char* op = (char*)out.data_ptr();
#pragma omp parallel for if (T * n >= kParallelElems)
  for (int64_t t = 0; t < T; ++t)
    k->rms_norm_row(xp + t * x.stride(0) * es, w.data_ptr(), op + t * n * es, int(n), float(eps));
  return out;
}

// h += r in place, returns rms_norm(h) * w.
torch::Tensor add_rms_norm(torch::Tensor& h, const torch::Tensor& r, const torch::Tensor& w,
                           double eps) {
  check_rows(h, "h");
  check_rows(r, "r");
  TORCH_CHECK(h.sizes() == r.sizes() && h.dtype() == r.dtype(), "h and r must match");
  TORCH_CHECK(w.is_contiguous() && w.numel() == h.size(1) && w.dtype() == h.dtype(),
              "weight must match h's last dimension and dtype");
  const Kernels* k = kernels_for(h);
  auto out = torch::empty({h.size(0), h.size(1)}, h.options());
  const int64_t T = h.size(0), n = h.size(1), es = h.element_size();
  char* hp = (char*)h.data_ptr();
  const char* rp = (const char*)r.data_ptr();
  char* op = (char*)out.data_ptr();
#pragma omp parallel for if (T * n >= kParallelElems)
  for (int64_t t = 0; t < T; ++t)
    k->add_rms_norm_row(hp + t * h.stride(0) * es, rp + t * r.stride(0) * es, w.data_ptr(),
                        op + t * n * es, int(n), float(eps));
  return out;
}

torch::Tensor silu_mul(const torch::Tensor& x) {
  check_rows(x, "x");
  TORCH_CHECK(x.size(1) % 2 == 0, "silu_mul needs an even last dimension (gate, up)");
  const Kernels* k = kernels_for(x);
  const int64_t T = x.size(0), n = x.size(1) / 2, es = x.element_size();
  auto out = torch::empty({T, n}, x.options());
  const char* xp = (const char*)x.data_ptr();
  char* op = (char*)out.data_ptr();
#pragma omp parallel for if (T * n >= kParallelElems)
  for (int64_t t = 0; t < T; ++t) k->silu_mul_row(xp + t * x.stride(0) * es, op + t * n * es, int(n));
  return out;
}

std::vector<float>& scratch(int64_t floats) {
  thread_local std::vector<float> buf;
  if (int64_t(buf.size()) < floats) buf.resize(floats);
  return buf;
}

bool has_bf16_gemm();

// Where a sequence's K and V of a layer (its decode step's reads) exceed this, its
// decode tile covers every KV head at once (AttnTile::kvh): a third of L2, between
// the contexts measured on a 2 MiB L2 (600 tokens of SmolLM2's bfloat16 K/V, 460 KiB:
// head by head 3% faster; 1,000 tokens, 770 KiB: every head at once 3-5% faster,
// 13% at 2,000, 23% at 5,000).
// set_whole_heads_bytes changes it (tests: both ways at any context).
std::atomic<int64_t> g_whole_heads{-1};
int64_t whole_heads_bytes() {
  static const int64_t v = [] {
    const long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
    return (l2 > 0 ? int64_t(l2) : int64_t(1) << 20) / 3;
  }();
  const int64_t set = g_whole_heads.load(std::memory_order_relaxed);
  return set >= 0 ? set : v;
}
// n < 0: back to a third of L2. Returns the bytes in force before.
int64_t set_whole_heads_bytes(int64_t n) {
  const int64_t before = whole_heads_bytes();
  g_whole_heads.store(n < 0 ? -1 : n, std::memory_order_relaxed);
  return before;
}

// Positions (and step tokens) the attention kernels take: they index in int.
constexpr int64_t kMaxPositions = int64_t(1) << 30;

// The first cache row of `layer` (layer * 2 * bs, K then V, a block's layers in turn),
// after checking the geometry without an overflow: every layer's rows fit the cache.
int64_t layer_rows(int64_t layer, int64_t layers, int64_t bs, int64_t total_rows) {
  TORCH_CHECK(bs > 0 && layers > 0 && bs <= total_rows && layers <= total_rows / (2 * bs) &&
                  layer >= 0 && layer < layers,
              "layer ", layer, " of ", layers, " (block size ", bs, ") does not fit the cache");
  return layer * 2 * bs;
}

// Each of the n layer-0 K rows in kr (a token's slot, or a key's) has its K and V rows of
// the layer whose rows start at lo (layer_rows) inside the cache's total_rows.
void check_kv_rows(const int64_t* kr, int64_t n, int64_t lo, int64_t bs, int64_t total_rows,
                   const char* what) {
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(kr[i] >= 0 && kr[i] < total_rows - lo - bs, "KV row ", kr[i], " of ", what,
                " ", i, " is outside the cache");
}

// One layer's attention. qkv (T, (H + 2 KVH) D): q and k are rotated in place, k and v
// written to the cache at k_rows (layer-0 K rows of KVH * D values, as
// attention.AttnMetadata.write_rows), then every query token attends to its
// sequence's context read in place from the blocks. seqs (S, 3): first token, token
// count, position of the first token; tables (S, W) block ids.
torch::Tensor attention(torch::Tensor& qkv, const torch::Tensor& positions,
                        const torch::Tensor& cos, const torch::Tensor& sin,
                        const torch::Tensor& k_rows, const torch::Tensor& seqs,
                        const torch::Tensor& tables, torch::Tensor& cache, int64_t layer,
                        int64_t H, int64_t KVH, int64_t D, int64_t bs, int64_t layers,
                        int64_t skip_from, int64_t skip_tokens) {
  check_rows(qkv, "qkv");
  const int64_t T = qkv.size(0);
  TORCH_CHECK(qkv.size(1) == (H + 2 * KVH) * D, "qkv width must be (H + 2 KVH) * D");
  TORCH_CHECK(H % KVH == 0 && D % 16 == 0 && D <= 512,
              "native attention needs head_dim a multiple of 16, at most 512");
  // uint8: an fp8_e4m3 cache, each head's D codes followed by its float16 scale
  const bool fp8 = cache.scalar_type() == torch::kByte;
  TORCH_CHECK(cache.is_contiguous() && (cache.dtype() == qkv.dtype() || fp8 ||
                                         (qkv.scalar_type() == torch::kFloat32 &&
                                          cache.scalar_type() == torch::kBFloat16)),
              "cache: contiguous, qkv's dtype, bfloat16 under float32, or uint8 (fp8_e4m3 "
              "codes and scales)");
  TORCH_CHECK(!fp8 || cache.size(-1) == D + kFp8ScaleBytes,
              "an fp8 cache's rows hold head_dim codes and a 2-byte scale per head");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.dtype() == torch::kFloat32 &&
                  sin.dtype() == torch::kFloat32 && cos.size(1) == D,
              "cos/sin: contiguous float32 (max_len, D)");
  TORCH_CHECK(positions.dtype() == torch::kInt64 && k_rows.dtype() == torch::kInt64 &&
                  seqs.dtype() == torch::kInt64 && tables.dtype() == torch::kInt64,
              "positions, k_rows, seqs and tables must be int64");
  TORCH_CHECK(positions.is_contiguous() && k_rows.is_contiguous() && seqs.is_contiguous() &&
                  tables.is_contiguous() && positions.numel() == T && k_rows.numel() >= T,
              "positions, k_rows, seqs, tables: contiguous, one position and row per token");
  const Kernels* k = kernels_for(qkv, &cache);
  auto out = torch::empty({T, H * D}, qkv.options());
  const int64_t es = qkv.element_size(), ces = cache.element_size();
  const int64_t row = KVH * (fp8 ? D + kFp8ScaleBytes : D);  // cache elements a token
  AttnGeom g{int(H), int(KVH), int(D), int(bs), qkv.stride(0), H * D,
             layers * 2 * bs * row, layer * 2 * bs * row, float(1.0 / std::sqrt(double(D)))};
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* kr = k_rows.data_ptr<int64_t>();
  const int64_t* sq = seqs.data_ptr<int64_t>();
  const int64_t S = seqs.size(0), W = tables.size(1);
  const int64_t max_pos = cos.size(0);
  // Bounds, so that a bad block table is an error and never a read or write outside
  // the cache: O(tokens + blocks) per layer, nothing next to the attention itself.
  const int64_t n_blocks = cache.size(0), total_rows = cache.numel() / row;
  const int64_t lo = layer_rows(layer, layers, bs, total_rows);
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < max_pos, "position ", pos[t], " outside the rope table");
  check_kv_rows(kr, T, lo, bs, total_rows, "token");
  // Tiles: up to 64 query rows (tokens x the G heads sharing a KV head) each.
  const int G = int(H / KVH), tile_tokens = G >= 64 ? 1 : 64 / G;
  std::vector<AttnTile> tiles;
  int max_ctx = 1;
  double work = double(T) * (H + KVH) * D;  // rope (alone where skip_from takes the rest)
  for (int64_t s = 0; s < S; ++s) {
    // checked as int64 (no sum can overflow), then narrowed
    TORCH_CHECK(sq[3 * s] >= 0 && sq[3 * s + 1] >= 1 && sq[3 * s + 1] <= T - sq[3 * s] &&
                    sq[3 * s + 2] >= 0 && sq[3 * s + 2] < kMaxPositions &&
                    (sq[3 * s + 2] + sq[3 * s + 1] + bs - 1) / bs <= W,
                "seqs row ", s, " does not fit the step or its block table");
    const int tok0 = int(sq[3 * s]), n = int(sq[3 * s + 1]), pos0 = int(sq[3 * s + 2]);
    const int64_t* row_table = tables.data_ptr<int64_t>() + s * W;
    for (int64_t b = 0; b < (pos0 + n + bs - 1) / bs; ++b)
      TORCH_CHECK(row_table[b] >= 0 && row_table[b] < n_blocks, "block id ", row_table[b],
                  " of seqs row ", s, " is outside the cache (", n_blocks, " blocks)");
    // skip_from, skip_tokens: the attention of a prompt chunk (more than one token: a
    // first chunk, or one after cached context) of skip_tokens tokens or more that
    // attends to skip_from positions or more is the caller's (native.NativeBackend:
    // torch's SDPA or the AMX kernel); its rope and KV write stay here. Compared as
    // int64: a skip_from past every position skips none.
    if (n > 1 && n >= skip_tokens && int64_t(pos0) + n >= skip_from) continue;
    max_ctx = std::max(max_ctx, pos0 + n);  // sizes the tiles' scratch
    work += double(n) * (pos0 + n) * H * D;
    for (int i = 0; i < n; i += tile_tokens)
      for (int h = 0; h < KVH; ++h)
        tiles.push_back({tok0 + i, std::min(tile_tokens, n - i), pos0 + i, h, row_table});
  }
  const int64_t n_tiles = int64_t(tiles.size());
  // With tiles enough for every thread to take a few sequences, each thread takes the
  // KVH tiles of the same tokens together, the first fetching whole token rows ahead
  // (every head's K or V: 16 tokens of a block are one contiguous run) for the others
  // to find in cache: on the AVX2 EPYC, batch 8 at 128-248 tokens of context, attention
  // 11.4-11.8 -> 10.4-10.9 ms a step (in-process A/B, alternating steps).
  const bool group = n_tiles >= 2 * KVH * omp_get_max_threads();
  if (group)
    for (auto& tile : tiles) tile.whole_rows = tile.kvh == 0;
  const int chunk = group ? int(KVH) : 1;
  // A decode step (one query token a sequence, sequences enough for every thread):
  // each thread takes a fixed run of whole sequences, balanced by context, and fetches
  // the next sequence's K/V of this layer into L2 a few lines at a time from inside the
  // current one's loops (Fetch). The tiles alone wait on memory chunk by chunk, a
  // thread's fill buffers then mostly idle; one burst of prefetches ahead of each
  // sequence stalls the thread as long as the misses would (both measured: no gain).
  // Spread thin, the fetch overlaps the compute: batch 8 at 140 tokens of context,
  // attention 2.4 -> 1.9 ms a bfloat16 step (1.95 -> 1.7 beside the GGUF codes;
  // 2.8 -> 2.5 for float32 over a bfloat16 cache, 3.4 -> 3.2 over float32).
  bool decode = group;
  for (const auto& tile : tiles) decode = decode && tile.n == 1;
  std::vector<double> cum(1, 0.0);  // cum[i]: context positions of the first i sequences
  if (decode)
    for (int64_t i = 0; i < n_tiles; i += KVH) cum.push_back(cum.back() + tiles[i].pos0 + 1);
  const int64_t need =
      attend_scratch_floats(std::max<int>(tile_tokens * G, int(H)), max_ctx, int(D), int(row));
  // A bfloat16 cache: the AVX-512 BF16 kernels where the CPU has them and they take the
  // shape (else the generic kernel, whose step() calls Fetch's quota counts below).
  const bool bf16 = qkv.scalar_type() == torch::kBFloat16 &&
                    cache.scalar_type() == torch::kBFloat16 && has_bf16_gemm() &&
                    attend_bf16_takes(g);
  char* qp = (char*)qkv.data_ptr();
  char* cp = (char*)cache.data_ptr();
  const float* cs = cos.data_ptr<float>();
  const float* sn = sin.data_ptr<float>();
#pragma omp parallel if (work >= 4.0 * kParallelElems)
  {
#pragma omp for
    for (int64_t t = 0; t < T; ++t) {
      char* kd = cp + ((kr[t] + layer * 2 * bs) * row) * ces;
      k->rope_write_token(qp + t * qkv.stride(0) * es, cs + pos[t] * D, sn + pos[t] * D, int(H),
                          int(KVH), int(D), kd, kd + bs * row * ces);
    }
    float* buf = scratch(need).data();
    auto run = [&](const AttnTile& tile) {
      if (!(bf16 && attend_bf16(qkv.data_ptr(), out.data_ptr(), cache.data_ptr(), g, tile,
                                buf)))
        k->attend(qkv.data_ptr(), out.data_ptr(), cache.data_ptr(), g, tile, buf);
    };
    if (decode) {
      const int nt = omp_get_num_threads(), me = omp_get_thread_num();
      const auto at = [&](int t) {  // first sequence of thread t's share: the boundary
        // nearest its part of the context (rounding up alone gave one thread everything
        // where a long context came last: [100 x 7, 800] split 1,500 / 0, now 700 / 800)
        const double want = cum.back() * t / nt;
        auto it = std::lower_bound(cum.begin(), cum.end(), want);
        if (it != cum.begin() && want - it[-1] < *it - want) --it;
        return int64_t(it - cum.begin());
      };
      const int64_t s0 = at(me), s1 = me + 1 == nt ? int64_t(cum.size()) - 1 : at(me + 1);
      // The share's K and V runs (a block's rows of this layer), sequence by sequence:
      // sequence s0 + j has runs [first[j], first[j + 1]), lines[j] lines in all.
      thread_local std::vector<FetchRun> runs;
      thread_local std::vector<int64_t> first, lines;
      runs.clear(), first.assign(1, 0), lines.clear();
      const int64_t run_bytes = int64_t(bs) * row * ces;  // K (or V) rows of a block
      for (int64_t s = s0; s < s1; ++s) {
        const AttnTile& t = tiles[s * KVH];
        const int ctx = t.pos0 + 1;
        int64_t n = 0;
        for (int b = 0; b * bs < ctx; ++b) {
          const char* kb = cp + (t.table[b] * g.block_stride + g.layer_off) * ces;
          const int64_t l = (std::min<int64_t>(bs, ctx - b * bs) * row * ces + 63) / 64;
          runs.push_back({kb, l});
          runs.push_back({kb + run_bytes, l});
          n += 2 * l;
        }
        first.push_back(int64_t(runs.size()));
        lines.push_back(n);
      }
      Fetch f;
      f.run = runs.data();
      f.i = first.size() > 2 ? first[1] : int64_t(runs.size());
      for (int64_t j = 0; j < s1 - s0; ++j) {
        const int64_t s = s0 + j;
        const bool last = j + 1 == s1 - s0;
        f.n = last ? int64_t(runs.size()) : first[j + 2];
        // the tile kernels call step() once a chunk of 16 positions and pass (K, V)
        const int chunks = (tiles[s * KVH].pos0 + 1 + 15) / 16;
        const int64_t calls = KVH * chunks * 2;
        f.per = last ? 0 : int(lines[j + 1] / calls) + 1;
        // the generic kernel's own fetch of its next chunk: only where Fetch has not
        // brought the rows (the share's first sequence)
        f.own = j == 0;
        // A long context: one tile over every KV head (see AttnTile::kvh); a short one
        // stays in L2 across its heads' tiles, which were 3% faster at 600 tokens.
        if (int64_t(tiles[s * KVH].pos0 + 1) * row * ces * 2 > whole_heads_bytes()) {
          AttnTile tile = tiles[s * KVH];
          tile.kvh = -1;
          tile.fetch = &f;
          run(tile);
        } else {
          for (int64_t i = s * KVH; i < (s + 1) * KVH; ++i) {
            AttnTile tile = tiles[i];
            tile.fetch = &f;
            run(tile);
          }
        }
      }
    } else {
#pragma omp for schedule(dynamic, chunk)
      for (int64_t i = 0; i < n_tiles; ++i) run(tiles[i]);
    }
  }
  return out;
}

// The checks every small-M GEMM makes: x a matrix of rows, the packed weight of the
// shape its packer gives for (N, K), the bias N values (returned as float32, or
// undefined without one).
void check_packed(const torch::Tensor& wp, torch::ScalarType type,
                  std::initializer_list<int64_t> shape, int64_t N, int64_t K) {
  TORCH_CHECK(wp.scalar_type() == type && wp.is_contiguous() &&
                  wp.sizes() == c10::IntArrayRef(shape),
              "packed weight does not match N=", N, ", K=", K);
}

torch::Tensor bias_f32(const c10::optional<torch::Tensor>& bias, int64_t N) {
  if (!bias.has_value()) return {};
  TORCH_CHECK(bias->numel() == N, "bias must have N=", N, " values");
  return bias->to(torch::kFloat32).contiguous();
}

// f(b0, b1) for contiguous ranges of the nblk column blocks, one per thread: each
// thread streams its own part of the weight once.
template <class F>
void over_blocks(int64_t nblk, int64_t work, F f) {
#pragma omp parallel if (work >= kParallelElems)
  {
    const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t b0 = nblk * t / nt, b1 = nblk * (t + 1) / nt;
    if (b0 < b1) f(b0, b1);
  }
}

// float32 -> bfloat16 as torch's .to(torch.bfloat16) rounds (c10::BFloat16: nearest,
// ties to even; NaN to 0x7FC0).
// Branch-free, so that loops of it vectorize.
inline uint16_t bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16;
  return (u & 0x7FFFFFFF) > 0x7F800000 ? uint16_t(0x7FC0) : uint16_t(r);
}

// n float32 values -> bfloat16 (bf16_bits)
inline void round_bf16(const float* y, uint16_t* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = bf16_bits(y[i]);
}

// The fused gate/up GEMMs' epilogue: out (M, I) = silu(gate) * up for the columns
// [c0, c1) of y (M, 2I: gate, then up), through the silu_mul kernel of out's dtype over
// a row [gate, up] as the unfused path hands it to silu_mul (y of type Y, rounded to
// bfloat16 first where out is bfloat16 and y float32): the values silu_mul gives of the
// unfused GEMM's output, without its second pass over (M, 2I) nor its call.
template <typename Y>
void silu_cols(const Kernels* k, bool out_bf16, const Y* y, int64_t M, int64_t I, int64_t c0,
               int64_t c1, void* out) {
  const int64_t n = c1 - c0;
  if (n <= 0) return;
  thread_local std::vector<float> buf;      // one row: 2n float32 values
  thread_local std::vector<uint16_t> bufh;  // or 2n bfloat16 ones
  if (out_bf16)
    bufh.resize(size_t(2 * n));
  else
    buf.resize(size_t(2 * n));
  for (int64_t m = 0; m < M; ++m) {
    const Y* g = y + m * 2 * I + c0;
    const Y* u = g + I;
    if (out_bf16) {
      uint16_t* b = bufh.data();
      for (int64_t c = 0; c < n; ++c) {
        if constexpr (sizeof(Y) == 2) {
          b[c] = g[c], b[n + c] = u[c];
        } else {
          b[c] = bf16_bits(g[c]), b[n + c] = bf16_bits(u[c]);
        }
      }
      k->silu_mul_row(b, (uint16_t*)out + m * I + c0, int(n));
    } else {
      for (int64_t c = 0; c < n; ++c) buf[size_t(c)] = g[c], buf[size_t(n + c)] = u[c];
      k->silu_mul_row(buf.data(), (float*)out + m * I + c0, int(n));
    }
  }
}

// The run of the small-M GEMMs: y = x W^T (+ bias) over every column block with
// gemm(b0, b1) on each thread's share; with silu (N = 2I, I a multiple of 16), each
// thread takes gate blocks and the up blocks I / 16 further, then writes out = silu(gate)
// * up for its columns (silu_cols) while they are in its cache.
template <typename Y, class F>
void run_gemm(int64_t N, int64_t K, int64_t M, bool silu, const Y* y, const Kernels* k,
              bool out_bf16, void* out, F gemm) {
  const int64_t nblk = (N + 15) / 16;
  if (!silu) {
    over_blocks(nblk, N * K, gemm);
    return;
  }
  const int64_t up = nblk / 2, I = N / 2;
  over_blocks(up, N * K, [&](int64_t b0, int64_t b1) {
    gemm(b0, b1);
    gemm(b0 + up, b1 + up);
    silu_cols(k, out_bf16, y, M, I, b0 * 16, b1 * 16, out);
  });
}

void check_silu(bool silu, int64_t N, const char* name) {
  TORCH_CHECK(!silu || N % 32 == 0, name, " silu needs N a multiple of 32, got ", N);
}

// AVX-512 BF16 (vdpbf16ps) for the small-M GEMM; off when the ISA is forced to AVX2.
bool has_bf16_gemm() {
  __builtin_cpu_init();
  return isa() == "avx512" && __builtin_cpu_supports("avx512bf16");
}

// (N, K) bfloat16 -> the pair layout of gemm_bf16.cpp, (ceil(N/16), ceil(K/2), 32).
torch::Tensor pack_bf16_gemm(const torch::Tensor& w) {
  TORCH_CHECK(w.device().is_cpu() && w.dim() == 2 && w.is_contiguous() &&
                  w.scalar_type() == torch::kBFloat16,
              "pack_bf16_gemm takes a contiguous bfloat16 (N, K) CPU matrix");
  const int64_t N = w.size(0), K = w.size(1);
  auto out = torch::empty({(N + 15) / 16, (K + 1) / 2, 32}, w.options());
  pack_bf16_pairs((const uint16_t*)w.data_ptr(), N, K, (uint16_t*)out.data_ptr());
  return out;
}

// y = x W^T (+ bias) with W packed by pack_bf16_gemm; x (M, K) bfloat16, K even.
torch::Tensor bf16_gemm(const torch::Tensor& x, const torch::Tensor& wp, int64_t N,
                        const c10::optional<torch::Tensor>& bias, bool silu) {
  TORCH_CHECK(has_bf16_gemm(), "bf16_gemm needs AVX-512 BF16");
  check_rows(x, "x");
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16, "bf16_gemm takes bfloat16 x and weight");
  const int64_t M = x.size(0), K = x.size(1), nblk = (N + 15) / 16;
  TORCH_CHECK(K % 2 == 0, "bf16_gemm needs an even K, got ", K);
  check_packed(wp, torch::kBFloat16, {nblk, K / 2, 32}, N, K);
  check_silu(silu, N, "bf16_gemm");
  const torch::Tensor b = bias_f32(bias, N);
  auto y = torch::empty({M, N}, x.options());
  auto out = silu ? torch::empty({M, N / 2}, x.options()) : y;
  if (M == 0) return out;  // the row kernels take 1 or more rows
  const uint16_t* xp = (const uint16_t*)x.data_ptr();
  const uint16_t* wpp = (const uint16_t*)wp.data_ptr();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  uint16_t* yp = (uint16_t*)y.data_ptr();
  const int64_t ldx = x.stride(0);
  run_gemm(N, K, M, silu, yp, kernels_for(x), true, out.data_ptr(), [&](int64_t b0, int64_t b1) {
    gemm_bf16_pairs(xp, ldx, M, wpp, K, b0, b1, bp, yp, N, N);
  });
  return out;
}

// The AMX GEMM (prefill-sized M) over pack_bf16_gemm's weight: AVX-512 BF16 kernels
// and a CPU with AMX-BF16 whose tile state Linux grants.
bool has_amx_bf16_gemm() { return has_bf16_gemm() && amx_bf16_usable(); }

// bf16_gemm with AMX tiles; K a multiple of 32. The column blocks go to the threads in
// pairs (a pair is one tile step's two B tiles), as evenly as pairs allow.
//
// silu: the fused gate/up projection (N = 2I, gate rows then up rows, I a multiple of
// 16), returning silu(gate) * up (M, I) with the same values as silu_mul of this GEMM's
// output, without writing and reading back the (M, 2I) product.
torch::Tensor bf16_gemm_amx(const torch::Tensor& x, const torch::Tensor& wp, int64_t N,
                            const c10::optional<torch::Tensor>& bias, bool silu) {
  TORCH_CHECK(has_amx_bf16_gemm(), "bf16_gemm_amx needs AMX-BF16");
  check_rows(x, "x");
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16, "bf16_gemm_amx takes bfloat16 x and weight");
  const int64_t M = x.size(0), K = x.size(1), nblk = (N + 15) / 16;
  TORCH_CHECK(K % 32 == 0, "bf16_gemm_amx needs K a multiple of 32, got ", K);
  TORCH_CHECK(!silu || N % 32 == 0, "bf16_gemm_amx silu needs N a multiple of 32, got ", N);
  check_packed(wp, torch::kBFloat16, {nblk, K / 2, 32}, N, K);
  const torch::Tensor b = bias_f32(bias, N);
  const int64_t out_n = silu ? N / 2 : N, up = silu ? nblk / 2 : 0;
  auto y = torch::empty({M, out_n}, x.options());
  if (M == 0 || N == 0) return y;
  const uint16_t* xp = (const uint16_t*)x.data_ptr();
  const uint16_t* wpp = (const uint16_t*)wp.data_ptr();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  uint16_t* yp = (uint16_t*)y.data_ptr();
  // work units: pairs of column blocks (silu: gate blocks, each with its up block)
  const int64_t ldx = x.stride(0), step = silu ? 1 : 2, units = silu ? up : (nblk + 1) / 2;
  const int64_t end = silu ? up : nblk;
  // Both threads where the weight alone is enough work to split, as for the other small-M
  // GEMMs: at decode-sized M the call streams the weight from memory, and one thread
  // reads it at half the bandwidth (SmolLM2's o at 8 rows, 663 KB: a bfloat16 batch-8
  // step 12.6-12.8 -> 11.8-11.9 ms); or where the products are.
#pragma omp parallel if (N * K >= kParallelElems || M * N * K >= 64 * kParallelElems)
  {
    const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t b0 = step * (units * t / nt), b1 = std::min(end, step * (units * (t + 1) / nt));
    if (b0 < b1) gemm_bf16_amx(xp, ldx, M, wpp, K, b0, b1, bp, yp, out_n, out_n, up);
  }
  return y;
}

// Prompt attention on AMX tiles (attn_prefill_amx.cpp) for bfloat16 at head_dim 64, 128.
bool has_amx_prefill_attention() { return has_amx_bf16_gemm(); }

// The attention of the prompt chunks that attention() skipped (skip_from), into their
// rows of out. chunks (P, 4): first token in the step, cached positions before it
// (start), its tokens (length), and where its keys' layer-0 K rows begin in k_rows
// (start + length of them: every position up to the chunk's last). q is in qkv, rotated,
// and the chunk's K and V are in the cache: call after attention() of the same layer.
void prefill_attention(const torch::Tensor& qkv, const torch::Tensor& cache, torch::Tensor& out,
                       int64_t layer, const torch::Tensor& chunks, const torch::Tensor& k_rows,
                       int64_t H, int64_t KVH, int64_t D, int64_t bs, int64_t layers) {
  TORCH_CHECK(has_amx_prefill_attention(), "prefill_attention needs AMX-BF16");
  check_rows(qkv, "qkv");
  const int64_t T = qkv.size(0), row = KVH * D;
  TORCH_CHECK((D == 64 || D == 128) && KVH > 0 && H % KVH == 0 &&
                  qkv.size(1) == (H + 2 * KVH) * D,
              "prefill_attention takes head_dim 64 or 128 and qkv of (H + 2 KVH) * head_dim "
              "columns");
  TORCH_CHECK(qkv.scalar_type() == torch::kBFloat16 && cache.scalar_type() == torch::kBFloat16 &&
                  out.scalar_type() == torch::kBFloat16 && cache.is_contiguous(),
              "prefill_attention takes bfloat16 qkv, out and a contiguous bfloat16 cache");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == T && out.size(1) == H * D && out.stride(1) == 1,
              "out: (T, H * D) rows");
  TORCH_CHECK(chunks.device().is_cpu() && chunks.dtype() == torch::kInt64 &&
                  chunks.is_contiguous() && chunks.dim() == 2 && chunks.size(1) == 4 &&
                  k_rows.device().is_cpu() && k_rows.dtype() == torch::kInt64 &&
                  k_rows.is_contiguous(),
              "chunks: contiguous int64 (P, 4); k_rows: contiguous int64");
  TORCH_CHECK(cache.device().is_cpu() && out.device().is_cpu(), "cache and out must be on the CPU");
  const int64_t P = chunks.size(0), n_rows = k_rows.numel();
  const int64_t* ch = chunks.data_ptr<int64_t>();
  const int64_t* kr = k_rows.data_ptr<int64_t>();
  const int64_t total_rows = cache.numel() / row;
  const int64_t lo = layer_rows(layer, layers, bs, total_rows);
  check_kv_rows(kr, n_rows, lo, bs, total_rows, "key");
  // Each chunk's rows of the step (written by its units alone: no two may overlap), and
  // its keys within k_rows; checked as int64 so that no sum overflows.
  std::vector<std::pair<int64_t, int64_t>> spans;  // first token, tokens
  for (int64_t p = 0; p < P; ++p) {
    const int64_t first = ch[4 * p], start = ch[4 * p + 1], n = ch[4 * p + 2], off = ch[4 * p + 3];
    TORCH_CHECK(first >= 0 && n >= 1 && n <= T - first && start >= 0 && off >= 0 &&
                    off <= n_rows && n <= n_rows - off && start <= n_rows - off - n &&
                    start + n <= kMaxPositions,
                "chunks row ", p, " does not fit the step or k_rows");
    spans.emplace_back(first, n);
  }
  std::sort(spans.begin(), spans.end());
  for (size_t i = 1; i < spans.size(); ++i)
    TORCH_CHECK(spans[i].first >= spans[i - 1].first + spans[i - 1].second,
                "chunks overlap at token ", spans[i].first);
  std::vector<int64_t> base(1, 0);  // scratch of chunk p from base[p]: K then V^T per KV head
  std::vector<int64_t> tpads;        // chunk p's keys, padded to a multiple of 32
  int64_t max_blocks = 0;            // of 32 keys, in a chunk
  struct Queries {  // a unit: 16 queries of one head
    int64_t p, h, i0;
  };
  std::vector<Queries> qs;
  std::vector<std::array<int64_t, 3>> packs;  // chunk, KV head, first key
  const int64_t G = H / KVH;
  double work = 0;
  for (int64_t p = 0; p < P; ++p) {
    const int64_t start = ch[4 * p + 1], n = ch[4 * p + 2];
    const int64_t tpad = (start + n + 31) / 32 * 32;
    tpads.push_back(tpad);
    max_blocks = std::max(max_blocks, tpad / 32);
    base.push_back(base.back() + 2 * KVH * tpad * D);
    for (int64_t kvh = 0; kvh < KVH; ++kvh) {
      for (int64_t k0 = 0; k0 < tpad; k0 += 32) packs.push_back({p, kvh, k0});
      for (int64_t h = kvh * G; h < (kvh + 1) * G; ++h)  // longest first, for the balance
        for (int64_t i0 = (n - 1) / 16 * 16; i0 >= 0; i0 -= 16) qs.push_back({p, h, i0});
    }
    work += double(n) * (start + n) * H * D;
  }
  if (qs.empty()) return;
  const int64_t nt = omp_get_max_threads();
  const int64_t qt_at = base.back();  // then each unit's Q^T, 16 x D values
  const int64_t ps_at = qt_at + int64_t(qs.size()) * 16 * D;  // then each thread's P^T blocks
  // the calling thread's, kept between calls (a fresh buffer a layer faulted its pages
  // in) up to kKeepScratch values (256 MiB): a rare step of long prompts past that does
  // not hold its size after
  constexpr size_t kKeepScratch = size_t(128) << 20;
  thread_local std::vector<uint16_t> scratch;
  const size_t need = size_t(ps_at + nt * max_blocks * 512) + 32;
  std::vector<RescaleEvent> events(size_t(nt * max_blocks));  // each thread's rescales
  if (scratch.size() < need) scratch.resize(need);
  // 64-byte aligned: a tile row (64 bytes) across two cache lines reads both
  uint16_t* sp = (uint16_t*)((uintptr_t(scratch.data()) + 63) & ~uintptr_t(63));
  const uint16_t* cp = (const uint16_t*)cache.data_ptr();
  const uint16_t* qp = (const uint16_t*)qkv.data_ptr();
  uint16_t* op = (uint16_t*)out.data_ptr();
  const int64_t ldq = qkv.stride(0), ldo = out.stride(0);
  const float scale = float(1.0 / std::sqrt(double(D)));
  const int64_t n_packs = int64_t(packs.size()), n_qs = int64_t(qs.size());
#pragma omp parallel if (work >= kParallelElems)
  {
#pragma omp for schedule(static) nowait
    for (int64_t i = 0; i < n_packs; ++i) {
      const auto [p, kvh, k0] = packs[size_t(i)];
      const int64_t start = ch[4 * p + 1], n = ch[4 * p + 2], off = ch[4 * p + 3];
      const int64_t tpad = tpads[size_t(p)];
      const int cnt = int(std::min<int64_t>(32, start + n - k0));
      const uint16_t* src_k[32];
      const uint16_t* src_v[32];
      for (int r = 0; r < cnt; ++r) {
        const uint16_t* k = cp + (kr[off + k0 + r] + lo) * row + kvh * D;
        src_k[r] = k, src_v[r] = k + bs * row;
      }
      uint16_t* kp = sp + base[size_t(p)] + 2 * kvh * tpad * D;
      prefill_amx_pack(src_k, src_v, cnt, k0, tpad, int(D), kp, kp + tpad * D);
    }
#pragma omp for schedule(static)
    for (int64_t i = 0; i < n_qs; ++i) {
      const Queries u = qs[size_t(i)];
      const int64_t first = ch[4 * u.p], n = ch[4 * u.p + 2];
      prefill_amx_pack_q(qp + (first + u.i0) * ldq + u.h * D, ldq,
                         int(std::min<int64_t>(16, n - u.i0)), int(D), sp + qt_at + i * 16 * D);
    }
    prefill_amx_configure();
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n_qs; ++i) {
      const Queries u = qs[size_t(i)];
      const int64_t first = ch[4 * u.p], start = ch[4 * u.p + 1], n = ch[4 * u.p + 2];
      const int64_t tpad = tpads[size_t(u.p)];
      const uint16_t* kp = sp + base[size_t(u.p)] + 2 * (u.h / G) * tpad * D;
      const int nq = int(std::min<int64_t>(16, n - u.i0));
      const int64_t me = omp_get_thread_num();
      prefill_amx_unit(sp + qt_at + i * 16 * D, kp, int(D), kp + tpad * D, tpad, start, u.i0,
                       nq, scale, op + (first + u.i0) * ldo + u.h * D, ldo,
                       sp + ps_at + me * max_blocks * 512, events.data() + me * max_blocks);
    }
    prefill_amx_release();
  }
  if (scratch.size() > kKeepScratch) std::vector<uint16_t>().swap(scratch);
}

// float32 small-M GEMM: AVX-512 or AVX2 + FMA, whichever the kernels run with.
bool has_f32_gemm() { return isa() == "avx512" || isa() == "avx2"; }

// (N, K) float32 -> the block layout of gemm_f32_impl.h, (ceil(N/16), K, 16).
torch::Tensor pack_f32_gemm(const torch::Tensor& w) {
  TORCH_CHECK(w.device().is_cpu() && w.dim() == 2 && w.is_contiguous() &&
                  w.scalar_type() == torch::kFloat32,
              "pack_f32_gemm takes a contiguous float32 (N, K) CPU matrix");
  const int64_t N = w.size(0), K = w.size(1);
  auto out = torch::empty({(N + 15) / 16, K, 16}, w.options());
  pack_f32_blocks(w.data_ptr<float>(), N, K, out.data_ptr<float>());
  return out;
}

// y = x W^T (+ bias) with W packed by pack_f32_gemm; x (M, K) float32.
torch::Tensor f32_gemm(const torch::Tensor& x, const torch::Tensor& wp, int64_t N,
                       const c10::optional<torch::Tensor>& bias, bool silu) {
  TORCH_CHECK(has_f32_gemm(), "f32_gemm needs AVX2 + FMA or AVX-512");
  check_rows(x, "x");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32, "f32_gemm takes float32 x and weight");
  const int64_t M = x.size(0), K = x.size(1), nblk = (N + 15) / 16;
  check_packed(wp, torch::kFloat32, {nblk, K, 16}, N, K);
  check_silu(silu, N, "f32_gemm");
  const torch::Tensor b = bias_f32(bias, N);
  auto y = torch::empty({M, N}, x.options());
  auto out = silu ? torch::empty({M, N / 2}, x.options()) : y;
  if (M == 0 || N == 0) return out;  // the row kernels take 1 or more rows
  auto* run = isa() == "avx512" ? gemm_f32_avx512 : gemm_f32_avx2;
  // x transposed, (K, M), as the kernel takes it (gemm_f32_impl.h)
  thread_local std::vector<float> xt;
  xt.resize(size_t(M * K));
  const float* xp = x.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) xt[size_t(k * M + m)] = xp[m * ldx + k];
  const float* wpp = wp.data_ptr<float>();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const float* xtp = xt.data();  // this thread's buffer (in the lambda, `xt` is the worker's)
  run_gemm(N, K, M, silu, yp, kernels_for(x), false, out.data_ptr(), [&](int64_t b0, int64_t b1) {
    run(xtp, M, wpp, K, b0, b1, bp, yp, N, N);
  });
  return out;
}

bool gguf_type_known(int64_t type) {
  return type == int(QType::Q8_0) || type == int(QType::Q4_1) || type == int(QType::Q5_1) ||
         type == int(QType::Q4_K) || type == int(QType::Q5_K) || type == int(QType::Q6_K);
}

// GGUF raw rows (N, K / 32 * block bytes) uint8 -> (ceil(N/16), K/32, group bytes).
torch::Tensor pack_gguf_gemm(const torch::Tensor& raw, int64_t type, int64_t K) {
  TORCH_CHECK(gguf_type_known(type),
              "pack_gguf_gemm takes GGUF types Q8_0 (8), Q4_1 (3), Q5_1 (7), Q4_K (12), Q5_K "
              "(13) or Q6_K (14), got ", type);
  const int64_t per = gguf_block_values(int(type));
  TORCH_CHECK(K > 0 && K % per == 0, "K must be a positive multiple of ", per, ", got ", K);
  TORCH_CHECK(raw.device().is_cpu() && raw.dim() == 2 && raw.is_contiguous() &&
                  raw.scalar_type() == torch::kUInt8 &&
                  raw.size(1) == gguf_row_bytes(int(type), K),
              "raw must be contiguous uint8 (N, ", gguf_row_bytes(int(type), K), ")");
  const int64_t N = raw.size(0);
  auto out = torch::empty({(N + 15) / 16, K / 32, gguf_group_bytes(int(type))}, raw.options());
  pack_gguf_blocks(int(type), raw.data_ptr<uint8_t>(), N, K, out.data_ptr<uint8_t>());
  return out;
}

// The quantized GEMM's instruction set: AVX-512 with VNNI, else AVX2 (also on an
// AVX-512 CPU without VNNI), following the ISA the kernels run with.
std::string gguf_isa() {
  __builtin_cpu_init();
  if (isa() == "avx512" && __builtin_cpu_supports("avx512vnni")) return "avx512";
  return isa() == "none" ? "none" : "avx2";
}

// A grow-only buffer of a thread's, not zero-filled (std::vector's resize fills it), kept
// between calls up to kKeep elements (a prefill chunk's), not at a rare larger call's size.
template <typename T>
struct Scratch {
  static constexpr int64_t kKeep = (int64_t(64) << 20) / int64_t(sizeof(T));
  std::unique_ptr<T[]> buf;
  int64_t cap = 0;
  T* get(int64_t n) {
    if (n > cap) buf.reset(new T[size_t(n)]), cap = n;
    return buf.get();
  }
  void trim() {
    if (cap > kKeep) buf.reset(), cap = 0;
  }
};

// y = x W^T (+ bias), W packed by pack_gguf_gemm; x (M, K) float32 or bfloat16, quantized
// to int8 per 32 values (gemm_q_impl.h), the result in x's dtype.
torch::Tensor gguf_gemm(const torch::Tensor& x_in, const torch::Tensor& wp, int64_t type,
                        int64_t N, const c10::optional<torch::Tensor>& bias, bool silu) {
  TORCH_CHECK(has_f32_gemm(), "gguf_gemm needs AVX2 + FMA or AVX-512");
  check_rows(x_in, "x");
  TORCH_CHECK(gguf_type_known(type), "unknown GGUF type ", type,
              "; gguf_gemm takes Q8_0 (8), Q4_1 (3), Q5_1 (7), Q4_K (12), Q5_K (13) or Q6_K "
              "(14)");
  TORCH_CHECK(x_in.scalar_type() == torch::kFloat32 || x_in.scalar_type() == torch::kBFloat16,
              "gguf_gemm takes float32 or bfloat16 x");
  const bool bf16 = x_in.scalar_type() == torch::kBFloat16;
  const int64_t M = x_in.size(0), K = x_in.size(1), nblk = (N + 15) / 16, G = K / 32;
  TORCH_CHECK(K % 32 == 0, "packed weight does not match N=", N, ", K=", K);
  check_packed(wp, torch::kUInt8, {nblk, G, gguf_group_bytes(int(type))}, N, K);
  check_silu(silu, N, "gguf_gemm");
  const torch::Tensor b = bias_f32(bias, N);
  // The result in x's dtype; the float32 products go to `y` itself only for float32 x
  // without silu, else to this thread's scratch, which each worker then rounds (silu_cols,
  // or bf16_bits as .to() rounds) for its own columns while they are in its cache. With
  // bfloat16 x that saves the two conversions around the call (a torch op each, 5-12 us of
  // a 15-55 us call at 8 rows).
  auto out = torch::empty({M, silu ? N / 2 : N}, x_in.options());
  if (M == 0 || N == 0) return out;
  thread_local Scratch<float> scratch;  // [y] [scales, scaled sums, half sums]
  thread_local Scratch<int8_t> codes;
  const bool y_is_out = !silu && !bf16;
  float* sp = scratch.get((y_is_out ? 0 : M * N) + 4 * M * G);
  float* yp = y_is_out ? out.data_ptr<float>() : sp;
  float* dxp = sp + (y_is_out ? 0 : M * N);
  float* sxp = dxp + M * G;
  float* shp = sxp + M * G;
  int8_t* xqp = codes.get(M * K);
  const bool vnni = gguf_isa() == "avx512";
  (vnni ? quantize_q8_avx512 : quantize_q8_avx2)(x_in.data_ptr(), bf16, x_in.stride(0), M, K,
                                                 xqp, dxp, sxp, shp);
  auto* run = vnni ? gemm_q_avx512 : gemm_q_avx2;
  const uint8_t* wpp = wp.data_ptr<uint8_t>();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  uint16_t* ob = bf16 && !silu ? (uint16_t*)out.data_ptr() : nullptr;
  run_gemm(N, K, M, silu, yp, kernels_for(x_in), bf16, out.data_ptr(), [&](int64_t b0, int64_t b1) {
    run(int(type), xqp, dxp, sxp, shp, M, wpp, K, b0, b1, bp, yp, N, N);
    if (ob)
      for (int64_t m = 0; m < M; ++m)
        round_bf16(yp + m * N + b0 * 16, ob + m * N + b0 * 16, std::min(N, b1 * 16) - b0 * 16);
  });
  scratch.trim();
  codes.trim();
  return out;
}

}  // namespace
}  // namespace kvr

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "kvrelay native CPU kernels (see kvrelay/model/native.py)";
  // native.API: bumped whenever a binding's signature changes meaning, so a module built
  // from older sources is refused at load (pybind11 would, say, take an int for a bool).
  m.attr("API") = 4;
  m.def("isa", &kvr::isa, "the instruction set the kernels run with");
  m.def("set_isa", &kvr::set_isa, "use the kernels of an instruction set this CPU has");
  m.def("max_threads", []() { return omp_get_max_threads(); });
  // Every kernel runs without the GIL, as ATen's own ops do: the server's event loop
  // thread (HTTP streaming, detokenizing) keeps running during a step's kernels
  // instead of waiting for the engine thread to reach a Python bytecode boundary.
  using nogil = pybind11::call_guard<pybind11::gil_scoped_release>;
  m.def("rms_norm", &kvr::rms_norm, nogil());
  m.def("add_rms_norm", &kvr::add_rms_norm, nogil());
  m.def("silu_mul", &kvr::silu_mul, nogil());
  m.def("attention", &kvr::attention, nogil());
  m.def("set_whole_heads_bytes", &kvr::set_whole_heads_bytes,
        "decode attention: a sequence whose layer K/V exceeds this many bytes takes one tile "
        "over every KV head (n < 0: a third of L2); returns the value before");
  m.def("has_bf16_gemm", &kvr::has_bf16_gemm, "AVX-512 BF16 small-M GEMM available");
  m.def("pack_bf16_gemm", &kvr::pack_bf16_gemm, nogil());
  m.def("bf16_gemm", &kvr::bf16_gemm, pybind11::arg("x"), pybind11::arg("packed"),
        pybind11::arg("n"), pybind11::arg("bias") = pybind11::none(),
        pybind11::arg("silu") = false, nogil());
  m.def("has_amx_bf16_gemm", &kvr::has_amx_bf16_gemm, "AMX-BF16 prefill GEMM available");
  m.def("bf16_gemm_amx", &kvr::bf16_gemm_amx, pybind11::arg("x"), pybind11::arg("packed"),
        pybind11::arg("n"), pybind11::arg("bias") = pybind11::none(),
        pybind11::arg("silu") = false, nogil());
  m.def("has_amx_prefill_attention", &kvr::has_amx_prefill_attention,
        "AMX-BF16 prompt attention available");
  m.def("prefill_attention", &kvr::prefill_attention, nogil());
  m.def("pack_gguf_gemm", &kvr::pack_gguf_gemm, nogil());
  m.def("gguf_gemm", &kvr::gguf_gemm, pybind11::arg("x"), pybind11::arg("packed"),
        pybind11::arg("type"), pybind11::arg("n"), pybind11::arg("bias") = pybind11::none(),
        pybind11::arg("silu") = false, nogil());
  m.def("gguf_isa", &kvr::gguf_isa, "the instruction set of the quantized GEMM");
  m.def("has_f32_gemm", &kvr::has_f32_gemm, "float32 small-M GEMM available");
  m.def("pack_f32_gemm", &kvr::pack_f32_gemm, nogil());
  m.def("f32_gemm", &kvr::f32_gemm, pybind11::arg("x"), pybind11::arg("packed"),
        pybind11::arg("n"), pybind11::arg("bias") = pybind11::none(),
        pybind11::arg("silu") = false, nogil());
}
