// Shared helpers for every op family: FFI shape/error helpers, the one dtype dispatch,
// host 16-bit float types for the CPU handlers, and (under nvcc) vector load/store and
// warp/block reductions for the CUDA kernels.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>

#include "xla/ffi/api/ffi.h"

#ifdef __CUDACC__
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#define JAXSUB_HD __host__ __device__ __forceinline__
#else
#define JAXSUB_HD inline
#endif

namespace jaxsub {
namespace ffi = xla::ffi;

// ---------------------------------------------------------------------------------------
// Errors and shapes.

inline ffi::Error invalid(const char* op, const std::string& msg) {
  return ffi::Error::InvalidArgument(std::string(op) + ": " + msg);
}

// A tensor viewed as [rows, cols]: cols is the last dimension, rows the product of the rest.
struct Rows {
  int64_t rows = 0;
  int64_t cols = 0;
};

inline Rows as_rows(const ffi::AnyBuffer& b) {
  auto d = b.dimensions();
  Rows r;
  r.cols = d.size() == 0 ? 1 : d.back();
  r.rows = r.cols == 0 ? 0 : static_cast<int64_t>(b.element_count()) / r.cols;
  return r;
}

// Attention-family masks (ABI.md): a 4-D buffer [Bm, Hm, Sqm, Skm], each dim 1 or the
// full size, read as pred (kind 1) or f32 additive (kind 2); kind 0 = no mask.
constexpr int32_t kMaskNone = 0, kMaskBool = 1, kMaskAdditive = 2;

// Checks the mask against the logical [B, H, Sq, Sk] dims `full` and stores its dims.
inline ffi::Error check_mask(const char* op, const ffi::AnyBuffer& mask, int32_t kind, const int64_t (&full)[4],
                             int64_t (&dims)[4]) {
  auto m = mask.dimensions();
  if (m.size() != 4) return invalid(op, "mask must be 4-D");
  for (int i = 0; i < 4; ++i) dims[i] = m[i];
  if (kind < kMaskNone || kind > kMaskAdditive) return invalid(op, "mask_kind must be 0, 1 or 2");
  if (kind == kMaskNone) return ffi::Error::Success();
  for (int i = 0; i < 4; ++i)
    if (dims[i] != 1 && dims[i] != full[i]) return invalid(op, "mask dims must be 1 or full");
  const auto want = kind == kMaskBool ? ffi::DataType::PRED : ffi::DataType::F32;
  if (mask.element_type() != want) return invalid(op, "mask dtype does not match mask_kind");
  return ffi::Error::Success();
}

// The checked mask read with broadcasting (CPU handlers): a dim of size 1 gets stride 0,
// so a [B, 1, 1, Sk] padding mask is indexed in place, never expanded.
struct MaskView {
  int32_t kind = kMaskNone;
  const void* data = nullptr;
  int64_t stride[4] = {0, 0, 0, 0};

