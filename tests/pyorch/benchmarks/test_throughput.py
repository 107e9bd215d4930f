"""`pyorch bench throughput` on a tiny random-weight Llama: flags, rows, ratios, files."""

from __future__ import annotations

import argparse
import json
import os

import pytest

from pyorch.benchmarks import throughput
from tests.conftest import CUDA_AVAILABLE
from tests.pyorch.benchmarks.conftest import ENGINE_FLAGS


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    throughput.add_cli_args(parser)
    return parser.parse_args(argv)


def test_defaults_and_vllm_names():
    args = _parse([])
    assert args.hf_batch_sizes == [1, 16] and not args.hf_best
    assert args.model is None and args.max_num_seqs is None and args.load_format is None
    args = _parse(["--input-len", "7", "--output-len", "3", "--num-prompts", "5",
                   "--hf-batch-sizes", "2,8", "--hf-best", "--seed", "4", "--load-format", "dummy",
                   "--max-num-seqs", "8", "--max-model-len", "64", "--dtype", "float32"])
    assert (args.input_len, args.output_len, args.num_prompts) == (7, 3, 5)
    assert args.hf_batch_sizes == [2, 8] and args.hf_best and args.seed == 4
    assert (args.load_format, args.max_num_seqs, args.max_model_len) == ("dummy", 8, 64)


def test_run_against_transformers(tiny_model_dir, tmp_path):
    out = tmp_path / "res" / "tp.json"
    args = _parse(["--model", tiny_model_dir, "--input-len", "6",
                   "--output-len", "4", "--num-prompts", "3", "--hf-batch-sizes", "1,2",
                   "--num-repeats", "2", "--disable-detokenize", "--output-json", str(out),
                   *ENGINE_FLAGS])
    assert throughput.main(args) == 0
    doc = json.loads(out.read_text())
    assert os.path.getsize(tmp_path / "res" / "tp.png") > 1000
    assert doc["benchmark"] == "throughput" and doc["model"] == tiny_model_dir
    for key in ("torch", "device_name", "cpu_count", "transformers", "load_avg_at_end"):
        assert key in doc["env"]
    assert doc["env"]["device_name"] == "cpu"
    rows = {(r["engine"], r["batch_size"]): r for r in doc["rows"]}
    assert set(rows) == {("pyorch", 1), ("pyorch", 2), ("transformers", 1), ("transformers", 2)}
    input_tokens = rows[("pyorch", 1)]["input_tokens"]
    assert input_tokens == 3 * 6
    for r in rows.values():
        assert r["num_requests"] == 3 and r["output_tokens"] == 3 * 4
        assert r["input_tokens"] == input_tokens  # both engines saw the same prompts
        assert len(r["elapsed_s_all"]) == 2
        assert r["elapsed_s"] == pytest.approx(sorted(r["elapsed_s_all"])[0] / 2
                                               + sorted(r["elapsed_s_all"])[1] / 2)
        assert r["output_tokens_per_s"] == pytest.approx(r["output_tokens"] / r["elapsed_s"])
        assert r["requests_per_s"] == pytest.approx(3 / r["elapsed_s"])
        assert r["total_tokens_per_s"] == pytest.approx(
            (r["input_tokens"] + r["output_tokens"]) / r["elapsed_s"])
        assert r["dtype"] == "torch.float32"
        if r["engine"] == "pyorch":  # KV cache room for everything: nothing recomputed
            assert r["preemptions"] == 0 and r["engine_steps"] >= 4
    ratios = {r["pyorch_batch_size"]: r["output_tokens_per_s_ratio"]
              for r in doc["summary"]["ratios"]}
    for b in (1, 2):
        assert ratios[b] == pytest.approx(rows[("pyorch", b)]["output_tokens_per_s"]
                                          / rows[("transformers", b)]["output_tokens_per_s"])
    assert doc["summary"]["hf_loader"] == "from_pretrained"


