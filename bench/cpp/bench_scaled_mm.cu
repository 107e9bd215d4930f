// Benchmark and correctness check of the W8A8 GEMMs of pyorch/scaled_mm.h (no torch, no Python).
//
// Correctness (op=check rows, PASS/FAIL each): every tile configuration x fp8/int8 x bf16/fp16 out
// x scale granularity (tensor/tensor, token/tensor, tensor/channel, token/channel) x bias or not,
// the zero-point variant (per-tensor and per-token zero points) in its tiles, and the block-scaled
// fp8 GEMM, on awkward sizes and fresh random data, against a simple reference kernel (one
// thread per output, fp32 accumulation for fp8, exact int64 for int8, the scales and bias applied
// in fp32). A result passes when every element is within tol * (|ref| + mean |ref|) of the
// reference (tol 2^-7 for bf16 out, 2^-9 for fp16: two roundings of the output type; 4x that for
// fp8's fast accumulation); the same check also runs on sampled rows of every timed shape, where
// fp8 passes within 1.5x of cuBLASLt's own fast-accumulation error (cublaslt_max_err) if larger.
//
// Timing (op=fp8 / int8 / fp8_block rows): Llama-3-8B and 70B projection shapes (N, K of qkv, o,
// gate_up, down) x --tokens M. Ours with per-tensor scales (time_us) and with per-token and
// per-channel scales (token_channel_us), against cuBLASLt on the same data:
//   fp8:  cublasLtMatmul with e4m3 inputs and per-tensor scale pointers, bf16 out, fp32 compute
//         (what torch._scaled_mm calls); fast accumulation as ours unless --cublas-fast-accum 0.
//   int8: cublasLtMatmul int8 x int8 -> int32 (what torch._int_mm calls), with no scaling at all.
// ratio = cuBLASLt time / our time (> 1: ours faster); fp8 at M >= 1024 also times the 128 x 256
// cooperative tile (huge_us, ratio_huge). The weights rotate over enough copies that
// no launch finds its weight in L2; each time is the median replay of a CUDA graph of launches.
// Decode (op=fp8_skinny rows, --skinny-tokens, default 1,8,16): pyorch::skinny_gemm_fp8 (bf16
// activations, e4m3 weights, per-channel scales; pyorch/gemm.h) on the same shapes: its time with
// the default launch and with every (warps, L2 hint) it takes (sweep_us; weights over a 2 GB
// span, as in a decode step), % of the in-run copy
// bandwidth for its bytes (weight + x + out), and the W8A8 path at the same M for comparison (our
// cutlass_scaled_mm per-token/channel, without its activation quant kernel, and cuBLASLt).
// fused_us / fused_sweep_us: the form the engine's fused decode layer runs on that shape (normed
// input for qkv_proj, normed input + SiLU-and-mul for gate_up, the residual add for o_proj and
// down) with its default launch and every (warps, L2 hint, PDL).
// Flags: --tokens 1,16,...  --models 8b,70b  --no-check --no-bench --no-int8 --no-block
//        --no-fp8 --no-skinny --skinny-tokens 1,8,16 --iters 20 --cublas-fast-accum 1 --json FILE
//        --sweep-tiles (every instantiated tile at every M: sweep_us, best_tile, ratio_best)
//        --rounds 3 (each form of a shape and M, cuBLASLt included, timed this many times in a
//        rotated order; the medians are reported: see bench_shape)
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#ifdef PYORCH_BENCH_CUBLASLT
#include <cublasLt.h>
#endif

#include "common/bench_util.h"
#include "pyorch/gemm.h"
#include "pyorch/scaled_mm.h"

namespace {

using pyorch::DType;
using pyorch::ScaledMmTile;
using pyorch::bench::Args;
using pyorch::bench::Report;

#ifdef PYORCH_BENCH_CUBLASLT
#define CUBLAS_CHECK(expr)                                                             \
  do {                                                                                 \
    cublasStatus_t s_ = (expr);                                                        \
    if (s_ != CUBLAS_STATUS_SUCCESS) {                                                 \
      std::fprintf(stderr, "%s:%d: %s: cuBLAS status %d\n", __FILE__, __LINE__, #expr, \
                   static_cast<int>(s_));                                              \
      std::exit(1);                                                                    \
    }                                                                                  \
  } while (0)
#endif

enum class Mode { kScaled, kAzp, kBlock };

// ---- random data -----------------------------------------------------------------------------

__device__ float hash_uniform(size_t i, uint64_t seed) {  // [0, 1)
  uint64_t z = (i + seed * 0x632be59bd9b4e019ull) * 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 31)) * 0xbf58476d1ce4e5b9ull;
  z ^= z >> 29;
  return static_cast<float>(z >> 40) * (1.f / 16777216.f);
}

// fp8: uniform in [-range, range) rounded to e4m3; int8: uniform integers in [-range, range].
__global__ void fill_8bit_kernel(uint8_t* data, size_t n, bool is_int8, float range,
                                 uint64_t seed) {
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += stride) {
    const float u = 2.f * hash_uniform(i, seed) - 1.f;
    if (is_int8) {
      data[i] = static_cast<uint8_t>(static_cast<int8_t>(lrintf(u * range)));
    } else {
      data[i] = __nv_fp8_e4m3(u * range).__x;
    }
  }
}

// Uniform in [lo, hi).
__global__ void fill_float_kernel(float* data, size_t n, float lo, float hi, uint64_t seed) {
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += stride) {
    data[i] = lo + (hi - lo) * hash_uniform(i, seed);
  }
}

__global__ void fill_int32_kernel(int32_t* data, size_t n, int32_t range, uint64_t seed) {
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += stride) {
    data[i] = static_cast<int32_t>(lrintf((2.f * hash_uniform(i, seed) - 1.f) * range));
  }
}

// Bias in the output type, uniform in [-range, range).
template <typename T>
__global__ void fill_out_kernel(T* data, size_t n, float range, uint64_t seed) {
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += stride) {
    data[i] = static_cast<T>((2.f * hash_uniform(i, seed) - 1.f) * range);
  }
}

