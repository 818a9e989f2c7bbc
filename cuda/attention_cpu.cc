// CPU handlers for fused attention (ABI.md, "Attention family": attention_fwd / _bwd, the
// packed-gradient attention_bwd_dqkv and the packed self-attention attention_qkv_fwd / _bwd).
// Plain loops over (b, h, i) rows, f32 element math with double dot products and row
// sums, so these handlers are a tight oracle for the CUDA kernels and for the unfused path.
// Nothing [B, H, Sq, Sk] is stored: each row's scores are recomputed from q and k, and
// backward regenerates probabilities from lse and the dropout mask from the seed.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "common.h"
#include "philox.h"

namespace jaxsub {
namespace {

constexpr const char* kFwd = "attention_fwd";
constexpr const char* kBwd = "attention_bwd";
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// ---------------------------------------------------------------------------------------
// Shapes and checks.

// Sizes, and the strides of the q, k, v views (and of dq, dk, dv): position s of batch b,
// head h at b * q_batch + s * row + h * d (k, v: b * kv_batch + s * kv_row + (h / group) *
// d, q head h reading k/v head h / group). out and dout are plain [B, Sq, H, D].
struct Dims {
  int64_t b, sq, sk, h, d;
  int64_t row, q_batch, kv_batch;
  int64_t kv_row, group;
};

// q: T[B, Sq, H, D]; k, v: T[B, Sk, H_kv, D] (H_kv dividing H); seed: u32[2].
ffi::Error qkv_dims(const char* op, const ffi::AnyBuffer& q, const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                    const ffi::AnyBuffer& seed, Dims& out) {
  auto dq = q.dimensions(), dk = k.dimensions(), dv = v.dimensions();
  if (dq.size() != 4 || dk.size() != 4 || dv.size() != 4) return invalid(op, "q, k and v must have rank 4");
  if (dk[2] < 1 || dq[2] % dk[2] != 0) return invalid(op, "k's heads must divide q's (k, v: [B, Sk, H_kv, D])");
  out = Dims{dq[0], dq[1], dk[1], dq[2], dq[3], dq[2] * dq[3], dq[1] * dq[2] * dq[3], dk[1] * dk[2] * dq[3],
             dk[2] * dq[3], dq[2] / dk[2]};
  if (dk[0] != out.b || dk[3] != out.d) return invalid(op, "k must be [B, Sk, H_kv, D] with q's B and D");
  for (int a = 0; a < 4; ++a) {
    if (dv[a] != dk[a]) return invalid(op, "v must have k's shape");
  }
  if (k.element_type() != q.element_type() || v.element_type() != q.element_type())
    return invalid(op, "q, k and v must have one dtype");
  return check_buffer(op, "seed", seed, ffi::DataType::U32, seed_words(seed.element_count()));
}

ffi::Error attention_mask(const char* op, const ffi::AnyBuffer& m, int32_t kind, const Dims& d, MaskView& out) {
  const int64_t full[4] = {d.b, d.h, d.sq, d.sk};
  return mask_view(op, m, kind, full, out);
}

// ---------------------------------------------------------------------------------------
// One (b, h, i) row: its scaled, masked scores and probabilities.

struct RowCtx {
  Dims d;
  float scale;
  bool causal;
  MaskView mask;
  Seed seed;
  uint32_t threshold;
  float keep_scale;
  bool dropout_bcast;  // one keep mask [Sq, Sk] for every (b, h)
};

// Offsets of query i / key j of head h in the q / k, v views, and of query i in out.
int64_t q_at(const Dims& d, int64_t b, int64_t i, int64_t h) { return b * d.q_batch + i * d.row + h * d.d; }
int64_t kv_at(const Dims& d, int64_t b, int64_t j, int64_t h) {  // h: the q head
  return b * d.kv_batch + j * d.kv_row + h / d.group * d.d;
}
int64_t o_at(const Dims& d, int64_t b, int64_t i, int64_t h) { return ((b * d.sq + i) * d.h + h) * d.d; }

template <typename T>
double dot(const T* a, const T* b, int64_t n) {
  double acc = 0.0;
  for (int64_t c = 0; c < n; ++c) acc += static_cast<double>(to_float(a[c])) * to_float(b[c]);
  return acc;
}

// s: f32[Sk], the scaled (and additively masked) scores of row (b, h, i); kNegInf where
// the key is not visible. Returns the row maximum (kNegInf when no key is visible, NaN
// when a visible score is NaN: the row's probabilities are then NaN).
template <typename T>
float row_scores(const RowCtx& c, const T* q, const T* k, int64_t b, int64_t h, int64_t i, float* s) {
  const Dims& d = c.d;
  const T* qi = q + q_at(d, b, i, h);
  const int64_t last = i + (d.sk - d.sq);  // causal: keys j <= last are visible
  const int64_t m0 = c.mask.row_offset(b, h, i), ms = c.mask.stride[3];
  float mx = kNegInf;
  for (int64_t j = 0; j < d.sk; ++j) {
    bool visible = !c.causal || j <= last;
    if (visible && c.mask.kind == kMaskBool) visible = static_cast<const bool*>(c.mask.data)[m0 + j * ms];
    float v = kNegInf;
    if (visible) {
      v = static_cast<float>(dot(qi, k + kv_at(d, b, j, h), d.d)) * c.scale;
      if (c.mask.kind == kMaskAdditive) v += static_cast<const float*>(c.mask.data)[m0 + j * ms];
    }
    s[j] = v;
    mx = max_nan(mx, v);
  }
  return mx;
}

// Keep decision of probability (b, h, i, j), element ((b * H + h) * Sq + i) * Sk + j of the
// keep index (i * Sk + j under dropout_bcast): one Philox call per eight consecutive j.
class RowKeep {
 public:
  RowKeep(const RowCtx& c, int64_t b, int64_t h, int64_t i)
      : seed_(c.seed),
        threshold_(c.threshold),
        base_(static_cast<uint64_t>(((c.dropout_bcast ? 0 : b * c.d.h + h) * c.d.sq + i) * c.d.sk)) {}

