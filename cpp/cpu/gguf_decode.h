// GGML block decoding for the CPU GGUF kernels (cpp/cpu/gguf.cpp): one block of any quantized
// type becomes unsigned 8-bit values u plus, per group of kGroup elements, a float scale and
// bias, so that the weight is y = scale * (u - offset) + bias. The offset is the type's (8 for
// Q4_0, 16 for Q5_0, 128 for Q8_0, 4 for Q3_K, 32 for Q6_K, 0 otherwise). The formats are those
// of the gguf package (gguf/quants.py), which the tests use as the reference.
//
// A dot product with an 8-bit activation x = dx * qx then needs only integer sums:
//   sum_i y_i x_i = dx * (scale * sum_i u_i qx_i + (bias - scale * offset) * sum_i qx_i).
// u is at most 63 except for Q8_0 (whose values are signed bytes: u = q ^ 0x80).
#pragma once

#include <cstdint>
#include <cstring>

#include <c10/util/Half.h>

#include "gguf_checks.h"

namespace pyorch::cpu::gguf_decode {

using pyorch::gguf::GgmlType;

inline float half_bits_to_float(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// Group size (elements sharing a scale and bias) of a quantized type.
constexpr int group_size(int64_t type) {
  return type == GgmlType::kQ2_K || type == GgmlType::kQ3_K || type == GgmlType::kQ6_K ? 16 : 32;
}

constexpr int value_offset(int64_t type) {
  switch (type) {
    case GgmlType::kQ4_0: return 8;
    case GgmlType::kQ5_0: return 16;
    case GgmlType::kQ8_0: return 128;
    case GgmlType::kQ3_K: return 4;
    case GgmlType::kQ6_K: return 32;
    default: return 0;
  }
}

// The 6-bit scale and min of sub-block j of Q4_K/Q5_K's 12 packed scale bytes.
inline void k4_scale_min(const uint8_t* s, int j, int* sc, int* mn) {
  if (j < 4) {
    *sc = s[j] & 63;
    *mn = s[j + 4] & 63;
  } else {
    *sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
    *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// Decodes one block of TYPE at b into u [block_size] and scale/bias [block_size / group_size].
template <int64_t TYPE>
inline void decode_block(const uint8_t* __restrict__ b, uint8_t* __restrict__ u,
                         float* __restrict__ scale, float* __restrict__ bias) {
  if constexpr (TYPE == GgmlType::kQ4_0 || TYPE == GgmlType::kQ4_1) {
    const int head = TYPE == GgmlType::kQ4_0 ? 2 : 4;
    scale[0] = half_bits_to_float(b);
    bias[0] = TYPE == GgmlType::kQ4_1 ? half_bits_to_float(b + 2) : 0.f;
    const uint8_t* qs = b + head;
    for (int j = 0; j < 16; ++j) {
      u[j] = qs[j] & 0x0F;
      u[j + 16] = qs[j] >> 4;
    }
  } else if constexpr (TYPE == GgmlType::kQ5_0 || TYPE == GgmlType::kQ5_1) {
    const int head = TYPE == GgmlType::kQ5_0 ? 2 : 4;
    scale[0] = half_bits_to_float(b);
    bias[0] = TYPE == GgmlType::kQ5_1 ? half_bits_to_float(b + 2) : 0.f;
    uint32_t qh;
    std::memcpy(&qh, b + head, 4);
    const uint8_t* qs = b + head + 4;
    for (int j = 0; j < 16; ++j) {
      u[j] = (qs[j] & 0x0F) | (((qh >> j) & 1) << 4);
      u[j + 16] = (qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
    }
  } else if constexpr (TYPE == GgmlType::kQ8_0) {
    scale[0] = half_bits_to_float(b);
    bias[0] = 0.f;
    for (int j = 0; j < 32; ++j) u[j] = b[2 + j] ^ 0x80;
  } else if constexpr (TYPE == GgmlType::kQ2_K) {
    // scales[16] | qs[64] | d | dmin. Element h*128 + s*32 + l is bits 2s of qs[h*32 + l].
    const uint8_t* sc = b;
    const uint8_t* qs = b + 16;
    const float d = half_bits_to_float(b + 80), dmin = half_bits_to_float(b + 82);
    for (int g = 0; g < 16; ++g) {
      scale[g] = d * static_cast<float>(sc[g] & 0x0F);
      bias[g] = -(dmin * static_cast<float>(sc[g] >> 4));
    }
    for (int h = 0; h < 2; ++h)
      for (int s = 0; s < 4; ++s)
        for (int l = 0; l < 32; ++l) u[h * 128 + s * 32 + l] = (qs[h * 32 + l] >> (2 * s)) & 3;
  } else if constexpr (TYPE == GgmlType::kQ3_K) {
    // hmask[32] | qs[64] | scales[12] | d. q = low 2 bits - 4 * (1 - high bit); u = q + 4.
    const uint8_t* hm = b;
    const uint8_t* qs = b + 32;
    const uint8_t* sc = b + 96;
    const float d = half_bits_to_float(b + 108);
    for (int g = 0; g < 16; ++g) {
      const int lo = g < 8 ? (sc[g] & 0x0F) : (sc[g - 8] >> 4);
      const int hi = (sc[8 + (g & 3)] >> (2 * (g >> 2))) & 3;
      scale[g] = d * static_cast<float>((lo | (hi << 4)) - 32);
      bias[g] = 0.f;
    }
    for (int h = 0; h < 2; ++h)
      for (int s = 0; s < 4; ++s)
        for (int l = 0; l < 32; ++l) {
          const int e = h * 128 + s * 32 + l;
          u[e] = ((qs[h * 32 + l] >> (2 * s)) & 3) | (((hm[l] >> (e / 32)) & 1) << 2);
        }
  } else if constexpr (TYPE == GgmlType::kQ4_K || TYPE == GgmlType::kQ5_K) {
    // d | dmin | scales[12] | (Q5_K: qh[32]) | qs[128]. Element c*64 + s*32 + l is nibble s of
    // qs[c*32 + l]; Q5_K's fifth bit of element e is bit e / 32 of qh[e % 32].
    const float d = half_bits_to_float(b), dmin = half_bits_to_float(b + 2);
    const uint8_t* sc = b + 4;
    const uint8_t* qh = b + 16;
    const uint8_t* qs = TYPE == GgmlType::kQ5_K ? b + 48 : b + 16;
    for (int j = 0; j < 8; ++j) {
      int s, m;
      k4_scale_min(sc, j, &s, &m);
      scale[j] = d * static_cast<float>(s);
      bias[j] = -(dmin * static_cast<float>(m));
    }
    for (int c = 0; c < 4; ++c)
      for (int l = 0; l < 32; ++l) {
        u[c * 64 + l] = qs[c * 32 + l] & 0x0F;
        u[c * 64 + 32 + l] = qs[c * 32 + l] >> 4;
      }
    if constexpr (TYPE == GgmlType::kQ5_K) {
      for (int e = 0; e < 256; ++e) u[e] |= ((qh[e & 31] >> (e >> 5)) & 1) << 4;
    }
  } else if constexpr (TYPE == GgmlType::kQ6_K) {
    // ql[128] | qh[64] | scales[16] (int8) | d. Element h*128 + s*64 + l (l < 64): nibble s of
    // ql[h*64 + l]; its high 2 bits: bits 2k of qh[h*32 + l % 32], k = (s*64 + l) / 32.
    const uint8_t* ql = b;
    const uint8_t* qh = b + 128;
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    const float d = half_bits_to_float(b + 208);
    for (int g = 0; g < 16; ++g) {
      scale[g] = d * static_cast<float>(sc[g]);
      bias[g] = 0.f;
    }
    for (int h = 0; h < 2; ++h)
      for (int k = 0; k < 4; ++k)
        for (int l = 0; l < 32; ++l) {
          const int e = h * 128 + k * 32 + l;
          const int s = k >> 1, li = (k & 1) * 32 + l;
          const int low = (ql[h * 64 + li] >> (4 * s)) & 0x0F;
          const int high = (qh[h * 32 + l] >> (2 * k)) & 3;
          u[e] = static_cast<uint8_t>(low | (high << 4));
        }
  }
}

}  // namespace pyorch::cpu::gguf_decode
