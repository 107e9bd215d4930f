"""The fused all-reduce + residual add + RMSNorm's CPU path (gloo, 2 processes): the same
result as the all-reduce then RMSNorm, residual updated in place; and the decoder layers defer
their row-parallel reductions into it only under tensor parallelism."""

from __future__ import annotations

import torch

from tests.pyorch.distributed.helpers import run_distributed


def _check_all_reduce_rms_norm(rank: int, world_size: int) -> None:
    import torch.distributed as dist

    from pyorch.distributed.communication_op import (
        fuse_all_reduce_rms_norm,
        tensor_model_parallel_all_reduce_rms_norm,
    )
    from pyorch.layers.layernorm import RMSNorm

    assert fuse_all_reduce_rms_norm()
    torch.manual_seed(0)  # residual and weight: the same on every rank
    norm = RMSNorm(64, eps=1e-5)
    norm.weight.data = torch.rand(64) + 0.5
    residual = torch.randn(3, 64)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(10 + rank))
    parts = [torch.empty_like(x) for _ in range(world_size)]
    dist.all_gather(parts, x)
    total = sum(parts[1:], parts[0].clone())
    want, want_residual = norm.forward_native(total, residual.clone())
    got, got_residual = tensor_model_parallel_all_reduce_rms_norm(x.clone(), residual, norm)
    assert got_residual is residual  # updated in place
    torch.testing.assert_close(got_residual, want_residual)
    torch.testing.assert_close(got, want)


def _check_layers_defer(rank: int, world_size: int) -> None:
    import transformers

    from pyorch.models.llama import LlamaDecoderLayer, LlamaMLP
    from pyorch.models.qwen2_moe import Qwen2MoeForCausalLM

    config = transformers.Qwen2MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, shared_expert_intermediate_size=32, mlp_only_layers=[0])
    model = Qwen2MoeForCausalLM(config)
    dense, sparse = model.model.layers
    assert isinstance(dense, LlamaDecoderLayer) and isinstance(dense.mlp, LlamaMLP)
    # Both layers leave o_proj to post_attention_layernorm; only the dense MLP defers down_proj.
    for layer in (dense, sparse):
        assert not layer.self_attn.o_proj.reduce_results and not layer.attn_output_reduced
    assert not dense.mlp.down_proj.reduce_results and not dense.mlp_output_reduced
    assert sparse.mlp_output_reduced


def test_all_reduce_rms_norm_on_two_cpu_ranks():
    run_distributed(_check_all_reduce_rms_norm, 2)


def test_decoder_layers_defer_row_parallel_reductions_under_tp():
    run_distributed(_check_layers_defer, 2)


def test_one_rank_layers_reduce_as_before():
    from pyorch.models.llama import LlamaForCausalLM
    from tests.pyorch.entrypoints.test_llm import _tiny_config

    model = LlamaForCausalLM(_tiny_config("llama"))
    for layer in model.model.layers:
        assert layer.self_attn.o_proj.reduce_results and layer.attn_output_reduced
        assert layer.mlp.down_proj.reduce_results and layer.mlp_output_reduced


def test_the_environment_switch_turns_the_deferral_off(monkeypatch):
    monkeypatch.setenv("PYORCH_FUSED_ALLREDUCE_RMS_NORM", "0")
    run_distributed(_check_no_deferral, 2)


def _check_no_deferral(rank: int, world_size: int) -> None:
    from pyorch.distributed.communication_op import fuse_all_reduce_rms_norm
    from pyorch.models.llama import LlamaForCausalLM
    from tests.pyorch.entrypoints.test_llm import _tiny_config

    assert not fuse_all_reduce_rms_norm()
    layer = LlamaForCausalLM(_tiny_config("llama")).model.layers[0]
    assert layer.self_attn.o_proj.reduce_results and layer.mlp.down_proj.reduce_results


def _leave_in_order(rank: int, world_size: int) -> None:
    import time

    from pyorch.distributed import parallel_state

    if rank != 0:
        time.sleep(2.0)  # rank 1 leaves late
    start = time.monotonic()
    parallel_state.destroy_model_parallel()
    if rank == 0:
        # Rank 0 hosts the rendezvous store: it leaves only once rank 1 has (its 2 s sleep),
        # never more than _LEAVE_TIMEOUT_S later.
        waited = time.monotonic() - start
        assert 1.0 <= waited <= parallel_state._LEAVE_TIMEOUT_S + 1.0, waited


def test_rank_zero_leaves_the_process_group_last():
    """destroy_model_parallel: rank 0 (the TCPStore's host) waits for the others to leave, so
    no rank's NCCL heartbeat monitor is left polling a store that is gone."""
    run_distributed(_leave_in_order, 2)
