// Checks cuda/wgmma.cuh on the GPU without JAX: S = Q Kᵀ (K-major B) and O = P V
// (MN-major B) for one 64-row warpgroup tile, D = 64 and 128, bf16 and f16, against a
// host product; A from registers, and from shared memory (Q K-major; P stored transposed,
// MN-major). Build: nvcc -std=c++17 -O2 -gencode=arch=compute_90a,code=sm_90a -Icuda
// tools/probe_wgmma.cu -o build/probe_wgmma
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "mma.cuh"
#include "wgmma.cuh"

using namespace jaxsub;

template <typename T, int D>
__global__ void probe(const T* q, const T* k, const T* v, const T* p, float* s_out, float* o_out, bool ss) {
  __shared__ __align__(1024) unsigned char smem[3 * 64 * D * 2 + 64 * 64 * 2];
  unsigned char* ks = smem;
  unsigned char* vs = smem + 64 * D * 2;
  unsigned char* qs = smem + 2 * 64 * D * 2;
  unsigned char* pts = smem + 3 * 64 * D * 2;  // Pᵀ: row = key, column = query
  for (int i = threadIdx.x; i < 64 * D; i += 128) {
    const int r = i / D, c = i % D;
    *reinterpret_cast<T*>(ks + swz_offset(r, c)) = k[i];
    *reinterpret_cast<T*>(vs + swz_offset(r, c)) = v[i];
    *reinterpret_cast<T*>(qs + swz_offset(r, c)) = q[i];
  }
  for (int i = threadIdx.x; i < 64 * 64; i += 128) *reinterpret_cast<T*>(pts + swz_offset(i % 64, i / 64)) = p[i];
  fence_proxy_async();
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, quad = lane / 4, tq = lane % 4;
  uint32_t qf[D / 16][4], pf[4][4];
  for (int kc = 0; kc < D / 16; ++kc)
    for (int r = 0; r < 4; ++r) {
      const int i = warp * 16 + quad + (r & 1) * 8, c = kc * 16 + tq * 2 + (r >> 1) * 8;
      qf[kc][r] = *reinterpret_cast<const uint32_t*>(q + i * D + c);
    }
  for (int kc = 0; kc < 4; ++kc)
    for (int r = 0; r < 4; ++r) {
      const int i = warp * 16 + quad + (r & 1) * 8, c = kc * 16 + tq * 2 + (r >> 1) * 8;
      pf[kc][r] = *reinterpret_cast<const uint32_t*>(p + i * 64 + c);
    }
  const uint32_t kb = static_cast<uint32_t>(__cvta_generic_to_shared(ks));
  const uint32_t vb = static_cast<uint32_t>(__cvta_generic_to_shared(vs));
  float s[32], o[D / 2];
  const uint32_t qb = static_cast<uint32_t>(__cvta_generic_to_shared(qs));
  const uint32_t pb = static_cast<uint32_t>(__cvta_generic_to_shared(pts));
  wgmma_fence();
  if (ss) {
#pragma unroll
    for (int kc = 0; kc < D / 16; ++kc) {
      const uint32_t off = (kc / 4) * kPanelBytes + (kc % 4) * 32;
      wgmma_ss<T, 64, false, false>(s, wgmma_desc(qb + off), wgmma_desc(kb + off), kc > 0);
    }
#pragma unroll
    for (int kc = 0; kc < 4; ++kc)
      wgmma_ss<T, D, true, true>(o, wgmma_desc(pb + kc * 2048), wgmma_desc(vb + kc * 2048), kc > 0);
  } else {
#pragma unroll
    for (int kc = 0; kc < D / 16; ++kc)
      wgmma_rs<T, 64, false>(s, qf[kc], wgmma_desc(kb + (kc / 4) * kPanelBytes + (kc % 4) * 32), kc > 0);
#pragma unroll
    for (int kc = 0; kc < 4; ++kc) wgmma_rs<T, D, true>(o, pf[kc], wgmma_desc(vb + kc * 2048), kc > 0);
  }
  wgmma_commit();
  wgmma_wait<0>();
  for (int j = 0; j < 8; ++j)
    for (int e = 0; e < 4; ++e)
      s_out[(warp * 16 + quad + 8 * (e / 2)) * 64 + 8 * j + 2 * tq + e % 2] = s[4 * j + e];
  for (int j = 0; j < D / 8; ++j)
    for (int e = 0; e < 4; ++e)
      o_out[(warp * 16 + quad + 8 * (e / 2)) * D + 8 * j + 2 * tq + e % 2] = o[4 * j + e];
}

