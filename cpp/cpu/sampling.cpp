// CPU apply_token_bitmask_inplace: logits[r, t] = -inf where bit t of bitmask row r is 0; and
// random_sample_from_logits with the CUDA kernel's Philox words and float32 expression.
//
// A row is walked one 32-bit mask word at a time; all-ones words (unconstrained rows, free text
// inside a JSON string) are skipped without touching the logits.
#include <cmath>
#include <limits>

#include <ATen/Parallel.h>

#include "cpu/cpu_utils.h"
#include "ops.h"
#include "pyorch/philox.h"
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

// a is better than b (random_sample_kernel's rule): NaN beats any number, then the larger value,
// then the lower index.
bool sample_better(float av, int64_t ai, float bv, int64_t bi) {
  const bool a_nan = std::isnan(av);
  const bool b_nan = std::isnan(bv);
  if (a_nan != b_nan) return a_nan;
  if (!a_nan && av != bv) return av > bv;
  return ai < bi;
}

template <typename T>
int64_t sample_row(const T* __restrict__ x, int64_t vocab_size, float t, uint64_t seed) {
  float best = -std::numeric_limits<float>::infinity();
  int64_t best_idx = 0;
  const bool greedy = !(t > 0.f);
  for (int64_t j0 = 0; j0 < vocab_size; j0 += 4) {
    philox::U32x4 words{};
    if (!greedy) words = philox::token_words(seed, static_cast<uint64_t>(j0 / 4));
    const int64_t n = std::min<int64_t>(4, vocab_size - j0);
    for (int64_t e = 0; e < n; ++e) {
      float s = static_cast<float>(x[j0 + e]);
      if (!greedy) {
        const float q = -std::log(philox::uniform_open(words.v[e]));
        s = s / t - std::log(q);
      }
      if (j0 + e == 0 || sample_better(s, j0 + e, best, best_idx)) {
        best = s;
        best_idx = j0 + e;
      }
    }
  }
  return best_idx;
}

}  // namespace

void random_sample_from_logits(at::Tensor& out, const at::Tensor& logits,
                               const at::Tensor& temperature, const at::Tensor& seeds) {
  constexpr const char* op = "random_sample_from_logits";
  TORCH_CHECK(logits.device().is_cpu(), op, ": tensors must be on CPU");
  pyorch::check_random_sample(out, logits, temperature, seeds);
  const int64_t num_rows = logits.size(0);
  const int64_t vocab_size = logits.size(1);
  const int64_t stride = logits.stride(0);
  const float* temp = temperature.const_data_ptr<float>();
  const int64_t* seed = seeds.const_data_ptr<int64_t>();
  int64_t* dst = out.data_ptr<int64_t>();
  PYORCH_CPU_DISPATCH_FLOATS(logits.scalar_type(), op, [&] {
    const scalar_t* base = logits.const_data_ptr<scalar_t>();
    at::parallel_for(0, num_rows, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        dst[r] = sample_row(base + r * stride, vocab_size, temp[r], static_cast<uint64_t>(seed[r]));
      }
    });
  });
}

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
