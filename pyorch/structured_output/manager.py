"""StructuredOutputManager: the engine core's side of structured output (vLLM v1's shape).

- `grammar_init(request)` (when the core queues a request): starts compiling the request's
  grammar on a thread pool, or takes it from the cache of compiled grammars (keyed by the spec).
  The scheduler does not start a request whose grammar is still compiling (vLLM's
  WAITING_FOR_FSM), and starts the others meanwhile.
- `grammar_bitmask(...)` (after `schedule()`, before the step runs): one int32 row of
  ceil(vocab_size / 32) words per constrained row that samples this step, filled by xgrammar.
  The runner applies it to the logits (`apply_token_bitmask_inplace`) before sampling.
- After the step, the scheduler advances the matchers over the sampled tokens
  (`accept_sampled`: xgrammar's threaded batch accept for many one-token decodes); a finished
  request drops its matcher with it.

The tokenizer and xgrammar load on the first constrained request, on the compile thread, so a
server that never sees one never pays for them and the step loop never waits for them.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

import numpy as np

from pyorch.structured_output.backend_xgrammar import (
    GrammarSpec,
    XgrammarBackend,
    XgrammarGrammar,
    grammar_spec,
)

if TYPE_CHECKING:
    from pyorch.core.request import Request
    from pyorch.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

# Rows filled one matcher after another below this; xgrammar's batch filler (threads) above.
_BATCH_FILL_MIN_ROWS = 16
# Compiled grammars kept for reuse (least recently used dropped first; a running request keeps
# its own matcher, so dropping one never affects it). Bounds memory under many distinct specs.
GRAMMAR_CACHE_SIZE = 256


@dataclass
class GrammarOutput:
    """The bitmask of one step: row i constrains the request structured_output_request_ids[i]."""

    structured_output_request_ids: list[str]
    grammar_bitmask: np.ndarray  # [len(ids), ceil(vocab_size / 32)] int32


class StructuredOutputRequest:
    """A request's constraint: its spec, then (once compiled) its matcher."""

    def __init__(self, params: StructuredOutputsParams, spec: GrammarSpec) -> None:
        self.params = params
        self.spec = spec
        self._future: Optional[Future] = None
        self.grammar: Optional[XgrammarGrammar] = None
        self.error: Optional[str] = None  # why the grammar could not be built

    @property
    def is_ready(self) -> bool:
        """True once the matcher exists or compiling failed (the scheduler then drops the
        request with `error`)."""
        if self.grammar is not None or self.error is not None:
            return True
        future = self._future
        if future is None or not future.done():
            return False
        try:
            self.grammar = future.result()
        except Exception as e:  # noqa: BLE001 - reported to the client as the request's error
            self.error = f"structured_outputs could not be compiled: {e}"
        self._future = None
        return True

    def accept_tokens(self, request_id: str, token_ids: list[int]) -> None:
        assert self.grammar is not None, "a request runs only once its grammar is ready"
        if not self.grammar.accept_tokens(token_ids):
            _rejected(request_id, token_ids)


def _rejected(request_id: str, token_ids: list[int]) -> None:
    # Cannot happen while the bitmask is applied: a bug, not the client's fault.
    logger.error("request %s: the grammar rejected sampled tokens %s", request_id, token_ids)


_batch_matcher: Any = None


def _get_batch_matcher() -> Any:
    """xgrammar's BatchGrammarMatcher (its thread pool: half the cores), made once."""
    global _batch_matcher
    if _batch_matcher is None:
        import xgrammar

        _batch_matcher = xgrammar.BatchGrammarMatcher()
    return _batch_matcher


def accept_sampled(pending: list[tuple[str, StructuredOutputRequest, list[int]]]) -> None:
    """Advances the matchers of a step's constrained requests over their sampled tokens
    (request id, its StructuredOutputRequest, new token ids). From `_BATCH_FILL_MIN_ROWS`
    one-token decodes on, those go to xgrammar's batch accept (its threads) in one call; the
    rest (several tokens, terminated grammars) one matcher at a time, as accept_tokens does."""
    batch: list[tuple[str, XgrammarGrammar, int]] = []
    for req_id, so_request, token_ids in pending:
        grammar = so_request.grammar
        assert grammar is not None, "a request runs only once its grammar is ready"
        if len(token_ids) == 1 and not grammar.matcher.is_terminated():
            batch.append((req_id, grammar, token_ids[0]))
        else:
            so_request.accept_tokens(req_id, token_ids)
    if len(batch) < _BATCH_FILL_MIN_ROWS:
        for req_id, grammar, token_id in batch:
            if not grammar.accept_tokens([token_id]):
                _rejected(req_id, [token_id])
        return
    accepted = _get_batch_matcher().batch_accept_token(
        [g.matcher for _, g, _ in batch], [t for _, _, t in batch])
    for (req_id, grammar, token_id), ok in zip(batch, accepted, strict=True):
        if ok:
            grammar.num_processed_tokens += 1
        else:
            _rejected(req_id, [token_id])


