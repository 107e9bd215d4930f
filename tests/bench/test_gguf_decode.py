"""bench/gguf_decode.py: the random GGUF file it writes (types, shapes, the bytes it counts for
the floor, reuse) and a tiny end-to-end run on the CPU."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "gguf_decode.py")
_SPEC = importlib.util.spec_from_file_location("gguf_decode", _PATH)
bench = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(bench)

TINY = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 512,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 2048}


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K", "Q8_0", "Q4_1"])
def test_random_blocks_have_modest_fp16_scales(type_name: str) -> None:
    block_size, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]
    blocks = bench.random_blocks(type_name, 3, 2 * block_size, np.random.default_rng(0))
    assert blocks.shape == (3, 2 * block_bytes) and blocks.dtype == np.uint8
    flat = blocks.reshape(-1, block_bytes)
    for offset in bench.FP16_FIELDS[type_name]:
        scales = flat[:, offset:offset + 2].copy().view(np.float16).astype(np.float32)
        assert ((scales >= 0.001) & (scales < 0.01)).all()
    with pytest.raises(SystemExit, match="not whole"):
        bench.random_blocks(type_name, 1, block_size + 1, np.random.default_rng(0))
    with pytest.raises(SystemExit, match="unsupported type"):
        bench.random_blocks("IQ4_NL", 1, 32, np.random.default_rng(0))


def test_written_file_and_counted_bytes(tmp_path) -> None:
    path = str(tmp_path / "m.gguf")
    sizes = bench.write_gguf(path, TINY, "Q4_K", "Q6_K")
    reader = gguf.GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}
    assert tensors["output.weight"].tensor_type == gguf.GGMLQuantizationType.Q6_K
    assert tensors["token_embd.weight"].tensor_type == gguf.GGMLQuantizationType.Q4_K
    projections = [t for n, t in tensors.items() if n.startswith("blk.") and "norm" not in n]
    assert len(projections) == 7 * TINY["num_hidden_layers"]
    assert {t.tensor_type for t in projections} == {gguf.GGMLQuantizationType.Q4_K}
    assert sizes == {"projections": sum(int(t.n_bytes) for t in projections),
                     "lm_head": int(tensors["output.weight"].n_bytes)}
    down = tensors["blk.0.ffn_down.weight"]
    assert [int(d) for d in down.shape] == [TINY["intermediate_size"], TINY["hidden_size"]]
    # A second call reuses the file and counts the same bytes.
    mtime = os.path.getmtime(path)
    assert bench.write_gguf(path, TINY, "Q4_K", "Q6_K") == sizes
    assert os.path.getmtime(path) == mtime
    assert bench.default_output_type("Q4_K") == "Q6_K"
    assert bench.default_output_type("Q8_0") == "Q8_0"


def test_end_to_end_on_the_cpu(tmp_path) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY))
    out = tmp_path / "out.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.join(os.path.dirname(_PATH), ".."), os.environ.get("PYTHONPATH", "")]))
    subprocess.run([sys.executable, _PATH, "--types", "Q8_0", "--config", str(config), "--dir",
                    str(tmp_path), "--device", "cpu", "--new-tokens", "2", "--repeats", "1",
                    "--fused-decode", "on,off", "--json", str(out)], check=True, env=env,
                   timeout=300)
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert [row["fused_decode"] for row in rows] == [True, False]
    for row in rows:
        assert row["type"] == "Q8_0" and row["output_type"] == "Q8_0"
        assert row["ms_per_token"] > 0 and row["floor_ms"] > 0
        assert row["step_bytes"] == row["projections"] + row["lm_head"] + row["kv_bytes"]
        assert row["pct_of_floor"] == pytest.approx(100 * row["floor_ms"] / row["ms_per_token"])
    bad = subprocess.run([sys.executable, _PATH, "--fused-decode", "maybe"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "--fused-decode takes on / off values" in bad.stderr
