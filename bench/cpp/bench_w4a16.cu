// Benchmark of pyorch::gptq_marlin_gemm (W4A16, GPTQ uint4b8, group 128, bf16) against cuBLAS's
// bf16 GEMM on Llama-3-8B and 70B projections (no torch).
//
// Each row: our time (where w4a16_mma_path says so: gptq_marlin_gemm, whose kernel the row names;
// else w4a16_dequantize in column chunks + cuBLAS, exactly the adapter's large-M path), cuBLAS
// bf16 on the unquantized [N, K] weight, the speedup (cuBLAS / ours), our achieved weight bandwidth
// (4-bit codes + scales per second) and PASS/FAIL against a naive reference kernel that decodes the
// tile layout through its own inverse formula (independent of the kernels' index math) and sums in
// fp32.
//
// Timing: a CUDA graph of back-to-back launches rotating over copies of the weight that span
// --span-mb (default 2000: a decode step reads each weight once across a model-sized span; at
// 200 MB part of a large weight is still in L2 when its copy comes round again, as bench_gemm.cu
// measured for bf16), at least --launches and at least one per copy; the median replay over
// --iters replays, divided by the launch count.
// The decode chain: the 128 GEMMs of a Llama-3-8B decode step (32 layers, own weights each), one
// graph, ours against cuBLAS bf16 (--chain-tokens; --no-chain skips it).
// Flags: --models 8b,70b --tokens 1,2,4,8,16,32,64,128,512,2048 --launches 20 --iters 20
//        --span-mb 2000
//        --chain-tokens 1,8,16 --no-chain --prefetch N (L2 prefetch depth; 0: off) --json FILE
//        --kernel stream|registers (the m <= 16 kernel)
//        --stages N (stream ring slots per warp, 1..8) --ctas-per-sm N (the k-split's target)
//        --pdl 0|1 (the stream kernel's PDL launch) --shapes qkv_proj,o_proj,... (default: all)
//        --prefetch-acts 0|1 (the stream kernel loads the next k-block's activations early)
//        --chunk N (k-blocks per ring slot of the stream kernel, groups of 64+ rows: 4 or 8)
//        --scales-by-copy 0|1 (the stream kernel's groups of 128 take their scales by the ring
//        slots' bulk copies; default 0: global loads into registers)
//        --tiled-min-rows N (from N rows on the tiled kernel; 65: the registers kernel up to 64)
//        --mma-max-rows N (above N rows dequantize + cuBLAS, as the adapter does; 0: auto)
//        --chunk-mb N (MiB of dequantized columns per chunk of that path; default 64)
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <cuda_bf16.h>
#ifdef PYORCH_BENCH_CUBLAS
#include <cublas_v2.h>
#endif

#include "common/bench_util.h"
#include "pyorch/launch.h"
#include "pyorch/w4a16.h"

namespace {

using pyorch::bench::Args;
using pyorch::bench::Report;
using bf16 = __nv_bfloat16;

#ifdef PYORCH_BENCH_CUBLAS
#define CUBLAS_CHECK(expr)                                                             \
  do {                                                                                 \
    cublasStatus_t s_ = (expr);                                                        \
    if (s_ != CUBLAS_STATUS_SUCCESS) {                                                 \
      std::fprintf(stderr, "%s:%d: %s: cuBLAS status %d\n", __FILE__, __LINE__, #expr, \
                   static_cast<int>(s_));                                              \
      std::exit(1);                                                                    \
    }                                                                                  \
  } while (0)
#else
using cublasHandle_t = void*;
#endif

constexpr int64_t kGroupSize = 128;

// Whether the adapter's path for m rows is gptq_marlin_gemm (else dequantize + cuBLAS).
bool mma_path(int64_t m, int64_t n, int64_t k) { return pyorch::w4a16_mma_path(m, n, k); }

struct Shape {
  std::string model, name;
  int64_t n, k;
};

const std::vector<Shape> kShapes = {{"8b", "qkv_proj", 6144, 4096},   {"8b", "o_proj", 4096, 4096},
                                    {"8b", "gate_up", 28672, 4096},   {"8b", "down", 4096, 14336},
                                    {"70b", "qkv_proj", 10240, 8192}, {"70b", "o_proj", 8192, 8192},
                                    {"70b", "gate_up", 57344, 8192},  {"70b", "down", 8192, 28672}};

__device__ uint64_t bench_hash(uint64_t i, uint64_t seed) {
  uint64_t z = (i + seed * 0x632be59bd9b4e019ull) * 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 31)) * 0xbf58476d1ce4e5b9ull;
  return z ^ (z >> 29);
}