template <typename T>
T* device_alloc(size_t n) {
  T* ptr;
  BENCH_CHECK(cudaMalloc(&ptr, std::max<size_t>(n, 1) * sizeof(T)));
  return ptr;
}

// ---- the reference ---------------------------------------------------------------------------

__device__ float fp8_to_float(uint8_t bits) {
  __nv_fp8_e4m3 v;
  v.__x = bits;
  return static_cast<float>(v);
}

__device__ float load_out(const void* p, size_t i, bool bf16) {
  return bf16 ? __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i])
              : __half2float(static_cast<const __half*>(p)[i]);
}

// Everything one problem needs, in device memory.
struct Problem {
  int64_t m, n, k;
  uint8_t* a;        // [m, k] fp8 or int8
  uint8_t* b;        // [n, k]
  float* a_scales;   // [m] (scaled: per token or [0]) or block: [k / 128][a_scales_stride]
  float* b_scales;   // [n] or block: [ceil(n / 128)][k / 128]
  void* bias;        // [n] out dtype
  int32_t* azp;      // [m]
  int32_t* azp_adj;  // [n]
  void* out;         // [m, n] out dtype
  int64_t a_scales_stride;
};

struct Case {
  Mode mode;
  DType ab_dtype;
  DType out_dtype;
  ScaledMmTile tile;
  bool a_per_token, b_per_channel, with_bias, azp_per_token;
};

// ref[r, j] (fp32) for the rows rows[r] of out, one thread per output element.
__global__ void reference_kernel(float* ref, const int32_t* rows, int num_rows, Problem p, Case c) {
  const int64_t j = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  const int r = blockIdx.y;
  if (j >= p.n || r >= num_rows) return;
  const int64_t i = rows[r];
  const uint8_t* a = p.a + i * p.k;
  const uint8_t* b = p.b + j * p.k;
  float value;
  if (c.ab_dtype == DType::kInt8) {
    int64_t acc = 0;
    for (int64_t kk = 0; kk < p.k; ++kk) {
      acc += int64_t(static_cast<int8_t>(a[kk])) * int64_t(static_cast<int8_t>(b[kk]));
    }
    if (c.mode == Mode::kAzp) acc -= int64_t(c.azp_per_token ? p.azp[i] : 1) * p.azp_adj[j];
    value = static_cast<float>(acc);
  } else if (c.mode == Mode::kBlock) {
    value = 0.f;
    const int64_t groups = p.k / pyorch::kScaledMmBlockK;
    for (int64_t g = 0; g < groups; ++g) {
      float acc = 0.f;
      for (int64_t kk = g * pyorch::kScaledMmBlockK; kk < (g + 1) * pyorch::kScaledMmBlockK; ++kk) {
        acc += fp8_to_float(a[kk]) * fp8_to_float(b[kk]);
      }
      value += p.a_scales[g * p.a_scales_stride + i] *
               p.b_scales[(j / pyorch::kScaledMmBlockN) * groups + g] * acc;
    }
  } else {
    float acc = 0.f;
    for (int64_t kk = 0; kk < p.k; ++kk) {
      acc += fp8_to_float(a[kk]) * fp8_to_float(b[kk]);
    }
    value = acc;
  }
  if (c.mode != Mode::kBlock) {
    value *= p.a_scales[c.a_per_token ? i : 0] * p.b_scales[c.b_per_channel ? j : 0];
  }
  if (c.with_bias) value += load_out(p.bias, j, c.out_dtype == DType::kBFloat16);
  ref[r * p.n + j] = value;
}

// Our output on the sampled rows, compared on the host.
struct CheckResult {
  double max_err;  // max over elements of |ours - ref| / (|ref| + mean |ref|)
  bool pass;
};

// tol < 0: the default for the case (below).
CheckResult check_rows(const Problem& p, const Case& c, const std::vector<int32_t>& rows,
                       cudaStream_t stream, double tol = -1) {
  int32_t* d_rows = device_alloc<int32_t>(rows.size());
  float* d_ref = device_alloc<float>(rows.size() * p.n);
  BENCH_CHECK(
      cudaMemcpy(d_rows, rows.data(), rows.size() * sizeof(int32_t), cudaMemcpyHostToDevice));
  const dim3 grid(static_cast<unsigned>((p.n + 127) / 128), static_cast<unsigned>(rows.size()));
  reference_kernel<<<grid, 128, 0, stream>>>(d_ref, d_rows, static_cast<int>(rows.size()), p, c);
  BENCH_CHECK(cudaGetLastError());
  BENCH_CHECK(cudaStreamSynchronize(stream));
  std::vector<float> ref(rows.size() * p.n);
  std::vector<uint16_t> out(rows.size() * p.n);  // the sampled rows of out
  BENCH_CHECK(cudaMemcpy(ref.data(), d_ref, ref.size() * sizeof(float), cudaMemcpyDeviceToHost));
  for (size_t r = 0; r < rows.size(); ++r) {
    BENCH_CHECK(cudaMemcpy(out.data() + r * p.n,
                           static_cast<const uint16_t*>(p.out) + size_t(rows[r]) * p.n,
                           p.n * sizeof(uint16_t), cudaMemcpyDeviceToHost));
  }
  BENCH_CHECK(cudaFree(d_rows));
  BENCH_CHECK(cudaFree(d_ref));
  const bool bf16 = c.out_dtype == DType::kBFloat16;
  double mean_abs = 0;
  for (float v : ref) mean_abs += std::fabs(v);
  mean_abs /= std::max<size_t>(ref.size(), 1);
  double max_err = 0;
  for (size_t r = 0; r < rows.size(); ++r) {
    for (int64_t j = 0; j < p.n; ++j) {
      const uint16_t bits = out[r * p.n + j];
      float ours;
      if (bf16) {
        __nv_bfloat16_raw raw;
        raw.x = bits;
        ours = __bfloat162float(__nv_bfloat16(raw));
      } else {
        __half_raw raw;
        raw.x = bits;
        ours = __half2float(__half(raw));
      }
      const double want = ref[r * p.n + j];
      const double err =
          std::isfinite(ours) ? std::fabs(ours - want) / (std::fabs(want) + mean_abs) : INFINITY;
      max_err = std::max(max_err, err);
    }
  }
  // fp8 runs with fast accumulation (cuBLASLt's fast-accum mode: the wgmma accumulator is not
  // promoted to full fp32 between k steps): up to ~1% at k = 4096 on an H100, against 0.4% for
  // bf16's own rounding. Layout or scale bugs are O(1).
  const bool fast_accum = c.ab_dtype == DType::kFp8E4M3 && c.mode == Mode::kScaled;
  if (tol < 0) tol = (bf16 ? 1.0 / 128 : 1.0 / 512) * (fast_accum ? 4 : 1);
  return {max_err, max_err <= tol && mean_abs > 0};
}