@pytest.mark.parametrize("dataset", [
    ["--random-range-ratio", "0.5"],  # vLLM's semantics: on the output lengths too
    ["--dataset-name", "longtail", "--longtail-input-len", "8", "--longtail-output-len", "4",
     "--longtail-max-len", "40"],
])
def test_workloads_with_varying_output_lengths(tiny_model_dir, tmp_path, dataset):
    out = tmp_path / "tp.json"
    argv = ["--model", tiny_model_dir, "--input-len", "6", "--output-len", "6",
            "--num-prompts", "12", "--hf-batch-sizes", "4", "--disable-detokenize",
            "--no-plot", "--output-json", str(out), *dataset, *ENGINE_FLAGS]
    with pytest.raises(ValueError, match="--skip-hf"):
        throughput.main(_parse(argv))  # transformers cannot run per-request output lengths
    assert throughput.main(_parse([*argv, "--skip-hf"])) == 0
    doc = json.loads(out.read_text())
    (row,) = doc["rows"]
    expected = [s.output_len for s in throughput.datasets.sample_requests(
        _parse(argv), 12, 6, 6, float(dataset[1]) if dataset[0] == "--random-range-ratio"
        else 0.0, 10, 0)]
    assert len(set(expected)) > 1 and row["output_tokens"] == sum(expected)
    assert doc["workload"]["dataset"] == ("longtail" if "longtail" in dataset else "random")


def test_prefix_repetition_against_transformers(tiny_model_dir, tmp_path):
    out = tmp_path / "tp.json"
    args = _parse(["--model", tiny_model_dir, "--dataset-name", "prefix_repetition",
                   "--prefix-repetition-prefix-len", "16", "--prefix-repetition-suffix-len", "3",
                   "--prefix-repetition-num-prefixes", "2", "--prefix-repetition-output-len", "3",
                   "--num-prompts", "6", "--hf-batch-sizes", "2", "--disable-detokenize",
                   "--no-plot", "--output-json", str(out), *ENGINE_FLAGS])
    assert throughput.main(args) == 0
    doc = json.loads(out.read_text())
    for r in doc["rows"]:
        assert r["input_tokens"] == 6 * 19 and r["output_tokens"] == 6 * 3


def test_dummy_weights_and_hf_best(tiny_config_dir, tmp_path):
    out = tmp_path / "tp.json"
    args = _parse(["--model", tiny_config_dir, "--load-format", "dummy", "--input-len", "4",
                   "--output-len", "3", "--num-prompts", "4", "--hf-best", "--max-num-seqs", "4",
                   "--hf-max-batch-size", "2", "--disable-detokenize", "--no-plot",
                   "--output-json", str(out), *ENGINE_FLAGS])
    assert throughput.main(args) == 0
    doc = json.loads(out.read_text())
    assert not (tmp_path / "tp.png").exists()
    assert doc["summary"]["hf_loader"] == "from_config (dummy weights)"
    probes = doc["summary"]["hf_probes"]
    assert [p["batch_size"] for p in probes] == [1, 2]
    best = max(probes, key=lambda p: p["output_tokens_per_s"])["batch_size"]
    (ours,) = [r for r in doc["rows"] if r["engine"] == "pyorch"]
    (theirs,) = [r for r in doc["rows"] if r["engine"] == "transformers"]
    assert ours["batch_size"] == 4 and theirs["batch_size"] == best
    (ratio,) = doc["summary"]["ratios"]
    assert ratio["output_tokens_per_s_ratio"] == pytest.approx(
        ours["output_tokens_per_s"] / theirs["output_tokens_per_s"])