// Uniform values in [lo, hi) per element.
__global__ void fill_bf16_kernel(bf16* data, size_t n, float lo, float hi, uint64_t seed) {
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += stride) {
    const float u = static_cast<float>(bench_hash(i, seed) >> 40) * (1.f / 16777216.f);
    data[i] = __float2bfloat16(lo + (hi - lo) * u);
  }
}

// Random 32-bit words: random 4-bit codes in any layout.
__global__ void fill_words_kernel(uint32_t* data, size_t n, uint64_t seed) {
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += stride) {
    data[i] = static_cast<uint32_t>(bench_hash(i, seed) >> 16);
  }
}

// The reference: out[m, n] = sum_k a[m, k] * bf16((q(k, n) - 8) * s[k / 128, n]) in fp32, the
// code found by inverting the documented layout: n = 16 nt + g + 8 (r % 2), k = 64 kb + 16 t +
// 4 kt + h + 2 (r / 2) for code p = 4 h + r of word kt of lane 4 g + t.
// Only rows kRefRows spread over [0, m) are computed (row_of), to keep M = 2048 affordable.
constexpr int64_t kRefRows = 4;
__host__ __device__ int64_t ref_row(int64_t i, int64_t m) {
  return m <= kRefRows ? i : i * (m - 1) / (kRefRows - 1);
}
__global__ void reference_kernel(float* out, const bf16* a, const uint32_t* b_q, const bf16* scales,
                                 int64_t m, int64_t n, int64_t k) {
  const int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (idx >= (m < kRefRows ? m : kRefRows) * n) return;
  const int64_t row = ref_row(idx / n, m), col = idx % n;
  const int64_t nt = col / 16, gg = col % 16, g = gg % 8, rlow = gg / 8;
  float sum = 0.f;
  for (int64_t kk = 0; kk < k; ++kk) {
    const int64_t kb = kk / 64, within = kk % 64, t = within / 16, kt = (within % 16) / 4;
    const int64_t j = within % 4, h = j % 2, r = (j / 2) * 2 + rlow, p = 4 * h + r;
    const int64_t word = ((nt * (k / 64) + kb) * 32 + g * 4 + t) * 4 + kt;
    const int q = static_cast<int>((b_q[word] >> (4 * p)) & 0xF);
    const float w = __bfloat162float(__float2bfloat16(
        static_cast<float>(q - 8) * __bfloat162float(scales[(kk / kGroupSize) * n + col])));
    sum += __bfloat162float(a[row * k + kk]) * w;
  }
  out[row * n + col] = sum;
}

template <typename T>
T* device_alloc(size_t n) {
  T* p;
  BENCH_CHECK(cudaMalloc(&p, std::max<size_t>(n, 1) * sizeof(T)));
  return p;
}

struct Bench {
  cublasHandle_t handle;
  cudaStream_t stream;
  int launches, iters;
  double span_bytes;  // the weight copies of one shape span at least this many bytes
  Report* report;
};

// Median milliseconds of one replay of a graph holding `body`'s launches.
double graph_ms(const std::function<void(cudaStream_t)>& body, cudaStream_t stream, int iters) {
  body(stream);
  BENCH_CHECK(cudaStreamSynchronize(stream));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  BENCH_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  body(stream);
  BENCH_CHECK(cudaStreamEndCapture(stream, &graph));
  BENCH_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  const double us = pyorch::bench::time_us(
      [&](cudaStream_t s) { BENCH_CHECK(cudaGraphLaunch(exec, s)); }, stream, 3, iters);
  BENCH_CHECK(cudaGraphExecDestroy(exec));
  BENCH_CHECK(cudaGraphDestroy(graph));
  return us / 1e3;
}

