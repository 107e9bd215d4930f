"""`pyorch` and `pyorch-serve` entry points.

Each subcommand lives in its own module exposing ``add_cli_args(parser)`` and ``main(args)``;
this file only wires them into argparse, so importing it stays cheap (no torch, no FastAPI) and
``--help`` is fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from types import ModuleType
from typing import Optional, Sequence

from pyorch.logger import configure_logging

# subcommand -> module with add_cli_args(parser) and main(args)
_SERVE = "pyorch.entrypoints.openai.cli_args"
_RUN_BATCH = "pyorch.entrypoints.openai.run_batch"
_BENCH = {
    "throughput": ("pyorch.benchmarks.throughput",
                   "offline throughput: pyorch against transformers"),
    "latency": ("pyorch.benchmarks.latency",
                "batch-1 decode latency against the weight-read floor"),
    "startup": ("pyorch.benchmarks.startup", "cold start to ready"),
    "serve": ("pyorch.benchmarks.serve", "load generator for any OpenAI-compatible server"),
    "attention": ("pyorch.benchmarks.attention",
                  "decode attention: pyorch, paged_attention_v2 and torch SDPA on the same data"),
}


def _load(module: str) -> ModuleType:
    return importlib.import_module(module)


def build_parser(argv: Sequence[str] = ()) -> argparse.ArgumentParser:
    """The full parser for the subcommand named in argv; only that subcommand's module is
    imported (the others are listed by name, so `pyorch --help` stays cheap)."""
    argv = list(argv)
    parser = argparse.ArgumentParser(prog="pyorch", description="pyorch: LLM inference and serving")
    sub = parser.add_subparsers(dest="command", required=True,
                                metavar="{serve,run-batch,bench}")
    serve = sub.add_parser("serve", help="start the OpenAI-compatible server (pyorch-serve)")
    if argv[:1] == ["serve"]:
        _load(_SERVE).add_cli_args(serve)
        serve.set_defaults(_module=_SERVE)
    run_batch = sub.add_parser("run-batch", help="run an OpenAI batch file (JSON lines) offline")
    if argv[:1] == ["run-batch"]:
        _load(_RUN_BATCH).add_cli_args(run_batch)
        run_batch.set_defaults(_module=_RUN_BATCH)
    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True,
                                     metavar="{" + ",".join(_BENCH) + "}")
    for name, (module, help_text) in _BENCH.items():
        p = bench_sub.add_parser(name, help=help_text, description=help_text)
        if argv[:2] == ["bench", name]:
            _load(module).add_cli_args(p)
            p.set_defaults(_module=module)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    configure_logging()
    args = build_parser(argv).parse_args(argv)
    return int(_load(args._module).main(args) or 0)


def serve_main(argv: Optional[Sequence[str]] = None) -> int:
    """`pyorch-serve [MODEL] [flags]`, the same as `pyorch serve`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    return main(["serve", *argv])


if __name__ == "__main__":
    sys.exit(main())
