"""ggml_mul_mat_vec_fused: a GGUF product with the decode layer's neighbours (the input's RMSNorm
or SiLU-and-mul, the residual add) against the ops it fuses, run one after another.

On the CPU, and on CUDA wherever no fused kernel applies, the op is those ops in turn; on CUDA
one token of Q4_K is one kernel (the direct form, cuda/gguf/gguf_mmvq_q4k.cuh) that rounds each
step as its op does. The RMSNorm's inputs are multiples of 1/4 below 8 in magnitude, so that
every order of summing their squares is exact and the fused kernel's norm scale equals
rms_norm's: then the results must be equal bit for bit. A second test takes plain random inputs
and checks the fused kernel against the float64 product of its own q8_1 activation.
"""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize

from pyorch import _ops
from tests.conftest import CUDA_AVAILABLE, DEVICES, capture_graph
from tests.reference import gguf as ref

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
INPUT_OPS = ["none", "rms_norm", "silu_and_mul"]
OUT_EPS = {torch.float32: 2e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}
EPS = 1e-5


def _weight(qtype: Q, rows: int, cols: int, device: str, seed: int) -> tuple[np.ndarray,
                                                                             torch.Tensor]:
    raw = ref.make_weight(qtype, rows, cols, np.random.default_rng(seed))
    return raw, torch.from_numpy(raw).to(device)


def _inputs(input_op: str, tokens: int, cols: int, dtype: torch.dtype, device: str,
            gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor | None]:
    """X (exact quarter steps, see the module docstring) and the norm weight."""
    width = 2 * cols if input_op == "silu_and_mul" else cols
    x = torch.randint(-31, 32, (tokens, width), generator=gen).float() / 4
    g = (1 + 0.3 * torch.randn(cols, generator=gen)) if input_op == "rms_norm" else None
    return x.to(device, dtype), None if g is None else g.to(device, dtype)


