"""The API server's own cost at many concurrent streams, on the CPU (issue 24).

    python bench/api_server_cpu.py --streams 500 --step-ms 20 [--endpoint chat] [--pin]
    python bench/api_server_cpu.py --target trivial --streams 500 --step-ms 5  # the client's limit

What runs: the real `pyorch-serve` (api_server under uvicorn, AsyncLLM, output processor,
detokenizer, the completion/chat SSE handlers, the wire protocol to a separate engine-core
process) in a subprocess, in front of `FakeEngineCore`: an engine core whose step costs nothing
but a sleep to the next `--step-ms` tick and emits one token per running request per step
(`ignore_eos`: every request runs to its `max_tokens`). It runs inside the real `EngineCoreProc`
busy loop; the bench puts it in place of the real core by swapping `core_client._engine_core_main`
in the server's process only (the spawned core process unpickles this module's callable).

The client (this process) opens `--streams` connections at once, each one streaming request of
`--input-len` prompt words and `--output-len` tokens, over raw asyncio protocols (no HTTP
library), and timestamps every SSE event. `--target trivial` puts a trivial SSE server (one event
per stream per tick, no work) in place of pyorch-serve, to show what the client itself sustains.

Reports chunks/s delivered, tokens per chunk, ITL p50/p99 as the client saw them, TTFT, and the
API-server process's CPU seconds per token (utime + stime of its process, all threads; the engine
core is another process). Writes JSON to bench/results/cpu/ (`--output-json`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Optional

_HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_MODEL = "/work/shared/tools/vllm-peer/llama3-8b-dummy"
_FIRST_WORD_ID = 3  # the dummy tokenizer's words are t3.. (0-2 are special)
# For --endpoint chat: the messages' text, then one word as the assistant's header.
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}t4{% endif %}")


# ---- the fake engine core (runs in the engine-core process) ------------------------------------
class FakeEngineCore:
    """EngineCore's interface (what `EngineCoreProc` calls) with a model step that costs nothing:
    every `step_ms`, each running request gets one token; a request finishes ("length") at its
    max_tokens. At most `max_num_seqs` run; the rest wait, as in the scheduler."""

    def __init__(self, config: Any, step_ms: float, seed: int = 0) -> None:
        from pyorch.metrics.stats import SchedulerStats

        self._stats_type = SchedulerStats
        self.config = config
        self.step_s = step_ms / 1000.0
        self.max_num_seqs = int(config.scheduler_config.max_num_seqs)
        vocab = int(config.model_config.vocab_size)
        rng = random.Random(seed)
        self.token_ids = [rng.randrange(_FIRST_WORD_ID, vocab) for _ in range(4093)]
        self.waiting: dict[str, int] = {}  # req_id -> max_tokens
        self.running: dict[str, list[int]] = {}  # req_id -> [num_generated, max_tokens]
        self.deadline = 0.0
        self.cursor = 0

    def add_request(self, request: Any) -> None:
        self.waiting[request.request_id] = int(request.max_tokens or 16)

    def abort_requests(self, request_ids: Any) -> None:
        for rid in request_ids:
            self.waiting.pop(rid, None)
            self.running.pop(rid, None)

    def finish_requests(self, request_ids: Any, status: Any) -> None:
        self.abort_requests(request_ids)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    def step(self) -> Any:
        from pyorch.core.engine_core import EngineCoreOutputs
        from pyorch.core_types import EngineCoreOutput

        now = time.monotonic()
        if self.deadline < now:  # idle before, or a late tick: start a fresh cadence
            self.deadline = now + self.step_s
        time.sleep(max(0.0, self.deadline - now))
        self.deadline += self.step_s
        scheduled = time.time()
        new_ids = []
        while self.waiting and len(self.running) < self.max_num_seqs:
            rid = next(iter(self.waiting))
            self.running[rid] = [0, self.waiting.pop(rid)]
            new_ids.append(rid)
        outputs, ids, n = [], self.token_ids, len(self.token_ids)
        for rid, state in list(self.running.items()):
            state[0] += 1
            self.cursor = (self.cursor + 1) % n
            done = state[0] >= state[1]
            if done:
                del self.running[rid]
            outputs.append(EngineCoreOutput(rid, [ids[self.cursor]],
                                            "length" if done else None))
        return EngineCoreOutputs(outputs, self.make_stats(), time.time(), scheduled, new_ids)

    def make_stats(self) -> Any:
        return self._stats_type(num_running_reqs=len(self.running),
                                num_waiting_reqs=len(self.waiting))

    def reset_prefix_cache(self) -> bool:
        return True

    def get_kv_cache_info(self) -> dict[str, Any]:
        return {"num_blocks": 65537, "num_usable_blocks": 65536, "num_free_blocks": 65536,
                "block_size": 16, "kv_cache_usage": 0.0,
                "num_unfinished_requests": self.get_num_unfinished_requests()}

    def ready_info(self) -> dict[str, Any]:
        sc = self.config.scheduler_config
        return {"num_kv_blocks": 65537, "num_usable_blocks": 65536, "block_size": 16,
                "max_model_len": sc.max_model_len,
                "vocab_size": self.config.model_config.vocab_size,
                "max_num_seqs": sc.max_num_seqs,
                "max_num_batched_tokens": sc.max_num_batched_tokens,
                "device": "cpu", "dtype": "bfloat16"}

    def shutdown(self) -> None:
        return None


class FakeCoreMain:
    """Takes `core_client._engine_core_main`'s place: the engine-core process's entry point, with
    FakeEngineCore inside the real EngineCoreProc loop (picklable: spawn sends it by value)."""

    def __init__(self, step_ms: float) -> None:
        self.step_ms = step_ms

    def __call__(self, config: Any, sock: socket.socket, parent_pid: int) -> None:
        from pyorch import wire
        from pyorch.core.core_proc import EngineCoreProc, _Shutdown

        sock.setblocking(True)
        core: Any = FakeEngineCore(config, self.step_ms)
        proc = EngineCoreProc(core, sock, parent_pid)
        try:
            proc.send((wire.READY, core.ready_info()))
            proc.run_busy_loop()
        except (_Shutdown, BrokenPipeError, ConnectionResetError):
            pass
        finally:
            sock.close()


def serve(argv: list[str], step_ms: float, loop: Optional[str], http: Optional[str],
          profile: Optional[str] = None) -> int:
    """The server subprocess: pyorch-serve with FakeEngineCore as its engine core."""
    import uvicorn

    from pyorch.engine import core_client
    from pyorch.entrypoints.openai import api_server

    core_client._engine_core_main = FakeCoreMain(step_ms)  # type: ignore[assignment]
    if loop or http:  # uvicorn's choice of event loop / HTTP parser, to compare them
        base_init = uvicorn.Config.__init__

        def init(self: Any, *args: Any, **kwargs: Any) -> None:
            kwargs.update({k: v for k, v in (("loop", loop), ("http", http)) if v})
            base_init(self, *args, **kwargs)

        uvicorn.Config.__init__ = init  # type: ignore[method-assign]
    if not profile:
        return api_server.main(argv)
    import cProfile

    profiler = cProfile.Profile()
    try:
        return profiler.runcall(api_server.main, argv)
    finally:
        profiler.dump_stats(profile)


# ---- a trivial SSE server (the client's own limit) --------------------------------------------
def serve_trivial(port: int, step_ms: float) -> None:
    """Answers every POST with `max_tokens` one-token SSE events, one per stream per tick."""
    streams: list[list[Any]] = []  # [transport, tokens left]
    head = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n")

    def chunk(payload: bytes) -> bytes:
        return b"%x\r\n%s\r\n" % (len(payload), payload)

    event = chunk(b'data: {"id":"x","object":"text_completion","choices":[{"index":0,'
                  b'"text":" t1","finish_reason":null}]}\n\n')

    def tail(n: int) -> bytes:
        return chunk(b'data: {"id":"x","choices":[],"usage":{"completion_tokens":%d}}\n\n'
                     b"data: [DONE]\n\n" % n) + b"0\r\n\r\n"

    class Proto(asyncio.Protocol):
        def connection_made(self, transport: Any) -> None:
            self.transport, self.buf = transport, b""

        def data_received(self, data: bytes) -> None:
            self.buf += data
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            length = 0
            for line in self.buf[:end].split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            if len(self.buf) < end + 4 + length:
                return
            if self.buf.startswith(b"GET"):
                self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
                self.buf = b""
                return
            body = json.loads(self.buf[end + 4:end + 4 + length])
            self.buf = b""
            self.transport.write(head)
            n = int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)
            streams.append([self.transport, n, n])

    async def ticker() -> None:
        while True:
            await asyncio.sleep(step_ms / 1000.0)
            for s in list(streams):
                s[1] -= 1
                s[0].write(event if s[1] > 0 else event + tail(s[2]))
                if s[1] <= 0:
                    streams.remove(s)

    async def main() -> None:
        server = await asyncio.get_running_loop().create_server(Proto, "127.0.0.1", port,
                                                                backlog=4096)
        asyncio.get_running_loop().create_task(ticker())
        await server.serve_forever()

    asyncio.run(main())


# ---- the client --------------------------------------------------------------------------------
@dataclass
class StreamResult:
    """One streaming request as the client saw it."""

    start: float = 0.0
    chunk_times: list[float] = field(default_factory=list)  # each event with generated text
    completion_tokens: Optional[int] = None  # from the usage event
    error: Optional[str] = None
    done: bool = False


class SSEStream(asyncio.Protocol):
    """One POST and its chunked SSE response, parsed just enough: an event counts as a token
    chunk when its first choice has non-empty text (completions) or content (chat)."""

    def __init__(self, request: bytes, result: StreamResult, finished: asyncio.Future) -> None:
        self.request, self.result, self.finished = request, result, finished
        self.head: Optional[bytes] = None
        self.raw = b""  # received, not yet de-chunked
        self.body = b""  # de-chunked, not yet split into events

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        self.result.start = time.perf_counter()
        transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        self.raw += data
        if self.head is None:
            end = self.raw.find(b"\r\n\r\n")
            if end < 0:
                return
            self.head, self.raw = self.raw[:end], self.raw[end + 4:]
            if not self.head.startswith(b"HTTP/1.1 200"):
                status = self.head.split(b"\r\n", 1)[0].decode(errors="replace")
                self._finish(f"HTTP error: {status}")
                return
        while True:  # de-chunk
            eol = self.raw.find(b"\r\n")
            if eol < 0:
                break
            size = int(self.raw[:eol], 16)
            if len(self.raw) < eol + 4 + size:
                break
            self.body += self.raw[eol + 2:eol + 2 + size]
            self.raw = self.raw[eol + 4 + size:]
        events = self.body.split(b"\n\n")
        self.body = events.pop()
        for ev in events:
            self._event(ev, now)

    def _event(self, ev: bytes, now: float) -> None:
        if ev == b"data: [DONE]":
            self.result.done = True
            self._finish(None)
            return
        if b'"error"' in ev[:20]:
            self._finish(ev.decode(errors="replace")[:300])
            return
        for key in (b'"text":"', b'"content":"'):
            i = ev.find(key)
            if i >= 0 and ev[i + len(key):i + len(key) + 1] != b'"':
                self.result.chunk_times.append(now)
                return
        i = ev.find(b'"completion_tokens":')
        if i >= 0 and b'"choices":[]' in ev:
            self.result.completion_tokens = json.loads(ev[6:])["usage"]["completion_tokens"]

    def _finish(self, error: Optional[str]) -> None:
        if error is not None and self.result.error is None:
            self.result.error = error
        if not self.finished.done():
            self.finished.set_result(None)
        self.transport.close()

    def connection_lost(self, exc: Optional[Exception]) -> None:
        if not self.finished.done():
            self.result.error = self.result.error or f"connection lost: {exc}"
            self.finished.set_result(None)


def request_bytes(endpoint: str, prompt: str, output_len: int, port: int) -> bytes:
    """vLLM's `bench serve` payloads (openai / openai-chat backends) with ignore_eos."""
    if endpoint == "chat":
        path = "/v1/chat/completions"
        body: dict[str, Any] = {"model": "bench", "messages": [{"role": "user",
                                                                 "content": prompt}],
                                "max_completion_tokens": output_len}
    else:
        path = "/v1/completions"
        body = {"model": "bench", "prompt": prompt, "max_tokens": output_len}
    body.update({"temperature": 0.0, "ignore_eos": True, "stream": True,
                 "stream_options": {"include_usage": True}})
    data = json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(data)}\r\n"
            f"connection: close\r\n\r\n").encode() + data


