// The KV-cache block pool and prefix cache (see block_pool.h for the model).
#include "block_manager/block_pool.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>

#include "block_manager/prefix_hash.h"

namespace pyorch::block {

BlockPool::BlockPool(int32_t num_blocks, int32_t block_size, bool enable_caching, int32_t hash_bits)
    : block_size_(block_size), enable_caching_(enable_caching) {
  if (num_blocks < 2) {
    throw std::invalid_argument(
        "BlockPool: num_blocks must be >= 2 (block 0 is the null block), got " +
        std::to_string(num_blocks));
  }
  if (block_size < 1) {
    throw std::invalid_argument("BlockPool: block_size must be >= 1, got " +
                                std::to_string(block_size));
  }
  if (hash_bits < 0 || hash_bits > 64) {
    throw std::invalid_argument("BlockPool: hash_bits must be in [0, 64], got " +
                                std::to_string(hash_bits));
  }
  bucket_mask_ = hash_bits == 64 ? ~0ull : (1ull << hash_bits) - 1;
  blocks_.resize(num_blocks);
  if (enable_caching_) buckets_.reserve(static_cast<size_t>(num_blocks));
  if (enable_caching_) token_ids_.resize(static_cast<size_t>(num_blocks) * block_size);
  for (int32_t b = 1; b < num_blocks; ++b) push_free_tail(b);
}

double BlockPool::usage() const {
  const int32_t num_usable = num_blocks() - 1;
  return static_cast<double>(num_usable - num_free_) / num_usable;
}

const BlockPool::Block& BlockPool::at(int32_t block_id) const {
  if (block_id < 0 || block_id >= num_blocks()) {
    throw std::out_of_range("BlockPool: block id " + std::to_string(block_id) +
                            " out of range [0, " + std::to_string(num_blocks()) + ")");
  }
  return blocks_[block_id];
}

void BlockPool::push_free_tail(int32_t block_id) {
  Block& blk = blocks_[block_id];
  blk.prev = free_tail_;
  blk.next = -1;
  if (free_tail_ >= 0) {
    blocks_[free_tail_].next = block_id;
  } else {
    free_head_ = block_id;
  }
  free_tail_ = block_id;
  blk.in_free_queue = true;
  ++num_free_;
}

void BlockPool::unlink_free(int32_t block_id) {
  Block& blk = blocks_[block_id];
  if (blk.prev >= 0) {
    blocks_[blk.prev].next = blk.next;
  } else {
    free_head_ = blk.next;
  }
  if (blk.next >= 0) {
    blocks_[blk.next].prev = blk.prev;
  } else {
    free_tail_ = blk.prev;
  }
  blk.prev = blk.next = -1;
  blk.in_free_queue = false;
  --num_free_;
}

void BlockPool::evict(int32_t block_id) {
  Block& blk = blocks_[block_id];
  auto it = buckets_.find(blk.hash & bucket_mask_);
  if (it != buckets_.end()) {
    if (it->second == block_id) {
      if (blk.bucket_next >= 0) {
        it->second = blk.bucket_next;
      } else {
        buckets_.erase(it);
      }
    } else {
      for (int32_t b = it->second; b >= 0; b = blocks_[b].bucket_next) {
        if (blocks_[b].bucket_next == block_id) {
          blocks_[b].bucket_next = blk.bucket_next;
          break;
        }
      }
    }
  }
  blk.bucket_next = -1;
  blk.cached = false;
  blk.hash = 0;
  blk.content_id = blk.parent_content_id = 0;
  blk.extra_key.clear();
  --num_cached_;
  ++num_evictions_;
}

std::vector<int32_t> BlockPool::allocate(int32_t num_blocks) {
  if (num_blocks < 0 || num_blocks > num_free_) {
    throw std::runtime_error("BlockPool: cannot allocate " + std::to_string(num_blocks) +
                             " blocks, " + std::to_string(num_free_) + " free");
  }
  std::vector<int32_t> out;
  out.reserve(num_blocks);
  for (int32_t i = 0; i < num_blocks; ++i) {
    const int32_t b = free_head_;
    unlink_free(b);
    if (blocks_[b].cached) evict(b);
    blocks_[b].ref_count = 1;
    out.push_back(b);
  }
  return out;
}

void BlockPool::free(const std::vector<int32_t>& block_ids) {
  for (int32_t b : block_ids) {
    Block& blk = at(b);
    if (b == kNullBlockId) continue;
    if (blk.ref_count <= 0) {
      throw std::runtime_error("BlockPool: double free of block " + std::to_string(b));
    }
    if (--blk.ref_count == 0) push_free_tail(b);
  }
}

void BlockPool::touch(const std::vector<int32_t>& block_ids) {
  for (int32_t b : block_ids) {
    Block& blk = at(b);
    if (b == kNullBlockId) continue;
    if (blk.ref_count == 0) unlink_free(b);
    ++blk.ref_count;
  }
}

int32_t BlockPool::find_cached(uint64_t hash, uint64_t parent_content_id,
                               const std::string& extra_key, const int32_t* token_ids) const {
  auto it = buckets_.find(hash & bucket_mask_);
  if (it == buckets_.end()) return -1;
  const size_t num_bytes = sizeof(int32_t) * block_size_;
  for (int32_t b = it->second; b >= 0; b = blocks_[b].bucket_next) {
    const Block& blk = blocks_[b];
    if (blk.hash == hash && blk.parent_content_id == parent_content_id &&
        blk.extra_key == extra_key &&
        std::memcmp(&token_ids_[static_cast<size_t>(b) * block_size_], token_ids, num_bytes) == 0) {
      return b;
    }
  }
  return -1;
}

std::vector<int32_t> BlockPool::find_longest_prefix(const std::vector<int32_t>& token_ids,
                                                    const std::string& extra_key,
                                                    int64_t max_num_tokens) {
  const int32_t* data = token_ids.data();
  return find_longest_prefix(
      static_cast<int64_t>(token_ids.size()),
      [data](int64_t start, int64_t n, int32_t* out) {
        std::copy(data + start, data + start + n, out);
      },
      extra_key, max_num_tokens);
}

std::vector<int32_t> BlockPool::find_longest_prefix(int64_t num_tokens_in, const TokenReader& read,
                                                    const std::string& extra_key,
                                                    int64_t max_num_tokens) {
  std::vector<int32_t> out;
  num_query_tokens_ += num_tokens_in;
  if (!enable_caching_ || num_cached_ == 0) return out;
  const int64_t num_tokens = std::min<int64_t>(num_tokens_in, std::max<int64_t>(max_num_tokens, 0));
  const int64_t num_full_blocks = num_tokens / block_size_;
  std::vector<int32_t> tokens(block_size_);
  uint64_t parent_hash = kRootBlockHash;
  uint64_t parent_content_id = 0;
  for (int64_t i = 0; i < num_full_blocks; ++i) {
    read(i * block_size_, block_size_, tokens.data());
    const uint64_t hash = hash_block_tokens(parent_hash, tokens.data(), block_size_, extra_key);
    const int32_t b = find_cached(hash, parent_content_id, extra_key, tokens.data());
    if (b < 0) break;
    out.push_back(b);
    parent_hash = hash;
    parent_content_id = blocks_[b].content_id;
  }
  num_hit_tokens_ += static_cast<int64_t>(out.size()) * block_size_;
  return out;
}

int32_t BlockPool::cache_full_blocks(int32_t parent_block_id, const std::vector<int32_t>& block_ids,
                                     const std::vector<int32_t>& token_ids,
                                     const std::string& extra_key) {
  if (token_ids.size() != block_ids.size() * static_cast<size_t>(block_size_)) {
    throw std::invalid_argument("BlockPool::cache_full_blocks: expected " +
                                std::to_string(block_ids.size() * block_size_) +
                                " token ids, got " + std::to_string(token_ids.size()));
  }
  return cache_full_blocks(parent_block_id, block_ids, token_ids.data(), extra_key);
}

int32_t BlockPool::cache_full_blocks(int32_t parent_block_id, const std::vector<int32_t>& block_ids,
                                     const int32_t* token_ids, const std::string& extra_key) {
  if (!enable_caching_) return 0;
  uint64_t parent_hash = kRootBlockHash;
  uint64_t parent_content_id = 0;
  if (parent_block_id >= 0) {
    const Block& parent = at(parent_block_id);
    if (!parent.cached) return 0;  // the chain is broken (e.g. the cache was reset): stop
    parent_hash = parent.hash;
    parent_content_id = parent.content_id;
  }
  int32_t num_done = 0;
  for (size_t i = 0; i < block_ids.size(); ++i) {
    const int32_t b = block_ids[i];
    Block& blk = at(b);
    if (b == kNullBlockId) break;
    const int32_t* tokens = token_ids + i * block_size_;
    const uint64_t hash = hash_block_tokens(parent_hash, tokens, block_size_, extra_key);
    if (blk.cached) {
      // Already cached (a prefix hit): it must hold exactly this content to continue the chain.
      const bool same = blk.hash == hash && blk.parent_content_id == parent_content_id &&
                        blk.extra_key == extra_key &&
                        std::equal(tokens, tokens + block_size_,
                                   &token_ids_[static_cast<size_t>(b) * block_size_]);
      if (!same) break;
    } else {
      const int32_t twin = find_cached(hash, parent_content_id, extra_key, tokens);
      blk.content_id = twin >= 0 ? blocks_[twin].content_id : next_content_id_++;
      blk.parent_content_id = parent_content_id;
      blk.hash = hash;
      blk.extra_key = extra_key;
      blk.cached = true;
      std::copy(tokens, tokens + block_size_, &token_ids_[static_cast<size_t>(b) * block_size_]);
      auto [head, inserted] = buckets_.try_emplace(hash & bucket_mask_, b);
      blk.bucket_next = inserted ? -1 : head->second;
      head->second = b;
      ++num_cached_;
    }
    parent_hash = hash;
    parent_content_id = blk.content_id;
    ++num_done;
  }
  return num_done;
}

bool BlockPool::reset_prefix_cache() {
  if (num_free_ != num_blocks() - 1) return false;
  for (Block& blk : blocks_) {
    blk.cached = false;
    blk.hash = blk.content_id = blk.parent_content_id = 0;
    blk.extra_key.clear();
    blk.bucket_next = -1;
  }
  buckets_.clear();
  num_cached_ = 0;
  return true;
}

}  // namespace pyorch::block
