// The ten GGML block formats, each decoded the same way: 32 consecutive weights (a "sub-block")
// become 32 small non-negative integers q (packed four to a uint32, as int8 lanes for dp4a / mma)
// plus a scale and a bias for each 16-value half, w = scale * q + bias. Every kernel in cuda/gguf
// (dequantize, the vector and the matrix products) goes through `unpack`, so one decoder per type
// is all there is to get right. The layouts are ggml's (ggml-common.h), as the `gguf` package's
// gguf/quants.py reads them; the comments give the element -> byte mapping each decoder follows.
//
// Host and device: the functions are __host__ __device__ so a host program can check them
// against gguf's dequantization without a GPU.
#pragma once

#include <cstdint>

#include <cuda_fp16.h>

#include "common/check.cuh"
#include "pyorch/gguf.h"

namespace pyorch::kernels::gguf {

#define PYORCH_HD __host__ __device__ __forceinline__

constexpr int kSubSize = 32;   // weights per sub-block
constexpr int kHalfSize = 16;  // weights per scale group (the finest any type has)

// One decoded sub-block: weight i = scale[i / 16] * byte i of q + bias[i / 16].
struct Sub32 {
  uint32_t q[8];  // [32] uint8 (int8 for Q8_0), little-endian, four per word
  float scale[2];
  float bias[2];
};

PYORCH_HD float half_bits_to_float(uint16_t h) {
#ifdef __CUDA_ARCH__
  return __half2float(__ushort_as_half(h));
#else
  const uint32_t sign = (h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1f;
  uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  } else if (mant == 0) {
    bits = sign;
  } else {  // subnormal: normalize
    exp = 113;
    while ((mant & 0x400u) == 0) {
      mant <<= 1;
      --exp;
    }
    bits = sign | (exp << 23) | ((mant & 0x3ffu) << 13);
  }
  float f;
  __builtin_memcpy(&f, &bits, 4);
  return f;
#endif
}

// Loads from a block, which (blocks being an even number of bytes) is only 2-byte aligned in
// general; A4: the address is known to be 4-byte aligned.
PYORCH_HD uint32_t ld_u16(const uint8_t* p) {
#ifdef __CUDA_ARCH__
  return *reinterpret_cast<const uint16_t*>(p);
#else
  return p[0] | (uint32_t(p[1]) << 8);
#endif
}
template <bool A4>
PYORCH_HD uint32_t ld_u32(const uint8_t* p) {
#ifdef __CUDA_ARCH__
  if constexpr (A4) return *reinterpret_cast<const uint32_t*>(p);
#endif
  return ld_u16(p) | (ld_u16(p + 2) << 16);
}
PYORCH_HD float ld_half(const uint8_t* p) { return half_bits_to_float(ld_u16(p)); }

// Spreads the low four bits of `bits` to bit `shift` of each byte (bit k -> bit 8k + shift).
PYORCH_HD uint32_t spread_nibble(uint32_t bits, int shift) {
  return ((bits & 1u) | ((bits & 2u) << 7) | ((bits & 4u) << 14) | ((bits & 8u) << 21)) << shift;
}

// The 6-bit scale and min j (0..7) of Q4_K / Q5_K, packed in 12 bytes (gguf Q4_K.get_scale_min).
PYORCH_HD void k4_scale_min(const uint8_t* s, int j, int& sc, int& m) {
  if (j < 4) {
    sc = s[j] & 63;
    m = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0x0f) | ((s[j - 4] >> 2) & 0x30);
    m = (s[j + 4] >> 4) | ((s[j] >> 2) & 0x30);
  }
}

template <int TYPE>
struct BlockTraits;

// Q4_0: d (f16), qs[16]. Element i < 16: qs[i] & 15, i >= 16: qs[i - 16] >> 4; w = d * (q - 8).
template <>
struct BlockTraits<int(GgmlType::kQ4_0)> {
  static constexpr int kBlockSize = 32, kBlockBytes = 18;
  static constexpr bool kAlign4 = false;
  PYORCH_HD static void unpack(const uint8_t* b, int, Sub32& s) {
    const float d = ld_half(b);
#pragma unroll
    for (int p = 0; p < 4; ++p) {
      const uint32_t v = ld_u32<kAlign4>(b + 2 + 4 * p);
      s.q[p] = v & 0x0f0f0f0fu;
      s.q[p + 4] = (v >> 4) & 0x0f0f0f0fu;
    }
    s.scale[0] = s.scale[1] = d;
    s.bias[0] = s.bias[1] = -8.f * d;
  }
};

