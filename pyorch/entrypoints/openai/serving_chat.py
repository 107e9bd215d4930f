"""POST /v1/chat/completions: the model's chat template (or --chat-template), then generation.

Streaming follows OpenAI: each choice's first chunk carries `delta.role`, later chunks the text,
the choice's last chunk its `finish_reason`; then (with stream_options.include_usage) a chunk with
`usage` and no choices; then `data: [DONE]`.
"""

from __future__ import annotations

import time
from typing import Any, AsyncIterator, Optional

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from pyorch.entrypoints.openai.chat_output import (
    ChatOutputParser,
    ToolRequest,
    template_messages_tool_calls,
    tool_request,
)
from pyorch.entrypoints.openai.errors import OpenAIError
from pyorch.entrypoints.openai.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    ChatResponseMessage,
    ChatTokenLogprob,
    SamplingExtras,
    TopLogprob,
    UsageInfo,
    random_id,
)
from pyorch.entrypoints.openai.request_fields import (
    RequestFields,
    beam_search_outputs,
    best_of,
    prompt_logprobs_json,
    token_label,
    usage,
)
from pyorch.entrypoints.openai.serving_engine import (
    SSE_DONE,
    OpenAIServing,
    TextChunks,
    clamp_logprob,
    close_quietly,
    collect_finals,
    first_output,
    ranked,
    sse,
    sse_error,
    stream_with_errors,
    token_text,
)
from pyorch.outputs import Logprob
from pyorch.sampling_params import SamplingParams

# Keyword arguments of apply_chat_template that chat_template_kwargs may not override.
_RESERVED_TEMPLATE_KWARGS = {"conversation", "chat_template", "tokenize", "add_generation_prompt",
                             "continue_final_message", "return_dict", "tools", "documents"}


def _message_dict(message: ChatMessage, index: int = 0,
                  content_format: str = "string") -> dict[str, Any]:
    """The message as the chat template sees it: content a string (text parts joined by
    newlines), or with content_format "openai" a list of {"type": "text", "text"} parts."""
    content = message.content
    where = f"messages.{index}"
    texts = []
    if isinstance(content, list):
        for j, part in enumerate(content):
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise OpenAIError("only text content parts ({\"type\": \"text\", \"text\": ...}) "
                                  "are supported", param=f"{where}.content.{j}")
            OpenAIServing.check_text(part["text"], f"{where}.content.{j}.text")
            texts.append(part["text"])
    elif content is not None:
        OpenAIServing.check_text(content, f"{where}.content")
        texts.append(content)
    rendered: Any = "\n".join(texts)
    if content_format == "openai":
        rendered = [{"type": "text", "text": t} for t in texts]
    out: dict[str, Any] = {"role": message.role, "content": rendered}
    if message.name is not None:
        OpenAIServing.check_text(message.name, f"{where}.name")
        out["name"] = message.name
    if message.tool_calls is not None:
        out["tool_calls"] = template_messages_tool_calls(message.tool_calls, where)
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    reasoning = message.reasoning if message.reasoning is not None else message.reasoning_content
    if reasoning is not None:  # vLLM passes both names to the template
        out["reasoning"] = out["reasoning_content"] = reasoning
    return out


def render_chat(serving: OpenAIServing, messages: list[ChatMessage], add_generation_prompt: bool,
                continue_final_message: bool,
                chat_template_kwargs: Optional[dict[str, Any]] = None,
                tools: Optional[list[dict[str, Any]]] = None) -> str:
    """The conversation as prompt text, through the chat template; 400 if it cannot be.
    CPU-heavy on long conversations: the handlers run it on the renderer pool."""
    tokenizer = serving.tokenizer()
    if add_generation_prompt and continue_final_message:
        raise OpenAIError("continue_final_message cannot be combined with add_generation_prompt; "
                          "set add_generation_prompt to false", param="continue_final_message")
    conversation = [_message_dict(m, i, serving.ctx.content_format)
                    for i, m in enumerate(messages)]
    if continue_final_message and conversation[-1]["role"] != "assistant":
        raise OpenAIError("continue_final_message needs the last message to be the assistant's",
                          param="continue_final_message")
    template = serving.ctx.chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise OpenAIError("this model has no chat template; start the server with "
                          "--chat-template", param="messages")
    extra = {k: v for k, v in (chat_template_kwargs or {}).items()
             if k not in _RESERVED_TEMPLATE_KWARGS}
    try:
        text = tokenizer.apply_chat_template(
            conversation, chat_template=template, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, tokenize=False, tools=tools,
            **extra)
    except Exception as e:  # a template that raises (jinja errors, raise_exception(...))
        raise OpenAIError(f"the chat template failed on these messages: {e}",
                          param="messages") from None
    if not isinstance(text, str):
        raise OpenAIError("the chat template did not produce text", param="messages")
    return text


