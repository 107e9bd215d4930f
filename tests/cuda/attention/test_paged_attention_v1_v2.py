"""paged_attention_v1 / paged_attention_v2 (vLLM's split KV layout) against the float64 reference.

Caches are built directly in torch: random data, random non-contiguous block tables, and NaN in
every slot no sequence owns (unused blocks and the tail of each sequence's last block), so a kernel
that reads past a sequence's length fails loudly.
"""

import math
from dataclasses import dataclass

import pytest
import torch

from pyorch import _ops
from tests.conftest import DEVICES, tol
from tests.reference import paged_attention_v1_v2 as ref

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SEQ_LENS = [1, 7, 83, 769, 1025]  # 1025 crosses two partition boundaries in v2
FP8_NAN = 0x7F  # e4m3fn NaN byte

# (head_size, block_size, gqa ratio, num_kv_heads, alibi): every head size and block size, GQA
# ratios 1/4/8 and ALiBi on and off, without the full cross product (2 CPU cores run this).
CASES = [
    (32, 8, 4, 2, True),  # fp8: 2 key chunks for a thread group of 4 lanes
    (64, 8, 1, 2, False),
    (80, 16, 4, 1, True),
    (96, 32, 8, 1, False),
    (112, 8, 4, 2, True),
    (120, 16, 1, 3, False),
    (128, 32, 4, 2, True),
    (128, 16, 8, 1, False),
    (192, 16, 8, 1, True),
    (256, 8, 1, 2, False),
    (256, 32, 4, 1, True),
]


@dataclass
class Case:
    query: torch.Tensor  # [num_seqs, num_heads, head_size] (a strided view)
    key_cache: torch.Tensor  # [num_blocks, num_kv_heads, head_size // x, block_size, x]
    value_cache: torch.Tensor  # [num_blocks, num_kv_heads, head_size, block_size]
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    alibi_slopes: torch.Tensor | None  # [num_heads] float32
    kv_cache_dtype: str
    k_scale: torch.Tensor  # [1] float32
    v_scale: torch.Tensor
    scale: float
    num_kv_heads: int
    block_size: int
    max_seq_len: int

    @property
    def ref_scales(self) -> tuple[float, float]:
        if self.kv_cache_dtype == "auto":  # the scales are ignored, as in vLLM
            return 1.0, 1.0
        return self.k_scale.item(), self.v_scale.item()


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """ALiBi's geometric slopes, jittered so that heads differ."""
    base = torch.tensor([2.0 ** (-8.0 * (h + 1) / num_heads) for h in range(num_heads)])
    return (base * (0.5 + torch.rand(num_heads))).float()


def random_cache(
    shape: tuple, dtype: torch.dtype, storage: torch.dtype, device: str
) -> torch.Tensor:
    data = torch.randn(shape, device=device)
    if storage == torch.float8_e4m3fn or storage == torch.uint8:
        data = (data * 2).to(torch.float8_e4m3fn)
        return data.view(torch.uint8) if storage == torch.uint8 else data
    return data.to(dtype)


def poison(cache: torch.Tensor, index: tuple) -> None:
    """Writes NaN at cache[index]."""
    if cache.dtype in (torch.uint8, torch.float8_e4m3fn):
        cache.view(torch.uint8)[index] = FP8_NAN
    else:
        cache[index] = float("nan")


