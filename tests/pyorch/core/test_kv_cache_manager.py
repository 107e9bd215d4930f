"""KVCacheManager over the C++ pool: slots, prefix hits (never the whole prompt), eviction-aware
allocation, caching after compute, salts, prompt-logprob requests, freeing order, stats."""

import pytest

from pyorch.core.kv_cache_manager import KVCacheManager
from pyorch.core.request import Request
from pyorch.sampling_params import SamplingParams

BS = 4


def make_request(rid: str, prompt: list[int], **kwargs) -> Request:
    salt = kwargs.pop("cache_salt", None)
    return Request(rid, prompt, SamplingParams(**kwargs), None, 0.0, cache_salt=salt)


def run_prefill(kv: KVCacheManager, req: Request) -> list[int]:
    """Admits a request the way the scheduler does, computes its whole prompt, caches it."""
    hit, num_hit = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - num_hit, num_hit, hit) is not None
    req.num_computed_tokens = req.num_tokens
    kv.cache_blocks(req, req.num_computed_tokens)
    return kv.get_block_ids(req.request_id)


def test_allocate_grows_by_blocks_and_frees():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    req = make_request("a", list(range(6)))
    new = kv.allocate_slots(req, 6)
    assert len(new) == 2 and kv.get_block_ids("a") == new
    req.num_computed_tokens = 6
    assert kv.allocate_slots(req, 2) == []  # still fits in block 2
    req.num_computed_tokens = 8
    assert len(kv.allocate_slots(req, 1)) == 1
    assert kv.usage == pytest.approx(3 / 9)
    kv.free(req)
    assert kv.num_free_blocks == 9 and kv.usage == 0.0 and kv.get_block_ids("a") == []


def test_out_of_blocks_returns_none_and_changes_nothing():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    a = make_request("a", list(range(8)))
    assert kv.allocate_slots(a, 8) is not None
    b = make_request("b", list(range(100, 112)))
    assert kv.allocate_slots(b, 12) is None
    assert kv.num_free_blocks == 1 and kv.get_block_ids("b") == []
    assert kv.allocate_slots(b, 4) is not None
    kv.free(a)
    kv.free(b)
    assert kv.num_free_blocks == 3


def test_prefix_hit_never_covers_the_whole_prompt():
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    a = make_request("a", list(range(8)))
    blocks = run_prefill(kv, a)
    kv.free(a)
    same = make_request("b", list(range(8)))
    hit, num_hit = kv.get_computed_blocks(same)
    assert hit == blocks[:1] and num_hit == 4  # the last token must be recomputed
    longer = make_request("c", list(range(9)))
    hit, num_hit = kv.get_computed_blocks(longer)
    assert hit == blocks and num_hit == 8
    # A lookup alone counts nothing (the scheduler repeats it for a request that waits); an
    # admitted request's lookup is counted once.
    assert kv.prefix_cache_queries == 0 and kv.prefix_cache_hits == 0
    kv.record_prefix_lookup(longer.num_tokens, num_hit)
    kv.record_prefix_lookup(same.num_tokens, 4)
    assert kv.prefix_cache_queries == 9 + 8 and kv.prefix_cache_hits == 8 + 4
    assert kv.prefix_cache_requests == 2
    assert kv.prefix_cache_hit_rate == pytest.approx(12 / 17)


def test_hits_on_free_blocks_are_not_counted_twice():
    # 4 usable blocks; a 2-block prefix is cached and free. A request reusing it and needing
    # 2 more blocks fits exactly; one needing 3 more does not (the hit blocks are not free for it).
    kv = KVCacheManager(num_blocks=5, block_size=BS)
    a = make_request("a", list(range(8)))
    run_prefill(kv, a)
    kv.free(a)
    assert kv.num_free_blocks == 4
    big = make_request("big", list(range(8)) + [50] * 13)  # 21 tokens: 6 blocks, 2 hit
    hit, num_hit = kv.get_computed_blocks(big)
    assert num_hit == 8
    assert kv.allocate_slots(big, big.num_tokens - num_hit, num_hit, hit) is None
    ok = make_request("ok", list(range(8)) + [50] * 8)  # 16 tokens: 4 blocks, 2 hit
    hit, num_hit = kv.get_computed_blocks(ok)
    new = kv.allocate_slots(ok, ok.num_tokens - num_hit, num_hit, hit)
    assert new is not None and len(new) == 2
    assert kv.get_block_ids("ok")[:2] == hit and kv.num_free_blocks == 0
    kv.free(ok)


