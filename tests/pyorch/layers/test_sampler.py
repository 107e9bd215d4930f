"""Sampler: each knob against a plain reference, on small random logits, per device."""

import pytest
import torch

from pyorch.layers.sampler import (
    Sampler,
    SamplingMetadata,
    SamplingRow,
    apply_penalties,
    compute_prompt_logprobs,
    make_generator,
)
from pyorch.sampling_params import SamplingParams
from tests.conftest import DEVICES

NUM_DRAWS = 4000  # rows of one batch that share the same logits, for support / frequency checks


def _sample(logits, params_list, device, outputs=None, prompts=None, generators=None):
    rows = [
        SamplingRow(
            params=p,
            prompt_token_ids=(prompts or {}).get(i, []),
            output_token_ids=(outputs or {}).get(i, []),
            generator=(generators or {}).get(i),
        )
        for i, p in enumerate(params_list)
    ]
    metadata = SamplingMetadata.from_requests(rows, logits.shape[1], device)
    return Sampler()(logits.to(device), metadata)


def _draws(logits_row, params, device, n=NUM_DRAWS):
    logits = logits_row.unsqueeze(0).expand(n, -1).contiguous()
    return _sample(logits, [params] * n, device).sampled_token_ids.cpu()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("vocab_size", [7, 151, 1000])
def test_greedy_is_argmax(device, vocab_size):
    logits = torch.randn(9, vocab_size)
    out = _sample(logits, [SamplingParams(temperature=0.0)] * 9, device)
    assert out.sampled_token_ids.dtype == torch.int64
    assert torch.equal(out.sampled_token_ids.cpu(), logits.argmax(-1))
    assert out.logprobs is None


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_on_bfloat16_logits_matches_float32(device):
    """Plain greedy samples the model's dtype directly: the same pick as on the float32 upcast,
    ties included (the first maximum)."""
    logits = torch.randn(33, 517).to(torch.bfloat16)
    logits[3, [10, 400]] = 9.0  # a tie: the first index wins, as on float32
    out = _sample(logits, [SamplingParams(temperature=0.0)] * 33, device)
    assert torch.equal(out.sampled_token_ids.cpu(), logits.float().argmax(-1))
    assert out.sampled_token_ids[3].item() == 10
    # With logprobs the float32 path runs; same tokens.
    out = _sample(logits, [SamplingParams(temperature=0.0, logprobs=2)] * 33, device)
    assert torch.equal(out.sampled_token_ids.cpu(), logits.float().argmax(-1))


@pytest.mark.parametrize("device", DEVICES)
def test_mixed_greedy_and_random_rows(device):
    logits = torch.randn(6, 50)
    params = [SamplingParams(temperature=0.0 if i % 2 == 0 else 1.0) for i in range(6)]
    out = _sample(logits, params, device).sampled_token_ids.cpu()
    assert torch.equal(out[0::2], logits[0::2].argmax(-1))
    assert ((out >= 0) & (out < 50)).all()


