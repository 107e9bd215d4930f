"""The MoE prefill path (moe_grouped_permute, moe_grouped_gemm, moe_grouped_unpermute and
fused_experts_grouped) on CPU and CUDA against float64 references on fresh random data: awkward
sizes, experts with no rows, tokens with identical routing, experts of another rank, M = 0,
fp8 operands with per-expert scales, CUDA-graph capture and the argument checks."""

import pytest
import torch

from pyorch import _ops
from pyorch.layers.fused_moe import fused_moe as fm
from tests.conftest import CUDA_AVAILABLE, DEVICES, capture_graph, tol
from tests.reference import moe as ref

needs_cuda = pytest.mark.skipif(not CUDA_AVAILABLE, reason="no CUDA device on this machine")
needs_grouped = pytest.mark.skipif(
    not (CUDA_AVAILABLE and _ops.moe_grouped_gemm_available()
         and torch.cuda.get_device_capability() == (9, 0)),
    reason="needs an sm90 GPU and a build with the CUTLASS grouped GEMM")
FP8 = torch.float8_e4m3fn

# (device, dtype) of the GEMM: the CPU takes any float type, CUDA bf16 (fp8 separately).
GEMM_CASES = [("cpu", torch.float32), ("cpu", torch.bfloat16),
              pytest.param("cuda", torch.bfloat16, marks=needs_grouped)]
PERMUTE_DEVICES = ["cpu", pytest.param("cuda", marks=needs_cuda)]


def _routing(num_tokens: int, num_experts: int, top_k: int, device: str,
             dtype: torch.dtype = torch.int32) -> torch.Tensor:
    """Distinct experts per token from the lower three quarters (the rest get no row); tokens 0
    and 1 have identical routing."""
    used = max(top_k, 3 * num_experts // 4)
    ids = torch.stack([torch.randperm(used)[:top_k] for _ in range(num_tokens)]) \
        if num_tokens else torch.empty(0, top_k, dtype=torch.long)
    if num_tokens > 1:
        ids[1] = ids[0]
    return ids.to(device=device, dtype=dtype)


def _local_map(num_experts: int, first: int, count: int) -> torch.Tensor:
    m = torch.full((num_experts,), -1, dtype=torch.int32)
    m[first:first + count] = torch.arange(count, dtype=torch.int32)
    return m


def _permute(x: torch.Tensor, ids: torch.Tensor, num_experts: int, num_local: int,
             expert_map: torch.Tensor | None = None,
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    permuted = torch.full((ids.numel(), x.shape[1]), 7, dtype=x.dtype, device=x.device) \
        if x.dtype != FP8 else torch.zeros(ids.numel(), x.shape[1], dtype=x.dtype, device=x.device)
    offsets = torch.full((num_local + 1,), -5, dtype=torch.int32, device=x.device)
    inv = torch.full(ids.shape, -7, dtype=torch.int32, device=x.device)
    _ops.moe_grouped_permute(x, ids, num_experts, expert_map, permuted, offsets, inv)
    return permuted, offsets, inv


# ---- moe_grouped_permute ----
@pytest.mark.parametrize("device", PERMUTE_DEVICES)
@pytest.mark.parametrize("num_tokens,num_experts,top_k,hidden",
                         [(0, 8, 2, 64), (1, 8, 2, 40), (37, 16, 4, 136), (300, 128, 8, 72),
                          (513, 60, 6, 33)])
@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("ep", [False, True])
def test_permute(device: str, num_tokens: int, num_experts: int, top_k: int, hidden: int,
                 ids_dtype: torch.dtype, ep: bool):
    ids = _routing(num_tokens, num_experts, top_k, device, ids_dtype)
    # A strided input (a column window of a wider buffer).
    x = torch.randn(num_tokens, hidden + 8, device=device).to(torch.bfloat16)[:, 8:]
    first, num_local = (num_experts // 3, num_experts // 2) if ep else (0, num_experts)
    emap = _local_map(num_experts, first, num_local).to(device) if ep else None
    permuted, offsets, inv = _permute(x, ids, num_experts, num_local, emap)
    ids_c, inv_c, x_c, permuted_c = ids.long().cpu(), inv.cpu(), x.cpu(), permuted.cpu()
    local = ids_c - first
    is_local = (local >= 0) & (local < num_local)
    counts = torch.bincount(local[is_local], minlength=num_local)
    want_offsets = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)])
    assert offsets.cpu().long().tolist() == want_offsets.tolist()
    assert torch.all(inv_c[~is_local] == -1)
    rows = inv_c[is_local].long()
    # Each local pair owns one row of its expert's range, and the rows are all different.
    assert sorted(rows.tolist()) == list(range(int(want_offsets[-1])))
    lo, hi = want_offsets[local[is_local]], want_offsets[local[is_local] + 1]
    assert torch.all((rows >= lo) & (rows < hi))
    tokens = torch.arange(num_tokens).unsqueeze(1).expand(-1, top_k)[is_local]
    assert torch.equal(permuted_c[rows], x_c[tokens])
    if device == "cpu":  # the CPU keeps pair order inside an expert
        for e in range(num_local):
            assert torch.all(torch.diff(rows[local[is_local] == e]) > 0)