cudaError_t run_ours(const Problem& p, const Case& c, cudaStream_t stream) {
  const void* bias = c.with_bias ? p.bias : nullptr;
  switch (c.mode) {
    case Mode::kScaled:
      return pyorch::cutlass_scaled_mm(p.out, p.a, p.b, p.a_scales, p.b_scales, bias, c.ab_dtype,
                                       c.out_dtype, p.m, p.n, p.k, p.n, p.k, p.k, c.a_per_token,
                                       c.b_per_channel, stream, c.tile);
    case Mode::kAzp:
      return pyorch::cutlass_scaled_mm_azp(p.out, p.a, p.b, p.a_scales, p.b_scales, p.azp_adj,
                                           c.azp_per_token ? p.azp : nullptr, bias, c.out_dtype,
                                           p.m, p.n, p.k, p.n, p.k, p.k, c.a_per_token,
                                           c.b_per_channel, stream, c.tile);
    case Mode::kBlock:
      return pyorch::cutlass_scaled_mm_blockwise(p.out, p.a, p.b, p.a_scales, p.b_scales, bias,
                                                 c.out_dtype, p.m, p.n, p.k, p.n, p.k, p.k,
                                                 p.a_scales_stride, stream);
  }
  return cudaErrorInvalidValue;
}

// Allocates and fills a problem; the weight region b may be larger than [n, k] (timing rotates
// over copies inside it).
Problem make_problem(int64_t m, int64_t n, int64_t k, DType ab_dtype, size_t b_bytes,
                     uint64_t seed) {
  Problem p{};
  p.m = m;
  p.n = n;
  p.k = k;
  const bool is_int8 = ab_dtype == DType::kInt8;
  p.a = device_alloc<uint8_t>(size_t(m) * k);
  p.b = device_alloc<uint8_t>(std::max(b_bytes, size_t(n) * k));
  fill_8bit_kernel<<<2048, 256>>>(p.a, size_t(m) * k, is_int8, is_int8 ? 127.f : 2.f, seed);
  fill_8bit_kernel<<<2048, 256>>>(p.b, std::max(b_bytes, size_t(n) * k), is_int8,
                                  is_int8 ? 127.f : 1.f, seed + 1);
  const int64_t groups = (k + pyorch::kScaledMmBlockK - 1) / pyorch::kScaledMmBlockK;
  const int64_t n_blocks = (n + pyorch::kScaledMmBlockN - 1) / pyorch::kScaledMmBlockN;
  p.a_scales_stride = (m + 3) / 4 * 4;
  const size_t a_scales_n = std::max<size_t>(size_t(p.a_scales_stride) * groups, m);
  const size_t b_scales_n = std::max<size_t>(size_t(n_blocks) * groups, n);
  p.a_scales = device_alloc<float>(a_scales_n);
  p.b_scales = device_alloc<float>(b_scales_n);
  // int8 products reach 127^2 k: scale them down so that bf16/fp16 outputs stay in range.
  const float s = is_int8 ? 1e-4f : 0.05f;
  fill_float_kernel<<<256, 256>>>(p.a_scales, a_scales_n, 0.5f * s, 1.5f * s, seed + 2);
  fill_float_kernel<<<256, 256>>>(p.b_scales, b_scales_n, 0.5f, 1.5f, seed + 3);
  p.bias = device_alloc<uint16_t>(n);
  p.azp = device_alloc<int32_t>(m);
  p.azp_adj = device_alloc<int32_t>(n);
  fill_int32_kernel<<<64, 256>>>(p.azp, m, 100, seed + 4);
  fill_int32_kernel<<<64, 256>>>(p.azp_adj, n, 1 << 12, seed + 5);
  p.out = device_alloc<uint16_t>(size_t(m) * n);
  BENCH_CHECK(cudaGetLastError());
  // The fills ran on the legacy stream, which the non-blocking timing stream does not wait for.
  BENCH_CHECK(cudaDeviceSynchronize());
  return p;
}

void fill_bias(const Problem& p, DType out_dtype, float range, uint64_t seed) {
  if (out_dtype == DType::kBFloat16) {
    fill_out_kernel<<<64, 256>>>(static_cast<__nv_bfloat16*>(p.bias), p.n, range, seed);
  } else {
    fill_out_kernel<<<64, 256>>>(static_cast<__half*>(p.bias), p.n, range, seed);
  }
  BENCH_CHECK(cudaGetLastError());
  BENCH_CHECK(cudaDeviceSynchronize());  // (see make_problem)
}

void free_problem(Problem& p) {
  for (void* ptr : {static_cast<void*>(p.a), static_cast<void*>(p.b),
                    static_cast<void*>(p.a_scales), static_cast<void*>(p.b_scales), p.bias,
                    static_cast<void*>(p.azp), static_cast<void*>(p.azp_adj), p.out}) {
    BENCH_CHECK(cudaFree(ptr));
  }
}

std::string case_name(const Case& c) {
  std::string s = c.mode == Mode::kBlock ? "block"
                  : c.mode == Mode::kAzp ? (c.azp_per_token ? "azp_token" : "azp_tensor")
                                         : "scaled";
  s += std::string("_") + pyorch::dtype_name(c.ab_dtype) + "_" + pyorch::dtype_name(c.out_dtype);
  if (c.mode != Mode::kBlock) {
    s += std::string("_a") + (c.a_per_token ? "token" : "tensor") + "_b" +
         (c.b_per_channel ? "channel" : "tensor");
  }
  s += c.with_bias ? "_bias" : "";
  return s;
}

