"""The real OpenAI app (api_server.build_app under uvicorn, on localhost) in front of an engine
that answers with scripted text, for features whose tests need chosen model output (tool calls,
reasoning): a random tiny model only writes garbage.

Everything above the engine is the production code path: HTTP, request parsing, chat templates,
tokenization, SamplingParams, the chat/responses handlers, parsers and SSE. The engine records
what it was asked (prompt text, SamplingParams) and streams the script in small pieces, the
way detokenized deltas arrive.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, AsyncIterator, Optional

import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from pyorch.entrypoints.openai.api_server import build_app
from pyorch.entrypoints.openai.serving_engine import ServerContext
from pyorch.outputs import CompletionOutput, RequestOutput
from pyorch.sampling_params import RequestOutputKind, SamplingParams

TEMPLATES = Path(__file__).parent / "templates"
PIECE_CHARS = 3  # characters per streamed delta: tags and JSON get cut at every place
SPECIAL_TOKENS = ["<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|eot_id|>",
                  "<|start_header_id|>", "<|end_header_id|>", "<|python_tag|>"]


def byte_tokenizer(template: str) -> Any:
    """A byte-level tokenizer (any text encodes) with ChatML and Llama-3 special tokens and
    the given real chat template."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = Tokenizer(models.BPE({ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<|begin_of_text|>", eos_token="<|im_end|>",
        additional_special_tokens=SPECIAL_TOKENS)
    tok.chat_template = template
    return tok


def template(name: str) -> str:
    return (TEMPLATES / name).read_text()


class ScriptedEngine:
    """Stands in for AsyncLLM: `reply` (a string, or a list of strings for n > 1) is what the
    model "writes"; `calls` records (prompt, params) of every request."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.reply: Any = ""
        self.finish_reason = "stop"
        self.calls: list[tuple[dict, SamplingParams]] = []
        self.errored = False
        self.model_config = SimpleNamespace(model="scripted", vocab_size=len(tokenizer),
                                            is_pooling=False, max_logprobs=20)

    @property
    def last_prompt(self) -> str:
        return self.calls[-1][0]["prompt"]

    @property
    def last_params(self) -> SamplingParams:
        return self.calls[-1][1]

    async def check_health(self) -> None:
        return None

    def shutdown(self) -> None:
        return None

    async def generate(self, prompt: dict, params: SamplingParams, request_id: str,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        self.calls.append((prompt, params))
        replies = self.reply if isinstance(self.reply, list) else [self.reply] * params.n
        if params.output_kind != RequestOutputKind.DELTA:
            yield self._output(request_id, prompt, [(i, r, self.finish_reason)
                                                    for i, r in enumerate(replies)])
            return
        longest = max(len(r) for r in replies)
        for start in range(0, max(longest, 1), PIECE_CHARS):
            await asyncio.sleep(0)
            last = start + PIECE_CHARS >= longest
            pieces = [(i, r[start:start + PIECE_CHARS], self.finish_reason if last else None)
                      for i, r in enumerate(replies)]
            yield self._output(request_id, prompt, pieces, finished=last)

    def _output(self, request_id: str, prompt: dict, pieces: list[tuple[int, str, Any]],
                finished: bool = True) -> RequestOutput:
        outputs = [CompletionOutput(index=i, text=text,
                                    token_ids=self.tokenizer.encode(text) or [0],
                                    cumulative_logprob=None, logprobs=None,
                                    finish_reason=reason)
                   for i, text, reason in pieces]
        return RequestOutput(request_id=request_id, prompt=prompt.get("prompt"),
                             prompt_token_ids=prompt.get("prompt_token_ids"),
                             prompt_logprobs=None, outputs=outputs, finished=finished)


class ScriptedServer:
    """build_app(ctx) served by uvicorn in a thread; `url` is the base URL."""

    def __init__(self, template_name: str = "qwen2_5.jinja", **ctx_fields: Any) -> None:
        import uvicorn

        self.tokenizer = byte_tokenizer(template(template_name))
        self.engine = ScriptedEngine(self.tokenizer)
        ctx = ServerContext(engine=self.engine, served_model_names=["scripted"],  # type: ignore[arg-type]
                            max_model_len=16384, vocab_size=len(self.tokenizer),
                            tokenizer=self.tokenizer, log_requests=False, **ctx_fields)
        args = argparse.Namespace(root_path=None, api_key=None, allowed_origins=["*"],
                                  allow_credentials=False, allowed_methods=["*"],
                                  allowed_headers=["*"], max_request_body_bytes=0)
        self.app = build_app(ctx, stat_logger=None, args=args)
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run,
                                       kwargs={"sockets": [self.sock]}, daemon=True)

    def start(self) -> "ScriptedServer":
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the scripted server did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()


def openai_client(server: ScriptedServer, reply: Optional[str] = None) -> Any:
    import openai

    if reply is not None:
        server.engine.reply = reply
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=60)
