"""Structured output: what it costs per step, and whether its outputs always parse.

Part 1 (`step`): the structured-output work of one decode step at batch 1, 64 and 256, against
plain sampling of the same logits. Plain: the sampler over [batch, vocab] logits. Structured:
xgrammar fills each row's bitmask (the StructuredOutputManager, as the engine core does after
schedule()), the runner's `apply_grammar_bitmask` copies it to the device and masks the logits
with `apply_token_bitmask_inplace`, the sampler runs, and each matcher accepts its sampled token
(update_from_output). The model's forward pass is the same for both and is left out: the ratio
is of the step's sampling work, the part structured output changes. Every row is a JSON-schema
request mid-generation (matchers advance by the tokens they sample; one that terminates is
replaced by a fresh one). Times are medians over `--steps` steps after warm-up, plain and
structured taking turns step by step (so that load on a shared machine falls on both alike); on
CUDA each step ends with a synchronize (the engine waits for a constrained step's tokens anyway).

Part 2 (`validity`): `--num-schemas` random JSON schemas (objects, nested objects, arrays,
enums, bounded integers and strings, booleans, optional keys), each the constraint of one
request of a tiny random-weight Llama with the default model's tokenizer (its logits 40 ids
wider than the tokenizer), run through `LLM.generate` together; every output must parse with
`json` and validate with `jsonschema`. Random weights would fill a JSON string forever, so
string lengths are bounded by the schemas and whitespace is off (`disable_any_whitespace`).

    python bench/structured_output.py --device cpu
    python bench/structured_output.py --device cuda --steps 50 --num-schemas 500

Writes bench/results/<device name>/structured_output.json.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from typing import Any, Callable

import torch

from pyorch.benchmarks import common

PAD = 40


# ---- random schemas -----------------------------------------------------------------------------
def random_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """A random JSON schema that a random-weight model still finishes: every string, array
    and integer is bounded."""
    kinds = ["string", "integer", "boolean", "enum", "null"]
    if depth < 2:
        kinds += ["object", "array"]
    kind = rng.choice(kinds)
    if kind == "string":
        return {"type": "string", "minLength": rng.randint(0, 2), "maxLength": rng.randint(3, 8)}
    if kind == "integer":
        low = rng.randint(-1000, 1000)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 5000)}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "null":
        return {"type": "null"}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", 1, 2.5, True, None, "a b"],
                                   rng.randint(1, 4))}
    if kind == "array":
        return {"type": "array", "items": random_schema(rng, depth + 1),
                "minItems": 0, "maxItems": rng.randint(1, 3)}
    names = rng.sample(["id", "name", "tags", "size", "ok", "kind", "meta", "x_y"],
                       rng.randint(1, 4))
    props = {n: random_schema(rng, depth + 1) for n in names}
    required = [n for n in names if rng.random() < 0.7]
    return {"type": "object", "properties": props, "required": required,
            "additionalProperties": False}


def random_object_schema(rng: random.Random) -> dict[str, Any]:
    schema = random_schema(rng, 1)
    if schema.get("type") != "object":
        schema = {"type": "object", "properties": {"value": schema}, "required": ["value"],
                  "additionalProperties": False}
    return schema


# ---- part 1: per-step cost ----------------------------------------------------------------------
def _interleaved_ms(fns: list[Callable[[], None]], steps: int, warmup: int,
                   sync: Callable[[], None]) -> list[list[float]]:
    """Per function, the milliseconds of each of `steps` runs; the functions take turns, so
    load from other processes on a shared machine falls on all of them alike."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    sync()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(steps):
        for fn, out in zip(fns, times, strict=True):
            start = time.perf_counter()
            fn()
            sync()
            out.append((time.perf_counter() - start) * 1e3)
    return times


def bench_step(tokenizer: Any, device: str, batch_sizes: list[int], steps: int,
               warmup: int, seed: int) -> list[dict[str, Any]]:
    from pyorch.structured_output.manager import StructuredOutputManager

    manager = StructuredOutputManager(lambda: tokenizer, len(tokenizer) + PAD)
    rng = random.Random(seed)
    schemas = [random_object_schema(rng) for _ in range(8)]
    rows = [_bench_batch(tokenizer, manager, schemas, device, batch, steps, warmup, seed)
            for batch in batch_sizes]
    manager.shutdown()
    return rows


