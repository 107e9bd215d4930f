"""GGUF weights that stay quantized: vLLM's "gguf" quantization method.

A GGUF file's linear and embedding weights are kept as the file's blocks (uint8
[rows, cols / block_size * type_size]) with their GGML type, and computed from through the ggml
ops (pyorch/_ops.py):

- linear layers: `ggml_mul_mat_vec_a8` for up to MMVQ_MAX_TOKENS tokens (decode),
  `ggml_mul_mat_a8` above; on the GPU above MMQ_MAX_TOKENS_CUDA tokens the blocks are instead
  dequantized to the activations' dtype (`ggml_dequantize`, in chunks of at most
  DEQUANT_CHUNK_BYTES) and multiplied by cuBLAS (vLLM's dequantize path); a quantized type
  without a product kernel would be dequantized and multiplied (`DEQUANT_ONLY_TYPES`, empty
  today: every type we load has one). Float tensors (F32, F16, BF16) stay float, in the model's
  dtype, and use a plain matmul.
- merged layers (qkv_proj, gate_up_proj) are built from separate GGUF tensors that may have
  different types: each shard keeps its own blocks and runs its own product, as vLLM does; when
  every shard has the same type they are joined into one tensor (one product).
- tensor parallelism splits blocks along rows (the output features); a row-parallel layer's input
  split must fall on block boundaries.
- the token embedding gathers the looked-up rows' blocks and dequantizes only those
  (`ggml_dequantize`); a tied LM head computes the logits from the same blocks.

- on the CPU, tensors of every quantized type (Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q2_K..Q6_K)
  whose rows come in groups of 8 are repacked once at load (`repack_blocks`, the layout in
  cpp/cpu/gguf.cpp; interleaved 8 rows at a time so each row is one SIMD lane; the same bytes
  per row, Q4_K's 3%, Q3_K's 4% and Q5_K's 2% more with their scales unpacked) and multiplied
  by `ggml_mul_mat_repacked_a8` at every token count. A repacked embedding gathers its
  looked-up rows back into the file's layout (`repacked_rows`; Q4_0 / Q4_1 / Q8_0 only, any
  other type's embedding keeps the file layout) before dequantizing them.
  `PYORCH_GGUF_CPU_REPACK=0` turns it off.

The loader (pyorch/model_loader/gguf_loader.py) hands each weight over as `ggml_tensor(...)`:
a tensor tagged with its GGML type.
"""

from __future__ import annotations

import functools
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pyorch import _ops, envs
from pyorch.layers.linear import LinearBase, LinearMethodBase
from pyorch.layers.quantization import (
    QuantizationConfig,
    QuantizeMethodBase,
    register_quantization_config,
)

# GGML type ids (gguf.GGMLQuantizationType); kept here so the engine needs no gguf import.
GGML_F32, GGML_F16, GGML_BF16 = 0, 1, 30
FLOAT_TYPES = {GGML_F32: torch.float32, GGML_F16: torch.float16, GGML_BF16: torch.bfloat16}
# name, (block_size, type_size) of the quantized types with a product kernel.
PRODUCT_TYPES: dict[int, tuple[str, int, int]] = {
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    10: ("Q2_K", 256, 84),
    11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
}
# Quantized types that are dequantized and multiplied (none today; see the module docstring).
DEQUANT_ONLY_TYPES: dict[int, tuple[str, int, int]] = {}
# Up to this many tokens a product uses ggml_mul_mat_vec_a8 (vLLM's switch point).
MMVQ_MAX_TOKENS = 8
# Above this many tokens on CUDA: dequantize + cuBLAS instead of ggml_mul_mat_a8. On an H100
# (bench/gguf_matmul_crossover.py, Llama-3-8B shapes, Q4_K and Q8_0, bf16) the int8-mma kernel
# is 1.1-1.7x faster on gate_up / down up to 32 tokens (the dequantize writes 2-4x the block
# bytes), the two tie at 64 on gate_up, and at 512 dequantize + cuBLAS is 3-7x faster.
MMQ_MAX_TOKENS_CUDA = 32
# The dequantized weight is made this many bytes at a time (bounds the temporary).
DEQUANT_CHUNK_BYTES = 64 << 20

_GGML_TYPE_ATTR = "ggml_type"

# Types with a repacked CPU layout: bytes of each block's header (fp16 scale, Q4_1's fp16 min)
# and of its quants.
REPACK_TYPES: dict[int, tuple[int, int]] = {2: (2, 16), 3: (4, 16), 8: (2, 32)}
REPACK_ROWS = 8