def test_hf_subset_and_probe_sizes(tiny_config_dir, tmp_path):
    """transformers on the first --hf-num-prompts prompts, probing only --hf-probe-sizes; a best
    probe that ran exactly those prompts is the row (no second run)."""
    out = tmp_path / "tp.json"
    args = _parse(["--model", tiny_config_dir, "--load-format", "dummy", "--input-len", "4",
                   "--output-len", "3", "--num-prompts", "5", "--hf-best", "--max-num-seqs", "4",
                   "--hf-probe-sizes", "2,1,64", "--hf-num-prompts", "2", "--disable-detokenize",
                   "--no-plot", "--output-json", str(out), *ENGINE_FLAGS])
    assert throughput.main(args) == 0
    doc = json.loads(out.read_text())
    assert doc["summary"]["hf_num_prompts"] == 2
    assert [p["batch_size"] for p in doc["summary"]["hf_probes"]] == [1, 2]  # 64 > 2 prompts
    (ours,) = [r for r in doc["rows"] if r["engine"] == "pyorch"]
    (theirs,) = [r for r in doc["rows"] if r["engine"] == "transformers"]
    assert ours["num_requests"] == 5 and ours["output_tokens"] == 15
    assert theirs["num_requests"] == 2 and theirs["output_tokens"] == 6
    assert len(theirs["elapsed_s_all"]) == 1
    best = max(doc["summary"]["hf_probes"], key=lambda p: p["output_tokens_per_s"])
    if best["batch_size"] == 2:  # the probe's own timing was reused
        assert theirs["output_tokens_per_s"] == pytest.approx(best["output_tokens_per_s"])


def test_compare_pairs_by_batch_size():
    rows = [{"engine": "pyorch", "batch_size": 1, "output_tokens_per_s": 30.0},
            {"engine": "pyorch", "batch_size": 16, "output_tokens_per_s": 400.0},
            {"engine": "transformers", "batch_size": 16, "output_tokens_per_s": 100.0},
            {"engine": "transformers", "batch_size": 1, "output_tokens_per_s": 20.0}]
    got = {r["pyorch_batch_size"]: r["output_tokens_per_s_ratio"]
           for r in throughput.compare(rows, hf_best=False)}
    assert got == {1: pytest.approx(1.5), 16: pytest.approx(4.0)}


def test_summarize_step_trace():
    """Per-step host/wait from consecutive records' running totals; busy and idle per kind; the
    wall time split into before the first launch, busy, idle and after the last step."""
    from pyorch.metrics.stats import format_step_trace, summarize_step_trace

    records = [
        {"t_s": 10.5, "num_tokens": 300, "num_rows": 3, "decode_only": False,
         "host_total_s": 1.0, "wait_total_s": 0.0, "device_ms": 100.0,
         "phase_s": {"schedule": 0.5, "launch": 0.5}, "gc_total_s": 0.0, "gc_full_total": 0,
         "alloc_retries_total": 0},
        {"t_s": 10.52, "num_tokens": 3, "num_rows": 3, "decode_only": True,
         "host_total_s": 1.004, "wait_total_s": 0.09, "device_ms": 20.0, "idle_before_ms": 0.0,
         "phase_s": {"schedule": 0.501, "launch": 0.503}, "gc_total_s": 0.002, "gc_full_total": 0,
         "alloc_retries_total": 0},
        {"t_s": 10.54, "num_tokens": 3, "num_rows": 3, "decode_only": True,
         "host_total_s": 1.030, "wait_total_s": 0.10, "device_ms": 20.0, "idle_before_ms": 6.0,
         "phase_s": {"schedule": 0.502, "launch": 0.528}, "gc_total_s": 0.022, "gc_full_total": 1,
         "alloc_retries_total": 2},
    ]
    summary = summarize_step_trace(records, start_s=10.4, end_s=10.7)
    assert summary["wall_ms"] == pytest.approx(300.0)
    assert summary["before_first_launch_ms"] == pytest.approx(100.0)
    assert summary["device_busy_ms"] == pytest.approx(140.0)
    assert summary["device_idle_between_steps_ms"] == pytest.approx(6.0)
    assert summary["after_last_step_ms"] == pytest.approx(300.0 - 100.0 - 140.0 - 6.0)
    prefill, decode = summary["by_kind"]["prefill"], summary["by_kind"]["decode"]
    assert (prefill["steps"], prefill["tokens"]) == (1, 300)
    assert (decode["steps"], decode["tokens"]) == (2, 6)
    assert prefill["host_ms"] == pytest.approx(4.0) and prefill["wait_ms"] == pytest.approx(90.0)
    assert decode["host_ms"] == pytest.approx(26.0)  # the last record has no successor
    assert decode["idle_ms_per_step"] == pytest.approx(3.0) and decode["idle_steps"] == 1
    assert records[1]["phase_ms"] == pytest.approx({"schedule": 1.0, "launch": 25.0})
    assert records[1]["gc_ms"] == pytest.approx(20.0) and records[1]["gc_full"] == 1
    assert decode["gc_ms"] == pytest.approx(20.0) and decode["alloc_retries"] == 2
    assert prefill["gc_ms"] == pytest.approx(2.0) and prefill["gc_full"] == 0
    # The one idle gap, before step 2, with the host time of the step before it.
    (gap,) = summary["longest_idle_gaps"]
    assert gap["step"] == 2 and gap["idle_before_ms"] == 6.0
    assert gap["host_ms"] == pytest.approx(26.0) and gap["gc_ms"] == pytest.approx(20.0)
    line = format_step_trace(summary)
    assert "idle between steps 6" in line and "decode: 2 steps" in line
    assert "gc 20 ms (1 full), allocator retries 2" in line


