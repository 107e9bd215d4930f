// The sizes paged_attention_v1 / paged_attention_v2 (pyorch/paged_attention_v1_v2.h) support,
// in one place for the kernels' switch and cpp/'s argument checks. No CUDA headers: the CPU-only
// build includes it.
#pragma once

#include <cstdint>

namespace pyorch {

// The head sizes the kernels are instantiated for (vLLM's list for these ops).
inline constexpr int kPagedAttentionV1V2HeadSizes[] = {32, 64, 80, 96, 112, 120, 128, 192, 256};

constexpr bool paged_attention_v1_v2_head_size_supported(int64_t head_size) {
  for (const int d : kPagedAttentionV1V2HeadSizes) {
    if (d == head_size) return true;
  }
  return false;
}

// v2 splits each sequence into partitions of this many tokens (vLLM's PARTITION_SIZE); v1 walks
// the context in chunks of the same length.
inline constexpr int kPagedAttentionV2PartitionSize = 512;

// Number of v2 partitions a context of max_seq_len tokens needs: the last dim of exp_sums,
// max_logits and tmp_out.
constexpr int64_t paged_attention_v2_num_partitions(int64_t max_seq_len) {
  return (max_seq_len + kPagedAttentionV2PartitionSize - 1) / kPagedAttentionV2PartitionSize;
}

}  // namespace pyorch
