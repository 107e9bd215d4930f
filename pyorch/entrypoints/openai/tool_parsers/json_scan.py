"""A JSON scanner that tolerates text cut off at any character: what a streaming tool parser
sees of a tool call while the model is still writing it.

`scan_call(text, pos)` reads one `{"name": ..., "arguments": {...}}` object and reports the
name (once its string is complete), where the arguments value starts and (once complete) ends,
and where the object ends. A tool call's `arguments` are the raw JSON text the model wrote
(valid JSON, checked once complete), so the streamed pieces of a call add up to exactly the
non-streamed string.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Optional

# Keys that hold a call's arguments: OpenAI's / Hermes' / Mistral's "arguments", Llama 3.1's
# "parameters" (also what the schema for tool_choice="required" uses, as vLLM's does).
ARGUMENT_KEYS = ("arguments", "parameters")
_WS = " \t\n\r"
_LITERAL_RE = re.compile(r"-?[0-9][0-9.eE+\-]*|true|false|null")
_STRING_REST_RE = re.compile(r'(?:[^"\\]|\\.)*"', re.DOTALL)  # after the opening quote
_STRUCTURAL_RE = re.compile(r'["{}\[\]]')


class Malformed(Exception):
    """The text cannot be (the start of) a tool-call object."""


@dataclass
class ScannedCall:
    """One tool-call object as far as `text` goes."""

    name: Optional[str] = None  # set once the name's string is complete
    args_start: Optional[int] = None  # index of the arguments value's first character
    args_end: Optional[int] = None  # one past its last character, once it is complete
    end: Optional[int] = None  # one past the closing '}', once the object is complete

    def arguments(self, text: str) -> str:
        """The arguments text so far (all of it once complete)."""
        if self.args_start is None:
            return ""
        return text[self.args_start:len(text) if self.args_end is None else self.args_end]


def skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in _WS:
        pos += 1
    return pos


def _string_end(text: str, pos: int) -> Optional[int]:
    """End of the JSON string starting at text[pos] == '"', or None if cut off."""
    match = _STRING_REST_RE.match(text, pos + 1)
    return None if match is None else match.end()


def value_end(text: str, pos: int) -> Optional[int]:
    """End of the JSON value starting at text[pos] (None if cut off); Malformed if it cannot be
    JSON. Containers are matched by depth, strings skipped; json.loads checks the rest later."""
    if pos >= len(text):
        return None
    c = text[pos]
    if c == '"':
        return _string_end(text, pos)
    if c in "{[":
        depth, i = 0, pos
        while True:  # regex jumps between structural characters: this runs on every delta
            found = _STRUCTURAL_RE.search(text, i)
            if found is None:
                return None
            c, i = found.group(), found.start()
            if c == '"':
                end = _string_end(text, i)
                if end is None:
                    return None
                i = end
                continue
            depth += 1 if c in "{[" else -1
            if depth == 0:
                return i + 1
            i += 1
    match = _LITERAL_RE.match(text, pos)
    if match is None:
        if any(w.startswith(text[pos:]) for w in ("true", "false", "null")):
            return None
        raise Malformed(f"unexpected {text[pos]!r} in JSON")
    if match.end() == len(text):
        return None  # a number may go on
    return match.end()


def scan_call(text: str, pos: int) -> ScannedCall:
    """Scans the tool-call object starting at text[pos] (which must be '{' or the text's end)."""
    call = ScannedCall()
    if pos >= len(text):
        return call
    if text[pos] != "{":
        raise Malformed("a tool call must be a JSON object")
    i = pos + 1
    while True:
        i = skip_ws(text, i)
        if i >= len(text):
            return call
        if text[i] == "}":
            call.end = i + 1
            return call
        if text[i] == ",":
            i = skip_ws(text, i + 1)
            if i >= len(text):
                return call
        if text[i] != '"':
            raise Malformed("expected a key in the tool-call object")
        key_end = _string_end(text, i)
        if key_end is None:
            return call
        key = json.loads(text[i:key_end])
        i = skip_ws(text, key_end)
        if i >= len(text):
            return call
        if text[i] != ":":
            raise Malformed("expected ':' after a key")
        i = skip_ws(text, i + 1)
        if i >= len(text):
            return call
        if key in ARGUMENT_KEYS:
            if text[i] != "{":
                raise Malformed(f"the tool call's {key} must be a JSON object")
            call.args_start = i
        end = value_end(text, i)
        if end is None:
            return call
        if key == "name":
            name = json.loads(text[i:end])
            if not isinstance(name, str):
                raise Malformed("the tool call's name must be a string")
            call.name = name
        elif key in ARGUMENT_KEYS:
            call.args_end = end
        i = end


def check_call(text: str, call: ScannedCall) -> None:
    """Malformed unless `call` is a complete call with a name and JSON-object arguments."""
    if call.end is None or not call.name:
        raise Malformed("incomplete tool call")
    if call.args_start is not None:
        try:
            json.loads(call.arguments(text))
        except (ValueError, RecursionError) as e:
            raise Malformed(f"the tool call's arguments are not JSON: {e}") from None


def scan_array(text: str, pos: int, calls: list[ScannedCall]) -> Optional[int]:
    """Scans a JSON array of tool-call objects starting at text[pos] == '[' into `calls`; returns
    the index one past its ']' once the array is complete, else None."""
    if text[pos] != "[":
        raise Malformed("expected a JSON array of tool calls")
    i = pos + 1
    while True:
        i = skip_ws(text, i)
        if i >= len(text):
            return None
        if text[i] == "]":
            return i + 1
        if calls:
            if text[i] != ",":
                raise Malformed("expected ',' between tool calls")
            i = skip_ws(text, i + 1)
            if i >= len(text):
                return None
        call = scan_call(text, i)
        calls.append(call)
        if call.end is None:
            return None
        i = call.end


def held_prefix(text: str, tag: str) -> int:
    """How many characters at the end of `text` could be the start of `tag` (held back while
    streaming until the next characters tell)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
