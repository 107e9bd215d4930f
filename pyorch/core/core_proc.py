"""The engine-core process: EngineCore's busy loop behind a socket.

The front end (`pyorch.engine.core_client`) starts this process and talks to it in the wire
protocol of `pyorch.wire`. The process steps while it has work and blocks on the socket when
idle. It exits on SHUTDOWN, on socket EOF (the front end closed or died), or when its parent
process is gone.
"""

from __future__ import annotations

import gc
import logging
import os
import select
import signal
import socket
import sys
import traceback
from typing import Any, Optional

from pyorch import envs
from pyorch.config import EngineConfig
from pyorch.core.engine_core import EngineCore
from pyorch.core.request import Request, RequestStatus
from pyorch.logger import configure_logging
from pyorch.pooling_params import PoolingParams
from pyorch.sampling_params import SamplingParams
from pyorch.wire import (
    ABORT,
    ADD,
    ENGINE_ERROR,
    FINISH_STOPPED,
    OUTPUTS,
    READY,
    REQUEST_ERROR,
    RESET_PREFIX_CACHE,
    SHUTDOWN,
    STARTUP_ERROR,
    UTILITY,
    UTILITY_RESULT,
    FrameReader,
    decode_params,
    encode_frame,
    encode_output,
    encode_stats,
)

logger = logging.getLogger(__name__)

_IDLE_POLL_S = 1.0  # when idle, how often to check that the parent still lives


# ---- the process -----------------------------------------------------------------------------
class _Shutdown(Exception):
    pass


class EngineCoreProc:
    """Runs an EngineCore behind a blocking socket (inside the engine-core process)."""

    def __init__(self, core: EngineCore, sock: socket.socket, parent_pid: int) -> None:
        self.core = core
        self.sock = sock
        self.parent_pid = parent_pid
        self.reader = FrameReader()
        self.test_hooks = envs.PYORCH_ENGINE_CORE_TEST_HOOKS

    def send(self, msg: Any) -> None:
        self.sock.sendall(encode_frame(msg))

    def _receive(self, timeout: Optional[float]) -> list[Any]:
        """Messages available within `timeout` (0 = poll); raises _Shutdown on EOF."""
        msgs: list[Any] = []
        while True:
            ready, _, _ = select.select([self.sock], [], [], timeout)
            if not ready:
                return msgs
            data = self.sock.recv(1 << 20)
            if not data:
                raise _Shutdown("the front end closed the socket")
            msgs.extend(self.reader.feed(data))
            timeout = 0.0  # drain what else is there, then go step

    def run_busy_loop(self) -> None:
        core = self.core
        while True:
            busy = core.has_unfinished_requests()
            for msg in self._receive(0.0 if busy else _IDLE_POLL_S):
                self._handle(msg)
            if os.getppid() != self.parent_pid:
                raise _Shutdown("the parent process is gone")
            if not core.has_unfinished_requests():
                continue
            step = core.step()
            self.send((OUTPUTS, [encode_output(o) for o in step.outputs],
                       encode_stats(step.scheduler_stats), step.timestamp, step.scheduled_time,
                       step.scheduled_new_req_ids))

    def _handle(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == ADD:
            _, req_id, token_ids, params, arrival_time, priority, eos_token_id = msg
            try:
                decoded = decode_params(params)
                if isinstance(decoded, PoolingParams):
                    request = Request(req_id, token_ids, SamplingParams(), eos_token_id,
                                      arrival_time, priority, pooling_params=decoded)
                else:
                    request = Request(req_id, token_ids, decoded, eos_token_id, arrival_time,
                                      priority)
                self.core.add_request(request)
            except ValueError as e:
                self.send((REQUEST_ERROR, req_id, str(e)))
        elif kind == ABORT:
            self.core.abort_requests(msg[1])
        elif kind == FINISH_STOPPED:
            self.core.finish_requests(msg[1], RequestStatus.FINISHED_STOPPED)
        elif kind == RESET_PREFIX_CACHE:
            self.send((UTILITY_RESULT, msg[1], True, self.core.reset_prefix_cache()))
        elif kind == UTILITY:
            self._utility(*msg[1:])
        elif kind == SHUTDOWN:
            raise _Shutdown("asked to shut down")
        else:
            raise ValueError(f"unknown engine-core message type {kind!r}")

    def _utility(self, call_id: int, method: str, args: list) -> None:
        methods = {
            "get_stats": lambda: encode_stats(self.core.make_stats()),
            "get_kv_cache_info": self.core.get_kv_cache_info,
            "get_num_unfinished_requests": self.core.get_num_unfinished_requests,
            "ping": lambda: "pong",
        }
        if self.test_hooks:
            methods["inject_step_error"] = self._inject_step_error
        if method not in methods:
            self.send((UTILITY_RESULT, call_id, False, f"unknown engine-core utility {method!r}"))
            return
        try:
            result = methods[method](*args)
        except Exception as e:
            self.send((UTILITY_RESULT, call_id, False, f"{type(e).__name__}: {e}"))
            return
        self.send((UTILITY_RESULT, call_id, True, result))

    def _inject_step_error(self) -> bool:
        """Test hook: the next step fails inside the model runner."""

        def failing_execute(*args: Any) -> Any:  # (scheduler_output, grammar)
            raise RuntimeError("injected failure in model_runner.execute (test hook)")

        # Replaces the bound method on this one instance: typed Any, since mypy forbids
        # assigning to a method (method-assign) through the class's type.
        executor: Any = self.core.model_executor
        executor.execute_model = failing_execute
        return True


def run_engine_core(config: EngineConfig, sock: socket.socket, parent_pid: int) -> None:
    """Entry point of the engine-core process (multiprocessing, spawn context)."""
    # The front end owns Ctrl-C and SIGTERM (a process-group SIGTERM from systemd or `timeout`
    # reaches us too) and shuts us down after in-flight requests finish; we also exit on socket
    # EOF or when the parent dies, and its shutdown falls back to SIGKILL.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    configure_logging(process_name="engine-core")
    sock.setblocking(True)
    try:
        core = EngineCore(config)
    except BaseException as e:  # report, then exit: the front end raises it
        _send_quietly(sock, (STARTUP_ERROR, type(e).__name__, str(e), traceback.format_exc()))
        sys.exit(1)
    proc = EngineCoreProc(core, sock, parent_pid)
    # The start-up heap (model, KV cache, imports) lives as long as this process: keep the
    # collector's full collections off it, as vLLM's engine-core process does (LLM.generate
    # does the same for the duration of a call).
    gc.collect()
    gc.freeze()
    try:
        proc.send((READY, core.ready_info()))
        proc.run_busy_loop()
    except _Shutdown as e:
        logger.info("engine core exiting: %s", e)
    except (BrokenPipeError, ConnectionResetError):
        logger.info("engine core exiting: the front end is gone")
    except BaseException as e:
        logger.exception("engine core failed")
        _send_quietly(sock, (ENGINE_ERROR, f"{type(e).__name__}: {e}", traceback.format_exc()))
        sys.exit(1)
    finally:
        core.shutdown()
        sock.close()


def _send_quietly(sock: socket.socket, msg: Any) -> None:
    try:
        sock.sendall(encode_frame(msg))
    except OSError:
        pass
