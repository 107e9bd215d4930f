"""GGUF references: real blocks to test with, and the 8-bit activation of the product kernels.

Dequantization itself is never re-implemented here: tests use ``gguf.quants.dequantize``.
"""

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize as gguf_quantize

# Types gguf's own quantizer writes.
QUANTIZABLE = {Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0}
# Byte offsets of the fp16 scale fields of the K-quant blocks (random bytes there could be inf).
K_FP16_FIELDS = {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}


def block_size(qtype: Q) -> int:
    return GGML_QUANT_SIZES[qtype][0]


def make_weight(qtype: Q, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """[rows, cols / block_size * type_size] uint8: a GGUF tensor of fresh random values."""
    values = rng.standard_normal((rows, cols), dtype=np.float32) * cols**-0.5
    if qtype == Q.F32:
        return values.view(np.uint8)
    if qtype == Q.F16:
        return values.astype(np.float16).view(np.uint8)
    if qtype == Q.BF16:
        bits = (values.view(np.uint32) >> 16).astype(np.uint16)
        return bits.view(np.uint8)
    if qtype in QUANTIZABLE:
        return gguf_quantize(values, qtype)
    bs, ts = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(rows * cols // bs, ts), dtype=np.uint8)
    for offset in K_FP16_FIELDS[qtype]:
        scale = rng.uniform(0.001, 0.01, size=blocks.shape[0]).astype(np.float16)
        blocks[:, offset : offset + 2] = scale.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def quantize_activation(x: torch.Tensor) -> torch.Tensor:
    """x [num_tokens, cols] as the product kernels see it, float64: per 32 values
    dx = max|x| / 127 and qx = round(x / dx) (computed as x * (1 / dx) in fp32, half to even)."""
    xf = x.detach().cpu().float().reshape(x.shape[0], -1, 32)
    d = xf.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    q = torch.round(xf * inv)
    return (q.double() * d.double()).reshape(x.shape)


def dequantized_weights(path: str):
    """(HF name, float32 tensor) of a GGUF file, the blocks that the GGUF loader keeps decoded by
    the gguf package: the float reference model's weights."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from pyorch.model_loader.gguf_loader import iterate_gguf_weights

    for name, weight in iterate_gguf_weights(path):
        ggml_type = getattr(weight, "ggml_type", None)
        if weight.dtype == torch.uint8 and ggml_type is not None:
            cols = weight.shape[1] // GGML_QUANT_SIZES[ggml_type][1] * block_size(ggml_type)
            values = dequantize(weight.numpy(), GGMLQuantizationType(ggml_type))
            weight = torch.from_numpy(np.ascontiguousarray(values)).reshape(-1, cols)
        yield name, weight.float()


def llama_family_writer(path, arch: str, *, layers: int, hidden: int, inter: int, heads: int,
                        kv_heads: int, head_dim: int, rope_base: float):
    """A gguf-py GGUFWriter with the metadata llama.cpp's converter writes for a Llama-family
    decoder (block count, context 2048, widths, heads, RMSNorm eps 1e-6, rope base); the caller
    adds its own keys and tensors, then `finish_gguf`."""
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(layers)
    writer.add_context_length(2048)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(rope_base)
    return writer


def finish_gguf(writer) -> None:
    """Header, metadata and tensors to the file, then close it."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
