"""The W4A16 ops (gptq_marlin_repack, awq_marlin_repack, gptq_marlin_gemm) on CPU and CUDA
against the float64 dequantized reference, on fresh random codes, zero points, scales and inputs.

The reference applies the op's contract (cuda/include/pyorch/w4a16.h): W = (q - z) * s rounded
once to a's dtype (the kernels hold the dequantized weight in that dtype), products summed in
float64, the output rounded once; except in the CUDA stream kernel (m <= 16, groups of whole
64-row k-blocks), which multiplies the exact q - z and scales each group's fp32 sum once, so W is
not rounded there (its outputs sit within half an ulp of the exact product, and up to a few
ulps from the rounded-W one). Outputs are O(1) (scales ~ 1/sqrt(K)), so the per-dtype tolerance
table applies as is.
"""

import pytest
import torch

from pyorch import _C, _ops
from pyorch.scalar_type import scalar_types
from tests.conftest import CUDA_AVAILABLE, DEVICES, tol
from tests.reference import w4a16 as ref

DTYPES = [torch.float16, torch.bfloat16]
GROUP_SIZES = [32, 64, 128, -1]
# (K, N): one k-block and one n-tile; a partial thread block of columns (N = 80, 272: not a
# multiple of 64); several k-blocks.
SHAPES = [(64, 16), (256, 80), (640, 272)]
ROWS = [1, 7, 16, 33, 64, 83, 150]  # CUDA: tiled 17..64, dequantize + GEMM above (small weights)
FORMATS = ["gptq", "gptq_act_order", "awq"]
STREAM_MAX_ROWS = 16  # kW4A16StreamMaxRows
BLOCK_K = 64  # kW4A16BlockK


class _Reference:
    """The op's expected output for an input a: a @ W in float64, rounded once to a's dtype, with
    W rounded to that dtype or exact as the kernel that runs a holds it (the module docstring)."""

    def __init__(self, q, dtype: torch.dtype, device: str, group_size: int, k: int):
        self.rounded = q.dequantize().to(dtype).double().to(device)
        self.exact = q.dequantize().double().to(device)
        group_rows = k if group_size == -1 else group_size
        self.stream_exact = device == "cuda" and group_rows % BLOCK_K == 0

    def __call__(self, a: torch.Tensor) -> torch.Tensor:
        exact = self.stream_exact and a.shape[0] <= STREAM_MAX_ROWS
        return (a.double() @ (self.exact if exact else self.rounded)).to(a.dtype)


