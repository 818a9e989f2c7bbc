// CPU handlers for bias + GELU + dropout (ABI.md: bias_gelu_dropout_fwd / _bwd) and for
// the same without the GELU, the pre-LN residual (bias_dropout_residual_fwd,
// bias_dropout_bwd). Plain loops: they define the results the CUDA kernels are compared
// against on any machine. GELU itself (gelu_math.h) is the same code as in the kernels.
#include <cmath>
#include <string>
#include <vector>

#include "common.h"
#include "gelu_math.h"
#include "gemm.h"
#include "philox.h"

namespace jaxsub {
namespace {

constexpr const char* kFwd = "bias_gelu_dropout_fwd";
constexpr const char* kBwd = "bias_gelu_dropout_bwd";

// Keep decisions walk the row-major index in order, so one Philox call serves eight
// consecutive elements instead of being recomputed per element.
class KeepStream {
 public:
  KeepStream(const Seed& seed, uint32_t threshold) : seed_(seed), threshold_(threshold) {}
  bool keep(uint64_t idx) {
    if (threshold_ == 0) return true;
    const uint64_t q = idx >> 3;
    if (q != q_) {
      q_ = q;
      words_ = dropout_words(seed_, q);
    }
    return lane16(words_, static_cast<int>(idx & 7)) >= threshold_;
  }

