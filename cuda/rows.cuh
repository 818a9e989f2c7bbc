// The row-tile machinery shared by the row-wise CUDA kernels (layer norm, BDRLN, GELU).
//
// A tensor [R, N] is processed by blocks of (TX, TY) threads: each group of TX threads
// (fixed threadIdx.y) owns one row at a time; thread tx owns the same columns in every row
// it visits, namely NV vectors of VEC contiguous elements at columns (v * TX + tx) * VEC.
// Because a thread's columns never change, per-column parameters are loaded once and
// per-column gradient partial sums stay in registers across rows; they are reduced over
// the block in shared memory, written as one row of a workspace per block, and summed
// over blocks by `column_sum_kernel` (deterministic: no atomics). Launch shapes: row_config.h.
#pragma once

#include <algorithm>
#include <cstdlib>

#include "common.h"
#include "pdl.cuh"
#include "philox.h"
#include "row_config.h"

namespace jaxsub {

inline int sm_count() {
  static int cached = 0;
  if (cached == 0) {
    int dev = 0, n = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev);
    cached = n > 0 ? n : 132;
  }
  return cached;
}

// Number of blocks for a kernel that accumulates column partials: exactly the blocks that
// are resident at once (one wave, each block walking many rows), never more than the
// workspace rows or the row groups.
template <typename Kernel>
inline int partial_blocks(Kernel kernel, int64_t rows, const RowConfig& c, size_t smem, int64_t workspace_rows) {
  int per_sm = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, c.tx * c.ty, smem) != cudaSuccess || per_sm < 1)
    per_sm = 1;
  const int64_t groups = (rows + c.ty - 1) / c.ty;
  return static_cast<int>(
      std::max<int64_t>(1, std::min<int64_t>({groups, workspace_rows, static_cast<int64_t>(per_sm) * sm_count()})));
}

// Iterations ahead that the streaming row kernels (the GELU forward, softmax_dropout's
// forward and backward) ask L2 for the rows they will read (JAXSUB_L2_PREFETCH, read once;
// default 1, 0 for none): while a row group works on one row, its next row is already on
// its way from DRAM, so the memory stream has no gap while the group computes. Bulk
// prefetch by the group's first thread (prefetch_row_l2). GELU forward [4096, 4096] bf16
// 27.8 -> 26.7 us, [12288, 4096] 76.3 -> 72.0; softmax_dropout [8, 16, 512, 512] bf16
// forward 52.4 -> 50.9, backward 63.4 -> 59.7 (its grid then one wave of blocks walking
// rows, where it was a block per row group). The same prefetch in the GELU backward and
// the norm kernels measured equal or slower (bench/NOTES.md, forty-sixth session). The
// GELU forward's 16-byte paths of up to two vectors now load their next row into
// registers instead (gelu.cu's kAhead), and use this only with JAXSUB_GELU_AHEAD=0.
inline int l2_ahead() {
  static const int ahead = [] {
    const char* v = std::getenv("JAXSUB_L2_PREFETCH");
    return v == nullptr ? 1 : std::atoi(v);
  }();
  return ahead;
}

// An A/B switch of a kernel variant: the environment variable as an integer (0 off), or
// `otherwise` where it is unset. Callers read it once, into a function-local static.
inline bool env_flag(const char* name, bool otherwise) {
  const char* v = std::getenv(name);
  return v == nullptr ? otherwise : std::atoi(v) != 0;
}

inline int row_blocks(int64_t rows, const RowConfig& c) {
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>((rows + c.ty - 1) / c.ty, 1 << 24)));
}

// ---------------------------------------------------------------------------------------
// Device side.

// Loads/stores of VEC elements in 16-byte pieces (VEC * sizeof(T) may exceed 16 when a
// float parameter sits beside 16-bit activations).
template <typename T, int VEC>
__device__ __forceinline__ void load_elems(const T* p, float (&out)[VEC]) {
  constexpr int kPiece = (VEC * sizeof(T) > 16) ? 16 / sizeof(T) : VEC;
#pragma unroll
  for (int i = 0; i < VEC; i += kPiece) {
    float part[kPiece];
    load_vec<T, kPiece>(p + i, part);
#pragma unroll
    for (int j = 0; j < kPiece; ++j) out[i + j] = part[j];
  }
}

template <typename T, int VEC>
__device__ __forceinline__ void store_elems(T* p, const float (&in)[VEC]) {
  constexpr int kPiece = (VEC * sizeof(T) > 16) ? 16 / sizeof(T) : VEC;
#pragma unroll
  for (int i = 0; i < VEC; i += kPiece) {
    float part[kPiece];
#pragma unroll
    for (int j = 0; j < kPiece; ++j) part[j] = in[i + j];
    store_vec<T, kPiece>(p + i, part);
  }
}