@pytest.mark.parametrize("device", DEVICES)
def test_temperature_matches_softmax(device):
    logits = torch.randn(8) * 2
    for temperature in (0.5, 1.0, 2.0):
        draws = _draws(logits, SamplingParams(temperature=temperature), device, n=20000)
        freq = torch.bincount(draws, minlength=8).float() / draws.numel()
        expected = torch.softmax(logits / temperature, -1)
        torch.testing.assert_close(freq, expected, atol=0.015, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("top_k", [1, 3, 10])
def test_top_k_support(device, top_k):
    logits = torch.randn(40)
    draws = _draws(logits, SamplingParams(top_k=top_k, temperature=3.0), device)
    expected = set(logits.topk(top_k).indices.tolist())
    assert set(draws.tolist()) == expected


def _nucleus(logits, top_p):
    probs, order = torch.softmax(logits, -1).sort(descending=True)
    mass_before = probs.cumsum(-1) - probs
    return set(order[mass_before < top_p].tolist())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("top_p", [0.3, 0.7, 0.95])
def test_top_p_support(device, top_p):
    logits = torch.randn(30) * 1.5
    draws = _draws(logits, SamplingParams(top_p=top_p), device, n=20000)
    assert set(draws.tolist()) <= _nucleus(logits, top_p)
    # Every nucleus token that carries >= 0.5 % of the mass shows up in 20000 draws.
    probs = torch.softmax(logits, -1)
    likely = {t for t in _nucleus(logits, top_p) if probs[t] > 0.005}
    assert likely <= set(draws.tolist())


@pytest.mark.parametrize("device", DEVICES)
def test_top_k_and_top_p_together(device):
    logits = torch.randn(30)
    draws = _draws(logits, SamplingParams(top_k=5, top_p=0.6), device)
    top5 = logits.topk(5).indices
    assert set(draws.tolist()) <= {top5[i].item() for i in _nucleus(logits[top5], 0.6)}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("min_p", [0.05, 0.3])
def test_min_p_support(device, min_p):
    logits = torch.randn(25) * 2
    draws = _draws(logits, SamplingParams(min_p=min_p, temperature=1.0), device, n=20000)
    probs = torch.softmax(logits, -1)
    allowed = set(torch.nonzero(probs >= min_p * probs.max()).flatten().tolist())
    assert set(draws.tolist()) <= allowed
    assert {t for t in allowed if probs[t] > 0.005} <= set(draws.tolist())


@pytest.mark.parametrize("device", DEVICES)
def test_per_row_knobs_in_one_batch(device):
    logits = torch.randn(1, 60).expand(3 * 1000, -1).contiguous()
    params = [SamplingParams(top_k=2)] * 1000 + [SamplingParams(top_p=0.2)] * 1000 + [
        SamplingParams(temperature=0.0)
    ] * 1000
    out = _sample(logits, params, device).sampled_token_ids.cpu()
    assert set(out[:1000].tolist()) == set(logits[0].topk(2).indices.tolist())
    assert set(out[1000:2000].tolist()) <= _nucleus(logits[0], 0.2)
    assert (out[2000:] == logits[0].argmax()).all()


def _seeded_run(device, logits_steps, batch_builder, seed=1234, position=0, params=None):
    """Sample a seeded request (by default with top_p) for several steps inside changing
    batches; return its tokens. Rows with a presence penalty have outputs to penalize."""
    generator = make_generator(seed, device)
    params = params or SamplingParams(seed=seed, temperature=0.8, top_p=0.9)
    tokens = []
    for step, step_logits in enumerate(logits_steps):
        others = batch_builder(step)
        batch_params = others[:position] + [params] + others[position:]
        logits = torch.randn(len(batch_params), step_logits.shape[0])
        logits[position] = step_logits
        generators = {i: make_generator(p.seed, device) for i, p in enumerate(batch_params)
                      if p.seed is not None}
        generators[position] = generator
        outputs = {i: [1, 2, 2] for i, p in enumerate(batch_params) if p.presence_penalty}
        out = _sample(logits, batch_params, device, outputs=outputs, generators=generators)
        tokens.append(out.sampled_token_ids[position].item())
    return tokens


@pytest.mark.parametrize("device", DEVICES)
def test_seed_is_independent_of_batch(device):
    logits_steps = [torch.randn(500) for _ in range(12)]
    alone = _seeded_run(device, logits_steps, lambda step: [])
    crowd = _seeded_run(
        device, logits_steps,
        lambda step: [SamplingParams(temperature=0.0 if i % 3 else 1.0, seed=i if i % 2 else None,
                                     top_k=7) for i in range(step % 5 + 3)],
        position=2,
    )
    assert alone == crowd
    assert alone == _seeded_run(device, logits_steps, lambda step: [SamplingParams()] * 4,
                                position=4)
    assert alone != _seeded_run(device, logits_steps, lambda step: [], seed=99)


def _reference_penalties(logits, prompt, output, presence, frequency, repetition):
    logits = logits.clone()
    for token in set(prompt) | set(output):
        value = logits[token]
        logits[token] = value / repetition if value > 0 else value * repetition
    for token in set(output):
        logits[token] -= frequency * output.count(token) + presence
    return logits


@pytest.mark.parametrize("device", DEVICES)
def test_penalties_match_reference(device):
    vocab_size = 64
    logits = torch.randn(4, vocab_size) * 3
    prompts = {i: torch.randint(0, vocab_size, (7 + i,)).tolist() for i in range(4)}
    outputs = {i: torch.randint(0, vocab_size, (3 * i,)).tolist() for i in range(4)}
    settings = [(0.0, 0.0, 1.0), (0.5, 0.0, 1.3), (-0.4, 1.2, 1.0), (1.5, -0.7, 0.6)]
    expected = torch.stack([
        _reference_penalties(logits[i], prompts[i], outputs[i], *settings[i]) for i in range(4)
    ])
    params = [SamplingParams(temperature=0.0, presence_penalty=p, frequency_penalty=f,
                             repetition_penalty=r) for p, f, r in settings]
    rows = [SamplingRow(params[i], prompts[i], outputs[i]) for i in range(4)]
    metadata = SamplingMetadata.from_requests(rows, vocab_size, device)
    got = apply_penalties(logits.clone().to(device), metadata.prompt_token_ids,
                          metadata.output_token_ids, metadata.presence_penalties,
                          metadata.frequency_penalties, metadata.repetition_penalties)
    torch.testing.assert_close(got.cpu(), expected)
    out = Sampler()(logits.to(device), metadata)
    assert torch.equal(out.sampled_token_ids.cpu(), expected.argmax(-1))


@pytest.mark.parametrize("device", DEVICES)
def test_logit_bias(device):
    logits = torch.randn(3, 20)
    params = [SamplingParams(temperature=0.0, logit_bias={5: 100.0}),
              SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.0, logit_bias={int(logits[2].argmax()): -100.0})]
    out = _sample(logits, params, device).sampled_token_ids.cpu()
    assert out[0] == 5
    assert out[1] == logits[1].argmax()
    assert out[2] == logits[2].topk(2).indices[1]


