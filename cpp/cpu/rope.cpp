// CPU rotary embedding: one token per task, each head staged through fp32 and rotated in place.
#include <cmath>
#include <vector>

#include <ATen/Parallel.h>

#include "cpu/cpu_utils.h"
#include "ops.h"
#include "rope_checks.h"

namespace pyorch::cpu {
namespace {

using pyorch::heads_view;
using pyorch::HeadsView;

// neox: x1 = x[:half], x2 = x[half:2*half] (separate restrict pointers so the loop vectorizes).
inline void rotate_neox(float* __restrict__ x1, float* __restrict__ x2,
                        const float* __restrict__ cos, const float* __restrict__ sin,
                        int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float a = x1[i];
    const float b = x2[i];
    x1[i] = a * cos[i] - b * sin[i];
    x2[i] = b * cos[i] + a * sin[i];
  }
}

// gpt-j: pairs (x[2i], x[2i + 1]).
inline void rotate_gptj(float* __restrict__ x, const float* __restrict__ cos,
                        const float* __restrict__ sin, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float a = x[2 * i];
    const float b = x[2 * i + 1];
    x[2 * i] = a * cos[i] - b * sin[i];
    x[2 * i + 1] = b * cos[i] + a * sin[i];
  }
}

template <typename T, typename CacheT>
void rope_tokens(const int64_t* positions, T* query, T* key, const CacheT* cache,
                 int64_t num_tokens, const HeadsView& q, const HeadsView& k, int64_t rot_dim,
                 int64_t max_position, int64_t cache_stride, bool is_neox,
                 const T* q_norm_weight = nullptr, const T* k_norm_weight = nullptr,
                 float norm_eps = 0.f) {
  const int64_t half = rot_dim / 2;
  const int64_t total_heads = q.num_heads + k.num_heads;
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, total_heads * rot_dim));
  at::parallel_for(0, num_tokens, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(2 * rot_dim);  // [cos | sin] of the token, then one head
    float* cos = buf.data();
    float* sin = cos + half;
    float* x = buf.data() + rot_dim;
    for (int64_t t = begin; t < end; ++t) {
      const int64_t pos = positions[t];
      TORCH_CHECK(pos >= 0 && pos < max_position, "rotary_embedding: position ", pos,
                  " is outside the cos_sin_cache [0, ", max_position, ")");
      to_float(cache + pos * cache_stride, cos, rot_dim);
      for (int64_t h = 0; h < total_heads; ++h) {
        T* head = h < q.num_heads ? query + t * q.token_stride + h * q.head_stride
                                  : key + t * k.token_stride + (h - q.num_heads) * k.head_stride;
        to_float(head, x, rot_dim);
        if (q_norm_weight != nullptr) {  // rot_dim == head_size (checked): rms_norm's arithmetic
          const T* w = h < q.num_heads ? q_norm_weight : k_norm_weight;
          float sum_sq = 0.f;
          for (int64_t i = 0; i < rot_dim; ++i) sum_sq += x[i] * x[i];
          const float inv_rms = 1.f / std::sqrt(sum_sq / static_cast<float>(rot_dim) + norm_eps);
          for (int64_t i = 0; i < rot_dim; ++i) {
            const float normed = static_cast<float>(static_cast<T>(x[i] * inv_rms));
            x[i] = static_cast<float>(static_cast<T>(normed * static_cast<float>(w[i])));
          }
        }
        if (is_neox) {
          rotate_neox(x, x + half, cos, sin, half);
        } else {
          rotate_gptj(x, cos, sin, half);
        }
        from_float(x, head, rot_dim);
      }
    }
  });
}

}  // namespace

