"""rotary_embedding_and_cache with q/k norm weights: every query and key head RMS-normalized
(Qwen3's q_norm / k_norm), then rotated, then the key and value written into the caches.

Checked against the float64 references (tests/reference/norm.py then tests/reference/rope.py:
rms_norm's rounding, then the rotation) on fresh random inputs and weights, and against the ops
it replaces (rms_norm on each head, then rotary_embedding_and_cache without weights). q, k and v
are strided views of one qkv tensor, as the model passes them; the caches are poisoned with
random bytes so untouched slots are checked too.
"""

import pytest
import torch

from pyorch import _ops
from tests.conftest import CUDA_AVAILABLE, DEVICES, capture_graph, tol
from tests.cuda.rope.test_rotary_embedding_and_cache import (
    BLOCK_SIZE, KV_DTYPES, _bytes, _clone, _inputs)
from tests.reference import norm as norm_ref
from tests.reference import rope as rope_ref

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
HEAD_SIZES = [64, 128, 256]
# (num_tokens, num_heads, num_kv_heads): one decode token with Qwen3-30B-A3B's heads, odd sizes
TOKENS = [(1, 32, 4), (7, 7, 1), (83, 4, 2)]
EPS = 1e-6


def _weights(head_size, dtype, device):
    q_w = (1.0 + 0.5 * torch.randn(head_size, device=device)).to(dtype)
    k_w = (1.0 + 0.5 * torch.randn(head_size, device=device)).to(dtype)
    return q_w, k_w


def _fused(x, head_size, is_neox, q_w, k_w, eps=EPS):
    _ops.rotary_embedding_and_cache(
        x["positions"], x["q"], x["k"], x["v"], head_size, x["cos_sin"], is_neox, x["key_cache"],
        x["value_cache"], x["slots"], x["kv"], x["k_scale"], x["v_scale"], q_w, k_w, eps)


def _norm_heads_in_place(x, head_size, q_w, k_w):
    """What the model did before the fusion: rms_norm over each head, written back."""
    for name, w in (("q", q_w), ("k", k_w)):
        heads = x[name].reshape(-1, head_size).contiguous()
        out = torch.empty_like(heads)
        _ops.rms_norm(out, heads, w, EPS)
        x[name].copy_(out.view(x[name].shape))


def _written(x):
    """[num_blocks, block_size] bool: the cache slots the op writes."""
    mask = torch.zeros(x["key_cache"].shape[:2], dtype=torch.bool, device=x["slots"].device)
    for slot in x["slots"].tolist():
        if slot >= 0:
            mask[divmod(slot, BLOCK_SIZE)] = True
    return mask


