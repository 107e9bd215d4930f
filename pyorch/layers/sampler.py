"""Batched next-token sampling (vLLM v1's Sampler), pure torch on the logits' device.

Per step the model runner builds a `SamplingMetadata` from one `SamplingRow` per sampled request
(rows in batch order) and calls `Sampler()(logits, metadata)`. The order is vLLM v1's:

1. raw logprobs of the model's distribution, if a row asks for logprobs;
2. in float32: allowed_token_ids, bad_words, min_tokens (stop tokens masked), logit_bias;
3. penalties: repetition (prompt + output), frequency and presence (output);
4. greedy rows take the argmax; random rows get temperature, min_p, top_k / top_p, then are
   sampled by the exponential race argmax(probs / q), q ~ Exp(1). A seeded row draws its q from
   its own generator, so its tokens depend only on its seed and its own logits. A random row
   whose only knob is the temperature (vLLM's benchmark sampling, plain chat requests) is drawn
   by one kernel instead (`fused_draw`: Philox noise; over the raw logits, with no float32 copy,
   when no row of the batch edits them);
5. top-N logprobs plus the sampled token's logprob and rank (from step 1).

Only seeded rows loop (one noise draw each); sparse per-row inputs (bad words, min_tokens,
logit_bias, allowed ids) become index tensors on the CPU, applied with one indexed write each.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch
from torch import nn

from pyorch import _ops, envs
from pyorch.core_types import LogprobsLists
from pyorch.sampling_params import SamplingParams

_SAMPLING_EPS = 1e-5


class LogprobsTensors(NamedTuple):
    """Logprobs of the sampled (or, for prompts, actual next) token and the top-N tokens.

    Column 0 holds the chosen token; columns 1..N the top-N in descending order (N is the
    batch's max; `pyorch.engine.logprobs` cuts each request down to its own N).
    """

    logprob_token_ids: torch.Tensor  # [num_rows, num_logprobs + 1] int64
    logprobs: torch.Tensor  # [num_rows, num_logprobs + 1] float32
    selected_token_ranks: torch.Tensor  # [num_rows] int64

    def tolists(self) -> LogprobsLists:
        return LogprobsLists(
            self.logprob_token_ids.cpu().tolist(),
            self.logprobs.cpu().tolist(),
            self.selected_token_ranks.cpu().tolist(),
        )


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [num_rows] int64
    logprobs: LogprobsTensors | None  # None unless some row asked for logprobs


@dataclass
class SamplingRow:
    """One request to sample for: its params, token history and (if seeded) its generator.

    The runner keeps `generator` across steps (see `make_generator`), so a seeded request's
    random stream advances by one draw per sampled token wherever it sits in the batch. It may
    keep the row itself too (the token lists are read, never copied): `greedy` and `plain` are
    derived from `params` when the row is made, and params must not change afterwards.
    """

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None = None
    greedy: bool = field(init=False)
    # Temperature / top-k / top-p / min-p / seed only: no logprobs, penalties, bad words,
    # min_tokens, logit bias or allowed ids, so the row needs no per-row work beyond its knobs.
    plain: bool = field(init=False)

    def __post_init__(self) -> None:
        p = self.params
        self.greedy = p.temperature < _SAMPLING_EPS
        self.plain = (
            p.logprobs is None and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0
            and p.repetition_penalty == 1.0 and not p.bad_words and not p.min_tokens
            and not p.logit_bias and p.allowed_token_ids is None
        )


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """The per-request generator for a seeded request, on the device the logits live on."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def _pad_to_tensor(lists: list[list[int]], pad: int, device: torch.device) -> torch.Tensor:
    max_len = max((len(x) for x in lists), default=0)
    array = np.full((len(lists), max_len), pad, dtype=np.int64)
    for i, x in enumerate(lists):
        array[i, : len(x)] = x
    return torch.from_numpy(array).to(device, non_blocking=True)


def _coords(
    pairs: list[tuple[int, int]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:  # ([n] row, [n] col) int64
    both = torch.tensor(pairs, dtype=torch.int64).reshape(-1, 2).T.contiguous()
    both = both.to(device, non_blocking=True)
    return both[0], both[1]


@dataclass
class SamplingMetadata:
    """Per-row sampling inputs of one batch, as tensors on the logits' device.

    A knob no row uses is None (or flagged), so the sampler skips its work entirely.
    """

    num_rows: int
    vocab_size: int
    all_greedy: bool
    all_random: bool
    greedy_mask: torch.Tensor | None  # [num_rows] bool, True = greedy row
    temperature: torch.Tensor | None  # [num_rows] float32 (1.0 on greedy rows)
    top_k: torch.Tensor | None  # [num_rows] int64 (vocab_size = off)
    max_top_k: int  # max top_k over the rows that use it
    top_p: torch.Tensor | None  # [num_rows] float32 (1.0 = off)
    min_p: torch.Tensor | None  # [num_rows] float32 (0.0 = off)
    generators: dict[int, torch.Generator]  # row -> generator, for seeded random rows
    max_num_logprobs: int | None  # max top-N over rows (-1 resolved to vocab_size)
    no_penalties: bool
    presence_penalties: torch.Tensor | None  # [num_rows] float32
    frequency_penalties: torch.Tensor | None  # [num_rows] float32
    repetition_penalties: torch.Tensor | None  # [num_rows] float32
    prompt_token_ids: torch.Tensor | None  # [num_rows, max_prompt_len] int64, pad = vocab_size
    output_token_ids: torch.Tensor | None  # [num_rows, max_output_len] int64, pad = vocab_size
    allowed_token_ids_mask: torch.Tensor | None  # [num_rows, vocab_size] bool, True = banned
    banned: tuple[torch.Tensor, torch.Tensor] | None  # ([num_bans] row, [num_bans] token)
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # ([n] row, [n] token, [n] f32)
    # Random rows whose only knob is the temperature (no min_p, top_k, top_p) are drawn by the
    # one-pass kernel (fused_draw), always, whatever the rest of the batch. num_fused counts them
    # (0 with PYORCH_FUSED_SAMPLER=0); when only some random rows are, fused_rows marks them
    # ([num_rows] bool) and fused_host is the same on the host.
    num_fused: int = 0
    fused_rows: torch.Tensor | None = None
    fused_host: list[bool] | None = None

    @classmethod
    def from_requests(
        cls, rows: list[SamplingRow], vocab_size: int, device: torch.device | str
    ) -> SamplingMetadata:
        device = torch.device(device)
        params = [r.params for r in rows]
        greedy = [r.greedy for r in rows]
        all_greedy, all_random = all(greedy), not any(greedy)
        max_num_logprobs, no_penalties, banned, bias, allowed = None, True, None, None, None
        # A batch of plain rows (the usual one) has no logprobs, penalties or sparse edits: skip
        # the per-row scans that look for them.
        if not all(r.plain for r in rows):
            requested = [p.logprobs for p in params if p.logprobs is not None]
            if requested:
                max_num_logprobs = (vocab_size if -1 in requested
                                    else min(max(requested), vocab_size))
            no_penalties = all(
                p.presence_penalty == 0.0 and p.frequency_penalty == 0.0
                and p.repetition_penalty == 1.0 for p in params
            )
            banned, bias = _sparse_edits(rows, vocab_size, device)
            allowed = _allowed_token_ids_mask(params, vocab_size, device)
        return cls(
            num_rows=len(rows), vocab_size=vocab_size, all_greedy=all_greedy,
            all_random=all_random,
            greedy_mask=None if all_greedy or all_random else _tensor(greedy, torch.bool, device),
            **_random_knobs(rows, greedy, vocab_size, device),
            max_num_logprobs=max_num_logprobs, no_penalties=no_penalties,
            **_penalty_inputs(rows, no_penalties, vocab_size, device),
            allowed_token_ids_mask=allowed, banned=banned, bias=bias,
        )


def _tensor(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


def _random_knobs(
    rows: list[SamplingRow], greedy: list[bool], vocab_size: int, device: torch.device
) -> dict:
    """temperature, top_k, top_p, min_p and generators: each None/empty when no row uses it."""
    knobs: dict = dict(temperature=None, top_k=None, max_top_k=0, top_p=None, min_p=None,
                       generators={}, num_fused=0, fused_rows=None, fused_host=None)
    if all(greedy):
        return knobs
    params = [r.params for r in rows]
    # Greedy rows get temperature 1 so the division is harmless; their sample is discarded.
    temperature = [1.0 if g else p.temperature for g, p in zip(greedy, params, strict=True)]
    knobs["temperature"] = _tensor(temperature, torch.float32, device)
    ks = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
    if any(k < vocab_size for k in ks):
        knobs["top_k"] = _tensor(ks, torch.int64, device)
        knobs["max_top_k"] = max(k for k in ks if k < vocab_size)
    if any(p.top_p < 1.0 for p in params):
        knobs["top_p"] = _tensor([p.top_p for p in params], torch.float32, device)
    if any(p.min_p > _SAMPLING_EPS for p in params):
        knobs["min_p"] = _tensor([p.min_p for p in params], torch.float32, device)
    if fused_sampler_on():
        fused = [not g and k >= vocab_size and p.top_p >= 1.0 and p.min_p <= _SAMPLING_EPS
                 for g, k, p in zip(greedy, ks, params, strict=True)]
        knobs["num_fused"] = sum(fused)
        if 0 < knobs["num_fused"] < len(fused) - sum(greedy):
            knobs["fused_rows"] = _tensor(fused, torch.bool, device)
            knobs["fused_host"] = fused
    for i, (g, r) in enumerate(zip(greedy, rows, strict=True)):
        if not g and r.params.seed is not None:
            if r.generator is None:
                raise ValueError(f"row {i} has a seed but no generator (see make_generator)")
            knobs["generators"][i] = r.generator
    return knobs


def _penalty_inputs(
    rows: list[SamplingRow], no_penalties: bool, vocab_size: int, device: torch.device
) -> dict:
    names = ("presence_penalties", "frequency_penalties", "repetition_penalties",
             "prompt_token_ids", "output_token_ids")
    if no_penalties:
        return dict.fromkeys(names)
    params = [r.params for r in rows]
    return dict(
        presence_penalties=_tensor([p.presence_penalty for p in params], torch.float32, device),
        frequency_penalties=_tensor([p.frequency_penalty for p in params], torch.float32, device),
        repetition_penalties=_tensor([p.repetition_penalty for p in params], torch.float32,
                                     device),
        # A row without a repetition penalty needs no prompt history: less to copy each step.
        prompt_token_ids=_pad_to_tensor(
            [r.prompt_token_ids if r.params.repetition_penalty != 1.0 else [] for r in rows],
            vocab_size, device),
        output_token_ids=_pad_to_tensor([r.output_token_ids for r in rows], vocab_size, device),
    )


def _allowed_token_ids_mask(
    params: list[SamplingParams], vocab_size: int, device: torch.device
) -> torch.Tensor | None:  # [num_rows, vocab_size] bool, True = banned
    if all(p.allowed_token_ids is None for p in params):
        return None
    restricted = [i for i, p in enumerate(params) if p.allowed_token_ids is not None]
    keep = [(i, t) for i in restricted for t in params[i].allowed_token_ids or []
            if 0 <= t < vocab_size]
    mask = torch.zeros(len(params), vocab_size, dtype=torch.bool, device=device)
    mask[_tensor(restricted, torch.int64, device)] = True
    mask[_coords(keep, device)] = False
    return mask


def _sparse_edits(rows: list[SamplingRow], vocab_size: int, device: torch.device) -> tuple:
    """(row, token) pairs to ban (bad words, stop tokens before min_tokens) and logit biases."""
    bans: list[tuple[int, int]] = []
    biases: list[tuple[int, int, float]] = []
    for i, r in enumerate(rows):
        p = r.params
        banned_ids = _banned_by_bad_words(p, r.output_token_ids)
        if p.min_tokens and len(r.output_token_ids) < p.min_tokens:
            banned_ids += sorted(p.all_stop_token_ids)
        bans += [(i, t) for t in banned_ids if t < vocab_size]
        biases += [(i, t, v) for t, v in (p.logit_bias or {}).items() if t < vocab_size]
    banned = _coords(bans, device) if bans else None
    bias = None
    if biases:
        values = _tensor([v for _, _, v in biases], torch.float32, device)
        bias = (*_coords([(i, t) for i, t, _ in biases], device), values)
    return banned, bias


def _banned_by_bad_words(params: SamplingParams, output_token_ids: list[int]) -> list[int]:
    """Last tokens of the bad words whose earlier tokens match the end of the output."""
    if not params.bad_words:
        return []
    words = params.bad_words_token_ids
    if words is None:
        raise ValueError("bad_words need SamplingParams.update_from_tokenizer() first")
    banned = []
    for word in words:
        prefix_len = len(word) - 1
        if prefix_len > len(output_token_ids):
            continue
        if prefix_len == 0 or output_token_ids[-prefix_len:] == word[:-1]:
            banned.append(word[-1])
    return banned


def apply_penalties(
    logits: torch.Tensor,  # [num_rows, vocab_size] float32, modified in place
    prompt_token_ids: torch.Tensor,  # [num_rows, max_prompt_len] int64, pad = vocab_size
    output_token_ids: torch.Tensor,  # [num_rows, max_output_len] int64, pad = vocab_size
    presence_penalties: torch.Tensor,  # [num_rows] float32
    frequency_penalties: torch.Tensor,  # [num_rows] float32
    repetition_penalties: torch.Tensor,  # [num_rows] float32
) -> torch.Tensor:
    """Repetition penalty over prompt + output (HF/vLLM: divide positive logits, multiply
    negative ones); frequency (x count) and presence (x seen) penalties over the output."""
    num_rows, vocab_size = logits.shape
    # One extra bin swallows the padding id (vocab_size).
    output_counts = torch.zeros(num_rows, vocab_size + 1, dtype=torch.float32, device=logits.device)
    output_counts.scatter_add_(1, output_token_ids, torch.ones_like(output_token_ids,
                                                                    dtype=torch.float32))
    output_counts = output_counts[:, :vocab_size]
    seen = torch.zeros(num_rows, vocab_size + 1, dtype=torch.bool, device=logits.device)
    seen.scatter_(1, prompt_token_ids, True)
    output_seen = output_counts > 0
    seen = seen[:, :vocab_size] | output_seen
    penalty = torch.where(seen, repetition_penalties.unsqueeze(1), 1.0)
    logits.copy_(torch.where(logits > 0, logits / penalty, logits * penalty))
    logits -= frequency_penalties.unsqueeze(1) * output_counts
    logits -= presence_penalties.unsqueeze(1) * output_seen
    return logits


def apply_min_p(
    logits: torch.Tensor,  # [num_rows, vocab_size] float32, modified in place
    min_p: torch.Tensor,  # [num_rows] float32
) -> torch.Tensor:
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill_(probs < threshold, float("-inf"))


def apply_top_k_top_p(
    logits: torch.Tensor,  # [num_rows, vocab_size] float32, modified in place
    top_k: torch.Tensor | None,  # [num_rows] int64, vocab_size = off
    top_p: torch.Tensor | None,  # [num_rows] float32, 1.0 = off
    max_top_k: int = 0,
) -> torch.Tensor:
    """Keep each row's top_k tokens (ties at the k-th value kept), then the smallest set of
    top tokens whose probability reaches top_p (at least one token always stays)."""
    vocab_size = logits.shape[1]
    if top_p is None:
        if top_k is None:
            return logits
        # top_k only: a partial top-k is much cheaper than a full sort.
        top_values = logits.topk(max_top_k, dim=-1).values  # [num_rows, max_top_k]
        threshold = top_values.gather(1, (top_k.clamp(max=max_top_k) - 1).unsqueeze(1))
        threshold.masked_fill_((top_k >= vocab_size).unsqueeze(1), float("-inf"))
        return logits.masked_fill_(logits < threshold, float("-inf"))
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=False)
    if top_k is not None:
        threshold = sorted_logits.gather(1, (vocab_size - top_k).clamp(0, vocab_size - 1)
                                         .unsqueeze(1))
        sorted_logits.masked_fill_(sorted_logits < threshold, float("-inf"))
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    drop = cumulative <= (1.0 - top_p).unsqueeze(1)
    drop[:, -1] = False
    sorted_logits.masked_fill_(drop, float("-inf"))
    return logits.scatter_(1, sorted_ids, sorted_logits)


def gather_logprobs(
    logprobs: torch.Tensor,  # [num_rows, vocab_size] float32
    num_logprobs: int,
    token_ids: torch.Tensor,  # [num_rows] int64
) -> LogprobsTensors:
    """Top-`num_logprobs` logprobs plus `token_ids`' logprob and 1-based rank, per row."""
    token_logprobs = logprobs.gather(1, token_ids.unsqueeze(1))  # [num_rows, 1]
    ranks = (logprobs > token_logprobs).sum(dim=-1) + 1
    top_logprobs, top_ids = logprobs.topk(num_logprobs, dim=-1)
    return LogprobsTensors(
        logprob_token_ids=torch.cat([token_ids.unsqueeze(1), top_ids], dim=1),
        logprobs=torch.cat([token_logprobs, top_logprobs], dim=1),
        selected_token_ranks=ranks,
    )


def compute_prompt_logprobs(
    logits: torch.Tensor,  # [num_positions, vocab_size], position i predicts target i
    target_token_ids: torch.Tensor,  # [num_positions] int64, the next prompt tokens
    num_logprobs: int,
) -> LogprobsTensors:
    """Prompt logprobs (raw model distribution): top-N plus each actual next token's logprob and
    rank. For a prompt chunk at positions [s, e) the runner passes the logits of positions
    [s, min(e, num_prompt_tokens - 1)) and the prompt tokens one further; num_logprobs -1 = all."""
    vocab_size = logits.shape[1]
    num = vocab_size if num_logprobs == -1 else min(num_logprobs, vocab_size)
    logprobs = logits.to(torch.float32).log_softmax(dim=-1)
    return gather_logprobs(logprobs, num, target_token_ids.to(torch.int64))


class Sampler(nn.Module):
    """Samples one token per row; see the module docstring for the order of processing."""

    def forward(
        self,
        logits: torch.Tensor,  # [num_rows, vocab_size], any float dtype; not modified
        metadata: SamplingMetadata,
    ) -> SamplerOutput:
        raw_logprobs = None
        if metadata.max_num_logprobs is not None:
            raw_logprobs = logits.to(torch.float32).log_softmax(dim=-1)
        elif (metadata.all_greedy and metadata.allowed_token_ids_mask is None
              and metadata.banned is None and metadata.bias is None and metadata.no_penalties):
            # Plain greedy: argmax of the model's own dtype (the float32 upcast is exact, so the
            # pick is the same) without a float32 copy of the logits.
            return SamplerOutput(sampled_token_ids=argmax_rows(logits), logprobs=None)
        if fused_draw_applies(metadata):  # every random row fused, no edit of the logits
            sampled = fused_draw(logits, metadata)
            logprobs = None
            if raw_logprobs is not None:
                assert metadata.max_num_logprobs is not None
                logprobs = gather_logprobs(raw_logprobs, metadata.max_num_logprobs, sampled)
            return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)
        logits = logits.to(torch.float32, copy=True)
        if metadata.allowed_token_ids_mask is not None:
            logits.masked_fill_(metadata.allowed_token_ids_mask, float("-inf"))
        if metadata.banned is not None:
            logits[metadata.banned] = float("-inf")
        if metadata.bias is not None:
            rows, cols, values = metadata.bias
            logits.index_put_((rows, cols), values, accumulate=True)
        if not metadata.no_penalties:
            # _penalty_inputs fills all five tensors whenever no_penalties is False.
            assert metadata.prompt_token_ids is not None and metadata.output_token_ids is not None
            assert metadata.presence_penalties is not None
            assert metadata.frequency_penalties is not None
            assert metadata.repetition_penalties is not None
            apply_penalties(logits, metadata.prompt_token_ids, metadata.output_token_ids,
                            metadata.presence_penalties, metadata.frequency_penalties,
                            metadata.repetition_penalties)
        sampled = self.sample(logits, metadata)
        logprobs = None
        if raw_logprobs is not None:
            assert metadata.max_num_logprobs is not None
            logprobs = gather_logprobs(raw_logprobs, metadata.max_num_logprobs, sampled)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)

    def sample(
        self,
        logits: torch.Tensor,  # [num_rows, vocab_size] float32, processed; modified in place
        metadata: SamplingMetadata,
    ) -> torch.Tensor:  # [num_rows] int64
        greedy = None if metadata.all_random else argmax_rows(logits)
        if metadata.all_greedy:
            assert greedy is not None
            return greedy
        assert metadata.temperature is not None
        fused = None
        if metadata.num_fused:  # the kernel's rows (the logits' edits are already in)
            fused = fused_draw(logits, metadata)
            if metadata.fused_rows is None:  # every random row is the kernel's
                return fused
        logits.div_(metadata.temperature.unsqueeze(1))
        if metadata.min_p is not None:
            apply_min_p(logits, metadata.min_p)
        apply_top_k_top_p(logits, metadata.top_k, metadata.top_p, metadata.max_top_k)
        generators = metadata.generators
        if fused is not None:  # the kernel's seeded rows drew their seeds there
            generators = {row: g for row, g in generators.items() if not _is_fused(metadata, row)}
        sampled = exponential_race(logits, generators)
        if fused is not None:
            assert metadata.fused_rows is not None
            sampled = torch.where(metadata.fused_rows, fused, sampled)
        if greedy is None:
            return sampled
        assert metadata.greedy_mask is not None
        return torch.where(metadata.greedy_mask, greedy, sampled)


def fused_sampler_on() -> bool:
    """PYORCH_FUSED_SAMPLER: on, off, or auto (on for both devices: the CUDA kernel's tests pass
    on an H200 and it takes 1.2 ms off a 1,024-row decode step there, 0.54 against 2.03 ms at a
    128k vocabulary; bench/results/NVIDIA_H200/fused_sampler_20261129)."""
    return envs.PYORCH_FUSED_SAMPLER != "off"


def _is_fused(metadata: SamplingMetadata, row: int) -> bool:
    return metadata.num_fused > 0 and (metadata.fused_host is None or metadata.fused_host[row])


def fused_draw_applies(metadata: SamplingMetadata) -> bool:
    """Whether every random row is the kernel's and nothing edits the logits (no mask, bias or
    penalty on any row): then `fused_draw` samples the raw logits, with no float32 copy."""
    return (metadata.num_fused > 0 and metadata.fused_rows is None
            and metadata.allowed_token_ids_mask is None and metadata.banned is None
            and metadata.bias is None and metadata.no_penalties)


def fused_draw(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """The exponential race of `Sampler.sample` in one kernel (`_ops.random_sample_from_logits`):
    no float32 copy and no [rows, vocab] noise tensor. Each row's Exp(1) noise comes from Philox
    keyed by a 64-bit seed drawn per step: from the row's own generator for a seeded row (one
    draw a step, so its tokens depend only on its seed and its logits: a row whose only knob is
    the temperature is always the kernel's), else from torch's default generator. Greedy rows
    (temperature 0 here) take their argmax; the rows that are not the kernel's get a token the
    caller discards. The draws differ from `exponential_race`'s; both are exact."""
    assert metadata.temperature is not None
    temperature = metadata.temperature
    if metadata.greedy_mask is not None:
        temperature = temperature.masked_fill(metadata.greedy_mask, 0.0)
    seeds = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    if len(metadata.generators) != logits.shape[0]:
        seeds.random_()
    for row, generator in metadata.generators.items():
        if _is_fused(metadata, row):
            seeds[row:row + 1].random_(generator=generator)
    return _ops.random_sample_from_logits(logits, temperature, seeds)


# A batch of more rows than this many elements' worth of vocabulary rows is sampled in chunks of
# rows: each row in flight holds several [vocab] float32 temporaries (the upcast copy, top-p's
# sorted values and int64 ids, probabilities, noise), and the engine reserves the peak of a
# max_num_seqs batch out of the KV cache's memory. At a 128k vocabulary, 261 rows per chunk;
# measured on an H100, a 1024-row batch with every knob on peaked 3.7 GiB above the forward pass
# unchunked.
SAMPLER_CHUNK_ELEMENTS = 1 << 25


def sample_rows(sampler: "Sampler", logits: torch.Tensor,
                rows: list[SamplingRow]) -> SamplerOutput:
    """``sampler`` over ``logits`` [num_rows, vocab] for ``rows``, in chunks of rows past
    SAMPLER_CHUNK_ELEMENTS; the outputs are those of one pass (logprobs of every chunk have the
    batch's top-N width; a seeded row draws from its own generator in any chunk)."""
    num_rows, vocab_size = logits.shape
    step = max(1, SAMPLER_CHUNK_ELEMENTS // max(vocab_size, 1))
    if num_rows <= step:
        return sampler(logits, SamplingMetadata.from_requests(rows, vocab_size, logits.device))
    chunks = [(a, min(a + step, num_rows)) for a in range(0, num_rows, step)]
    metas = [SamplingMetadata.from_requests(rows[a:b], vocab_size, logits.device)
             for a, b in chunks]
    widths = [m.max_num_logprobs for m in metas if m.max_num_logprobs is not None]
    for m in metas:  # one top-N width for the whole batch
        m.max_num_logprobs = max(widths) if widths else None
    outs = [sampler(logits[a:b], m) for (a, b), m in zip(chunks, metas, strict=True)]
    logprobs = None
    if widths:
        logprobs = LogprobsTensors(*(torch.cat(parts) for parts in
                                     zip(*(o.logprobs for o in outs), strict=True)))
    return SamplerOutput(sampled_token_ids=torch.cat([o.sampled_token_ids for o in outs]),
                         logprobs=logprobs)


# Rows below which argmax_rows splits each row: torch's argmax reduces one row in one thread block
# (27 us for a 128k vocabulary on an H100: most of a batch-1 step's sampling).
_SPLIT_ARGMAX_ROWS = 64
_SPLIT_ARGMAX_MIN_CHUNK = 256


def argmax_rows(x: torch.Tensor, split: bool | None = None) -> torch.Tensor:
    """``x.argmax(dim=-1)`` of a [num_rows, n] tensor: the first index of each row's maximum.

    With few rows on a GPU (``split`` None) or ``split`` True, in two passes: the max of each of
    c chunks of the row (c thread blocks' work per row), then the first chunk holding the row's
    max; its index in the chunk gives the answer. Ties resolve as argmax's do (the first chunk,
    the first index in it); so do NaNs (max and argmax take them as the maximum)."""
    rows, n = x.shape
    if split is None:
        split = x.device.type == "cuda" and rows < _SPLIT_ARGMAX_ROWS
    if split and rows > 0 and x.is_contiguous():
        for chunks in (256, 128, 64, 32):
            if n % chunks == 0 and n // chunks >= _SPLIT_ARGMAX_MIN_CHUNK:
                values, index = x.view(rows, chunks, n // chunks).max(dim=-1)
                best = values.argmax(dim=-1, keepdim=True)  # [rows, 1]
                return (best * (n // chunks) + index.gather(1, best)).squeeze(1)
    return x.argmax(dim=-1)


def exponential_race(
    logits: torch.Tensor,  # [num_rows, vocab_size] float32 (tempered, masked), modified in place
    generators: dict[int, torch.Generator],
) -> torch.Tensor:  # [num_rows] int64
    """argmax(softmax(logits) / q), q ~ Exp(1): an exact draw from each row's distribution (no
    CPU sync), computed as argmax(logits - log q): the softmax's normalisation is one constant
    per row, so it is skipped (two fewer passes over [rows, vocab] than through probabilities).

    Rows in `generators` draw their q from their own generator; the others from the default one.
    """
    q = torch.empty_like(logits)
    if len(generators) != logits.shape[0]:
        q.exponential_()
    for row, generator in generators.items():
        q[row].exponential_(generator=generator)
    # q of exactly 0 would give +inf for every token of the row, masked ones included.
    q.clamp_min_(torch.finfo(q.dtype).tiny).log_()
    return argmax_rows(logits.sub_(q))
