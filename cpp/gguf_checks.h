// GGML block formats and the argument checks shared by the CPU kernels (cpp/cpu/gguf.cpp) and the
// CUDA adapters of ggml_dequantize, ggml_mul_mat_vec_a8 and ggml_mul_mat_a8, so both backends
// accept and reject the same inputs.
//
// A quantized weight of `rows` rows and `cols` columns (cols % block_size == 0) is the GGUF
// tensor's bytes as stored in the file: row after row, each row cols / block_size blocks of
// type_size bytes (torch.uint8 [rows, cols / block_size * type_size]). quant_type is the GGML type
// id (gguf.GGMLQuantizationType).
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

namespace pyorch::gguf {

// GGML type ids (ggml.h / gguf.GGMLQuantizationType) of the types these ops know.
enum GgmlType : int64_t {
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

struct GgmlTypeInfo {
  const char* name;
  int64_t block_size;  // elements per block
  int64_t type_size;   // bytes per block
  bool quantized;      // has a product kernel (ggml_mul_mat_*_a8)
};

// The layout of a known type; false for any other id.
inline bool ggml_type_info(int64_t type, GgmlTypeInfo* info) {
  switch (type) {
    case kF32: *info = {"F32", 1, 4, false}; return true;
    case kF16: *info = {"F16", 1, 2, false}; return true;
    case kBF16: *info = {"BF16", 1, 2, false}; return true;
    case kQ4_0: *info = {"Q4_0", 32, 18, true}; return true;
    case kQ4_1: *info = {"Q4_1", 32, 20, true}; return true;
    case kQ5_0: *info = {"Q5_0", 32, 22, true}; return true;
    case kQ5_1: *info = {"Q5_1", 32, 24, true}; return true;
    case kQ8_0: *info = {"Q8_0", 32, 34, true}; return true;
    case kQ2_K: *info = {"Q2_K", 256, 84, true}; return true;
    case kQ3_K: *info = {"Q3_K", 256, 110, true}; return true;
    case kQ4_K: *info = {"Q4_K", 256, 144, true}; return true;
    case kQ5_K: *info = {"Q5_K", 256, 176, true}; return true;
    case kQ6_K: *info = {"Q6_K", 256, 210, true}; return true;
    default: return false;
  }
}

inline GgmlTypeInfo check_ggml_type(int64_t type, const char* op, bool need_product) {
  GgmlTypeInfo info{};
  TORCH_CHECK(ggml_type_info(type, &info), op, ": GGML type ", type,
              " is not supported (supported: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, "
              "Q2_K, Q3_K, Q4_K, Q5_K, Q6_K)");
  TORCH_CHECK(!need_product || info.quantized, op, ": GGML type ", info.name,
              " has no product kernel (dequantize it with ggml_dequantize and use a matmul)");
  return info;
}

// The weight's bytes for rows x cols of `info`; W must hold exactly those, contiguously.
inline void check_ggml_weight(const at::Tensor& W, const GgmlTypeInfo& info, int64_t rows,
                              int64_t cols, const char* op) {
  TORCH_CHECK(rows >= 0 && cols >= 0, op, ": negative size rows ", rows, ", cols ", cols);
  TORCH_CHECK(cols % info.block_size == 0, op, ": ", cols, " columns are not a whole number of ",
              info.name, " blocks of ", info.block_size);
  TORCH_CHECK(W.is_contiguous(), op, ": W must be contiguous");
  const int64_t row_bytes = cols / info.block_size * info.type_size;
  TORCH_CHECK(W.nbytes() == static_cast<size_t>(rows * row_bytes), op, ": W has ", W.nbytes(),
              " bytes, but ", rows, " rows of ", cols, " ", info.name, " columns take ",
              rows * row_bytes, " (", row_bytes, " per row)");
}

// ggml_dequantize(W, quant_type, m, n, dtype): out [m, n] of dtype.
inline GgmlTypeInfo check_ggml_dequantize(const at::Tensor& W, int64_t type, int64_t m, int64_t n,
                                          at::ScalarType dtype) {
  const char* op = "ggml_dequantize";
  const GgmlTypeInfo info = check_ggml_type(type, op, false);
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16, op,
              ": dtype must be float32, float16 or bfloat16, got ", dtype);
  check_ggml_weight(W, info, m, n, op);
  return info;
}

// ggml_mul_mat_vec_a8 / ggml_mul_mat_a8(W, X, quant_type, row): X [num_tokens, cols]
// fp32/fp16/bf16 (rows contiguous), W `row` rows of cols; out [num_tokens, row] of X's dtype.
// group_bytes > 0: W is in the CPU's repacked layout (cpp/cpu/gguf.cpp), row / 8 groups of
// cols / block_size blocks of group_bytes each.
inline GgmlTypeInfo check_ggml_mul_mat(const at::Tensor& W, const at::Tensor& X, int64_t type,
                                       int64_t row, const char* op, int64_t group_bytes = 0) {
  const GgmlTypeInfo info = check_ggml_type(type, op, true);
  const at::ScalarType dtype = X.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16, op,
              ": X must be float32, float16 or bfloat16, got ", dtype);
  TORCH_CHECK(X.dim() == 2, op, ": X must be [num_tokens, cols], got ", X.sizes());
  TORCH_CHECK(X.size(1) <= 1 || X.stride(1) == 1, op, ": X's last dimension must be contiguous");
  TORCH_CHECK(W.device() == X.device(), op, ": W is on ", W.device(), ", X on ", X.device());
  if (group_bytes <= 0) {
    check_ggml_weight(W, info, row, X.size(1), op);
    return info;
  }
  const int64_t cols = X.size(1);
  TORCH_CHECK(row >= 0 && row % 8 == 0, op, ": row ", row,
              " is not a multiple of 8 (rows are repacked in groups of 8)");
  TORCH_CHECK(cols % info.block_size == 0, op, ": ", cols, " columns are not a whole number of ",
              info.name, " blocks of ", info.block_size);
  TORCH_CHECK(W.is_contiguous(), op, ": W must be contiguous");
  const int64_t bytes = row / 8 * (cols / info.block_size) * group_bytes;
  TORCH_CHECK(W.nbytes() == static_cast<size_t>(bytes), op, ": W has ", W.nbytes(), " bytes, but ",
              row, " rows of ", cols, " ", info.name, " columns take ", bytes, " repacked");
  return info;
}

