// Per-work-item kernels, compiled once per ISA (isa_avx512.cpp, isa_avx2.cpp).
// No OpenMP and no torch here: the parallel regions live in bindings.cpp, which
// calls these for one row, one token or one attention tile at a time.
#pragma once
#include <cstdint>

namespace kvr {

// Element types: float32 and bfloat16 (stored as uint16_t bits); FP8 only as a KV cache's
// (--kv-cache-dtype fp8_e4m3): each head's D codes (e4m3fn bytes) then its scale, 2 bytes
// of float16, so a token's row of one head is D + 2 bytes (kFp8ScaleBytes).
enum class DType : int { F32 = 0, BF16 = 1, FP8 = 2 };
constexpr int kFp8ScaleBytes = 2;

struct AttnGeom {
  int H, KVH, D, bs;
  int64_t q_stride;      // elements between tokens in q (heads contiguous, D each)
  int64_t out_stride;    // elements between tokens in out
  int64_t block_stride;  // elements per cache block: layers * 2 * bs * KVH * D
  int64_t layer_off;     // elements from a block's start to this layer's K rows
  float scale;
};

// Memory to bring into L2 a few lines at a time from inside the attention loops: runs
// of 64-byte lines (a block's K or V rows of one layer), `per` lines a call to step()
// (bindings.cpp, attention). `own`: the generic tile kernel still fetches its own next
// chunk (rows Fetch did not bring).
struct FetchRun {
  const char* p;
  int64_t lines;
};
struct Fetch {
  const FetchRun* run = nullptr;
  int64_t n = 0, i = 0, l = 0;  // runs [i, n) left, line l of run i next
  int per = 0;
  bool own = true;
  inline void step() {
    for (int k = 0; k < per && i < n; ++k) {
      __builtin_prefetch(run[i].p + l * 64, 0, 2);
      if (++l == run[i].lines) l = 0, ++i;
    }
  }
};

// One attention tile: `n` consecutive query tokens of one sequence (token index
// tok0 in q/out, position pos0) against KV head `kvh`, reading K/V in place from
// the blocks of `table`. Query i attends to positions [0, pos0 + i].
struct AttnTile {
  int tok0, n, pos0, kvh;  // kvh < 0: a decode tile (n == 1) over every KV head
  const int64_t* table;
  // Fetch ahead the next chunk's whole token rows (every KV head's K or V), not only
  // this head's: the tiles of the same tokens' other heads follow on this thread.
  bool whole_rows = false;
  // The next sequence's K/V, fetched while this tile computes (a decode step's tiles).
  Fetch* fetch = nullptr;
};

struct Kernels {
  void (*rms_norm_row)(const void* x, const void* w, void* out, int n, float eps);
  // h += r (rounded to the dtype), then out = rms_norm(h) * w.
  void (*add_rms_norm_row)(void* h, const void* r, const void* w, void* out, int n, float eps);
  // out[i] = silu(x[i]) * x[n + i]
  void (*silu_mul_row)(const void* x, void* out, int n);
  // Rotates the q and k heads of one token's qkv row in place (rotate-half), then
  // copies k and v to their cache rows.
  void (*rope_write_token)(void* qkv, const float* cos, const float* sin, int H, int KVH,
                           int D, void* k_dst, void* v_dst);
  // `scratch` holds attend_scratch_floats(...) floats owned by the calling thread.
  void (*attend)(const void* q, void* out, const void* cache, const AttnGeom& g,
                 const AttnTile& t, float* scratch);
};

// rows: the most query rows of a tile (a decode tile over every KV head: H); width:
// the elements of a token's K row (KVH * D).
inline int64_t attend_scratch_floats(int rows, int ctx, int D, int width) {
  return int64_t(rows) * (ctx + 2 * D) + 16 * int64_t(D + width) + 64;
}

// dt: the activations' dtype; cache: the KV cache's (rope_write_token and attend
// convert between them).
const Kernels* kernels_avx512(DType dt, DType cache);

// bfloat16 GEMM for decode-sized M with AVX-512 BF16 (gemm_bf16.cpp). The weight
// (N, K) is packed by pack_bf16_pairs into ceil(N/16) * ceil(K/2) * 32 values;
// gemm_bf16_pairs computes the columns of blocks [blk0, blk1) (16 columns each) for
// all M rows (K even), bias optional (float32), output rounded to bfloat16.
constexpr int kGemmRows = 8;
void pack_bf16_pairs(const uint16_t* w, int64_t N, int64_t K, uint16_t* out);
void gemm_bf16_pairs(const uint16_t* x, int64_t ldx, int64_t M, const uint16_t* wp, int64_t K,
                     int64_t blk0, int64_t blk1, const float* bias, uint16_t* y, int64_t ldy,
                     int64_t N);
// The same GEMM for prefill-sized M with AMX tiles (gemm_bf16_amx.cpp), over the same
// packed weight; K a multiple of 32. up > 0: a fused gate/up weight whose up half
// starts at block `up`, y = silu(gate) * up (N = 16 up columns). amx_bf16_usable: the
// CPU has AMX-BF16 and Linux granted the tile state.
bool amx_bf16_usable();
void gemm_bf16_amx(const uint16_t* x, int64_t ldx, int64_t M, const uint16_t* wp, int64_t K,
                   int64_t blk0, int64_t blk1, const float* bias, uint16_t* y, int64_t ldy,
                   int64_t N, int64_t up);
const Kernels* kernels_avx2(DType dt, DType cache);

// The 64 bytes ldtilecfg reads (palette 1: rows and bytes a row of tiles 0-7), for the
// AMX files (gemm_bf16_amx.cpp, attn_prefill_amx.cpp).
struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Prompt attention with AMX tiles, head_dim 64 or 128, bfloat16 (attn_prefill_amx.cpp).
// A chunk's keys of one KV head are packed once a layer (prefill_amx_pack: K as
// [tpad][D], V transposed as [D][tpad], tpad a multiple of 32), and each 16 queries'
// Q^T (prefill_amx_pack_q: D / 32 parts of 16 x 16 pairs); prefill_amx_unit then computes
// the output of 16 queries (nq valid) of one head: query i0 + n, after `start` cached
// positions, sees keys [0, start + i0 + n]; ps (64-byte aligned) and events: the
// calling thread's room for 512 values and one RescaleEvent per 32 keys. A thread loads
// the tile configuration (prefill_amx_configure) before its units and releases it after.
struct RescaleEvent {  // a unit's running max moved at this block of 32 keys, by alpha
  int32_t block;
  float alpha[16];
};
void prefill_amx_configure();
void prefill_amx_release();
void prefill_amx_pack(const uint16_t* const* src_k, const uint16_t* const* src_v, int n,
                      int64_t k0, int64_t tpad, int D, uint16_t* kp, uint16_t* vt);
void prefill_amx_pack_q(const uint16_t* q, int64_t ldq, int nq, int D, uint16_t* qt);
void prefill_amx_unit(const uint16_t* qt, const uint16_t* kp, int D, const uint16_t* vt,
                      int64_t tpad, int64_t start, int64_t i0, int nq, float scale,
                      uint16_t* out, int64_t ldo, uint16_t* ps, RescaleEvent* events);

// GGUF block types the quantized decode GEMM takes (their ggml type codes).
enum class QType : int { Q4_1 = 3, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

// GGUF-quantized GEMM for decode-sized M (gemm_q_impl.h): AVX-512 VNNI
// (isa_avx512_vnni.cpp) or AVX2 (isa_avx2.cpp). The (N, K) weight, as the file stores it
// (N rows of gguf_row_bytes: K / 32 blocks, or K / 256 super-blocks for the K types),
// is repacked by pack_gguf_blocks into ceil(N/16) * (K/32) groups of
// gguf_group_bytes(type) bytes; quantize_q8_<isa> turns x (M, K) float32 (or bfloat16:
// bf16, read as the float32 values they are) into int8 codes xq (M, K), a scale dx and
// sx = dx * sum of codes per 32 values (M, K/32), and sh, the same per 16 (M, K/16),
// which gemm_q_<isa> takes.
int64_t gguf_block_values(int type);
int64_t gguf_row_bytes(int type, int64_t K);
int64_t gguf_group_bytes(int type);
void pack_gguf_blocks(int type, const uint8_t* raw, int64_t N, int64_t K, uint8_t* out);
void quantize_q8_avx512(const void* x, bool bf16, int64_t ldx, int64_t M, int64_t K,
                        int8_t* xq, float* dx, float* sx, float* sh);
void quantize_q8_avx2(const void* x, bool bf16, int64_t ldx, int64_t M, int64_t K, int8_t* xq,
                      float* dx, float* sx, float* sh);
void gemm_q_avx512(int type, const int8_t* xq, const float* dx, const float* sx,
                   const float* sh, int64_t M, const uint8_t* wp, int64_t K, int64_t blk0,
                   int64_t blk1, const float* bias, float* y, int64_t ldy, int64_t N);
void gemm_q_avx2(int type, const int8_t* xq, const float* dx, const float* sx, const float* sh,
                 int64_t M, const uint8_t* wp, int64_t K, int64_t blk0, int64_t blk1,
                 const float* bias, float* y, int64_t ldy, int64_t N);

// float32 GEMM for decode-sized M (gemm_f32_impl.h, compiled per ISA). The weight
// (N, K) is packed by pack_f32_blocks into ceil(N/16) * K * 16 values, one layout for
// both ISAs; gemm_f32_<isa> computes the columns of blocks [blk0, blk1) (16 columns
// each) for all M rows of x, given transposed: xt (K, M), bias optional.
void pack_f32_blocks(const float* w, int64_t N, int64_t K, float* out);
void gemm_f32_avx512(const float* xt, int64_t M, const float* wp, int64_t K, int64_t blk0,
                     int64_t blk1, const float* bias, float* y, int64_t ldy, int64_t N);
void gemm_f32_avx2(const float* xt, int64_t M, const float* wp, int64_t K, int64_t blk0,
                   int64_t blk1, const float* bias, float* y, int64_t ldy, int64_t N);

// Attention tiles over a bfloat16 cache with AVX-512 BF16 (attn_bf16.cpp); the caller
// checks the CPU. False when it does not take the tile (head_dim other than 64 or 128,
// blocks not a multiple of 16 positions): Kernels::attend runs it instead.
bool attend_bf16(const void* q, void* out, const void* cache, const AttnGeom& g,
                 const AttnTile& t, float* scratch);
// The shapes it takes (bindings.cpp counts Fetch's calls by the kernel that runs).
bool attend_bf16_takes(const AttnGeom& g);

}  // namespace kvr
