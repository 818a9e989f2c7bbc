// CPU handlers for softmax + dropout (ABI.md, "Attention family": softmax_dropout_fwd /
// _bwd; paper: SM forward, BS backward). Plain loops over the rows of the logical
// [B, H, Sq, Sk] tensor, with row statistics in double, so they are a tight oracle for the
// CUDA kernels on any machine.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "common.h"
#include "philox.h"

namespace jaxsub {
namespace {

constexpr const char* kFwd = "softmax_dropout_fwd";
constexpr const char* kBwd = "softmax_dropout_bwd";
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// The logical dims of the probability tensor [B, H, Sq, Sk].
struct Dims {
  int64_t b = 0, h = 0, sq = 0, sk = 0;
  int64_t rows() const { return b * h * sq; }
  size_t count() const { return static_cast<size_t>(rows() * sk); }
};

// The scaled, masked score row s' (f32[Sk]) of row (b, h, i): -inf where masked out.
// scores: T[Sk] (the row); mask: see MaskView (common.h).
template <typename T>
void masked_row(const T* scores, const Dims& d, const MaskView& m, float scale, bool causal, int64_t b,
                int64_t h, int64_t i, float* out) {
  // Causal alignment is bottom-right: the last query sees every key.
  const int64_t last_visible = causal ? i + (d.sk - d.sq) : d.sk - 1;
  const int64_t base = m.row_offset(b, h, i);
  for (int64_t j = 0; j < d.sk; ++j) {
    float v = scale * to_float(scores[j]);
    if (m.kind == kMaskBool) {
      if (!static_cast<const bool*>(m.data)[base + j * m.stride[3]]) v = kNegInf;
    } else if (m.kind == kMaskAdditive) {
      v += static_cast<const float*>(m.data)[base + j * m.stride[3]];
    }
    out[j] = j > last_visible ? kNegInf : v;
  }
}

// Keep decisions for `n` consecutive elements starting at row-major index `start`; one
// Philox call serves each aligned group of eight.
void keep_row(const Seed& seed, uint32_t threshold, uint64_t start, int64_t n, std::vector<uint8_t>& keep) {
  if (threshold == 0) {
    std::fill(keep.begin(), keep.begin() + n, uint8_t{1});
    return;
  }
  U32x4 words{};
  uint64_t block = ~uint64_t{0};
  for (int64_t j = 0; j < n; ++j) {
    const uint64_t idx = start + static_cast<uint64_t>(j);
    if ((idx >> 3) != block) {
      block = idx >> 3;
      words = dropout_words(seed, block);
    }
    keep[j] = lane16(words, static_cast<int>(idx & 7)) >= threshold;
  }
}

// ---------------------------------------------------------------------------------------
// Argument checks. Everything is bound as AnyBuffer, so dtypes and sizes are checked here.

ffi::Error scores_dims(const char* op, const ffi::AnyBuffer& scores, Dims& d) {
  auto s = scores.dimensions();
  if (s.size() != 4) return invalid(op, "scores must have rank 4 [B, H, Sq, Sk]");
  d = Dims{s[0], s[1], s[2], s[3]};
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------
// FFI handlers.

// scores: T[B, H, Sq, Sk]; mask: pred/f32[Bm, Hm, Sqm, Skm] (or a dummy); seed: u32[2]
//   -> y: T[B, H, Sq, Sk]; lse: f32[B, H, Sq].
ffi::Error SoftmaxDropoutFwdCpu(ffi::AnyBuffer scores, ffi::AnyBuffer mask, ffi::AnyBuffer seed, float scale,
                                bool causal, int32_t mask_kind, uint32_t threshold, float keep_scale,
                                ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> lse) {
  Dims d;
  MaskView m;
  if (auto e = scores_dims(kFwd, scores, d); e.failure()) return e;
  const int64_t full[4] = {d.b, d.h, d.sq, d.sk};
  if (auto e = mask_view(kFwd, mask, mask_kind, full, m); e.failure()) return e;
  if (auto e = check_buffer(kFwd, "seed", seed, ffi::DataType::U32, seed_words(seed.element_count())); e.failure()) return e;
  if (auto e = check_buffer(kFwd, "y", *y, scores.element_type(), d.count()); e.failure()) return e;
  if (auto e = check_buffer(kFwd, "lse", *lse, ffi::DataType::F32, d.rows()); e.failure()) return e;
  return dispatch_float<HostTypes>(scores.element_type(), kFwd, [&](auto tt) {
    using T = typename decltype(tt)::type;
    const T* s = data<T>(scores);
    T* ys = data<T>(y);
    float* lses = data<float>(lse);
    const Seed key = cpu_seed(seed);
    std::vector<float> row(d.sk);
    std::vector<uint8_t> keep(d.sk);
    int64_t r = 0;
    for (int64_t b = 0; b < d.b; ++b) {
      for (int64_t h = 0; h < d.h; ++h) {
        for (int64_t i = 0; i < d.sq; ++i, ++r) {
          masked_row(s + r * d.sk, d, m, scale, causal, b, h, i, row.data());
          T* out = ys + r * d.sk;
          float mx = kNegInf;
          for (int64_t j = 0; j < d.sk; ++j) mx = max_nan(mx, row[j]);
          if (mx == kNegInf) {  // no visible key
            lses[r] = kNegInf;
            for (int64_t j = 0; j < d.sk; ++j) out[j] = from_float<T>(0.f);
            continue;
          }
          double sum = 0.0;
          for (int64_t j = 0; j < d.sk; ++j) sum += std::exp(static_cast<double>(row[j]) - mx);
          lses[r] = static_cast<float>(mx + std::log(sum));
          keep_row(key, threshold, static_cast<uint64_t>(r * d.sk), d.sk, keep);
          for (int64_t j = 0; j < d.sk; ++j) {
            const float p = static_cast<float>(std::exp(static_cast<double>(row[j]) - mx) / sum);
            out[j] = from_float<T>(keep[j] ? p * keep_scale : 0.f);
          }
        }
      }
    }
    return ffi::Error::Success();
  });
}

// dy, scores: T[B, H, Sq, Sk]; lse: f32[B, H, Sq]; mask: pred/f32[Bm, Hm, Sqm, Skm] (or a
// dummy); seed: u32[2] -> dscores: T[B, H, Sq, Sk].
ffi::Error SoftmaxDropoutBwdCpu(ffi::AnyBuffer dy, ffi::AnyBuffer scores, ffi::AnyBuffer lse, ffi::AnyBuffer mask,
                                ffi::AnyBuffer seed, float scale, bool causal, int32_t mask_kind, uint32_t threshold,
                                float keep_scale, ffi::Result<ffi::AnyBuffer> dscores) {
  Dims d;
  MaskView m;
  if (auto e = scores_dims(kBwd, scores, d); e.failure()) return e;
  const int64_t full[4] = {d.b, d.h, d.sq, d.sk};
  if (auto e = mask_view(kBwd, mask, mask_kind, full, m); e.failure()) return e;
  if (auto e = check_buffer(kBwd, "dy", dy, scores.element_type(), d.count()); e.failure()) return e;
  if (auto e = check_buffer(kBwd, "lse", lse, ffi::DataType::F32, d.rows()); e.failure()) return e;
  if (auto e = check_buffer(kBwd, "seed", seed, ffi::DataType::U32, seed_words(seed.element_count())); e.failure()) return e;
  if (auto e = check_buffer(kBwd, "dscores", *dscores, scores.element_type(), d.count()); e.failure()) return e;
  return dispatch_float<HostTypes>(scores.element_type(), kBwd, [&](auto tt) {
    using T = typename decltype(tt)::type;
    const T* s = data<T>(scores);
    const T* dys = data<T>(dy);
    const float* lses = data<float>(lse);
    T* ds = data<T>(dscores);
    const Seed key = cpu_seed(seed);
    std::vector<float> p(d.sk), g(d.sk);
    std::vector<uint8_t> keep(d.sk);
    int64_t r = 0;
    for (int64_t b = 0; b < d.b; ++b) {
      for (int64_t h = 0; h < d.h; ++h) {
        for (int64_t i = 0; i < d.sq; ++i, ++r) {
          T* out = ds + r * d.sk;
          // A row with no visible key has no probabilities, hence no gradient; checking
          // lse first also keeps exp(-inf - -inf) = NaN out of it. A NaN lse (a NaN score
          // in the row) gives a NaN gradient, as plain JAX's.
          if (lses[r] == kNegInf) {
            for (int64_t j = 0; j < d.sk; ++j) out[j] = from_float<T>(0.f);
            continue;
          }
          masked_row(s + r * d.sk, d, m, scale, causal, b, h, i, p.data());
          keep_row(key, threshold, static_cast<uint64_t>(r * d.sk), d.sk, keep);
          double dot = 0.0;  // sum_j g_j p_j
          for (int64_t j = 0; j < d.sk; ++j) {
            p[j] = std::exp(p[j] - lses[r]);
            g[j] = keep[j] ? to_float(dys[r * d.sk + j]) * keep_scale : 0.f;
            dot += static_cast<double>(g[j]) * p[j];
          }
          const float dotf = static_cast<float>(dot);
          for (int64_t j = 0; j < d.sk; ++j) out[j] = from_float<T>(scale * p[j] * (g[j] - dotf));
        }
      }
    }
    return ffi::Error::Success();
  });
}

}  // namespace

// The attributes both handlers take, in ABI.md's order; one definition so that forward and
// backward cannot drift apart.
template <typename Binding>
auto bind_attrs(Binding&& b) {
  return std::forward<Binding>(b)
      .template Attr<float>("scale")
      .template Attr<bool>("causal")
      .template Attr<int32_t>("mask_kind")
      .template Attr<uint32_t>("threshold")
      .template Attr<float>("keep_scale");
}

}  // namespace jaxsub

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxsubCpu_softmax_dropout_fwd, jaxsub::SoftmaxDropoutFwdCpu,
                              jaxsub::bind_attrs(xla::ffi::Ffi::Bind()
                                                     .Arg<xla::ffi::AnyBuffer>()   // scores
                                                     .Arg<xla::ffi::AnyBuffer>()   // mask
                                                     .Arg<xla::ffi::AnyBuffer>())  // seed
                                  .Ret<xla::ffi::AnyBuffer>()   // y
                                  .Ret<xla::ffi::AnyBuffer>());  // lse

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxsubCpu_softmax_dropout_bwd, jaxsub::SoftmaxDropoutBwdCpu,
                              jaxsub::bind_attrs(xla::ffi::Ffi::Bind()
                                                     .Arg<xla::ffi::AnyBuffer>()   // dy
                                                     .Arg<xla::ffi::AnyBuffer>()   // scores
                                                     .Arg<xla::ffi::AnyBuffer>()   // lse
                                                     .Arg<xla::ffi::AnyBuffer>()   // mask
                                                     .Arg<xla::ffi::AnyBuffer>())  // seed
                                  .Ret<xla::ffi::AnyBuffer>());  // dscores
