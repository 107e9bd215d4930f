"""bench/structured_output.py: its random schemas are valid JSON schemas that xgrammar
compiles, bound every string and array (what lets a random-weight model finish them), and the
per-step part runs and reports both timings."""

import importlib.util
import os
import random

import pytest

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

_SPEC = importlib.util.spec_from_file_location(
    "structured_output",
    os.path.join(os.path.dirname(__file__), "..", "..", "bench", "structured_output.py"))
structured_output = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(structured_output)


def _walk(schema):
    yield schema
    for sub in schema.get("properties", {}).values():
        yield from _walk(sub)
    if "items" in schema:
        yield from _walk(schema["items"])


def test_random_schemas_are_valid_and_bounded():
    from pyorch.sampling_params import StructuredOutputsParams
    from pyorch.structured_output import validate_structured_outputs

    rng = random.Random(0)
    kinds = set()
    for _ in range(200):
        schema = structured_output.random_object_schema(rng)
        assert schema["type"] == "object"
        jsonschema.Draft202012Validator.check_schema(schema)
        validate_structured_outputs(StructuredOutputsParams(json=schema))
        for node in _walk(schema):
            kinds.add(node.get("type", "enum"))
            if node.get("type") == "string":
                assert node["maxLength"] <= 8
            if node.get("type") == "array":
                assert node["maxItems"] <= 3
    assert kinds == {"object", "array", "string", "integer", "boolean", "null", "enum"}


def test_step_part_runs():
    from pyorch.model_loader import default_model_path, get_tokenizer

    rows = structured_output.bench_step(get_tokenizer(default_model_path()), "cpu", [3], 2, 1, 0)
    (row,) = rows
    assert row["batch"] == 3 and len(row["plain_runs_ms"]) == len(row["structured_runs_ms"]) == 2
    assert row["plain_ms"] > 0 and row["structured_ms"] > 0
