"""EngineCoreClient: the front end's handle on the engine-core process (`pyorch.core.core_proc`).

It starts the process (spawn context: torch and fork do not mix), waits for READY, then sends
messages without ever blocking the event loop (a non-blocking socket with an outgoing buffer
flushed by the loop's writer callback) and receives frames with `await recv()`. Messages follow
`pyorch.wire`. This module never imports `pyorch.core`: the child process does, through
`_engine_core_main`.
"""

from __future__ import annotations

import asyncio
import builtins
import logging
import multiprocessing
import multiprocessing.connection
import os
import select
import socket
import time
import weakref
from typing import Any, Optional, Union

from pyorch import wire
from pyorch.config import EngineConfig
from pyorch.engine.exceptions import EngineDeadError
from pyorch.pooling_params import PoolingParams
from pyorch.sampling_params import SamplingParams
from pyorch.wire import FrameReader, encode_frame, encode_params

logger = logging.getLogger(__name__)

_SYNC_SEND_TIMEOUT_S = 10.0  # a send outside an event loop waits this long for room


class EngineCoreClient:
    """Starts the engine-core process (the constructor returns at once) and talks to it.

    `wait_ready()` raises the process's start-up error with its original message: the
    same exception type when it is a builtin one (ValueError, FileNotFoundError, ...), otherwise
    RuntimeError.
    """

    def __init__(self, config: EngineConfig) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.sock, child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        for s in (self.sock, child_sock):
            wire.configure_socket(s)
        self.proc = ctx.Process(target=_engine_core_main, name="pyorch-engine-core",
                                args=(config, child_sock, os.getpid()), daemon=True)
        self.proc.start()
        child_sock.close()  # only the child holds its end: its death reads as EOF here
        self._finalizer = weakref.finalize(self, _kill, self.proc, self.sock)
        self._reader = FrameReader()
        self._inbox: list[Any] = []
        self._out_buf = bytearray()
        self._writer_loop: Optional[asyncio.AbstractEventLoop] = None
        self.closed = False
        self.ready_info: dict[str, Any] = {}

    # ---- start-up ----------------------------------------------------------------------------
    def wait_ready(self) -> dict[str, Any]:
        """Blocks until the core has loaded the model and sized the KV cache; returns its READY
        info. On a start-up failure, shuts the process down and raises its error."""
        try:
            self.ready_info = self._wait_ready()
        except BaseException:
            self.shutdown()
            raise
        self.sock.setblocking(False)
        return self.ready_info

    def _wait_ready(self) -> dict[str, Any]:
        while True:
            multiprocessing.connection.wait([self.sock, self.proc.sentinel])
            data = self.sock.recv(1 << 20)
            if not data:
                self.proc.join(5.0)
                raise RuntimeError(
                    "the engine-core process exited during start-up "
                    f"(exit code {self.proc.exitcode}); see its log above")
            for msg in self._reader.feed(data):
                if msg[0] == wire.READY:
                    return msg[1]
                if msg[0] == wire.STARTUP_ERROR:
                    _, type_name, message, tb = msg
                    logger.error("engine core failed to start:\n%s", tb)
                    raise _rebuild_exception(type_name, message)
                raise RuntimeError(f"unexpected engine-core message during start-up: {msg[0]}")

    # ---- state -------------------------------------------------------------------------------
    def is_alive(self) -> bool:
        return not self.closed and self.proc.is_alive()

    @property
    def pid(self) -> Optional[int]:
        return self.proc.pid

    @property
    def exitcode(self) -> Optional[int]:
        return self.proc.exitcode

    # ---- sending -----------------------------------------------------------------------------
    def add_request(self, req_id: str, prompt_token_ids: list[int],
                    params: Union[SamplingParams, PoolingParams],
                    arrival_time: float, priority: int, eos_token_id: Optional[int]) -> None:
        self.send((wire.ADD, req_id, prompt_token_ids, encode_params(params), arrival_time,
                   priority, eos_token_id))

    def abort_requests(self, req_ids: list[str]) -> None:
        if req_ids:
            self.send((wire.ABORT, list(req_ids)))

    def finish_stopped(self, req_ids: list[str]) -> None:
        if req_ids:
            self.send((wire.FINISH_STOPPED, list(req_ids)))

    def send(self, msg: Any) -> None:
        """Queues one message and sends what the socket takes now; never blocks a loop."""
        if self.closed:
            raise EngineDeadError("the engine-core connection is closed")
        self._out_buf += encode_frame(msg)
        self._flush()

    def _flush(self) -> None:
        deadline = None
        while self._out_buf:
            try:
                sent = self.sock.send(self._out_buf)
            except BlockingIOError:
                try:
                    loop = asyncio.get_running_loop()
                except RuntimeError:  # no loop: wait for room (start-up, sync shutdown)
                    deadline = deadline or time.monotonic() + _SYNC_SEND_TIMEOUT_S
                    if time.monotonic() > deadline:
                        raise EngineDeadError(
                            "the engine core stopped reading its socket") from None
                    select.select([], [self.sock], [], 0.1)
                    continue
                if self._writer_loop is None:
                    loop.add_writer(self.sock.fileno(), self._flush)
                    self._writer_loop = loop
                return
            except OSError as e:
                self._out_buf.clear()
                raise EngineDeadError(f"lost the engine-core connection: {e}") from e
            del self._out_buf[:sent]
        if self._writer_loop is not None:
            self._writer_loop.remove_writer(self.sock.fileno())
            self._writer_loop = None

    # ---- receiving ---------------------------------------------------------------------------
    async def recv(self) -> list[Any]:
        """The next messages from the core (at least one); raises EOFError when it is gone."""
        loop = asyncio.get_running_loop()
        while not self._inbox:
            data = await loop.sock_recv(self.sock, 1 << 20)
            if not data:
                raise EOFError("the engine-core process closed its socket")
            self._inbox.extend(self._reader.feed(data))
        msgs, self._inbox = self._inbox, []
        return msgs

    # ---- shutdown ----------------------------------------------------------------------------
    def shutdown(self, timeout: float = 5.0) -> None:
        """Asks the process to exit, then terminates / kills it if it does not, joins it and
        closes the socket. Idempotent."""
        if not self.closed:
            try:
                self._out_buf.clear()
                self.sock.setblocking(True)
                self.sock.settimeout(1.0)
                self.sock.sendall(encode_frame((wire.SHUTDOWN,)))
            except OSError:
                pass
        # Closing our end now also frees a core blocked sending to us (it gets EPIPE / EOF).
        self.close_socket()
        if self.proc.pid is not None:
            self.proc.join(timeout)
            if self.proc.is_alive():
                logger.warning("engine core did not exit in %.0f s; terminating it", timeout)
                self.proc.terminate()
                self.proc.join(2.0)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join()

    def close_socket(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        if loop is not None and not loop.is_closed():
            # Safe only from the loop's own thread, which is where shutdown normally runs.
            loop.remove_reader(self.sock.fileno())
            loop.remove_writer(self.sock.fileno())
        self._writer_loop = None
        self.sock.close()
        self._finalizer.detach()


def _engine_core_main(config: EngineConfig, sock: socket.socket, parent_pid: int) -> None:
    """The engine-core process's entry point: the core (model runner, layers, ops) is imported
    here, in the child, and never in the front end's process."""
    from pyorch.core.core_proc import run_engine_core

    run_engine_core(config, sock, parent_pid)


def _rebuild_exception(type_name: str, message: str) -> BaseException:
    exc_type = getattr(builtins, type_name, None)
    if isinstance(exc_type, type) and issubclass(exc_type, Exception):
        try:
            return exc_type(message)
        except Exception:
            pass
    return RuntimeError(f"{type_name}: {message}")


def _kill(proc: multiprocessing.process.BaseProcess, sock: socket.socket) -> None:
    """Finalizer: never leave the core running when its client is garbage-collected."""
    sock.close()
    if proc.is_alive():
        proc.terminate()
        proc.join(2.0)
    if proc.is_alive():
        proc.kill()