async def constrain_tools(serving: OpenAIServing, req: SamplingExtras, params: SamplingParams,
                          tool_req: ToolRequest, parser: ChatOutputParser) -> None:
    """required / named tool_choice through structured output (checked like any constraint:
    a tools' schema that does not compile is a 400 naming `tools`); special tokens kept where
    the tool-call parser needs them."""
    constraint = tool_req.structured_outputs()
    if constraint is not None:
        if params.structured_outputs is not None:
            raise OpenAIError("tool_choice \"required\" or a named function cannot be "
                              "combined with another output constraint", param="tool_choice")
        params.structured_outputs = constraint
    params.skip_special_tokens = parser.skip_special_tokens(params.skip_special_tokens)
    try:
        await serving.check_structured_outputs(req, params)
    except OpenAIError as e:
        if constraint is None:
            raise
        raise OpenAIError(f"the tools' parameters cannot be enforced: {e.message}",
                          param="tools") from None


class OpenAIServingChat(OpenAIServing):
    async def create_chat_completion(self, req: ChatCompletionRequest, raw: Request) -> Any:
        self.check_model(req.model)
        self.check_engine()
        self.check_fields(req)
        include_usage = self.check_stream_options(req)
        if req.top_logprobs and not req.logprobs:
            raise OpenAIError("top_logprobs needs logprobs=true", param="top_logprobs")
        ctx = self.ctx
        fields = RequestFields.of(req, ctx)
        tool_req = tool_request(req.tools, req.tool_choice, req.parallel_tool_calls,
                                ctx.enable_auto_tools, ctx.tool_call_parser)
        text = await self.render(render_chat, self, req.messages, req.add_generation_prompt,
                                 req.continue_final_message, req.chat_template_kwargs,
                                 tool_req.template_tools(ctx.exclude_tools_when_tool_choice_none))
        token_ids = fields.truncated(await self.encode(
            text, False, "messages", truncating=fields.truncate is not None))
        self.check_prompt_ids(token_ids)
        requested = req.max_completion_tokens or req.max_tokens
        max_tokens = self.resolve_max_tokens(requested, len(token_ids))
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = self.sampling_params(req, max_tokens, fields.engine_logprobs(logprobs),
                                      fields.prompt_logprobs, fields.best_of)
        # one parser per sequence the engine makes (best_of of them when best_of > n)
        parsers = [ChatOutputParser(tool_req, ctx.tool_call_parser, ctx.reasoning_parser, text,
                                    ctx.tokenizer) for _ in range(max(req.n, fields.best_of))]
        await constrain_tools(self, req, params, tool_req, parsers[0])
        request_id = random_id("chatcmpl")
        self.log_request(request_id, text, len(token_ids), params)
        if fields.beam is not None:
            merged = beam_search_outputs(self, [token_ids], fields.beam, max_tokens, request_id,
                                         req.priority, req.skip_special_tokens)
        else:
            merged = self.generate_many([{"prompt_token_ids": token_ids, "prompt": text}],
                                        params, request_id, req.priority)
        echo = self._echo_text(req)
        if req.stream:
            first = await first_output(merged)
            return StreamingResponse(
                self._stream(req, fields, token_ids, first, merged, request_id, include_usage,
                             echo, parsers),
                media_type="text/event-stream")
        final = (await self.run_until_disconnect(raw, collect_finals(merged, 1)))[0]
        if fields.best_of > req.n:
            final = best_of(final, req.n)
        choices, num_generated = [], 0
        for c in final.outputs:
            parser = parsers[c.index]
            if parser.active:
                parsed = parser.parse(c.text)
                message = ChatResponseMessage(
                    role=self._role(req),
                    content=parsed.content if not echo else echo + (parsed.content or ""),
                    tool_calls=parsed.tool_calls, reasoning=parsed.reasoning,
                    reasoning_content=parsed.reasoning)
                finish = parser.finish_reason(c.finish_reason, bool(parsed.tool_calls))
            else:
                message = ChatResponseMessage(role=self._role(req), content=echo + c.text)
                finish = c.finish_reason
            choices.append(ChatChoice(
                index=c.index, message=message,
                logprobs=self._logprobs(c.token_ids, c.logprobs, logprobs, fields.as_token_ids),
                finish_reason=finish, stop_reason=c.stop_reason,
                token_ids=list(c.token_ids) if fields.return_token_ids else None))
            num_generated += len(c.token_ids)
        response = ChatCompletionResponse(
            id=request_id, model=self.ctx.model_name, choices=choices,
            usage=usage(self.ctx, len(token_ids), num_generated, final.num_cached_tokens),
            prompt_token_ids=token_ids if fields.return_token_ids else None)
        if fields.prompt_logprobs is not None:
            response.prompt_logprobs = prompt_logprobs_json(
                self.ctx.tokenizer, token_ids, final.prompt_logprobs, fields.prompt_logprobs,
                fields.as_token_ids)
        return JSONResponse(response.model_dump())

    def _role(self, req: ChatCompletionRequest) -> str:
        """vLLM's rule: --response-role after a generation prompt, else the last message's."""
        return self.ctx.response_role if req.add_generation_prompt else req.messages[-1].role

    @staticmethod
    def _echo_text(req: ChatCompletionRequest) -> str:
        """vLLM's chat echo: the last message's content, when it is the assistant's."""
        if not req.echo or req.messages[-1].role != "assistant":
            return ""
        return str(_message_dict(req.messages[-1], len(req.messages) - 1)["content"])

    def _logprobs(self, token_ids: list[int], steps: Optional[list[dict[int, Logprob]]],
                  num: Optional[int], as_ids: bool = False) -> Optional[ChatLogprobs]:
        if num is None:
            return None
        tok = self.ctx.tokenizer
        content = []
        for i, token_id in enumerate(token_ids):
            step = steps[i] if steps is not None and i < len(steps) else {}
            chosen = step.get(token_id)
            text = token_label(token_id, token_text(tok, token_id, chosen), as_ids)
            tops = [TopLogprob(token=(t_text := token_label(t, token_text(tok, t, lp), as_ids)),
                               logprob=clamp_logprob(lp.logprob),
                               bytes=list(t_text.encode("utf-8")))
                    for t, lp in ranked(step, num)]
            content.append(ChatTokenLogprob(
                token=text, logprob=clamp_logprob(chosen.logprob) if chosen else -9999.0,
                bytes=list(text.encode("utf-8")), top_logprobs=tops))
        return ChatLogprobs(content=content)

    def _chunk(self, request_id: str, created: int, choices: list[dict],
               usage: Optional[UsageInfo] = None, extra: Optional[dict] = None) -> str:
        body: dict[str, Any] = {"id": request_id, "object": "chat.completion.chunk",
                                "created": created, "model": self.ctx.model_name,
                                "choices": choices, **(extra or {})}
        if usage is not None:
            body["usage"] = usage.model_dump()
        return sse(body)

    async def _stream(self, req: ChatCompletionRequest, fields: RequestFields,
                      prompt_ids: list[int], first: Any, merged: Any, request_id: str,
                      include_usage: bool, echo: str,
                      parsers: list[ChatOutputParser]) -> AsyncIterator[str]:
        created = int(time.time())
        num_logprobs = (req.top_logprobs or 0) if req.logprobs else None
        num_prompt = len(prompt_ids)
        num_generated, num_cached = 0, 0
        per_choice = [0] * req.n
        texts = [""] * req.n  # each choice's text so far (the parsers read all of it)

        def so_far(index: int) -> Optional[UsageInfo]:  # continuous_usage_stats (vLLM)
            if not fields.continuous_usage:
                return None
            return UsageInfo(prompt_tokens=num_prompt, completion_tokens=per_choice[index],
                             total_tokens=num_prompt + per_choice[index])

        plain = TextChunks({"id": request_id, "object": "chat.completion.chunk",
                            "created": created, "model": self.ctx.model_name},
                           '{"index":{index},"delta":{"content":',
                           '},"logprobs":null,"finish_reason":null}')
        plain_only = not fields.continuous_usage and not fields.return_token_ids
        try:
            for index in range(req.n):
                role_delta = {"role": self._role(req), "content": echo}
                extra = {"prompt_token_ids": prompt_ids} if fields.return_token_ids else None
                yield self._chunk(request_id, created, [
                    {"index": index, "delta": role_delta, "logprobs": None,
                     "finish_reason": None}], so_far(index), extra)
            async for _, output in stream_with_errors(first, merged):
                num_cached = max(num_cached, output.num_cached_tokens or 0)
                for c in output.outputs:
                    num_generated += len(c.token_ids)
                    per_choice[c.index] += len(c.token_ids)
                    logprobs = self._logprobs(c.token_ids, c.logprobs, num_logprobs,
                                              fields.as_token_ids)
                    if not c.text and c.finish_reason is None and not c.token_ids:
                        continue
                    parser = parsers[c.index]
                    finish = c.finish_reason
                    if parser.active:
                        texts[c.index] += c.text
                        delta = parser.feed(texts[c.index], c.finish_reason is not None)
                        finish = parser.finish_reason(finish, parser.streamed_tool_calls)
                        if not delta and finish is None and logprobs is None:
                            continue  # held back (a tag may be starting)
                    elif plain_only and logprobs is None and finish is None:
                        yield plain.chunk(c.index, c.text)  # the usual chunk: text only
                        continue
                    else:
                        delta = {"content": c.text}
                    choice: dict[str, Any] = {
                        "index": c.index, "delta": delta,
                        "logprobs": None if logprobs is None else logprobs.model_dump(),
                        "finish_reason": finish}
                    if c.finish_reason is not None:
                        choice["stop_reason"] = c.stop_reason
                    if fields.return_token_ids:
                        choice["token_ids"] = list(c.token_ids)
                    yield self._chunk(request_id, created, [choice], so_far(c.index))
            if include_usage:
                yield self._chunk(request_id, created, [],
                                  usage(self.ctx, num_prompt, num_generated, num_cached))
        except Exception as e:
            yield sse_error(e)
        finally:
            await close_quietly(merged)
        yield SSE_DONE


def resolve_content_format(option: str, template: Optional[str]) -> str:
    """--chat-template-content-format: "string" or "openai" as given; "auto" looks at the
    template, as vLLM does: one that loops over a message's content (directly or through a
    variable set from it) wants OpenAI's list of parts, any other a string."""
    if option != "auto":
        return option
    if not template:
        return "string"
    import jinja2
    from jinja2 import nodes

    try:
        ast = jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError:
        return "string"

    def is_content(node: Any) -> bool:
        if isinstance(node, nodes.Getitem):
            return isinstance(node.arg, nodes.Const) and node.arg.value == "content"
        return isinstance(node, nodes.Getattr) and node.attr == "content"

    content_vars = {a.target.name for a in ast.find_all(nodes.Assign)
                    if isinstance(a.target, nodes.Name) and is_content(a.node)}
    for loop in ast.find_all(nodes.For):
        it = loop.iter
        if isinstance(it, nodes.Filter) and it.node is not None:
            it = it.node
        if is_content(it) or (isinstance(it, nodes.Name) and it.name in content_vars):
            return "openai"
    return "string"
