// fp8 e4m3 KV tiles read straight into mma.sync fragments, for the decode kernel
// (paged_decode.cuh) at tile heads 64 and 128.
//
// Why: unpacking a landed fp8 tile into a bf16 tile in shared memory and reading it back with
// ldmatrix cost each element a shared-memory round trip and, for bf16, four conversions (e4m3 ->
// f16x2 -> 2 x f32 -> bf16x2 per pair); the warps were issue-bound on it. Here each lane loads
// the fp8 bytes its fragments need with 16-byte shared loads and converts every pair with one
// cvt.rn.f16x2.e4m3x2, the products run on the f16 tensor cores whatever the model dtype, and
// nothing is written back to shared memory.
//
// Exactness. e4m3 -> f16 is exact (3 mantissa bits, |x| <= 448, smallest subnormal 2^-9). The
// query rows are converted to f16 once per CTA, each row times a power of two 2^e that puts its
// largest magnitude in [2^14, 2^15): exact for a bf16 row (8 significant bits) down to 2^-29 of
// its max (f16 subnormals below), and the scores are multiplied back by 2^-e (exact). The
// probabilities P go to the P V product as f16 (more mantissa than bf16).
//
// Layouts (lane = 4 g + c; D = the tile head, 64 or 128). The dot products q.k and the P V sums
// do not depend on the order of the summed index, so each lane takes contiguous bytes:
// - Q K^T, k-step kk: lane c's logical k = {2c, 2c+1, 2c+8, 2c+9} are the physical head dims
//   c * D/4 + 4 kk + {0, 1, 2, 3}; the query fragment uses the same map. B column n = key g (and
//   g + 8 for the second n-tile): lane (g, c) reads D/4 bytes of key rows g and g + 8.
// - P V: the keys keep their order (the score accumulators are the A operand); output column n
//   of n-tile j is the physical head dim n * D/8 + j, so lane (g, c) reads D/8 bytes of key rows
//   2c, 2c+1, 2c+8, 2c+9 and interleaves the rows' bytes pairwise with a byte permute. The output
//   accumulator o[j][2i + e] (row g + 8i) is head dim (2c + e) * D/8 + j.
// Shared rows are padded (Fp8FragRows) so that these loads are free of bank conflicts.
#pragma once

#include <cmath>
#include <cstdint>

#include "attention/paged_attention_utils.cuh"

namespace pyorch::kernels {

// Raw fp8 tile row pitches in shared memory (bytes) for a tile head of D dims. K: lanes (g, c)
// of a quarter warp read rows g in {0, 1} at c * D/4; V: rows 2c at g * D/8. Pitches that put
// those eight 16-byte (or, V at head 64, 8-byte) reads on distinct banks.
template <int D>
struct Fp8FragRows {
  static_assert(D == 64 || D == 128, "fp8 fragment loads: tile heads 64 and 128");
  static constexpr int kK = D == 128 ? D + 16 : D;  // 144: rows 16 bytes apart; 64: 64 apart
  static constexpr int kV = D + 16;                 // 144 / 80: rows 2c 32 bytes apart mod 128
};

namespace fp8frag {

__device__ __forceinline__ uint32_t e4m3x2_to_f16x2(uint32_t pair) {  // low byte -> low half
  const __half2_raw h =
      __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(pair & 0xffffu), __NV_E4M3);
  return static_cast<uint32_t>(h.x) | (static_cast<uint32_t>(h.y) << 16);
}

// N bytes (a multiple of 8) of shared memory at src into N / 4 words.
template <int N>
__device__ __forceinline__ void load_bytes(const uint8_t* src, uint32_t (&w)[N / 4]) {
  static_assert(N % 8 == 0, "8- or 16-byte loads");
  if constexpr (N % 16 == 0) {
#pragma unroll
    for (int i = 0; i < N / 16; ++i) {
      const uint4 x = reinterpret_cast<const uint4*>(src)[i];
      w[4 * i] = x.x;
      w[4 * i + 1] = x.y;
      w[4 * i + 2] = x.z;
      w[4 * i + 3] = x.w;
    }
  } else {
#pragma unroll
    for (int i = 0; i < N / 8; ++i) {
      const uint2 x = reinterpret_cast<const uint2*>(src)[i];
      w[2 * i] = x.x;
      w[2 * i + 1] = x.y;
    }
  }
}

}  // namespace fp8frag

