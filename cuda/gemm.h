// The gemm target's shape contract (ABI.md: gemm), shared by its CPU and CUDA handlers.
#pragma once

#include <string>
#include <vector>

#include "common.h"

namespace jaxsub {

// d[m, n] = op(a) · op(b) (+ bias) (+ c): a [m, k] or, trans_a, [k, m]; b [k, n] or,
// trans_b, [n, k]; bias [n] or [0] (none); c [m, n] or [0] (none); d [m, n]; all of one
// float dtype.
struct GemmShape {
  int64_t m = 0, n = 0, k = 0;
  bool bias = false, c = false;
};

inline ffi::Error check_gemm(const char* op, const ffi::AnyBuffer& a, const ffi::AnyBuffer& b,
                             const ffi::AnyBuffer& bias, const ffi::AnyBuffer& c, const ffi::AnyBuffer& d,
                             bool trans_a, bool trans_b, GemmShape& g) {
  auto ad = a.dimensions(), bd = b.dimensions(), dd = d.dimensions(), bsd = bias.dimensions(),
       cd = c.dimensions();
  if (ad.size() != 2 || bd.size() != 2 || dd.size() != 2 || bsd.size() != 1)
    return invalid(op, "a, b and d must be 2-D and bias 1-D");
  const auto t = a.element_type();
  if (t != ffi::DataType::F32 && t != ffi::DataType::BF16 && t != ffi::DataType::F16)
    return invalid(op, "unsupported dtype (expected float32, bfloat16 or float16)");
  if (b.element_type() != t || d.element_type() != t || bias.element_type() != t || c.element_type() != t)
    return invalid(op, "a, b, bias, c and d must have one dtype");
  g.m = trans_a ? ad[1] : ad[0];
  g.k = trans_a ? ad[0] : ad[1];
  g.n = trans_b ? bd[0] : bd[1];
  if ((trans_b ? bd[1] : bd[0]) != g.k) return invalid(op, "the contracted dims of a and b differ");
  if (dd[0] != g.m || dd[1] != g.n) return invalid(op, "d must be [m, n]");
  if (bsd[0] != 0 && bsd[0] != g.n) return invalid(op, "bias must be [n] or [0]");
  g.bias = bsd[0] != 0;
  g.c = !(cd.size() == 1 && cd[0] == 0);
  if (g.c && (cd.size() != 2 || cd[0] != g.m || cd[1] != g.n)) return invalid(op, "c must be [m, n] or [0]");
  return ffi::Error::Success();
}

// dense_gelu_fwd's contract (ABI.md), shared by its CPU handler (gelu_cpu.cc) and CUDA
// handler (dense_gelu.cu): x [m, k], w [k, n], bias [n], seed u32[2] or [4], y and h
// [m, n], every float operand of one dtype.
inline ffi::Error check_dense_gelu(const char* op, const ffi::AnyBuffer& x, const ffi::AnyBuffer& w,
                                   const ffi::AnyBuffer& bias, const ffi::Buffer<ffi::U32>& seed,
                                   const ffi::AnyBuffer& y, const ffi::AnyBuffer& h, GemmShape& g) {
  auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || bias.dimensions().size() != 1)
    return invalid(op, "x and w must be 2-D, bias 1-D");
  g.m = xd[0];
  g.k = xd[1];
  g.n = wd[1];
  g.bias = true;
  if (wd[0] != g.k) return invalid(op, "w must be [k, n] for x [m, k]");
  if (bias.dimensions()[0] != g.n) return invalid(op, "bias must be [n]");
  if (seed.element_count() != seed_words(seed.element_count())) return invalid(op, "seed must have 2 words");
  const auto t = x.element_type();
  if (w.element_type() != t || bias.element_type() != t || y.element_type() != t || h.element_type() != t)
    return invalid(op, "x, w, bias, y and h must have one dtype");
  if (y.element_count() != static_cast<size_t>(g.m * g.n) || h.element_count() != static_cast<size_t>(g.m * g.n))
    return invalid(op, "y and h must be [m, n]");
  return ffi::Error::Success();
}

// The algorithm the CUDA handler will use for a shape, with or without c (gemm.cu; XLA's
// 256-byte aligned buffers): cuBLASLt's heuristic offers up to eight, each is timed once
// per process on scratch buffers and the fastest kept (JAXSUB_GEMM_TUNE=0: the
// heuristic's first).
// index: the choice in the heuristic's order, -1 when there is no device or library;
// times_us: each candidate's time, -1 where it was not timed. Declared here for the
// Python module (module.cc), which calls it when a product is traced, before XLA may
// capture the call into a CUDA graph, where it cannot be timed.
struct GemmTuning {
  int index = -1;
  std::vector<float> times_us;
};
GemmTuning gemm_tune(const std::string& dtype, int64_t m, int64_t n, int64_t k, bool trans_a, bool trans_b, bool bias,
                     bool c, int64_t workspace_bytes);

}  // namespace jaxsub
