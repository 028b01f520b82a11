#include "kernels.h"
#pragma GCC target("avx2,fma,f16c")
#define KVR_ISA avx2
#include "kernels_impl.h"

namespace kvr {
const Kernels* kernels_avx2(DType dt) { return avx2::table(dt); }
}  // namespace kvr
