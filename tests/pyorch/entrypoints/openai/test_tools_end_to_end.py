"""Tool calling and reasoning end to end on a real `pyorch-serve` (engine-core process, KV
cache, sampler, detokenizer) with a tiny Llama whose output is forced by its weights.

The model is a "chain": attention and MLP write nothing back (o_proj and down_proj are zero),
so the last hidden state is the current token's embedding, and lm_head maps each chain token
to the next one. Greedy decoding after the generation prompt (which ends with "\\n") therefore
writes SCRIPT token by token, then the EOS. The script's pieces are added tokens of a byte-level
tokenizer whose tokenizer_config.json carries Qwen2.5's real chat template.
"""

from __future__ import annotations

import json

import openai
import pytest
import torch
import transformers
from conftest import start_server
from scripted_engine import SPECIAL_TOKENS, byte_tokenizer, template

SCRIPT = ["<think>", "The user wants the weather.", "</think>", "\n\n", "<tool_call>",
          '\n{"name": "get_weather", ', '"arguments": {"city": "Paris"}}', "\n</tool_call>"]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object",
                                          "properties": {"city": {"type": "string"}}}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
ARGS = ["--max-model-len", "2048", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
        "--reasoning-parser", "qwen3", "--served-model-name", "chain"]


def chain_model(path) -> transformers.PreTrainedTokenizerFast:
    """Saves the chain model and its tokenizer in `path`."""
    tok = byte_tokenizer(template("qwen2_5.jinja"))
    tok.add_tokens(SCRIPT)
    start = tok.encode("\n")
    assert len(start) == 1
    chain = [start[0]] + tok.convert_tokens_to_ids(SCRIPT) + [tok.eos_token_id]
    assert len(set(chain)) == len(chain)  # each token has one successor
    vocab = len(tok)
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=512, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=128,
        max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        emb = torch.nn.functional.normalize(torch.randn(vocab, 512), dim=-1) * 512 ** 0.5
        model.model.embed_tokens.weight.copy_(emb)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        head = torch.zeros(vocab, 512)
        for current, following in zip(chain[:-1], chain[1:], strict=True):
            head[following] += emb[current] * (30.0 / 512)  # logit ~30 for the successor
        model.lm_head.weight.copy_(head)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return tok


@pytest.fixture(scope="module")
def chain_server(tmp_path_factory):
    path = tmp_path_factory.mktemp("chain_model")
    tok = chain_model(path)
    proc = start_server(path, "chain", [str(path), *ARGS]).wait_ready()
    with openai.OpenAI(base_url=proc.url + "/v1", api_key="unused", max_retries=0,
                       timeout=120) as client:
        yield client, tok
    proc.terminate()


def test_the_template_is_in_the_tokenizer_config(chain_server):
    _, tok = chain_server
    assert tok.chat_template == template("qwen2_5.jinja")
    assert all(t in tok.all_special_tokens for t in SPECIAL_TOKENS[:2])


def test_tool_call_with_reasoning_round_trip(chain_server):
    client, tok = chain_server
    out = client.chat.completions.create(model="chain", messages=ASK, tools=[WEATHER],
                                         temperature=0, max_tokens=32)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert (choice.message.model_extra or {})["reasoning"] == "The user wants the weather."
    assert choice.message.content == "\n\n"  # what the model wrote between </think> and the call
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    prompt = tok.apply_chat_template(ASK, tools=[WEATHER], tokenize=False,
                                     add_generation_prompt=True)
    assert out.usage.prompt_tokens == len(tok.encode(prompt, add_special_tokens=False))
    assert out.usage.completion_tokens == len(SCRIPT) + 1  # the script and the EOS

    turn2 = ASK + [choice.message.model_dump(exclude_none=True),
                   {"role": "tool", "tool_call_id": call.id, "content": "22 C"}]
    again = client.chat.completions.create(model="chain", messages=turn2, tools=[WEATHER],
                                           temperature=0, max_tokens=32)
    expected = tok.apply_chat_template(
        ASK + [{"role": "assistant", "content": "\n\n", "tool_calls": [
            {"id": call.id, "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
               {"role": "tool", "tool_call_id": call.id, "content": "22 C"}],
        tools=[WEATHER], tokenize=False, add_generation_prompt=True)
    assert "<tool_response>\n22 C\n</tool_response>" in expected
    assert again.usage.prompt_tokens == len(tok.encode(expected, add_special_tokens=False))


def test_streamed_deltas_reassemble_to_the_message(chain_server):
    client, _ = chain_server
    whole = client.chat.completions.create(model="chain", messages=ASK, tools=[WEATHER],
                                           temperature=0, max_tokens=32).choices[0]
    content, reasoning, arguments, names, finish = "", "", "", [], None
    for chunk in client.chat.completions.create(model="chain", messages=ASK, tools=[WEATHER],
                                                temperature=0, max_tokens=32, stream=True):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        reasoning += (delta.model_extra or {}).get("reasoning") or ""
        for tc in delta.tool_calls or []:
            if tc.function.name:
                names.append(tc.function.name)
            arguments += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert content == whole.message.content
    assert reasoning == (whole.message.model_extra or {})["reasoning"]
    assert names == ["get_weather"]
    assert arguments == whole.message.tool_calls[0].function.arguments
    assert finish == "tool_calls"


def test_tool_choice_none_leaves_the_call_in_the_content(chain_server):
    client, _ = chain_server
    out = client.chat.completions.create(model="chain", messages=ASK, tools=[WEATHER],
                                         tool_choice="none", temperature=0, max_tokens=32)
    message = out.choices[0].message
    assert message.tool_calls == [] and out.choices[0].finish_reason == "stop"
    assert message.content == "".join(SCRIPT[3:])


def test_responses_api_on_the_real_engine(chain_server):
    client, _ = chain_server
    out = client.responses.create(model="chain", input="Weather in Paris?", tools=[
        {"type": "function", "name": "get_weather", "parameters": WEATHER["function"][
            "parameters"]}], temperature=0, max_output_tokens=32)
    assert [item.type for item in out.output] == ["reasoning", "message", "function_call"]
    assert json.loads(out.output[2].arguments) == {"city": "Paris"}


# Enforced by structured output. Under a grammar the chain's own tokens are mostly disallowed
# and the rest have no preference, so greedy decoding is steered to the shortest valid JSON:
# whitespace and the script's tokens are banned, '"' preferred (an empty string wherever a
# string goes), ties go to the lowest id; the schema alone decides the output.
CITY = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
    "additionalProperties": False}}}


def constrained(client, tok, **kw):
    banned = [tok.encode(c)[0] for c in " \n\t\r"] + tok.convert_tokens_to_ids(SCRIPT)
    bias = {str(t): -100 for t in banned}
    bias[str(tok.encode('"')[0])] = 5
    return client.chat.completions.create(model="chain", messages=ASK, tools=[CITY],
                                          temperature=0, max_tokens=64, logit_bias=bias, **kw)


def test_tool_choice_required_on_the_real_engine(chain_server):
    client, tok = chain_server
    out = constrained(client, tok, tool_choice="required", parallel_tool_calls=False)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": ""}


def test_named_tool_choice_on_the_real_engine(chain_server):
    client, tok = chain_server
    out = constrained(client, tok, tool_choice={"type": "function",
                                                "function": {"name": "get_weather"}})
    assert out.choices[0].finish_reason == "stop"
    (call,) = out.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": ""}
