#include "kernels.h"
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c,prefer-vector-width=512")
#define KVR_ISA avx512
#include "kernels_impl.h"
#define KVR_F32_LANES 16
#include "gemm_f32_impl.h"

namespace kvr {
const Kernels* kernels_avx512(DType dt, DType cache) { return avx512::table(dt, cache); }
void gemm_f32_avx512(const float* xt, int64_t M, const float* wp, int64_t K, int64_t blk0,
                     int64_t blk1, const float* bias, float* y, int64_t ldy, int64_t N) {
  avx512::f32::gemm(xt, M, wp, K, blk0, blk1, bias, y, ldy, N);
}
}  // namespace kvr