  // Offset of row (b, h, i) in the mask; column j adds j * stride[3].
  int64_t row_offset(int64_t b, int64_t h, int64_t i) const {
    return b * stride[0] + h * stride[1] + i * stride[2];
  }
};

inline ffi::Error mask_view(const char* op, const ffi::AnyBuffer& mask, int32_t kind, const int64_t (&full)[4],
                            MaskView& m) {
  m = MaskView{};
  int64_t dims[4];
  if (auto e = check_mask(op, mask, kind, full, dims); e.failure()) return e;
  if (kind == kMaskNone) return ffi::Error::Success();
  int64_t stride = 1;
  for (int k = 3; k >= 0; --k) {
    m.stride[k] = dims[k] == 1 ? 0 : stride;
    stride *= dims[k];
  }
  m.kind = kind;
  m.data = mask.untyped_data();
  return ffi::Error::Success();
}

// A buffer bound as AnyBuffer with the dtype and element count it must have.
inline ffi::Error check_buffer(const char* op, const char* name, const ffi::AnyBuffer& b, ffi::DataType dtype,
                               size_t count) {
  if (b.element_type() == dtype && b.element_count() == count) return ffi::Error::Success();
  return invalid(op, std::string("`") + name + "` has the wrong dtype or number of elements");
}

// The q/k/v bias gradient of the packed attention backwards as its three parts' outputs
// (ABI.md), null for none: `dbias` T[3, H, D] (its parts hd = H * D elements apart) or T[0]
// (none), or, where `more` (attention_qkv_bwd's remaining results) holds two more results,
// dbias T[H, D] for q and those two T[H, D] for k and v (three separate parameters'
// gradients, which slices of one [3, H, D] result would make copies of). Shared by the CPU
// and CUDA handlers.
inline ffi::Error dbias_parts(const char* op, ffi::AnyBuffer& dbias, ffi::DataType t, size_t hd,
                              const ffi::RemainingRets* more, void* (&out)[3]) {
  out[0] = out[1] = out[2] = nullptr;
  const size_t extra = more != nullptr ? more->size() : 0;
  if (extra != 0 && extra != 2)
    return invalid(op, "after its five results it takes two more (the k and v bias gradients) or none");
  if (dbias.element_count() == 0 && extra == 0) return ffi::Error::Success();
  if (auto e = check_buffer(op, "dbias", dbias, t, extra ? hd : 3 * hd); e.failure()) return e;
  char* q = static_cast<char*>(dbias.untyped_data());
  out[0] = q;
  for (size_t p = 1; p < 3; ++p) {
    if (extra == 0) {
      out[p] = q + p * hd * ffi::ByteWidth(t);
      continue;
    }
    auto r = more->get<ffi::AnyBuffer>(p - 1);
    if (r.has_error()) return invalid(op, "the k and v bias gradients must be results");
    if (auto e = check_buffer(op, p == 1 ? "the k bias gradient" : "the v bias gradient", **r, t, hd); e.failure())
      return e;
    out[p] = (*r)->untyped_data();
  }
  return ffi::Error::Success();
}

// The words a dropout seed may have: 2 (the Philox key), or 4 (the key, then the 64-bit
// offset of the call's slice in 8-element blocks: philox.h `Seed`; ABI.md). Anything else is
// checked against 2, so the error names the usual size.
inline size_t seed_words(size_t count) { return count == 4 ? 4 : 2; }

// A row op's kernel configuration: the attributes `block_threads` and `max_elems`
// (ABI.md), 0 meaning the kernel's built-in default.
struct KernelConfig {
  int32_t block_threads = 0;  // threads per block: 0, or a multiple of 32 in [32, 1024]
  int32_t max_elems = 0;      // elements per thread at most: 0, 4, 8, 16 or 32

