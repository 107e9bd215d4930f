"""apply_token_bitmask_inplace on CPU and CUDA against the pure-PyTorch reference
(pyorch.layers.token_bitmask.apply_token_bitmask_native): random masks, vocab sizes that are
not multiples of 32, every logits dtype, strided logits rows, a subset of rows by index, the
argument checks, opcheck and (CUDA) capture in a graph."""

import pytest
import torch

from pyorch import _ops
from pyorch.layers.token_bitmask import apply_token_bitmask_native
from tests.conftest import CUDA_AVAILABLE, DEVICES, capture_graph

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SHAPES = [(1, 1), (1, 31), (7, 32), (3, 33), (83, 769), (5, 49152), (2, 151_936 + 7), (256, 5125)]


def _random_bitmask(num_rows: int, vocab_size: int, device: str, p_allowed: float = 0.3,
                    generator: torch.Generator | None = None) -> torch.Tensor:
    """[num_rows, ceil(vocab/32)] int32 with each token allowed with probability p_allowed;
    some rows all ones and some words all ones (the kernels' skip paths), bits past the vocab
    random (they must be ignored)."""
    num_words = (vocab_size + 31) // 32
    bits = torch.rand(num_rows, num_words * 32, generator=generator) < p_allowed
    bits[::3] = True  # unconstrained rows
    bits[:, 64:128] = True  # all-ones words inside constrained rows
    weights = torch.tensor([1 << b for b in range(32)], dtype=torch.int64)
    words = (bits.view(num_rows, num_words, 32).long() * weights).sum(-1)
    words = torch.where(words >= 2**31, words - 2**32, words)  # two's complement int32
    return words.to(torch.int32).to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_rows,vocab_size", SHAPES)
def test_matches_reference(device: str, dtype: torch.dtype, num_rows: int, vocab_size: int):
    logits = torch.randn(num_rows, vocab_size, device=device).to(dtype)
    bitmask = _random_bitmask(num_rows, vocab_size, device)
    expected = logits.clone()
    apply_token_bitmask_native(expected, bitmask)
    _ops.apply_token_bitmask_inplace(logits, bitmask)
    torch.testing.assert_close(logits, expected, atol=0, rtol=0)
    # Masked means exactly -inf, allowed means untouched (not a large negative number).
    bit_of = ((bitmask.unsqueeze(-1) >> torch.arange(32, device=device, dtype=torch.int32)) & 1)
    allowed = bit_of.bool().flatten(1)[:, :vocab_size]
    assert torch.isneginf(logits[~allowed]).all()
    assert torch.isfinite(logits[allowed]).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_index_subset_and_strided_rows(device: str, dtype: torch.dtype):
    num_rows, vocab_size = 83, 5125
    base = torch.randn(num_rows, vocab_size + 40, device=device).to(dtype)
    logits = base[:, 8 : 8 + vocab_size]  # row stride != vocab_size, shifted start
    bitmask = _random_bitmask(num_rows, vocab_size, device, p_allowed=0.05)
    indices = torch.tensor([0, 5, 6, 40, 82], dtype=torch.int32, device=device)
    expected = base.clone()
    apply_token_bitmask_native(expected[:, 8 : 8 + vocab_size], bitmask, indices)
    _ops.apply_token_bitmask_inplace(logits, bitmask, indices)
    torch.testing.assert_close(base, expected, atol=0, rtol=0)
    untouched = torch.ones(num_rows, dtype=torch.bool)
    untouched[indices.long().cpu()] = False
    assert torch.isfinite(base[untouched.to(device)]).all()  # rows not listed keep every logit


@pytest.mark.parametrize("device", DEVICES)
def test_empty_indices_and_rows(device: str):
    logits = torch.randn(4, 100, device=device)
    before = logits.clone()
    bitmask = torch.zeros(4, 4, dtype=torch.int32, device=device)
    _ops.apply_token_bitmask_inplace(logits, bitmask,
                                     torch.empty(0, dtype=torch.int32, device=device))
    assert torch.equal(logits, before)
    empty = torch.empty(0, 100, device=device)
    _ops.apply_token_bitmask_inplace(empty, torch.empty(0, 4, dtype=torch.int32, device=device))


@pytest.mark.parametrize("device", DEVICES)
def test_bad_arguments_raise(device: str):
    logits = torch.randn(3, 70, device=device)
    good = torch.full((3, 3), -1, dtype=torch.int32, device=device)
    with pytest.raises(RuntimeError, match="logits must be float32, float16 or bfloat16"):
        _ops.apply_token_bitmask_inplace(logits.double(), good)
    with pytest.raises(RuntimeError, match="bitmask must be int32"):
        _ops.apply_token_bitmask_inplace(logits, good.long())
    with pytest.raises(RuntimeError, match=r"bitmask must be \[num_rows, ceil"):
        _ops.apply_token_bitmask_inplace(logits, good[:, :2])
    with pytest.raises(RuntimeError, match="indices must be int32"):
        _ops.apply_token_bitmask_inplace(logits, good, torch.tensor([0], device=device))
    with pytest.raises(RuntimeError, match="last dimension must be contiguous"):
        _ops.apply_token_bitmask_inplace(torch.randn(70, 3, device=device).t(), good)


def test_out_of_range_index_raises_on_cpu():
    logits = torch.randn(3, 70)
    with pytest.raises(RuntimeError, match="index 3 out of range"):
        _ops.apply_token_bitmask_inplace(logits, torch.zeros(3, 3, dtype=torch.int32),
                                         torch.tensor([1, 3], dtype=torch.int32))


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device: str):
    logits = torch.randn(5, 77, device=device, dtype=torch.bfloat16)
    bitmask = _random_bitmask(5, 77, device)
    indices = torch.tensor([1, 4], dtype=torch.int32, device=device)
    torch.library.opcheck(torch.ops.pyorch.apply_token_bitmask_inplace,
                          (logits, bitmask, indices))
    torch.library.opcheck(torch.ops.pyorch.apply_token_bitmask_inplace, (logits, bitmask, None))


@pytest.mark.skipif(not CUDA_AVAILABLE, reason="no CUDA device on this machine")
def test_cuda_graph_replay_reads_new_masks():
    num_rows, vocab_size = 64, 32_000 + 5
    logits = torch.empty(num_rows, vocab_size, device="cuda")
    bitmask = torch.empty(num_rows, (vocab_size + 31) // 32, dtype=torch.int32, device="cuda")
    indices = torch.arange(0, num_rows, 2, dtype=torch.int32, device="cuda")
    graph = capture_graph(lambda: _ops.apply_token_bitmask_inplace(logits, bitmask, indices))
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        fresh = torch.randn(num_rows, vocab_size, generator=g).cuda()
        logits.copy_(fresh)
        bitmask.copy_(_random_bitmask(num_rows, vocab_size, "cuda", generator=g))
        graph.replay()
        expected = fresh.clone()
        apply_token_bitmask_native(expected, bitmask, indices)
        torch.testing.assert_close(logits, expected, atol=0, rtol=0)
