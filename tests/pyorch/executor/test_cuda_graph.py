"""CUDA graphs of the forward pass: capture sizes, and graph replay against eager execution."""

from __future__ import annotations

import gc

import pytest
import torch

from pyorch.executor.cuda_graph import (
    CUDAGraphRunner,
    default_capture_sizes,
    graph_pool_bytes,
    default_max_mixed_size,
    normalize_capture_sizes,
)
from tests.conftest import CUDA_AVAILABLE

transformers = pytest.importorskip("transformers")


def test_default_capture_sizes():
    assert default_capture_sizes(256, 8192)[:5] == [1, 2, 4, 8, 16]
    assert default_capture_sizes(256, 8192)[-1] == 512
    assert default_capture_sizes(4, 8192) == [1, 2, 4, 8]  # up to 2 * max_num_seqs
    assert default_capture_sizes(256, 100)[-1] == 100  # within the token budget, which is covered
    assert default_capture_sizes(3, 8192) == [1, 2, 4, 6]
    # Beyond 512 up to max_num_seqs, so a decode of every sequence replays a graph.
    big = default_capture_sizes(1024, 16384)
    assert big[-1] == 1024 and 512 in big and 528 not in big and 544 in big
    assert 1008 not in big and 992 in big  # multiples of 32 past 512: 1,000 rows pad to 1,024
    assert default_capture_sizes(1000, 16384)[-2:] == [992, 1000]  # the largest batch itself
    assert default_capture_sizes(1, 1) == [1]


def test_graph_pool_bytes_sums_the_pools_segments(monkeypatch):
    """Graph memory is what the allocator's snapshot holds in the graphs' pool on this device,
    not other pools' segments or another device's."""
    segments = [
        {"device": 0, "segment_pool_id": (0, 7), "total_size": 2 << 20},
        {"device": 0, "segment_pool_id": (0, 7), "total_size": 20 << 20},
        {"device": 0, "segment_pool_id": (0, 0), "total_size": 64 << 20},  # the default pool
        {"device": 1, "segment_pool_id": (0, 7), "total_size": 8 << 20},
    ]
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda: segments)
    assert graph_pool_bytes((0, 7), torch.device("cuda", 0)) == 22 << 20
    assert graph_pool_bytes((0, 7), torch.device("cuda", 1)) == 8 << 20
    assert graph_pool_bytes((0, 9), torch.device("cuda", 0)) == 0


def test_normalize_capture_sizes():
    assert normalize_capture_sizes([8, 1, 8, 4096, 2], 1024) == [1, 2, 8]
    with pytest.raises(ValueError, match="positive"):
        normalize_capture_sizes([0, 4], 1024)


def test_decode_and_mixed_graph_choice():
    """Decode-only steps take decode graphs (up to max_num_seqs), mixed steps mixed graphs (up to
    the mixed limit); what no captured graph covers runs eagerly."""
    sizes = default_capture_sizes(1024, 16384)
    runner = CUDAGraphRunner(lambda *a: None, sizes, 1024, 2048, torch.device("cpu"),
                             max_mixed_size=default_max_mixed_size(1024))
    assert runner.mixed_sizes[-1] == 256 and runner.decode_sizes[-1] == 1024
    # Pretend every graph was captured (capture needs a GPU; the choice does not); the size-1
    # mixed graph is the decode graph too (capture shares it).
    runner.graphs = {s: object() for s in runner.mixed_sizes}
    runner.decode_graphs = {s: object() for s in runner.decode_sizes}
    runner.decode_graphs[1] = runner.graphs[1]
    assert runner.padded_size(1000, decode_only=True) == 1024
    assert runner.padded_size(1000, decode_only=False) is None  # a mixed batch of 1000: eager
    assert runner.padded_size(300, decode_only=False) is None  # past the mixed limit: eager
    assert runner.padded_size(250, decode_only=False) == 256
    assert runner.padded_size(300, decode_only=True) == 304
    assert runner.padded_size(1, decode_only=True) == 1
    assert runner.graph_for(1, True) is runner.graphs[1]
    assert runner.graph_for(8, True) is runner.decode_graphs[8]
    assert runner.graph_for(8, False) is runner.graphs[8]
    assert runner.num_graphs == len(runner.mixed_sizes) + len(runner.decode_sizes) - 1
    # A user's list: mixed graphs at every size, decode graphs only up to max_num_seqs.
    user = CUDAGraphRunner(lambda *a: None, [1, 2, 4, 8, 64], 4, 2048, torch.device("cpu"))
    assert user.mixed_sizes == [1, 2, 4, 8, 64] and user.decode_sizes == [1, 2, 4]
    user.graphs = {s: object() for s in user.mixed_sizes}
    user.decode_graphs = {s: object() for s in user.decode_sizes}
    assert user.padded_size(3, decode_only=True) == 4
    assert user.graph_for(4, True) is user.decode_graphs[4]
    assert user.padded_size(65, decode_only=True) is None


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama_graphs")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, head_dim=64, max_position_embeddings=1024,
        initializer_range=0.1, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return str(path)


