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

// Checks random_sample_from_logits' arguments: out [num_rows] int64, logits [num_rows, vocab_size]
// (float32/float16/bfloat16, last dim contiguous, 1 <= vocab_size < 2^31 - 4), temperature
// [num_rows] float32 and seeds [num_rows] int64, all contiguous where 1-D and on one device.
inline void check_random_sample(const at::Tensor& out, const at::Tensor& logits,
                                const at::Tensor& temperature, const at::Tensor& seeds) {
  constexpr const char* op = "random_sample_from_logits";
  const at::ScalarType dtype = logits.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16, op,
              ": logits must be float32, float16 or bfloat16, got ", dtype);
  TORCH_CHECK(logits.dim() == 2, op, ": logits must be 2-D [num_rows, vocab_size], got ",
              logits.sizes());
  const int64_t num_rows = logits.size(0);
  TORCH_CHECK(logits.size(1) >= 1 && logits.size(1) < INT32_MAX - 4, op,
              ": vocab_size must be in [1, 2^31 - 5], got ", logits.size(1));
  TORCH_CHECK(logits.size(1) <= 1 || logits.stride(1) == 1, op,
              ": the logits' last dimension must be contiguous");
  const auto check_vector = [&](const at::Tensor& t, at::ScalarType want, const char* name) {
    TORCH_CHECK(t.scalar_type() == want, op, ": ", name, " must be ", want, ", got ",
                t.scalar_type());
    TORCH_CHECK(t.dim() == 1 && t.size(0) == num_rows, op, ": ", name, " must be [", num_rows,
                "], got ", t.sizes());
    TORCH_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous");
    TORCH_CHECK(t.device() == logits.device(), op, ": ", name, " must be on the logits' device (",
                logits.device(), "), got ", t.device());
  };
  check_vector(out, at::kLong, "out");
  check_vector(temperature, at::kFloat, "temperature");
  check_vector(seeds, at::kLong, "seeds");
}

}  // namespace pyorch