// Sampled output rows: all of them up to max_rows, else max_rows spread over [0, m) with both
// ends.
std::vector<int32_t> sample_rows(int64_t m, int64_t max_rows) {
  std::vector<int32_t> rows;
  const int64_t count = std::min<int64_t>(m, max_rows);
  for (int64_t r = 0; r < count; ++r) {
    rows.push_back(static_cast<int32_t>(count == m ? r : r * (m - 1) / (count - 1)));
  }
  return rows;
}

// ---- correctness over every configuration -------------------------------------------------

// The m each tile is checked at: inside its range, not a multiple of the tile.
int64_t check_m(ScaledMmTile tile) {
  switch (tile) {
    case ScaledMmTile::kSwapM16: return 13;
    case ScaledMmTile::kSwapM64: return 37;
    case ScaledMmTile::kM256: return 200;
    default: return 333;
  }
}

int run_checks(Report& report, cudaStream_t stream) {
  int failures = 0;
  // n not a multiple of any tile width, k not a multiple of the k tile (16 | both, as required).
  const int64_t n = 272, k = 336;
  auto one = [&](const Case& c, int64_t m, int64_t kk) {
    Problem p = make_problem(m, n, kk, c.ab_dtype, 0, 1000 + m + kk);
    fill_bias(p, c.out_dtype, c.ab_dtype == DType::kInt8 ? 2.f : 4.f, 77);
    BENCH_CHECK(cudaMemset(p.out, 0xff, size_t(m) * n * 2));  // NaN poison
    const cudaError_t err = run_ours(p, c, stream);
    BENCH_CHECK(cudaStreamSynchronize(stream));
    CheckResult r{INFINITY, false};
    if (err == cudaSuccess) r = check_rows(p, c, sample_rows(m, m), stream);
    free_problem(p);
    failures += r.pass ? 0 : 1;
    report.add({{"op", "check"},
                {"case", case_name(c)},
                {"tile", pyorch::scaled_mm_tile_name(c.tile)},
                {"M", std::to_string(m)},
                {"N", std::to_string(n)},
                {"K", std::to_string(kk)},
                {"status", err == cudaSuccess ? "ok" : cudaGetErrorString(err)},
                {"max_err", Report::fmt(r.max_err, 6)},
                {"result", r.pass ? "PASS" : "FAIL"}});
  };
  for (DType ab : {DType::kFp8E4M3, DType::kInt8}) {
    for (DType out : {DType::kBFloat16, DType::kFloat16}) {
      for (int t = 0; t < pyorch::kNumScaledMmTiles; ++t) {
        const auto tile = static_cast<ScaledMmTile>(t);
        if (!pyorch::scaled_mm_tile_instantiated(tile, ab)) continue;
        for (int scales = 0; scales < 4; ++scales) {
          for (bool bias : {false, true}) {
            one({Mode::kScaled, ab, out, tile, (scales & 1) != 0, (scales & 2) != 0, bias, false},
                check_m(tile), k);
          }
        }
      }
      if (ab == DType::kInt8) {
        for (ScaledMmTile tile : {ScaledMmTile::kM256, ScaledMmTile::kLarge}) {
          for (bool per_token : {false, true}) {
            for (bool bias : {false, true}) {
              one({Mode::kAzp, ab, out, tile, per_token, true, bias, per_token}, check_m(tile), k);
            }
          }
        }
        // Decode-sized m through the launcher's own choice.
        one({Mode::kAzp, ab, out, ScaledMmTile::kAuto, true, false, true, true}, 3, k);
      } else {
        for (int64_t m : {1, 13, 130, 333}) {
          for (bool bias : {false, true}) {
            one({Mode::kBlock, ab, out, ScaledMmTile::kAuto, true, true, bias, false}, m, 384);
          }
        }
      }
    }
  }
  // A tile without a kernel for the dtype is refused, not run on another tile.
  for (int t = 0; t < pyorch::kNumScaledMmTiles; ++t) {
    const auto tile = static_cast<ScaledMmTile>(t);
    if (pyorch::scaled_mm_tile_instantiated(tile, DType::kInt8)) continue;
    const Case c{Mode::kScaled, DType::kInt8, DType::kBFloat16, tile, true, true, false, false};
    Problem p = make_problem(32, n, k, DType::kInt8, 0, 99);
    const cudaError_t err = run_ours(p, c, stream);
    free_problem(p);
    const bool refused = err == cudaErrorInvalidValue;
    failures += refused ? 0 : 1;
    report.add({{"op", "check"},
                {"case", case_name(c) + "_refused"},
                {"tile", pyorch::scaled_mm_tile_name(tile)},
                {"status", cudaGetErrorString(err)},
                {"result", refused ? "PASS" : "FAIL"}});
  }
  return failures;
}

// ---- timing ----------------------------------------------------------------------------------

struct Shape {
  std::string model, name;
  int64_t n, k;
};

// Llama-3 8B (hidden 4096, 32 q / 8 kv heads of 128, MLP 14336) and 70B (hidden 8192, 64 q / 8
// kv heads, MLP 28672), merged as the engine runs them.
const std::vector<Shape> kShapes = {
    {"8b", "qkv_proj", 6144, 4096},   {"8b", "o_proj", 4096, 4096},
    {"8b", "gate_up", 28672, 4096},   {"8b", "down", 4096, 14336},
    {"70b", "qkv_proj", 10240, 8192}, {"70b", "o_proj", 8192, 8192},
    {"70b", "gate_up", 57344, 8192},  {"70b", "down", 8192, 28672},
};

#ifdef PYORCH_BENCH_CUBLASLT
// One cuBLASLt matmul: out^T [n, m] = (B as k x n)^T (A^T as k x m) in cuBLAS's column-major
// terms, the "TN" layout fp8 needs; fp8 with per-tensor scale pointers, int8 to int32.
struct CublasLtGemm {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, ld = nullptr;
  cublasLtMatmulAlgo_t algo{};
  bool is_int8 = false;
  bool ok = false;

