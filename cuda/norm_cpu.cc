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

// Parameters (P) come either in the activation dtype T or in f32: a second, two-way dispatch
// after dispatch_float picked T.
template <typename T, typename F>
ffi::Error dispatch_param(const char* op, ffi::DataType x_dtype, ffi::DataType p_dtype, F&& f) {
  if (p_dtype == x_dtype) return f(TypeTag<T>{});
  if (p_dtype == ffi::DataType::F32) return f(TypeTag<float>{});
  return invalid(op, "parameters must be float32 or have the dtype of x");
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
    const double d = h[c] - mean;
    sq += d * d;
  }
  return {mean, 1.0f / std::sqrt(static_cast<float>(sq / n) + eps)};
}

// load_row(r, h) fills h: f32[N]; scale, bias: P[N]; y: T[R, N]; mean, rstd: f32[R].
template <typename T, typename P, typename LoadRow>
void layer_norm_fwd_rows(int64_t rows, int64_t n, float eps, LoadRow load_row, const P* scale, const P* bias,
                         T* y, float* mean, float* rstd) {
  std::vector<float> h(n);
  for (int64_t r = 0; r < rows; ++r) {
    load_row(r, h.data());
    const Stats s = row_stats(h.data(), n, eps);
    mean[r] = s.mean;
    rstd[r] = s.rstd;
    for (int64_t c = 0; c < n; ++c) {
      y[r * n + c] = from_float<T>((h[c] - s.mean) * s.rstd * to_float(scale[c]) + to_float(bias[c]));
    }
  }
}

// load_row(r, h) recomputes h: f32[N]; dy: T[R, N]; scale: P[N]; mean, rstd: f32[R];
// store_dh(r, dh) receives the layer-norm input gradient dh: f32[N] of row r;
// dscale, dbias: P[N] (sums over rows).
template <typename T, typename P, typename LoadRow, typename StoreDh>
void layer_norm_bwd_rows(int64_t rows, int64_t n, LoadRow load_row, const T* dy, const P* scale,
                         const float* mean, const float* rstd, StoreDh store_dh, P* dscale, P* dbias) {
  std::vector<float> xhat(n), g(n);
  std::vector<double> dscale_acc(n, 0.0), dbias_acc(n, 0.0);
  for (int64_t r = 0; r < rows; ++r) {
    load_row(r, xhat.data());
    double sum_g = 0.0, sum_gx = 0.0;
    for (int64_t c = 0; c < n; ++c) {
      const float xh = (xhat[c] - mean[r]) * rstd[r];
      const float d = to_float(dy[r * n + c]);
      xhat[c] = xh;
      g[c] = d * to_float(scale[c]);
      sum_g += g[c];
      sum_gx += static_cast<double>(g[c]) * xh;
      dscale_acc[c] += static_cast<double>(d) * xh;
      dbias_acc[c] += d;
    }
    const float mean_g = static_cast<float>(sum_g / n), mean_gx = static_cast<float>(sum_gx / n);
    for (int64_t c = 0; c < n; ++c) g[c] = rstd[r] * (g[c] - mean_g - xhat[c] * mean_gx);
    store_dh(r, g.data());
  }
  for (int64_t c = 0; c < n; ++c) {
    dscale[c] = from_float<P>(static_cast<float>(dscale_acc[c]));
    dbias[c] = from_float<P>(static_cast<float>(dbias_acc[c]));
  }
}