def random_prompts(num: int, input_len: int, vocab_size: int, seed: int = 0) -> list[str]:
    """Prompts of `input_len` dummy-tokenizer words (one token each), as vLLM's random dataset
    draws random ids."""
    rng = random.Random(seed)
    return [" ".join(f"t{rng.randrange(_FIRST_WORD_ID, vocab_size)}" for _ in range(input_len))
            for _ in range(num)]


async def run_streams(port: int, requests: list[bytes]) -> tuple[list[StreamResult], float]:
    """Opens every stream at once (request rate inf); returns results and the wall time."""
    loop = asyncio.get_running_loop()
    results = [StreamResult() for _ in requests]
    futures = [loop.create_future() for _ in requests]
    start = time.perf_counter()

    async def one(req: bytes, res: StreamResult, fut: asyncio.Future) -> None:
        try:
            await loop.create_connection(lambda: SSEStream(req, res, fut), "127.0.0.1", port)
        except OSError as e:
            res.error = f"connect: {e}"
            fut.set_result(None)
        await fut

    streams = zip(requests, results, futures, strict=True)
    await asyncio.gather(*(one(r, s, f) for r, s, f in streams))
    return results, time.perf_counter() - start


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q / 100.0 * len(xs)))]


def summarize(results: list[StreamResult], wall_s: float, output_len: int) -> dict[str, Any]:
    """Chunks/s, tokens per chunk, client-side ITL and TTFT (ms) over the finished streams."""
    ok = [r for r in results if r.error is None and r.done]
    chunks = sum(len(r.chunk_times) for r in ok)
    tokens = sum(r.completion_tokens if r.completion_tokens is not None else output_len
                 for r in ok)
    itl = [(b - a) * 1e3 for r in ok
           for a, b in zip(r.chunk_times, r.chunk_times[1:], strict=False)]
    ttft = [(r.chunk_times[0] - r.start) * 1e3 for r in ok if r.chunk_times]
    times = [t for r in ok for t in r.chunk_times]
    span = (max(times) - min(times)) if len(times) > 1 else float("nan")
    return {
        "num_ok": len(ok), "num_failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "wall_s": wall_s, "chunks": chunks, "tokens": tokens,
        "chunks_per_s": chunks / span if span else float("nan"),
        "tokens_per_s": tokens / span if span else float("nan"),
        "tokens_per_chunk": tokens / chunks if chunks else float("nan"),
        "itl_mean_ms": sum(itl) / len(itl) if itl else float("nan"),
        "itl_p50_ms": _pct(itl, 50), "itl_p99_ms": _pct(itl, 99), "itl_max_ms": max(itl or [0]),
        "ttft_p50_ms": _pct(ttft, 50), "ttft_p99_ms": _pct(ttft, 99),
    }


