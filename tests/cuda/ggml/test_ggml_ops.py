"""ggml_dequantize, ggml_mul_mat_vec_a8 and ggml_mul_mat_a8 against the gguf package.

The weights are real GGUF blocks: written by ``gguf.quants.quantize`` from fresh random data for
the types it can quantize (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0), and random bytes with finite, modest
fp16 scales for the K-quants (gguf 0.19 has no K-quant quantizer). The reference is always
``gguf.quants.dequantize``. The products quantize the activation to 8 bits per 32 values, so they
are compared (1) with a reference that quantizes it the same way (tests/reference/gguf.py) and
(2) with the float64 product of the unquantized activation, within the bound that the
activation's rounding allows. On the CPU every instruction set the machine has is tested.
"""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize

from pyorch import _C, _ops
from tests.conftest import DEVICES
from tests.reference import gguf as ref

QUANT_TYPES = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K]
FLOAT_TYPES = [Q.F32, Q.F16, Q.BF16]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Rounding of the output dtype, relative.
OUT_EPS = {torch.float32: 2e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}
CPU_ISAS = [isa for isa in ("portable", "avx2", "avx512_vnni")]


def _available_isas() -> list[str]:
    best = _C.gguf_cpu_isa("best")
    return CPU_ISAS[: CPU_ISAS.index(best) + 1]


@pytest.fixture(params=CPU_ISAS)
def cpu_isa(request: pytest.FixtureRequest):
    if request.param not in _available_isas():
        pytest.skip(f"this CPU has no {request.param}")
    _C.gguf_cpu_isa(request.param)
    yield request.param
    _C.gguf_cpu_isa("best")


def _cols(qtype: Q, blocks: int) -> int:
    return ref.block_size(qtype) * blocks