// Q4_1: d, m (f16), qs[16] as Q4_0; w = d * q + m.
template <>
struct BlockTraits<int(GgmlType::kQ4_1)> {
  static constexpr int kBlockSize = 32, kBlockBytes = 20;
  static constexpr bool kAlign4 = true;
  PYORCH_HD static void unpack(const uint8_t* b, int, Sub32& s) {
#pragma unroll
    for (int p = 0; p < 4; ++p) {
      const uint32_t v = ld_u32<kAlign4>(b + 4 + 4 * p);
      s.q[p] = v & 0x0f0f0f0fu;
      s.q[p + 4] = (v >> 4) & 0x0f0f0f0fu;
    }
    s.scale[0] = s.scale[1] = ld_half(b);
    s.bias[0] = s.bias[1] = ld_half(b + 2);
  }
};

// Q5_0: d, qh (u32: bit i is bit 4 of element i), qs[16] as Q4_0; w = d * (q - 16).
template <>
struct BlockTraits<int(GgmlType::kQ5_0)> {
  static constexpr int kBlockSize = 32, kBlockBytes = 22;
  static constexpr bool kAlign4 = false;
  PYORCH_HD static void unpack(const uint8_t* b, int, Sub32& s) {
    const float d = ld_half(b);
    const uint32_t qh = ld_u32<kAlign4>(b + 2);
#pragma unroll
    for (int p = 0; p < 4; ++p) {
      const uint32_t v = ld_u32<kAlign4>(b + 6 + 4 * p);
      s.q[p] = (v & 0x0f0f0f0fu) | spread_nibble(qh >> (4 * p), 4);
      s.q[p + 4] = ((v >> 4) & 0x0f0f0f0fu) | spread_nibble(qh >> (16 + 4 * p), 4);
    }
    s.scale[0] = s.scale[1] = d;
    s.bias[0] = s.bias[1] = -16.f * d;
  }
};

// Q5_1: d, m, qh, qs[16]; w = d * q + m (q as Q5_0).
template <>
struct BlockTraits<int(GgmlType::kQ5_1)> {
  static constexpr int kBlockSize = 32, kBlockBytes = 24;
  static constexpr bool kAlign4 = true;
  PYORCH_HD static void unpack(const uint8_t* b, int, Sub32& s) {
    const uint32_t qh = ld_u32<kAlign4>(b + 4);
#pragma unroll
    for (int p = 0; p < 4; ++p) {
      const uint32_t v = ld_u32<kAlign4>(b + 8 + 4 * p);
      s.q[p] = (v & 0x0f0f0f0fu) | spread_nibble(qh >> (4 * p), 4);
      s.q[p + 4] = ((v >> 4) & 0x0f0f0f0fu) | spread_nibble(qh >> (16 + 4 * p), 4);
    }
    s.scale[0] = s.scale[1] = ld_half(b);
    s.bias[0] = s.bias[1] = ld_half(b + 2);
  }
};

// Q8_0: d, qs[32] int8; w = d * q (q signed here: the only type whose q is not unsigned).
template <>
struct BlockTraits<int(GgmlType::kQ8_0)> {
  static constexpr int kBlockSize = 32, kBlockBytes = 34;
  static constexpr bool kAlign4 = false;
  PYORCH_HD static void unpack(const uint8_t* b, int, Sub32& s) {
#pragma unroll
    for (int p = 0; p < 8; ++p) s.q[p] = ld_u32<kAlign4>(b + 2 + 4 * p);
    s.scale[0] = s.scale[1] = ld_half(b);
    s.bias[0] = s.bias[1] = 0.f;
  }
};

