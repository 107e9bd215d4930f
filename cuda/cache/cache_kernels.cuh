// KV-cache kernels: writes of new keys/values into the NHD and the split layout (optionally
// quantized to fp8 e4m3), and block copies between the blocks of many layers' caches.
//
// All of them are pure data movement, so the design goal is DRAM bandwidth: every thread moves
// 16-byte vectors where the alignment allows (scalar fallbacks otherwise) and keeps several loads
// in flight before its stores; lanes are laid out so that a warp's stores land on whole 32-byte
// sectors for the usual slot mappings (consecutive tokens -> consecutive slots of a block).
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "common/dtype.cuh"
#include "common/launch.cuh"
#include "common/vec.cuh"

namespace pyorch::kernels {

constexpr int kCacheThreads = 256;
// Each thread of the NHD write moves this many (key, value) vector pairs, loaded before stored.
// One for fp8: converting two pairs at once takes ~80 registers, and the lost occupancy costs more
// than the extra loads in flight gain (H100, bf16, 8 x 128 heads, 65536 tokens: 61% of copy
// bandwidth with two, 69% with one; the auto path reaches 94%).
// TODO(cache): the fp8 write is bound by loads in flight at 63 registers; try two pairs under
// __launch_bounds__(256, 4) (64 registers, no spill for bf16), or staging loads with cp.async.
template <bool FP8>
constexpr int kFlashItemsPerThread = FP8 ? 1 : 2;
template <bool FP8>
constexpr int kFlashItemsPerBlock = kCacheThreads * kFlashItemsPerThread<FP8>;
// Split layout: a block is 32 tokens (one per lane) x kSplitRows warps over head_size chunks.
constexpr int kSplitTokensPerBlock = 32;
constexpr int kSplitRows = kCacheThreads / kSplitTokensPerBlock;
// Chunks each thread loads before it stores (one for fp8, for the registers, as above).
template <bool FP8>
constexpr int kSplitUnroll = FP8 ? 1 : 2;
// copy_blocks passes the per-layer pointers by value; 2 * 128 pointers = 2 KiB of the 4 KiB of
// kernel parameters. More layers take more launches.
constexpr int kMaxCopyLayers = 128;
constexpr int kCopyUnroll = 4;

// The scale a thread divides by: x / scale = (x * pre) / div, exactly. div is the scale itself
// with pre = 1, except for scales so far from 1 that 1 / scale would lose precision; there an exact
// power of two moves into pre (x * pre then overflows / underflows only where x / scale saturates
// / rounds to a zero fp8 anyway). Zero, infinite and NaN scales are folded into pre too, so that
// x * pre reproduces x / scale's inf / zero / NaN.
struct Fp8Scale {
  float div, inv_div, pre;
};

__device__ __forceinline__ Fp8Scale load_scale(const float* scale) {
  const float s = *scale;
  const float a = fabsf(s);
  // __frcp_rn: div_by_scale needs the correctly rounded reciprocal.
  if (a >= 0x1p-100f && a <= 0x1p100f) return {s, __frcp_rn(s), 1.f};
  if (a == 0.f) return {1.f, 1.f, copysignf(INFINITY, s)};
  if (isinf(a)) return {1.f, 1.f, copysignf(0.f, s)};
  if (isnan(a)) return {1.f, 1.f, s};
  const float pre = a < 1.f ? 0x1p100f : 0x1p-100f;  // s * pre is a normal number near 2^+-49
  return {s * pre, __frcp_rn(s * pre), pre};
}

// x / scale, correctly rounded (bit-identical to IEEE division) in four instructions instead of
// a full division: q = x * inv_div is within an ulp, and one FMA-residual step rounds it
// correctly (Markstein's theorem; needs inv_div = RN(1 / div) and no underflow in the residual,
// which fails only for |q| < 2^-100, far below fp8's smallest value). The step is skipped where q
// is exact already (r == 0, which also keeps the sign of a zero) and far outside the fp8 range,
// where q only decides saturation and the step could turn an inf into a NaN.
__device__ __forceinline__ float div_by_scale(float x, const Fp8Scale& s) {
  x *= s.pre;
  const float q = x * s.inv_div;
  const float r = fmaf(-q, s.div, x);
  const float q_rn = fmaf(r, s.inv_div, q);
  return (r != 0.f && fabsf(q) < 1024.f) ? q_rn : q;
}

// One element as the cache stores it: as is, or fp8(x / scale) saturated to +-448. The conversion
// saturates (satfinite), which is what torch's (x.float() / scale).clamp(-448, 448)
// .to(torch.float8_e4m3fn) does (inf -> 448 included), so the result is bit-identical to it.
template <typename CacheT, bool FP8, typename T>
__device__ __forceinline__ CacheT to_cache(T x, Fp8Scale s) {
  if constexpr (FP8) {
    static_assert(std::is_same_v<CacheT, uint8_t>, "fp8 caches are stored as bytes");
    return float_to_fp8(div_by_scale(to_float(x), s));
  } else {
    static_assert(std::is_same_v<CacheT, T>, "an auto cache holds the model dtype");
    return x;
  }
}

template <typename CacheT, bool FP8, typename T, int VEC_SIZE>
__device__ __forceinline__ Vec<CacheT, VEC_SIZE> to_cache_vec(const Vec<T, VEC_SIZE>& in,
                                                              Fp8Scale s) {
  Vec<CacheT, VEC_SIZE> out;
  if constexpr (FP8 && VEC_SIZE % 2 == 0) {
    // Two elements per conversion instruction (cvt.rn.satfinite.e4m3x2.f32).
#pragma unroll
    for (int i = 0; i < VEC_SIZE; i += 2) {
      const float2 f{div_by_scale(to_float(in.data[i]), s),
                     div_by_scale(to_float(in.data[i + 1]), s)};
      const __nv_fp8x2_storage_t pair = __nv_cvt_float2_to_fp8x2(f, __NV_SATFINITE, __NV_E4M3);
      out.data[i] = static_cast<uint8_t>(pair & 0xff);
      out.data[i + 1] = static_cast<uint8_t>(pair >> 8);
    }
  } else {
#pragma unroll
    for (int i = 0; i < VEC_SIZE; ++i) out.data[i] = to_cache<CacheT, FP8>(in.data[i], s);
  }
  return out;
}

// ---- NHD layout -----------------------------------------------------------------------------
// The work is the flat list of (token, head, vector) items, kFlashItemsPerBlock per thread block,
// so that any (num_kv_heads, head_size) keeps every thread busy. Consecutive lanes take
// consecutive vectors of a token's [num_kv_heads, head_size] row, which is contiguous in the cache
// when cache_head_stride == head_size: a warp writes 512 contiguous bytes (16-bit types).
template <typename T, typename CacheT, bool FP8, int VEC_SIZE>
__global__ void __launch_bounds__(kCacheThreads) reshape_and_cache_flash_kernel(
    const T* __restrict__ key,                 // [num_tokens, num_kv_heads, head_size]
    const T* __restrict__ value,               // [num_tokens, num_kv_heads, head_size]
    CacheT* __restrict__ key_cache,            // [num_blocks, block_size, num_kv_heads, head_size]
    CacheT* __restrict__ value_cache,          // [num_blocks, block_size, num_kv_heads, head_size]
    const int64_t* __restrict__ slot_mapping,  // [num_tokens]
    const float* __restrict__ k_scale,         // [1], read only when FP8
    const float* __restrict__ v_scale,         // [1], read only when FP8
    int64_t num_tokens, int vecs_per_head, int vecs_per_token, int64_t num_slots,
    int64_t block_size, int64_t key_token_stride, int64_t key_head_stride,
    int64_t value_token_stride, int64_t value_head_stride, int64_t cache_block_stride,
    int64_t cache_slot_stride, int64_t cache_head_stride) {
  using V = Vec<T, VEC_SIZE>;
  pdl_wait();  // launched with PDL (common/launch.cuh)
  pdl_launch_dependents();
  const int64_t first_item = static_cast<int64_t>(blockIdx.x) * kFlashItemsPerBlock<FP8>;
  // One 64-bit division per thread; the per-item ones below are 32-bit.
  const int64_t first_token = first_item / vecs_per_token;
  const int first_rem = static_cast<int>(first_item - first_token * vecs_per_token);
  const int64_t items_left = num_tokens * vecs_per_token - first_item;
  const int num_items = items_left < kFlashItemsPerBlock<FP8> ? static_cast<int>(items_left)
                                                              : kFlashItemsPerBlock<FP8>;
  Fp8Scale ks{1.f, 1.f, 1.f}, vs = ks;
  if constexpr (FP8) {
    ks = load_scale(k_scale);
    vs = load_scale(v_scale);
  }

  // Phase 1: all loads, so that kFlashItemsPerThread x 2 vectors are in flight per thread. The
  // key/value loads do not wait for the slot: their addresses depend only on the token.
  constexpr int kItems = kFlashItemsPerThread<FP8>;
  V k[kItems], v[kItems];
  int64_t slot[kItems];
  int head[kItems], d[kItems];
#pragma unroll
  for (int u = 0; u < kItems; ++u) {
    slot[u] = -1;
    const int j = threadIdx.x + u * kCacheThreads;
    if (j >= num_items) continue;
    const int local = first_rem + j;
    const int64_t token = first_token + local / vecs_per_token;
    const int rem = local % vecs_per_token;
    head[u] = rem / vecs_per_head;
    d[u] = (rem - head[u] * vecs_per_head) * VEC_SIZE;
    slot[u] = slot_mapping[token];
    k[u].load(key + token * key_token_stride + head[u] * key_head_stride + d[u]);
    v[u].load(value + token * value_token_stride + head[u] * value_head_stride + d[u]);
  }
  // Phase 2: convert and store. Negative slots are padding; slots past the cache are dropped
  // rather than written out of bounds (they cannot be rejected on the host without a sync).
#pragma unroll
  for (int u = 0; u < kItems; ++u) {
    if (slot[u] < 0 || slot[u] >= num_slots) continue;
    const int64_t block_id = slot[u] / block_size;
    const int64_t block_offset = slot[u] - block_id * block_size;
    const int64_t dst = block_id * cache_block_stride + block_offset * cache_slot_stride +
                        head[u] * cache_head_stride + d[u];
    to_cache_vec<CacheT, FP8>(k[u], ks).store(key_cache + dst);
    to_cache_vec<CacheT, FP8>(v[u], vs).store(value_cache + dst);
  }
}

// ---- split layout ---------------------------------------------------------------------------
// Here a token's elements are scattered (x-element chunks block_size * x apart for the key,
// single elements block_size apart for the value), but consecutive slots of a block are adjacent.
// So lanes take consecutive tokens and warps take head_size chunks: for a prefill (consecutive
// tokens -> consecutive slots) a warp's key stores are 32 x 16 contiguous bytes, and each of its
// value stores covers whole 32-byte sectors.
template <typename T, typename CacheT, bool FP8, int VEC_SIZE>
__global__ void __launch_bounds__(kCacheThreads) reshape_and_cache_kernel(
    const T* __restrict__ key,         // [num_tokens, num_kv_heads, head_size]
    const T* __restrict__ value,       // [num_tokens, num_kv_heads, head_size]
    CacheT* __restrict__ key_cache,    // [num_blocks, num_kv_heads, head_size / x, block_size, x]
    CacheT* __restrict__ value_cache,  // [num_blocks, num_kv_heads, head_size, block_size]
    const int64_t* __restrict__ slot_mapping,  // [num_tokens]
    const float* __restrict__ k_scale,         // [1], read only when FP8
    const float* __restrict__ v_scale,         // [1], read only when FP8
    int64_t num_tokens, int vecs_per_head, int64_t num_slots, int64_t block_size,
    int64_t key_token_stride, int64_t key_head_stride, int64_t value_token_stride,
    int64_t value_head_stride, int64_t key_cache_block_stride, int64_t key_cache_head_stride,
    int64_t value_cache_block_stride, int64_t value_cache_head_stride) {
  constexpr int kX = 16 / static_cast<int>(sizeof(CacheT));
  static_assert(kX % VEC_SIZE == 0, "a vector must not straddle two x-chunks of the key cache");
  using V = Vec<T, VEC_SIZE>;
  pdl_wait();  // launched with PDL (common/launch.cuh)
  pdl_launch_dependents();
  const int64_t token = static_cast<int64_t>(blockIdx.x) * kSplitTokensPerBlock + threadIdx.x;
  const int64_t head = blockIdx.y;
  if (token >= num_tokens) return;  // no barriers below
  // The slot load and the first key/value loads are issued together (the sources do not depend
  // on the slot); only the stores wait for it.
  const int64_t slot = slot_mapping[token];
  Fp8Scale ks{1.f, 1.f, 1.f}, vs = ks;
  if constexpr (FP8) {
    ks = load_scale(k_scale);
    vs = load_scale(v_scale);
  }
  const T* k_src = key + token * key_token_stride + head * key_head_stride;
  const T* v_src = value + token * value_token_stride + head * value_head_stride;
  const bool valid = slot >= 0 && slot < num_slots;
  const int64_t block_id = valid ? slot / block_size : 0;
  const int64_t block_offset = valid ? slot - block_id * block_size : 0;
  CacheT* k_dst = key_cache + block_id * key_cache_block_stride + head * key_cache_head_stride +
                  block_offset * kX;
  CacheT* v_dst = value_cache + block_id * value_cache_block_stride +
                  head * value_cache_head_stride + block_offset;
  const int64_t chunk_stride = block_size * kX;
#pragma unroll 1
  for (int c0 = threadIdx.y; c0 < vecs_per_head; c0 += kSplitRows * kSplitUnroll<FP8>) {
    V k[kSplitUnroll<FP8>], v[kSplitUnroll<FP8>];
#pragma unroll
    for (int u = 0; u < kSplitUnroll<FP8>; ++u) {
      const int d = (c0 + u * kSplitRows) * VEC_SIZE;
      if (d < vecs_per_head * VEC_SIZE) {
        k[u].load(k_src + d);
        v[u].load(v_src + d);
      }
    }
    if (!valid) return;  // padding, or a slot past the cache
#pragma unroll
    for (int u = 0; u < kSplitUnroll<FP8>; ++u) {
      const int d = (c0 + u * kSplitRows) * VEC_SIZE;
      if (d >= vecs_per_head * VEC_SIZE) break;
      to_cache_vec<CacheT, FP8>(k[u], ks).store(k_dst + (d / kX) * chunk_stride + d % kX);
      CacheT* v_out = v_dst + d * block_size;
#pragma unroll
      for (int i = 0; i < VEC_SIZE; ++i) {
        v_out[i * block_size] = to_cache<CacheT, FP8>(v[u].data[i], vs);
      }
    }
  }
}

// ---- block copies ---------------------------------------------------------------------------
struct CopyBlocksLayers {
  char* key[kMaxCopyLayers];    // [num_layers] base of each layer's key cache
  char* value[kMaxCopyLayers];  // [num_layers] base of each layer's value cache
};

// grid (num_pairs, num_layers, 2 = key / value); U is the copy unit (16, 8, 4, 2 or 1 bytes), the
// widest that every base pointer, block_bytes and block_stride_bytes is aligned to. src and dst
// may alias (a block copied onto itself), so no __restrict__ here.
template <typename U>
__global__ void __launch_bounds__(kCacheThreads)
    copy_blocks_kernel(CopyBlocksLayers layers,
                       const int64_t* block_mapping,  // [num_pairs, 2] (src, dst)
                       int64_t num_blocks, int64_t units_per_block, int64_t block_stride_units) {
  const int64_t pair = blockIdx.x;
  const int64_t src_block = block_mapping[2 * pair];
  const int64_t dst_block = block_mapping[2 * pair + 1];
  if (src_block < 0 || src_block >= num_blocks || dst_block < 0 || dst_block >= num_blocks) return;
  char* base = blockIdx.z == 0 ? layers.key[blockIdx.y] : layers.value[blockIdx.y];
  const U* src = reinterpret_cast<const U*>(base) + src_block * block_stride_units;
  U* dst = reinterpret_cast<U*>(base) + dst_block * block_stride_units;
  for (int64_t i = threadIdx.x; i < units_per_block; i += kCacheThreads * kCopyUnroll) {
    U r[kCopyUnroll];
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) {
      const int64_t idx = i + u * kCacheThreads;
      if (idx < units_per_block) r[u] = src[idx];
    }
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) {
      const int64_t idx = i + u * kCacheThreads;
      if (idx < units_per_block) dst[idx] = r[u];
    }
  }
}

