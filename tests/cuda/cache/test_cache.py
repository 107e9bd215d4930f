"""KV-cache ops (reshape_and_cache(_flash), copy_blocks, swap_blocks) on CPU and CUDA against the
pure-torch references in tests/reference/cache.py. Every write is exact, so caches are compared
bit for bit; caches start out random so that a stray or missing write shows."""

import math

import pytest
import torch

from pyorch import _ops
from tests.conftest import CUDA_AVAILABLE, DEVICES
from tests.reference import cache as ref

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (kv_cache_dtype, cache storage dtype; None = the model dtype)
KV_DTYPES = [("auto", None), ("fp8", torch.uint8), ("fp8_e4m3", torch.float8_e4m3fn)]
# (num_tokens, num_kv_heads, head_size, block_size)
SHAPES = [
    (1, 1, 64, 8),
    (7, 3, 80, 16),
    (83, 8, 96, 32),
    (989, 8, 128, 16),
    (83, 3, 256, 8),
    (7, 8, 64, 32),
    (989, 1, 256, 32),
    (1, 3, 128, 16),
    (83, 1, 80, 8),
]
# contiguous: plain key/value and caches; qkv: key/value sliced out of a fused qkv output and caches
# that are views of one [num_blocks, 2, ...] allocation; padded: head stride head_size + 1, which
# forces the scalar (unaligned) path.
INPUT_LAYOUTS = ["contiguous", "qkv", "padded"]
K_SCALE, V_SCALE = 0.37, 2.5


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _assert_same(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    got_b, want_b = _bytes(got), _bytes(want)
    if not torch.equal(got_b, want_b):
        bad = (got_b != want_b).nonzero()
        raise AssertionError(f"{bad.shape[0]} elements differ, first at {bad[0].tolist()}")


def _random_cache(shape: tuple, dtype: torch.dtype, device: str) -> torch.Tensor:
    if dtype in (torch.uint8, torch.float8_e4m3fn):
        return torch.randint(0, 256, shape, dtype=torch.uint8, device=device).view(dtype)
    return torch.randn(shape, device=device).to(dtype)


def _key_value(layout: str, num_tokens: int, num_kv_heads: int, head_size: int, dtype, device):
    shape = (num_tokens, num_kv_heads, head_size)
    if layout == "qkv":
        kv = num_kv_heads * head_size
        qkv = torch.randn(num_tokens, 2 * kv + kv, device=device).to(dtype)  # q has 2x kv heads
        return qkv[:, 2 * kv : 3 * kv].view(shape), qkv[:, kv : 2 * kv].view(shape)
    if layout == "padded":
        base = torch.randn(2, num_tokens, num_kv_heads, head_size + 1, device=device).to(dtype)
        return base[0, ..., :head_size], base[1, ..., 1:]
    return torch.randn(shape, device=device).to(dtype), torch.randn(shape, device=device).to(dtype)


def _caches(
    split: bool,
    layout: str,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    cache_dtype: torch.dtype,
    device: str,
):
    x = 16 // torch.empty((), dtype=cache_dtype).element_size()
    if split:
        k_shape = (num_blocks, num_kv_heads, head_size // x, block_size, x)
        v_shape = (num_blocks, num_kv_heads, head_size, block_size)
    else:
        k_shape = v_shape = (num_blocks, block_size, num_kv_heads, head_size)
    if layout == "contiguous":
        return _random_cache(k_shape, cache_dtype, device), _random_cache(
            v_shape, cache_dtype, device
        )
    # Views of one allocation: the block stride is twice a block.
    both = _random_cache((num_blocks, 2, math.prod(k_shape[1:])), cache_dtype, device)
    return both[:, 0].view(k_shape), both[:, 1].view(v_shape)


def _slot_mapping(num_tokens: int, num_slots: int, device: str) -> torch.Tensor:
    slots = torch.randperm(num_slots)[:num_tokens]
    slots[torch.rand(num_tokens) < 0.1] = -1  # padding tokens
    return slots.to(device)


def _scales(device: str) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.tensor([K_SCALE], device=device), torch.tensor([V_SCALE], device=device))


def _run_write(split: bool, device: str, shape: tuple, dtype, kv: tuple, layout: str) -> None:
    num_tokens, num_kv_heads, head_size, block_size = shape
    kv_cache_dtype, cache_dtype = kv
    cache_dtype = cache_dtype or dtype
    key, value = _key_value(layout, num_tokens, num_kv_heads, head_size, dtype, device)
    if kv_cache_dtype != "auto":  # wide enough that x / scale saturates at +-448 now and then
        key, value = key * 100, value * 600
    num_blocks = (3 * num_tokens) // (2 * block_size) + 2
    key_cache, value_cache = _caches(
        split, layout, num_blocks, block_size, num_kv_heads, head_size, cache_dtype, device
    )
    slot_mapping = _slot_mapping(num_tokens, num_blocks * block_size, device)
    k_scale, v_scale = _scales(device)
    args = (slot_mapping, kv_cache_dtype, k_scale, v_scale)
    if split:
        want_k, want_v = ref.reshape_and_cache(key, value, key_cache, value_cache, *args)
        _ops.reshape_and_cache(key, value, key_cache, value_cache, *args)
    else:
        want_k, want_v = ref.reshape_and_cache_flash(key, value, key_cache, value_cache, *args)
        _ops.reshape_and_cache_flash(key, value, key_cache, value_cache, *args)
    _assert_same(key_cache, want_k)
    _assert_same(value_cache, want_v)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv", KV_DTYPES, ids=[k[0] for k in KV_DTYPES])
@pytest.mark.parametrize("layout", INPUT_LAYOUTS)
def test_reshape_and_cache_flash(device, shape, dtype, kv, layout):
    _run_write(False, device, shape, dtype, kv, layout)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv", KV_DTYPES, ids=[k[0] for k in KV_DTYPES])
@pytest.mark.parametrize("layout", INPUT_LAYOUTS)
def test_reshape_and_cache(device, shape, dtype, kv, layout):
    _run_write(True, device, shape, dtype, kv, layout)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", ["flash", "split"])
def test_write_no_tokens_and_all_padding(device, op):
    fn = _ops.reshape_and_cache if op == "split" else _ops.reshape_and_cache_flash
    for num_tokens, pad in [(0, False), (5, True)]:
        key, value = _key_value("contiguous", num_tokens, 2, 64, torch.float16, device)
        key_cache, value_cache = _caches(
            op == "split", "contiguous", 3, 16, 2, 64, torch.float16, device
        )
        k0, v0 = key_cache.clone(), value_cache.clone()
        slots = torch.full((num_tokens,), -1, dtype=torch.long, device=device)
        fn(key, value, key_cache, value_cache, slots, "auto", *_scales(device))
        _assert_same(key_cache, k0)
        _assert_same(value_cache, v0)


@pytest.mark.skipif(not CUDA_AVAILABLE, reason="no CUDA device on this machine")
@pytest.mark.parametrize("op", ["flash", "split"])
def test_write_in_cuda_graph(op):
    # fp8 writes read the scales on the device, so they can be captured and replayed.
    fn = _ops.reshape_and_cache if op == "split" else _ops.reshape_and_cache_flash
    ref_fn = ref.reshape_and_cache if op == "split" else ref.reshape_and_cache_flash
    key, value = _key_value("qkv", 83, 8, 128, torch.bfloat16, "cuda")
    key_cache, value_cache = _caches(op == "split", "qkv", 16, 16, 8, 128, torch.uint8, "cuda")
    slots = _slot_mapping(83, 16 * 16, "cuda")
    k_scale, v_scale = _scales("cuda")
    want = ref_fn(key, value, key_cache, value_cache, slots, "fp8", k_scale, v_scale)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):  # warm up off the default stream, as graph capture wants
        fn(key, value, key_cache.clone(), value_cache.clone(), slots, "fp8", k_scale, v_scale)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(key, value, key_cache, value_cache, slots, "fp8", k_scale, v_scale)
    graph.replay()
    torch.cuda.synchronize()
    _assert_same(key_cache, want[0])
    _assert_same(value_cache, want[1])