@pytest.mark.parametrize("device", PERMUTE_DEVICES)
def test_permute_fp8_rows_and_out_of_range_ids(device: str):
    x = torch.randn(6, 48, device=device).to(FP8)
    ids = torch.tensor([[0, 3], [3, 9], [-1, 2], [1, 0], [2, 2], [5, 3]], dtype=torch.int32,
                       device=device)  # 9 and -1 are outside [0, 4): dropped
    permuted, offsets, inv = _permute(x, ids, 4, 4)
    assert offsets.cpu().tolist() == [0, 2, 3, 6, 9]
    assert inv.cpu()[1, 1] == -1 and inv.cpu()[2, 0] == -1 and inv.cpu()[5, 0] == -1
    ok = inv.cpu() >= 0
    tokens = torch.arange(6).unsqueeze(1).expand(-1, 2)[ok]
    assert torch.equal(permuted.cpu()[inv.cpu()[ok].long()].view(torch.uint8),
                       x.cpu()[tokens].view(torch.uint8))


# ---- moe_grouped_gemm ----
def _offsets(counts: list[int], device: str) -> torch.Tensor:
    return torch.tensor([0] + torch.tensor(counts).cumsum(0).tolist(), dtype=torch.int32,
                        device=device)


def _gemm_ref(a: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor,
              alpha: torch.Tensor | None = None) -> torch.Tensor:
    o = offsets.cpu().tolist()
    out = torch.zeros(o[-1], w.shape[1], dtype=torch.float64)
    for e in range(w.shape[0]):
        c = a[o[e]:o[e + 1]].cpu().double() @ w[e].cpu().double().T
        out[o[e]:o[e + 1]] = c * (float(alpha[e]) if alpha is not None else 1.0)
    return out


# (counts per expert, N, K): empty experts, one-row experts, a single expert with all rows,
# decode-like and prefill-like averages (each CUDA tile: swapped 32 / 64 and the 128 x 256).
GEMM_SHAPES = [([3, 0, 5, 1], 64, 48), ([0, 0, 0], 32, 16), ([70], 272, 96),
               ([9, 0, 31, 17, 2, 0, 40, 1], 128, 256), ([130, 0, 200, 77], 512, 128),
               ([600, 1, 0, 350], 256, 320)]


@pytest.mark.parametrize("device,dtype", GEMM_CASES)
@pytest.mark.parametrize("counts,n,k", GEMM_SHAPES)
def test_grouped_gemm(device: str, dtype: torch.dtype, counts: list[int], n: int, k: int):
    offsets = _offsets(counts, device)
    rows = sum(counts) + 3  # rows past offsets[-1] are never written
    a = torch.randn(rows, k, device=device).to(dtype)
    w = (torch.randn(len(counts), n, k, device=device) / k**0.5).to(dtype)
    out = torch.full((rows, n), float("nan"), dtype=dtype, device=device)
    _ops.moe_grouped_gemm(out, a, w, offsets)
    torch.testing.assert_close(out[:sum(counts)].cpu().double(), _gemm_ref(a, w, offsets),
                               **tol(dtype, 2.0))
    assert torch.isnan(out[sum(counts):]).all()


