"""Builds pyorch._C by driving CMakeLists.txt (the vLLM pattern).

Install with ``pip install --no-build-isolation -e .`` after installing torch: the build reads the
installed torch's headers and libraries, and never pulls another torch. When that torch has CUDA
and nvcc is on PATH (or CUDACXX is set), the CUDA ops for Hopper are built and linked in too.
"""

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


class CMakeExtension(Extension):
    def __init__(self, name: str) -> None:
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        try:
            import torch
            import torch.utils.cpp_extension as cpp_ext
        except ImportError as e:  # pragma: no cover - a build without torch cannot work
            raise RuntimeError(
                "pyorch needs torch installed before it is built: "
                "pip install torch==2.13.0, then pip install --no-build-isolation -e ."
            ) from e

        out_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        build_dir = Path(os.environ.get("PYORCH_BUILD_DIR", ROOT / "build" / "cmake"))
        build_dir.mkdir(parents=True, exist_ok=True)
        torch_cuda = torch.version.cuda is not None and os.environ.get("PYORCH_NO_CUDA") != "1"
        args = [
            f"-DCMAKE_BUILD_TYPE={os.environ.get('PYORCH_BUILD_TYPE', 'Release')}",
            "-DPYORCH_BUILD_EXTENSION=ON",
            f"-DPYORCH_TORCH_CUDA={'ON' if torch_cuda else 'OFF'}",
            f"-DPYORCH_TORCH_INCLUDE_DIRS={';'.join(cpp_ext.include_paths())}",
            f"-DPYORCH_TORCH_LIBRARY_DIRS={';'.join(cpp_ext.library_paths())}",
            f"-DPYORCH_TORCH_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
            f"-DPYORCH_PYTHON_INCLUDE={sysconfig.get_paths()['include']}",
            f"-DPYORCH_EXT_SUFFIX={sysconfig.get_config_var('EXT_SUFFIX')}",
            f"-DPYORCH_OUTPUT_DIR={out_dir}",
            f"-DPython_EXECUTABLE={sys.executable}",
        ]
        cutlass = _cutlass_include()
        if cutlass:
            args.append(f"-DPYORCH_CUTLASS_DIR={cutlass}")
        if os.environ.get("PYORCH_NO_BENCH") == "1":
            args.append("-DPYORCH_BUILD_BENCH=OFF")
        generator = ["-G", "Ninja"] if _has_ninja() else []
        env = dict(os.environ)
        gcc_lib_dir = _libstdcxx_dir()
        if torch_cuda and gcc_lib_dir:
            # NOTE(lead): make the linker find the compiler's shared libstdc++ before any static
            # libstdc++.a in CUDA's link directories; a static copy inside _C.so crashed every
            # error message that formatted a number (seen on our H100 image).
            env["LDFLAGS"] = f"-L{gcc_lib_dir} " + env.get("LDFLAGS", "")
        subprocess.check_call(["cmake", str(ROOT), *generator, *args], cwd=build_dir, env=env)
        jobs = os.environ.get("MAX_JOBS", str(os.cpu_count() or 1))
        subprocess.check_call(["cmake", "--build", ".", "--target", "_C", "-j", jobs], cwd=build_dir)


def _libstdcxx_dir() -> str | None:
    try:
        path = subprocess.check_output(
            [os.environ.get("CXX", "c++"), "-print-file-name=libstdc++.so"], text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return str(Path(path).parent) if os.path.isabs(path) else None


def _has_ninja() -> bool:
    try:
        subprocess.check_output(["ninja", "--version"])
        return True
    except (OSError, subprocess.CalledProcessError):
        return False


def _cutlass_include() -> str | None:
    """CUTLASS/CuTe headers from the nvidia-cutlass package, when it is installed."""
    try:
        import cutlass_library  # type: ignore[import-not-found]
    except ImportError:
        return None
    inc = Path(cutlass_library.__file__).parent / "source" / "include"
    return str(inc) if inc.is_dir() else None


setup(
    name="pyorch",
    version="0.1.0",
    description="A high-throughput, memory-efficient LLM inference and serving engine",
    packages=find_packages(include=["pyorch", "pyorch.*"]),
    ext_modules=[CMakeExtension("pyorch._C")],
    cmdclass={"build_ext": CMakeBuild},
    python_requires=">=3.10",
    # torch is deliberately not listed: pip would resolve it to the multi-GB CUDA build on a
    # CPU machine. Install torch first (see README).
    install_requires=[
        "numpy", "transformers", "safetensors", "gguf", "tqdm",
        "fastapi", "uvicorn", "pydantic>=2", "prometheus_client", "pyyaml",
        # uvicorn's C event loop and HTTP parser: what keeps hundreds of streams fed (issue 24)
        "uvloop", "httptools",
    ],
    extras_require={
        "test": ["pytest", "openai", "httpx", "schemathesis"],
        "bench": ["matplotlib"],
    },
    entry_points={
        "console_scripts": [
            "pyorch = pyorch.cli.main:main",
            "pyorch-serve = pyorch.cli.main:serve_main",
        ]
    },
)