// One bulk prefetch into L2 of row r of a [R, n] array of T (sm_90; elsewhere nothing),
// issued by the row group's first thread. Fast path only (16-byte vectors: the row is
// 16-byte aligned and a multiple of 16 bytes long, as the instruction needs); the caller
// checks r < R. A hint: it changes no value.
template <typename T, int VEC>
__device__ __forceinline__ void prefetch_row_l2(const void* base, int64_t r, int64_t n) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if constexpr (VEC * sizeof(T) == 16) {
    if (base != nullptr && threadIdx.x == 0) {
      const T* row = static_cast<const T*>(base) + r * n;
      asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(row), "r"(static_cast<uint32_t>(n * sizeof(T))));
    }
  }
#endif
}

template <int VEC, int NV>
struct Tile {
  float v[NV][VEC];
};

__device__ __forceinline__ int64_t tile_col(int v, int vec) {
  return (static_cast<int64_t>(v) * blockDim.x + threadIdx.x) * vec;
}

// Loads the thread's columns of one row (zeros outside [0, n)).
template <typename T, int VEC, int NV>
__device__ __forceinline__ void load_tile(const T* row, int64_t n, bool valid, Tile<VEC, NV>& t) {
#pragma unroll
  for (int v = 0; v < NV; ++v) {
    const int64_t c = tile_col(v, VEC);
    if (valid && c < n) {
      load_elems<T, VEC>(row + c, t.v[v]);
    } else {
#pragma unroll
      for (int e = 0; e < VEC; ++e) t.v[v][e] = 0.f;
    }
  }
}

// A thread's columns of one row as loaded, still in T (4 registers per 16 bytes): the BDRLN
// backward keeps the next row's copy in flight while it works on the current one. A
// 16-byte vector is held as four 32-bit words. Held as eight 16-bit elements, a load
// that may be skipped (zeros past the row's end) made ptxas merge and move every half
// with a permute: 65 PRMTs in the BDRLN backward's 559-instruction loop (bench/NOTES.md).
template <typename T, int VEC>
using RawVec = std::conditional_t<sizeof(T) * VEC == 16, uint4, Vec<T, VEC>>;

template <typename T, int VEC, int NV>
struct RawTile {
  RawVec<T, VEC> v[NV];
};

template <typename T, int VEC, int NV>
__device__ __forceinline__ void load_raw(const T* row, int64_t n, bool valid, RawTile<T, VEC, NV>& t) {
#pragma unroll
  for (int v = 0; v < NV; ++v) {
    const int64_t c = tile_col(v, VEC);
    t.v[v] = RawVec<T, VEC>{};
    if (valid && c < n) t.v[v] = *reinterpret_cast<const RawVec<T, VEC>*>(row + c);
  }
}

template <typename T, int VEC>
__device__ __forceinline__ void raw_floats(const RawVec<T, VEC>& raw, float (&out)[VEC]) {
  Vec<T, VEC> x;
  memcpy(&x, &raw, sizeof(x));  // a reinterpretation of registers, no instruction
  to_floats<T, VEC>(x, out);
}

template <typename T, int VEC, int NV>
__device__ __forceinline__ void unpack(const RawTile<T, VEC, NV>& raw, Tile<VEC, NV>& t) {
#pragma unroll
  for (int v = 0; v < NV; ++v) raw_floats<T, VEC>(raw.v[v], t.v[v]);
}

// Per-column parameters are either T or float32 (decided at run time: they are loaded
// once per thread, so the branch costs nothing and halves the kernel instantiations).
template <typename T, int VEC, int NV>
__device__ __forceinline__ void load_param(const void* p, bool f32, int64_t n, Tile<VEC, NV>& t) {
  if (f32) {
    load_tile<float, VEC, NV>(static_cast<const float*>(p), n, true, t);
  } else {
    load_tile<T, VEC, NV>(static_cast<const T*>(p), n, true, t);
  }
}

template <typename T, int VEC, int NV>
__device__ __forceinline__ void store_tile(T* row, int64_t n, bool valid, const Tile<VEC, NV>& t) {
  if (!valid) return;
#pragma unroll
  for (int v = 0; v < NV; ++v) {
    const int64_t c = tile_col(v, VEC);
    if (c < n) store_elems<T, VEC>(row + c, t.v[v]);
  }
}