def _unfused(out0: torch.Tensor, x: torch.Tensor, w: torch.Tensor, qtype: Q, rows: int,
             g: torch.Tensor | None, input_op: str, epilogue: str) -> torch.Tensor:
    """The ops ggml_mul_mat_vec_fused fuses, one after another."""
    x_in = x
    if input_op == "rms_norm":
        x_in = torch.empty_like(x)
        _ops.rms_norm(x_in, x, g, EPS)
    elif input_op == "silu_and_mul":
        x_in = torch.empty(x.shape[0], x.shape[1] // 2, dtype=x.dtype, device=x.device)
        _ops.silu_and_mul(x_in, x)
    y = _ops.ggml_mul_mat_vec_a8(w, x_in, int(qtype), rows)
    return out0 + y if epilogue == "add" else y


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q8_0], ids=lambda q: q.name)
@pytest.mark.parametrize("input_op", INPUT_OPS)
@pytest.mark.parametrize("epilogue", ["store", "add"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,rows,blocks", [(1, 7, 3), (1, 130, 9), (3, 37, 2)])
def test_fused_equals_the_ops_it_fuses(device: str, qtype: Q, input_op: str, epilogue: str,
                                       dtype: torch.dtype, tokens: int, rows: int,
                                       blocks: int) -> None:
    # One token of Q4_K on CUDA is the fused kernel; Q8_0, three tokens and the CPU run the ops.
    # 3 and 9 blocks of 256 leave the direct kernel's 8-block warp steps partly idle.
    cols = 256 * blocks
    gen = torch.Generator().manual_seed(rows * 31 + blocks)
    _, w = _weight(qtype, rows, cols, device, rows + blocks)
    x, g = _inputs(input_op, tokens, cols, dtype, device, gen)
    out0 = (4 * torch.randn(tokens, rows, generator=gen)).to(device, dtype)
    out = out0.clone()
    _ops.ggml_mul_mat_vec_fused(out, x, w, int(qtype), rows, g, EPS, input_op, epilogue)
    expected = _unfused(out0, x, w, qtype, rows, g, input_op, epilogue)
    assert torch.equal(out, expected), (out - expected).abs().max()


@pytest.mark.skipif(not CUDA_AVAILABLE, reason="no CUDA device on this machine")
@pytest.mark.parametrize("warps", [1, 8, 16])
@pytest.mark.parametrize("input_op", INPUT_OPS)
def test_fused_kernel_with_fewer_warps(warps: int, input_op: str) -> None:
    # set_gguf_fused_warps (PYORCH_GGUF_FUSED_WARPS): smaller thread blocks, one per SM, take
    # several rows per warp and reduce the norm over fewer warps: still the ops' bits.
    from pyorch import _C

    rows, cols = 1031, 4096
    gen = torch.Generator().manual_seed(warps)
    _, w = _weight(Q.Q4_K, rows, cols, "cuda", warps + 100)
    x, g = _inputs(input_op, 1, cols, torch.bfloat16, "cuda", gen)
    out0 = torch.randn(1, rows, generator=gen).to("cuda", torch.bfloat16)
    out = out0.clone()
    assert _C.gguf_fused_warps() == 32
    _C.set_gguf_fused_warps(warps)
    try:
        _ops.ggml_mul_mat_vec_fused(out, x, w, int(Q.Q4_K), rows, g, EPS, input_op, "add")
    finally:
        _C.set_gguf_fused_warps(32)
    expected = _unfused(out0, x, w, Q.Q4_K, rows, g, input_op, "add")
    assert torch.equal(out, expected), (out - expected).abs().max()


def _rms_norm64(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """rms_norm's value in the dtype: T(x * inv_rms) * g, rounded to T."""
    xd = x.double()
    inv = torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + EPS)
    return ((xd * inv).to(x.dtype).double() * g.double()).to(x.dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("input_op", INPUT_OPS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,cols", [(1, 256), (1031, 4096), (4096, 14336), (20011, 512)])
def test_fused_against_the_float64_product(device: str, input_op: str, dtype: torch.dtype,
                                           rows: int, cols: int) -> None:
    # Random inputs: the kernel's own norm scale may differ from rms_norm's in its last bit, so
    # it is checked against the reference of its definition instead. 20011 rows give each warp
    # several rows; 14336 columns are Llama-3-8B's down projection (x in shared memory: 28 KB of
    # values beside the q8_1 groups). The CPU takes the smaller shapes.
    from pyorch import _C

    if device == "cpu" and rows * cols > 1 << 23:
        pytest.skip("a large shape for the CPU's composed op")
    assert device == "cpu" or _C.gguf_q4k_direct()
    gen = torch.Generator().manual_seed(cols + rows)
    raw, w = _weight(Q.Q4_K, rows, cols, device, rows * 3 + cols)
    width = 2 * cols if input_op == "silu_and_mul" else cols
    x = (2 * torch.randn(1, width, generator=gen)).to(device, dtype)
    g = (1 + 0.3 * torch.randn(cols, generator=gen)).to(device, dtype)
    residual = torch.randn(1, rows, generator=gen).to(device, dtype)
    out = residual.clone()
    _ops.ggml_mul_mat_vec_fused(out, x, w, int(Q.Q4_K), rows,
                                g if input_op == "rms_norm" else None, EPS, input_op, "add")
    xc = x.cpu()
    if input_op == "rms_norm":
        x_in = _rms_norm64(xc, g.cpu())
    elif input_op == "silu_and_mul":
        x_in = (torch.nn.functional.silu(xc[:, :cols].double()) * xc[:, cols:].double()).to(dtype)
    else:
        x_in = xc
    wd = torch.from_numpy(gguf_dequantize(raw, Q.Q4_K).astype(np.float64)).reshape(rows, cols)
    xq = ref.quantize_activation(x_in)
    y = xq @ wd.T
    expected = residual.cpu().double() + y.to(dtype).double()
    # fp32 accumulation, two roundings (the product, the sum); the formed values may sit one
    # rounding apart from the float64 ones (the norm scale's last bit, fp32 against float64
    # SiLU), a q8_1 step on such a value: allowed on 2% of them.
    step = (x_in.double().abs().view(1, -1, 32).amax(-1) / 127).repeat_interleave(32, -1)
    bound = (1e-5 * (xq.abs() @ wd.abs().T) + 2 * OUT_EPS[dtype] * (expected.abs() + y.abs())
             + (0.02 * step @ wd.abs().T if input_op != "none" else 0))
    err = (out.cpu().double() - expected).abs()
    assert (err <= bound).all(), f"max excess {(err - bound).max().item():.3g}"


@pytest.mark.skipif(not CUDA_AVAILABLE, reason="no CUDA device on this machine")
def test_one_token_of_q4k_is_one_kernel_and_graph_safe() -> None:
    # The fused kernel, not rms_norm + product + add: one launch, no rms_norm kernel. It replays
    # from a CUDA graph (the engine's decode steps) with the same result.
    from torch.profiler import ProfilerActivity, profile

    rows, cols = 300, 2048
    gen = torch.Generator().manual_seed(3)
    _, w = _weight(Q.Q4_K, rows, cols, "cuda", 9)
    x, g = _inputs("rms_norm", 1, cols, torch.bfloat16, "cuda", gen)
    residual = torch.randn(1, rows, generator=gen).to("cuda", torch.bfloat16)
    out = residual.clone()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        _ops.ggml_mul_mat_vec_fused(out, x, w, int(Q.Q4_K), rows, g, EPS, "rms_norm", "add")
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type.name == "CUDA"]
    assert sum("q4k_mul_mat_vec_kernel" in k for k in kernels) == 1, kernels
    assert not any("rms_norm" in k or "elementwise" in k for k in kernels), kernels
    eager = out.clone()

    def call() -> None:
        out.copy_(residual)
        _ops.ggml_mul_mat_vec_fused(out, x, w, int(Q.Q4_K), rows, g, EPS, "rms_norm", "add")

    graph = capture_graph(call)
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


@pytest.mark.parametrize("device", DEVICES)
def test_fused_refuses_bad_input(device: str) -> None:
    rows, cols = 16, 256
    _, w = _weight(Q.Q4_K, rows, cols, device, 1)
    x = torch.randn(1, cols, device=device)
    g = torch.ones(cols, device=device)
    out = torch.empty(1, rows, device=device)
    op, q4k = _ops.ggml_mul_mat_vec_fused, int(Q.Q4_K)
    with pytest.raises(RuntimeError, match="input_op must be none, rms_norm or silu_and_mul"):
        op(out, x, w, q4k, rows, None, EPS, "gelu", "store")
    with pytest.raises(RuntimeError, match="epilogue must be store or add"):
        op(out, x, w, q4k, rows, None, EPS, "none", "silu_and_mul")
    with pytest.raises(RuntimeError, match="rms_norm needs norm_weight"):
        op(out, x, w, q4k, rows, None, EPS, "rms_norm", "store")
    with pytest.raises(RuntimeError, match="norm_weight is rms_norm's"):
        op(out, x, w, q4k, rows, g, EPS, "none", "store")
    with pytest.raises(RuntimeError, match=r"norm_weight must be a contiguous \[256\]"):
        op(out, x, w, q4k, rows, g[:128], EPS, "rms_norm", "store")
    with pytest.raises(RuntimeError, match="silu_and_mul needs an even number of columns"):
        op(out, torch.randn(1, 3, device=device), w, q4k, rows, None, EPS, "silu_and_mul",
           "store")
    with pytest.raises(RuntimeError, match="not a whole number"):  # silu_and_mul halves X
        op(out, x, w, q4k, rows, None, EPS, "silu_and_mul", "store")
    with pytest.raises(RuntimeError, match=r"out must be a contiguous \[1, 16\]"):
        op(torch.empty(1, rows + 1, device=device), x, w, q4k, rows, None, EPS, "none", "store")
    with pytest.raises(RuntimeError, match=r"out must be a contiguous \[1, 16\]"):
        op(out.to(torch.float16), x, w, q4k, rows, None, EPS, "none", "store")
    with pytest.raises(RuntimeError, match="X must be a contiguous"):
        op(out, torch.randn(1, 2 * cols, device=device)[:, ::2], w, q4k, rows, None, EPS,
           "none", "store")
    shared = torch.randn(1, 8 + cols, device=device)  # out's last 8 values are X's first
    with pytest.raises(RuntimeError, match="out must not overlap X"):
        op(shared[:, :rows], shared[:, 8:], w, q4k, rows, None, EPS, "none", "store")
    with pytest.raises(RuntimeError, match="has no product kernel"):
        op(out, x, w, int(Q.F32), rows, None, EPS, "none", "store")