# Repacked too, each in its own layout (cpp/cpu/gguf.cpp); not read back by row.
GGML_Q5_0, GGML_Q5_1, GGML_Q2_K, GGML_Q3_K = 6, 7, 10, 11
GGML_Q4_K, GGML_Q5_K, GGML_Q6_K = 12, 13, 14
_REPACK_OTHER = (GGML_Q5_0, GGML_Q5_1, GGML_Q2_K, GGML_Q3_K, GGML_Q4_K, GGML_Q5_K, GGML_Q6_K)


def can_repack(ggml_type: int, rows: int, cols: int) -> bool:
    """Whether `repack_blocks` takes this tensor: a repackable type, whole groups of 8 rows."""
    return ((ggml_type in REPACK_TYPES or ggml_type in _REPACK_OTHER)
            and rows % REPACK_ROWS == 0 and rows > 0 and cols > 0)


def repack_blocks(data: torch.Tensor, ggml_type: int, rows: int, cols: int) -> torch.Tensor:
    """The file's blocks (uint8 [rows, cols / 32 * type_size]) in the CPU kernels' repacked
    layout: uint8 [rows / 8, cols / 32 * 8 * type_size]. Per group of 8 rows and block: the 8
    fp16 scales, then (Q4_1) the 8 fp16 mins, then the quants as 32-byte registers whose bytes
    4 i + e hold bytes 4 k + e of row i's quants (k-th register)."""
    if not can_repack(ggml_type, rows, cols):
        raise ValueError(f"no repacked layout for {rows} rows of {ggml_type_name(ggml_type)}")
    if ggml_type in (GGML_Q5_0, GGML_Q5_1):
        return _repack_q5(data, rows, cols, ggml_type == GGML_Q5_1)
    if ggml_type == GGML_Q4_K:
        return _repack_q4_k(data, rows, cols)
    if ggml_type == GGML_Q5_K:
        return _repack_q4_k(data, rows, cols, five_bits=True)
    if ggml_type == GGML_Q6_K:
        return _repack_q6_k(data, rows, cols)
    if ggml_type == GGML_Q3_K:
        return _repack_q3_k(data, rows, cols)
    if ggml_type == GGML_Q2_K:
        return _repack_q2_k(data, rows, cols)
    header, quants = REPACK_TYPES[ggml_type]
    groups, blocks = rows // REPACK_ROWS, cols // 32
    x = data.reshape(groups, REPACK_ROWS, blocks, header + quants).transpose(1, 2)
    parts = [x[..., h:h + 2].reshape(groups, blocks, 2 * REPACK_ROWS) for h in range(0, header, 2)]
    q = x[..., header:].reshape(groups, blocks, REPACK_ROWS, quants // 4, 4).transpose(2, 3)
    parts.append(q.reshape(groups, blocks, REPACK_ROWS * quants))
    return torch.cat(parts, dim=-1).reshape(groups, -1).contiguous()


def _repack_q5(data: torch.Tensor, rows: int, cols: int, has_min: bool) -> torch.Tensor:
    """Q5_0 / Q5_1 blocks (d, Q5_1's m, qh[4], qs[16]) repacked: Q4_0's / Q4_1's layout, then
    one register of fifth bits, bit k of byte 4 i + e holding row i's value 4 k + e's."""
    header = 4 if has_min else 2
    groups, blocks = rows // REPACK_ROWS, cols // 32
    x = data.reshape(groups, REPACK_ROWS, blocks, header + 20).transpose(1, 2)  # [G, nb, 8, ts]
    parts = [x[..., h:h + 2].reshape(groups, blocks, 2 * REPACK_ROWS) for h in range(0, header, 2)]
    q = x[..., header + 4:].reshape(groups, blocks, REPACK_ROWS, 4, 4).transpose(2, 3)
    parts.append(q.reshape(groups, blocks, 128))
    qh = x[..., header:header + 4].to(torch.int64)
    qh = qh[..., 0] | (qh[..., 1] << 8) | (qh[..., 2] << 16) | (qh[..., 3] << 24)  # bit n: value n
    value = 4 * torch.arange(8).view(8, 1) + torch.arange(4)  # [k, e] -> 4 k + e
    bits = (qh[..., None, None] >> value) & 1  # [G, nb, i, k, e]
    packed = (bits << torch.arange(8).view(8, 1)).sum(dim=3)  # [G, nb, i, e]
    parts.append(packed.reshape(groups, blocks, 32).to(torch.uint8))
    return torch.cat(parts, dim=-1).reshape(groups, -1).contiguous()


def _repack_q4_k(data: torch.Tensor, rows: int, cols: int, five_bits: bool = False) -> torch.Tensor:
    """Q4_K blocks (d, dmin, 12 bytes of 6-bit scales and mins, qs[128]) repacked: per group of
    8 rows and block, [8 d][8 dmin][scale j of row i at 8 j + i][min likewise][qs as registers:
    byte 4 i + e of register k of chunk c is row i's qs[32 c + 4 k + e]] (1184 bytes).
    five_bits: Q5_K (qh[32] before qs): then one register of fifth bits per sub-block j, bit k
    of byte 4 i + e holding value 32 j + 4 k + e's (1440 bytes)."""
    groups, blocks = rows // REPACK_ROWS, cols // 256
    type_size = 176 if five_bits else 144
    x = data.reshape(groups, REPACK_ROWS, blocks, type_size).transpose(1, 2)  # [G, nb, 8, ts]
    s = x[..., 4:16].to(torch.int32)
    low, mid, high = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    scales = torch.cat([low & 63, (high & 0x0F) | ((low >> 6) << 4)], dim=-1)  # [G, nb, 8, 8]
    mins = torch.cat([mid & 63, (high >> 4) | ((mid >> 6) << 4)], dim=-1)
    qs = x[..., type_size - 128:]
    q = qs.reshape(groups, blocks, REPACK_ROWS, 4, 8, 4).permute(0, 1, 3, 4, 2, 5)
    parts = [
        x[..., 0:2].reshape(groups, blocks, 16),
        x[..., 2:4].reshape(groups, blocks, 16),
        scales.transpose(-1, -2).reshape(groups, blocks, 64).to(torch.uint8),
        mins.transpose(-1, -2).reshape(groups, blocks, 64).to(torch.uint8),
        q.reshape(groups, blocks, 1024),
    ]
    if five_bits:
        # the fifth bit of value 32 j + l is bit j of qh[l]; l = 4 k + e
        qh = x[..., 16:48].to(torch.int32).reshape(groups, blocks, REPACK_ROWS, 1, 8, 4)
        bits = (qh >> torch.arange(8).view(8, 1, 1)) & 1  # [G, nb, i, j, k, e]
        packed = (bits << torch.arange(8).view(8, 1)).sum(dim=4)  # [G, nb, i, j, e]
        parts.append(packed.permute(0, 1, 3, 2, 4).reshape(groups, blocks, 256).to(torch.uint8))
    return torch.cat(parts, dim=-1).reshape(groups, -1).contiguous()


def _low_bit_registers(low: torch.Tensor) -> torch.Tensor:
    """2-bit values [G, nb, 8 rows, 8 sub-blocks, 32] as 2 registers per sub-block j: bits 2 m
    of byte 4 i + e of register h hold row i's value 32 j + 4 (4 h + m) + e. -> [G, nb, 512]."""
    groups, blocks = low.shape[:2]
    v = low.reshape(groups, blocks, REPACK_ROWS, 8, 2, 4, 4)  # [.., i, j, h, m, e]
    packed = (v << (2 * torch.arange(4).view(4, 1))).sum(dim=5)  # [.., i, j, h, e]
    return packed.permute(0, 1, 3, 4, 2, 5).reshape(groups, blocks, 512).to(torch.uint8)


def _repack_q2_k(data: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Q2_K blocks (16 scale/min bytes, qs[64], d, dmin) repacked: per group of 8 rows and block,
    [8 d][8 dmin][scale byte g of row i at 8 g + i (scale in the low nibble, min in the high, as
    in the file)][2 low-bit registers per sub-block of 32 values, as Q3_K's] (672 bytes, the
    file's). The weight is d * scale * q - dmin * min, q in 0..3."""
    groups, blocks = rows // REPACK_ROWS, cols // 256
    x = data.reshape(groups, REPACK_ROWS, blocks, 84).transpose(1, 2)  # [G, nb, 8, 84]
    qs = x[..., 16:80].to(torch.int32).reshape(groups, blocks, REPACK_ROWS, 2, 1, 32)
    low = ((qs >> (2 * torch.arange(4).view(4, 1))) & 3).reshape(groups, blocks, REPACK_ROWS, 8, 32)
    parts = [
        x[..., 80:82].reshape(groups, blocks, 16),
        x[..., 82:84].reshape(groups, blocks, 16),
        x[..., 0:16].transpose(-1, -2).reshape(groups, blocks, 128),
        _low_bit_registers(low),
    ]
    return torch.cat(parts, dim=-1).reshape(groups, -1).contiguous()


def _repack_q3_k(data: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Q3_K blocks (hmask[32], qs[64], 12 bytes of 6-bit scales, d) repacked: per group of 8
    rows and block, [8 d][scale g - 32 of row i at 8 g + i, int8][2 low-bit registers per
    sub-block j of 32 values: bits 2 m of byte 4 i + e of register h hold the low 2 bits of row
    i's value 32 j + 4 (4 h + m) + e][1 high-bit register per sub-block: bit k of byte 4 i + e
    holds that value's third bit, k = 4 h + m] (912 bytes, the file's 880 with the scales
    unpacked from 12 bytes to 16). Values u = low | high << 2 in 0..7; the weight is
    d * scale * (u - 4)."""
    groups, blocks = rows // REPACK_ROWS, cols // 256
    x = data.reshape(groups, REPACK_ROWS, blocks, 110).transpose(1, 2)  # [G, nb, 8, 110]
    hm = x[..., 0:32].to(torch.int32)
    qs = x[..., 32:96].to(torch.int32).reshape(groups, blocks, REPACK_ROWS, 2, 1, 32)
    # value e = 128 h + 32 s + l: bits 2 s of qs[32 h + l], bit 4 h + s of hmask[l]
    low = (qs >> (2 * torch.arange(4).view(4, 1))) & 3  # [.., h, s, l]
    high = (hm.reshape(groups, blocks, REPACK_ROWS, 1, 32) >> torch.arange(8).view(8, 1)) & 1
    u = (low.reshape(groups, blocks, REPACK_ROWS, 8, 32) | (high << 2))  # [.., j, 32 values]
    sc = x[..., 96:108].to(torch.int32)
    g = torch.arange(16)
    lo = torch.where(g < 8, sc[..., g % 8] & 15, sc[..., g % 8] >> 4)
    hi = (sc[..., 8 + (g & 3)] >> (2 * (g >> 2))) & 3
    scales = ((lo | (hi << 4)) - 32).to(torch.int8)  # [G, nb, 8, 16]
    highs = (((u >> 2) & 1).reshape(groups, blocks, REPACK_ROWS, 8, 8, 4)
             << torch.arange(8).view(8, 1)).sum(dim=4)  # [.., i, j, e]
    parts = [
        x[..., 108:110].reshape(groups, blocks, 16),
        scales.transpose(-1, -2).reshape(groups, blocks, 128).view(torch.uint8),
        _low_bit_registers(u & 3),
        highs.permute(0, 1, 3, 2, 4).reshape(groups, blocks, 256).to(torch.uint8),
    ]
    return torch.cat(parts, dim=-1).reshape(groups, -1).contiguous()


def _repack_q6_k(data: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Q6_K blocks (ql[128], qh[64], 16 int8 scales, d) repacked: per group of 8 rows and block,
    [8 d][scale g of row i at 8 g + i][low nibbles as Q4_K's chunks][2 high-bit registers per
    32 values: bits 2 m of byte 4 i + e of register h hold value 4 (4 h + m) + e's] (1680 bytes,
    as the file's)."""
    groups, blocks = rows // REPACK_ROWS, cols // 256
    x = data.reshape(groups, REPACK_ROWS, blocks, 210).transpose(1, 2)  # [G, nb, 8, 210]
    ql = x[..., :128].to(torch.int32).reshape(groups, blocks, REPACK_ROWS, 2, 2, 32)
    qh = x[..., 128:192].to(torch.int32).reshape(groups, blocks, REPACK_ROWS, 2, 1, 32)
    # value h * 128 + k * 32 + l: nibble k // 2 of ql[h][k % 2][l], bits 2 k of qh[h][l]
    low = torch.cat([ql & 15, ql >> 4], dim=4)  # [.., h, k, l]
    high = (qh >> (2 * torch.arange(4).view(4, 1))) & 3
    u = (low | (high << 4)).reshape(groups, blocks, REPACK_ROWS, 256)
    # low nibbles: chunk c, register k, row i, byte e <- values 64 c + 4 k + e (nibble 0) and
    # 64 c + 32 + 4 k + e (nibble 1)
    v = (u & 15).reshape(groups, blocks, REPACK_ROWS, 4, 2, 8, 4)  # [.., i, c, half, k, e]
    nibbles = (v[..., 0, :, :] | (v[..., 1, :, :] << 4)).permute(0, 1, 3, 4, 2, 5)
    # high bits: sub-block j, register h, row i, byte e <- values 32 j + 4 (4 h + m) + e, m < 4
    b = (u >> 4).reshape(groups, blocks, REPACK_ROWS, 8, 2, 4, 4)  # [.., i, j, h, m, e]
    shifts = (2 * torch.arange(4)).view(4, 1)
    hbytes = (b << shifts).sum(dim=5).permute(0, 1, 3, 4, 2, 5)  # [.., j, h, i, e]
    scales = x[..., 192:208].transpose(-1, -2)  # [.., g, i]
    parts = [
        x[..., 208:210].reshape(groups, blocks, 16),
        scales.reshape(groups, blocks, 128),
        nibbles.reshape(groups, blocks, 1024).to(torch.uint8),
        hbytes.reshape(groups, blocks, 512).to(torch.uint8),
    ]
    return torch.cat(parts, dim=-1).reshape(groups, -1).contiguous()


def repacked_rows(
    packed: torch.Tensor, ggml_type: int, rows: int, cols: int, ids: torch.Tensor
) -> torch.Tensor:
    """Rows `ids` of a repacked tensor in the file's block layout: uint8 [len(ids), row_bytes]
    (the inverse of `repack_blocks` for the rows asked for)."""
    header, quants = REPACK_TYPES[ggml_type]
    groups, blocks = rows // REPACK_ROWS, cols // 32
    ids = ids.to(torch.int64)
    index = _lane_offsets(ggml_type, ids.device)[ids % REPACK_ROWS]  # [n, header + quants]
    sel = packed.view(groups, blocks, REPACK_ROWS * (header + quants))[ids // REPACK_ROWS]
    out = torch.gather(sel, 2, index[:, None, :].expand(-1, blocks, -1))
    return out.reshape(ids.shape[0], blocks * (header + quants))


@functools.cache
def _lane_offsets(ggml_type: int, device: torch.device) -> torch.Tensor:
    """[8, header + quants] int64: where row i of a group keeps each byte of its block, within
    the group's repacked block (its header fields, then its quants)."""
    header, quants = REPACK_TYPES[ggml_type]
    lane = torch.arange(REPACK_ROWS)[:, None]
    head = [2 * REPACK_ROWS * (h // 2) + 2 * lane + h % 2 for h in range(header)]
    k = torch.arange(quants)
    quant = REPACK_ROWS * header + 32 * (k // 4) + 4 * lane + k % 4
    return torch.cat(head + [quant], dim=1).to(device)


def ggml_type_name(ggml_type: int) -> str:
    if ggml_type in FLOAT_TYPES:
        return {GGML_F32: "F32", GGML_F16: "F16", GGML_BF16: "BF16"}[ggml_type]
    info = PRODUCT_TYPES.get(ggml_type) or DEQUANT_ONLY_TYPES.get(ggml_type)
    return info[0] if info else f"GGML type {ggml_type}"


def ggml_tensor(data: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """Tags a loaded GGUF tensor with its GGML type: uint8 blocks [rows, row_bytes] for a
    quantized type, or the float values in torch's shape for F32/F16/BF16."""
    if ggml_type not in FLOAT_TYPES and ggml_type not in PRODUCT_TYPES and (
        ggml_type not in DEQUANT_ONLY_TYPES
    ):
        raise ValueError(f"{ggml_type_name(ggml_type)} is not supported by pyorch's GGUF kernels")
    if ggml_type not in FLOAT_TYPES and data.dtype != torch.uint8:
        raise ValueError(f"{ggml_type_name(ggml_type)} blocks must be uint8, got {data.dtype}")
    setattr(data, _GGML_TYPE_ATTR, ggml_type)
    return data


def ggml_type_of(tensor: torch.Tensor) -> int:
    """The GGML type of a tensor tagged by ggml_tensor; ValueError for an untagged one."""
    ggml_type = getattr(tensor, _GGML_TYPE_ATTR, None)
    if ggml_type is None:
        raise ValueError(
            "a GGUF-quantized layer was given an untagged tensor: GGUF weights come from the "
            "GGUF loader (pyorch.model_loader.gguf_loader)"
        )
    return int(ggml_type)


def _bytes_per_row(ggml_type: int, cols: int) -> int:
    _, block_size, type_size = PRODUCT_TYPES.get(ggml_type) or DEQUANT_ONLY_TYPES[ggml_type]
    if cols % block_size:
        raise ValueError(f"{cols} columns are not whole {ggml_type_name(ggml_type)} blocks")
    return cols // block_size * type_size


class GGUFShard:
    """One GGUF tensor's part of a layer: rows of blocks of one type (or float values)."""

    def __init__(self, data: torch.Tensor, ggml_type: int, rows: int, cols: int):
        self.data = data  # uint8 [rows, row_bytes], or float [rows, cols]
        self.ggml_type = ggml_type
        self.rows = rows
        self.cols = cols
        self.repacked = False  # data is in the CPU kernels' layout (repack_blocks)

    @property
    def is_float(self) -> bool:
        return self.ggml_type in FLOAT_TYPES

    def repack_for_cpu(self, lookups: bool = False) -> None:
        """On the CPU, puts a repackable tensor in the repacked layout (once). lookups: rows are
        also gathered (an embedding): only the types `repacked_rows` reads back."""
        if (self.repacked or self.data.device.type != "cpu" or not envs.PYORCH_GGUF_CPU_REPACK
                or not can_repack(self.ggml_type, self.rows, self.cols)
                or (lookups and self.ggml_type not in REPACK_TYPES)):
            return
        self.data = repack_blocks(self.data, self.ggml_type, self.rows, self.cols)
        self.repacked = True


def gguf_matmul(x: torch.Tensor, shard: GGUFShard) -> torch.Tensor:
    """x [num_tokens, cols] @ shard^T -> [num_tokens, rows], in x's dtype."""
    if shard.is_float:
        return F.linear(x, shard.data)
    if shard.repacked:
        return _ops.ggml_mul_mat_repacked_a8(shard.data, x, shard.ggml_type, shard.rows)
    if shard.ggml_type in DEQUANT_ONLY_TYPES:  # no product kernel: explicit dequantize + matmul
        w = _ops.ggml_dequantize(shard.data, shard.ggml_type, shard.rows, shard.cols, x.dtype)
        return F.linear(x, w)
    if x.shape[0] <= MMVQ_MAX_TOKENS:
        return _ops.ggml_mul_mat_vec_a8(shard.data, x, shard.ggml_type, shard.rows)
    if x.is_cuda and x.shape[0] > MMQ_MAX_TOKENS_CUDA:
        return dequantize_matmul(x, shard)
    return _ops.ggml_mul_mat_a8(shard.data, x, shard.ggml_type, shard.rows)


def dequantize_matmul(
    x: torch.Tensor, shard: GGUFShard, chunk_bytes: int = DEQUANT_CHUNK_BYTES
) -> torch.Tensor:
    """x @ shard^T with the blocks dequantized to x's dtype (`ggml_dequantize`) and a plain
    matmul (cuBLAS on the GPU), at most chunk_bytes of dequantized rows at a time."""
    rows_per_chunk = max(1, chunk_bytes // (shard.cols * x.element_size()))
    if rows_per_chunk >= shard.rows:
        w = _ops.ggml_dequantize(shard.data, shard.ggml_type, shard.rows, shard.cols, x.dtype)
        return F.linear(x, w)
    out = torch.empty(x.shape[0], shard.rows, dtype=x.dtype, device=x.device)
    for r0 in range(0, shard.rows, rows_per_chunk):
        r1 = min(shard.rows, r0 + rows_per_chunk)
        w = _ops.ggml_dequantize(shard.data[r0:r1], shard.ggml_type, r1 - r0, shard.cols, x.dtype)
        out[:, r0:r1] = F.linear(x, w)
    return out


def _narrow_columns(data: torch.Tensor, ggml_type: int, start: int, size: int) -> torch.Tensor:
    """Columns [start, start + size) of a float tensor or of a block tensor (whole blocks)."""
    if ggml_type in FLOAT_TYPES:
        return data.narrow(1, start, size)
    _, block_size, type_size = PRODUCT_TYPES.get(ggml_type) or DEQUANT_ONLY_TYPES[ggml_type]
    if start % block_size or size % block_size:
        raise ValueError(
            f"a row-parallel split at columns {start}..{start + size} cuts "
            f"{ggml_type_name(ggml_type)} blocks of {block_size}"
        )
    return data.narrow(1, start // block_size * type_size, size // block_size * type_size)


def _to_shard(
    data: torch.Tensor, ggml_type: int, rows: int, cols: int, dtype: torch.dtype,
    device: torch.device, what: str,
) -> GGUFShard:
    if ggml_type in FLOAT_TYPES:
        expected: tuple[int, ...] = (rows, cols)
        data = data.to(dtype)
    else:
        expected = (rows, _bytes_per_row(ggml_type, cols))
    if tuple(data.shape) != expected:
        raise ValueError(
            f"{what}: a {ggml_type_name(ggml_type)} tensor of shape {tuple(data.shape)} where "
            f"{expected} was expected ({rows} x {cols} values)"
        )
    return GGUFShard(data.to(device).contiguous().clone(), ggml_type, rows, cols)


class GGUFLinearMethod(LinearMethodBase):
    """A linear layer computed from GGUF blocks (see the module docstring).

    create_weights registers an empty `weight` parameter whose loader collects the shards;
    process_weights_after_loading joins them (one tensor when the types agree) into `weight`.
    """

    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs: Any,
    ) -> None:
        lay: Any = layer
        lay.gguf_partition_sizes = list(output_partition_sizes)
        lay.gguf_input_size = input_size_per_partition
        lay.gguf_loaded = [None] * len(output_partition_sizes)
        lay.gguf_shards = []
        weight = nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False)
        weight.weight_loader = partial(self.load_weight, layer)  # type: ignore[attr-defined]
        layer.register_parameter("weight", weight)

    # ---- loading ---------------------------------------------------------------------------
    def load_weight(
        self, module: nn.Module, param: nn.Parameter, loaded: torch.Tensor,
        shard_id: str | int | None = None,
    ) -> None:
        """Takes one GGUF tensor (tagged by ggml_tensor): a whole layer, or one shard of a
        merged one (shard_id 'q'/'k'/'v' or the index in output_sizes), and keeps this rank's
        rows (and columns, row-parallel) of it."""
        layer: Any = module  # a LinearBase with the attributes create_weights set
        ggml_type = ggml_type_of(loaded)
        sizes: list[int] = layer.gguf_partition_sizes
        tp_rank, tp_size = layer.tp_rank, layer.tp_size
        if shard_id is None and len(sizes) > 1:
            # An already-merged tensor: split it into its shards (whole rows of blocks).
            totals = [s * tp_size for s in sizes]
            if hasattr(layer, "num_kv_head_replicas"):  # QKV: kv heads may be replicated
                totals = [layer.total_num_heads * layer.head_size] + [
                    layer.total_num_kv_heads * layer.head_size
                ] * 2
            ids: list[str | int] = ["q", "k", "v"] if hasattr(layer, "num_kv_head_replicas") else (
                list(range(len(sizes)))
            )
            offset = 0
            for sid, total in zip(ids, totals, strict=True):
                part = ggml_tensor(loaded.narrow(0, offset, total), ggml_type)
                self.load_weight(module, param, part, sid)
                offset += total
            return
        if isinstance(shard_id, str):
            if shard_id not in ("q", "k", "v"):
                raise ValueError(f"QKV shard id must be 'q', 'k' or 'v', not {shard_id!r}")
            index = "qkv".index(shard_id)
            replicas = getattr(layer, "num_kv_head_replicas", 1)
            shard_rank = tp_rank if shard_id == "q" else tp_rank // replicas
        else:
            index = shard_id or 0
            if not 0 <= index < len(sizes):
                raise ValueError(f"shard id {shard_id} out of range for {len(sizes)} shards")
            shard_rank = tp_rank
        rows = sizes[index]
        cols = layer.gguf_input_size
        column_parallel = hasattr(layer, "output_sizes")
        if column_parallel and loaded.shape[0] != rows:
            loaded = loaded.narrow(0, shard_rank * rows, rows)
        row_parallel = hasattr(layer, "input_size_per_partition") and tp_size > 1
        if row_parallel:
            loaded = _narrow_columns(loaded, ggml_type, tp_rank * cols, cols)
        what = f"{getattr(layer, 'prefix', '') or type(layer).__name__} shard {index}"
        layer.gguf_loaded[index] = _to_shard(
            loaded, ggml_type, rows, cols, layer.params_dtype, param.device, what
        )

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        lay: Any = layer  # the attributes create_weights set
        shards: list[GGUFShard | None] = lay.gguf_loaded
        missing = [i for i, s in enumerate(shards) if s is None]
        if missing:
            raise ValueError(f"{getattr(layer, 'prefix', '')}: GGUF shards {missing} were not "
                             "loaded")
        loaded = [s for s in shards if s is not None]
        if len({s.ggml_type for s in loaded}) == 1:  # one type: one tensor, one product
            data = torch.cat([s.data for s in loaded]) if len(loaded) > 1 else loaded[0].data
            rows = sum(s.rows for s in loaded)
            loaded = [GGUFShard(data, loaded[0].ggml_type, rows, loaded[0].cols)]
        for shard in loaded:
            shard.repack_for_cpu()
        lay.gguf_shards = loaded
        lay.gguf_loaded = [None] * len(shards)
        # The parameter holds the layer's bytes (for memory accounting and .to()); with one
        # shard it is the shard's tensor itself.
        param: nn.Parameter = lay.weight
        if len(loaded) == 1:
            param.data = loaded[0].data
        else:
            param.data = torch.empty(0, dtype=torch.uint8)

    # ---- compute ---------------------------------------------------------------------------
    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        shards: list[GGUFShard] = layer.gguf_shards  # type: ignore[assignment]
        if not shards:
            raise RuntimeError(
                f"{getattr(layer, 'prefix', '')}: GGUF weights used before "
                "process_weights_after_loading"
            )
        x2 = x.reshape(-1, x.shape[-1])
        if len(shards) == 1:
            out = gguf_matmul(x2, shards[0])
        else:
            out = torch.cat([gguf_matmul(x2, s) for s in shards], dim=-1)
        if bias is not None:
            out += bias
        return out.view(*x.shape[:-1], out.shape[-1])


class GGUFEmbeddingMethod(QuantizeMethodBase):
    """The token embedding (and a tied LM head) from GGUF blocks: `weight` holds this rank's
    vocabulary rows as blocks, tagged with their GGML type; a lookup dequantizes only the rows
    it gathers, the LM head multiplies through the product ops."""

    def create_weights(
        self, layer: nn.Module, num_embeddings_per_partition: int, embedding_dim: int,
        params_dtype: torch.dtype, **extra: Any,
    ) -> None:
        weight = nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False)
        weight.weight_loader = partial(self.load_weight, layer)  # type: ignore[attr-defined]
        weight.gguf_shard = None  # type: ignore[attr-defined]
        layer.register_parameter("weight", weight)

    def load_weight(self, module: nn.Module, param: nn.Parameter, loaded: torch.Tensor) -> None:
        layer: Any = module  # a VocabParallelEmbedding
        ggml_type = ggml_type_of(loaded)
        if loaded.shape[0] != layer.num_embeddings:
            raise ValueError(
                f"Vocab size mismatch: the GGUF tensor has {loaded.shape[0]} rows, the model "
                f"expects {layer.num_embeddings}"
            )
        start, end = layer.vocab_start_index, layer.vocab_end_index
        part = loaded[start:end]
        pad = layer.num_embeddings_per_partition - (end - start)
        if pad:  # the last shard's padding rows: zeros (all-zero blocks decode to 0)
            part = torch.cat([part, part.new_zeros(pad, *part.shape[1:])])
        shard = _to_shard(
            part, ggml_type, layer.num_embeddings_per_partition, layer.embedding_dim,
            layer.params_dtype, param.device, type(layer).__name__,
        )
        param.data = shard.data
        param.gguf_shard = shard  # type: ignore[attr-defined]

    def _shard(self, layer: nn.Module) -> GGUFShard:
        shard: GGUFShard | None = getattr(layer.weight, "gguf_shard", None)
        if shard is None:
            raise RuntimeError(f"{type(layer).__name__}: GGUF embedding used before loading")
        return shard

    def embedding(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        """ids [T] (local rows) -> [T, embedding_dim] in the model's dtype."""
        shard = self._shard(layer)
        if shard.is_float:
            return F.embedding(ids, shard.data)
        if shard.repacked:
            rows = repacked_rows(shard.data, shard.ggml_type, shard.rows, shard.cols,
                                 ids.reshape(-1))
        else:
            rows = shard.data.index_select(0, ids.reshape(-1))
        dtype: torch.dtype = layer.params_dtype  # type: ignore[assignment]
        out = _ops.ggml_dequantize(rows, shard.ggml_type, rows.shape[0], shard.cols, dtype)
        return out.view(*ids.shape, shard.cols)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        shard: GGUFShard | None = getattr(layer.weight, "gguf_shard", None)
        if shard is not None:
            shard.repack_for_cpu(lookups=True)
            layer.weight.data = shard.data

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The LM head: x [N, embedding_dim] -> [N, num_embeddings_per_partition]."""
        out = gguf_matmul(x.reshape(-1, x.shape[-1]), self._shard(layer))
        if bias is not None:
            out += bias
        return out


@register_quantization_config("gguf")
class GGUFConfig(QuantizationConfig):
    """vLLM's "gguf": what a .gguf file runs with (ModelConfig sets it, as vLLM does): every
    linear and embedding layer keeps the file's blocks; norms and other small tensors are float.
    Mixture-of-experts experts (FusedMoE) are not GGUF layers: the loader dequantizes them to
    float, and they run as an unquantized model's (is_layer_skipped)."""

    @classmethod
    def get_name(cls) -> str:
        return "gguf"

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> GGUFConfig:
        return cls()

    def is_layer_skipped(self, prefix: str) -> bool:
        """FusedMoE experts (prefix ``*.experts``) load dequantized: gguf_loader hands them over
        as float matrices."""
        return prefix.endswith(".experts")

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        from pyorch.layers.vocab_embedding import VocabParallelEmbedding

        if isinstance(layer, LinearBase):
            return GGUFLinearMethod()
        if isinstance(layer, VocabParallelEmbedding):
            return GGUFEmbeddingMethod()
        return None
