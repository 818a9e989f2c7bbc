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
#include <vector>

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

// The shape of one call (device, dtype, m, n, k, transposes, bias in the epilogue, the
// alignments of a, b and d (with c: the smaller of c's and d's), whether it adds c); the
// algorithm chosen for it is kept per process (`choose`).
using Key = std::tuple<int, int, int64_t, int64_t, int64_t, bool, bool, bool, uint32_t, uint32_t, uint32_t, bool>;

struct Chosen {
  lt::Heuristic h;
  int index;                // in the heuristic's order
  std::vector<float> times;  // each candidate's µs, -1 where untimed
};

struct Cache {
  std::mutex mu;
  std::map<int, lt::Handle> handles;  // per device
  std::map<Key, Chosen> algos;
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

// The cuBLASLt descriptors of d[m, n] = op(a) · op(b) (+ bias in the epilogue when `bias`).
// Row-major d is column-major dᵀ[n, m] = op(b)ᵀ · op(a)ᵀ, so b is cuBLASLt's A and a its
// B, each in its stored shape read column-major, and the bias runs along dᵀ's rows.
lt::Status describe(Descriptors& ds, ffi::DataType t, int64_t m, int64_t n, int64_t k, bool ta, bool tb,
                    const void* bias) {
  const lt::Api& f = lt::api();
  const cudaDataType_t dt = cuda_type(t);
  lt::Status s;
  if ((s = f.desc_create(&ds.desc, lt::kCompute32F, CUDA_R_32F))) return s;
  const int32_t op_a = tb ? lt::kOpT : lt::kOpN, op_b = ta ? lt::kOpT : lt::kOpN;
  const uint32_t epi = bias != nullptr ? lt::kEpilogueBias : lt::kEpilogueDefault;
  if ((s = f.desc_set(ds.desc, lt::kDescTransA, &op_a, sizeof(op_a))) ||
      (s = f.desc_set(ds.desc, lt::kDescTransB, &op_b, sizeof(op_b))) ||
      (s = f.desc_set(ds.desc, lt::kDescEpilogue, &epi, sizeof(epi))))
    return s;
  if (bias != nullptr && (s = f.desc_set(ds.desc, lt::kDescBiasPointer, &bias, sizeof(bias)))) return s;
  // cuBLASLt's A = b: [k, n] row-major is n x k column-major (ld n); transposed, k x n (ld k).
  // Its B = a: [m, k] row-major is k x m (ld k); transposed ([k, m] stored), m x k (ld m).
  if ((s = f.layout_create(&ds.a, dt, tb ? k : n, tb ? n : k, tb ? k : n)) ||
      (s = f.layout_create(&ds.b, dt, ta ? m : k, ta ? k : m, ta ? m : k)) ||
      (s = f.layout_create(&ds.d, dt, n, m, n)))
    return s;
  return 0;
}

// Up to kCandidates algorithms for the key's shape and alignments, the heuristic's order.
constexpr int kCandidates = 8;

// Whether algorithms that take no workspace are asked for first (JAXSUB_GEMM_WORKSPACE=1
// in the environment: not, for comparisons). With a workspace, every candidate for the
// layer's products with results of 12.6 M elements or more zeroes 4 bytes of it before
// its kernel: a Memset node in XLA's command buffer, followed by 3-7 us of idle in a
// layer's step. Asked for without one, the heuristic offers the same algorithms (ID,
// tile, stages, cluster) with no memset, and they were no slower (bench/NOTES.md,
// thirtieth session).
bool no_workspace_first() {
  const char* e = std::getenv("JAXSUB_GEMM_WORKSPACE");
  return e == nullptr || std::string(e) != "1";
}

// The workspace a call of `h`'s algorithm is given: none when it needs none (the buffer
// would let cuBLASLt use it, and zero a counter in it first), else all of it.
void* workspace_for(const lt::Heuristic& h, void* workspace) { return h.workspace_size ? workspace : nullptr; }
size_t workspace_bytes_for(const lt::Heuristic& h, size_t bytes) { return h.workspace_size ? bytes : 0; }

lt::Status candidates(lt::Handle handle, Descriptors& ds, const Key& key, size_t workspace_bytes,
                      lt::Heuristic* out, int* found) {
  const lt::Api& f = lt::api();
  lt::Status s;
  if ((s = f.pref_create(&ds.pref))) return s;
  const uint64_t max_ws = workspace_bytes;
  const uint32_t al[4] = {std::get<9>(key), std::get<8>(key), std::get<10>(key), std::get<10>(key)};
  if ((s = f.pref_set(ds.pref, lt::kPrefMaxWorkspace, &max_ws, sizeof(max_ws))) ||
      (s = f.pref_set(ds.pref, lt::kPrefAlignA, &al[0], sizeof(uint32_t))) ||
      (s = f.pref_set(ds.pref, lt::kPrefAlignB, &al[1], sizeof(uint32_t))) ||
      (s = f.pref_set(ds.pref, lt::kPrefAlignC, &al[2], sizeof(uint32_t))) ||
      (s = f.pref_set(ds.pref, lt::kPrefAlignD, &al[3], sizeof(uint32_t))))
    return s;
  *found = 0;
  if (workspace_bytes > 0 && no_workspace_first()) {  // those without a workspace, if any
    const uint64_t none = 0;
    if ((s = f.pref_set(ds.pref, lt::kPrefMaxWorkspace, &none, sizeof(none)))) return s;
    if (f.heuristic(handle, ds.desc, ds.a, ds.b, ds.d, ds.d, ds.pref, kCandidates, out, found) == 0 && *found > 0)
      return 0;
    *found = 0;
    if ((s = f.pref_set(ds.pref, lt::kPrefMaxWorkspace, &max_ws, sizeof(max_ws)))) return s;
  }
  return f.heuristic(handle, ds.desc, ds.a, ds.b, ds.d, ds.d, ds.pref, kCandidates, out, found);
}

// Values in [-1, 1) for the timing buffers (a GEMM's power draw, and so its clock, depends
// on the data: zeros would time faster than real operands).
template <typename T>
__global__ void fill_kernel(T* p, int64_t count, uint32_t salt) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 0x9E3779B1u ^ salt;
    h ^= h >> 16; h *= 0x7FEB352Du; h ^= h >> 15; h *= 0x846CA68Bu; h ^= h >> 16;
    p[i] = from_float_dev<T>(static_cast<float>(h >> 8) * (2.0f / 16777216.0f) - 1.0f);
  }
}

