// The GGUF-quantized GEMM with AVX-512 VNNI (vpdpbusd); a CPU with AVX-512 but no VNNI
// runs the AVX2 one (bindings.cpp, gguf_isa).
#include "kernels.h"
// GCC 12 reports the AVX-512 intrinsics' _mm512_undefined_*() operands (self-initialized
// on purpose) as maybe uninitialized once they inline into quantize_any: 22 false
// warnings, GCC bug 105593, fixed in GCC 13. Off for this file's headers and code.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c,prefer-vector-width=512")
#define KVR_ISA avx512vnni
#define KVR_F32_LANES 16
#define KVR_Q_VNNI 1
#include "gemm_f32_impl.h"
#include "gemm_q_impl.h"

namespace kvr {
void quantize_q8_avx512(const void* x, bool bf16, int64_t ldx, int64_t M, int64_t K, int8_t* xq,
                        float* dx, float* sx, float* sh) {
  avx512vnni::q::quantize_any(x, bf16, ldx, M, K, xq, dx, sx, sh);
}
void gemm_q_avx512(int type, const int8_t* xq, const float* dx, const float* sx, const float* sh,
                   int64_t M, const uint8_t* wp, int64_t K, int64_t blk0, int64_t blk1,
                   const float* bias, float* y, int64_t ldy, int64_t N) {
  avx512vnni::q::gemm_any(type, xq, dx, sx, sh, M, wp, K, blk0, blk1, bias, y, ldy, N);
}
}  // namespace kvr
