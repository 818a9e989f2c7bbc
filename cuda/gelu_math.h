// GELU and its derivative, one definition for the CPU handlers and the CUDA kernels.
//
// Exact GELU is v * Phi(v), Phi the standard normal CDF. Phi is computed from its lower
// tail q(t) = Phi(-sqrt(2) t) = erfc(t) / 2 at t = |v| / sqrt(2), written as
//   q(t) = 2^(-log2(e) t^2 + P(t)),
// P a degree-8 polynomial fitted (weighted minimax, t in [0, 4]) to log2(q(t)) +
// log2(e) t^2, a slowly varying function. Then Phi(v) = q for v < 0 and 1 - q otherwise:
// one exp2 and nine FMAs, no branches, where CUDA's erff takes two polynomial branches
// and a select per coefficient (~27 instructions). The GELU kernels were issue-bound, so
// this is most of their arithmetic (bench/NOTES.md).
//
// Accuracy: |q - q_exact| <= 5.4e-8 in float32 arithmetic with an exact exp2 (the CPU
// handlers; a NumPy simulation of the fit), plus up to 2 ulps of ex2.approx on the GPU.
// tests/test_gelu.py bounds gelu and its derivative on a dense grid: 2.5e-7 * (1 + |y|)
// on the CPU, 4e-7 on the GPU. Beyond t = 4 (q < 8e-9) P is held at P(4) while the t^2
// term keeps falling, so q underflows to 0 as erfc does.
#pragma once

#include <cmath>

#include "common.h"

namespace jaxsub {

namespace gelu_detail {
constexpr float kInvSqrt2 = 0.70710678118654752f;
constexpr float kInvSqrt2Pi = 0.39894228040143268f;  // normal pdf at 0
constexpr float kSqrt2OverPi = 0.79788456080286536f;
constexpr float kTanhCubic = 0.044715f;
constexpr float kHalfLog2e = -0.72134752044448170f;  // -log2(e) / 2: 2^(kHalfLog2e v^2) = exp(-v^2 / 2)
constexpr float kTailT = 4.0f;
}  // namespace gelu_detail

JAXSUB_HD float fast_exp2(float x) {
#ifdef __CUDA_ARCH__
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else
  return std::exp2(x);
#endif
}

// log2(q(t)) + log2(e) t^2 for t = min(|v| / sqrt(2), 4) (see the file comment).
JAXSUB_HD float normal_tail_poly(float v) {
  const float t = fminf(fabsf(v) * gelu_detail::kInvSqrt2, gelu_detail::kTailT);
  float p = -4.435281516634859e-05f;
  p = fmaf(p, t, 4.3694410123862326e-04f);
  p = fmaf(p, t, -1.4603815507143736e-03f);
  p = fmaf(p, t, -8.251648978330195e-04f);
  p = fmaf(p, t, 2.8301885351538658e-02f);
  p = fmaf(p, t, -1.4850664138793945e-01f);
  p = fmaf(p, t, 5.242851972579956e-01f);
  p = fmaf(p, t, -1.6279093027114868f);
  return fmaf(p, t, -1.0f);
}

// Phi(v), and through `gauss` exp(-v^2 / 2).
JAXSUB_HD float normal_cdf(float v, float& gauss) {
  const float a = gelu_detail::kHalfLog2e * v * v;  // log2(exp(-v^2 / 2))
  const float q = fast_exp2(a + normal_tail_poly(v));
  gauss = fast_exp2(a);
  return v < 0.f ? q : 1.f - q;
}

JAXSUB_HD float normal_cdf(float v) {
  const float q = fast_exp2(gelu_detail::kHalfLog2e * v * v + normal_tail_poly(v));
  return v < 0.f ? q : 1.f - q;
}

JAXSUB_HD float tanh_gelu_inner(float v) {
  using namespace gelu_detail;
  return tanhf(kSqrt2OverPi * (v + kTanhCubic * v * v * v));
}

// y = gelu(v): exact (erf) or the tanh approximation.
JAXSUB_HD float gelu(float v, bool approximate) {
  if (approximate) return 0.5f * v * (1.f + tanh_gelu_inner(v));
  return v * normal_cdf(v);
}

// d gelu(v) / dv.
JAXSUB_HD float gelu_grad(float v, bool approximate) {
  using namespace gelu_detail;
  if (approximate) {
    const float t = tanh_gelu_inner(v);
    return 0.5f * (1.f + t) + 0.5f * v * (1.f - t * t) * kSqrt2OverPi * (1.f + 3.f * kTanhCubic * v * v);
  }
  float gauss;
  const float cdf = normal_cdf(v, gauss);
  return fmaf(v * kInvSqrt2Pi, gauss, cdf);
}

}  // namespace jaxsub
