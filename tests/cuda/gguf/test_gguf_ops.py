"""The CUDA GGUF kernels (cuda/gguf, cpp/ops/gguf.cpp) against the gguf package.

Weights are real GGUF blocks from tests/reference/gguf.py (``gguf.quants.quantize`` on fresh random
data where gguf can quantize the type, random bytes with modest fp16 scales for the K-quants); the
reference is ``gguf.quants.dequantize``. ggml_dequantize must equal it bit for bit (the kernel
rounds gguf's fp32 value once to the output dtype). The products quantize the activation to q8_1
as tests/reference/gguf.py does, so they are compared with that activation times the dequantized
weight in float64, within fp32 accumulation and the output dtype's rounding.

The shapes cross the kernels' tile edges: the vector kernel streams a row in tiles of 64
sub-blocks (2048 values) and runs 8 tokens per pass; the matrix kernel takes 64 rows x 32 tokens
x 256 values per step. 130 rows leave a partial 64-row tile and a partial 4-row block; 2304 = 9 x
256 columns (K-quants) is a full 8-block tile plus one block, and 2336 = 73 x 32 (the others) a
full 64-block tile plus 9 blocks and a partial 256 slice; 11 and 40 tokens need two passes / two
token tiles. The CPU/CUDA op tests in tests/cuda/ggml cover the shared argument checks.
"""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize

from pyorch import _ops
from tests.conftest import CUDA_AVAILABLE, capture_graph
from tests.reference import gguf as ref

pytestmark = pytest.mark.skipif(not CUDA_AVAILABLE, reason="no CUDA device on this machine")

QUANT_TYPES = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K]
FLOAT_TYPES = [Q.F32, Q.F16, Q.BF16]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Relative rounding of one output value in each dtype (with margin).
OUT_EPS = {torch.float32: 2e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}
TOKENS = {"ggml_mul_mat_vec_a8": [1, 3, 8, 11], "ggml_mul_mat_a8": [1, 17, 40, 83]}
PRODUCTS = list(TOKENS)


def _cols(qtype: Q) -> int:
    return 2304 if ref.block_size(qtype) == 256 else 2336


def _check_product(out: torch.Tensor, x: torch.Tensor, raw: np.ndarray, qtype: Q) -> None:
    rows, cols = raw.shape[0], x.shape[1]
    w = torch.from_numpy(gguf_dequantize(raw, qtype).astype(np.float64)).reshape(rows, cols)
    xq = ref.quantize_activation(x)  # float64: the kernels' q8_1 activation
    expected = xq @ w.T
    # fp32 accumulation errors scale with the sum of |terms|; the output rounds once.
    bound = 1e-5 * (xq.abs() @ w.abs().T) + OUT_EPS[out.dtype] * expected.abs()
    err = (out.cpu().double() - expected).abs()
    assert (err <= bound).all(), f"max excess {(err - bound).max().item():.3g}"


def _device_weight(raw: np.ndarray, offset: int = 0) -> torch.Tensor:
    """raw's bytes on the GPU, starting `offset` bytes into their buffer."""
    buf = torch.empty(raw.size + offset, dtype=torch.uint8, device="cuda")
    w = buf[offset:].view(raw.shape[0], -1)
    w.copy_(torch.from_numpy(raw))
    return w