def _fp8_gemm_case(counts: list[int], n: int, k: int, device: str
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    a = (torch.randn(sum(counts), k, device=device) * 4).to(FP8)
    w = (torch.randn(len(counts), n, k, device=device) * 4).to(FP8)
    alpha = (torch.rand(len(counts), device=device) + 0.5) / (16 * k**0.5)
    return a, w, alpha, _offsets(counts, device)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_grouped)])
@pytest.mark.parametrize("counts,n,k", GEMM_SHAPES)
def test_grouped_gemm_fp8(device: str, counts: list[int], n: int, k: int):
    """fp8 e4m3 operands (exact in float64), one alpha per expert, bf16 out."""
    a, w, alpha, offsets = _fp8_gemm_case(counts, n, k, device)
    out = torch.empty(sum(counts), n, dtype=torch.bfloat16, device=device)
    _ops.moe_grouped_gemm(out, a, w, offsets, alpha)
    torch.testing.assert_close(out.cpu().double(), _gemm_ref(a, w, offsets, alpha),
                               **tol(torch.bfloat16, 2.0))


# ---- moe_grouped_unpermute ----
@pytest.mark.parametrize("device", PERMUTE_DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_tokens,top_k,hidden", [(0, 2, 64), (1, 1, 8), (29, 4, 136),
                                                     (64, 8, 37)])
def test_unpermute(device: str, dtype: torch.dtype, num_tokens: int, top_k: int, hidden: int):
    rows = num_tokens * top_k
    permuted = torch.randn(rows + 2, hidden, device=device).to(dtype)
    inv = torch.randperm(rows).to(torch.int32).view(num_tokens, top_k)
    if rows:
        inv[0, -1] = -1  # a pair of another rank's expert adds nothing
    inv = inv.to(device)
    weights = torch.rand(num_tokens, top_k, device=device)
    out = torch.full((num_tokens, hidden), float("nan"), dtype=dtype, device=device)
    _ops.moe_grouped_unpermute(permuted, inv, weights, out)
    p, i, wt = permuted.cpu().double(), inv.cpu().long(), weights.cpu().double()
    want = torch.zeros(num_tokens, hidden, dtype=torch.float64)
    for t in range(num_tokens):
        for j in range(top_k):
            if i[t, j] >= 0:
                want[t] += wt[t, j] * p[i[t, j]]
    torch.testing.assert_close(out.cpu().double(), want, **tol(dtype, 2.0))
    _ops.moe_grouped_unpermute(permuted, inv, None, out)  # no weights: a plain sum
    want_sum = torch.stack([sum((p[r] for r in i[t] if r >= 0), torch.zeros(hidden,
                            dtype=torch.float64)) for t in range(num_tokens)]) \
        if num_tokens else want
    torch.testing.assert_close(out.cpu().double(), want_sum, **tol(dtype, 2.0))


# ---- fused_experts_grouped ----
@pytest.mark.parametrize("device,dtype", GEMM_CASES)
@pytest.mark.parametrize("num_tokens,num_experts,top_k,hidden,inter",
                         [(0, 8, 2, 64, 32), (5, 8, 2, 64, 48), (70, 16, 4, 128, 96),
                          (300, 8, 2, 256, 128), (200, 128, 8, 128, 64)])
def test_fused_experts_grouped(device: str, dtype: torch.dtype, num_tokens: int,
                               num_experts: int, top_k: int, hidden: int, inter: int):
    x = torch.randn(num_tokens, hidden, device=device).to(dtype)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, device=device) / hidden**0.5).to(dtype)
    w2 = (torch.randn(num_experts, hidden, inter, device=device) / inter**0.5).to(dtype)
    ids = _routing(num_tokens, num_experts, top_k, device)
    weights = torch.softmax(torch.randn(num_tokens, top_k, device=device), -1)
    out = fm.fused_experts_grouped(x, w13, w2, weights, ids, num_experts)
    assert out.shape == (num_tokens, hidden) and out.dtype == dtype
    torch.testing.assert_close(out.cpu().double(), ref.fused_moe(x, w13, w2, weights, ids),
                               **tol(dtype, 4.0))


