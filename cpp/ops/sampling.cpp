// CUDA adapters of apply_token_bitmask_inplace and random_sample_from_logits: check, guard, stream,
// call cuda/, check status.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "common.h"
#include "ops.h"
#include "pyorch/sampling.h"
#include "sampling_checks.h"

// logits: [num_rows, vocab_size]; bitmask: [num_rows, ceil(vocab_size / 32)] int32;
// indices: [k] int32 rows to mask, or None for all.
void apply_token_bitmask_inplace(at::Tensor& logits, const at::Tensor& bitmask,
                                 const std::optional<at::Tensor>& indices) {
  TORCH_CHECK(logits.is_cuda(), "apply_token_bitmask_inplace: tensors must be on a CUDA device");
  pyorch::check_token_bitmask(logits, bitmask, indices);
  // An empty index list masks no row; its data pointer may be null, which cuda/ reads as "all".
  if (indices.has_value() && indices->numel() == 0) return;
  const c10::cuda::OptionalCUDAGuard guard(logits.device());
  PYORCH_CHECK_CUDA(pyorch::apply_token_bitmask_inplace(
      logits.data_ptr(), bitmask.const_data_ptr<int32_t>(),
      indices.has_value() ? indices->const_data_ptr<int32_t>() : nullptr,
      pyorch::to_pyorch_dtype(logits.scalar_type()), logits.size(0),
      indices.has_value() ? indices->numel() : logits.size(0), logits.size(1), logits.stride(0),
      bitmask.stride(0), c10::cuda::getCurrentCUDAStream()));
}

// out: [num_rows] int64; logits: [num_rows, vocab_size]; temperature: [num_rows] float32;
// seeds: [num_rows] int64.
void random_sample_from_logits(at::Tensor& out, const at::Tensor& logits,
                               const at::Tensor& temperature, const at::Tensor& seeds) {
  TORCH_CHECK(logits.is_cuda(), "random_sample_from_logits: tensors must be on a CUDA device");
  pyorch::check_random_sample(out, logits, temperature, seeds);
  const c10::cuda::OptionalCUDAGuard guard(logits.device());
  PYORCH_CHECK_CUDA(pyorch::random_sample_from_logits(
      out.data_ptr<int64_t>(), logits.const_data_ptr(), temperature.const_data_ptr<float>(),
      seeds.const_data_ptr<int64_t>(), pyorch::to_pyorch_dtype(logits.scalar_type()),
      logits.size(0), logits.size(1), logits.stride(0), c10::cuda::getCurrentCUDAStream()));
}
