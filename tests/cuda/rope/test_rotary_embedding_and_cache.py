"""rotary_embedding_and_cache: the same bits as rotary_embedding then reshape_and_cache_flash.

The CUDA kernel rotates query and key and writes the rotated key and the value into the NHD
caches in one launch; on CPU the op is that composition. Both are compared with the two ops run
on copies of the same fresh random inputs: query, key (rotated in place), both caches (poisoned
with random bytes first, so untouched slots are checked too) must match exactly, and the written
slots also against the float64 rotary reference (tests/reference/rope.py).
"""

import pytest
import torch

from pyorch import _ops
from tests.conftest import CUDA_AVAILABLE, DEVICES, capture_graph, tol
from tests.reference import rope as ref

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (head_size, rot_dim): full rotary, and partial rotary (a key tail copied unrotated).
HEADS = [(64, 64), (80, 80), (128, 128), (256, 256), (128, 64), (80, 32)]
# (num_tokens, num_heads, num_kv_heads)
TOKENS = [(1, 32, 8), (7, 7, 1), (83, 4, 2)]
KV_DTYPES = [("auto", None), ("fp8", torch.uint8), ("fp8_e4m3", torch.float8_e4m3fn)]
BLOCK_SIZE = 16
MAX_POSITION = 4096


def _inputs(num_tokens, num_heads, num_kv_heads, head_size, rot_dim, dtype, kv, device,
            pad=8, padding_tokens=2):
    """q, k, v as views of one fused qkv tensor (a token stride wider than the heads); caches
    in a wider tensor (a block stride past the block) filled with random bytes; a shuffled
    slot mapping whose last `padding_tokens` entries are -1."""
    q_size, kv_size = num_heads * head_size, num_kv_heads * head_size
    qkv = torch.randn(num_tokens, q_size + 2 * kv_size + pad, dtype=dtype, device=device)
    q = qkv[:, :q_size]
    k = qkv[:, q_size : q_size + kv_size].view(num_tokens, num_kv_heads, head_size)
    v = qkv[:, q_size + kv_size : q_size + 2 * kv_size].view(num_tokens, num_kv_heads, head_size)
    positions = torch.randint(0, MAX_POSITION, (num_tokens,), device=device)
    cos_sin = torch.randn(MAX_POSITION, rot_dim, dtype=dtype, device=device)
    num_blocks = (num_tokens + BLOCK_SIZE - 1) // BLOCK_SIZE + 2
    cache_dtype = kv[1] or dtype
    wide = (2, num_blocks, BLOCK_SIZE, num_kv_heads, head_size)
    if cache_dtype in (torch.uint8, torch.float8_e4m3fn):
        kv_cache = torch.randint(0, 256, wide, dtype=torch.uint8, device=device).view(cache_dtype)
    else:
        kv_cache = torch.randn(wide, dtype=cache_dtype, device=device)
    slots = torch.randperm(num_blocks * BLOCK_SIZE, device=device)[:num_tokens]
    if padding_tokens:
        slots[-padding_tokens:] = -1
    k_scale = torch.tensor([0.5], device=device)
    v_scale = torch.tensor([2.0], device=device)
    return dict(positions=positions, qkv=qkv, q=q, k=k, v=v, cos_sin=cos_sin,
                key_cache=kv_cache[0], value_cache=kv_cache[1], wide_cache=kv_cache,
                slots=slots, k_scale=k_scale, v_scale=v_scale, kv=kv[0])


def _clone(x):
    """A deep copy whose views keep the same layout (q/k/v in one qkv, caches in one tensor)."""
    y = dict(x)
    y["qkv"] = x["qkv"].clone()
    q_size, kv_size = x["q"].shape[1], x["k"].shape[1] * x["k"].shape[2]
    y["q"] = y["qkv"][:, :q_size]
    y["k"] = y["qkv"][:, q_size : q_size + kv_size].view(x["k"].shape)
    y["v"] = y["qkv"][:, q_size + kv_size : q_size + 2 * kv_size].view(x["v"].shape)
    y["wide_cache"] = x["wide_cache"].clone()
    y["key_cache"], y["value_cache"] = y["wide_cache"][0], y["wide_cache"][1]
    return y


def _fused(x, head_size, is_neox):
    _ops.rotary_embedding_and_cache(
        x["positions"], x["q"], x["k"], x["v"], head_size, x["cos_sin"], is_neox, x["key_cache"],
        x["value_cache"], x["slots"], x["kv"], x["k_scale"], x["v_scale"])


def _apart(x, head_size, is_neox):
    _ops.rotary_embedding(x["positions"], x["q"], x["k"], head_size, x["cos_sin"], is_neox)
    _ops.reshape_and_cache_flash(x["k"], x["v"], x["key_cache"], x["value_cache"], x["slots"],
                                 x["kv"], x["k_scale"], x["v_scale"])


