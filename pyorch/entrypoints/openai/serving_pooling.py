"""Handlers of the pooling routes: /v1/embeddings, /pooling, /score (/v1/score) and /rerank
(/v1/rerank), for a server started with `--runner pooling` (or `--convert embed`).

Each input is tokenized on the renderer pool, checked like a completion prompt, and run as one
pooling request (`AsyncLLM.encode`: prefill only, the pooled final hidden states back). /score
and /rerank embed both sides and score each pair by the cosine similarity of the embeddings
(vLLM's bi-encoder scoring; pyorch has no cross-encoder models). A server without the pooling
runner answers these routes with vLLM's "The model does not support ... API" (400), and a pooling
server answers the generation routes the same way.
"""

from __future__ import annotations

import asyncio
import base64
from typing import Any, Optional, Union

import numpy as np
from fastapi import APIRouter, Request

from pyorch.entrypoints.openai.errors import OpenAIError
from pyorch.entrypoints.openai.protocol import ErrorResponse, random_id
from pyorch.entrypoints.openai.protocol_pooling import (
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    PoolingData,
    PoolingInput,
    PoolingRequest,
    PoolingResponse,
    PoolingUsage,
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
)
from pyorch.entrypoints.openai.serving_engine import OpenAIServing, ServerContext
from pyorch.entrypoints.pooling import cosine_scores, pair_up
from pyorch.pooling_outputs import PoolingRequestOutput
from pyorch.pooling_params import PoolingParams


def require_generate(ctx: ServerContext, api: str) -> None:
    """400 on a pooling server for a generation route (vLLM's message)."""
    if ctx.engine.model_config.is_pooling:
        raise OpenAIError(f"The model does not support {api} API")


def _encode_base64(values: np.ndarray) -> str:
    """OpenAI's base64 embedding: little-endian float32 bytes (what its client decodes)."""
    return base64.b64encode(np.ascontiguousarray(values, dtype="<f4").tobytes()).decode("ascii")