// ---- launchers ------------------------------------------------------------------------------
// Calls f(std::integral_constant<int, V>{}) for the runtime vector size vec; sizes wider than
// 16 bytes of T are never chosen, so they are not instantiated.
template <typename T, typename F>
__host__ cudaError_t dispatch_vec_size(int vec, F&& f) {
  constexpr int kMaxVec = 16 / static_cast<int>(sizeof(T));
  switch (vec) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2:
      if constexpr (kMaxVec >= 2) return f(std::integral_constant<int, 2>{});
      break;
    case 4:
      if constexpr (kMaxVec >= 4) return f(std::integral_constant<int, 4>{});
      break;
    case 8:
      if constexpr (kMaxVec >= 8) return f(std::integral_constant<int, 8>{});
      break;
    default: break;
  }
  PYORCH_INVALID("cache: bad vector size %d", vec);
}

template <typename T, typename CacheT, bool FP8>
cudaError_t launch_reshape_and_cache_flash(
    const T* key, const T* value, CacheT* key_cache, CacheT* value_cache,
    const int64_t* slot_mapping, const float* k_scale, const float* v_scale, int64_t num_tokens,
    int64_t num_kv_heads, int64_t head_size, int64_t num_blocks, int64_t block_size,
    int64_t key_token_stride, int64_t key_head_stride, int64_t value_token_stride,
    int64_t value_head_stride, int64_t cache_block_stride, int64_t cache_slot_stride,
    int64_t cache_head_stride, cudaStream_t stream) {
  if (num_tokens == 0 || num_kv_heads == 0 || head_size == 0) return cudaSuccess;
  if (num_kv_heads * head_size > (int64_t{1} << 30)) {
    PYORCH_INVALID("reshape_and_cache_flash: num_kv_heads * head_size too large");
  }
  // min of two powers of two that each fit: fits both the inputs and the caches.
  const int vec = std::min(
      max_vec_size<T>(head_size, {key, value},
                      {key_token_stride, key_head_stride, value_token_stride, value_head_stride}),
      max_vec_size<CacheT>(head_size, {key_cache, value_cache},
                           {cache_block_stride, cache_slot_stride, cache_head_stride}));
  return dispatch_vec_size<T>(vec, [&](auto vec_c) {
    constexpr int kVec = decltype(vec_c)::value;
    const int vecs_per_head = static_cast<int>(head_size / kVec);
    const int vecs_per_token = static_cast<int>(num_kv_heads) * vecs_per_head;
    const int64_t num_items = num_tokens * vecs_per_token;
    constexpr int64_t kPerBlock = kFlashItemsPerBlock<FP8>;
    const int64_t num_ctas = (num_items + kPerBlock - 1) / kPerBlock;
    if (num_ctas > INT32_MAX) PYORCH_INVALID("reshape_and_cache_flash: too many tokens");
    return launch_kernel(&reshape_and_cache_flash_kernel<T, CacheT, FP8, kVec>,
                         dim3(static_cast<unsigned>(num_ctas)), dim3(kCacheThreads), 0, stream,
                         pdl_enabled(), key, value, key_cache, value_cache, slot_mapping, k_scale,
                         v_scale, num_tokens, vecs_per_head, vecs_per_token,
                         num_blocks * block_size, block_size, key_token_stride, key_head_stride,
                         value_token_stride, value_head_stride, cache_block_stride,
                         cache_slot_stride, cache_head_stride);
  });
}

