"""bench/probes/plot_paged_attention.py: the rows it takes from bench_paged_attention's output."""

import importlib.util
import json
import os
import sys

import pytest

_SPEC = importlib.util.spec_from_file_location(
    "plot_paged_attention",
    os.path.join(os.path.dirname(__file__), "..", "..", "bench", "probes",
                 "plot_paged_attention.py"))
plot_paged_attention = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(plot_paged_attention)

_DECODE = [{"op": "paged_attention", "mode": "decode", "batch": 64, "context": 4096,
            "pct_of_copy": 93.3, "graph_pct_of_copy": 94.4, "steady_pct_of_copy": 95.3},
           {"op": "paged_attention", "mode": "decode", "batch": 16, "context": 1000,
            "pct_of_copy": 60.0, "graph_pct_of_copy": 70.0}]
_PREFILL = [{"op": "paged_attention", "mode": "prefill", "batch": 1, "context": 8192,
             "head_size": 128, "TFLOP/s": 529.2},
            {"op": "paged_attention", "mode": "prefill", "batch": 4, "context": 2048,
             "head_size": 128, "TFLOP/s": 360.9},
            {"op": "paged_attention", "mode": "prefill", "batch": 1, "context": 8192,
             "head_size": 64, "TFLOP/s": 371.6}]
_TXT = ("== torch_sdpa_flash\n"
        "op=torch_sdpa_flash torch=2.11 batch=1 context=8192 head_size=128 time_us=1798 "
        "TFLOP/s=305.6\n"
        "op=torch_sdpa_flash torch=2.11 batch=1 context=8192 head_size=128 time_us=1700 "
        "TFLOP/s=310.0\n"
        "op=torch_sdpa_flash torch=2.11 batch=1 context=8192 head_size=64 time_us=900 "
        "TFLOP/s=268.4\n")


def test_decode_table_targets_and_missing_steady():
    table = plot_paged_attention.decode_table(_DECODE + _PREFILL)
    assert [(r["batch"], r["context"]) for r in table] == [(64, 4096), (16, 1000)]
    assert table[0]["target"] == 90.0 and table[1]["target"] is None
    assert table[0]["steady"] == 95.3 and table[1]["steady"] is None


def test_prefill_table_takes_the_first_sdpa_line_of_the_head_size(tmp_path):
    txt = tmp_path / "run.txt"
    txt.write_text(_TXT)
    sdpa = plot_paged_attention.sdpa_rows(str(txt), 128)
    assert sdpa == {(1, 8192): 305.6}
    table = plot_paged_attention.prefill_table(_PREFILL, sdpa, 128)
    assert [(r["pyorch"], r["sdpa_flash"], r["target"]) for r in table] == [
        (529.2, 305.6, 450.0), (360.9, None, None)]


def test_main_picks_a_key_and_writes_json_and_png(tmp_path, monkeypatch):
    src = tmp_path / "runs.json"
    src.write_text(json.dumps({"note": "two runs", "a": _DECODE[:1], "b": _DECODE}))
    out = str(tmp_path / "plot")
    monkeypatch.setattr(sys, "argv", ["x", "decode", str(src), "--key", "b", "--out", out])
    assert plot_paged_attention.main() == 0
    with open(out + ".json") as f:
        assert len(json.load(f)["rows"]) == 2
    with open(out + ".png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    monkeypatch.setattr(sys, "argv", ["x", "decode", str(src), "--key", "c", "--out", out])
    with pytest.raises(SystemExit, match="no key 'c'"):
        plot_paged_attention.main()
    monkeypatch.setattr(sys, "argv", ["x", "prefill", str(src), "--out", out])
    with pytest.raises(SystemExit, match="--sdpa-from"):
        plot_paged_attention.main()
