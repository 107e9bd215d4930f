"""The reasoning parsers on hand-written outputs, whole and streamed character by character."""

from __future__ import annotations

import pytest

from pyorch.entrypoints.openai.reasoning import ReasoningStreamer, get_reasoning_parser

CASES = [
    ("qwen3", "", "<think>\nstep 1</think>\n\nAnswer.", "\nstep 1", "\n\nAnswer."),
    ("qwen3", "", "  <think>a</think>b", "a", "b"),
    ("qwen3", "", "Answer without thinking.", None, "Answer without thinking."),
    ("qwen3", "", "<think>never closed", "never closed", None),
    ("qwen3", "", "<thin", None, "<thin"),
    # Qwen3 thinking-only models: the template opened the block.
    ("qwen3", "<|im_start|>assistant\n<think>\n", "why</think>so", "why", "so"),
    # enable_thinking=False: the template wrote an empty block; the output is content.
    ("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n", "Just this.", None,
     "Just this."),
    ("deepseek_r1", "", "r</think>c", "r", "c"),
    ("deepseek_r1", "", "<think>r</think>c</think>", "r", "c</think>"),
    ("deepseek_r1", "", "only reasoning", "only reasoning", None),
    ("deepseek_r1", "", "x</thin", "x</thin", None),
]


def streamed(parser, prompt, text):
    streamer = ReasoningStreamer(parser, prompt)
    reasoning, content = "", ""
    for i in range(1, len(text) + 1):
        r, c = streamer.feed(text[:i], i == len(text))
        reasoning, content = reasoning + r, content + c
        assert content == streamer.content_text
    return reasoning, content


@pytest.mark.parametrize("name, prompt, text, reasoning, content", CASES)
def test_split(name, prompt, text, reasoning, content):
    parser = get_reasoning_parser(name)
    assert parser.extract_reasoning(text, prompt) == (reasoning, content)
    assert streamed(parser, prompt, text) == (reasoning or "", content or "")


def test_tags_are_held_back_while_streaming():
    streamer = ReasoningStreamer(get_reasoning_parser("deepseek_r1"), "")
    assert streamer.feed("abc</th", False) == ("abc", "")
    assert streamer.in_reasoning
    assert streamer.feed("abc</think>d", False) == ("", "d")
    assert not streamer.in_reasoning


def test_unknown_parser_is_named():
    with pytest.raises(ValueError, match="deepseek_r1"):
        get_reasoning_parser("nope")
