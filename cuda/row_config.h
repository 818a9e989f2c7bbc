// The launch shape of the row-wise CUDA kernels (layer norm, BDRLN, GELU, softmax): which
// vector width, vectors per thread, threads per row and rows per block a [R, N] problem
// gets. Host-only and free of CUDA, so a plain C++ program can check every shape it can
// produce (tests/row_config_check.cc); the kernels themselves are in rows.cuh.
#pragma once

#include <algorithm>
#include <cstdint>

#include "common.h"

namespace jaxsub {

// Launch shape for one [R, N] problem.
struct RowConfig {
  int vec = 1;  // elements per vector access (16 bytes on the fast path, 1 on the general path)
  int nv = 1;   // vectors per thread per row
  int tx = 32;  // threads per row
  int ty = 1;   // rows per block
  bool ok = false;
};

// Vectors per thread the kernels are compiled for: fast path {1, 2, 4} with up to 512
// threads per row (16-bit N <= 16384, f32 N <= 8192); general path {4, 16} with up to 1024
// (N <= 16384). max_threads_for is also each kernel's __launch_bounds__, so a block never
// has more threads than that.
constexpr int kMaxBlockRows = 16;  // rows per block at most (512 threads / 32)
JAXSUB_HD constexpr int max_threads_for(int vec, int nv) { return vec == 1 && nv == 16 ? 1024 : 512; }

// Fast path when N is a multiple of the 16-byte vector and every pointer is 16-byte
// aligned; otherwise scalar accesses.
//
// `max_elems` caps the elements per thread and `block_threads` the threads per block;
// both are relaxed where a row needs it (a row longer than the thread limit at
// `max_elems` takes more elements; a row wider than `block_threads` gets a block to
// itself; a fast-path thread holds at least one vector). Callers pass their tuned
// defaults or a kernel configuration (ABI.md: `max_elems` 4, 8, 16, 32; `block_threads` a
// multiple of 32 in [32, 1024]).
//
// Fast path: one warp per row whenever the row fits in 32 threads with at most
// `max_elems` elements each (the fewest vectors that cover it: shuffle-only reductions,
// no barriers); a longer row takes the most vectors per thread within `max_elems` (fewest
// warps per row), relaxing to 4 vectors only when the row needs it. General path: the most
// elements per thread within `max_elems`, relaxed likewise.
inline RowConfig choose_rows(int64_t n, int itemsize, bool aligned, int max_elems, int block_threads) {
  RowConfig c;
  const int vmax = 16 / itemsize;
  c.vec = (aligned && n % vmax == 0 && n / vmax <= 4 * 512) ? vmax : 1;
  const int cap = std::max(max_elems, c.vec);
  const int64_t nvec = (n + c.vec - 1) / c.vec;
  auto threads = [&](int nv) { return ((nvec + nv - 1) / nv + 31) / 32 * 32; };
  auto pick = [&](int nv) {
    c.nv = nv, c.tx = static_cast<int>(threads(nv)), c.ok = true;
  };
  if (c.vec > 1) {
    for (int nv : {1, 2, 4})
      if (!c.ok && threads(nv) == 32 && nv * c.vec <= cap) pick(nv);
    for (int nv : {4, 2, 1})
      if (!c.ok && nv * c.vec <= cap && threads(nv) <= max_threads_for(c.vec, nv)) pick(nv);
    if (!c.ok && threads(4) <= max_threads_for(c.vec, 4)) pick(4);
  } else {
    for (int pass = 0; pass < 2 && !c.ok; ++pass)
      for (int nv : {16, 4})
        if (!c.ok && threads(nv) <= max_threads_for(c.vec, nv) && (pass == 1 || nv * c.vec <= cap)) pick(nv);
  }
  if (!c.ok) return c;
  // Rows per block, with the backward's partial-sum buffer (tx * ty * nv * vec floats)
  // kept within 32 KB so no kernel needs the shared-memory opt-in, and the block within
  // the kernel's launch bound. Row groups of more than one warp synchronize on named
  // barrier 1 + threadIdx.y, so then ty <= 15.
  c.ty = std::min({kMaxBlockRows, block_threads / c.tx, 8192 / (c.tx * c.nv * c.vec),
                   max_threads_for(c.vec, c.nv) / c.tx});
  c.ty = std::max(1, c.ty);
  if (c.tx > 32) c.ty = std::min(c.ty, 15);
  return c;
}

}  // namespace jaxsub
