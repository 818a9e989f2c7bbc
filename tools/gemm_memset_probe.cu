// Which cuBLASLt candidates put a Memset node before their GEMM, and what each costs in a
// CUDA graph (after a dependent kernel, as in XLA's command buffers) against on a plain
// stream; then, for the products whose candidates all have the memset, one GEMM against two
// of m / 2 rows (outputs below the memset's size), as plain nodes and as child graphs (how
// a command buffer holds a traced custom call). bf16, BERT-large layer shapes at 4096
// tokens, the operand order of cuda/gemm.cu. Without JAX; cuBLASLt is loaded by path.
// bench/NOTES.md, twenty-ninth session. On a GPU machine:
//   nvcc -O2 -gencode=arch=compute_90,code=sm_90 -o /tmp/probe tools/gemm_memset_probe.cu -ldl
//   /tmp/probe <path of libcublasLt.so.13 (pip's nvidia/cu13/lib)> [1|2|3]   # the part to run (default 1)
#include <dlfcn.h>
#include <library_types.h>
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cstdio>
#include <cstdint>
#include <vector>
#include <algorithm>

using Status = int;
struct Ctx; using Handle = Ctx*;
struct DescO { uint64_t d[32]; }; struct LayO { uint64_t d[14]; }; struct PrefO { uint64_t d[12]; };
using Desc = DescO*; using Lay = LayO*; using Pref = PrefO*;
struct Algo { uint64_t d[8]; };
struct Heur { Algo algo; size_t ws; Status state; float waves; int r[4]; };
Status (*create)(Handle*); Status (*desc_create)(Desc*, int, cudaDataType_t);
Status (*desc_set)(Desc, int, const void*, size_t);
Status (*lay_create)(Lay*, cudaDataType_t, uint64_t, uint64_t, int64_t);
Status (*pref_create)(Pref*); Status (*pref_set)(Pref, int, const void*, size_t);
Status (*heur)(Handle, Desc, Lay, Lay, Lay, Lay, Pref, int, Heur*, int*);
Status (*mm)(Handle, Desc, const void*, const void*, Lay, const void*, Lay, const void*, const void*, Lay, void*, Lay,
             const Algo*, void*, size_t, cudaStream_t);
Status (*cfg_get)(const Algo*, int, void*, size_t, size_t*);
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { printf("CUDA %s at %d\n", cudaGetErrorString(e_), __LINE__); return 1; } } while (0)

__global__ void fill(__nv_bfloat16* p, int64_t n, uint32_t salt) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    uint32_t h = (uint32_t)i * 0x9E3779B1u ^ salt; h ^= h >> 16; h *= 0x7FEB352Du; h ^= h >> 15;
    p[i] = __float2bfloat16((h >> 8) * (2.0f / 16777216.0f) - 1.0f);
  }
}
// a memory-bound kernel standing for the jaxsub kernel before the GEMM (8 MB copy)
__global__ void dep(const float4* a, float4* b, int64_t n) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) b[i] = a[i];
}
__global__ void zero4(int* p) { *p = 0; }

struct Shape { const char* name; int64_t m, n, k; bool ta, tb; };

