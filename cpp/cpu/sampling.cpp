// CPU apply_token_bitmask_inplace: logits[r, t] = -inf where bit t of bitmask row r is 0.
//
// A row is walked one 32-bit mask word at a time; all-ones words (unconstrained rows, free text
// inside a JSON string) are skipped without touching the logits.
#include <limits>

#include <ATen/Parallel.h>

#include "cpu/cpu_utils.h"
#include "ops.h"
#include "sampling_checks.h"

namespace pyorch::cpu {
namespace {

template <typename T>
void mask_row(T* __restrict__ row, const int32_t* __restrict__ words, int64_t vocab_size) {
  const T neg_inf = static_cast<T>(-std::numeric_limits<float>::infinity());
  const int64_t num_words = (vocab_size + 31) / 32;
  for (int64_t w = 0; w < num_words; ++w) {
    const uint32_t word = static_cast<uint32_t>(words[w]);
    if (word == 0xffffffffu) continue;
    const int64_t first = w * 32;
    const int64_t num_bits = std::min<int64_t>(32, vocab_size - first);
    for (int64_t b = 0; b < num_bits; ++b) {
      if (((word >> b) & 1u) == 0u) row[first + b] = neg_inf;
    }
  }
}

}  // namespace

void apply_token_bitmask_inplace(at::Tensor& logits, const at::Tensor& bitmask,
                                 const std::optional<at::Tensor>& indices) {
  constexpr const char* op = "apply_token_bitmask_inplace";
  TORCH_CHECK(logits.device().is_cpu(), op, ": tensors must be on CPU");
  pyorch::check_token_bitmask(logits, bitmask, indices);
  const int64_t num_rows = logits.size(0);
  const int64_t vocab_size = logits.size(1);
  const int64_t logits_stride = logits.stride(0);
  const int64_t bitmask_stride = bitmask.stride(0);
  const int32_t* idx = indices.has_value() ? indices->const_data_ptr<int32_t>() : nullptr;
  const int64_t num_masked = indices.has_value() ? indices->numel() : num_rows;
  for (int64_t i = 0; idx != nullptr && i < num_masked; ++i) {
    TORCH_CHECK(0 <= idx[i] && idx[i] < num_rows, op, ": index ", idx[i], " out of range [0, ",
                num_rows, ")");
  }
  if (num_masked == 0 || vocab_size == 0) return;
  const int32_t* words = bitmask.const_data_ptr<int32_t>();
  PYORCH_CPU_DISPATCH_FLOATS(logits.scalar_type(), op, [&] {
    scalar_t* base = logits.data_ptr<scalar_t>();
    at::parallel_for(0, num_masked, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t row = idx == nullptr ? i : idx[i];
        mask_row(base + row * logits_stride, words + row * bitmask_stride, vocab_size);
      }
    });
  });
}

}  // namespace pyorch::cpu
