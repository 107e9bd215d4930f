"""The mp executor: one worker process per rank on this host (vLLM's MultiprocExecutor).

The engine core writes every request to the workers once, into a shared-memory broadcast queue
(`pyorch.distributed.shm_broadcast`): a step's SchedulerOutput, or a call (`rpc`) during
start-up. Each worker answers into its own reply queue; for steps only rank 0 (the driver)
answers, with the sampled tokens, since every rank samples the same tokens from the same
gathered logits.

A worker overlaps like the async engine: after launching step N it resolves step N - 1 only
if step N + 1 has not arrived yet, else it launches N + 1 first.

Failure: a thread per worker waits on its process; when one exits, every wait of the engine
core on the queues raises `WorkerDiedError` naming the rank, its exit code and its last error,
and the other workers are killed. Workers exit when the engine core's process is gone. Exits
the executor causes itself (shutdown(), or the finalizer that kills the workers when the
executor is dropped or the interpreter exits without shutdown()) are not reported as deaths.

A call (`collective_rpc`) may come while steps are in flight (async scheduling): the workers
answer those steps first, so rank 0's step outputs that arrive ahead of the call's answer are
kept for `resolve`, in order.

Workers are started with subprocess (not multiprocessing): the serving engine core is a daemon
process, which multiprocessing forbids to have children.
"""

from __future__ import annotations

import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
import traceback
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Any, Optional

import pyorch
from pyorch.config import EngineConfig
from pyorch.core.scheduler_output import SchedulerOutput
from pyorch.distributed.parallel_state import worker_env
from pyorch.distributed.shm_broadcast import ShmBroadcastQueue, ShmQueueHandle
from pyorch.executor.abstract import Executor
from pyorch.executor.step import ModelRunnerOutput
from pyorch.structured_output.manager import GrammarOutput

logger = logging.getLogger(__name__)

_STEP, _RPC, _SHUTDOWN = "step", "rpc", "shutdown"
_SHUTDOWN_GRACE_S = 5.0


class WorkerDiedError(RuntimeError):
    """A worker process exited while the engine needed it."""


# How long a wait on a shared-memory queue spins before it sleeps, on GPUs (a core per process).
_GPU_SPIN_S = 0.05


def get_open_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class _MpStepHandle:
    index: int  # the step's number, to keep resolves in launch order


class MultiprocExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.world_size = config.parallel_config.world_size
        self._failure: Optional[str] = None
        self._failed_rank: Optional[int] = None
        self._closed = False
        # Set before any exit the executor causes itself (shutdown, the finalizer): the watcher
        # threads then do not report it as a worker death.
        self._stopping = threading.Event()
        # Rank 0's outputs of launched steps that a collective_rpc read ahead of its own answer.
        self._early_outputs: deque[ModelRunnerOutput] = deque()
        on_gpu = config.model_config.device.startswith("cuda")
        self.broadcast = ShmBroadcastQueue.create(self.world_size)
        self.replies = [ShmBroadcastQueue.create(1, num_slots=4, reader_rank=0)
                        for _ in range(self.world_size)]
        for q in (self.broadcast, *self.replies):
            q.check = self.check_health
            # A GPU step takes milliseconds: spin through one rather than oversleep (past the
            # spin the sleeps grow to 1 ms, so a wait of a few ms could overshoot by ~0.5 ms: a
            # decode step's worth of latency at batch 1). On the CPU the workers need every core.
            q.spin_s = _GPU_SPIN_S if on_gpu else 0.0
        init_method = f"tcp://127.0.0.1:{get_open_port()}"
        self.procs: list[subprocess.Popen] = []
        try:
            for rank in range(self.world_size):
                self.procs.append(self._start_worker(rank, init_method, on_gpu))
        except BaseException:
            _release(self.procs, [self.broadcast, *self.replies], self._stopping)
            raise
        # Kills the workers and frees the shared memory if the executor is dropped (or the
        # interpreter exits) without shutdown().
        self._finalizer = weakref.finalize(self, _release, self.procs,
                                           [self.broadcast, *self.replies], self._stopping)
        for rank, proc in enumerate(self.procs):
            threading.Thread(target=self._watch, args=(rank, proc), daemon=True,
                             name=f"pyorch-worker-{rank}-monitor").start()
        self._launched = 0
        self._resolved = 0

    def _start_worker(self, rank: int, init_method: str, on_gpu: bool) -> subprocess.Popen:
        spec = {
            "config": self.config, "rank": rank, "local_rank": rank,
            "distributed_init_method": init_method, "broadcast": self.broadcast.handle(),
            "reply": self.replies[rank].handle(), "parent_pid": os.getpid(),
            "spin_s": _GPU_SPIN_S if on_gpu else 0.0,
        }
        # The workers import the same pyorch as this process (a checkout, or the installed one).
        root = os.path.dirname(os.path.dirname(os.path.abspath(pyorch.__file__)))
        env = worker_env(dict(os.environ))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        proc = subprocess.Popen([sys.executable, "-m", "pyorch.executor.multiproc_executor"],
                                stdin=subprocess.PIPE, env=env)
        assert proc.stdin is not None  # stdin=PIPE
        proc.stdin.write(pickle.dumps(spec))
        proc.stdin.close()
        return proc

    # ---- health -------------------------------------------------------------------------------
    def _watch(self, rank: int, proc: subprocess.Popen) -> None:
        code = proc.wait()
        if self._stopping.is_set() or self._failure is not None:
            return
        self._failure = f"worker rank {rank} (pid {proc.pid}) died with exit code {code}"
        self._failed_rank = rank
        logger.error("%s; stopping the other workers", self._failure)
        self._kill_all()

    def _last_error(self, rank: int) -> str:
        """The error a dying worker wrote to its reply queue, if it got that far (read by the
        engine core's thread, the queue's one reader)."""
        q = self.replies[rank]
        try:
            while q.poll():
                msg = q.dequeue(timeout_s=1.0)
                if msg[0] == "error":
                    return str(msg[1])
        except Exception:  # noqa: BLE001 - a half-written reply: nothing more to say
            pass
        return ""

    def check_health(self) -> None:
        """Raises WorkerDiedError once a worker has exited (call from the engine core's thread)."""
        if self._failure is None:
            return
        if self._failed_rank is not None:
            rank, self._failed_rank = self._failed_rank, None
            detail = self._last_error(rank)
            if detail:
                self._failure += f": {detail}"
        raise WorkerDiedError(self._failure)

    # ---- calls ------------------------------------------------------------------------------
    def _reply(self, rank: int) -> Any:
        msg = self.replies[rank].dequeue()
        if msg[0] == "error":
            self._raise_if_a_peer_died()
            raise RuntimeError(f"worker rank {rank} failed: {msg[1]}\n{msg[2]}")
        return msg[1]

    def _raise_if_a_peer_died(self, grace_s: float = 1.0) -> None:
        """When a worker dies mid-step, the survivors' collectives fail too (gloo/NCCL: connection
        reset), and one of their errors may arrive first: the death is the cause to report. A
        worker that has exited is seen at once; its watcher records it within grace_s."""
        if self._failure is None and all(p.poll() is None for p in self.procs):
            return
        deadline = time.monotonic() + grace_s
        while self._failure is None and time.monotonic() < deadline:
            time.sleep(0.005)
        self.check_health()

    def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        self.check_health()
        self.broadcast.enqueue((_RPC, method, args))
        # Steps launched before the call are answered (by rank 0) before it: keep their outputs.
        while self._resolved + len(self._early_outputs) < self._launched:
            self._early_outputs.append(self._reply(0))
        return [self._reply(rank) for rank in range(self.world_size)]

    def execute_model(self, scheduler_output: SchedulerOutput,
                      grammar: Optional[GrammarOutput] = None) -> _MpStepHandle:
        self.check_health()
        start = time.perf_counter()
        self.broadcast.enqueue((_STEP, scheduler_output, grammar))
        self.timings.launch += time.perf_counter() - start
        self._launched += 1
        return _MpStepHandle(self._launched)

    def resolve(self, handle: Any) -> ModelRunnerOutput:
        if handle.index != self._resolved + 1:
            raise RuntimeError(f"step {handle.index} resolved out of order (next is "
                               f"{self._resolved + 1})")
        start = time.perf_counter()
        out = self._early_outputs.popleft() if self._early_outputs else self._reply(0)
        self.timings.wait += time.perf_counter() - start
        self._resolved += 1
        return out

    # ---- shutdown -----------------------------------------------------------------------------
    def _kill_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stopping.set()
        if self._failure is None and all(p.poll() is None for p in self.procs):
            try:
                self.broadcast.enqueue((_SHUTDOWN,), timeout_s=_SHUTDOWN_GRACE_S)
            except Exception:  # noqa: BLE001 - the workers are killed below anyway
                pass
        deadline = time.monotonic() + _SHUTDOWN_GRACE_S
        for proc in self.procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        self._finalizer()


