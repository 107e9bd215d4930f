"""`--structured-outputs-config` (vLLM's `StructuredOutputsConfig`, given as JSON).

- `backend`: "auto" or "xgrammar" (pyorch's one backend; "auto" picks it); "guidance",
  "outlines" and "lm-format-enforcer" are refused by name.
- `disable_any_whitespace`: every JSON constraint of this server is compiled without free
  whitespace (as if each request set `structured_outputs.disable_any_whitespace`).
- `disable_additional_properties`: vLLM allows it only with the guidance backend and refuses
  it otherwise; so does pyorch.
- `reasoning_parser`: the same as `--reasoning-parser` (both given must agree);
  `reasoning_parser_plugin`: refused, as the `--reasoning-parser-plugin` flag is.
- `enable_in_reasoning`: accepted; pyorch applies a constraint from the first generated token,
  reasoning included, which is what `true` asks for. With a reasoning parser and `false` (vLLM's
  default), vLLM starts constraining after the reasoning ends, which pyorch does not do: refused.
"""

from __future__ import annotations

import argparse
from typing import Any

_BACKENDS = ("auto", "xgrammar")
_OTHER_BACKENDS = ("guidance", "outlines", "lm-format-enforcer")
_KEYS = ("backend", "disable_any_whitespace", "disable_additional_properties",
         "reasoning_parser", "reasoning_parser_plugin", "enable_in_reasoning")


def _bool(config: dict[str, Any], key: str) -> bool:
    value = config.get(key, False)
    if not isinstance(value, bool):
        raise ValueError(f"--structured-outputs-config: {key} must be true or false, got "
                         f"{value!r}")
    return value


def apply_structured_outputs_config(args: argparse.Namespace) -> None:
    """Checks `args.structured_outputs_config` (a dict or None) and applies it to args:
    `reasoning_parser` and `structured_outputs_disable_any_whitespace` (ValueError names the
    key of a setting pyorch cannot honour)."""
    from pyorch.entrypoints.openai.reasoning import REASONING_PARSERS

    config = getattr(args, "structured_outputs_config", None) or {}
    args.structured_outputs_disable_any_whitespace = False
    unknown = sorted(set(config) - set(_KEYS))
    if unknown:
        raise ValueError(f"--structured-outputs-config: unknown keys {unknown} (vLLM's keys: "
                         f"{', '.join(_KEYS)})")
    backend = config.get("backend", "auto")
    if backend in _OTHER_BACKENDS:
        raise ValueError(f"--structured-outputs-config: backend {backend!r} is not supported "
                         "by pyorch (xgrammar is its structured-output backend; use \"auto\" "
                         "or \"xgrammar\")")
    if backend not in _BACKENDS:
        raise ValueError(f"--structured-outputs-config: backend must be one of "
                         f"{', '.join(_BACKENDS + _OTHER_BACKENDS)}, got {backend!r}")
    args.structured_outputs_disable_any_whitespace = _bool(config, "disable_any_whitespace")
    if _bool(config, "disable_additional_properties"):
        raise ValueError("--structured-outputs-config: disable_additional_properties is only "
                         "supported for the guidance backend (vLLM's rule; xgrammar already "
                         "refuses properties a schema does not list)")
    if config.get("reasoning_parser_plugin"):
        raise ValueError("--structured-outputs-config: reasoning_parser_plugin: reasoning-parser "
                         "plugins are not supported by pyorch (built in: "
                         f"{', '.join(sorted(REASONING_PARSERS))})")
    parser = config.get("reasoning_parser") or None
    if parser is not None:
        if parser not in REASONING_PARSERS:
            raise ValueError(f"--structured-outputs-config: reasoning_parser {parser!r} is not "
                             f"one of {', '.join(sorted(REASONING_PARSERS))}")
        if args.reasoning_parser not in (None, parser):
            raise ValueError(f"--structured-outputs-config: reasoning_parser {parser!r} "
                             f"contradicts --reasoning-parser {args.reasoning_parser}")
        args.reasoning_parser = parser
    if args.reasoning_parser is not None and not _bool(config, "enable_in_reasoning"):
        if "enable_in_reasoning" in config:
            raise ValueError("--structured-outputs-config: enable_in_reasoning false is not "
                             "supported: pyorch constrains the reasoning too (give true)")