int main(int argc, char** argv) {
  void* lib = dlopen(argc > 1 ? argv[1] : "libcublasLt.so.13", RTLD_NOW);
  if (!lib) { printf("no cublasLt: %s\n", dlerror()); return 1; }
#define R(f, s) f = (decltype(f))dlsym(lib, s); if (!f) { printf("missing %s\n", s); return 1; }
  R(create, "cublasLtCreate") R(desc_create, "cublasLtMatmulDescCreate") R(desc_set, "cublasLtMatmulDescSetAttribute")
  R(lay_create, "cublasLtMatrixLayoutCreate") R(pref_create, "cublasLtMatmulPreferenceCreate")
  R(pref_set, "cublasLtMatmulPreferenceSetAttribute") R(heur, "cublasLtMatmulAlgoGetHeuristic")
  R(mm, "cublasLtMatmul") R(cfg_get, "cublasLtMatmulAlgoConfigGetAttribute")
  Handle h; if (create(&h)) { printf("create failed\n"); return 1; }
  const Shape shapes[] = {
      {"qkv fwd   4096x3072x1024", 4096, 3072, 1024, false, false},
      {"ff1 fwd   4096x4096x1024", 4096, 4096, 1024, false, false},
      {"ff2 fwd   4096x1024x4096", 4096, 1024, 4096, false, false},
      {"ff2 dx    4096x4096x1024 tb", 4096, 4096, 1024, false, true},
      {"ff1 dw    1024x4096x4096 ta", 1024, 4096, 4096, true, false},
      {"qkv dw    1024x3072x4096 ta", 1024, 3072, 4096, true, false},
      {"qkv dx    4096x1024x3072 tb", 4096, 1024, 3072, false, true},
      {"out fwd   4096x1024x1024", 4096, 1024, 1024, false, false},
  };
  const size_t WS = 32 << 20;
  __nv_bfloat16 *A, *B, *D; void* ws; float4 *s0, *s1; int* flag;
  CK(cudaMalloc(&A, 2ull * 4096 * 4096)); CK(cudaMalloc(&B, 2ull * 4096 * 4096)); CK(cudaMalloc(&D, 2ull * 4096 * 4096));
  CK(cudaMalloc(&ws, WS)); CK(cudaMalloc(&s0, 8 << 20)); CK(cudaMalloc(&s1, 8 << 20)); CK(cudaMalloc(&flag, 4));
  fill<<<1024, 256>>>(A, 4096ll * 4096, 1); fill<<<1024, 256>>>(B, 4096ll * 4096, 2);
  CK(cudaDeviceSynchronize());
  cudaStream_t st; CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  cudaEvent_t e0, e1; CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
  const int NDEP = (8 << 20) / 16;
  auto time_graph = [&](auto body, int reps) -> float {  // µs per rep of body, in one graph, min of 7
    cudaGraph_t g; cudaGraphExec_t ge;
    cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal);
    for (int r = 0; r < reps; ++r) body();
    if (cudaStreamEndCapture(st, &g) != cudaSuccess) return -1.f;
    if (cudaGraphInstantiate(&ge, g, 0) != cudaSuccess) return -2.f;
    float best = 1e30f;
    for (int i = 0; i < 8; ++i) {
      cudaEventRecord(e0, st); cudaGraphLaunch(ge, st); cudaEventRecord(e1, st); cudaEventSynchronize(e1);
      float ms; cudaEventElapsedTime(&ms, e0, e1); if (i) best = std::min(best, ms);
    }
    cudaGraphExecDestroy(ge); cudaGraphDestroy(g);
    return best * 1e3f / reps;
  };
  auto time_stream = [&](auto body, int reps) -> float {
    float best = 1e30f;
    for (int i = 0; i < 8; ++i) {
      cudaEventRecord(e0, st); for (int r = 0; r < reps; ++r) body(); cudaEventRecord(e1, st); cudaEventSynchronize(e1);
      float ms; cudaEventElapsedTime(&ms, e0, e1); if (i) best = std::min(best, ms);
    }
    return best * 1e3f / reps;
  };
  auto depk = [&] { dep<<<528, 256, 0, st>>>(s0, s1, NDEP); };
  float t_dep_g = time_graph(depk, 20), t_dep_s = time_stream(depk, 20);
  float t_ms_g = time_graph([&] { depk(); cudaMemsetAsync(flag, 0, 4, st); }, 20);
  float t_zk_g = time_graph([&] { depk(); zero4<<<1, 1, 0, st>>>(flag); }, 20);
  printf("dep kernel alone: graph %.2f stream %.2f us; +memset node %.2f; +zero kernel %.2f\n", t_dep_g, t_dep_s,
         t_ms_g, t_zk_g);
  const char part = argc > 2 ? argv[2][0] : '1';
  // Part 1 (and 3): each candidate of the heuristic for a workspace limit. Part 3 sweeps the
  // limit on the products whose candidates all have the memset at 32 MiB: a counter in the
  // workspace is what a memset of 4 bytes would zero, so a smaller limit may leave only
  // algorithms without it.
  const size_t limits3[] = {0, 4 << 10, 256 << 10, 1 << 20, 4 << 20, WS};
  const size_t* limits = part == '3' ? limits3 : limits3 + 5;
  const int nlimits = part == '3' ? 6 : 1;
  for (int li = 0; li < nlimits && part != '2'; ++li)
  for (const Shape& s : shapes) {
    if (part == '3' && s.m * s.n < 12000000) continue;
    const size_t lim = limits[li];
    Desc desc; desc_create(&desc, 68, CUDA_R_32F);
    int32_t opa = s.tb ? 1 : 0, opb = s.ta ? 1 : 0; uint32_t epi = 1;
    desc_set(desc, 3, &opa, 4); desc_set(desc, 4, &opb, 4); desc_set(desc, 7, &epi, 4);
    Lay la, lb, ld;
    lay_create(&la, CUDA_R_16BF, s.tb ? s.k : s.n, s.tb ? s.n : s.k, s.tb ? s.k : s.n);
    lay_create(&lb, CUDA_R_16BF, s.ta ? s.m : s.k, s.ta ? s.k : s.m, s.ta ? s.m : s.k);
    lay_create(&ld, CUDA_R_16BF, s.n, s.m, s.n);
    Pref pf; pref_create(&pf); uint64_t w = lim; pref_set(pf, 1, &w, 8);
    Heur c[64]; int found = 0;
    Status hs = heur(h, desc, la, lb, ld, ld, pf, 64, c, &found);
    printf("\n== %s, workspace limit %zu: %d candidates (status %d)\n", s.name, lim, found, hs);
    printf("  #  algo tile stages splitk red swz cust clus  ws_needed | nodes(k/memset/other) | stream us | graph us (gemm only, after dep)\n");
    const float alpha = 1.f, beta = 0.f;
    for (int i = 0; i < found; ++i) {
      void* wsp = lim ? ws : nullptr;
      auto gemm = [&] { mm(h, desc, &alpha, B, la, A, lb, &beta, D, ld, D, ld, &c[i].algo, wsp, lim, st); };
      if (mm(h, desc, &alpha, B, la, A, lb, &beta, D, ld, D, ld, &c[i].algo, wsp, lim, st)) { printf("  %2d failed\n", i); continue; }
      if (cudaStreamSynchronize(st) != cudaSuccess) { printf("  %2d error\n", i); cudaGetLastError(); continue; }
      int cfg[8] = {}; size_t wr;
      const int attrs[8] = {0, 1, 6, 2, 3, 4, 5, 8};  // ID TILE STAGES SPLITK RED SWIZZ CUSTOM CLUSTER
      for (int a = 0; a < 8; ++a) cfg_get(&c[i].algo, attrs[a], &cfg[a], a == 7 ? 2 : 4, &wr);
      cudaGraph_t g; size_t nn = 0; int nk = 0, nm = 0, no = 0;
      cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal); gemm(); cudaStreamEndCapture(st, &g);
      cudaGraphGetNodes(g, nullptr, &nn); std::vector<cudaGraphNode_t> nodes(nn); cudaGraphGetNodes(g, nodes.data(), &nn);
      for (auto n : nodes) { cudaGraphNodeType t; cudaGraphNodeGetType(n, &t);
        if (t == cudaGraphNodeTypeKernel) ++nk; else if (t == cudaGraphNodeTypeMemset) ++nm; else ++no; }
      cudaGraphDestroy(g);
      float ts = time_stream(gemm, 10);
      float tg = time_graph([&] { depk(); gemm(); }, 10) - t_dep_g;
      float tgs = time_stream([&] { depk(); gemm(); }, 10) - t_dep_s;
      printf("  %2d %4d %4d %5d %4d %3d %3d %4d %4d %10zu | %d/%d/%d | %7.1f | %7.1f (stream after dep %7.1f)\n", i, cfg[0], cfg[1],
             cfg[2], cfg[3], cfg[4], cfg[5], cfg[6], cfg[7], c[i].ws, nk, nm, no, ts, tg, tgs);
    }
  }

  if (part != '2') return 0;
  // Part 2: for the shapes with a memset, the heuristic's first candidate as one GEMM, as
  // two GEMMs of m/2 rows (outputs below the memset's size), and both as child graphs
  // (how a command buffer holds a traced custom call), each after the dependent kernel.
  printf("\n== part 2: one GEMM vs two of m/2 rows; plain nodes vs child graphs (graph us per GEMM call)\n");
  for (const Shape& s : shapes) {
    if (s.ta) continue;
    Desc desc; desc_create(&desc, 68, CUDA_R_32F);
    int32_t opa = s.tb ? 1 : 0, opb = 0; uint32_t epi = 1;
    desc_set(desc, 3, &opa, 4); desc_set(desc, 4, &opb, 4); desc_set(desc, 7, &epi, 4);
    Pref pf; pref_create(&pf); uint64_t w = WS; pref_set(pf, 1, &w, 8);
    Lay la, lb, ld, lb2, ld2;
    lay_create(&la, CUDA_R_16BF, s.tb ? s.k : s.n, s.tb ? s.n : s.k, s.tb ? s.k : s.n);
    lay_create(&lb, CUDA_R_16BF, s.k, s.m, s.k);
    lay_create(&ld, CUDA_R_16BF, s.n, s.m, s.n);
    lay_create(&lb2, CUDA_R_16BF, s.k, s.m / 2, s.k);
    lay_create(&ld2, CUDA_R_16BF, s.n, s.m / 2, s.n);
    Heur c1[1], c2[1]; int f1 = 0, f2 = 0;
    heur(h, desc, la, lb, ld, ld, pf, 1, c1, &f1);
    heur(h, desc, la, lb2, ld2, ld2, pf, 1, c2, &f2);
    if (!f1 || !f2) { printf("  %s: no algorithm\n", s.name); continue; }
    const float alpha = 1.f, beta = 0.f;
    auto one = [&] { mm(h, desc, &alpha, B, la, A, lb, &beta, D, ld, D, ld, &c1[0].algo, ws, WS, st); };
    auto two = [&] {
      mm(h, desc, &alpha, B, la, A, lb2, &beta, D, ld2, D, ld2, &c2[0].algo, ws, WS, st);
      mm(h, desc, &alpha, B, la, A + (s.m / 2) * s.k, lb2, &beta, D + (s.m / 2) * s.n, ld2, D + (s.m / 2) * s.n, ld2,
         &c2[0].algo, ws, WS, st);
    };
    auto count_memsets = [&](auto body) {
      cudaGraph_t g; size_t nn = 0; int nm = 0;
      cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal); body(); cudaStreamEndCapture(st, &g);
      cudaGraphGetNodes(g, nullptr, &nn); std::vector<cudaGraphNode_t> nodes(nn); cudaGraphGetNodes(g, nodes.data(), &nn);
      for (auto n : nodes) { cudaGraphNodeType t; cudaGraphNodeGetType(n, &t); nm += t == cudaGraphNodeTypeMemset; }
      cudaGraphDestroy(g); return nm;
    };
    // child-graph version: an outer graph of reps x [dep kernel node -> child graph node]
    auto child_time = [&](auto body, int reps) -> float {
      cudaGraph_t inner; cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal); body(); cudaStreamEndCapture(st, &inner);
      cudaGraph_t depg; cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal); depk(); cudaStreamEndCapture(st, &depg);
      cudaGraph_t outer; cudaGraphCreate(&outer, 0);
      cudaGraphNode_t prev = nullptr;
      for (int r = 0; r < reps; ++r) {
        cudaGraphNode_t a, b;
        cudaGraphAddChildGraphNode(&a, outer, prev ? &prev : nullptr, prev ? 1 : 0, depg);
        cudaGraphAddChildGraphNode(&b, outer, &a, 1, inner);
        prev = b;
      }
      cudaGraphExec_t ge; if (cudaGraphInstantiate(&ge, outer, 0) != cudaSuccess) return -1.f;
      float best = 1e30f;
      for (int i = 0; i < 8; ++i) {
        cudaEventRecord(e0, st); cudaGraphLaunch(ge, st); cudaEventRecord(e1, st); cudaEventSynchronize(e1);
        float ms; cudaEventElapsedTime(&ms, e0, e1); if (i) best = std::min(best, ms);
      }
      cudaGraphExecDestroy(ge); cudaGraphDestroy(outer); cudaGraphDestroy(inner); cudaGraphDestroy(depg);
      return best * 1e3f / reps;
    };
    one(); two(); cudaStreamSynchronize(st);
    float k1 = time_stream(one, 10), k2 = time_stream(two, 10);
    float g1 = time_graph([&] { depk(); one(); }, 10) - t_dep_g, g2 = time_graph([&] { depk(); two(); }, 10) - t_dep_g;
    float c1t = child_time(one, 10) - t_dep_g, c2t = child_time(two, 10) - t_dep_g;
    printf("  %s: memsets one %d two %d | stream one %.1f two %.1f | graph one %.1f two %.1f | child one %.1f two %.1f\n",
           s.name, count_memsets(one), count_memsets(two), k1, k2, g1, g2, c1t, c2t);
  }
  return 0;
}
