"""Each CUDA MoE expert path, end to end: greedy output of the tiny Mixtral / Qwen2-MoE / Qwen3-MoE
models against transformers with one path forced for every batch.

fused_experts picks among three CUDA paths by batch size (pyorch/layers/fused_moe/fused_moe.py):
the decode kernel pair (few tokens), the CUTLASS grouped GEMMs (64 tokens and more, bf16) and the
mma.sync `fused_moe_gemm` pair (everything else: float16, 33..63-token Mixtral batches, builds
without CUTLASS, shapes the TMA loads refuse). test_llm.py runs whichever the batch sizes pick, so
the fallback pair is barely exercised there; here each path serves prefill and decode alike.
On the CPU there is one path (the CPU twins), which test_llm.py covers: this file is GPU-only.
"""

from __future__ import annotations

import pytest
import torch

from pyorch import _ops
from pyorch.layers.fused_moe import fused_moe as fm
from tests.conftest import CUDA_AVAILABLE
from tests.pyorch.entrypoints.test_llm import (
    MAX_TOKENS,
    _assert_greedy_matches,
    _assert_pool_empty,
    _greedy,
    _make_llm,
    _prompts,
    _tiny_config,
)

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.skipif(not CUDA_AVAILABLE, reason="the CUDA MoE paths need a GPU")


@pytest.fixture(scope="module", params=["mixtral", "qwen2_moe", "qwen3_moe"])
def tiny_moe(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"tiny_{request.param}")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        _tiny_config(request.param), torch_dtype=torch.float32)
    model.save_pretrained(path, safe_serialization=True)
    return str(path), model


def _force(monkeypatch, path: str) -> dict:
    """Route every fused_experts call to one path; returns the engine arguments it needs."""
    if path == "fused_moe_gemm":
        monkeypatch.setattr(fm, "moe_decode_block_size", lambda *a: None)
        monkeypatch.setattr(fm, "_use_grouped_gemm", lambda *a: False)
        return {}
    if path == "grouped":
        if not _ops.moe_grouped_gemm_available():
            pytest.skip("this build has no CUTLASS grouped GEMM")
        monkeypatch.setattr(fm, "moe_decode_block_size", lambda *a: None)
        monkeypatch.setattr(fm, "GROUPED_GEMM_MIN_TOKENS", 1)
        return {}
    assert path == "decode_pair"  # its kernel's limit is 128 tokens: steps of at most 128
    monkeypatch.setattr(fm, "MOE_DECODE_MAX_PAIRS_PER_EXPERT", 1 << 20)
    return {"max_num_batched_tokens": fm.MOE_DECODE_MAX_TOKENS}


# The expert op each path launches (pyorch/_ops.py).
_PATH_OPS = {"fused_moe_gemm": "fused_moe_gemm", "grouped": "moe_grouped_gemm",
             "decode_pair": "fused_moe_decode"}


@pytest.mark.parametrize("chunked", [False, True], ids=["whole", "chunked16"])
@pytest.mark.parametrize("path", list(_PATH_OPS))
def test_greedy_matches_transformers_on_each_moe_path(tiny_moe, path, chunked, monkeypatch):
    model_path, hf = tiny_moe
    kwargs = _force(monkeypatch, path)
    if chunked:
        kwargs["max_num_batched_tokens"] = 16
    calls = {name: 0 for name in _PATH_OPS.values()}
    def counting(name: str, real):
        def counted(*args):
            calls[name] += 1
            return real(*args)
        return counted

    for name in calls:  # count launches (eager steps and CUDA-graph captures)
        monkeypatch.setattr(_ops, name, counting(name, getattr(_ops, name)))
    llm = _make_llm(model_path, **kwargs)
    prompts = _prompts(hf.config.vocab_size)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(), use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        _assert_greedy_matches(hf, prompt, out.outputs[0].token_ids, MAX_TOKENS)
    _assert_pool_empty(llm)
    assert calls[_PATH_OPS[path]] > 0 and sum(calls.values()) == calls[_PATH_OPS[path]], calls
