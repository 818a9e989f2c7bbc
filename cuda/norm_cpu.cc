// CPU handlers for the normalization family (layer norm and bias-dropout-residual-layer-norm,
// BDRLN), forward and backward, bound exactly as ABI.md says. They are plain loops over rows;
// statistics and parameter-gradient sums accumulate in double so that the CPU result is a
// tight oracle for the CUDA kernels. The `workspace` results exist for the GPU's deterministic
// column reductions, so the CPU handlers leave them untouched.
#include <cmath>
#include <initializer_list>
#include <string>
#include <vector>

#include "common.h"
#include "philox.h"

namespace jaxsub {
namespace {

// ---------------------------------------------------------------------------------------
// Argument checks and the parameter dtype.

// What one argument must be: its dtype and its element count.
struct Expect {
  const char* name;
  ffi::AnyBuffer buf;
  ffi::DataType dtype;
  size_t count;
};

ffi::Error check(const char* op, std::initializer_list<Expect> args) {
  for (const Expect& a : args) {
    if (a.buf.element_type() != a.dtype || a.buf.element_count() != a.count) {
      return invalid(op, std::string("`") + a.name + "` has the wrong dtype or number of elements");
    }
  }
  return ffi::Error::Success();
}

// An optional T[R, N] argument: empty ([0], none) or as `count` says; its data or null.
template <typename T>
ffi::Error optional_rows(const char* op, const char* name, ffi::AnyBuffer buf, ffi::DataType t, size_t count,
                         T*& out) {
  out = nullptr;
  if (buf.element_count() == 0) return ffi::Error::Success();
  if (auto e = check(op, {{name, buf, t, count}}); e.failure()) return e;
  out = static_cast<T*>(buf.untyped_data());
  return ffi::Error::Success();
}

// The dims and dtypes a handler checks its other arguments against: x is T[R, N] and the
// parameters are P[N], P taken from `scale`.
struct NormShape {
  ffi::DataType t, p;
  size_t rows, cols, count;
};

NormShape norm_shape(const ffi::AnyBuffer& x, const ffi::AnyBuffer& scale) {
  const Rows d = as_rows(x);
  return {x.element_type(), scale.element_type(), static_cast<size_t>(d.rows), static_cast<size_t>(d.cols),
          x.element_count()};
}

// f(TypeTag<T>, TypeTag<P>) for the activation dtype T (dispatch_float) and the parameter
// dtype P, which is either T or f32.
template <typename F>
ffi::Error dispatch_norm(const char* op, const NormShape& s, F&& f) {
  return dispatch_float<HostTypes>(s.t, op, [&](auto t) -> ffi::Error {
    if (s.p == s.t) return f(t, t);
    if (s.p == ffi::DataType::F32) return f(t, TypeTag<float>{});
    return invalid(op, "parameters must be float32 or have the dtype of x");
  });
}

// ---------------------------------------------------------------------------------------
// Row kernels shared by layer norm and BDRLN. They differ only in the row h that is
// normalized (x itself, or residual + dropout(x + bias)) and in what the backward does with
// the gradient dh of that row, so both are passed in as callables.

struct Stats {
  float mean;
  float rstd;
};

// h: f32[n]. Two passes (mean, then centred squares) so a large mean does not cancel the variance.
Stats row_stats(const float* h, int64_t n, float eps) {
  double sum = 0.0;
  for (int64_t c = 0; c < n; ++c) sum += h[c];
  const float mean = static_cast<float>(sum / n);
  double sq = 0.0;
  for (int64_t c = 0; c < n; ++c) {
    const double d = static_cast<double>(h[c]) - mean;
    sq += d * d;
  }
  return {mean, 1.0f / std::sqrt(static_cast<float>(sq / n) + eps)};
}

// load_row(r, h) fills h: f32[N]; scale, bias: P[N]; y: T[R, N]; mean, rstd: f32[R];
// h_out: T[R, N] (h itself, rounded) or null.
template <typename T, typename P, typename LoadRow>
void layer_norm_fwd_rows(int64_t rows, int64_t n, float eps, LoadRow load_row, const P* scale, const P* bias,
                         T* y, float* mean, float* rstd, T* h_out = nullptr) {
  std::vector<float> h(n);
  for (int64_t r = 0; r < rows; ++r) {
    load_row(r, h.data());
    if (h_out != nullptr)
      for (int64_t c = 0; c < n; ++c) h_out[r * n + c] = from_float<T>(h[c]);
    const Stats s = row_stats(h.data(), n, eps);
    mean[r] = s.mean;
    rstd[r] = s.rstd;
    for (int64_t c = 0; c < n; ++c) {
      y[r * n + c] = from_float<T>((h[c] - s.mean) * s.rstd * to_float(scale[c]) + to_float(bias[c]));
    }
  }
}

// load_row(r, h) recomputes h: f32[N]; dy: T[R, N]; dy2: T[R, N] or null, a second cotangent
// added to dy; dh_in: T[R, N] or null, a cotangent of h itself added to its gradient; scale:
// P[N]; mean, rstd: f32[R]; store_dh(r, dh) receives the layer-norm input gradient dh: f32[N]
// of row r; dscale, dbias: P[N] (sums over rows).
template <typename T, typename P, typename LoadRow, typename StoreDh>
void layer_norm_bwd_rows(int64_t rows, int64_t n, LoadRow load_row, const T* dy, const T* dy2, const T* dh_in,
                         const P* scale, const float* mean, const float* rstd, StoreDh store_dh, P* dscale,
                         P* dbias) {
  std::vector<float> xhat(n), g(n);
  std::vector<double> dscale_acc(n, 0.0), dbias_acc(n, 0.0);
  for (int64_t r = 0; r < rows; ++r) {
    load_row(r, xhat.data());
    double sum_g = 0.0, sum_gx = 0.0;
    for (int64_t c = 0; c < n; ++c) {
      const float xh = (xhat[c] - mean[r]) * rstd[r];
      const float d = to_float(dy[r * n + c]) + (dy2 != nullptr ? to_float(dy2[r * n + c]) : 0.0f);
      xhat[c] = xh;
      g[c] = d * to_float(scale[c]);
      sum_g += g[c];
      sum_gx += static_cast<double>(g[c]) * xh;
      dscale_acc[c] += static_cast<double>(d) * xh;
      dbias_acc[c] += d;
    }
    const float mean_g = static_cast<float>(sum_g / n), mean_gx = static_cast<float>(sum_gx / n);
    for (int64_t c = 0; c < n; ++c) {
      g[c] = rstd[r] * (g[c] - mean_g - xhat[c] * mean_gx);
      if (dh_in != nullptr) g[c] += to_float(dh_in[r * n + c]);
    }
    store_dh(r, g.data());
  }
  for (int64_t c = 0; c < n; ++c) {
    dscale[c] = from_float<P>(static_cast<float>(dscale_acc[c]));
    dbias[c] = from_float<P>(static_cast<float>(dbias_acc[c]));
  }
}

// The layer-norm row h = x. x: T[R, N].
template <typename T>
struct PlainRow {
  const T* x;
  int64_t n;