@pytest.mark.parametrize("device,dtype", GEMM_CASES)
def test_fused_experts_grouped_expert_parallel(device: str, dtype: torch.dtype):
    """Rank 1 of 2: only experts 6..11 computed here; the others' pairs add nothing."""
    num_experts, top_k, hidden, inter, num_tokens = 12, 3, 64, 32, 90
    emap = _local_map(num_experts, 6, 6).to(device)
    x = torch.randn(num_tokens, hidden, device=device).to(dtype)
    w13 = (torch.randn(6, 2 * inter, hidden, device=device) / hidden**0.5).to(dtype)
    w2 = (torch.randn(6, hidden, inter, device=device) / inter**0.5).to(dtype)
    ids = _routing(num_tokens, num_experts, top_k, device)
    weights = torch.rand(num_tokens, top_k, device=device)
    out = fm.fused_experts_grouped(x, w13, w2, weights, ids, num_experts, emap)
    act = ref.expert_gemm(x, w13, None, ids, top_k, True, emap.cpu())
    down = ref.expert_gemm(act, w2, weights, ids.reshape(-1, 1), 1, False, emap.cpu())
    want = down.view(num_tokens, top_k, hidden).sum(1)
    torch.testing.assert_close(out.cpu().double(), want, **tol(dtype, 4.0))