def test_gc_pauses_times_collections():
    import gc

    from pyorch.metrics.stats import GcPauses

    with GcPauses() as pauses:
        gc.collect()
        gc.collect(0)
    assert pauses.full_collections == 1 and pauses.total_s > 0
    assert pauses not in gc.callbacks


@pytest.mark.skipif(not CUDA_AVAILABLE, reason="the step trace uses CUDA events")
def test_step_trace_on_cuda(tiny_model_dir, tmp_path):
    out = tmp_path / "tp.json"
    # CUDA attention takes float16 / bfloat16 only.
    flags = [{"cpu": "cuda", "float32": "bfloat16"}.get(f, f) for f in ENGINE_FLAGS]
    args = _parse(["--model", tiny_model_dir, "--input-len", "6", "--output-len", "5",
                   "--num-prompts", "4", "--skip-hf", "--hf-batch-sizes", "4", "--num-repeats", "2",
                   "--step-trace",
                   "--disable-detokenize", "--no-plot", "--output-json", str(out), *flags])
    assert throughput.main(args) == 0
    (row,) = json.loads(out.read_text())["rows"]
    records, summary = row["step_trace_records"], row["step_trace"]
    # One record per step with work in the first run: the prompts, then 4 decodes of 4 rows.
    # (Steps that schedule nothing are not traced; engine_steps counts them, among them the
    # warm-up's last, which only finishes in this run.)
    assert [r["num_tokens"] for r in records] == [4 * 6, 4, 4, 4, 4]
    assert all(r["device_ms"] > 0 for r in records)
    assert not records[0]["decode_only"] and all(r["decode_only"] for r in records[1:])
    # The records' device_ms are rounded in the JSON; the summary adds the unrounded times.
    assert summary["device_busy_ms"] == pytest.approx(sum(r["device_ms"] for r in records),
                                                      abs=1e-3 * len(records))
    assert 0 < summary["device_busy_ms"] < summary["wall_ms"]


def test_step_trace_records_nothing_on_cpu(tiny_model_dir, tmp_path):
    out = tmp_path / "tp.json"
    args = _parse(["--model", tiny_model_dir, "--input-len", "6", "--output-len", "3",
                   "--num-prompts", "2", "--skip-hf", "--hf-batch-sizes", "2", "--step-trace",
                   "--disable-detokenize",
                   "--no-plot", "--output-json", str(out), *ENGINE_FLAGS])
    assert throughput.main(args) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert "step_trace" not in row and "step_trace_records" not in row