def _release(procs: list[subprocess.Popen], queues: list[ShmBroadcastQueue],
             stopping: threading.Event) -> None:
    """Kills the workers still running and frees the queues' shared memory (`stopping` tells
    the watcher threads that these exits are the executor's own)."""
    stopping.set()
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    for q in queues:
        q.close()


# ---- the worker process -----------------------------------------------------------------------
class _WorkerProc:
    """A worker's loop: calls and steps from the broadcast queue, answers to its reply queue."""

    def __init__(self, spec: dict[str, Any]) -> None:
        from pyorch.executor.worker import Worker

        self.rank: int = spec["rank"]
        self.parent_pid: int = spec["parent_pid"]
        self.worker = Worker(spec["config"], self.rank, spec["local_rank"],
                             spec["distributed_init_method"])
        bq_handle: ShmQueueHandle = spec["broadcast"]
        self.broadcast = ShmBroadcastQueue.attach(bq_handle, self.rank)
        self.reply = ShmBroadcastQueue.attach(spec["reply"], None)
        for q in (self.broadcast, self.reply):
            q.check = self._check_parent
            q.spin_s = spec["spin_s"]
        self.in_flight: Any = None

    def _check_parent(self) -> None:
        if os.getppid() != self.parent_pid:
            raise SystemExit(f"worker {self.rank}: the engine core is gone")

    def _resolve_in_flight(self) -> None:
        handle, self.in_flight = self.in_flight, None
        out = self.worker.resolve(handle)
        if self.rank == 0:
            self.reply.enqueue(("ok", out))

    def run(self) -> None:
        while True:
            if self.in_flight is not None and not self.broadcast.poll():
                self._resolve_in_flight()
                continue
            msg = self.broadcast.dequeue()
            kind = msg[0]
            if kind == _STEP:
                handle = self.worker.execute_model(msg[1], msg[2])
                if self.in_flight is not None:
                    self._resolve_in_flight()
                self.in_flight = handle
                continue
            if self.in_flight is not None:
                self._resolve_in_flight()
            if kind == _SHUTDOWN:
                return
            if kind == _RPC:
                _, method, args = msg
                self.reply.enqueue(("ok", getattr(self.worker, method)(*args)))
            else:
                raise ValueError(f"unknown executor message {kind!r}")


def _worker_main() -> None:
    from pyorch.logger import configure_logging

    spec = pickle.loads(sys.stdin.buffer.read())
    configure_logging(process_name=f"worker-{spec['rank']}")
    proc: Optional[_WorkerProc] = None
    code = 0
    try:
        proc = _WorkerProc(spec)
        proc.run()
    except SystemExit as e:  # the engine core is gone
        logger.info("%s", e)
        code = 1
    except BaseException as e:
        logger.exception("worker %d failed", spec["rank"])
        code = 1
        if proc is not None:
            try:
                proc.reply.enqueue(("error", f"{type(e).__name__}: {e}", traceback.format_exc()),
                                   timeout_s=1.0)
            except Exception:  # noqa: BLE001 - the exit code still tells the engine
                pass
    if proc is not None:
        try:
            proc.worker.shutdown()
            proc.broadcast.close()
            proc.reply.close()
        except Exception:  # noqa: BLE001 - exiting anyway; the OS frees what is left
            logger.exception("worker %d: cleanup failed", spec["rank"])
    # Skip the interpreter's teardown: torch.distributed's threads kept a finished worker
    # alive for ~5 s, which every engine shutdown waited for.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    _worker_main()
