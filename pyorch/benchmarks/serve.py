"""`pyorch bench serve`: a load generator for any OpenAI-compatible server (pyorch-serve, vLLM).

`--num-prompts` streaming requests of a synthetic workload (`--dataset-name`: `random` with
`--random-input-len`, `--random-output-len` and `--random-range-ratio` on both, vLLM's
`prefix_repetition`, or the log-normal `longtail` mix; `pyorch.benchmarks.datasets`), sent at
`--request-rate` (inf: all at once) with
Poisson/gamma (`--burstiness`) or fixed (`--arrival fixed`) gaps, at most `--max-concurrency` in
flight, `ignore_eos` sent as an extra body field. Reports request and token throughput and TTFT /
ITL / TPOT / E2E (mean, p50, p90, p99), and with `--goodput ttft:MS tpot:MS e2el:MS` (vLLM's
SLO flag) the rate of requests that met every SLO given. `--request-rates 1,2,4,inf` sweeps several
rates (fresh
prompts for each, so a prefix cache cannot help a later rate) and draws TTFT and ITL (p50, p99)
against the achieved load.

Baseline, same run: the lightest load of the sweep. Each rate's ITL and TTFT p50 are printed as
a ratio to it, and its achieved request rate as a ratio to the offered rate.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import time
from typing import Any

from pyorch.benchmarks import common, datasets
from pyorch.benchmarks.serve_client import (
    RequestResult,
    RequestSpec,
    arrival_offsets,
    build_payload,
    parse_goodput,
    send_request,
    summarize,
)

NAME = "serve"


def _rates(text: str) -> list[float]:
    try:
        rates = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected numbers or inf separated by commas: {text!r}") from None
    if not rates or any(not r > 0 for r in rates):
        raise argparse.ArgumentTypeError(f"request rates must be positive: {text!r}")
    return rates


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default=None, help="e.g. http://127.0.0.1:8000")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--endpoint", default="/v1/completions",
                        help="/v1/completions or /v1/chat/completions")
    parser.add_argument("--model", default=None, help="model name (default: first of /v1/models)")
    parser.add_argument("--tokenizer", default=None,
                        help="tokenizer that turns random ids into prompt text (default: --model "
                             "when it is a local path, else pyorch's default model)")
    parser.add_argument("--prompt-format", choices=("text", "token-ids"), default="text",
                        help="token-ids sends the ids as the prompt (completions only)")
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="random ids are drawn from [0, N) (default: the tokenizer's base "
                             "vocabulary; with --prompt-format token-ids no tokenizer is loaded)")
    parser.add_argument("--num-prompts", type=int, default=50, help="requests per rate")
    parser.add_argument("--random-input-len", type=int, default=64)
    parser.add_argument("--random-output-len", type=int, default=32)
    parser.add_argument("--random-range-ratio", type=float, default=0.0,
                        help="random dataset: input and output lengths uniform in "
                             "[len*(1-r), len*(1+r)]")
    datasets.add_dataset_args(parser)
    parser.add_argument("--goodput", nargs="+", type=parse_goodput, default=None,
                        metavar="KEY:MS",
                        help="SLOs in ms, e.g. ttft:500 tpot:50 e2el:10000 (vLLM's flag): "
                             "reports requests/s that met all of them")
    parser.add_argument("--request-rate", type=float, default=math.inf,
                        help="requests/s (default inf: all at once)")
    parser.add_argument("--request-rates", type=_rates, default=None,
                        help="sweep, e.g. 1,2,4,inf (overrides --request-rate)")
    parser.add_argument("--burstiness", type=float, default=1.0,
                        help="gamma shape of the gaps: 1 = Poisson, <1 burstier, >1 steadier")
    parser.add_argument("--arrival", choices=("poisson", "fixed"), default="poisson")
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--ignore-eos", default=True, action=argparse.BooleanOptionalAction)
    parser.add_argument("--extra-body", type=json.loads, default=None,
                        help="JSON object merged into every request body")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--request-timeout", type=float, default=600.0)
    parser.add_argument("--ready-check-timeout-sec", type=float, default=60.0,
                        help="wait this long for the server's /v1/models")
    parser.add_argument("--output-json", default=None,
                        help="result file (default bench/results/<device>/serve.json)")
    parser.add_argument("--no-plot", action="store_true")


def base_url(args: argparse.Namespace) -> str:
    return (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")


async def wait_ready(client: Any, url: str, timeout: float) -> list[str]:
    """Polls GET /v1/models until it answers 200; returns the model ids."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            resp = await client.get(f"{url}/v1/models")
            if resp.status_code == 200:
                return [m["id"] for m in resp.json().get("data", [])]
        except Exception:  # not up yet
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"no answer from {url}/v1/models within {timeout:.0f} s")
        await asyncio.sleep(0.5)


