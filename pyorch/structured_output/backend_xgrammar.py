"""The xgrammar backend (vLLM's default): what a constraint means as a grammar, the front end's
check of a constraint, and the per-request matcher that fills token bitmasks.

`grammar_spec` turns a `StructuredOutputsParams` into a hashable `GrammarSpec` (the cache key of
compiled grammars). `validate_structured_outputs` parses the spec with xgrammar's tokenizer-free
`Grammar.from_*` (a bad schema, regex or grammar raises ValueError with xgrammar's reason).
`XgrammarBackend` compiles specs against the model's tokenizer; `XgrammarGrammar` is one
request's matcher. xgrammar is imported lazily: it loads torch and takes seconds to import.
"""

from __future__ import annotations

import functools
import json
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from pyorch.sampling_params import StructuredOutputsParams

BITS_PER_WORD = 32
_ANY_OBJECT = '{"type": "object"}'


@dataclass(frozen=True)
class GrammarSpec:
    """A constraint in canonical form: kind is json, json_object, regex, choice, grammar or
    structural_tag; text is the schema (compact JSON, keywords sorted but each `properties` map
    in its given order: xgrammar emits properties in that order, as vLLM does) or structural
    tag, regex, EBNF grammar (choices become one)."""

    kind: str
    text: str
    any_whitespace: bool = True


