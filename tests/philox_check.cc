// philox4x32_10_n (cuda/philox.h: N calls side by side with one key schedule, as the
// attention and row kernels draw their keep decisions) gives exactly N calls of
// philox4x32_10, and both give the Random123 known answers. Host-only; built and run by test_dropout.py.
// Prints the first failures and exits 1 on any.
#include <cstdio>

#include "philox.h"

namespace {

int failures = 0;

bool same(const jaxsub::U32x4& a, const jaxsub::U32x4& b) {
  return a.x == b.x && a.y == b.y && a.z == b.z && a.w == b.w;
}

void check(const char* what, const jaxsub::U32x4& got, const jaxsub::U32x4& want) {
  if (!same(got, want) && ++failures <= 20)
    std::printf("%s: got %08x %08x %08x %08x want %08x %08x %08x %08x\n", what, got.x, got.y, got.z, got.w, want.x,
                want.y, want.z, want.w);
}

uint32_t next(uint64_t& s) {  // splitmix64, for test inputs
  uint64_t z = (s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return static_cast<uint32_t>(z ^ (z >> 31));
}

}  // namespace

int main() {
  using jaxsub::U32x4;
  // Random123 kat_vectors, philox4x32 with 10 rounds, through both forms.
  const struct {
    U32x4 ctr;
    uint32_t k0, k1;
    U32x4 want;
  } kat[] = {
      {{0, 0, 0, 0}, 0, 0, {0x6627E8D5u, 0xE169C58Du, 0xBC57AC4Cu, 0x9B00DBD8u}},
      {{~0u, ~0u, ~0u, ~0u}, ~0u, ~0u, {0x408F276Du, 0x41C83B0Eu, 0xA20BC7C6u, 0x6D5451FDu}},
      {{0x243F6A88u, 0x85A308D3u, 0x13198A2Eu, 0x03707344u}, 0xA4093822u, 0x299F31D0u,
       {0xD16CFE09u, 0x94FDCCEBu, 0x5001E420u, 0x24126EA1u}},
  };
  for (const auto& k : kat) {
    check("philox4x32_10 known answer", jaxsub::philox4x32_10(k.ctr, k.k0, k.k1), k.want);
    U32x4 one[1] = {k.ctr};
    jaxsub::philox4x32_10_n<1>(one, k.k0, k.k1);
    check("philox4x32_10_n<1> known answer", one[0], k.want);
  }
  uint64_t s = 12345;
  int calls = 0;
  for (int trial = 0; trial < 20000; ++trial) {
    const uint32_t k0 = next(s), k1 = next(s);
    U32x4 c[4], ref[4];
    for (int i = 0; i < 4; ++i) {
      // The kernels' counters: (index lo, index hi, 0, 0); every third trial any words.
      c[i] = trial % 3 ? U32x4{next(s), next(s) & 0xffu, 0u, 0u} : U32x4{next(s), next(s), next(s), next(s)};
      ref[i] = jaxsub::philox4x32_10(c[i], k0, k1);
    }
    jaxsub::philox4x32_10_n<4>(c, k0, k1);
    for (int i = 0; i < 4; ++i, ++calls) check("philox4x32_10_n<4>", c[i], ref[i]);
  }
  std::printf("%d calls, %d failures\n", calls, failures);
  return failures ? 1 : 0;
}
