// The KV-cache block pool and its prefix cache. Plain C++17, no torch; bound to Python as
// pyorch._C.BlockPool (bindings.cpp) and wrapped by pyorch/engine/kv_cache_manager.py.
//
// Ownership: the pool owns every block's reference count, the free queue and the prefix cache.
// It knows nothing of requests: the Python KVCacheManager keeps each request's block list.
// Not thread-safe: the scheduler drives it from one thread.
//
// Blocks:
//   - block 0 is the null block: reserved for padding, never handed out, never freed.
//   - a block with ref_count 0 sits in the free queue (a doubly linked list). allocate() pops the
//     head, free() appends to the tail, so the least recently freed block is reused first (LRU).
//   - a FULL block can be cached: its (bucket hash, content id, parent content id, extra key,
//     token ids) are recorded and it can be found by later requests. Freeing a cached block keeps
//     it cached (evictable) in the free queue; it is evicted when allocate() pops it, and a lookup
//     hit that touch()es it takes it out of the free queue again.
//
// Exactness: a cached block's content id names the whole token prefix ending at that block: it
// is assigned once per distinct (parent content id, extra key, token ids) and never reused, and
// identical content cached twice (two requests computing the same prefix at once) shares one id.
// A lookup walks a chain block by block and accepts a block only if its parent content id equals
// the content id of the block accepted one step earlier and its extra key and token ids are equal,
// so a match is exact whatever the hash does; the hash only picks the bucket.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace pyorch::block {

class BlockPool {
 public:
  static constexpr int32_t kNullBlockId = 0;

  // num_blocks includes the null block (so num_blocks - 1 are usable, and it must be >= 2).
  // hash_bits (0..64) is how many low bits of the block hash form the bucket key: 64 in
  // production; tests shrink it to force collisions.
  BlockPool(int32_t num_blocks, int32_t block_size, bool enable_caching, int32_t hash_bits = 64);

  int32_t num_blocks() const { return static_cast<int32_t>(blocks_.size()); }
  int32_t block_size() const { return block_size_; }
  bool enable_caching() const { return enable_caching_; }
  // Blocks in the free queue, cached (evictable) ones included.
  int32_t num_free_blocks() const { return num_free_; }
  // Fraction of usable blocks held by requests (ref_count > 0), in [0, 1].
  double usage() const;
  int32_t ref_count(int32_t block_id) const { return at(block_id).ref_count; }
  bool is_cached(int32_t block_id) const { return at(block_id).cached; }
  int32_t num_cached_blocks() const { return num_cached_; }

  // Takes num_blocks blocks from the head of the free queue (evicting cached ones), each with
  // ref_count 1. Throws std::runtime_error when fewer are free: check num_free_blocks() first.
  std::vector<int32_t> allocate(int32_t num_blocks);
  // Drops one reference from each block, in order; blocks reaching 0 go to the free queue tail in
  // that order (pass a request's blocks reversed so its tail is evicted first). Skips null ids.
  void free(const std::vector<int32_t>& block_ids);
  // Takes one reference on each block (prefix-cache hits), pulling free ones out of the free queue.
  void touch(const std::vector<int32_t>& block_ids);

  // Longest cached prefix of token_ids (with this extra key) in whole blocks, considering at most
  // max_num_tokens tokens. Takes no references. Counts token_ids.size() queried tokens and the
  // matched tokens as hits.
  std::vector<int32_t> find_longest_prefix(const std::vector<int32_t>& token_ids,
                                           const std::string& extra_key, int64_t max_num_tokens);
  // The same lookup over a sequence of num_tokens tokens read block by block: read(start, n,
  // out) writes tokens [start, start + n) to out[0, n). It stops reading at the first block that
  // misses, so a miss costs one block, not the whole prompt (the Python binding reads a list
  // this way instead of converting all of it first).
  using TokenReader = std::function<void(int64_t start, int64_t n, int32_t* out)>;
  std::vector<int32_t> find_longest_prefix(int64_t num_tokens, const TokenReader& read,
                                           const std::string& extra_key, int64_t max_num_tokens);
  // Caches full blocks that continue the chain after parent_block_id (-1: they start a sequence;
  // otherwise it must be cached). token_ids: [block_ids.size() * block_size], their tokens in
  // order. Returns how many blocks are cached afterwards (stops early if the chain cannot be
  // continued). A no-op when caching is off.
  int32_t cache_full_blocks(int32_t parent_block_id, const std::vector<int32_t>& block_ids,
                            const std::vector<int32_t>& token_ids, const std::string& extra_key);
  // The same from a pointer: token_ids: [block_ids.size() * block_size].
  int32_t cache_full_blocks(int32_t parent_block_id, const std::vector<int32_t>& block_ids,
                            const int32_t* token_ids, const std::string& extra_key);
  // Drops every cached block. Refused (returns false) while any block is held.
  bool reset_prefix_cache();

  int64_t prefix_cache_queries() const { return num_query_tokens_; }  // tokens looked up
  int64_t prefix_cache_hits() const { return num_hit_tokens_; }       // tokens found
  int64_t num_evictions() const { return num_evictions_; }

 private:
  struct Block {
    int32_t ref_count = 0;
    int32_t prev = -1;  // free-queue links (block ids), -1 at the ends
    int32_t next = -1;
    bool in_free_queue = false;
    bool cached = false;
    uint64_t hash = 0;               // full 64-bit chained hash (bucket key = hash & mask)
    uint64_t content_id = 0;         // names the whole prefix ending here (0 = none)
    uint64_t parent_content_id = 0;  // 0 for a sequence's first block
    std::string extra_key;
    int32_t bucket_next = -1;  // next cached block of the same bucket, -1 at the end
  };

  const Block& at(int32_t block_id) const;
  Block& at(int32_t block_id) { return const_cast<Block&>(std::as_const(*this).at(block_id)); }
  void push_free_tail(int32_t block_id);
  void unlink_free(int32_t block_id);
  void evict(int32_t block_id);
  // The cached block that holds (parent, extra key, tokens), or -1.
  int32_t find_cached(uint64_t hash, uint64_t parent_content_id, const std::string& extra_key,
                      const int32_t* token_ids) const;

  int32_t block_size_;
  bool enable_caching_;
  uint64_t bucket_mask_;
  std::vector<Block> blocks_;
  std::vector<int32_t> token_ids_;  // [num_blocks, block_size]: the tokens of cached blocks
  // bucket key -> first cached block of the bucket; the rest follow Block::bucket_next. An
  // intrusive chain: caching a block allocates no per-bucket vector (the miss path's main cost).
  std::unordered_map<uint64_t, int32_t> buckets_;
  int32_t free_head_ = -1;
  int32_t free_tail_ = -1;
  int32_t num_free_ = 0;
  int32_t num_cached_ = 0;
  uint64_t next_content_id_ = 1;
  int64_t num_query_tokens_ = 0;
  int64_t num_hit_tokens_ = 0;
  int64_t num_evictions_ = 0;
};

}  // namespace pyorch::block