template <typename T, typename CacheT, bool FP8>
cudaError_t launch_reshape_and_cache(
    const T* key, const T* value, CacheT* key_cache, CacheT* value_cache,
    const int64_t* slot_mapping, const float* k_scale, const float* v_scale, int64_t num_tokens,
    int64_t num_kv_heads, int64_t head_size, int64_t num_blocks, int64_t block_size,
    int64_t key_token_stride, int64_t key_head_stride, int64_t value_token_stride,
    int64_t value_head_stride, int64_t key_cache_block_stride, int64_t key_cache_head_stride,
    int64_t value_cache_block_stride, int64_t value_cache_head_stride, cudaStream_t stream) {
  constexpr int kX = 16 / static_cast<int>(sizeof(CacheT));
  if (num_tokens == 0 || num_kv_heads == 0 || head_size == 0) return cudaSuccess;
  if (head_size % kX != 0) {
    PYORCH_INVALID("reshape_and_cache: head_size %lld is not a multiple of x = %d",
                   static_cast<long long>(head_size), kX);
  }
  if (num_kv_heads > 65535 || head_size > (int64_t{1} << 30)) {
    PYORCH_INVALID("reshape_and_cache: too many kv heads or too large a head");
  }
  // Value stores are scalar, so only the key cache's alignment limits the vector.
  const int vec = std::min(
      max_vec_size<T>(head_size, {key, value},
                      {key_token_stride, key_head_stride, value_token_stride, value_head_stride}),
      max_vec_size<CacheT>(head_size, {key_cache},
                           {key_cache_block_stride, key_cache_head_stride}));
  return dispatch_vec_size<T>(vec, [&](auto vec_c) {
    constexpr int kVec = decltype(vec_c)::value;
    const int64_t num_ctas = (num_tokens + kSplitTokensPerBlock - 1) / kSplitTokensPerBlock;
    if (num_ctas > INT32_MAX) PYORCH_INVALID("reshape_and_cache: too many tokens");
    const dim3 grid(static_cast<unsigned>(num_ctas), static_cast<unsigned>(num_kv_heads));
    const dim3 block(kSplitTokensPerBlock, kSplitRows);
    return launch_kernel(&reshape_and_cache_kernel<T, CacheT, FP8, kVec>, grid, block, 0, stream,
                         pdl_enabled(), key, value, key_cache, value_cache, slot_mapping, k_scale,
                         v_scale, num_tokens, static_cast<int>(head_size / kVec),
                         num_blocks * block_size, block_size, key_token_stride, key_head_stride,
                         value_token_stride, value_head_stride, key_cache_block_stride,
                         key_cache_head_stride, value_cache_block_stride, value_cache_head_stride);
  });
}

}  // namespace pyorch::kernels
