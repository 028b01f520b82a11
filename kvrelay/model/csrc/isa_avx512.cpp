#include "kernels.h"
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c,prefer-vector-width=512")
#define KVR_ISA avx512
#include "kernels_impl.h"

namespace kvr {
const Kernels* kernels_avx512(DType dt) { return avx512::table(dt); }
}  // namespace kvr
