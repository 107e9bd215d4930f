"""Tool calling and reasoning on /v1/chat/completions, through the official openai client and
the real app, with scripted model output (scripted_engine.py) and real chat templates
(Qwen2.5's hermes-style, Llama 3.1's JSON one, in templates/)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from scripted_engine import ScriptedServer, byte_tokenizer, openai_client, template

from pyorch.entrypoints.openai.chat_output import named_schema, required_schema
from pyorch.entrypoints.openai.protocol import ChatTool

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["C", "F"]}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}}}}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "Weather in Paris, and the time in Tokyo?"}]
HERMES_CALLS = ('Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
                '"unit": "C"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": '
                '{"tz": "Asia/Tokyo"}}\n</tool_call>')


@pytest.fixture(scope="module")
def hermes():
    server = ScriptedServer("qwen2_5.jinja", enable_auto_tools=True,
                            tool_call_parser="hermes").start()
    yield server
    server.stop()


def chat(server, reply, messages=ASK, **kw):
    with openai_client(server, reply) as client:
        return client.chat.completions.create(model="scripted", messages=messages, **kw)


def stream(server, reply, messages=ASK, **kw):
    """The streamed message reassembled: (content, reasoning, tool calls, finish_reason)."""
    content, reasoning, calls, finish = "", "", {}, None
    with openai_client(server, reply) as client:
        for chunk in client.chat.completions.create(model="scripted", messages=messages,
                                                    stream=True, **kw):
            if not chunk.choices:
                continue
            choice = chunk.choices[0]
            delta = choice.delta
            content += delta.content or ""
            reasoning += (delta.model_extra or {}).get("reasoning") or ""
            for tc in delta.tool_calls or []:
                if tc.id is not None:  # the first delta of a call: id, type and name
                    assert tc.index not in calls and tc.type == "function"
                    calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": ""}
                else:
                    assert tc.function.name is None
                calls[tc.index]["arguments"] += tc.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, reasoning, [calls[i] for i in sorted(calls)], finish


def calls_of(message):
    return [{"name": c.function.name, "arguments": c.function.arguments}
            for c in message.tool_calls]


def test_hermes_round_trip(hermes):
    out = chat(hermes, HERMES_CALLS, tools=TOOLS)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    weather, now = choice.message.tool_calls
    assert weather.id.startswith("chatcmpl-tool-") and weather.id != now.id
    assert weather.type == "function" and weather.function.name == "get_weather"
    assert json.loads(weather.function.arguments) == {"city": "Paris", "unit": "C"}
    assert (now.function.name, json.loads(now.function.arguments)) == ("get_time",
                                                                        {"tz": "Asia/Tokyo"})
    # The tools reached the template exactly as transformers passes them.
    tok = hermes.tokenizer
    assert hermes.engine.last_prompt == tok.apply_chat_template(
        ASK, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert '"name": "get_weather"' in hermes.engine.last_prompt

    # Second turn: the assistant's tool calls and the tool results go back through the template.
    turn2 = ASK + [choice.message.model_dump(exclude_none=True),
                   {"role": "tool", "tool_call_id": weather.id, "content": "22 C, sunny"},
                   {"role": "tool", "tool_call_id": now.id, "content": "21:04"}]
    answer = chat(hermes, "Sunny, 22 C; it is 21:04 in Tokyo.", turn2, tools=TOOLS)
    assert answer.choices[0].message.content == "Sunny, 22 C; it is 21:04 in Tokyo."
    assert answer.choices[0].message.tool_calls == []
    assert answer.choices[0].finish_reason == "stop"
    expected_messages = ASK + [
        {"role": "assistant", "content": "Let me check.", "tool_calls": [
            {"id": weather.id, "type": "function", "function": {
                "name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}},
            {"id": now.id, "type": "function", "function": {
                "name": "get_time", "arguments": {"tz": "Asia/Tokyo"}}}]},
        {"role": "tool", "tool_call_id": weather.id, "content": "22 C, sunny"},
        {"role": "tool", "tool_call_id": now.id, "content": "21:04"}]
    prompt = hermes.engine.last_prompt
    assert prompt == tok.apply_chat_template(expected_messages, tools=TOOLS, tokenize=False,
                                             add_generation_prompt=True)
    assert ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}'
            '\n</tool_call>') in prompt
    assert "<tool_response>\n22 C, sunny\n</tool_response>" in prompt


def test_tokenize_renders_tools_and_tool_messages_like_chat(hermes):
    messages = ASK + [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function",
         "function": {"name": "get_time", "arguments": '{"tz": "UTC"}'}}]},
                      {"role": "tool", "tool_call_id": "c1", "content": "12:00"}]
    counted = httpx.post(hermes.url + "/tokenize",
                         json={"messages": messages, "tools": TOOLS}).json()["count"]
    usage = chat(hermes, "It is noon.", messages, tools=TOOLS).usage
    assert counted == usage.prompt_tokens == len(hermes.engine.calls[-1][0]["prompt_token_ids"])
    assert "<tool_response>\n12:00\n</tool_response>" in hermes.engine.last_prompt


@pytest.mark.parametrize("reply", [
    HERMES_CALLS,
    "Plain answer, no tools.",
    "<tool_call>\n{\"name\": \"get_time\"}\n</tool_call>",  # no arguments: "{}"
    "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": [1]}\n</tool_call>",  # malformed
    "Almost a tag: <tool_cal and more",
])
def test_hermes_stream_reassembles_to_the_message(hermes, reply):
    message = chat(hermes, reply, tools=TOOLS).choices[0]
    content, reasoning, calls, finish = stream(hermes, reply, tools=TOOLS)
    assert content == (message.message.content or "")
    assert [{"name": c["name"], "arguments": c["arguments"]} for c in calls] == calls_of(
        message.message)
    assert finish == message.finish_reason
    assert reasoning == ""


def test_malformed_calls_fall_back_to_content(hermes):
    reply = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": [1]}\n</tool_call>"
    message = chat(hermes, reply, tools=TOOLS).choices[0]
    assert message.message.content == reply and message.message.tool_calls == []
    assert message.finish_reason == "stop"
    assert calls_of(chat(hermes, "<tool_call>\n{\"name\": \"get_time\"}\n</tool_call>",
                         tools=TOOLS).choices[0].message) == [{"name": "get_time",
                                                              "arguments": "{}"}]


def test_a_call_cut_off_is_content_unless_it_was_already_streamed(hermes):
    # vLLM's behaviour: the whole output falls back to content; a stream cannot take back the
    # name and argument pieces it already sent.
    reply = 'Text <tool_call>{"name": "get_weather", "arguments": {"city": "Par'
    message = chat(hermes, reply, tools=TOOLS).choices[0].message
    assert message.content == reply and message.tool_calls == []
    content, _, calls, finish = stream(hermes, reply, tools=TOOLS)
    assert content == "Text " and finish == "tool_calls"
    assert calls[0]["name"] == "get_weather" and calls[0]["arguments"] == '{"city": "Par'


def test_parallel_tool_calls_false_keeps_the_first(hermes):
    for out in (calls_of(chat(hermes, HERMES_CALLS, tools=TOOLS,
                              parallel_tool_calls=False).choices[0].message),
                stream(hermes, HERMES_CALLS, tools=TOOLS, parallel_tool_calls=False)[2]):
        assert [c["name"] for c in out] == ["get_weather"]


def test_tool_choice_none_renders_tools_and_parses_nothing(hermes):
    out = chat(hermes, HERMES_CALLS, tools=TOOLS, tool_choice="none").choices[0]
    assert out.message.content == HERMES_CALLS and out.message.tool_calls == []
    assert out.finish_reason == "stop"
    assert "<tools>" in hermes.engine.last_prompt
    assert hermes.engine.last_params.structured_outputs is None


def test_tool_choice_required_is_enforced_by_a_schema(hermes):
    reply = ('[{"name": "get_weather", "parameters": {"city": "Paris"}}, '
             '{"name": "get_time", "parameters": {}}]')
    out = chat(hermes, reply, tools=TOOLS, tool_choice="required").choices[0]
    schema = hermes.engine.last_params.structured_outputs.json
    assert schema == required_schema([ChatTool(**t) for t in TOOLS], True)
    assert out.finish_reason == "tool_calls" and out.message.content is None
    assert calls_of(out.message) == [
        {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"name": "get_time", "arguments": "{}"}]
    content, _, calls, finish = stream(hermes, reply, tools=TOOLS, tool_choice="required")
    assert content == "" and finish == "tool_calls"
    assert [{"name": c["name"], "arguments": c["arguments"]} for c in calls] == calls_of(
        out.message)
    chat(hermes, reply, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert hermes.engine.last_params.structured_outputs.json["maxItems"] == 1


def test_named_tool_choice_is_enforced_by_the_parameters_schema(hermes):
    reply = '{"city": "Paris", "unit": "F"}'
    choice = {"type": "function", "function": {"name": "get_weather"}}
    out = chat(hermes, reply, tools=TOOLS, tool_choice=choice).choices[0]
    assert hermes.engine.last_params.structured_outputs.json == WEATHER["function"]["parameters"]
    assert out.finish_reason == "stop" and out.message.content is None
    assert calls_of(out.message) == [{"name": "get_weather", "arguments": reply}]
    content, _, calls, _ = stream(hermes, reply, tools=TOOLS, tool_choice=choice)
    assert content == "" and [(c["name"], c["arguments"]) for c in calls] == [
        ("get_weather", reply)]


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "broken"}}])
def test_a_tool_schema_that_cannot_be_enforced_is_400_naming_tools(hermes, choice):
    broken = {"type": "function", "function": {"name": "broken", "parameters": {
        "type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}}
    calls = len(hermes.engine.calls)
    with openai_client(hermes) as client:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="scripted", messages=ASK, tools=[broken],
                                           tool_choice=choice)
    assert info.value.body["param"] == "tools"  # type: ignore[index]
    assert "cannot be enforced" in info.value.body["message"]  # type: ignore[index]
    assert len(hermes.engine.calls) == calls  # refused before the engine


def test_tool_choice_with_another_constraint_is_400(hermes):
    with openai_client(hermes) as client:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="scripted", messages=ASK, tools=TOOLS,
                                           tool_choice="required",
                                           response_format={"type": "json_object"})
    assert info.value.body["param"] == "tool_choice"  # type: ignore[index]


def test_schemas():
    tools = [ChatTool(**t) for t in TOOLS]
    schema = required_schema(tools, True)
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    first, second = schema["items"]["anyOf"]
    assert first["properties"]["name"] == {"type": "string", "enum": ["get_weather"]}
    assert first["properties"]["parameters"] == WEATHER["function"]["parameters"]
    assert first["required"] == ["name", "parameters"]
    assert second["properties"]["parameters"] == TIME["function"]["parameters"]
    one = required_schema(tools[:1], False)
    assert one["items"] == first and one["maxItems"] == 1
    assert named_schema(tools, "get_time") == TIME["function"]["parameters"]
    bare = ChatTool(**{"type": "function", "function": {"name": "ping"}})
    assert named_schema([bare], "ping") == {"type": "object", "properties": {}}


@pytest.mark.parametrize("body, fragment", [
    ({"tool_choice": "required"}, "`tools` must be set"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "'nope'"),
    ({"tools": [WEATHER, WEATHER]}, "unique"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": True}}]}, "strict"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"functions": [WEATHER["function"]]}, "`functions` is not supported"),
    ({"function_call": {"name": "get_weather"}}, "`function_call` is not supported"),
    ({"messages": ASK + [{"role": "assistant", "tool_calls": [
        {"id": "x", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]},
     "arguments are not JSON"),
])
def test_bad_tool_requests_are_400(hermes, body, fragment):
    with openai_client(hermes) as client:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="scripted", **{"messages": ASK, **body})
    assert fragment in info.value.body["message"]  # type: ignore[index]


def test_auto_needs_the_server_flags():
    server = ScriptedServer("qwen2_5.jinja").start()
    try:
        with pytest.raises(openai.BadRequestError) as info:
            chat(server, "hi", tools=TOOLS)  # tools default to tool_choice="auto"
        assert "--enable-auto-tool-choice" in info.value.body["message"]  # type: ignore[index]
        # none and required work without a parser
        assert chat(server, HERMES_CALLS, tools=TOOLS, tool_choice="none").choices[
            0].message.content == HERMES_CALLS
    finally:
        server.stop()


def test_exclude_tools_when_tool_choice_none():
    server = ScriptedServer("qwen2_5.jinja", exclude_tools_when_tool_choice_none=True).start()
    try:
        chat(server, "hi", tools=TOOLS, tool_choice="none")
        assert "<tools>" not in server.engine.last_prompt
        assert server.engine.last_prompt == server.tokenizer.apply_chat_template(
            ASK, tokenize=False, add_generation_prompt=True)
    finally:
        server.stop()


def test_llama3_json_round_trip():
    server = ScriptedServer("llama3_1_json.jinja", enable_auto_tools=True,
                            tool_call_parser="llama3_json").start()
    try:
        reply = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
        out = chat(server, reply, tools=TOOLS).choices[0]
        assert out.finish_reason == "tool_calls" and out.message.content is None
        (call,) = out.message.tool_calls
        assert (call.function.name, json.loads(call.function.arguments)) == (
            "get_weather", {"city": "Paris"})
        assert "Given the following functions" in server.engine.last_prompt
        _, _, calls, finish = stream(server, reply, tools=TOOLS)
        assert [(c["name"], c["arguments"]) for c in calls] == [
            ("get_weather", call.function.arguments)] and finish == "tool_calls"
        turn2 = ASK + [out.message.model_dump(exclude_none=True),
                       {"role": "tool", "tool_call_id": call.id, "content": "22 C"}]
        chat(server, "It is 22 C.", turn2, tools=TOOLS)
        prompt = server.engine.last_prompt
        assert ('<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "get_weather", '
                '"parameters": {"city": "Paris"}}<|eot_id|>') in prompt
        assert ('<|start_header_id|>ipython<|end_header_id|>\n\n{"output": "22 C"}<|eot_id|>'
                in prompt)
        assert chat(server, "Paris is sunny.", tools=TOOLS).choices[0].message.content == (
            "Paris is sunny.")
    finally:
        server.stop()


def test_mistral_keeps_special_tokens_and_uses_short_ids():
    server = ScriptedServer("qwen2_5.jinja", enable_auto_tools=True,
                            tool_call_parser="mistral").start()
    try:
        reply = '[TOOL_CALLS][{"name": "get_time", "arguments": {"tz": "UTC"}}]'
        out = chat(server, reply, tools=TOOLS).choices[0]
        assert server.engine.last_params.skip_special_tokens is False
        (call,) = out.message.tool_calls
        assert len(call.id) == 9 and call.id.isalnum()
        assert (call.function.name, call.function.arguments) == ("get_time", '{"tz": "UTC"}')
        assert stream(server, reply, tools=TOOLS)[2][0]["arguments"] == '{"tz": "UTC"}'
        chat(server, "no tools here", tools=TOOLS, tool_choice="none")
        assert server.engine.last_params.skip_special_tokens is True
    finally:
        server.stop()


@pytest.fixture(scope="module")
def qwen3():
    server = ScriptedServer("qwen2_5.jinja", enable_auto_tools=True, tool_call_parser="hermes",
                            reasoning_parser="qwen3").start()
    yield server
    server.stop()


@pytest.mark.parametrize("reply, reasoning, content", [
    ("<think>\nParis is in France.</think>\n\nIt is sunny.", "\nParis is in France.",
     "\n\nIt is sunny."),
    ("No thinking today.", None, "No thinking today."),
    ("<think>cut off while thinking", "cut off while thinking", None),
])
def test_qwen3_reasoning_split(qwen3, reply, reasoning, content):
    message = chat(qwen3, reply).choices[0].message
    assert message.content == content
    extra = message.model_extra or {}
    assert extra["reasoning"] == reasoning and extra["reasoning_content"] == reasoning
    streamed_content, streamed_reasoning, _, _ = stream(qwen3, reply)
    assert streamed_content == (content or "") and streamed_reasoning == (reasoning or "")


def test_reasoning_then_tool_calls(qwen3):
    reply = "<think>I need the weather tool.</think>" + HERMES_CALLS
    out = chat(qwen3, reply, tools=TOOLS).choices[0]
    assert (out.message.model_extra or {})["reasoning"] == "I need the weather tool."
    assert out.message.content == "Let me check." and out.finish_reason == "tool_calls"
    content, reasoning, calls, finish = stream(qwen3, reply, tools=TOOLS)
    assert (content, reasoning, finish) == ("Let me check.", "I need the weather tool.",
                                            "tool_calls")
    assert [{"name": c["name"], "arguments": c["arguments"]} for c in calls] == calls_of(
        out.message)
    # A tool call written inside the reasoning is not a call.
    inside = "<think>" + HERMES_CALLS + "</think>Done."
    message = chat(qwen3, inside, tools=TOOLS).choices[0].message
    assert message.content == "Done." and message.tool_calls == []


def test_deepseek_r1_reasoning_and_prompt_opened_thinking():
    server = ScriptedServer("qwen2_5.jinja", reasoning_parser="deepseek_r1").start()
    try:
        for reply, reasoning, content in [("Thinking...</think>The answer is 4.", "Thinking...",
                                           "The answer is 4."),
                                          ("never closed", "never closed", None)]:
            message = chat(server, reply).choices[0].message
            assert (message.model_extra or {})["reasoning"] == reasoning
            assert message.content == content
            assert stream(server, reply)[:2] == (content or "", reasoning)
    finally:
        server.stop()


def test_reasoning_fields_of_earlier_turns_reach_the_template():
    tok = byte_tokenizer("{% for m in messages %}{{ m.role }}:{{ m.reasoning_content }}|"
                         "{{ m.content }};{% endfor %}")
    server = ScriptedServer("qwen2_5.jinja", chat_template=tok.chat_template).start()
    try:
        chat(server, "ok", [{"role": "user", "content": "q"},
                            {"role": "assistant", "content": "a", "reasoning": "r"},
                            {"role": "user", "content": "q2"}])
        assert server.engine.last_prompt.startswith("user:|q;assistant:r|a;user:|q2;")
    finally:
        server.stop()


def test_templates_are_the_real_ones():
    assert "<tool_call>" in template("qwen2_5.jinja")
    assert "Environment: ipython" in template("llama3_1_json.jinja")
