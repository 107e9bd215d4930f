// Philox4x32-10 (Salmon, Moraes, Dror, Shaw, "Parallel random numbers: as easy as 1, 2, 3",
// SC'11) and the exponential draws of random_sample_from_logits, for the host and the device:
// the CPU kernel and the CUDA kernel of the op compute the same uniform words from the same
// (seed, token) and the same float32 expression on them.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define PYORCH_PHILOX_HD __host__ __device__ __forceinline__
#else
#define PYORCH_PHILOX_HD inline
#endif

namespace pyorch::philox {

struct U32x4 {
  uint32_t v[4];
};

// The multipliers and Weyl key increments of Philox4x32.
constexpr uint32_t kM0 = 0xD2511F53u;
constexpr uint32_t kM1 = 0xCD9E8D57u;
constexpr uint32_t kW0 = 0x9E3779B9u;
constexpr uint32_t kW1 = 0xBB67AE85u;

PYORCH_PHILOX_HD void mul_hi_lo(uint32_t a, uint32_t b, uint32_t& hi, uint32_t& lo) {
  const uint64_t p = static_cast<uint64_t>(a) * b;
  hi = static_cast<uint32_t>(p >> 32);
  lo = static_cast<uint32_t>(p);
}

// Four 32-bit words for counter (c0, c1, c2, c3) under key (k0, k1): ten rounds.
PYORCH_PHILOX_HD U32x4 philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3,
                                     uint32_t k0, uint32_t k1) {
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int round = 0; round < 10; ++round) {
    uint32_t hi0, lo0, hi1, lo1;
    mul_hi_lo(kM0, c0, hi0, lo0);
    mul_hi_lo(kM1, c2, hi1, lo1);
    const uint32_t n0 = hi1 ^ c1 ^ k0;
    const uint32_t n2 = hi0 ^ c3 ^ k1;
    c0 = n0;
    c1 = lo1;
    c2 = n2;
    c3 = lo0;
    k0 += kW0;
    k1 += kW1;
  }
  return U32x4{{c0, c1, c2, c3}};
}

// The four uniform words of vocabulary entries 4 g .. 4 g + 3 of a row whose key is `seed`.
PYORCH_PHILOX_HD U32x4 token_words(uint64_t seed, uint64_t group) {
  return philox4x32_10(static_cast<uint32_t>(group), static_cast<uint32_t>(group >> 32), 0u, 0u,
                       static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
}

// u in (0, 1) from the word's top 23 bits, centred in its cell: ((w >> 9) + 1/2) 2^-23. Both
// steps are exact in float32 (the sum needs 24 significant bits), so u is never 0 or 1: the
// exponential draw q = -log(u) lies in [5.96e-8, 16.64] (never 0 or inf), and the race adds
// -log(q): see random_sample_from_logits (pyorch/sampling.h).
PYORCH_PHILOX_HD float uniform_open(uint32_t word) {
  return (static_cast<float>(word >> 9) + 0.5f) * 1.1920928955078125e-7f;  // 2^-23
}

}  // namespace pyorch::philox