// Scratch for timing one shape off the caller's stream: operands, result, bias and
// workspace of its own, released on scope exit.
struct Scratch {
  void* p[5] = {};
  cudaStream_t stream = nullptr;
  cudaEvent_t ev[2] = {};
  ~Scratch() {
    for (cudaEvent_t e : ev)
      if (e) cudaEventDestroy(e);
    if (stream) cudaStreamDestroy(stream);
    for (void* q : p)
      if (q) cudaFree(q);
  }
};

bool tuning_enabled() {
  const char* e = std::getenv("JAXSUB_GEMM_TUNE");
  return e == nullptr || std::string(e) != "0";
}

// Times each candidate on scratch buffers and returns the index of the fastest: the
// minimum over rounds of three back-to-back runs, candidates interleaved, so that other
// work on the GPU (another stream's kernels) only ever lengthens a sample. The heuristic's
// first stays unless another is at least 2% faster, which keeps the choice stable from
// one process to the next. Any failure leaves the heuristic's first.
int fastest(lt::Handle handle, ffi::DataType t, int64_t m, int64_t n, int64_t k, bool ta, bool tb, bool with_bias,
            bool with_c, size_t workspace_bytes, const lt::Heuristic* cand, int count, float* times) {
  for (int i = 0; i < count; ++i) times[i] = -1.f;
  if (count < 2) return 0;
  const size_t item = t == ffi::DataType::F32 ? 4 : 2;
  const size_t bytes[5] = {item * m * k, item * k * n, item * m * n, item * n, workspace_bytes};
  Scratch sc;
  for (int i = 0; i < 5; ++i)
    if (bytes[i] && cudaMalloc(&sc.p[i], bytes[i]) != cudaSuccess) {
      cudaGetLastError();  // clear the allocation failure; the call goes on with the heuristic's first
      return 0;
    }
  if (cudaStreamCreateWithFlags(&sc.stream, cudaStreamNonBlocking) != cudaSuccess ||
      cudaEventCreate(&sc.ev[0]) != cudaSuccess || cudaEventCreate(&sc.ev[1]) != cudaSuccess)
    return 0;
  ffi::Error filled = dispatch_float<DeviceTypes>(t, kOp, [&](auto tt) {
    using T = typename decltype(tt)::type;
    for (int i = 0; i < 4; ++i)
      fill_kernel<T><<<1024, 256, 0, sc.stream>>>(static_cast<T*>(sc.p[i]), static_cast<int64_t>(bytes[i] / item),
                                                  0x1234567u * (i + 1));
    return cudaGetLastError() == cudaSuccess ? ffi::Error::Success() : ffi::Error::Internal("fill");
  });
  if (filled.failure()) return 0;
  Descriptors ds;
  if (describe(ds, t, m, n, k, ta, tb, with_bias ? sc.p[3] : nullptr)) return 0;
  const lt::Api& f = lt::api();
  const float alpha = 1.f, beta = with_c ? 1.f : 0.f;  // with c: accumulating into the result in place
  float best[kCandidates];
  bool usable[kCandidates];
  for (int i = 0; i < count; ++i) {  // one untimed run each: a candidate that fails is dropped
    usable[i] = f.matmul(handle, ds.desc, &alpha, sc.p[1], ds.a, sc.p[0], ds.b, &beta, sc.p[2], ds.d, sc.p[2], ds.d,
                         &cand[i].algo, workspace_for(cand[i], sc.p[4]), workspace_bytes_for(cand[i], workspace_bytes),
                         sc.stream) == 0;
    best[i] = 1e30f;
  }
  if (!usable[0] || cudaStreamSynchronize(sc.stream) != cudaSuccess) return 0;
  for (int round = 0; round < 5; ++round) {
    for (int i = 0; i < count; ++i) {
      if (!usable[i]) continue;
      cudaEventRecord(sc.ev[0], sc.stream);
      for (int r = 0; r < 3; ++r)
        f.matmul(handle, ds.desc, &alpha, sc.p[1], ds.a, sc.p[0], ds.b, &beta, sc.p[2], ds.d, sc.p[2], ds.d,
                 &cand[i].algo, workspace_for(cand[i], sc.p[4]), workspace_bytes_for(cand[i], workspace_bytes),
                 sc.stream);
      cudaEventRecord(sc.ev[1], sc.stream);
      float ms = 0.f;
      if (cudaEventSynchronize(sc.ev[1]) != cudaSuccess || cudaEventElapsedTime(&ms, sc.ev[0], sc.ev[1]) != cudaSuccess)
        return 0;
      best[i] = std::min(best[i], ms / 3.f);
    }
  }
  int pick = 0;
  for (int i = 0; i < count; ++i) {
    if (usable[i]) times[i] = best[i] * 1e3f;
    if (usable[i] && best[i] < best[pick]) pick = i;
  }
  return best[pick] <= 0.98f * best[0] ? pick : 0;
}

