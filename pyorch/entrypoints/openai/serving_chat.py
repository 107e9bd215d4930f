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

from pyorch.entrypoints.openai.errors import OpenAIError
from pyorch.entrypoints.openai.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    ChatResponseMessage,
    ChatTokenLogprob,
    TopLogprob,
    UsageInfo,
    random_id,
)
from pyorch.entrypoints.openai.serving_engine import (
    SSE_DONE,
    OpenAIServing,
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

# Keyword arguments of apply_chat_template that chat_template_kwargs may not override.
_RESERVED_TEMPLATE_KWARGS = {"conversation", "chat_template", "tokenize", "add_generation_prompt",
                             "continue_final_message", "return_dict", "tools", "documents"}


def _message_dict(message: ChatMessage, index: int = 0) -> dict[str, Any]:
    content = message.content
    where = f"messages.{index}"
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise OpenAIError("only text content parts ({\"type\": \"text\", \"text\": ...}) "
                                  "are supported", param=f"{where}.content.{j}")
            OpenAIServing.check_text(part["text"], f"{where}.content.{j}.text")
            texts.append(part["text"])
        content = "\n".join(texts)
    elif content is not None:
        OpenAIServing.check_text(content, f"{where}.content")
    out: dict[str, Any] = {"role": message.role, "content": content or ""}
    if message.name is not None:
        OpenAIServing.check_text(message.name, f"{where}.name")
        out["name"] = message.name
    return out


def render_chat(serving: OpenAIServing, messages: list[ChatMessage], add_generation_prompt: bool,
                continue_final_message: bool,
                chat_template_kwargs: Optional[dict[str, Any]] = None) -> str:
    """The conversation as prompt text, through the chat template; 400 if it cannot be.
    CPU-heavy on long conversations: the handlers run it on the renderer pool."""
    tokenizer = serving.tokenizer()
    if add_generation_prompt and continue_final_message:
        raise OpenAIError("continue_final_message cannot be combined with add_generation_prompt; "
                          "set add_generation_prompt to false", param="continue_final_message")
    conversation = [_message_dict(m, i) for i, m in enumerate(messages)]
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
            continue_final_message=continue_final_message, tokenize=False, **extra)
    except Exception as e:  # a template that raises (jinja errors, raise_exception(...))
        raise OpenAIError(f"the chat template failed on these messages: {e}",
                          param="messages") from None
    if not isinstance(text, str):
        raise OpenAIError("the chat template did not produce text", param="messages")
    return text


