// The FFI handlers of fused attention (ABI.md, "Attention family"): shapes and buffers
// into AttnArgs, then run_fwd / run_bwd (attention.cu). Included once, at the end of
// attention.cu, whose launchers they call.
#pragma once

namespace jaxsub {
namespace {

// The packed gradients' optional bias gradient (the column sums of the dq, dk and dv parts
// over B and S; its forms: dbias_parts in common.h) and its workspace f32[B * ceil(S / 16),
// 3, H, D], f32[0] without a bias gradient.
ffi::Error set_dbias(const char* op, AttnArgs& a, int d, ffi::DataType t, ffi::Result<ffi::AnyBuffer>& dbias,
                     ffi::Result<ffi::AnyBuffer>& ws, const ffi::RemainingRets* parts = nullptr) {
  const size_t hd = static_cast<size_t>(a.h * d);
  if (auto e = dbias_parts(op, *dbias, t, hd, parts, a.dbias); e.failure()) return e;
  const size_t want = a.dbias[0] != nullptr ? static_cast<size_t>(a.b * ((a.sq + 15) / 16)) * 3 * hd : 0;
  if (ws->element_type() != ffi::DataType::F32 || ws->element_count() != want)
    return invalid(op, "the dbias workspace must be f32[B * ceil(S / 16), 3, H, D] with dbias, f32[0] without");
  a.dbias_ws = want ? data<float>(ws) : nullptr;
  return ffi::Error::Success();
}
// A backward with no score at all (B, H or S zero): every column sum is zero.
void zero_dbias(const AttnArgs& a, int d, ffi::DataType t, cudaStream_t stream) {
  for (void* part : a.dbias)
    if (part != nullptr) cudaMemsetAsync(part, 0, static_cast<size_t>(a.h * d) * ffi::ByteWidth(t), stream);
}

// The backward's buffers besides q, k, v and their gradients.
void set_bwd_buffers(AttnArgs& a, const ffi::AnyBuffer& dout, const ffi::AnyBuffer& out, const ffi::AnyBuffer& lse,
                     const ffi::AnyBuffer& mask, const ffi::Buffer<ffi::U32>& seed,
                     ffi::Result<ffi::AnyBuffer>& delta, ffi::Result<ffi::AnyBuffer>& dq_acc) {
  a.out = out.untyped_data(), a.dout = dout.untyped_data(), a.mask = mask.untyped_data(), a.seed = seed.typed_data();
  a.seed_offset = seed.element_count() == 4;
  a.lse = data<float>(lse), a.delta = data<float>(delta), a.dq_acc = data<float>(dq_acc);
}

// q: [B, Sq, H, D]; k, v: [B, Sk, H, D]; mask: [Bm, Hm, Sqm, Skm]; seed: [2]
//   -> out: [B, Sq, H, D]; lse: [B, H, Sq].
ffi::Error AttentionFwd(cudaStream_t stream, float scale, bool causal, int32_t mask_kind, uint32_t threshold,
                        float keep_scale, bool dropout_bcast, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                        ffi::AnyBuffer mask, ffi::Buffer<ffi::U32> seed, ffi::Result<ffi::AnyBuffer> out,
                        ffi::Result<ffi::AnyBuffer> lse) {
  const char* op = "attention_fwd";
  AttnArgs a{};
  int d = 0;
  if (auto e = read_shapes(op, q, k, v, mask, mask_kind, a, d); e.failure()) return e;
  a.q = q.untyped_data(), a.k = k.untyped_data(), a.v = v.untyped_data(), a.mask = mask.untyped_data();
  a.seed_offset = seed.element_count() == 4;
  a.seed = seed.typed_data(), a.o = out->untyped_data(), a.lse = data<float>(lse);
  set_attrs(a, scale, causal, threshold, keep_scale, dropout_bcast);
  return run_fwd(op, stream, q.element_type(), d, a);
}

// dout, q: [B, Sq, H, D]; k, v: [B, Sk, H, D]; out: [B, Sq, H, D]; lse: [B, H, Sq]; mask; seed
//   -> dq: [B, Sq, H, D]; dk, dv: [B, Sk, H, D]; delta: [B, H, Sq] f32; dq_acc: [B, Sq, H, D] f32.
ffi::Error AttentionBwd(cudaStream_t stream, float scale, bool causal, int32_t mask_kind, uint32_t threshold,
                        float keep_scale, bool dropout_bcast, ffi::AnyBuffer dout, ffi::AnyBuffer q, ffi::AnyBuffer k,
                        ffi::AnyBuffer v, ffi::AnyBuffer out, ffi::AnyBuffer lse, ffi::AnyBuffer mask,
                        ffi::Buffer<ffi::U32> seed, ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
                        ffi::Result<ffi::AnyBuffer> dv, ffi::Result<ffi::AnyBuffer> delta,
                        ffi::Result<ffi::AnyBuffer> dq_acc) {
  const char* op = "attention_bwd";
  AttnArgs a{};
  int d = 0;
  if (auto e = read_shapes(op, q, k, v, mask, mask_kind, a, d); e.failure()) return e;
  a.q = q.untyped_data(), a.k = k.untyped_data(), a.v = v.untyped_data();
  a.o = dq->untyped_data(), a.dk = dk->untyped_data(), a.dv = dv->untyped_data();
  set_bwd_buffers(a, dout, out, lse, mask, seed, delta, dq_acc);
  set_attrs(a, scale, causal, threshold, keep_scale, dropout_bcast);
  if (a.b * a.h == 0 || a.sq * a.sk == 0) {
    // No score at all: every gradient is zero (empty outputs need no writes).
    if (dq->element_count()) cudaMemsetAsync(dq->untyped_data(), 0, dq->size_bytes(), stream);
    if (dk->element_count()) cudaMemsetAsync(dk->untyped_data(), 0, dk->size_bytes(), stream);
    if (dv->element_count()) cudaMemsetAsync(dv->untyped_data(), 0, dv->size_bytes(), stream);
    return launch_status(op);
  }
  return run_bwd(op, stream, q.element_type(), d, a);
}

// The backward of self-attention on separate q, k, v (as three projections write them)
// with the gradient in one packed array, as one projection's backward reads it:
// dout, q, k, v: [B, S, H, D]; out; lse; mask; seed -> dqkv: [B, S, 3, H, D]; dbias (set_dbias) and its workspace;
// delta; dq_acc.
ffi::Error AttentionBwdDqkv(cudaStream_t stream, float scale, bool causal, int32_t mask_kind, uint32_t threshold,
                            float keep_scale, bool dropout_bcast, ffi::AnyBuffer dout, ffi::AnyBuffer q,
                            ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer out, ffi::AnyBuffer lse,
                            ffi::AnyBuffer mask, ffi::Buffer<ffi::U32> seed, ffi::Result<ffi::AnyBuffer> dqkv,
                            ffi::Result<ffi::AnyBuffer> dbias, ffi::Result<ffi::AnyBuffer> dbias_ws,
                            ffi::Result<ffi::AnyBuffer> delta, ffi::Result<ffi::AnyBuffer> dq_acc) {
  const char* op = "attention_bwd_dqkv";
  AttnArgs a{};
  int d = 0;
  if (auto e = read_shapes(op, q, k, v, mask, mask_kind, a, d); e.failure()) return e;
  auto g = dqkv->dimensions();
  if (a.sq != a.sk || a.group != 1 || g.size() != 5 || g[0] != a.b || g[1] != a.sq || g[2] != 3 || g[3] != a.h ||
      g[4] != d)
    return invalid(op, "dqkv must be [B, S, 3, H, D] for q, k, v of shape [B, S, H, D]");
  if (auto e = set_dbias(op, a, d, q.element_type(), dbias, dbias_ws); e.failure()) return e;
  if (a.b * a.h * a.sq == 0) {  // dqkv is empty too
    zero_dbias(a, d, q.element_type(), stream);
    return launch_status(op);
  }
  const int64_t hd = a.h * d;
  a.grad_row = a.dkv_row = 3 * hd, a.dq_batch = a.dkv_batch = a.sq * a.grad_row;
  const int64_t kbytes = hd * static_cast<int64_t>(ffi::ByteWidth(q.element_type()));
  char* dbase = static_cast<char*>(dqkv->untyped_data());
  a.q = q.untyped_data(), a.k = k.untyped_data(), a.v = v.untyped_data();
  a.o = dbase, a.dk = dbase + kbytes, a.dv = dbase + 2 * kbytes;
  set_bwd_buffers(a, dout, out, lse, mask, seed, delta, dq_acc);
  set_attrs(a, scale, causal, threshold, keep_scale, dropout_bcast);
  return run_bwd(op, stream, q.element_type(), d, a);
}

// qkv: [B, S, 3, H, D] or [3, B, S, H, D] (qkv_axis); mask; seed -> out: [B, S, H, D]; lse: [B, H, S].
ffi::Error AttentionQkvFwd(cudaStream_t stream, float scale, bool causal, int32_t mask_kind, uint32_t threshold,
                           float keep_scale, bool dropout_bcast, int32_t qkv_axis, ffi::AnyBuffer qkv,
                           ffi::AnyBuffer mask, ffi::Buffer<ffi::U32> seed, ffi::Result<ffi::AnyBuffer> out,
                           ffi::Result<ffi::AnyBuffer> lse) {
  const char* op = "attention_qkv_fwd";
  AttnArgs a{};
  int d = 0;
  int64_t koff = 0;
  if (auto e = read_packed_shapes(op, qkv, qkv_axis, mask, mask_kind, a, d, koff); e.failure()) return e;
  const char* base = static_cast<const char*>(qkv.untyped_data());
  const int64_t kbytes = koff * static_cast<int64_t>(ffi::ByteWidth(qkv.element_type()));
  a.q = base, a.k = base + kbytes, a.v = base + 2 * kbytes, a.mask = mask.untyped_data();
  a.seed_offset = seed.element_count() == 4;
  a.seed = seed.typed_data(), a.o = out->untyped_data(), a.lse = data<float>(lse);
  set_attrs(a, scale, causal, threshold, keep_scale, dropout_bcast);
  return run_fwd(op, stream, qkv.element_type(), d, a);
}

// dout: [B, S, H, D]; qkv; out: [B, S, H, D]; lse: [B, H, S]; mask; seed
//   -> dqkv: qkv's shape; dbias and its workspace (set_dbias); delta: [B, H, S] f32; dq_acc: [B, S, H, D] f32;
//   then none, or the k and v bias gradients (set_dbias).
ffi::Error AttentionQkvBwd(cudaStream_t stream, float scale, bool causal, int32_t mask_kind, uint32_t threshold,
                           float keep_scale, bool dropout_bcast, int32_t qkv_axis, ffi::AnyBuffer dout,
                           ffi::AnyBuffer qkv, ffi::AnyBuffer out, ffi::AnyBuffer lse, ffi::AnyBuffer mask,
                           ffi::Buffer<ffi::U32> seed, ffi::Result<ffi::AnyBuffer> dqkv,
                           ffi::Result<ffi::AnyBuffer> dbias, ffi::Result<ffi::AnyBuffer> dbias_ws,
                           ffi::Result<ffi::AnyBuffer> delta, ffi::Result<ffi::AnyBuffer> dq_acc,
                           ffi::RemainingRets dbias_kv) {
  const char* op = "attention_qkv_bwd";
  AttnArgs a{};
  int d = 0;
  int64_t koff = 0;
  if (auto e = read_packed_shapes(op, qkv, qkv_axis, mask, mask_kind, a, d, koff); e.failure()) return e;
  if (auto e = set_dbias(op, a, d, qkv.element_type(), dbias, dbias_ws, &dbias_kv); e.failure()) return e;
  if (a.b * a.h * a.sq == 0) {  // dqkv is empty too
    zero_dbias(a, d, qkv.element_type(), stream);
    return launch_status(op);
  }
  const int64_t kbytes = koff * static_cast<int64_t>(ffi::ByteWidth(qkv.element_type()));
  const char* base = static_cast<const char*>(qkv.untyped_data());
  char* dbase = static_cast<char*>(dqkv->untyped_data());
  a.q = base, a.k = base + kbytes, a.v = base + 2 * kbytes;
  a.o = dbase, a.dk = dbase + kbytes, a.dv = dbase + 2 * kbytes;
  set_bwd_buffers(a, dout, out, lse, mask, seed, delta, dq_acc);
  set_attrs(a, scale, causal, threshold, keep_scale, dropout_bcast);
  return run_bwd(op, stream, qkv.element_type(), d, a);
}

// The two backward targets that read q, k and v apart take the same arguments.
auto separate_bwd_binding() {
  return attention_attrs(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>())
      .Arg<ffi::AnyBuffer>()           // dout
      .Arg<ffi::AnyBuffer>()           // q
      .Arg<ffi::AnyBuffer>()           // k
      .Arg<ffi::AnyBuffer>()           // v
      .Arg<ffi::AnyBuffer>()           // out
      .Arg<ffi::AnyBuffer>()           // lse
      .Arg<ffi::AnyBuffer>()           // mask
      .Arg<ffi::Buffer<ffi::U32>>();  // seed
}

}  // namespace
}  // namespace jaxsub

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxsubCuda_attention_fwd, jaxsub::AttentionFwd,
                              jaxsub::attention_attrs(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>())
                                  .Arg<ffi::AnyBuffer>()  // q
                                  .Arg<ffi::AnyBuffer>()  // k
                                  .Arg<ffi::AnyBuffer>()  // v
                                  .Arg<ffi::AnyBuffer>()  // mask
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Ret<ffi::AnyBuffer>()  // out
                                  .Ret<ffi::AnyBuffer>(),  // lse
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxsubCuda_attention_bwd, jaxsub::AttentionBwd,
                              jaxsub::separate_bwd_binding()
                                  .Ret<ffi::AnyBuffer>()  // dq
                                  .Ret<ffi::AnyBuffer>()  // dk
                                  .Ret<ffi::AnyBuffer>()  // dv
                                  .Ret<ffi::AnyBuffer>()  // delta workspace
                                  .Ret<ffi::AnyBuffer>(),  // dq_acc workspace
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxsubCuda_attention_bwd_dqkv, jaxsub::AttentionBwdDqkv,
                              jaxsub::separate_bwd_binding()
                                  .Ret<ffi::AnyBuffer>()  // dqkv
                                  .Ret<ffi::AnyBuffer>()  // dbias: T[3, H, D] or T[0]
                                  .Ret<ffi::AnyBuffer>()  // dbias workspace: f32[B * ceil(S / 16), 3, H, D] or f32[0]
                                  .Ret<ffi::AnyBuffer>()  // delta workspace
                                  .Ret<ffi::AnyBuffer>(),  // dq_acc workspace
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxsubCuda_attention_qkv_fwd, jaxsub::AttentionQkvFwd,
                              jaxsub::attention_attrs(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>())
                                  .Attr<int32_t>("qkv_axis")
                                  .Arg<ffi::AnyBuffer>()  // qkv
                                  .Arg<ffi::AnyBuffer>()  // mask
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Ret<ffi::AnyBuffer>()  // out
                                  .Ret<ffi::AnyBuffer>(),  // lse
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxsubCuda_attention_qkv_bwd, jaxsub::AttentionQkvBwd,
                              jaxsub::attention_attrs(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>())
                                  .Attr<int32_t>("qkv_axis")
                                  .Arg<ffi::AnyBuffer>()  // dout
                                  .Arg<ffi::AnyBuffer>()  // qkv
                                  .Arg<ffi::AnyBuffer>()  // out
                                  .Arg<ffi::AnyBuffer>()  // lse
                                  .Arg<ffi::AnyBuffer>()  // mask
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Ret<ffi::AnyBuffer>()  // dqkv
                                  .Ret<ffi::AnyBuffer>()  // dbias: T[3, H, D] or T[0]
                                  .Ret<ffi::AnyBuffer>()  // dbias workspace: f32[B * ceil(S / 16), 3, H, D] or f32[0]
                                  .Ret<ffi::AnyBuffer>()  // delta workspace
                                  .Ret<ffi::AnyBuffer>()   // dq_acc workspace
                                  .RemainingRets(),        // none, or dbias_k, dbias_v: T[H, D] (dbias then q's)
                              {ffi::Traits::kCmdBufferCompatible});
