"""The engine-core process: EngineCore's busy loop behind a socket, and the wire protocol.

Wire format: length-prefixed frames (4-byte little-endian length, then a pickle protocol 5
payload) over a stream socket (one end of a `socket.socketpair`). Payloads hold plain data only
(tuples, lists, dicts, str, int, float, bool, None): both ends unpickle with a class-free
unpickler, so a tensor or an object can never slip onto the wire.

Front end -> core (first element = message type):
    (ADD, req_id, prompt_token_ids, params_dict, arrival_time, priority, eos_token_id)
    (ABORT, [req_id, ...])                      finish as aborted, free blocks
    (FINISH_STOPPED, [req_id, ...])             the front end found a stop string
    (RESET_PREFIX_CACHE, call_id)               answered with UTILITY_RESULT (bool)
    (UTILITY, call_id, method, args)            answered with UTILITY_RESULT
    (SHUTDOWN,)
Core -> front end:
    (READY, info_dict) | (STARTUP_ERROR, exc_type_name, message, traceback_text)
    (OUTPUTS, [output tuple, ...], stats_dict, timestamp, scheduled_time, [new req ids])
    (UTILITY_RESULT, call_id, ok, value or error text)
    (REQUEST_ERROR, req_id, message)            the core refused an ADD
    (ENGINE_ERROR, message, traceback_text)     a step raised; the process exits after it

The process steps while it has work and blocks on the socket when idle. It exits on SHUTDOWN, on
socket EOF (the front end closed or died), or when its parent process is gone.
"""

from __future__ import annotations

import dataclasses
import gc
import io
import logging
import os
import pickle
import select
import signal
import socket
import struct
import sys
import traceback
from typing import Any, Optional

from pyorch.engine.core import EngineCore
from pyorch.engine.request import Request, RequestStatus
from pyorch.engine.scheduler_output import EngineCoreOutput, SchedulerStats
from pyorch.layers.sampler import LogprobsLists
from pyorch.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# Message types.
ADD, ABORT, FINISH_STOPPED, RESET_PREFIX_CACHE, UTILITY, SHUTDOWN = 1, 2, 3, 4, 5, 6
READY, STARTUP_ERROR, OUTPUTS, UTILITY_RESULT, REQUEST_ERROR, ENGINE_ERROR = 10, 11, 12, 13, 14, 15

# With this set in the environment, the core accepts test-only utility calls (fault injection).
TEST_HOOKS_ENV = "PYORCH_ENGINE_CORE_TEST_HOOKS"
_IDLE_POLL_S = 1.0  # when idle, how often to check that the parent still lives
_HEADER = struct.Struct("<I")
_SOCKET_BUFFER_BYTES = 4 << 20


# ---- framing ---------------------------------------------------------------------------------
class _PlainUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(
            f"engine-core frames carry plain data only; refusing {module}.{name}")


def encode_frame(msg: Any) -> bytes:
    payload = pickle.dumps(msg, protocol=5)
    return _HEADER.pack(len(payload)) + payload


class FrameReader:
    """Reassembles frames from a byte stream."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[Any]:
        self._buf += data
        msgs = []
        while len(self._buf) >= _HEADER.size:
            (length,) = _HEADER.unpack_from(self._buf)
            end = _HEADER.size + length
            if len(self._buf) < end:
                break
            msgs.append(_PlainUnpickler(io.BytesIO(self._buf[_HEADER.size:end])).load())
            del self._buf[:end]
        return msgs


def configure_socket(sock: socket.socket) -> None:
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, _SOCKET_BUFFER_BYTES)
        except OSError:
            pass


# ---- payload encoding ------------------------------------------------------------------------
def encode_params(params: SamplingParams) -> dict[str, Any]:
    """SamplingParams -> a dict of plain values, with the engine-filled stop/bad-word ids."""
    d = {f.name: getattr(params, f.name) for f in dataclasses.fields(params) if f.init}
    d["output_kind"] = int(params.output_kind)
    d["_all_stop_token_ids"] = sorted(params.all_stop_token_ids)
    d["_bad_words_token_ids"] = params.bad_words_token_ids
    return d


def decode_params(d: dict[str, Any]) -> SamplingParams:
    d = dict(d)
    all_stop = d.pop("_all_stop_token_ids")
    bad_words_ids = d.pop("_bad_words_token_ids")
    params = SamplingParams(**d)
    params._all_stop_token_ids = set(all_stop)
    params._bad_words_token_ids = bad_words_ids
    return params


def _lists(x: Optional[LogprobsLists]) -> Optional[tuple]:
    return None if x is None else tuple(x)


def encode_output(o: EngineCoreOutput) -> tuple:
    return (o.req_id, o.new_token_ids, o.finish_reason, o.stop_reason, _lists(o.new_logprobs),
            _lists(o.new_prompt_logprobs), o.num_cached_tokens)


def decode_output(t: tuple) -> EngineCoreOutput:
    req_id, new_ids, finish, stop, lp, plp, cached = t
    return EngineCoreOutput(
        req_id=req_id, new_token_ids=new_ids, finish_reason=finish, stop_reason=stop,
        new_logprobs=None if lp is None else LogprobsLists(*lp),
        new_prompt_logprobs=None if plp is None else LogprobsLists(*plp),
        num_cached_tokens=cached,
    )


def encode_stats(stats: SchedulerStats) -> dict[str, Any]:
    return {f.name: getattr(stats, f.name) for f in dataclasses.fields(stats)}


def decode_stats(d: dict[str, Any]) -> SchedulerStats:
    return SchedulerStats(**d)


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
        self.test_hooks = os.environ.get(TEST_HOOKS_ENV) == "1"

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
                self.core.add_request(Request(req_id, token_ids, decode_params(params),
                                              eos_token_id, arrival_time, priority))
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

        def failing_execute(scheduler_output: Any) -> Any:
            raise RuntimeError("injected failure in model_runner.execute (test hook)")

        self.core.model_runner.execute_model = failing_execute
        return True


def run_engine_core(config: Any, sock: socket.socket, parent_pid: int) -> None:
    """Entry point of the engine-core process (multiprocessing, spawn context)."""
    # The front end owns Ctrl-C and SIGTERM (a process-group SIGTERM from systemd or `timeout`
    # reaches us too) and shuts us down after in-flight requests finish; we also exit on socket
    # EOF or when the parent dies, and its shutdown falls back to SIGKILL.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s engine-core %(levelname)s %(message)s")
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
        sock.close()


def _send_quietly(sock: socket.socket, msg: Any) -> None:
    try:
        sock.sendall(encode_frame(msg))
    except OSError:
        pass
