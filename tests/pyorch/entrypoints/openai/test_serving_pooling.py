"""The pooling routes of a `--runner pooling` server (tiny random Llama with SmolLM2's tokenizer,
float32 on the CPU): /v1/embeddings through the official openai client (float and base64 give
the same values, equal to transformers' final hidden states), /pooling, /score, /v1/score,
/rerank, /v1/rerank through httpx, and each side's refusals (a generation server refuses the
pooling routes, a pooling server the generation routes)."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

TEXTS = ["The capital of France is Paris.", "def fibonacci(n):", "Bonjour"]


@pytest.fixture(scope="module")
def pool_http(pooling_server):
    with httpx.Client(base_url=pooling_server.url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def reference(pooling_model):
    """text -> LAST-pooled, normalized final hidden state from transformers."""
    tok = transformers.AutoTokenizer.from_pretrained(pooling_model)
    hf = transformers.AutoModel.from_pretrained(pooling_model, dtype=torch.float32).eval()

    def embed(text: str) -> np.ndarray:
        ids = tok(text)["input_ids"]
        with torch.no_grad():
            h = hf(torch.tensor([ids])).last_hidden_state[0, -1]
        return F.normalize(h, dim=-1).numpy()

    return embed


def _cos(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_embeddings_openai_client_float_and_base64(pooling_server, reference):
    import openai

    with openai.OpenAI(base_url=pooling_server.url + "/v1", api_key="unused",
                       max_retries=0) as client:
        models = client.models.list().data
        floats = client.embeddings.create(model=models[0].id, input=TEXTS,
                                          encoding_format="float")
        b64 = client.embeddings.create(model=models[0].id, input=TEXTS,
                                       encoding_format="base64")
        # Without encoding_format the client asks for base64 and decodes it itself.
        default = client.embeddings.create(model=models[0].id, input=TEXTS)
    assert [d.index for d in floats.data] == [0, 1, 2]
    assert floats.usage.prompt_tokens == floats.usage.total_tokens > 0
    # Three requests, three batches: a request still running from an earlier test (the fuzz's)
    # can share a step with one of them and move its float32 sums by an ulp, so they agree to
    # float tolerance, not bit for bit (the encoding itself is exact: test_base64_is_exact).
    for text, f, b, d in zip(TEXTS, floats.data, b64.data, default.data, strict=True):
        assert len(f.embedding) == 128 and isinstance(b.embedding, str)
        decoded = np.frombuffer(base64.b64decode(b.embedding), dtype="<f4")
        np.testing.assert_allclose(np.asarray(f.embedding, np.float32), decoded, rtol=0,
                                   atol=1e-6)
        np.testing.assert_allclose(np.asarray(d.embedding, np.float32), decoded, rtol=0,
                                   atol=1e-6)
        np.testing.assert_allclose(f.embedding, reference(text), atol=2e-5)


def test_base64_is_exact():
    from pyorch.entrypoints.openai.serving_pooling import _encode_base64

    values = np.random.default_rng(0).standard_normal(129).astype(np.float32)
    for given in (values, values.astype(np.float64), values[::-1], values.astype(">f4")):
        decoded = np.frombuffer(base64.b64decode(_encode_base64(given)), dtype="<f4")
        np.testing.assert_array_equal(decoded, np.asarray(given, np.float32))


def test_embeddings_do_not_depend_on_the_batch(pool_http, reference):
    """The same text alone, batched with the others, and beside long prompts that are chunked
    into the same steps (--max-num-batched-tokens 64) pools to the same vector within float32
    tolerance; anything more would be a row of another request leaking in."""
    import concurrent.futures

    def embed(texts: list[str]) -> list[np.ndarray]:
        r = pool_http.post("/v1/embeddings", json={"input": texts})
        assert r.status_code == 200, r.text
        return [np.asarray(d["embedding"]) for d in r.json()["data"]]

    alone = [embed([t])[0] for t in TEXTS]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        long = [pool.submit(embed, ["word " * n]) for n in (50, 90, 130)]
        batched = embed(TEXTS)
        for job in long:
            job.result()
    for text, a, b in zip(TEXTS, alone, batched, strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
        np.testing.assert_allclose(a, reference(text), atol=2e-5)


def test_embeddings_raw_base64_and_token_ids(pool_http, reference):
    r = pool_http.post("/v1/embeddings", json={"input": TEXTS[0], "encoding_format": "base64"})
    assert r.status_code == 200, r.text
    raw = np.frombuffer(base64.b64decode(r.json()["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(raw, reference(TEXTS[0]), atol=2e-5)
    ids = [[5, 6, 7, 8], [9, 10]]
    r = pool_http.post("/v1/embeddings", json={"input": ids, "normalize": False})
    body = r.json()
    assert r.status_code == 200 and body["usage"]["prompt_tokens"] == 6
    assert abs(np.linalg.norm(body["data"][0]["embedding"]) - 1.0) > 1e-3  # not normalized


def test_pooling_route_embed_and_token_embed(pool_http, reference):
    r = pool_http.post("/pooling", json={"input": [TEXTS[1]]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["data"][0]["object"] == "pooling"
    np.testing.assert_allclose(body["data"][0]["data"], reference(TEXTS[1]), atol=2e-5)
    r = pool_http.post("/pooling", json={"input": [1, 2, 3, 4, 5], "task": "token_embed"})
    data = np.asarray(r.json()["data"][0]["data"])
    assert r.status_code == 200 and data.shape == (5, 128)
    np.testing.assert_allclose(np.linalg.norm(data, axis=1), 1.0, atol=1e-5)


@pytest.mark.parametrize("path", ["/score", "/v1/score"])
def test_score_is_cosine_of_embeddings(pool_http, reference, path):
    r = pool_http.post(path, json={"text_1": TEXTS[0], "text_2": TEXTS})
    assert r.status_code == 200, r.text
    scores = [d["score"] for d in r.json()["data"]]
    want = [_cos(reference(TEXTS[0]), reference(t)) for t in TEXTS]
    np.testing.assert_allclose(scores, want, atol=1e-5)
    assert abs(scores[0] - 1.0) < 1e-5
    r = pool_http.post(path, json={"text_1": TEXTS[:2], "text_2": TEXTS[1:]})  # N -> N
    want = [_cos(reference(a), reference(b)) for a, b in zip(TEXTS[:2], TEXTS[1:], strict=True)]
    np.testing.assert_allclose([d["score"] for d in r.json()["data"]], want, atol=1e-5)
    r = pool_http.post(path, json={"text_1": TEXTS[:2], "text_2": TEXTS})  # 2 -> 3
    assert r.status_code == 400 and "1:1, 1:N or N:N" in r.json()["error"]["message"]


@pytest.mark.parametrize("path", ["/rerank", "/v1/rerank"])
def test_rerank_orders_documents_and_keeps_top_n(pool_http, reference, path):
    query, docs = TEXTS[1], [TEXTS[0], TEXTS[2], TEXTS[1]]
    r = pool_http.post(path, json={"query": query, "documents": docs, "top_n": 2})
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    want = [_cos(reference(query), reference(d)) for d in docs]
    order = sorted(range(3), key=lambda i: -want[i])[:2]
    assert [x["index"] for x in results] == order == [2, order[1]]
    for x in results:
        assert x["document"]["text"] == docs[x["index"]]
        assert abs(x["relevance_score"] - want[x["index"]]) < 1e-5
    r = pool_http.post(path, json={"query": query, "documents": docs})  # top_n 0: all
    assert len(r.json()["results"]) == 3 and r.json()["usage"]["total_tokens"] > 0


def test_pooling_server_refuses_generation_and_bad_input(pool_http):
    for path, body, api in [("/v1/completions", {"prompt": "Hi", "max_tokens": 2}, "Completions"),
                            ("/v1/chat/completions", {"messages": [{"role": "user",
                                                                    "content": "Hi"}]},
                             "Chat Completions")]:
        r = pool_http.post(path, json=body)
        assert r.status_code == 400
        assert r.json()["error"]["message"] == f"The model does not support {api} API"
    r = pool_http.post("/v1/embeddings", json={"input": "Hi", "dimensions": 16})
    assert r.status_code == 400 and "matryoshka" in r.json()["error"]["message"]
    r = pool_http.post("/v1/embeddings", json={"input": [[10**9]]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input.0"
    r = pool_http.post("/v1/embeddings", json={"input": "Hi", "truncate_prompt_tokens": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens"
    r = pool_http.post("/v1/embeddings", json={"input": []})
    assert r.status_code == 400
    r = pool_http.post("/v1/embeddings", json={"input": "Hi", "model": "nope"})
    assert r.status_code == 404
    # The engine is still serving, and its KV blocks are all free again.
    r = pool_http.post("/v1/embeddings", json={"input": "still alive"})
    assert r.status_code == 200 and len(r.json()["data"][0]["embedding"]) == 128


@pytest.mark.parametrize("path,api", [("/v1/embeddings", "Embeddings"), ("/pooling", "Pooling"),
                                      ("/score", "Score"), ("/v1/rerank", "Rerank (Score)")])
def test_generation_server_refuses_pooling_routes(http, path, api):
    body = {"input": "Hi", "text_1": "a", "text_2": "b", "query": "q", "documents": ["d"]}
    r = http.post(path, json=body)
    assert r.status_code == 400
    assert r.json()["error"]["message"] == f"The model does not support {api} API"
