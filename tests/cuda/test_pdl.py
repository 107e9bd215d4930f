"""Programmatic dependent launch (cuda/common/launch.cuh) changes timing, never results.

The norm, rotary, cache-write, decode-attention, activation and skinny-GEMM kernels launch with
PDL: each may be scheduled while the kernel before it still runs and must wait for it before
touching its data. A kernel that read or wrote too early would race with its predecessor. This
test runs a decode-shaped layer chain, each kernel consuming the one before, eagerly and replayed
in a CUDA graph, in two fresh processes, PYORCH_PDL=1 and PYORCH_PDL=0, and requires the same bits
from all of them (every kernel in the chain is deterministic; with PDL off each kernel starts
after the previous one ended). With PDL the plain skinny GEMM also asks L2 for its first weight
slice before it waits on its input, without PDL it does not, so the same bits cover that prefetch
too. The kernels' own tests check their results against references.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.conftest import CUDA_AVAILABLE

pytestmark = pytest.mark.skipif(not CUDA_AVAILABLE, reason="no CUDA device on this machine")

# Llama-like shapes at a small scale: 8 query heads, 2 KV heads, head 128, hidden 1024.
_CHAIN = r"""
import json, sys
import torch
from pyorch import _ops

torch.manual_seed(0)
dev, dt = "cuda", torch.bfloat16
T, H, NQ, NKV, D, I, L, BS = int(sys.argv[1]), 1024, 8, 2, 128, 2816, 3, 16
ctx = [37, 130, 5, 64, 300, 17, 90, 1][:T]  # context length per sequence (one query token each)
blocks_per_seq = (max(ctx) + BS - 1) // BS
num_blocks = T * blocks_per_seq + 3

def w(n, k):
    return (torch.randn(n, k, device=dev) * k ** -0.5).to(dt)

layers = [dict(n1=(1 + 0.1 * torch.randn(H, device=dev)).to(dt), qkv=w((NQ + 2 * NKV) * D, H),
               o=w(H, NQ * D), n2=(1 + 0.1 * torch.randn(H, device=dev)).to(dt),
               gu=w(2 * I, H), down=w(H, I),
               kc=torch.randn(num_blocks, BS, NKV, D, device=dev).to(dt),
               vc=torch.randn(num_blocks, BS, NKV, D, device=dev).to(dt)) for _ in range(L)]