def _as_float(cache, kv):
    if kv == "auto":
        return cache.float()
    return cache.view(torch.float8_e4m3fn).float()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv", KV_DTYPES, ids=[k[0] for k in KV_DTYPES])
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("head_size", HEAD_SIZES)
@pytest.mark.parametrize("num_tokens,num_heads,num_kv_heads", TOKENS)
def test_matches_reference_and_the_ops_it_replaces(device, dtype, kv, is_neox, head_size,
                                                   num_tokens, num_heads, num_kv_heads):
    padding = 2 if num_tokens > 2 else 0
    x = _inputs(num_tokens, num_heads, num_kv_heads, head_size, head_size, dtype, kv, device,
                padding_tokens=padding)
    q_w, k_w = _weights(head_size, dtype, device)
    before = _clone(x)
    apart = _clone(x)
    _fused(x, head_size, is_neox, q_w, k_w)

    # float64 references: rms_norm's rounding per head, then the rotation.
    q_n = norm_ref.rms_norm(before["q"].reshape(-1, head_size), q_w, EPS).view(num_tokens, -1)
    k_n = norm_ref.rms_norm(before["k"].reshape(-1, head_size), k_w, EPS).view(before["k"].shape)
    ref_q, ref_k = rope_ref.rotary_embedding(before["positions"], q_n, k_n, head_size,
                                             before["cos_sin"], is_neox)
    # Two roundings (normed, times the weight) happen before the rotation: an fp32 sum of
    # squares may flip either by an ulp, which the rotation can carry into a smaller output.
    torch.testing.assert_close(x["q"], ref_q, **tol(dtype, 2))
    torch.testing.assert_close(x["k"], ref_k.view(x["k"].shape), **tol(dtype, 2))
    torch.testing.assert_close(x["v"], before["v"], rtol=0, atol=0)

    # The ops it replaces, on a copy (the sums of squares add in another order: close, not equal).
    _norm_heads_in_place(apart, head_size, q_w, k_w)
    _ops.rotary_embedding_and_cache(
        apart["positions"], apart["q"], apart["k"], apart["v"], head_size, apart["cos_sin"],
        is_neox, apart["key_cache"], apart["value_cache"], apart["slots"], apart["kv"],
        apart["k_scale"], apart["v_scale"])
    torch.testing.assert_close(x["qkv"], apart["qkv"], **tol(dtype, 2))

    # Written slots hold the rotated key and the value (fp8: to its precision); others untouched.
    written = _written(x)
    for cache in ("key_cache", "value_cache"):
        got, want = _as_float(x[cache], kv[0]), _as_float(apart[cache], kv[0])
        fp8_tol = dict(atol=2e-2, rtol=0.13) if kv[0] != "auto" else tol(dtype)
        torch.testing.assert_close(got[written], want[written], **fp8_tol)
        assert torch.equal(_bytes(x[cache])[~written], _bytes(before[cache])[~written])
    if kv[0] == "auto":
        for t, slot in enumerate(x["slots"].tolist()):
            if slot >= 0:
                block, offset = divmod(slot, BLOCK_SIZE)
                assert torch.equal(x["key_cache"][block, offset], x["k"][t])


@pytest.mark.parametrize("device", DEVICES)
def test_norm_weights_change_the_result(device):
    """The weights and eps are used: another weight or eps gives another query."""
    x = _inputs(3, 8, 2, 128, 128, torch.float32, ("auto", None), device, padding_tokens=0)
    q_w, k_w = _weights(128, torch.float32, device)
    a, b, c = _clone(x), _clone(x), _clone(x)
    _fused(a, 128, True, q_w, k_w)
    _fused(b, 128, True, q_w * 2, k_w)
    _fused(c, 128, True, q_w, k_w, eps=1e3)
    torch.testing.assert_close(b["q"], 2 * a["q"], **tol(torch.float32))
    torch.testing.assert_close(b["k"], a["k"], rtol=0, atol=0)
    assert not torch.allclose(c["q"], a["q"])


@pytest.mark.skipif(not CUDA_AVAILABLE, reason="no CUDA device on this machine")
@pytest.mark.parametrize("kv", KV_DTYPES[:2], ids=[k[0] for k in KV_DTYPES[:2]])
def test_cuda_graph_replay(kv):
    """Captured once (Qwen3-30B-A3B's decode shape), replayed on new inputs and slots."""
    x = _inputs(4, 32, 4, 128, 128, torch.bfloat16, kv, "cuda", padding_tokens=1)
    q_w, k_w = _weights(128, torch.bfloat16, "cuda")
    graph = capture_graph(lambda: _fused(x, 128, True, q_w, k_w))
    for _ in range(3):
        x["qkv"].normal_()
        x["positions"].random_(0, 4096)
        x["slots"][:3] = torch.randperm(x["key_cache"].shape[0] * BLOCK_SIZE, device="cuda")[:3]
        want = _clone(x)
        graph.replay()
        torch.cuda.synchronize()
        _fused(want, 128, True, q_w, k_w)
        assert torch.equal(x["qkv"], want["qkv"])
        assert torch.equal(_bytes(x["wide_cache"]), _bytes(want["wide_cache"]))


