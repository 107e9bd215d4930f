"""paged_attention on CPU and CUDA against the float64 block-table-walking reference."""

import math

import pytest
import torch

from pyorch import _ops
from tests.conftest import DEVICES, capture_graph, tol
from tests.reference import attention as ref

# vLLM's attention's head sizes, every one of which the CUDA op runs (cuda/attention/attention.cu):
# 64/128/192/256 take the wgmma prefill kernel with 16-bit caches, 120 runs on 128-dim tiles.
HEAD_SIZES = [32, 64, 80, 96, 112, 120, 128, 192, 256]
# Sizes outside that list: the CPU op runs them (on the next tile capacity up), CUDA refuses them.
CPU_ONLY_HEAD_SIZES = [8, 40, 72, 136, 300]
# (num_heads, num_kv_heads): GQA ratios 1, 4 and 8, with an odd head count for ratio 1.
HEADS = [(7, 7), (16, 4), (32, 4)]
# (q_len, seq_len) per sequence: decodes, a chunked prefill of 37 over 200 cached tokens, full
# prefills, awkward lengths, and a sequence with no query this step.
MIXED = [(1, 1), (1, 517), (37, 237), (83, 83), (1, 48), (5, 5), (0, 17)]
SENTINEL = 42.0  # padding rows past query_start_loc[-1] must keep it
PAD_TOKENS = 3


def dtypes_for(device: str) -> list[torch.dtype]:
    return [torch.float16, torch.bfloat16] if device == "cuda" else [torch.float32, torch.bfloat16]


def attn_tol(dtype: torch.dtype) -> dict:
    # fp32 sums hundreds of terms; fp16/bf16 also round the probabilities to the dtype on CUDA.
    return tol(dtype, 10.0 if dtype == torch.float32 else 2.0)