def test_hits_on_held_blocks_leave_the_free_blocks_to_the_request():
    # 4 usable blocks; a (running) holds a cached 2-block prefix, 2 blocks are free. b hits a's
    # blocks (held: not in the free queue) and needs exactly the 2 free ones: it fits, though the
    # bound that counts every hit block as evictable says it might not.
    kv = KVCacheManager(num_blocks=5, block_size=BS)
    a = make_request("a", list(range(8)))
    run_prefill(kv, a)
    assert kv.num_free_blocks == 2
    b = make_request("b", list(range(8)) + [50] * 8)  # 16 tokens: 4 blocks, 2 hit
    hit, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 8 and hit == kv.get_block_ids("a")
    new = kv.allocate_slots(b, b.num_tokens - num_hit, num_hit, hit)
    assert new is not None and len(new) == 2 and kv.num_free_blocks == 0
    c = make_request("c", list(range(8)) + [60] * 5)  # 2 new blocks, none free
    hit, num_hit = kv.get_computed_blocks(c)
    assert kv.allocate_slots(c, c.num_tokens - num_hit, num_hit, hit) is None


def test_blocks_are_cached_only_once_computed():
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    a = make_request("a", list(range(12)))
    assert kv.allocate_slots(a, 12) is not None
    b = make_request("b", list(range(12)) + [1])
    assert kv.get_computed_blocks(b) == ([], 0)  # scheduled, not computed yet
    a.num_computed_tokens = 7
    kv.cache_blocks(a, 7)
    assert kv.get_computed_blocks(b)[1] == 4
    a.num_computed_tokens = 12
    kv.cache_blocks(a, 12)
    assert kv.get_computed_blocks(b)[1] == 12
    kv.free(a)


def test_decode_blocks_are_cached_too():
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    a = make_request("a", list(range(6)))
    run_prefill(kv, a)
    a.append_output_token_ids([40, 41])
    assert kv.allocate_slots(a, 2) == []
    a.num_computed_tokens = 8
    kv.cache_blocks(a, 8)
    kv.free(a)
    b = make_request("b", list(range(6)) + [40, 41, 9])
    assert kv.get_computed_blocks(b)[1] == 8


def test_salt_isolation_and_prompt_logprobs_skip_lookup():
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    a = make_request("a", list(range(9)), cache_salt="alice")
    run_prefill(kv, a)
    kv.free(a)
    assert kv.get_computed_blocks(make_request("b", list(range(9))))[1] == 0
    assert kv.get_computed_blocks(make_request("c", list(range(9)), cache_salt="bob"))[1] == 0
    assert kv.get_computed_blocks(make_request("d", list(range(9)), cache_salt="alice"))[1] == 8
    lp = make_request("e", list(range(9)), cache_salt="alice", prompt_logprobs=1)
    assert kv.get_computed_blocks(lp) == ([], 0)


def test_free_puts_the_tail_first_in_eviction_order():
    kv = KVCacheManager(num_blocks=4, block_size=BS)  # 3 usable blocks
    a = make_request("a", list(range(12)))
    blocks = run_prefill(kv, a)
    kv.free(a)
    # One new block evicts a's last block; its first two blocks still hit.
    b = make_request("b", [99] * 3)
    assert kv.allocate_slots(b, 3) == [blocks[2]]
    c = make_request("c", list(range(12)) + [5])
    assert kv.get_computed_blocks(c) == (blocks[:2], 8)
    kv.free(b)


def test_caching_disabled():
    kv = KVCacheManager(num_blocks=8, block_size=BS, enable_caching=False)
    a = make_request("a", list(range(8)))
    run_prefill(kv, a)
    kv.free(a)
    assert kv.get_computed_blocks(make_request("b", list(range(9)))) == ([], 0)
    assert kv.prefix_cache_queries == 0


def test_reset_prefix_cache():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    a = make_request("a", list(range(8)))
    run_prefill(kv, a)
    assert not kv.reset_prefix_cache()
    kv.free(a)
    assert kv.reset_prefix_cache()
    assert kv.get_computed_blocks(make_request("b", list(range(9)))) == ([], 0)
