// GGUF (GGML block-quantized) weights on the GPU: dequantize, and matrix products that read the
// quantized blocks directly (vLLM's ggml_dequantize / ggml_mul_mat_vec_a8 / ggml_mul_mat_a8).
//
// A weight of `rows` rows and `cols` columns is the GGUF tensor's bytes as stored in the file: row
// after row, each row cols / block_size(type) blocks of block_bytes(type) bytes, rows
// weight_row_stride_bytes apart (normally cols / block_size * block_bytes). The block layouts are
// ggml's (ggml-common.h; the `gguf` package's gguf/quants.py decodes the same bytes).
//
// The products quantize the activation to q8_1 first: per 32 consecutive values x, d = max|x| /
// 127, q = round-half-even(x * (1 / d)) as int8 (d = 0 gives q = 0), stored as an fp32 d and the
// sums d * sum(q) of each 16-value half. Weight block times activation block is then integer dot
// products (dp4a, or int8 tensor-core mma) scaled once per 16 values, accumulated in fp32:
//   out[t, r] = sum over 16-value groups g of  scale_w(r, g) * d_x(t, g) * sum_i q_w * q_x
//                                            + bias_w(r, g) * d_x(t, g) * sum_i q_x
// where every ggml type is written as w = scale_w * q_w + bias_w with 0 <= q_w < 64 (Q8_0: int8).
// The result is the fp32 product of the dequantized weight with the dequantized q8_1 activation,
// up to fp32 summation order (bench/cpp/bench_gguf.cu and tests/cuda/gguf check exactly that).
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

#include "pyorch/dtype.h"

