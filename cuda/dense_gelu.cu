// Dense + bias + GELU + dropout in one GEMM (ABI.md: dense_gelu_fwd), CUDA: the GEMM's
// epilogue writes the product h = x · w (rounded to T, for the backward) and
// y = dropout(gelu(h + bias)), so the GELU kernel's read of h and its own pass go.
//
// The GEMM is CUTLASS's sm90 TMA warp-specialized ping-pong kernel (128 x 128 x 64 tiles,
// clusters of 2 x 1: the fastest of five configurations at 4096 x 4096 x 1024, bench/NOTES.md
// twenty-fourth session). The epilogue is an epilogue-visitor tree: the accumulator, stored
// as h by CUTLASS's aux-store node and passed on; the bias, CUTLASS's row broadcast; and
// GeluDropout below, which computes y from both with the keep decisions of every other
// dropout kernel (philox.h: element index row * n + column).
//
// Measured slower than the GEMM and the GELU kernel apart (149 against 96 us at BERT-large
// size; bench/NOTES.md, twenty-fifth session), so Python runs it only when asked
// (JAXSUB_DENSE_GELU=1).
//
// A file of its own in the GELU family (its CPU handler is in gelu_cpu.cc): CUTLASS's
// headers are optional and its kernels take minutes to compile.
// Built when CUTLASS's headers were found at configure time (JAXSUB_CUTLASS) and sm_90a
// device code is built (JAXSUB_SM90A); dense_gelu_sm90() says whether this handler runs
// on the current device. Python routes every other case to the gemm and
// bias_gelu_dropout targets (jaxsub/ops/gelu.py), which compute the same values.
#include <cstdlib>
#include <string>

#include "common.h"
#include "gelu_math.h"
#include "gemm.h"
#include "philox.h"

#if defined(JAXSUB_CUTLASS) && defined(JAXSUB_SM90A)
#define JAXSUB_DENSE_GELU 1
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"
#endif

namespace jaxsub {

#ifdef JAXSUB_DENSE_GELU
namespace {

using namespace cute;
namespace fusion = cutlass::epilogue::fusion;

struct GeluDropoutParams {
  const uint32_t* seed = nullptr;  // [2] or [4] (philox.h Seed)
  uint32_t threshold = 0;          // drop where the element's 16 random bits < threshold
  float keep_scale = 1.f;          // 1 / (1 - rate)
  int64_t n = 0;                   // columns of y: element (i, j) has index i * n + j
  bool approximate = false;
  bool quad = true;  // share Philox calls within quads where the layout allows (fragment_math)
  bool seed_offset = false;  // the seed has four words: words 2-3 are the slice's offset
};

// One fragment's epilogue values: v (h + bias, then y), and its keep decisions, either as
// bits (keep) or, with the quad layout (quad), as the Philox counters this lane draws.
template <int F>
struct FragmentArgs {
  float v[F];
  uint64_t calls[F / 8];
  uint32_t keep;
  bool quad;
};

// v = dropout(gelu(v)) for one fragment, out of line: one copy for all of a tile's
// fragments, its loops unrolled so that the F / 8 Philox calls and the F GELU chains
// overlap (one warp per scheduler runs the epilogue). With
// a.quad each lane draws one call per four of its pairs and the quad swaps words (step s:
// lane q takes word q of the call of lane (q + s) % 4): in the accumulator layout the
// quad's four lanes hold the call's eight columns, 2 q and 2 q + 1 for lane q.
template <bool kApproximate, int F>
__device__ __noinline__ void fragment_math(FragmentArgs<F>& a, const Seed& seed, uint32_t thr_hi,
                                           float keep_scale) {
  uint32_t keep = a.keep;
  if (a.quad) {
    const int lane = static_cast<int>(threadIdx.x & 31), ql = lane & 3;
    U32x4 w[F / 8];
#pragma unroll
    for (int g = 0; g < F / 8; ++g)
      w[g] = dropout_words(seed, a.calls[g]);
    keep = 0;
#pragma unroll
    for (int g = 0; g < F / 8; ++g) {
#pragma unroll
      for (int s = 0; s < 4; ++s) {
        const int src = (lane & ~3) | ((ql + s) & 3);
        const uint32_t word = __shfl_sync(0xffffffffu, word_at(w[g], (ql - s) & 3), src);
        const int e = 2 * (4 * g + ((ql + s) & 3));  // lanes 2 ql (low half) and 2 ql + 1
        keep |= static_cast<uint32_t>((word << 16) >= thr_hi) << e;
        keep |= static_cast<uint32_t>(word >= thr_hi) << (e + 1);
      }
    }
  }
#pragma unroll
  for (int i = 0; i < F; ++i) a.v[i] = gelu(a.v[i], kApproximate) * ((keep >> i & 1u) ? keep_scale : 0.f);
}

// The epilogue node y = dropout(gelu(float(T(acc)) + bias)): the GELU kernel's arithmetic
// on the h the aux node stores, so y is what bias_gelu_dropout gives for that h. Its two
// children give the accumulator (after the aux store) and the bias, both as floats.
template <class T>
struct GeluDropout {
  struct SharedStorage {};
  using Arguments = GeluDropoutParams;
  using Params = GeluDropoutParams;

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const&, Arguments const& args, void*) {
    return args;
  }
  template <class ProblemShape>
  static bool can_implement(ProblemShape const&, Arguments const&) {
    return true;
  }
  template <class ProblemShape>
  static size_t get_workspace_size(ProblemShape const&, Arguments const&) {
    return 0;
  }
  template <class ProblemShape>
  static cutlass::Status initialize_workspace(ProblemShape const&, Arguments const&, void*, cudaStream_t,
                                              cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }

