"""The boundaries docs/architecture.md draws, checked on the code: what each process imports,
where the environment is read, and the environment table in the docs."""

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Modules that only the engine-core process may load.
CORE_ONLY = ("pyorch.core", "pyorch.executor", "pyorch.distributed", "pyorch.layers",
             "pyorch.models", "pyorch._ops", "pyorch._C", "pyorch.forward_context",
             "pyorch.model_loader.loader")


def _loaded_after(code: str) -> list[str]:
    """The pyorch modules a fresh interpreter has loaded after running `code`."""
    probe = code + "\nimport json, sys\nprint(json.dumps(sorted(m for m in sys.modules if " \
                   "m == 'pyorch' or m.startswith('pyorch.'))))"
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                             [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _core_only(modules: list[str]) -> list[str]:
    return [m for m in modules if any(m == c or m.startswith(c + ".") for c in CORE_ONLY)]


def test_api_server_process_never_imports_the_core():
    loaded = _loaded_after(
        "import pyorch.entrypoints.openai.api_server\n"
        "import pyorch.engine.async_llm\n"
        "import pyorch.metrics.prometheus\n")
    assert "pyorch.wire" in loaded and "pyorch.engine.core_client" in loaded
    assert _core_only(loaded) == []


def test_import_pyorch_is_light():
    loaded = _loaded_after("import pyorch\nassert pyorch.__version__")
    assert loaded == ["pyorch"]


def test_wire_and_shared_types_are_torch_free():
    code = ("import sys\nimport pyorch.wire, pyorch.core_types, pyorch.metrics.stats, "
            "pyorch.envs, pyorch.utils\nassert 'torch' not in sys.modules, 'torch was imported'")
    _loaded_after(code)


def test_core_never_imports_the_front_end():
    for path in sorted((ROOT / "pyorch" / "core").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for name in names:
                assert not name.startswith("pyorch.engine"), f"{path.name} imports {name}"


def _python_files() -> list[Path]:
    return sorted(p for p in (ROOT / "pyorch").rglob("*.py") if p.name != "envs.py")


def test_environment_read_only_in_envs():
    pattern = re.compile(r"os\.(environ|getenv)\b")
    offenders = []
    for path in _python_files():
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            # Copying the environment for a child process is not reading a variable.
            if pattern.search(line) and "dict(os.environ" not in line \
                    and "{**os.environ" not in line:
                offenders.append(f"{path.relative_to(ROOT)}:{lineno}: {line.strip()}")
    assert offenders == []


def test_cuda_sources_never_read_the_environment():
    offenders = [str(p.relative_to(ROOT)) for p in (ROOT / "cuda").rglob("*")
                 if p.suffix in (".cu", ".cuh", ".h", ".cpp") and "getenv" in p.read_text()]
    assert offenders == []


def test_environment_table_lists_every_variable():
    from pyorch import envs

    doc = (ROOT / "docs" / "environment.md").read_text()
    documented = set(re.findall(r"^\| `([A-Z0-9_]+)` \|", doc, flags=re.M))
    assert documented == set(envs.describe())


def test_envs_parse_flags(monkeypatch):
    from pyorch import envs

    monkeypatch.setenv("PYORCH_PDL", "0")
    assert envs.PYORCH_PDL is False
    monkeypatch.setenv("PYORCH_PDL", "yes")
    assert envs.PYORCH_PDL is True
    monkeypatch.setenv("PYORCH_PDL", "maybe")
    with pytest.raises(ValueError, match="PYORCH_PDL='maybe'"):
        envs.PYORCH_PDL
    monkeypatch.setenv("PYORCH_W4A16_MMA_MAX_ROWS", "300")
    assert envs.PYORCH_W4A16_MMA_MAX_ROWS == 300
    monkeypatch.setenv("PYORCH_W4A16_MMA_MAX_ROWS", "0")
    with pytest.raises(ValueError, match="PYORCH_W4A16_MMA_MAX_ROWS='0'"):
        envs.PYORCH_W4A16_MMA_MAX_ROWS
    monkeypatch.setenv("PYORCH_W4A16_TILED_MIN_ROWS", "lots")
    with pytest.raises(ValueError, match="positive number of rows"):
        envs.PYORCH_W4A16_TILED_MIN_ROWS
    monkeypatch.delenv("PYORCH_W4A16_TILED_MIN_ROWS")
    assert envs.PYORCH_W4A16_TILED_MIN_ROWS is None
    monkeypatch.setenv("PYORCH_LOGGING_LEVEL", "debug")
    assert envs.PYORCH_LOGGING_LEVEL == "DEBUG"
    monkeypatch.delenv("PYORCH_SKINNY_GEMM_LEGACY_PICKS", raising=False)
    assert envs.PYORCH_SKINNY_GEMM_LEGACY_PICKS is False
    monkeypatch.setenv("PYORCH_SKINNY_GEMM_LEGACY_PICKS", "1")
    assert envs.PYORCH_SKINNY_GEMM_LEGACY_PICKS is True
    monkeypatch.delenv("PYORCH_MOE_DECODE_LEGACY_PICKS", raising=False)
    assert envs.PYORCH_MOE_DECODE_LEGACY_PICKS is False
    monkeypatch.setenv("PYORCH_MOE_DECODE_LEGACY_PICKS", "1")
    assert envs.PYORCH_MOE_DECODE_LEGACY_PICKS is True
    monkeypatch.delenv("PYORCH_GGUF_Q4K_DIRECT", raising=False)
    assert envs.PYORCH_GGUF_Q4K_DIRECT is True
    monkeypatch.setenv("PYORCH_GGUF_Q4K_DIRECT", "0")
    assert envs.PYORCH_GGUF_Q4K_DIRECT is False
    monkeypatch.delenv("PYORCH_GGUF_FUSED_DECODE", raising=False)
    assert envs.PYORCH_GGUF_FUSED_DECODE is False
    monkeypatch.delenv("PYORCH_GGUF_FUSED_WARPS", raising=False)
    assert envs.PYORCH_GGUF_FUSED_WARPS is None
    monkeypatch.setenv("PYORCH_GGUF_FUSED_WARPS", "16")
    assert envs.PYORCH_GGUF_FUSED_WARPS == 16
    for bad in ("0", "33", "-4", "x"):
        monkeypatch.setenv("PYORCH_GGUF_FUSED_WARPS", bad)
        with pytest.raises(ValueError, match="number of warps from 1 to 32"):
            envs.PYORCH_GGUF_FUSED_WARPS
    with pytest.raises(AttributeError):
        envs.PYORCH_NOT_A_VARIABLE


def test_envs_parse_the_all_reduce_norm_split_mode(monkeypatch):
    from pyorch import envs

    name = "PYORCH_FUSED_ALLREDUCE_RMS_NORM_SPLIT"
    monkeypatch.delenv(name, raising=False)
    assert envs.PYORCH_FUSED_ALLREDUCE_RMS_NORM_SPLIT == "auto"
    for value, mode in (("AUTO", "auto"), ("1", "on"), ("on", "on"), ("0", "off"), ("no", "off")):
        monkeypatch.setenv(name, value)
        assert envs.PYORCH_FUSED_ALLREDUCE_RMS_NORM_SPLIT == mode, value
    monkeypatch.setenv(name, "sometimes")
    with pytest.raises(ValueError, match=f"{name}='sometimes'"):
        envs.PYORCH_FUSED_ALLREDUCE_RMS_NORM_SPLIT