// Q2_K (256 per block): scales[16] (low nibble scale, high nibble min), qs[64], d, dmin.
// Element 128 g + 32 j + i (g < 2, j < 4, i < 32): (qs[32 g + i] >> 2 j) & 3, in group e / 16:
// w = d * (sc & 15) * q - dmin * (sc >> 4).
template <>
struct BlockTraits<int(GgmlType::kQ2_K)> {
  static constexpr int kBlockSize = 256, kBlockBytes = 84;
  static constexpr bool kAlign4 = true;
  PYORCH_HD static void unpack(const uint8_t* b, int sub, Sub32& s) {
    const int g = sub / 4, shift = 2 * (sub % 4);
#pragma unroll
    for (int p = 0; p < 8; ++p) {
      s.q[p] = (ld_u32<kAlign4>(b + 16 + 32 * g + 4 * p) >> shift) & 0x03030303u;
    }
    const float d = ld_half(b + 80), dmin = ld_half(b + 82);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int sc = b[2 * sub + h];
      s.scale[h] = d * float(sc & 15);
      s.bias[h] = -dmin * float(sc >> 4);
    }
  }
};

// Q3_K: hmask[32], qs[64], scales[12] (sixteen 6-bit scales), d. Element 32 j + i (j < 8):
// low bits (qs[32 (j / 4) + i] >> 2 (j % 4)) & 3, high bit (hmask[i] >> j) & 1; the value is
// low - 4 where the high bit is clear, low where it is set: q = low | high << 2, w = d * (sc -
// 32) * (q - 4). Scale t: low nibble of scales[t % 8] (>> 4 for t >= 8), high two bits
// (scales[8 + t % 4] >> 2 (t / 4)) & 3.
template <>
struct BlockTraits<int(GgmlType::kQ3_K)> {
  static constexpr int kBlockSize = 256, kBlockBytes = 110;
  static constexpr bool kAlign4 = false;
  PYORCH_HD static void unpack(const uint8_t* b, int sub, Sub32& s) {
    const int g = sub / 4, shift = 2 * (sub % 4);
#pragma unroll
    for (int p = 0; p < 8; ++p) {
      const uint32_t lo = (ld_u32<kAlign4>(b + 32 + 32 * g + 4 * p) >> shift) & 0x03030303u;
      const uint32_t hi = (ld_u32<kAlign4>(b + 4 * p) >> sub) & 0x01010101u;
      s.q[p] = lo | (hi << 2);
    }
    const float d = ld_half(b + 108);
    const uint8_t* sc = b + 96;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int t = 2 * sub + h;
      const int lo = (sc[t % 8] >> (t >= 8 ? 4 : 0)) & 15;
      const int hi = (sc[8 + t % 4] >> (2 * (t / 4))) & 3;
      s.scale[h] = d * float((lo | (hi << 4)) - 32);
      s.bias[h] = -4.f * s.scale[h];
    }
  }
};

// Q4_K: d, dmin, scales[12] (eight 6-bit scales and mins), qs[128]. Element 32 j + i: (qs[32 (j
// / 2) + i] >> 4 (j % 2)) & 15; w = d * sc[j] * q - dmin * m[j].
template <>
struct BlockTraits<int(GgmlType::kQ4_K)> {
  static constexpr int kBlockSize = 256, kBlockBytes = 144;
  static constexpr bool kAlign4 = true;
  PYORCH_HD static void unpack(const uint8_t* b, int sub, Sub32& s) {
    const int shift = 4 * (sub % 2);
#pragma unroll
    for (int p = 0; p < 8; ++p) {
      s.q[p] = (ld_u32<kAlign4>(b + 16 + 32 * (sub / 2) + 4 * p) >> shift) & 0x0f0f0f0fu;
    }
    int sc, m;
    k4_scale_min(b + 4, sub, sc, m);
    s.scale[0] = s.scale[1] = ld_half(b) * float(sc);
    s.bias[0] = s.bias[1] = -ld_half(b + 2) * float(m);
  }
};

