"""`pyorch bench attention`: flags, the CPU refusal, and one tiny row on CUDA."""

from __future__ import annotations

import json

import pytest
import torch

from pyorch.benchmarks import attention
from pyorch.cli.main import build_parser


def _args(*extra: str):
    argv = ["bench", "attention", *extra]
    return build_parser(argv).parse_args(argv)


def test_flags() -> None:
    args = _args("--batch", "2,3", "--context", "300", "--ops", "pyorch,sdpa")
    assert args.batch == [2, 3] and args.context == [300] and args.block_size == 16
    assert _args().batch == [64, 256, 1, 16, 1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_needs_cuda() -> None:
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        attention.main(_args())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_tiny_row(tmp_path) -> None:
    """Awkward sizes (context not a multiple of the block or of 512): all three ops agree."""
    out = tmp_path / "attention.json"
    args = _args("--batch", "3", "--context", "300", "--num-heads", "8", "--num-kv-heads", "2",
                 "--head-size", "64", "--iters", "3", "--output-json", str(out))
    assert attention.main(args) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["op"] for r in rows] == ["pyorch", "paged_attention_v2", "sdpa"]
    for r in rows:
        assert r["graph_us"] > 0 and r["max_abs_diff_vs_sdpa"] < 2e-2


def test_replot_draws_an_earlier_run(tmp_path) -> None:
    """--replot draws the PNG of a saved JSON without a GPU: one bar per op and shape."""
    rows = [{"op": op, "batch": b, "context": c, "graph_pct_of_copy": pct}
            for op, pct0 in (("pyorch", 95.0), ("sdpa", 100.0))
            for (b, c), pct in (((64, 4096), pct0), ((1, 32768), pct0 - 20))]
    doc = {"benchmark": "attention", "rows": rows,
           "args": {"num_heads": 32, "num_kv_heads": 8, "head_size": 128, "block_size": 16,
                    "dtype": "bfloat16"}, "env": {"device_name": "test GPU"}}
    path = tmp_path / "attention.json"
    path.write_text(json.dumps(doc))
    assert attention.main(_args("--replot", str(path))) == 0
    assert (tmp_path / "attention.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