  int threads_or(int fallback) const { return block_threads != 0 ? block_threads : fallback; }
  int elems_or(int fallback) const { return max_elems != 0 ? max_elems : fallback; }
};

// The one check of a kernel configuration, for the CPU handlers (which then ignore it)
// and the CUDA handlers alike, so a bad one fails the same way on every platform.
inline ffi::Error check_kernel_config(const char* op, const KernelConfig& k) {
  const int32_t t = k.block_threads, e = k.max_elems;
  if (t != 0 && (t < 32 || t > 1024 || t % 32 != 0))
    return invalid(op, "`block_threads` must be 0 or a multiple of 32 in [32, 1024], got " + std::to_string(t));
  if (e != 0 && e != 4 && e != 8 && e != 16 && e != 32)
    return invalid(op, "`max_elems` must be 0, 4, 8, 16 or 32, got " + std::to_string(e));
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------
// Host 16-bit floats for the CPU handlers (the FFI passes them as uint16_t bit patterns).

struct HostBF16 { uint16_t bits; };
struct HostF16 { uint16_t bits; };

JAXSUB_HD float to_float(float x) { return x; }
inline float to_float(HostBF16 x) {
  uint32_t u = static_cast<uint32_t>(x.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline float to_float(HostF16 x) {
  uint32_t h = x.bits, sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ffu;
  uint32_t u;
  if (exp == 0x1f) {
    u = sign | 0x7f800000u | (man << 13);
  } else if (exp != 0) {
    u = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    u = sign;
  } else {  // subnormal half: renormalize
    int e = -1;
    do { man <<= 1; ++e; } while ((man & 0x400u) == 0);
    u = sign | ((112 - e) << 23) | ((man & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

template <typename T> inline T from_float(float f);
template <> inline float from_float<float>(float f) { return f; }
template <> inline HostBF16 from_float<HostBF16>(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return HostBF16{static_cast<uint16_t>((u >> 16) | 0x40)};
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return HostBF16{static_cast<uint16_t>(u >> 16)};
}
template <> inline HostF16 from_float<HostF16>(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  uint32_t sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return HostF16{static_cast<uint16_t>(sign | 0x7e00u)};
  if (a >= 0x477ff000u) return HostF16{static_cast<uint16_t>(sign | 0x7c00u)};  // rounds to inf
  if (a < 0x38800000u) {  // subnormal or zero in half: round on the 2^-24 grid
    float af;
    std::memcpy(&af, &a, 4);
    float scaled = af * 16777216.0f;  // exact: power of two
    uint32_t m = static_cast<uint32_t>(scaled);
    float rem = scaled - static_cast<float>(m);
    if (rem > 0.5f || (rem == 0.5f && (m & 1u))) ++m;
    return HostF16{static_cast<uint16_t>(sign | m)};
  }
  uint32_t r = a + 0xfffu + ((a >> 13) & 1u) - (112u << 23);
  return HostF16{static_cast<uint16_t>(sign | (r >> 13))};
}

// 2^x. On the device one special-function instruction (ex2.approx.ftz: relative error
// about 2^-22, subnormal results flushed to zero, i.e. off by less than 2^-126); exp2f
// and __expf add a range fix-up of three to five instructions per call for those.
JAXSUB_HD float fast_exp2(float x) {
#ifdef __CUDA_ARCH__
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else
  return std::exp2(x);
#endif
}

// max(a, b) where a NaN in either wins (fmaxf and std::max return the other operand): a
// softmax row with a NaN score is NaN, as in plain JAX, not a row with that key dropped or,
// all NaN, an empty row of zeros. On the device one instruction, as fmaxf (max.NaN, sm_80).
JAXSUB_HD float max_nan(float a, float b) {
#ifdef __CUDA_ARCH__
  float y;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(y) : "f"(a), "f"(b));
  return y;
#else
  return (b > a || b != b) ? b : a;
#endif
}

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// ---------------------------------------------------------------------------------------
// The one dtype dispatch: f(tag) is called with tag::type the storage type of `dt` on the
// chosen platform (Map::F32 / Map::BF16 / Map::F16).

template <typename T> struct TypeTag { using type = T; };

struct HostTypes {
  using F32 = float;
  using BF16 = HostBF16;
  using F16 = HostF16;
};

template <typename Map, typename F>
ffi::Error dispatch_float(ffi::DataType dt, const char* op, F&& f) {
  switch (dt) {
    case ffi::DataType::F32: return f(TypeTag<typename Map::F32>{});
    case ffi::DataType::BF16: return f(TypeTag<typename Map::BF16>{});
    case ffi::DataType::F16: return f(TypeTag<typename Map::F16>{});
    default: return invalid(op, "unsupported dtype (expected float32, bfloat16 or float16)");
  }
}

// Parameters are either the activation type T or float32: f(tag) gets tag::type = P.
template <typename Map, typename T, typename F>
ffi::Error dispatch_param(ffi::DataType activation, ffi::DataType param, const char* op, F&& f) {
  if (param == activation) return f(TypeTag<T>{});
  if (param == ffi::DataType::F32) return f(TypeTag<typename Map::F32>{});
  return invalid(op, "parameters must have the activation dtype or float32");
}

template <typename T> inline T* data(ffi::AnyBuffer b) { return reinterpret_cast<T*>(b.untyped_data()); }
template <typename T> inline T* data(ffi::Result<ffi::AnyBuffer>& b) {
  return reinterpret_cast<T*>(b->untyped_data());
}

#ifdef __CUDACC__
// ---------------------------------------------------------------------------------------
// CUDA helpers.

struct DeviceTypes {
  using F32 = float;
  using BF16 = __nv_bfloat16;
  using F16 = __half;
};

__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
template <typename T> __device__ __forceinline__ T from_float_dev(float f);
template <> __device__ __forceinline__ float from_float_dev<float>(float f) { return f; }
template <> __device__ __forceinline__ __nv_bfloat16 from_float_dev<__nv_bfloat16>(float f) {
  return __float2bfloat16_rn(f);
}
template <> __device__ __forceinline__ __half from_float_dev<__half>(float f) { return __float2half_rn(f); }

// N elements of T moved as one aligned access (16 bytes when N * sizeof(T) == 16).
template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

// A vector's elements as float. bfloat16 pairs are split with one shift and one mask per
// element (a bfloat16 is the top half of its float), where per-element conversion
// extracts each half first (a permute and a shift). The words are copied out of the
// vector value (a register move), so its load stays one 16-byte access.
template <typename T, int N>
__device__ __forceinline__ void to_floats(const Vec<T, N>& v, float (&out)[N]) {
  if constexpr (std::is_same_v<T, __nv_bfloat16> && N % 2 == 0) {
    uint32_t w[N / 2];
    memcpy(w, &v, sizeof(w));
#pragma unroll
    for (int i = 0; i < N / 2; ++i) {
      out[2 * i] = __uint_as_float(w[i] << 16);
      out[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) out[i] = to_float(v.v[i]);
  }
}

template <typename T, int N>
__device__ __forceinline__ void load_vec(const T* p, float (&out)[N]) {
  const Vec<T, N> v = *reinterpret_cast<const Vec<T, N>*>(p);
  to_floats<T, N>(v, out);
}

template <typename T, int N>
__device__ __forceinline__ void store_vec(T* p, const float (&in)[N]) {
  Vec<T, N> v;
#pragma unroll
  for (int i = 0; i < N; ++i) v.v[i] = from_float_dev<T>(in[i]);
  *reinterpret_cast<Vec<T, N>*>(p) = v;
}

struct SumOp {
  static constexpr float kIdentity = 0.f;
  __device__ __forceinline__ float operator()(float a, float b) const { return a + b; }
};
struct MaxOp {
  static constexpr float kIdentity = -__builtin_huge_valf();
  __device__ __forceinline__ float operator()(float a, float b) const { return max_nan(a, b); }
};

template <typename Op>
__device__ __forceinline__ float warp_reduce(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = Op()(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}

__device__ __forceinline__ float warp_sum(float x) { return warp_reduce<SumOp>(x); }

// Barrier over the blockDim.x threads of this row group only (named barrier
// 1 + threadIdx.y; 0 is __syncthreads): row groups of one block never wait for each other.
// Needs blockDim.x a multiple of 32 and blockDim.y <= 15 (choose_rows guarantees both).
__device__ __forceinline__ void row_group_barrier() {
  asm volatile("bar.sync %0, %1;" ::"r"(threadIdx.y + 1), "r"(blockDim.x) : "memory");
}

// Reduction over the blockDim.x threads of one row group (threadIdx.y selects the group):
// shuffles only when the group is one warp. `scratch` holds at least 32 * blockDim.y
// floats. All threads of the row group must call it.
template <typename Op>
__device__ __forceinline__ float row_group_reduce(float x, float* scratch) {
  x = warp_reduce<Op>(x);
  if (blockDim.x <= 32) return x;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  float* s = scratch + threadIdx.y * 32;
  row_group_barrier();  // the previous reduction's readers are done with s
  if (lane == 0) s[warp] = x;
  row_group_barrier();
  return warp_reduce<Op>(lane < nwarps ? s[lane] : Op::kIdentity);
}

__device__ __forceinline__ float row_group_sum(float x, float* scratch) { return row_group_reduce<SumOp>(x, scratch); }

// Two sums at once (one round of barriers): scratch holds at least 64 * blockDim.y floats.
__device__ __forceinline__ void row_group_sum2(float& a, float& b, float* scratch) {
  a = warp_sum(a);
  b = warp_sum(b);
  if (blockDim.x <= 32) return;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  float* s = scratch + threadIdx.y * 64;
  row_group_barrier();
  if (lane == 0) s[warp] = a, s[32 + warp] = b;
  row_group_barrier();
  a = warp_sum(lane < nwarps ? s[lane] : 0.f);
  b = warp_sum(lane < nwarps ? s[32 + lane] : 0.f);
}

inline ffi::Error launch_status(const char* op) {
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return ffi::Error::Internal(std::string(op) + ": CUDA error: " + cudaGetErrorString(e));
  return ffi::Error::Success();
}

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// Whether the current device has compute capability 9.0 (Hopper: the sm_90a kernels).
inline bool device_is_sm90() {
  int dev = 0, major = 0, minor = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return false;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess)
    return false;
  return major == 9 && minor == 0;
}
#endif  // __CUDACC__

// The FFI attributes every attention target binds, in ABI.md's order (CUDA and CPU bindings
// alike; the packed targets add qkv_axis). dropout_bcast: one keep mask [Sq, Sk] shared by
// every batch and head (the keep decisions index [Sq, Sk], not [B, H, Sq, Sk]).
template <typename Binding>
auto attention_attrs(Binding b) {
  return std::move(b)
      .template Attr<float>("scale")
      .template Attr<bool>("causal")
      .template Attr<int32_t>("mask_kind")
      .template Attr<uint32_t>("threshold")
      .template Attr<float>("keep_scale")
      .template Attr<bool>("dropout_bcast");
}

}  // namespace jaxsub