// Q4_K as gguf_mmvq_q4k.cuh's direct form reads it: a lane per 32 bytes of qs (two sub-blocks).
// The 6-bit scales and mins of sub-blocks 2 pair and 2 pair + 1 (pair 0..3), two at a time and
// without a branch on the pair: byte 0 of sc / m is the even sub-block's, byte 1 the odd one's.
// s0, s1, s2: the block's scales[12] as three little-endian words (bytes 0-3, 4-7, 8-11); the
// same values as k4_scale_min (gguf's Q4_K get_scale_min).
PYORCH_HD void q4k_pair_scale_min(uint32_t s0, uint32_t s1, uint32_t s2, int pair, uint32_t& sc,
                                  uint32_t& m) {
  const int shift = 16 * (pair & 1);
  const uint32_t a = (s0 >> shift) & 0xffffu;
  const uint32_t b = (s1 >> shift) & 0xffffu;
  const uint32_t c = (s2 >> shift) & 0xffffu;
  // Sub-blocks 0..3: the low six bits of scales[j] and scales[j + 4]. 4..7: the nibbles of
  // scales[j + 4] with the top two bits of scales[j - 4] and scales[j] above them.
  const uint32_t sc_hi = (c & 0x0f0fu) | ((a >> 2) & 0x3030u);
  const uint32_t m_hi = ((c >> 4) & 0x0f0fu) | ((b >> 2) & 0x3030u);
  sc = pair < 2 ? (a & 0x3f3fu) : sc_hi;
  m = pair < 2 ? (b & 0x3f3fu) : m_hi;
}

// One lane's share of a block in the direct form, decoded into the Sub32 form (for the host test
// of the layout: tests/cuda/gguf/test_gguf_blocks_host.py). hdr: the block's first 16 bytes as
// words; qs: the 32 bytes qs[32 pair .. 32 pair + 31] as words. sub[0] is sub-block 2 pair (the
// low nibbles), sub[1] sub-block 2 pair + 1 (the high nibbles).
PYORCH_HD void q4k_decode_pair(const uint32_t hdr[4], const uint32_t qs[8], int pair,
                               Sub32 sub[2]) {
  uint32_t sc, m;
  q4k_pair_scale_min(hdr[1], hdr[2], hdr[3], pair, sc, m);
  const float d = half_bits_to_float(static_cast<uint16_t>(hdr[0] & 0xffffu));
  const float dmin = half_bits_to_float(static_cast<uint16_t>(hdr[0] >> 16));
  for (int s = 0; s < 2; ++s) {
    for (int i = 0; i < 8; ++i) sub[s].q[i] = (qs[i] >> (4 * s)) & 0x0f0f0f0fu;
    sub[s].scale[0] = sub[s].scale[1] = d * float((sc >> (8 * s)) & 0xffu);
    sub[s].bias[0] = sub[s].bias[1] = -dmin * float((m >> (8 * s)) & 0xffu);
  }
}

// Q5_K: d, dmin, scales[12], qh[32], qs[128]. Low four bits as Q4_K, bit 4 of element 32 j + i
// is (qh[i] >> j) & 1; w = d * sc[j] * q - dmin * m[j].
template <>
struct BlockTraits<int(GgmlType::kQ5_K)> {
  static constexpr int kBlockSize = 256, kBlockBytes = 176;
  static constexpr bool kAlign4 = true;
  PYORCH_HD static void unpack(const uint8_t* b, int sub, Sub32& s) {
    const int shift = 4 * (sub % 2);
#pragma unroll
    for (int p = 0; p < 8; ++p) {
      const uint32_t lo = (ld_u32<kAlign4>(b + 48 + 32 * (sub / 2) + 4 * p) >> shift) & 0x0f0f0f0fu;
      const uint32_t hi = (ld_u32<kAlign4>(b + 16 + 4 * p) >> sub) & 0x01010101u;
      s.q[p] = lo | (hi << 4);
    }
    int sc, m;
    k4_scale_min(b + 4, sub, sc, m);
    s.scale[0] = s.scale[1] = ld_half(b) * float(sc);
    s.bias[0] = s.bias[1] = -ld_half(b + 2) * float(m);
  }
};

// Q6_K: ql[128], qh[64], scales[16] (int8), d. Element 128 a + 32 r + i (a < 2, r < 4): low four
// bits (ql[64 a + 32 (r % 2) + i] >> 4 (r / 2)) & 15, high two (qh[32 a + i] >> 2 r) & 3;
// w = d * scales[e / 16] * (q - 32).
template <>
struct BlockTraits<int(GgmlType::kQ6_K)> {
  static constexpr int kBlockSize = 256, kBlockBytes = 210;
  static constexpr bool kAlign4 = false;
  PYORCH_HD static void unpack(const uint8_t* b, int sub, Sub32& s) {
    const int a = sub / 4, r = sub % 4;
    const uint8_t* ql = b + 64 * a + 32 * (r % 2);
    const uint8_t* qh = b + 128 + 32 * a;
#pragma unroll
    for (int p = 0; p < 8; ++p) {
      const uint32_t lo = (ld_u32<kAlign4>(ql + 4 * p) >> (4 * (r / 2))) & 0x0f0f0f0fu;
      const uint32_t hi = (ld_u32<kAlign4>(qh + 4 * p) >> (2 * r)) & 0x03030303u;
      s.q[p] = lo | (hi << 4);
    }
    const float d = ld_half(b + 208);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      s.scale[h] = d * float(static_cast<int8_t>(b[192 + 2 * sub + h]));
      s.bias[h] = -32.f * s.scale[h];
    }
  }
};