class StructuredOutputManager:
    """Compiles, caches and serves grammars for the requests of one engine core.

    load_tokenizer: returns the model's HF tokenizer (called once, on the compile thread).
    vocab_size: the model's logits width (may exceed the tokenizer's vocabulary).
    """

    def __init__(self, load_tokenizer: Callable[[], Any], vocab_size: int,
                 max_workers: int = 2) -> None:
        self._load_tokenizer = load_tokenizer
        self.vocab_size = vocab_size
        self.num_words = (vocab_size + 31) // 32
        self._backend: Optional[XgrammarBackend] = None
        self._backend_lock = threading.Lock()
        self._executor: Optional[ThreadPoolExecutor] = None
        self._max_workers = max_workers
        # spec -> future of its CompiledGrammar, least recently used first
        self._cache: OrderedDict[GrammarSpec, Future] = OrderedDict()
        self._cache_lock = threading.Lock()

    # ---- compiling ----------------------------------------------------------------------------
    def _get_backend(self) -> XgrammarBackend:
        with self._backend_lock:
            if self._backend is None:
                self._backend = XgrammarBackend(self._load_tokenizer(), self.vocab_size)
            return self._backend

    def _compile(self, spec: GrammarSpec) -> Any:
        return self._get_backend().compile(spec)

    def _compiled_future(self, spec: GrammarSpec) -> Future:
        with self._cache_lock:
            future = self._cache.get(spec)
            if future is not None and future.done() and future.exception() is not None:
                future = None  # a failure (e.g. the tokenizer failed to load) is not cached
            if future is None:
                if self._executor is None:
                    self._executor = ThreadPoolExecutor(self._max_workers,
                                                        thread_name_prefix="pyorch-grammar")
                future = self._executor.submit(self._compile, spec)
                self._cache[spec] = future
                while len(self._cache) > GRAMMAR_CACHE_SIZE:
                    self._cache.popitem(last=False)
            self._cache.move_to_end(spec)
            return future

    def grammar_init(self, request: Request) -> None:
        """Gives a constrained request its StructuredOutputRequest and starts compiling."""
        params = request.sampling_params.structured_outputs
        if params is None:
            return
        so_request = StructuredOutputRequest(params, grammar_spec(params))
        compiled = self._compiled_future(so_request.spec)
        matcher: Future = Future()

        def on_compiled(done: Future) -> None:
            try:
                matcher.set_result(self._get_backend().new_grammar(done.result()))
            except Exception as e:  # noqa: BLE001 - surfaced by StructuredOutputRequest
                matcher.set_exception(e)

        compiled.add_done_callback(on_compiled)
        so_request._future = matcher
        request.structured_output_request = so_request

    def wait_for_compiles(self, requests: list[Request], timeout: float) -> None:
        """Blocks up to `timeout` s until one of these requests' grammars is ready (the core
        calls it when nothing else can run, instead of spinning)."""
        futures = [r.structured_output_request._future for r in requests
                   if r.structured_output_request is not None
                   and r.structured_output_request._future is not None]
        if futures:
            wait_futures(futures, timeout=timeout, return_when="FIRST_COMPLETED")

    # ---- one step -----------------------------------------------------------------------------
    def grammar_bitmask(self, requests: dict[str, Request],
                        req_ids: list[str]) -> Optional[GrammarOutput]:
        """The bitmask rows of the constrained requests that sample this step (None if none)."""
        if not req_ids:
            return None
        bitmask = np.empty((len(req_ids), self.num_words), dtype=np.int32)
        grammars = []
        for req_id in req_ids:
            so_request = requests[req_id].structured_output_request
            assert so_request is not None and so_request.grammar is not None
            grammars.append(so_request.grammar)
        live = [i for i, g in enumerate(grammars) if not g.is_terminated()]
        if len(live) >= _BATCH_FILL_MIN_ROWS:
            if len(live) < len(grammars):  # terminated rows allow everything
                bitmask[[i for i, g in enumerate(grammars) if g.is_terminated()]] = -1
            _get_batch_matcher().batch_fill_next_token_bitmask(
                [grammars[i].matcher for i in live], bitmask, live)
        else:
            for i, grammar in enumerate(grammars):
                grammar.fill_bitmask(bitmask, i)
        return GrammarOutput(list(req_ids), bitmask)

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
