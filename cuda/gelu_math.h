// GELU and its derivative, one definition for the CPU handlers and the CUDA kernels.
//
// Exact GELU is v * Phi(v), Phi the standard normal CDF. Phi is computed from its lower
// tail q(t) = Phi(-sqrt(2) t) = erfc(t) / 2 at t = |v| / sqrt(2), written as
//   q(t) = 2^(-log2(e) t^2 + P(t)),
// P a degree-8 polynomial fitted (weighted minimax, t in [0, 4]) to log2(q(t)) +
// log2(e) t^2, a slowly varying function (its coefficients are stored for |v| = sqrt(2) t,
// which saves a multiply). Then Phi(v) = q for v < 0 and 1 - q otherwise, and
// v Phi(v) = max(v, 0) - |v| q: one exp2, nine FMAs and a max, no branches, where CUDA's
// erff takes two polynomial branches and a select per coefficient (~27 instructions).
// The GELU kernels are issue-bound, so this is most of their arithmetic (bench/NOTES.md).
//
// Accuracy: |q - q_exact| <= 5.6e-8 in float32 arithmetic with an exact exp2 (the CPU
// handlers; a NumPy simulation of the coefficients below on [0, 12], float32 steps without
// fused multiply-adds), plus up to 2 ulps of ex2.approx on the GPU.
// tests/test_gelu.py bounds gelu and its derivative on a dense grid: 2.5e-7 * (1 + |y|)
// on the CPU, 4e-7 on the GPU. Beyond t = 4 (q < 8e-9) P is held at P(4) while the t^2
// term keeps falling, so q underflows to 0 as erfc does.
#pragma once

#include <cmath>

#include "common.h"

namespace jaxsub {

namespace gelu_detail {
constexpr float kInvSqrt2Pi = 0.39894228040143268f;  // normal pdf at 0
constexpr float kSqrt2OverPi = 0.79788456080286536f;
constexpr float kTanhCubic = 0.044715f;
constexpr float kHalfLog2e = -0.72134752044448170f;  // -log2(e) / 2: 2^(kHalfLog2e v^2) = exp(-v^2 / 2)
constexpr float kTailV = 5.65685424949238f;  // 4 sqrt(2): t = 4
}  // namespace gelu_detail

// min(|v|, 4 sqrt(2)): the polynomial's argument, and the factor of the tail in v Phi(v)
// (`gelu`).
JAXSUB_HD float tail_abs(float v) { return fminf(fabsf(v), gelu_detail::kTailV); }

// log2(q(t)) + log2(e) t^2 at t = min(|v|, 4 sqrt(2)) / sqrt(2) (see the file comment): the
// fitted coefficients of t^k divided by sqrt(2)^k, so |v| goes in unscaled.
JAXSUB_HD float normal_tail_poly(float v) {
  const float s = tail_abs(v);
  float p = -2.772050947896787e-06f;
  p = fmaf(p, s, 3.8620768464170396e-05f);
  p = fmaf(p, s, -1.825476938392967e-04f);
  p = fmaf(p, s, -1.458699262002483e-04f);
  p = fmaf(p, s, 7.0754713378846645e-03f);
  p = fmaf(p, s, -5.250502750277519e-02f);
  p = fmaf(p, s, 2.621425986289978e-01f);
  p = fmaf(p, s, -1.1511057615280151f);
  return fmaf(p, s, -1.0f);
}

// q(|v| / sqrt(2)) = Phi(-|v|), the lower tail, and through `gauss` exp(-v^2 / 2).
JAXSUB_HD float normal_tail(float v, float& gauss) {
  const float a = gelu_detail::kHalfLog2e * v * v;  // log2(exp(-v^2 / 2))
  gauss = fast_exp2(a);
  return fast_exp2(a + normal_tail_poly(v));
}

JAXSUB_HD float normal_tail(float v) {
  return fast_exp2(gelu_detail::kHalfLog2e * v * v + normal_tail_poly(v));
}

JAXSUB_HD float tanh_gelu_inner(float v) {
  using namespace gelu_detail;
  return tanhf(kSqrt2OverPi * (v + kTanhCubic * v * v * v));
}

// v Phi(v) = max(v, 0) - |v| Phi(-|v|) for either sign: one max and an FMA where
// v * (v < 0 ? q : 1 - q) takes a compare, a select, a subtraction and a product. |v| is
// taken at most 4 sqrt(2) (the polynomial's own argument, so no instruction more): past it
// q < 8e-9, which rounds v - |v| q to v for v > 0, and for v < 0 the far tail's |v| q
// (below 5e-8) was no more exact with |v| itself (bench/NOTES.md, sixty-fourth session);
// at v = +inf the product is then 0 * 5.66 and y is +inf, as jax.nn.gelu gives, where
// |v| q was inf * 0, NaN. (v = -inf gives 0, the limit, where jax.nn.gelu gives NaN.)
JAXSUB_HD float exact_gelu_from_tail(float v, float q) { return fmaf(-tail_abs(v), q, fmaxf(v, 0.f)); }

// y = gelu(v): exact (erf) or the tanh approximation.
JAXSUB_HD float gelu(float v, bool approximate) {
  if (approximate) return 0.5f * v * (1.f + tanh_gelu_inner(v));
  return exact_gelu_from_tail(v, normal_tail(v));
}

// d gelu(v) / dv, and gelu(v) in `y` from the same normal tail (an FMA and a max more).
JAXSUB_HD float gelu_and_grad(float v, bool approximate, float& y) {
  using namespace gelu_detail;
  if (approximate) {
    const float t = tanh_gelu_inner(v);
    y = 0.5f * v * (1.f + t);
    return 0.5f * (1.f + t) + 0.5f * v * (1.f - t * t) * kSqrt2OverPi * (1.f + 3.f * kTanhCubic * v * v);
  }
  float gauss;
  const float q = normal_tail(v, gauss);
  y = exact_gelu_from_tail(v, q);
  return fmaf(v * kInvSqrt2Pi, gauss, v < 0.f ? q : 1.f - q);
}

// d gelu(v) / dv (the compiler drops the unused y).
JAXSUB_HD float gelu_grad(float v, bool approximate) {
  float y;
  return gelu_and_grad(v, approximate, y);
}

}  // namespace jaxsub