def make_case(
    device: str,
    dtype: torch.dtype,
    kv_cache_dtype: str,
    seq_lens: list[int],
    head_size: int,
    block_size: int,
    gqa: int,
    num_kv_heads: int,
    use_alibi: bool,
    fp8_storage: torch.dtype = torch.uint8,
    max_seq_len: int | None = None,
) -> Case:
    num_heads = num_kv_heads * gqa
    num_seqs = len(seq_lens)
    storage = dtype if kv_cache_dtype == "auto" else fp8_storage
    x = ref.split_cache_x(storage)
    blocks_per_seq = [math.ceil(n / block_size) for n in seq_lens]
    max_blocks = max(blocks_per_seq) + 2  # padded rows, like a real block table
    num_blocks = sum(blocks_per_seq) + 7  # some blocks belong to nobody
    perm = torch.randperm(num_blocks).tolist()
    block_tables = torch.randint(0, num_blocks, (num_seqs, max_blocks), dtype=torch.int32)
    owned = set()
    for i, n in enumerate(blocks_per_seq):
        ids, perm = perm[:n], perm[n:]
        block_tables[i, :n] = torch.tensor(ids, dtype=torch.int32)
        owned.update(ids)

    key_cache = random_cache(
        (num_blocks, num_kv_heads, head_size // x, block_size, x), dtype, storage, device
    )
    value_cache = random_cache(
        (num_blocks, num_kv_heads, head_size, block_size), dtype, storage, device
    )
    for b in range(num_blocks):
        if b not in owned:
            poison(key_cache, (b,))
            poison(value_cache, (b,))
    for i, n in enumerate(seq_lens):
        tail = n % block_size
        if n > 0 and tail:
            last = int(block_tables[i, blocks_per_seq[i] - 1])
            poison(key_cache, (last, slice(None), slice(None), slice(tail, None)))
            poison(value_cache, (last, slice(None), slice(None), slice(tail, None)))

    # A strided query: heads padded on both sides in the underlying storage.
    query = torch.randn(num_seqs, num_heads + 2, head_size, device=device, dtype=dtype)[:, 1:-1]
    scales = (0.37, 1.9) if kv_cache_dtype != "auto" else (2.0, 3.0)  # auto ignores them
    return Case(
        query=query,
        key_cache=key_cache,
        value_cache=value_cache,
        block_tables=block_tables.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        alibi_slopes=alibi_slopes(num_heads).to(device) if use_alibi else None,
        kv_cache_dtype=kv_cache_dtype,
        k_scale=torch.tensor([scales[0]], dtype=torch.float32, device=device),
        v_scale=torch.tensor([scales[1]], dtype=torch.float32, device=device),
        scale=head_size**-0.5,
        num_kv_heads=num_kv_heads,
        block_size=block_size,
        max_seq_len=max(seq_lens) if max_seq_len is None else max_seq_len,
    )


def new_out(c: Case) -> torch.Tensor:
    """A strided output view (a padded head dimension)."""
    n, h, d = c.query.shape
    return torch.full((n, h, d + 8), float("nan"), dtype=c.query.dtype, device=c.query.device)[
        ..., :d
    ]


def run_v1(c: Case, out: torch.Tensor | None = None, **kw) -> torch.Tensor:
    out = new_out(c) if out is None else out
    _ops.paged_attention_v1(
        out, c.query, c.key_cache, c.value_cache, c.num_kv_heads, c.scale, c.block_tables,
        c.seq_lens, c.block_size, c.max_seq_len, c.alibi_slopes, c.kv_cache_dtype, c.k_scale,
        c.v_scale, **kw,
    )  # fmt: skip
    return out


def v2_scratch(c: Case, partitions: int | None = None) -> tuple[torch.Tensor, ...]:
    n, h, d = c.query.shape
    p = math.ceil(c.max_seq_len / ref.PARTITION_SIZE) if partitions is None else partitions
    dev = c.query.device
    exp_sums = torch.empty(n, h, p, dtype=torch.float32, device=dev)
    max_logits = torch.empty(n, h, p, dtype=torch.float32, device=dev)
    tmp_out = torch.empty(n, h, p, d, dtype=c.query.dtype, device=dev)
    return exp_sums, max_logits, tmp_out


def run_v2(c: Case, scratch: tuple | None = None, **kw) -> torch.Tensor:
    out = new_out(c)
    exp_sums, max_logits, tmp_out = v2_scratch(c) if scratch is None else scratch
    _ops.paged_attention_v2(
        out, exp_sums, max_logits, tmp_out, c.query, c.key_cache, c.value_cache, c.num_kv_heads,
        c.scale, c.block_tables, c.seq_lens, c.block_size, c.max_seq_len, c.alibi_slopes,
        c.kv_cache_dtype, c.k_scale, c.v_scale, **kw,
    )  # fmt: skip
    return out


def reference(c: Case) -> torch.Tensor:
    k_scale, v_scale = c.ref_scales
    return ref.paged_attention(
        c.query, c.key_cache, c.value_cache, c.block_tables, c.seq_lens, c.scale, c.alibi_slopes,
        c.kv_cache_dtype, k_scale, v_scale,
    )  # fmt: skip


def to_cpu(c: Case) -> Case:
    fields = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in vars(c).items()}
    return Case(**fields)


def check_all(c: Case, dtype: torch.dtype) -> None:
    """v1 == v2 == reference (and, on CUDA, == the CPU backend)."""
    want = reference(c)
    got_v1 = run_v1(c)
    got_v2 = run_v2(c)
    # v2 rounds each partition's output to dtype before combining: one more rounding than v1.
    torch.testing.assert_close(got_v1, want, **tol(dtype, 2))
    torch.testing.assert_close(got_v2, want, **tol(dtype, 3))
    torch.testing.assert_close(got_v2, got_v1, **tol(dtype, 3))
    if c.query.is_cuda:
        torch.testing.assert_close(got_v1.cpu(), run_v1(to_cpu(c)), **tol(dtype, 3))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
