"""The engine-core wire protocol: message ids, framing and payload codecs.

Both processes import this module, and it imports nothing of torch, the model runner or the
scheduler, so the API-server process never loads the engine core (see docs/architecture.md,
"Processes at run time").

Wire format: length-prefixed frames (4-byte little-endian length, then a pickle protocol 5
payload) over a stream socket (one end of a `socket.socketpair`). Payloads hold plain data only
(tuples, lists, dicts, str, int, float, bool, None): both ends unpickle with a class-free
unpickler, so a tensor or an object can never slip onto the wire.

Front end -> core (first element = message type):
    (ADD, req_id, prompt_token_ids, params_dict, arrival_time, priority, eos_token_id)
                                                params_dict {"pooling": {...}}: a pooling request
    (ABORT, [req_id, ...])                      finish as aborted, free blocks
    (FINISH_STOPPED, [req_id, ...])             the front end found a stop string
    (RESET_PREFIX_CACHE, call_id)               answered with UTILITY_RESULT (bool)
    (UTILITY, call_id, method, args)            answered with UTILITY_RESULT
    (SHUTDOWN,)
Core -> front end:
    (READY, info_dict) | (STARTUP_ERROR, exc_type_name, message, traceback_text)
    (OUTPUTS, [output tuple, ...], stats_dict, timestamp, scheduled_time, [new req ids])
                                                a pooled array travels as (shape, float32 bytes)
    (UTILITY_RESULT, call_id, ok, value or error text)
    (REQUEST_ERROR, req_id, message)            the core refused an ADD
    (ENGINE_ERROR, message, traceback_text)     a step raised; the process exits after it
"""

from __future__ import annotations

import dataclasses
import io
import pickle
import socket
import struct
from typing import Any, Optional, Union

import numpy as np

from pyorch.core_types import EngineCoreOutput, LogprobsLists
from pyorch.metrics.stats import SchedulerStats
from pyorch.pooling_params import PoolingParams
from pyorch.sampling_params import SamplingParams

# Message types.
ADD, ABORT, FINISH_STOPPED, RESET_PREFIX_CACHE, UTILITY, SHUTDOWN = 1, 2, 3, 4, 5, 6
READY, STARTUP_ERROR, OUTPUTS, UTILITY_RESULT, REQUEST_ERROR, ENGINE_ERROR = 10, 11, 12, 13, 14, 15

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
        buf, start, size = self._buf, 0, len(self._buf)
        with memoryview(buf) as view:
            while size - start >= _HEADER.size:
                (length,) = _HEADER.unpack_from(buf, start)
                end = start + _HEADER.size + length
                if size < end:
                    break
                msgs.append(_PlainUnpickler(io.BytesIO(view[start + _HEADER.size:end])).load())
                start = end
        # One deletion per read, not per frame: many frames arrive together under load.
        del buf[:start]
        return msgs


def configure_socket(sock: socket.socket) -> None:
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, _SOCKET_BUFFER_BYTES)
        except OSError:
            pass


# ---- payload encoding ------------------------------------------------------------------------
def encode_params(params: Union[SamplingParams, PoolingParams]) -> dict[str, Any]:
    """SamplingParams -> a dict of plain values, with the engine-filled stop/bad-word ids;
    PoolingParams -> {"pooling": its fields}."""
    if isinstance(params, PoolingParams):
        return {"pooling": params.to_dict()}
    return params.to_dict()


def decode_params(d: dict[str, Any]) -> Union[SamplingParams, PoolingParams]:
    if "pooling" in d:
        return PoolingParams.from_dict(d["pooling"])
    return SamplingParams.from_dict(d)


def _lists(x: Optional[LogprobsLists]) -> Optional[tuple]:
    return None if x is None else tuple(x)


def encode_pooled(a: Optional[np.ndarray]) -> Optional[tuple]:
    """A pooled array as (shape, float32 little-endian bytes): plain data, 4 bytes a value."""
    if a is None:
        return None
    return (tuple(int(d) for d in a.shape), np.ascontiguousarray(a, dtype="<f4").tobytes())


def decode_pooled(t: Optional[tuple]) -> Optional[np.ndarray]:
    if t is None:
        return None
    shape, data = t
    return np.frombuffer(data, dtype="<f4").reshape(shape)


def encode_output(o: EngineCoreOutput) -> tuple:
    return (o.req_id, o.new_token_ids, o.finish_reason, o.stop_reason, _lists(o.new_logprobs),
            _lists(o.new_prompt_logprobs), o.num_cached_tokens, encode_pooled(o.pooled))


def decode_output(t: tuple) -> EngineCoreOutput:
    req_id, new_ids, finish, stop, lp, plp, cached, pooled = t
    if lp is None and plp is None and pooled is None:  # the usual output: one per request
        return EngineCoreOutput(req_id, new_ids, finish, stop, None, None, cached)
    return EngineCoreOutput(
        req_id=req_id, new_token_ids=new_ids, finish_reason=finish, stop_reason=stop,
        new_logprobs=None if lp is None else LogprobsLists(*lp),
        new_prompt_logprobs=None if plp is None else LogprobsLists(*plp),
        num_cached_tokens=cached, pooled=decode_pooled(pooled),
    )


def encode_stats(stats: SchedulerStats) -> dict[str, Any]:
    return {f.name: getattr(stats, f.name) for f in dataclasses.fields(stats)}


def decode_stats(d: dict[str, Any]) -> SchedulerStats:
    return SchedulerStats(**d)
