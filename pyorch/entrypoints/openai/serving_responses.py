"""POST /v1/responses: OpenAI's Responses API over the chat path (text in, text out, function
tools), without stored responses.

The input (a string, or input items: messages, `function_call` and `function_call_output`
items, `reasoning` items) becomes a chat conversation (`instructions` first, as a system
message), rendered by the chat template with the tools; the output is parsed by the same
ChatOutputParser as chat (reasoning, tool calls) into output items: `reasoning`, `message`
(`output_text`), `function_call`. Streaming sends the Responses event stream
(`response.created`, `response.in_progress`, `response.output_item.added`,
`response.output_text.delta`, ..., `response.completed`), each event with a `sequence_number`.

`store`, `previous_response_id` and `GET /v1/responses/{id}` work behind vLLM's opt-in store
(`PYORCH_ENABLE_RESPONSES_API_STORE=1`; responses_store.py) and are refused by name without it.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, AsyncIterator, Literal, Optional, Union

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import Field

from pyorch.entrypoints.openai.chat_output import ChatOutputParser, tool_request
from pyorch.entrypoints.openai.errors import OpenAIError
from pyorch.entrypoints.openai.protocol import (
    MAX_MESSAGES,
    MAX_TOOLS,
    ChatMessage,
    ChatTool,
    FunctionDefinition,
    NamedFunction,
    NamedToolChoice,
    OpenAIBaseModel,
    SamplingExtras,
)
from pyorch.entrypoints.openai.request_fields import RequestFields
from pyorch.entrypoints.openai.responses_store import ResponsesStore
from pyorch.entrypoints.openai.serving_chat import constrain_tools, render_chat
from pyorch.entrypoints.openai.serving_engine import (
    OpenAIServing,
    ServerContext,
    close_quietly,
    collect_finals,
    first_output,
    sse_error,
    stream_with_errors,
)


class ResponsesTool(OpenAIBaseModel):
    """A function tool in the Responses shape (name etc. at the top level)."""

    type: Literal["function"]
    name: str = Field(min_length=1, max_length=256)
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


class ResponsesRequest(SamplingExtras):
    model: Optional[str] = None
    input: Union[str, Annotated[list[dict[str, Any]], Field(max_length=MAX_MESSAGES)]]
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = Field(None, ge=1)
    tools: Optional[list[ResponsesTool]] = Field(None, max_length=MAX_TOOLS)
    tool_choice: Optional[Union[Literal["none", "auto", "required"], dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = True
    store: Optional[bool] = None
    previous_response_id: Optional[str] = None
    metadata: Optional[dict[str, str]] = None
    text: Optional[dict[str, Any]] = None
    background: Optional[bool] = None


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# Responses fields that would change the output and that this server does not implement:
# refused with 400 unless neutral (other unknown fields are ignored with a log line).
_UNSUPPORTED_RESPONSES: dict[str, Any] = {
    "include": lambda v: not v,
    "top_logprobs": lambda v: not v,
    "truncation": lambda v: v in (None, "disabled"),
    "reasoning": lambda v: v is None,
    "prompt": lambda v: v is None,
    "max_tool_calls": lambda v: v is None,
    "conversation": lambda v: v is None,
}


def _check_request(req: ResponsesRequest) -> None:
    OpenAIServing.check_fields(req)
    for name, neutral in _UNSUPPORTED_RESPONSES.items():
        if not neutral((req.model_extra or {}).get(name)):
            raise OpenAIError(f"`{name}` is not supported by this server", param=name)
    if req.stream_options is not None:
        raise OpenAIError("stream_options is not supported on /v1/responses",
                          param="stream_options")
    if req.background:
        raise OpenAIError("background responses are not supported", param="background")
    fmt = (req.text or {}).get("format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise OpenAIError("only text output (text.format.type \"text\") is supported",
                          param="text.format")
    if req.n != 1:
        raise OpenAIError("a response has one output; n must be 1", param="n")


def _request_fields(req: ResponsesRequest, ctx: ServerContext) -> RequestFields:
    """The shared request extras a response can honour (truncate_prompt_tokens, priority); the
    ones that need several outputs or token lists, which a response has no place for, are
    refused by name."""
    for name, given in (("best_of", (req.best_of or 1) > 1),
                        ("use_beam_search", req.use_beam_search),
                        ("prompt_logprobs", req.prompt_logprobs is not None),
                        ("return_token_ids", bool(req.return_token_ids)),
                        ("return_tokens_as_token_ids", bool(req.return_tokens_as_token_ids))):
        if given:
            raise OpenAIError(f"`{name}` is not supported on /v1/responses (a response has one "
                              "output and no token or logprob lists)", param=name)
    return RequestFields.of(req, ctx)


def _text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise OpenAIError("content must be a string or a list of text parts", param=where)
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text") \
                or not isinstance(part.get("text"), str):
            raise OpenAIError("only input_text / output_text content parts are supported",
                              param=f"{where}.{j}")
        texts.append(part["text"])
    return "\n".join(texts)


def input_items(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's input as a list of input items (a string is one user message)."""
    if isinstance(req.input, str):
        return [{"role": "user", "content": req.input}]
    return list(req.input)