# ---- the driver --------------------------------------------------------------------------------
def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, all its threads (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_healthy(port: int, proc: subprocess.Popen, log_path: str,
                 timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode}: "
                               f"{_tail(log_path)}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1.0) as s:
                s.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
                if s.recv(64).startswith(b"HTTP/1.1 200"):
                    return
        except OSError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"the server did not answer /health in {timeout_s:.0f} s: "
                       f"{_tail(log_path)}")


def _tail(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-15:])
    except OSError:
        return "(no server log)"


def start_server(args: argparse.Namespace, port: int) -> subprocess.Popen:
    cmd = [sys.executable, os.path.abspath(__file__), "--role", "server", "--port", str(port),
           "--step-ms", str(args.step_ms)]
    if args.target == "trivial":
        cmd[3] = "trivial"
    else:
        for flag in ("loop", "http", "profile"):
            if getattr(args, flag):
                cmd += [f"--{flag}", getattr(args, flag)]
        cmd += ["--", args.model, "--host", "127.0.0.1", "--port", str(port),
                "--load-format", "dummy", "--served-model-name", "bench",
                "--max-num-seqs", str(max(args.streams, 256)),
                "--max-model-len", str(args.input_len + args.output_len + 64),
                *args.server_args]
        if args.endpoint == "chat" and "--chat-template" not in args.server_args:
            cmd += ["--chat-template", CHAT_TEMPLATE]  # dummy tokenizers come without one
    # The server's output goes to a file (shown when it fails to start), or here with --verbose.
    log = None if args.verbose else open(args.server_log, "wb")  # noqa: SIM115
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT if log else None)


