"""bench/scheduler_replay.py: the real scheduler replayed with a step-cost model."""

import importlib.util
import json
import os

import pytest

_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "scheduler_replay.py")
_SPEC = importlib.util.spec_from_file_location("scheduler_replay", _PATH)
scheduler_replay = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(scheduler_replay)


def _run(tmp_path, *argv: str) -> dict:
    out = tmp_path / "replay.json"
    assert scheduler_replay.main([*argv, "--output-json", str(out), "--max-model-len", "256",
                                  "--max-num-batched-tokens", "2048"]) == 0
    return {row["policy"]: row for row in json.loads(out.read_text())["rows"]}


def test_thin_tail_against_a_near_fit_cache(tmp_path):
    """100 requests of 64 + 64 tokens (8 blocks each at the cap) on a cache that holds 94 of
    them: held back, the last 6 run alone for 64 steps; started with the others, they are
    preempted near the end and recompute. Every policy samples every token."""
    rows = _run(tmp_path, "--num-prompts", "100", "--input-len", "64", "--output-len", "64",
                "--kv-tokens", str(94 * 128))
    reserve, tail, none = rows["reserve"], rows["tail"], rows["none"]
    assert {r["output_tokens"] for r in rows.values()} == {100 * 64}
    assert reserve["preemptions"] == 0 and reserve["steps"] >= 2 * 64  # two waves
    assert tail["preemptions"] > 0 and tail["steps"] < 100
    assert tail["simulated_s"] < reserve["simulated_s"]
    assert tail["ratio_to_first"] == pytest.approx(reserve["simulated_s"] / tail["simulated_s"])


def test_long_queue_keeps_the_reservation(tmp_path):
    """A cache that holds a fifth of the requests: the queue is long, the thin-tail rule stays
    out of the way (the same steps as the reservation alone), and admitting whatever fits
    (vLLM's policy) preempts."""
    rows = _run(tmp_path, "--num-prompts", "100", "--input-len", "64", "--output-len", "64",
                "--kv-tokens", str(20 * 128))
    assert rows["tail"]["steps"] == rows["reserve"]["steps"]
    assert rows["tail"]["preemptions"] == rows["reserve"]["preemptions"] == 0
    assert rows["none"]["preemptions"] > 0


def test_argument_checks(tmp_path):
    with pytest.raises(SystemExit):
        scheduler_replay.main(["--policies", "reserve,fifo", "--output-json",
                               str(tmp_path / "x.json")])
    with pytest.raises(SystemExit):
        scheduler_replay.main(["--cost", "1,2,3", "--output-json", str(tmp_path / "x.json")])
