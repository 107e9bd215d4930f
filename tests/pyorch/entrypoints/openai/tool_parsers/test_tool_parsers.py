"""The tool-call parsers on hand-written model outputs: complete, streamed character by
character (the deltas must add up to the non-streamed result), and malformed (whole text back
as content, as vLLM does)."""

from __future__ import annotations

import json

import pytest

from pyorch.entrypoints.openai.tool_parsers import (
    JsonArrayToolParser,
    ToolCallStreamer,
    get_tool_parser,
)
from pyorch.entrypoints.openai.tool_parsers.json_scan import Malformed, held_prefix, scan_call

# (parser, output, expected content, expected [(name, arguments)])
CASES = [
    ("hermes", 'Sure.<tool_call>\n{"name": "f", "arguments": {"a": "x}<y\\"z"}}\n</tool_call>',
     "Sure.", [("f", '{"a": "x}<y\\"z"}')]),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"n": [1, {"b": null}]}}</tool_call>'
     '\n<tool_call>{"arguments": {}, "name": "g"}</tool_call>',
     None, [("f", '{"n": [1, {"b": null}]}'), ("g", "{}")]),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": 1e5}}', None,  # no closing tag
     [("f", '{"a": 1e5}')]),
    ("hermes", "No calls, just <tool> talk.", "No calls, just <tool> talk.", []),
    ("llama3_json", '{"name": "f", "parameters": {"q": "a;b"}}; {"name": "g", "parameters": {}}',
     None, [("f", '{"q": "a;b"}'), ("g", "{}")]),
    ("llama3_json", '<|python_tag|>{"name": "f", "arguments": {"x": true}}', None,
     [("f", '{"x": true}')]),
    ("llama3_json", "The answer is {42}.", "The answer is {42}.", []),
    ("mistral", 'Calling.[TOOL_CALLS] [{"name": "f", "arguments": {"a": -1.5}}, '
     '{"name": "g", "arguments": {"b": "]"}}]', "Calling.", [("f", '{"a": -1.5}'),
                                                          ("g", '{"b": "]"}')]),
    ("mistral", "Plain [TOOL text", "Plain [TOOL text", []),
]
MALFORMED = [
    ("hermes", '<tool_call>\n{"name": "f", "arguments": "not an object"}\n</tool_call>'),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": 1}} trailing\n</tool_call>'),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": 1}\n</tool_call>'),
    ("hermes", "Hi <tool_call>\n</tool_call>"),
    ("hermes", '<tool_call>{"name": 7, "arguments": {}}</tool_call>'),
    ("llama3_json", '{"name": "f", "parameters": {"a": 1}} and then words'),
    ("llama3_json", '{"name": "f", "parameters": {"a": tru}}'),
    ("mistral", '[TOOL_CALLS] [{"name": "f", "arguments": {}}'),
    ("mistral", '[TOOL_CALLS] {"name": "f", "arguments": {}}'),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": ' + "[" * 100000 + "]" * 100000
     + "}}</tool_call>"),  # too deep for json.loads
]


def stream(parser, text):
    """Feeds `text` one character at a time; returns (content, [(name, arguments)])."""
    streamer = ToolCallStreamer(parser)
    content, calls = "", {}
    for i in range(1, len(text) + 1):
        piece, deltas = streamer.feed(text[:i], i == len(text))
        content += piece
        for d in deltas:
            if "id" in d:
                assert d["index"] == len(calls) and d["type"] == "function"
                calls[d["index"]] = [d["function"]["name"], ""]
            calls[d["index"]][1] += d["function"]["arguments"]
    return content, [tuple(calls[i]) for i in sorted(calls)]


@pytest.mark.parametrize("name, text, content, calls", CASES)
def test_complete_and_streamed(name, text, content, calls):
    parser = get_tool_parser(name)
    extracted = parser.extract_tool_calls(text)
    assert extracted.tools_called == bool(calls)
    assert extracted.content == content
    got = [(c["function"]["name"], c["function"]["arguments"]) for c in extracted.tool_calls]
    assert got == calls
    for _, arguments in got:
        assert isinstance(json.loads(arguments), dict)
    assert len({c["id"] for c in extracted.tool_calls}) == len(calls)
    assert stream(parser, text) == (content or "", calls)


@pytest.mark.parametrize("name, text", MALFORMED)
def test_malformed_output_is_content(name, text):
    parser = get_tool_parser(name)
    extracted = parser.extract_tool_calls(text)
    assert (extracted.tools_called, extracted.tool_calls, extracted.content) == (False, [], text)


# Malformed before a call's name went out (the name waits for its arguments object to start):
# the stream falls back to content too. Later breakage cannot be taken back once streamed.
@pytest.mark.parametrize("name, text", [MALFORMED[i] for i in (0, 3, 4, 8)])
def test_malformed_before_any_call_went_out_streams_as_content(name, text):
    assert stream(get_tool_parser(name), text) == (text, [])


def test_content_never_shows_a_partial_tag():
    parser = get_tool_parser("hermes")
    streamer = ToolCallStreamer(parser)
    shown = ""
    for i in range(1, len("Hi <tool_call>") + 1):
        shown += streamer.feed("Hi <tool_call>"[:i], False)[0]
        assert "<" not in shown
    assert shown == "Hi "


def test_required_array_and_ids():
    parser = JsonArrayToolParser()
    text = '[{"name": "f", "parameters": {"a": 1}}, {"name": "g", "parameters": {}}]'
    extracted = parser.extract_tool_calls(text)
    assert [(c["function"]["name"], c["function"]["arguments"])
            for c in extracted.tool_calls] == [("f", '{"a": 1}'), ("g", "{}")]
    assert extracted.content is None
    assert all(c["id"].startswith("chatcmpl-tool-") for c in extracted.tool_calls)
    mistral = get_tool_parser("mistral").extract_tool_calls('[TOOL_CALLS][{"name": "f"}]')
    assert len(mistral.tool_calls[0]["id"]) == 9


def test_parallel_false_streams_only_the_first_call():
    text = '<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{"name": "g"}'
    streamer = ToolCallStreamer(get_tool_parser("hermes"), parallel_tool_calls=False)
    _, deltas = streamer.feed(text, True)
    assert [d["function"]["name"] for d in deltas] == ["f"]


def test_scanner_pieces():
    call = scan_call('{"name": "f", "arguments": {"a": "}"', 0)
    assert call.name == "f" and call.args_end is None and call.end is None
    assert call.arguments('{"name": "f", "arguments": {"a": "}"') == '{"a": "}"'
    with pytest.raises(Malformed):
        scan_call('{"name": "f", "arguments": 3}', 0)
    with pytest.raises(Malformed):
        scan_call("[1]", 0)
    assert held_prefix("abc <tool", "<tool_call>") == 5
    assert held_prefix("abc", "<tool_call>") == 0


def test_unknown_parser_is_named():
    with pytest.raises(ValueError, match="hermes"):
        get_tool_parser("nope")