void rotary_embedding(const at::Tensor& positions, at::Tensor& query, std::optional<at::Tensor> key,
                      int64_t head_size, const at::Tensor& cos_sin_cache, bool is_neox) {
  TORCH_CHECK(positions.device().is_cpu() && query.device().is_cpu() &&
                  cos_sin_cache.device().is_cpu() && (!key.has_value() || key->device().is_cpu()),
              "rotary_embedding: tensors must be on CPU");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.dim() == 1,
              "rotary_embedding: positions must be a [num_tokens] int64 tensor");
  const at::ScalarType dtype = query.scalar_type();
  const int64_t rot_dim = pyorch::check_rope_args(query, head_size, cos_sin_cache);
  const at::Tensor pos = positions.contiguous();
  const int64_t num_tokens = pos.size(0);
  const HeadsView q = heads_view(query, num_tokens, head_size, "query");
  HeadsView k{0, 0, 0};
  if (key.has_value()) {
    TORCH_CHECK(key->scalar_type() == dtype, "rotary_embedding: key dtype must match query");
    k = heads_view(*key, num_tokens, head_size, "key");
  }
  PYORCH_CPU_DISPATCH_FLOATS(dtype, "rotary_embedding", [&] {
    scalar_t* k_ptr = key.has_value() ? key->data_ptr<scalar_t>() : nullptr;
    auto run = [&](const auto* cache) {
      rope_tokens(pos.const_data_ptr<int64_t>(), query.data_ptr<scalar_t>(), k_ptr, cache,
                  num_tokens, q, k, rot_dim, cos_sin_cache.size(0), cos_sin_cache.stride(0),
                  is_neox);
    };
    if (cos_sin_cache.scalar_type() == at::kFloat) {
      run(cos_sin_cache.const_data_ptr<float>());
    } else {
      run(cos_sin_cache.const_data_ptr<scalar_t>());
    }
  });
}

// The two ops in order: the CUDA kernel's contract is exactly this composition.
void rotary_embedding_and_cache(const at::Tensor& positions, at::Tensor& query, at::Tensor& key,
                                const at::Tensor& value, int64_t head_size,
                                const at::Tensor& cos_sin_cache, bool is_neox,
                                at::Tensor& key_cache, at::Tensor& value_cache,
                                const at::Tensor& slot_mapping, const std::string& kv_cache_dtype,
                                const at::Tensor& k_scale, const at::Tensor& v_scale,
                                const std::optional<at::Tensor>& q_norm_weight,
                                const std::optional<at::Tensor>& k_norm_weight, double norm_eps) {
  const pyorch::RopeCacheShape s = pyorch::check_rope_and_cache(
      positions, query, key, value, head_size, cos_sin_cache, key_cache, value_cache, slot_mapping,
      kv_cache_dtype, k_scale, v_scale);
  if (pyorch::check_qk_norm(query, q_norm_weight, k_norm_weight, head_size, s.rot_dim)) {
    TORCH_CHECK(query.device().is_cpu() && cos_sin_cache.device().is_cpu(),
                "rotary_embedding_and_cache: tensors must be on CPU");
    const at::Tensor pos = positions.contiguous();
    PYORCH_CPU_DISPATCH_FLOATS(query.scalar_type(), "rotary_embedding_and_cache", [&] {
      auto run = [&](const auto* cache) {
        rope_tokens(pos.const_data_ptr<int64_t>(), query.data_ptr<scalar_t>(),
                    key.data_ptr<scalar_t>(), cache, s.cache.num_tokens, s.query, s.key, s.rot_dim,
                    cos_sin_cache.size(0), cos_sin_cache.stride(0), is_neox,
                    q_norm_weight->const_data_ptr<scalar_t>(),
                    k_norm_weight->const_data_ptr<scalar_t>(), static_cast<float>(norm_eps));
      };
      if (cos_sin_cache.scalar_type() == at::kFloat) {
        run(cos_sin_cache.const_data_ptr<float>());
      } else {
        run(cos_sin_cache.const_data_ptr<scalar_t>());
      }
    });
  } else {
    rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox);
  }
  reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale,
                          v_scale);
}

}  // namespace pyorch::cpu