// out [m, n] = x [m, k] @ w [n, k]^T, as torch's F.linear calls cuBLAS.
void run_cublas(cublasHandle_t handle, const bf16* w, const bf16* x, bf16* out, int64_t m,
                int64_t n, int64_t k, cudaStream_t s) {
#ifdef PYORCH_BENCH_CUBLAS
  const float alpha = 1.f, beta = 0.f;
  CUBLAS_CHECK(cublasSetStream(handle, s));
  CUBLAS_CHECK(cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(n),
                            static_cast<int>(m), static_cast<int>(k), &alpha, w, CUDA_R_16BF,
                            static_cast<int>(k), x, CUDA_R_16BF, static_cast<int>(k), &beta, out,
                            CUDA_R_16BF, static_cast<int>(n), CUBLAS_COMPUTE_32F,
                            CUBLAS_GEMM_DEFAULT));
#endif
}

// The buffers of one shape: rotating copies of the 4-bit weight (and of a bf16 weight for
// cuBLAS), activations and outputs at the largest M.
struct Buffers {
  std::vector<uint32_t*> codes;  // w4 tiles, each k * n / 8 words
  std::vector<bf16*> dense;      // [n, k] each
  bf16* scales;                  // [k / 128, n]
  bf16* a;                       // [max_m, k]
  bf16* out;                     // [max_m, n]
  bf16* dequant;                 // [chunk, k]: the large-M path's dequantized columns
  int64_t chunk;
  int32_t* workspace;
  float* partials;
  float* ref;  // [max_m, n]
  Buffers(const Shape& s, const std::vector<int64_t>& tokens, double span_bytes) {
    int64_t max_m = 1, max_partials = 1;
    for (int64_t m : tokens) {
      max_m = std::max(max_m, m);
      if (mma_path(m, s.n, s.k))
        max_partials = std::max(max_partials, pyorch::w4a16_partials_size(m, s.n, s.k));
    }
    const double q_bytes = s.n * s.k / 2.0, d_bytes = 2.0 * s.n * s.k;
    const int q_copies = std::max(2, static_cast<int>(std::ceil(span_bytes / q_bytes)) + 1);
    const int d_copies = std::max(2, static_cast<int>(std::ceil(span_bytes / d_bytes)) + 1);
    for (int c = 0; c < q_copies; ++c) {
      codes.push_back(device_alloc<uint32_t>(size_t(s.n) * s.k / 8));
      fill_words_kernel<<<2048, 256>>>(codes.back(), size_t(s.n) * s.k / 8, 100 + c);
    }
    const float w_scale = 1.f / std::sqrt(float(s.k));
    for (int c = 0; c < d_copies; ++c) {
      dense.push_back(device_alloc<bf16>(size_t(s.n) * s.k));
      fill_bf16_kernel<<<2048, 256>>>(dense.back(), size_t(s.n) * s.k, -w_scale, w_scale, 200 + c);
    }
    scales = device_alloc<bf16>(size_t(s.k / kGroupSize) * s.n);
    fill_bf16_kernel<<<2048, 256>>>(scales, size_t(s.k / kGroupSize) * s.n, 0.05f * w_scale,
                                    0.3f * w_scale, 7);
    a = device_alloc<bf16>(size_t(max_m) * s.k);
    fill_bf16_kernel<<<2048, 256>>>(a, size_t(max_m) * s.k, -1.f, 1.f, 8);
    out = device_alloc<bf16>(size_t(max_m) * s.n);
    chunk = pyorch::w4a16_dequant_chunk_cols(s.n, s.k, sizeof(bf16));
    dequant = device_alloc<bf16>(size_t(chunk) * s.k);
    workspace = device_alloc<int32_t>(size_t(s.n / pyorch::kW4A16BlockN + 1));
    BENCH_CHECK(cudaMemset(workspace, 0, (s.n / pyorch::kW4A16BlockN + 1) * sizeof(int32_t)));
    partials = device_alloc<float>(size_t(max_partials));
    ref = device_alloc<float>(size_t(max_m) * s.n);
    // The fills ran on the legacy stream; the timed work runs on a non-blocking one (the first
    // run's M = 1 rows of the 70B shapes read codes still being written: NaN, FAIL).
    BENCH_CHECK(cudaDeviceSynchronize());
  }
  ~Buffers() {
    for (auto* p : codes) cudaFree(p);
    for (auto* p : dense) cudaFree(p);
    for (void* p : std::vector<void*>{scales, a, out, dequant, workspace, partials, ref}) {
      cudaFree(p);
    }
  }
};

