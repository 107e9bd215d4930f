"""Tool calling and reasoning for one request: what `tools` / `tool_choice` ask for, the
structured-output schema that enforces `required` and named choices, and the parser that turns
each choice's text into `reasoning`, `content` and `tool_calls` (whole, or as stream deltas).

tool_choice follows vLLM: with `tools` the default is `auto`, which needs the server started
with `--enable-auto-tool-choice --tool-call-parser NAME`; `none` renders the tools but parses
nothing; `required` constrains the output to a JSON array of `{"name", "parameters"}` objects
(one at most when parallel_tool_calls is false), a named function to that function's
arguments object. Reasoning is split off first; tool calls are parsed in what follows it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional

from pyorch.entrypoints.openai.errors import OpenAIError
from pyorch.entrypoints.openai.protocol import ChatTool, NamedToolChoice, ToolChoice
from pyorch.entrypoints.openai.reasoning import (
    ReasoningParser,
    ReasoningStreamer,
    get_reasoning_parser,
)
from pyorch.entrypoints.openai.tool_parsers import (
    JsonArrayToolParser,
    ToolCallStreamer,
    ToolParser,
    get_tool_parser,
)
from pyorch.entrypoints.openai.tool_parsers.abstract_tool_parser import random_tool_call_id
from pyorch.sampling_params import StructuredOutputsParams


def _parameters(tool: ChatTool) -> dict[str, Any]:
    return tool.function.parameters or {"type": "object", "properties": {}}


def required_schema(tools: list[ChatTool], parallel_tool_calls: bool) -> dict[str, Any]:
    """The output of tool_choice="required": a non-empty array of calls of the given tools."""
    items = [{"type": "object",
              "properties": {"name": {"type": "string", "enum": [t.function.name]},
                             "parameters": _parameters(t)},
              "required": ["name", "parameters"]} for t in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": items[0] if len(items) == 1 else {"anyOf": items}}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    return schema


def named_schema(tools: list[ChatTool], name: str) -> dict[str, Any]:
    """The output of a named tool_choice: that function's arguments object."""
    return _parameters(next(t for t in tools if t.function.name == name))


@dataclass
class ToolRequest:
    """What one request asks of tools: `mode` is none / auto / required / named."""

    mode: str
    tools: Optional[list[ChatTool]]
    parallel: bool
    function_name: Optional[str] = None  # the named choice

    def template_tools(self, exclude_when_none: bool) -> Optional[list[dict[str, Any]]]:
        """The tools as the chat template sees them (transformers' `tools=`)."""
        if not self.tools or (self.mode == "none" and exclude_when_none):
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def structured_outputs(self) -> Optional[StructuredOutputsParams]:
        assert self.tools is not None or self.mode in ("none", "auto")
        if self.mode == "required":
            return StructuredOutputsParams(json=required_schema(self.tools or [], self.parallel))
        if self.mode == "named":
            assert self.function_name is not None
            return StructuredOutputsParams(json=named_schema(self.tools or [],
                                                             self.function_name))
        return None


def tool_request(tools: Optional[list[ChatTool]], tool_choice: Optional[ToolChoice],
                 parallel_tool_calls: Optional[bool], enable_auto_tools: bool,
                 tool_call_parser: Optional[str]) -> ToolRequest:
    """Checks the tool fields of a request (400 naming the field) and says what they ask."""
    parallel = parallel_tool_calls is not False
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if not tools:
        if tool_choice != "none":
            raise OpenAIError("When using `tool_choice`, `tools` must be set.",
                              param="tool_choice")
        return ToolRequest("none", None, parallel)
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise OpenAIError("tool names must be unique", param="tools")
    if isinstance(tool_choice, NamedToolChoice):
        name = tool_choice.function.name
        if name not in names:
            raise OpenAIError(f"tool_choice names the function {name!r}, which is not in "
                              "`tools`", param="tool_choice")
        return ToolRequest("named", tools, parallel, name)
    if tool_choice == "auto":
        if not (enable_auto_tools and tool_call_parser):
            raise OpenAIError('"auto" tool choice requires --enable-auto-tool-choice and '
                              "--tool-call-parser to be set", param="tool_choice")
        for i, tool in enumerate(tools):
            if tool.function.strict:
                # The auto mode cannot constrain the arguments; refusing beats ignoring it.
                raise OpenAIError("strict function tools need tool_choice \"required\" or a "
                                  "named function (the \"auto\" mode does not constrain the "
                                  "arguments)", param=f"tools.{i}.function.strict")
    return ToolRequest(str(tool_choice), tools, parallel)


