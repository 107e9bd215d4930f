"""The block decoders of the CUDA GGUF kernels (cuda/gguf/gguf_blocks.cuh) on the host, no GPU.

The decoders are __host__ __device__: this compiles them with nvcc into a small host library and
checks every quantized type's values against ``gguf.quants.dequantize`` bit for bit, so a layout
mistake shows on a CPU-only machine (CI has nvcc) before any GPU run.
"""

import ctypes
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize

from tests.reference import gguf as ref

ROOT = Path(__file__).resolve().parents[3]
QUANT_TYPES = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K]

# Decodes num_blocks blocks of `type` into fp32 with the kernels' own decoder and value rounding.
SOURCE = r"""
#include "gguf/gguf_blocks.cuh"
using namespace pyorch::kernels::gguf;
template <int TYPE>
static void run(const uint8_t* src, float* dst, long num_blocks) {
  using Traits = BlockTraits<TYPE>;
  for (long b = 0; b < num_blocks; ++b) {
    for (int sub = 0; sub < Traits::kBlockSize / kSubSize; ++sub) {
      Sub32 s;
      Traits::unpack(src + b * Traits::kBlockBytes, sub, s);
      for (int i = 0; i < kSubSize; ++i) {
        dst[b * Traits::kBlockSize + sub * kSubSize + i] = sub_value(s, i, kQSigned<TYPE>);
      }
    }
  }
}
extern "C" int decode(int type, const uint8_t* src, float* dst, long num_blocks) {
  switch (type) {
    case 2: run<2>(src, dst, num_blocks); return 0;
    case 3: run<3>(src, dst, num_blocks); return 0;
    case 6: run<6>(src, dst, num_blocks); return 0;
    case 7: run<7>(src, dst, num_blocks); return 0;
    case 8: run<8>(src, dst, num_blocks); return 0;
    case 10: run<10>(src, dst, num_blocks); return 0;
    case 11: run<11>(src, dst, num_blocks); return 0;
    case 12: run<12>(src, dst, num_blocks); return 0;
    case 13: run<13>(src, dst, num_blocks); return 0;
    case 14: run<14>(src, dst, num_blocks); return 0;
  }
  return 1;
}
// Q4_K through the direct product's decoder (gguf_mmvq_q4k.cuh): four lanes per block, each
// 32 bytes of qs holding two sub-blocks.
extern "C" void decode_q4k_pairs(const uint8_t* src, float* dst, long num_blocks) {
  for (long b = 0; b < num_blocks; ++b) {
    const uint8_t* block = src + b * 144;
    uint32_t hdr[4];
    for (int w = 0; w < 4; ++w) hdr[w] = ld_u32<false>(block + 4 * w);
    for (int pair = 0; pair < 4; ++pair) {
      uint32_t qs[8];
      for (int w = 0; w < 8; ++w) qs[w] = ld_u32<false>(block + 16 + 32 * pair + 4 * w);
      Sub32 sub[2];
      q4k_decode_pair(hdr, qs, pair, sub);
      for (int s = 0; s < 2; ++s) {
        for (int i = 0; i < 32; ++i) {
          dst[b * 256 + 32 * (2 * pair + s) + i] = sub_value(sub[s], i, false);
        }
      }
    }
  }
}
"""


@pytest.fixture(scope="module")
def decoder(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc not found")
    build = tmp_path_factory.mktemp("gguf_blocks_host")
    (build / "decode.cu").write_text(SOURCE)
    lib = build / "libdecode.so"
    subprocess.run(
        [nvcc, "-std=c++17", "-O2", "-shared", "-Xcompiler", "-fPIC",
         f"-I{ROOT / 'cuda'}", f"-I{ROOT / 'cuda' / 'include'}", str(build / "decode.cu"),
         "-o", str(lib)],
        check=True, capture_output=True,
    )  # fmt: skip
    return ctypes.CDLL(str(lib))


@pytest.mark.parametrize("qtype", QUANT_TYPES, ids=lambda q: q.name)
def test_block_decoders_match_gguf(decoder: ctypes.CDLL, qtype: Q) -> None:
    rows, cols = 13, ref.block_size(qtype) * 7
    rng = np.random.default_rng(int(qtype))
    raw = np.ascontiguousarray(ref.make_weight(qtype, rows, cols, rng))
    expected = gguf_dequantize(raw, qtype).astype(np.float32).reshape(-1)
    out = np.full(rows * cols, np.nan, dtype=np.float32)
    num_blocks = rows * cols // ref.block_size(qtype)
    status = decoder.decode(
        int(qtype),
        raw.ctypes.data_as(ctypes.c_void_p),
        out.ctypes.data_as(ctypes.c_void_p),
        ctypes.c_long(num_blocks),
    )
    assert status == 0
    # Equal as numbers (the decoder's exact zero is +0 where gguf's d * 0 may be -0).
    assert np.array_equal(out, expected)


def test_q4k_direct_pair_decoder_matches_gguf(decoder: ctypes.CDLL) -> None:
    # The direct one-token Q4_K product's layout: a lane's 32 bytes qs[32 p ..] hold sub-blocks
    # 2 p (low nibbles) and 2 p + 1 (high nibbles), and both sub-blocks' 6-bit scales and mins
    # come from three header words without a branch (q4k_pair_scale_min).
    rows, cols = 11, 256 * 5
    raw = np.ascontiguousarray(ref.make_weight(Q.Q4_K, rows, cols, np.random.default_rng(412)))
    expected = gguf_dequantize(raw, Q.Q4_K).astype(np.float32).reshape(-1)
    out = np.full(rows * cols, np.nan, dtype=np.float32)
    decoder.decode_q4k_pairs(
        raw.ctypes.data_as(ctypes.c_void_p),
        out.ctypes.data_as(ctypes.c_void_p),
        ctypes.c_long(rows * cols // 256),
    )
    assert np.array_equal(out, expected)
