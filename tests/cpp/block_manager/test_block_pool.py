"""pyorch._C.BlockPool: allocation, reference counts, the null block, LRU eviction and the exact
prefix cache (extra keys, forced hash collisions), through the pybind11 bindings."""

import random

import pytest
from pyorch._C import BlockPool

BS = 4  # block size used by most tests


def tokens(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def cache_chain(pool: BlockPool, token_ids: list[int], extra: str = "") -> list[int]:
    """Allocates and caches full blocks for token_ids (one request that computed them)."""
    n = len(token_ids) // pool.block_size
    blocks = pool.allocate(n)
    assert pool.cache_full_blocks(-1, blocks, token_ids[: n * pool.block_size], extra) == n
    return blocks


def test_construction_and_null_block():
    pool = BlockPool(8, BS)
    assert pool.num_blocks == 8 and pool.block_size == BS and pool.enable_caching
    assert pool.num_free_blocks == 7  # block 0 is reserved
    assert BlockPool.null_block_id == 0
    assert pool.usage == 0.0
    blocks = pool.allocate(7)
    assert sorted(blocks) == list(range(1, 8)) and 0 not in blocks
    assert pool.num_free_blocks == 0 and pool.usage == 1.0
    with pytest.raises(RuntimeError, match="cannot allocate"):
        pool.allocate(1)
    pool.free([0])  # freeing the null block is a no-op
    pool.free(blocks)
    assert pool.num_free_blocks == 7


@pytest.mark.parametrize("args", [(1, 4), (0, 4), (8, 0), (8, 4, True, 65), (8, 4, True, -1)])
def test_bad_construction(args):
    with pytest.raises(ValueError):
        BlockPool(*args)


def test_refcounts_and_double_free():
    pool = BlockPool(6, BS)
    (b,) = pool.allocate(1)
    assert pool.ref_count(b) == 1
    pool.touch([b])
    assert pool.ref_count(b) == 2
    pool.free([b])
    assert pool.ref_count(b) == 1 and pool.num_free_blocks == 4
    pool.free([b])
    assert pool.ref_count(b) == 0 and pool.num_free_blocks == 5
    with pytest.raises(RuntimeError, match="double free"):
        pool.free([b])
    with pytest.raises(IndexError):
        pool.ref_count(6)
    with pytest.raises(IndexError):
        pool.free([-1])


def test_free_queue_is_lru():
    pool = BlockPool(6, BS, enable_caching=False)
    a = pool.allocate(5)
    assert a == [1, 2, 3, 4, 5]
    pool.free([3, 1])
    pool.free([5])
    # least recently freed first
    assert pool.allocate(3) == [3, 1, 5]


def test_prefix_hit_across_requests():
    pool = BlockPool(16, BS)
    prompt = tokens(10)  # 2 full blocks + 2 tokens
    blocks = cache_chain(pool, prompt)
    assert pool.num_cached_blocks == 2
    # Another request with the same first 9 tokens: only the first 2 full blocks can hit.
    assert pool.find_longest_prefix(tokens(9) + [99], "", 10) == blocks
    # max_num_tokens caps the hit to whole blocks inside it.
    assert pool.find_longest_prefix(prompt, "", 7) == blocks[:1]
    # A different second block stops the match there.
    assert pool.find_longest_prefix(tokens(4) + [50] * 6, "", 10) == blocks[:1]
    assert pool.find_longest_prefix([7] * 10, "", 10) == []
    # The hit survives the owner finishing: freed cached blocks stay reusable until evicted.
    pool.free(blocks[::-1])
    assert pool.num_free_blocks == 15 and pool.num_cached_blocks == 2
    hit = pool.find_longest_prefix(prompt, "", 9)
    assert hit == blocks
    pool.touch(hit)
    assert pool.num_free_blocks == 13 and all(pool.ref_count(b) == 1 for b in hit)
    pool.free(hit[::-1])


@pytest.mark.parametrize("hash_bits", [64, 0])
def test_chained_hash_depends_on_the_prefix(hash_bits):
    # hash_bits=0 puts every block in one bucket: only the stored tokens/parent tell them apart.
    pool = BlockPool(16, BS, True, hash_bits)
    a = cache_chain(pool, [1, 1, 1, 1, 2, 2, 2, 2])
    b = cache_chain(pool, [3, 3, 3, 3])
    # Same second block behind a different first block: no hit for the second block.
    assert pool.find_longest_prefix([3, 3, 3, 3, 2, 2, 2, 2], "", 8) == b
    assert pool.find_longest_prefix([2, 2, 2, 2], "", 4) == []
    assert pool.find_longest_prefix([1, 1, 1, 1, 2, 2, 2, 2], "salt:s", 8) == []
    assert pool.find_longest_prefix([1, 1, 1, 1, 2, 2, 2, 2], "", 8) == a


def test_continue_chain_and_duplicates_share_content():
    pool = BlockPool(16, BS)
    # Two requests compute the same prefix at once (neither hit): both cache their copy.
    p = tokens(12)
    a = pool.allocate(3)
    b = pool.allocate(3)
    assert pool.cache_full_blocks(-1, a[:1], p[:4], "") == 1
    assert pool.cache_full_blocks(-1, b[:2], p[:8], "") == 2
    # a continues its chain after its own first block; lookups then reach 3 blocks.
    assert pool.cache_full_blocks(a[0], a[1:3], p[4:12], "") == 2
    hit = pool.find_longest_prefix(p + [0], "", 13)
    assert len(hit) == 3
    # Evict every copy of a's chain except b's: b's blocks still serve the first two blocks.
    pool.free(a[::-1])
    pool.allocate(pool.num_free_blocks)  # evicts all free cached blocks (a's)
    assert len(pool.find_longest_prefix(p + [0], "", 13)) == 2


def test_extra_key_isolation():
    pool = BlockPool(16, BS)
    p = tokens(8)
    plain = cache_chain(pool, p)
    salted = cache_chain(pool, p, "salt:alice")
    assert pool.find_longest_prefix(p, "", 8) == plain
    assert pool.find_longest_prefix(p, "salt:alice", 8) == salted
    assert pool.find_longest_prefix(p, "salt:bob", 8) == []
    assert set(plain).isdisjoint(salted)


def test_lru_eviction_order_of_cached_blocks():
    pool = BlockPool(5, BS)  # 4 usable blocks
    first = cache_chain(pool, tokens(8, 0))
    second = cache_chain(pool, tokens(8, 100))
    pool.free(first[::-1])  # tail first: first[1] then first[0]
    pool.free(second[::-1])
    assert pool.num_cached_blocks == 4
    # One new block evicts the least recently freed: the tail of the first request.
    (new,) = pool.allocate(1)
    assert new == first[1] and not pool.is_cached(first[1])
    assert pool.find_longest_prefix(tokens(8, 0), "", 8) == first[:1]
    assert pool.find_longest_prefix(tokens(8, 100), "", 8) == second
    assert pool.num_evictions == 1
    # A hit block that is touched leaves the free queue and is not evicted.
    pool.touch(second)
    got = pool.allocate(1)
    assert got == [first[0]] and pool.is_cached(second[0]) and pool.is_cached(second[1])
    with pytest.raises(RuntimeError):
        pool.allocate(1)
    pool.free(got + [new] + second[::-1])


@pytest.mark.parametrize("hash_bits", [0, 1, 3])
def test_forced_collisions_never_return_wrong_blocks(hash_bits):
    """With 0-3 bucket bits every cached block shares a handful of buckets; lookups must still
    return exactly the blocks holding the queried tokens (checked against a 64-bit pool)."""
    rng = random.Random(hash_bits)
    weak = BlockPool(400, BS, True, hash_bits)
    strong = BlockPool(400, BS, True, 64)
    contents: dict[int, tuple] = {}  # weak block id -> (extra, prefix tokens ending here)
    prompts = []
    for i in range(40):
        # Many shared prefixes, identical blocks behind different parents, different salts.
        prefix = prompts[rng.randrange(len(prompts))][: BS * rng.randrange(3)] if prompts else []
        body = [rng.randrange(3) for _ in range(BS * rng.randrange(1, 4))]
        prompt = prefix + body
        extra = rng.choice(["", "", "salt:x"])
        prompts.append(prompt)
        for pool in (weak, strong):
            hit = pool.find_longest_prefix(prompt, extra, len(prompt))
            n = len(prompt) // BS
            pool.touch(hit)
            new = pool.allocate(n - len(hit))
            parent = hit[-1] if hit else -1
            pool.cache_full_blocks(parent, new, prompt[len(hit) * BS : n * BS], extra)
            if pool is weak:
                for j, b in enumerate(hit + new):
                    contents[b] = (extra, tuple(prompt[: (j + 1) * BS]))
            pool.free((hit + new)[::-1])
    num_hit_blocks = 0
    for _ in range(300):
        prompt = rng.choice(prompts)[:]
        if rng.random() < 0.5:
            prompt[rng.randrange(len(prompt))] = rng.randrange(3)
        extra = rng.choice(["", "salt:x", "salt:y"])
        hit = weak.find_longest_prefix(prompt, extra, len(prompt))
        assert len(hit) == len(strong.find_longest_prefix(prompt, extra, len(prompt)))
        num_hit_blocks += len(hit)
        for j, b in enumerate(hit):
            assert contents[b] == (extra, tuple(prompt[: (j + 1) * BS])), "wrong KV returned"
    assert num_hit_blocks > 100  # the lookups did hit, through crowded buckets


def test_cache_full_blocks_checks():
    pool = BlockPool(8, BS)
    a = pool.allocate(2)
    with pytest.raises(ValueError, match="expected 8 token ids"):
        pool.cache_full_blocks(-1, a, tokens(7), "")
    # A parent that is not cached cannot be continued.
    assert pool.cache_full_blocks(a[0], a[1:], tokens(4), "") == 0
    assert pool.num_cached_blocks == 0
    off = BlockPool(8, BS, enable_caching=False)
    b = off.allocate(1)
    assert off.cache_full_blocks(-1, b, tokens(4), "") == 0
    assert off.find_longest_prefix(tokens(4), "", 4) == []


def test_counters_and_reset():
    pool = BlockPool(8, BS)
    blocks = cache_chain(pool, tokens(8))
    assert pool.prefix_cache_queries == 0 and pool.prefix_cache_hits == 0
    pool.find_longest_prefix(tokens(10), "", 9)
    pool.find_longest_prefix([5] * 6, "", 5)
    assert pool.prefix_cache_queries == 16
    assert pool.prefix_cache_hits == 8
    assert pool.usage == pytest.approx(2 / 7)
    assert not pool.reset_prefix_cache()  # blocks are held
    pool.free(blocks)
    assert pool.reset_prefix_cache()
    assert pool.num_cached_blocks == 0 and pool.num_free_blocks == 7
    assert pool.find_longest_prefix(tokens(8), "", 8) == []


@pytest.mark.parametrize("hash_bits", [0, 2])
def test_evictions_from_crowded_buckets_keep_lookups_exact(hash_bits):
    """A small pool evicts cached blocks from the middle of shared buckets (the intrusive bucket
    chains): every later lookup must still equal a 64-bit pool's, and never return a block
    that was evicted and reused."""
    rng = random.Random(7 + hash_bits)
    weak = BlockPool(24, BS, True, hash_bits)
    strong = BlockPool(24, BS, True, 64)
    for _ in range(200):
        prompt = [rng.randrange(2) for _ in range(BS * rng.randrange(1, 5))]
        extra = rng.choice(["", "salt:x"])
        lengths = []
        for pool in (weak, strong):
            hit = pool.find_longest_prefix(prompt, extra, len(prompt))
            lengths.append(len(hit))
            pool.touch(hit)
            new = pool.allocate(len(prompt) // BS - len(hit))
            pool.cache_full_blocks(hit[-1] if hit else -1, new, prompt, extra, len(hit) * BS)
            for b in hit:  # a hit block is still cached (never evicted while found)
                assert pool.is_cached(b)
            pool.free((hit + new)[::-1])
        assert lengths[0] == lengths[1]
    assert weak.num_evictions > 50 and weak.num_cached_blocks <= 23


def test_token_offset_reads_the_blocks_from_a_longer_list():
    pool = BlockPool(8, BS)
    a = pool.allocate(3)
    prompt = tokens(13)
    assert pool.cache_full_blocks(-1, a[:1], prompt, "", 0) == 1
    assert pool.cache_full_blocks(a[0], a[1:3], prompt, "", BS) == 2
    assert pool.find_longest_prefix(prompt, "", 13) == a
    with pytest.raises(ValueError, match="expected 8 token ids from offset 8"):
        pool.cache_full_blocks(a[0], a[1:3], prompt, "", 2 * BS)
    with pytest.raises(ValueError, match="from offset"):
        pool.cache_full_blocks(a[0], a[1:3], prompt, "", -2)


def test_lookup_reads_tokens_only_up_to_the_first_miss():
    """A lookup that misses on its first block does not read (or convert) the rest of the
    prompt: a non-integer past it is never seen; one inside the matched range is an error."""
    pool = BlockPool(8, BS)
    blocks = cache_chain(pool, tokens(8))
    prompt = [99] * BS + ["not a token"] * 100
    assert pool.find_longest_prefix(prompt, "", len(prompt)) == []
    assert pool.prefix_cache_queries == len(prompt)
    assert pool.find_longest_prefix(tokens(8) + ["x"], "", 8) == blocks
    with pytest.raises(TypeError):
        pool.find_longest_prefix(tokens(4) + ["x"] * 4, "", 8)
    with pytest.raises(ValueError, match="does not fit int32"):
        pool.find_longest_prefix(tokens(4) + [2**40] * 4, "", 8)
