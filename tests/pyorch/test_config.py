"""ModelConfig's vLLM settings (pyorch/config.py) and what the offline LLM does with them:
generation-config defaults, max_logprobs, download_dir (a hub id found in a local folder, with
the hub offline) and tokenizer_mode. Tiny random-weight Llama, CPU."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from pyorch import LLM, SamplingParams
from pyorch.config import ModelConfig
from tests.pyorch.engine.test_async_llm import make_tiny_model

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    from tests.pyorch.model_loader.test_tokenizer import _tiny_tokenizer_dir

    folder = tmp_path_factory.mktemp("tiny")
    _tiny_tokenizer_dir(folder, "PreTrainedTokenizerFast")
    path = make_tiny_model(folder)
    (folder / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.25, "top_k": 7, "top_p": 0.5, "max_new_tokens": 6, "do_sample": True,
         "bos_token_id": 1, "eos_token_id": 2}))
    return path


def _llm(path: str, **kwargs) -> LLM:
    return LLM(path, dtype=torch.float32, max_model_len=256, seed=0, device="cpu",
               kv_cache_memory_bytes=16 << 20, **kwargs)


def test_generation_config_rules(tiny, tmp_path):
    auto = ModelConfig(model=tiny)
    assert auto.get_diff_sampling_param() == {"temperature": 0.25, "top_k": 7, "top_p": 0.5,
                                              "max_tokens": 6}
    assert ModelConfig(model=tiny, generation_config="vllm").get_diff_sampling_param() == {}
    override = ModelConfig(model=tiny, generation_config="vllm",
                           override_generation_config={"temperature": 0.0, "min_p": 0.1,
                                                       "max_new_tokens": 2, "num_beams": 4})
    assert override.get_diff_sampling_param() == {"temperature": 0.0, "min_p": 0.1,
                                                  "max_tokens": 2}
    other = tmp_path / "gen"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"repetition_penalty": 1.3}))
    folder = ModelConfig(model=tiny, generation_config=str(other))
    assert folder.get_diff_sampling_param() == {"repetition_penalty": 1.3}
    with pytest.raises(ValueError, match="generation_config.json"):
        ModelConfig(model=tiny, generation_config=str(tmp_path / "nowhere")).resolve()


def test_llm_uses_generation_config_defaults(tiny):
    plain = _llm(tiny)
    defaults = plain.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_k, defaults.top_p, defaults.max_tokens) == \
        (0.25, 7, 0.5, 6)
    llm = _llm(tiny, override_generation_config={"temperature": 0.0})
    assert llm.get_default_sampling_params().temperature == 0.0  # greedy (top_k/top_p moot)
    prompt = {"prompt_token_ids": [5, 6, 7, 8]}
    out = llm.generate([prompt], use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) <= 6
    greedy = SamplingParams(temperature=0.0, max_tokens=6)
    assert llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids == \
        out.token_ids
    vllm_defaults = _llm(tiny, generation_config="vllm").get_default_sampling_params()
    assert (vllm_defaults.temperature, vllm_defaults.max_tokens) == \
        (SamplingParams().temperature, SamplingParams().max_tokens)
    # reset_prefix_cache: False (nothing dropped) while a request holds blocks, else True.
    engine = llm.llm_engine
    engine.add_request("held", prompt, SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    assert llm.reset_prefix_cache() is False
    engine.abort_request("held")
    assert llm.reset_prefix_cache() is True


def test_max_logprobs(tiny):
    llm = _llm(tiny, max_logprobs=2, skip_tokenizer_init=True)
    prompt = {"prompt_token_ids": [5, 6, 7]}
    out = llm.generate([prompt], SamplingParams(max_tokens=1, logprobs=2), use_tqdm=False)[0]
    assert len(out.outputs[0].logprobs[0]) >= 2
    for params in (SamplingParams(max_tokens=1, logprobs=3),
                   SamplingParams(max_tokens=1, prompt_logprobs=3),
                   SamplingParams(max_tokens=1, logprobs=-1)):
        with pytest.raises(ValueError, match="greater than max allowed: 2"):
            llm.generate([prompt], params, use_tqdm=False)
    uncapped = _llm(tiny, max_logprobs=-1, skip_tokenizer_init=True)
    full = uncapped.generate([prompt], SamplingParams(max_tokens=1, logprobs=-1),
                             use_tqdm=False)[0]
    assert len(full.outputs[0].logprobs[0]) == 512  # the whole vocabulary
    with pytest.raises(ValueError, match="max_logprobs"):
        ModelConfig(model=tiny, max_logprobs=-2).resolve()


def test_download_dir_finds_a_hub_model_offline(tiny, tmp_path, monkeypatch):
    # The layout huggingface_hub keeps: models--ORG--NAME/{refs/main, snapshots/<commit>/...}.
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "models--pyorch-test--tiny"
    shutil.copytree(tiny, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    llm = _llm("pyorch-test/tiny", download_dir=str(tmp_path))
    config = llm.llm_engine.config.model_config
    assert config.model == str(repo / "snapshots" / commit)
    assert config.tokenizer == config.model
    ids = llm.get_tokenizer().encode("hello world", add_special_tokens=False)
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=2),
                       use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) <= 2
    with pytest.raises(FileNotFoundError, match="--download-dir"):
        ModelConfig(model="pyorch-test/missing", download_dir=str(tmp_path)).resolve()


def test_tokenizer_mode(tiny):
    from pyorch.model_loader import default_model_path, get_tokenizer

    assert get_tokenizer(tiny, tokenizer_mode="hf").is_fast
    # transformers 5 builds this tokenizer only as a fast one: 'slow' says so, no fallback.
    with pytest.raises(ValueError, match="no slow"):
        get_tokenizer(tiny, tokenizer_mode="slow")
    with pytest.raises(ValueError, match="GGUF"):
        get_tokenizer(default_model_path(), tokenizer_mode="slow")
    with pytest.raises(ValueError, match="tokenizer_mode 'mistral' is not supported"):
        ModelConfig(model=tiny, tokenizer_mode="mistral").resolve()


def test_cache_config_kv_cache_dtype():
    from pyorch.config import CacheConfig, kv_cache_torch_dtype

    for value in ("auto", "fp8", "fp8_e4m3"):
        CacheConfig(cache_dtype=value).validate()
    assert kv_cache_torch_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert kv_cache_torch_dtype("fp8", torch.bfloat16) == torch.uint8  # e4m3 bytes
    assert kv_cache_torch_dtype("fp8_e4m3", torch.float16) == torch.uint8
    with pytest.raises(ValueError, match=r"'fp8_e5m2' is not supported.*e4m3 only"):
        CacheConfig(cache_dtype="fp8_e5m2").validate()
    with pytest.raises(ValueError, match="'float16' is not supported; expected one of auto"):
        CacheConfig(cache_dtype="float16").validate()