def input_messages(instructions: Optional[str], items: list[dict[str, Any]],
                   num_earlier: int = 0) -> list[ChatMessage]:
    """Instructions and input items as a chat conversation. The first `num_earlier` items come
    from a stored response (previous_response_id); errors name the request's own items."""
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    reasoning: Optional[str] = None
    for i, item in enumerate(items):
        where = f"input.{i - num_earlier}"
        if not isinstance(item, dict):
            raise OpenAIError("input items must be objects", param=where)
        kind = item.get("type", "message")
        if kind == "message":
            message = {"role": item.get("role"),
                       "content": _text_of(item.get("content"), f"{where}.content")}
            if message["role"] == "assistant" and reasoning is not None:
                message["reasoning"], reasoning = reasoning, None
            messages.append(message)
        elif kind == "reasoning":  # an earlier output's reasoning: goes with the next turn
            texts: list[str] = []
            for key in ("content", "summary"):
                parts = item.get(key)
                for part in parts if isinstance(parts, list) else []:
                    text = part.get("text") if isinstance(part, dict) else None
                    if not isinstance(text, str):
                        raise OpenAIError("reasoning item parts need a text", param=where)
                    texts.append(text)
            reasoning = "".join(texts)
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
                if reasoning is not None:
                    messages[-1]["reasoning"], reasoning = reasoning, None
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": output if isinstance(output, str)
                             else json.dumps(output)})
        else:
            raise OpenAIError(f"input items of type {kind!r} are not supported", param=where)
    try:
        return [ChatMessage(**m) for m in messages]
    except ValueError as e:
        raise OpenAIError(f"bad input item: {e}", param="input") from None


def _chat_tools(req: ResponsesRequest) -> tuple[Optional[list[ChatTool]], Any]:
    tools = None if req.tools is None else [ChatTool(type="function", function=FunctionDefinition(
        name=t.name, description=t.description, parameters=t.parameters, strict=t.strict))
        for t in req.tools]
    choice: Any = req.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise OpenAIError('tool_choice must be "none", "auto", "required" or '
                              '{"type": "function", "name": ...}', param="tool_choice")
        choice = NamedToolChoice(type="function", function=NamedFunction(name=choice["name"]))
    return tools, choice


def output_items(parsed: Any) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    if parsed.reasoning:
        items.append(_reasoning_item(_id("rs"), parsed.reasoning))
    if parsed.content:
        items.append(_message_item(_id("msg"), parsed.content, "completed"))
    for call in parsed.tool_calls:
        items.append(_call_item(_id("fc"), call["id"], call["function"]["name"],
                                call["function"]["arguments"], "completed"))
    return items


def _reasoning_item(item_id: str, text: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "summary": [], "status": "completed",
            "content": [{"type": "reasoning_text", "text": text}]}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message_item(item_id: str, text: Optional[str], status: str) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "role": "assistant", "status": status,
            "content": [] if text is None else [_text_part(text)]}


