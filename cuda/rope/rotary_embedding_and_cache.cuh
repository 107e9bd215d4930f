// Rotary embedding of query and key, and the write of the rotated key and the value into an NHD
// KV cache, in one kernel: what rotary_embedding followed by reshape_and_cache_flash do, with the
// same bits, one launch (and one kernel boundary of a decode step) fewer.
//
// The block shape and the rotation are rotary_embedding_kernel's (rotary_embedding.cuh): a
// thread owns a chunk of VEC_SIZE rotation pairs of one token and walks its heads. A key piece is
// stored twice from the registers that rotated it: in place (as rotary_embedding leaves it) and
// into the key cache at the token's slot. The token's threads also copy the value heads and the
// key elements past rot_dim (partial rotary), which no rotation touches, so no barrier is needed;
// each thread loads its first copy before rotating, so the two round trips overlap.
// A negative slot (padding) or one past the cache is not written, as in reshape_and_cache_flash.
//
// With QK_NORM (Qwen3's per-head q/k RMSNorm, vLLM's fused_qk_norm_rope folded in), every query
// and key head is RMS-normalized with its weight before it rotates, with rms_norm's arithmetic
// (fp32 sum of squares, the normalized value rounded to T, times the weight, rounded to T): the
// two norm launches (and, for several tokens, the copies of the strided q/k views they needed)
// go. A head's sum of squares is a shuffle over the group of threads that holds it, so it needs
// rot_dim == head_size and one chunk per thread with a power-of-two chunk count <= 32 (the host
// checks; see qk_norm_supported).
#pragma once

#include <algorithm>
#include <cstdint>

#include "cache/cache_kernels.cuh"
#include "common/reduce.cuh"
#include "rope/rotary_embedding.cuh"

