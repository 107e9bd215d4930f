"""Dequantize GGUF tensor data to float32 with numpy.

The block layouts follow GGML's ``ggml-common.h`` (``block_q8_0``, ``block_q4_K``, ...). Every
format is decoded for all of a tensor's blocks at once with array operations; large tensors are
walked in chunks of blocks so that the integer temporaries stay bounded. The arithmetic order
matches GGML's reference ``dequantize_row_*`` functions (scale products are formed first, in
float32), so results agree with llama.cpp and gguf-py to float32 rounding.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

# GGMLQuantizationType ids (the numbers stored in a GGUF tensor header).
F32, F16, Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K, BF16 = 0, 1, 2, 3, 8, 12, 13, 14, 30

QK_K = 256  # elements per K-quant super-block

# type id -> (name, elements per block, bytes per block)
BLOCK_LAYOUTS: dict[int, tuple[str, int, int]] = {
    F32: ("F32", 1, 4),
    F16: ("F16", 1, 2),
    BF16: ("BF16", 1, 2),
    Q8_0: ("Q8_0", 32, 2 + 32),  # d: f16, qs: int8[32]
    Q4_0: ("Q4_0", 32, 2 + 16),  # d: f16, qs: 32 x 4-bit
    Q4_1: ("Q4_1", 32, 4 + 16),  # d, m: f16, qs: 32 x 4-bit
    Q4_K: ("Q4_K", QK_K, 4 + 12 + QK_K // 2),  # d, dmin, 6-bit scales/mins[12], qs[128]
    Q5_K: ("Q5_K", QK_K, 4 + 12 + QK_K // 8 + QK_K // 2),  # ... + qh[32] high bits
    Q6_K: ("Q6_K", QK_K, QK_K // 2 + QK_K // 4 + QK_K // 16 + 2),  # ql, qh, int8 scales, d
}

# Blocks decoded per step: bounds the temporaries to a few hundred MiB for any tensor size.
_CHUNK_BLOCKS = 1 << 16


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """[num_blocks, 1] float32 from the fp16 stored at byte ``start`` of each block."""
    return blocks[:, start : start + 2].copy().view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[num_blocks, 2 * n] uint8: the low nibbles of qs [num_blocks, n], then the high ones."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _dequant_q8_0(blocks: np.ndarray) -> np.ndarray:  # blocks: [n, 34] uint8
    d = _f16(blocks, 0)
    return d * blocks[:, 2:].view(np.int8).astype(np.float32)


def _dequant_q4_0(blocks: np.ndarray) -> np.ndarray:  # blocks: [n, 18] uint8
    d = _f16(blocks, 0)
    q = _nibbles(blocks[:, 2:]).astype(np.int8) - np.int8(8)
    return d * q.astype(np.float32)


def _dequant_q4_1(blocks: np.ndarray) -> np.ndarray:  # blocks: [n, 20] uint8
    d, m = _f16(blocks, 0), _f16(blocks, 2)
    return d * _nibbles(blocks[:, 4:]).astype(np.float32) + m


def _k_scales_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Unpack Q4_K/Q5_K 6-bit sub-block scales and mins.

    packed: [n, 12] uint8 -> (scales [n, 8], mins [n, 8]) float32. Sub-blocks 0-3 keep their
    6 bits in the low bits of bytes 0-3 (scales) and 4-7 (mins); sub-blocks 4-7 take 4 low
    bits from bytes 8-11 and their top 2 bits from the spare high bits of bytes 0-7.
    """
    lo, mid, hi = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = np.concatenate([lo & 63, (hi & 0x0F) | ((lo >> 6) << 4)], axis=-1)
    mins = np.concatenate([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], axis=-1)
    return scales.astype(np.float32), mins.astype(np.float32)


def _k_quant_4bit(qs: np.ndarray) -> np.ndarray:
    """qs [n, 128] uint8 -> [n, 8, 32] 4-bit values: each 32-byte group holds sub-block 2j in
    its low nibbles and sub-block 2j + 1 in its high nibbles."""
    q = qs.reshape(-1, 4, 1, 32)
    return np.concatenate([q & 0x0F, q >> 4], axis=2).reshape(-1, 8, 32)


