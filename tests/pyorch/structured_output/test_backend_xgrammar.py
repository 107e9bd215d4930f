"""The xgrammar backend: canonical specs (the compile cache key), the front end's validation
(xgrammar's reason in a ValueError), choices as a grammar, and bitmasks that never allow the
model's padding tokens past the tokenizer's vocabulary."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pyorch.sampling_params import StructuredOutputsParams
from pyorch.structured_output.backend_xgrammar import (
    XgrammarBackend,
    grammar_spec,
    validate_structured_outputs,
)

pytest.importorskip("xgrammar")


@pytest.fixture(scope="module")
def tokenizer():
    from pyorch.model_loader import default_model_path, get_tokenizer

    return get_tokenizer(default_model_path())


PAD = 45  # the model's logits are wider than the tokenizer's vocabulary


@pytest.fixture(scope="module")
def backend(tokenizer) -> XgrammarBackend:
    return XgrammarBackend(tokenizer, len(tokenizer) + PAD)


def _allowed(bitmask: np.ndarray, row: int, vocab_size: int) -> np.ndarray:
    bits = (bitmask[row].astype(np.uint32)[:, None] >> np.arange(32, dtype=np.uint32)) & 1
    return bits.reshape(-1)[:vocab_size].astype(bool)


def test_spec_is_canonical():
    a = grammar_spec(StructuredOutputsParams(json={"type": "object", "required": ["a"]}))
    b = grammar_spec(StructuredOutputsParams(json='{"required": ["a"], "type": "object"}'))
    assert a == b and hash(a) == hash(b)
    c = grammar_spec(StructuredOutputsParams(json={"type": "object", "required": ["a"]},
                                             disable_any_whitespace=True))
    assert c != a  # compiled differently: part of the key


@pytest.mark.parametrize("params,reason", [
    (dict(json='{"type": "object",'), "not valid JSON"),
    (dict(json={"type": "object", "properties": {"a": {"type": "nonsense"}}}), "JSON schema"),
    (dict(json={"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}),
     "JSON schema"),
    (dict(regex="([a-z]"), "invalid regex"),
    (dict(grammar='root ::= "a" | undefined_rule'), "invalid grammar"),
    (dict(grammar="this is not ebnf"), "invalid grammar"),
    (dict(structural_tag='{"type": "structural_tag", "format": {"type": "nope"}}'),
     "invalid structural tag"),
    (dict(structural_tag='{"structures": [{"begin": "<a>"}], "triggers": ["<a>"]}'),
     "invalid structural tag"),
    (dict(structural_tag="<a>"), "structural_tag is not valid JSON"),
])
def test_invalid_constraints_raise_with_reason(params, reason):
    with pytest.raises(ValueError, match=reason) as info:
        validate_structured_outputs(StructuredOutputsParams(**params))
    assert len(str(info.value)) > len(reason) + 10  # xgrammar's explanation follows


def test_valid_constraints_pass():
    for params in [dict(json={"type": "object", "properties": {"a": {"type": "integer"}}}),
                   dict(json_object=True), dict(regex=r"\d{3}-[a-z]+"),
                   dict(choice=["yes", "no"]), dict(grammar='root ::= "a" ("b" | "c")*'),
                   dict(structural_tag=json.dumps(TAG)), dict(structural_tag=json.dumps(LEGACY))]:
        validate_structured_outputs(StructuredOutputsParams(**params))


def _walk(backend: XgrammarBackend, tokenizer, spec_params: dict, text: str) -> bool:
    """Whether the grammar accepts exactly `text` (token by token, then only EOS)."""
    grammar = backend.new_grammar(backend.compile(grammar_spec(
        StructuredOutputsParams(**spec_params))))
    ids = tokenizer.encode(text, add_special_tokens=False)
    if not grammar.accept_tokens(ids):
        return False
    bitmask = np.zeros((1, backend.num_words), dtype=np.int32)
    grammar.fill_bitmask(bitmask, 0)
    allowed = _allowed(bitmask, 0, backend.vocab_size)
    return bool(allowed[tokenizer.eos_token_id]) and not grammar.is_terminated()


def test_choice_accepts_exactly_its_strings(backend, tokenizer):
    choices = ['say "hi"', "back\\slash", "two\nlines", "ünïcödé ✓", "plain"]
    for choice in choices:
        assert _walk(backend, tokenizer, dict(choice=choices), choice), choice
    assert not _walk(backend, tokenizer, dict(choice=choices), "pla")
    assert not _walk(backend, tokenizer, dict(choice=choices), "plainer")


def test_bitmask_never_allows_padding_tokens(backend, tokenizer):
    vocab = len(tokenizer)
    for params in [dict(json_object=True), dict(regex=".*"), dict(choice=["a", "b"])]:
        grammar = backend.new_grammar(backend.compile(grammar_spec(
            StructuredOutputsParams(**params))))
        bitmask = np.full((2, backend.num_words), -1, dtype=np.int32)
        grammar.fill_bitmask(bitmask, 1)
        allowed = _allowed(bitmask, 1, backend.vocab_size)
        assert allowed[:vocab].any()
        assert not allowed[vocab:].any(), params
        assert (bitmask[0] == -1).all()  # other rows untouched


def test_terminated_grammar_allows_everything(backend, tokenizer):
    """After the stop token (ignore_eos keeps generating), vLLM leaves the row unconstrained."""
    grammar = backend.new_grammar(backend.compile(grammar_spec(
        StructuredOutputsParams(choice=["ok"]))))
    assert grammar.accept_tokens(tokenizer.encode("ok", add_special_tokens=False))
    assert grammar.accept_tokens([tokenizer.eos_token_id])
    assert grammar.is_terminated()
    bitmask = np.zeros((1, backend.num_words), dtype=np.int32)
    grammar.fill_bitmask(bitmask, 0)
    assert (bitmask == -1).all()


def test_rejected_token_leaves_state(backend, tokenizer):
    grammar = backend.new_grammar(backend.compile(grammar_spec(
        StructuredOutputsParams(regex="[0-9]+"))))
    assert not grammar.accept_tokens(tokenizer.encode("x", add_special_tokens=False))
    assert grammar.num_processed_tokens == 0
    digits = tokenizer.encode("42", add_special_tokens=False)
    assert grammar.accept_tokens(digits)
    assert grammar.num_processed_tokens == len(digits)


TAG = {"type": "structural_tag", "format": {
    "type": "tag", "begin": "<a>", "end": "</a>",
    "content": {"type": "json_schema", "json_schema": {"enum": ["on", "off"]}}}}
LEGACY = {"type": "structural_tag", "triggers": ["<f="],
          "structures": [{"begin": "<f=x>", "schema": {"enum": [1, 2]}, "end": "</f>"}]}


def test_structural_tags_compile_to_their_language(tokenizer):
    """Both forms vLLM passes to xgrammar: the current `format` (a tag, here the whole output)
    and the legacy `structures` + `triggers` (free text until a trigger, then the structure)."""
    import xgrammar as xgr

    from pyorch.structured_output.backend_xgrammar import XgrammarBackend, grammar_spec

    backend = XgrammarBackend(tokenizer, len(tokenizer))

    def complete(tag: dict, text: str) -> bool:
        """Whether `text` followed by EOS is a whole output of the tag's grammar."""
        spec = grammar_spec(StructuredOutputsParams(structural_tag=json.dumps(tag)))
        matcher = xgr.GrammarMatcher(backend.compile(spec))
        return matcher.accept_string(text) and matcher.accept_token(tokenizer.eos_token_id)

    assert complete(TAG, '<a>"on"</a>')
    assert not complete(TAG, '<a>"maybe"</a>')
    assert not complete(TAG, 'hello <a>"on"</a>')
    assert not complete(TAG, '<a>"on"')
    assert complete(LEGACY, 'hello <f=x>2</f> bye')
    assert not complete(LEGACY, 'hello <f=x>3</f>')


def test_json_properties_keep_the_schema_order(tokenizer):
    """xgrammar emits properties in the schema's order (vLLM's behaviour): the spec must not
    reorder them (it once sorted the keys, so {"name", "age"} had to come out age first)."""
    import xgrammar as xgr

    from pyorch.structured_output.backend_xgrammar import XgrammarBackend, grammar_spec

    schema = {"type": "object", "properties": {"name": {"type": "string"},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    backend = XgrammarBackend(tokenizer, len(tokenizer))
    spec = grammar_spec(StructuredOutputsParams(json=schema, disable_any_whitespace=True))
    matcher = xgr.GrammarMatcher(backend.compile(spec))
    assert matcher.accept_string('{"name": "a", "age": 1}')
    flipped = dict(schema, properties={"age": {"type": "integer"}, "name": {"type": "string"}})
    assert grammar_spec(StructuredOutputsParams(json=flipped)) != grammar_spec(
        StructuredOutputsParams(json=schema))
