"""random_sample_from_logits on CPU and CUDA: the token each row draws is the argmax of the
reference's float64 race scores (same Philox words; within float32 rounding), greedy rows are
torch.argmax, draws follow softmax(logits / T) over many seeds, a row depends only on its own
logits / temperature / seed, -inf logits are never drawn, NaN wins as in argmax, strided rows
(the kernel's unaligned path), the argument checks and (CUDA) capture in a graph."""

import numpy as np
import pytest
import torch

from pyorch import _ops
from tests.conftest import CUDA_AVAILABLE, DEVICES, capture_graph
from tests.reference.sampling import race_scores

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SHAPES = [(1, 1), (3, 7), (5, 33), (4, 1000), (2, 151_936 + 3), (64, 4096), (9, 128_256)]


def _inputs(rows: int, vocab: int, dtype: torch.dtype, device: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=g) * 3).to(dtype).to(device)
    temperature = torch.tensor([[0.7, 1.0, 1.6, 0.0, 0.3][r % 5] for r in range(rows)],
                               dtype=torch.float32).to(device)
    seeds = torch.randint(-2**63, 2**63 - 1, (rows,), generator=g, dtype=torch.int64).to(device)
    return logits, temperature, seeds


def _assert_race_argmax(picked: torch.Tensor, logits: torch.Tensor, temperature: torch.Tensor,
                        seeds: torch.Tensor) -> None:
    """Each row's pick is the reference's argmax, or within float32 rounding of its max."""
    scores = race_scores(logits, temperature, seeds)
    picked = picked.cpu().numpy()
    for r in range(scores.shape[0]):
        row = scores[r]
        best = np.nanmax(row) if not np.isnan(row).any() else np.nan
        if temperature[r].item() <= 0:
            assert picked[r] == logits[r].float().argmax().item(), r
            continue
        got = row[picked[r]]
        assert np.isfinite(got) and got >= best - 1e-5 * max(1.0, abs(best)), (r, got, best)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,vocab", SHAPES)
def test_matches_reference(device: str, dtype: torch.dtype, rows: int, vocab: int) -> None:
    logits, temperature, seeds = _inputs(rows, vocab, dtype, device)
    picked = _ops.random_sample_from_logits(logits, temperature, seeds)
    assert picked.dtype == torch.int64 and picked.shape == (rows,)
    assert picked.device == logits.device
    _assert_race_argmax(picked, logits, temperature, seeds)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("pad", [1, 3, 8])
def test_strided_rows(device: str, pad: int) -> None:
    """Rows of a wider tensor (row stride vocab + pad: unaligned groups for pad 1 and 3)."""
    wide, temperature, seeds = _inputs(6, 5000 + pad, torch.bfloat16, device, seed=1)
    logits = wide[:, pad:]
    picked = _ops.random_sample_from_logits(logits, temperature, seeds)
    _assert_race_argmax(picked, logits, temperature, seeds)
    assert torch.equal(picked, _ops.random_sample_from_logits(logits.contiguous(), temperature,
                                                              seeds))


@pytest.mark.skipif(not CUDA_AVAILABLE, reason="no CUDA device on this machine")
@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_and_cuda_draw_the_same_tokens(dtype: torch.dtype) -> None:
    logits, temperature, seeds = _inputs(300, 32_000, dtype, "cpu", seed=2)
    cpu = _ops.random_sample_from_logits(logits, temperature, seeds)
    cuda = _ops.random_sample_from_logits(logits.cuda(), temperature.cuda(), seeds.cuda()).cpu()
    # The same words and expression; logf may differ by an ulp, which only a near-tie shows.
    assert (cpu == cuda).float().mean().item() >= 0.99
    _assert_race_argmax(cuda, logits, temperature, seeds)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("temp", [0.5, 1.0, 2.0])
def test_draws_follow_the_softmax(device: str, temp: float) -> None:
    """20,000 rows of the same 12 logits under distinct seeds: the frequencies match
    softmax(logits / T) (max abs error < 0.012, about 4.5 standard errors at p = 0.25)."""
    n = 20_000
    base = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.25, -2.0, -30.0, 0.75, 1.25])
    logits = base.expand(n, -1).contiguous().to(device)
    temperature = torch.full((n,), temp, device=device)
    seeds = torch.arange(n, dtype=torch.int64, device=device) * 7919 + 11
    picked = _ops.random_sample_from_logits(logits, temperature, seeds).cpu()
    freq = torch.bincount(picked, minlength=12).double() / n
    expected = torch.softmax(base.double() / temp, dim=0)
    assert (freq - expected).abs().max().item() < 0.012, (freq, expected)