  CublasLtGemm(cublasLtHandle_t handle, bool int8, int64_t m, int64_t n, int64_t k,
               const float* a_scale, const float* b_scale, bool fast_accum, void* workspace,
               size_t workspace_bytes)
      : is_int8(int8) {
    const cublasComputeType_t compute = int8 ? CUBLAS_COMPUTE_32I : CUBLAS_COMPUTE_32F;
    const cudaDataType_t scale_type = int8 ? CUDA_R_32I : CUDA_R_32F;
    const cudaDataType_t in_type = int8 ? CUDA_R_8I : CUDA_R_8F_E4M3;
    const cudaDataType_t out_type = int8 ? CUDA_R_32I : CUDA_R_16BF;
    CUBLAS_CHECK(cublasLtMatmulDescCreate(&desc, compute, scale_type));
    const cublasOperation_t op_t = CUBLAS_OP_T, op_n = CUBLAS_OP_N;
    CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_t, sizeof(op_t)));
    CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_n, sizeof(op_n)));
    if (!int8) {
      // cuBLAS's A is our weight (b_scale), its B our activations (a_scale).
      CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
                                                  &b_scale, sizeof(b_scale)));
      CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER,
                                                  &a_scale, sizeof(a_scale)));
      const int8_t fast = fast_accum ? 1 : 0;
      CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast,
                                                  sizeof(fast)));
    }
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&la, in_type, k, n, k));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&lb, in_type, k, m, k));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&ld, out_type, n, m, n));
    cublasLtMatmulPreference_t pref;
    CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
        pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace_bytes, sizeof(workspace_bytes)));
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    CUBLAS_CHECK(
        cublasLtMatmulAlgoGetHeuristic(handle, desc, la, lb, ld, ld, pref, 1, &result, &found));
    CUBLAS_CHECK(cublasLtMatmulPreferenceDestroy(pref));
    // None found (torch._int_mm refuses m <= 16 for the same reason): the row says nan.
    ok = found > 0;
    if (!ok) {
      std::fprintf(stderr, "cuBLASLt has no algorithm for m=%lld n=%lld k=%lld (%s)\n",
                   (long long)m, (long long)n, (long long)k, int8 ? "int8" : "fp8");
    }
    algo = result.algo;
    (void)workspace;
  }
  ~CublasLtGemm() {
    cublasLtMatrixLayoutDestroy(la);
    cublasLtMatrixLayoutDestroy(lb);
    cublasLtMatrixLayoutDestroy(ld);
    cublasLtMatmulDescDestroy(desc);
  }
  void run(cublasLtHandle_t handle, const void* weight, const void* act, void* out, void* workspace,
           size_t workspace_bytes, cudaStream_t stream) const {
    const float one_f = 1.f, zero_f = 0.f;
    const int32_t one_i = 1, zero_i = 0;
    const void* alpha = is_int8 ? static_cast<const void*>(&one_i) : &one_f;
    const void* beta = is_int8 ? static_cast<const void*>(&zero_i) : &zero_f;
    CUBLAS_CHECK(cublasLtMatmul(handle, desc, alpha, weight, la, act, lb, beta, out, ld, out, ld,
                                &algo, workspace, workspace_bytes, stream));
  }
};
#endif

// Median microseconds of one launch, timed as a graph of `launches` launches rotating over the
// weight copies.
double time_launches(const std::function<void(int, cudaStream_t)>& launch, int launches, int iters,
                     cudaStream_t stream) {
  launch(0, stream);
  BENCH_CHECK(cudaStreamSynchronize(stream));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  BENCH_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < launches; ++i) launch(i, stream);
  BENCH_CHECK(cudaStreamEndCapture(stream, &graph));
  BENCH_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  const double us = pyorch::bench::time_us(
      [&](cudaStream_t s) { BENCH_CHECK(cudaGraphLaunch(exec, s)); }, stream, 2, iters);
  BENCH_CHECK(cudaGraphExecDestroy(exec));
  BENCH_CHECK(cudaGraphDestroy(graph));
  return us / launches;
}

struct Timer {
  cudaStream_t stream;
  int iters;
  bool fast_accum;
  bool sweep_tiles;  // --sweep-tiles: time every instantiated tile at every m
  int rounds;        // --rounds: each form timed this many times, interleaved; the median
  void* workspace;
  size_t workspace_bytes;
#ifdef PYORCH_BENCH_CUBLASLT
  cublasLtHandle_t handle;
#endif
};

