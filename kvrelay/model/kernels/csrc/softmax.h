// exp and softmax for the attention kernels. Included inside the namespace of each
// translation unit that uses them (kernels_impl.h per ISA, attn_bf16.cpp), so every
// copy is compiled for its own target; static inline keeps the copies apart.

// exp for x <= 0 (softmax after subtracting the max), Cephes' polynomial:
// about 1 ulp, vectorizes (no libm call).
static inline float exp_neg(float x) {
  float xc = x < -87.0f ? -87.0f : x;
  float n = __builtin_floorf(xc * 1.44269504088896341f + 0.5f);
  float r = xc - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  float y = p * r * r + r + 1.0f;
  float scale = __builtin_bit_cast(float, (int32_t(n) + 127) << 23);
  return x < -87.0f ? 0.0f : y * scale;
}

// s[0, len) = softmax(s[0, len)) in place, in float32.
static inline void softmax_row(float* __restrict s, int len) {
  float m = s[0];
#pragma omp simd reduction(max : m)
  for (int p = 1; p < len; ++p) m = s[p] > m ? s[p] : m;
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int p = 0; p < len; ++p) {
    s[p] = exp_neg(s[p] - m);
    sum += s[p];
  }
  const float inv = 1.0f / sum;
#pragma omp simd
  for (int p = 0; p < len; ++p) s[p] *= inv;
}
