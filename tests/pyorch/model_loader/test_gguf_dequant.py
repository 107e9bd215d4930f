"""Our numpy GGUF dequantization against gguf-py's reference ``gguf.quants.dequantize``."""

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize

from pyorch.model_loader.gguf_dequant import BLOCK_LAYOUTS, dequantize

# Byte offsets of each block's fp16 scale fields: random bytes there could be inf/NaN.
FP16_FIELDS = {
    Q.Q8_0: (0,),
    Q.Q4_0: (0,),
    Q.Q4_1: (0, 2),
    Q.Q4_K: (0, 2),
    Q.Q5_K: (0, 2),
    Q.Q6_K: (208,),
}


def random_tensor_bytes(qtype: Q, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """[rows, row_bytes] uint8: random blocks whose fp16 scales are finite and modest."""
    _, block_size, type_size = BLOCK_LAYOUTS[int(qtype)]
    num_blocks = rows * cols // block_size
    if qtype == Q.F32:
        return rng.standard_normal(rows * cols, dtype=np.float32).view(np.uint8).reshape(rows, -1)
    if qtype == Q.F16:
        values = rng.standard_normal(rows * cols).astype(np.float16)
        return values.view(np.uint8).reshape(rows, -1)
    if qtype == Q.BF16:
        bits = rng.standard_normal(rows * cols, dtype=np.float32).view(np.uint32) >> 16
        return bits.astype(np.uint16).view(np.uint8).reshape(rows, -1)
    blocks = rng.integers(0, 256, size=(num_blocks, type_size), dtype=np.uint8)
    for offset in FP16_FIELDS[qtype]:
        scale = rng.uniform(-0.05, 0.05, size=num_blocks).astype(np.float16)
        blocks[:, offset : offset + 2] = scale.view(np.uint8).reshape(num_blocks, 2)
    return blocks.reshape(rows, -1)


ALL_TYPES = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q5_K, Q.Q6_K]


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("rows, cols_in_blocks", [(1, 1), (7, 3), (83, 2)])
def test_dequantize_matches_gguf_py(qtype: Q, rows: int, cols_in_blocks: int) -> None:
    _, block_size, _ = BLOCK_LAYOUTS[int(qtype)]
    block_size = max(block_size, 32)  # float types: rows of a few dozen values
    cols = cols_in_blocks * block_size
    rng = np.random.default_rng(int(qtype) * 1000 + rows)
    raw = random_tensor_bytes(qtype, rows, cols, rng)
    expected = gguf_dequantize(raw, qtype).astype(np.float32)  # [rows, cols]
    ours = dequantize(raw, qtype, rows * cols)
    assert ours.dtype == np.float32 and ours.shape == (rows * cols,)
    np.testing.assert_allclose(ours.reshape(rows, cols), expected, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1])
def test_dequantize_quantized_values(qtype: Q) -> None:
    # Round trip through gguf-py's quantizer: dequantized values are close to the originals.
    rng = np.random.default_rng(0)
    values = rng.uniform(-1, 1, size=(5, 64)).astype(np.float32)
    from gguf.quants import quantize

    raw = quantize(values, qtype)
    ours = dequantize(raw, qtype, values.size).reshape(values.shape)
    np.testing.assert_allclose(ours, gguf_dequantize(raw, qtype), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(ours, values, atol=0.15)


def test_dequantize_many_blocks_chunked(monkeypatch: pytest.MonkeyPatch) -> None:
    # Tensors larger than one chunk of blocks are decoded piecewise; the result must not change.
    import pyorch.model_loader.gguf_dequant as mod

    rng = np.random.default_rng(1)
    raw = random_tensor_bytes(Q.Q4_K, 10, 256, rng)
    whole = dequantize(raw, Q.Q4_K, 2560)
    monkeypatch.setattr(mod, "_CHUNK_BLOCKS", 3)
    np.testing.assert_array_equal(dequantize(raw, Q.Q4_K, 2560), whole)


def test_dequantize_rejects_bad_input() -> None:
    with pytest.raises(NotImplementedError, match="Q2_K|type id 10"):
        dequantize(np.zeros(84, dtype=np.uint8), 10, 256)
    with pytest.raises(ValueError, match="does not hold"):
        dequantize(np.zeros(33, dtype=np.uint8), Q.Q8_0, 32)
    with pytest.raises(ValueError, match="does not hold"):
        dequantize(np.zeros(34, dtype=np.uint8), Q.Q8_0, 31)