// The Philox words of a thread's vectors in row r (VEC a multiple of 8: a call per 8
// elements, word set v * VEC / 8 + e / 8 for elements e.. of vector v), every call side by
// side with one key schedule (philox4x32_10_n). Where threshold is 0 the words stay
// counters: lane_kept with thr_hi 0 keeps every lane.
template <int VEC, int NV>
__device__ __forceinline__ void tile_words(const Seed& seed, uint32_t threshold, int64_t r, int64_t n,
                                           U32x4 (&w)[NV * VEC / 8]) {
  static_assert(VEC % 8 == 0, "one Philox call per 8 elements");
#pragma unroll
  for (int v = 0; v < NV; ++v)
#pragma unroll
    for (int e = 0; e < VEC; e += 8) {
      const uint64_t q = (static_cast<uint64_t>(r) * n + tile_col(v, VEC) + e) >> 3;
      w[(v * VEC + e) / 8] = counter(seed, q);
    }
  if (threshold != 0) philox4x32_10_n<NV * VEC / 8>(w, seed.k0, seed.k1);
}

// Keep bits for the thread's elements of row r (bit v * VEC + e). On the fast path every
// vector's first index is a multiple of VEC (N is), so a vector of 8 takes one Philox call
// and a vector of 4 takes half of one; the general path takes one call per element.
// Vectors past the row's end get bits too, which no caller uses (their values are zeros
// or never stored): skipping them made the loop body divergent, and ptxas then kept the
// Philox key schedule in vector registers instead of uniform ones (bench/NOTES.md,
// thirty-sixth session).
template <int VEC, int NV>
__device__ __forceinline__ uint32_t keep_bits(const Seed& seed, uint32_t threshold, int64_t r, int64_t n) {
  static_assert(VEC * NV <= 32, "keep bits must fit in 32 bits");
  if (threshold == 0) return 0xffffffffu;
  const uint32_t thr_hi = threshold << 16;
  uint32_t bits = 0;
  if constexpr (VEC % 8 == 0) {
    U32x4 w[NV * VEC / 8];
    tile_words<VEC, NV>(seed, threshold, r, n, w);
#pragma unroll
    for (int c = 0; c < NV * VEC / 8; ++c)
#pragma unroll
      for (int j = 0; j < 8; ++j) bits |= static_cast<uint32_t>(lane_kept(w[c], j, thr_hi)) << (8 * c + j);
  } else {
#pragma unroll
    for (int v = 0; v < NV; ++v) {
      const uint64_t base = static_cast<uint64_t>(r) * n + tile_col(v, VEC);
      if constexpr (VEC == 4) {
        const U32x4 w = dropout_words(seed, base >> 3);
        const int off = static_cast<int>(base & 7);  // 0 or 4
#pragma unroll
        for (int j = 0; j < 4; ++j) bits |= static_cast<uint32_t>(lane_kept(w, off + j, thr_hi)) << (v * VEC + j);
      } else {
#pragma unroll
        for (int e = 0; e < VEC; ++e)
          bits |= static_cast<uint32_t>(dropout_keep(seed, base + e, threshold)) << (v * VEC + e);
      }
    }
  }
  return bits;
}

// The dropout multipliers (keep_scale or 0) of the VEC elements at logical indices base ..
// base + VEC - 1 (base a multiple of VEC on the fast path), for kernels that use each
// decision once, right away: one compare and a select per element, no bit packing.
template <int VEC>
__device__ __forceinline__ void keep_scales(const Seed& seed, uint32_t threshold, float keep_scale, uint64_t base,
                                            float (&m)[VEC]) {
  if (threshold == 0) {
#pragma unroll
    for (int e = 0; e < VEC; ++e) m[e] = keep_scale;
    return;
  }
  const uint32_t thr_hi = threshold << 16;
  if constexpr (VEC % 8 == 0) {
#pragma unroll
    for (int e = 0; e < VEC; e += 8) {
      const U32x4 w = dropout_words(seed, (base + e) >> 3);
#pragma unroll
      for (int j = 0; j < 8; ++j) m[e + j] = lane_kept(w, j, thr_hi) ? keep_scale : 0.f;
    }
  } else if constexpr (VEC == 4) {
    const U32x4 w = dropout_words(seed, base >> 3);
    const bool upper = (base & 7) != 0;  // lanes 4..7
    const U32x4 half{upper ? w.z : w.x, upper ? w.w : w.y, 0u, 0u};
#pragma unroll
    for (int j = 0; j < 4; ++j) m[j] = lane_kept(half, j, thr_hi) ? keep_scale : 0.f;
  } else {
#pragma unroll
    for (int e = 0; e < VEC; ++e) m[e] = dropout_keep(seed, base + e, threshold) ? keep_scale : 0.f;
  }
}

__device__ __forceinline__ bool bit(uint32_t bits, int i) { return (bits >> i) & 1u; }

