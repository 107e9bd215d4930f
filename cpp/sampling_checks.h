// Argument checks shared by the CPU kernel (cpp/cpu/sampling.cpp) and the CUDA adapter
// (cpp/ops/sampling.cpp) of apply_token_bitmask_inplace, so both backends accept the same inputs.
#pragma once

#include <cstdint>
#include <optional>

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

namespace pyorch {

// Checks logits [num_rows, vocab_size] (float32/float16/bfloat16, last dim contiguous) against
// bitmask [num_rows, ceil(vocab_size / 32)] int32 (last dim contiguous) and indices [k] int32
// (1-D, contiguous, on the logits' device).
inline void check_token_bitmask(const at::Tensor& logits, const at::Tensor& bitmask,
                                const std::optional<at::Tensor>& indices) {
  constexpr const char* op = "apply_token_bitmask_inplace";
  const at::ScalarType dtype = logits.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16, op,
              ": logits must be float32, float16 or bfloat16, got ", dtype);
  TORCH_CHECK(bitmask.scalar_type() == at::kInt, op, ": bitmask must be int32, got ",
              bitmask.scalar_type());
  TORCH_CHECK(logits.dim() == 2 && bitmask.dim() == 2, op, ": logits and bitmask must be 2-D, got ",
              logits.sizes(), " and ", bitmask.sizes());
  const int64_t num_words = (logits.size(1) + 31) / 32;
  TORCH_CHECK(bitmask.size(0) == logits.size(0) && bitmask.size(1) == num_words, op,
              ": bitmask must be [num_rows, ceil(vocab_size / 32)] = [", logits.size(0), ", ",
              num_words, "], got ", bitmask.sizes());
  TORCH_CHECK(logits.size(1) <= 1 || logits.stride(1) == 1, op,
              ": the logits' last dimension must be contiguous");
  TORCH_CHECK(bitmask.size(1) <= 1 || bitmask.stride(1) == 1, op,
              ": the bitmask's last dimension must be contiguous");
  TORCH_CHECK(bitmask.device() == logits.device(), op, ": bitmask must be on the logits' device (",
              logits.device(), "), got ", bitmask.device());
  if (indices.has_value()) {
    const at::Tensor& idx = *indices;
    TORCH_CHECK(idx.scalar_type() == at::kInt, op, ": indices must be int32, got ",
                idx.scalar_type());
    TORCH_CHECK(idx.dim() == 1 && idx.is_contiguous(), op,
                ": indices must be a contiguous 1-D tensor, got ", idx.sizes());
    TORCH_CHECK(idx.device() == logits.device(), op, ": indices must be on the logits' device (",
                logits.device(), "), got ", idx.device());
  }
}

}  // namespace pyorch
