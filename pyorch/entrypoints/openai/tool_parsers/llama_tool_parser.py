"""`llama3_json`: Llama 3.1 / 3.2 JSON calls, the whole output being one or more objects
separated by `;`, optionally after `<|python_tag|>`:

    {"name": "get_weather", "parameters": {"city": "Paris"}}

Output that does not start with `{` (or the tag) is plain content, as in vLLM.
"""

from __future__ import annotations

from pyorch.entrypoints.openai.tool_parsers.abstract_tool_parser import ToolParser, ToolScan
from pyorch.entrypoints.openai.tool_parsers.json_scan import Malformed, scan_call, skip_ws

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    def scan(self, text: str, final: bool) -> ToolScan:
        i = skip_ws(text, 0)
        rest = text[i:]
        if not final and (not rest or (PYTHON_TAG.startswith(rest) and rest != PYTHON_TAG)):
            return ToolScan("")  # cannot tell yet
        if rest.startswith(PYTHON_TAG):
            i = skip_ws(text, i + len(PYTHON_TAG))
        elif not rest.startswith("{"):
            return ToolScan(text)
        scan = ToolScan("", started=True)
        while i < len(text):
            call = scan_call(text, i)
            scan.calls.append(call)
            if call.end is None:
                break
            i = skip_ws(text, call.end)
            if i < len(text):
                if text[i] != ";":
                    raise Malformed("expected ';' between tool calls")
                i = skip_ws(text, i + 1)
        return scan