int bench_shape(Report& report, const Timer& t, const Shape& s, const std::vector<int64_t>& tokens,
                DType ab_dtype, bool block) {
  int failures = 0;
  const size_t weight_bytes = size_t(s.n) * s.k;
  // Enough copies that >= 200 MB lie between two reads of one.
  const int copies = static_cast<int>(std::max<size_t>(2, 200000000 / weight_bytes + 2));
  int64_t max_m = 1;
  for (int64_t m : tokens) max_m = std::max(max_m, m);
  Problem p = make_problem(max_m, s.n, s.k, ab_dtype, weight_bytes * copies, 42);
  fill_bias(p, DType::kBFloat16, 1.f, 43);
  void* cublas_out = device_alloc<int32_t>(size_t(max_m) * s.n);
  for (int64_t m : tokens) {
    Problem pm = p;
    pm.m = m;
    pm.a_scales_stride = (m + 3) / 4 * 4;
    const Mode mode = block ? Mode::kBlock : Mode::kScaled;
    const Case tensor{mode,  ab_dtype, DType::kBFloat16, ScaledMmTile::kAuto, false, false,
                      false, false};
    const Case token{mode,  ab_dtype, DType::kBFloat16, ScaledMmTile::kAuto, true, true,
                     false, false};
    // Correctness on this shape first (sampled rows), with the engine's scale granularity. A
    // refused call is a FAIL row, and the other shapes still run.
    cudaError_t err = run_ours(pm, token, t.stream);
    if (err == cudaSuccess && !block) err = run_ours(pm, tensor, t.stream);
    BENCH_CHECK(cudaStreamSynchronize(t.stream));
    if (err != cudaSuccess) {
      ++failures;
      report.add({{"op", "bench_error"},
                  {"shape", s.model + "_" + s.name},
                  {"M", std::to_string(m)},
                  {"status", cudaGetErrorString(err)},
                  {"result", "FAIL"}});
      continue;
    }
    if (!block) BENCH_CHECK(run_ours(pm, token, t.stream));  // out from the checked case again
    CheckResult check = check_rows(pm, token, sample_rows(m, 16), t.stream);
    // Few launches per graph for large m (each is milliseconds), 24 for decode sizes.
    const double flops = 2.0 * m * s.n * s.k;
    const int launches = static_cast<int>(std::clamp(2e12 / std::max(flops, 1.0), 2.0, 24.0));
    auto ours = [&](const Case& c) {
      return time_launches(
          [&](int i, cudaStream_t st) {
            Problem pi = pm;
            pi.b = p.b + (size_t(i) % copies) * weight_bytes;
            BENCH_CHECK(run_ours(pi, c, st));
          },
          launches, t.iters, t.stream);
    };
    // Every timed form is a candidate, timed in t.rounds rounds in a rotated order and reported
    // as its median. At large m the GPU is power-bound and its clock falls as a run goes on:
    // forms timed one after another in a fixed order are not comparable (in one H200 sweep the
    // same 128 x 128 kernel ran 0.74x or 0.94x of cuBLASLt by its place in the order).
    struct Candidate {
      std::string name;
      std::function<double()> time;
      std::vector<double> us;
      double median() const {
        std::vector<double> v = us;
        std::sort(v.begin(), v.end());
        return v.empty() ? NAN : v[v.size() / 2];
      }
    };
    std::vector<Candidate> cands;
    cands.push_back({"token", [&] { return ours(token); }, {}});
    if (!block) cands.push_back({"tensor", [&] { return ours(tensor); }, {}});
    // fp8 at m >= 1024: the 128 x 256 cooperative tile too (per-token/channel scales).
    double huge_err = NAN;
    Case huge = token;
    huge.tile = ScaledMmTile::kHuge;
    if (!block && ab_dtype == DType::kFp8E4M3 && m >= 1024) {
      BENCH_CHECK(run_ours(pm, huge, t.stream));
      huge_err = check_rows(pm, huge, sample_rows(m, 16), t.stream).max_err;
      cands.push_back({"huge", [&] { return ours(huge); }, {}});
    }
    // --sweep-tiles: every tile the dtype instantiates that fits m (the 64-row swapped tiles up
    // to m = 256, the 128-row ones from m = 128, 64 x 128 up to 2048), per-token/channel scales.
    std::vector<Case> sweep_cases;
    if (!block && t.sweep_tiles) {
      for (int ti = 0; ti < pyorch::kNumScaledMmTiles; ++ti) {
        Case c = token;
        c.tile = static_cast<ScaledMmTile>(ti);
        if (!pyorch::scaled_mm_tile_instantiated(c.tile, ab_dtype)) continue;
        const bool swapped = c.tile == ScaledMmTile::kSwapM16 || c.tile == ScaledMmTile::kSwapM64;
        if (swapped ? m > 256 : c.tile == ScaledMmTile::kM256 ? m > 2048 : m < 128) continue;
        sweep_cases.push_back(c);
      }
    }
    for (const Case& c : sweep_cases) {
      cands.push_back({pyorch::scaled_mm_tile_name(c.tile), [&, c] { return ours(c); }, {}});
    }
    double cublas_err = NAN;
#ifdef PYORCH_BENCH_CUBLASLT
    const CublasLtGemm g(t.handle, ab_dtype == DType::kInt8, m, s.n, s.k, p.a_scales, p.b_scales,
                         t.fast_accum, t.workspace, t.workspace_bytes);
    if (g.ok) {
      cands.push_back({"cublaslt",
                       [&] {
                         return time_launches(
                             [&](int i, cudaStream_t st) {
                               g.run(t.handle, p.b + (size_t(i) % copies) * weight_bytes, p.a,
                                     cublas_out, t.workspace, t.workspace_bytes, st);
                             },
                             launches, t.iters, t.stream);
                       },
                       {}});
      // fp8 fast accumulation loses precision as k grows (3-4% of the output scale at k =
      // 28672 on an H100): with cuBLASLt in the same mode, ours passes when within 1.5x of
      // cuBLASLt's own error on the same data (per-tensor scales, the same sampled rows).
      if (ab_dtype == DType::kFp8E4M3 && !block && t.fast_accum) {
        g.run(t.handle, p.b, p.a, cublas_out, t.workspace, t.workspace_bytes, t.stream);
        BENCH_CHECK(cudaStreamSynchronize(t.stream));
        Problem pc = pm;
        pc.out = cublas_out;
        cublas_err = check_rows(pc, tensor, sample_rows(m, 16), t.stream).max_err;
        const double tol = std::max(4.0 / 128, 1.5 * cublas_err);
        check.pass = check.max_err <= tol;
      }
    }
#endif
    const size_t n_cands = cands.size();
    for (int r = 0; r < t.rounds; ++r) {
      for (size_t i = 0; i < n_cands; ++i) {
        Candidate& c = cands[(i + size_t(r)) % n_cands];
        c.us.push_back(c.time());
      }
    }
    auto median_of = [&](const std::string& name) {
      for (const Candidate& c : cands) {
        if (c.name == name) return c.median();
      }
      return double(NAN);
    };
    const double token_us = median_of("token");
    const double tensor_us = block ? token_us : median_of("tensor");
    const double huge_us = median_of("huge");
    const double cublas_us = median_of("cublaslt");
    std::string sweep;
    double best_us = INFINITY;
    std::string best_tile;
    for (const Case& c : sweep_cases) {
      const std::string name = pyorch::scaled_mm_tile_name(c.tile);
      const double us = median_of(name);
      sweep += (sweep.empty() ? "" : ",") + name + ":" + Report::fmt(us);
      if (us < best_us) best_us = us, best_tile = name;
    }
    failures += check.pass ? 0 : 1;
    const std::string op = block ? "fp8_block" : pyorch::dtype_name(ab_dtype);
    report.add({{"op", op == "fp8_e4m3" ? "fp8" : op},
                {"model", s.model},
                {"shape", s.name},
                {"M", std::to_string(m)},
                {"N", std::to_string(s.n)},
                {"K", std::to_string(s.k)},
                {"tile", block ? "block_128x128x128_c1x2"
                               : pyorch::scaled_mm_tile_name(
                                     pyorch::default_scaled_mm_tile(m, s.n, s.k, ab_dtype))},
                {"time_us", Report::fmt(tensor_us)},
                {"token_channel_us", Report::fmt(token_us)},
                {"cublaslt_us", Report::fmt(cublas_us)},
                {"ratio", Report::fmt(cublas_us / tensor_us, 3)},
                {"ratio_token_channel", Report::fmt(cublas_us / token_us, 3)},
                {"huge_us", Report::fmt(huge_us)},
                {"ratio_huge", Report::fmt(cublas_us / huge_us, 3)},
                {"huge_max_err", Report::fmt(huge_err, 6)},
                {"sweep_us", sweep},
                {"best_tile", best_tile},
                {"ratio_best", Report::fmt(cublas_us / best_us, 3)},
                {"TFLOPS", Report::fmt(flops / (tensor_us * 1e6), 1)},
                {"max_err", Report::fmt(check.max_err, 6)},
                {"cublaslt_max_err", Report::fmt(cublas_err, 6)},
                {"result", check.pass ? "PASS" : "FAIL"}});
  }
  BENCH_CHECK(cudaFree(cublas_out));
  free_problem(p);
  return failures;
}

