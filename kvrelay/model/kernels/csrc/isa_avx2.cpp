#include "kernels.h"
#pragma GCC target("avx2,fma,f16c")
#define KVR_ISA avx2
#define KVR_ATTN_LANES 8
#include "kernels_impl.h"
#define KVR_F32_LANES 8
#include "gemm_f32_impl.h"
#include "gemm_q_impl.h"

namespace kvr {
const Kernels* kernels_avx2(DType dt, DType cache) { return avx2::table(dt, cache); }
void gemm_f32_avx2(const float* xt, int64_t M, const float* wp, int64_t K, int64_t blk0,
                   int64_t blk1, const float* bias, float* y, int64_t ldy, int64_t N) {
  avx2::f32::gemm(xt, M, wp, K, blk0, blk1, bias, y, ldy, N);
}
void quantize_q8_avx2(const void* x, bool bf16, int64_t ldx, int64_t M, int64_t K, int8_t* xq,
                      float* dx, float* sx, float* sh) {
  avx2::q::quantize_any(x, bf16, ldx, M, K, xq, dx, sx, sh);
}
void gemm_q_avx2(int type, const int8_t* xq, const float* dx, const float* sx, const float* sh,
                 int64_t M, const uint8_t* wp, int64_t K, int64_t blk0, int64_t blk1,
                 const float* bias, float* y, int64_t ldy, int64_t N) {
  avx2::q::gemm_any(type, xq, dx, sx, sh, M, wp, K, blk0, blk1, bias, y, ldy, N);
}
}  // namespace kvr