def _ebnf_literal(text: str) -> str:
    """A string as an xgrammar EBNF literal: JSON's escapes, which the EBNF parser reads."""
    return json.dumps(text, ensure_ascii=False)


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose language is exactly the given strings (vLLM's guided_choice)."""
    return "root ::= " + " | ".join(f"({_ebnf_literal(c)})" for c in choices)


def grammar_spec(params: StructuredOutputsParams) -> GrammarSpec:
    """The canonical spec of a constraint (ValueError for an unparsable JSON schema string or a
    constraint this backend does not offer)."""
    any_ws = not params.disable_any_whitespace
    if params.json is not None:
        schema: Any = params.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError("structured_outputs.json must be a JSON schema object, got "
                             f"{type(schema).__name__}")
        return GrammarSpec("json", json.dumps(_canonical(schema), separators=(",", ":")),
                           any_ws)
    if params.json_object:
        return GrammarSpec("json_object", "", any_ws)
    if params.regex is not None:
        return GrammarSpec("regex", params.regex)
    if params.choice is not None:
        return GrammarSpec("choice", choice_grammar(params.choice))
    if params.grammar is not None:
        return GrammarSpec("grammar", params.grammar)
    return GrammarSpec("structural_tag", _structural_tag_text(params.structural_tag))


_DATA_KEYS = ("enum", "const", "default", "examples")  # JSON values, not schemas


def _canonical(node: Any, properties: bool = False) -> Any:
    """A schema with its keywords sorted (so equal schemas share a cache entry) but the order of
    each `properties` map kept: xgrammar emits an object's properties in that order, as vLLM
    does. Values of enum/const/default/examples are data and stay as given."""
    if isinstance(node, list):
        return [_canonical(v) for v in node]
    if not isinstance(node, dict):
        return node
    if properties:  # property name -> its schema, in the user's order
        return {k: _canonical(v) for k, v in node.items()}
    return {k: v if k in _DATA_KEYS else _canonical(v, properties=k == "properties")
            for k, v in sorted(node.items())}


def _structural_tag_text(text: Any) -> str:
    """A structural tag as compact JSON: xgrammar's `{"type": "structural_tag", "format": ...}`
    or vLLM's legacy `{"structures": [{"begin", "schema", "end"}], "triggers": [...]}`."""
    try:
        tag = json.loads(text)
    except (TypeError, json.JSONDecodeError) as e:
        raise ValueError(f"structured_outputs.structural_tag is not valid JSON: {e}") from None
    if not isinstance(tag, dict):
        raise ValueError("structured_outputs.structural_tag must be a JSON object")
    return json.dumps(tag, separators=(",", ":"))


def _legacy_tags(text: str) -> tuple[list[Any], list[str]] | None:
    """vLLM's legacy structural tag (structures + triggers) as xgrammar's items and triggers, or
    None for the current format (what vLLM's xgrammar backend does)."""
    tag = json.loads(text)
    if "structures" not in tag:
        return None
    structures, triggers = tag["structures"], tag.get("triggers")
    if not isinstance(structures, list) or not isinstance(triggers, list) or not all(
            isinstance(s, dict) and isinstance(s.get("begin"), str)
            and isinstance(s.get("end"), str) for s in structures):
        raise ValueError("a legacy structural tag needs structures (begin, schema, end) and "
                         "triggers")
    items = [_xgr().StructuralTagItem(begin=s["begin"], end=s["end"],
                                      schema=json.dumps(s.get("schema") or {}))
             for s in structures]
    return items, triggers


def _xgr() -> Any:
    import xgrammar

    return xgrammar


@functools.lru_cache(maxsize=1024)
def _check_spec(spec: GrammarSpec) -> None:
    xgr = _xgr()
    what = {"json": "JSON schema", "regex": "regex", "grammar": "grammar",
            "choice": "choice", "structural_tag": "structural tag"}.get(spec.kind)
    try:
        if spec.kind == "json":
            xgr.Grammar.from_json_schema(spec.text, any_whitespace=spec.any_whitespace)
        elif spec.kind == "regex":
            xgr.Grammar.from_regex(spec.text)
        elif spec.kind in ("grammar", "choice"):
            xgr.Grammar.from_ebnf(spec.text)
        elif spec.kind == "structural_tag":
            legacy = _legacy_tags(spec.text)
            if legacy is None:
                xgr.Grammar.from_structural_tag(spec.text)
            else:
                xgr.Grammar.from_structural_tag(*legacy)
    except Exception as e:  # xgrammar raises RuntimeError, InvalidJSONError, ... with a reason
        reason = str(e).strip().splitlines()
        raise ValueError(f"invalid {what} in structured_outputs: "
                         f"{' '.join(reason)[:1000] or type(e).__name__}") from None


def validate_structured_outputs(params: StructuredOutputsParams) -> GrammarSpec:
    """Raises ValueError (with xgrammar's reason) unless the constraint compiles; returns its
    spec. Tokenizer-free, so the front end can run it; results are cached by spec."""
    spec = grammar_spec(params)
    _check_spec(spec)
    return spec


class XgrammarBackend:
    """Compiles specs against one tokenizer (thread-safe; xgrammar caches compiled grammars).

    vocab_size: the model's logits width; tokens past the tokenizer's vocabulary are never
    allowed by the masks of constrained rows."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        xgr = _xgr()
        self.vocab_size = vocab_size
        self.num_words = (vocab_size + BITS_PER_WORD - 1) // BITS_PER_WORD
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.compiler = xgr.GrammarCompiler(info, max_threads=1)
        self._lock = threading.Lock()

    def compile(self, spec: GrammarSpec) -> Any:
        """The CompiledGrammar of a spec (RuntimeError/ValueError if it does not compile)."""
        c = self.compiler
        if spec.kind == "json":
            return c.compile_json_schema(spec.text, any_whitespace=spec.any_whitespace)
        if spec.kind == "json_object":
            # Any JSON object (OpenAI's json_object; xgrammar's builtin JSON grammar would also
            # take arrays and scalars). Non-strict: an object of any properties.
            return c.compile_json_schema(_ANY_OBJECT, any_whitespace=spec.any_whitespace,
                                         strict_mode=False)
        if spec.kind == "regex":
            return c.compile_regex(spec.text)
        if spec.kind == "structural_tag":
            legacy = _legacy_tags(spec.text)
            return c.compile_structural_tag(spec.text) if legacy is None \
                else c.compile_structural_tag(*legacy)
        return c.compile_grammar(spec.text)

    def new_grammar(self, compiled: Any) -> XgrammarGrammar:
        return XgrammarGrammar(_xgr().GrammarMatcher(compiled), self.num_words)


class XgrammarGrammar:
    """One request's position in its grammar."""

    def __init__(self, matcher: Any, num_words: int) -> None:
        self.matcher = matcher
        self.num_words = num_words
        self.num_processed_tokens = 0

    def accept_tokens(self, token_ids: list[int]) -> bool:
        """Advances over sampled tokens; False (state unchanged past the first bad one) if the
        grammar rejects one, which a masked sampler never produces."""
        for token_id in token_ids:
            if self.matcher.is_terminated():
                return True  # past the stop token (ignore_eos): nothing left to constrain
            if not self.matcher.accept_token(token_id):
                return False
            self.num_processed_tokens += 1
        return True

    def is_terminated(self) -> bool:
        return bool(self.matcher.is_terminated())

    def fill_bitmask(self, bitmask: np.ndarray, index: int) -> None:
        """Writes this request's allowed tokens into row `index` of bitmask
        ([rows, num_words] int32): all ones once the grammar has terminated (vLLM's rule: after
        the stop token, as with ignore_eos, generation is free)."""
        if self.matcher.is_terminated():
            bitmask[index] = -1
        else:
            self.matcher.fill_next_token_bitmask(bitmask, index)
