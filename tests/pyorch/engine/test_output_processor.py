"""OutputProcessor: output kinds (cumulative, delta, final only), n > 1, aborts, and the
IterationStats it measures. No model: EngineCoreOutputs are made by hand."""

from __future__ import annotations

import pytest

from pyorch.engine.output_processor import OutputProcessor
from pyorch.core_types import EngineCoreOutput
from pyorch.metrics.stats import IterationStats
from pyorch.sampling_params import RequestOutputKind, SamplingParams

EOS = 0


class _CharTokenizer:
    """Token t decodes to one letter; 0 is EOS (decodes to nothing)."""

    eos_token_id = EOS

    def decode(self, token_ids, **kwargs):
        return "".join(chr(ord("a") + (t - 1) % 26) for t in token_ids if t != EOS)

    def get_added_vocab(self):
        return {}


def _out(req_id, tokens, finish=None, stop=None):
    return EngineCoreOutput(req_id=req_id, new_token_ids=list(tokens), finish_reason=finish,
                            stop_reason=stop)


def _processor(kind, n=1, **kw):
    op = OutputProcessor(_CharTokenizer())
    params = SamplingParams(n=n, output_kind=kind, max_tokens=50, **kw)
    children = op.add_request("r", "prompt", [1, 2, 3], params, EOS, vocab_size=64)
    return op, [cid for cid, _ in children]


# tokens 1..5 -> "abcde"
STEPS = [[1], [2], [3], [4], [5]]


def _run(op, child_ids, steps, finish_last="length"):
    results = []
    for i, tokens in enumerate(steps):
        finish = finish_last if i == len(steps) - 1 else None
        outs, stopped = op.process_outputs([_out(c, tokens, finish) for c in child_ids])
        assert stopped == []
        results.extend(outs)
    return results


def test_cumulative_delta_final_only_agree():
    cumulative = _run(*_processor(RequestOutputKind.CUMULATIVE), STEPS)
    assert [o.outputs[0].text for o in cumulative] == ["a", "ab", "abc", "abcd", "abcde"]
    assert [o.finished for o in cumulative] == [False] * 4 + [True]

    delta = _run(*_processor(RequestOutputKind.DELTA), STEPS)
    assert [o.outputs[0].text for o in delta] == list("abcde")
    assert [o.outputs[0].token_ids for o in delta] == STEPS
    assert delta[-1].finished and delta[-1].outputs[0].finish_reason == "length"

    final = _run(*_processor(RequestOutputKind.FINAL_ONLY), STEPS)
    assert len(final) == 1 and final[0].finished
    assert final[0].outputs[0].text == "abcde" and final[0].outputs[0].token_ids == [1, 2, 3, 4, 5]


def test_delta_holds_back_possible_stop_string_and_stops():
    op, (cid,) = _processor(RequestOutputKind.DELTA, stop=["cd"])
    texts = []
    for tokens in STEPS[:4]:
        outs, stopped = op.process_outputs([_out(cid, tokens)])
        texts += [o.outputs[0].text for o in outs]
    # "c" is held back (it could start "cd"); once "cd" appears the request stops before it.
    assert stopped == [cid]
    assert "".join(texts) == "ab"
    assert outs[-1].finished and outs[-1].outputs[0].stop_reason == "cd"
    assert not op.has_request("r")


def test_delta_n2_sends_only_changed_children():
    op, (c0, c1) = _processor(RequestOutputKind.DELTA, n=2, seed=3)
    outs, _ = op.process_outputs([_out(c0, [1]), _out(c1, [2])])
    assert sorted(c.index for c in outs[0].outputs) == [0, 1]
    outs, _ = op.process_outputs([_out(c1, [3], "length")])
    assert [(c.index, c.text, c.finish_reason) for c in outs[0].outputs] == [(1, "c", "length")]
    assert not outs[0].finished
    # A stop token id ends child 0: its text is left out, its id is kept (vLLM's rule).
    outs, _ = op.process_outputs([_out(c0, [4], "stop", 4)])
    assert [(c.index, c.text, c.token_ids, c.stop_reason) for c in outs[0].outputs] == [
        (0, "", [4], 4)]
    assert outs[0].finished