@pytest.mark.parametrize("device", DEVICES)
def test_allowed_token_ids(device):
    logits = torch.randn(50)
    allowed = [3, 17, 41]
    draws = _draws(logits, SamplingParams(allowed_token_ids=allowed, temperature=5.0), device)
    assert set(draws.tolist()) == set(allowed)
    both = _sample(torch.stack([logits, logits]),
                   [SamplingParams(temperature=0.0, allowed_token_ids=allowed),
                    SamplingParams(temperature=0.0)], device).sampled_token_ids.cpu()
    assert both[0] == max(allowed, key=lambda t: logits[t]) and both[1] == logits.argmax()


class _IdTokenizer:
    """Words are space-separated decimal token ids."""

    def encode(self, text, add_special_tokens=False):
        return [int(t) for t in text.split()]


@pytest.mark.parametrize("device", DEVICES)
def test_bad_words(device):
    params = SamplingParams(temperature=0.0, bad_words=["7", "3 4 9"])
    params.update_from_tokenizer(_IdTokenizer())
    logits = torch.zeros(1, 12)
    logits[0, 7] = 10.0
    logits[0, 9] = 9.0
    logits[0, 2] = 8.0
    # Single-token bad word: always banned. "3 4 9": 9 banned only right after "3 4".
    assert _sample(logits, [params], device, outputs={0: [1, 2]}).sampled_token_ids.item() == 9
    assert _sample(logits, [params], device, outputs={0: [3, 4]}).sampled_token_ids.item() == 2
    assert _sample(logits, [params], device, outputs={0: [4, 3]}).sampled_token_ids.item() == 9
    unset = SamplingParams(bad_words=["x"])
    with pytest.raises(ValueError, match="update_from_tokenizer"):
        _sample(logits, [unset], device)


@pytest.mark.parametrize("device", DEVICES)
def test_min_tokens_masks_stop_tokens(device):
    eos, stop = 4, 6
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[stop])
    params.update_from_generation_config({}, model_eos_token_id=eos)
    logits = torch.zeros(1, 10)
    logits[0, eos], logits[0, stop], logits[0, 1] = 5.0, 4.0, 3.0
    for num_out, expected in [(0, 1), (2, 1), (3, eos), (8, eos)]:
        out = _sample(logits, [params], device, outputs={0: [0] * num_out})
        assert out.sampled_token_ids.item() == expected


