"""pyorch's custom all-reduce on 2 GPUs (one process each, NCCL for setup) against the exact
rank-ordered fp32 sum: one-shot, two-shot and auto, every dtype, awkward sizes, CUDA-graph
replays (the kernel alternates its buffers from a device-side counter), and the NCCL fallback
for messages it does not take. Skipped on machines with fewer than 2 GPUs."""

from __future__ import annotations

import pytest
import torch

from tests.pyorch.distributed.helpers import run_distributed

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")

# Element counts: 16 bytes, awkward multiples of a 16-byte pack, one past a block's share, and
# a few MiB (two-shot's partitions straddle blocks).
NUMELS = [8, 8 * 7, 8 * 83, 8 * 1001, 8 * 512 * 36 + 8, 1 << 20]


def _reference(x: torch.Tensor, world_size: int) -> torch.Tensor:
    """Every rank's x gathered (NCCL) and summed in rank order in fp32, rounded once."""
    import torch.distributed as dist

    parts = [torch.empty_like(x) for _ in range(world_size)]
    dist.all_gather(parts, x)
    total = parts[0].float()
    for p in parts[1:]:
        total = total + p.float()
    return total.to(x.dtype)


def _check_kernel(rank: int, world_size: int) -> None:
    from pyorch.distributed.custom_all_reduce import (
        ALGO_AUTO,
        ALGO_ONE_SHOT,
        ALGO_TWO_SHOT,
        CustomAllreduce,
    )
    from pyorch.distributed.parallel_state import get_tp_group

    group = get_tp_group()
    comm = CustomAllreduce.create(group)
    assert comm is not None, "2 GPUs of one host with peer access should take the kernel"
    try:
        gen = torch.Generator(device="cuda").manual_seed(1234 + rank)
        for algo in (ALGO_ONE_SHOT, ALGO_TWO_SHOT, ALGO_AUTO):
            comm.algo = algo
            for dtype in (torch.bfloat16, torch.float16, torch.float32):
                for numel in NUMELS:
                    numel = numel * 2 // torch.empty((), dtype=dtype).element_size()
                    x = torch.randn(numel, dtype=dtype, device="cuda", generator=gen)
                    out = comm.all_reduce(x)
                    assert out is not None
                    torch.testing.assert_close(out, _reference(x, world_size), atol=0, rtol=0,
                                               msg=f"algo {algo} {dtype} numel {numel}")
        # The group's all_reduce goes through the kernel and matches NCCL's sum.
        group.device_communicator = comm
        x = torch.randn(4096, dtype=torch.bfloat16, device="cuda", generator=gen)
        torch.testing.assert_close(group.all_reduce(x), _reference(x, world_size), atol=0, rtol=0)
        # Messages the kernel does not take fall back to NCCL.
        assert comm.all_reduce(torch.ones(7, dtype=torch.bfloat16, device="cuda")) is None
        big = torch.ones(comm.max_bytes // 2 + 8, dtype=torch.bfloat16, device="cuda")
        assert comm.all_reduce(big) is None
        assert comm.all_reduce(torch.ones(16, dtype=torch.int32, device="cuda")) is None
        odd = torch.full((7,), float(rank + 1), dtype=torch.bfloat16, device="cuda")
        torch.testing.assert_close(group.all_reduce(odd), torch.full_like(odd, 3.0))
        _check_graph_replay(comm, world_size, rank)
    finally:
        group.device_communicator = None
        comm.close()


def _check_graph_replay(comm: "object", world_size: int, rank: int) -> None:
    """Captured once, replayed with new inputs: each replay must use the other buffer."""
    static_in = torch.zeros(8 * 1001, dtype=torch.bfloat16, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        comm.all_reduce(static_in)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = comm.all_reduce(static_in)
    for step in range(5):
        static_in.copy_(torch.arange(static_in.numel(), device="cuda") % 13 + rank + step)
        graph.replay()
        torch.cuda.synchronize()
        expected = (torch.arange(static_in.numel(), device="cuda") % 13 + step) * world_size + sum(
            range(world_size))
        torch.testing.assert_close(static_out, expected.to(torch.bfloat16), atol=0, rtol=0,
                                   msg=f"replay {step}")


def test_custom_all_reduce_matches_the_exact_sum_on_two_gpus():
    run_distributed(_check_kernel, 2, backend="nccl")