// The algorithm for a key: cached, else the heuristic's candidates, timed unless `stream`
// is capturing a CUDA graph (XLA's command buffers) or JAXSUB_GEMM_TUNE is "0". Timing
// first waits for `stream` (once per key), so that its own work does not overlap the
// samples (a null stream: the caller is not running any). Under capture the heuristic's
// first is used and not cached, so that a later call may still time.
ffi::Error choose(lt::Handle handle, const Key& key, ffi::DataType t, size_t workspace_bytes, cudaStream_t stream,
                  lt::Heuristic* choice, GemmTuning* report = nullptr) {
  {
    std::lock_guard<std::mutex> lock(cache().mu);
    auto it = cache().algos.find(key);
    if (it != cache().algos.end()) {
      *choice = it->second.h;
      if (report) *report = GemmTuning{it->second.index, it->second.times};
      return ffi::Error::Success();
    }
  }
  const int64_t m = std::get<2>(key), n = std::get<3>(key), k = std::get<4>(key);
  const bool ta = std::get<5>(key), tb = std::get<6>(key), with_bias = std::get<7>(key), with_c = std::get<11>(key);
  Descriptors ds;
  // The heuristic sees the epilogue, not the data: any aligned address stands for the bias.
  lt::Status s = describe(ds, t, m, n, k, ta, tb, with_bias ? reinterpret_cast<const void*>(256) : nullptr);
  if (s) return lt_error("matmul descriptors", s);
  lt::Heuristic cand[kCandidates] = {};
  int found = 0;
  if ((s = candidates(handle, ds, key, workspace_bytes, cand, &found)) || found < 1)
    return lt_error("cublasLtMatmulAlgoGetHeuristic (no algorithm for this shape)", s);
  float times[kCandidates];
  for (float& x : times) x = -1.f;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  const bool enabled = tuning_enabled();
  const bool tune = enabled && (stream == nullptr || (cudaStreamIsCapturing(stream, &capture) == cudaSuccess &&
                                                      capture == cudaStreamCaptureStatusNone &&
                                                      cudaStreamSynchronize(stream) == cudaSuccess));
  const int pick =
      tune ? fastest(handle, t, m, n, k, ta, tb, with_bias, with_c, workspace_bytes, cand, found, times) : 0;
  *choice = cand[pick];
  Chosen chosen{cand[pick], pick, std::vector<float>(times, times + found)};
  if (report) *report = GemmTuning{pick, chosen.times};
  if (tune || !enabled) {  // final either way: the heuristic's query costs tens of µs of host time
    std::lock_guard<std::mutex> lock(cache().mu);
    cache().algos.emplace(key, std::move(chosen));
  }
  return ffi::Error::Success();
}

