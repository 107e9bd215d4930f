"""gguf_mul_mat_vec's launch configuration (GgufMulMatVecConfig) on the host, no GPU.

The direct Q4_K form's fields (`direct`, `blocks_per_sm`) must never be accepted and ignored: where
the ring form would run instead, the call is refused with a message naming the field. These
checks run before any CUDA call, so a host program built with nvcc exercises them on a CPU-only
machine (CI has nvcc).
"""

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

# Each case: (name, tokens, GGML type id, config fields). Q4_K = 12, Q8_0 = 8.
CASES = [
    ("direct, two tokens", 2, 12, "c.direct = 1;", "need one token"),
    ("direct without fuse_x", 1, 12, "c.direct = 1; c.fuse_x = 0;", "need one token"),
    ("blocks_per_sm on the ring form", 1, 12, "c.direct = 0; c.blocks_per_sm = 2;",
     "blocks_per_sm is the direct form's"),
    ("blocks_per_sm on Q8_0", 1, 8, "c.blocks_per_sm = 2;", "blocks_per_sm is the direct form's"),
    ("direct on Q8_0", 1, 8, "c.direct = 1;", "direct: needs Q4_K (got Q8_0)"),
    ("blocks_per_sm 0", 1, 12, "c.direct = 1; c.blocks_per_sm = 0;", "blocks_per_sm 0"),
    ("warps past the ring form's 8", 1, 12, "c.warps = 16;", "warps 16 is not 1..8"),
]


def _program() -> str:
    calls = "\n".join(
        f"""  {{
    pyorch::GgufMulMatVecConfig c;
    {fields}
    std::fprintf(stderr, "case {i}\\n");
    const cudaError_t e = pyorch::gguf_mul_mat_vec(out, x, w, ws, {qtype}, pyorch::DType::kBFloat16,
                                                   {tokens}, 2, 1024, 1024, 1024, 2, nullptr, &c);
    std::fprintf(stderr, "result {i} %d\\n", int(e == cudaErrorInvalidValue));
  }}"""
        for i, (_, tokens, qtype, fields, _) in enumerate(CASES)
    )
    return f"""
#include <cstdio>
#include "pyorch/gguf.h"
int main() {{
  alignas(16) static unsigned char w[2048];
  alignas(16) static unsigned short x[2048];
  alignas(16) static unsigned char ws[8192];
  alignas(16) static unsigned short out[16];
{calls}
  return 0;
}}
"""


@pytest.fixture(scope="module")
def stderr_by_case(tmp_path_factory: pytest.TempPathFactory) -> dict[int, str]:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc not found")
    build = tmp_path_factory.mktemp("gguf_config_host")
    (build / "main.cu").write_text(_program())
    exe = build / "main"
    subprocess.run(
        [nvcc, "-std=c++17", "-O1", "--expt-relaxed-constexpr", "-diag-suppress=177",
         "-gencode=arch=compute_90a,code=compute_90a",
         f"-I{ROOT / 'cuda'}", f"-I{ROOT / 'cuda' / 'include'}", str(build / "main.cu"),
         str(ROOT / "cuda" / "gguf" / "gguf.cu"), str(ROOT / "cuda" / "common" / "launch.cu"),
         "-o", str(exe)],
        check=True, capture_output=True,
    )  # fmt: skip
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60, check=True)
    parts: dict[int, str] = {}
    current = -1
    for line in run.stderr.splitlines():
        if line.startswith("case "):
            current = int(line.split()[1])
            parts[current] = ""
        else:
            parts[current] += line + "\n"
    return parts


@pytest.mark.parametrize("index", range(len(CASES)), ids=[c[0] for c in CASES])
def test_direct_form_fields_are_refused_by_name(stderr_by_case: dict[int, str], index: int) -> None:
    message = stderr_by_case[index]
    assert f"result {index} 1" in message, message
    assert CASES[index][4] in message, message
