"""POST /v1/responses through the official client's `client.responses.create`, on the real app
with scripted model output (scripted_engine.py) and Qwen2.5's real template."""

from __future__ import annotations

import json

import openai
import pytest
from scripted_engine import ScriptedServer, openai_client

TOOL = {"type": "function", "name": "get_weather", "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def server():
    s = ScriptedServer("qwen2_5.jinja", enable_auto_tools=True, tool_call_parser="hermes",
                       reasoning_parser="qwen3").start()
    yield s
    s.stop()


def create(server, reply, **kw):
    with openai_client(server, reply) as client:
        return client.responses.create(model="scripted", **kw)


def events(server, reply, **kw):
    with openai_client(server, reply) as client:
        return list(client.responses.create(model="scripted", stream=True, **kw))


def test_text_in_text_out(server):
    out = create(server, "Bonjour!", input="Say hello in French.", instructions="Be brief.",
                 max_output_tokens=50)
    assert out.object == "response" and out.id.startswith("resp_")
    assert out.status == "completed" and out.output_text == "Bonjour!"
    (message,) = out.output
    assert message.type == "message" and message.role == "assistant"
    assert out.usage.input_tokens == len(server.engine.calls[-1][0]["prompt_token_ids"])
    assert out.usage.total_tokens == out.usage.input_tokens + out.usage.output_tokens
    assert server.engine.last_prompt == server.tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."},
         {"role": "user", "content": "Say hello in French."}],
        tokenize=False, add_generation_prompt=True)
    assert server.engine.last_params.max_tokens == 50


def test_long_string_input(server):
    long = "word " * 2000  # a string input is bounded by the prompt rules, not MAX_MESSAGES
    assert create(server, "ok", input=long).output_text == "ok"
    assert long.strip() in server.engine.last_prompt


def test_length_is_incomplete(server):
    server.engine.finish_reason = "length"
    try:
        out = create(server, "Bonj", input="hi")
    finally:
        server.engine.finish_reason = "stop"
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"


def test_stream_events(server):
    evs = events(server, "<think>French.</think>Bonjour tout le monde!", input="hello")
    kinds = [e.type for e in evs]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert [e.sequence_number for e in evs] == list(range(len(evs)))
    text = "".join(e.delta for e in evs if e.type == "response.output_text.delta")
    reasoning = "".join(e.delta for e in evs if e.type == "response.reasoning_text.delta")
    assert (text, reasoning) == ("Bonjour tout le monde!", "French.")
    final = evs[-1].response
    assert final.output_text == text and final.status == "completed"
    assert [i.type for i in final.output] == ["reasoning", "message"]
    assert kinds.count("response.output_item.added") == 2 == kinds.count(
        "response.output_item.done")
    done = [e for e in evs if e.type == "response.output_text.done"]
    assert done[0].text == text
    # The same output, not streamed.
    whole = create(server, "<think>French.</think>Bonjour tout le monde!", input="hello")
    assert whole.output_text == text
    assert whole.output[0].content[0].text == "French."


def test_function_tools_round_trip(server):
    out = create(server, "Checking." + CALL, input="Weather in Paris?", tools=[TOOL])
    message, call = out.output
    assert message.type == "message" and out.output_text == "Checking."
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris"} and call.call_id
    assert '"name": "get_weather"' in server.engine.last_prompt
    # Second turn: the call and its output go back as input items.
    follow = [{"role": "user", "content": "Weather in Paris?"}, call.model_dump(),
              {"type": "function_call_output", "call_id": call.call_id, "output": "22 C"}]
    answer = create(server, "It is 22 C.", input=follow, tools=[TOOL])
    assert answer.output_text == "It is 22 C."
    assert "<tool_response>\n22 C\n</tool_response>" in server.engine.last_prompt
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in server.engine.last_prompt
    # Streamed: the arguments deltas add up to the same call.
    evs = events(server, "Checking." + CALL, input="Weather in Paris?", tools=[TOOL])
    arguments = "".join(e.delta for e in evs
                        if e.type == "response.function_call_arguments.delta")
    assert arguments == call.arguments
    (args_done,) = [e for e in evs if e.type == "response.function_call_arguments.done"]
    assert args_done.arguments == call.arguments
    assert [i.type for i in evs[-1].response.output] == ["message", "function_call"]


def test_named_tool_choice(server):
    out = create(server, '{"city": "Oslo"}', input="Weather?", tools=[TOOL],
                 tool_choice={"type": "function", "name": "get_weather"})
    assert server.engine.last_params.structured_outputs.json == TOOL["parameters"]
    (call,) = out.output
    assert (call.name, call.arguments) == ("get_weather", '{"city": "Oslo"}')


@pytest.mark.parametrize("kw, fragment", [
    ({"previous_response_id": "resp_123"}, "previous_response_id"),
    ({"store": True}, "store"),
    ({"input": [{"type": "image_generation_call", "id": "x"}]}, "image_generation_call"),
    ({"tool_choice": "required"}, "`tools` must be set"),
    ({"include": ["message.output_text.logprobs"]}, "`include`"),
    ({"reasoning": {"effort": "high"}}, "`reasoning`"),
    ({"truncation": "auto"}, "`truncation`"),
    ({"text": {"format": {"type": "json_object"}}}, "text.format"),
    ({"background": True}, "background"),
    ({"text": {"format": "json"}}, "text.format"),
    ({"input": [{"type": "reasoning", "content": "not a list", "summary": [{"text": 5}]}]},
     "reasoning item"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "bad input item"),
    ({"input": [{"role": "user", "content": None}]}, "content must be"),
])
def test_refused_fields(server, kw, fragment):
    with openai_client(server) as client:
        with pytest.raises(openai.BadRequestError) as info:
            client.responses.create(model="scripted", **{"input": "hi", **kw})
    assert fragment in info.value.body["message"]  # type: ignore[index]