lt::Handle handle_for(int device, lt::Status* s) {
  std::lock_guard<std::mutex> lock(cache().mu);
  lt::Handle& cached = cache().handles[device];
  if (cached == nullptr && (*s = lt::api().create(&cached))) cached = nullptr;
  return cached;
}

Key make_key(int device, ffi::DataType t, int64_t m, int64_t n, int64_t k, bool ta, bool tb, bool epilogue_bias,
             uint32_t al_a, uint32_t al_b, uint32_t al_d, bool with_c) {
  return Key{device, static_cast<int>(t), m, n, k, ta, tb, epilogue_bias, al_a, al_b, al_d, with_c};
}

// d = op(a) op(b) (+ bias) (+ c): with c, cuBLASLt's C operand (beta = 1) in d's layout,
// added in f32 in the epilogue with the bias before the one rounding.
ffi::Error run(cudaStream_t stream, ffi::DataType t, const void* a, const void* b, const void* bias, const void* c,
               void* d, void* workspace, size_t workspace_bytes, int64_t m, int64_t n, int64_t k, bool ta, bool tb) {
  const lt::Api& f = lt::api();
  if (!f.ok) return ffi::Error::Internal(std::string(kOp) + ": libcublasLt could not be loaded");
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return ffi::Error::Internal(std::string(kOp) + ": no CUDA device");
  const bool epilogue_bias = bias != nullptr && alignment(bias) >= 16;
  const uint32_t al_d = c != nullptr ? std::min(alignment(c), alignment(d)) : alignment(d);
  const Key key = make_key(device, t, m, n, k, ta, tb, epilogue_bias, alignment(a), alignment(b), al_d, c != nullptr);
  lt::Status s = 0;
  lt::Handle handle = handle_for(device, &s);
  if (handle == nullptr) return lt_error("cublasLtCreate", s);
  lt::Heuristic choice{};
  if (ffi::Error e = choose(handle, key, t, workspace_bytes, stream, &choice); e.failure()) return e;
  Descriptors ds;
  if ((s = describe(ds, t, m, n, k, ta, tb, epilogue_bias ? bias : nullptr))) return lt_error("matmul descriptors", s);
  const float alpha = 1.f, beta = c != nullptr ? 1.f : 0.f;
  s = f.matmul(handle, ds.desc, &alpha, b, ds.a, a, ds.b, &beta, c != nullptr ? c : d, ds.d, d, ds.d, &choice.algo,
               workspace_for(choice, workspace), workspace_bytes_for(choice, workspace_bytes), stream);
  if (s) return lt_error("cublasLtMatmul", s);
  return bias != nullptr && !epilogue_bias ? bias_kernel(stream, t, d, bias, m, n) : ffi::Error::Success();
}

