"""`pyorch bench startup` on a tiny random-weight Llama: fresh processes, phases, the floor."""

from __future__ import annotations

import argparse
import json

import pytest

from pyorch.benchmarks import common, startup
from tests.pyorch.benchmarks.conftest import ENGINE_FLAGS, TINY


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    startup.add_cli_args(parser)
    return parser.parse_args(argv)


def test_defaults():
    args = _parse([])
    assert args.num_iters == 3 and args.num_iters_warmup == 1 and args.model is None


def test_run(tiny_model_dir, tmp_path):
    out = tmp_path / "startup.json"
    args = _parse(["--model", tiny_model_dir, "--num-iters", "1", "--num-iters-warmup", "0",
                   "--output-json", str(out), "--cprofile", str(tmp_path / "prof.txt"),
                   *ENGINE_FLAGS])
    assert startup.main(args) == 0
    doc = json.loads(out.read_text())
    prof = (tmp_path / "prof.txt").read_text()
    assert "cumulative" in prof and "__init__" in prof  # LLM.__init__ and what it called
    ours = [r for r in doc["rows"] if r["kind"] == "pyorch"]
    floors = [r for r in doc["rows"] if r["kind"] == "floor"]
    assert len(ours) == 1 and len(floors) == 1
    h, i, v, n = (TINY["hidden_size"], TINY["intermediate_size"], TINY["vocab_size"],
                  TINY["num_hidden_layers"])
    q, kv = TINY["num_attention_heads"] * TINY["head_dim"], TINY["num_key_value_heads"] * TINY[
        "head_dim"]
    params = n * (h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h) + h + 2 * v * h
    for r in ours + floors:
        assert r["weight_bytes"] == 4 * params  # float32, embedding and LM head untied
        # the phases partition the wall time from spawn to ready
        assert sum(r["phases"].values()) == pytest.approx(r["total_s"], abs=1e-6)
        assert r["phases"]["interpreter_s"] > 0 and r["phases"]["import_torch_s"] > 0
    for r in ours:
        assert r["device"] == "cpu" and r["phases"]["llm_init_s"] > 0
        assert any(rec["msg"].startswith("Loaded") for rec in r["log"])  # model_runner's record
        assert all(0 < rec["t_s"] <= r["total_s"] for rec in r["log"])
    s = doc["summary"]
    assert s["pyorch_median"]["total_s"] == pytest.approx(common.median(
        [r["total_s"] for r in ours]))
    assert s["ratio_to_floor"] == pytest.approx(
        s["pyorch_median"]["total_s"] / s["floor_median"]["total_s"])
