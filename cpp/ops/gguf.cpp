// CUDA adapters for ggml_dequantize, ggml_mul_mat_vec_a8 and ggml_mul_mat_a8 (vLLM's GGUF ops)
// and ggml_mul_mat_vec_fused:
// the shared checks (gguf_checks.h, as the CPU kernels run them), guard, stream, the q8_1
// workspace, call cuda/gguf. No math here.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "common.h"
#include "gguf_checks.h"
#include "gguf_fused.h"
#include "ops.h"
#include "pyorch/gguf.h"

namespace {

void check_gguf_cuda(const at::Tensor& W, const pyorch::gguf::GgmlTypeInfo& info, int64_t type,
                     const char* op) {
  TORCH_CHECK(W.is_cuda(), op, ": W must be a CUDA tensor");
  TORCH_CHECK(pyorch::gguf_block_size(static_cast<int32_t>(type)) == info.block_size &&
                  pyorch::gguf_block_bytes(static_cast<int32_t>(type)) == info.type_size,
              op, ": the CUDA kernels and the shared checks disagree on ", info.name, "'s layout");
  // The decoders read aligned words from the blocks (see cuda/include/pyorch/gguf.h).
  const int64_t align = info.type_size % 4 == 0 ? 4 : 2;
  TORCH_CHECK(reinterpret_cast<uintptr_t>(W.const_data_ptr()) % align == 0, op, ": W (", info.name,
              ") must be ", align, "-byte aligned");
}

// Both products: out [num_tokens, row] of X's dtype; vec: the matrix-vector kernel.
at::Tensor ggml_mul_mat(const at::Tensor& W, const at::Tensor& X, int64_t quant_type, int64_t row,
                        bool vec) {
  const char* op = vec ? "ggml_mul_mat_vec_a8" : "ggml_mul_mat_a8";
  const pyorch::gguf::GgmlTypeInfo info =
      pyorch::gguf::check_ggml_mul_mat(W, X, quant_type, row, op);
  check_gguf_cuda(W, info, quant_type, op);
  const c10::cuda::OptionalCUDAGuard guard(X.device());
  const int64_t num_tokens = X.size(0), cols = X.size(1);
  at::Tensor out = at::empty({num_tokens, row}, X.options());
  // The caching allocator's blocks are at least 16-byte aligned, as the q8_1 workspace must be.
  at::Tensor workspace =
      at::empty({static_cast<int64_t>(pyorch::gguf_workspace_bytes(num_tokens, cols))},
                X.options().dtype(at::kByte));
  const int64_t input_stride = num_tokens <= 1 || cols == 0 ? cols : X.stride(0);
  const int64_t row_bytes = cols / info.block_size * info.type_size;
  const int32_t type = static_cast<int32_t>(quant_type);
  const pyorch::DType dtype = pyorch::to_pyorch_dtype(X.scalar_type());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  if (vec) {
    PYORCH_CHECK_CUDA(pyorch::gguf_mul_mat_vec(
        out.data_ptr(), X.const_data_ptr(), W.const_data_ptr(), workspace.data_ptr(), type, dtype,
        num_tokens, row, cols, row_bytes, input_stride, row, stream));
  } else {
    PYORCH_CHECK_CUDA(pyorch::gguf_mul_mat(out.data_ptr(), X.const_data_ptr(), W.const_data_ptr(),
                                           workspace.data_ptr(), type, dtype, num_tokens, row, cols,
                                           row_bytes, input_stride, row, stream));
  }
  return out;
}

}  // namespace