class OpenAIServingPooling(OpenAIServing):
    def __init__(self, ctx: ServerContext) -> None:
        super().__init__(ctx)

    # ---- shared ----------------------------------------------------------------------------
    def _require_pooling(self, api: str) -> None:
        if not self.ctx.engine.model_config.is_pooling:
            raise OpenAIError(f"The model does not support {api} API")

    def _params(self, normalize: Optional[bool], dimensions: Optional[int] = None,
                task: Optional[str] = None) -> PoolingParams:
        try:
            params = PoolingParams(task=task, normalize=normalize, dimensions=dimensions)
            mc = self.ctx.engine.model_config
            assert mc.pooler_config is not None  # a pooling server resolved it
            params.resolve(mc.pooler_config, int(mc.hf_config.hidden_size), mc.hf_config)
        except ValueError as e:
            raise OpenAIError(str(e), param="dimensions" if dimensions is not None
                              and "dimension" in str(e) else None) from None
        return params

    async def _token_ids(self, value: Union[str, list[int]], add_special_tokens: bool,
                         param: str) -> list[int]:
        if isinstance(value, str):  # (encode checks the length and the Unicode first)
            ids = await self.encode(value, add_special_tokens, param)
        else:
            ids = list(value)
        try:
            self.check_prompt_ids(ids)
        except OpenAIError as e:
            raise OpenAIError(e.message, param=param) from None
        return ids

    async def _inputs(self, value: PoolingInput, add_special_tokens: bool) -> list[list[int]]:
        """Token ids of each input (str, [str], [int] or [[int]])."""
        if isinstance(value, str):
            return [await self._token_ids(value, add_special_tokens, "input")]
        if value and isinstance(value[0], int):
            return [await self._token_ids(value, add_special_tokens, "input")]
        return [await self._token_ids(v, add_special_tokens, f"input.{i}")  # type: ignore
                for i, v in enumerate(value)]

    async def _run(self, request: Request, prompts: list[list[int]], params: PoolingParams,
                   request_id: str, priority: int) -> list[PoolingRequestOutput]:
        """Runs every prompt as a pooling request; their outputs in input order. A client that
        goes away, or an error, aborts them all (their KV blocks are freed)."""
        self.check_engine()

        async def one(index: int) -> PoolingRequestOutput:
            rid = request_id if len(prompts) == 1 else f"{request_id}-{index}"
            gen = self.ctx.engine.encode({"prompt_token_ids": prompts[index]}, params, rid,
                                         priority=priority)
            try:
                async for output in gen:
                    return output
            finally:
                await gen.aclose()
            raise RuntimeError(f"the engine returned no output for input {index}")

        async def all_of() -> list[PoolingRequestOutput]:
            tasks = [asyncio.create_task(one(i)) for i in range(len(prompts))]
            try:
                return list(await asyncio.gather(*tasks))
            finally:
                for task in tasks:
                    if not task.done():
                        task.cancel()
                        self._background.add(task)
                        task.add_done_callback(self._background.discard)

        try:
            return await self.run_until_disconnect(request, all_of())
        except (ValueError, TypeError) as e:
            raise OpenAIError(str(e)) from None

    @staticmethod
    def _usage(outputs: list[PoolingRequestOutput]) -> PoolingUsage:
        num = sum(len(o.prompt_token_ids) for o in outputs)
        return PoolingUsage(prompt_tokens=num, total_tokens=num)

    # ---- routes ----------------------------------------------------------------------------
    async def create_embedding(self, body: EmbeddingRequest, request: Request,
                               ) -> EmbeddingResponse:
        self._require_pooling("Embeddings")
        self.check_model(body.model)
        self.check_fields(body)
        refuse_truncation(body)
        params = self._params(body.normalize, body.dimensions, "embed")
        prompts = await self._inputs(body.input, body.add_special_tokens)
        outputs = await self._run(request, prompts, params, random_id("embd"), body.priority)
        data = []
        for i, out in enumerate(outputs):
            values = out.outputs.data.numpy()
            embedding: Union[list[float], str] = (
                _encode_base64(values) if body.encoding_format == "base64" else values.tolist())
            data.append(EmbeddingData(index=i, embedding=embedding))
        return EmbeddingResponse(id=random_id("embd"), model=body.model or self.ctx.model_name,
                                 data=data, usage=self._usage(outputs))

    async def create_pooling(self, body: PoolingRequest, request: Request) -> PoolingResponse:
        self._require_pooling("Pooling")
        self.check_model(body.model)
        self.check_fields(body)
        refuse_truncation(body)
        params = self._params(body.normalize, body.dimensions, body.task)
        prompts = await self._inputs(body.input, body.add_special_tokens)
        outputs = await self._run(request, prompts, params, random_id("pool"), body.priority)
        data = []
        for i, out in enumerate(outputs):
            values = out.outputs.data.numpy()
            payload: Union[list[float], list[list[float]], str] = (
                _encode_base64(values) if body.encoding_format == "base64" else values.tolist())
            data.append(PoolingData(index=i, data=payload))
        return PoolingResponse(id=random_id("pool"), model=body.model or self.ctx.model_name,
                               data=data, usage=self._usage(outputs))

    async def _score_pairs(self, request: Request, left: list[str], right: list[str],
                           params: PoolingParams, add_special_tokens: bool, priority: int,
                           prefix: str, params_of: tuple[str, str],
                           ) -> tuple[list[float], list[PoolingRequestOutput]]:
        """Cosine scores of (left[i], right[i]); the embeddings of each distinct text once."""
        texts = list(dict.fromkeys(left + right))
        names = {t: (params_of[0] if t in left else params_of[1]) for t in texts}
        prompts = [await self._token_ids(t, add_special_tokens, names[t]) for t in texts]
        outputs = await self._run(request, prompts, params, random_id(prefix), priority)
        by_text = {t: o.outputs.data.tolist() for t, o in zip(texts, outputs, strict=True)}
        scores = cosine_scores([by_text[t] for t in left], [by_text[t] for t in right])
        return scores, outputs

    async def create_score(self, body: ScoreRequest, request: Request) -> ScoreResponse:
        self._require_pooling("Score")
        self.check_model(body.model)
        self.check_fields(body)
        refuse_truncation(body)
        params = self._params(body.normalize, task="embed")
        text_1 = [body.text_1] if isinstance(body.text_1, str) else body.text_1
        text_2 = [body.text_2] if isinstance(body.text_2, str) else body.text_2
        try:
            left, right = pair_up(text_1, text_2)
        except ValueError as e:
            raise OpenAIError(str(e), param="text_1") from None
        scores, outputs = await self._score_pairs(request, left, right, params,
                                                  body.add_special_tokens, body.priority,
                                                  "score", ("text_1", "text_2"))
        return ScoreResponse(id=random_id("score"), model=body.model or self.ctx.model_name,
                             data=[ScoreData(index=i, score=s) for i, s in enumerate(scores)],
                             usage=self._usage(outputs))

    async def create_rerank(self, body: RerankRequest, request: Request) -> RerankResponse:
        self._require_pooling("Rerank (Score)")
        self.check_model(body.model)
        self.check_fields(body)
        refuse_truncation(body)
        params = self._params(body.normalize, task="embed")
        docs = body.documents
        scores, outputs = await self._score_pairs(request, [body.query] * len(docs), docs,
                                                  params, body.add_special_tokens,
                                                  body.priority, "rerank", ("query", "documents"))
        order = sorted(range(len(docs)), key=lambda i: -scores[i])
        top_n = body.top_n if 0 < body.top_n < len(docs) else len(docs)
        results = [RerankResult(index=i, document=RerankDocument(text=docs[i]),
                                relevance_score=scores[i]) for i in order[:top_n]]
        return RerankResponse(id=random_id("rerank"), model=body.model or self.ctx.model_name,
                              usage=RerankUsage(total_tokens=self._usage(outputs).total_tokens),
                              results=results)


