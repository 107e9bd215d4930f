"""The Responses API's store: `store`, `previous_response_id`, `GET /v1/responses/{id}` and
`POST /v1/responses/{id}/cancel`, as vLLM has them behind `VLLM_ENABLE_RESPONSES_API_STORE`.

Off by default (`PYORCH_ENABLE_RESPONSES_API_STORE=1` turns it on). When on, a response is
stored unless the request says `store: false` (the API's default is true), in this API-server
process's memory, together with the conversation that produced it (the input items, without
`instructions`, which OpenAI does not carry over); a request naming it in `previous_response_id`
continues that conversation: its input items come after the stored ones and the stored output.
vLLM's store never forgets; ours keeps the newest `MAX_STORED_RESPONSES` and forgets the oldest.
When off, `store: true`, `previous_response_id` and the GET/cancel routes are refused by name
(vLLM drops `store: true` silently; pyorch refuses what it does not do).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Optional

from pyorch import envs
from pyorch.entrypoints.openai.errors import OpenAIError

MAX_STORED_RESPONSES = 4096
_OFF = ("this server does not store responses: start it with "
        "PYORCH_ENABLE_RESPONSES_API_STORE=1 (vLLM's VLLM_ENABLE_RESPONSES_API_STORE)")


class ResponsesStore:
    """Stored responses by id, newest last (an LRU of at most `MAX_STORED_RESPONSES`)."""

    def __init__(self, enabled: Optional[bool] = None,
                 max_size: int = MAX_STORED_RESPONSES) -> None:
        self.enabled = envs.PYORCH_ENABLE_RESPONSES_API_STORE if enabled is None else enabled
        self.max_size = max_size
        # response id -> (response body, conversation items that led to it)
        self._items: OrderedDict[str, tuple[dict[str, Any], list[dict[str, Any]]]] = \
            OrderedDict()

    def wants_store(self, store: Optional[bool]) -> bool:
        """Whether a request with this `store` value is stored; refuses store=true when off."""
        if not self.enabled:
            if store:
                raise OpenAIError(f"store=true is not supported: {_OFF}", param="store")
            return False
        return store is not False

    def history(self, previous_response_id: Optional[str]) -> list[dict[str, Any]]:
        """The input items that come before a request continuing `previous_response_id`."""
        if previous_response_id is None:
            return []
        if not self.enabled:
            raise OpenAIError(f"previous_response_id is not supported: {_OFF}",
                              param="previous_response_id")
        found = self._items.get(previous_response_id)
        if found is None:
            raise OpenAIError(f"Response with id '{previous_response_id}' not found.",
                              status=404, param="previous_response_id")
        self._items.move_to_end(previous_response_id)
        body, conversation = found
        return conversation + [_as_input(item) for item in body["output"]]

    def put(self, body: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        self._items[body["id"]] = (body, conversation)
        self._items.move_to_end(body["id"])
        while len(self._items) > self.max_size:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> dict[str, Any]:
        if not self.enabled:
            raise OpenAIError(f"retrieving responses is not supported: {_OFF}",
                              param="response_id")
        found = self._items.get(response_id)
        if found is None:
            raise OpenAIError(f"Response with id '{response_id}' not found.", status=404,
                              param="response_id")
        self._items.move_to_end(response_id)
        return found[0]

    def cancel(self, response_id: str) -> None:
        """vLLM cancels only background responses, which this server refuses; a stored one
        has finished, so cancelling it is a 400 (vLLM's answer for a synchronous response)."""
        self.get(response_id)
        raise OpenAIError("Cannot cancel a synchronous response.", param="response_id")


def _as_input(item: dict[str, Any]) -> dict[str, Any]:
    """An output item as an input item of the next turn (the same shapes the input accepts)."""
    if item["type"] == "message":
        return {"type": "message", "role": "assistant", "content": item["content"]}
    return dict(item)
