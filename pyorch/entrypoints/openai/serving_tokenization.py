"""POST /tokenize and POST /detokenize (vLLM's endpoints).

/tokenize takes either `prompt` (a completion prompt) or `messages` (rendered through the chat
template exactly as /v1/chat/completions would), and answers the token ids, their count and
max_model_len.
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
    def tokenize(self, req: TokenizeRequest) -> TokenizeResponse:
        self.check_model(req.model)
        tokenizer = self.tokenizer()
        if isinstance(req, TokenizeChatRequest):
            text = render_chat(self, req.messages, req.add_generation_prompt,
                               req.continue_final_message, req.chat_template_kwargs)
        else:
            text = req.prompt
        tokens = list(tokenizer.encode(text, add_special_tokens=req.add_special_tokens))
        token_strs = None
        if req.return_token_strs:
            token_strs = [str(t) for t in tokenizer.convert_ids_to_tokens(tokens)]
        return TokenizeResponse(count=len(tokens), max_model_len=self.ctx.max_model_len,
                                tokens=tokens, token_strs=token_strs)

    def detokenize(self, req: DetokenizeRequest) -> DetokenizeResponse:
        self.check_model(req.model)
        try:
            check_token_ids(req.tokens, self.ctx.vocab_size, "token ids")
        except ValueError as e:
            raise OpenAIError(str(e), param="tokens") from None
        return DetokenizeResponse(prompt=self.tokenizer().decode(req.tokens))