 private:
  Seed seed_;
  uint32_t threshold_;
  uint64_t q_ = ~uint64_t{0};
  U32x4 words_{};
};

// Calls f(i, c, kept) for every element of the [R, N] view, in row-major order so that
// KeepStream reuses each Philox block.
template <typename F>
void for_each_element(const Rows& d, const Seed& seed, uint32_t threshold, F&& f) {
  KeepStream keep(seed, threshold);
  for (int64_t r = 0; r < d.rows; ++r) {
    for (int64_t c = 0; c < d.cols; ++c) {
      const int64_t i = r * d.cols + c;
      f(i, c, keep.keep(static_cast<uint64_t>(i)));
    }
  }
}

// Calls f(TypeTag<T>{}, TypeTag<P>{}) for activation dtype `t` and parameter dtype `p`;
// ABI.md allows P == T or P == f32 and nothing else.
template <typename F>
ffi::Error dispatch_act_param(const char* op, ffi::DataType t, ffi::DataType p, F&& f) {
  return dispatch_float<HostTypes>(t, op, [&](auto tt) -> ffi::Error {
    if (p == t) return f(tt, tt);
    if (p == ffi::DataType::F32) return f(tt, TypeTag<float>{});
    return invalid(op, "bias must have x's dtype or float32");
  });
}

ffi::Error check_common(const char* op, const ffi::AnyBuffer& x, const ffi::AnyBuffer& bias,
                        const ffi::Buffer<ffi::U32>& seed) {
  if (x.dimensions().size() < 1) return invalid(op, "x must have rank >= 1");
  if (bias.dimensions().size() != 1 || bias.dimensions()[0] != x.dimensions().back())
    return invalid(op, "bias must have shape [N] with N = x.shape[-1]");
  if (seed.element_count() != seed_words(seed.element_count())) return invalid(op, "seed must have 2 words");
  return ffi::Error::Success();
}

// Outputs and dy are bound as AnyBuffer, so their dtype and size are checked here rather
// than by the binding.
ffi::Error check_like(const char* op, const char* name, const ffi::AnyBuffer& b, const char* like_name,
                      const ffi::AnyBuffer& like) {
  if (b.element_type() == like.element_type() && b.element_count() == like.element_count())
    return ffi::Error::Success();
  return invalid(op, std::string(name) + " must match " + like_name + " in dtype and size");
}

// x: T[R, N]; bias: P[N]; seed: u32[2]; y: T[R, N]. block_threads and max_elems (a GPU
// launch shape) are checked and otherwise unused, here and in the backward.
ffi::Error BiasGeluDropoutFwdCpu(ffi::AnyBuffer x, ffi::AnyBuffer bias, ffi::Buffer<ffi::U32> seed,
                                 bool approximate, uint32_t threshold, float keep_scale, int32_t block_threads,
                                 int32_t max_elems, ffi::Result<ffi::AnyBuffer> y) {
  if (auto e = check_kernel_config(kFwd, {block_threads, max_elems}); e.failure()) return e;
  if (auto e = check_common(kFwd, x, bias, seed); e.failure()) return e;
  if (auto e = check_like(kFwd, "y", *y, "x", x); e.failure()) return e;
  const Rows d = as_rows(x);
  return dispatch_act_param(kFwd, x.element_type(), bias.element_type(), [&](auto tt, auto pt) {
    using T = typename decltype(tt)::type;
    using P = typename decltype(pt)::type;
    const T* xs = data<T>(x);
    const P* bs = data<P>(bias);
    T* ys = data<T>(y);
    for_each_element(d, cpu_seed(seed), threshold, [&](int64_t i, int64_t c, bool kept) {
      const float g = gelu(to_float(xs[i]) + to_float(bs[c]), approximate);
      ys[i] = from_float<T>(kept ? g * keep_scale : 0.f);
    });
    return ffi::Error::Success();
  });
}

// dy: T[R, N]; x: T[R, N]; bias: P[N]; seed: u32[2];
// dx: T[R, N]; dbias: P[N]; workspace: f32[C, 1, N] (GPU scratch, untouched here);
// y: T[R, N] (the forward's output, written again) or empty (not written).
ffi::Error BiasGeluDropoutBwdCpu(ffi::AnyBuffer dy, ffi::AnyBuffer x, ffi::AnyBuffer bias,
                                 ffi::Buffer<ffi::U32> seed, bool approximate, uint32_t threshold,
                                 float keep_scale, int32_t block_threads, int32_t max_elems,
                                 ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer> dbias,
                                 ffi::Result<ffi::AnyBuffer> workspace, ffi::Result<ffi::AnyBuffer> y) {
  if (auto e = check_kernel_config(kBwd, {block_threads, max_elems}); e.failure()) return e;
  if (auto e = check_common(kBwd, x, bias, seed); e.failure()) return e;
  if (auto e = check_like(kBwd, "dy", dy, "x", x); e.failure()) return e;
  if (auto e = check_like(kBwd, "dx", *dx, "x", x); e.failure()) return e;
  if (auto e = check_like(kBwd, "dbias", *dbias, "bias", bias); e.failure()) return e;
  const bool store_y = y->element_count() != 0;
  if (store_y) {
    if (auto e = check_like(kBwd, "y", *y, "x", x); e.failure()) return e;
  }
  const Rows d = as_rows(x);
  return dispatch_act_param(kBwd, x.element_type(), bias.element_type(), [&](auto tt, auto pt) {
    using T = typename decltype(tt)::type;
    using P = typename decltype(pt)::type;
    const T* dys = data<T>(dy);
    const T* xs = data<T>(x);
    const P* bs = data<P>(bias);
    T* dxs = data<T>(dx);
    P* dbs = data<P>(dbias);
    T* ys = store_y ? data<T>(y) : nullptr;
    // Rows are summed in a fixed order in double, so dbias is deterministic and its
    // rounding error does not grow with R.
    std::vector<double> acc(static_cast<size_t>(d.cols), 0.0);
    for_each_element(d, cpu_seed(seed), threshold, [&](int64_t i, int64_t c, bool kept) {
      const float m = kept ? keep_scale : 0.f;
      float fwd;
      const float v = to_float(dys[i]) * m * gelu_and_grad(to_float(xs[i]) + to_float(bs[c]), approximate, fwd);
      dxs[i] = from_float<T>(v);
      if (store_y) ys[i] = from_float<T>(fwd * m);
      acc[c] += v;
    });
    for (int64_t c = 0; c < d.cols; ++c) dbs[c] = from_float<P>(static_cast<float>(acc[c]));
    return ffi::Error::Success();
  });
}

// y: T[R, N]; bias: P[N]; residual: T[R, N]; seed: u32[2];
// out: T[R, N] = residual + dropout(y + bias), in f32, rounded once.
ffi::Error BiasDropoutResidualFwdCpu(ffi::AnyBuffer y, ffi::AnyBuffer bias, ffi::AnyBuffer residual,
                                     ffi::Buffer<ffi::U32> seed, uint32_t threshold, float keep_scale,
                                     int32_t block_threads, int32_t max_elems, ffi::Result<ffi::AnyBuffer> out) {
  constexpr const char* op = "bias_dropout_residual_fwd";
  if (auto e = check_kernel_config(op, {block_threads, max_elems}); e.failure()) return e;
  if (auto e = check_common(op, y, bias, seed); e.failure()) return e;
  if (auto e = check_like(op, "residual", residual, "y", y); e.failure()) return e;
  if (auto e = check_like(op, "out", *out, "y", y); e.failure()) return e;
  return dispatch_act_param(op, y.element_type(), bias.element_type(), [&](auto tt, auto pt) {
    using T = typename decltype(tt)::type;
    using P = typename decltype(pt)::type;
    const T* ys = data<T>(y);
    const T* rs = data<T>(residual);
    const P* bs = data<P>(bias);
    T* os = data<T>(out);
    for_each_element(as_rows(y), cpu_seed(seed), threshold, [&](int64_t i, int64_t c, bool kept) {
      const float v = to_float(ys[i]) + to_float(bs[c]);
      os[i] = from_float<T>(std::fma(v, kept ? keep_scale : 0.f, to_float(rs[i])));
    });
    return ffi::Error::Success();
  });
}

// dy: T[R, N]; seed: u32[2]; dx: T[R, N] = dropout(dy); dbias: P[N], the column sums of
// dx before rounding; workspace: f32[C, 1, N] (GPU scratch, untouched here).
ffi::Error BiasDropoutBwdCpu(ffi::AnyBuffer dy, ffi::Buffer<ffi::U32> seed, uint32_t threshold, float keep_scale,
                             int32_t block_threads, int32_t max_elems, ffi::Result<ffi::AnyBuffer> dx,
                             ffi::Result<ffi::AnyBuffer> dbias, ffi::Result<ffi::AnyBuffer> workspace) {
  constexpr const char* op = "bias_dropout_bwd";
  if (auto e = check_kernel_config(op, {block_threads, max_elems}); e.failure()) return e;
  if (auto e = check_common(op, dy, *dbias, seed); e.failure()) return e;
  if (auto e = check_like(op, "dx", *dx, "dy", dy); e.failure()) return e;
  const Rows d = as_rows(dy);
  return dispatch_act_param(op, dy.element_type(), dbias->element_type(), [&](auto tt, auto pt) {
    using T = typename decltype(tt)::type;
    using P = typename decltype(pt)::type;
    const T* dys = data<T>(dy);
    T* dxs = data<T>(dx);
    std::vector<double> acc(static_cast<size_t>(d.cols), 0.0);  // fixed order, as the GELU backward
    for_each_element(d, cpu_seed(seed), threshold, [&](int64_t i, int64_t c, bool kept) {
      const float v = kept ? to_float(dys[i]) * keep_scale : 0.f;
      dxs[i] = from_float<T>(v);
      acc[c] += v;
    });
    P* dbs = data<P>(dbias);
    for (int64_t c = 0; c < d.cols; ++c) dbs[c] = from_float<P>(static_cast<float>(acc[c]));
    return ffi::Error::Success();
  });
}

// x: T[m, k]; w: T[k, n]; bias: T[n]; seed: u32[2]; y, h: T[m, n] (ABI.md:
// dense_gelu_fwd). h = x · w with f32 sums over k in order, rounded once (the gemm
// target's CPU arithmetic); y = bias_gelu_dropout of that h.
ffi::Error DenseGeluFwdCpu(ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer bias, ffi::Buffer<ffi::U32> seed,
                           bool approximate, uint32_t threshold, float keep_scale, ffi::Result<ffi::AnyBuffer> y,
                           ffi::Result<ffi::AnyBuffer> h) {
  constexpr const char* op = "dense_gelu_fwd";
  GemmShape g;
  if (auto e = check_dense_gelu(op, x, w, bias, seed, *y, *h, g); e.failure()) return e;
  const int64_t m = g.m, k = g.k, n = g.n;
  return dispatch_float<HostTypes>(x.element_type(), op, [&](auto tt) {
    using T = typename decltype(tt)::type;
    const T* xs = data<T>(x);
    const T* ws = data<T>(w);
    const T* bs = data<T>(bias);
    T* ys = data<T>(y);
    T* hs = data<T>(h);
    std::vector<float> row(static_cast<size_t>(n));
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t j = 0; j < n; ++j) row[j] = 0.f;
      for (int64_t p = 0; p < k; ++p) {
        const float a = to_float(xs[i * k + p]);
        for (int64_t j = 0; j < n; ++j) row[j] += a * to_float(ws[p * n + j]);
      }
      for (int64_t j = 0; j < n; ++j) hs[i * n + j] = from_float<T>(row[j]);
    }
    for_each_element(Rows{m, n}, cpu_seed(seed), threshold, [&](int64_t i, int64_t c, bool kept) {
      const float g = gelu(to_float(hs[i]) + to_float(bs[c]), approximate);
      ys[i] = from_float<T>(kept ? g * keep_scale : 0.f);
    });
    return ffi::Error::Success();
  });
}

}  // namespace
}  // namespace jaxsub

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxsubCpu_bias_gelu_dropout_fwd, jaxsub::BiasGeluDropoutFwdCpu,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()                 // x
                                  .Arg<xla::ffi::AnyBuffer>()                 // bias
                                  .Arg<xla::ffi::Buffer<xla::ffi::U32>>()     // seed
                                  .Attr<bool>("approximate")
                                  .Attr<uint32_t>("threshold")
                                  .Attr<float>("keep_scale")
                                  .Attr<int32_t>("block_threads")
                                  .Attr<int32_t>("max_elems")
                                  .Ret<xla::ffi::AnyBuffer>());               // y

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxsubCpu_bias_gelu_dropout_bwd, jaxsub::BiasGeluDropoutBwdCpu,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()                 // dy
                                  .Arg<xla::ffi::AnyBuffer>()                 // x
                                  .Arg<xla::ffi::AnyBuffer>()                 // bias
                                  .Arg<xla::ffi::Buffer<xla::ffi::U32>>()     // seed
                                  .Attr<bool>("approximate")
                                  .Attr<uint32_t>("threshold")
                                  .Attr<float>("keep_scale")
                                  .Attr<int32_t>("block_threads")
                                  .Attr<int32_t>("max_elems")
                                  .Ret<xla::ffi::AnyBuffer>()                 // dx
                                  .Ret<xla::ffi::AnyBuffer>()                 // dbias
                                  .Ret<xla::ffi::AnyBuffer>()                 // workspace
                                  .Ret<xla::ffi::AnyBuffer>());               // y, or empty

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxsubCpu_dense_gelu_fwd, jaxsub::DenseGeluFwdCpu,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()                 // x
                                  .Arg<xla::ffi::AnyBuffer>()                 // w
                                  .Arg<xla::ffi::AnyBuffer>()                 // bias
                                  .Arg<xla::ffi::Buffer<xla::ffi::U32>>()     // seed
                                  .Attr<bool>("approximate")
                                  .Attr<uint32_t>("threshold")
                                  .Attr<float>("keep_scale")
                                  .Ret<xla::ffi::AnyBuffer>()                 // y
                                  .Ret<xla::ffi::AnyBuffer>());               // h

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxsubCpu_bias_dropout_residual_fwd, jaxsub::BiasDropoutResidualFwdCpu,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()                 // y
                                  .Arg<xla::ffi::AnyBuffer>()                 // bias
                                  .Arg<xla::ffi::AnyBuffer>()                 // residual
                                  .Arg<xla::ffi::Buffer<xla::ffi::U32>>()     // seed
                                  .Attr<uint32_t>("threshold")
                                  .Attr<float>("keep_scale")
                                  .Attr<int32_t>("block_threads")
                                  .Attr<int32_t>("max_elems")
                                  .Ret<xla::ffi::AnyBuffer>());               // out

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxsubCpu_bias_dropout_bwd, jaxsub::BiasDropoutBwdCpu,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()                 // dy
                                  .Arg<xla::ffi::Buffer<xla::ffi::U32>>()     // seed
                                  .Attr<uint32_t>("threshold")
                                  .Attr<float>("keep_scale")
                                  .Attr<int32_t>("block_threads")
                                  .Attr<int32_t>("max_elems")
                                  .Ret<xla::ffi::AnyBuffer>()                 // dx
                                  .Ret<xla::ffi::AnyBuffer>()                 // dbias
                                  .Ret<xla::ffi::AnyBuffer>());               // workspace