def make_batch(
    spec: list[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    dtype: torch.dtype,
    device: str,
    kv_cache_dtype: str = "auto",
    fp8_storage: torch.dtype = torch.uint8,
    query_view: bool = False,
) -> dict:
    """Random inputs for one call: caches full of random data (unused blocks too), a random
    non-contiguous block table with garbage in its unused columns, PAD_TOKENS padding rows."""
    num_seqs = len(spec)
    blocks_needed = [math.ceil(seq_len / block_size) for _, seq_len in spec]
    max_blocks = max(blocks_needed) + 2
    num_blocks = sum(blocks_needed) + 7
    perm = torch.randperm(num_blocks).tolist()
    block_table = torch.randint(0, num_blocks, (num_seqs, max_blocks), dtype=torch.int32)
    for i, n in enumerate(blocks_needed):
        block_table[i, :n] = torch.tensor(perm[:n], dtype=torch.int32)
        perm = perm[n:]
    cache_shape = (num_blocks, block_size, num_kv_heads, head_size)
    k_scale = torch.tensor([1.0])
    v_scale = torch.tensor([1.0])
    if kv_cache_dtype == "auto":
        key_cache = torch.randn(cache_shape, dtype=dtype)
        value_cache = torch.randn(cache_shape, dtype=dtype)
    else:
        k_scale, v_scale = torch.tensor([0.037]), torch.tensor([0.052])
        key_cache = (torch.randn(cache_shape) / k_scale).to(torch.float8_e4m3fn).view(fp8_storage)
        value_cache = (torch.randn(cache_shape) / v_scale).to(torch.float8_e4m3fn).view(fp8_storage)
    q_lens = [q for q, _ in spec]
    query_start_loc = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    num_tokens = int(query_start_loc[-1]) + PAD_TOKENS
    if query_view:  # a view of a fused qkv projection: token stride != num_heads * head_size
        width = (num_heads + 2 * num_kv_heads) * head_size
        qkv = torch.randn(num_tokens, width, dtype=dtype, device=device)
        query = qkv[:, : num_heads * head_size].view(num_tokens, num_heads, head_size)
    else:
        query = torch.randn(num_tokens, num_heads, head_size, dtype=dtype, device=device)
    return dict(
        query=query,
        key_cache=key_cache.to(device),
        value_cache=value_cache.to(device),
        query_start_loc=query_start_loc.to(device),
        seq_lens=torch.tensor([s for _, s in spec], dtype=torch.int32, device=device),
        block_table=block_table.to(device),
        max_query_len=max(q_lens),
        max_seq_len=max(s for _, s in spec),
        kv_cache_dtype=kv_cache_dtype,
        k_scale=k_scale.to(device),
        v_scale=v_scale.to(device),
    )


def run_op(b: dict, causal: bool = True, sliding_window: int = 0, soft_cap: float = 0.0,
           out_view: bool = False) -> torch.Tensor:  # fmt: skip
    out = torch.full_like(b["query"], SENTINEL, memory_format=torch.contiguous_format)
    if out_view:  # token stride past num_heads * head_size, head stride past head_size
        t, h, d = out.shape
        out = torch.full((t, h + 1, d + 8), SENTINEL, dtype=out.dtype, device=out.device)[:, 1:, 8:]
    scale = 1.0 / math.sqrt(b["query"].shape[-1])
    _ops.paged_attention(
        out, b["query"], b["key_cache"], b["value_cache"], b["query_start_loc"], b["seq_lens"],
        b["block_table"], b["max_query_len"], b["max_seq_len"], scale, causal, sliding_window,
        soft_cap, b["kv_cache_dtype"], b["k_scale"], b["v_scale"],
    )  # fmt: skip
    return out


def check(b: dict, out: torch.Tensor, causal: bool = True, sliding_window: int = 0,
          soft_cap: float = 0.0) -> None:  # fmt: skip
    want = ref.paged_attention(
        b["query"], b["key_cache"], b["value_cache"], b["query_start_loc"], b["seq_lens"],
        b["block_table"], 1.0 / math.sqrt(b["query"].shape[-1]), causal, sliding_window, soft_cap,
        b["kv_cache_dtype"], b["k_scale"].cpu(), b["v_scale"].cpu(),
    )  # fmt: skip
    n = want.shape[0]
    got = out[:n].cpu().double()
    assert not got.isnan().any(), "NaN in the output"
    torch.testing.assert_close(got, want, **attn_tol(out.dtype))
    pad = out[n:]
    assert pad.shape[0] == PAD_TOKENS and (pad == SENTINEL).all(), "padding rows were written"


# Non-causal rows take no head-size-specific code: the sizes added for vLLM's list run causal only.
MIXED_HEAD_CAUSAL = [(d, c) for d in [64, 80, 96, 128, 256] for c in (True, False)] + [
    (d, True) for d in [32, 112, 120, 192]
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype_idx", [0, 1])
@pytest.mark.parametrize("head_size,causal", MIXED_HEAD_CAUSAL)
@pytest.mark.parametrize("num_heads,num_kv_heads", HEADS)
def test_mixed_batch(device: str, dtype_idx: int, head_size: int, num_heads: int,
                     num_kv_heads: int, causal: bool) -> None:  # fmt: skip
    dtype = dtypes_for(device)[dtype_idx]
    b = make_batch(MIXED, num_heads, num_kv_heads, head_size, 16, dtype, device, query_view=True)
    check(b, run_op(b, causal), causal)


@pytest.mark.parametrize("device", DEVICES)
def test_cpu_float16(device: str) -> None:
    if device != "cpu":
        pytest.skip("float16 is a CPU-only extra here; CUDA covers it in test_mixed_batch")
    b = make_batch(MIXED, 8, 2, 64, 16, torch.float16, device)
    check(b, run_op(b))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_heads,num_kv_heads", [(32, 8), (8, 1)])
def test_long_prefill(device: str, num_heads: int, num_kv_heads: int) -> None:
    b = make_batch([(769, 769), (1, 1000), (0, 3), (300, 1100)], num_heads, num_kv_heads, 128, 16,
                   torch.bfloat16, device)  # fmt: skip
    check(b, run_op(b))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block_size", [1, 8, 16, 32])
def test_block_sizes(device: str, block_size: int) -> None:
    b = make_batch(MIXED, 16, 4, 128, block_size, torch.bfloat16, device)
    check(b, run_op(b))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sliding_window", [1, 16, 100, 5000])
@pytest.mark.parametrize("causal", [True, False])
def test_sliding_window(device: str, sliding_window: int, causal: bool) -> None:
    b = make_batch(MIXED + [(200, 700)], 16, 4, 64, 16, torch.bfloat16, device)
    check(b, run_op(b, causal, sliding_window), causal, sliding_window)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("soft_cap", [5.0, 50.0])
def test_soft_cap(device: str, soft_cap: float) -> None:
    b = make_batch(MIXED, 8, 4, 256, 16, torch.bfloat16, device)
    b["query"] = b["query"] * 4  # large scores, so that the cap bites
    check(b, run_op(b, True, 0, soft_cap), True, 0, soft_cap)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype_idx", [0, 1])
@pytest.mark.parametrize("head_size", [64, 96, 128, 256])
@pytest.mark.parametrize("fp8_storage", [torch.uint8, torch.float8_e4m3fn])
@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e4m3"])
def test_fp8_kv_cache(device: str, dtype_idx: int, head_size: int, fp8_storage: torch.dtype,
                      kv_cache_dtype: str) -> None:  # fmt: skip
    dtype = dtypes_for(device)[dtype_idx]
    b = make_batch(MIXED, 16, 4, head_size, 16, dtype, device, kv_cache_dtype, fp8_storage)
    check(b, run_op(b))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_never_reads_unused_slots(device: str, kv_cache_dtype: str) -> None:
    """NaN in every cache slot that no query may see: any read of one poisons the output."""
    b = make_batch(MIXED, 16, 4, 128, 16, dtypes_for(device)[1], device, kv_cache_dtype)
    visible = torch.zeros(b["key_cache"].shape[:2], dtype=torch.bool)
    table = b["block_table"].cpu()
    for i, seq_len in enumerate(b["seq_lens"].tolist()):
        for pos in range(seq_len):
            visible[table[i, pos // 16], pos % 16] = True
    poison = float("nan") if kv_cache_dtype == "auto" else 0x7F  # 0x7f: e4m3 NaN
    for name in ("key_cache", "value_cache"):
        b[name][~visible.to(device)] = poison
    check(b, run_op(b))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_seqs,seq_len", [(1, 3000), (3, 1500), (300, 130)])
def test_decode_batches(device: str, num_seqs: int, seq_len: int) -> None:
    """Pure decode: long single sequences (CUDA splits the KV range) and a wide batch (no split)."""
    spec = [(1, seq_len - (7 * i) % 100) for i in range(num_seqs)]
    b = make_batch(spec, 32, 8, 128, 16, dtypes_for(device)[1], device)
    check(b, run_op(b))


@pytest.mark.parametrize("device", [d for d in DEVICES if d != "cpu"])
@pytest.mark.parametrize("head_size", HEAD_SIZES)
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
@pytest.mark.parametrize("block_size,sliding_window", [(16, 0), (32, 0), (16, 50)])
def test_decode_wide_batches(device: str, head_size: int, kv_cache_dtype: str, block_size: int,
                             sliding_window: int) -> None:  # fmt: skip
    """Decode batches of 160 x 8 kv heads = 1,280 CTAs, past the 8 a SM (1,056 on a 132-SM
    Hopper) from which CUDA launches its 3-CTA decode shape where three fit an SM (every head
    size here but 256), the 2-CTA one otherwise. Ragged lengths from 1 to ~900 keys, a few
    two-token queries. (On an H200 the 120-sequence form of this test ran the 3-CTA shape under
    the launcher's first threshold, 3 a SM: 54 passed.)"""
    spec = [(1 + (i % 11 == 0), 1 + (i * 37) % 900) for i in range(160)]
    b = make_batch(spec, 32, 8, head_size, block_size, torch.bfloat16, device, kv_cache_dtype)
    check(b, run_op(b, True, sliding_window), True, sliding_window)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("head_size", [64, 128, 256])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(16, 1), (32, 1), (12, 4)])
@pytest.mark.parametrize("sliding_window", [0, 40])
def test_decode_rows_per_cta(device: str, head_size: int, num_heads: int, num_kv_heads: int,
                             sliding_window: int) -> None:  # fmt: skip
    """CTAs whose rows fit one m16 tile (CUDA splits their keys across warps): group sizes 16
    (exactly one tile), 32 (two tiles: the general path) and 3, with 1-4 query tokens, a long
    decode that splits the KV range, and the short last CTA of a longer query."""
    spec = [(1, 1), (1, 300), (2, 77), (3, 16), (4, 129), (1, 2500), (22, 150)]
    b = make_batch(spec, num_heads, num_kv_heads, head_size, 16, dtypes_for(device)[1], device)
    check(b, run_op(b, True, sliding_window), True, sliding_window)


# Prefill rows (q_len * group_size > 16; paged_prefill_kernel on CUDA, 128-row CTAs over 64-key
# tiles): several row tiles and KV tiles per sequence, chunked prefills over a cached prefix
# (130 over 1070), 17-row and 20-row sequences at the decode boundary, decodes (1, 4) beside them.
PREFILL_MIXED = [(300, 300), (1, 700), (130, 1200), (17, 17), (5, 900), (4, 50), (0, 9), (64, 64)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype_idx", [0, 1])
@pytest.mark.parametrize("head_size", HEAD_SIZES)
@pytest.mark.parametrize("num_heads,num_kv_heads", [(3, 3), (12, 4), (16, 2)])
def test_prefill_batch(device: str, dtype_idx: int, head_size: int, num_heads: int,
                       num_kv_heads: int) -> None:  # fmt: skip
    dtype = dtypes_for(device)[dtype_idx]
    b = make_batch(PREFILL_MIXED, num_heads, num_kv_heads, head_size, 16, dtype, device,
                   query_view=True)  # fmt: skip
    check(b, run_op(b, out_view=True))


@pytest.mark.parametrize("device", DEVICES)
def test_prefill_long(device: str) -> None:
    """1000+ token prefills: many CTAs per sequence, heavy (late) row tiles first."""
    b = make_batch([(1100, 1100), (2, 1300), (700, 1500)], 8, 2, 128, 16, torch.bfloat16, device)
    check(b, run_op(b))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block_size", [1, 24, 64])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
@pytest.mark.parametrize("head_size", [96, 128])
def test_prefill_block_sizes(device: str, block_size: int, kv_cache_dtype: str,
                             head_size: int) -> None:  # fmt: skip
    """Both CUDA prefill kernels (wgmma: head 128 with a 16-bit cache; mma.sync: the rest)."""
    b = make_batch(PREFILL_MIXED, 8, 2, head_size, block_size, dtypes_for(device)[1], device,
                   kv_cache_dtype)  # fmt: skip
    check(b, run_op(b))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype_idx", [0, 1])
@pytest.mark.parametrize("head_size", HEAD_SIZES)
def test_prefill_fp8(device: str, dtype_idx: int, head_size: int) -> None:
    b = make_batch(PREFILL_MIXED, 8, 2, head_size, 16, dtypes_for(device)[dtype_idx], device,
                   "fp8")  # fmt: skip
    check(b, run_op(b))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sliding_window", [1, 37, 200])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("soft_cap", [0.0, 30.0])
def test_prefill_window_and_cap(device: str, sliding_window: int, causal: bool,
                                soft_cap: float) -> None:  # fmt: skip
    b = make_batch(PREFILL_MIXED, 8, 2, 64, 16, dtypes_for(device)[1], device)
    b["query"] = b["query"] * 3  # large scores, so that the cap bites
    check(b, run_op(b, causal, sliding_window, soft_cap), causal, sliding_window, soft_cap)


# (q_len, seq_len) around the wgmma kernel's tiles (128 rows = 32 tokens at G=4, 64 keys):
# one, two and three KV tiles (the pipeline's odd and even ends), ragged last tiles, a chunk of 5
# tokens (one warpgroup of rows) over a long prefix, 64-row tiles whose second warpgroup is idle.
WGMMA_EDGES = [(127, 127), (128, 128), (129, 129), (255, 383), (257, 257), (5, 900), (16, 640)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("head_size", [64, 128, 192, 256])
@pytest.mark.parametrize("block_size", [16, 32, 64])
@pytest.mark.parametrize("causal,sliding_window", [(True, 0), (False, 0), (True, 150)])
def test_prefill_tile_edges(device: str, head_size: int, block_size: int, causal: bool,
                            sliding_window: int) -> None:  # fmt: skip
    """Warp-specialized wgmma kernel: tile counts 1..n, ragged ends, windows that skip tiles."""
    b = make_batch(WGMMA_EDGES, 8, 2, head_size, block_size, dtypes_for(device)[1], device)
    check(b, run_op(b, causal, sliding_window), causal, sliding_window)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("head_size", [32, 80, 112, 120, 128, 192])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_prefill_split_kv(device: str, head_size: int, kv_cache_dtype: str) -> None:
    """Few CTAs and long contexts: CUDA splits the KV range of prefill and decode rows alike
    (partial rows of head_size floats, merged by merge_split_kv_kernel)."""
    b = make_batch([(40, 3000), (1, 2500), (9, 2000)], 4, 1, head_size, 16, torch.bfloat16, device,
                   kv_cache_dtype)  # fmt: skip
    check(b, run_op(b))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block_size", [16, 32, 64])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_decode_many_splits(device: str, block_size: int, kv_cache_dtype: str) -> None:
    """Pure decode at long context: CUDA runs only the decode kernel and splits each sequence's
    keys over up to dozens of CTAs (whole 64-key chunks each). A 20011-token sequence (not a
    multiple of 16, 64 or the block size) beside short ones whose later splits are empty."""
    spec = [(1, 20011), (1, 1), (1, 63), (1, 1000), (1, 4097)]
    b = make_batch(spec, 32, 8, 128, block_size, torch.bfloat16, device, kv_cache_dtype)
    check(b, run_op(b))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("max_seq_len", [0, 1, 32768])
def test_decode_seq_len_hint(device: str, max_seq_len: int) -> None:
    """The split count comes from the max_seq_len hint, not the real lengths: a pessimistic hint
    (as CUDA graphs pass, max_model_len) leaves most splits empty, a tiny one gives one split.
    With the in-launch merge a sequence of at most 384 keys takes one split whatever the grid
    (kDecodeSingleSplitKeys in cuda/attention/attention.cu): 384 and 385 sit either side."""
    spec = [(1, 700), (1, 2500), (1, 33), (1, 384), (1, 385)]
    b = make_batch(spec, 16, 4, 128, 16, torch.bfloat16, device)
    b["max_seq_len"] = max_seq_len
    check(b, run_op(b))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("head_size", HEAD_SIZES)
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
@pytest.mark.parametrize("block_size", [16, 64])
def test_decode_head_sizes(device: str, head_size: int, kv_cache_dtype: str,
                           block_size: int) -> None:  # fmt: skip
    """Decode rows (1-2 query tokens, GQA 4 and 8) for every head size, bf16 and fp8 KV, with a
    long sequence that splits; fp16 queries so that both dtypes take the decode kernel."""
    spec = [(1, 3001), (1, 17), (2, 200), (1, 1)]
    for num_heads, num_kv_heads, dtype in [(16, 4, torch.float16), (16, 2, torch.bfloat16)]:
        if device == "cpu" and dtype == torch.float16:
            dtype = torch.float32
        b = make_batch(spec, num_heads, num_kv_heads, head_size, block_size, dtype, device,
                       kv_cache_dtype)  # fmt: skip
        check(b, run_op(b))


@pytest.mark.parametrize("device", DEVICES)
def test_decode_beside_prefill_splits(device: str) -> None:
    """A mixed batch whose decode rows go to the decode kernel and whose prefill rows go to the
    general kernel, both writing split partials that one merge combines."""
    spec = [(1, 9000), (40, 300), (1, 5), (3, 4000), (17, 17)]
    b = make_batch(spec, 32, 8, 128, 32, torch.bfloat16, device, "fp8")
    check(b, run_op(b))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_size",
    [(8, 1, 128), (16, 2, 64), (8, 4, 256), (8, 1, 120), (16, 2, 32), (8, 2, 192)],
)
def test_decode_split_merge_ragged(device: str, num_heads: int, num_kv_heads: int,
                                   head_size: int) -> None:  # fmt: skip
    """Pure decode with up to 64 splits per sequence (one or two kv heads: few CTAs), merged
    inside the decode launch on CUDA: ragged lengths leave some sequences' later splits empty,
    and one length is 1 (a single key in the first split only)."""
    spec = [(1, 9001), (1, 1), (1, 2047), (1, 64), (1, 65), (1, 700)]
    b = make_batch(spec, num_heads, num_kv_heads, head_size, 16, torch.bfloat16, device)
    check(b, run_op(b))


def _poison_cuda_allocator() -> None:
    """Frees blocks full of random bytes, so that the next workspaces start as garbage."""
    junk = [torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda") for n in
            (1 << 12, 1 << 16, 1 << 18, 1 << 20, 3 << 20)]  # fmt: skip
    del junk


@pytest.mark.parametrize("device", DEVICES)
def test_decode_split_merge_repeated(device: str) -> None:
    """The in-launch merge's arrival slots live in a fresh, uninitialized workspace each call and
    are counted per call: repeated calls, with garbage handed out as workspace, stay exact."""
    if device != "cuda":
        pytest.skip("the split merge is CUDA's")
    for spec in ([(1, 5000)], [(1, 3000), (1, 17), (1, 1200)]):
        b = make_batch(spec, 32, 8, 128, 16, torch.bfloat16, device)
        first = run_op(b)
        check(b, first)
        for _ in range(3):
            _poison_cuda_allocator()
            out = run_op(b)
            torch.testing.assert_close(out, first, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_cuda_graph_decode_split_replays(device: str, kv_cache_dtype: str) -> None:
    """A split decode captured once and replayed several times with new queries and lengths (the
    graph replays the tag of its capture; the last CTA must leave each slot reset), with eager
    calls of the same op between replays."""
    if device != "cuda":
        pytest.skip("CUDA graphs only")
    b = make_batch([(1, 6000), (1, 900)], 16, 2, 128, 16, torch.bfloat16, device, kv_cache_dtype)
    out = torch.full_like(b["query"], SENTINEL)
    args = [b[k] for k in ("query", "key_cache", "value_cache", "query_start_loc", "seq_lens",
                           "block_table")]  # fmt: skip
    call = lambda: _ops.paged_attention(out, *args, 1, 8192, 1 / math.sqrt(128), True, 0, 0.0,  # noqa: E731
                                        kv_cache_dtype, b["k_scale"], b["v_scale"])  # fmt: skip
    graph = capture_graph(call)
    # Lengths shrink until the second sequence fits one split (it then writes `out` directly and
    # never arrives), then grow back so that its later splits count again.
    for shrink in ([0, 0], [1000, 3], [2500, 890], [-3000, -800]):
        b["query"].normal_()
        b["seq_lens"].sub_(torch.tensor(shrink, dtype=torch.int32, device=device))
        out.fill_(SENTINEL)
        graph.replay()
        torch.cuda.synchronize()
        check(b, out)
        check(b, run_op(b))  # an eager call in between, on its own workspace
        _poison_cuda_allocator()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("head_size", [48, 136])
def test_unsupported_head_size(device: str, head_size: int) -> None:
    """CUDA refuses a size outside HEAD_SIZES with the op's own message; the CPU runs it."""
    b = make_batch([(1, 5), (9, 9)], 4, 4, head_size, 16, dtypes_for(device)[1], device)
    if device == "cpu":
        check(b, run_op(b))
        return
    with pytest.raises(RuntimeError, match=f"Unsupported head size: {head_size}"):
        run_op(b)


# CPU only: CUDA runs HEAD_SIZES and refuses the rest (test_unsupported_head_size).
@pytest.mark.parametrize("head_size", CPU_ONLY_HEAD_SIZES)
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_cpu_any_head_size(head_size: int, kv_cache_dtype: str) -> None:
    """The CPU op takes any head size (up to 1024): decode and prefill rows, GQA 4."""
    b = make_batch(PREFILL_MIXED, 8, 2, head_size, 16, torch.bfloat16, "cpu", kv_cache_dtype)
    check(b, run_op(b))


def test_cpu_head_size_limit() -> None:
    """The CPU kernel's bound: head sizes past 1024 raise."""
    b = make_batch([(1, 5)], 2, 2, 1032, 16, torch.float32, "cpu")
    with pytest.raises(RuntimeError, match="Unsupported head size: 1032"):
        run_op(b)


@pytest.mark.parametrize("device", DEVICES)
def test_bad_dtype(device: str) -> None:
    bad = torch.float32 if device == "cuda" else torch.float64
    b = make_batch([(1, 5)], 4, 4, 64, 16, bad, device)
    with pytest.raises(RuntimeError, match="paged_attention"):
        run_op(b)
    b = make_batch([(1, 5)], 4, 4, 64, 16, dtypes_for(device)[1], device)
    b["key_cache"] = b["key_cache"].half() if b["key_cache"].dtype != torch.half else b["key_cache"].float()
    with pytest.raises(RuntimeError, match="kv_cache_dtype=auto"):
        run_op(b)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device: str) -> None:
    b = make_batch([(1, 20), (9, 30)], 8, 2, 64, 16, dtypes_for(device)[1], device)
    args = (
        torch.empty_like(b["query"]), b["query"], b["key_cache"], b["value_cache"],
        b["query_start_loc"], b["seq_lens"], b["block_table"], 9, 30, 0.125, True, 0, 0.0, "auto",
        b["k_scale"], b["v_scale"],
    )  # fmt: skip
    torch.library.opcheck(torch.ops.pyorch.paged_attention.default, args)


@pytest.mark.parametrize("device", DEVICES)
def test_cuda_graph_capture(device: str) -> None:
    """No host sync inside: the op (split-KV workspace included) captures and replays."""
    if device != "cuda":
        pytest.skip("CUDA graphs only")
    b = make_batch([(1, 2000), (1, 700)], 32, 8, 128, 16, torch.bfloat16, device, "fp8")
    out = torch.full_like(b["query"], SENTINEL)
    args = [b[k] for k in ("query", "key_cache", "value_cache", "query_start_loc", "seq_lens",
                           "block_table")]  # fmt: skip
    call = lambda: _ops.paged_attention(out, *args, 1, 2000, 1 / math.sqrt(128), True, 0, 0.0,  # noqa: E731
                                        "fp8", b["k_scale"], b["v_scale"])  # fmt: skip
    graph = capture_graph(call)
    b["query"].normal_()
    b["seq_lens"].sub_(torch.tensor([100, 50], dtype=torch.int32, device=device))
    b["v_scale"].fill_(0.07)
    out.fill_(SENTINEL)
    graph.replay()
    torch.cuda.synchronize()
    check(b, out)


@pytest.mark.parametrize("device", DEVICES)
def test_cuda_graph_capture_mixed(device: str) -> None:
    """A mixed batch captured with a loose max_query_len (as the runner captures), replayed after
    the cached prefix grew: the prefill and decode kernels read every range from device data."""
    if device != "cuda":
        pytest.skip("CUDA graphs only")
    b = make_batch([(40, 600), (1, 300), (200, 900)], 16, 4, 128, 16, torch.bfloat16, device)
    out = torch.full_like(b["query"], SENTINEL)
    args = [b[k] for k in ("query", "key_cache", "value_cache", "query_start_loc", "seq_lens",
                           "block_table")]  # fmt: skip
    call = lambda: _ops.paged_attention(out, *args, 512, 4096, 1 / math.sqrt(128), True, 0, 0.0,  # noqa: E731
                                        "auto", b["k_scale"], b["v_scale"])  # fmt: skip
    graph = capture_graph(call)
    b["query"].normal_()
    b["seq_lens"].sub_(torch.tensor([30, 0, 150], dtype=torch.int32, device=device))
    out.fill_(SENTINEL)
    graph.replay()
    torch.cuda.synchronize()
    check(b, out)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("head_size", [64, 120, 128])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (16, 4), (32, 2)])
def test_fp8_decode_query_range(device: str, head_size: int, num_heads: int,
                                num_kv_heads: int) -> None:  # fmt: skip
    """fp8 decode at the tile heads whose CUDA kernel reads the fp8 bytes straight into f16 mma
    fragments and runs the query as f16 scaled per row by a power of two: bf16 query rows from
    1e-6 to 1e6 in magnitude (past f16's range) over the whole e4m3 range (bytes up to +-448),
    1 to 16 rows per CTA (GQA 1, 4 and 16 with 1 or 2 query tokens), short and split sequences."""
    spec = [(1, 1), (1, 37), (2, 300), (1, 2500), (1, 16)]
    b = make_batch(spec, num_heads, num_kv_heads, head_size, 16, torch.bfloat16, device, "fp8")
    g = torch.Generator().manual_seed(7)
    for cache in (b["key_cache"], b["value_cache"]):  # every finite e4m3 byte (0x7f/0xff: NaN)
        raw = torch.randint(0, 256, cache.shape, generator=g, dtype=torch.int32)
        raw[(raw & 0x7F) == 0x7F] = 0x7E
        cache.copy_(raw.to(torch.uint8).to(cache.device))
    b["k_scale"].fill_(1e-3)
    b["v_scale"].fill_(2e-3)
    q = b["query"]
    row_mag = 10.0 ** torch.linspace(-6, 6, q.shape[0] * q.shape[1], device=q.device)
    q.copy_(q.float() * row_mag.view(q.shape[0], q.shape[1], 1))
    check(b, run_op(b))


# ---- the optional log-sum-exp output (cascade attention merges two calls by it) ----------------
LSE_SENTINEL = 7.0  # lse columns of padding rows, and past num_tokens, must keep it


def run_with_lse(b: dict, causal: bool = True, sliding_window: int = 0,
                 soft_cap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """paged_attention writing its lse into a [num_heads, num_tokens + 5] buffer (row stride past
    num_tokens); returns (out, that buffer)."""
    query = b["query"]
    out = torch.full_like(query, SENTINEL, memory_format=torch.contiguous_format)
    lse = torch.full((query.shape[1], query.shape[0] + 5), LSE_SENTINEL, dtype=torch.float32,
                     device=query.device)
    _ops.paged_attention(
        out, query, b["key_cache"], b["value_cache"], b["query_start_loc"], b["seq_lens"],
        b["block_table"], b["max_query_len"], b["max_seq_len"], 1.0 / math.sqrt(query.shape[-1]),
        causal, sliding_window, soft_cap, b["kv_cache_dtype"], b["k_scale"], b["v_scale"],
        lse=lse,
    )  # fmt: skip
    return out, lse


def check_lse(b: dict, out: torch.Tensor, lse: torch.Tensor, causal: bool = True,
              sliding_window: int = 0, soft_cap: float = 0.0) -> None:  # fmt: skip
    want_out, want_lse = ref.paged_attention_with_lse(
        b["query"], b["key_cache"], b["value_cache"], b["query_start_loc"], b["seq_lens"],
        b["block_table"], 1.0 / math.sqrt(b["query"].shape[-1]), causal, sliding_window, soft_cap,
        b["kv_cache_dtype"], b["k_scale"].cpu(), b["v_scale"].cpu(),
    )  # fmt: skip
    n = want_out.shape[0]
    torch.testing.assert_close(out[:n].cpu().double(), want_out, **attn_tol(out.dtype))
    got = lse[:, :n].cpu().double()
    empty = want_lse == float("-inf")
    assert (got[empty] == float("-inf")).all(), "a row that sees no key must report -inf"
    # The lse is float32 from scores rounded like the output's probabilities.
    torch.testing.assert_close(got[~empty], want_lse[~empty], atol=2e-3, rtol=1e-4)
    assert (lse[:, n:].cpu() == LSE_SENTINEL).all(), "lse past the real rows was written"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype_idx", [0, 1])
@pytest.mark.parametrize("head_size", [64, 96, 128])
@pytest.mark.parametrize("causal", [True, False])
def test_lse_mixed_batch(device: str, dtype_idx: int, head_size: int, causal: bool) -> None:
    """Decodes, a chunked prefill, full prefills and a query-less sequence in one call: both
    CUDA prefill kernels (wgmma at 64/128, mma.sync at 96) and the decode kernel write the lse."""
    b = make_batch(MIXED, 16, 4, head_size, 16, dtypes_for(device)[dtype_idx], device)
    check_lse(b, *run_with_lse(b, causal), causal)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_seqs,seq_len", [(1, 3000), (3, 1500), (300, 130)])
def test_lse_decode_splits(device: str, num_seqs: int, seq_len: int) -> None:
    """Pure decode: split KV ranges merged inside the decode launch, and no split."""
    spec = [(1, seq_len - (7 * i) % 100) for i in range(num_seqs)]
    b = make_batch(spec, 32, 8, 128, 16, dtypes_for(device)[1], device)
    check_lse(b, *run_with_lse(b))


@pytest.mark.parametrize("device", DEVICES)
def test_lse_prefill_splits(device: str) -> None:
    """Few long non-causal sequences: CUDA splits the prefill kernel's KV range and merges the
    partials in merge_split_kv_kernel, which writes the lse."""
    b = make_batch([(40, 4000), (1, 3000), (70, 2500)], 8, 2, 128, 16, dtypes_for(device)[1],
                   device)  # fmt: skip
    check_lse(b, *run_with_lse(b, causal=False), causal=False)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kv_cache_dtype", ["fp8"])
@pytest.mark.parametrize("soft_cap", [0.0, 30.0])
def test_lse_fp8_and_soft_cap(device: str, kv_cache_dtype: str, soft_cap: float) -> None:
    b = make_batch(PREFILL_MIXED, 8, 2, 128, 16, dtypes_for(device)[1], device, kv_cache_dtype)
    check_lse(b, *run_with_lse(b, soft_cap=soft_cap), soft_cap=soft_cap)


@pytest.mark.parametrize("device", DEVICES)
def test_lse_rejects_bad_buffer(device: str) -> None:
    b = make_batch([(1, 50)], 8, 2, 64, 16, dtypes_for(device)[1], device)
    out = torch.empty_like(b["query"])
    for bad in (torch.empty(8, b["query"].shape[0], dtype=torch.float16, device=device),
                torch.empty(4, b["query"].shape[0], dtype=torch.float32, device=device)):
        with pytest.raises(RuntimeError, match="lse must be a float32"):
            _ops.paged_attention(
                out, b["query"], b["key_cache"], b["value_cache"], b["query_start_loc"],
                b["seq_lens"], b["block_table"], 1, 50, 0.125, True, 0, 0.0, "auto",
                b["k_scale"], b["v_scale"], lse=bad,
            )  # fmt: skip


def make_cascade(device: str, dtype: torch.dtype, num_heads: int, num_kv_heads: int,
                 kv_cache_dtype: str = "auto") -> dict:
    """Decode rows in two groups of 5 whose sequences share a 512-token prefix (32 blocks of 16,
    physically the same blocks), each with a private suffix of 1-300 tokens; members of the two
    groups interleave in the batch."""
    bs, head, prefix_blocks, groups, per_group = 16, 128, 32, 2, 5
    suffix_lens = [1 + (37 * i) % 300 for i in range(groups * per_group)]
    num_seqs = len(suffix_lens)
    suffix_blocks = [math.ceil(s / bs) for s in suffix_lens]
    num_blocks = groups * prefix_blocks + sum(suffix_blocks) + 3
    ids = torch.randperm(num_blocks).tolist()
    prefixes = [ids[g * prefix_blocks : (g + 1) * prefix_blocks] for g in range(groups)]
    rest = ids[groups * prefix_blocks :]
    width = prefix_blocks + max(suffix_blocks)
    table = torch.zeros(num_seqs, width, dtype=torch.int32)
    for i, n in enumerate(suffix_blocks):
        own, rest = rest[:n], rest[n:]
        table[i, : prefix_blocks + n] = torch.tensor(prefixes[i % groups] + own)
    seq_lens = torch.tensor([prefix_blocks * bs + s for s in suffix_lens], dtype=torch.int32)
    shape = (num_blocks, bs, num_kv_heads, head)
    scale = torch.tensor([1.0])
    if kv_cache_dtype == "auto":
        kc, vc = torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype)
    else:
        scale = torch.tensor([0.05])
        kc, vc = ((torch.randn(shape) / scale).to(torch.float8_e4m3fn).view(torch.uint8)
                  for _ in range(2))
    perm = [i for g in range(groups) for i in range(g, num_seqs, groups)]
    suffix_table = torch.zeros_like(table)
    suffix_table[:, : width - prefix_blocks] = table[:, prefix_blocks:]
    return dict(
        query=torch.randn(num_seqs, num_heads, head, dtype=dtype, device=device),
        key_cache=kc.to(device), value_cache=vc.to(device),
        query_start_loc=torch.arange(num_seqs + 1, dtype=torch.int32, device=device),
        seq_lens=seq_lens.to(device), block_table=table.to(device), max_query_len=1,
        max_seq_len=int(seq_lens.max()), kv_cache_dtype=kv_cache_dtype,
        k_scale=scale.to(device), v_scale=scale.to(device),
        suffix_seq_lens=(seq_lens - prefix_blocks * bs).to(device),
        suffix_block_table=suffix_table.to(device), suffix_max_seq_len=max(suffix_lens),
        perm=torch.tensor(perm, dtype=torch.int64, device=device),
        prefix_query_start_loc=torch.arange(0, num_seqs + 1, per_group, dtype=torch.int32,
                                            device=device),
        prefix_seq_lens=torch.full((groups,), prefix_blocks * bs, dtype=torch.int32,
                                   device=device),
        prefix_block_table=torch.tensor(prefixes, dtype=torch.int32, device=device),
        prefix_max_query_len=per_group, prefix_max_seq_len=prefix_blocks * bs,
    )


def run_cascade(c: dict, soft_cap: float = 0.0, perm: torch.Tensor | None = None) -> torch.Tensor:
    out = torch.full_like(c["query"], SENTINEL)
    _ops.cascade_attention(
        out, c["query"], c["key_cache"], c["value_cache"], c["query_start_loc"],
        c["suffix_seq_lens"], c["suffix_block_table"], 1, c["suffix_max_seq_len"],
        c["perm"] if perm is None else perm, c["prefix_query_start_loc"], c["prefix_seq_lens"],
        c["prefix_block_table"], c["prefix_max_query_len"], c["prefix_max_seq_len"],
        c["query"].shape[-1] ** -0.5, soft_cap, c["kv_cache_dtype"], c["k_scale"], c["v_scale"],
    )  # fmt: skip
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_heads,num_kv_heads", [(32, 8), (8, 8)])
@pytest.mark.parametrize("kv_cache_dtype,soft_cap", [("auto", 0.0), ("auto", 30.0), ("fp8", 0.0)])
def test_cascade_attention(device: str, num_heads: int, num_kv_heads: int, kv_cache_dtype: str,
                           soft_cap: float) -> None:  # fmt: skip
    """Each group's prefix attended once (its members' queries as one non-causal sequence), each
    suffix on its own, merged by lse: equals the float64 reference over the whole sequences."""
    c = make_cascade(device, dtypes_for(device)[1], num_heads, num_kv_heads, kv_cache_dtype)
    check(c, _padded(run_cascade(c, soft_cap)), soft_cap=soft_cap)


def _padded(out: torch.Tensor) -> torch.Tensor:
    """check() expects PAD_TOKENS sentinel rows after the real ones."""
    pad = torch.full((PAD_TOKENS, *out.shape[1:]), SENTINEL, dtype=out.dtype, device=out.device)
    return torch.cat([out, pad])


@pytest.mark.parametrize("device", DEVICES)
def test_cascade_attention_without_groups(device: str) -> None:
    """An empty perm: only the suffixes, which are then the whole attention of each row."""
    c = make_cascade(device, dtypes_for(device)[1], 8, 2)
    c.update(seq_lens=c["suffix_seq_lens"], block_table=c["suffix_block_table"],
             max_seq_len=c["suffix_max_seq_len"])
    check(c, _padded(run_cascade(c, perm=c["perm"][:0])))


def test_cascade_attention_rejects_bad_perm() -> None:
    c = make_cascade("cpu", torch.float32, 8, 2)
    for bad in ([0, 0, 1, 2, 3, 4, 5, 6, 7, 8], [0, 1, 2, 3, 4, 5, 6, 7, 8, 10]):
        with pytest.raises(RuntimeError, match="out of range or repeated"):
            run_cascade(c, perm=torch.tensor(bad))
    with pytest.raises(RuntimeError, match="perm must be a contiguous 1-D int64"):
        run_cascade(c, perm=c["perm"].to(torch.int32))
