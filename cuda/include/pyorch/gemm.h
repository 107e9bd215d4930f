// Matrix products of the linear layers that cuBLAS serves poorly: the "skinny" GEMM of decode.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "pyorch/dtype.h"

namespace pyorch {

// The most rows of input (tokens) skinny_gemm takes. The engine may use it for fewer (see
// pyorch/layers/linear.py): past some M cuBLAS's tiled GEMM is the faster of the two.
constexpr int64_t kSkinnyGemmMaxTokens = 16;

// How skinny_gemm launches; a field < 0 means "the launcher picks". Exposed for the benchmark's
// sweep (bench/cpp/bench_gemm.cu); callers normally pass nullptr. None of it changes the result.
struct SkinnyGemmConfig {
  int num_warps = -1;        // warps per thread block, splitting K between them: 4, 8 or 16
  int l2_prefetch = -1;      // 1: weight loads carry the L2::256B prefetch hint, 0: they do not
  int prefetch_slices = -1;  // 128-wide K slices of its 16 rows each warp asks of L2 up front
  int pdl = -1;              // 1: launch with programmatic dependent launch where pdl_enabled()
                 // (pyorch/launch.h: the GPU has it and the process did not turn it off; the
                 // weight stream starts while the previous kernel drains), 0: a plain launch  //
                 // skinny_gemm_fp8 with a normed input at <= 8 tokens only (the fp16/bf16 forms and
                 // the other
  // fp8 forms have no such choice and leave it unread): 1 norms each K slice's x rows once per
  // warp into shared memory and feeds the mmas from there, 0 has every lane norm its own
  // fragments (the same products; the sum of squares in another order).
  int stage_x = -1;
};

// The configuration skinny_gemm uses when given none; normed: skinny_gemm_fused's picks for a
// normed input (norm_weight), which differ.
SkinnyGemmConfig default_skinny_gemm_config(int64_t num_tokens, int64_t output_size,
                                            int64_t input_size, bool normed = false);

// The picks skinny_gemm made before they were re-swept over a 2 GB span of weights (2026-11-27):
// 4 warps and the L2::256B hint, 8 warps from K = 8192, no hint past 8 tokens, 16 warps without
// the hint from 4096 blocks.
SkinnyGemmConfig legacy_skinny_gemm_config(int64_t num_tokens, int64_t output_size,
                                           int64_t input_size);

// Process-wide: default_skinny_gemm_config returns legacy_skinny_gemm_config's picks for every
// fp16/bf16 skinny GEMM launched afterwards, and skinny_gemm_fp8 its own picks from before its
// 2 GB-span sweep (off by default). For A/B timing of the engine;
// pyorch sets it from PYORCH_SKINNY_GEMM_LEGACY_PICKS when its extension loads. Safe from any
// thread; set it before CUDA graphs are captured (a graph keeps the launches it recorded).
void set_skinny_gemm_legacy_picks(bool on);
bool skinny_gemm_legacy_picks();

// out = input @ weight^T (+ bias), accumulated in fp32 and rounded once: torch's F.linear for
// few rows. Each thread block owns 16 whole output columns (weight rows), so the result is
// deterministic and there is no split-K pass.
//   out:    [num_tokens, output_size]  (row stride out_stride, last dimension contiguous)
//   input:  [num_tokens, input_size]   (row stride input_stride, a multiple of 8; 16-byte aligned)
//   weight: [output_size, input_size]  (contiguous, 16-byte aligned): nn.Linear's layout
//   bias:   [output_size] or nullptr
// dtype: fp16 or bf16 (all four share it). num_tokens <= kSkinnyGemmMaxTokens and input_size a
// multiple of 8, else cudaErrorInvalidValue. out must not overlap input, weight or bias.
// Captures in a CUDA graph: no allocation, no synchronization.
cudaError_t skinny_gemm(void* out, const void* input, const void* weight, const void* bias,
                        DType dtype, int64_t num_tokens, int64_t output_size, int64_t input_size,
                        int64_t out_stride, int64_t input_stride, cudaStream_t stream,
                        const SkinnyGemmConfig* config = nullptr);

// What skinny_gemm_fused does with the product p = norm(input) @ weight^T + bias (fp32). The
// kernel templates (cuda/gemm/skinny_gemm.cuh) take the same enum as a template parameter.
enum class SkinnyGemmEpilogue : int {
  kStore = 0,    // out = p, rounded once (skinny_gemm)
  kSiluMul = 1,  // weight is [gate; up], output_size = 2 * d rows: out [num_tokens, d] =
                 // silu(gate) * up, gate and up each rounded first (silu_and_mul's inputs)
  kAdd = 2,      // out += p rounded: the residual stream's add, in place
};

// skinny_gemm with the decoder layer's neighbours fused into it:
//   norm_weight: [input_size] or nullptr. With it the input is RMS-normed on the fly:
//     p = inv_rms * ((input * norm_weight) @ weight^T) + bias, inv_rms = rsqrt(mean(input^2) +
//     eps) per token (fp32), input * norm_weight rounded to dtype before the product. Close to,
//     not bit-equal with, rms_norm followed by skinny_gemm (that rounds input * inv_rms first).
//   epilogue: see SkinnyGemmEpilogue. kSiluMul needs an even output_size; out then has
//     output_size / 2 columns. kAdd reads and writes out (which must not overlap input).
// Everything else as skinny_gemm; norm_weight shares the dtype and must be 16-byte aligned.
// Launched without PDL unless config->pdl = 1: in a chain of these GEMMs an early-launched one
// slowed the one before it (see gemm.cu).
cudaError_t skinny_gemm_fused(void* out, const void* input, const void* weight, const void* bias,
                              const void* norm_weight, float eps, SkinnyGemmEpilogue epilogue,
                              DType dtype, int64_t num_tokens, int64_t output_size,
                              int64_t input_size, int64_t out_stride, int64_t input_stride,
                              cudaStream_t stream, const SkinnyGemmConfig* config = nullptr);

// ---- fp8 weights (cuda/gemm/skinny_gemm_fp8.cu) ----
// skinny_gemm_fused with float8_e4m3fn weights and fp16/bf16 activations, the decode path of the
// fp8 linear methods (W8A16 numerics: the activations are not quantized):
//   p = weight_scale * (norm(input) @ widen(weight)^T) + bias
// where widen(weight) is the e4m3 values exactly in dtype, each product summed in fp32 on the
// tensor cores, and weight_scale [output_size] (weight_scale_per_channel) or [1] fp32 multiplies
// the fp32 sum of each output (kSiluMul: the gate's and the up's own scales). The norm and the
// epilogues as skinny_gemm_fused. weight: [output_size, input_size] e4m3, contiguous, 16-byte
// aligned; input_size a multiple of 16. config->num_warps 4 or 8 (16 is a bf16-only form; the
// default config's 16 becomes 8). pdl < 0 (config nullptr or config->pdl < 0): PDL for the plain
// form (kStore, no norm: it follows a norm or activation kernel), off for the fused ones.
cudaError_t skinny_gemm_fp8(void* out, const void* input, const void* weight,
                            const float* weight_scale, bool weight_scale_per_channel,
                            const void* bias, const void* norm_weight, float eps,
                            SkinnyGemmEpilogue epilogue, DType dtype, int64_t num_tokens,
                            int64_t output_size, int64_t input_size, int64_t out_stride,
                            int64_t input_stride, cudaStream_t stream,
                            const SkinnyGemmConfig* config = nullptr);

// Process-wide launch overrides of skinny_gemm_fp8's picks, one per form the decode layer runs:
// kSkinnyFp8Plain (kStore, no norm), kSkinnyFp8Normed (kStore with a norm: qkv_proj),
// kSkinnyFp8NormedSilu (norm + kSiluMul: gate_up), kSkinnyFp8Add (kAdd: o_proj, down). A field
// >= 0 replaces the pick (prefetch_slices: slices per warp asked of L2 before the main loop,
// whatever the PDL setting; stage_x: the normed forms' staged norm); -1 leaves it. A config passed
// to skinny_gemm_fp8 still wins over both. For A/B timing inside the engine; pyorch sets them from
// PYORCH_SKINNY_FP8_OVERRIDE when its extension loads. Set them before CUDA graphs are captured.
enum SkinnyFp8Form : int {
  kSkinnyFp8Plain = 0,
  kSkinnyFp8Normed = 1,
  kSkinnyFp8NormedSilu = 2,
  kSkinnyFp8Add = 3,
  kSkinnyFp8NumForms = 4,
};
void set_skinny_gemm_fp8_override(int form, SkinnyGemmConfig config);  // invalid form: ignored
SkinnyGemmConfig skinny_gemm_fp8_override(int form);

}  // namespace pyorch
