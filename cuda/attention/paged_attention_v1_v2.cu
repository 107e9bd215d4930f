// Instantiates the split-layout paged attention kernels (v1 and v2) behind the torch-free C API:
// dtype -> cache type -> head size -> block size, each an explicit switch over a finite set.
#include <cstddef>
#include <utility>

#include "attention/paged_attention_v1_v2.cuh"
#include "pyorch/paged_attention_v1_v2.h"

namespace pyorch {
namespace {

using kernels::paged_v1_v2::launch_paged_attention_v1_v2;

// The v2 scratch; all null for v1.
struct Scratch {
  float* exp_sums;
  float* max_logits;
  void* tmp_out;
  int64_t max_num_partitions;
};

template <typename T, typename CacheT, int HEAD_SIZE>
cudaError_t dispatch_block_size(const PagedAttentionV1V2Args& args, const Scratch& s,
                                cudaStream_t stream) {
  if constexpr (HEAD_SIZE % (16 / sizeof(CacheT)) != 0) {
    // The key layout splits head_size into 16-byte groups: an fp8 cache cannot hold head 120.
    PYORCH_INVALID("paged_attention: head size %d is not a multiple of x = %d", HEAD_SIZE,
                   static_cast<int>(16 / sizeof(CacheT)));
  } else {
    T* tmp_out = static_cast<T*>(s.tmp_out);
    switch (args.block_size) {
      case 8:
        return launch_paged_attention_v1_v2<T, CacheT, HEAD_SIZE, 8>(
            args, s.exp_sums, s.max_logits, tmp_out, s.max_num_partitions, stream);
      case 16:
        return launch_paged_attention_v1_v2<T, CacheT, HEAD_SIZE, 16>(
            args, s.exp_sums, s.max_logits, tmp_out, s.max_num_partitions, stream);
      case 32:
        return launch_paged_attention_v1_v2<T, CacheT, HEAD_SIZE, 32>(
            args, s.exp_sums, s.max_logits, tmp_out, s.max_num_partitions, stream);
      default:
        PYORCH_INVALID("paged_attention: unsupported block size %d (expected 8, 16 or 32)",
                       args.block_size);
    }
  }
}

// The switch over kPagedAttentionV1V2HeadSizes (pyorch/paged_attention_v1_v2_sizes.h, shared with
// cpp/'s checks): one dispatch_block_size instantiation per entry, the first equal one runs.
template <typename T, typename CacheT, size_t... I>
cudaError_t dispatch_head_size(const PagedAttentionV1V2Args& args, const Scratch& s,
                               cudaStream_t stream, std::index_sequence<I...>) {
  cudaError_t status = cudaSuccess;
  const bool supported =
      ((args.head_size == kPagedAttentionV1V2HeadSizes[I] &&
        (status = dispatch_block_size<T, CacheT, kPagedAttentionV1V2HeadSizes[I]>(args, s, stream),
         true)) ||
       ...);
  if (!supported) PYORCH_INVALID("Unsupported head size: %d", args.head_size);
  return status;
}

template <typename T, typename CacheT>
cudaError_t dispatch_head_size(const PagedAttentionV1V2Args& args, const Scratch& s,
                               cudaStream_t stream) {
  constexpr size_t kNumHeadSizes =
      sizeof(kPagedAttentionV1V2HeadSizes) / sizeof(kPagedAttentionV1V2HeadSizes[0]);
  return dispatch_head_size<T, CacheT>(args, s, stream, std::make_index_sequence<kNumHeadSizes>{});
}

cudaError_t run(const PagedAttentionV1V2Args& args, const Scratch& s, cudaStream_t stream) {
  if (args.num_kv_heads <= 0 || args.num_heads % args.num_kv_heads != 0) {
    PYORCH_INVALID("paged_attention: num_heads %d is not a multiple of num_kv_heads %d",
                   args.num_heads, args.num_kv_heads);
  }
  if (args.num_seqs == 0 || args.num_heads == 0) return cudaSuccess;
  return PYORCH_DISPATCH_FLOAT_TYPES(args.dtype, T, [&] {
    if (args.kv_cache_dtype == KVCacheDType::kFp8E4M3) {
      return dispatch_head_size<T, uint8_t>(args, s, stream);
    }
    return dispatch_head_size<T, T>(args, s, stream);
  });
}

}  // namespace

cudaError_t paged_attention_v1(const PagedAttentionV1V2Args& args, cudaStream_t stream) {
  return run(args, Scratch{nullptr, nullptr, nullptr, 0}, stream);
}

cudaError_t paged_attention_v2(const PagedAttentionV1V2Args& args, float* exp_sums,
                               float* max_logits, void* tmp_out, int64_t max_num_partitions,
                               cudaStream_t stream) {
  if (exp_sums == nullptr || max_logits == nullptr || tmp_out == nullptr) {
    PYORCH_INVALID("paged_attention_v2: scratch pointers must not be null");
  }
  return run(args, Scratch{exp_sums, max_logits, tmp_out, max_num_partitions}, stream);
}

}  // namespace pyorch