@pytest.mark.parametrize("device", DEVICES)
def test_logprobs_are_raw_top_n_and_ranked(device):
    vocab_size = 100
    logits = torch.randn(5, vocab_size) * 2
    params = [
        SamplingParams(logprobs=3, temperature=0.7, presence_penalty=1.0, top_k=5),
        SamplingParams(logprobs=0, temperature=0.0, repetition_penalty=2.0),
        SamplingParams(temperature=0.0),
        SamplingParams(logprobs=5, temperature=1.0, logit_bias={11: 50.0}),
        SamplingParams(logprobs=2, temperature=0.0, allowed_token_ids=[0, 1, 2]),
    ]
    out = _sample(logits, params, device, outputs={i: [1, 2, 3] for i in range(5)})
    lp = out.logprobs
    assert lp is not None and lp.logprobs.shape == (5, 6) and lp.logprob_token_ids.shape == (5, 6)
    ref = torch.log_softmax(logits.double(), -1)
    sampled = out.sampled_token_ids.cpu()
    ids, values, ranks = (t.cpu() for t in lp)
    assert torch.equal(ids[:, 0], sampled)
    assert sampled[3] == 11
    top = ref.topk(5, -1)
    assert torch.equal(ids[:, 1:], top.indices)
    torch.testing.assert_close(values[:, 1:].double(), top.values, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(values[:, 0].double(), ref.gather(1, sampled[:, None])[:, 0],
                               atol=1e-5, rtol=1e-5)
    expected_ranks = (ref > ref.gather(1, sampled[:, None])).sum(-1) + 1
    assert torch.equal(ranks, expected_ranks)


@pytest.mark.parametrize("device", DEVICES)
def test_logprobs_whole_vocab(device):
    logits = torch.randn(2, 33)
    out = _sample(logits, [SamplingParams(logprobs=-1), SamplingParams(logprobs=2)], device)
    assert out.logprobs.logprobs.shape == (2, 34)
    lists = out.logprobs.tolists()
    assert len(lists.logprob_token_ids[0]) == 34 and lists.slice(1, 2).sampled_token_ranks == [
        lists.sampled_token_ranks[1]
    ]


@pytest.mark.parametrize("device", DEVICES)
def test_prompt_logprobs(device):
    vocab_size = 40
    logits = torch.randn(6, vocab_size, dtype=torch.bfloat16)
    targets = torch.randint(0, vocab_size, (6,))
    lp = compute_prompt_logprobs(logits.to(device), targets.to(device), num_logprobs=4)
    ref = torch.log_softmax(logits.float(), -1)
    ids, values, ranks = (t.cpu() for t in lp)
    assert torch.equal(ids[:, 0], targets)
    torch.testing.assert_close(values[:, 0], ref.gather(1, targets[:, None])[:, 0])
    assert torch.equal(ids[:, 1:], ref.topk(4, -1).indices)
    assert torch.equal(ranks, (ref > ref.gather(1, targets[:, None])).sum(-1) + 1)
    full = compute_prompt_logprobs(logits.to(device), targets.to(device), num_logprobs=-1)
    assert full.logprobs.shape == (6, vocab_size + 1)


@pytest.mark.parametrize("device", DEVICES)
def test_logits_not_modified_and_seeded_row_needs_generator(device):
    logits = torch.randn(2, 30).to(device)
    before = logits.clone()
    _sample(logits, [SamplingParams(top_k=3, presence_penalty=1.0),
                     SamplingParams(temperature=0.0, logit_bias={1: 9.0})], device,
            outputs={0: [1, 2], 1: [3]})
    assert torch.equal(logits, before)
    with pytest.raises(ValueError, match="generator"):
        _sample(logits, [SamplingParams(seed=3), SamplingParams()], device)


def _same_metadata(a: SamplingMetadata, b: SamplingMetadata) -> None:
    for name, x in vars(a).items():
        y = getattr(b, name)
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            torch.testing.assert_close(x, y, rtol=0, atol=0, msg=name)
        elif name == "generators":  # each side made its own, from the same seeds
            assert x.keys() == y.keys()
            assert all(torch.equal(x[k].get_state(), y[k].get_state()) for k in x)
        elif isinstance(x, tuple):
            assert len(x) == len(y), name
            for u, v in zip(x, y):
                torch.testing.assert_close(u, v, rtol=0, atol=0, msg=name)
        else:
            assert x == y, name


PLAIN_PARAMS = [
    [SamplingParams(temperature=0.0)] * 3,
    [SamplingParams(temperature=1.0)] * 3,
    [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_k=5, seed=3),
     SamplingParams(temperature=1.2, top_p=0.8, min_p=0.05), SamplingParams(logit_bias={})],
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("params_list", PLAIN_PARAMS, ids=["greedy", "random", "mixed"])
def test_plain_rows_give_the_general_metadata(device, params_list):
    """A batch of plain rows skips the scans for logprobs, penalties and edits: its metadata and
    samples are those of the general path (forced by marking the same rows not plain)."""
    vocab_size = 37

    def rows(plain: bool) -> list[SamplingRow]:
        out = []
        for i, p in enumerate(params_list):
            gen = make_generator(p.seed, device) if p.seed is not None else None
            row = SamplingRow(p, [1, 2, i], [3, i], gen)
            assert row.plain
            row.plain = plain
            out.append(row)
        return out

    fast = SamplingMetadata.from_requests(rows(True), vocab_size, device)
    general = SamplingMetadata.from_requests(rows(False), vocab_size, device)
    _same_metadata(fast, general)
    logits = torch.randn(len(params_list), vocab_size, device=device)
    torch.manual_seed(0)
    fast_ids = Sampler()(logits, fast).sampled_token_ids
    torch.manual_seed(0)
    general_ids = Sampler()(logits, general).sampled_token_ids
    assert fast_ids.tolist() == general_ids.tolist()


@pytest.mark.parametrize("params", [
    SamplingParams(logprobs=1), SamplingParams(presence_penalty=0.5),
    SamplingParams(frequency_penalty=0.5), SamplingParams(repetition_penalty=1.2),
    SamplingParams(bad_words=["x"]), SamplingParams(min_tokens=1, max_tokens=4),
    SamplingParams(logit_bias={1: 1.0}), SamplingParams(allowed_token_ids=[1]),
])
def test_rows_with_per_row_work_are_not_plain(params):
    assert not SamplingRow(params, [], []).plain
    assert SamplingRow(SamplingParams(temperature=0.5, top_k=3, top_p=0.9, min_p=0.1, seed=1),
                       [], []).plain


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n", [128256, 151936, 32000, 1000, 4096 * 3 + 1])
@pytest.mark.parametrize("rows", [1, 3, 63, 70])
def test_argmax_rows_split_matches_argmax(device: str, n: int, rows: int) -> None:
    from pyorch.layers.sampler import argmax_rows

    x = torch.randn(rows, n, device=device)
    # Ties across chunks and inside one: the first index must win, as with argmax.
    x[0, n // 3] = x[0, n - 1] = x[0, 5] = 100.0
    if rows > 1:
        x[1, 7:9] = 50.0
    if rows > 2:
        x[2, n // 2] = float("nan")  # argmax takes a NaN as the maximum
    expected = x.argmax(dim=-1)
    for split in (True, False, None):
        assert torch.equal(argmax_rows(x, split=split), expected)
    assert torch.equal(argmax_rows(x.to(torch.bfloat16), split=True),
                       x.to(torch.bfloat16).argmax(dim=-1))
    # A non-contiguous view goes through plain argmax.
    wide = torch.randn(rows, 2 * n, device=device)
    assert torch.equal(argmax_rows(wide[:, ::2], split=True), wide[:, ::2].argmax(dim=-1))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("chunk_rows", [1, 3, 4, 100])
def test_sample_rows_in_chunks_matches_one_pass(device, chunk_rows, monkeypatch):
    """Sampling a big batch in chunks of rows (bounded memory) gives what one pass gives: greedy
    and seeded rows the same tokens, logprobs of the batch's top-N width in every chunk, penalty
    and bias rows their own edits."""
    from pyorch.layers import sampler as sampler_mod

    vocab = 97
    torch.manual_seed(3)
    logits = torch.randn(10, vocab)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8, top_p=0.9, seed=11),
        SamplingParams(temperature=0.0, logprobs=3),
        SamplingParams(temperature=1.2, top_k=5, seed=12, logprobs=1),
        SamplingParams(temperature=0.0, repetition_penalty=1.5, presence_penalty=0.5),
        SamplingParams(temperature=0.7, min_p=0.1, seed=13),
        SamplingParams(temperature=0.0, logit_bias={5: 100.0}),
        SamplingParams(temperature=0.9, seed=14, frequency_penalty=0.3),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, top_p=0.5, top_k=20, seed=15, logprobs=5),
    ]

    def run(chunk_elements):
        monkeypatch.setattr(sampler_mod, "SAMPLER_CHUNK_ELEMENTS", chunk_elements)
        rows = [SamplingRow(params=p, prompt_token_ids=[1, 2, 3], output_token_ids=[4, 4, 7],
                            generator=None if p.seed is None else make_generator(p.seed, device))
                for p in params]
        return sampler_mod.sample_rows(Sampler(), logits.to(device), rows)

    whole, chunked = run(1 << 30), run(chunk_rows * vocab)
    assert torch.equal(whole.sampled_token_ids, chunked.sampled_token_ids)
    assert whole.sampled_token_ids[6].item() == 5  # the bias row
    assert whole.logprobs is not None and chunked.logprobs is not None
    assert whole.logprobs.logprobs.shape == (10, 6)  # 5 + the sampled token, for every row
    for a, b in zip(whole.logprobs, chunked.logprobs):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_fused_draw_seeded_row_is_independent_of_batch(device, monkeypatch):
    """A seeded temperature-only row is drawn by the one-pass kernel in every batch: alone, among
    top_p / top_k / min_p rows (the unfused path beside it), greedy rows, and rows whose logits are
    edited (penalties: the float32 copy, then the kernel on it) gives the same tokens."""
    monkeypatch.setenv("PYORCH_FUSED_SAMPLER", "1")
    logits_steps = [torch.randn(300) for _ in range(10)]
    plain = SamplingParams(seed=77, temperature=0.9)
    alone = _seeded_run(device, logits_steps, lambda step: [], seed=77, params=plain)
    for builder, position in [
        (lambda step: [SamplingParams(top_p=0.8, seed=5), SamplingParams(top_k=4)], 1),
        (lambda step: [SamplingParams(temperature=0.0), SamplingParams(min_p=0.1)] * 2, 3),
        (lambda step: [SamplingParams(presence_penalty=0.5), SamplingParams()], 2),
        (lambda step: [SamplingParams(temperature=1.3, seed=9)] * (step % 3 + 1), 0),
    ]:
        assert _seeded_run(device, logits_steps, builder, 77, position, plain) == alone


