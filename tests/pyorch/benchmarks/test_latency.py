"""`pyorch bench latency` on a tiny random-weight Llama: medians, floors, the GEMM chain."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from pyorch.benchmarks import common, latency
from tests.pyorch.benchmarks.conftest import ENGINE_FLAGS, TINY


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    latency.add_cli_args(parser)
    return parser.parse_args(argv)


def test_defaults():
    args = _parse([])
    assert (args.batch_size, args.input_len, args.output_len) == (1, 32, 128)
    assert args.num_iters >= 1 and args.num_iters_warmup >= 0


def test_copy_bandwidth_counts_read_and_written():
    r = latency.copy_bandwidth(torch.device("cpu"), 1 << 20, iters=3)
    assert r["buffer_bytes"] == 1 << 20
    assert r["bytes_per_s"] == pytest.approx(2 * (1 << 20) / r["median_s"])


def test_gemm_chain_shapes_and_flops():
    weights = [torch.randn(24, 16), torch.randn(16, 24), torch.randn(40, 16)]
    r = latency.gemm_chain(weights, batch=3, device=torch.device("cpu"), iters=2)
    assert r["num_gemms"] == 3
    assert r["flops"] == 2 * 3 * (24 * 16 + 16 * 24 + 40 * 16)
    assert r["weight_bytes"] == 4 * (24 * 16 + 16 * 24 + 40 * 16)
    assert r["eager_ms"] > 0 and "cuda_graph_ms" not in r


def _expected_read_bytes() -> int:
    """Every weight of the tiny Llama but the (untied) input embedding, float32."""
    h, i, v, layers = (TINY["hidden_size"], TINY["intermediate_size"], TINY["vocab_size"],
                       TINY["num_hidden_layers"])
    q = TINY["num_attention_heads"] * TINY["head_dim"]
    kv = TINY["num_key_value_heads"] * TINY["head_dim"]
    per_layer = h * (q + 2 * kv) + q * h + 2 * h * i + i * h + 2 * h  # + two RMSNorm weights
    return 4 * (layers * per_layer + h + v * h)  # + final norm + lm_head


@pytest.mark.parametrize("dummy", [False, True])
def test_run(tiny_model_dir, tiny_config_dir, tmp_path, dummy):
    out = tmp_path / "lat.json"
    model = ["--model", tiny_config_dir, "--load-format", "dummy"] if dummy else [
        "--model", tiny_model_dir]
    args = _parse([*model, "--input-len", "5", "--output-len", "6", "--batch-size", "2",
                   "--num-iters", "3", "--num-iters-warmup", "1", "--copy-bytes", str(1 << 22),
                   "--output-json", str(out), *ENGINE_FLAGS])
    assert latency.main(args) == 0
    doc = json.loads(out.read_text())
    s = doc["summary"]
    full = [r["latency_s"] for r in doc["rows"] if r["kind"] == "full"]
    prefill = [r["latency_s"] for r in doc["rows"] if r["kind"] == "prefill_only"]
    assert len(full) == 3 and len(prefill) == 3
    assert s["request_latency_s_median"] == pytest.approx(common.median(full))
    assert s["ms_per_output_token"] == pytest.approx(common.median(full) / 6 * 1e3)
    assert s["decode_ms_per_token"] == pytest.approx(
        (common.median(full) - common.median(prefill)) / 5 * 1e3)
    assert s["weight_read_bytes"] == _expected_read_bytes()
    assert s["weight_read_floor_ms"] == pytest.approx(
        s["weight_read_bytes"] / s["copy_bandwidth"]["bytes_per_s"] * 1e3)
    chain = s["gemm_chain"]
    # per layer: qkv, o, gate_up, down; then the LM head
    assert chain["num_gemms"] == 4 * TINY["num_hidden_layers"] + 1
    assert chain["flops"] == 2 * 2 * (_expected_read_bytes() // 4
                                      - TINY["hidden_size"] * (2 * TINY["num_hidden_layers"] + 1))
    assert s["decode_over_gemm_chain"] == pytest.approx(
        s["decode_ms_per_token"] / chain["eager_ms"])
    assert doc["env"]["device"] == "cpu"


def test_decode_weights_count_only_the_routed_experts():
    """A FusedMoE layer's experts count for the share a batch routes to: top_k / E at batch 1,
    1 - (1 - top_k / E)^batch above; every other parameter counts whole."""
    from pyorch.layers.fused_moe import FusedMoE

    model = torch.nn.Sequential(FusedMoE(8, 2, 16, 12, params_dtype=torch.float32),
                                torch.nn.Linear(16, 4))
    experts = 4 * (8 * 24 * 16 + 8 * 16 * 12)
    other = 4 * (16 * 4 + 4)
    assert latency.decode_weights(model, 1)[0] == round(experts * 2 / 8) + other
    assert latency.decode_weights(model, 3)[0] == round(experts * (1 - (6 / 8) ** 3)) + other
    assert latency.active_expert_fraction(8, 2, 10_000) == pytest.approx(1.0)