// Sums K tiles of per-thread column partials over the block's rows (threadIdx.y) and
// writes them as workspace[blockIdx.x, k, :]. `smem` holds blockDim.y * blockDim.x * NV*VEC floats.
template <int K, int VEC, int NV>
__device__ __forceinline__ void write_partials(const Tile<VEC, NV> (&acc)[K], float* smem, float* workspace,
                                               int64_t n) {
  constexpr int E = VEC * NV;
  const int tx = threadIdx.x, ty = threadIdx.y, TX = blockDim.x, TY = blockDim.y;
#pragma unroll
  for (int k = 0; k < K; ++k) {
    if (TY > 1) {
      __syncthreads();
#pragma unroll
      for (int v = 0; v < NV; ++v)
#pragma unroll
        for (int e = 0; e < VEC; ++e) smem[(ty * E + v * VEC + e) * TX + tx] = acc[k].v[v][e];
      __syncthreads();
    }
    if (ty == 0) {
      float* out = workspace + (static_cast<int64_t>(blockIdx.x) * K + k) * n;
#pragma unroll
      for (int v = 0; v < NV; ++v) {
        const int64_t c = tile_col(v, VEC);
        if (c >= n) continue;
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          float s = acc[k].v[v][e];
          for (int y = 1; y < TY; ++y) s += smem[(y * E + v * VEC + e) * TX + tx];
          out[c + e] = s;
        }
      }
    }
  }
}

// out_k[c] = sum over g < groups of workspace[g, k, c], k < K, stored as T or float32;
// block (32, 32), grid (ceil(n/32), K). A few loads per thread, all independent, so the
// kernel costs about one memory latency, not `groups` of them.
template <typename T>
__global__ void column_sum_kernel(const float* __restrict__ workspace, int groups, int K, int64_t n, bool f32,
                                  void* out0, void* out1, void* out2) {
  wait_for_previous_grid();  // the partials (launched dependent: pdl.cuh)
  __shared__ float part[32][33];
  const int k = blockIdx.y;
  const int64_t c = static_cast<int64_t>(blockIdx.x) * 32 + threadIdx.x;
  float s = 0.f;
  if (c < n) {
#pragma unroll 4
    for (int g = threadIdx.y; g < groups; g += 32) s += workspace[(static_cast<int64_t>(g) * K + k) * n + c];
  }
  part[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && c < n) {
    float t = 0.f;
#pragma unroll
    for (int y = 0; y < 32; ++y) t += part[y][threadIdx.x];
    void* out = k == 0 ? out0 : k == 1 ? out1 : out2;
    if (f32) {
      static_cast<float*>(out)[c] = t;
    } else {
      static_cast<T*>(out)[c] = from_float_dev<T>(t);
    }
  }
}

// Launched dependent on the kernel before it, which wrote the partials (pdl.cuh).
template <typename T>
inline void launch_column_sum(const float* workspace, int groups, int K, int64_t n, bool f32, void* const* outs,
                              cudaStream_t stream) {
  dim3 grid(static_cast<unsigned>((n + 31) / 32), K);
  launch_dependent(column_sum_kernel<T>, grid, dim3(32, 32), 0, stream, workspace, groups, K, n, f32, outs[0],
                   outs[1], outs[2]);
}

// Checks the launch just made and names the kernel and its shape on failure.
inline ffi::Error launch_check(const char* op, const char* kernel, const RowConfig& c, int blocks, size_t smem) {
  const cudaError_t e = cudaGetLastError();
  if (e == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string(op) + ": launching " + kernel + " (vec " + std::to_string(c.vec) + ", nv " +
                              std::to_string(c.nv) + ", block " + std::to_string(c.tx) + "x" + std::to_string(c.ty) +
                              ", grid " + std::to_string(blocks) + ", smem " + std::to_string(smem) +
                              "): " + cudaGetErrorString(e));
}

template <int V>
using IntC = std::integral_constant<int, V>;

// Calls f(IntC<VEC>, IntC<NV>) for the configuration chosen at run time.
template <int VMAX, typename F>
inline bool dispatch_tile(const RowConfig& c, F&& f) {
  if (c.vec == VMAX && c.nv == 1) return f(IntC<VMAX>{}, IntC<1>{}), true;
  if (c.vec == VMAX && c.nv == 2) return f(IntC<VMAX>{}, IntC<2>{}), true;
  if (c.vec == VMAX && c.nv == 4) return f(IntC<VMAX>{}, IntC<4>{}), true;
  if (c.vec == 1 && c.nv == 4) return f(IntC<1>{}, IntC<4>{}), true;
  if (c.vec == 1 && c.nv == 16) return f(IntC<1>{}, IntC<16>{}), true;
  return false;
}

}  // namespace jaxsub