ffi::Error Gemm(cudaStream_t stream, ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::AnyBuffer bias, ffi::AnyBuffer c,
                ffi::Result<ffi::AnyBuffer> d, ffi::Result<ffi::AnyBuffer> workspace, bool trans_a, bool trans_b) {
  GemmShape g;
  if (ffi::Error e = check_gemm(kOp, a, b, bias, c, *d, trans_a, trans_b, g); e.failure()) return e;
  if (g.m == 0 || g.n == 0) return ffi::Error::Success();
  const ffi::DataType t = a.element_type();
  const size_t item = t == ffi::DataType::F32 ? 4 : 2;
  if (g.k == 0) {  // d = c (+ bias), or bias, or zeros
    const cudaError_t filled =
        g.c ? cudaMemcpyAsync(d->untyped_data(), c.untyped_data(), item * g.m * g.n, cudaMemcpyDeviceToDevice, stream)
            : cudaMemsetAsync(d->untyped_data(), 0, item * g.m * g.n, stream);
    if (filled != cudaSuccess) return ffi::Error::Internal(std::string(kOp) + ": memset or copy failed");
    return g.bias ? bias_kernel(stream, t, d->untyped_data(), bias.untyped_data(), g.m, g.n) : ffi::Error::Success();
  }
  return run(stream, t, a.untyped_data(), b.untyped_data(), g.bias ? bias.untyped_data() : nullptr,
             g.c ? c.untyped_data() : nullptr, d->untyped_data(), workspace->untyped_data(), workspace->size_bytes(),
             g.m, g.n, g.k, trans_a, trans_b);
}

}  // namespace

GemmTuning gemm_tune(const std::string& dtype, int64_t m, int64_t n, int64_t k, bool trans_a, bool trans_b, bool bias,
                     bool c, int64_t workspace_bytes) {
  GemmTuning r;
  const ffi::DataType t = dtype == "float32" ? ffi::DataType::F32
                          : dtype == "bfloat16" ? ffi::DataType::BF16
                          : dtype == "float16"  ? ffi::DataType::F16
                                                : ffi::DataType::INVALID;
  int device = 0, devices = 0;
  if (t == ffi::DataType::INVALID || m <= 0 || n <= 0 || k <= 0 || !lt::api().ok ||
      cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0 || cudaGetDevice(&device) != cudaSuccess) {
    cudaGetLastError();
    return r;
  }
  lt::Status s = 0;
  lt::Handle handle = handle_for(device, &s);
  if (handle == nullptr) return r;
  // XLA's buffers, and the slices of them that reach the target, are 256-byte aligned.
  const Key key = make_key(device, t, m, n, k, trans_a, trans_b, bias, 256, 256, 256, c);
  lt::Heuristic choice{};
  if (choose(handle, key, t, static_cast<size_t>(workspace_bytes), nullptr, &choice, &r).failure()) return GemmTuning{};
  return r;
}

}  // namespace jaxsub

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxsubCuda_gemm, jaxsub::Gemm,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // a
                                  .Arg<ffi::AnyBuffer>()  // b
                                  .Arg<ffi::AnyBuffer>()  // bias [n] or [0]
                                  .Arg<ffi::AnyBuffer>()  // c [m, n] or [0]
                                  .Ret<ffi::AnyBuffer>()  // d
                                  .Ret<ffi::AnyBuffer>()  // workspace
                                  .Attr<bool>("trans_a")
                                  .Attr<bool>("trans_b"),
                              {ffi::Traits::kCmdBufferCompatible});