// What ggml_mul_mat_vec_fused multiplies and how it writes (cpp/gguf_fused.h).
enum class FusedInput { kNone, kRmsNorm, kSiluAndMul };
struct FusedArgs {
  GgmlTypeInfo info;
  FusedInput input;
  bool add;      // out += the product; else out = it
  int64_t cols;  // the product's input size (X's columns, half of them for silu_and_mul)
};

// Whether two tensors' bytes overlap.
inline bool bytes_overlap(const at::Tensor& a, const at::Tensor& b) {
  if (a.numel() == 0 || b.numel() == 0) return false;
  const auto* a0 = static_cast<const char*>(a.const_data_ptr());
  const auto* b0 = static_cast<const char*>(b.const_data_ptr());
  return a0 < b0 + b.nbytes() && b0 < a0 + a.nbytes();
}

// ggml_mul_mat_vec_fused(out, X, W, quant_type, row, norm_weight, eps, input_op, epilogue):
// out [num_tokens, row] (=, or += for epilogue "add") the product of W with f(X), f by input_op:
// "none" (X [num_tokens, cols]), "rms_norm" (rms_norm(X, norm_weight [cols], eps)) or
// "silu_and_mul" (X [num_tokens, 2 * cols]: silu of the first half times the second). X, out and
// norm_weight contiguous, of one dtype; out overlaps neither X nor norm_weight.
inline FusedArgs check_ggml_mul_mat_vec_fused(const at::Tensor& out, const at::Tensor& X,
                                              const at::Tensor& W, int64_t type, int64_t row,
                                              const std::optional<at::Tensor>& norm_weight,
                                              const std::string& input_op,
                                              const std::string& epilogue, const char* op) {
  FusedArgs a{};
  if (input_op == "none") {
    a.input = FusedInput::kNone;
  } else if (input_op == "rms_norm") {
    a.input = FusedInput::kRmsNorm;
  } else if (input_op == "silu_and_mul") {
    a.input = FusedInput::kSiluAndMul;
  } else {
    TORCH_CHECK(false, op, ": input_op must be none, rms_norm or silu_and_mul, got ", input_op);
  }
  TORCH_CHECK(epilogue == "store" || epilogue == "add", op, ": epilogue must be store or add, got ",
              epilogue);
  a.add = epilogue == "add";
  a.info = check_ggml_type(type, op, true);
  const at::ScalarType dtype = X.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16, op,
              ": X must be float32, float16 or bfloat16, got ", dtype);
  TORCH_CHECK(X.dim() == 2 && X.is_contiguous(), op, ": X must be a contiguous [num_tokens, cols]",
              " tensor, got sizes ", X.sizes(), " strides ", X.strides());
  TORCH_CHECK(a.input != FusedInput::kSiluAndMul || X.size(1) % 2 == 0, op,
              ": silu_and_mul needs an even number of columns, got ", X.size(1));
  a.cols = a.input == FusedInput::kSiluAndMul ? X.size(1) / 2 : X.size(1);
  TORCH_CHECK(W.device() == X.device() && out.device() == X.device(), op,
              ": W, X and out must be on one device, got ", W.device(), ", ", X.device(), ", ",
              out.device());
  check_ggml_weight(W, a.info, row, a.cols, op);
  TORCH_CHECK(out.scalar_type() == dtype && out.dim() == 2 && out.size(0) == X.size(0) &&
                  out.size(1) == row && out.is_contiguous(),
              op, ": out must be a contiguous [", X.size(0), ", ", row, "] ", dtype,
              " tensor, got ", out.scalar_type(), " ", out.sizes(), " strides ", out.strides());
  TORCH_CHECK(!bytes_overlap(out, X), op, ": out must not overlap X");
  if (a.input == FusedInput::kRmsNorm) {
    TORCH_CHECK(norm_weight.has_value(), op, ": rms_norm needs norm_weight");
    const at::Tensor& g = *norm_weight;
    TORCH_CHECK(g.dim() == 1 && g.size(0) == a.cols && g.scalar_type() == dtype &&
                    g.is_contiguous() && g.device() == X.device(),
                op, ": norm_weight must be a contiguous [", a.cols, "] ", dtype, " tensor on ",
                X.device(), ", got ", g.scalar_type(), " ", g.sizes(), " on ", g.device());
    TORCH_CHECK(!bytes_overlap(out, g), op, ": out must not overlap norm_weight");
  } else {
    TORCH_CHECK(!norm_weight.has_value(), op, ": norm_weight is rms_norm's, got input_op ",
                input_op);
  }
  return a;
}

}  // namespace pyorch::gguf
