// Every launch shape choose_rows (cuda/row_config.h) can produce is one the row kernels
// can run: for every kernel configuration the handlers accept (ABI.md: block_threads a
// multiple of 32 in [32, 1024], max_elems 4, 8, 16 or 32; the built-in defaults are among
// them), both element sizes, aligned or not, and every row length 1..16384. Host-only;
// built and run by test_row_config.py. Prints the first failures and exits 1 on any.
#include <cstdio>

#include "row_config.h"

namespace {

int failures = 0;

void fail(const char* what, int64_t n, int itemsize, bool aligned, int max_elems, int block_threads,
          const jaxsub::RowConfig& c) {
  if (++failures <= 20)
    std::printf("%s: n %lld itemsize %d aligned %d max_elems %d block_threads %d -> vec %d nv %d tx %d ty %d\n", what,
                static_cast<long long>(n), itemsize, aligned, max_elems, block_threads, c.vec, c.nv, c.tx, c.ty);
}

// The (VEC, NV) pairs dispatch_tile (rows.cuh) has kernels for.
bool has_kernel(const jaxsub::RowConfig& c, int vmax) {
  return (c.vec == vmax && (c.nv == 1 || c.nv == 2 || c.nv == 4)) || (c.vec == 1 && (c.nv == 4 || c.nv == 16));
}

}  // namespace

int main() {
  using jaxsub::max_threads_for;
  int64_t checked = 0;
  for (int itemsize : {2, 4}) {
    const int vmax = 16 / itemsize;
    for (bool aligned : {false, true}) {
      for (int max_elems : {4, 8, 16, 32}) {
        for (int block_threads = 32; block_threads <= 1024; block_threads += 32) {
          for (int64_t n = 1; n <= 16384; ++n, ++checked) {
            const jaxsub::RowConfig c = jaxsub::choose_rows(n, itemsize, aligned, max_elems, block_threads);
            auto check = [&](bool ok, const char* what) {
              if (!ok) fail(what, n, itemsize, aligned, max_elems, block_threads, c);
            };
            if (!c.ok) {
              check(false, "no configuration");
              continue;
            }
            check(has_kernel(c, vmax), "no kernel for (vec, nv)");
            check(c.vec == 1 || (aligned && n % c.vec == 0), "vector access on a row that is not vector-aligned");
            check(c.tx >= 32 && c.tx % 32 == 0, "threads per row not whole warps");
            check(static_cast<int64_t>(c.tx) * c.nv * c.vec >= n, "row not covered");
            check(c.nv * c.vec <= 32, "more than 32 elements per thread (keep bits)");
            check(c.ty >= 1 && c.ty <= jaxsub::kMaxBlockRows, "rows per block outside [1, kMaxBlockRows]");
            check(c.tx == 32 || c.ty <= 15, "more than 15 named barriers");
            check(c.tx * c.ty <= max_threads_for(c.vec, c.nv), "block above the kernel's launch bound");
            check(c.tx * c.ty <= (block_threads > c.tx ? block_threads : c.tx), "block above block_threads");
            check(c.ty == 1 || c.tx * c.ty * c.nv * c.vec <= 8192, "partial-sum buffer above 32 KB");
          }
        }
      }
    }
  }
  std::printf("%lld configurations checked, %d failures\n", static_cast<long long>(checked), failures);
  return failures == 0 ? 0 : 1;
}
