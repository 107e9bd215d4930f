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


# ---- the store (PYORCH_ENABLE_RESPONSES_API_STORE) ---------------------------------------------
@pytest.fixture(scope="module")
def store_server():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYORCH_ENABLE_RESPONSES_API_STORE", "1")
        s = ScriptedServer("qwen2_5.jinja", enable_auto_tools=True, tool_call_parser="hermes",
                           reasoning_parser="qwen3").start()
    yield s
    s.stop()


def test_store_retrieve_and_previous_response_id(store_server):
    first = create(store_server, "<think>Easy.</think>Paris.", input="Capital of France?",
                   instructions="Be brief.")
    assert first.store is True
    with openai_client(store_server) as client:
        got = client.responses.retrieve(first.id)
    assert got.model_dump() == first.model_dump()
    # The next turn continues the stored conversation: the earlier input, the earlier output
    # (its reasoning with the assistant turn, as the template takes it), then the new input.
    second = create(store_server, "Berlin.", input="And Germany?",
                    previous_response_id=first.id)
    assert second.previous_response_id == first.id and second.output_text == "Berlin."
    assert store_server.engine.last_prompt == store_server.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Capital of France?"},
         {"role": "assistant", "content": "Paris.", "reasoning": "Easy."},
         {"role": "user", "content": "And Germany?"}],
        tokenize=False, add_generation_prompt=True)
    # A chain: the third turn sees both earlier turns (instructions are not carried over).
    create(store_server, "Rome.", input="And Italy?", previous_response_id=second.id)
    prompt = store_server.engine.last_prompt
    assert prompt.index("France") < prompt.index("Berlin.") < prompt.index("Italy")
    assert "Be brief." not in prompt


def test_store_streamed_and_tool_call_turns(store_server):
    evs = events(store_server, "Checking." + CALL, input="Weather in Paris?", tools=[TOOL])
    final = evs[-1].response
    assert final.store is True
    with openai_client(store_server) as client:
        assert client.responses.retrieve(final.id).model_dump() == final.model_dump()
    call = final.output[1]
    answer = create(store_server, "It is 22 C.", tools=[TOOL], previous_response_id=final.id,
                    input=[{"type": "function_call_output", "call_id": call.call_id,
                            "output": "22 C"}])
    assert answer.output_text == "It is 22 C."
    prompt = store_server.engine.last_prompt
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt
    assert "<tool_response>\n22 C\n</tool_response>" in prompt


def test_store_false_unknown_ids_and_cancel(store_server):
    out = create(store_server, "ok", input="hi", store=False)
    assert out.store is False
    with openai_client(store_server) as client:
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(out.id)
        with pytest.raises(openai.NotFoundError) as info:
            client.responses.create(model="scripted", input="hi", previous_response_id=out.id)
        assert info.value.body["param"] == "previous_response_id"  # type: ignore[index]
        stored = client.responses.create(model="scripted", input="hi")
        with pytest.raises(openai.BadRequestError) as bad:
            client.responses.cancel(stored.id)
        assert "Cannot cancel a synchronous response" in bad.value.body["message"]  # type: ignore[index]
        with pytest.raises(openai.NotFoundError):
            client.responses.cancel("resp_nope")


def test_store_off_refuses_retrieve_and_cancel(server):
    with openai_client(server) as client:
        for call in (client.responses.retrieve, client.responses.cancel):
            with pytest.raises(openai.BadRequestError) as info:
                call("resp_123")
            assert "PYORCH_ENABLE_RESPONSES_API_STORE" in info.value.body["message"]  # type: ignore[index]
    assert create(server, "ok", input="hi").store is False


def test_store_keeps_the_newest():
    from pyorch.entrypoints.openai.responses_store import ResponsesStore

    store = ResponsesStore(enabled=True, max_size=2)
    for i in range(3):
        store.put({"id": f"r{i}", "output": [], "status": "completed"}, [])
    store.get("r1")  # r1 is used again: r2 is now the older one
    store.put({"id": "r3", "output": [], "status": "completed"}, [])
    assert store.get("r1")["id"] == "r1"
    for gone in ("r0", "r2"):
        with pytest.raises(Exception, match="not found"):
            store.get(gone)


def test_parallel_tool_calls_and_strict_tools(server):
    two = CALL + "\n" + CALL.replace("Paris", "Oslo")
    out = create(server, two, input="Weather in Paris and Oslo?", tools=[TOOL])
    assert [json.loads(i.arguments)["city"] for i in out.output] == ["Paris", "Oslo"]
    assert out.parallel_tool_calls is True
    out = create(server, two, input="Weather in Paris and Oslo?", tools=[TOOL],
                 parallel_tool_calls=False)
    assert [json.loads(i.arguments)["city"] for i in out.output] == ["Paris"]
    assert out.parallel_tool_calls is False
    # A strict tool's arguments must follow its schema: only under a forced choice (the
    # structured-output backend enforces it); with "auto" a 400 names the field.
    strict = dict(TOOL, strict=True)
    out = create(server, '{"city": "Oslo"}', input="Weather?", tools=[strict],
                 tool_choice={"type": "function", "name": "get_weather"})
    assert json.loads(out.output[0].arguments) == {"city": "Oslo"}
    with openai_client(server) as client:
        with pytest.raises(openai.BadRequestError) as info:
            client.responses.create(model="scripted", input="hi", tools=[strict])
    assert info.value.body["param"] == "tools.0.function.strict"  # type: ignore[index]
