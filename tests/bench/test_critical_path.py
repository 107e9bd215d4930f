"""bench/probes/critical_path.py: each kernel charged for how far it moves the latest end time."""

import importlib.util
import json
import os
import subprocess
import sys

_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "probes", "critical_path.py")
_SPEC = importlib.util.spec_from_file_location("critical_path", _PATH)
critical_path = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(critical_path)


def _kernel(name: str, ts: float, dur: float, grid: tuple = (1, 1, 1)) -> dict:
    return {"ph": "X", "cat": "kernel", "name": f"void {name}(int)", "ts": ts, "dur": dur,
            "args": {"grid": list(grid)}}


# a [0, 10); b starts under a (PDL: its profiled time includes the wait) and ends at 15; an idle
# gap of 5; a again [20, 23); a host-side event that must be ignored.
EVENTS = [_kernel("a", 20, 3), _kernel("b", 5, 10, (2, 1, 1)), _kernel("a", 0, 10),
          {"ph": "X", "cat": "cpu_op", "name": "aten::add", "ts": 0, "dur": 100}]


def test_marginals_and_idle_add_up_to_the_span() -> None:
    table, span, idle = critical_path.charge(critical_path.kernel_events({"traceEvents": EVENTS}))
    a, b = table["a (1, 1, 1)"], table["b (2, 1, 1)"]
    assert (a["count"], a["dur"], a["marginal"], a["idle"]) == (2, 13, 13, 5)
    assert (b["count"], b["dur"], b["marginal"], b["idle"]) == (1, 10, 5, 0)
    assert (span, idle) == (23, 5)
    assert sum(r["marginal"] + r["idle"] for r in table.values()) == span


def test_report(tmp_path) -> None:
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": EVENTS}))
    out = subprocess.run([sys.executable, _PATH, str(trace), "--steps", "2"], check=True,
                         capture_output=True, text=True, timeout=60).stdout
    assert out.splitlines()[0] == ("3 kernels, span 11.5 us/step, idle 2.5 us/step, summed "
                                   "durations 11.5 us/step")
    assert out.splitlines()[2].split()[:2] == ["a", "(1,"]  # the largest charge first