@pytest.mark.parametrize("device", DEVICES)
def test_a_row_depends_only_on_its_inputs(device: str) -> None:
    logits, temperature, seeds = _inputs(40, 3000, torch.float32, device, seed=3)
    temperature.fill_(1.0)
    full = _ops.random_sample_from_logits(logits, temperature, seeds)
    for r in (0, 17, 39):
        alone = _ops.random_sample_from_logits(logits[r:r + 1], temperature[r:r + 1],
                                               seeds[r:r + 1])
        assert alone.item() == full[r].item()
    perm = torch.randperm(40, generator=torch.Generator().manual_seed(0)).to(device)
    shuffled = _ops.random_sample_from_logits(logits[perm], temperature[perm], seeds[perm])
    assert torch.equal(shuffled, full[perm])
    other = _ops.random_sample_from_logits(logits, temperature, seeds + 1)
    assert not torch.equal(other, full)  # a new seed draws anew


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_masked_and_nan_logits(device: str, dtype: torch.dtype) -> None:
    vocab = 777
    logits = torch.randn(6, vocab).to(dtype)
    logits[0, :] = float("-inf")  # all masked: index 0, as argmax
    logits[1, :] = float("-inf")
    logits[1, 500] = 0.0  # one allowed token: always drawn
    logits[2, ::2] = float("-inf")  # masked half: never drawn
    logits[3, 100] = float("nan")  # NaN is the largest value (argmax's rule)
    logits[3, 300] = float("nan")
    logits[4, 5] = float("inf")
    logits = logits.to(device)
    temperature = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, 0.0], device=device)
    for _ in range(20):
        seeds = torch.randint(-2**62, 2**62, (6,), dtype=torch.int64).to(device)
        picked = _ops.random_sample_from_logits(logits, temperature, seeds).cpu()
        assert picked[0] == 0 and picked[1] == 500 and picked[2] % 2 == 1
        assert picked[3] == 100 and picked[4] == 5
        assert picked[5] == logits[5].float().argmax().item()


@pytest.mark.parametrize("device", DEVICES)
def test_argument_checks(device: str) -> None:
    logits, temperature, seeds = _inputs(4, 100, torch.float32, device)
    out = torch.empty(4, dtype=torch.int64, device=device)
    op = torch.ops.pyorch.random_sample_from_logits
    with pytest.raises(RuntimeError, match="logits must be float32"):
        op(out, logits.to(torch.float64), temperature, seeds)
    with pytest.raises(RuntimeError, match="logits must be 2-D"):
        op(out, logits[0], temperature, seeds)
    with pytest.raises(RuntimeError, match="last dimension must be contiguous"):
        op(out, logits.t().contiguous().t()[:, :50], temperature, seeds)
    with pytest.raises(RuntimeError, match="temperature must be Float"):
        op(out, logits, temperature.double(), seeds)
    with pytest.raises(RuntimeError, match=r"seeds must be \[4\]"):
        op(out, logits, temperature, seeds[:3])
    with pytest.raises(RuntimeError, match="out must be Long"):
        op(out.int(), logits, temperature, seeds)
    with pytest.raises(RuntimeError, match="vocab_size must be in"):
        op(out, logits[:, :0], temperature, seeds)
    if device == "cuda":
        with pytest.raises(RuntimeError, match="seeds must be on the logits' device"):
            op(out, logits, temperature, seeds.cpu())


@pytest.mark.skipif(not CUDA_AVAILABLE, reason="no CUDA device on this machine")
def test_cuda_graph_capture() -> None:
    logits, temperature, seeds = _inputs(8, 4096, torch.bfloat16, "cuda", seed=4)
    out = torch.empty(8, dtype=torch.int64, device="cuda")
    graph = capture_graph(
        lambda: torch.ops.pyorch.random_sample_from_logits(out, logits, temperature, seeds))
    seeds.add_(12345)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, _ops.random_sample_from_logits(logits, temperature, seeds))


def test_reference_philox_known_answers() -> None:
    """The reference's Philox4x32-10 gives Random123's known-answer vectors (the kernels' words
    are checked against the reference above)."""
    from tests.reference.sampling import philox4x32_10

    cases = [((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
             ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2,
              (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
             ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
              (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1))]
    for counter, key, want in cases:
        assert [int(w) for w in philox4x32_10(*counter, *key)] == list(want)
