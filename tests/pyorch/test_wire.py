"""The engine-core wire protocol (pyorch/wire.py): framing, the class-free unpickler, and the
payload codecs of SamplingParams, EngineCoreOutput and SchedulerStats."""

from __future__ import annotations

import pickle

import pytest
import torch

from pyorch.core_types import EngineCoreOutput, LogprobsLists
from pyorch.metrics.stats import SchedulerStats
from pyorch.sampling_params import RequestOutputKind, SamplingParams
from pyorch.wire import (
    FrameReader,
    decode_output,
    decode_params,
    decode_stats,
    encode_frame,
    encode_output,
    encode_params,
    encode_stats,
)


def test_frames_roundtrip_in_pieces():
    msgs = [(1, "req", [1, 2, 3], {"a": 1.5, "b": None}), (2, ["x", "y"]), (6,)]
    data = b"".join(encode_frame(m) for m in msgs)
    reader = FrameReader()
    got = []
    for i in range(0, len(data), 7):  # a stream delivers arbitrary pieces
        got += reader.feed(data[i:i + 7])
    assert got == msgs


def test_many_frames_in_one_read_then_a_partial_one():
    """Under load one read holds many frames and the start of the next (the reader parses them
    in place and trims its buffer once per read)."""
    msgs = [(12, [("r%d" % i, [i], None)], i) for i in range(300)]
    frames = [encode_frame(m) for m in msgs]
    reader = FrameReader()
    head, tail = frames[-1][:5], frames[-1][5:]
    assert reader.feed(b"".join(frames[:-1]) + head) == msgs[:-1]
    assert reader.feed(b"") == []
    assert reader.feed(tail + frames[0]) == [msgs[-1], msgs[0]]
    assert reader.feed(b"") == []


def test_frames_refuse_objects():
    with pytest.raises(pickle.UnpicklingError, match="plain data only"):
        FrameReader().feed(encode_frame((12, torch.zeros(2))))
    with pytest.raises(pickle.UnpicklingError):
        FrameReader().feed(encode_frame(SamplingParams()))


def test_params_roundtrip_keeps_engine_filled_fields():
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=5, seed=3, stop=["x"],
                            stop_token_ids=[9], logit_bias={4: 1.5}, max_tokens=7, min_tokens=2,
                            logprobs=2, output_kind=RequestOutputKind.DELTA)
    params.update_from_generation_config({"eos_token_id": [2, 11]}, 2)
    params._bad_words_token_ids = [[5, 6]]
    wire = encode_params(params)
    FrameReader().feed(encode_frame(wire))  # plain data only
    back = decode_params(wire)
    assert back == params
    assert back.all_stop_token_ids == {2, 9, 11} and back.bad_words_token_ids == [[5, 6]]
    assert back.output_kind is RequestOutputKind.DELTA


def test_outputs_and_stats_roundtrip():
    lp = LogprobsLists([[3, 1]], [[-0.1, -2.0]], [1])
    out = EngineCoreOutput("r", [3], "stop", 3, lp, None, 16)
    (back,) = FrameReader().feed(encode_frame(encode_output(out)))
    assert decode_output(back) == out
    stats = SchedulerStats(2, 1, 0.25, 100, 40, 3)
    (back,) = FrameReader().feed(encode_frame(encode_stats(stats)))
    assert decode_stats(back) == stats