// Ours: gptq_marlin_gemm where w4a16_mma_path says so, else the adapter's dequantize + cuBLAS.
void run_ours(const Bench& b, const Buffers& buf, const Shape& s, int64_t m, int copy,
              cudaStream_t st) {
  const auto* q = reinterpret_cast<const int32_t*>(buf.codes[copy]);
  if (mma_path(m, s.n, s.k)) {
    BENCH_CHECK(pyorch::gptq_marlin_gemm(buf.out, buf.a, q, buf.scales, nullptr, nullptr, nullptr,
                                         buf.workspace, buf.partials, pyorch::W4A16Type::kUint4b8,
                                         pyorch::DType::kBFloat16, m, s.n, s.k, kGroupSize, s.k,
                                         s.n, st));
    return;
  }
  for (int64_t n0 = 0; n0 < s.n; n0 += buf.chunk) {
    const int64_t cols = std::min(buf.chunk, s.n - n0);
    BENCH_CHECK(pyorch::w4a16_dequantize(buf.dequant, q, buf.scales, nullptr,
                                         pyorch::W4A16Type::kUint4b8, pyorch::DType::kBFloat16, s.n,
                                         s.k, kGroupSize, n0, cols, st));
#ifdef PYORCH_BENCH_CUBLAS
    // out[:, n0:n0+cols] (row stride n) = a @ dequant^T.
    const float alpha = 1.f, beta = 0.f;
    CUBLAS_CHECK(cublasSetStream(b.handle, st));
    CUBLAS_CHECK(cublasGemmEx(b.handle, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(cols),
                              static_cast<int>(m), static_cast<int>(s.k), &alpha, buf.dequant,
                              CUDA_R_16BF, static_cast<int>(s.k), buf.a, CUDA_R_16BF,
                              static_cast<int>(s.k), &beta, buf.out + n0, CUDA_R_16BF,
                              static_cast<int>(s.n), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
#endif
  }
}

// max |ours - ref| / max |ref| over the reference's rows.
double rel_err(const Buffers& buf, int64_t m, int64_t n) {
  std::vector<bf16> ours(size_t(m) * n);
  std::vector<float> ref(size_t(m) * n);
  BENCH_CHECK(cudaMemcpy(ours.data(), buf.out, ours.size() * sizeof(bf16), cudaMemcpyDeviceToHost));
  BENCH_CHECK(cudaMemcpy(ref.data(), buf.ref, ref.size() * sizeof(float), cudaMemcpyDeviceToHost));
  double diff = 0, scale = 0;
  for (int64_t r = 0; r < std::min(m, kRefRows); ++r) {
    for (int64_t c = 0; c < n; ++c) {
      const size_t i = size_t(ref_row(r, m)) * n + c;
      const double x = __bfloat162float(ours[i]);
      diff = std::isnan(x) ? INFINITY : std::max(diff, std::fabs(x - ref[i]));
      scale = std::max(scale, std::fabs(double(ref[i])));
    }
  }
  return diff / std::max(scale, 1e-30);
}

void bench_shape(const Bench& b, const Shape& s, const std::vector<int64_t>& tokens) {
  Buffers buf(s, tokens, b.span_bytes);
  const int q_launches = std::max(b.launches, static_cast<int>(buf.codes.size()));
  const int d_launches = std::max(b.launches, static_cast<int>(buf.dense.size()));
  const double weight_bytes = s.n * s.k / 2.0 + 2.0 * s.n * (s.k / kGroupSize);
  for (int64_t m : tokens) {
    // Correctness first (copy 0), against the naive reference.
    BENCH_CHECK(cudaMemset(buf.out, 0xff, size_t(m) * s.n * sizeof(bf16)));  // NaN poison
    run_ours(b, buf, s, m, 0, b.stream);
    const int64_t items = std::min(m, kRefRows) * s.n;
    reference_kernel<<<static_cast<unsigned>((items + 255) / 256), 256, 0, b.stream>>>(
        buf.ref, buf.a, buf.codes[0], buf.scales, m, s.n, s.k);
    BENCH_CHECK(cudaStreamSynchronize(b.stream));
    const double err = rel_err(buf, m, s.n);
    const bool pass = err < 1e-2;
    const double us = 1e3 *
                      graph_ms(
                          [&](cudaStream_t st) {
                            for (int i = 0; i < q_launches; ++i) {
                              run_ours(b, buf, s, m, i % static_cast<int>(buf.codes.size()), st);
                            }
                          },
                          b.stream, b.iters) /
                      q_launches;
    const double cublas_us = 1e3 *
                             graph_ms(
                                 [&](cudaStream_t st) {
                                   for (int i = 0; i < d_launches; ++i) {
                                     run_cublas(b.handle, buf.dense[i % buf.dense.size()], buf.a,
                                                buf.out, m, s.n, s.k, st);
                                   }
                                 },
                                 b.stream, b.iters) /
                             d_launches;
    b.report->add(
        {{"op", "w4a16_gemm"},
         {"model", s.model},
         {"shape", s.name},
         {"M", std::to_string(m)},
         {"N", std::to_string(s.n)},
         {"K", std::to_string(s.k)},
         {"path", mma_path(m, s.n, s.k) ? "mma" : "dequant+cublas"},
         {"kernel", mma_path(m, s.n, s.k) ? pyorch::w4a16_kernel_name(m) : "dequant"},
         {"stages", std::to_string(pyorch::w4a16_stream_stages())},
         {"prefetch_acts", pyorch::w4a16_prefetch_acts() ? "1" : "0"},
         {"chunk", std::to_string(pyorch::w4a16_stream_chunk())},
         {"ctas_per_sm", std::to_string(pyorch::w4a16_ctas_per_sm())},
         {"pdl", pyorch::pdl_enabled() ? "1" : "0"},
         {"chunk_cols", std::to_string(mma_path(m, s.n, s.k) ? 0 : buf.chunk)},
         {"splits",
          std::to_string(mma_path(m, s.n, s.k) ? pyorch::w4a16_num_splits(m, s.n, s.k) : 1)},
         {"acts_ahead", pyorch::w4a16_stream_acts_ahead(m, s.n, s.k) ? "1" : "0"},
         {"time_us", Report::fmt(us)},
         {"cublas_bf16_us", Report::fmt(cublas_us)},
         {"speedup_vs_cublas", Report::fmt(cublas_us / us, 3)},
         {"weight_GB/s", Report::fmt(weight_bytes / (us * 1e3), 1)},
         {"rel_err", Report::fmt(err, 5)},
         {"check", pass ? "PASS" : "FAIL"}});
  }
}

// The GEMMs of one Llama-3-8B decode step: 32 layers x (qkv_proj, o_proj, gate_up, down), each
// with its own weights (4-bit: 3.5 GB; bf16 for cuBLAS: 13 GB), one graph. The 4-bit decode's
// GEMM time per token against the bf16 one (the LM head stays bf16 in both and is left out).
void bench_chain(const Bench& b, const std::vector<int64_t>& tokens) {
  constexpr int kLayers = 32;
  std::vector<Shape> layer_shapes;
  for (const Shape& s : kShapes) {
    if (s.model == "8b") layer_shapes.push_back(s);
  }
  int64_t max_m = 1, max_n = 0, max_k = 0;
  for (int64_t m : tokens) max_m = std::max(max_m, m);
  for (const Shape& s : layer_shapes) {
    max_n = std::max(max_n, s.n);
    max_k = std::max(max_k, s.k);
  }
  struct Layer {
    const Shape* shape;
    uint32_t* codes;
    bf16* dense;
    bf16* scales;
    int32_t* workspace;
  };
  std::vector<Layer> chain;
  double q_bytes = 0;
  for (int l = 0; l < kLayers; ++l) {
    for (const Shape& s : layer_shapes) {
      Layer layer{&s, device_alloc<uint32_t>(size_t(s.n) * s.k / 8),
                  device_alloc<bf16>(size_t(s.n) * s.k),
                  device_alloc<bf16>(size_t(s.k / kGroupSize) * s.n),
                  device_alloc<int32_t>(size_t(s.n / pyorch::kW4A16BlockN + 1))};
      fill_words_kernel<<<2048, 256>>>(layer.codes, size_t(s.n) * s.k / 8, 1000 + chain.size());
      const float w_scale = 1.f / std::sqrt(float(s.k));
      fill_bf16_kernel<<<2048, 256>>>(layer.dense, size_t(s.n) * s.k, -w_scale, w_scale, 3);
      fill_bf16_kernel<<<2048, 256>>>(layer.scales, size_t(s.k / kGroupSize) * s.n, 0.05f * w_scale,
                                      0.3f * w_scale, 4);
      BENCH_CHECK(cudaMemset(layer.workspace, 0, (s.n / pyorch::kW4A16BlockN + 1) * 4));
      q_bytes += s.n * s.k / 2.0 + 2.0 * s.n * (s.k / kGroupSize);
      chain.push_back(layer);
    }
  }
  bf16* a = device_alloc<bf16>(size_t(max_m) * max_k);
  fill_bf16_kernel<<<2048, 256>>>(a, size_t(max_m) * max_k, -1.f, 1.f, 5);
  bf16* out = device_alloc<bf16>(size_t(max_m) * max_n);
  int64_t max_partials = 1;
  for (const Shape& s : layer_shapes) {
    for (int64_t m : tokens) {
      if (mma_path(m, s.n, s.k))
        max_partials = std::max(max_partials, pyorch::w4a16_partials_size(m, s.n, s.k));
    }
  }
  float* partials = device_alloc<float>(size_t(max_partials));
  BENCH_CHECK(cudaDeviceSynchronize());
  for (int64_t m : tokens) {
    // The chain times gptq_marlin_gemm: only row counts where every shape takes it.
    if (!std::all_of(layer_shapes.begin(), layer_shapes.end(),
                     [&](const Shape& s) { return mma_path(m, s.n, s.k); })) {
      continue;
    }
    const double ours_ms = graph_ms(
        [&](cudaStream_t st) {
          for (const Layer& l : chain) {
            BENCH_CHECK(pyorch::gptq_marlin_gemm(
                out, a, reinterpret_cast<const int32_t*>(l.codes), l.scales, nullptr, nullptr,
                nullptr, l.workspace, partials, pyorch::W4A16Type::kUint4b8,
                pyorch::DType::kBFloat16, m, l.shape->n, l.shape->k, kGroupSize, l.shape->k,
                l.shape->n, st));
          }
        },
        b.stream, std::max(5, b.iters / 2));
    const double cublas_ms = graph_ms(
        [&](cudaStream_t st) {
          for (const Layer& l : chain) {
            run_cublas(b.handle, l.dense, a, out, m, l.shape->n, l.shape->k, st);
          }
        },
        b.stream, std::max(5, b.iters / 2));
    b.report->add({{"op", "w4a16_decode_chain"},
                   {"model", "8b"},
                   {"kernel", pyorch::w4a16_kernel_name(m)},
                   {"stages", std::to_string(pyorch::w4a16_stream_stages())},
                   {"prefetch_acts", pyorch::w4a16_prefetch_acts() ? "1" : "0"},
                   {"chunk", std::to_string(pyorch::w4a16_stream_chunk())},
                   {"ctas_per_sm", std::to_string(pyorch::w4a16_ctas_per_sm())},
                   {"pdl", pyorch::pdl_enabled() ? "1" : "0"},
                   {"M", std::to_string(m)},
                   {"num_gemms", std::to_string(chain.size())},
                   {"weight_GB", Report::fmt(q_bytes / 1e9, 2)},
                   {"time_ms", Report::fmt(ours_ms, 3)},
                   {"cublas_bf16_ms", Report::fmt(cublas_ms, 3)},
                   {"speedup_vs_cublas", Report::fmt(cublas_ms / ours_ms, 3)},
                   {"weight_GB/s", Report::fmt(q_bytes / (ours_ms * 1e6), 1)}});
  }
  for (const Layer& l : chain) {
    for (void* p : std::vector<void*>{l.codes, l.dense, l.scales, l.workspace}) cudaFree(p);
  }
  for (void* p : std::vector<void*>{a, out, partials}) cudaFree(p);
}

cublasHandle_t create_cublas(void** workspace) {
#ifdef PYORCH_BENCH_CUBLAS
  cublasHandle_t handle;
  CUBLAS_CHECK(cublasCreate(&handle));
  const size_t workspace_bytes = size_t(64) << 20;
  BENCH_CHECK(cudaMalloc(workspace, workspace_bytes));
  CUBLAS_CHECK(cublasSetWorkspace(handle, *workspace, workspace_bytes));
  return handle;
#else
  (void)workspace;
  std::fprintf(stderr, "bench_w4a16 was built without cuBLAS: nothing to compare with\n");
  std::exit(1);
#endif
}

}  // namespace

int main(int argc, char** argv) {
  const Args args(argc, argv);
  Report report(args);
  Bench b;
  void* cublas_workspace = nullptr;
  b.handle = create_cublas(&cublas_workspace);
  BENCH_CHECK(cudaStreamCreateWithFlags(&b.stream, cudaStreamNonBlocking));
  b.launches = static_cast<int>(args.num("launches", 20));
  b.iters = static_cast<int>(args.num("iters", 20));
  const int64_t span_mb = args.num("span-mb", 2000);
  if (span_mb <= 0) {
    std::fprintf(stderr, "--span-mb must be positive, got %lld\n", static_cast<long long>(span_mb));
    return 2;
  }
  b.span_bytes = 1e6 * static_cast<double>(span_mb);
  b.report = &report;
  if (args.has("prefetch"))
    pyorch::set_w4a16_l2_prefetch(static_cast<int>(args.num("prefetch", 0)));
  if (args.has("kernel")) {
    const auto kernel = args.strs("kernel", {"stream"});
    pyorch::set_w4a16_kernel(kernel.at(0) == "registers" ? pyorch::W4A16Kernel::kRegisters
                                                         : pyorch::W4A16Kernel::kStream);
  }
  if (args.has("stages")) pyorch::set_w4a16_stream_stages(static_cast<int>(args.num("stages", 4)));
  if (args.has("pdl")) pyorch::set_pdl_enabled(args.num("pdl", 1) != 0);
  if (args.has("prefetch-acts")) pyorch::set_w4a16_prefetch_acts(args.num("prefetch-acts", 0) != 0);
  if (args.has("chunk")) pyorch::set_w4a16_stream_chunk(static_cast<int>(args.num("chunk", 4)));
  if (args.has("scales-by-copy"))
    pyorch::set_w4a16_stream_scales_by_copy(args.num("scales-by-copy", 1) != 0);
  if (args.has("ctas-per-sm"))
    pyorch::set_w4a16_ctas_per_sm(static_cast<int>(args.num("ctas-per-sm", 4)));
  if (args.has("tiled-min-rows"))
    pyorch::set_w4a16_tiled_min_rows(args.num("tiled-min-rows", pyorch::kW4A16DefaultTiledMinRows));
  if (args.has("mma-max-rows")) pyorch::set_w4a16_mma_max_rows(args.num("mma-max-rows", 0));
  if (args.has("chunk-mb")) pyorch::set_w4a16_dequant_chunk_bytes(args.num("chunk-mb", 64) << 20);
  std::printf(
      "device=%s copy_GB/s=%.1f l2_prefetch_blocks=%d kernel=%s stages=%d prefetch_acts=%d "
      "chunk=%d scales_by_copy=%d ctas_per_sm=%d pdl=%d tiled_min_rows=%lld mma_max_rows=%lld\n",
      pyorch::bench::device_name().c_str(), pyorch::bench::copy_bandwidth_gbs(b.stream),
      pyorch::w4a16_l2_prefetch(), pyorch::w4a16_kernel_name(1), pyorch::w4a16_stream_stages(),
      static_cast<int>(pyorch::w4a16_prefetch_acts()), pyorch::w4a16_stream_chunk(),
      static_cast<int>(pyorch::w4a16_stream_scales_by_copy()), pyorch::w4a16_ctas_per_sm(),
      static_cast<int>(pyorch::pdl_enabled()),
      static_cast<long long>(pyorch::w4a16_tiled_min_rows()),
      static_cast<long long>(pyorch::w4a16_mma_max_rows()));
  const auto models = args.strs("models", {"8b", "70b"});
  const auto tokens = args.list("tokens", {1, 2, 4, 8, 16, 32, 64, 128, 512, 2048});
  const auto shapes = args.strs("shapes", {});
  for (const Shape& s : kShapes) {
    if (std::find(models.begin(), models.end(), s.model) != models.end() &&
        (shapes.empty() || std::find(shapes.begin(), shapes.end(), s.name) != shapes.end())) {
      bench_shape(b, s, tokens);
    }
  }
  if (!args.has("no-chain")) bench_chain(b, args.list("chain-tokens", {1, 8, 16}));
#ifdef PYORCH_BENCH_CUBLAS
  CUBLAS_CHECK(cublasDestroy(b.handle));
#endif
  BENCH_CHECK(cudaFree(cublas_workspace));
  return 0;
}