  bool operator()(int64_t j) {
    if (threshold_ == 0) return true;
    const uint64_t idx = base_ + static_cast<uint64_t>(j), blk = idx >> 3;
    if (blk != blk_) {
      blk_ = blk;
      words_ = dropout_words(seed_, blk);
    }
    return lane16(words_, static_cast<int>(idx & 7)) >= threshold_;
  }

 private:
  Seed seed_;
  uint32_t threshold_;
  uint64_t base_;
  uint64_t blk_ = ~uint64_t{0};
  U32x4 words_{};
};

// ---------------------------------------------------------------------------------------
// Forward and backward over all rows.

// out: T[B, Sq, H, D]; lse: f32[B, H, Sq].
template <typename T>
void attention_fwd(const RowCtx& c, const T* q, const T* k, const T* v, T* out, float* lse) {
  const Dims& d = c.d;
  std::vector<float> s(d.sk);
  std::vector<double> acc(d.d);
  for (int64_t b = 0; b < d.b; ++b) {
    for (int64_t h = 0; h < d.h; ++h) {
      for (int64_t i = 0; i < d.sq; ++i) {
        T* oi = out + o_at(d, b, i, h);
        float& lse_i = lse[(b * d.h + h) * d.sq + i];
        const float mx = row_scores(c, q, k, b, h, i, s.data());
        if (mx == kNegInf) {  // no visible key: probabilities, output and gradients are 0
          lse_i = kNegInf;
          for (int64_t e = 0; e < d.d; ++e) oi[e] = from_float<T>(0.f);
          continue;
        }
        double sum = 0.0;
        for (int64_t j = 0; j < d.sk; ++j) {
          s[j] = std::exp(s[j] - mx);
          sum += s[j];
        }
        lse_i = mx + static_cast<float>(std::log(sum));
        const float inv = static_cast<float>(1.0 / sum);
        std::fill(acc.begin(), acc.end(), 0.0);
        RowKeep keep(c, b, h, i);
        for (int64_t j = 0; j < d.sk; ++j) {
          if (s[j] == 0.f || !keep(j)) continue;
          const float pd = s[j] * inv * c.keep_scale;
          const T* vj = v + kv_at(d, b, j, h);
          for (int64_t e = 0; e < d.d; ++e) acc[e] += static_cast<double>(pd) * to_float(vj[e]);
        }
        for (int64_t e = 0; e < d.d; ++e) oi[e] = from_float<T>(static_cast<float>(acc[e]));
      }
    }
  }
}

// dout, out: T[B, Sq, H, D]; lse: f32[B, H, Sq]; dq, dk, dv: views of g's strides (q, k,
// v's own, or one packed gradient's).
template <typename T>
void attention_bwd(const RowCtx& c, const T* dout, const T* q, const T* k, const T* v, const T* out,
                   const float* lse, const Dims& g, T* dq, T* dk, T* dv) {
  const Dims& d = c.d;
  std::vector<float> p(d.sk);
  std::vector<double> dqi(d.d), dkh(d.sk * d.d), dvh(d.sk * d.d);
  for (int64_t b = 0; b < d.b; ++b) {
    for (int64_t h = 0; h < d.h; ++h) {
      if (h % d.group == 0) {  // the first q head reading this k/v head: dk, dv sum over the group
        std::fill(dkh.begin(), dkh.end(), 0.0);
        std::fill(dvh.begin(), dvh.end(), 0.0);
      }
      for (int64_t i = 0; i < d.sq; ++i) {
        const int64_t qi = q_at(d, b, i, h), oi = o_at(d, b, i, h);
        const float lse_i = lse[(b * d.h + h) * d.sq + i];
        std::fill(dqi.begin(), dqi.end(), 0.0);
        if (lse_i != kNegInf) {
          row_scores(c, q, k, b, h, i, p.data());
          // delta = sum_j dP_j P_j = dO . O (ABI.md), so no second pass over the row.
          const float delta = static_cast<float>(dot(dout + oi, out + oi, d.d));
          RowKeep keep(c, b, h, i);
          for (int64_t j = 0; j < d.sk; ++j) {
            const float pj = std::exp(p[j] - lse_i);
            if (pj == 0.f) continue;
            const int64_t kj = kv_at(d, b, j, h);
            const bool kept = keep(j);
            const float dpd = static_cast<float>(dot(dout + oi, v + kj, d.d));
            const float dp = kept ? dpd * c.keep_scale : 0.f;
            const float ds = pj * (dp - delta) * c.scale;
            const float pd = kept ? pj * c.keep_scale : 0.f;
            double* dkj = dkh.data() + j * d.d;
            double* dvj = dvh.data() + j * d.d;
            for (int64_t e = 0; e < d.d; ++e) {
              dqi[e] += static_cast<double>(ds) * to_float(k[kj + e]);
              dkj[e] += static_cast<double>(ds) * to_float(q[qi + e]);
              dvj[e] += static_cast<double>(pd) * to_float(dout[oi + e]);
            }
          }
        }
        const int64_t gi = q_at(g, b, i, h);
        for (int64_t e = 0; e < d.d; ++e) dq[gi + e] = from_float<T>(static_cast<float>(dqi[e]));
      }
      if (h % d.group != d.group - 1) continue;
      for (int64_t j = 0; j < d.sk; ++j) {
        const int64_t gj = kv_at(g, b, j, h);
        for (int64_t e = 0; e < d.d; ++e) {
          dk[gj + e] = from_float<T>(static_cast<float>(dkh[j * d.d + e]));
          dv[gj + e] = from_float<T>(static_cast<float>(dvh[j * d.d + e]));
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------
// FFI handlers.

// q: T[B, Sq, H, D]; k, v: T[B, Sk, H, D]; mask: [Bm, Hm, Sqm, Skm] (pred or f32);
// seed: u32[2] -> out: T[B, Sq, H, D]; lse: f32[B, H, Sq].
ffi::Error AttentionFwdCpu(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer mask,
                           ffi::AnyBuffer seed, float scale, bool causal, int32_t mask_kind, uint32_t threshold,
                           float keep_scale, bool dropout_bcast, ffi::Result<ffi::AnyBuffer> out,
                           ffi::Result<ffi::AnyBuffer> lse) {
  Dims d;
  MaskView m;
  if (auto e = qkv_dims(kFwd, q, k, v, seed, d); e.failure()) return e;
  if (auto e = attention_mask(kFwd, mask, mask_kind, d, m); e.failure()) return e;
  if (auto e = check_buffer(kFwd, "out", *out, q.element_type(), q.element_count()); e.failure()) return e;
  if (auto e = check_buffer(kFwd, "lse", *lse, ffi::DataType::F32, d.b * d.h * d.sq); e.failure()) return e;
  const RowCtx c{d, scale, causal, m, cpu_seed(seed), threshold, keep_scale, dropout_bcast};
  return dispatch_float<HostTypes>(q.element_type(), kFwd, [&](auto tt) {
    using T = typename decltype(tt)::type;
    attention_fwd<T>(c, data<T>(q), data<T>(k), data<T>(v), data<T>(out), data<float>(lse));
    return ffi::Error::Success();
  });
}

// dout: T[B, Sq, H, D]; q: T[B, Sq, H, D]; k, v: T[B, Sk, H, D]; out: T[B, Sq, H, D];
// lse: f32[B, H, Sq]; mask: [Bm, Hm, Sqm, Skm]; seed: u32[2]
//   -> dq: T[B, Sq, H, D]; dk, dv: T[B, Sk, H, D]; workspaces f32[B, H, Sq] and
//      f32[B, Sq, H, D] (GPU scratch, untouched here).
ffi::Error AttentionBwdCpu(ffi::AnyBuffer dout, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                           ffi::AnyBuffer out, ffi::AnyBuffer lse, ffi::AnyBuffer mask, ffi::AnyBuffer seed,
                           float scale, bool causal, int32_t mask_kind, uint32_t threshold, float keep_scale,
                           bool dropout_bcast, ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
                           ffi::Result<ffi::AnyBuffer> dv, ffi::Result<ffi::AnyBuffer> /*delta workspace*/,
                           ffi::Result<ffi::AnyBuffer> /*dq workspace*/) {
  Dims d;
  MaskView m;
  if (auto e = qkv_dims(kBwd, q, k, v, seed, d); e.failure()) return e;
  if (auto e = attention_mask(kBwd, mask, mask_kind, d, m); e.failure()) return e;
  const ffi::DataType t = q.element_type();
  const size_t nq = q.element_count(), nk = k.element_count();
  if (auto e = check_buffer(kBwd, "dout", dout, t, nq); e.failure()) return e;
  if (auto e = check_buffer(kBwd, "out", out, t, nq); e.failure()) return e;
  if (auto e = check_buffer(kBwd, "lse", lse, ffi::DataType::F32, d.b * d.h * d.sq); e.failure()) return e;
  if (auto e = check_buffer(kBwd, "dq", *dq, t, nq); e.failure()) return e;
  if (auto e = check_buffer(kBwd, "dk", *dk, t, nk); e.failure()) return e;
  if (auto e = check_buffer(kBwd, "dv", *dv, t, nk); e.failure()) return e;
  const RowCtx c{d, scale, causal, m, cpu_seed(seed), threshold, keep_scale, dropout_bcast};
  return dispatch_float<HostTypes>(t, kBwd, [&](auto tt) {
    using T = typename decltype(tt)::type;
    attention_bwd<T>(c, data<T>(dout), data<T>(q), data<T>(k), data<T>(v), data<T>(out), data<float>(lse), d,
                     data<T>(dq), data<T>(dk), data<T>(dv));
    return ffi::Error::Success();
  });
}

// out[p][h, e] = the sum over b and s of part p's gradient (the written, rounded values
// at g's strides, part p at element offset p * poff), in double; nothing where out is null.
template <typename T>
void packed_column_sums(const T* grad, int64_t poff, const Dims& g, void* const (&out)[3]) {
  if (out[0] == nullptr) return;
  const int64_t hd = g.h * g.d;
  std::vector<double> sum(hd);
  for (int64_t p = 0; p < 3; ++p) {
    std::fill(sum.begin(), sum.end(), 0.0);
    for (int64_t b = 0; b < g.b; ++b)
      for (int64_t i = 0; i < g.sq; ++i) {
        const T* row = grad + p * poff + q_at(g, b, i, 0);
        for (int64_t c = 0; c < hd; ++c) sum[c] += to_float(row[c]);
      }
    T* dst = static_cast<T*>(out[p]);
    for (int64_t c = 0; c < hd; ++c) dst[c] = from_float<T>(static_cast<float>(sum[c]));
  }
}

// Self-attention on separate q, k, v (T[B, S, H, D] each) with the gradient packed:
// dout; q; k; v; out; lse; mask; seed -> dqkv: T[B, S, 3, H, D]; dbias (dbias_parts in common.h), its workspace;
// workspaces (untouched).
ffi::Error AttentionBwdDqkvCpu(ffi::AnyBuffer dout, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                               ffi::AnyBuffer out, ffi::AnyBuffer lse, ffi::AnyBuffer mask, ffi::AnyBuffer seed,
                               float scale, bool causal, int32_t mask_kind, uint32_t threshold, float keep_scale,
                               bool dropout_bcast, ffi::Result<ffi::AnyBuffer> dqkv, ffi::Result<ffi::AnyBuffer> dbias,
                               ffi::Result<ffi::AnyBuffer> /*dbias workspace*/,
                               ffi::Result<ffi::AnyBuffer> /*delta workspace*/,
                               ffi::Result<ffi::AnyBuffer> /*dq workspace*/) {
  const char* op = "attention_bwd_dqkv";
  Dims d;
  MaskView m;
  if (auto e = qkv_dims(op, q, k, v, seed, d); e.failure()) return e;
  if (d.sq != d.sk) return invalid(op, "q and k must have one sequence length (self-attention)");
  if (d.group != 1) return invalid(op, "q, k and v must have the same heads (one packed gradient)");
  if (auto e = attention_mask(op, mask, mask_kind, d, m); e.failure()) return e;
  const ffi::DataType t = q.element_type();
  const size_t nq = q.element_count();
  if (auto e = check_buffer(op, "dout", dout, t, nq); e.failure()) return e;
  if (auto e = check_buffer(op, "out", out, t, nq); e.failure()) return e;
  if (auto e = check_buffer(op, "lse", lse, ffi::DataType::F32, d.b * d.h * d.sq); e.failure()) return e;
  if (auto e = check_buffer(op, "dqkv", *dqkv, t, 3 * nq); e.failure()) return e;
  void* dbias_out[3];  // its GPU workspace (the next result) is not touched here
  if (auto e = dbias_parts(op, *dbias, t, d.h * d.d, nullptr, dbias_out); e.failure()) return e;
  const int64_t hd = d.h * d.d;
  const Dims g{d.b, d.sq, d.sk, d.h, d.d, 3 * hd, d.sq * 3 * hd, d.sq * 3 * hd, 3 * hd, 1};  // [B, S, 3, H, D]
  const RowCtx c{d, scale, causal, m, cpu_seed(seed), threshold, keep_scale, dropout_bcast};
  return dispatch_float<HostTypes>(t, op, [&](auto tt) {
    using T = typename decltype(tt)::type;
    T* dq = data<T>(dqkv);
    attention_bwd<T>(c, data<T>(dout), data<T>(q), data<T>(k), data<T>(v), data<T>(out), data<float>(lse), g, dq,
                     dq + hd, dq + 2 * hd);
    packed_column_sums<T>(dq, hd, g, dbias_out);
    return ffi::Error::Success();
  });
}

// Packed self-attention: qkv T[B, S, 3, H, D] (qkv_axis 2) or T[3, B, S, H, D] (qkv_axis 0);
// q, k, v are its views at element offsets 0, koff, 2 koff.
ffi::Error packed_dims(const char* op, const ffi::AnyBuffer& qkv, int32_t axis, const ffi::AnyBuffer& seed, Dims& out,
                       int64_t& koff) {
  auto s = qkv.dimensions();
  if (s.size() != 5 || (axis != 0 && axis != 2) || s[axis] != 3)
    return invalid(op, "qkv must be [B, S, 3, H, D] (qkv_axis 2) or [3, B, S, H, D] (qkv_axis 0)");
  const int64_t hd = s[3] * s[4];
  const int64_t b = axis == 2 ? s[0] : s[1], seq = axis == 2 ? s[1] : s[2], row = axis == 2 ? 3 * hd : hd;
  out = Dims{b, seq, seq, s[3], s[4], row, seq * row, seq * row, row, 1};
  koff = axis == 2 ? hd : b * seq * hd;
  return check_buffer(op, "seed", seed, ffi::DataType::U32, seed_words(seed.element_count()));
}

// qkv; mask; seed -> out: T[B, S, H, D]; lse: f32[B, H, S].
ffi::Error AttentionQkvFwdCpu(ffi::AnyBuffer qkv, ffi::AnyBuffer mask, ffi::AnyBuffer seed, float scale, bool causal,
                              int32_t mask_kind, uint32_t threshold, float keep_scale, bool dropout_bcast,
                              int32_t qkv_axis,
                              ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> lse) {
  const char* op = "attention_qkv_fwd";
  Dims d;
  MaskView m;
  int64_t koff = 0;
  if (auto e = packed_dims(op, qkv, qkv_axis, seed, d, koff); e.failure()) return e;
  if (auto e = attention_mask(op, mask, mask_kind, d, m); e.failure()) return e;
  if (auto e = check_buffer(op, "out", *out, qkv.element_type(), d.b * d.sq * d.h * d.d); e.failure()) return e;
  if (auto e = check_buffer(op, "lse", *lse, ffi::DataType::F32, d.b * d.h * d.sq); e.failure()) return e;
  const RowCtx c{d, scale, causal, m, cpu_seed(seed), threshold, keep_scale, dropout_bcast};
  return dispatch_float<HostTypes>(qkv.element_type(), op, [&](auto tt) {
    using T = typename decltype(tt)::type;
    const T* q = data<T>(qkv);
    attention_fwd<T>(c, q, q + koff, q + 2 * koff, data<T>(out), data<float>(lse));
    return ffi::Error::Success();
  });
}

// dout: T[B, S, H, D]; qkv; out: T[B, S, H, D]; lse: f32[B, H, S]; mask; seed
//   -> dqkv: qkv's shape; dbias (dbias_parts in common.h), its workspace; workspaces (GPU scratch, untouched here);
//   then none, or the k and v bias gradients (dbias_parts).
ffi::Error AttentionQkvBwdCpu(ffi::AnyBuffer dout, ffi::AnyBuffer qkv, ffi::AnyBuffer out, ffi::AnyBuffer lse,
                              ffi::AnyBuffer mask, ffi::AnyBuffer seed, float scale, bool causal, int32_t mask_kind,
                              uint32_t threshold, float keep_scale, bool dropout_bcast, int32_t qkv_axis,
                              ffi::Result<ffi::AnyBuffer> dqkv, ffi::Result<ffi::AnyBuffer> dbias,
                              ffi::Result<ffi::AnyBuffer> /*dbias workspace*/,
                              ffi::Result<ffi::AnyBuffer> /*delta workspace*/,
                              ffi::Result<ffi::AnyBuffer> /*dq workspace*/, ffi::RemainingRets dbias_kv) {
  const char* op = "attention_qkv_bwd";
  Dims d;
  MaskView m;
  int64_t koff = 0;
  if (auto e = packed_dims(op, qkv, qkv_axis, seed, d, koff); e.failure()) return e;
  if (auto e = attention_mask(op, mask, mask_kind, d, m); e.failure()) return e;
  const ffi::DataType t = qkv.element_type();
  const size_t no = d.b * d.sq * d.h * d.d;
  if (auto e = check_buffer(op, "dout", dout, t, no); e.failure()) return e;
  if (auto e = check_buffer(op, "out", out, t, no); e.failure()) return e;
  if (auto e = check_buffer(op, "lse", lse, ffi::DataType::F32, d.b * d.h * d.sq); e.failure()) return e;
  if (auto e = check_buffer(op, "dqkv", *dqkv, t, qkv.element_count()); e.failure()) return e;
  void* dbias_out[3];
  if (auto e = dbias_parts(op, *dbias, t, d.h * d.d, &dbias_kv, dbias_out); e.failure()) return e;
  const RowCtx c{d, scale, causal, m, cpu_seed(seed), threshold, keep_scale, dropout_bcast};
  return dispatch_float<HostTypes>(t, op, [&](auto tt) {
    using T = typename decltype(tt)::type;
    const T* q = data<T>(qkv);
    T* dq = data<T>(dqkv);
    attention_bwd<T>(c, data<T>(dout), q, q + koff, q + 2 * koff, data<T>(out), data<float>(lse), d, dq, dq + koff,
                     dq + 2 * koff);
    packed_column_sums<T>(dq, koff, d, dbias_out);
    return ffi::Error::Success();
  });
}

// The arguments and attributes of attention_bwd and attention_bwd_dqkv (their results differ).
auto separate_bwd_binding() {
  return attention_attrs(ffi::Ffi::Bind()
                             .Arg<ffi::AnyBuffer>()    // dout
                             .Arg<ffi::AnyBuffer>()    // q
                             .Arg<ffi::AnyBuffer>()    // k
                             .Arg<ffi::AnyBuffer>()    // v
                             .Arg<ffi::AnyBuffer>()    // out
                             .Arg<ffi::AnyBuffer>()    // lse
                             .Arg<ffi::AnyBuffer>()    // mask
                             .Arg<ffi::AnyBuffer>());  // seed
}

}  // namespace
}  // namespace jaxsub

// Bindings in ABI.md's order: arguments, then attributes, then results.

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxsubCpu_attention_fwd, jaxsub::AttentionFwdCpu,
                              jaxsub::attention_attrs(xla::ffi::Ffi::Bind()
                                                          .Arg<xla::ffi::AnyBuffer>()   // q
                                                          .Arg<xla::ffi::AnyBuffer>()   // k
                                                          .Arg<xla::ffi::AnyBuffer>()   // v
                                                          .Arg<xla::ffi::AnyBuffer>()   // mask
                                                          .Arg<xla::ffi::AnyBuffer>())  // seed
                                  .Ret<xla::ffi::AnyBuffer>()   // out
                                  .Ret<xla::ffi::AnyBuffer>());  // lse

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxsubCpu_attention_bwd, jaxsub::AttentionBwdCpu,
                              jaxsub::separate_bwd_binding()
                                  .Ret<xla::ffi::AnyBuffer>()   // dq
                                  .Ret<xla::ffi::AnyBuffer>()   // dk
                                  .Ret<xla::ffi::AnyBuffer>()   // dv
                                  .Ret<xla::ffi::AnyBuffer>()   // workspace: delta
                                  .Ret<xla::ffi::AnyBuffer>());  // workspace: dq accumulator

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxsubCpu_attention_bwd_dqkv, jaxsub::AttentionBwdDqkvCpu,
                              jaxsub::separate_bwd_binding()
                                  .Ret<xla::ffi::AnyBuffer>()   // dqkv
                                  .Ret<xla::ffi::AnyBuffer>()   // dbias: T[3, H, D] or T[0]
                                  .Ret<xla::ffi::AnyBuffer>()   // workspace: dbias partials (GPU)
                                  .Ret<xla::ffi::AnyBuffer>()   // workspace: delta
                                  .Ret<xla::ffi::AnyBuffer>());  // workspace: dq accumulator

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxsubCpu_attention_qkv_fwd, jaxsub::AttentionQkvFwdCpu,
                              jaxsub::attention_attrs(xla::ffi::Ffi::Bind()
                                                          .Arg<xla::ffi::AnyBuffer>()   // qkv
                                                          .Arg<xla::ffi::AnyBuffer>()   // mask
                                                          .Arg<xla::ffi::AnyBuffer>())  // seed
                                  .Attr<int32_t>("qkv_axis")
                                  .Ret<xla::ffi::AnyBuffer>()   // out
                                  .Ret<xla::ffi::AnyBuffer>());  // lse

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxsubCpu_attention_qkv_bwd, jaxsub::AttentionQkvBwdCpu,
                              jaxsub::attention_attrs(xla::ffi::Ffi::Bind()
                                                          .Arg<xla::ffi::AnyBuffer>()   // dout
                                                          .Arg<xla::ffi::AnyBuffer>()   // qkv
                                                          .Arg<xla::ffi::AnyBuffer>()   // out
                                                          .Arg<xla::ffi::AnyBuffer>()   // lse
                                                          .Arg<xla::ffi::AnyBuffer>()   // mask
                                                          .Arg<xla::ffi::AnyBuffer>())  // seed
                                  .Attr<int32_t>("qkv_axis")
                                  .Ret<xla::ffi::AnyBuffer>()   // dqkv
                                  .Ret<xla::ffi::AnyBuffer>()   // dbias: T[3, H, D] or T[0]
                                  .Ret<xla::ffi::AnyBuffer>()   // workspace: dbias partials (GPU)
                                  .Ret<xla::ffi::AnyBuffer>()   // workspace: delta
                                  .Ret<xla::ffi::AnyBuffer>()   // workspace: dq accumulator
                                  .RemainingRets());            // none, or dbias_k, dbias_v: T[H, D]
