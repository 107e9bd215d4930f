"""`vllm serve` flags that need a feature pyorch lacks: argparse knows them (so a vLLM launch
command does not die on "unrecognized arguments"), and `refusal(args)` names the flag and the
missing feature before anything is loaded. A flag given its neutral value (the value that asks
for what pyorch does anyway, e.g. `--data-parallel-size 1`) is accepted.

Flags that pyorch implements live in cli_args.py and must not appear here: argparse refuses
a flag defined twice, so every test that builds the parser catches a flag added to both.
"""

from __future__ import annotations

import argparse
from typing import Any, Callable, Optional

# (long flag, short alias, kind, the missing feature, neutral values as the user writes them)
# kind: "flag" (store_true), "bool" (--x / --no-x), "value" (one word), "list" (one or more).
_REFUSED: list[tuple[str, Optional[str], str, str, tuple[str, ...]]] = [
    # server
    ("--uds", None, "value", "serving on a Unix domain socket", ()),
    ("--lora-modules", None, "list", "LoRA adapters", ()),
    ("--trust-request-chat-template", None, "flag", "per-request chat templates", ()),
    ("--enable-ssl-refresh", None, "flag", "reloading TLS certificates", ()),
    ("--middleware", None, "list", "user ASGI middleware", ()),
    ("--return-tokens-as-token-ids", None, "flag", "'token_id:N' logprob tokens", ()),
    ("--disable-frontend-multiprocessing", None, "flag",
     "running the API server in the engine process (pyorch always uses two processes)", ()),
    ("--enable-request-id-headers", None, "flag", "X-Request-Id response headers", ()),
    ("--log-config-file", None, "value", "a logging config file", ()),
    ("--enable-force-include-usage", None, "flag", "forced usage on every stream", ()),
    ("--enable-log-outputs", None, "flag", "logging generated outputs", ()),
    ("--h11-max-incomplete-event-size", None, "value", "h11 header-size limits", ()),
    ("--h11-max-header-count", None, "value", "h11 header-count limits", ()),
    ("--log-error-stack", None, "flag", "stack traces in error responses", ()),
    ("--tokens-only", None, "flag", "the tokens-in/tokens-out endpoint", ()),
    ("--api-server-count", "-asc", "value", "several API server processes", ("1",)),
    ("--headless", None, "flag", "headless (API-less) engines", ()),
    ("--allowed-local-media-path", None, "value", "multimodal inputs", ("",)),
    ("--allowed-media-domains", None, "list", "multimodal inputs", ()),
    # model
    ("--hf-config-path", None, "value", "a separate Hugging Face config path", ()),
    ("--code-revision", None, "value", "remote-code revisions", ()),
    ("--tokenizer-revision", None, "value", "tokenizer revisions", ()),
    ("--logprobs-mode", None, "value",
     "logprobs modes other than raw_logprobs (pyorch returns the model's raw logprobs)",
     ("raw_logprobs",)),
    ("--disable-sliding-window", None, "flag", "sliding-window attention", ()),
    ("--enable-prompt-embeds", None, "flag", "prompt embeddings as input", ()),
    ("--config-format", None, "value", "config formats other than Hugging Face's",
     ("auto", "hf")),
    ("--hf-token", None, "value", "Hugging Face Hub tokens", ()),
    ("--hf-overrides", None, "value", "Hugging Face config overrides", ()),
    ("--logits-processor-pattern", None, "value", "logits-processor plugins", ()),
    ("--logits-processors", None, "list", "logits-processor plugins", ()),
    ("--tool-parser-plugin", None, "value", "tool-parser plugins (built in: hermes, llama3_json, "
     "mistral)", ()),
    ("--tool-server", None, "value", "built-in tool servers (MCP, demo tools)", ()),
    ("--reasoning-parser-plugin", None, "value", "reasoning-parser plugins (built in: qwen3, "
     "deepseek_r1)", ()),
    ("--allow-deprecated-quantization", None, "flag", "deprecated quantization methods (pyorch "
     "offers none)", ()),
    ("--calculate-kv-scales", None, "flag", "fp8 KV-cache scales", ()),
    ("--enable-sleep-mode", None, "flag", "sleep mode", ()),
    ("--model-impl", None, "value", "model implementations other than pyorch's own",
     ("auto", "vllm")),
    ("--override-attention-dtype", None, "value", "a separate attention dtype", ()),
    ("--io-processor-plugin", None, "value", "IO processor plugins", ()),
    ("--enable-return-routed-experts", None, "flag", "mixture-of-experts models", ()),
    # load
    ("--safetensors-load-strategy", None, "value", "safetensors load strategies", ()),
    ("--model-loader-extra-config", None, "value", "model-loader plugins", ()),
    ("--ignore-patterns", None, "list", "hub download patterns", ()),
    ("--pt-load-map-location", None, "value", "a .pt load map location", ("cpu",)),
    # attention, compilation, cache
    ("--attention-backend", None, "value", "choosing an attention backend", ()),
    ("--attention-config", "-ac", "value", "choosing an attention backend", ()),
    ("--compilation-config", "-cc", "value", "torch.compile (pyorch runs eager or CUDA graphs)",
     ()),
    ("--optimization-level", "-O", "value", "torch.compile optimization levels", ()),
    ("--max-cudagraph-capture-size", None, "value",
     "a CUDA-graph size cap (list the sizes with --cudagraph-capture-sizes)", ()),
    ("--swap-space", None, "value", "swapping KV blocks to CPU memory (pyorch recomputes "
     "preempted requests)", ()),
    ("--prefix-caching-hash-algo", None, "value",
     "choosing the prefix-cache hash (pyorch compares block contents, not only hashes)", ()),
    ("--cpu-offload-gb", None, "value", "weight offloading to CPU memory", ("0",)),
    ("--kv-sharing-fast-prefill", None, "flag", "KV sharing across layers", ()),
    ("--mamba-cache-dtype", None, "value", "Mamba models", ("auto",)),
    ("--mamba-ssm-cache-dtype", None, "value", "Mamba models", ("auto",)),
    ("--mamba-block-size", None, "value", "Mamba models", ()),
    ("--kv-offloading-size", None, "value", "KV offloading", ()),
    ("--kv-offloading-backend", None, "value", "KV offloading", ()),
    # parallel (tensor parallelism itself is another branch's)
    ("--data-parallel-size", "-dp", "value", "data parallelism", ("1",)),
    ("--data-parallel-rank", "-dpn", "value", "data parallelism", ()),
    ("--data-parallel-start-rank", "-dpr", "value", "data parallelism", ()),
    ("--data-parallel-size-local", "-dpl", "value", "data parallelism", ()),
    ("--data-parallel-address", "-dpa", "value", "data parallelism", ()),
    ("--data-parallel-rpc-port", "-dpp", "value", "data parallelism", ()),
    ("--data-parallel-backend", "-dpb", "value", "data parallelism", ()),
    ("--data-parallel-hybrid-lb", "-dph", "flag", "data parallelism", ()),
    ("--data-parallel-external-lb", "-dpe", "flag", "data parallelism", ()),
    ("--decode-context-parallel-size", "-dcp", "value", "context parallelism", ("1",)),
    ("--prefill-context-parallel-size", "-pcp", "value", "context parallelism", ("1",)),
    # vLLM's default is what expert parallelism without data parallelism does (all-reduce).
    ("--all2all-backend", None, "value",
     "all-to-all expert dispatch (expert parallelism combines by all-reduce)",
     ("allgather_reducescatter",)),
    ("--enable-eplb", None, "flag", "expert load balancing (mixture of experts)", ()),
    ("--eplb-config", None, "value", "expert load balancing (mixture of experts)", ()),
    ("--enable-dbo", None, "flag", "dual batch overlap", ()),
    ("--master-addr", None, "value", "multi-node serving", ()),
    ("--master-port", None, "value", "multi-node serving", ()),
    ("--nnodes", "-n", "value", "multi-node serving", ("1",)),
    ("--node-rank", "-r", "value", "multi-node serving", ("0",)),
    ("--max-parallel-loading-workers", None, "value", "parallel weight loading", ()),
    ("--ray-workers-use-nsight", None, "flag", "Ray workers", ()),
    ("--worker-cls", None, "value", "custom worker classes", ("auto",)),
    ("--worker-extension-cls", None, "value", "worker extensions", ("",)),
    # multimodal
    ("--limit-mm-per-prompt", None, "value", "multimodal inputs", ()),
    ("--enable-mm-embeds", None, "flag", "multimodal inputs", ()),
    ("--media-io-kwargs", None, "value", "multimodal inputs", ()),
    ("--mm-processor-kwargs", None, "value", "multimodal inputs", ()),
    ("--mm-processor-cache-gb", None, "value", "multimodal inputs", ()),
    ("--mm-processor-cache-type", None, "value", "multimodal inputs", ()),
    ("--mm-encoder-tp-mode", None, "value", "multimodal inputs", ()),
    ("--interleave-mm-strings", None, "flag", "multimodal inputs", ()),
    ("--skip-mm-profiling", None, "flag", "multimodal inputs", ()),
    # LoRA
    ("--enable-lora", None, "flag", "LoRA adapters", ()),
    ("--max-loras", None, "value", "LoRA adapters", ()),
    ("--max-lora-rank", None, "value", "LoRA adapters", ()),
    ("--lora-dtype", None, "value", "LoRA adapters", ()),
    ("--max-cpu-loras", None, "value", "LoRA adapters", ()),
    ("--fully-sharded-loras", None, "flag", "LoRA adapters", ()),
    ("--default-mm-loras", None, "value", "LoRA adapters", ()),
    # observability
    ("--show-hidden-metrics-for-version", None, "value", "deprecated (hidden) metrics", ()),
    ("--otlp-traces-endpoint", None, "value", "OpenTelemetry tracing", ()),
    ("--collect-detailed-traces", None, "value", "OpenTelemetry tracing", ()),
    ("--kv-cache-metrics", None, "flag", "KV-cache residency metrics", ()),
    ("--cudagraph-metrics", None, "flag", "CUDA-graph metrics", ()),
    ("--enable-layerwise-nvtx-tracing", None, "flag", "NVTX tracing", ()),
    ("--enable-mfu-metrics", None, "flag", "MFU metrics", ()),
    ("--aggregate-engine-logging", None, "flag", "data-parallel engine logging", ()),
    # scheduler
    ("--disable-chunked-mm-input", None, "flag", "multimodal inputs", ()),
    ("--scheduler-cls", None, "value", "custom scheduler classes", ()),
    ("--disable-hybrid-kv-cache-manager", None, "flag", "the hybrid KV-cache manager", ()),
    ("--stream-interval", None, "value", "batching several tokens per stream chunk", ("1",)),
    # whole-engine configs
    ("--speculative-config", None, "value", "speculative decoding", ()),
    ("--kv-transfer-config", None, "value", "KV transfer (disaggregated prefill)", ()),
    ("--kv-events-config", None, "value", "KV-cache events", ()),
    ("--ec-transfer-config", None, "value", "encoder-cache transfer", ()),
    ("--additional-config", None, "value", "platform-specific configs", ()),
    ("--profiler-config", None, "value", "the profiler endpoints", ()),
    ("--performance-mode", None, "value", "performance modes", ()),
]