namespace pyorch::kernels {

// The KV side: value [num_tokens, num_kv_heads, head_size] (strided), the caches
// [num_blocks, block_size, num_kv_heads, head_size] with shared strides, as in
// reshape_and_cache_flash; KvT is T (auto) or uint8_t (fp8 e4m3, stored = fp8(x / scale)).
template <typename T, typename KvT>
struct RopeKvParams {
  const T* value;
  KvT* key_cache;
  KvT* value_cache;
  const int64_t* slot_mapping;  // [num_tokens]
  const float* k_scale;         // [1], read only for fp8
  const float* v_scale;
  int64_t value_token_stride;
  int64_t value_head_stride;
  int64_t num_slots;  // num_blocks * block_size
  int64_t block_size;
  int64_t kv_block_stride;
  int64_t kv_slot_stride;
  int64_t kv_head_stride;
  int head_size;
  const T* q_norm_weight = nullptr;  // [head_size], read only with QK_NORM
  const T* k_norm_weight = nullptr;
  float norm_eps = 0.f;
};

template <typename T, typename CosSinT, typename KvT, bool FP8, bool IS_NEOX, int VEC_SIZE,
          bool QK_NORM>
__global__ void __launch_bounds__(kRopeMaxThreads)
    rotary_embedding_and_cache_kernel(const RopeParams<T, CosSinT> p,
                                      const RopeKvParams<T, KvT> kv) {
  using V = Vec<T, VEC_SIZE>;
  pdl_wait();  // launched with PDL (common/launch.cuh)
  pdl_launch_dependents();
  const int64_t token = static_cast<int64_t>(blockIdx.x) * blockDim.z + threadIdx.z;
  if (token >= p.num_tokens) return;  // no barriers below, so idle threads may leave early
  const int64_t slot = kv.slot_mapping[token];
  const bool write = slot >= 0 && slot < kv.num_slots;
  const int64_t kv_block = write ? slot / kv.block_size : 0;
  const int64_t kv_token_offset =
      kv_block * kv.kv_block_stride + (slot - kv_block * kv.block_size) * kv.kv_slot_stride;
  Fp8Scale ks{1.f, 1.f, 1.f}, vs = ks;
  if constexpr (FP8) {
    if (write) {
      ks = load_scale(kv.k_scale);
      vs = load_scale(kv.v_scale);
    }
  }

  // This thread's first item of the copies below (value heads, then the key elements past
  // rot_dim), loaded now so that its round trip overlaps the rotation's: once the rotation has
  // stored to query and key, the compiler may not move a load above those stores.
  const int num_threads = static_cast<int>(blockDim.x * blockDim.y);
  const int tid = static_cast<int>(threadIdx.y * blockDim.x + threadIdx.x);
  const int vecs_per_head = kv.head_size / VEC_SIZE;
  const int rot_vecs = 2 * p.half_rot_dim / VEC_SIZE;
  const int tail_vecs = vecs_per_head - rot_vecs;
  const int value_items = p.num_kv_heads * vecs_per_head;
  const int num_items = value_items + p.num_kv_heads * tail_vecs;  // the loads need no slot
  T* k_token = p.key + token * p.key_token_stride;
  const T* v_token = kv.value + token * kv.value_token_stride;
  // Item -> (source, cache destination); the value cache for value items, the key cache after.
  auto locate = [&](int item, const T*& src, KvT*& dst, bool& is_value) {
    is_value = item < value_items;
    int h, d;
    if (is_value) {
      h = item / vecs_per_head;
      d = (item - h * vecs_per_head) * VEC_SIZE;
      src = v_token + h * kv.value_head_stride + d;
    } else {
      const int j = item - value_items;
      h = j / tail_vecs;
      d = (rot_vecs + j - h * tail_vecs) * VEC_SIZE;
      src = k_token + h * p.key_head_stride + d;
    }
    dst = (is_value ? kv.value_cache : kv.key_cache) + kv_token_offset + h * kv.kv_head_stride + d;
  };
  V first;
  const T* first_src = nullptr;
  KvT* first_dst = nullptr;
  bool first_is_value = false;
  if (tid < num_items) {
    locate(tid, first_src, first_dst, first_is_value);
    first.load(first_src);
  }

  const int num_chunks = p.half_rot_dim / VEC_SIZE;
  const int total_heads = p.num_heads + p.num_kv_heads;
  const CosSinT* cos_row = p.cos_sin_cache + p.positions[token] * p.cache_stride;
  const CosSinT* sin_row = cos_row + p.half_rot_dim;
  T* q_token = p.query + token * p.query_token_stride;
  auto head_ptr = [&](int h) {
    return h >= p.num_heads ? k_token + (h - p.num_heads) * p.key_head_stride
                            : q_token + h * p.query_head_stride;
  };
  // QK_NORM: the lanes of this thread's group (same head row and token: blockDim.x lanes, one
  // chunk each, aligned in the warp) run the head loop in step and reduce over group_mask.
  const int lane = static_cast<int>((threadIdx.z * blockDim.y * blockDim.x + tid) % kWarpSize);
  const unsigned group_mask =
      QK_NORM ? (blockDim.x >= kWarpSize
                     ? 0xffffffffu
                     : ((1u << blockDim.x) - 1u) << (lane / blockDim.x * blockDim.x))
              : 0u;
  for (int chunk = threadIdx.x; chunk < num_chunks; chunk += blockDim.x) {
    float cos_v[VEC_SIZE], sin_v[VEC_SIZE];
    load_as_float(cos_row + chunk * VEC_SIZE, cos_v);
    load_as_float(sin_row + chunk * VEC_SIZE, sin_v);
    const int lo_off = IS_NEOX ? chunk * VEC_SIZE : 2 * chunk * VEC_SIZE;
    const int hi_off = IS_NEOX ? p.half_rot_dim + chunk * VEC_SIZE : lo_off + VEC_SIZE;
    V wq_lo, wq_hi, wk_lo, wk_hi;  // this chunk's norm weights (QK_NORM only)
    if constexpr (QK_NORM) {
      wq_lo.load(kv.q_norm_weight + lo_off);
      wq_hi.load(kv.q_norm_weight + hi_off);
      wk_lo.load(kv.k_norm_weight + lo_off);
      wk_hi.load(kv.k_norm_weight + hi_off);
    }
    // Two heads per step, both loaded before either is stored (one round trip, not two).
    for (int h0 = threadIdx.y; h0 < total_heads; h0 += 2 * blockDim.y) {
      const int hs[2] = {h0, h0 + static_cast<int>(blockDim.y)};
      V lo[2], hi[2];
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        if (hs[u] < total_heads) {
          lo[u].load(head_ptr(hs[u]) + lo_off);
          hi[u].load(head_ptr(hs[u]) + hi_off);
        }
      }
      if constexpr (QK_NORM) {
        float sum_sq[2] = {0.f, 0.f};
#pragma unroll
        for (int u = 0; u < 2; ++u) {
          if (hs[u] >= total_heads) continue;
#pragma unroll
          for (int j = 0; j < VEC_SIZE; ++j) {
            const float a = to_float(lo[u].data[j]);
            const float b = to_float(hi[u].data[j]);
            sum_sq[u] += a * a + b * b;
          }
        }
        for (int offset = 1; offset < static_cast<int>(blockDim.x); offset *= 2) {
          sum_sq[0] += __shfl_xor_sync(group_mask, sum_sq[0], offset);
          sum_sq[1] += __shfl_xor_sync(group_mask, sum_sq[1], offset);
        }
#pragma unroll
        for (int u = 0; u < 2; ++u) {
          if (hs[u] >= total_heads) continue;
          const float inv_rms = rsqrtf(sum_sq[u] / static_cast<float>(kv.head_size) + kv.norm_eps);
          const bool is_query = hs[u] < p.num_heads;
          const V& w_lo = is_query ? wq_lo : wk_lo;
          const V& w_hi = is_query ? wq_hi : wk_hi;
#pragma unroll
          for (int j = 0; j < VEC_SIZE; ++j) {
            lo[u].data[j] =
                from_float<T>(to_float(from_float<T>(to_float(lo[u].data[j]) * inv_rms)) *
                              to_float(w_lo.data[j]));
            hi[u].data[j] =
                from_float<T>(to_float(from_float<T>(to_float(hi[u].data[j]) * inv_rms)) *
                              to_float(w_hi.data[j]));
          }
        }
      }
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        if (hs[u] >= total_heads) continue;
        rotate_vecs<T, IS_NEOX, VEC_SIZE>(lo[u], hi[u], cos_v, sin_v);
        T* head = head_ptr(hs[u]);
        lo[u].store(head + lo_off);
        hi[u].store(head + hi_off);
        if (hs[u] >= p.num_heads && write) {
          KvT* dst = kv.key_cache + kv_token_offset + (hs[u] - p.num_heads) * kv.kv_head_stride;
          to_cache_vec<KvT, FP8>(lo[u], ks).store(dst + lo_off);
          to_cache_vec<KvT, FP8>(hi[u], ks).store(dst + hi_off);
        }
      }
    }
  }

  if (!write) return;
  if (tid < num_items) {
    to_cache_vec<KvT, FP8>(first, first_is_value ? vs : ks).store(first_dst);
  }
  for (int item = tid + num_threads; item < num_items; item += num_threads) {
    const T* src;
    KvT* dst;
    bool is_value;
    locate(item, src, dst, is_value);
    V x;
    x.load(src);
    to_cache_vec<KvT, FP8>(x, is_value ? vs : ks).store(dst);
  }
}