def _bench_batch(tokenizer: Any, manager: Any, schemas: list[dict[str, Any]], device: str,
                 batch: int, steps: int, warmup: int, seed: int) -> dict[str, Any]:
    from pyorch.core.request import Request
    from pyorch.layers.sampler import Sampler, SamplingRow, sample_rows
    from pyorch.layers.token_bitmask import apply_grammar_bitmask
    from pyorch.sampling_params import SamplingParams, StructuredOutputsParams
    from pyorch.structured_output.manager import accept_sampled

    vocab_size = manager.vocab_size
    sampler = Sampler()
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    params = [SamplingParams(temperature=1.0, max_tokens=10_000,
                             structured_outputs=StructuredOutputsParams(
                                 json=schemas[i % len(schemas)]))
              for i in range(batch)]

    def new_request(i: int) -> Request:
        request = Request(f"r{i}", [1], params[i], tokenizer.eos_token_id, 0.0)
        manager.grammar_init(request)
        so_request = request.structured_output_request
        assert so_request is not None
        while not so_request.is_ready:
            time.sleep(0.001)
        return request

    requests = {f"r{i}": new_request(i) for i in range(batch)}
    req_ids = list(requests)
    sampling_rows = [SamplingRow(p, [1], []) for p in params]
    g = torch.Generator(device=device).manual_seed(seed)
    logits_src = torch.randn(batch, vocab_size, device=device, generator=g)
    logits = torch.empty_like(logits_src)

    def plain() -> None:
        logits.copy_(logits_src)
        sample_rows(sampler, logits, sampling_rows).sampled_token_ids.tolist()

    def structured() -> None:
        logits.copy_(logits_src)
        grammar = manager.grammar_bitmask(requests, req_ids)
        assert grammar is not None
        apply_grammar_bitmask(logits, req_ids, grammar)
        tokens = sample_rows(sampler, logits, sampling_rows).sampled_token_ids.tolist()
        pending = []
        for i, (req_id, token) in enumerate(zip(req_ids, tokens, strict=True)):
            so_request = requests[req_id].structured_output_request
            assert so_request is not None and so_request.grammar is not None
            if token == tokenizer.eos_token_id or so_request.grammar.is_terminated():
                requests[req_id] = new_request(i)  # finished: a fresh request takes the row
            else:
                pending.append((req_id, so_request, [token]))
        accept_sampled(pending)  # as Scheduler.update_from_output advances the matchers

    plain_runs, structured_runs = _interleaved_ms([plain, structured], steps, warmup, sync)
    plain_ms, structured_ms = common.median(plain_runs), common.median(structured_runs)
    row = {"batch": batch, "vocab_size": vocab_size, "plain_ms": plain_ms,
           "structured_ms": structured_ms, "overhead_ms": structured_ms - plain_ms,
           "ratio": structured_ms / plain_ms,
           "ratio_of_step_medians": common.median(
               [b / a for a, b in zip(plain_runs, structured_runs, strict=True)]),
           "plain_runs_ms": plain_runs, "structured_runs_ms": structured_runs}
    print(f"bench=structured_output_step device={device} batch={batch} "
          f"plain_ms={plain_ms:.3f} structured_ms={structured_ms:.3f} "
          f"ratio={row['ratio']:.2f}")
    return row


# ---- part 2: validity ---------------------------------------------------------------------------
def bench_validity(tokenizer: Any, device: str, num_schemas: int, seed: int,
                   max_tokens: int) -> dict[str, Any]:
    import jsonschema
    import transformers

    from pyorch import LLM, SamplingParams
    from pyorch.sampling_params import StructuredOutputsParams

    rng = random.Random(seed + 1)
    schemas = [random_object_schema(rng) for _ in range(num_schemas)]
    with tempfile.TemporaryDirectory() as path:
        torch.manual_seed(0)
        config = transformers.LlamaConfig(
            vocab_size=len(tokenizer) + PAD, hidden_size=128, intermediate_size=256,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            max_position_embeddings=1024, tie_word_embeddings=False,
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
        tokenizer.save_pretrained(path)
        # float32 on the CPU; the CUDA attention kernels take 16-bit activations
        dtype = torch.float32 if device == "cpu" else torch.bfloat16
        llm = LLM(path, device=device, dtype=dtype, max_model_len=1024, seed=seed,
                  kv_cache_memory_bytes=256 << 20, gpu_memory_utilization=0.3,
                  max_num_seqs=min(256, num_schemas))
        params = [SamplingParams(temperature=1.0, seed=seed + i, max_tokens=max_tokens,
                                 structured_outputs=StructuredOutputsParams(
                                     json=s, disable_any_whitespace=True))
                  for i, s in enumerate(schemas)]
        start = time.perf_counter()
        outs = llm.generate([f"JSON {i}:" for i in range(num_schemas)], params, use_tqdm=False)
        elapsed = time.perf_counter() - start
    failures = []
    num_length = 0
    num_tokens = 0
    for schema, out in zip(schemas, outs, strict=True):
        c = out.outputs[0]
        num_tokens += len(c.token_ids)
        if c.finish_reason != "stop":
            num_length += 1
            failures.append({"schema": schema, "text": c.text, "error": c.finish_reason})
            continue
        try:
            jsonschema.validate(json.loads(c.text), schema)
        except (ValueError, jsonschema.ValidationError) as e:
            failures.append({"schema": schema, "text": c.text, "error": str(e)[:300]})
    result = {"num_schemas": num_schemas, "num_valid": num_schemas - len(failures),
              "num_finished_by_length": num_length, "num_output_tokens": num_tokens,
              "elapsed_s": elapsed, "failures": failures[:10]}
    print(f"bench=structured_output_validity device={device} schemas={num_schemas} "
          f"valid={result['num_valid']} length_capped={num_length} tokens={num_tokens} "
          f"time_s={elapsed:.1f}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    parser.add_argument("--batch-sizes", default="1,64,256")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--num-schemas", type=int, default=100)
    parser.add_argument("--max-tokens", type=int, default=600)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-json", default=None)
    parser.add_argument("--tokenizer", default=None,
                        help="a tokenizer folder (default: the default model's, from its GGUF)")
    args = parser.parse_args()
    device = common.resolve_device(args.device)

    from pyorch.model_loader import default_model_path, get_tokenizer

    tokenizer = get_tokenizer(args.tokenizer or default_model_path())
    step_rows = bench_step(tokenizer, device, common.parse_int_list(args.batch_sizes),
                           args.steps, args.warmup, args.seed)
    validity = bench_validity(tokenizer, device, args.num_schemas, args.seed, args.max_tokens)
    path, _ = common.output_paths("structured_output", device, args.output_json)
    common.write_json(path, {"bench": "structured_output", "args": common.args_dict(args),
                             "env": common.environment(device), "step": step_rows,
                             "validity": validity})
    if validity["num_valid"] != validity["num_schemas"]:
        raise SystemExit(f"{validity['num_schemas'] - validity['num_valid']} outputs did not "
                         "parse or match their schema")


if __name__ == "__main__":
    main()