inv = 1.0 / (10000 ** (torch.arange(0, D, 2, device=dev).float() / D))
ang = torch.arange(4096, device=dev).float()[:, None] * inv[None, :]
cos_sin = torch.cat([ang.cos(), ang.sin()], dim=-1).to(dt)
perm = torch.randperm(num_blocks - 3, device=dev).to(torch.int32)
block_table = perm[: T * blocks_per_seq].view(T, blocks_per_seq).contiguous()
seq_lens = torch.tensor(ctx, dtype=torch.int32, device=dev)
positions = (seq_lens - 1).long()
slots = (block_table[torch.arange(T, device=dev), positions // BS].long() * BS + positions % BS)
qsl = torch.arange(T + 1, dtype=torch.int32, device=dev)
one = torch.ones(1, device=dev)
x0 = torch.randn(T, H, device=dev).to(dt)
res0 = torch.randn(T, H, device=dev).to(dt)

x, res = x0.clone(), res0.clone()
qkv = torch.empty(T, (NQ + 2 * NKV) * D, device=dev, dtype=dt)
attn = torch.empty(T, NQ, D, device=dev, dtype=dt)
gu = torch.empty(T, 2 * I, device=dev, dtype=dt)
act = torch.empty(T, I, device=dev, dtype=dt)
caches0 = [(l["kc"].clone(), l["vc"].clone()) for l in layers]

def chain():
    for l in layers:
        _ops.fused_add_rms_norm(x, res, l["n1"], 1e-5)
        _ops.skinny_gemm(qkv, x, l["qkv"], None)
        q = qkv[:, : NQ * D].view(T, NQ, D)
        k = qkv[:, NQ * D : (NQ + NKV) * D].view(T, NKV, D)
        v = qkv[:, (NQ + NKV) * D :].view(T, NKV, D)
        _ops.rotary_embedding(positions, q, k, D, cos_sin, True)
        _ops.reshape_and_cache_flash(k, v, l["kc"], l["vc"], slots, "auto", one, one)
        _ops.paged_attention(attn, q, l["kc"], l["vc"], qsl, seq_lens, block_table, 1, max(ctx),
                             D ** -0.5, True, 0, 0.0, "auto", one, one)
        _ops.skinny_gemm(x, attn.view(T, NQ * D), l["o"], None)
        _ops.fused_add_rms_norm(x, res, l["n2"], 1e-5)
        _ops.skinny_gemm(gu, x, l["gu"], None)
        _ops.silu_and_mul(act, gu)
        _ops.skinny_gemm(x, act, l["down"], None)

def reset():
    x.copy_(x0); res.copy_(res0)
    for l, (kc, vc) in zip(layers, caches0):
        l["kc"].copy_(kc); l["vc"].copy_(vc)

out = {}
reset(); chain(); torch.cuda.synchronize()
out["eager"] = [x.float().cpu().tolist(), res.float().cpu().tolist()]
reset(); torch.cuda.synchronize()
s = torch.cuda.Stream()
s.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(s):
    chain()  # warm-up on a side stream, as torch recommends before capture
torch.cuda.current_stream().wait_stream(s)
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g):
    chain()
runs = []
for _ in range(5):
    reset()
    g.replay()
    torch.cuda.synchronize()
    runs.append([x.float().cpu().tolist(), res.float().cpu().tolist()])
out["graph"] = runs
print("PDL_RESULT " + json.dumps(out))
"""


def _run_chain(pdl: str, num_tokens: int) -> dict:
    env = dict(os.environ, PYORCH_PDL=pdl)
    proc = subprocess.run([sys.executable, "-c", _CHAIN, str(num_tokens)], capture_output=True,
                          text=True, timeout=600, env=env,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    for line in proc.stdout.splitlines():
        if line.startswith("PDL_RESULT "):
            return json.loads(line[len("PDL_RESULT "):])
    raise AssertionError(f"chain failed (PYORCH_PDL={pdl}):\n{proc.stderr[-4000:]}")


@pytest.mark.parametrize("num_tokens", [1, 3, 8])
def test_pdl_chain_same_bits_with_and_without_pdl(num_tokens: int):
    on, off = _run_chain("1", num_tokens), _run_chain("0", num_tokens)
    assert on["eager"] == off["eager"]
    # Every replay of the graph gives the eager result, with PDL and without.
    for run in on["graph"] + off["graph"]:
        assert run == on["eager"]
    # The chain did real work: the hidden state moved away from where it started and is finite.
    x = torch.tensor(on["eager"][0])
    assert torch.isfinite(x).all() and x.abs().max() > 0


def test_pyorch_pdl_sets_the_process_wide_switch():
    # pyorch/_ops.py hands envs.PYORCH_PDL to the C API (pyorch/launch.h) when it loads the ops;
    # nothing under cuda/ reads the environment. With it off no kernel may launch with PDL.
    code = "import pyorch._ops; print('PDL', pyorch._C.pdl_enabled())"
    root = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
    seen = {}
    for pdl in ("0", "1"):
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=120, env=dict(os.environ, PYORCH_PDL=pdl), cwd=root)
        assert proc.returncode == 0, proc.stderr[-2000:]
        seen[pdl] = proc.stdout.split("PDL ")[-1].strip()
    assert seen["0"] == "False"
    hopper = torch.cuda.get_device_capability()[0] >= 9
    assert seen["1"] == str(hopper)