// The widest VEC_SIZE that rotary_embedding's constraints and the KV side's (value and cache
// pointers and strides, head_size) allow.
template <typename T, typename CosSinT, typename KvT>
__host__ inline int rope_and_cache_vec_size(const RopeParams<T, CosSinT>& p,
                                            const RopeKvParams<T, KvT>& kv) {
  return std::min(
      {rope_vec_size(p),
       max_vec_size<T>(kv.head_size, {kv.value}, {kv.value_token_stride, kv.value_head_stride}),
       max_vec_size<KvT>(kv.head_size, {kv.key_cache, kv.value_cache},
                         {kv.kv_block_stride, kv.kv_slot_stride, kv.kv_head_stride})});
}

// Whether the QK_NORM form can run at this vector width: whole heads rotate (rot_dim ==
// head_size) and a head's chunks (one per thread) are a power-of-two group of at most a warp.
__host__ inline bool qk_norm_supported(int half_rot_dim, int head_size, int vec) {
  const int num_chunks = half_rot_dim / vec;
  return 2 * half_rot_dim == head_size && num_chunks >= 1 && num_chunks <= kWarpSize &&
         (num_chunks & (num_chunks - 1)) == 0;
}

template <typename T, typename CosSinT, typename KvT, bool FP8>
cudaError_t launch_rotary_embedding_and_cache(const RopeParams<T, CosSinT>& p,
                                              const RopeKvParams<T, KvT>& kv, bool is_neox,
                                              cudaStream_t stream) {
  if (p.num_tokens == 0) return cudaSuccess;
  const bool qk_norm = kv.q_norm_weight != nullptr;
  int vec = rope_and_cache_vec_size(p, kv);
  if (qk_norm) {
    // The weights are read with the heads' vector width.
    vec = std::min(vec, max_vec_size<T>(kv.head_size, {kv.q_norm_weight, kv.k_norm_weight}, {}));
    if (!qk_norm_supported(p.half_rot_dim, kv.head_size, vec)) {
      PYORCH_INVALID(
          "rotary_embedding_and_cache: the q/k norm needs rot_dim == head_size (got %d and %d) "
          "and head_size / 2 / vector width a power of two <= 32 (vector width %d: check the "
          "16-byte alignment of query, key, value, the caches and the norm weights)",
          2 * p.half_rot_dim, kv.head_size, vec);
    }
  }
  // The block shape of rotary_embedding; its threads also do the copies.
  auto launch = [&](auto vec_c, auto neox_c, auto norm_c) -> cudaError_t {
    constexpr int kVec = decltype(vec_c)::value;
    int64_t num_blocks = 0;
    const dim3 block = rope_block_shape(p, kVec, &num_blocks);
    if (num_blocks > 0x7fffffff) PYORCH_INVALID("rotary_embedding_and_cache: too many tokens");
    return launch_kernel(
        &rotary_embedding_and_cache_kernel<T, CosSinT, KvT, FP8, decltype(neox_c)::value, kVec,
                                           decltype(norm_c)::value>,
        dim3(static_cast<unsigned>(num_blocks)), block, 0, stream, pdl_enabled(), p, kv);
  };
  return dispatch_vec_size<T>(vec, [&](auto vec_c) {
    if (qk_norm) {
      return is_neox ? launch(vec_c, std::true_type{}, std::true_type{})
                     : launch(vec_c, std::false_type{}, std::true_type{});
    }
    return is_neox ? launch(vec_c, std::true_type{}, std::false_type{})
                   : launch(vec_c, std::false_type{}, std::false_type{});
  });
}

}  // namespace pyorch::kernels
