"""`hermes`: Hermes 2 Pro / Qwen2.5 / Qwen3 / SmolLM3-style calls, one JSON object per
`<tool_call>...</tool_call>` block:

    Let me check.<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Content is the text before the first `<tool_call>` (vLLM drops text between and after calls);
the last block may lack its closing tag.
"""

from __future__ import annotations

from pyorch.entrypoints.openai.tool_parsers.abstract_tool_parser import ToolParser, ToolScan
from pyorch.entrypoints.openai.tool_parsers.json_scan import held_prefix, scan_call, skip_ws

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    def scan(self, text: str, final: bool) -> ToolScan:
        start = text.find(START)
        if start < 0:
            held = 0 if final else held_prefix(text, START)
            return ToolScan(text[:len(text) - held])
        scan = ToolScan(text[:start], started=True)
        pos = start
        while pos >= 0:
            body = pos + len(START)
            close = text.find(END, body)
            segment = text if close < 0 else text[:close]
            i = skip_ws(segment, body)
            if i >= len(segment):
                break
            call = scan_call(segment, i)
            scan.calls.append(call)
            if close < 0 or call.end is None:
                if close >= 0:  # the block closed before its object did
                    scan.trailing.append((body, close))
                break
            scan.trailing.append((call.end, close))
            pos = text.find(START, close + len(END))
        return scan