// The warp's query fragments for every k-step, as f16, and per accumulator row (lane/4, +8) the
// factor 2^-e that undoes the row's scaling (see above). q_smem: [16][ROW_STRIDE] T, rows past
// the CTA's and dims past the head zero. Called once per CTA, after q_smem is visible.
template <int D, int ROW_STRIDE, typename T>
__device__ __forceinline__ void load_q_fp8frag(const T* q_smem, uint32_t (&qf)[D / 16][4],
                                               float (&row_inv)[2]) {
  const int lane = threadIdx.x % kWarpSize;
  const int g = lane / 4, c = lane % 4;
  float q[2][D / 4];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const T* src = q_smem + (g + 8 * i) * ROW_STRIDE + c * (D / 4);
    float max_abs = 0.f;
#pragma unroll
    for (int d = 0; d < D / 4; ++d) {
      q[i][d] = static_cast<float>(src[d]);
      max_abs = fmaxf(max_abs, fabsf(q[i][d]));
    }
    // The quad's four lanes hold the row's four quarters.
    max_abs = fmaxf(max_abs, __shfl_xor_sync(0xffffffffu, max_abs, 1));
    max_abs = fmaxf(max_abs, __shfl_xor_sync(0xffffffffu, max_abs, 2));
    int e = 0;
    if (max_abs > 0.f && max_abs <= 3.4e38f) {  // 0, inf and NaN rows stay as they are
      int ex;
      frexpf(max_abs, &ex);  // max_abs < 2^ex
      e = min(15 - ex, 120);
    }
    row_inv[i] = ldexpf(1.f, -e);
    const float mul = ldexpf(1.f, e);
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      qf[kk][i] = attn::pack2<__half>(q[i][4 * kk] * mul, q[i][4 * kk + 1] * mul);
      qf[kk][2 + i] = attn::pack2<__half>(q[i][4 * kk + 2] * mul, q[i][4 * kk + 3] * mul);
    }
  }
}

// s[16 rows][16 keys] = Q K^T of the warp's tile (unscaled, rows still times 2^e). k_tile: raw
// [16][Fp8FragRows<D>::kK] bytes.
template <int D>
__device__ __forceinline__ void compute_scores_fp8frag(const uint32_t (&qf)[D / 16][4],
                                                       const uint8_t* k_tile, float (&s)[2][4]) {
  constexpr int kPitch = Fp8FragRows<D>::kK;
  const int lane = threadIdx.x % kWarpSize;
  const int g = lane / 4, c = lane % 4;
#pragma unroll
  for (int jn = 0; jn < 2; ++jn) {
    uint32_t w[D / 16];
    fp8frag::load_bytes<D / 4>(k_tile + (g + 8 * jn) * kPitch + c * (D / 4), w);
    // Two independent accumulator chains (even and odd k-steps), added at the end: half the
    // dependent mma latency per tile, which the decode warps wait on.
    float acc[2][4] = {};
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const uint32_t b0 = fp8frag::e4m3x2_to_f16x2(w[kk]);
      const uint32_t b1 = fp8frag::e4m3x2_to_f16x2(w[kk] >> 16);
      attn::mma_16816<__half>(acc[kk % 2], qf[kk], b0, b1);
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) s[jn][e] = acc[0][e] + acc[1][e];
  }
}

// o += P V over the warp's 16 keys; s holds the probabilities (online_softmax's output). o[j] is
// the permuted n-tile j (see above). v_tile: raw [16][Fp8FragRows<D>::kV] bytes.
template <int D>
__device__ __forceinline__ void accumulate_pv_fp8frag(const float (&s)[2][4], const uint8_t* v_tile,
                                                      float (&o)[D / 8][4]) {
  constexpr int kPitch = Fp8FragRows<D>::kV;
  constexpr int kBytes = D / 8;  // per key row and lane
  const int lane = threadIdx.x % kWarpSize;
  const int g = lane / 4, c = lane % 4;
  const uint32_t a[4] = {
      attn::pack2<__half>(s[0][0], s[0][1]), attn::pack2<__half>(s[0][2], s[0][3]),
      attn::pack2<__half>(s[1][0], s[1][1]), attn::pack2<__half>(s[1][2], s[1][3])};
  uint32_t rows[4][kBytes / 4];  // keys 2c, 2c + 1, 2c + 8, 2c + 9
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const int key = 2 * c + (r & 1) + 8 * (r >> 1);
    fp8frag::load_bytes<kBytes>(v_tile + key * kPitch + g * kBytes, rows[r]);
  }
#pragma unroll
  for (int wi = 0; wi < kBytes / 4; ++wi) {
    // Bytes of keys (2c, 2c+1) and (2c+8, 2c+9) interleaved: [k0 b0, k1 b0, k0 b1, k1 b1], ...
    const uint32_t lo01 = __byte_perm(rows[0][wi], rows[1][wi], 0x5140);
    const uint32_t hi01 = __byte_perm(rows[0][wi], rows[1][wi], 0x7362);
    const uint32_t lo89 = __byte_perm(rows[2][wi], rows[3][wi], 0x5140);
    const uint32_t hi89 = __byte_perm(rows[2][wi], rows[3][wi], 0x7362);
    const uint32_t b0[4] = {lo01, lo01 >> 16, hi01, hi01 >> 16};
    const uint32_t b1[4] = {lo89, lo89 >> 16, hi89, hi89 >> 16};
#pragma unroll
    for (int t = 0; t < 4; ++t) {
      attn::mma_16816<__half>(o[4 * wi + t], a, fp8frag::e4m3x2_to_f16x2(b0[t]),
                              fp8frag::e4m3x2_to_f16x2(b1[t]));
    }
  }
}

// The head dim of accumulator o[j][2i + e] of lane c (see above).
template <int D>
__device__ __forceinline__ int fp8frag_out_dim(int j, int c, int e) {
  return (2 * c + e) * (D / 8) + j;
}

}  // namespace pyorch::kernels
