"""vLLM's side routes and the flags that shape the server (servers of their own, started
together): /invocations, /load, /reset_prefix_cache, /tokenizer_info behind the API key; the
vllm: metric prefix and the newer vLLM metrics; preemptions counted under a tiny KV cache;
--disable-log-stats; --override-generation-config, --response-role, --max-logprobs and the
chat-template content format."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from conftest import metric, start_server, wait_for_metrics

KEY = {"Authorization": "Bearer sesame"}
# Iterates over each message's content parts: --chat-template-content-format auto must see
# that the template wants OpenAI's list of parts.
PARTS_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}:{% for p in m['content'] %}"
                  "[{{ p['text'] }}]{% endfor %}\n{% endfor %}")


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("routes")
    template = tmp / "parts.jinja"
    template.write_text(PARTS_TEMPLATE)
    fast_stats = {"PYORCH_LOG_STATS_INTERVAL": "0.3"}
    extras = start_server(tmp, "extras", [
        "--api-key", "sesame", "--enable-tokenizer-info-endpoint",
        "--enable-server-load-tracking", "--metrics-prefix", "vllm",
        "--chat-template", str(template)])
    tiny_kv = start_server(tmp, "tiny_kv", [
        "--max-model-len", "128", "--num-gpu-blocks-override", "13",
        "--no-reserve-kv-for-growth"], env=fast_stats)
    quiet = start_server(tmp, "quiet", [
        "--disable-log-stats", "--max-logprobs", "3", "--response-role", "bot",
        "--override-generation-config", '{"temperature": 0, "max_new_tokens": 3}'],
        env=fast_stats)
    try:
        yield {"extras": extras.wait_ready(), "tiny_kv": tiny_kv.wait_ready(),
               "quiet": quiet.wait_ready()}
    finally:
        for srv in (extras, tiny_kv, quiet):
            srv.terminate()


def test_side_routes_need_the_api_key(servers):
    url = servers["extras"].url
    for method, path in (("POST", "/invocations"), ("GET", "/load"),
                         ("POST", "/reset_prefix_cache"), ("GET", "/tokenizer_info")):
        r = httpx.request(method, url + path, json={"prompt": "x"})
        assert r.status_code == 401, path
    assert httpx.get(url + "/ping").status_code == 200  # SageMaker's health probe stays open


def test_invocations_routes_by_body_shape(servers):
    url = servers["extras"].url
    chat = httpx.post(url + "/invocations", headers=KEY, timeout=120, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert chat.status_code == 200 and chat.json()["object"] == "chat.completion"
    body = {"prompt": "The capital of France is", "max_tokens": 2, "temperature": 0}
    completion = httpx.post(url + "/invocations", headers=KEY, timeout=120, json=body)
    assert completion.status_code == 200 and completion.json()["object"] == "text_completion"
    # The same body on /v1/completions gives the same (greedy) text. (The default model has no
    # generation config: without temperature 0 both would be random draws at temperature 1,
    # equal only as long as the server's random stream happened to make them so.)
    direct = httpx.post(url + "/v1/completions", headers=KEY, timeout=120, json=body)
    assert direct.json()["choices"][0]["text"] == completion.json()["choices"][0]["text"]
    neither = httpx.post(url + "/invocations", headers=KEY, json={"input": "x"})
    assert neither.status_code == 400
    assert "ChatCompletionRequest" in neither.json()["error"]["message"]
    bad = httpx.post(url + "/invocations", content=b"{nope",
                     headers={**KEY, "content-type": "application/json"})
    assert bad.status_code == 400 and "malformed JSON" in bad.json()["error"]["message"]


def test_load_counts_requests_in_flight(servers):
    url = servers["extras"].url
    assert httpx.get(url + "/load", headers=KEY).json() == {"server_load": 0}
    body = {"prompt": "Tell me a story.", "max_tokens": 40, "ignore_eos": True,
            "stream": True}
    with httpx.Client(base_url=url, headers=KEY, timeout=120) as h:
        with h.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            next(lines)
            assert h.get("/load").json() == {"server_load": 1}
            list(lines)  # the stream ends
    deadline = time.monotonic() + 10
    while httpx.get(url + "/load", headers=KEY).json()["server_load"] != 0:
        assert time.monotonic() < deadline, "the load never went back to 0"
        time.sleep(0.05)


def test_reset_prefix_cache(servers):
    url = servers["extras"].url
    r = httpx.post(url + "/reset_prefix_cache", headers=KEY)
    assert r.status_code == 200 and r.json() == {"success": True}
    body = {"prompt": "Tell me a story.", "max_tokens": 240, "ignore_eos": True,
            "stream": True}
    with httpx.Client(base_url=url, headers=KEY, timeout=120) as h:
        with h.stream("POST", "/v1/completions", json=body) as s:
            lines = s.iter_lines()
            assert next(line for line in lines if line).startswith("data: {")
            # A running request holds blocks: nothing is dropped, and the request carries on.
            assert h.post("/reset_prefix_cache").json() == {"success": False}
            assert next(line for line in lines if line).startswith("data: {")
        # The client hung up: the request is aborted, its blocks freed, and a reset succeeds.
        deadline = time.monotonic() + 30
        while h.post("/reset_prefix_cache").json() != {"success": True}:
            assert time.monotonic() < deadline, "the prefix cache was never reset"
            time.sleep(0.1)
    for param in ("reset_running_requests", "reset_external"):
        refused = httpx.post(url + f"/reset_prefix_cache?{param}=true", headers=KEY)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param


def test_tokenizer_info(servers):
    info = httpx.get(servers["extras"].url + "/tokenizer_info", headers=KEY).json()
    assert info["tokenizer_class"]
    assert info["chat_template"] == PARTS_TEMPLATE  # the server's --chat-template
    assert "vocab_file" not in info and "merges_file" not in info
    # Off unless asked for, as in vLLM.
    assert httpx.get(servers["tiny_kv"].url + "/tokenizer_info").status_code == 404


def test_content_format_auto_detects_openai_parts(servers):
    msgs = [{"role": "user", "content": [{"type": "text", "text": "hi"},
                                         {"type": "text", "text": "there"}]}]
    with httpx.Client(base_url=servers["extras"].url, headers=KEY, timeout=120) as h:
        # The template loops over content parts: auto chose OpenAI's list form.
        ids = h.post("/tokenize", json={"messages": msgs}).json()["tokens"]
        text = h.post("/detokenize", json={"tokens": ids}).json()["prompt"]
        assert text == "user:[hi][there]"  # (jinja drops the template's last newline)


def test_generation_config_role_and_max_logprobs(servers):
    url = servers["quiet"].url
    msgs = [{"role": "user", "content": [{"type": "text", "text": "hi"},
                                         {"type": "text", "text": "there"}]}]
    with httpx.Client(base_url=url, timeout=120) as h:
        # max_new_tokens=3 caps the default (what fits) and temperature 0 makes it greedy.
        outs = [h.post("/v1/chat/completions", json={"messages": msgs}).json()
                for _ in range(2)]
        assert outs[0]["choices"][0]["message"]["role"] == "bot"  # --response-role
        assert outs[0]["usage"]["completion_tokens"] <= 3
        assert outs[0]["choices"][0]["message"]["content"] == \
            outs[1]["choices"][0]["message"]["content"]
        # A request's own value beats the generation config's.
        hot = h.post("/v1/completions", json={"prompt": "Once", "max_tokens": 5,
                                              "temperature": 1.0, "seed": 1,
                                              "ignore_eos": True}).json()
        assert hot["usage"]["completion_tokens"] == 3  # min(5, max_new_tokens)
        # Without a generation prompt the answer continues the last message's role.
        cont = h.post("/v1/chat/completions", json={
            "messages": msgs, "add_generation_prompt": False, "max_tokens": 1}).json()
        assert cont["choices"][0]["message"]["role"] == "user"
        # --max-logprobs 3
        ok = h.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1, "logprobs": 3})
        assert ok.status_code == 200
        assert len(ok.json()["choices"][0]["logprobs"]["top_logprobs"][0]) == 3
        over = h.post("/v1/chat/completions", json={"messages": msgs, "logprobs": True,
                                                    "top_logprobs": 4})
        assert over.status_code == 400 and "max allowed: 3" in over.json()["error"]["message"]
        # The SmolLM2 template prints content as a string: auto kept the string form.
        ids = h.post("/tokenize", json={"messages": msgs}).json()["tokens"]
        assert "hi\nthere" in h.post("/detokenize", json={"tokens": ids}).json()["prompt"]


def test_vllm_prefix_and_new_metrics(servers):
    url = servers["extras"].url
    with httpx.Client(base_url=url, headers=KEY, timeout=120) as h:
        h.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2, "n": 2})
        text = h.get("/metrics").text
    assert "pyorch:" not in text
    assert metric(text, "vllm:request_params_n_count") >= 1
    assert metric(text, "vllm:request_params_n_sum") >= 2
    assert metric(text, "vllm:request_params_max_tokens_bucket", le="2.0") >= 1
    assert metric(text, "vllm:iteration_tokens_total_count") >= 2
    assert metric(text, "vllm:iteration_tokens_total_sum") >= \
        metric(text, "vllm:prompt_tokens_total") + metric(text, "vllm:generation_tokens_total")
    assert metric(text, "vllm:request_inference_time_seconds_count") >= 1
    assert metric(text, "vllm:request_inference_time_seconds_sum") >= \
        metric(text, "vllm:request_decode_time_seconds_sum")
    assert metric(text, "vllm:request_prefill_time_seconds_count") >= 1
    assert metric(text, "vllm:cache_config_info", block_size="16", enable_prefix_caching="True",
                  model_name="SmolLM2-135M-Instruct") == 1
    info = next(line for line in text.splitlines() if line.startswith("vllm:cache_config_info"))
    blocks = int(info.split('num_gpu_blocks="')[1].split('"')[0])
    assert blocks > 0


def test_preemptions_are_counted(servers):
    srv = servers["tiny_kv"]
    # 12 usable blocks of 16 tokens: three 60-token prompts fill them (4 blocks each), and the
    # fifth block each needs at its 65th token forces preemptions (no growth reservation);
    # every request still finishes.
    prompts = [[100 + (i * 7 + j) % 500 for j in range(60)] for i in range(3)]

    async def run() -> list[int]:
        async with httpx.AsyncClient(base_url=srv.url, timeout=300) as h:
            async def one(p: list[int]) -> int:
                r = await h.post("/v1/completions", json={"prompt": p, "max_tokens": 8,
                                                          "ignore_eos": True,
                                                          "temperature": 0})
                return r.json()["usage"]["completion_tokens"]

            return await asyncio.gather(*(one(p) for p in prompts))

    assert asyncio.run(run()) == [8] * 3
    with httpx.Client(base_url=srv.url, timeout=60) as h:
        text = wait_for_metrics(h, lambda t: metric(t, "pyorch:kv_cache_usage_perc") == 0.0)
    assert metric(text, "pyorch:num_preemptions_total") > 0
    assert metric(text, "pyorch:cache_config_info", num_gpu_blocks="13") == 1
    # The periodic stats line (every 0.3 s here) reported the activity.
    deadline = time.monotonic() + 10
    while "Avg generation throughput" not in srv.log():
        assert time.monotonic() < deadline, srv.log()
        time.sleep(0.1)


def test_disable_log_stats(servers):
    srv = servers["quiet"]
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2},
                   timeout=120)
    assert r.status_code == 200
    time.sleep(1.0)  # several stats intervals
    assert "pyorch:" not in httpx.get(srv.url + "/metrics").text
    assert "Avg generation throughput" not in srv.log()


def test_refused_and_contradicting_flags_exit_before_loading(tmp_path):
    # (each refusal's message: test_cli_args.py; here, the server's own entry point)
    for flags, message in (
            (["--speculative-config", json.dumps({"method": "ngram"})],
             "--speculative-config {\"method\": \"ngram\"}: speculative decoding"),
            (["--enable-log-requests", "--disable-log-requests"], "contradict")):
        srv = start_server(tmp_path, "refused", flags)
        assert srv.proc.wait(60) == 2
        srv.terminate()
        log = srv.log()
        assert message in log, log
        assert "loaded" not in log  # refused before the model was loaded
