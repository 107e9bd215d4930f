"""Real `pyorch-serve` processes on localhost for the server tests (default model, CPU).

No __init__.py in this folder on purpose: a package named `openai` here would shadow the openai
client library.

One session-scoped server (`server`) answers most tests; the few that must kill or stop a server
start their own. Servers log to a file (a pipe nobody drains would block them) and announce their
URL and engine-core pid there.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import httpx
import pytest

START_TIMEOUT_S = 300
# Small limits keep start-up fast and bound what the fuzzer can ask for.
MAX_MODEL_LEN = 256
BASE_ARGS = ["--host", "127.0.0.1", "--port", "0", "--device", "cpu", "--seed", "0",
             "--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory-bytes", "96MiB"]
MODEL_NAME = "SmolLM2-135M-Instruct"

_URL_RE = re.compile(r"serving the OpenAI API at (\S+)/v1 ")
_PID_RE = re.compile(r"engine core pid (\d+)")


class ServerProcess:
    """`python -m pyorch.entrypoints.openai.api_server ARGS`, logging to `log_path`."""

    def __init__(self, args: list[str], log_path: Path, env: Optional[dict] = None) -> None:
        self.log_path = log_path
        self._log = open(log_path, "wb")
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        full_env.pop("PYORCH_API_KEY", None)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pyorch.entrypoints.openai.api_server", *args],
            stdout=self._log, stderr=subprocess.STDOUT, env=full_env)
        self.url = ""
        self.core_pid = 0

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> "ServerProcess":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            match = _URL_RE.search(self.log())
            if match:
                self.url = match.group(1)
                self.core_pid = int(_PID_RE.search(self.log()).group(1))  # type: ignore[union-attr]
                break
            time.sleep(0.2)
        else:
            raise TimeoutError(f"server not ready after {timeout} s:\n{self.log()}")
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"/health never answered 200:\n{self.log()}")

    def terminate(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def start_server(tmp_dir: Path, name: str, extra: list[str],
                 env: Optional[dict] = None) -> ServerProcess:
    return ServerProcess(BASE_ARGS + extra, tmp_dir / f"{name}.log", env)


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory):
    proc = start_server(tmp_path_factory.mktemp("server"), "main", []).wait_ready()
    yield proc
    proc.terminate()


@pytest.fixture(scope="session")
def client(server: ServerProcess):
    import openai

    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                       timeout=120) as c:
        yield c


@pytest.fixture(scope="session")
def http(server: ServerProcess):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one Prometheus sample, e.g. metric(body, "pyorch:prompt_tokens_total")."""
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(f"no sample {name} {labels} in /metrics")


def wait_for_metrics(http: httpx.Client, predicate, timeout: float = 30) -> str:
    """Polls /metrics until predicate(text) holds; returns the text."""
    deadline = time.monotonic() + timeout
    text = ""
    while time.monotonic() < deadline:
        text = http.get("/metrics").text
        if predicate(text):
            return text
        time.sleep(0.1)
    raise AssertionError(f"/metrics never satisfied the condition:\n{text}")


@pytest.fixture(scope="session")
def pooling_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Tiny random Llama weights with SmolLM2's tokenizer (text in), for --runner pooling."""
    from pyorch.model_loader import default_model_path, get_tokenizer
    from tests.pyorch.engine.test_async_llm import make_tiny_model

    tokenizer = get_tokenizer(default_model_path())
    return make_tiny_model(tmp_path_factory.mktemp("tiny_pool"), len(tokenizer), tokenizer)


@pytest.fixture(scope="session")
def pooling_server(tmp_path_factory: pytest.TempPathFactory, pooling_model: str):
    """`pyorch-serve MODEL --runner pooling` (LAST pooling, normalized: vLLM's defaults), with
    /tokenizer_info on (for the schema fuzz)."""
    proc = start_server(tmp_path_factory.mktemp("pooling_server"), "pooling",
                        [pooling_model, "--runner", "pooling", "--dtype", "float32",
                         "--max-num-batched-tokens", "64",
                         "--enable-tokenizer-info-endpoint"]).wait_ready()
    yield proc
    proc.terminate()