  CUTLASS_HOST_DEVICE GeluDropout() {}
  CUTLASS_HOST_DEVICE GeluDropout(Params const& p, SharedStorage const&) : params(p) {}
  Params params;

  CUTLASS_DEVICE bool is_producer_load_needed() const { return false; }
  CUTLASS_DEVICE bool is_C_load_needed() const { return false; }

  template <class... Args>
  CUTLASS_DEVICE auto get_producer_load_callbacks(fusion::detail::ProducerLoadArgs<Args...> const&) {
    return fusion::detail::EmptyProducerLoadCallbacks{};
  }

  template <class CoordTensor>
  struct ConsumerStoreCallbacks : fusion::detail::EmptyConsumerStoreCallbacks {
    CUTLASS_DEVICE ConsumerStoreCallbacks(CoordTensor c, int64_t m0, int64_t n0, Params const& p)
        : tCcD(c), base(static_cast<uint64_t>(m0) * static_cast<uint64_t>(p.n) + static_cast<uint64_t>(n0)), params(p) {
      seed = load_seed(p.seed, p.seed_offset);
    }
    CoordTensor tCcD;  // (CPY, CPY_M, CPY_N, EPI_M, EPI_N): coordinates from the thread's first element
    uint64_t base;  // the index of the thread's first element
    Params const& params;
    Seed seed;
    bool quad_ok = false;  // quad_layout() of the tile's first fragment

    // Element k of the thread's fragment c: its index row * n + column in y.
    template <class C>
    CUTLASS_DEVICE uint64_t index_of(C const& c, int k) const {
      const auto mn = c(k);
      return base + static_cast<uint64_t>(get<0>(mn)) * static_cast<uint64_t>(params.n) +
             static_cast<uint64_t>(get<1>(mn));
    }

    // Whether the fragment's elements sit as the MMA's accumulator layout puts them: pairs
    // (2 p, 2 p + 1) of adjacent columns 2 q, 2 q + 1 of a group of eight, q the lane's index
    // in its quad, and the quad's four lanes on the same rows and groups, so that the quad
    // shares Philox calls (keep_mask). Checked on a tile's first fragment, warp-wide: the
    // other fragments are the same partition moved by whole epilogue tiles.
    template <int F, class C>
    CUTLASS_DEVICE bool quad_layout(C const& c, int epi_v) const {
      const int lane = static_cast<int>(threadIdx.x & 31), ql = lane & 3;
      bool ok = true;
#pragma unroll 1
      for (int p = 0; p < F / 2; ++p) {
        const uint64_t i0 = index_of(c, epi_v * F + 2 * p), i1 = index_of(c, epi_v * F + 2 * p + 1);
        const uint64_t call = i0 >> 3;  // the same for the quad's four lanes
        const uint32_t lo = __shfl_sync(0xffffffffu, static_cast<uint32_t>(call), lane & ~3);
        const uint32_t hi = __shfl_sync(0xffffffffu, static_cast<uint32_t>(call >> 32), lane & ~3);
        ok = ok && i1 == i0 + 1 && static_cast<int>(i0 & 7) == 2 * ql && lo == static_cast<uint32_t>(call) &&
             hi == static_cast<uint32_t>(call >> 32);
      }
      return __all_sync(0xffffffffu, ok);
    }

