"""Host (CPU) time per engine step by phase, with the model's device work stubbed out.

    python bench/probes/host_step.py --model /tmp/tinyllama --num-prompts 1000 --input-len 128 \
        --output-len 128 --max-num-seqs 1024 [--async-scheduling] [--profile]

The model's forward returns zeros and its logits are slices of one fixed random table over a
small vocabulary (--stub-vocab), so what is left is the engine's own Python: schedule, prepare,
launch (sampling metadata, sampler calls), update and output (detokenization, RequestOutputs).
Prints StepTimings per step over all steps and over the decode steps at the full batch only.
A developer's tool: `pyorch bench throughput` gives the figures to report on a GPU.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

from pyorch import LLM, SamplingParams
from pyorch.sampling_params import RequestOutputKind
from pyorch.metrics.stats import StepTimings


def _stub_model(llm: LLM, vocab: int, max_rows: int) -> None:
    runner = llm.llm_engine.engine_core.model_runner
    model = runner.model
    hidden_size = int(runner.model_config.hf_config.hidden_size)
    table = torch.randn(max_rows + 97, vocab, generator=torch.Generator().manual_seed(0))
    calls = [0]

    hidden = torch.zeros(runner.max_num_tokens, hidden_size)

    def forward(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return hidden[: input_ids.shape[0]]

    def compute_logits(hidden: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        offset = calls[0] % 97
        return table[offset : offset + hidden.shape[0]]

    model.forward = forward
    model.compute_logits = compute_logits


def _phases(after: StepTimings, before: StepTimings) -> str:
    ms = after.per_step_ms(before)
    parts = " ".join(f"{k} {ms[k]:.2f}" for k in StepTimings.PHASES if k != "wait")
    return f"{ms['steps']} steps, host {ms['host']:.2f} ms/step: {parts}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="/tmp/tinyllama")
    parser.add_argument("--num-prompts", type=int, default=1000)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=1024)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--stub-vocab", type=int, default=2048)
    parser.add_argument("--async-scheduling", action="store_true")
    parser.add_argument("--repeats", type=int, default=3, help="runs; the fastest is shown")
    parser.add_argument("--profile", action="store_true", help="cProfile the decode steps")
    parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args()

    llm = LLM(args.model, load_format="dummy", dtype="float32", max_num_seqs=args.max_num_seqs,
              max_model_len=args.input_len + args.output_len + 16,
              async_scheduling=args.async_scheduling)
    _stub_model(llm, args.stub_vocab, args.max_num_seqs)
    gen = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(100, args.stub_vocab, (args.input_len,),
                                                  generator=gen).tolist()}
               for _ in range(args.num_prompts)]
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True,
                            temperature=args.temperature, top_p=1.0,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    llm.generate(prompts[:8], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)

    engine = llm.llm_engine
    core = engine.engine_core
    profiler = cProfile.Profile() if args.profile else None
    engine_step = engine.step
    decode = StepTimings()

    def step():  # LLM.generate's steps, timed by phase; full-batch decode steps apart
        full_decode = (len(core.scheduler.running) >= min(args.num_prompts, args.max_num_seqs)
                       and not core.scheduler.waiting
                       and all(r.num_computed_tokens >= r.num_prompt_tokens
                               for r in core.scheduler.running))
        before = core.timings.snapshot()
        if profiler is not None and full_decode:
            profiler.enable()
        outputs = engine_step()
        if profiler is not None:
            profiler.disable()
        if full_decode:
            for k in StepTimings.PHASES + ("steps",):
                setattr(decode, k, getattr(decode, k) + getattr(core.timings, k)
                        - getattr(before, k))
        return outputs

    engine.step = step
    print(f"{args.num_prompts} prompts {args.input_len}/{args.output_len}, async "
          f"{args.async_scheduling}, temperature {args.temperature}")
    best: tuple[float, str, str] | None = None
    for _ in range(args.repeats):
        llm.reset_prefix_cache()
        decode.__init__()
        first = core.timings.snapshot()
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        assert sum(len(o.outputs[0].token_ids) for o in outputs) == (
            args.num_prompts * args.output_len)
        host = decode.per_step_ms(StepTimings())["host"]
        lines = (_phases(core.timings, first), _phases(decode, StepTimings()))
        print(f"  {elapsed:.2f} s; decode host {host:.2f} ms/step")
        if best is None or host < best[0]:
            best = (host, *lines)
    assert best is not None
    print(f"best of {args.repeats} runs (by decode host time):")
    print("all steps:   ", best[1])
    print("full decode: ", best[2])
    if profiler is not None:
        stats = pstats.Stats(profiler)
        stats.sort_stats("tottime").print_stats(args.top)
        stats.print_callees("execute_model|update_from_output|process_outputs|resolve")

if __name__ == "__main__":
    main()
