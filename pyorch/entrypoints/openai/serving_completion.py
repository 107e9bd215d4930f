"""POST /v1/completions: prompts as text or token ids, one or many, streamed or not.

Choice `i * n + j` is sample j of prompt i, as in OpenAI's API.
"""

from __future__ import annotations

import time
from typing import Any, AsyncIterator, Optional, Sequence

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from pyorch.entrypoints.openai.errors import OpenAIError
from pyorch.entrypoints.openai.protocol import (
    MAX_SEQUENCES,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
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
from pyorch.outputs import Logprob, RequestOutput


class _Prompt:
    """One prompt of the request: its text (for echo) and token ids."""

    def __init__(self, text: Optional[str], token_ids: list[int]) -> None:
        self.text, self.token_ids = text, token_ids


class OpenAIServingCompletion(OpenAIServing):
    async def _prompts(self, req: CompletionRequest) -> list[_Prompt]:
        raw = req.prompt
        if isinstance(raw, str):
            items: list[Any] = [raw]
        elif raw and all(isinstance(p, int) for p in raw):
            items = [raw]
        else:
            items = list(raw)
        if not items:
            raise OpenAIError("the prompt is empty", param="prompt")
        if len(items) * req.n > MAX_SEQUENCES:
            raise OpenAIError(f"{len(items)} prompts x n={req.n} is more than the "
                              f"{MAX_SEQUENCES} sequences one request may ask for", param="n")
        prompts = []
        for i, item in enumerate(items):
            param = "prompt" if len(items) == 1 else f"prompt.{i}"
            if isinstance(item, str):
                ids = await self.encode(item, req.add_special_tokens, param)
                prompts.append(_Prompt(item, ids))
            else:
                prompts.append(_Prompt(None, list(item)))
            self.check_prompt_ids(prompts[-1].token_ids)
        return prompts

    async def create_completion(self, req: CompletionRequest, raw: Request) -> Any:
        self.check_model(req.model)
        self.check_engine()
        self.check_fields(req)
        if req.suffix:
            raise OpenAIError("suffix is not supported", param="suffix")
        include_usage = self.check_stream_options(req)
        prompts = await self._prompts(req)
        longest = max(len(p.token_ids) for p in prompts)
        max_tokens = self.resolve_max_tokens(req.max_tokens, longest)
        params = self.sampling_params(req, max_tokens, req.logprobs,
                                      req.logprobs if req.echo and req.logprobs is not None
                                      else None)
        await self.check_structured_outputs(req, params)
        request_id = random_id("cmpl")
        for i, p in enumerate(prompts):
            rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
            self.log_request(rid, p.text or p.token_ids, len(p.token_ids), params)
        engine_prompts = [{"prompt_token_ids": p.token_ids, "prompt": p.text} for p in prompts]
        merged = self.generate_many(engine_prompts, params, request_id)
        if req.stream:
            first = await first_output(merged)
            return StreamingResponse(
                self._stream(req, prompts, first, merged, request_id, include_usage),
                media_type="text/event-stream")
        finals = await self.run_until_disconnect(raw, collect_finals(merged, len(prompts)))
        return JSONResponse(self._response(req, prompts, finals, request_id).model_dump())

    # ---- non-streaming ------------------------------------------------------------------------
    def _response(self, req: CompletionRequest, prompts: list[_Prompt],
                  finals: list[RequestOutput], request_id: str) -> CompletionResponse:
        choices, num_generated = [], 0
        for i, (prompt, final) in enumerate(zip(prompts, finals, strict=True)):
            for c in final.outputs:
                text, logprobs = c.text, None
                if req.logprobs is not None:
                    logprobs = CompletionLogprobs()
                    offset = 0
                    if req.echo:
                        offset = self._add_logprobs(logprobs, prompt.token_ids,
                                                    final.prompt_logprobs, req.logprobs, offset)
                    self._add_logprobs(logprobs, c.token_ids, c.logprobs, req.logprobs, offset)
                if req.echo:
                    text = self._prompt_text(prompt) + text
                choices.append(CompletionChoice(index=i * req.n + c.index, text=text,
                                                logprobs=logprobs, finish_reason=c.finish_reason,
                                                stop_reason=c.stop_reason))
                num_generated += len(c.token_ids)
        num_prompt = sum(len(p.token_ids) for p in prompts)
        return CompletionResponse(id=request_id, model=self.ctx.model_name, choices=choices,
                                  usage=UsageInfo(prompt_tokens=num_prompt,
                                                  completion_tokens=num_generated,
                                                  total_tokens=num_prompt + num_generated))

    def _prompt_text(self, prompt: _Prompt) -> str:
        if prompt.text is None:
            prompt.text = self.tokenizer().decode(prompt.token_ids)
        return prompt.text

    def _add_logprobs(self, out: CompletionLogprobs, token_ids: list[int],
                      steps: Optional[Sequence[Optional[dict[int, Logprob]]]], num: int,
                      offset: int) -> int:
        """Appends OpenAI's (tokens, token_logprobs, top_logprobs, text_offset) for
        `token_ids`; returns the text offset after them."""
        tok = self.ctx.tokenizer
        for i, token_id in enumerate(token_ids):
            step = steps[i] if steps is not None and i < len(steps) else None
            chosen = step.get(token_id) if step else None
            text = token_text(tok, token_id, chosen)
            out.tokens.append(text)
            out.text_offset.append(offset)
            offset += len(text)
            if step is None or chosen is None:
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            out.token_logprobs.append(clamp_logprob(chosen.logprob))
            top = {text: clamp_logprob(chosen.logprob)}
            for t, lp in ranked(step, num):
                top.setdefault(token_text(tok, t, lp), clamp_logprob(lp.logprob))
            out.top_logprobs.append(top)
        return offset

    # ---- streaming ----------------------------------------------------------------------------
    async def _stream(self, req: CompletionRequest, prompts: list[_Prompt],
                      first: Any, merged: Any, request_id: str,
                      include_usage: bool) -> AsyncIterator[str]:
        created = int(time.time())
        n = req.n
        offsets = [0] * (len(prompts) * n)
        echoed = [False] * (len(prompts) * n)
        num_generated = 0
        try:
            async for prompt_idx, output in stream_with_errors(first, merged):
                prompt = prompts[prompt_idx]
                for c in output.outputs:
                    index = prompt_idx * n + c.index
                    text, logprobs = c.text, None
                    if req.logprobs is not None:
                        logprobs = CompletionLogprobs()
                    if req.echo and not echoed[index]:
                        echoed[index] = True
                        text = self._prompt_text(prompt) + text
                        if logprobs is not None:
                            assert req.logprobs is not None  # logprobs is made only then
                            offsets[index] = self._add_logprobs(
                                logprobs, prompt.token_ids, output.prompt_logprobs,
                                req.logprobs, offsets[index])
                    if logprobs is not None:
                        assert req.logprobs is not None  # logprobs is made only then
                        offsets[index] = self._add_logprobs(logprobs, c.token_ids, c.logprobs,
                                                            req.logprobs, offsets[index])
                    num_generated += len(c.token_ids)
                    if not text and logprobs is None and c.finish_reason is None:
                        continue  # nothing new (e.g. an incomplete UTF-8 character)
                    choice = CompletionChoice(index=index, text=text, logprobs=logprobs,
                                              finish_reason=c.finish_reason,
                                              stop_reason=c.stop_reason)
                    yield sse({"id": request_id, "object": "text_completion",
                               "created": created, "model": self.ctx.model_name,
                               "choices": [choice.model_dump()]})
            if include_usage:
                num_prompt = sum(len(p.token_ids) for p in prompts)
                usage = UsageInfo(prompt_tokens=num_prompt, completion_tokens=num_generated,
                                  total_tokens=num_prompt + num_generated)
                yield sse({"id": request_id, "object": "text_completion", "created": created,
                           "model": self.ctx.model_name, "choices": [],
                           "usage": usage.model_dump()})
        except Exception as e:
            yield sse_error(e)
        finally:
            await close_quietly(merged)
        yield SSE_DONE

