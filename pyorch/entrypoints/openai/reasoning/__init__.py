"""Reasoning parsers (`--reasoning-parser NAME`, vLLM's names)."""

from __future__ import annotations

from pyorch.entrypoints.openai.reasoning.abstract_reasoning_parser import (
    DeepSeekR1ReasoningParser,
    Qwen3ReasoningParser,
    ReasoningParser,
    ReasoningStreamer,
)

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "qwen3": Qwen3ReasoningParser,
    "deepseek_r1": DeepSeekR1ReasoningParser,
}


def get_reasoning_parser(name: str) -> ReasoningParser:
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of "
                         f"{', '.join(sorted(REASONING_PARSERS))}")
    return REASONING_PARSERS[name]()


__all__ = ["REASONING_PARSERS", "ReasoningParser", "ReasoningStreamer", "get_reasoning_parser"]
