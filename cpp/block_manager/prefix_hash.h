// Chained 64-bit hash of a full KV block: H(parent hash, extra key, the block's token ids).
// Plain C++17, no torch.
//
// NOTE(engine-core): this hash only picks a bucket in the prefix cache. It is fast and well mixed,
// not cryptographic: BlockPool never trusts it alone. A lookup also compares the stored token ids,
// extra key and the parent block's content id (see block_pool.h), so even a forced collision (all
// blocks in one bucket) can never hand a request another request's KV.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>

namespace pyorch::block {

// Hash of the empty prefix: the parent of every sequence's first block.
constexpr uint64_t kRootBlockHash = 0x9e3779b97f4a7c15ull;

namespace detail {

constexpr uint64_t kMix0 = 0xa0761d6478bd642full;
constexpr uint64_t kMix1 = 0xe7037ed1a0b428dbull;
constexpr uint64_t kMix2 = 0x8ebc6af09c88c6e3ull;
constexpr uint64_t kMix3 = 0x589965cc75374cc3ull;

// 64x64 -> 128-bit multiply, folded back to 64 bits: every input bit reaches every output bit.
inline uint64_t fold_mul(uint64_t a, uint64_t b) {
  const __uint128_t r = static_cast<__uint128_t>(a) * b;
  return static_cast<uint64_t>(r) ^ static_cast<uint64_t>(r >> 64);
}

inline uint64_t absorb(uint64_t h, uint64_t word) { return fold_mul(h ^ kMix1, word ^ kMix2); }

}  // namespace detail

// token_ids: [num_tokens] (one block). The extra key (adapter id, cache salt) is mixed into every
// block, so chains with different extra keys never share a bucket sequence.
inline uint64_t hash_block_tokens(uint64_t parent_hash, const int32_t* token_ids,
                                  int64_t num_tokens, const std::string& extra_key) {
  uint64_t h = detail::fold_mul(parent_hash ^ detail::kMix0, detail::kMix3 ^ num_tokens);
  int64_t i = 0;
  for (; i + 1 < num_tokens; i += 2) {  // two 32-bit token ids per 64-bit word
    const uint64_t word = static_cast<uint32_t>(token_ids[i]) |
                          (static_cast<uint64_t>(static_cast<uint32_t>(token_ids[i + 1])) << 32);
    h = detail::absorb(h, word);
  }
  if (i < num_tokens) h = detail::absorb(h, static_cast<uint32_t>(token_ids[i]) | (1ull << 40));
  const size_t n = extra_key.size();
  for (size_t j = 0; j < n; j += 8) {
    uint64_t word = 0;
    std::memcpy(&word, extra_key.data() + j, n - j < 8 ? n - j : 8);
    h = detail::absorb(h, word);
  }
  return detail::fold_mul(h ^ detail::kMix3, static_cast<uint64_t>(n) ^ detail::kMix0);
}

}  // namespace pyorch::block