@pytest.mark.parametrize("device", DEVICES)
def test_temperature_only_rows_take_the_fused_draw(device, monkeypatch):
    """Which rows the one-pass kernel draws: all of a temperature-only batch (on the raw logits),
    only the plain rows of a mixed one, none of a top_p batch or with PYORCH_FUSED_SAMPLER=0."""
    from pyorch.layers import sampler as sampler_mod

    calls = []
    real = sampler_mod._ops.random_sample_from_logits

    def counting(logits, temperature, seeds):
        calls.append((logits.dtype, temperature.clone()))
        return real(logits, temperature, seeds)

    monkeypatch.setattr(sampler_mod._ops, "random_sample_from_logits", counting)
    monkeypatch.setenv("PYORCH_FUSED_SAMPLER", "1")
    logits = torch.randn(6, 90).to(torch.bfloat16)
    plain = [SamplingParams(temperature=0.0 if i == 2 else 0.7) for i in range(6)]
    out = _sample(logits, plain, device).sampled_token_ids.cpu()
    assert len(calls) == 1 and calls[0][0] == torch.bfloat16  # the raw logits, no float32 copy
    assert calls[0][1].cpu().tolist()[2] == 0.0  # the greedy row is the kernel's argmax
    assert out[2].item() == logits[2].float().argmax().item()
    calls.clear()
    mixed = [SamplingParams(top_p=0.5) if i % 2 else SamplingParams() for i in range(6)]
    out = _sample(logits, mixed, device).sampled_token_ids.cpu()
    assert len(calls) == 1 and calls[0][0] == torch.float32
    assert ((out >= 0) & (out < 90)).all()
    calls.clear()
    _sample(logits, [SamplingParams(top_p=0.5)] * 6, device)
    assert not calls
    monkeypatch.setenv("PYORCH_FUSED_SAMPLER", "0")
    _sample(logits, plain, device)
    assert not calls
    monkeypatch.setenv("PYORCH_FUSED_SAMPLER", "auto")  # on for both devices
    _sample(logits, plain, device)
    assert len(calls) == 1


@pytest.mark.parametrize("device", DEVICES)
def test_fused_and_unfused_draws_follow_the_same_softmax(device, monkeypatch):
    logits = torch.randn(10) * 1.5
    expected = torch.softmax(logits / 0.8, -1)
    for flag in ("1", "0"):  # the kernel and the unfused race
        monkeypatch.setenv("PYORCH_FUSED_SAMPLER", flag)
        draws = _draws(logits, SamplingParams(temperature=0.8), device, n=20000)
        freq = torch.bincount(draws, minlength=10).float() / draws.numel()
        torch.testing.assert_close(freq, expected, atol=0.015, rtol=0)