def _bytes(t):
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv", KV_DTYPES, ids=[k[0] for k in KV_DTYPES])
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("head_size,rot_dim", HEADS)
@pytest.mark.parametrize("num_tokens,num_heads,num_kv_heads", TOKENS)
def test_same_bits_as_rope_then_cache_write(device, dtype, kv, is_neox, head_size, rot_dim,
                                            num_tokens, num_heads, num_kv_heads):
    padding = 2 if num_tokens > 2 else 0
    x = _inputs(num_tokens, num_heads, num_kv_heads, head_size, rot_dim, dtype, kv, device,
                padding_tokens=padding)
    before = _clone(x)
    want = _clone(x)
    _fused(x, head_size, is_neox)
    _apart(want, head_size, is_neox)
    assert torch.equal(x["qkv"], want["qkv"]), "query / key / value differ"
    assert torch.equal(_bytes(x["wide_cache"]), _bytes(want["wide_cache"])), "caches differ"

    # The float64 reference of the rotation, and the auto cache's written slots.
    ref_q, ref_k = ref.rotary_embedding(before["positions"], before["q"], before["k"], head_size,
                                        before["cos_sin"], is_neox)
    torch.testing.assert_close(x["q"], ref_q, **tol(dtype))
    torch.testing.assert_close(x["k"], ref_k.view(x["k"].shape), **tol(dtype))
    torch.testing.assert_close(x["v"], before["v"], rtol=0, atol=0)
    if kv[0] == "auto":
        for t, slot in enumerate(x["slots"].tolist()):
            if slot < 0:
                continue
            block, offset = divmod(slot, BLOCK_SIZE)
            assert torch.equal(x["key_cache"][block, offset], x["k"][t])
            assert torch.equal(x["value_cache"][block, offset], x["v"][t])


@pytest.mark.parametrize("device", DEVICES)
def test_float32_cos_sin_cache_and_no_tokens(device):
    """A float32 cos/sin table with 16-bit activations, and an empty batch (a no-op)."""
    x = _inputs(5, 8, 2, 128, 128, torch.bfloat16, ("auto", None), device)
    x["cos_sin"] = x["cos_sin"].float()
    want = _clone(x)
    _fused(x, 128, True)
    _apart(want, 128, True)
    assert torch.equal(x["qkv"], want["qkv"]) and torch.equal(x["wide_cache"], want["wide_cache"])
    empty = _inputs(0, 8, 2, 128, 128, torch.bfloat16, ("auto", None), device, padding_tokens=0)
    cache_before = empty["wide_cache"].clone()
    _fused(empty, 128, True)
    assert torch.equal(empty["wide_cache"], cache_before)


@pytest.mark.skipif(not CUDA_AVAILABLE, reason="no CUDA device on this machine")
@pytest.mark.parametrize("kv", KV_DTYPES[:2], ids=[k[0] for k in KV_DTYPES[:2]])
def test_cuda_graph_replay(kv):
    """Captured once (Llama-3-8B's decode shape), replayed on new inputs and new slots."""
    x = _inputs(4, 32, 8, 128, 128, torch.bfloat16, kv, "cuda", padding_tokens=1)
    graph = capture_graph(lambda: _fused(x, 128, True))
    for _ in range(3):
        x["qkv"].normal_()
        x["positions"].random_(0, MAX_POSITION)
        x["slots"][:3] = torch.randperm(x["key_cache"].shape[0] * BLOCK_SIZE, device="cuda")[:3]
        want = _clone(x)
        graph.replay()
        torch.cuda.synchronize()
        _apart(want, 128, True)
        assert torch.equal(x["qkv"], want["qkv"])
        assert torch.equal(_bytes(x["wide_cache"]), _bytes(want["wide_cache"]))


@pytest.mark.parametrize("device", DEVICES)
def test_rejects_bad_arguments(device):
    x = _inputs(3, 4, 2, 64, 64, torch.float16, ("auto", None), device, padding_tokens=0)
    before = _clone(x)

    def call(**over):
        a = {**x, **over}
        _ops.rotary_embedding_and_cache(
            a["positions"], a["q"], a["k"], a["v"], a.get("head_size", 64), a["cos_sin"], True,
            a["key_cache"], a["value_cache"], a["slots"], a["kv"], a["k_scale"], a["v_scale"])

    with pytest.raises(RuntimeError, match="key must be \\[num_tokens, num_kv_heads"):
        call(k=x["k"].flatten(1))
    with pytest.raises(RuntimeError, match="key dtype"):
        call(k=x["k"].float())
    with pytest.raises(RuntimeError, match="rot_dim"):
        call(cos_sin=torch.randn(MAX_POSITION, 66, dtype=torch.float16, device=device))
    with pytest.raises(RuntimeError, match="kv_cache_dtype"):
        call(kv="fp8_e5m2")
    with pytest.raises(RuntimeError, match="slot_mapping must be"):
        call(slots=x["slots"][:2])
    with pytest.raises(RuntimeError, match="positions must be"):
        call(positions=x["positions"].int())
    # The rejected calls wrote nothing.
    assert torch.equal(x["qkv"], before["qkv"])
    assert torch.equal(x["wide_cache"], before["wide_cache"])


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    x = _inputs(6, 4, 2, 64, 64, torch.bfloat16, ("auto", None), device)
    args = (x["positions"], x["q"], x["k"], x["v"], 64, x["cos_sin"], True, x["key_cache"],
            x["value_cache"], x["slots"], x["kv"], x["k_scale"], x["v_scale"])
    torch.library.opcheck(torch.ops.pyorch.rotary_embedding_and_cache.default, args)