    // The fallback keep decisions (each element's own Philox call, bit i for element i),
    // where the fragment does not sit in the quad layout.
    template <int F, class C>
    CUTLASS_DEVICE uint32_t keep_bits_apart(C const& c, int epi_v) const {
      const uint32_t thr_hi = params.threshold << 16;
      uint32_t bits = 0;
#pragma unroll 1
      for (int i = 0; i < F; ++i) {
        const uint64_t idx = index_of(c, epi_v * F + i);
        bits |= static_cast<uint32_t>(lane_kept(dropout_words(seed, idx >> 3), static_cast<int>(idx & 7), thr_hi))
                << i;
      }
      return bits;
    }

    // y for the fragment. The collective inlines visit() once per fragment of the tile
    // (eight times at 128 x 128), so the arithmetic is one out-of-line copy
    // (fragment_math) and only the values and the Philox counters are made here. With
    // everything inlined the kernel held 16 248 instructions and ran 498 us at 4096 x 1024
    // x 4096; with rolled loops inline 153 us; this way 149 us, against 46 for the GEMM
    // alone and 82 for this epilogue without the GELU and the Philox calls
    // (bench/NOTES.md, twenty-fourth and twenty-fifth sessions).
    template <typename ElementAccumulator, typename ElementInput, int F>
    CUTLASS_DEVICE cutlass::Array<T, F> visit(cutlass::Array<ElementAccumulator, F> const&, int epi_v, int epi_m,
                                              int epi_n, cutlass::Array<ElementInput, F> const& acc,
                                              cutlass::Array<ElementInput, F> const& bias) {
      static_assert(F % 8 == 0 && F <= 32, "four pairs per quad step, one bit per element");
      Tensor c = tCcD(_, _, _, epi_m, epi_n);
      FragmentArgs<F> a;
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < F; ++i) a.v[i] = static_cast<float>(static_cast<T>(acc[i])) + static_cast<float>(bias[i]);
      a.keep = ~0u;
      a.quad = false;
      if (params.threshold != 0) {
        if (epi_v == 0 && epi_m == 0 && epi_n == 0) quad_ok = params.quad && quad_layout<F>(c, epi_v);
        if (quad_ok) {
          // Lane q draws the call of its pair 4 g + q (elements 8 g + 2 q, + 1): the indices
          // of the four candidates are constants here, the lane picks one.
          const int ql = static_cast<int>(threadIdx.x & 3);
          CUTLASS_PRAGMA_UNROLL
          for (int g = 0; g < F / 8; ++g) {
            const uint64_t c0 = index_of(c, epi_v * F + 8 * g) >> 3, c1 = index_of(c, epi_v * F + 8 * g + 2) >> 3,
                           c2 = index_of(c, epi_v * F + 8 * g + 4) >> 3, c3 = index_of(c, epi_v * F + 8 * g + 6) >> 3;
            a.calls[g] = ql == 0 ? c0 : ql == 1 ? c1 : ql == 2 ? c2 : c3;
          }
          a.quad = true;
        } else {
          a.keep = keep_bits_apart<F>(c, epi_v);
        }
      }
      if (params.approximate)
        fragment_math<true, F>(a, seed, params.threshold << 16, params.keep_scale);
      else
        fragment_math<false, F>(a, seed, params.threshold << 16, params.keep_scale);
      cutlass::Array<T, F> y;
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < F; ++i) y[i] = static_cast<T>(a.v[i]);
      return y;
    }
  };

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(fusion::detail::ConsumerStoreArgs<Args...> const& args) {
    // tCcD's coordinates are relative to the thread's first element, whose absolute
    // coordinate is the problem's extent less the residue CUTLASS passes for it.
    const int64_t m0 = static_cast<int64_t>(get<0>(args.problem_shape_mnkl)) - get<0>(args.residue_tCcD);
    const int64_t n0 = static_cast<int64_t>(get<1>(args.problem_shape_mnkl)) - get<1>(args.residue_tCcD);
    return ConsumerStoreCallbacks<decltype(args.tCcD)>(args.tCcD, m0, n0, params);
  }
};