def _dequant_q4_k(blocks: np.ndarray) -> np.ndarray:  # blocks: [n, 144] uint8
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    scales, mins = _k_scales_mins(blocks[:, 4:16])
    q = _k_quant_4bit(blocks[:, 16:]).astype(np.float32)
    out = (d * scales)[:, :, None] * q - (dmin * mins)[:, :, None]
    return out.reshape(-1, QK_K)


def _dequant_q5_k(blocks: np.ndarray) -> np.ndarray:  # blocks: [n, 176] uint8
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    scales, mins = _k_scales_mins(blocks[:, 4:16])
    qh = blocks[:, 16:48]  # bit k of qh[l] is the fifth bit of element l of sub-block k
    high = (qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1
    q = (_k_quant_4bit(blocks[:, 48:]) | (high << 4)).astype(np.float32)
    out = (d * scales)[:, :, None] * q - (dmin * mins)[:, :, None]
    return out.reshape(-1, QK_K)


def _dequant_q6_k(blocks: np.ndarray) -> np.ndarray:  # blocks: [n, 210] uint8
    # Two halves of 128 elements; each half has ql[64], qh[32] and four quarters of 32:
    # quarters 0/1 take the low nibbles of ql[0:32]/ql[32:64], quarters 2/3 the high nibbles,
    # and quarter k takes its top two bits from bits 2k..2k+1 of qh.
    ql = blocks[:, 0:128].reshape(-1, 2, 2, 32)
    qh = blocks[:, 128:192].reshape(-1, 2, 1, 32)
    scales = blocks[:, 192:208].view(np.int8).astype(np.float32)  # [n, 16], one per 16 elements
    d = _f16(blocks, 208)
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=2)  # [n, 2, 4, 32]
    high = (qh >> np.array([0, 2, 4, 6], dtype=np.uint8)[None, None, :, None]) & 3
    q = ((low | (high << 4)).astype(np.int8) - np.int8(32)).astype(np.float32)
    out = (d * scales)[:, :, None] * q.reshape(-1, 16, 16)
    return out.reshape(-1, QK_K)


def _dequant_bf16(blocks: np.ndarray) -> np.ndarray:  # blocks: [n, 2] uint8
    bits = blocks.copy().view(np.uint16).astype(np.uint32) << 16
    return bits.view(np.float32)


_DEQUANT: dict[int, Callable[[np.ndarray], np.ndarray]] = {
    Q8_0: _dequant_q8_0,
    Q4_0: _dequant_q4_0,
    Q4_1: _dequant_q4_1,
    Q4_K: _dequant_q4_k,
    Q5_K: _dequant_q5_k,
    Q6_K: _dequant_q6_k,
    BF16: _dequant_bf16,
}


def type_name(qtype: int) -> str:
    layout = BLOCK_LAYOUTS.get(int(qtype))
    return layout[0] if layout else f"type id {int(qtype)}"


def dequantize(raw: np.ndarray, qtype: int, num_elements: int) -> np.ndarray:
    """Decode one tensor's stored bytes.

    Parameters
    ----------
    raw : np.ndarray
        The tensor's data exactly as stored in the file (any dtype, C-contiguous); it is
        reinterpreted as bytes.
    qtype : int
        The GGMLQuantizationType id (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q5_K or Q6_K).
    num_elements : int
        The number of values the tensor holds.

    Returns
    -------
    np.ndarray
        [num_elements] float32, a fresh writable array, in GGML element order.
    """
    qtype = int(qtype)
    if qtype not in BLOCK_LAYOUTS:
        raise NotImplementedError(f"GGUF tensor type {type_name(qtype)} is not supported")
    _, block_size, type_size = BLOCK_LAYOUTS[qtype]
    data = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    if num_elements % block_size or data.size != num_elements // block_size * type_size:
        raise ValueError(
            f"{type_name(qtype)} data of {data.size} bytes does not hold {num_elements} elements"
        )
    if qtype == F32:
        return data.view(np.float32).copy()
    if qtype == F16:
        return data.view(np.float16).astype(np.float32)
    blocks = data.reshape(-1, type_size)
    out = np.empty((blocks.shape[0], block_size), dtype=np.float32)
    decode = _DEQUANT[qtype]
    for start in range(0, blocks.shape[0], _CHUNK_BLOCKS):
        stop = start + _CHUNK_BLOCKS
        out[start:stop] = decode(blocks[start:stop])
    return out.reshape(-1)
