"""The wheel, not the editable install: build it, install it into a fresh venv, run the default model.

An editable install imports pyorch from the source tree, so a package that the wheel leaves out
(a folder without ``__init__.py``, which ``find_packages`` skips) goes unnoticed by every other
test. Here the wheel is built with ``pip wheel --no-build-isolation --no-deps`` (the build reuses
build/cmake, so after the first build it only relinks), installed with ``--no-deps`` into a new
venv, and run from outside the repository. The venv borrows its dependencies (torch, transformers,
the default model's GGUF, ...) from the running environment through a ``.pth`` file of plain path
lines: those add the directories to ``sys.path`` without processing the ``.pth`` files inside them,
so the editable install's finder for pyorch stays out and only the wheel's pyorch can be imported.
"""

import json
import os
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Runs in the venv, cwd outside the repository: where pyorch comes from, and a few greedy tokens.
RUN_DEFAULT_MODEL = """
import json, sys
import pyorch
from pyorch import LLM, SamplingParams

llm = LLM(device="cpu")
out = llm.generate(["The capital of France is"], SamplingParams(temperature=0.0, max_tokens=4))
print(json.dumps({"file": pyorch.__file__, "sys_path": sys.path,
                  "token_ids": list(out[0].outputs[0].token_ids),
                  "text": out[0].outputs[0].text}))
"""


def _site_dirs() -> list[str]:
    """The running environment's site-packages folders (a venv's and, with
    --system-site-packages, the base interpreter's), never the repository itself."""
    dirs = []
    for p in sys.path:
        if Path(p).name in ("site-packages", "dist-packages") and Path(p).is_dir():
            if Path(p).resolve() != ROOT and p not in dirs:
                dirs.append(p)
    return dirs


@pytest.mark.slow
def test_wheel_installs_and_runs_default_model(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"

    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-build-isolation", "--no-deps",
         "-w", str(wheels), str(ROOT)],
        check=True, env=env, cwd=ROOT)
    (wheel,) = wheels.glob("pyorch-*.whl")

    venv_dir = tmp_path / "venv"
    venv.create(venv_dir, with_pip=False)
    py = venv_dir / "bin" / "python"
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps",
         "--no-index", str(wheel)],
        check=True, env=env, cwd=tmp_path)
    purelib = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True, env=env).stdout.strip()
    assert purelib != sysconfig.get_paths()["purelib"]
    (Path(purelib) / "_outer_env.pth").write_text("".join(d + "\n" for d in _site_dirs()))

    run = subprocess.run(
        [str(py), "-c", RUN_DEFAULT_MODEL], capture_output=True, text=True, cwd=tmp_path,
        env={**env, "CUDA_VISIBLE_DEVICES": ""}, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])

    # The wheel's pyorch, from the venv: not the source tree, not the editable install.
    assert Path(result["file"]).resolve().is_relative_to(venv_dir.resolve()), result["file"]
    assert str(ROOT) not in result["sys_path"]
    assert len(result["token_ids"]) == 4
    assert result["text"].strip()