def _prompts(lens: list[int], seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in lens]


def _llm(path: str, eager: bool, **kw):
    from pyorch import LLM

    return LLM(path, skip_tokenizer_init=True, dtype=torch.bfloat16, max_model_len=1024, seed=0,
               kv_cache_memory_bytes=64 << 20, max_num_seqs=16, max_num_batched_tokens=1024,
               enforce_eager=eager, cuda_graph_sizes=[1, 2, 4, 8, 16, 32, 64], **kw)


@pytest.mark.skipif(not CUDA_AVAILABLE, reason="CUDA graphs need a GPU")
def test_graph_replay_matches_eager(tiny_llama):
    from pyorch import SamplingParams

    # Lengths straddle the capture sizes: 1..64 tokens replay a graph, 100 runs eagerly.
    prompts = _prompts([1, 5, 16, 33, 64, 100])
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=0)
    graphed = _llm(tiny_llama, eager=False)
    runner = graphed.llm_engine.model_runner
    assert runner.cuda_graphs is not None and sorted(runner.cuda_graphs.graphs) == [
        1, 2, 4, 8, 16, 32, 64]
    assert runner.cuda_graphs.capture_seconds > 0
    assert runner.cuda_graphs.pool_bytes > 0  # the graphs' activations live in their pool
    graphs = runner.cuda_graphs
    assert sorted(graphs.decode_graphs) == [1, 2, 4, 8, 16]  # up to max_num_seqs
    assert graphs.decode_graphs[1] is graphs.graphs[1] and graphs.num_graphs == 7 + 4
    outs = graphed.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
    assert runner.cuda_graphs.num_replays > 0
    # The six sequences' joint decode steps replay the decode graph of 8: checked below.
    assert runner.cuda_graphs.num_decode_replays > 0
    # A prefill alone (33 tokens) replays the 64-token graph: its prompt logprobs are checked too.
    check = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    before = runner.cuda_graphs.num_replays
    graph_prefill = graphed.generate([{"prompt_token_ids": prompts[3]}], check, use_tqdm=False)[0]
    assert runner.cuda_graphs.num_replays == before + 1
    del graphed, runner
    gc.collect()
    torch.cuda.empty_cache()

    # Teacher-forced check of every generated token with the eager engine: the logprob the graph
    # run reported for its token equals the eager engine's prompt logprob at that position.
    eager = _llm(tiny_llama, eager=True)
    assert eager.llm_engine.model_runner.cuda_graphs is None
    ref = eager.generate([{"prompt_token_ids": prompts[3]}], check, use_tqdm=False)[0]
    for pos in range(1, len(prompts[3])):
        token = prompts[3][pos]
        assert graph_prefill.prompt_logprobs[pos][token].logprob == pytest.approx(
            ref.prompt_logprobs[pos][token].logprob, abs=0.05)
    for prompt, out in zip(prompts, outs):
        comp = out.outputs[0]
        full = prompt + comp.token_ids
        ref = eager.generate([{"prompt_token_ids": full}], check, use_tqdm=False)[0]
        for i, token in enumerate(comp.token_ids):
            got = comp.logprobs[i][token].logprob
            want = ref.prompt_logprobs[len(prompt) + i][token].logprob
            assert got == pytest.approx(want, abs=0.05), (len(prompt), i)