def _fp8_weights(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-expert per-tensor fp8 weights and scales (what Fp8MoEMethod produces)."""
    scale = w.abs().amax(dim=(1, 2)).float() / _ops.FP8_MAX
    return (w / scale[:, None, None]).to(FP8), scale


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_grouped)])
@pytest.mark.parametrize("num_tokens", [0, 3, 150])
def test_fused_experts_grouped_fp8(device: str, num_tokens: int):
    """fp8 experts: against the float64 layer with the dequantized weights (the activations'
    per-tensor fp8 rounding is the only difference, a few percent at most)."""
    num_experts, top_k, hidden, inter = 8, 2, 128, 64
    x = torch.randn(num_tokens, hidden, device=device).to(torch.bfloat16)
    w13, s13 = _fp8_weights(torch.randn(num_experts, 2 * inter, hidden, device=device)
                            / hidden**0.5)
    w2, s2 = _fp8_weights(torch.randn(num_experts, hidden, inter, device=device) / inter**0.5)
    ids = _routing(num_tokens, num_experts, top_k, device)
    weights = torch.rand(num_tokens, top_k, device=device)
    out = fm.fused_experts_grouped(x, w13, w2, weights, ids, num_experts, None, s13, s2)
    assert out.dtype == torch.bfloat16
    want = ref.fused_moe(x, w13.double() * s13.double()[:, None, None],
                         w2.double() * s2.double()[:, None, None], weights, ids)
    peak = want.abs().max().item() if num_tokens else 0.0
    torch.testing.assert_close(out.cpu().double(), want, atol=0.05 * peak + 1e-3, rtol=0.08)
    # The scales matter: a wrong w2 scale is caught.
    if num_tokens:
        bad = fm.fused_experts_grouped(x, w13, w2, weights, ids, num_experts, None, s13, s2 * 2)
        assert not torch.allclose(bad.cpu().double(), want, rtol=0.2, atol=1e-3)


@needs_grouped
def test_fused_experts_grouped_cuda_graph():
    """Captured once, replayed with new routings and inputs: nothing is read on the host."""
    num_experts, top_k, hidden, inter, num_tokens = 16, 2, 128, 64, 96
    dev, dtype = "cuda", torch.bfloat16
    x = torch.randn(num_tokens, hidden, device=dev).to(dtype)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, device=dev) / hidden**0.5).to(dtype)
    w2 = (torch.randn(num_experts, hidden, inter, device=dev) / inter**0.5).to(dtype)
    ids = _routing(num_tokens, num_experts, top_k, dev)
    weights = torch.rand(num_tokens, top_k, device=dev)
    result: list[torch.Tensor] = []
    graph = capture_graph(lambda: result.append(
        fm.fused_experts_grouped(x, w13, w2, weights, ids, num_experts)))
    for _ in range(3):
        ids.copy_(_routing(num_tokens, num_experts, top_k, dev))
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.testing.assert_close(result[-1].cpu().double(),
                                   ref.fused_moe(x, w13, w2, weights, ids), **tol(dtype, 4.0))


def test_dispatch():
    """fused_experts takes the grouped path exactly for CUDA bf16 prefill on a build with it."""
    w13 = torch.empty(8, 128, 64, dtype=torch.bfloat16)
    w2 = torch.empty(8, 64, 64, dtype=torch.bfloat16)
    assert not fm._use_grouped_gemm(torch.empty(512, 64, dtype=torch.bfloat16), w13, w2)
    if CUDA_AVAILABLE:
        cuda = torch.empty(512, 64, dtype=torch.bfloat16, device="cuda")
        assert fm._use_grouped_gemm(cuda, w13, w2) == _ops.moe_grouped_gemm_available()
        assert not fm._use_grouped_gemm(cuda[:63], w13, w2)
        assert not fm._use_grouped_gemm(cuda.half(), w13, w2)
        assert not fm._use_grouped_gemm(cuda, w13[:, :120], w2)


# ---- argument checks ----
@pytest.mark.parametrize("device", DEVICES)
def test_checks(device: str):
    bf = torch.bfloat16
    a = torch.randn(10, 64, device=device, dtype=bf)
    w = torch.randn(3, 32, 64, device=device, dtype=bf)
    offsets = _offsets([4, 0, 6], device)
    out = torch.empty(10, 32, device=device, dtype=bf)
    if device == "cpu" or _ops.moe_grouped_gemm_available():
        _ops.moe_grouped_gemm(out, a, w, offsets)  # the valid call
    with pytest.raises(RuntimeError, match="must be float32, float16, bfloat16 or float8"):
        _ops.moe_grouped_gemm(out, a.to(torch.int32), w.to(torch.int32), offsets)
    with pytest.raises(RuntimeError, match="do not fit weight"):
        _ops.moe_grouped_gemm(torch.empty(10, 16, device=device, dtype=bf), a, w, offsets)
    with pytest.raises(RuntimeError, match="num_experts \\+ 1 = 4"):
        _ops.moe_grouped_gemm(out, a, w, offsets[:3])
    with pytest.raises(RuntimeError, match="alpha is for fp8 operands only"):
        _ops.moe_grouped_gemm(out, a, w, offsets, torch.ones(3, device=device))
    with pytest.raises(RuntimeError, match="fp8 operands need alpha"):
        _ops.moe_grouped_gemm(out, a.to(FP8), w.to(FP8), offsets)
    with pytest.raises(RuntimeError, match="out must be BFloat16"):
        _ops.moe_grouped_gemm(out.half(), a.to(FP8), w.to(FP8), offsets,
                              torch.ones(3, device=device))
    if device == "cpu":
        with pytest.raises(RuntimeError, match="expert_offsets must rise"):
            _ops.moe_grouped_gemm(out, a, w, _offsets([4, 9, 6], device))
        with pytest.raises(RuntimeError, match="inv_perm\\[1\\] = 40 is outside"):
            _ops.moe_grouped_unpermute(out, torch.tensor([[0, 40]], dtype=torch.int32),
                                       None, torch.empty(1, 32, dtype=bf))
    elif _ops.moe_grouped_gemm_available():
        with pytest.raises(RuntimeError, match="CUDA takes bfloat16 or float8_e4m3fn"):
            _ops.moe_grouped_gemm(out.half(), a.half(), w.half(), offsets)
        with pytest.raises(RuntimeError, match="multiples of 16"):
            _ops.moe_grouped_gemm(out[:, :24].contiguous(), a, w[:, :24].contiguous(), offsets)
    ids = torch.zeros(10, 2, dtype=torch.int32, device=device)
    perm = torch.empty(20, 64, device=device, dtype=bf)
    inv = torch.empty(10, 2, dtype=torch.int32, device=device)
    with pytest.raises(RuntimeError, match="without expert_map expert_offsets needs 5"):
        _ops.moe_grouped_permute(a, ids, 4, None, perm, offsets, inv)
    with pytest.raises(RuntimeError, match="topk_ids must be contiguous int32 or int64"):
        _ops.moe_grouped_permute(a, ids.float(), 3, None, perm, offsets, inv)
    with pytest.raises(RuntimeError, match="permuted must be contiguous"):
        _ops.moe_grouped_permute(a, ids, 3, None, perm[:19], offsets, inv)
    with pytest.raises(RuntimeError, match="dtype must be float32, float16 or bfloat16"):
        _ops.moe_grouped_unpermute(perm.to(torch.int32), inv, None,
                                   torch.empty(10, 64, device=device, dtype=torch.int32))
    with pytest.raises(RuntimeError, match="topk_weights must be contiguous float32"):
        _ops.moe_grouped_unpermute(perm, inv, torch.ones(10, 3, device=device),
                                   torch.empty(10, 64, device=device, dtype=bf))
    with pytest.raises(ValueError, match="fp8 weights"):
        fm.fused_experts_grouped(a, w, w, torch.ones(10, 2, device=device), ids, 3, None,
                                 torch.ones(3, device=device), None)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_grouped)])
def test_opcheck(device: str):
    dtype = torch.bfloat16
    ids = _routing(6, 4, 2, device)
    x = torch.randn(6, 32, device=device, dtype=dtype)
    torch.library.opcheck(torch.ops.pyorch.moe_grouped_permute.default, (
        x, ids, 4, None, torch.empty(12, 32, device=device, dtype=dtype),
        torch.empty(5, dtype=torch.int32, device=device),
        torch.empty(6, 2, dtype=torch.int32, device=device)))
    torch.library.opcheck(torch.ops.pyorch.moe_grouped_gemm.default, (
        torch.empty(12, 16, device=device, dtype=dtype), torch.randn(12, 32, device=device,
                                                                     dtype=dtype),
        torch.randn(4, 16, 32, device=device, dtype=dtype), _offsets([3, 0, 5, 4], device),
        None))
    torch.library.opcheck(torch.ops.pyorch.moe_grouped_unpermute.default, (
        torch.randn(12, 32, device=device, dtype=dtype),
        torch.randperm(12).to(torch.int32).view(6, 2).to(device),
        torch.rand(6, 2, device=device), torch.empty(6, 32, device=device, dtype=dtype)))


@pytest.mark.parametrize("fp8", [False, True])
def test_fused_experts_grouped_releases_each_intermediate(monkeypatch, fp8: bool):
    """Each buffer is dropped once the next exists (the layer's peak is two neighbours, which
    the memory profile turns into KV cache): by the un-permute, the permuted rows, the gate_up
    product and the down GEMM's input are gone."""
    import weakref

    seen: dict[str, list] = {"gemm_in": [], "gemm_out": []}
    real = fm._ops

    class Spy:
        def __getattr__(self, name):
            return getattr(real, name)

        def moe_grouped_gemm(self, out, inp, *args):
            seen["gemm_in"].append(weakref.ref(inp))
            seen["gemm_out"].append(weakref.ref(out))
            return real.moe_grouped_gemm(out, inp, *args)

        def moe_grouped_unpermute(self, down, *args):
            seen["alive"] = [r() is not None for r in (*seen["gemm_in"], seen["gemm_out"][0])]
            return real.moe_grouped_unpermute(down, *args)

    monkeypatch.setattr(fm, "_ops", Spy())
    num_experts, top_k, hidden, inter, num_tokens = 8, 2, 64, 32, 40
    x = torch.randn(num_tokens, hidden).to(torch.bfloat16)
    w13 = torch.randn(num_experts, 2 * inter, hidden) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter) / inter**0.5
    scales: tuple = (None, None)
    if fp8:
        (w13, s13), (w2, s2) = _fp8_weights(w13), _fp8_weights(w2)
        scales = (s13, s2)
    else:
        w13, w2 = w13.to(torch.bfloat16), w2.to(torch.bfloat16)
    ids = _routing(num_tokens, num_experts, top_k, "cpu")
    weights = torch.rand(num_tokens, top_k)
    out = fm.fused_experts_grouped(x, w13, w2, weights, ids, num_experts, None, *scales)
    assert out.shape == (num_tokens, hidden)
    # permuted rows, the down GEMM's input (the SiLU output or its fp8 copy), gate_up
    assert seen["alive"] == [False, False, False]