// The BDRLN row h = residual + dropout(x + bias), in f32 without intermediate rounding.
// x, residual: T[R, N]; bias: P[N]; seed: u32[2].
template <typename T, typename P>
struct BdrlnRow {
  const T* x;
  const P* bias;
  const T* residual;
  const uint32_t* seed;
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
// FFI handlers.

// x: T[R, N]; scale, bias: P[N] -> y: T[R, N]; mean, rstd: f32[R].
ffi::Error LayerNormFwdCpu(float eps, ffi::AnyBuffer x, ffi::AnyBuffer scale, ffi::AnyBuffer bias,
                           ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> mean,
                           ffi::Result<ffi::AnyBuffer> rstd) {
  constexpr const char* op = "layer_norm_fwd";
  const Rows d = as_rows(x);
  const ffi::DataType t = x.element_type(), p = scale.element_type(), f32 = ffi::DataType::F32;
  const size_t rn = x.element_count(), r = d.rows, n = d.cols;
  if (auto e = check(op, {{"bias", bias, p, n}, {"y", *y, t, rn}, {"mean", *mean, f32, r}, {"rstd", *rstd, f32, r},
                          {"scale", scale, p, n}});
      e.failure()) {
    return e;
  }
  return dispatch_float<HostTypes>(t, op, [&](auto tt) {
    using T = typename decltype(tt)::type;
    return dispatch_param<T>(op, t, p, [&](auto pt) {
      using P = typename decltype(pt)::type;
      const T* xs = data<T>(x);
      auto load = [&](int64_t row, float* h) {
        for (int64_t c = 0; c < d.cols; ++c) h[c] = to_float(xs[row * d.cols + c]);
      };
      layer_norm_fwd_rows<T, P>(d.rows, d.cols, eps, load, data<P>(scale), data<P>(bias), data<T>(y),
                                data<float>(mean), data<float>(rstd));
      return ffi::Error::Success();
    });
  });
}

// dy, x: T[R, N]; scale: P[N]; mean, rstd: f32[R]
//   -> dx: T[R, N]; dscale, dbias: P[N]; workspace: f32[C, 2, N] (unused on CPU).
ffi::Error LayerNormBwdCpu(ffi::AnyBuffer dy, ffi::AnyBuffer x, ffi::AnyBuffer scale, ffi::AnyBuffer mean,
                           ffi::AnyBuffer rstd, ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer> dscale,
                           ffi::Result<ffi::AnyBuffer> dbias, ffi::Result<ffi::AnyBuffer> /*workspace*/) {
  constexpr const char* op = "layer_norm_bwd";
  const Rows d = as_rows(x);
  const ffi::DataType t = x.element_type(), p = scale.element_type(), f32 = ffi::DataType::F32;
  const size_t rn = x.element_count(), r = d.rows, n = d.cols;
  if (auto e = check(op, {{"dy", dy, t, rn}, {"scale", scale, p, n}, {"mean", mean, f32, r}, {"rstd", rstd, f32, r},
                          {"dx", *dx, t, rn}, {"dscale", *dscale, p, n}, {"dbias", *dbias, p, n}});
      e.failure()) {
    return e;
  }
  return dispatch_float<HostTypes>(t, op, [&](auto tt) {
    using T = typename decltype(tt)::type;
    return dispatch_param<T>(op, t, p, [&](auto pt) {
      using P = typename decltype(pt)::type;
      const T* xs = data<T>(x);
      T* dxs = data<T>(dx);
      auto load = [&](int64_t row, float* h) {
        for (int64_t c = 0; c < d.cols; ++c) h[c] = to_float(xs[row * d.cols + c]);
      };
      auto store = [&](int64_t row, const float* dh) {
        for (int64_t c = 0; c < d.cols; ++c) dxs[row * d.cols + c] = from_float<T>(dh[c]);
      };
      layer_norm_bwd_rows<T, P>(d.rows, d.cols, load, data<T>(dy), data<P>(scale), data<float>(mean),
                                data<float>(rstd), store, data<P>(dscale), data<P>(dbias));
      return ffi::Error::Success();
    });
  });
}

// x: T[R, N]; bias: P[N]; residual: T[R, N]; scale, ln_bias: P[N]; seed: u32[2]
//   -> y: T[R, N]; mean, rstd: f32[R] (statistics of h = residual + dropout(x + bias)).
ffi::Error BdrlnFwdCpu(float eps, uint32_t threshold, float keep_scale, ffi::AnyBuffer x, ffi::AnyBuffer bias,
                       ffi::AnyBuffer residual, ffi::AnyBuffer scale, ffi::AnyBuffer ln_bias, ffi::AnyBuffer seed,
                       ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> mean,
                       ffi::Result<ffi::AnyBuffer> rstd) {
  constexpr const char* op = "bdrln_fwd";
  const Rows d = as_rows(x);
  const ffi::DataType t = x.element_type(), p = scale.element_type(), f32 = ffi::DataType::F32;
  const size_t rn = x.element_count(), r = d.rows, n = d.cols;
  if (auto e = check(op, {{"bias", bias, p, n}, {"residual", residual, t, rn}, {"ln_bias", ln_bias, p, n},
                          {"seed", seed, ffi::DataType::U32, 2}, {"y", *y, t, rn}, {"mean", *mean, f32, r},
                          {"rstd", *rstd, f32, r}});
      e.failure()) {
    return e;
  }
  return dispatch_float<HostTypes>(t, op, [&](auto tt) {
    using T = typename decltype(tt)::type;
    return dispatch_param<T>(op, t, p, [&](auto pt) {
      using P = typename decltype(pt)::type;
      const BdrlnRow<T, P> load{data<T>(x), data<P>(bias), data<T>(residual), data<uint32_t>(seed),
                                threshold,  keep_scale,    d.cols};
      layer_norm_fwd_rows<T, P>(d.rows, d.cols, eps, load, data<P>(scale), data<P>(ln_bias), data<T>(y),
                                data<float>(mean), data<float>(rstd));
      return ffi::Error::Success();
    });
  });
}

// dy, x: T[R, N]; bias: P[N]; residual: T[R, N]; scale: P[N]; mean, rstd: f32[R]; seed: u32[2]
//   -> dx: T[R, N]; dbias: P[N]; dresidual: T[R, N]; dscale, dln_bias: P[N];
//      workspace: f32[C, 3, N] (unused on CPU).
ffi::Error BdrlnBwdCpu(uint32_t threshold, float keep_scale, ffi::AnyBuffer dy, ffi::AnyBuffer x, ffi::AnyBuffer bias,
                       ffi::AnyBuffer residual, ffi::AnyBuffer scale, ffi::AnyBuffer mean, ffi::AnyBuffer rstd,
                       ffi::AnyBuffer seed, ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer> dbias,
                       ffi::Result<ffi::AnyBuffer> dresidual, ffi::Result<ffi::AnyBuffer> dscale,
                       ffi::Result<ffi::AnyBuffer> dln_bias, ffi::Result<ffi::AnyBuffer> /*workspace*/) {
  constexpr const char* op = "bdrln_bwd";
  const Rows d = as_rows(x);
  const ffi::DataType t = x.element_type(), p = scale.element_type(), f32 = ffi::DataType::F32;
  const size_t rn = x.element_count(), r = d.rows, n = d.cols;
  if (auto e = check(op, {{"dy", dy, t, rn}, {"bias", bias, p, n}, {"residual", residual, t, rn},
                          {"mean", mean, f32, r}, {"rstd", rstd, f32, r}, {"seed", seed, ffi::DataType::U32, 2},
                          {"dx", *dx, t, rn}, {"dbias", *dbias, p, n}, {"dresidual", *dresidual, t, rn},
                          {"dscale", *dscale, p, n}, {"dln_bias", *dln_bias, p, n}});
      e.failure()) {
    return e;
  }
  return dispatch_float<HostTypes>(t, op, [&](auto tt) {
    using T = typename decltype(tt)::type;
    return dispatch_param<T>(op, t, p, [&](auto pt) {
      using P = typename decltype(pt)::type;
      const uint32_t* s = data<uint32_t>(seed);
      const BdrlnRow<T, P> load{data<T>(x), data<P>(bias), data<T>(residual), s, threshold, keep_scale, d.cols};
      T* dxs = data<T>(dx);
      T* dres = data<T>(dresidual);
      std::vector<double> dbias_acc(d.cols, 0.0);
      auto store = [&](int64_t row, const float* dh) {
        for (int64_t c = 0; c < d.cols; ++c) {
          const int64_t i = row * d.cols + c;
          const float g = dropout_keep(s, static_cast<uint64_t>(i), threshold) ? dh[c] * keep_scale : 0.0f;
          dres[i] = from_float<T>(dh[c]);
          dxs[i] = from_float<T>(g);
          dbias_acc[c] += g;
        }
      };
      layer_norm_bwd_rows<T, P>(d.rows, d.cols, load, data<T>(dy), data<P>(scale), data<float>(mean),
                                data<float>(rstd), store, data<P>(dscale), data<P>(dln_bias));
      P* db = data<P>(dbias);
      for (int64_t c = 0; c < d.cols; ++c) db[c] = from_float<P>(static_cast<float>(dbias_acc[c]));
      return ffi::Error::Success();
    });
  });
}

}  // namespace
}  // namespace jaxsub

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxsubCpu_layer_norm_fwd, jaxsub::LayerNormFwdCpu,
                              ffi::Ffi::Bind()
                                  .Attr<float>("eps")
                                  .Arg<ffi::AnyBuffer>()   // x
                                  .Arg<ffi::AnyBuffer>()   // scale
                                  .Arg<ffi::AnyBuffer>()   // bias
                                  .Ret<ffi::AnyBuffer>()   // y
                                  .Ret<ffi::AnyBuffer>()   // mean
                                  .Ret<ffi::AnyBuffer>());  // rstd

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxsubCpu_layer_norm_bwd, jaxsub::LayerNormBwdCpu,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()   // dy
                                  .Arg<ffi::AnyBuffer>()   // x
                                  .Arg<ffi::AnyBuffer>()   // scale
                                  .Arg<ffi::AnyBuffer>()   // mean
                                  .Arg<ffi::AnyBuffer>()   // rstd
                                  .Ret<ffi::AnyBuffer>()   // dx
                                  .Ret<ffi::AnyBuffer>()   // dscale
                                  .Ret<ffi::AnyBuffer>()   // dbias
                                  .Ret<ffi::AnyBuffer>());  // workspace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxsubCpu_bdrln_fwd, jaxsub::BdrlnFwdCpu,
                              ffi::Ffi::Bind()
                                  .Attr<float>("eps")
                                  .Attr<uint32_t>("threshold")
                                  .Attr<float>("keep_scale")
                                  .Arg<ffi::AnyBuffer>()   // x
                                  .Arg<ffi::AnyBuffer>()   // bias
                                  .Arg<ffi::AnyBuffer>()   // residual
                                  .Arg<ffi::AnyBuffer>()   // scale
                                  .Arg<ffi::AnyBuffer>()   // ln_bias
                                  .Arg<ffi::AnyBuffer>()   // seed
                                  .Ret<ffi::AnyBuffer>()   // y
                                  .Ret<ffi::AnyBuffer>()   // mean
                                  .Ret<ffi::AnyBuffer>());  // rstd

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxsubCpu_bdrln_bwd, jaxsub::BdrlnBwdCpu,
                              ffi::Ffi::Bind()
                                  .Attr<uint32_t>("threshold")
                                  .Attr<float>("keep_scale")
                                  .Arg<ffi::AnyBuffer>()   // dy
                                  .Arg<ffi::AnyBuffer>()   // x
                                  .Arg<ffi::AnyBuffer>()   // bias
                                  .Arg<ffi::AnyBuffer>()   // residual
                                  .Arg<ffi::AnyBuffer>()   // scale
                                  .Arg<ffi::AnyBuffer>()   // mean
                                  .Arg<ffi::AnyBuffer>()   // rstd
                                  .Arg<ffi::AnyBuffer>()   // seed
                                  .Ret<ffi::AnyBuffer>()   // dx
                                  .Ret<ffi::AnyBuffer>()   // dbias
                                  .Ret<ffi::AnyBuffer>()   // dresidual
                                  .Ret<ffi::AnyBuffer>()   // dscale
                                  .Ret<ffi::AnyBuffer>()   // dln_bias
                                  .Ret<ffi::AnyBuffer>());  // workspace