template <typename T>
float to_f(T x) { return static_cast<float>(x); }

template <typename T, int D>
int run(const char* name, bool ss) {
  std::vector<T> q(64 * D), k(64 * D), v(64 * D), p(64 * 64);
  std::vector<float> qf(64 * D), kf(64 * D), vf(64 * D), pf(64 * 64);
  srand(D * 7 + sizeof(T));
  auto fill = [](std::vector<T>& a, std::vector<float>& f) {
    for (size_t i = 0; i < a.size(); ++i) {
      a[i] = T(static_cast<float>(rand() % 17 - 8) / 8.f);
      f[i] = to_f(a[i]);
    }
  };
  fill(q, qf), fill(k, kf), fill(v, vf), fill(p, pf);
  T *dq, *dk, *dv, *dp;
  float *ds, *dO;
  cudaMalloc(&dq, q.size() * 2), cudaMalloc(&dk, k.size() * 2), cudaMalloc(&dv, v.size() * 2),
      cudaMalloc(&dp, p.size() * 2), cudaMalloc(&ds, 64 * 64 * 4), cudaMalloc(&dO, 64 * D * 4);
  cudaMemcpy(dq, q.data(), q.size() * 2, cudaMemcpyHostToDevice);
  cudaMemcpy(dk, k.data(), k.size() * 2, cudaMemcpyHostToDevice);
  cudaMemcpy(dv, v.data(), v.size() * 2, cudaMemcpyHostToDevice);
  cudaMemcpy(dp, p.data(), p.size() * 2, cudaMemcpyHostToDevice);
  cudaMemset(ds, 0xff, 64 * 64 * 4), cudaMemset(dO, 0xff, 64 * D * 4);  // NaN poison
  probe<T, D><<<1, 128>>>(dq, dk, dv, dp, ds, dO, ss);
  cudaError_t e = cudaDeviceSynchronize();
  if (e != cudaSuccess) {
    printf("%s: CUDA error %s\n", name, cudaGetErrorString(e));
    return 1;
  }
  std::vector<float> s(64 * 64), o(64 * D);
  cudaMemcpy(s.data(), ds, s.size() * 4, cudaMemcpyDeviceToHost);
  cudaMemcpy(o.data(), dO, o.size() * 4, cudaMemcpyDeviceToHost);
  double es = 0, eo = 0;
  for (int i = 0; i < 64; ++i)
    for (int j = 0; j < 64; ++j) {
      double ref = 0;
      for (int c = 0; c < D; ++c) ref += qf[i * D + c] * kf[j * D + c];
      es = fmax(es, std::isnan(s[i * 64 + j]) ? 1e9 : fabs(s[i * 64 + j] - ref));
    }
  for (int i = 0; i < 64; ++i)
    for (int c = 0; c < D; ++c) {
      double ref = 0;
      for (int j = 0; j < 64; ++j) ref += pf[i * 64 + j] * vf[j * D + c];
      eo = fmax(eo, std::isnan(o[i * D + c]) ? 1e9 : fabs(o[i * D + c] - ref));
    }
  printf("%s %s D=%d: max |S - ref| = %g, max |O - ref| = %g  %s\n", name, ss ? "SS" : "RS", D, es, eo,
         es < 1e-3 && eo < 1e-3 ? "OK" : "FAIL");
  return es < 1e-3 && eo < 1e-3 ? 0 : 1;
}

int main() {
  int bad = 0;
  for (bool ss : {false, true}) {
    bad += run<__nv_bfloat16, 64>("bf16", ss);
    bad += run<__nv_bfloat16, 128>("bf16", ss);
    bad += run<__half, 64>("f16", ss);
    bad += run<__half, 128>("f16", ss);
  }
  printf(bad ? "probe_wgmma: FAIL\n" : "probe_wgmma: all OK\n");
  return bad;
}
