"""Shared fixtures: devices to test on, per-dtype tolerances, seeding, and op helpers."""

import zlib

import pytest
import torch

CUDA_AVAILABLE = torch.cuda.is_available()

# One tolerance table per dtype (vLLM's allclose_default idea): ops compare against a float64/32
# reference; the output is rounded to the op's dtype.
TOLERANCES = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=1e-3, rtol=1e-3),
    torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
}

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(not CUDA_AVAILABLE, reason="no CUDA device on this machine"),
    ),
]


def tol(dtype: torch.dtype, scale: float = 1.0) -> dict:
    t = TOLERANCES[dtype]
    return dict(atol=t["atol"] * scale, rtol=t["rtol"] * scale)


def capture_graph(call) -> "torch.cuda.CUDAGraph":
    """Runs `call` once on a side stream (warm-up outside capture, as torch recommends), then
    captures it into a CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    return graph


@pytest.fixture(autouse=True)
def _seed(request: pytest.FixtureRequest) -> None:
    # Fresh random inputs per test, yet reproducible: the seed comes from the test's id.
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))