// Value i (< 32) of a decoded sub-block, as gguf's dequantization computes it in fp32 (one
// rounding: the fma's, which equals gguf's product-then-add on these operands).
PYORCH_HD float sub_value(const Sub32& s, int i, bool q_signed) {
  const uint32_t byte = (s.q[i / 4] >> (8 * (i % 4))) & 0xffu;
  const int q = q_signed ? int(static_cast<int8_t>(byte)) : int(byte);
#ifdef __CUDA_ARCH__
  return __fmaf_rn(s.scale[i / 16], float(q), s.bias[i / 16]);
#else
  return __builtin_fmaf(s.scale[i / 16], float(q), s.bias[i / 16]);
#endif
}

template <int TYPE>
constexpr bool kQSigned = TYPE == int(GgmlType::kQ8_0);

// Whether the type's scale and bias are the same for both halves of a sub-block (one pair per 32
// weights): all but Q2_K, Q3_K and Q6_K, which have one per 16. The products then fold each
// 32-value integer sum into fp32 once instead of twice.
template <int TYPE>
constexpr bool kScalePer32 =
    TYPE != int(GgmlType::kQ2_K) && TYPE != int(GgmlType::kQ3_K) && TYPE != int(GgmlType::kQ6_K);

// Runs BODY with the compile-time constant TYPE bound to a quantized ggml type id.
#define PYORCH_DISPATCH_GGUF_QUANT(TYPE_ID, TYPE, ...)                           \
  [&]() -> cudaError_t {                                                         \
    switch (TYPE_ID) {                                                           \
      case int(::pyorch::GgmlType::kQ4_0): {                                     \
        constexpr int TYPE = 2;                                                  \
        return __VA_ARGS__();                                                    \
      }                                                                          \
      case int(::pyorch::GgmlType::kQ4_1): {                                     \
        constexpr int TYPE = 3;                                                  \
        return __VA_ARGS__();                                                    \
      }                                                                          \
      case int(::pyorch::GgmlType::kQ5_0): {                                     \
        constexpr int TYPE = 6;                                                  \
        return __VA_ARGS__();                                                    \
      }                                                                          \
      case int(::pyorch::GgmlType::kQ5_1): {                                     \
        constexpr int TYPE = 7;                                                  \
        return __VA_ARGS__();                                                    \
      }                                                                          \
      case int(::pyorch::GgmlType::kQ8_0): {                                     \
        constexpr int TYPE = 8;                                                  \
        return __VA_ARGS__();                                                    \
      }                                                                          \
      case int(::pyorch::GgmlType::kQ2_K): {                                     \
        constexpr int TYPE = 10;                                                 \
        return __VA_ARGS__();                                                    \
      }                                                                          \
      case int(::pyorch::GgmlType::kQ3_K): {                                     \
        constexpr int TYPE = 11;                                                 \
        return __VA_ARGS__();                                                    \
      }                                                                          \
      case int(::pyorch::GgmlType::kQ4_K): {                                     \
        constexpr int TYPE = 12;                                                 \
        return __VA_ARGS__();                                                    \
      }                                                                          \
      case int(::pyorch::GgmlType::kQ5_K): {                                     \
        constexpr int TYPE = 13;                                                 \
        return __VA_ARGS__();                                                    \
      }                                                                          \
      case int(::pyorch::GgmlType::kQ6_K): {                                     \
        constexpr int TYPE = 14;                                                 \
        return __VA_ARGS__();                                                    \
      }                                                                          \
      default: PYORCH_INVALID("gguf: GGML type %d has no kernel", int(TYPE_ID)); \
    }                                                                            \
  }()

}  // namespace pyorch::kernels::gguf
