"""The tensor-parallel layers on 2 CPU processes (gloo) against the same layers unsharded.

Every rank builds the layer twice from the same full checkpoint tensors: once sharded over the
group (rank and size from pyorch.distributed) and once whole (tp_size=1); the sharded layer's
output after its collective must equal the whole one's.
"""

from __future__ import annotations

import torch

from tests.pyorch.distributed.helpers import run_distributed


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def _load(layer: torch.nn.Module, tensors: dict[str, torch.Tensor], shard_id=None) -> None:
    for name, param in layer.named_parameters():
        loader = param.weight_loader
        if shard_id is None:
            loader(param, tensors[name])
        else:
            for sid, full in zip(shard_id, tensors[name], strict=True):
                loader(param, full, sid)


def _check_linears(rank: int, world_size: int) -> None:
    from pyorch.distributed import get_tensor_model_parallel_world_size
    from pyorch.layers.linear import (
        ColumnParallelLinear,
        MergedColumnParallelLinear,
        RowParallelLinear,
    )

    assert get_tensor_model_parallel_world_size() == world_size
    torch.manual_seed(0)  # the same checkpoint and inputs on every rank
    x = torch.randn(7, 24)
    whole = dict(tp_rank=0, tp_size=1)

    # Column-parallel with gather_output: the full output on every rank.
    w, b = torch.randn(10, 24), torch.randn(10)
    col = ColumnParallelLinear(24, 10, bias=True, gather_output=True)
    assert col.tp_size == world_size and col.weight.shape == (10 // world_size, 24)
    ref = ColumnParallelLinear(24, 10, bias=True, gather_output=True, **whole)
    for layer in (col, ref):
        _load(layer, {"weight": w, "bias": b})
    _close(col(x), ref(x))

    # Row-parallel: partial sums all-reduced, the bias added once; both input forms.
    w, b = torch.randn(6, 24), torch.randn(6)
    row = RowParallelLinear(24, 6, bias=True)
    row_whole_input = RowParallelLinear(24, 6, bias=True, input_is_parallel=False)
    ref = RowParallelLinear(24, 6, bias=True, **whole)
    for layer in (row, row_whole_input, ref):
        _load(layer, {"weight": w, "bias": b})
    part = 24 // world_size
    _close(row(x[:, rank * part : (rank + 1) * part]), ref(x))
    _close(row_whole_input(x), ref(x))
    no_reduce = RowParallelLinear(24, 6, bias=False, reduce_results=False)
    _load(no_reduce, {"weight": w})
    partial = no_reduce(x[:, rank * part : (rank + 1) * part])
    _close(partial, x[:, rank * part : (rank + 1) * part] @ w[:, rank * part : (rank + 1) * part].T)

    # An MLP: merged gate/up (column) then down (row), loaded per checkpoint shard.
    gate, up, down = torch.randn(16, 24), torch.randn(16, 24), torch.randn(24, 16)
    gate_up = MergedColumnParallelLinear(24, [16, 16], bias=False)
    gate_up_ref = MergedColumnParallelLinear(24, [16, 16], bias=False, **whole)
    down_tp, down_ref = RowParallelLinear(16, 24, bias=False), RowParallelLinear(16, 24, bias=False,
                                                                               **whole)
    for layer in (gate_up, gate_up_ref):
        _load(layer, {"weight": (gate, up)}, shard_id=(0, 1))
    for layer in (down_tp, down_ref):
        _load(layer, {"weight": down})

    def mlp(gu: torch.nn.Module, dn: torch.nn.Module) -> torch.Tensor:
        g, u = gu(x).chunk(2, dim=-1)
        return dn(torch.nn.functional.silu(g) * u)

    _close(mlp(gate_up, down_tp), mlp(gate_up_ref, down_ref))


def _check_qkv_kv_replication(rank: int, world_size: int) -> None:
    """One KV head over two ranks: both hold it whole; q heads are split."""
    from pyorch.layers.linear import QKVParallelLinear

    torch.manual_seed(0)
    head, heads, kv_heads = 8, 4, 1
    q, k, v = torch.randn(heads * head, 32), torch.randn(head, 32), torch.randn(head, 32)
    bq, bk, bv = torch.randn(heads * head), torch.randn(head), torch.randn(head)
    qkv = QKVParallelLinear(32, head, heads, kv_heads, bias=True)
    assert (qkv.num_heads, qkv.num_kv_heads, qkv.num_kv_head_replicas) == (2, 1, 2)
    for name, parts in (("weight", (q, k, v)), ("bias", (bq, bk, bv))):
        param = getattr(qkv, name)
        for sid, full in zip("qkv", parts, strict=True):
            qkv.weight_loader(param, full, sid)
    x = torch.randn(5, 32)
    out = qkv(x)
    q_rows = slice(rank * 2 * head, (rank + 1) * 2 * head)
    expected = torch.cat([x @ q[q_rows].T + bq[q_rows], x @ k.T + bk, x @ v.T + bv], dim=-1)
    _close(out, expected)


def _check_vocab_parallel(rank: int, world_size: int) -> None:
    """A vocabulary that does not split evenly (37 over 2): embedding and gathered logits."""
    from pyorch.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding

    torch.manual_seed(0)
    vocab, dim = 37, 12
    table, head_w = torch.randn(vocab, dim), torch.randn(vocab, dim)
    emb, emb_ref = VocabParallelEmbedding(vocab, dim), VocabParallelEmbedding(vocab, dim, tp_rank=0,
                                                                             tp_size=1)
    head, head_ref = ParallelLMHead(vocab, dim), ParallelLMHead(vocab, dim, tp_rank=0, tp_size=1)
    assert emb.weight.shape == (19, dim)
    for layer, w in ((emb, table), (emb_ref, table), (head, head_w), (head_ref, head_w)):
        layer.weight_loader(layer.weight, w)
    ids = torch.tensor([0, 18, 19, 36, 5, 20, 36])
    _close(emb(ids), table[ids])
    _close(emb(ids), emb_ref(ids))
    hidden = torch.randn(4, dim)
    logits = head.compute_logits(hidden)
    assert logits.shape == (4, vocab) and logits.dtype == torch.float32
    _close(logits, head_ref.compute_logits(hidden))
    _close(logits, hidden @ head_w.T)
    # Tied: the head shares the embedding's shard.
    tied = ParallelLMHead(vocab, dim).tie_weights(emb)
    _close(tied.compute_logits(hidden), hidden @ table.T)


def _check_all_layers(rank: int, world_size: int) -> None:
    _check_linears(rank, world_size)
    _check_qkv_kv_replication(rank, world_size)
    _check_vocab_parallel(rank, world_size)


def test_parallel_layers_match_unsharded_on_two_cpu_ranks():
    run_distributed(_check_all_layers, 2)
