// A GEMM through cuBLASLt, as an FFI target of ours (ABI.md: gemm). What it is for: XLA's
// dynamic-slice fusion reads the operands of a custom call in place when they are dynamic
// slices of a larger buffer (a layer's weights in a scanned stack) and writes a result in
// place into a dynamic-update-slice, where XLA's own cuBLAS and Triton GEMMs copy the slice
// first (bench/NOTES.md, nineteenth session). The arithmetic is cuBLASLt's: f32
// accumulation, the optional bias added in f32 in the epilogue, one rounding.
//
// cuBLASLt is not linked: the few entry points used here are looked up in the process
// (jaxlib's CUDA plugin has loaded libcublasLt already) or in the library by soname, so
// the build needs no cuBLAS headers and the extension imports where there is no GPU. The
// declarations below are the C ABI of cublasLt.h; where that header is on the include path
// the build checks them against it.
#include <dlfcn.h>
#include <library_types.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <tuple>

#include "common.h"
#include "gemm.h"

namespace jaxsub {
namespace {

constexpr const char* kOp = "gemm";

namespace lt {
using Status = int;  // cublasStatus_t: 0 is success
struct Context;
using Handle = Context*;
struct DescOpaque { uint64_t data[32]; };
struct LayoutOpaque { uint64_t data[14]; };
struct PrefOpaque { uint64_t data[12]; };
using Desc = DescOpaque*;
using Layout = LayoutOpaque*;
using Pref = PrefOpaque*;
struct Algo { uint64_t data[8]; };
struct Heuristic {
  Algo algo;
  size_t workspace_size;
  Status state;
  float waves;
  int reserved[4];
};
constexpr int kCompute32F = 68;                                      // CUBLAS_COMPUTE_32F
constexpr int kOpN = 0, kOpT = 1;                                    // CUBLAS_OP_N / _T
constexpr int kDescTransA = 3, kDescTransB = 4, kDescEpilogue = 7;   // cublasLtMatmulDescAttributes_t
constexpr int kDescBiasPointer = 8;
constexpr uint32_t kEpilogueDefault = 1, kEpilogueBias = 4;          // cublasLtEpilogue_t
constexpr int kPrefMaxWorkspace = 1, kPrefAlignA = 5, kPrefAlignB = 6,  // cublasLtMatmulPreferenceAttributes_t
    kPrefAlignC = 7, kPrefAlignD = 8;

// The entry points, resolved once.
struct Api {
  Status (*create)(Handle*);
  Status (*desc_create)(Desc*, int, cudaDataType_t);
  Status (*desc_destroy)(Desc);
  Status (*desc_set)(Desc, int, const void*, size_t);
  Status (*layout_create)(Layout*, cudaDataType_t, uint64_t, uint64_t, int64_t);
  Status (*layout_destroy)(Layout);
  Status (*pref_create)(Pref*);
  Status (*pref_destroy)(Pref);
  Status (*pref_set)(Pref, int, const void*, size_t);
  Status (*heuristic)(Handle, Desc, Layout, Layout, Layout, Layout, Pref, int, Heuristic*, int*);
  Status (*matmul)(Handle, Desc, const void*, const void*, Layout, const void*, Layout, const void*, const void*,
                   Layout, void*, Layout, const Algo*, void*, size_t, cudaStream_t);
  bool ok = false;
};

void* find_library() {
  // Already in the process (jaxlib's plugin loads it), else by soname.
  for (const char* name : {"libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so"}) {
    if (void* h = dlopen(name, RTLD_NOW | RTLD_NOLOAD | RTLD_LOCAL)) return h;
  }
  for (const char* name : {"libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so"}) {
    if (void* h = dlopen(name, RTLD_NOW | RTLD_LOCAL)) return h;
  }
  return nullptr;
}

template <typename F>
bool resolve(void* lib, const char* name, F*& fn) {
  fn = reinterpret_cast<F*>(dlsym(lib, name));
  return fn != nullptr;
}

const Api& api() {
  static const Api table = [] {
    Api a{};
    void* lib = find_library();
    if (lib == nullptr) return a;
    a.ok = resolve(lib, "cublasLtCreate", a.create) && resolve(lib, "cublasLtMatmulDescCreate", a.desc_create) &&
           resolve(lib, "cublasLtMatmulDescDestroy", a.desc_destroy) &&
           resolve(lib, "cublasLtMatmulDescSetAttribute", a.desc_set) &&
           resolve(lib, "cublasLtMatrixLayoutCreate", a.layout_create) &&
           resolve(lib, "cublasLtMatrixLayoutDestroy", a.layout_destroy) &&
           resolve(lib, "cublasLtMatmulPreferenceCreate", a.pref_create) &&
           resolve(lib, "cublasLtMatmulPreferenceDestroy", a.pref_destroy) &&
           resolve(lib, "cublasLtMatmulPreferenceSetAttribute", a.pref_set) &&
           resolve(lib, "cublasLtMatmulAlgoGetHeuristic", a.heuristic) && resolve(lib, "cublasLtMatmul", a.matmul);
    return a;
  }();
  return table;
}
}  // namespace lt

#if __has_include(<cublasLt.h>)
}  // namespace
}  // namespace jaxsub
#include <cublasLt.h>
namespace jaxsub {
namespace {
static_assert(sizeof(lt::DescOpaque) == sizeof(cublasLtMatmulDescOpaque_t));
static_assert(sizeof(lt::LayoutOpaque) == sizeof(cublasLtMatrixLayoutOpaque_t));
static_assert(sizeof(lt::PrefOpaque) == sizeof(cublasLtMatmulPreferenceOpaque_t));
static_assert(sizeof(lt::Algo) == sizeof(cublasLtMatmulAlgo_t));
static_assert(sizeof(lt::Heuristic) == sizeof(cublasLtMatmulHeuristicResult_t));
static_assert(lt::kCompute32F == CUBLAS_COMPUTE_32F && lt::kOpN == CUBLAS_OP_N && lt::kOpT == CUBLAS_OP_T);
static_assert(lt::kDescTransA == CUBLASLT_MATMUL_DESC_TRANSA && lt::kDescTransB == CUBLASLT_MATMUL_DESC_TRANSB);
static_assert(lt::kDescEpilogue == CUBLASLT_MATMUL_DESC_EPILOGUE &&
              lt::kDescBiasPointer == CUBLASLT_MATMUL_DESC_BIAS_POINTER);
static_assert(lt::kEpilogueDefault == CUBLASLT_EPILOGUE_DEFAULT && lt::kEpilogueBias == CUBLASLT_EPILOGUE_BIAS);
static_assert(lt::kPrefMaxWorkspace == CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES &&
              lt::kPrefAlignA == CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES &&
              lt::kPrefAlignB == CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES &&
              lt::kPrefAlignC == CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES &&
              lt::kPrefAlignD == CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES);
#endif

// Owned cuBLASLt descriptors, destroyed with the call.
struct Descriptors {
  lt::Desc desc = nullptr;
  lt::Layout a = nullptr, b = nullptr, d = nullptr;
  lt::Pref pref = nullptr;
  ~Descriptors() {
    const lt::Api& f = lt::api();
    if (desc) f.desc_destroy(desc);
    for (lt::Layout l : {a, b, d})
      if (l) f.layout_destroy(l);
    if (pref) f.pref_destroy(pref);
  }
};

// The largest power of two up to 256 that divides the address.
uint32_t alignment(const void* p) {
  const auto v = reinterpret_cast<uintptr_t>(p);
  uint32_t a = 256;
  while (a > 1 && v % a != 0) a >>= 1;
  return a;
}

// The shape of one call; the heuristic's choice is kept per shape (querying it costs
// tens of microseconds of host time).
using Key = std::tuple<int, int, int64_t, int64_t, int64_t, bool, bool, bool, uint32_t, uint32_t, uint32_t>;

struct Cache {
  std::mutex mu;
  std::map<int, lt::Handle> handles;  // per device
  std::map<Key, lt::Heuristic> algos;
};

Cache& cache() {
  static Cache* c = new Cache();  // never destroyed: handles outlive static destruction order
  return *c;
}

ffi::Error lt_error(const char* what, lt::Status s) {
  return ffi::Error::Internal(std::string(kOp) + ": " + what + " failed (cuBLAS status " + std::to_string(s) + ")");
}

// d[m, n] += bias[n] in place (the bias rounded into d: used only where the epilogue cannot
// take the bias pointer).
template <typename T>
__global__ void add_bias_kernel(T* d, const T* bias, int64_t m, int64_t n) {
  const int64_t total = m * n;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    d[i] = from_float_dev<T>(to_float(d[i]) + to_float(bias[i % n]));
}

template <typename T>
cudaError_t add_bias(cudaStream_t stream, void* d, const void* bias, int64_t m, int64_t n) {
  const int64_t blocks = std::min<int64_t>((m * n + 255) / 256, 4096);
  add_bias_kernel<T><<<static_cast<int>(blocks), 256, 0, stream>>>(static_cast<T*>(d), static_cast<const T*>(bias),
                                                                    m, n);
  return cudaGetLastError();
}

ffi::Error bias_kernel(cudaStream_t stream, ffi::DataType t, void* d, const void* bias, int64_t m, int64_t n) {
  return dispatch_float<DeviceTypes>(t, kOp, [&](auto tt) {
    using T = typename decltype(tt)::type;
    return add_bias<T>(stream, d, bias, m, n) == cudaSuccess
               ? ffi::Error::Success()
               : ffi::Error::Internal(std::string(kOp) + ": bias kernel launch failed");
  });
}

cudaDataType_t cuda_type(ffi::DataType t) {
  return t == ffi::DataType::F32 ? CUDA_R_32F : t == ffi::DataType::BF16 ? CUDA_R_16BF : CUDA_R_16F;
}

// Row-major d[m, n] = op(a) · op(b) (+ bias[n]), op(a) [m, k], op(b) [k, n]. cuBLASLt is
// column-major: the same bytes are dᵀ[n, m] = op(b)ᵀ · op(a)ᵀ, so b is cuBLASLt's A and
// a its B, each in its stored shape read column-major, and the bias runs along dᵀ's rows.
ffi::Error run(cudaStream_t stream, ffi::DataType t, const void* a, const void* b, const void* bias, void* d,
               void* workspace, size_t workspace_bytes, int64_t m, int64_t n, int64_t k, bool ta, bool tb) {
  const lt::Api& f = lt::api();
  if (!f.ok) return ffi::Error::Internal(std::string(kOp) + ": libcublasLt could not be loaded");
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return ffi::Error::Internal(std::string(kOp) + ": no CUDA device");
  const bool epilogue_bias = bias != nullptr && alignment(bias) >= 16;
  const Key key{device, static_cast<int>(t), m, n, k, ta, tb, epilogue_bias, alignment(a), alignment(b),
                alignment(d)};

  Descriptors ds;
  const cudaDataType_t dt = cuda_type(t);
  lt::Status s;
  if ((s = f.desc_create(&ds.desc, lt::kCompute32F, CUDA_R_32F))) return lt_error("matmul descriptor", s);
  const int32_t op_a = tb ? lt::kOpT : lt::kOpN, op_b = ta ? lt::kOpT : lt::kOpN;
  const uint32_t epi = epilogue_bias ? lt::kEpilogueBias : lt::kEpilogueDefault;
  if ((s = f.desc_set(ds.desc, lt::kDescTransA, &op_a, sizeof(op_a))) ||
      (s = f.desc_set(ds.desc, lt::kDescTransB, &op_b, sizeof(op_b))) ||
      (s = f.desc_set(ds.desc, lt::kDescEpilogue, &epi, sizeof(epi))))
    return lt_error("matmul attributes", s);
  if (epilogue_bias && (s = f.desc_set(ds.desc, lt::kDescBiasPointer, &bias, sizeof(bias))))
    return lt_error("bias pointer", s);
  // cuBLASLt's A = b: [k, n] row-major is n x k column-major (ld n); transposed, k x n (ld k).
  // Its B = a: [m, k] row-major is k x m (ld k); transposed ([k, m] stored), m x k (ld m).
  if ((s = f.layout_create(&ds.a, dt, tb ? k : n, tb ? n : k, tb ? k : n)) ||
      (s = f.layout_create(&ds.b, dt, ta ? m : k, ta ? k : m, ta ? m : k)) ||
      (s = f.layout_create(&ds.d, dt, n, m, n)))
    return lt_error("matrix layout", s);

  lt::Heuristic choice{};
  lt::Handle handle = nullptr;
  {
    std::lock_guard<std::mutex> lock(cache().mu);
    lt::Handle& cached = cache().handles[device];
    if (cached == nullptr && (s = f.create(&cached))) {
      cached = nullptr;
      return lt_error("cublasLtCreate", s);
    }
    handle = cached;
    auto it = cache().algos.find(key);
    if (it == cache().algos.end()) {
      if ((s = f.pref_create(&ds.pref))) return lt_error("preference", s);
      const uint64_t max_ws = workspace_bytes;
      const uint32_t al[4] = {std::get<9>(key), std::get<8>(key), std::get<10>(key), std::get<10>(key)};
      if ((s = f.pref_set(ds.pref, lt::kPrefMaxWorkspace, &max_ws, sizeof(max_ws))) ||
          (s = f.pref_set(ds.pref, lt::kPrefAlignA, &al[0], sizeof(uint32_t))) ||
          (s = f.pref_set(ds.pref, lt::kPrefAlignB, &al[1], sizeof(uint32_t))) ||
          (s = f.pref_set(ds.pref, lt::kPrefAlignC, &al[2], sizeof(uint32_t))) ||
          (s = f.pref_set(ds.pref, lt::kPrefAlignD, &al[3], sizeof(uint32_t))))
        return lt_error("preference attributes", s);
      int found = 0;
      s = f.heuristic(handle, ds.desc, ds.a, ds.b, ds.d, ds.d, ds.pref, 1, &choice, &found);
      if (s || found < 1) return lt_error("cublasLtMatmulAlgoGetHeuristic (no algorithm for this shape)", s);
      cache().algos.emplace(key, choice);
    } else {
      choice = it->second;
    }
  }
  const float alpha = 1.f, beta = 0.f;
  s = f.matmul(handle, ds.desc, &alpha, b, ds.a, a, ds.b, &beta, d, ds.d, d, ds.d, &choice.algo,
               workspace, workspace_bytes, stream);
  if (s) return lt_error("cublasLtMatmul", s);
  return bias != nullptr && !epilogue_bias ? bias_kernel(stream, t, d, bias, m, n) : ffi::Error::Success();
}

ffi::Error Gemm(cudaStream_t stream, ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::AnyBuffer bias,
                ffi::Result<ffi::AnyBuffer> d, ffi::Result<ffi::AnyBuffer> workspace, bool trans_a, bool trans_b) {
  GemmShape g;
  if (ffi::Error e = check_gemm(kOp, a, b, bias, *d, trans_a, trans_b, g); e.failure()) return e;
  if (g.m == 0 || g.n == 0) return ffi::Error::Success();
  const ffi::DataType t = a.element_type();
  const size_t item = t == ffi::DataType::F32 ? 4 : 2;
  if (g.k == 0) {  // d = bias, or zeros
    if (cudaMemsetAsync(d->untyped_data(), 0, item * g.m * g.n, stream) != cudaSuccess)
      return ffi::Error::Internal(std::string(kOp) + ": memset failed");
    return g.bias ? bias_kernel(stream, t, d->untyped_data(), bias.untyped_data(), g.m, g.n) : ffi::Error::Success();
  }
  return run(stream, t, a.untyped_data(), b.untyped_data(), g.bias ? bias.untyped_data() : nullptr,
             d->untyped_data(), workspace->untyped_data(), workspace->size_bytes(), g.m, g.n, g.k, trans_a, trans_b);
}

}  // namespace
}  // namespace jaxsub

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxsubCuda_gemm, jaxsub::Gemm,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // a
                                  .Arg<ffi::AnyBuffer>()  // b
                                  .Arg<ffi::AnyBuffer>()  // bias [n] or [0]
                                  .Ret<ffi::AnyBuffer>()  // d
                                  .Ret<ffi::AnyBuffer>()  // workspace
                                  .Attr<bool>("trans_a")
                                  .Attr<bool>("trans_b"),
                              {ffi::Traits::kCmdBufferCompatible});