  void operator()(int64_t r, float* h) const {
    for (int64_t c = 0; c < n; ++c) h[c] = to_float(x[r * n + c]);
  }
};

// The BDRLN row h = residual + dropout(x + bias), in f32 without intermediate rounding.
// x, residual: T[R, N]; bias: P[N]; seed: u32[2].
template <typename T, typename P>
struct BdrlnRow {
  const T* x;
  const P* bias;
  const T* residual;
  Seed seed;
  uint32_t threshold;
  float keep_scale;
  int64_t n;

  void operator()(int64_t r, float* h) const {
    for (int64_t c = 0; c < n; ++c) {
      const int64_t i = r * n + c;
      const float v = to_float(x[i]) + to_float(bias[c]);
      const float dropped = dropout_keep(seed, static_cast<uint64_t>(i), threshold) ? v * keep_scale : 0.0f;
      h[c] = to_float(residual[i]) + dropped;
    }
  }
};

// ---------------------------------------------------------------------------------------
// FFI handlers. Each checks its kernel configuration (block_threads, max_elems: a GPU
// launch shape) and otherwise ignores it.

// x: T[R, N]; scale, bias: P[N] -> y: T[R, N]; mean, rstd: f32[R].
ffi::Error LayerNormFwdCpu(float eps, int32_t block_threads, int32_t max_elems, ffi::AnyBuffer x,
                           ffi::AnyBuffer scale, ffi::AnyBuffer bias, ffi::Result<ffi::AnyBuffer> y,
                           ffi::Result<ffi::AnyBuffer> mean, ffi::Result<ffi::AnyBuffer> rstd) {
  constexpr const char* op = "layer_norm_fwd";
  if (auto e = check_kernel_config(op, {block_threads, max_elems}); e.failure()) return e;
  const NormShape s = norm_shape(x, scale);
  const ffi::DataType f32 = ffi::DataType::F32;
  if (auto e = check(op, {{"scale", scale, s.p, s.cols}, {"bias", bias, s.p, s.cols}, {"y", *y, s.t, s.count},
                          {"mean", *mean, f32, s.rows}, {"rstd", *rstd, f32, s.rows}});
      e.failure()) {
    return e;
  }
  return dispatch_norm(op, s, [&](auto tt, auto pt) {
    using T = typename decltype(tt)::type;
    using P = typename decltype(pt)::type;
    const PlainRow<T> load{data<T>(x), static_cast<int64_t>(s.cols)};
    layer_norm_fwd_rows<T, P>(s.rows, s.cols, eps, load, data<P>(scale), data<P>(bias), data<T>(y),
                              data<float>(mean), data<float>(rstd));
    return ffi::Error::Success();
  });
}

// dy: T[R, N]; dh: T[R, N] or T[0] (a cotangent of x itself, added to dx); x: T[R, N]; scale: P[N];
// mean, rstd: f32[R] -> dx: T[R, N]; dscale, dbias: P[N]; workspace: f32[C, 2, N] (unused on CPU).
ffi::Error LayerNormBwdCpu(int32_t block_threads, int32_t max_elems, ffi::AnyBuffer dy, ffi::AnyBuffer dh,
                           ffi::AnyBuffer x, ffi::AnyBuffer scale, ffi::AnyBuffer mean, ffi::AnyBuffer rstd,
                           ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer> dscale,
                           ffi::Result<ffi::AnyBuffer> dbias, ffi::Result<ffi::AnyBuffer> /*workspace*/) {
  constexpr const char* op = "layer_norm_bwd";
  if (auto e = check_kernel_config(op, {block_threads, max_elems}); e.failure()) return e;
  const NormShape s = norm_shape(x, scale);
  const ffi::DataType f32 = ffi::DataType::F32;
  if (auto e = check(op, {{"dy", dy, s.t, s.count}, {"scale", scale, s.p, s.cols}, {"mean", mean, f32, s.rows},
                          {"rstd", rstd, f32, s.rows}, {"dx", *dx, s.t, s.count}, {"dscale", *dscale, s.p, s.cols},
                          {"dbias", *dbias, s.p, s.cols}});
      e.failure()) {
    return e;
  }
  return dispatch_norm(op, s, [&](auto tt, auto pt) {
    using T = typename decltype(tt)::type;
    using P = typename decltype(pt)::type;
    const PlainRow<T> load{data<T>(x), static_cast<int64_t>(s.cols)};
    T* dxs = data<T>(dx);
    auto store = [&](int64_t row, const float* dh) {
      for (size_t c = 0; c < s.cols; ++c) dxs[row * s.cols + c] = from_float<T>(dh[c]);
    };
    const T* dh_in;
    if (auto e = optional_rows(op, "dh", dh, s.t, s.count, dh_in); e.failure()) return e;
    layer_norm_bwd_rows<T, P>(s.rows, s.cols, load, data<T>(dy), nullptr, dh_in, data<P>(scale), data<float>(mean),
                              data<float>(rstd), store, data<P>(dscale), data<P>(dbias));
    return ffi::Error::Success();
  });
}

// x: T[R, N]; bias: P[N]; residual: T[R, N]; scale, ln_bias: P[N]; seed: u32[2]
//   -> y: T[R, N]; mean, rstd: f32[R] (statistics of h = residual + dropout(x + bias));
//      h: T[R, N] (h itself) or T[0] (not written).
ffi::Error BdrlnFwdCpu(float eps, uint32_t threshold, float keep_scale, int32_t block_threads, int32_t max_elems,
                       ffi::AnyBuffer x, ffi::AnyBuffer bias, ffi::AnyBuffer residual, ffi::AnyBuffer scale,
                       ffi::AnyBuffer ln_bias, ffi::AnyBuffer seed, ffi::Result<ffi::AnyBuffer> y,
                       ffi::Result<ffi::AnyBuffer> mean, ffi::Result<ffi::AnyBuffer> rstd,
                       ffi::Result<ffi::AnyBuffer> h) {
  constexpr const char* op = "bdrln_fwd";
  if (auto e = check_kernel_config(op, {block_threads, max_elems}); e.failure()) return e;
  const NormShape s = norm_shape(x, scale);
  const ffi::DataType f32 = ffi::DataType::F32;
  if (auto e = check(op, {{"bias", bias, s.p, s.cols}, {"residual", residual, s.t, s.count},
                          {"scale", scale, s.p, s.cols}, {"ln_bias", ln_bias, s.p, s.cols},
                          {"seed", seed, ffi::DataType::U32, seed_words(seed.element_count())}, {"y", *y, s.t, s.count},
                          {"mean", *mean, f32, s.rows}, {"rstd", *rstd, f32, s.rows}});
      e.failure()) {
    return e;
  }
  return dispatch_norm(op, s, [&](auto tt, auto pt) {
    using T = typename decltype(tt)::type;
    using P = typename decltype(pt)::type;
    const BdrlnRow<T, P> load{data<T>(x), data<P>(bias), data<T>(residual), cpu_seed(seed),
                              threshold,  keep_scale,    static_cast<int64_t>(s.cols)};
    T* h_out;
    if (auto e = optional_rows(op, "h", *h, s.t, s.count, h_out); e.failure()) return e;
    layer_norm_fwd_rows<T, P>(s.rows, s.cols, eps, load, data<P>(scale), data<P>(ln_bias), data<T>(y),
                              data<float>(mean), data<float>(rstd), h_out);
    return ffi::Error::Success();
  });
}

// dy: T[R, N]; dy2: T[R, N] or T[0] (none); dh: T[R, N] (a cotangent of h itself) or T[0];
// x: T[R, N]; bias: P[N]; residual: T[R, N]; scale: P[N]; mean, rstd: f32[R]; seed: u32[2]
//   -> dx: T[R, N]; dbias: P[N]; dresidual: T[R, N]; dscale, dln_bias: P[N];
//      workspace: f32[C, 3, N] (unused on CPU).
ffi::Error BdrlnBwdCpu(uint32_t threshold, float keep_scale, int32_t block_threads, int32_t max_elems,
                       ffi::AnyBuffer dy, ffi::AnyBuffer dy2, ffi::AnyBuffer dh, ffi::AnyBuffer x,
                       ffi::AnyBuffer bias, ffi::AnyBuffer residual, ffi::AnyBuffer scale, ffi::AnyBuffer mean,
                       ffi::AnyBuffer rstd, ffi::AnyBuffer seed,
                       ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer> dbias,
                       ffi::Result<ffi::AnyBuffer> dresidual, ffi::Result<ffi::AnyBuffer> dscale,
                       ffi::Result<ffi::AnyBuffer> dln_bias, ffi::Result<ffi::AnyBuffer> /*workspace*/) {
  constexpr const char* op = "bdrln_bwd";
  if (auto e = check_kernel_config(op, {block_threads, max_elems}); e.failure()) return e;
  const NormShape s = norm_shape(x, scale);
  const ffi::DataType f32 = ffi::DataType::F32;
  if (auto e = check(op, {{"dy", dy, s.t, s.count}, {"bias", bias, s.p, s.cols}, {"residual", residual, s.t, s.count},
                          {"scale", scale, s.p, s.cols}, {"mean", mean, f32, s.rows}, {"rstd", rstd, f32, s.rows},
                          {"seed", seed, ffi::DataType::U32, seed_words(seed.element_count())}, {"dx", *dx, s.t, s.count},
                          {"dbias", *dbias, s.p, s.cols}, {"dresidual", *dresidual, s.t, s.count},
                          {"dscale", *dscale, s.p, s.cols}, {"dln_bias", *dln_bias, s.p, s.cols}});
      e.failure()) {
    return e;
  }
  return dispatch_norm(op, s, [&](auto tt, auto pt) {
    using T = typename decltype(tt)::type;
    using P = typename decltype(pt)::type;
    const T *dy2_in, *dh_in;
    if (auto e = optional_rows(op, "dy2", dy2, s.t, s.count, dy2_in); e.failure()) return e;
    if (auto e = optional_rows(op, "dh", dh, s.t, s.count, dh_in); e.failure()) return e;
    const Seed key = cpu_seed(seed);
    const BdrlnRow<T, P> load{data<T>(x), data<P>(bias), data<T>(residual), key, threshold, keep_scale,
                              static_cast<int64_t>(s.cols)};
    T* dxs = data<T>(dx);
    T* dres = data<T>(dresidual);
    std::vector<double> dbias_acc(s.cols, 0.0);
    // dx = dropout(grad) with the forward's mask, grad the gradient of h; dbias sums dx
    // before it is rounded.
    auto store = [&](int64_t row, const float* grad) {
      for (size_t c = 0; c < s.cols; ++c) {
        const uint64_t i = row * s.cols + c;
        const float g = dropout_keep(key, i, threshold) ? grad[c] * keep_scale : 0.0f;
        dres[i] = from_float<T>(grad[c]);
        dxs[i] = from_float<T>(g);
        dbias_acc[c] += g;
      }
    };
    layer_norm_bwd_rows<T, P>(s.rows, s.cols, load, data<T>(dy), dy2_in, dh_in, data<P>(scale), data<float>(mean),
                              data<float>(rstd), store, data<P>(dscale), data<P>(dln_bias));
    P* db = data<P>(dbias);
    for (size_t c = 0; c < s.cols; ++c) db[c] = from_float<P>(static_cast<float>(dbias_acc[c]));
    return ffi::Error::Success();
  });
}

}  // namespace
}  // namespace jaxsub