@pytest.mark.parametrize("qtype", QUANT_TYPES + FLOAT_TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("rows,blocks", [(1, 1), (7, 3), (83, 2)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_ggml_dequantize(qtype: Q, rows: int, blocks: int, dtype: torch.dtype, device: str) -> None:
    rng = np.random.default_rng(int(qtype) * 1000 + rows)
    cols = _cols(qtype, blocks)
    raw = ref.make_weight(qtype, rows, cols, rng)
    expected = torch.from_numpy(gguf_dequantize(raw, qtype).astype(np.float32)).reshape(rows, cols)
    assert expected.abs().max() > 0
    out = _ops.ggml_dequantize(torch.from_numpy(raw).to(device), int(qtype), rows, cols, dtype)
    assert out.shape == (rows, cols) and out.dtype == dtype
    scale = float(expected.abs().max())
    # gguf computes scale * q, then + bias, in fp32: we match it but for a fused multiply-add.
    torch.testing.assert_close(
        out.cpu(), expected.to(dtype), rtol=OUT_EPS[dtype] / 2, atol=2e-7 * scale
    )


def test_ggml_dequantize_default_dtype_is_float16() -> None:
    raw = ref.make_weight(Q.Q8_0, 2, 32, np.random.default_rng(0))
    assert _ops.ggml_dequantize(torch.from_numpy(raw), int(Q.Q8_0), 2, 32).dtype == torch.float16


def _check_product(out: torch.Tensor, x: torch.Tensor, raw: np.ndarray, qtype: Q) -> None:
    rows, cols = raw.shape[0], x.shape[1]
    w = torch.from_numpy(gguf_dequantize(raw, qtype).astype(np.float64)).reshape(rows, cols)
    xq = ref.quantize_activation(x)  # float64, the kernel's 8-bit activation
    out64 = out.cpu().double()
    # (1) the same arithmetic as the kernel, exact but for fp32 accumulation and output rounding
    expected = xq @ w.T
    accum = xq.abs() @ w.abs().T  # what fp32 accumulation errors scale with
    err = (out64 - expected).abs()
    bound = 1e-5 * accum + OUT_EPS[out.dtype] * expected.abs() + 1e-30
    assert (err <= bound).all(), f"max excess {(err - bound).max().item()}"
    # (2) the float64 product of the unquantized activation, within the activation's rounding:
    # |x - xq| <= max|x| / 254 per 32 values.
    x64 = x.cpu().double()
    step = x64.reshape(x.shape[0], -1, 32).abs().amax(-1, keepdim=True) / 254
    step = step.expand(-1, -1, 32).reshape(x.shape)
    exact = x64 @ w.T
    bound2 = step @ w.abs().T + bound
    assert ((out64 - exact).abs() <= bound2).all()
    assert (out64 - exact).abs().max() > 0 or exact.abs().max() == 0  # really went through 8 bits


@pytest.mark.parametrize("op", ["ggml_mul_mat_vec_a8", "ggml_mul_mat_a8"])
@pytest.mark.parametrize("qtype", QUANT_TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("num_tokens", [1, 2, 3, 9, 17])
@pytest.mark.parametrize("rows,blocks", [(1, 1), (4, 2), (83, 3)])
def test_ggml_mul_mat_cpu(
    cpu_isa: str, op: str, qtype: Q, num_tokens: int, rows: int, blocks: int
) -> None:
    # 9 and 17 tokens: past one tile of 8 tokens (the kernel's), with a partial last tile.
    # 1 and 2 tokens of a 32-element type: the SIMD kernels' groups of 4 rows (4 rows: exactly
    # one group; 83: groups plus a tail of single rows in each thread's range).
    rng = np.random.default_rng(int(qtype) * 7919 + rows + num_tokens)
    cols = _cols(qtype, blocks)
    raw = ref.make_weight(qtype, rows, cols, rng)
    for dtype in DTYPES:
        x = torch.randn(num_tokens, cols).to(dtype)
        out = getattr(_ops, op)(torch.from_numpy(raw), x, int(qtype), rows)
        assert out.shape == (num_tokens, rows) and out.dtype == dtype
        _check_product(out, x, raw, qtype)


@pytest.mark.parametrize("op", ["ggml_mul_mat_vec_a8", "ggml_mul_mat_a8"])
@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q8_0, Q.Q4_K, Q.Q6_K], ids=lambda q: q.name)
@pytest.mark.parametrize("device", DEVICES)
def test_ggml_mul_mat_strided_rows_and_outliers(op: str, qtype: Q, device: str) -> None:
    # X rows with a stride (a slice of a wider buffer) and one huge value per 32-block: the
    # per-32 scales keep the other blocks exact.
    rng = np.random.default_rng(int(qtype))
    rows, cols = 67, _cols(qtype, 2)
    raw = ref.make_weight(qtype, rows, cols, rng)
    wide = torch.randn(5, cols + 64)
    wide[:, ::97] *= 300
    x = wide[:, :cols].to(device)
    out = getattr(_ops, op)(torch.from_numpy(raw).to(device), x, int(qtype), rows)
    _check_product(out, x, raw, qtype)


@pytest.mark.parametrize("device", DEVICES)
def test_ggml_mul_mat_zero_activation_and_empty(device: str) -> None:
    raw = torch.from_numpy(ref.make_weight(Q.Q4_0, 9, 64, np.random.default_rng(1))).to(device)
    out = _ops.ggml_mul_mat_vec_a8(raw, torch.zeros(2, 64, device=device), int(Q.Q4_0), 9)
    assert torch.equal(out.cpu(), torch.zeros(2, 9))
    empty = _ops.ggml_mul_mat_a8(raw, torch.zeros(0, 64, device=device), int(Q.Q4_0), 9)
    assert empty.shape == (0, 9)


@pytest.mark.parametrize("device", DEVICES)
def test_ggml_ops_refuse_bad_input(device: str) -> None:
    raw = torch.from_numpy(ref.make_weight(Q.Q4_0, 4, 64, np.random.default_rng(2))).to(device)
    x = torch.randn(1, 64, device=device)
    with pytest.raises(RuntimeError, match="GGML type 16 is not supported"):  # IQ2_XXS
        _ops.ggml_mul_mat_vec_a8(raw, x, int(Q.IQ2_XXS), 4)
    with pytest.raises(RuntimeError, match="GGML type 16 is not supported"):
        _ops.ggml_dequantize(raw, int(Q.IQ2_XXS), 4, 64)
    with pytest.raises(RuntimeError, match="F16 has no product kernel"):
        _ops.ggml_mul_mat_a8(raw, x, int(Q.F16), 4)
    with pytest.raises(RuntimeError, match="W has 144 bytes, but 5 rows of 64 Q4_0 columns"):
        _ops.ggml_mul_mat_a8(raw, x, int(Q.Q4_0), 5)
    with pytest.raises(RuntimeError, match="not a whole number of Q4_0 blocks"):
        _ops.ggml_mul_mat_a8(raw, torch.randn(1, 48, device=device), int(Q.Q4_0), 4)
    with pytest.raises(RuntimeError, match="X must be float32, float16 or bfloat16"):
        _ops.ggml_mul_mat_a8(raw, x.to(torch.int32), int(Q.Q4_0), 4)
    with pytest.raises(RuntimeError, match="dtype must be float32, float16 or bfloat16"):
        _ops.ggml_dequantize(raw, int(Q.Q4_0), 4, 64, torch.int8)


def test_gguf_cpu_isa_refuses_unknown_names() -> None:
    with pytest.raises(RuntimeError, match="unknown sse9"):
        _C.gguf_cpu_isa("sse9")
    assert _C.gguf_cpu_isa() in CPU_ISAS


# ---- the CPU's repacked layout (ggml_mul_mat_repacked_a8) ---------------------------------------
REPACK_TYPES = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K]


@pytest.mark.parametrize("qtype", REPACK_TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("num_tokens", [1, 3, 4, 5, 9, 17])
@pytest.mark.parametrize("rows,blocks", [(8, 1), (24, 3), (136, 2)])
def test_ggml_mul_mat_repacked_cpu(
    cpu_isa: str, qtype: Q, num_tokens: int, rows: int, blocks: int
) -> None:
    # 4 tokens: one tile of the kernel's; 5, 9, 17: partial last tiles. 136 rows: 17 groups of
    # 8, past one chunk of 16 groups, split over the threads. Q4_K: random blocks with modest
    # scales (tests/reference/gguf.make_weight), its 6-bit scales and mins unpacked at repack.
    from pyorch.layers.quantization.gguf import repack_blocks

    rng = np.random.default_rng(int(qtype) * 131 + rows + num_tokens)
    cols = _cols(qtype, blocks)
    raw = ref.make_weight(qtype, rows, cols, rng)
    packed = repack_blocks(torch.from_numpy(raw), int(qtype), rows, cols)
    for dtype in DTYPES:
        x = torch.randn(num_tokens, cols).to(dtype)
        out = _ops.ggml_mul_mat_repacked_a8(packed, x, int(qtype), rows)
        assert out.shape == (num_tokens, rows) and out.dtype == dtype
        _check_product(out, x, raw, qtype)
        # the same 8-bit activation and integer sums as the file-layout kernel: equal but for
        # the order of the fp32 accumulation
        same = _ops.ggml_mul_mat_a8(torch.from_numpy(raw), x, int(qtype), rows)
        w = torch.from_numpy(gguf_dequantize(raw, qtype).astype(np.float64)).reshape(rows, cols)
        accum = x.double().abs() @ w.abs().T
        bound = 1e-5 * accum + OUT_EPS[dtype] * same.double().abs()
        assert ((out.double() - same.double()).abs() <= bound).all()


@pytest.mark.parametrize("qtype", REPACK_TYPES, ids=lambda q: q.name)
def test_ggml_mul_mat_repacked_strided_rows_and_outliers(cpu_isa: str, qtype: Q) -> None:
    from pyorch.layers.quantization.gguf import repack_blocks

    rows, cols = 40, _cols(qtype, 4)
    raw = ref.make_weight(qtype, rows, cols, np.random.default_rng(int(qtype) + 5))
    wide = torch.randn(6, cols + 64)
    wide[:, ::97] *= 300
    x = wide[:, :cols]
    packed = repack_blocks(torch.from_numpy(raw), int(qtype), rows, cols)
    _check_product(_ops.ggml_mul_mat_repacked_a8(packed, x, int(qtype), rows), x, raw, qtype)


def test_ggml_mul_mat_repacked_refuses_bad_input() -> None:
    raw = torch.from_numpy(ref.make_weight(Q.Q4_1, 16, 64, np.random.default_rng(3)))
    x = torch.randn(2, 64)
    # every quantized type with a product kernel has a repacked layout; float types have neither
    with pytest.raises(RuntimeError, match="F16 has no product kernel"):
        _ops.ggml_mul_mat_repacked_a8(torch.zeros(16, 512, dtype=torch.uint8),
                                      torch.randn(2, 256), int(Q.F16), 16)
    with pytest.raises(RuntimeError, match="GGML type 16 is not supported"):
        _ops.ggml_mul_mat_repacked_a8(torch.zeros(16, 512, dtype=torch.uint8),
                                      torch.randn(2, 256), 16, 16)
    with pytest.raises(RuntimeError, match="row 12 is not a multiple of 8"):
        _ops.ggml_mul_mat_repacked_a8(raw[:12].contiguous(), x, int(Q.Q4_1), 12)
    with pytest.raises(RuntimeError, match="W has 640 bytes, but 8 rows"):
        _ops.ggml_mul_mat_repacked_a8(raw, x, int(Q.Q4_1), 8)
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="is a CPU op"):
            _ops.ggml_mul_mat_repacked_a8(raw.cuda(), x.cuda(), int(Q.Q4_1), 16)


def _rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return normed * weight


@pytest.mark.parametrize("qtype", REPACK_TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("epilogue", ["store", "add", "silu_and_mul"])
@pytest.mark.parametrize("num_tokens", [1, 6])
@pytest.mark.parametrize("with_norm,with_bias", [(True, False), (False, True), (True, True)])
def test_ggml_mul_mat_repacked_fused(
    cpu_isa: str, qtype: Q, epilogue: str, num_tokens: int, with_norm: bool, with_bias: bool
) -> None:
    # Against the unfused ops: RMSNorm, the repacked product (+ bias), then the epilogue, each
    # in the model's dtype.
    from pyorch.layers.quantization.gguf import repack_blocks

    if epilogue == "add" and with_norm:
        pytest.skip("the add epilogue takes no norm")
    rows, cols, eps = 48, _cols(qtype, 3), 1e-5
    rng = np.random.default_rng(int(qtype) * 17 + num_tokens)
    raw = ref.make_weight(qtype, rows, cols, rng)
    packed = repack_blocks(torch.from_numpy(raw), int(qtype), rows, cols)
    w = torch.from_numpy(gguf_dequantize(raw, qtype).astype(np.float64)).reshape(rows, cols)
    for dtype in (torch.float32, torch.bfloat16):
        x = (3 * torch.randn(num_tokens, cols)).to(dtype)
        norm_w = (1 + 0.3 * torch.randn(cols)).to(dtype) if with_norm else None
        bias = torch.randn(rows).to(dtype) if with_bias else None
        x_in = _rms_norm_ref(x, norm_w, eps) if with_norm else x
        y = _ops.ggml_mul_mat_repacked_a8(packed, x_in, int(qtype), rows)
        if bias is not None:
            y = y + bias
        residual = torch.randn(num_tokens, rows).to(dtype)
        if epilogue == "store":
            expected, out = y, torch.empty(num_tokens, rows, dtype=dtype)
        elif epilogue == "add":
            expected, out = residual + y, residual.clone()
        else:
            expected = (torch.nn.functional.silu(y[:, :rows // 2].float())
                        * y[:, rows // 2:].float()).to(dtype)
            out = torch.empty(num_tokens, rows // 2, dtype=dtype)
        _ops.ggml_mul_mat_repacked_fused(out, x, packed, int(qtype), rows, bias, norm_w, eps,
                                         epilogue)
        # fp32 accumulation order and one output rounding apart (8-bit activations of the same
        # normed input)
        scale = (x_in.double().abs() @ w.abs().T).max().item() + (
            0 if bias is None else bias.double().abs().max().item())
        tol = (2e-5 if dtype == torch.float32 else 2e-2) * scale
        if epilogue == "silu_and_mul":  # silu(g) * u: an error in g or u times the other
            tol *= 1 + scale
        torch.testing.assert_close(out.double(), expected.double(), rtol=0, atol=tol)


def test_ggml_mul_mat_repacked_fused_refuses_bad_input() -> None:
    from pyorch.layers.quantization.gguf import repack_blocks

    raw = torch.from_numpy(ref.make_weight(Q.Q8_0, 24, 64, np.random.default_rng(6)))
    packed = repack_blocks(raw, int(Q.Q8_0), 24, 64)
    x = torch.randn(2, 64)
    op = _ops.ggml_mul_mat_repacked_fused
    with pytest.raises(RuntimeError, match="epilogue must be store, add or silu_and_mul"):
        op(torch.empty(2, 24), x, packed, int(Q.Q8_0), 24, None, None, 0.0, "gelu")
    with pytest.raises(RuntimeError, match="silu_and_mul needs"):
        op(torch.empty(2, 12), x, packed, int(Q.Q8_0), 24, None, None, 0.0, "silu_and_mul")
    with pytest.raises(RuntimeError, match=r"out must be Float \[2, 24\]"):
        op(torch.empty(2, 12), x, packed, int(Q.Q8_0), 24, None, None, 0.0, "store")
    with pytest.raises(RuntimeError, match="the add epilogue takes no norm"):
        op(torch.empty(2, 24), x, packed, int(Q.Q8_0), 24, None, torch.ones(64), 1e-5, "add")
    with pytest.raises(RuntimeError, match=r"bias must be contiguous Float \[24\]"):
        op(torch.empty(2, 24), x, packed, int(Q.Q8_0), 24, torch.ones(23), None, 0.0, "store")
