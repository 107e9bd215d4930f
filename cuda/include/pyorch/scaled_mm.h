// W8A8 GEMMs with scales fused into the epilogue: vLLM's cutlass_scaled_mm family, built on
// CUTLASS 3.x for sm90a (TMA, warp-specialized wgmma). Torch-free; cpp/ops/scaled_mm.cpp adapts
// it, bench/cpp/bench_scaled_mm.cu times it against cuBLASLt.
//
// Layouts (vLLM's): A is row-major [m, k] (the activations), B is column-major k x n, i.e. the
// row-major [n, k] weight of nn.Linear; out is row-major [m, n]. Strides are in elements.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "pyorch/dtype.h"

namespace pyorch {

// False when cuda/ was compiled without the CUTLASS headers (nvidia-cutlass not installed at
// configure time): every function below then returns cudaErrorNotSupported.
bool cutlass_scaled_mm_available();

// The tile configurations of the per-tensor/token/channel kernels. kAuto: the launcher picks by
// m, n and k (default_scaled_mm_tile in cuda/quantization/scaled_mm.cu). Exposed for the benchmark,
// which checks and times each one; none of them changes the result beyond fp32 summation order.
enum class ScaledMmTile : int {
  kAuto = -1,
  kSwapM16 = 0,    // m <= 32 (or <= 64 when 64 x 64 would leave a thin second wave): out^T =
                   // B^T A^T, 64 (n) x 16 (m) x 256 tiles
  kSwapM64 = 1,    // m <= 64, or <= 128 while one wave: out^T = B^T A^T, 64 x 64 x 256 tiles
  kM256 = 2,       // m <= 256: 64 x 128 x 128 tiles, clusters of 2 along m (by wave count)
  kLarge = 3,      // larger m: 128 x 128 x 128 ping-pong tiles, clusters of 2 along m
  kHuge = 4,       // 128 x 256 x 128 tiles, cooperative, clusters of 2 along m (int8: m >= 2048;
                   // fp8: m n k >= 2^40)
  kLargeCoop = 5,  // fp8 only, no default: 128 x 128 x 128 cooperative, clusters of 2 along m
  kTall = 6,       // fp8 only, no default: 256 x 128 x 128 cooperative, clusters of 2 along m
};
constexpr int kNumScaledMmTiles = 7;
const char* scaled_mm_tile_name(ScaledMmTile tile);
// Whether cutlass_scaled_mm has a kernel of `tile` for ab_dtype operands (kAuto: always).
bool scaled_mm_tile_instantiated(ScaledMmTile tile, DType ab_dtype);
// The tile the launcher uses for an m x n output of ab_dtype operands over k when given kAuto
// (for the current device's SM count; scaled_mm.cu says where each rule was measured).
ScaledMmTile default_scaled_mm_tile(int64_t m, int64_t n, int64_t k, DType ab_dtype);

// out[m, n] = a_scales ⊙ (A @ B) ⊙ b_scales (+ bias[n]), accumulated in fp32 (fp8) or int32
// (int8), scaled in fp32 and rounded once to out_dtype; no extra pass over out.
//   out:      [m, n] out_dtype (bf16 or fp16), row stride out_stride (a multiple of 8)
//   a:        [m, k] ab_dtype (kFp8E4M3 or kInt8), row stride a_stride (a multiple of 16)
//   b:        [n, k] ab_dtype (B column-major), row stride b_stride (a multiple of 16)
//   a_scales: fp32, [m] when a_per_token else [1]
//   b_scales: fp32, [n] when b_per_channel else [1]
//   bias:     [n] out_dtype, or nullptr
// k and n must be multiples of 16 (vLLM's condition), m >= 1; all pointers 16-byte aligned
// except the scales and bias. Else cudaErrorInvalidValue (with a line on stderr). tile: see
// ScaledMmTile. Captures in a CUDA graph: no allocation, no synchronization.
cudaError_t cutlass_scaled_mm(void* out, const void* a, const void* b, const float* a_scales,
                              const float* b_scales, const void* bias, DType ab_dtype,
                              DType out_dtype, int64_t m, int64_t n, int64_t k, int64_t out_stride,
                              int64_t a_stride, int64_t b_stride, bool a_per_token,
                              bool b_per_channel, cudaStream_t stream,
                              ScaledMmTile tile = ScaledMmTile::kAuto);

// int8 with asymmetric activations (vLLM's cutlass_scaled_mm_azp): A holds q = round(x / s_a) +
// zp, so x @ W = s_a * s_b * (A @ B - zp * colsum(B)).
//   azp_adj: [n] int32. Without azp: zp (per-tensor) times colsum(B), already multiplied in.
//            With azp: colsum(B) alone.
//   azp:     [m] int32 per-token zero points, or nullptr (per-tensor: folded into azp_adj)
// out = a_scales * b_scales * (A @ B - (azp ? azp[i] * azp_adj[j] : azp_adj[j])) (+ bias[j]),
// the correction subtracted in int32 before the scales (as vLLM's epilogue). Everything else as
// cutlass_scaled_mm with ab_dtype = kInt8; tile must be kAuto, kM256 or kLarge.
cudaError_t cutlass_scaled_mm_azp(void* out, const void* a, const void* b, const float* a_scales,
                                  const float* b_scales, const int32_t* azp_adj, const int32_t* azp,
                                  const void* bias, DType out_dtype, int64_t m, int64_t n,
                                  int64_t k, int64_t out_stride, int64_t a_stride, int64_t b_stride,
                                  bool a_per_token, bool b_per_channel, cudaStream_t stream,
                                  ScaledMmTile tile = ScaledMmTile::kAuto);

// The group sizes of the block-scaled fp8 GEMM (DeepSeek-V3, Qwen3-FP8): activations scaled per
// 1 x 128 group, weights per 128 x 128 block.
constexpr int64_t kScaledMmBlockK = 128;
constexpr int64_t kScaledMmBlockN = 128;

// Block-scaled fp8: out[i, j] = sum over g of a_scales[i, g] * b_scales[g, j / 128] *
// sum_{kk in group g} A[i, kk] * B[kk, j], groups g of 128 along k, fp32 throughout.
//   a:        [m, k] fp8 e4m3, row stride a_stride (a multiple of 16)
//   b:        [n, k] fp8 e4m3 (B column-major), row stride b_stride (a multiple of 16)
//   a_scales: fp32 [m, k / 128], column-major: element (i, g) at a_scales[g * a_scales_stride +
//             i], a_scales_stride >= m and a multiple of 4 (vLLM's per_token_group_quant_fp8
//             with column_major_scales gives this layout)
//   b_scales: fp32 [k / 128, ceil(n / 128)], element (g, jb) at b_scales[jb * (k / 128) + g]:
//             the checkpoint's weight_scale_inv [ceil(n / 128), k / 128] row-major (vLLM passes
//             its transpose)
//   out:      [m, n] bf16 or fp16, row stride out_stride (a multiple of 8)
//   bias:     [n] out_dtype, added after the sum, or nullptr
// k a multiple of 128, n a multiple of 16.
cudaError_t cutlass_scaled_mm_blockwise(void* out, const void* a, const void* b,
                                        const float* a_scales, const float* b_scales,
                                        const void* bias, DType out_dtype, int64_t m, int64_t n,
                                        int64_t k, int64_t out_stride, int64_t a_stride,
                                        int64_t b_stride, int64_t a_scales_stride,
                                        cudaStream_t stream);

}  // namespace pyorch