class OpenAIServingChat(OpenAIServing):
    async def create_chat_completion(self, req: ChatCompletionRequest, raw: Request) -> Any:
        self.check_model(req.model)
        self.check_engine()
        self.check_fields(req)
        include_usage = self.check_stream_options(req)
        if req.top_logprobs and not req.logprobs:
            raise OpenAIError("top_logprobs needs logprobs=true", param="top_logprobs")
        text = await self.render(render_chat, self, req.messages, req.add_generation_prompt,
                                 req.continue_final_message, req.chat_template_kwargs)
        token_ids = await self.encode(text, False, "messages")
        self.check_prompt_ids(token_ids)
        requested = req.max_completion_tokens or req.max_tokens
        max_tokens = self.resolve_max_tokens(requested, len(token_ids))
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = self.sampling_params(req, max_tokens, logprobs)
        await self.check_structured_outputs(req, params)
        request_id = random_id("chatcmpl")
        self.log_request(request_id, text, len(token_ids), params)
        merged = self.generate_many([{"prompt_token_ids": token_ids, "prompt": text}], params,
                                    request_id)
        echo = self._echo_text(req)
        if req.stream:
            first = await first_output(merged)
            return StreamingResponse(
                self._stream(req, len(token_ids), first, merged, request_id, include_usage, echo),
                media_type="text/event-stream")
        final = (await self.run_until_disconnect(raw, collect_finals(merged, 1)))[0]
        choices, num_generated = [], 0
        for c in final.outputs:
            choices.append(ChatChoice(
                index=c.index, message=ChatResponseMessage(content=echo + c.text),
                logprobs=self._logprobs(c.token_ids, c.logprobs, logprobs),
                finish_reason=c.finish_reason, stop_reason=c.stop_reason))
            num_generated += len(c.token_ids)
        usage = UsageInfo(prompt_tokens=len(token_ids), completion_tokens=num_generated,
                          total_tokens=len(token_ids) + num_generated)
        response = ChatCompletionResponse(id=request_id, model=self.ctx.model_name,
                                          choices=choices, usage=usage)
        return JSONResponse(response.model_dump())

    @staticmethod
    def _echo_text(req: ChatCompletionRequest) -> str:
        """vLLM's chat echo: the last message's content, when it is the assistant's."""
        if not req.echo or req.messages[-1].role != "assistant":
            return ""
        return str(_message_dict(req.messages[-1], len(req.messages) - 1)["content"])

    def _logprobs(self, token_ids: list[int], steps: Optional[list[dict[int, Logprob]]],
                  num: Optional[int]) -> Optional[ChatLogprobs]:
        if num is None:
            return None
        tok = self.ctx.tokenizer
        content = []
        for i, token_id in enumerate(token_ids):
            step = steps[i] if steps is not None and i < len(steps) else {}
            chosen = step.get(token_id)
            text = token_text(tok, token_id, chosen)
            tops = [TopLogprob(token=(t_text := token_text(tok, t, lp)),
                               logprob=clamp_logprob(lp.logprob),
                               bytes=list(t_text.encode("utf-8")))
                    for t, lp in ranked(step, num)]
            content.append(ChatTokenLogprob(
                token=text, logprob=clamp_logprob(chosen.logprob) if chosen else -9999.0,
                bytes=list(text.encode("utf-8")), top_logprobs=tops))
        return ChatLogprobs(content=content)

    def _chunk(self, request_id: str, created: int, choices: list[dict],
               usage: Optional[UsageInfo] = None) -> str:
        body: dict[str, Any] = {"id": request_id, "object": "chat.completion.chunk",
                                "created": created, "model": self.ctx.model_name,
                                "choices": choices}
        if usage is not None:
            body["usage"] = usage.model_dump()
        return sse(body)

    async def _stream(self, req: ChatCompletionRequest, num_prompt: int, first: Any, merged: Any,
                      request_id: str, include_usage: bool, echo: str) -> AsyncIterator[str]:
        created = int(time.time())
        num_logprobs = (req.top_logprobs or 0) if req.logprobs else None
        num_generated = 0
        try:
            for index in range(req.n):
                role_delta = {"role": "assistant", "content": echo}
                yield self._chunk(request_id, created, [
                    {"index": index, "delta": role_delta, "logprobs": None,
                     "finish_reason": None}])
            async for _, output in stream_with_errors(first, merged):
                for c in output.outputs:
                    num_generated += len(c.token_ids)
                    logprobs = self._logprobs(c.token_ids, c.logprobs, num_logprobs)
                    if not c.text and c.finish_reason is None and not c.token_ids:
                        continue
                    choice: dict[str, Any] = {
                        "index": c.index, "delta": {"content": c.text},
                        "logprobs": None if logprobs is None else logprobs.model_dump(),
                        "finish_reason": c.finish_reason}
                    if c.finish_reason is not None:
                        choice["stop_reason"] = c.stop_reason
                    yield self._chunk(request_id, created, [choice])
            if include_usage:
                usage = UsageInfo(prompt_tokens=num_prompt, completion_tokens=num_generated,
                                  total_tokens=num_prompt + num_generated)
                yield self._chunk(request_id, created, [], usage)
        except Exception as e:
            yield sse_error(e)
        finally:
            await close_quietly(merged)
        yield SSE_DONE