def run(args: argparse.Namespace) -> dict[str, Any]:
    port = free_port()
    proc = start_server(args, port)
    try:
        wait_healthy(port, proc, args.server_log)
        if args.pin:  # the server on CPU 0, this client (and everything else) elsewhere
            os.sched_setaffinity(proc.pid, {0})
            others = os.sched_getaffinity(0) - {0}
            if others:
                os.sched_setaffinity(0, others)
        vocab = 128256 if args.target == "trivial" else _vocab_size(args.model)
        prompts = random_prompts(args.streams, args.input_len, vocab, args.seed)
        reqs = [request_bytes(args.endpoint, p, args.output_len, port) for p in prompts]
        warm = [request_bytes(args.endpoint, p, 8, port) for p in prompts[:8]]
        asyncio.run(run_streams(port, warm))
        cpu0 = cpu_seconds(proc.pid)
        client0 = time.process_time()
        results, wall = asyncio.run(run_streams(port, reqs))
        server_cpu = cpu_seconds(proc.pid) - cpu0
        client_cpu = time.process_time() - client0
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    summary = summarize(results, wall, args.output_len)
    tokens = summary["tokens"] or 1
    summary.update({
        "server_cpu_s": server_cpu, "server_cpu_util": server_cpu / wall,
        "server_cpu_us_per_token": server_cpu / tokens * 1e6,
        "client_cpu_s": client_cpu, "client_cpu_util": client_cpu / wall,
        "offered_tokens_per_s": args.streams * 1000.0 / args.step_ms,
    })
    return summary


