// Hopper warpgroup tensor-core building blocks (sm_90a only; used by attention.cu):
// shared-memory matrix descriptors for 128-byte-swizzled tiles, wgmma.mma_async with the
// A operand in registers and B in shared memory, and the fence / commit / wait that order
// them. Everything here compiles to nothing useful unless the target is sm_90a
// (__CUDA_ARCH_FEAT_SM90_ALL); callers guard their kernels with JAXSUB_WGMMA.
//
// Tile layout (one "panel"): 64 rows of 128 bytes (64 16-bit elements), 1024-byte aligned;
// the 16-byte piece c of row r is stored at piece position c ^ (r % 8), the hardware's
// 128-byte swizzle. A [64][128] tile is two panels, 8192 bytes apart. The same tile serves
// as a K-major B operand (rows = n, the product's reduction dim along the row: Kᵀ of
// Q Kᵀ) and as an MN-major B operand (rows = the reduction dim, n along the row: V of P V).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define JAXSUB_WGMMA 1
#endif

namespace jaxsub {

constexpr int kPanelBytes = 64 * 128;

// Byte offset of element (r, c) (16-bit elements) in a swizzled tile of 64-wide panels.
__host__ __device__ constexpr int swz_offset(int r, int c) {
  return (c / 64) * kPanelBytes + r * 128 + ((((c % 64) / 8) ^ (r % 8)) * 16) + (c % 8) * 2;
}

// The descriptor of a 128-byte-swizzled operand at shared address `addr` (bytes): SBO is
// the distance between 8-row groups (1024 here), LBO the distance between 64-element
// panels along a row of an MN-major operand (K-major swizzled operands ignore it).
__device__ __forceinline__ uint64_t wgmma_desc(uint32_t addr, uint32_t lbo = kPanelBytes, uint32_t sbo = 1024) {
  uint64_t d = 0;
  d |= static_cast<uint64_t>((addr >> 4) & 0x3fff);
  d |= static_cast<uint64_t>((lbo >> 4) & 0x3fff) << 16;
  d |= static_cast<uint64_t>((sbo >> 4) & 0x3fff) << 32;
  d |= static_cast<uint64_t>(1) << 62;  // 128-byte swizzle
  return d;
}

__device__ __forceinline__ void wgmma_fence() {
#ifdef JAXSUB_WGMMA
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wgmma_commit() {
#ifdef JAXSUB_WGMMA
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
#ifdef JAXSUB_WGMMA
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#endif
}
// Makes this thread's shared-memory writes (st.shared, cp.async) visible to the async
// proxy that wgmma reads operands through; call before the barrier that publishes them.
__device__ __forceinline__ void fence_proxy_async() {
#ifdef JAXSUB_WGMMA
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}
// Keeps the compiler from moving accesses of an accumulator register across the
// asynchronous product that writes it.
__device__ __forceinline__ void reg_fence(float& x) { asm volatile("" : "+f"(x)::"memory"); }

// Thread block clusters (sm_90): this block's rank in its cluster and the cluster's size,
// a barrier over every thread of the cluster (release / acquire: shared-memory writes
// before it are visible to the cluster's loads after it), and a 16-byte load from the
// shared memory of block `rank` at the offset of the local shared address `addr`.
__device__ __forceinline__ void cluster_rank_size(uint32_t& rank, uint32_t& size) {
  rank = 0, size = 1;
#ifdef JAXSUB_WGMMA
  asm volatile("mov.u32 %0, %%cluster_ctarank;\nmov.u32 %1, %%cluster_nctarank;\n" : "=r"(rank), "=r"(size));
#endif
}
__device__ __forceinline__ void cluster_sync() {
#ifdef JAXSUB_WGMMA
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ float4 cluster_load4(uint32_t addr, uint32_t rank) {
  float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
#ifdef JAXSUB_WGMMA
  uint32_t remote = 0;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(addr), "r"(rank));
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];\n"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "r"(remote)
               : "memory");
#endif
  return v;
}

#define JAXSUB_WG_D8(i) "+f"(d[i + 0]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), \
    "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])
#define JAXSUB_WG_D32 JAXSUB_WG_D8(0), JAXSUB_WG_D8(8), JAXSUB_WG_D8(16), JAXSUB_WG_D8(24)
#define JAXSUB_WG_D64 JAXSUB_WG_D32, JAXSUB_WG_D8(32), JAXSUB_WG_D8(40), JAXSUB_WG_D8(48), JAXSUB_WG_D8(56)
#define JAXSUB_WG_R32                                                                                    \
  "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26," \
  "%27,%28,%29,%30,%31}"
#define JAXSUB_WG_R64                                                                                     \
  "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,"  \
  "%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51," \
  "%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}"