at::Tensor ggml_dequantize(const at::Tensor& W, int64_t quant_type, int64_t m, int64_t n,
                           std::optional<at::ScalarType> dtype) {
  const at::ScalarType out_dtype = dtype.value_or(at::kHalf);  // vLLM's default
  const pyorch::gguf::GgmlTypeInfo info =
      pyorch::gguf::check_ggml_dequantize(W, quant_type, m, n, out_dtype);
  check_gguf_cuda(W, info, quant_type, "ggml_dequantize");
  const c10::cuda::OptionalCUDAGuard guard(W.device());
  at::Tensor out = at::empty({m, n}, W.options().dtype(out_dtype));
  PYORCH_CHECK_CUDA(pyorch::gguf_dequantize(
      out.data_ptr(), W.const_data_ptr(), static_cast<int32_t>(quant_type),
      pyorch::to_pyorch_dtype(out_dtype), m, n, n / info.block_size * info.type_size, n,
      c10::cuda::getCurrentCUDAStream()));
  return out;
}

at::Tensor ggml_mul_mat_vec_a8(const at::Tensor& W, const at::Tensor& X, int64_t quant_type,
                               int64_t row) {
  return ggml_mul_mat(W, X, quant_type, row, /*vec=*/true);
}

at::Tensor ggml_mul_mat_a8(const at::Tensor& W, const at::Tensor& X, int64_t quant_type,
                           int64_t row) {
  return ggml_mul_mat(W, X, quant_type, row, /*vec=*/false);
}

namespace {
struct CudaOps {
  static void rms_norm(at::Tensor& out, const at::Tensor& x, const at::Tensor& w, double eps) {
    ::rms_norm(out, x, w, eps);
  }
  static void silu_and_mul(at::Tensor& out, const at::Tensor& x) { ::silu_and_mul(out, x); }
  static at::Tensor mul_mat_vec(const at::Tensor& W, const at::Tensor& x, int64_t type,
                                int64_t row) {
    return ::ggml_mul_mat_vec_a8(W, x, type, row);
  }
};
}  // namespace

// One kernel where pyorch::gguf_mul_mat_vec_fused takes the arguments (one token of Q4_K), else
// the ops it fuses in turn.
void ggml_mul_mat_vec_fused(at::Tensor& out, const at::Tensor& X, const at::Tensor& W,
                            int64_t quant_type, int64_t row,
                            const std::optional<at::Tensor>& norm_weight, double eps,
                            const std::string& input_op, const std::string& epilogue) {
  const char* op = "ggml_mul_mat_vec_fused";
  const pyorch::gguf::FusedArgs a = pyorch::gguf::check_ggml_mul_mat_vec_fused(
      out, X, W, quant_type, row, norm_weight, input_op, epilogue, op);
  check_gguf_cuda(W, a.info, quant_type, op);
  if (norm_weight) TORCH_CHECK(norm_weight->is_cuda(), op, ": norm_weight must be on the GPU");
  const c10::cuda::OptionalCUDAGuard guard(X.device());
  const pyorch::GgufInputOp input =
      a.input == pyorch::gguf::FusedInput::kRmsNorm      ? pyorch::GgufInputOp::kRmsNorm
      : a.input == pyorch::gguf::FusedInput::kSiluAndMul ? pyorch::GgufInputOp::kSiluAndMul
                                                         : pyorch::GgufInputOp::kNone;
  const void* g = norm_weight ? norm_weight->const_data_ptr() : nullptr;
  const int32_t type = static_cast<int32_t>(quant_type);
  const pyorch::DType dtype = pyorch::to_pyorch_dtype(X.scalar_type());
  const int64_t row_bytes = a.cols / a.info.block_size * a.info.type_size;
  if (X.size(0) == 1 &&
      pyorch::gguf_mul_mat_vec_fused_supported(X.const_data_ptr(), W.const_data_ptr(), g, type,
                                               dtype, row, a.cols, row_bytes, input)) {
    PYORCH_CHECK_CUDA(pyorch::gguf_mul_mat_vec_fused(
        out.data_ptr(), X.const_data_ptr(), W.const_data_ptr(), g, static_cast<float>(eps), input,
        a.add, type, dtype, row, a.cols, row_bytes, c10::cuda::getCurrentCUDAStream()));
    return;
  }
  pyorch::gguf::ggml_mul_mat_vec_fused_composed<CudaOps>(out, X, W, quant_type, row, norm_weight,
                                                         eps, a);
}
