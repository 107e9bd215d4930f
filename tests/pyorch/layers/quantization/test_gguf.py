"""The "gguf" quantization method on single layers: GGUF blocks loaded per shard (types may
differ), split over tensor-parallel ranks, and computed from through the ggml ops.

Weights are real GGUF tensors (tests/reference/gguf.make_weight); references dequantize them with
the gguf package and quantize the activation as the kernels do (tests/reference/gguf.py).
"""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize

from pyorch import _ops
from pyorch.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from pyorch.layers.quantization import gguf as gguf_method
from pyorch.layers.quantization.gguf import (
    MMVQ_MAX_TOKENS,
    GGUFConfig,
    GGUFLinearMethod,
    ggml_tensor,
)
from pyorch.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from tests.reference import gguf as ref


def tensor(qtype: Q, rows: int, cols: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(tagged GGUF tensor as the loader yields it, its float64 values)."""
    raw = ref.make_weight(qtype, rows, cols, np.random.default_rng(seed))
    values = torch.from_numpy(gguf_dequantize(raw, qtype).astype(np.float64)).reshape(rows, cols)
    if qtype in (Q.F32, Q.F16, Q.BF16):
        return ggml_tensor(values.to(torch.float32), int(qtype)), values
    return ggml_tensor(torch.from_numpy(raw.copy()), int(qtype)), values


def expected(x: torch.Tensor, w: torch.Tensor, quantized: bool) -> torch.Tensor:
    xs = ref.quantize_activation(x) if quantized else x.double()
    return xs @ w.T


def check(out: torch.Tensor, x: torch.Tensor, parts: list[tuple[torch.Tensor, bool]]) -> None:
    """out [N, sum rows] against each part (values [rows, cols], quantized?) side by side."""
    ref_out = torch.cat([expected(x, w, q) for w, q in parts], dim=-1)
    bound = 1e-5 * torch.cat([x.double().abs() @ w.abs().T for w, _ in parts], dim=-1) + 1e-6
    assert ((out.double() - ref_out).abs() <= bound).all()


def gguf_layer(cls, *args, **kwargs):
    return cls(*args, quant_method=GGUFLinearMethod(), **kwargs)


@pytest.mark.parametrize("num_tokens", [1, MMVQ_MAX_TOKENS, MMVQ_MAX_TOKENS + 3])
def test_qkv_shards_of_different_types(num_tokens: int) -> None:
    # q Q4_1, k Q8_0, v F32 (float stays float): three products, side by side.
    hidden, head, heads, kv_heads = 64, 32, 4, 2
    layer = gguf_layer(QKVParallelLinear, hidden, head, heads, kv_heads, bias=False)
    q, qv = tensor(Q.Q4_1, heads * head, hidden, 1)
    k, kv = tensor(Q.Q8_0, kv_heads * head, hidden, 2)
    v, vv = tensor(Q.F32, kv_heads * head, hidden, 3)
    for shard_id, t in (("q", q), ("k", k), ("v", v)):
        layer.weight.weight_loader(layer.weight, t, shard_id)
    layer.quant_method.process_weights_after_loading(layer)
    assert [s.ggml_type for s in layer.gguf_shards] == [Q.Q4_1, Q.Q8_0, Q.F32]
    x = torch.randn(num_tokens, hidden)
    out = layer(x)
    assert out.shape == (num_tokens, (heads + 2 * kv_heads) * head)
    check(out, x, [(qv, True), (kv, True), (vv, False)])


def test_same_type_shards_are_joined_and_the_kernel_follows_the_token_count(monkeypatch) -> None:
    monkeypatch.setenv("PYORCH_GGUF_CPU_REPACK", "0")  # the file-layout kernels (on the CPU)
    layer = gguf_layer(MergedColumnParallelLinear, 64, [96, 32], bias=True)
    gate, gv = tensor(Q.Q5_0, 96, 64, 4)
    up, uv = tensor(Q.Q5_0, 32, 64, 5)
    layer.weight.weight_loader(layer.weight, gate, 0)
    layer.weight.weight_loader(layer.weight, up, 1)
    bias = torch.randn(128)
    layer.weight_loader(layer.bias, bias)
    layer.quant_method.process_weights_after_loading(layer)
    assert len(layer.gguf_shards) == 1 and layer.weight.shape == (128, 2 * 22)
    calls: list[str] = []
    for name in ("ggml_mul_mat_vec_a8", "ggml_mul_mat_a8"):
        real = getattr(_ops, name)
        monkeypatch.setattr(
            _ops, name, lambda *a, _n=name, _r=real: (calls.append(_n), _r(*a))[1]
        )
    for n in (MMVQ_MAX_TOKENS, MMVQ_MAX_TOKENS + 1):
        x = torch.randn(n, 64)
        out = layer(x)
        check(out - bias, x, [(gv, True), (uv, True)])
    assert calls == ["ggml_mul_mat_vec_a8", "ggml_mul_mat_a8"]


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q8_0, Q.Q6_K])
@pytest.mark.parametrize("chunk_rows", [1, 7, 48, 1000])
def test_dequantize_matmul_in_row_chunks(qtype: Q, chunk_rows: int) -> None:
    # The many-token GPU path: blocks dequantized to x's dtype a chunk of rows at a time (the
    # last chunk partial for 7), then a float matmul; x is not quantized on this path.
    rows, cols = 48, 512
    w, wv = tensor(qtype, rows, cols, 11)
    shard = gguf_method.GGUFShard(w, int(qtype), rows, cols)
    x = torch.randn(MMVQ_MAX_TOKENS + 5, cols)
    out = gguf_method.dequantize_matmul(x, shard, chunk_bytes=chunk_rows * cols * 4)
    assert out.shape == (x.shape[0], rows) and out.dtype == x.dtype
    check(out, x, [(wv, False)])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_many_tokens_on_cuda_dequantize_and_use_cublas_above_32(monkeypatch) -> None:
    rows, cols = 96, 256
    w, wv = tensor(Q.Q4_K, rows, cols, 12)
    shard = gguf_method.GGUFShard(w.cuda(), int(Q.Q4_K), rows, cols)
    calls: list[str] = []
    for name in ("ggml_mul_mat_vec_a8", "ggml_mul_mat_a8", "ggml_dequantize"):
        real = getattr(_ops, name)
        monkeypatch.setattr(
            _ops, name, lambda *a, _n=name, _r=real: (calls.append(_n), _r(*a))[1]
        )
    limit = gguf_method.MMQ_MAX_TOKENS_CUDA
    for n in (MMVQ_MAX_TOKENS, MMVQ_MAX_TOKENS + 1, limit, limit + 1, 64):
        x = torch.randn(n, cols, device="cuda")
        out = gguf_method.gguf_matmul(x, shard)
        check(out.cpu(), x.cpu(), [(wv, n <= limit)])  # the int8 kernels quantize x
    assert calls == ["ggml_mul_mat_vec_a8", "ggml_mul_mat_a8", "ggml_mul_mat_a8",
                     "ggml_dequantize", "ggml_dequantize"]


@pytest.mark.parametrize("tp_size", [2, 4])
def test_tensor_parallel_shards_of_blocks(tp_size: int) -> None:
    # Column-parallel: rank r's output is columns r of the whole; row-parallel: the ranks'
    # partial products sum to the whole (block-aligned input split).
    w, wv = tensor(Q.Q4_0, 48, 256, 6)
    x = torch.randn(3, 256)
    col_parts, row_sum = [], torch.zeros(3, 48, dtype=torch.float64)
    for rank in range(tp_size):
        col = gguf_layer(ColumnParallelLinear, 256, 48, bias=False, tp_rank=rank, tp_size=tp_size)
        col.weight.weight_loader(col.weight, w)
        col.quant_method.process_weights_after_loading(col)
        col_parts.append(col(x))
        row = gguf_layer(RowParallelLinear, 256, 48, bias=False, tp_rank=rank, tp_size=tp_size)
        row.weight.weight_loader(row.weight, w)
        row.quant_method.process_weights_after_loading(row)
        size = 256 // tp_size
        xs = x[:, rank * size : (rank + 1) * size]
        part = row.quant_method.apply(row, xs)
        check(part, xs, [(wv[:, rank * size : (rank + 1) * size], True)])
        row_sum += part.double()
    check(torch.cat(col_parts, dim=-1), x, [(wv, True)])
    # The ranks' partial sums use per-rank activation scales: compare with the float product.
    assert torch.allclose(row_sum, x.double() @ wv.T, atol=0.05)


def test_kv_heads_replicated_over_ranks() -> None:
    # 4 ranks, 2 kv heads: ranks 0-1 hold kv head 0, ranks 2-3 kv head 1.
    hidden, head = 64, 32
    k, kv = tensor(Q.Q8_0, 2 * head, hidden, 7)
    x = torch.randn(2, hidden)
    for rank in range(4):
        layer = gguf_layer(QKVParallelLinear, hidden, head, 4, 2, bias=False, tp_rank=rank,
                           tp_size=4)
        q, qv = tensor(Q.Q4_1, 4 * head, hidden, 8)
        layer.weight.weight_loader(layer.weight, q, "q")
        layer.weight.weight_loader(layer.weight, k, "k")
        layer.weight.weight_loader(layer.weight, k, "v")
        layer.quant_method.process_weights_after_loading(layer)
        kh = kv[(rank // 2) * head : (rank // 2 + 1) * head]
        check(layer(x), x, [(qv[rank * head : (rank + 1) * head], True), (kh, True), (kh, True)])


def test_loading_errors() -> None:
    layer = gguf_layer(ReplicatedLinear, 64, 32, bias=False)
    with pytest.raises(ValueError, match="untagged tensor"):
        layer.weight.weight_loader(layer.weight, torch.zeros(32, 40, dtype=torch.uint8))
    with pytest.raises(ValueError, match="IQ2_XXS|GGML type 16 is not supported"):
        ggml_tensor(torch.zeros(32, 66, dtype=torch.uint8), int(Q.IQ2_XXS))
    w, _ = tensor(Q.Q4_1, 32, 96, 9)
    with pytest.raises(ValueError, match=r"shape \(32, 60\) where \(32, 40\) was expected"):
        layer.weight.weight_loader(layer.weight, w)
    with pytest.raises(ValueError, match="shards \\[0\\] were not loaded"):
        layer.quant_method.process_weights_after_loading(layer)
    with pytest.raises(RuntimeError, match="before process_weights_after_loading"):
        layer(torch.randn(1, 64))
    row = gguf_layer(RowParallelLinear, 64, 32, bias=False, tp_rank=1, tp_size=4)
    w, _ = tensor(Q.Q4_1, 32, 64, 10)
    with pytest.raises(ValueError, match="cuts Q4_1 blocks of 32"):
        row.weight.weight_loader(row.weight, w)


@pytest.mark.parametrize("tp_size", [1, 2])
def test_embedding_gathers_and_dequantizes_rows(tp_size: int) -> None:
    vocab, dim = 37, 64  # 37 rows: the last rank's shard is padded
    table, values = tensor(Q.Q8_0, vocab, dim, 11)
    ids = torch.tensor([0, 36, 5, 5, 18])
    total = torch.zeros(len(ids), dim)
    for rank in range(tp_size):
        emb = VocabParallelEmbedding(vocab, dim, tp_rank=rank, tp_size=tp_size,
                                     quant_config=GGUFConfig())
        emb.weight.weight_loader(emb.weight, table)
        assert emb.weight.dtype == torch.uint8  # blocks, no float copy
        in_range = (ids >= emb.vocab_start_index) & (ids < emb.vocab_end_index)
        local = torch.where(in_range, ids - emb.vocab_start_index, 0)
        rows = emb.quant_method.embedding(emb, local)
        total += rows * in_range.unsqueeze(-1)
    assert torch.equal(total, values[ids].float())


def test_tied_lm_head_multiplies_the_embedding_blocks() -> None:
    vocab, dim = 50, 64
    table, values = tensor(Q.Q8_0, vocab, dim, 12)
    emb = VocabParallelEmbedding(vocab, dim, quant_config=GGUFConfig())
    emb.weight.weight_loader(emb.weight, table)
    head = ParallelLMHead(vocab, dim, quant_config=GGUFConfig()).tie_weights(emb)
    x = torch.randn(3, dim)
    logits = head.compute_logits(x)
    assert logits.shape == (3, vocab) and logits.dtype == torch.float32
    check(logits, x, [(values, True)])
    assert torch.equal(emb(torch.tensor([7, 3])), values[[7, 3]].float())


def test_config_names_the_method() -> None:
    config = GGUFConfig.from_config({})
    assert config.get_name() == "gguf"
    assert isinstance(config.get_quant_method(ReplicatedLinear(8, 8), "x"), GGUFLinearMethod)
    assert config.get_quant_method(torch.nn.LayerNorm(4), "norm") is None
    assert gguf_method.DEQUANT_ONLY_TYPES == {}  # every loadable type has a product kernel


def test_a_gguf_file_runs_with_the_gguf_method() -> None:
    from pyorch.config import ModelConfig
    from pyorch.model_loader import default_model_path

    try:
        path = default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    config = ModelConfig(model=path)
    config.resolve()
    assert config.quantization == "gguf"
    with pytest.raises(ValueError, match="a GGUF file runs with quantization 'gguf', not 'fp8'"):
        ModelConfig(model=path, quantization="fp8").resolve()


# ---- the CPU's repacked layout -------------------------------------------------------------------
@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0])
def test_repack_blocks_layout_and_inverse(qtype: Q) -> None:
    rows, cols = 24, 96
    raw = torch.from_numpy(ref.make_weight(qtype, rows, cols, np.random.default_rng(21)))
    packed = gguf_method.repack_blocks(raw, int(qtype), rows, cols)
    assert packed.shape == (rows // 8, raw.numel() // (rows // 8))  # the same bytes
    header, quants = gguf_method.REPACK_TYPES[int(qtype)]
    block = packed[1, 8 * (header + quants):16 * (header + quants)]  # group 1, block 1
    for i in range(8):
        src = raw[8 + i, header + quants:2 * (header + quants)]  # row 8 + i, block 1
        for h in range(0, header, 2):  # scale (and min): field h / 2 of every row, in order
            assert torch.equal(block[8 * h + 2 * i:8 * h + 2 * i + 2], src[h:h + 2])
        for k in range(quants // 4):
            at = 8 * header + 32 * k + 4 * i
            assert torch.equal(block[at:at + 4], src[header + 4 * k:header + 4 * k + 4])
    ids = torch.tensor([23, 0, 9, 9, 16])
    assert torch.equal(gguf_method.repacked_rows(packed, int(qtype), rows, cols, ids), raw[ids])
    assert not gguf_method.can_repack(int(qtype), 20, cols)
    assert not gguf_method.can_repack(int(Q.F16), 24, 256)
    with pytest.raises(ValueError, match="no repacked layout for 20 rows"):
        gguf_method.repack_blocks(raw[:20], int(qtype), 20, cols)


@pytest.mark.parametrize("repack", [True, False])
@pytest.mark.parametrize("num_tokens", [1, MMVQ_MAX_TOKENS + 3])
def test_cpu_layers_are_repacked_at_load(monkeypatch, repack: bool, num_tokens: int) -> None:
    # gate_up: Q4_1 joined shards (96 + 32 rows): repacked, one product on the repacked kernel
    # at every token count. PYORCH_GGUF_CPU_REPACK=0 keeps the file's layout.
    monkeypatch.setenv("PYORCH_GGUF_CPU_REPACK", "1" if repack else "0")
    layer = gguf_layer(MergedColumnParallelLinear, 64, [96, 32], bias=False)
    gate, gv = tensor(Q.Q4_1, 96, 64, 22)
    up, uv = tensor(Q.Q4_1, 32, 64, 23)
    layer.weight.weight_loader(layer.weight, gate, 0)
    layer.weight.weight_loader(layer.weight, up, 1)
    layer.quant_method.process_weights_after_loading(layer)
    (shard,) = layer.gguf_shards
    assert shard.repacked == repack
    assert layer.weight.data_ptr() == shard.data.data_ptr()  # one copy of the bytes
    calls: list[str] = []
    for name in ("ggml_mul_mat_vec_a8", "ggml_mul_mat_a8", "ggml_mul_mat_repacked_a8"):
        real = getattr(_ops, name)
        monkeypatch.setattr(
            _ops, name, lambda *a, _n=name, _r=real: (calls.append(_n), _r(*a))[1]
        )
    x = torch.randn(num_tokens, 64)
    check(layer(x), x, [(gv, True), (uv, True)])
    plain = "ggml_mul_mat_vec_a8" if num_tokens <= MMVQ_MAX_TOKENS else "ggml_mul_mat_a8"
    assert calls == ["ggml_mul_mat_repacked_a8" if repack else plain]


def test_cpu_rows_not_in_groups_of_8_keep_the_file_layout() -> None:
    layer = gguf_layer(ReplicatedLinear, 64, 36, bias=False)
    w, wv = tensor(Q.Q8_0, 36, 64, 24)
    layer.weight.weight_loader(layer.weight, w)
    layer.quant_method.process_weights_after_loading(layer)
    assert not layer.gguf_shards[0].repacked
    x = torch.randn(2, 64)
    check(layer(x), x, [(wv, True)])


def test_repacked_tied_embedding_gathers_rows_and_computes_logits() -> None:
    from pyorch.model_loader.loader import process_weights_after_loading

    vocab, dim = 56, 64
    table, values = tensor(Q.Q8_0, vocab, dim, 25)
    emb = VocabParallelEmbedding(vocab, dim, quant_config=GGUFConfig())
    emb.weight.weight_loader(emb.weight, table)
    head = ParallelLMHead(vocab, dim, quant_config=GGUFConfig()).tie_weights(emb)
    process_weights_after_loading(torch.nn.ModuleList([emb, head]))
    assert emb.weight.gguf_shard.repacked
    ids = torch.tensor([55, 7, 3, 7, 0])
    assert torch.equal(emb(ids), values[ids].float())
    x = torch.randn(3, dim)
    check(head.compute_logits(x), x, [(values, True)])


@pytest.mark.parametrize("qtype,group_bytes",
                         [(Q.Q2_K, 672), (Q.Q3_K, 912), (Q.Q4_K, 1184), (Q.Q5_K, 1440),
                          (Q.Q6_K, 1680)])
def test_k_quant_layers_repack_and_their_embeddings_keep_the_file_layout(
    qtype: Q, group_bytes: int
) -> None:
    from pyorch.model_loader.loader import process_weights_after_loading

    layer = gguf_layer(ReplicatedLinear, 512, 24, bias=False)
    w, wv = tensor(qtype, 24, 512, 26)
    layer.weight.weight_loader(layer.weight, w)
    layer.quant_method.process_weights_after_loading(layer)
    (shard,) = layer.gguf_shards
    assert shard.repacked and shard.data.numel() == 24 // 8 * 2 * group_bytes  # Q3_K/Q4_K: +4/3%
    for n in (1, 7):
        x = torch.randn(n, 512)
        check(layer(x), x, [(wv, True)])
    vocab, dim = 40, 256
    table, values = tensor(qtype, vocab, dim, 27)
    emb = VocabParallelEmbedding(vocab, dim, quant_config=GGUFConfig())
    emb.weight.weight_loader(emb.weight, table)
    process_weights_after_loading(torch.nn.ModuleList([emb]))
    assert not emb.weight.gguf_shard.repacked  # repacked_rows reads back the 32-value types only
    assert torch.equal(emb(torch.tensor([39, 2])), values[[39, 2]].float())


@pytest.mark.parametrize("num_tokens", [1, 5])
def test_fused_cpu_products_over_shards_of_different_types(num_tokens: int) -> None:
    # A Q4_K_M file's merged layers: q/k Q4_K with v Q6_K (qkv keeps three shards; norm + bias
    # fused into each shard's columns), gate Q4_K with up Q6_K (SiLU-and-mul after the shards).
    from pyorch.layers import fused_linear
    from pyorch.layers.layernorm import RMSNorm

    hidden, head, heads, kv_heads = 256, 32, 4, 2
    qkv = gguf_layer(QKVParallelLinear, hidden, head, heads, kv_heads, bias=True)
    parts = {"q": tensor(Q.Q4_K, heads * head, hidden, 31),
             "k": tensor(Q.Q4_K, kv_heads * head, hidden, 32),
             "v": tensor(Q.Q6_K, kv_heads * head, hidden, 33)}
    for sid, (t, _) in parts.items():
        qkv.weight.weight_loader(qkv.weight, t, sid)
    bias = torch.randn((heads + 2 * kv_heads) * head)
    qkv.weight_loader(qkv.bias, bias)
    qkv.quant_method.process_weights_after_loading(qkv)
    gate_up = gguf_layer(MergedColumnParallelLinear, hidden, [64, 64], bias=False)
    gate, gv = tensor(Q.Q4_K, 64, hidden, 34)
    up, uv = tensor(Q.Q6_K, 64, hidden, 35)
    gate_up.weight.weight_loader(gate_up.weight, gate, 0)
    gate_up.weight.weight_loader(gate_up.weight, up, 1)
    gate_up.quant_method.process_weights_after_loading(gate_up)
    assert len(qkv.gguf_shards) == 3 and len(gate_up.gguf_shards) == 2
    assert fused_linear.skinny_fusable(qkv) and fused_linear.skinny_fusable(gate_up)
    norm = RMSNorm(hidden, eps=1e-6)
    norm.weight.data = 1 + 0.2 * torch.randn(hidden)
    x = 4 * torch.randn(num_tokens, hidden)
    normed = norm(x.clone())
    out = fused_linear.norm_linear(x, norm, qkv)
    check(out - bias, normed, [(v, True) for _, v in parts.values()])
    act = fused_linear.norm_linear(x, norm, gate_up, "silu_and_mul")
    y = expected(normed, torch.cat([gv, uv]), True)
    want = torch.nn.functional.silu(y[:, :64]) * y[:, 64:]
    scale = (normed.double().abs() @ torch.cat([gv, uv]).abs().T).max().item()
    torch.testing.assert_close(act.double(), want, rtol=0, atol=1e-5 * scale * (1 + scale))


def test_fused_cpu_one_shard_call_follows_reloaded_weights() -> None:
    # fused_linear caches a one-shard layer's (data, type, rows, bias) beside its shard list:
    # norm_linear / linear_add_ run it, and a reload (a new shard list) is read afresh.
    from pyorch.layers import fused_linear
    from pyorch.layers.layernorm import RMSNorm

    def load(layer, qtype, seed):
        t, values = tensor(qtype, 48, 256, seed)
        layer.weight.weight_loader(layer.weight, t)
        layer.quant_method.process_weights_after_loading(layer)
        return values

    layer = gguf_layer(ReplicatedLinear, 256, 48, bias=True)
    layer.bias.data = torch.randn(48)
    values = load(layer, Q.Q4_K, 41)
    assert len(layer.gguf_shards) == 1 and layer.gguf_shards[0].repacked
    norm = RMSNorm(256, eps=1e-6)
    x = 3 * torch.randn(2, 256)
    normed = norm(x.clone())
    check(fused_linear.norm_linear(x, norm, layer) - layer.bias, normed, [(values, True)])
    residual = torch.randn(2, 48)
    out = fused_linear.linear_add_(residual.clone(), x, layer)
    check(out - residual - layer.bias, x, [(values, True)])
    values = load(layer, Q.Q6_K, 42)  # reloaded: another type, another shard list
    check(fused_linear.norm_linear(x, norm, layer) - layer.bias, normed, [(values, True)])