def _vocab_size(model: str) -> int:
    with open(os.path.join(model, "config.json")) as f:
        return int(json.load(f)["vocab_size"])


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--role", choices=["client", "server", "trivial"], default="client",
                        help=argparse.SUPPRESS)  # server/trivial: the subprocesses
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--target", choices=["pyorch", "trivial"], default="pyorch")
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help="a model folder with config.json and a tokenizer (no weights)")
    parser.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    parser.add_argument("--streams", type=int, default=500)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--step-ms", type=float, default=20.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--loop", choices=["asyncio", "uvloop"], default=None,
                        help="uvicorn's event loop (default: uvicorn's auto choice)")
    parser.add_argument("--http", choices=["h11", "httptools"], default=None,
                        help="uvicorn's HTTP protocol (default: uvicorn's auto choice)")
    parser.add_argument("--pin", action="store_true",
                        help="pin the API server to CPU 0, the client elsewhere")
    parser.add_argument("--verbose", action="store_true", help="show the server's output")
    parser.add_argument("--server-log", default=os.path.join(tempfile.gettempdir(),
                                                             "api_server_cpu.server.log"),
                        help="where the server's output goes (without --verbose)")
    parser.add_argument("--profile", default=None,
                        help="write a cProfile of the API-server process to this file")
    parser.add_argument("--output-json", default=None)
    parser.add_argument("server_args", nargs="*", help="after --: more pyorch-serve flags")
    return parser.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if args.role == "server":
        return serve(args.server_args, args.step_ms, args.loop, args.http, args.profile)
    if args.role == "trivial":
        serve_trivial(args.port, args.step_ms)
        return 0
    load_start = os.getloadavg()
    summary = run(args)
    config = {k: v for k, v in vars(args).items() if k not in ("role", "port", "verbose")}
    env = {"python": sys.version.split()[0], "cpu_count": os.cpu_count(),
           "loadavg_start": load_start, "loadavg_end": os.getloadavg(),
           "pythonpath": os.environ.get("PYTHONPATH", "")}
    report = {"config": config, "env": env, "result": summary}
    print(json.dumps(report, indent=2))
    if args.output_json:
        os.makedirs(os.path.dirname(os.path.abspath(args.output_json)), exist_ok=True)
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=2)
    return 1 if summary["num_failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