def make_requests(args: argparse.Namespace, tokenizer: Any, vocab_size: int,
                  seed: int) -> list[RequestSpec]:
    """The `--dataset-name` workload, sent as text (decoded by `tokenizer`) or as ids."""
    sampled = datasets.sample_requests(args, args.num_prompts, args.random_input_len,
                                       args.random_output_len, args.random_range_ratio,
                                       vocab_size, seed)
    specs = []
    for sample in sampled:
        ids = sample.prompt_token_ids
        if tokenizer is None:
            specs.append(RequestSpec(ids, len(ids), sample.output_len))
        else:
            text = tokenizer.decode(ids, skip_special_tokens=True)
            n = len(tokenizer.encode(text, add_special_tokens=False))
            specs.append(RequestSpec(text, n, sample.output_len))
    return specs


def load_tokenizer(args: argparse.Namespace) -> tuple[Any, int]:
    """(tokenizer or None for token-id prompts, vocabulary size to draw ids from)."""
    from pyorch.model_loader import default_model_path, get_tokenizer

    if args.prompt_format == "token-ids" and args.vocab_size:
        return None, args.vocab_size
    name = args.tokenizer
    if name is None:
        name = args.model if args.model and os.path.exists(args.model) else default_model_path()
    tokenizer = get_tokenizer(name)
    # Ids past the base vocabulary are special/added tokens; random prompts avoid them.
    vocab = args.vocab_size or getattr(tokenizer, "vocab_size", None) or len(tokenizer)
    return (None if args.prompt_format == "token-ids" else tokenizer), int(vocab)


async def run_rate(client: Any, args: argparse.Namespace, url: str, model: str,
                   specs: list[RequestSpec], rate: float, seed: int) -> dict[str, Any]:
    """Sends `specs` at `rate` and summarizes."""
    offsets = arrival_offsets(len(specs), rate, args.burstiness, args.arrival, seed)
    limit = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    target = url + args.endpoint

    async def one(spec: RequestSpec, offset: float, start: float) -> RequestResult:
        delay = start + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        body = build_payload(args.endpoint, model, spec, args.ignore_eos, args.extra_body)
        if limit is None:
            return await send_request(client, target, body, spec.prompt_len, start)
        async with limit:
            return await send_request(client, target, body, spec.prompt_len, start)

    start = time.perf_counter()
    results = await asyncio.gather(*(one(s, o, start) for s, o in zip(specs, offsets, strict=True)))
    duration = time.perf_counter() - start
    summary = summarize(results, duration, dict(args.goodput) if args.goodput else None)
    summary.update(request_rate=rate, burstiness=args.burstiness, arrival=args.arrival,
                   max_concurrency=args.max_concurrency, num_prompts=len(specs),
                   requests=[r.to_dict() for r in results])
    return summary


def _print_run(run: dict[str, Any]) -> None:
    rate = run["request_rate"]
    print(f"rate {rate:>5} req/s: {run['completed']} ok, {run['failed']} failed in "
          f"{run['duration_s']:.1f} s | {run['request_throughput']:.2f} req/s, "
          f"{run['output_throughput']:.1f} out tok/s | TTFT p50 {run['ttft_ms']['p50']:.0f} "
          f"p99 {run['ttft_ms']['p99']:.0f} ms | ITL p50 {run['itl_ms']['p50']:.1f} "
          f"p99 {run['itl_ms']['p99']:.1f} ms | TPOT mean {run['tpot_ms']['mean']:.1f} ms | "
          f"E2E p50 {run['e2e_ms']['p50']:.0f} ms"
          + (f" | goodput {run['request_goodput']:.2f} req/s" if "request_goodput" in run
             else ""))
    for err in run["errors"][:3]:
        print(f"    error: {err}")


