"""POST /tokenize and POST /detokenize (vLLM's endpoints).

/tokenize takes either `prompt` (a completion prompt) or `messages` (rendered through the chat
template exactly as /v1/chat/completions would, with the request's `tools`), and answers the
token ids, their count and max_model_len.
"""

from __future__ import annotations

from pyorch.engine.input_processor import check_token_ids
from pyorch.entrypoints.openai.errors import OpenAIError
from pyorch.entrypoints.openai.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeRequest,
    TokenizeResponse,
)
from pyorch.entrypoints.openai.serving_chat import render_chat
from pyorch.entrypoints.openai.serving_engine import OpenAIServing


class OpenAIServingTokenization(OpenAIServing):
    async def tokenize(self, req: TokenizeRequest) -> TokenizeResponse:
        """The same checks as generation, except the token count: a text that could still
        fit is tokenized in full (its count may exceed max_model_len); one longer than
        max_model_len x the tokenizer's longest token is refused without being encoded."""
        self.check_model(req.model)
        tokenizer = self.tokenizer()
        if isinstance(req, TokenizeChatRequest):
            tools = None if req.tools is None else [t.model_dump(exclude_none=True)
                                                    for t in req.tools]
            text = await self.render(render_chat, self, req.messages, req.add_generation_prompt,
                                     req.continue_final_message, req.chat_template_kwargs, tools)
            param = "messages"
        else:
            text, param = req.prompt, "prompt"
        tokens = await self.encode(text, req.add_special_tokens, param)
        token_strs = None
        if req.return_token_strs:
            token_strs = await self.render(
                lambda: [str(t) for t in tokenizer.convert_ids_to_tokens(tokens)])
        return TokenizeResponse(count=len(tokens), max_model_len=self.ctx.max_model_len,
                                tokens=tokens, token_strs=token_strs)

    async def detokenize(self, req: DetokenizeRequest) -> DetokenizeResponse:
        self.check_model(req.model)
        tokenizer = self.tokenizer()

        def work() -> str:
            try:
                check_token_ids(req.tokens, self.ctx.vocab_size, "token ids")
            except ValueError as e:
                raise OpenAIError(str(e), param="tokens") from None
            return str(tokenizer.decode(req.tokens))

        return DetokenizeResponse(prompt=await self.render(work))
