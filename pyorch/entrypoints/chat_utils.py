"""Chat messages as the chat template wants them: OpenAI's content-part lists flattened to text.

OpenAI (and vLLM) accept a message's `content` as a string or as a list of parts. Only text parts
(`{"type": "text", "text": ...}`) can be served by a text-only model; they are joined with
newlines, as vLLM does for templates that take string content. Any other part (`image_url`,
`input_audio`, ...) is refused by name rather than dropped.
"""

from __future__ import annotations

from typing import Any


def content_text(content: Any, where: str = "content") -> str:
    """The text of a message's `content` (a string, None, or a list of text parts); raises
    ValueError naming the first part that is not text."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, (list, tuple)):
        raise ValueError(f"{where} must be a string or a list of content parts, got "
                         f"{type(content).__name__}")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            raise ValueError(f"{where}.{j}: content parts of type {kind!r} are not supported "
                             "(this model takes text only: {\"type\": \"text\", \"text\": ...})")
        texts.append(part["text"])
    return "\n".join(texts)


def flatten_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation with every content-part list replaced by its text."""
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages.{i} must be a dict, got {type(message).__name__}")
        if isinstance(message.get("content"), (list, tuple)):
            message = {**message,
                       "content": content_text(message["content"], f"messages.{i}.content")}
        out.append(message)
    return out