def add_ratios(runs: list[dict[str, Any]]) -> None:
    """Each run against the lightest load of the sweep (the first, rates sorted ascending)."""
    base = runs[0]
    for run in runs:
        for key in ("ttft_ms", "itl_ms"):
            denom = base[key]["p50"]
            run[f"{key[:-3]}_p50_over_lightest"] = run[key]["p50"] / denom if denom else None
        offered = run["request_rate"]
        run["achieved_over_offered"] = (run["request_throughput"] / offered
                                        if not math.isinf(offered) else None)


def plot(path: str, runs: list[dict[str, Any]], title: str) -> None:
    plt = common.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    x = [r["request_throughput"] for r in runs]
    # (a rate read back from the JSON file is "inf", a string, for the unthrottled run)
    rates = [float(r["request_rate"]) for r in runs]
    labels = ["inf" if math.isinf(rate) else f"{rate:g}" for rate in rates]
    for ax, key, name in ((axes[0], "ttft_ms", "TTFT"), (axes[1], "itl_ms", "ITL")):
        for q, style in (("p50", "o-"), ("p99", "s--")):
            ax.plot(x, [r[key][q] for r in runs], style, label=f"{name} {q}")
        for xi, yi, lab in zip(x, [r[key]["p50"] for r in runs], labels, strict=True):
            ax.annotate(f"rate {lab}", (xi, yi), textcoords="offset points", xytext=(4, 4),
                        fontsize=7)
        ax.set_xlabel("achieved load (completed requests/s)")
        ax.set_ylabel(f"{name} (ms)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


async def _main_async(args: argparse.Namespace) -> dict[str, Any]:
    import httpx

    url = base_url(args)
    rates = sorted(args.request_rates or [args.request_rate])
    timeout = httpx.Timeout(args.request_timeout, connect=30.0)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        served = await wait_ready(client, url, args.ready_check_timeout_sec)
        model = args.model or (served[0] if served else None)
        if model is None:
            raise RuntimeError("--model not given and /v1/models lists none")
        tokenizer, vocab = load_tokenizer(args)
        # One short request first: a wrong endpoint or model fails here, not 50 times.
        probe = make_requests(argparse.Namespace(**{**vars(args), "num_prompts": 1,
                                                    "dataset_name": "random",
                                                    "random_output_len": 2}), tokenizer, vocab,
                              args.seed + 999)[0]
        check = await send_request(client, url + args.endpoint,
                                   build_payload(args.endpoint, model, probe, args.ignore_eos,
                                                 args.extra_body), probe.prompt_len,
                                   time.perf_counter())
        if not check.success:
            raise RuntimeError(f"the test request failed: {check.error}")
        runs = []
        for i, rate in enumerate(rates):
            specs = make_requests(args, tokenizer, vocab, args.seed + 10 * i)
            runs.append(await run_rate(client, args, url, model, specs, rate, args.seed + i))
            _print_run(runs[-1])
    add_ratios(runs)
    for run in runs[1:]:
        print(f"rate {run['request_rate']}: ITL p50 {run['itl_p50_over_lightest']:.2f}x, "
              f"TTFT p50 {run['ttft_p50_over_lightest']:.2f}x the lightest load")
    workload = datasets.describe(args, args.random_input_len, args.random_output_len,
                                 args.random_range_ratio)
    return {"base_url": url, "model": model, "workload": workload, "runs": runs}


def main(args: argparse.Namespace) -> int:
    device = common.resolve_device(None)
    env = common.environment(device)
    result = asyncio.run(_main_async(args))
    json_path, png_path = common.output_paths(NAME, device, args.output_json)
    common.write_json(json_path, {"benchmark": NAME, "args": common.args_dict(args), "env": env,
                                  **result})
    if not args.no_plot:
        workload = ", ".join(f"{k} {v}" for k, v in result["workload"].items())
        plot(png_path, result["runs"],
             f"{NAME}: {result['model']}, {args.endpoint}, {workload}, {args.num_prompts} "
             "prompts per rate")
    failed = sum(r["failed"] for r in result["runs"])
    return 1 if failed else 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_cli_args(parser)
    raise SystemExit(main(parser.parse_args()))