def template_messages_tool_calls(tool_calls: list[Any], where: str) -> list[dict[str, Any]]:
    """An assistant message's tool calls for the chat template, with the arguments as a dict
    (templates write them with `| tojson`), as vLLM and transformers pass them."""
    out = []
    for j, call in enumerate(tool_calls):
        try:
            arguments = json.loads(call.function.arguments)
        except (ValueError, RecursionError) as e:
            raise OpenAIError(f"the tool call's arguments are not JSON: {e}",
                              param=f"{where}.tool_calls.{j}.function.arguments") from None
        out.append({"id": call.id, "type": "function",
                    "function": {"name": call.function.name, "arguments": arguments}})
    return out


@dataclass
class ParsedOutput:
    reasoning: Optional[str]
    content: Optional[str]
    tool_calls: list[dict[str, Any]]


class ChatOutputParser:
    """Parses one choice's output the way the request asked (see the module docstring)."""

    def __init__(self, request: ToolRequest, tool_call_parser: Optional[str],
                 reasoning_parser: Optional[str], prompt: str, tokenizer: Any = None) -> None:
        self.request = request
        self.prompt = prompt
        self.reasoning: Optional[ReasoningParser] = (
            get_reasoning_parser(reasoning_parser) if reasoning_parser else None)
        self.tools: Optional[ToolParser] = None
        if request.mode == "auto":
            assert tool_call_parser is not None
            self.tools = get_tool_parser(tool_call_parser, tokenizer)
        elif request.mode == "required":
            self.tools = JsonArrayToolParser(tokenizer)
        self._reasoning_streamer: Optional[ReasoningStreamer] = None
        self._tool_streamer: Optional[ToolCallStreamer] = None
        self._named_id: Optional[str] = None
        self._content = ""  # content so far (after reasoning)

    @property
    def active(self) -> bool:
        return self.reasoning is not None or self.request.mode != "none"

    def skip_special_tokens(self, skip: bool) -> bool:
        return self.tools.adjust_skip_special_tokens(skip) if self.tools else skip

    def finish_reason(self, engine_reason: Optional[str], tools_called: bool) -> Optional[str]:
        """vLLM: "tool_calls" when auto / required calls were parsed (named: the engine's)."""
        if tools_called and self.request.mode in ("auto", "required"):
            return "tool_calls"
        return engine_reason

    # ---- whole outputs ----------------------------------------------------------------------
    def parse(self, text: str) -> ParsedOutput:
        reasoning: Optional[str] = None
        content: Optional[str] = text
        if self.reasoning is not None:
            reasoning, content = self.reasoning.extract_reasoning(text, self.prompt)
        if self.request.mode == "named":
            call = {"id": random_tool_call_id(), "type": "function",
                    "function": {"name": self.request.function_name,
                                 "arguments": content or ""}}
            return ParsedOutput(reasoning, None, [call])
        if self.tools is None or content is None:
            return ParsedOutput(reasoning, content, [])
        extracted = self.tools.extract_tool_calls(content)
        calls = extracted.tool_calls if self.request.parallel else extracted.tool_calls[:1]
        return ParsedOutput(reasoning, extracted.content if calls else content, calls)

    # ---- streams ----------------------------------------------------------------------------
    def feed(self, text: str, final: bool) -> dict[str, Any]:
        """The delta (OpenAI's `delta` fields) for the whole text so far."""
        delta: dict[str, Any] = {}
        content = text
        if self.reasoning is not None:
            if self._reasoning_streamer is None:
                self._reasoning_streamer = ReasoningStreamer(self.reasoning, self.prompt)
            reasoning, _ = self._reasoning_streamer.feed(text, final)
            if reasoning:
                delta["reasoning"] = delta["reasoning_content"] = reasoning
            content = self._reasoning_streamer.content_text
        if self.request.mode == "named":
            piece = content[len(self._content):]
            self._content = content
            if self._named_id is None and (piece or final):
                self._named_id = random_tool_call_id()
                delta["tool_calls"] = [{"index": 0, "id": self._named_id, "type": "function",
                                        "function": {"name": self.request.function_name,
                                                     "arguments": piece}}]
            elif piece:
                delta["tool_calls"] = [{"index": 0, "function": {"arguments": piece}}]
            return delta
        if self.tools is None:
            piece = content[len(self._content):]
            self._content = content
            if piece:
                delta["content"] = piece
            return delta
        if self._tool_streamer is None:
            self._tool_streamer = ToolCallStreamer(self.tools, self.request.parallel)
        piece, calls = self._tool_streamer.feed(content, final)
        if piece:
            delta["content"] = piece
        if calls:
            delta["tool_calls"] = calls
        return delta

    @property
    def streamed_tool_calls(self) -> bool:
        return self._named_id is not None or bool(
            self._tool_streamer and self._tool_streamer.tools_called)