namespace pyorch {

// GGML type ids (ggml.h, gguf.GGMLQuantizationType) of the types these kernels know.
enum class GgmlType : int32_t {
  kF32 = 0,
  kF16 = 1,
  kQ4_0 = 2,
  kQ4_1 = 3,
  kQ5_0 = 6,
  kQ5_1 = 7,
  kQ8_0 = 8,
  kQ2_K = 10,
  kQ3_K = 11,
  kQ4_K = 12,
  kQ5_K = 13,
  kQ6_K = 14,
  kBF16 = 30,
};

// Elements and bytes of one block of `type` (1 and the element size for F32/F16/BF16); 0 for an
// id not listed above.
int64_t gguf_block_size(int32_t type);
int64_t gguf_block_bytes(int32_t type);
// Whether `type` has product kernels (the ten quantized types).
bool gguf_has_mul_mat(int32_t type);
// "Q4_K" etc.; "unknown" for other ids.
const char* gguf_type_name(int32_t type);

// The most tokens gguf_mul_mat_vec handles in one pass over the weight; more tokens are processed
// in passes of this many (the engine switches to gguf_mul_mat before that: vLLM uses the vector
// kernel up to 8 tokens).
constexpr int64_t kGgufMulMatVecMaxTokens = 8;

// out [rows, cols] (row stride out_stride elements, of dtype fp32 / fp16 / bf16) = the dequantized
// weight. type: any GgmlType (F32/F16/BF16 are converted). Every value is the one gguf's
// dequantize computes in fp32, rounded once to dtype.
cudaError_t gguf_dequantize(void* out, const void* weight, int32_t type, DType dtype, int64_t rows,
                            int64_t cols, int64_t weight_row_stride_bytes, int64_t out_stride,
                            cudaStream_t stream);

// Bytes of device scratch gguf_mul_mat_vec / gguf_mul_mat need for the q8_1 activation of
// num_tokens x input_size (input_size a multiple of 32). 16-byte aligned sizes.
size_t gguf_workspace_bytes(int64_t num_tokens, int64_t input_size);

// out = input @ dequantize(weight)^T through q8_1 activations (see the top of this file).
//   out:       [num_tokens, output_size]  (row stride out_stride elements, of dtype)
//   input:     [num_tokens, input_size]   (row stride input_stride elements, of dtype)
//   weight:    [output_size, input_size] of `type` blocks (row stride weight_row_stride_bytes;
//              rows 4-byte aligned where the block size is a multiple of 4 bytes, else 2-byte
//              aligned; the vector kernel streams rows with 16-byte loads from the 16-byte
//              boundary at or below each row's start)
//   workspace: gguf_workspace_bytes(num_tokens, input_size) bytes, 16-byte aligned
// dtype: fp32, fp16 or bf16. type: one of the ten quantized types, input_size a multiple of its
// block size. Captures in a CUDA graph: no allocation, no synchronization.
// How gguf_mul_mat_vec launches; a field < 0 means "the launcher picks". Exposed for the
// benchmark's sweep (bench/cpp/bench_gguf.cu); callers normally pass nullptr. None of it changes
// the result.
struct GgufMulMatVecConfig {
  int subs_per_lane = -1;  // 2 or 4: 32-value sub-blocks per lane per tile (the tile's size)
  int num_stages = -1;     // 2..4: the shared-memory ring of tiles per warp (stages - 1 in flight)
  int l2_prefetch = -1;    // 1: the weight copies carry the L2::256B prefetch hint, 0: they do not
  int pdl = -1;     // 1: programmatic dependent launch where pdl_enabled() (the first weight tiles
                    // are requested while the kernel before it finishes), 0: a plain launch
  int warps = -1;   // 1..8 (1..4 without fuse_x; 1..32 in the direct form): weight rows (warps)
                    // per thread block
  int fuse_x = -1;  // 1: one token's product quantizes x itself (no q8_1 kernel; needs x 16-byte
                    // aligned, else refused), 0: the q8_1 kernel runs first
  int direct = -1;  // Q4_K, one token, fuse_x: 1 the direct form (lanes load their quants into
                    // registers, no ring; weight and row stride 16-byte aligned, else refused),
                    // 0 the ring form. The launcher takes the direct form where it can.
  int blocks_per_sm = -1;  // the direct form: thread blocks per SM in its grid (at most the
                           // resident ones; fewer leave room for the next kernel's blocks)
};

// Whether one token's Q4_K product may take the direct form (default on; GgufMulMatVecConfig's
// `direct` wins where a caller sets it). Process state, for comparisons
// (PYORCH_GGUF_Q4K_DIRECT); set it before any CUDA graph is captured.
void set_gguf_q4k_direct(bool on);
bool gguf_q4k_direct();

// gguf_mul_mat_vec: one warp streams each weight row with 16-byte loads and dp4a, for few tokens.
cudaError_t gguf_mul_mat_vec(void* out, const void* input, const void* weight, void* workspace,
                             int32_t type, DType dtype, int64_t num_tokens, int64_t output_size,
                             int64_t input_size, int64_t weight_row_stride_bytes,
                             int64_t input_stride, int64_t out_stride, cudaStream_t stream,
                             const GgufMulMatVecConfig* config = nullptr);
// What a fused one-token product multiplies instead of x (gguf_mul_mat_vec_fused).
enum class GgufInputOp : int32_t {
  kNone = 0,        // x itself: input_size values
  kRmsNorm = 1,     // rms_norm(x) * norm_weight (rms_norm's roundings): input_size values of x
  kSiluAndMul = 2,  // silu(x[:input_size]) * x[input_size:] (silu_and_mul's): 2 * input_size
};

// Whether gguf_mul_mat_vec_fused takes these arguments: one token's Q4_K product in the direct
// form (gguf_q4k_direct() on; weight, row stride, x and norm_weight 16-byte aligned; x's values
// fit the form's shared memory; 1 <= output_size <= 2^30). Elsewhere a caller composes
// rms_norm / silu_and_mul, gguf_mul_mat_vec and an add (cpp/ops/gguf.cpp does).
bool gguf_mul_mat_vec_fused_supported(const void* input, const void* weight,
                                      const void* norm_weight, int32_t type, DType dtype,
                                      int64_t output_size, int64_t input_size,
                                      int64_t weight_row_stride_bytes, GgufInputOp input_op);
// Warps per thread block of gguf_mul_mat_vec_fused's kernel (1..32, clamped; default 32); its grid
// is one thread block per SM, so with 16 or fewer the next kernel's blocks fit beside it (under PDL
// they start streaming their weights while it runs). Process state
// (PYORCH_GGUF_FUSED_WARPS), for comparisons; set it before any CUDA graph is captured.
void set_gguf_fused_warps(int warps);
int gguf_fused_warps();
// One token, one kernel: out[r] = dequantize(weight[r]) . q8_1(f(x)) with f the input op, or with
// accumulate out[r] = out[r] + that (rounded to dtype first: the residual stream's add). The
// engine's decode layer takes its norms, SiLU-and-mul and residual adds out of their own kernels
// this way. out [output_size] and x of dtype (fp32 / fp16 / bf16), norm_weight [input_size] of
// dtype (kRmsNorm, eps its epsilon; else unused). Refuses what gguf_mul_mat_vec_fused_supported
// does not take. Captures in a CUDA graph.
cudaError_t gguf_mul_mat_vec_fused(void* out, const void* input, const void* weight,
                                   const void* norm_weight, float eps, GgufInputOp input_op,
                                   bool accumulate, int32_t type, DType dtype, int64_t output_size,
                                   int64_t input_size, int64_t weight_row_stride_bytes,
                                   cudaStream_t stream);

// gguf_mul_mat: tiles of 64 weight rows (32 where the grid would be small) x 32 tokens, unpacked
// to int8 in shared memory, int8 tensor-core mma (m16n8k16), for many tokens; output_size at
// most 65535 * 32 for grids under 256 tiles of 64 rows, 65535 * 64 otherwise.
cudaError_t gguf_mul_mat(void* out, const void* input, const void* weight, void* workspace,
                         int32_t type, DType dtype, int64_t num_tokens, int64_t output_size,
                         int64_t input_size, int64_t weight_row_stride_bytes, int64_t input_stride,
                         int64_t out_stride, cudaStream_t stream);

// The q8_1 activation alone (exposed for the benchmark's reference path and for tests):
//   xq:  [num_tokens, input_size] int8 (contiguous)
//   xds: [num_tokens, input_size / 32] float4 (d, d * sum(q[0:16]), d * sum(q[16:32]), 0)
// workspace above is exactly xq followed by xds (at gguf_workspace_xds_offset).
size_t gguf_workspace_xds_offset(int64_t num_tokens, int64_t input_size);
cudaError_t gguf_quantize_q8_1(void* workspace, const void* input, DType dtype, int64_t num_tokens,
                               int64_t input_size, int64_t input_stride, cudaStream_t stream);

}  // namespace pyorch