def add_refused_args(parser: argparse.ArgumentParser,
                     register: Callable[..., None]) -> None:
    """Adds the refused flags in their own --help group; `register` is cli_args._add (so that
    --config files know them too)."""
    group = parser.add_argument_group(
        "not supported", "vLLM flags that need a feature pyorch lacks: accepted only with their "
        "neutral value; otherwise the server exits with an error naming the flag")
    for flag, short, kind, feature, neutral in _REFUSED:
        kwargs: dict[str, Any] = {"default": None, "help": feature}
        if kind == "flag":
            kwargs["action"] = "store_true"
            kwargs["default"] = None
        elif kind == "bool":
            kwargs["action"] = argparse.BooleanOptionalAction
        elif kind == "list":
            kwargs["nargs"] = "+"
        if neutral:
            kwargs["help"] = f"{feature} (accepted: {', '.join(repr(v) for v in neutral)})"
        register(group, flag, kind, short, **kwargs)


def refusal(args: argparse.Namespace) -> Optional[str]:
    """The error for the first refused flag given a non-neutral value, else None."""
    for flag, _short, kind, feature, neutral in _REFUSED:
        value = getattr(args, flag.lstrip("-").replace("-", "_"), None)
        if value is None or value is False:
            continue
        if kind == "list":
            shown = " ".join(map(str, value))
        else:
            shown = str(value)
        if kind not in ("flag", "bool") and shown in neutral:
            continue
        given = flag if kind in ("flag", "bool") else f"{flag} {shown}"
        return (f"{given}: {feature} is not supported by pyorch; remove the flag"
                + (f" (or give {flag} {neutral[0]!r})" if neutral else ""))
    return None