def _layer(k: int, n: int, group_size: int, fmt: str, dtype: torch.dtype, device: str,
           seed: int = 0):
    """(op arguments, _Reference) for one random quantized layer, generated on the device (a CUDA
    generator for CUDA: Llama-sized layers)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    act_order = fmt == "gptq_act_order"
    q = ref.random_quantized(k, n, group_size, zero_points=fmt == "awq", act_order=act_order,
                             generator=gen, device=device)
    if fmt == "awq":
        t = ref.awq_tensors(q)
        b_q = _ops.awq_marlin_repack(t["qweight"].to(device), k, n, 4)
        zeros = ref.pack_cols(q.zeros).to(device)  # plain order, the op's zero layout
        perm = None
        qtype = scalar_types.uint4
    else:
        t = ref.gptq_tensors(q, act_order)
        perm = torch.argsort(t["g_idx"], stable=True).to(torch.int32) if act_order else None
        b_q = _ops.gptq_marlin_repack(
            t["qweight"].to(device), perm.to(device) if perm is not None else None, k, n, 4)
        perm = perm.to(device) if perm is not None else None
        zeros = None
        qtype = scalar_types.uint4b8
    scales = q.scales.to(dtype).to(device)
    q.scales = scales.double()  # the scales as the op gets them (a bf16 copy rounds fp16's)
    workspace = _ops.w4a16_make_workspace(n, torch.device(device))
    return (b_q, scales, zeros, perm, workspace, qtype), _Reference(q, dtype, device, group_size, k)


def _gemm(a: torch.Tensor, args, n: int, c: torch.Tensor | None = None) -> torch.Tensor:
    b_q, scales, zeros, perm, workspace, qtype = args
    return _ops.gptq_marlin_gemm(a, c, b_q, scales, zeros, perm, workspace, qtype,
                                 a.shape[0], n, a.shape[1])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("group_size", GROUP_SIZES)
@pytest.mark.parametrize("k,n", SHAPES)
def test_gemm_matches_dequantized_reference(device: str, dtype: torch.dtype, fmt: str,
                                            group_size: int, k: int, n: int):
    if group_size != -1 and k % group_size:
        pytest.skip("K is not a multiple of the group size (tested to raise below)")
    args, reference = _layer(k, n, group_size, fmt, dtype, device)
    for m in ROWS:
        a = torch.randn(m, k, dtype=dtype, device=device)
        out = _gemm(a, args, n)
        expected = reference(a)
        torch.testing.assert_close(out, expected, **tol(dtype), msg=f"M={m}")


@pytest.mark.parametrize("fmt", FORMATS)
def test_cpu_float32(fmt: str):
    """The CPU kernel also serves float32 models (scales in float32, no rounding of W)."""
    k, n = 256, 80
    args, _ = _layer(k, n, 64, fmt, torch.float32, "cpu")
    gen = torch.Generator().manual_seed(0)  # the same layer as _layer's
    q = ref.random_quantized(k, n, 64, zero_points=fmt == "awq",
                             act_order=fmt == "gptq_act_order", generator=gen)
    a = torch.randn(5, k)
    expected = (a.double() @ q.dequantize()).float()
    torch.testing.assert_close(_gemm(a, args, n), expected, **tol(torch.float32))


@pytest.mark.parametrize("device", DEVICES)
def test_strided_input_and_output_buffer(device: str):
    dtype = torch.bfloat16
    k, n = 256, 80
    args, reference = _layer(k, n, 128, "awq", dtype, device)
    base = torch.randn(9, k + 64, dtype=dtype, device=device)
    a = base[:, 32:32 + k]  # row stride k + 64, 16-byte aligned rows
    c = torch.full((9, n), float("nan"), dtype=dtype, device=device)
    out = _gemm(a, args, n, c)
    assert out.data_ptr() == c.data_ptr()
    torch.testing.assert_close(c, reference(a), **tol(dtype))


def test_layout_is_the_documented_one():
    """Decodes repacked codes with the formula of cuda/include/pyorch/w4a16.h."""
    k, n = 128, 32
    codes = torch.randint(0, 16, (k, n))
    tiles = _ops.gptq_marlin_repack(ref.pack_rows(codes), None, k, n, 4)
    assert tiles.shape == (n // 16, k * 2)
    words = tiles.flatten().to(torch.int64) & 0xFFFFFFFF
    decoded = torch.full((k, n), -1, dtype=torch.int64)
    kblocks = k // 64
    for word in range(words.numel()):
        kt, lane, block = word % 4, (word // 4) % 32, word // 128
        kb, nt = block % kblocks, block // kblocks
        g, t = lane // 4, lane % 4
        for p in range(8):
            r, h = p % 4, p // 4
            row = kb * 64 + 16 * t + 4 * kt + h + 2 * (r // 2)
            col = nt * 16 + g + 8 * (r % 2)
            decoded[row, col] = (words[word] >> (4 * p)) & 0xF
    assert torch.equal(decoded, codes)


def test_awq_repack_equals_gptq_repack_of_the_same_codes():
    k, n = 192, 48
    codes = torch.randint(0, 16, (k, n))
    gptq = _ops.gptq_marlin_repack(ref.pack_rows(codes), None, k, n, 4)
    awq = _ops.awq_marlin_repack(ref.pack_cols(codes, ref.AWQ_ORDER), k, n, 4)
    assert torch.equal(gptq, awq)


@pytest.mark.parametrize("device", DEVICES)
def test_bad_arguments_raise(device: str):
    dtype = torch.float16
    k, n = 256, 80
    args, _ = _layer(k, n, 64, "gptq", dtype, device)
    b_q, scales, zeros, perm, workspace, qtype = args
    a = torch.randn(3, k, dtype=dtype, device=device)

    def gemm(**kw):  # type: ignore[no-untyped-def]
        call = dict(a=a, c=None, b_q_weight=b_q, b_scales=scales, b_zeros=None, perm=None,
                    workspace=workspace, b_q_type=qtype, size_m=3, size_n=n, size_k=k)
        call.update(kw)
        return _ops.gptq_marlin_gemm(**call)

    with pytest.raises(RuntimeError, match="scale groups"):  # K not a multiple of the groups
        gemm(b_scales=torch.ones(3, n, dtype=dtype, device=device))
    with pytest.raises(RuntimeError, match="multiple of 16"):  # group size 8
        gemm(b_scales=torch.ones(32, n, dtype=dtype, device=device))
    with pytest.raises(RuntimeError, match="8-bit"):
        gemm(b_q_type=scalar_types.uint8b128)
    with pytest.raises(RuntimeError, match="need b_zeros"):
        gemm(b_q_type=scalar_types.uint4)
    with pytest.raises(RuntimeError, match="take no b_zeros"):
        gemm(b_zeros=torch.zeros(4, n // 8, dtype=torch.int32, device=device))
    with pytest.raises(RuntimeError, match="dtype"):
        gemm(b_scales=scales.to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="workspace"):
        gemm(workspace=torch.zeros(1, dtype=torch.int32, device=device))
    with pytest.raises(RuntimeError, match="perm"):
        gemm(perm=torch.arange(k - 1, dtype=torch.int32, device=device))
    with pytest.raises(RuntimeError, match="a must be"):
        gemm(size_k=k + 64)
    with pytest.raises(RuntimeError, match="multiple of 64"):
        _ops.gptq_marlin_repack(torch.zeros(12, n, dtype=torch.int32, device=device), None,
                                96, n, 4)
    with pytest.raises(RuntimeError, match="num_bits=4"):
        _ops.gptq_marlin_repack(torch.zeros(k // 4, n, dtype=torch.int32, device=device), None,
                                k, n, 8)
    with pytest.raises(RuntimeError, match=r"\[size_k, size_n / 8\]"):
        _ops.awq_marlin_repack(torch.zeros(k // 8, n, dtype=torch.int32, device=device), k, n, 4)


def test_opcheck():
    args, _ = _layer(128, 32, 64, "awq", torch.bfloat16, "cpu")
    b_q, scales, zeros, perm, workspace, qtype = args
    a = torch.randn(2, 128, dtype=torch.bfloat16)
    torch.library.opcheck(torch.ops.pyorch.gptq_marlin_gemm,
                          (a, None, b_q, scales, zeros, perm, workspace, qtype.id, 2, 32, 128))
    torch.library.opcheck(torch.ops.pyorch.awq_marlin_repack,
                          (ref.pack_cols(torch.randint(0, 16, (128, 32))), 128, 32, 4))


# ---- CUDA only ----------------------------------------------------------------------------------
cuda_only = pytest.mark.skipif(not CUDA_AVAILABLE, reason="no CUDA device on this machine")
# Llama-3-8B (qkv, o, gate_up, down) and 70B (qkv, down) projections, as [K, N].
LLAMA_SHAPES = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096), (28672, 8192)]


@cuda_only
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("k,n", LLAMA_SHAPES)
def test_llama_shapes_cuda(fmt: str, k: int, n: int):
    dtype = torch.bfloat16
    args, reference = _layer(k, n, 128, fmt, dtype, "cuda")
    # The decode kernels' k-split and m-tile counts, the tiled kernel's 64- and 128-row blocks
    # (with and without its k-split; 65..128 rows only on the large weights), and the cuBLAS path.
    assert _C.w4a16_mma_max_rows() == 0  # auto
    for m in [1, 4, 8, 9, 16, 17, 33, 64, 65, 128, 129, 300]:
        mma = _C.w4a16_mma_path(m, n, k)
        assert mma == (m <= 64 or (m <= 128 and n * k >= 72 << 20)), m
        a = torch.randn(m, k, dtype=dtype, device="cuda")
        out = _gemm(a, args, n)
        expected = reference(a)
        torch.testing.assert_close(out, expected, **tol(dtype), msg=f"M={m}")
        if mma:  # the k-splits reduce in a fixed order: same bits
            assert torch.equal(out, _gemm(a, args, n))
    assert int(args[4].abs().sum()) == 0  # the workspace's counters are back to zero


@pytest.fixture
def tiled_everywhere():
    """gptq_marlin_gemm with the tiled kernel at every row count and no cuBLAS path."""
    tiled_min, mma_max = _C.w4a16_tiled_min_rows(), _C.w4a16_mma_max_rows()
    _C.set_w4a16_tiled_min_rows(1)
    _C.set_w4a16_mma_max_rows(1 << 30)
    try:
        yield
    finally:
        _C.set_w4a16_tiled_min_rows(tiled_min)
        _C.set_w4a16_mma_max_rows(mma_max)


@cuda_only
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("group_size", GROUP_SIZES)
@pytest.mark.parametrize("k,n", SHAPES + [(1024, 4096 + 48)])
def test_tiled_kernel_every_row_count_cuda(tiled_everywhere, dtype: torch.dtype, fmt: str,
                                           group_size: int, k: int, n: int):
    # The tiled kernel (cuda/w4a16/w4a16_tiled.cuh) holds W rounded to the dtype at every m:
    # partial row blocks, warps with no rows, a last column block of 3 n-tiles (N = 4144), a
    # k-split of a 1024-deep K (16 k-blocks) and of 1-block ones; through the adapter, which
    # runs gptq_marlin_gemm at every m once w4a16_mma_max_rows is set.
    if group_size != -1 and k % group_size:
        pytest.skip("K is not a multiple of the group size")
    args, reference = _layer(k, n, group_size, fmt, dtype, "cuda", seed=5)
    for m in [1, 5, 8, 16, 17, 31, 64, 65, 100, 128, 200]:
        assert _C.w4a16_kernel_name(m) == "tiled" and _C.w4a16_mma_path(m, n, k)
        a = torch.randn(m, k, dtype=dtype, device="cuda")
        out = _gemm(a, args, n)
        expected = (a.double() @ reference.rounded).to(dtype)
        torch.testing.assert_close(out, expected, **tol(dtype), msg=f"M={m}")
        assert torch.equal(out, _gemm(a, args, n))
    assert int(args[4].abs().sum()) == 0


@cuda_only
def test_kernel_by_row_count_cuda():
    assert _C.w4a16_kernel_name(16) == "stream"
    assert _C.w4a16_kernel_name(17) == "tiled"
    tiled_min = _C.w4a16_tiled_min_rows()
    try:
        _C.set_w4a16_tiled_min_rows(1000)  # clamped to 65: the registers kernel ends at 64
        assert _C.w4a16_tiled_min_rows() == 65
        assert _C.w4a16_kernel_name(64) == "registers"
        assert _C.w4a16_kernel_name(65) == "tiled"
        k, n = 256, 80
        args, reference = _layer(k, n, 64, "awq", torch.float16, "cuda")
        a = torch.randn(40, k, dtype=torch.float16, device="cuda")
        torch.testing.assert_close(_gemm(a, args, n), reference(a), **tol(torch.float16))
    finally:
        _C.set_w4a16_tiled_min_rows(tiled_min)


@cuda_only
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("group_size,dtype", [(32, torch.bfloat16), (64, torch.float16),
                                              (-1, torch.bfloat16)])
def test_stream_kernel_long_k_range_cuda(fmt: str, group_size: int, dtype: torch.dtype):
    # m <= 16 runs the stream kernel (cuda/w4a16/w4a16_stream.cuh). 2200 n-tiles are enough
    # column groups for no k-split on a 132-SM GPU, so each warp streams all 35 k-blocks: group
    # 32 (the per-weight form) in nine 4-block chunks (the last is 3 blocks), group 64 and
    # per-channel (K = 2240, not a power of two: the counted group ends) in 8-block chunks (the
    # last is 3 blocks), the rings wrapping.
    k, n = 2240, 16 * 2200
    args, reference = _layer(k, n, group_size, fmt, dtype, "cuda", seed=3)
    for m in [1, 5, 8, 9, 16]:
        a = torch.randn(m, k, dtype=dtype, device="cuda")
        out = _gemm(a, args, n)
        expected = reference(a)
        torch.testing.assert_close(out, expected, **tol(dtype), msg=f"M={m}")


@pytest.fixture
def stream_settings():
    """Restores the stream kernel's ring depth, chunk and scale path after a test."""
    stages, chunk = _C.w4a16_stream_stages(), _C.w4a16_stream_chunk()
    by_copy = _C.w4a16_stream_scales_by_copy()
    try:
        yield
    finally:
        _C.set_w4a16_stream_stages(stages)
        _C.set_w4a16_stream_chunk(chunk)
        _C.set_w4a16_stream_scales_by_copy(by_copy)


