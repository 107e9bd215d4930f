"""KVCacheManager: each request's KV blocks, on top of the C++ block pool (`pyorch._C.BlockPool`).

Ownership: the C++ pool owns reference counts, the LRU free queue and the prefix cache (see
cpp/block_manager/block_pool.h); this class owns the request -> block list map and decides when a
request's blocks become cacheable. Block ids are rows of every layer's KV cache
([num_blocks, block_size, num_kv_heads, head_size]); block 0 is the null block (padding).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch  # noqa: F401  (loads libtorch, which pyorch._C links against)

from pyorch._C import BlockPool
from pyorch.core.request import Request
from pyorch.utils import cdiv

NULL_BLOCK_ID = 0


class KVCacheManager:
    """Allocates, caches and frees the blocks of requests.

    Parameters
    ----------
    num_blocks: blocks in the pool, the null block included (num_blocks - 1 are usable).
    block_size: tokens per block.
    enable_caching: prefix caching of full blocks.
    hash_bits: bucket-key bits of the prefix hash (64; tests shrink it to force collisions).
    """

    def __init__(
        self, num_blocks: int, block_size: int, enable_caching: bool = True, hash_bits: int = 64
    ) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, block_size, enable_caching, hash_bits)
        self.req_to_blocks: dict[str, list[int]] = {}
        # Leading blocks of each request already registered in the prefix cache.
        self.num_cached_blocks: dict[str, int] = {}
        # Prefix-cache stats, counted once per admitted request (record_prefix_lookup), not per
        # lookup: a request that waits at the head of the queue is looked up every step.
        self.prefix_cache_requests = 0
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found

    # ---- capacity and stats ----------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_usable_blocks(self) -> int:
        """Blocks that can be handed out: all but the null block."""
        return self.pool.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Free blocks, cached (evictable) ones included."""
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests, in [0, 1]."""
        return self.pool.usage

    def record_prefix_lookup(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        """Counts the lookup of a request that was admitted: its tokens, and those it found."""
        self.prefix_cache_requests += 1
        self.prefix_cache_queries += num_query_tokens
        self.prefix_cache_hits += num_hit_tokens

    @property
    def prefix_cache_hit_rate(self) -> float:
        queries = self.prefix_cache_queries
        return self.prefix_cache_hits / queries if queries else 0.0

    def get_block_ids(self, request_id: str) -> list[int]:
        return self.req_to_blocks.get(request_id, [])

    # ---- per request -----------------------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """The longest cached prefix of a request that holds no blocks: (block ids, tokens).

        At most num_tokens - 1 tokens hit, so the last token is always computed (it yields the
        logits to sample from). Takes no references: pass the result to allocate_slots.
        """
        if not self.enable_caching or not request.use_prefix_cache:
            return [], 0
        block_ids = self.pool.find_longest_prefix(
            request.all_token_ids, request.prefix_cache_key, request.num_tokens - 1
        )
        return block_ids, len(block_ids) * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Sequence[int] = (),
    ) -> list[int] | None:
        """Makes room for num_new_tokens more tokens of the request.

        new_computed_blocks / num_new_computed_tokens are a prefix hit from get_computed_blocks
        (only for a request that holds no blocks yet); they are taken before anything is evicted.
        Returns the newly allocated block ids ([] when none are needed), or None when the pool
        cannot supply them (then nothing changes).
        """
        req_id = request.request_id
        req_blocks = self.req_to_blocks.get(req_id)
        if req_blocks and not new_computed_blocks and (
                request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
                <= len(req_blocks) * self.block_size):
            return []  # the common decode step (every step, every request): room in the last block
        if new_computed_blocks and req_blocks:
            raise ValueError(f"request {req_id}: a prefix hit is only for a request without blocks")
        num_held = (len(req_blocks) if req_blocks else 0) + len(new_computed_blocks)
        num_total = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        num_new_blocks = max(cdiv(num_total, self.block_size) - num_held, 0)
        if num_new_blocks == 0 and req_blocks is not None and not new_computed_blocks:
            return []  # an empty block list that needs none
        # Hit blocks nobody holds sit in the free queue: touching them removes them from it.
        # Counting them is a call per block, so only when the bound that counts every hit
        # block as evictable says the pool may be short (a 512-block hit: ~60% of the
        # per-request prefix-cache cost, bench/prefix_cache_cpu.py).
        num_free = self.pool.num_free_blocks
        if num_new_blocks > num_free - len(new_computed_blocks):
            ref_count = self.pool.ref_count
            num_evictable_hits = sum(1 for b in new_computed_blocks if ref_count(b) == 0)
            if num_new_blocks > num_free - num_evictable_hits:
                return None

        if req_blocks is None:
            req_blocks = self.req_to_blocks[req_id] = []
            self.num_cached_blocks[req_id] = 0
        if new_computed_blocks:
            self.pool.touch(list(new_computed_blocks))
            req_blocks.extend(new_computed_blocks)
            self.num_cached_blocks[req_id] = len(new_computed_blocks)
        new_blocks: list[int] = self.pool.allocate(num_new_blocks) if num_new_blocks else []
        req_blocks.extend(new_blocks)
        return new_blocks

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Registers the request's full blocks among its first num_computed_tokens tokens.

        Call it only once the step that writes those tokens' KV is scheduled for good (no
        preemption can undo it before it runs): a hit in a later step reads KV that step wrote,
        and a hit in the same step reads it too, since every layer writes the KV of all of a
        step's tokens before its attention reads any.
        """
        if not self.enable_caching:
            return
        req_id = request.request_id
        # Called for every running request on every step: most calls fill no new block.
        num_cached = self.num_cached_blocks.get(req_id)
        if num_cached is None or num_computed_tokens // self.block_size <= num_cached:
            return
        req_blocks = self.req_to_blocks[req_id]
        num_full = min(num_computed_tokens // self.block_size, len(req_blocks))
        if num_full <= num_cached:
            return
        bs = self.block_size
        parent = req_blocks[num_cached - 1] if num_cached > 0 else -1
        # The pool reads the blocks' tokens straight from the request's list (no sliced copy).
        self.pool.cache_full_blocks(
            parent,
            req_blocks[num_cached:num_full],
            request.all_token_ids,
            request.prefix_cache_key,
            num_cached * bs,
        )
        # If the chain broke (parent no longer cached), later calls are cheap no-ops.
        self.num_cached_blocks[req_id] = num_full

    def free(self, request: Request) -> None:
        """Returns the request's blocks, tail first, so its last blocks are evicted first."""
        req_blocks = self.req_to_blocks.pop(request.request_id, None)
        self.num_cached_blocks.pop(request.request_id, None)
        if req_blocks:
            self.pool.free(req_blocks[::-1])

    def reset_prefix_cache(self) -> bool:
        """Drops every cached block; refused (False) while any request holds blocks."""
        return self.pool.reset_prefix_cache()
