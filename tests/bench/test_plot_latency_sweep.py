"""bench/plot_latency_sweep.py: the figures it reads from `pyorch bench latency` logs."""

import importlib.util
import json
import os

import pytest

_SPEC = importlib.util.spec_from_file_location(
    "plot_latency_sweep",
    os.path.join(os.path.dirname(__file__), "..", "..", "bench", "plot_latency_sweep.py"))
plot_latency_sweep = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(plot_latency_sweep)

_LOG = (
    "INFO ... Captured 2 CUDA graphs\n"
    "batch 1, in 128, out 256: request 1591.9 ms (median of 10), {tok} ms per output token, "
    "decode {dec} ms/token\n"
    "weight-read floor: 15.010 GB / 2899.9 GB/s (copy, read+written) = 5.176 ms -> decode is "
    "1.20x\n"
    "GEMM chain (129 matmuls at M=1): eager 5.767 ms, CUDA graph 5.613 ms -> decode is 1.11x\n")


def _log(tmp_path, name, tok, dec):
    path = tmp_path / name
    path.write_text(_LOG.format(tok=tok, dec=dec))
    return str(path)


def test_parse_log_reads_decode_floor_and_chain(tmp_path):
    row = plot_latency_sweep.parse_log(_log(tmp_path, "a.log", "6.22", "6.21"))
    assert row["ms_per_output_token"] == 6.22
    assert row["decode_ms_per_token"] == 6.21
    assert row["weight_floor_ms"] == 5.176
    assert row["cublas_chain_graph_ms"] == 5.613


def test_failed_run_is_an_error(tmp_path):
    path = tmp_path / "failed.log"
    path.write_text("Traceback (most recent call last):\n  ...\nFileNotFoundError: model\n")
    with pytest.raises(SystemExit, match="no 'decode"):
        plot_latency_sweep.parse_log(str(path))


def test_main_writes_json_rows_and_png(tmp_path, monkeypatch):
    a1 = _log(tmp_path, "a1.log", "6.31", "6.30")
    a2 = _log(tmp_path, "a2.log", "6.33", "6.31")
    b = _log(tmp_path, "b.log", "6.22", "6.21")
    out = str(tmp_path / "sweep")
    monkeypatch.setattr("sys.argv", ["plot_latency_sweep.py", "--out", out, "--target", "5.9",
                                     f"splits >= 0={a1}", f"splits >= 0={a2}", f"one split={b}"])
    assert plot_latency_sweep.main() == 0
    with open(out + ".json") as f:
        rows = json.load(f)["rows"]
    # Names may hold "=": the path is what follows the last one.
    assert [r["name"] for r in rows] == ["splits >= 0", "splits >= 0", "one split"]
    assert [r["decode_ms_per_token"] for r in rows] == [6.30, 6.31, 6.21]
    with open(out + ".png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