@cuda_only
@pytest.mark.parametrize("by_copy", [False, True])
@pytest.mark.parametrize("chunk", [4, 8])
@pytest.mark.parametrize("stages", [1, 2, 3, 8])
@pytest.mark.parametrize("fmt", ["gptq", "awq"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group_size", [64, 128, 256, -1])
def test_stream_grouped_kernel_splits_cuda(stream_settings, by_copy: bool, chunk: int,
                                           stages: int, fmt: str, dtype: torch.dtype,
                                           group_size: int):
    # The grouped stream kernel (groups of whole k-blocks) over a k-split of 2-block ranges
    # (K = 1280 is 20 k-blocks; 2 column groups ask for many splits): group 256 starts ranges in
    # the middle of its groups, 128 takes the fixed group ends, 64 and per-channel the counted
    # ones. Ring depths 1..8 (3 runs as 2), chunks of 4 and 8 k-blocks; group 128's scales by
    # global loads or by the slots' bulk copies (AWQ's zero-point rows of N / 2 = 40 bytes take
    # the loads either way).
    k, n = 1280, 80
    _C.set_w4a16_stream_scales_by_copy(by_copy)
    _C.set_w4a16_stream_stages(stages)
    _C.set_w4a16_stream_chunk(chunk)
    args, reference = _layer(k, n, group_size, fmt, dtype, "cuda", seed=7)
    for m in [1, 3, 8, 9, 16]:
        splits = _C.w4a16_num_splits(m, n, k)
        assert splits > 1 and (k // BLOCK_K) // splits >= 2, splits
        a = torch.randn(m, k, dtype=dtype, device="cuda")
        out = _gemm(a, args, n)
        torch.testing.assert_close(out, reference(a), **tol(dtype), msg=f"M={m}")
        assert torch.equal(out, _gemm(a, args, n))
    assert int(args[4].abs().sum()) == 0


@cuda_only
@pytest.mark.parametrize("by_copy", [False, True])
@pytest.mark.parametrize("chunk,stages", [(8, 1), (8, 2), (4, 2)])
@pytest.mark.parametrize("fmt", ["gptq", "awq"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_stream_grouped_kernel_long_range_cuda(stream_settings, by_copy: bool, chunk: int,
                                               stages: int, fmt: str, dtype: torch.dtype):
    # Group 128 with no k-split: each warp streams 36 k-blocks (four 8-block chunks and a 4-block
    # one, or nine of 4) through a 1- or 2-slot ring that wraps, the group ends at fixed blocks.
    k, n = 2304, 16 * 2200
    _C.set_w4a16_stream_scales_by_copy(by_copy)
    _C.set_w4a16_stream_chunk(chunk)
    _C.set_w4a16_stream_stages(stages)
    args, reference = _layer(k, n, 128, fmt, dtype, "cuda", seed=11)
    for m in [1, 8, 16]:
        assert _C.w4a16_num_splits(m, n, k) == 1
        a = torch.randn(m, k, dtype=dtype, device="cuda")
        torch.testing.assert_close(_gemm(a, args, n), reference(a), **tol(dtype), msg=f"M={m}")


@cuda_only
def test_stream_kernel_keeps_its_blocks_resident_cuda():
    # The stream kernel's k-split never asks for more thread blocks than stay resident at once
    # (a partial last wave streams with few warps per SM): at most 8 per SM (128 threads of at
    # least 64 registers each), unless one split of the column groups is already more.
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    shapes = LLAMA_SHAPES + [(8192, 10240), (8192, 57344)]  # with the 70B qkv and gate_up
    for k, n in shapes:
        groups = (n + 63) // 64
        for m in range(1, STREAM_MAX_ROWS + 1):
            splits = _C.w4a16_num_splits(m, n, k)
            assert groups * splits <= max(groups, 8 * sms), (k, n, m, splits)
        assert _C.w4a16_num_splits(16, n, k) <= _C.w4a16_num_splits(8, n, k), (k, n)


@cuda_only
@pytest.mark.parametrize("fmt", ["gptq", "awq"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group_size", [64, 128])
def test_stream_kernel_lean_rows_form_cuda(fmt: str, dtype: torch.dtype, group_size: int):
    # 9..16 rows over more column groups than the look-ahead form keeps resident take the form
    # that loads each k-block's activations just before use; fewer columns, or at most 8 rows,
    # keep the look-ahead.
    k = 256
    n = next((n for n in [16 * 2700, 16 * 4200, 16 * 8400]
              if not _C.w4a16_stream_acts_ahead(12, n, k)), None)
    if n is None:
        pytest.skip("this GPU keeps every column group of these shapes resident")
    assert _C.w4a16_stream_acts_ahead(8, n, k) and _C.w4a16_stream_acts_ahead(12, 4096, k)
    args, reference = _layer(k, n, group_size, fmt, dtype, "cuda", seed=13)
    for m in [9, 12, 16]:
        assert not _C.w4a16_stream_acts_ahead(m, n, k)
        a = torch.randn(m, k, dtype=dtype, device="cuda")
        out = _gemm(a, args, n)
        torch.testing.assert_close(out, reference(a), **tol(dtype), msg=f"M={m}")
        assert torch.equal(out, _gemm(a, args, n))
    assert int(args[4].abs().sum()) == 0


@cuda_only
@pytest.mark.parametrize("by_copy", [False, True])
@pytest.mark.parametrize("n", [80, 4096])
@pytest.mark.parametrize("fmt", ["gptq", "awq"])
@pytest.mark.parametrize("offset", [0, 1])
def test_stream_grouped_kernel_misaligned_scales_cuda(stream_settings, offset: int, fmt: str,
                                                      n: int, by_copy: bool):
    # Group 128, scales by global loads or (by_copy) by the slots' bulk copies, which need their
    # rows 16-byte aligned (N = 4096): scales and zero points one element into a larger buffer, or
    # AWQ zero-point rows of N / 2 = 40 bytes (N = 80), take the loads instead. Same results.
    _C.set_w4a16_stream_scales_by_copy(by_copy)
    k, dtype = 2048, torch.bfloat16
    (b_q, scales, zeros, perm, ws, qtype), reference = _layer(k, n, 128, fmt, dtype, "cuda", seed=5)
    if offset:
        big = torch.empty(scales.numel() + offset, dtype=dtype, device="cuda")
        scales = big[offset:].view_as(scales).copy_(scales)
        if zeros is not None:
            zbig = torch.empty(zeros.numel() + offset, dtype=zeros.dtype, device="cuda")
            zeros = zbig[offset:].view_as(zeros).copy_(zeros)
    args = (b_q, scales, zeros, perm, ws, qtype)
    for m in [1, 5, 12, 16]:
        a = torch.randn(m, k, dtype=dtype, device="cuda")
        torch.testing.assert_close(_gemm(a, args, n), reference(a), **tol(dtype), msg=f"M={m}")


@cuda_only
@pytest.mark.parametrize("fmt", FORMATS)
def test_cuda_repack_matches_cpu(fmt: str):
    k, n = 1024, 336
    q = ref.random_quantized(k, n, 128, zero_points=fmt == "awq", act_order=fmt != "gptq")
    if fmt == "awq":
        qweight = ref.awq_tensors(q)["qweight"]
        cpu = _ops.awq_marlin_repack(qweight, k, n, 4)
        cuda = _ops.awq_marlin_repack(qweight.cuda(), k, n, 4)
    else:
        qweight = ref.gptq_tensors(q, act_order=True)["qweight"]
        perm = torch.argsort(q.g_idx, stable=True).to(torch.int32) if fmt != "gptq" else None
        cpu = _ops.gptq_marlin_repack(qweight, perm, k, n, 4)
        cuda = _ops.gptq_marlin_repack(qweight.cuda(), perm.cuda() if perm is not None else None,
                                       k, n, 4)
    assert torch.equal(cpu, cuda.cpu())


@cuda_only
def test_cuda_graph_capture():
    from tests.conftest import capture_graph

    dtype, k, n = torch.bfloat16, 4096, 4096
    args, reference = _layer(k, n, 128, "gptq_act_order", dtype, "cuda")
    a = torch.randn(4, k, dtype=dtype, device="cuda")
    c = torch.empty(4, n, dtype=dtype, device="cuda")
    graph = capture_graph(lambda: _gemm(a, args, n, c))
    a.copy_(torch.randn_like(a))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(c, reference(a), **tol(dtype))