@pytest.mark.parametrize("qtype", QUANT_TYPES + FLOAT_TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,blocks", [(1, 1), (83, 9)])
def test_ggml_dequantize_cuda_is_gguf_exactly(
    qtype: Q, dtype: torch.dtype, rows: int, blocks: int
) -> None:
    cols = ref.block_size(qtype) * blocks
    raw = ref.make_weight(qtype, rows, cols, np.random.default_rng(int(qtype) * 31 + rows))
    expected = torch.from_numpy(gguf_dequantize(raw, qtype).astype(np.float32)).reshape(rows, cols)
    out = _ops.ggml_dequantize(_device_weight(raw), int(qtype), rows, cols, dtype)
    assert out.shape == (rows, cols) and out.dtype == dtype and out.is_cuda
    assert torch.equal(out.cpu(), expected.to(dtype))


@pytest.mark.parametrize("op,num_tokens", [(op, n) for op in PRODUCTS for n in TOKENS[op]])
@pytest.mark.parametrize("qtype", QUANT_TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("dtype", DTYPES)
def test_ggml_mul_mat_cuda(op: str, num_tokens: int, qtype: Q, dtype: torch.dtype) -> None:
    rows, cols = 130, _cols(qtype)
    raw = ref.make_weight(qtype, rows, cols, np.random.default_rng(int(qtype) * 7 + num_tokens))
    x = torch.randn(num_tokens, cols, device="cuda").to(dtype)
    out = getattr(_ops, op)(_device_weight(raw), x, int(qtype), rows)
    assert out.shape == (num_tokens, rows) and out.dtype == dtype and out.is_cuda
    _check_product(out, x, raw, qtype)


@pytest.mark.parametrize("op,num_tokens", [("ggml_mul_mat_vec_a8", 1), ("ggml_mul_mat_a8", 64)])
@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q8_0], ids=lambda q: q.name)
def test_ggml_mul_mat_cuda_llama_rows(op: str, num_tokens: int, qtype: Q) -> None:
    # Llama-3-8B's K = 4096 (two or more full tiles per row), the bench's targets.
    rows, cols = 512, 4096
    raw = ref.make_weight(qtype, rows, cols, np.random.default_rng(int(qtype)))
    x = torch.randn(num_tokens, cols, device="cuda", dtype=torch.bfloat16)
    _check_product(getattr(_ops, op)(_device_weight(raw), x, int(qtype), rows), x, raw, qtype)


def _x_at(x: torch.Tensor, offset_elems: int) -> torch.Tensor:
    """A copy of x whose data starts `offset_elems` elements into its buffer."""
    buf = torch.empty(x.numel() + offset_elems, dtype=x.dtype, device=x.device)
    view = buf[offset_elems:].view(x.shape)
    view.copy_(x)
    return view


@pytest.mark.parametrize("rows,cols", [(1, 256), (7, 256 * 3), (130, 2304), (1031, 4096),
                                       (4096, 14336), (20011, 512), (3, 256 * 23)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_ggml_mul_mat_vec_cuda_q4k_direct_and_ring_forms(rows: int, cols: int,
                                                         dtype: torch.dtype) -> None:
    # One token of Q4_K with rows on 16 bytes takes the direct form (gguf_mmvq_q4k.cuh: four
    # lanes a block, eight blocks a warp step, x in padded shared-memory groups); the switch
    # PYORCH_GGUF_Q4K_DIRECT=0 (set_gguf_q4k_direct) sends it to the ring form. Rows of 1 to 23
    # blocks leave steps with idle lanes (not multiples of 8 blocks); 20011 rows give each warp
    # several rows. Both forms against the float64 reference.
    from pyorch import _C

    raw = ref.make_weight(Q.Q4_K, rows, cols, np.random.default_rng(rows * 7 + cols))
    w = _device_weight(raw)
    x = torch.randn(1, cols, device="cuda").to(dtype) * 2
    assert _C.gguf_q4k_direct()
    direct = _ops.ggml_mul_mat_vec_a8(w, x, int(Q.Q4_K), rows)
    try:
        _C.set_gguf_q4k_direct(False)
        ring = _ops.ggml_mul_mat_vec_a8(w, x, int(Q.Q4_K), rows)
    finally:
        _C.set_gguf_q4k_direct(True)
    _check_product(direct, x, raw, Q.Q4_K)
    _check_product(ring, x, raw, Q.Q4_K)


@pytest.mark.parametrize("qtype,rows,cols", [(q, 130, _cols(q)) for q in QUANT_TYPES] + [
    (Q.Q4_K, 6144, 4096), (Q.Q4_K, 4096, 14336), (Q.Q8_0, 6144, 4096), (Q.Q6_K, 1031, 14336),
    (Q.Q4_K, 20011, 512), (Q.Q6_K, 20011, 256), (Q.Q8_0, 20011, 96), (Q.Q8_0, 3, 147456)],
    ids=lambda v: getattr(v, "name", str(v)))
@pytest.mark.parametrize("dtype", DTYPES)
def test_ggml_mul_mat_vec_cuda_fused_q8_1_same_bits(
    qtype: Q, rows: int, cols: int, dtype: torch.dtype
) -> None:
    # One token with a 16-byte aligned x: the vector kernel quantizes x itself in shared memory
    # (no q8_1 kernel; for Q4_K the direct form, which has its own summation order). The same x
    # one element off 16 bytes takes the q8_1 kernel's path: both must give the same bits (Q4_K:
    # both close to the reference). 130 and 1031 rows leave blocks with idle warps, which still
    # quantize x; 20011 rows are more than the resident warps hold, so each warp takes several
    # rows (and K-quants then stream tiles of 4 sub-blocks per lane). An x of 147456 values does
    # not fit in shared memory (1.5 bytes a value): the product falls back to the q8_1 kernel.
    raw = ref.make_weight(qtype, rows, cols, np.random.default_rng(int(qtype) * 13 + rows))
    w = _device_weight(raw)
    x = torch.randn(1, cols, device="cuda").to(dtype) * 3
    fused = _ops.ggml_mul_mat_vec_a8(w, _x_at(x, 0), int(qtype), rows)
    plain = _ops.ggml_mul_mat_vec_a8(w, _x_at(x, 1), int(qtype), rows)
    if qtype == Q.Q4_K or (rows > 20000 and ref.block_size(qtype) == 256):
        # Q4_K's one-token form is the direct kernel (gguf_mmvq_q4k.cuh), and wider tiles sum
        # each row's sub-blocks in another order: both forms against the reference instead.
        _check_product(plain, x, raw, qtype)
        _check_product(fused, x, raw, qtype)
    else:
        assert torch.equal(fused, plain)
    if rows * cols <= 1 << 24:
        _check_product(fused, x, raw, qtype)


@pytest.mark.parametrize("op", PRODUCTS)
@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q5_0, Q.Q3_K, Q.Q6_K], ids=lambda q: q.name)
def test_ggml_mul_mat_cuda_rows_not_16_byte_aligned(op: str, qtype: Q) -> None:
    # W 2 bytes into its buffer: these types' blocks are read as 2-byte halves, and the vector
    # kernel streams such rows with 2-byte loads instead of 16-byte ones. The activation is a
    # strided view.
    rows, cols = 37, _cols(qtype)
    raw = ref.make_weight(qtype, rows, cols, np.random.default_rng(5))
    x = torch.randn(5, cols + 32, device="cuda", dtype=torch.float16)[:, :cols]
    _check_product(getattr(_ops, op)(_device_weight(raw, 2), x, int(qtype), rows), x, raw, qtype)