@pytest.mark.parametrize("device", DEVICES)
def test_rejects_bad_norm_arguments(device):
    x = _inputs(3, 4, 2, 64, 64, torch.float16, ("auto", None), device, padding_tokens=0)
    q_w, k_w = _weights(64, torch.float16, device)
    before = _clone(x)

    def call(head_size=64, cos_sin=None, **w):
        a = {**x, "cos_sin": x["cos_sin"] if cos_sin is None else cos_sin}
        _ops.rotary_embedding_and_cache(
            a["positions"], a["q"], a["k"], a["v"], head_size, a["cos_sin"], True, a["key_cache"],
            a["value_cache"], a["slots"], a["kv"], a["k_scale"], a["v_scale"],
            w.get("q_w", q_w), w.get("k_w", k_w), EPS)

    with pytest.raises(RuntimeError, match="go together"):
        call(k_w=None)
    with pytest.raises(RuntimeError, match="q_norm_weight must be a contiguous"):
        call(q_w=torch.ones(32, dtype=torch.float16, device=device))
    with pytest.raises(RuntimeError, match="k_norm_weight dtype"):
        call(k_w=k_w.float())
    with pytest.raises(RuntimeError, match="whole heads"):
        call(cos_sin=x["cos_sin"][:, :32].contiguous())
    # Every check runs before any write.
    assert torch.equal(x["qkv"], before["qkv"])
    assert torch.equal(x["wide_cache"], before["wide_cache"])

    # A head size that is not a power of two has no norm form (the kernel's thread groups).
    y = _inputs(3, 4, 2, 80, 80, torch.float16, ("auto", None), device, padding_tokens=0)
    w80 = torch.ones(80, dtype=torch.float16, device=device)
    with pytest.raises(RuntimeError, match="power-of-two head_size"):
        _fused(y, 80, True, w80, w80)


@pytest.mark.skipif(not CUDA_AVAILABLE, reason="no CUDA device on this machine")
def test_cuda_rejects_misaligned_heads_and_fusable_says_so():
    """Heads at an odd element offset could only be read an element at a time (64 chunks per
    half head, more than the kernel's thread group): the op refuses with a clear error, and
    qk_norm_fusable (the model's check) says no first."""
    head_size = 128
    x = _inputs(2, 4, 2, head_size, head_size, torch.bfloat16, ("auto", None), "cuda", pad=1,
                padding_tokens=0)
    odd = x["qkv"].new_empty(x["qkv"].shape[0], x["qkv"].shape[1] + 1)[:, 1:]
    odd.copy_(x["qkv"])
    q_size, kv_size = x["q"].shape[1], x["k"].shape[1] * head_size
    x["q"] = odd[:, :q_size]
    x["k"] = odd[:, q_size:q_size + kv_size].view(x["k"].shape)
    x["v"] = odd[:, q_size + kv_size:q_size + 2 * kv_size].view(x["v"].shape)
    q_w, k_w = _weights(head_size, torch.bfloat16, "cuda")
    assert not _ops.qk_norm_fusable(x["q"], x["k"], x["v"], head_size, head_size, q_w, k_w)
    with pytest.raises(RuntimeError, match="16-byte aligned"):
        _fused(x, head_size, True, q_w, k_w)


@pytest.mark.parametrize("device", DEVICES)
def test_qk_norm_fusable(device):
    x = _inputs(2, 4, 2, 128, 128, torch.bfloat16, ("auto", None), device, padding_tokens=0)
    q_w, k_w = _weights(128, torch.bfloat16, device)
    args = (x["q"], x["k"], x["v"])
    assert _ops.qk_norm_fusable(*args, 128, 128, q_w, k_w)
    assert not _ops.qk_norm_fusable(*args, 128, 64, q_w, k_w)  # partial rotary
    assert not _ops.qk_norm_fusable(*args, 128, 128, q_w.float(), k_w)  # weight dtype
    assert not _ops.qk_norm_fusable(*args, 128, 128, q_w[:64], k_w)  # weight shape


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    x = _inputs(6, 4, 2, 64, 64, torch.bfloat16, ("auto", None), device)
    q_w, k_w = _weights(64, torch.bfloat16, device)
    args = (x["positions"], x["q"], x["k"], x["v"], 64, x["cos_sin"], True, x["key_cache"],
            x["value_cache"], x["slots"], x["kv"], x["k_scale"], x["v_scale"], q_w, k_w, EPS)
    torch.library.opcheck(torch.ops.pyorch.rotary_embedding_and_cache.default, args)