// skinny_gemm_fp8 at decode sizes on one shape (see the header comment).
void bench_skinny(Report& report, const Timer& t, const Shape& s,
                  const std::vector<int64_t>& tokens, double copy_gbs) {
  const size_t weight_bytes = size_t(s.n) * s.k;
  // A decode step reads each weight once across a model-sized span: rotate over >= 2 GB of copies
  // (at 200 MB, part of a large weight is still in L2 when its copy comes round again, which
  // flatters the 4-warp, hinted launches; bench_gemm.cu measured it for bf16), with at least one
  // launch per copy.
  const int copies = static_cast<int>(std::max<size_t>(2, 2000000000 / weight_bytes + 2));
  const int launches = std::max(24, copies);
  int64_t max_m = 1;
  for (int64_t m : tokens) max_m = std::max(max_m, m);
  Problem p = make_problem(max_m, s.n, s.k, DType::kFp8E4M3, weight_bytes * copies, 44);
  __nv_bfloat16* x = pyorch::bench::random_device_buffer<__nv_bfloat16>(
      size_t(max_m) * s.k, -2.f, 2.f, 45, [](float f) { return __float2bfloat16(f); });
  __nv_bfloat16* out = device_alloc<__nv_bfloat16>(size_t(max_m) * s.n);
  void* cublas_out = device_alloc<int32_t>(size_t(max_m) * s.n);
  // The form the engine's fused decode layer runs on this shape (pyorch/layers/fused_linear.py):
  // qkv_proj a normed input, gate_up a normed input + SiLU-and-mul, o_proj and down the residual
  // add. Its launches default to no PDL (skinny_gemm_fp8), so the sweep tries both.
  const bool normed = s.name == "qkv_proj" || s.name == "gate_up";
  const pyorch::SkinnyGemmEpilogue fused_epi = s.name == "gate_up"
                                                   ? pyorch::SkinnyGemmEpilogue::kSiluMul
                                               : normed ? pyorch::SkinnyGemmEpilogue::kStore
                                                        : pyorch::SkinnyGemmEpilogue::kAdd;
  const int64_t fused_cols = fused_epi == pyorch::SkinnyGemmEpilogue::kSiluMul ? s.n / 2 : s.n;
  __nv_bfloat16* norm_weight = pyorch::bench::random_device_buffer<__nv_bfloat16>(
      size_t(s.k), 0.5f, 1.5f, 46, [](float f) { return __float2bfloat16(f); });
  __nv_bfloat16* residual = pyorch::bench::random_device_buffer<__nv_bfloat16>(
      size_t(max_m) * s.n, -1.f, 1.f, 47, [](float f) { return __float2bfloat16(f); });
  for (int64_t m : tokens) {
    const double bytes = double(weight_bytes) + 2.0 * m * (s.k + s.n);
    auto skinny = [&](const pyorch::SkinnyGemmConfig* config) {
      return time_launches(
          [&](int i, cudaStream_t st) {
            BENCH_CHECK(pyorch::skinny_gemm_fp8(
                out, x, p.b + (size_t(i) % copies) * weight_bytes, p.b_scales, true, nullptr,
                nullptr, 0.f, pyorch::SkinnyGemmEpilogue::kStore, DType::kBFloat16, m, s.n, s.k,
                s.n, s.k, st, config));
          },
          launches, t.iters, t.stream);
    };
    const double us = skinny(nullptr);
    std::string sweep;
    for (int warps : {4, 8}) {
      for (int l2 : {0, 1}) {
        const pyorch::SkinnyGemmConfig config{warps, l2, -1, -1};
        sweep += (sweep.empty() ? "" : ",") + std::string("w") + std::to_string(warps) + "l2" +
                 std::to_string(l2) + ":" + Report::fmt(skinny(&config));
      }
    }
    auto fused = [&](const pyorch::SkinnyGemmConfig* config) {
      return time_launches(
          [&](int i, cudaStream_t st) {
            const bool add = fused_epi == pyorch::SkinnyGemmEpilogue::kAdd;
            BENCH_CHECK(pyorch::skinny_gemm_fp8(
                add ? residual : out, x, p.b + (size_t(i) % copies) * weight_bytes, p.b_scales,
                true, nullptr, normed ? norm_weight : nullptr, 1e-5f, fused_epi, DType::kBFloat16,
                m, s.n, s.k, fused_cols, s.k, st, config));
          },
          launches, t.iters, t.stream);
    };
    const double fused_us = fused(nullptr);
    std::string fused_sweep;
    for (int warps : {4, 8}) {
      for (int l2 : {0, 1}) {
        for (int pdl : {0, 1}) {
          const pyorch::SkinnyGemmConfig config{warps, l2, -1, pdl};
          fused_sweep += (fused_sweep.empty() ? "" : ",") + std::string("w") +
                         std::to_string(warps) + "l2" + std::to_string(l2) + "pdl" +
                         std::to_string(pdl) + ":" + Report::fmt(fused(&config));
        }
      }
    }
    Problem pm = p;
    pm.m = m;
    pm.a_scales_stride = (m + 3) / 4 * 4;
    const Case token{
        Mode::kScaled, DType::kFp8E4M3, DType::kBFloat16, ScaledMmTile::kAuto, true, true, false,
        false};
    const double w8a8_us = time_launches(
        [&](int i, cudaStream_t st) {
          Problem pi = pm;
          pi.b = p.b + (size_t(i) % copies) * weight_bytes;
          BENCH_CHECK(run_ours(pi, token, st));
        },
        launches, t.iters, t.stream);
    double cublas_us = NAN;
#ifdef PYORCH_BENCH_CUBLASLT
    const CublasLtGemm g(t.handle, false, m, s.n, s.k, p.a_scales, p.b_scales, t.fast_accum,
                         t.workspace, t.workspace_bytes);
    if (g.ok) {
      cublas_us = time_launches(
          [&](int i, cudaStream_t st) {
            g.run(t.handle, p.b + (size_t(i) % copies) * weight_bytes, p.a, cublas_out, t.workspace,
                  t.workspace_bytes, st);
          },
          launches, t.iters, t.stream);
    }
#endif
    report.add({{"op", "fp8_skinny"},
                {"model", s.model},
                {"shape", s.name},
                {"M", std::to_string(m)},
                {"N", std::to_string(s.n)},
                {"K", std::to_string(s.k)},
                {"time_us", Report::fmt(us)},
                {"pct_of_copy", Report::fmt(100.0 * bytes / (us * 1e3) / copy_gbs, 1)},
                {"sweep_us", sweep},
                {"fused_form",
                 normed ? (fused_epi == pyorch::SkinnyGemmEpilogue::kSiluMul ? "norm_silu" : "norm")
                        : "add"},
                {"fused_us", Report::fmt(fused_us)},
                {"fused_sweep_us", fused_sweep},
                {"w8a8_gemm_us", Report::fmt(w8a8_us)},
                {"cublaslt_us", Report::fmt(cublas_us)},
                {"ratio_cublaslt", Report::fmt(cublas_us / us, 3)}});
  }
  BENCH_CHECK(cudaFree(x));
  BENCH_CHECK(cudaFree(out));
  BENCH_CHECK(cudaFree(cublas_out));
  BENCH_CHECK(cudaFree(norm_weight));
  BENCH_CHECK(cudaFree(residual));
  free_problem(p);
}

}  // namespace