def _call_item(item_id: str, call_id: str, name: str, arguments: str,
               status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


class OpenAIServingResponses(OpenAIServing):
    def __init__(self, ctx: ServerContext) -> None:
        super().__init__(ctx)
        self.store = ResponsesStore()

    async def create_response(self, req: ResponsesRequest, raw: Request) -> Any:
        self.check_model(req.model)
        self.check_engine()
        _check_request(req)
        ctx = self.ctx
        fields = _request_fields(req, ctx)
        tools, choice = _chat_tools(req)
        tool_req = tool_request(tools, choice, req.parallel_tool_calls, ctx.enable_auto_tools,
                                ctx.tool_call_parser)
        store = self.store.wants_store(req.store)
        earlier = self.store.history(req.previous_response_id)
        conversation = earlier + input_items(req)
        messages = input_messages(req.instructions, conversation, len(earlier))
        if not messages:
            raise OpenAIError("input is empty", param="input")
        text = await self.render(render_chat, self, messages, True, False, None,
                                 tool_req.template_tools(ctx.exclude_tools_when_tool_choice_none))
        token_ids = fields.truncated(await self.encode(
            text, False, "input", truncating=fields.truncate is not None))
        self.check_prompt_ids(token_ids)
        max_tokens = self.resolve_max_tokens(req.max_output_tokens, len(token_ids))
        params = self.sampling_params(req, max_tokens, None)
        parser = ChatOutputParser(tool_req, ctx.tool_call_parser, ctx.reasoning_parser, text,
                                  ctx.tokenizer)
        await constrain_tools(self, req, params, tool_req, parser)
        response_id = _id("resp")
        self.log_request(response_id, text, len(token_ids), params)
        merged = self.generate_many([{"prompt_token_ids": token_ids, "prompt": text}], params,
                                    response_id, req.priority)
        base = self._base(req, response_id, tools is not None, store)
        keep = conversation if store else None
        if req.stream:
            first = await first_output(merged)
            return StreamingResponse(self._stream(base, len(token_ids), first, merged, parser,
                                                  keep),
                                     media_type="text/event-stream")
        final = (await self.run_until_disconnect(raw, collect_finals(merged, 1)))[0]
        out = final.outputs[0]
        body = {**base, "output": output_items(parser.parse(out.text))}
        self._finish(body, out.finish_reason, len(token_ids), len(out.token_ids),
                     final.num_cached_tokens, keep)
        return JSONResponse(body)

    def retrieve(self, response_id: str) -> dict[str, Any]:
        return self.store.get(response_id)

    def cancel(self, response_id: str) -> None:
        self.store.cancel(response_id)

    def _base(self, req: ResponsesRequest, response_id: str, has_tools: bool,
              store: bool) -> dict[str, Any]:
        return {"id": response_id, "object": "response", "created_at": int(time.time()),
                "model": self.ctx.model_name, "status": "in_progress", "error": None,
                "incomplete_details": None, "instructions": req.instructions,
                "max_output_tokens": req.max_output_tokens, "metadata": req.metadata or {},
                "output": [], "parallel_tool_calls": req.parallel_tool_calls is not False,
                "previous_response_id": req.previous_response_id, "reasoning": None,
                "store": store,
                "temperature": req.temperature, "top_p": req.top_p,
                "text": {"format": {"type": "text"}}, "truncation": "disabled",
                "tool_choice": (req.tool_choice or ("auto" if has_tools else "none")),
                "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
                "usage": None, "user": req.user}

    def _finish(self, body: dict[str, Any], finish_reason: Optional[str], num_prompt: int,
                num_output: int, num_cached: Optional[int],
                keep: Optional[list[dict[str, Any]]]) -> None:
        """Sets the final status and usage; stores the response with its conversation when
        `keep` is one."""
        if finish_reason == "length":
            body["status"] = "incomplete"
            body["incomplete_details"] = {"reason": "max_output_tokens"}
        else:
            body["status"] = "completed"
        body["usage"] = {"input_tokens": num_prompt,
                         "input_tokens_details": {"cached_tokens": num_cached or 0},
                         "output_tokens": num_output,
                         "output_tokens_details": {"reasoning_tokens": 0},
                         "total_tokens": num_prompt + num_output}
        if keep is not None:
            self.store.put(body, keep)

    async def _stream(self, base: dict[str, Any], num_prompt: int, first: Any, merged: Any,
                      parser: ChatOutputParser,
                      keep: Optional[list[dict[str, Any]]]) -> AsyncIterator[str]:
        events = _EventStream(base)
        yield events.send("response.created", response=dict(base))
        yield events.send("response.in_progress", response=dict(base))
        text, num_output, finish, num_cached = "", 0, None, None
        try:
            async for _, output in stream_with_errors(first, merged):
                num_cached = output.num_cached_tokens
                c = output.outputs[0]
                text += c.text
                num_output += len(c.token_ids)
                finish = c.finish_reason
                for event in events.delta(parser.feed(text, finish is not None)):
                    yield event
            for event in events.close_item():
                yield event
            body = {**base, "output": events.items}
            self._finish(body, finish, num_prompt, num_output, num_cached, keep)
            yield events.send("response.completed", response=body)
        except Exception as e:
            yield sse_error(e)
        finally:
            await close_quietly(merged)


class _EventStream:
    """The Responses event stream of one output: items open in turn (reasoning, message,
    function calls); each gets added / delta / done events."""

    def __init__(self, base: dict[str, Any]) -> None:
        self.base = base
        self.sequence_number = 0
        self.items: list[dict[str, Any]] = []
        self.open: Optional[dict[str, Any]] = None
        self.calls: dict[int, dict[str, Any]] = {}  # tool-call index -> item

    def send(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        data = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
        return f"event: {kind}\ndata: {data}\n\n"

    def _where(self) -> dict[str, Any]:
        assert self.open is not None
        return {"item_id": self.open["id"], "output_index": len(self.items) - 1}

    def _start(self, item: dict[str, Any]) -> list[str]:
        events = self.close_item()
        self.items.append(item)
        self.open = item
        events.append(self.send("response.output_item.added", output_index=len(self.items) - 1,
                                item=dict(item, content=[]) if "content" in item else dict(item)))
        if item["type"] == "message":
            events.append(self.send("response.content_part.added", **self._where(),
                                    content_index=0, part=_text_part("")))
        return events

    def close_item(self) -> list[str]:
        item, events = self.open, list[str]()
        if item is None:
            return events
        where = self._where()
        item["status"] = "completed"
        if item["type"] == "reasoning":
            events.append(self.send("response.reasoning_text.done", **where, content_index=0,
                                    text=item["content"][0]["text"]))
        elif item["type"] == "message":
            part = item["content"][0]
            events.append(self.send("response.output_text.done", **where, content_index=0,
                                    text=part["text"], logprobs=[]))
            events.append(self.send("response.content_part.done", **where, content_index=0,
                                    part=part))
        else:
            events.append(self.send("response.function_call_arguments.done", **where,
                                    name=item["name"], arguments=item["arguments"]))
        events.append(self.send("response.output_item.done", output_index=where["output_index"],
                                item=item))
        self.open = None
        return events

    def delta(self, delta: dict[str, Any]) -> list[str]:
        events: list[str] = []
        if delta.get("reasoning"):
            if self.open is None or self.open["type"] != "reasoning":
                events += self._start(_reasoning_item(_id("rs"), ""))
                self.open["status"] = "in_progress"  # type: ignore[index]
            self.open["content"][0]["text"] += delta["reasoning"]  # type: ignore[index]
            events.append(self.send("response.reasoning_text.delta", **self._where(),
                                    content_index=0, delta=delta["reasoning"]))
        if delta.get("content"):
            if self.open is None or self.open["type"] != "message":
                events += self._start(_message_item(_id("msg"), "", "in_progress"))
            self.open["content"][0]["text"] += delta["content"]  # type: ignore[index]
            events.append(self.send("response.output_text.delta", **self._where(),
                                    content_index=0, delta=delta["content"], logprobs=[]))
        for call in delta.get("tool_calls") or []:
            fn = call["function"]
            if "id" in call:
                self.calls[call["index"]] = item = _call_item(_id("fc"), call["id"], fn["name"],
                                                              "", "in_progress")
                events += self._start(item)
            if fn.get("arguments"):
                self.calls[call["index"]]["arguments"] += fn["arguments"]
                events.append(self.send("response.function_call_arguments.delta",
                                        **self._where(), delta=fn["arguments"]))
        return events