# ---- routes (included by api_server.build_app) ----------------------------------------------
router = APIRouter()
_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse}, 401: {"model": ErrorResponse},
    404: {"model": ErrorResponse}, 503: {"model": ErrorResponse},
}


def _handler(request: Request) -> OpenAIServingPooling:
    return request.app.state.pooling


@router.post("/v1/embeddings", response_model=EmbeddingResponse, responses=_ERRORS)
async def create_embedding(body: EmbeddingRequest, request: Request) -> EmbeddingResponse:
    return await _handler(request).create_embedding(body, request)


@router.post("/pooling", response_model=PoolingResponse, responses=_ERRORS)
async def create_pooling(body: PoolingRequest, request: Request) -> PoolingResponse:
    return await _handler(request).create_pooling(body, request)


@router.post("/score", response_model=ScoreResponse, responses=_ERRORS)
@router.post("/v1/score", response_model=ScoreResponse, responses=_ERRORS)
async def create_score(body: ScoreRequest, request: Request) -> ScoreResponse:
    return await _handler(request).create_score(body, request)


@router.post("/rerank", response_model=RerankResponse, responses=_ERRORS)
@router.post("/v1/rerank", response_model=RerankResponse, responses=_ERRORS)
@router.post("/v2/rerank", response_model=RerankResponse, responses=_ERRORS)
async def create_rerank(body: RerankRequest, request: Request) -> RerankResponse:
    return await _handler(request).create_rerank(body, request)


def refuse_truncation(body: Any) -> None:
    """`truncate_prompt_tokens` is honoured on the generation routes only (request_fields.py);
    the pooling routes refuse it rather than ignore it."""
    value = (body.model_extra or {}).get("truncate_prompt_tokens")
    if value is not None:
        raise OpenAIError("`truncate_prompt_tokens` is not supported by the pooling routes",
                          param="truncate_prompt_tokens")
