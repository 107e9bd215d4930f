"""CPU microbenchmark of the prefix-cache path, per request, through `KVCacheManager`.

For prompts of 128 .. 32k tokens (block size 16) it times what the scheduler does for one request:

- `miss`: a prompt nobody cached: lookup (`get_computed_blocks`), allocation, caching the
  prompt's full blocks once computed (`cache_blocks`) and freeing them;
- `hit`: the same prompt again: lookup (every block found), taking the hit blocks, caching the
  (already cached) blocks and freeing;
- `lookup_miss` / `lookup_hit`: the lookup alone, as the scheduler repeats it for a waiting
  request that cannot be admitted yet.

Prints one line per length (`us_per_request`, median of --repeats rounds) and writes JSON (default
`bench/results/cpu/prefix_cache.json`). No model and no torch work: it needs `pyorch._C` only.

    python bench/prefix_cache_cpu.py [--lengths 128,1024,8192,32768] [--repeats 7]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import time
from typing import Any, Callable

from pyorch.core.kv_cache_manager import KVCacheManager
from pyorch.core.request import Request
from pyorch.sampling_params import SamplingParams

DEFAULT_LENGTHS = [128, 512, 2048, 8192, 32768]
BLOCK_SIZE = 16


_PARAMS = SamplingParams(max_tokens=1)


def _request(req_id: str, tokens: list[int]) -> Request:
    return Request(req_id, tokens, _PARAMS, None, 0.0)


def _time_us(fn: Callable[[], None], number: int, repeats: int) -> float:
    """Median over `repeats` rounds of the mean microseconds of one `fn()` call."""
    rounds = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(number):
            fn()
        rounds.append((time.perf_counter() - start) / number * 1e6)
    return statistics.median(rounds)


def measure(length: int, repeats: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed + length)
    num_blocks = 4 * (length // BLOCK_SIZE + 2) + 1
    kv = KVCacheManager(num_blocks, BLOCK_SIZE, enable_caching=True)
    number = max(1, 200_000 // length)
    counter = iter(range(10**9))

    def full_cycle(tokens: list[int]) -> None:
        req = _request(f"r{next(counter)}", tokens)
        hit_blocks, num_hit = kv.get_computed_blocks(req)
        assert kv.allocate_slots(req, req.num_tokens - num_hit, num_hit, hit_blocks) is not None
        req.num_computed_tokens = req.num_tokens
        kv.cache_blocks(req, req.num_tokens)
        kv.free(req)

    def fresh_prompt() -> list[int]:
        return [rng.randrange(1, 32000) for _ in range(length)]

    # Every timed miss needs a prompt nobody cached: one per call of every round.
    fresh_iter = iter([fresh_prompt() for _ in range(number * repeats)])

    def miss() -> None:
        full_cycle(next(fresh_iter))

    shared = fresh_prompt()
    full_cycle(shared)  # cached from now on

    def hit() -> None:
        full_cycle(shared)

    probe_miss = _request("probe-miss", fresh_prompt())
    probe_hit = _request("probe-hit", shared)
    row = {
        "prompt_tokens": length,
        "miss_us_per_request": _time_us(miss, number, repeats),
        "hit_us_per_request": _time_us(hit, number, repeats),
        "lookup_miss_us": _time_us(lambda: kv.get_computed_blocks(probe_miss), number, repeats),
        "lookup_hit_us": _time_us(lambda: kv.get_computed_blocks(probe_hit), number, repeats),
    }
    blocks, num_hit = kv.get_computed_blocks(probe_hit)
    assert num_hit == (length - 1) // BLOCK_SIZE * BLOCK_SIZE, (num_hit, length)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", default=",".join(map(str, DEFAULT_LENGTHS)))
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-json", default=os.path.join("bench", "results", "cpu",
                                                               "prefix_cache.json"))
    args = parser.parse_args()
    rows = []
    for length in (int(v) for v in args.lengths.split(",")):
        row = measure(length, args.repeats, args.seed)
        rows.append(row)
        print(f"prompt_tokens={length} miss_us_per_request={row['miss_us_per_request']:.1f} "
              f"hit_us_per_request={row['hit_us_per_request']:.1f} "
              f"lookup_miss_us={row['lookup_miss_us']:.1f} "
              f"lookup_hit_us={row['lookup_hit_us']:.1f}")
    doc = {"benchmark": "prefix_cache_cpu", "block_size": BLOCK_SIZE,
           "env": {"cpu": platform.processor() or platform.machine(),
                   "python": platform.python_version()},
           "rows": rows}
    os.makedirs(os.path.dirname(args.output_json) or ".", exist_ok=True)
    with open(args.output_json, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"wrote {args.output_json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