int main(int argc, char** argv) {
  const Args args(argc, argv);
  Report report(args);
  if (!pyorch::cutlass_scaled_mm_available()) {
    std::fprintf(stderr, "bench_scaled_mm: pyorch was built without CUTLASS: nothing to run\n");
    return 1;
  }
  Timer t{};
  BENCH_CHECK(cudaStreamCreateWithFlags(&t.stream, cudaStreamNonBlocking));
  t.iters = static_cast<int>(args.num("iters", 20));
  t.fast_accum = args.num("cublas-fast-accum", 1) != 0;
  t.sweep_tiles = args.has("sweep-tiles");
  t.rounds = static_cast<int>(std::max<int64_t>(1, args.num("rounds", 3)));
  t.workspace_bytes = size_t(32) << 20;
  BENCH_CHECK(cudaMalloc(&t.workspace, t.workspace_bytes));
#ifdef PYORCH_BENCH_CUBLASLT
  CUBLAS_CHECK(cublasLtCreate(&t.handle));
#else
  if (!args.has("no-bench")) {
    std::fprintf(stderr, "bench_scaled_mm was built without cuBLASLt: run with --no-bench\n");
    return 1;
  }
#endif
  std::printf("device=%s\n", pyorch::bench::device_name().c_str());

  int failures = 0;
  if (!args.has("no-check")) failures += run_checks(report, t.stream);
  if (!args.has("no-bench")) {
    const auto tokens = args.list("tokens", {1, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192});
    const auto models = args.strs("models", {"8b", "70b"});
    if (!args.has("no-skinny")) {
      const double copy_gbs = pyorch::bench::copy_bandwidth_gbs(t.stream);
      std::printf("copy_GB/s=%.1f\n", copy_gbs);
      const auto skinny_tokens = args.list("skinny-tokens", {1, 8, 16});
      for (const Shape& s : kShapes) {
        if (std::find(models.begin(), models.end(), s.model) == models.end()) continue;
        bench_skinny(report, t, s, skinny_tokens, copy_gbs);
      }
    }
    for (const Shape& s : kShapes) {
      if (std::find(models.begin(), models.end(), s.model) == models.end()) continue;
      if (!args.has("no-fp8"))
        failures += bench_shape(report, t, s, tokens, DType::kFp8E4M3, false);
      if (!args.has("no-int8")) failures += bench_shape(report, t, s, tokens, DType::kInt8, false);
      if (!args.has("no-block")) {
        failures += bench_shape(report, t, s, tokens, DType::kFp8E4M3, true);
      }
    }
  }
#ifdef PYORCH_BENCH_CUBLASLT
  CUBLAS_CHECK(cublasLtDestroy(t.handle));
#endif
  BENCH_CHECK(cudaFree(t.workspace));
  std::printf("%s: %d failing checks\n", failures == 0 ? "ALL PASS" : "FAILURES", failures);
  return failures == 0 ? 0 : 2;
}