template <class T>
struct DenseGelu {
  using Tile = Shape<_128, _128, _64>;
  using Cluster = Shape<_2, _1, _1>;
  using Layout = cutlass::layout::RowMajor;  // x [m, k], w [k, n], y and h [m, n]
  static constexpr int kAlign = 8;           // elements per 16 bytes
  using Schedule = cutlass::epilogue::TmaWarpSpecialized;
  using EpiTile = cutlass::epilogue::collective::EpilogueTileAuto;  // 64 x 32: 64 x 64 measured no faster
  using Desc = cutlass::epilogue::collective::detail::EpilogueDescriptor<Tile, EpiTile, T, T, Schedule>;
  using AuxDesc = cutlass::epilogue::collective::detail::AuxStoreDescriptor<Desc, Layout, T>;
  using Aux = fusion::Sm90AuxStore<AuxDesc::Stages, typename Desc::EpilogueTile, T,
                                   cutlass::FloatRoundStyle::round_to_nearest, typename AuxDesc::Stride,
                                   typename AuxDesc::SmemLayoutAtom, typename AuxDesc::CopyOpR2S, kAlign>;
  using Bias = fusion::Sm90RowBroadcast<0, Tile, T, float, Stride<_0, _1, int64_t>, kAlign>;
  using Tree = fusion::Sm90EVT<GeluDropout<T>, fusion::Sm90EVT<Aux, fusion::Sm90AccFetch>, Bias>;
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, Cluster, EpiTile, float, float, void, Layout, kAlign,
      T, Layout, kAlign, Schedule, Tree>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, T, Layout, kAlign, T, Layout, kAlign, float, Tile, Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      cutlass::gemm::KernelTmaWarpSpecializedPingpong>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  static ffi::Error run(const char* op, cudaStream_t stream, int64_t m, int64_t n, int64_t k, const void* x,
                        const void* w, const void* bias, void* y, void* h, const GeluDropoutParams& gp) {
    using SA = typename Kernel::StrideA;
    using SB = typename Kernel::StrideB;
    using SD = typename Kernel::StrideD;
    const int mi = static_cast<int>(m), ni = static_cast<int>(n), ki = static_cast<int>(k);
    SA sa = cutlass::make_cute_packed_stride(SA{}, make_shape(mi, ki, 1));
    SB sb = cutlass::make_cute_packed_stride(SB{}, make_shape(ni, ki, 1));
    SD sd = cutlass::make_cute_packed_stride(SD{}, make_shape(mi, ni, 1));
    typename AuxDesc::Stride saux = cutlass::make_cute_packed_stride(typename AuxDesc::Stride{}, make_shape(mi, ni, 1));
    typename Gemm::Arguments args{
        cutlass::gemm::GemmUniversalMode::kGemm,
        {mi, ni, ki, 1},
        {static_cast<const T*>(x), sa, static_cast<const T*>(w), sb},
        {{// Tree: {children..., node}
          {// Sm90EVT<Aux, AccFetch>: {AccFetch, Aux}
           {},
           {static_cast<T*>(h), saux}},
          {static_cast<const T*>(bias), T(0), {}},
          gp},
         nullptr,
         sd,
         static_cast<T*>(y),
         sd}};
    Gemm gemm;
    if (gemm.can_implement(args) != cutlass::Status::kSuccess) return invalid(op, "CUTLASS cannot run this shape");
    if (Gemm::get_workspace_size(args) != 0) return invalid(op, "the GEMM wants a workspace");
    if (gemm.initialize(args, nullptr, stream) != cutlass::Status::kSuccess)
      return invalid(op, "CUTLASS initialization failed");
    if (gemm.run(stream) != cutlass::Status::kSuccess) {
      const cudaError_t e = cudaGetLastError();  // read and cleared: the launch failed either way
      return ffi::Error::Internal(std::string(op) + ": CUTLASS launch failed: " + cudaGetErrorString(e));
    }
    return launch_status(op);
  }
};

}  // namespace
#endif

