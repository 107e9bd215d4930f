"""Structured output (constrained decoding) with xgrammar: the engine core's manager and the
backend. See `manager` for how a step uses them."""

from pyorch.structured_output.backend_xgrammar import (
    GrammarSpec,
    grammar_spec,
    validate_structured_outputs,
)

__all__ = ["GrammarSpec", "grammar_spec", "validate_structured_outputs"]