// One wgmma m64n{N}k16, f32 accumulators, element type TY ("bf16" / "f16"); REGS lists the
// accumulators and DOPS binds them; the other operands follow them, numbered from the
// strings given. RS: A in four registers, then B's descriptor, the accumulate flag and
// B's transpose flag. SS: A's descriptor, B's, the accumulate flag, A's and B's transpose flags.
#define JAXSUB_WG_RS(N, TY, REGS, DOPS, A, DB, ACC, TB)                                                   \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " ACC ", 0;\nwgmma.mma_async.sync.aligned.m64n" #N       \
               "k16.f32." TY "." TY " " REGS ", " A ", " DB ", p, 1, 1, " TB ";\n}\n"                     \
               : DOPS                                                                                     \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(acc), "n"(kTransB ? 1 : 0))
#define JAXSUB_WG_SS(N, TY, REGS, DOPS, DA, DB, ACC, TA, TB)                                              \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " ACC ", 0;\nwgmma.mma_async.sync.aligned.m64n" #N       \
               "k16.f32." TY "." TY " " REGS ", " DA ", " DB ", p, 1, 1, " TA ", " TB ";\n}\n"            \
               : DOPS                                                                                     \
               : "l"(da), "l"(db), "r"(acc), "n"(kTransA ? 1 : 0), "n"(kTransB ? 1 : 0))

// d[64 x N] (+)= a[64 x 16] · b[16 x N]: a in registers (the warp's 16 rows as an
// mma.sync m16n8k16 A fragment), b through descriptor `db`; kTransB: b is MN-major.
// Accumulator layout per warp: d[4 j + e] is row (lane / 4) + 8 (e / 2), column
// 8 j + 2 (lane % 4) + e % 2 — the m16n8 C fragments of the N / 8 column blocks.
template <typename T, int N, bool kTransB>
__device__ __forceinline__ void wgmma_rs(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t db, bool accumulate) {
  static_assert(N == 64 || N == 128, "wgmma_rs: N is 64 or 128");
#ifdef JAXSUB_WGMMA
  const int acc = accumulate ? 1 : 0;
  constexpr bool bf16 = std::is_same_v<T, __nv_bfloat16>;
  if constexpr (N == 64 && bf16) {
    JAXSUB_WG_RS(64, "bf16", JAXSUB_WG_R32, JAXSUB_WG_D32, "{%32,%33,%34,%35}", "%36", "%37", "%38");
  } else if constexpr (N == 64) {
    JAXSUB_WG_RS(64, "f16", JAXSUB_WG_R32, JAXSUB_WG_D32, "{%32,%33,%34,%35}", "%36", "%37", "%38");
  } else if constexpr (bf16) {
    JAXSUB_WG_RS(128, "bf16", JAXSUB_WG_R64, JAXSUB_WG_D64, "{%64,%65,%66,%67}", "%68", "%69", "%70");
  } else {
    JAXSUB_WG_RS(128, "f16", JAXSUB_WG_R64, JAXSUB_WG_D64, "{%64,%65,%66,%67}", "%68", "%69", "%70");
  }
#endif
}

// The same with a through descriptor `da` too; kTransA: a is MN-major (M along the rows
// of its tile).
template <typename T, int N, bool kTransA, bool kTransB>
__device__ __forceinline__ void wgmma_ss(float (&d)[N / 2], uint64_t da, uint64_t db, bool accumulate) {
  static_assert(N == 64 || N == 128, "wgmma_ss: N is 64 or 128");
#ifdef JAXSUB_WGMMA
  const int acc = accumulate ? 1 : 0;
  constexpr bool bf16 = std::is_same_v<T, __nv_bfloat16>;
  if constexpr (N == 64 && bf16) {
    JAXSUB_WG_SS(64, "bf16", JAXSUB_WG_R32, JAXSUB_WG_D32, "%32", "%33", "%34", "%35", "%36");
  } else if constexpr (N == 64) {
    JAXSUB_WG_SS(64, "f16", JAXSUB_WG_R32, JAXSUB_WG_D32, "%32", "%33", "%34", "%35", "%36");
  } else if constexpr (bf16) {
    JAXSUB_WG_SS(128, "bf16", JAXSUB_WG_R64, JAXSUB_WG_D64, "%64", "%65", "%66", "%67", "%68");
  } else {
    JAXSUB_WG_SS(128, "f16", JAXSUB_WG_R64, JAXSUB_WG_D64, "%64", "%65", "%66", "%67", "%68");
  }
#endif
}
#undef JAXSUB_WG_D8
#undef JAXSUB_WG_D32
#undef JAXSUB_WG_D64
#undef JAXSUB_WG_R32
#undef JAXSUB_WG_R64
#undef JAXSUB_WG_RS
#undef JAXSUB_WG_SS

}  // namespace jaxsub
