// Rotary embedding kernel: in place, fp32 math, 16-byte vector access to query/key heads.
//
// Work split: a thread owns one "chunk" of VEC_SIZE rotation pairs of a token, loads that chunk's
// cos/sin once into registers, then walks the token's heads (query heads, then key heads) with
// it. Both styles touch two VEC_SIZE-wide pieces of a head per chunk:
//   neox:  pieces [c*V, c*V+V) and [half + c*V, half + c*V+V); pair j = (lo[j], hi[j])
//   gpt-j: pieces [2c*V, 2c*V+V) and [2c*V+V, 2c*V+2V);      pairs are adjacent elements
// where half = rot_dim / 2 and V = VEC_SIZE. Elements past rot_dim are never read or written.
#pragma once

#include <algorithm>
#include <cstdint>

#include "common/dtype.cuh"
#include "common/launch.cuh"
#include "common/vec.cuh"

namespace pyorch::kernels {

constexpr int kRopeMaxThreads = 256;

template <typename T, typename CacheT>
struct RopeParams {
  const int64_t* positions;     // [num_tokens]
  T* query;                     // [num_tokens, num_heads, head_size] (strided tokens and heads)
  T* key;                       // [num_tokens, num_kv_heads, head_size] (strided) or nullptr
  const CacheT* cos_sin_cache;  // [max_position, rot_dim] (row stride cache_stride)
  int64_t num_tokens;
  int num_heads;
  int num_kv_heads;  // 0 when key is nullptr
  int half_rot_dim;  // rot_dim / 2: the number of rotation pairs per head
  int64_t query_token_stride;
  int64_t query_head_stride;
  int64_t key_token_stride;
  int64_t key_head_stride;
  int64_t cache_stride;
};

// Loads N cache values as fp32, in pieces of at most 16 bytes (a float32 cache next to a 16-bit
// query needs two 16-byte loads per 8-wide chunk).
template <typename CacheT, int N>
__device__ __forceinline__ void load_as_float(const CacheT* __restrict__ src,  // [N]
                                              float (&dst)[N]) {
  constexpr int kMaxPiece = 16 / static_cast<int>(sizeof(CacheT));
  constexpr int kPiece = N < kMaxPiece ? N : kMaxPiece;
  static_assert(N % kPiece == 0, "piece size must divide the chunk");
#pragma unroll
  for (int p = 0; p < N; p += kPiece) {
    Vec<CacheT, kPiece> v;
    v.load(src + p);
#pragma unroll
    for (int j = 0; j < kPiece; ++j) dst[p + j] = to_float(v.data[j]);
  }
}

// Rotates the VEC_SIZE pairs held by the pieces lo and hi of one head, in registers.
template <typename T, bool IS_NEOX, int VEC_SIZE>
__device__ __forceinline__ void rotate_vecs(Vec<T, VEC_SIZE>& lo, Vec<T, VEC_SIZE>& hi,
                                            const float (&cos_v)[VEC_SIZE],
                                            const float (&sin_v)[VEC_SIZE]) {
  float f[2 * VEC_SIZE];
#pragma unroll
  for (int j = 0; j < VEC_SIZE; ++j) {
    f[j] = to_float(lo.data[j]);
    f[VEC_SIZE + j] = to_float(hi.data[j]);
  }
#pragma unroll
  for (int j = 0; j < VEC_SIZE; ++j) {
    // neox pairs element j of lo with element j of hi; gpt-j pairs adjacent elements of lo ++ hi.
    const int a = IS_NEOX ? j : 2 * j;
    const int b = IS_NEOX ? VEC_SIZE + j : 2 * j + 1;
    const float x1 = f[a];
    const float x2 = f[b];
    f[a] = x1 * cos_v[j] - x2 * sin_v[j];
    f[b] = x2 * cos_v[j] + x1 * sin_v[j];
  }
#pragma unroll
  for (int j = 0; j < VEC_SIZE; ++j) {
    lo.data[j] = from_float<T>(f[j]);
    hi.data[j] = from_float<T>(f[VEC_SIZE + j]);
  }
}

// The same on the pieces lo_ptr and hi_ptr of a head in memory, in place.
template <typename T, bool IS_NEOX, int VEC_SIZE>
__device__ __forceinline__ void rotate_chunk(T* lo_ptr,  // [VEC_SIZE]
                                             T* hi_ptr,  // [VEC_SIZE]
                                             const float (&cos_v)[VEC_SIZE],
                                             const float (&sin_v)[VEC_SIZE]) {
  Vec<T, VEC_SIZE> lo, hi;
  lo.load(lo_ptr);
  hi.load(hi_ptr);
  rotate_vecs<T, IS_NEOX, VEC_SIZE>(lo, hi, cos_v, sin_v);
  lo.store(lo_ptr);
  hi.store(hi_ptr);
}

// Block = (chunks, head rows, tokens): threadIdx.x picks the chunk, threadIdx.y strides over the
// token's heads, threadIdx.z picks one of the block's tokens.
template <typename T, typename CacheT, bool IS_NEOX, int VEC_SIZE>
__global__ void __launch_bounds__(kRopeMaxThreads)
    rotary_embedding_kernel(const RopeParams<T, CacheT> p) {
  pdl_wait();  // launched with PDL (common/launch.cuh)
  pdl_launch_dependents();
  const int64_t token = static_cast<int64_t>(blockIdx.x) * blockDim.z + threadIdx.z;
  if (token >= p.num_tokens) return;  // no barriers below, so idle threads may leave early
  const int num_chunks = p.half_rot_dim / VEC_SIZE;
  const int total_heads = p.num_heads + p.num_kv_heads;
  const CacheT* cos_row = p.cos_sin_cache + p.positions[token] * p.cache_stride;
  const CacheT* sin_row = cos_row + p.half_rot_dim;
  T* q_token = p.query + token * p.query_token_stride;
  T* k_token = p.key == nullptr ? nullptr : p.key + token * p.key_token_stride;

  for (int chunk = threadIdx.x; chunk < num_chunks; chunk += blockDim.x) {
    float cos_v[VEC_SIZE], sin_v[VEC_SIZE];
    load_as_float(cos_row + chunk * VEC_SIZE, cos_v);
    load_as_float(sin_row + chunk * VEC_SIZE, sin_v);
    const int lo = IS_NEOX ? chunk * VEC_SIZE : 2 * chunk * VEC_SIZE;
    const int hi = IS_NEOX ? p.half_rot_dim + chunk * VEC_SIZE : lo + VEC_SIZE;
    for (int h = threadIdx.y; h < total_heads; h += blockDim.y) {
      T* head = h < p.num_heads ? q_token + h * p.query_head_stride
                                : k_token + (h - p.num_heads) * p.key_head_stride;
      rotate_chunk<T, IS_NEOX, VEC_SIZE>(head + lo, head + hi, cos_v, sin_v);
    }
  }
}

// The widest VEC_SIZE that the query/key pointers and strides, the pair count and the cache allow.
template <typename T, typename CacheT>
__host__ inline int rope_vec_size(const RopeParams<T, CacheT>& p) {
  int vec = max_vec_size<T>(
      p.half_rot_dim, {p.query, p.key},
      {p.query_token_stride, p.query_head_stride, p.key_token_stride, p.key_head_stride});
  auto cache_fits = [&](int v) {
    const int piece = std::min(v, 16 / static_cast<int>(sizeof(CacheT)));
    return reinterpret_cast<uintptr_t>(p.cos_sin_cache) % (piece * sizeof(CacheT)) == 0 &&
           p.cache_stride % piece == 0;
  };
  while (vec > 1 && !cache_fits(vec)) vec /= 2;
  return vec;
}

// Threads per token: one column per chunk of VEC_SIZE pairs; enough head rows that each thread
// walks about ceil(total_heads / rows) heads; leftover room in the block goes to more tokens.
// Returns the block; *num_blocks gets the grid.
template <typename T, typename CacheT>
__host__ inline dim3 rope_block_shape(const RopeParams<T, CacheT>& p, int vec,
                                      int64_t* num_blocks) {
  const int num_chunks = p.half_rot_dim / vec;
  const int total_heads = p.num_heads + p.num_kv_heads;
  const int bx = std::min(num_chunks, kRopeMaxThreads);
  const int max_rows = std::max(1, kRopeMaxThreads / bx);
  const int heads_per_thread = (total_heads + max_rows - 1) / max_rows;
  const int by = std::max(1, (total_heads + heads_per_thread - 1) / heads_per_thread);
  const int bz =
      static_cast<int>(std::min<int64_t>(std::max(1, kRopeMaxThreads / (bx * by)), p.num_tokens));
  *num_blocks = (p.num_tokens + bz - 1) / bz;
  return dim3(bx, by, bz);
}

template <typename T, typename CacheT, bool IS_NEOX, int VEC_SIZE>
cudaError_t launch_rope_vec(const RopeParams<T, CacheT>& p, cudaStream_t stream) {
  int64_t num_blocks = 0;
  const dim3 block = rope_block_shape(p, VEC_SIZE, &num_blocks);
  if (num_blocks > 0x7fffffff) PYORCH_INVALID("rotary_embedding: too many tokens");
  return launch_kernel(&rotary_embedding_kernel<T, CacheT, IS_NEOX, VEC_SIZE>,
                       dim3(static_cast<unsigned>(num_blocks)), block, 0, stream, pdl_enabled(), p);
}

template <typename T, typename CacheT>
cudaError_t launch_rotary_embedding(const RopeParams<T, CacheT>& p, bool is_neox,
                                    cudaStream_t stream) {
  if (p.num_tokens == 0 || p.half_rot_dim == 0 || p.num_heads + p.num_kv_heads == 0) {
    return cudaSuccess;
  }
  const int vec = rope_vec_size(p);
  constexpr int kMaxVec = 16 / sizeof(T);
  switch (vec) {
#define PYORCH_CASE(V)                                                  \
  case V:                                                               \
    if constexpr (V <= kMaxVec) {                                       \
      return is_neox ? launch_rope_vec<T, CacheT, true, V>(p, stream)   \
                     : launch_rope_vec<T, CacheT, false, V>(p, stream); \
    }                                                                   \
    break;
    PYORCH_CASE(1)
    PYORCH_CASE(2)
    PYORCH_CASE(4)
    PYORCH_CASE(8)
#undef PYORCH_CASE
    default: break;
  }
  PYORCH_INVALID("rotary_embedding: bad vector size %d", vec);
}

}  // namespace pyorch::kernels