# ---- errors -------------------------------------------------------------------------------------
def _write_args(
    device: str, split: bool = False, dtype=torch.bfloat16, cache_dtype=None, head_size: int = 64
):
    key, value = _key_value("contiguous", 4, 2, head_size, dtype, device)
    key_cache, value_cache = _caches(
        split, "contiguous", 2, 16, 2, head_size, cache_dtype or dtype, device
    )
    slots = torch.arange(4, device=device)
    return [key, value, key_cache, value_cache, slots, "auto", *_scales(device)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", ["flash", "split"])
def test_write_rejects_bad_args(device, op):
    split = op == "split"
    fn = _ops.reshape_and_cache if split else _ops.reshape_and_cache_flash

    def raises(match: str, args: list) -> None:
        with pytest.raises(RuntimeError, match=match):
            fn(*args)

    args = _write_args(device, split)
    raises("kv_cache_dtype 'fp8_e5m2'", args[:5] + ["fp8_e5m2"] + args[6:])
    raises("value shape", [args[0], args[1][:, :1]] + args[2:])
    raises("slot_mapping must be int64", args[:4] + [args[4].int()] + args[5:])
    raises("slot_mapping must be", args[:4] + [args[4][:3]] + args[5:])
    raises("kv_cache_dtype=auto needs", _write_args(device, split, cache_dtype=torch.uint8))
    fp8_args = _write_args(device, split)
    fp8_args[5] = "fp8"
    raises("fp8_e4m3 cache must be uint8", fp8_args)
    bad_cache = args[2][:, :1] if split else args[2][..., :32]  # wrong num_kv_heads / head_size
    raises("key_cache must be", args[:2] + [bad_cache] + args[3:])
    if split:
        wrong_x = args[2].view(2, 2, 4, 16, 16)  # bf16 needs x = 8
        raises("x = 8", args[:2] + [wrong_x] + args[3:])
        fp8_40 = _write_args(device, True, cache_dtype=torch.float16, head_size=40)
        fp8_40[2] = torch.zeros(2, 2, 2, 16, 16, dtype=torch.uint8, device=device)
        fp8_40[3] = torch.zeros(2, 2, 40, 16, dtype=torch.uint8, device=device)
        fp8_40[5] = "fp8"
        raises("head_size 40 is not divisible by x", fp8_40)
    if device == "cpu":  # CUDA drops such slots instead: checking would need a device sync
        raises("past the cache", args[:4] + [args[4] + 30] + args[5:])


# ---- copy_blocks --------------------------------------------------------------------------------
def _layer_caches(num_layers: int, split: bool, num_blocks: int, dtype, device, view: bool):
    keys, values = [], []
    for _ in range(num_layers):
        k, v = _caches(split, "qkv" if view else "contiguous", num_blocks, 16, 3, 64, dtype, device)
        keys.append(k)
        values.append(v)
    return keys, values


def _block_pairs(num_pairs: int, num_blocks: int) -> torch.Tensor:
    ids = torch.randperm(num_blocks)[: 2 * num_pairs]
    return torch.stack([ids[:num_pairs], ids[num_pairs:]], dim=1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("split", [False, True], ids=["flash", "split"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
@pytest.mark.parametrize("view", [False, True], ids=["contiguous", "view"])
@pytest.mark.parametrize("mapping_on_cpu", [False, True])
def test_copy_blocks(device, split, dtype, view, mapping_on_cpu):
    keys, values = _layer_caches(3, split, 23, dtype, device, view)
    mapping = _block_pairs(7, 23)
    mapping = mapping if mapping_on_cpu else mapping.to(device)
    want_k, want_v = ref.copy_blocks(keys, values, mapping)
    _ops.copy_blocks(keys, values, mapping)
    for got, want in zip(keys + values, want_k + want_v):
        _assert_same(got, want)


@pytest.mark.parametrize("device", DEVICES)
def test_copy_blocks_many_layers(device):
    # More layers than one CUDA launch carries (128), odd block bytes (the 1-byte copy path).
    keys = [_random_cache((9, 5, 3), torch.uint8, device) for _ in range(130)]
    values = [_random_cache((9, 5, 3), torch.uint8, device) for _ in range(130)]
    mapping = _block_pairs(4, 9).to(device)
    want_k, want_v = ref.copy_blocks(keys, values, mapping)
    _ops.copy_blocks(keys, values, mapping)
    for got, want in zip(keys + values, want_k + want_v):
        _assert_same(got, want)


@pytest.mark.parametrize("device", DEVICES)
def test_copy_blocks_rejects_bad_args(device):
    keys, values = _layer_caches(2, False, 5, torch.float16, device, False)
    for bad in ([[0, 5]], [[-1, 2]], [[1, 7]]):
        with pytest.raises(RuntimeError, match="outside"):
            _ops.copy_blocks(keys, values, torch.tensor(bad, device=device))
    with pytest.raises(RuntimeError, match=r"\[num_pairs, 2\]"):
        _ops.copy_blocks(keys, values, torch.tensor([0, 1], device=device))
    with pytest.raises(RuntimeError, match="layer 1"):
        _ops.copy_blocks([keys[0], keys[1][:4]], values, torch.tensor([[0, 1]], device=device))
    with pytest.raises(RuntimeError, match="value caches"):
        _ops.copy_blocks(keys, values[:1], torch.tensor([[0, 1]], device=device))


# ---- swap_blocks --------------------------------------------------------------------------------
SWAP_DEVICES = [
    ("cpu", "cpu"),
    *[
        pytest.param(s, d, marks=pytest.mark.skipif(not CUDA_AVAILABLE, reason="no CUDA device"))
        for s, d in [("cpu", "cuda"), ("cuda", "cpu"), ("cuda", "cuda")]
    ],
]


def _host_or_device(shape: tuple, dtype, device: str, strided: bool) -> torch.Tensor:
    # strided: every other block of a larger allocation (a block stride of two blocks).
    full = _random_cache((shape[0], 2, *shape[1:]) if strided else shape, dtype, "cpu")
    if device == "cpu" and CUDA_AVAILABLE:
        full = full.pin_memory()  # so that the copies are truly asynchronous
    full = full.to(device)
    return full[:, 1] if strided else full


@pytest.mark.parametrize("src_device,dst_device", SWAP_DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.uint8])
@pytest.mark.parametrize("strided", [False, True])
def test_swap_blocks(src_device, dst_device, dtype, strided):
    block = (16, 3, 80)
    src = _host_or_device((10, *block), dtype, src_device, strided)
    dst = _host_or_device((13, *block), dtype, dst_device, False)
    # A run of consecutive blocks (one memcpy) plus scattered ones.
    mapping = torch.tensor([[0, 3], [1, 4], [2, 5], [7, 0], [5, 12], [9, 8]])
    want = ref.swap_blocks(src, dst, mapping)
    _ops.swap_blocks(src, dst, mapping)
    if CUDA_AVAILABLE:
        torch.cuda.synchronize()
    _assert_same(dst, want)


@pytest.mark.parametrize("src_device,dst_device", SWAP_DEVICES)
def test_swap_blocks_rejects_bad_args(src_device, dst_device):
    src = torch.zeros(4, 16, 2, 8, device=src_device)
    dst = torch.zeros(6, 16, 2, 8, device=dst_device)
    ok = torch.tensor([[0, 1]])
    for bad, match in [
        ([[4, 0]], "src block id 4"),
        ([[0, 6]], "dst block id 6"),
        ([[-1, 0]], "outside"),
    ]:
        with pytest.raises(RuntimeError, match=match):
            _ops.swap_blocks(src, dst, torch.tensor(bad))
    with pytest.raises(RuntimeError, match="block shape"):
        _ops.swap_blocks(src, dst[:, :8], ok)
    with pytest.raises(RuntimeError, match="dtype"):
        _ops.swap_blocks(src, dst.half(), ok)
    with pytest.raises(RuntimeError, match="int64"):
        _ops.swap_blocks(src, dst, ok.int())
    if "cuda" in (src_device, dst_device):
        with pytest.raises(RuntimeError, match="on the CPU"):
            _ops.swap_blocks(src, dst, ok.cuda())


# ---- opcheck ------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_opcheck_writes(device, kv_cache_dtype):
    cache_dtype = torch.bfloat16 if kv_cache_dtype == "auto" else torch.uint8
    for split, op in [
        (False, torch.ops.pyorch.reshape_and_cache_flash.default),
        (True, torch.ops.pyorch.reshape_and_cache.default),
    ]:
        key, value = _key_value("qkv", 7, 2, 64, torch.bfloat16, device)
        key_cache, value_cache = _caches(split, "contiguous", 4, 8, 2, 64, cache_dtype, device)
        slots = _slot_mapping(7, 32, device)
        torch.library.opcheck(
            op, (key, value, key_cache, value_cache, slots, kv_cache_dtype, *_scales(device))
        )


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_block_ops(device):
    keys, values = _layer_caches(2, False, 6, torch.float16, device, False)
    mapping = _block_pairs(2, 6).to(device)
    torch.library.opcheck(torch.ops.pyorch.copy_blocks.default, (keys, values, mapping))
    src = torch.randn(4, 16, 2, 8, device=device)
    dst = torch.randn(5, 16, 2, 8)
    torch.library.opcheck(
        torch.ops.pyorch.swap_blocks.default, (src, dst, torch.tensor([[0, 4], [3, 1]]))
    )
