"""`mistral`: Mistral 7B v0.3 / Nemo / Small calls, a JSON array after the `[TOOL_CALLS]`
special token:

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]

`[TOOL_CALLS]` is a special token, so requests with tools keep special tokens in the text
(as vLLM's parser does). Call ids are 9 alphanumeric characters, as Mistral's templates require.
"""

from __future__ import annotations

import secrets
import string

from pyorch.entrypoints.openai.tool_parsers.abstract_tool_parser import ToolParser, ToolScan
from pyorch.entrypoints.openai.tool_parsers.json_scan import (
    Malformed,
    held_prefix,
    scan_array,
    skip_ws,
)

BOT = "[TOOL_CALLS]"
_ID_CHARS = string.ascii_letters + string.digits


class MistralToolParser(ToolParser):
    def adjust_skip_special_tokens(self, skip: bool) -> bool:
        return False

    def make_id(self) -> str:
        return "".join(secrets.choice(_ID_CHARS) for _ in range(9))

    def scan(self, text: str, final: bool) -> ToolScan:
        start = text.find(BOT)
        if start < 0:
            held = 0 if final else held_prefix(text, BOT)
            return ToolScan(text[:len(text) - held])
        scan = ToolScan(text[:start], started=True)
        i = skip_ws(text, start + len(BOT))
        if i < len(text):
            end = scan_array(text, i, scan.calls)
            if end is not None:
                scan.trailing.append((end, len(text)))
            elif final:
                raise Malformed("the tool-call array is not closed")
        return scan


class JsonArrayToolParser(ToolParser):
    """The output of tool_choice="required": a bare JSON array of {"name", "parameters"}
    objects, constrained by the schema that `tool_choice.required_schema` builds."""

    def scan(self, text: str, final: bool) -> ToolScan:
        scan = ToolScan("", started=True)
        i = skip_ws(text, 0)
        if i < len(text):
            end = scan_array(text, i, scan.calls)
            if end is not None:
                scan.trailing.append((end, len(text)))
            elif final:
                raise Malformed("the tool-call array is not closed")
        return scan
