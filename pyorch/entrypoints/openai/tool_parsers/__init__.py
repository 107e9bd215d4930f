"""Tool-call parsers (`--tool-call-parser NAME`, vLLM's names)."""

from __future__ import annotations

from typing import Any

from pyorch.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ExtractedToolCalls,
    ToolCallStreamer,
    ToolParser,
)
from pyorch.entrypoints.openai.tool_parsers.hermes_tool_parser import HermesToolParser
from pyorch.entrypoints.openai.tool_parsers.llama_tool_parser import Llama3JsonToolParser
from pyorch.entrypoints.openai.tool_parsers.mistral_tool_parser import (
    JsonArrayToolParser,
    MistralToolParser,
)

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
}


def get_tool_parser(name: str, tokenizer: Any = None) -> ToolParser:
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of "
                         f"{', '.join(sorted(TOOL_PARSERS))}")
    return TOOL_PARSERS[name](tokenizer)


__all__ = ["TOOL_PARSERS", "ExtractedToolCalls", "JsonArrayToolParser", "ToolCallStreamer",
           "ToolParser", "get_tool_parser"]