def test_finish_aborted_returns_last_output():
    op, (cid,) = _processor(RequestOutputKind.CUMULATIVE)
    op.process_outputs([_out(cid, [1, 2])])
    stats = IterationStats()
    child_ids, outs = op.finish_aborted(["r", "unknown"], stats)
    assert child_ids == [cid]
    assert len(outs) == 1 and outs[0].finished
    assert outs[0].outputs[0].finish_reason == "abort" and outs[0].outputs[0].text == "ab"
    assert [f.finish_reason for f in stats.finished_requests] == ["abort"]
    assert stats.finished_requests[0].num_generation_tokens == 2
    assert op.num_unfinished() == 0
    # Late outputs of the aborted request are ignored.
    assert op.process_outputs([_out(cid, [3])]) == ([], [])


def test_iteration_stats():
    op, (cid,) = _processor(RequestOutputKind.CUMULATIVE)
    op.mark_scheduled([cid], scheduled_time=op.parents["r"].metrics.arrival_time + 0.5)
    first = IterationStats()
    op.process_outputs([_out(cid, [1])], first)
    assert first.num_prompt_tokens == 3 and first.num_generation_tokens == 1
    assert len(first.time_to_first_tokens) == 1 and first.inter_token_latencies == []
    second = IterationStats()
    op.process_outputs([_out(cid, [2])], second)
    assert second.num_prompt_tokens == 0 and second.num_generation_tokens == 1
    assert second.time_to_first_tokens == [] and len(second.inter_token_latencies) == 1
    last = IterationStats()
    op.process_outputs([_out(cid, [EOS], "stop")], last)
    (done,) = last.finished_requests
    assert done.finish_reason == "stop" and done.num_prompt_tokens == 3
    assert done.num_generation_tokens == 3  # the EOS token counts as generated
    assert done.queued_time == pytest.approx(0.5)
    assert done.e2e_latency >= done.decode_time >= 0.0


def test_duplicate_request_id_is_refused():
    op, _ = _processor(RequestOutputKind.CUMULATIVE)
    with pytest.raises(ValueError, match="already running"):
        op.add_request("r", None, [1], SamplingParams(), EOS)


def test_output_kind_validation():
    assert SamplingParams(output_kind=1).output_kind is RequestOutputKind.DELTA
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind=7)


def test_stop_string_on_the_last_allowed_token_is_a_stop():
    """The core finishes with "length" on the step whose token completes a stop string: the
    request reports "stop" with that string (as vLLM), and the core need not be told again."""
    op, (cid,) = _processor(RequestOutputKind.CUMULATIVE, stop=["cd"])
    for tokens in STEPS[:3]:
        op.process_outputs([_out(cid, tokens)])
    outs, stopped = op.process_outputs([_out(cid, [4], finish="length")])
    assert stopped == []
    done = outs[-1].outputs[0]
    assert outs[-1].finished and (done.finish_reason, done.stop_reason) == ("stop", "cd")
    assert done.text == "ab"


def test_mixed_output_kinds_in_one_step():
    """A running FINAL_ONLY request with one sequence is skipped outright; the outputs of the
    others, and their order (first child seen first), are as before."""
    op = OutputProcessor(_CharTokenizer())
    for req_id, kind, n in (("f", RequestOutputKind.FINAL_ONLY, 1),
                            ("c", RequestOutputKind.CUMULATIVE, 1),
                            ("g", RequestOutputKind.FINAL_ONLY, 2),
                            ("s", RequestOutputKind.FINAL_ONLY, 1)):
        op.add_request(req_id, None, [1], SamplingParams(n=n, output_kind=kind, seed=1,
                                                         stop=["b"] if req_id == "s" else None),
                       EOS, vocab_size=64)

    def step(*outs):
        results, stopped = op.process_outputs([_out(*o) for o in outs])
        return [(r.request_id, r.finished, [c.text for c in r.outputs]) for r in results], stopped

    assert step(("0_g", [1]), ("f", [1]), ("c", [1]), ("1_g", [2]), ("s", [1])) == (
        [("c", False, ["a"])], [])
    assert step(("s", [2]), ("f", [2], "length"), ("0_g", [2], "length"), ("c", [2])) == (
        [("s", True, ["a"]), ("f", True, ["ab"]), ("c", False, ["ab"])], ["s"])
    assert step(("1_g", [3], "stop", 3), ("c", [3], "length")) == (
        [("g", True, ["ab", "b"]), ("c", True, ["abc"])], [])
    assert op.num_unfinished() == 0
