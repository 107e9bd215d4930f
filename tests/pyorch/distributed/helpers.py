"""Runs a function on N processes joined by torch.distributed (gloo on the CPU): the CI form of
tensor parallelism. Each process builds pyorch's groups (`parallel_state`) first."""

from __future__ import annotations

import socket
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp

TIMEOUT_S = 120.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple,
           backend: str, errors: Any) -> None:
    import torch

    from pyorch.distributed import parallel_state

    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    try:
        parallel_state.init_distributed_environment(
            world_size, rank, f"tcp://127.0.0.1:{port}", rank, backend)
        parallel_state.initialize_model_parallel(world_size)
        fn(rank, world_size, *args)
    except BaseException:
        errors.put((rank, traceback.format_exc()))
        raise
    finally:
        parallel_state.destroy_model_parallel()


def run_distributed(fn: Callable[..., Any], world_size: int = 2, args: tuple = (),
                    backend: str = "gloo") -> None:
    """fn(rank, world_size, *args) on world_size spawned processes (rank r on GPU r with
    backend "nccl"); raises AssertionError with the first failing rank's traceback. fn must be
    importable (module level)."""
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    port = _free_port()
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, fn, args, backend, errors))
             for r in range(world_size)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(TIMEOUT_S)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    if not errors.empty():
        rank, tb = errors.get()
        raise AssertionError(f"rank {rank} failed:\n{tb}")
    codes = [p.exitcode for p in procs]
    assert codes == [0] * world_size, f"exit codes {codes} (a rank hung or crashed)"