// Bindings: attributes by name, then buffers in the order of the handler signatures. (An FFI
// Binding can only be built in one expression, hence the explicit chains.)

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxsubCpu_layer_norm_fwd, jaxsub::LayerNormFwdCpu,
                              xla::ffi::Ffi::Bind()
                                  .Attr<float>("eps")
                                  .Attr<int32_t>("block_threads")
                                  .Attr<int32_t>("max_elems")
                                  .Arg<xla::ffi::AnyBuffer>()   // x
                                  .Arg<xla::ffi::AnyBuffer>()   // scale
                                  .Arg<xla::ffi::AnyBuffer>()   // bias
                                  .Ret<xla::ffi::AnyBuffer>()   // y
                                  .Ret<xla::ffi::AnyBuffer>()   // mean
                                  .Ret<xla::ffi::AnyBuffer>());  // rstd

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxsubCpu_layer_norm_bwd, jaxsub::LayerNormBwdCpu,
                              xla::ffi::Ffi::Bind()
                                  .Attr<int32_t>("block_threads")
                                  .Attr<int32_t>("max_elems")
                                  .Arg<xla::ffi::AnyBuffer>()   // dy
                                  .Arg<xla::ffi::AnyBuffer>()   // dh ([0]: none)
                                  .Arg<xla::ffi::AnyBuffer>()   // x
                                  .Arg<xla::ffi::AnyBuffer>()   // scale
                                  .Arg<xla::ffi::AnyBuffer>()   // mean
                                  .Arg<xla::ffi::AnyBuffer>()   // rstd
                                  .Ret<xla::ffi::AnyBuffer>()   // dx
                                  .Ret<xla::ffi::AnyBuffer>()   // dscale
                                  .Ret<xla::ffi::AnyBuffer>()   // dbias
                                  .Ret<xla::ffi::AnyBuffer>());  // workspace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxsubCpu_bdrln_fwd, jaxsub::BdrlnFwdCpu,
                              xla::ffi::Ffi::Bind()
                                  .Attr<float>("eps")
                                  .Attr<uint32_t>("threshold")
                                  .Attr<float>("keep_scale")
                                  .Attr<int32_t>("block_threads")
                                  .Attr<int32_t>("max_elems")
                                  .Arg<xla::ffi::AnyBuffer>()   // x
                                  .Arg<xla::ffi::AnyBuffer>()   // bias
                                  .Arg<xla::ffi::AnyBuffer>()   // residual
                                  .Arg<xla::ffi::AnyBuffer>()   // scale
                                  .Arg<xla::ffi::AnyBuffer>()   // ln_bias
                                  .Arg<xla::ffi::AnyBuffer>()   // seed
                                  .Ret<xla::ffi::AnyBuffer>()   // y
                                  .Ret<xla::ffi::AnyBuffer>()   // mean
                                  .Ret<xla::ffi::AnyBuffer>()   // rstd
                                  .Ret<xla::ffi::AnyBuffer>());  // h ([0]: not written)

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxsubCpu_bdrln_bwd, jaxsub::BdrlnBwdCpu,
                              xla::ffi::Ffi::Bind()
                                  .Attr<uint32_t>("threshold")
                                  .Attr<float>("keep_scale")
                                  .Attr<int32_t>("block_threads")
                                  .Attr<int32_t>("max_elems")
                                  .Arg<xla::ffi::AnyBuffer>()   // dy
                                  .Arg<xla::ffi::AnyBuffer>()   // dy2 ([0]: none)
                                  .Arg<xla::ffi::AnyBuffer>()   // dh ([0]: none)
                                  .Arg<xla::ffi::AnyBuffer>()   // x
                                  .Arg<xla::ffi::AnyBuffer>()   // bias
                                  .Arg<xla::ffi::AnyBuffer>()   // residual
                                  .Arg<xla::ffi::AnyBuffer>()   // scale
                                  .Arg<xla::ffi::AnyBuffer>()   // mean
                                  .Arg<xla::ffi::AnyBuffer>()   // rstd
                                  .Arg<xla::ffi::AnyBuffer>()   // seed
                                  .Ret<xla::ffi::AnyBuffer>()   // dx
                                  .Ret<xla::ffi::AnyBuffer>()   // dbias
                                  .Ret<xla::ffi::AnyBuffer>()   // dresidual
                                  .Ret<xla::ffi::AnyBuffer>()   // dscale
                                  .Ret<xla::ffi::AnyBuffer>()   // dln_bias
                                  .Ret<xla::ffi::AnyBuffer>());  // workspace
