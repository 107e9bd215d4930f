"""W4A16 GEMM time against M on the Llama-3-8B / 70B shapes (H100): the final default dispatch,
the previous one (registers kernel to 64 rows, the old dequantize + cuBLAS above) and cuBLAS bf16.

    python plot.py   # in this folder; writes w4a16_by_m.png
"""

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).parent


def rows(name: str) -> dict:
    return {(r["model"], r["shape"], r["M"]): r for r in json.loads((HERE / name).read_text())
            if r["op"] == "w4a16_gemm"}


final, old = rows("final_default.json"), rows("previous_dispatch.json")
shapes = sorted({(m, s) for m, s, _ in final}, key=lambda x: (x[0] != "8b", x[1]))
fig, axes = plt.subplots(2, 4, figsize=(16, 7), sharex=True)
for ax, (model, shape) in zip(axes.flat, shapes):
    ms = sorted(m for (mo, s, m) in final if (mo, s) == (model, shape))
    ax.plot(ms, [final[(model, shape, m)]["time_us"] for m in ms], "o-", label="pyorch (now)")
    om = [m for m in ms if (model, shape, m) in old]
    ax.plot(om, [old[(model, shape, m)]["time_us"] for m in om], "s--", label="pyorch (before)")
    ax.plot(ms, [final[(model, shape, m)]["cublas_bf16_us"] for m in ms], "k:",
            label="cuBLAS bf16")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_title(f"{model} {shape}")
    ax.set_xlabel("M (rows)")
    ax.set_ylabel("us")
axes.flat[0].legend()
fig.tight_layout()
fig.savefig(HERE / "w4a16_by_m.png", dpi=90)
