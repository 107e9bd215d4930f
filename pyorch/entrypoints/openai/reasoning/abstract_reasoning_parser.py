"""Reasoning parsers (`--reasoning-parser NAME`): split a thinking model's output into
`reasoning` (the text inside `<think>...</think>`) and `content` (the rest).

Whether the output starts inside the thinking block is decided before the first token: when
the rendered prompt ends with the start tag (DeepSeek-R1's template, Qwen3's thinking-only
models), the model's first words are reasoning. Deciding it from the prompt rather than from
the output makes the streamed split equal to the non-streamed one.
"""

from __future__ import annotations

from typing import Optional

from pyorch.entrypoints.openai.tool_parsers.json_scan import held_prefix


class ReasoningParser:
    """Subclasses set the tags and whether an output with no start tag is reasoning."""

    start_tag = "<think>"
    end_tag = "</think>"
    # DeepSeek-R1 always thinks first (its template opens the block); Qwen3 only when the
    # block is opened by the prompt or by the model.
    always_starts_in_reasoning = False

    def starts_in_reasoning(self, prompt: str) -> bool:
        return self.always_starts_in_reasoning or prompt.rstrip().endswith(self.start_tag)

    def extract_reasoning(self, text: str, prompt: str = "") -> tuple[Optional[str],
                                                                       Optional[str]]:
        """(reasoning, content) of a complete output; None for an empty part."""
        streamer = ReasoningStreamer(self, prompt)
        reasoning, content = streamer.feed(text, True)
        return reasoning or None, content or None


class ReasoningStreamer:
    """Splits the growing text of one choice into reasoning and content deltas; characters that
    may be the start of a tag are held back until the next ones tell."""

    def __init__(self, parser: ReasoningParser, prompt: str) -> None:
        self.parser = parser
        # "start": the output may still open the block with the start tag (dropped); else it
        # goes on in `default`. Then "reasoning" until the end tag, then "content".
        self.mode = "start"
        self.default = "reasoning" if parser.starts_in_reasoning(prompt) else "content"
        self.pos = 0  # characters of the text already handed out (or dropped as tags)
        self.content_text = ""  # all content so far (what tool parsers read)

    @property
    def in_reasoning(self) -> bool:
        return self.mode == "reasoning" or (self.mode == "start" and self.default == "reasoning")

    def feed(self, text: str, final: bool) -> tuple[str, str]:
        """(reasoning delta, content delta) for the whole text so far."""
        reasoning, content = "", ""
        start, end = self.parser.start_tag, self.parser.end_tag
        while self.pos < len(text):
            rest = text[self.pos:]
            if self.mode == "start":
                stripped = rest.lstrip()
                if stripped.startswith(start):
                    self.pos += len(rest) - len(stripped) + len(start)
                    self.mode = "reasoning"
                    continue
                if not final and start.startswith(stripped):
                    break  # maybe the start tag
                self.mode = self.default
                continue
            if self.mode == "reasoning":
                close = rest.find(end)
                if close >= 0:
                    reasoning += rest[:close]
                    self.pos += close + len(end)
                    self.mode = "content"
                    continue
                keep = 0 if final else held_prefix(rest, end)
                reasoning += rest[:len(rest) - keep]
                self.pos += len(rest) - keep
                break
            content += rest
            self.pos = len(text)
        self.content_text += content
        return reasoning, content


class Qwen3ReasoningParser(ReasoningParser):
    """`qwen3`: `<think>...</think>` at the start of the output (or opened by the prompt).
    An output that never opens the block (enable_thinking=False) is all content."""


class DeepSeekR1ReasoningParser(ReasoningParser):
    """`deepseek_r1`: the output is reasoning until `</think>` (the template opens the block;
    a leading `<think>` is dropped). An output cut off before `</think>` is all reasoning."""

    always_starts_in_reasoning = True
