"""What every tool-call parser provides, and the streaming differ they share.

A parser turns the model's text (after any reasoning) into plain content plus tool calls. Each
parser only implements `scan(text, final)`: the content that is safe to show so far and the
tool-call objects found so far (possibly cut off). Both the non-streaming answer
(`extract_tool_calls`) and the streamed deltas (`ToolCallStreamer`) come from it, so a stream's
deltas reassemble to the non-streamed message.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

from pyorch.entrypoints.openai.tool_parsers.json_scan import Malformed, ScannedCall, check_call


@dataclass
class ToolScan:
    """What a parser found in the text so far."""

    content: str  # content that may be shown (a prefix of the final content)
    calls: list[ScannedCall] = field(default_factory=list)  # offsets into the scanned text
    # The model started tool calls (a tag or a call object was seen): with no valid call at
    # the end, the whole text falls back to content.
    started: bool = False
    # (start, end) spans that must hold only whitespace once the output is complete: what
    # follows a call object inside its tags (Hermes' <tool_call>...</tool_call>).
    trailing: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class ExtractedToolCalls:
    """vLLM's ExtractedToolCallInformation: whether tools were called, the calls (OpenAI's
    `{"id", "type": "function", "function": {"name", "arguments"}}`), the content (None when
    empty)."""

    tools_called: bool
    tool_calls: list[dict[str, Any]]
    content: Optional[str]


RESCAN_FRACTION = 32


def random_tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def call_arguments(text: str, call: ScannedCall) -> str:
    """The arguments JSON text of a call; "{}" for a complete call that gave none."""
    if call.args_start is None:
        return "{}" if call.end is not None else ""
    return call.arguments(text)


class ToolParser:
    """Base class; subclasses implement `scan`."""

    def __init__(self, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer

    def adjust_skip_special_tokens(self, skip: bool) -> bool:
        """The skip_special_tokens the request should run with (Mistral needs its
        [TOOL_CALLS] token in the text)."""
        return skip

    def make_id(self) -> str:
        return random_tool_call_id()

    def scan(self, text: str, final: bool) -> ToolScan:
        """The content and the tool calls in `text`; `final` once the output is complete (then
        nothing is held back). Raises Malformed when the text cannot hold valid calls."""
        raise NotImplementedError

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        """The complete output's tool calls; on malformed calls, the whole text is content
        (vLLM's fallback)."""
        try:
            scan = self.scan(text, True)
            for call in scan.calls:
                check_call(text, call)
            for start, end in scan.trailing:
                if text[start:end].strip():
                    raise Malformed("text after a tool call inside its tags")
        except Malformed:
            return ExtractedToolCalls(False, [], text)
        if not scan.calls:
            return ExtractedToolCalls(False, [], text)
        calls = [{"id": self.make_id(), "type": "function",
                  "function": {"name": c.name, "arguments": call_arguments(text, c)}}
                 for c in scan.calls]
        return ExtractedToolCalls(True, calls, scan.content or None)


class ToolCallStreamer:
    """Turns the growing text of one choice into OpenAI deltas: content pieces, then per tool
    call a first delta `{index, id, type, function: {name, arguments}}` and later
    `{index, function: {arguments}}` pieces (vLLM's DeltaToolCall shape)."""

    def __init__(self, parser: ToolParser, parallel_tool_calls: bool = True) -> None:
        self.parser = parser
        self.parallel = parallel_tool_calls
        self.content_sent = 0
        self.calls_sent: list[list[Any]] = []  # per call: [id, arguments sent]
        self.broken = False
        self.in_calls = False  # the last scan saw tool calls start
        self.scanned_len = 0

    @property
    def tools_called(self) -> bool:
        return bool(self.calls_sent)

    def feed(self, text: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        """(content delta, tool-call deltas) for the text so far."""
        # Inside tool calls each feed rescans the calls from their start; rescanning only
        # after the text grew by 1/32 keeps a long call's cost O(n log n) (coarser pieces).
        if (not final and self.in_calls
                and len(text) - self.scanned_len < max(1, len(text) // RESCAN_FRACTION)):
            return "", []
        self.scanned_len = len(text)
        scan: Optional[ToolScan] = None
        if not self.broken:
            try:
                scan = self.parser.scan(text, final)
            except Malformed:
                self.broken = True
        if scan is None:
            # Malformed calls: vLLM's fallback is the whole text as content. Once a call went
            # out it cannot be taken back; then the rest is dropped.
            if final and not self.calls_sent:
                delta, self.content_sent = text[self.content_sent:], len(text)
                return delta, []
            return "", []
        self.in_calls = scan.started
        sent = self.content_sent
        if final and not self.calls_sent and (scan.started and not scan.calls
                                              or not self._valid(text, scan)):
            self.content_sent = len(text)  # the fallback: all of it is content
            return text[sent:], []
        content = scan.content[sent:]
        self.content_sent = max(sent, len(scan.content))
        deltas: list[dict[str, Any]] = []
        for index, call in enumerate(scan.calls):
            # A name goes out once the arguments have started as an object (or the call ended
            # without any): a call malformed before that still falls back to content.
            if ((index > 0 and not self.parallel) or call.name is None
                    or (call.args_start is None and call.end is None)):
                break
            arguments = call_arguments(text, call)
            if index == len(self.calls_sent):
                call_id = self.parser.make_id()
                self.calls_sent.append([call_id, len(arguments)])
                deltas.append({"index": index, "id": call_id, "type": "function",
                               "function": {"name": call.name, "arguments": arguments}})
            elif len(arguments) > self.calls_sent[index][1]:
                deltas.append({"index": index,
                               "function": {"arguments": arguments[self.calls_sent[index][1]:]}})
                self.calls_sent[index][1] = len(arguments)
        return content, deltas

    @staticmethod
    def _valid(text: str, scan: ToolScan) -> bool:
        try:
            for call in scan.calls:
                check_call(text, call)
        except Malformed:
            return False
        return all(not text[a:b].strip() for a, b in scan.trailing)
