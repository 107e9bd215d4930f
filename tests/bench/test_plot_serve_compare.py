"""bench/plot_serve_compare.py: reads vLLM's bench serve results and pyorch's bench serve JSON,
plots both engines, and writes the per-rate ratios."""

import importlib.util
import json
import math
import os

import pytest

_SPEC = importlib.util.spec_from_file_location(
    "plot_serve_compare",
    os.path.join(os.path.dirname(__file__), "..", "..", "bench", "plot_serve_compare.py"))
plot_serve_compare = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(plot_serve_compare)


def _vllm_result(rate, tput, ttft50, ttft99, itl99):
    # The keys vLLM's bench serve --save-result writes with --percentile-metrics
    # ttft,tpot,itl,e2el --metric-percentiles 50,99.
    doc = {"request_rate": rate, "output_throughput": tput, "request_goodput": 3.0}
    for m, base in (("ttft", ttft50), ("tpot", 7.0), ("itl", 6.0), ("e2el", 900.0)):
        doc[f"median_{m}_ms"] = base
        doc[f"p50_{m}_ms"] = base
        doc[f"p99_{m}_ms"] = {"ttft": ttft99, "itl": itl99}.get(m, 2 * base)
    return doc


def _pyorch_run(rate, tput, ttft50, ttft99, itl99):
    stats = {"mean": 0.0, "p90": 0.0}
    return {"request_rate": rate, "output_throughput": tput,
            "ttft_ms": {**stats, "p50": ttft50, "p99": ttft99},
            "tpot_ms": {**stats, "p50": 6.0, "p99": 12.0},
            "itl_ms": {**stats, "p50": 5.0, "p99": itl99},
            "e2e_ms": {**stats, "p50": 800.0, "p99": 1600.0}}


def test_two_engines_from_their_own_formats(tmp_path):
    vllm_files = []
    for i, (rate, row) in enumerate([(4, (1000.0, 40.0, 80.0, 30.0)),
                                      ("inf", (16000.0, 700.0, 1500.0, 60.0))]):
        path = tmp_path / f"vllm_{i}.json"
        path.write_text(json.dumps(_vllm_result(rate, *row)))
        vllm_files.append(str(path))
    pyorch_file = tmp_path / "serve.json"
    pyorch_file.write_text(json.dumps({"runs": [_pyorch_run(4.0, 1010.0, 30.0, 60.0, 20.0),
                                                _pyorch_run("inf", 17600.0, 350.0, 1400.0,
                                                            45.0)]}))
    out = tmp_path / "cmp.png"
    assert plot_serve_compare.main(["--engine", "vllm", *vllm_files, "--engine", "pyorch",
                                    str(pyorch_file), "--out", str(out)]) == 0
    assert out.stat().st_size > 5000
    doc = json.loads((tmp_path / "cmp.json").read_text())
    assert [p["request_rate"] for p in doc["engines"]["vllm"]] == [4.0, "inf"]
    by_rate = {r["request_rate"]: r for r in doc["ratios"]}
    assert by_rate["inf"]["engine"] == "pyorch" and by_rate["inf"]["baseline"] == "vllm"
    assert by_rate["inf"]["output_throughput_ratio"] == pytest.approx(1.1)
    assert by_rate["inf"]["ttft_p50_ratio"] == pytest.approx(0.5)
    assert by_rate[4.0]["itl_p99_ratio"] == pytest.approx(20 / 30)
    assert by_rate[4.0]["tpot_p50_ratio"] == pytest.approx(6 / 7)


def test_unknown_file_is_refused(tmp_path):
    path = tmp_path / "x.json"
    path.write_text(json.dumps({"rows": []}))
    with pytest.raises(ValueError, match="neither"):
        plot_serve_compare.load_points([str(path)])
    assert math.isinf(plot_serve_compare._rate("inf"))