@pytest.mark.parametrize("head_size,block_size,gqa,num_kv_heads,use_alibi", CASES)
def test_matches_reference(
    device: str,
    dtype: torch.dtype,
    kv_cache_dtype: str,
    head_size: int,
    block_size: int,
    gqa: int,
    num_kv_heads: int,
    use_alibi: bool,
):
    if kv_cache_dtype == "fp8" and head_size % 16:
        pytest.skip("an fp8 key cache splits head_size into groups of 16")
    seq_lens = SEQ_LENS + [int(torch.randint(1, 700, ()))]
    c = make_case(
        device, dtype, kv_cache_dtype, seq_lens, head_size, block_size, gqa, num_kv_heads,
        use_alibi,
    )  # fmt: skip
    check_all(c, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_long_context_partition_edges(device: str, dtype: torch.dtype):
    # 512 fills one partition exactly, 513 leaves one token in the second, 2100 spans five;
    # max_seq_len above every length gives v2 partitions that no sequence reaches.
    seq_lens = [2100, 513, 512, 1536, 1]
    c = make_case(device, dtype, "auto", seq_lens, 128, 16, 4, 2, False, max_seq_len=2600)
    check_all(c, dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_float8_storage(device: str):
    # An fp8 cache may be float8_e4m3fn instead of uint8; "fp8_e4m3" is the explicit name.
    c = make_case(device, torch.bfloat16, "fp8_e4m3", [300, 45], 128, 16, 4, 1, True,
                  fp8_storage=torch.float8_e4m3fn)  # fmt: skip
    check_all(c, torch.bfloat16)


@pytest.mark.parametrize("device", DEVICES)
def test_empty_sequence_gives_zeros(device: str):
    c = make_case(device, torch.float16, "auto", [0, 5, 0], 64, 16, 1, 2, False)
    torch.testing.assert_close(run_v1(c), reference(c))
    torch.testing.assert_close(run_v2(c), reference(c))
    assert not run_v1(c)[0].any() and not run_v2(c)[2].any()


@pytest.mark.parametrize("device", DEVICES)
def test_oversized_scratch(device: str):
    # vLLM's callers may allocate scratch for a larger max_seq_len than the batch needs.
    c = make_case(device, torch.float32, "auto", [900, 30], 64, 16, 1, 2, True)
    scratch = v2_scratch(c, partitions=5)
    torch.testing.assert_close(run_v2(c, scratch), reference(c), **tol(torch.float32, 2))


@pytest.mark.parametrize("device", DEVICES)
def test_unsupported_head_size_raises(device: str):
    c = make_case(device, torch.float16, "auto", [20, 3], 72, 16, 1, 1, False)
    with pytest.raises(RuntimeError, match="Unsupported head size: 72"):
        run_v1(c)
    with pytest.raises(RuntimeError, match="Unsupported head size: 72"):
        run_v2(c)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "sparse_args", [{"blocksparse_vert_stride": 8}, {"blocksparse_local_blocks": 4}]
)
def test_blocksparse_raises(device: str, sparse_args: dict):
    c = make_case(device, torch.float16, "auto", [20, 3], 64, 16, 1, 1, False)
    with pytest.raises(RuntimeError, match="blocksparse attention is not supported"):
        run_v1(c, **sparse_args)
    with pytest.raises(RuntimeError, match="blocksparse attention is not supported"):
        run_v2(c, **sparse_args)
    # The dense defaults vLLM passes (vert_stride 0 or 1, local_blocks 0, any block size) work.
    run_v1(c, tp_rank=1, blocksparse_vert_stride=1, blocksparse_block_size=64)


@pytest.mark.parametrize("device", DEVICES)
def test_bad_arguments_raise(device: str):
    c = make_case(device, torch.float16, "auto", [20, 3], 64, 16, 2, 2, False)
    with pytest.raises(RuntimeError, match="multiple of num_kv_heads"):
        c.num_kv_heads = 3
        run_v1(c)
    c.num_kv_heads = 2
    with pytest.raises(RuntimeError, match="max_num_partitions"):
        c.max_seq_len = 600
        run_v2(c, v2_scratch(c, partitions=1))


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device: str):
    c = make_case(device, torch.float16, "auto", [40, 600], 64, 16, 2, 1, True)
    c.query = c.query.contiguous()
    common = (c.num_kv_heads, c.scale, c.block_tables, c.seq_lens, c.block_size, c.max_seq_len,
              c.alibi_slopes, c.kv_cache_dtype, c.k_scale, c.v_scale, 0, 0, 0, 64, 0)  # fmt: skip
    out = torch.empty_like(c.query)
    torch.library.opcheck(
        torch.ops.pyorch.paged_attention_v1.default,
        (out, c.query, c.key_cache, c.value_cache, *common),
    )
    exp_sums, max_logits, tmp_out = v2_scratch(c)
    torch.library.opcheck(
        torch.ops.pyorch.paged_attention_v2.default,
        (out, exp_sums, max_logits, tmp_out, c.query, c.key_cache, c.value_cache, *common),
    )
