"""The client side of `pyorch bench serve`: one streaming request (httpx + SSE parsing), request
arrival times, and the metrics computed from the per-request records.

Works with any OpenAI-compatible server: `/v1/completions` (``choices[0].text``) or
`/v1/chat/completions` (``choices[0].delta.content``), `stream=True` with
``stream_options.include_usage`` so the last chunk can report the output token count.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Optional, Sequence

from pyorch.benchmarks.common import percentile


@dataclass
class RequestSpec:
    prompt: Any  # text, or a list of token ids (completions only)
    prompt_len: int  # tokens
    output_len: int  # max_tokens asked for


@dataclass
class RequestResult:
    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0  # from the server's usage when it sends one, else content chunks
    output_tokens_from_usage: bool = False
    ttft_s: float = 0.0  # send -> first content chunk
    e2e_s: float = 0.0  # send -> end of stream
    itl_s: list[float] = field(default_factory=list)  # gaps between content chunks
    start_s: float = 0.0  # send time, relative to the start of the run
    error: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def build_payload(endpoint: str, model: str, spec: RequestSpec, ignore_eos: bool,
                  extra_body: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "max_tokens": spec.output_len, "stream": True,
                            "stream_options": {"include_usage": True}, "temperature": 0.0}
    if endpoint.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": spec.prompt}]
        body["max_completion_tokens"] = spec.output_len
    else:
        body["prompt"] = spec.prompt
    if ignore_eos:
        body["ignore_eos"] = True  # not OpenAI's: vLLM's extra field, sent in the body
    body.update(extra_body or {})
    return body


def _chunk_text(chunk: dict[str, Any]) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if "text" in choice:
        return choice.get("text") or ""
    delta = choice.get("delta") or {}
    return (delta.get("content") or "") + (delta.get("reasoning_content") or "")


async def send_request(client: Any, url: str, body: dict[str, Any], prompt_len: int,
                       run_start: float) -> RequestResult:
    """POSTs one streaming request and times its chunks. Never raises: a failure is recorded."""
    result = RequestResult(prompt_len=prompt_len)
    sent = time.perf_counter()
    result.start_s = sent - run_start
    last = sent
    chunks = 0
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                result.error = f"HTTP {resp.status_code}: {text[:300]}"
                return result
            async for line in resp.aiter_lines():
                line = line.strip()
                if not line.startswith("data:"):
                    continue  # blank separators, comments, event: lines
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = f"stream error: {json.dumps(chunk['error'])[:300]}"
                    return result
                now = time.perf_counter()
                if _chunk_text(chunk):
                    if chunks == 0:
                        result.ttft_s = now - sent
                    else:
                        result.itl_s.append(now - last)
                    chunks += 1
                    last = now
                usage = chunk.get("usage")
                if usage and usage.get("completion_tokens") is not None:
                    result.output_tokens = int(usage["completion_tokens"])
                    result.output_tokens_from_usage = True
        result.e2e_s = time.perf_counter() - sent
        if not result.output_tokens_from_usage:
            result.output_tokens = chunks
        if chunks == 0:
            result.error = "no content in the stream"
            return result
        result.success = True
    except Exception as exc:  # a load generator records failures and goes on
        result.error = f"{type(exc).__name__}: {exc}"[:300]
    return result


def arrival_offsets(num: int, request_rate: float, burstiness: float = 1.0,
                    arrival: str = "poisson", seed: int = 0) -> list[float]:
    """Send times (s from the start) of `num` requests.

    rate inf: all at time 0. "fixed": one every 1/rate s. "poisson": gamma-distributed gaps with
    shape `burstiness` and mean 1/rate (burstiness 1 is a Poisson process; < 1 burstier, > 1
    steadier), as vLLM's --burstiness."""
    import numpy as np

    if num <= 0:
        return []
    if math.isinf(request_rate):
        return [0.0] * num
    if request_rate <= 0 or burstiness <= 0:
        raise ValueError("request rate and burstiness must be positive")
    if arrival == "fixed":
        gaps = np.full(num, 1.0 / request_rate)
    elif arrival == "poisson":
        rng = np.random.default_rng(seed)
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num)
    else:
        raise ValueError(f"arrival must be poisson or fixed, got {arrival!r}")
    gaps[0] = 0.0  # the first request goes at once
    return np.cumsum(gaps).tolist()


def _stats_ms(values: Sequence[float]) -> dict[str, float]:
    ms = [v * 1e3 for v in values]
    mean = sum(ms) / len(ms) if ms else float("nan")
    return {"mean": mean, "p50": percentile(ms, 50), "p90": percentile(ms, 90),
            "p99": percentile(ms, 99)}


GOODPUT_METRICS = ("ttft", "tpot", "e2el")


def parse_goodput(text: str) -> tuple[str, float]:
    """One `KEY:MS` SLO of vLLM's --goodput (ttft, tpot or e2el, in milliseconds)."""
    key, sep, value = text.partition(":")
    if not sep or key not in GOODPUT_METRICS:
        raise argparse.ArgumentTypeError(
            f"expected KEY:MS with KEY one of {', '.join(GOODPUT_METRICS)}, got {text!r}")
    try:
        ms = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected milliseconds after {key}:, got {text!r}") \
            from None
    if not ms > 0:
        raise argparse.ArgumentTypeError(f"an SLO must be positive, got {text!r}")
    return key, ms


def _tpot_s(r: RequestResult) -> float:
    """Time per output token after the first: (e2e - ttft) / (tokens - 1); 0 for one token."""
    return (r.e2e_s - r.ttft_s) / (r.output_tokens - 1) if r.output_tokens > 1 else 0.0


def meets_slos(r: RequestResult, slos_ms: dict[str, float]) -> bool:
    """Whether a successful request met every SLO (ms) given, as vLLM's goodput counts it."""
    measured = {"ttft": r.ttft_s, "tpot": _tpot_s(r), "e2el": r.e2e_s}
    return all(measured[key] * 1e3 <= slo for key, slo in slos_ms.items())


def summarize(results: Sequence[RequestResult], duration_s: float,
              slos_ms: Optional[dict[str, float]] = None) -> dict[str, Any]:
    """Throughputs and TTFT / ITL / TPOT / E2E (ms: mean, p50, p90, p99) over the successes,
    and with `slos_ms` the goodput: requests/s that met every SLO.

    TPOT per request = (e2e - ttft) / (output tokens - 1), requests with more than one token."""
    ok = [r for r in results if r.success]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    tpot = [_tpot_s(r) for r in ok if r.output_tokens > 1]
    errors = sorted({r.error for r in results if not r.success})
    extra: dict[str, Any] = {}
    if slos_ms:
        good = sum(meets_slos(r, slos_ms) for r in ok)
        extra = {"goodput_slos_ms": dict(slos_ms), "good_requests": good,
                 "request_goodput": good / duration_s if duration_s > 0 else float("nan")}
    return {
        **extra,
        "completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration_s,
        "input_tokens": in_tokens, "output_tokens": out_tokens,
        "request_throughput": len(ok) / duration_s if duration_s > 0 else float("nan"),
        "output_throughput": out_tokens / duration_s if duration_s > 0 else float("nan"),
        "total_token_throughput": ((in_tokens + out_tokens) / duration_s
                                   if duration_s > 0 else float("nan")),
        "ttft_ms": _stats_ms([r.ttft_s for r in ok]),
        "itl_ms": _stats_ms([gap for r in ok for gap in r.itl_s]),
        "tpot_ms": _stats_ms(tpot),
        "e2e_ms": _stats_ms([r.e2e_s for r in ok]),
        "errors": errors[:10],
    }