@pytest.mark.parametrize("op", PRODUCTS + ["ggml_dequantize"])
def test_ggml_ops_cuda_refuse_misaligned_words(op: str) -> None:
    # Q4_K blocks (144 bytes) are read as 4-byte words: W at a 2-byte offset is refused by name.
    raw = ref.make_weight(Q.Q4_K, 3, 256, np.random.default_rng(6))
    w = _device_weight(raw, 2)
    with pytest.raises(RuntimeError, match="Q4_K.* must be 4-byte aligned"):
        if op == "ggml_dequantize":
            _ops.ggml_dequantize(w, int(Q.Q4_K), 3, 256)
        else:
            getattr(_ops, op)(w, torch.randn(1, 256, device="cuda"), int(Q.Q4_K), 3)


@pytest.mark.parametrize("op", PRODUCTS)
def test_ggml_mul_mat_cuda_refuses_unsupported_types(op: str) -> None:
    raw = ref.make_weight(Q.Q4_0, 4, 64, np.random.default_rng(2))
    x = torch.randn(2, 64, device="cuda")
    with pytest.raises(RuntimeError, match="GGML type 20 is not supported"):  # IQ4_NL
        getattr(_ops, op)(_device_weight(raw), x, int(Q.IQ4_NL), 4)
    with pytest.raises(RuntimeError, match="BF16 has no product kernel"):
        getattr(_ops, op)(_device_weight(raw), x, int(Q.BF16), 4)


@pytest.mark.parametrize("op", PRODUCTS)
def test_ggml_mul_mat_cuda_graph_capture(op: str) -> None:
    # Captured once (the q8_1 workspace comes from the graph's pool), replayed on new values.
    raw = ref.make_weight(Q.Q4_K, 64, 512, np.random.default_rng(7))
    w = _device_weight(raw)
    x = torch.randn(4, 512, device="cuda", dtype=torch.bfloat16)
    result: dict[str, torch.Tensor] = {}

    def call() -> None:
        result["out"] = getattr(_ops, op)(w, x, int(Q.Q4_K), 64)

    graph = capture_graph(call)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    # The kernels sum in a fixed order: a replay equals an eager call bit for bit.
    assert torch.equal(result["out"], getattr(_ops, op)(w, x, int(Q.Q4_K), 64))
    _check_product(result["out"], x, raw, Q.Q4_K)