// Whether the dense_gelu_fwd CUDA handler runs on the current device (module.cc).
bool dense_gelu_sm90() {
#ifdef JAXSUB_DENSE_GELU
  return device_is_sm90();
#else
  return false;
#endif
}

namespace {

// x: [m, k]; w: [k, n]; bias: [n]; seed: [2] or [4] -> y, h: [m, n]. T = bf16 or f16
// throughout, k and n multiples of 8 (Python routes everything else elsewhere).
ffi::Error DenseGeluFwd(cudaStream_t stream, bool approximate, uint32_t threshold, float keep_scale, ffi::AnyBuffer x,
                        ffi::AnyBuffer w, ffi::AnyBuffer bias, ffi::Buffer<ffi::U32> seed,
                        ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> h) {
  const char* op = "dense_gelu_fwd";
  GemmShape g;
  if (auto e = check_dense_gelu(op, x, w, bias, seed, *y, *h, g); e.failure()) return e;
  const int64_t m = g.m, k = g.k, n = g.n;
  const auto t = x.element_type();
  if (m == 0 || n == 0) return ffi::Error::Success();
#ifdef JAXSUB_DENSE_GELU
  if (k % 8 != 0 || n % 8 != 0) return invalid(op, "k and n must be multiples of 8");
  if (!aligned16(x.untyped_data()) || !aligned16(w.untyped_data()) || !aligned16(bias.untyped_data()) ||
      !aligned16(y->untyped_data()) || !aligned16(h->untyped_data()))
    return invalid(op, "buffers must be 16-byte aligned");
  if (!device_is_sm90()) return invalid(op, "needs a compute capability 9.0 device");
  // JAXSUB_DENSE_GELU_QUAD=0: every element draws its own Philox call (read per call: the
  // GPU tests compare both ways).
  const char* quad = std::getenv("JAXSUB_DENSE_GELU_QUAD");
  const GeluDropoutParams gp{seed.typed_data(), threshold, keep_scale, n, approximate,
                             !(quad != nullptr && std::string(quad) == "0"), seed.element_count() == 4};
  if (t == ffi::DataType::BF16)
    return DenseGelu<cutlass::bfloat16_t>::run(op, stream, m, n, k, x.untyped_data(), w.untyped_data(),
                                               bias.untyped_data(), y->untyped_data(), h->untyped_data(), gp);
  if (t == ffi::DataType::F16)
    return DenseGelu<cutlass::half_t>::run(op, stream, m, n, k, x.untyped_data(), w.untyped_data(),
                                           bias.untyped_data(), y->untyped_data(), h->untyped_data(), gp);
  return invalid(op, "unsupported dtype on CUDA (expected bfloat16 or float16)");
#else
  (void)stream, (void)approximate, (void)threshold, (void)keep_scale;
  return invalid(op, "built without CUTLASS or sm_90a device code");
#endif
}

}  // namespace
}  // namespace jaxsub

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxsubCuda_dense_gelu_fwd, jaxsub::DenseGeluFwd,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Attr<bool>("approximate")
                                  .Attr<uint32_t>("threshold")
                                  .Attr<float>("keep_scale")
                                  .Arg<ffi::AnyBuffer>()        // x
                                  .Arg<ffi::AnyBuffer>()        // w
                                  .Arg<ffi::AnyBuffer>()        // bias
                                  .Arg<ffi::Buffer<ffi::U32>>()  // seed
                                  .Ret<ffi::AnyBuffer>()        // y
                                  .Ret<ffi::AnyBuffer>(),       // h
                              {ffi::Traits::kCmdBufferCompatible});
