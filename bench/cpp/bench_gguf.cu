// Benchmark of the GGUF products (pyorch::gguf_mul_mat_vec, pyorch::gguf_mul_mat) on Llama-3-8B
// projection shapes, for the ten quantized GGML types (no torch, no Python).
//   out[M, N] = x[M, K] @ dequantize(W[N, K])^T, x and out fp16.
//
// Weights: random blocks written here (every quant bit and packed scale byte random, the fp16
// super-scales d / dmin drawn uniform in +-0.01), never zeros; x uniform in [-1, 1).
// Timing: a CUDA graph of one call per weight copy, the copies spanning --span-mb (default 2000,
// as a decode step reads each weight once across a model-sized span: at a few hundred MB part of
// a large weight can still be in L2 when its copy comes round again); median replay time /
// copies. A call is the whole op: the q8_1 quantization of x (a kernel of its own, or inside the
// one-token product) and the product. Bytes: the weight blocks + x + out, each once;
// pct_of_copy: achieved bytes/s against a device-to-device copy in the same run (read + write
// bytes / time), i.e. how close the call is to the weight-read bandwidth floor.
// Correctness (first copy): a simple reference, W dequantized to fp32 by gguf_dequantize, x by its
// own q8_1 blocks, and a plain fp32 tiled GEMM; PASS when max |out - ref| <= 4e-3 * max |ref|
// (fp16 output rounding plus fp32 summation order).
// Rows: op=gguf_mul_mat_vec for M <= 16 (passes of 8 tokens past 8), op=gguf_mul_mat for M >= 4,
// op=gguf_mmvq_sweep: the vector kernel at --sweep-tokens under each launch configuration
// (tile size, ring stages, L2 hint, PDL, rows per block, fused q8_1; GgufMulMatVecConfig), to
// pick its defaults;
// op=gguf_dequantize: the whole weight to fp16 (time only: tests/cuda/gguf checks it bit for bit).
// Flags: --types Q4_0,...,Q6_K --shapes qkv_proj,o_proj,gate_up,down --tokens 1,4,16,64,512
//        --sweep-tokens 1 --no-sweep --no-dequantize --iters 20 --span-mb 2000 --json FILE
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include <cuda_fp16.h>

#include "common/bench_util.h"
#include "pyorch/gguf.h"

namespace {

using pyorch::DType;
using pyorch::bench::Args;
using pyorch::bench::Report;

struct Shape {
  std::string name;
  int64_t n, k;
};

const std::vector<Shape> kLlamaShapes = {{"qkv_proj", 6144, 4096},
                                         {"o_proj", 4096, 4096},
                                         {"gate_up", 28672, 4096},
                                         {"down", 4096, 14336}};

struct TypeSpec {
  std::string name;
  int32_t id;
  std::vector<int> half_offsets;  // byte offsets of the block's fp16 scale fields
};

const std::vector<TypeSpec> kTypes = {
    {"Q4_0", 2, {0}},     {"Q4_1", 3, {0, 2}},    {"Q5_0", 6, {0}},    {"Q5_1", 7, {0, 2}},
    {"Q8_0", 8, {0}},     {"Q2_K", 10, {80, 82}}, {"Q3_K", 11, {108}}, {"Q4_K", 12, {0, 2}},
    {"Q5_K", 13, {0, 2}}, {"Q6_K", 14, {208}}};

__device__ __forceinline__ uint64_t mix(uint64_t z) {
  z = (z ^ (z >> 31)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 29)) * 0x94d049bb133111ebull;
  return z ^ (z >> 32);
}

// Random blocks: random bytes (fill_bytes_kernel), then each fp16 scale field set to uniform
// +-0.01 (fill_scales_kernel; a second kernel, so no byte write can land after a field's).
__global__ void fill_bytes_kernel(uint8_t* data, size_t n, uint64_t seed) {
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += stride) {
    data[i] = static_cast<uint8_t>(mix(i * 0x9e3779b97f4a7c15ull + seed) >> 24);
  }
}

__global__ void fill_scales_kernel(uint8_t* data, size_t num_blocks, int block_bytes, int off0,
                                   int off1, uint64_t seed) {
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  for (size_t b = blockIdx.x * size_t(blockDim.x) + threadIdx.x; b < num_blocks; b += stride) {
    for (int off : {off0, off1}) {
      if (off < 0) continue;
      const float u = float(mix(b * 0x632be59bd9b4e019ull + seed + off) >> 40) / 16777216.f;
      const __half h = __float2half_rn((2.f * u - 1.f) * 0.01f);
      *reinterpret_cast<__half*>(data + b * block_bytes + off) = h;  // fields are 2-byte aligned
    }
  }
}

__global__ void fill_half_kernel(__half* data, size_t n, uint64_t seed) {
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += stride) {
    const float u = float(mix(i + seed) >> 40) / 16777216.f;
    data[i] = __float2half_rn(2.f * u - 1.f);
  }
}

// x's q8_1 blocks back to fp32: xf[t, k] = d(t, k / 32) * q[t, k].
//   xq: [m, k] int8, xds: [m, k / 32] float4 (d, ...)
__global__ void dequantize_q8_1_kernel(float* xf, const int8_t* xq, const float4* xds, int64_t m,
                                       int64_t k) {
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (i >= m * k) return;
  xf[i] = xds[i / 32].x * float(xq[i]);
}

// ref[M, N] = xf[M, K] @ wf[N, K]^T in fp32, 16 x 16 tiles.
__global__ void reference_gemm_kernel(float* ref, const float* xf, const float* wf, int64_t m,
                                      int64_t n, int64_t k) {
  __shared__ float xs[16][17], ws[16][17];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t row = blockIdx.x * 16 + tx;  // output column (weight row)
  const int64_t tok = blockIdx.y * 16 + ty;
  float acc = 0.f;
  for (int64_t k0 = 0; k0 < k; k0 += 16) {
    const int64_t wrow = blockIdx.x * 16 + ty, xtok = blockIdx.y * 16 + ty;
    ws[ty][tx] = wrow < n ? wf[wrow * k + k0 + tx] : 0.f;
    xs[ty][tx] = xtok < m ? xf[xtok * k + k0 + tx] : 0.f;
    __syncthreads();
#pragma unroll
    for (int i = 0; i < 16; ++i) acc += xs[ty][i] * ws[tx][i];
    __syncthreads();
  }
  if (row < n && tok < m) ref[tok * n + row] = acc;
}

double graph_ms(const std::function<void(cudaStream_t)>& body, cudaStream_t stream, int iters) {
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

// One call of either product: out = x @ W^T.
using Product =
    std::function<cudaError_t(void*, const void*, const void*, void*, int32_t, DType, int64_t,
                              int64_t, int64_t, int64_t, int64_t, int64_t, cudaStream_t)>;

Product mul_mat_vec_with(pyorch::GgufMulMatVecConfig config) {
  return [config](void* out, const void* x, const void* w, void* ws, int32_t type, DType dtype,
                  int64_t m, int64_t n, int64_t k, int64_t row_bytes, int64_t x_stride,
                  int64_t out_stride, cudaStream_t s) {
    return pyorch::gguf_mul_mat_vec(out, x, w, ws, type, dtype, m, n, k, row_bytes, x_stride,
                                    out_stride, s, &config);
  };
}

struct Case {
  const TypeSpec* type;
  const Shape* shape;
  std::vector<uint8_t*> weights;  // copies, each [n, k] blocks
  int64_t row_bytes;
  float* wf;  // [n, k] fp32, the first copy dequantized
};

// Checks one product against the reference and times it; adds one report row. Returns the check.
// Times gguf_dequantize of the whole weight to fp16 (checked bit-exact against gguf's own
// dequantization by tests/cuda/gguf, not here); adds one report row.
void run_dequantize(Report& report, const Case& c, double copy_gbs, int iters,
                    cudaStream_t stream) {
  const int64_t n = c.shape->n, k = c.shape->k;
  __half* out;
  BENCH_CHECK(cudaMalloc(&out, n * k * sizeof(__half)));
  const int copies = static_cast<int>(c.weights.size());
  const double ms = graph_ms(
      [&](cudaStream_t s) {
        for (int i = 0; i < copies; ++i) {
          BENCH_CHECK(pyorch::gguf_dequantize(out, c.weights[i], c.type->id, DType::kFloat16, n, k,
                                              c.row_bytes, k, s));
        }
      },
      stream, iters);
  const double us = 1e3 * ms / copies;
  const double bytes = double(n) * c.row_bytes + 2.0 * n * k;
  const double gbs = bytes / (us * 1e3);
  report.add({{"op", "gguf_dequantize"},
              {"type", c.type->name},
              {"shape", c.shape->name},
              {"n", std::to_string(n)},
              {"k", std::to_string(k)},
              {"time_us", Report::fmt(us, 2)},
              {"GB/s", Report::fmt(gbs, 1)},
              {"pct_of_copy", Report::fmt(100.0 * gbs / copy_gbs, 1)}});
  BENCH_CHECK(cudaFree(out));
}

bool run_product(Report& report, const Case& c, const std::string& op, const Product& product,
                 int64_t m, double copy_gbs, int iters, cudaStream_t stream,
                 const std::string& config_name = "default") {
  const int64_t n = c.shape->n, k = c.shape->k;
  __half *x, *out;
  float *xf, *ref;
  void* workspace;
  BENCH_CHECK(cudaMalloc(&x, m * k * sizeof(__half)));
  BENCH_CHECK(cudaMalloc(&out, m * n * sizeof(__half)));
  BENCH_CHECK(cudaMalloc(&xf, m * k * sizeof(float)));
  BENCH_CHECK(cudaMalloc(&ref, m * n * sizeof(float)));
  BENCH_CHECK(cudaMalloc(&workspace, pyorch::gguf_workspace_bytes(m, k)));
  fill_half_kernel<<<1024, 256, 0, stream>>>(x, m * k, 1234 + m);
  auto call = [&](int copy, cudaStream_t s) {
    BENCH_CHECK(product(out, x, c.weights[copy], workspace, c.type->id, DType::kFloat16, m, n, k,
                        c.row_bytes, k, n, s));
  };
  // Correctness on the first copy. The reference's x is its q8_1 blocks, quantized here into a
  // workspace of its own (one-token products quantize x themselves and leave theirs unwritten).
  call(0, stream);
  void* ref_ws;
  BENCH_CHECK(cudaMalloc(&ref_ws, pyorch::gguf_workspace_bytes(m, k)));
  BENCH_CHECK(pyorch::gguf_quantize_q8_1(ref_ws, x, DType::kFloat16, m, k, k, stream));
  const auto* xq = static_cast<const int8_t*>(ref_ws);
  const auto* xds = reinterpret_cast<const float4*>(static_cast<const char*>(ref_ws) +
                                                    pyorch::gguf_workspace_xds_offset(m, k));
  dequantize_q8_1_kernel<<<(m * k + 255) / 256, 256, 0, stream>>>(xf, xq, xds, m, k);
  reference_gemm_kernel<<<dim3((n + 15) / 16, (m + 15) / 16), dim3(16, 16), 0, stream>>>(
      ref, xf, c.wf, m, n, k);
  BENCH_CHECK(cudaStreamSynchronize(stream));
  BENCH_CHECK(cudaGetLastError());
  std::vector<__half> h_out(m * n);
  std::vector<float> h_ref(m * n);
  BENCH_CHECK(cudaMemcpy(h_out.data(), out, m * n * sizeof(__half), cudaMemcpyDeviceToHost));
  BENCH_CHECK(cudaMemcpy(h_ref.data(), ref, m * n * sizeof(float), cudaMemcpyDeviceToHost));
  double max_err = 0, max_ref = 0;
  bool finite = true;
  for (int64_t i = 0; i < m * n; ++i) {
    const double o = __half2float(h_out[i]);
    finite = finite && std::isfinite(o);
    max_err = std::max(max_err, std::fabs(o - h_ref[i]));
    max_ref = std::max(max_ref, std::fabs(double(h_ref[i])));
  }
  const bool pass = finite && max_ref > 0 && max_err <= 4e-3 * max_ref;

  const int copies = static_cast<int>(c.weights.size());
  const double ms = graph_ms(
      [&](cudaStream_t s) {
        for (int i = 0; i < copies; ++i) call(i, s);
      },
      stream, iters);
  const double us = 1e3 * ms / copies;
  const double bytes = double(n) * c.row_bytes + 2.0 * m * k + 2.0 * m * n;
  const double gbs = bytes / (us * 1e3);
  report.add({{"op", op},
              {"type", c.type->name},
              {"shape", c.shape->name},
              {"m", std::to_string(m)},
              {"n", std::to_string(n)},
              {"k", std::to_string(k)},
              {"time_us", Report::fmt(us, 2)},
              {"GB/s", Report::fmt(gbs, 1)},
              {"pct_of_copy", Report::fmt(100.0 * gbs / copy_gbs, 1)},
              {"max_err", Report::fmt(max_err, 6)},
              {"max_ref", Report::fmt(max_ref, 4)},
              {"check", pass ? "PASS" : "FAIL"},
              {"config", config_name}});
  BENCH_CHECK(cudaFree(x));
  BENCH_CHECK(cudaFree(out));
  BENCH_CHECK(cudaFree(xf));
  BENCH_CHECK(cudaFree(ref));
  BENCH_CHECK(cudaFree(workspace));
  BENCH_CHECK(cudaFree(ref_ws));
  return pass;
}

}  // namespace

int main(int argc, char** argv) {
  Args args(argc, argv);
  Report report(args);
  const auto type_names = args.strs("types", {});
  const auto shape_names = args.strs("shapes", {});
  const auto tokens = args.list("tokens", {1, 4, 16, 64, 512});
  const int iters = static_cast<int>(args.num("iters", 20));
  const int64_t span_mb = args.num("span-mb", 2000);
  if (span_mb <= 0) {
    std::fprintf(stderr, "--span-mb must be positive, got %lld\n", static_cast<long long>(span_mb));
    return 2;
  }
  const size_t span_bytes = size_t(span_mb) * 1000000;
  const auto sweep_tokens =
      args.has("no-sweep") ? std::vector<int64_t>{} : args.list("sweep-tokens", {1});
  cudaStream_t stream;
  BENCH_CHECK(cudaStreamCreate(&stream));
  const double copy_gbs = pyorch::bench::copy_bandwidth_gbs(stream);
  std::printf("device=%s copy_GB/s=%.1f\n", pyorch::bench::device_name().c_str(), copy_gbs);
  report.add({{"op", "copy"}, {"GB/s", Report::fmt(copy_gbs, 1)}});
  int failures = 0;
  for (const TypeSpec& type : kTypes) {
    if (!type_names.empty() &&
        std::find(type_names.begin(), type_names.end(), type.name) == type_names.end()) {
      continue;
    }
    for (const Shape& shape : kLlamaShapes) {
      if (!shape_names.empty() &&
          std::find(shape_names.begin(), shape_names.end(), shape.name) == shape_names.end()) {
        continue;
      }
      Case c{&type, &shape, {}, 0, nullptr};
      const int64_t block_size = pyorch::gguf_block_size(type.id);
      const int64_t block_bytes = pyorch::gguf_block_bytes(type.id);
      c.row_bytes = shape.k / block_size * block_bytes;
      const size_t bytes = size_t(shape.n) * c.row_bytes;
      const int copies = static_cast<int>(std::max<size_t>(2, span_bytes / bytes + 1));
      for (int i = 0; i < copies; ++i) {
        uint8_t* w;
        BENCH_CHECK(cudaMalloc(&w, bytes));
        fill_bytes_kernel<<<2048, 256, 0, stream>>>(w, bytes, 77 + i * 1000003ull);
        fill_scales_kernel<<<2048, 256, 0, stream>>>(
            w, bytes / block_bytes, static_cast<int>(block_bytes), type.half_offsets[0],
            type.half_offsets.size() > 1 ? type.half_offsets[1] : -1, 77 + i * 1000003ull);
        BENCH_CHECK(cudaGetLastError());
        c.weights.push_back(w);
      }
      BENCH_CHECK(cudaMalloc(&c.wf, size_t(shape.n) * shape.k * sizeof(float)));
      BENCH_CHECK(pyorch::gguf_dequantize(c.wf, c.weights[0], type.id, DType::kFloat32, shape.n,
                                          shape.k, c.row_bytes, shape.k, stream));
      if (!args.has("no-dequantize")) run_dequantize(report, c, copy_gbs, iters, stream);
      for (int64_t m : tokens) {
        if (m <= 16) {
          failures += !run_product(report, c, "gguf_mul_mat_vec", mul_mat_vec_with({}), m, copy_gbs,
                                   iters, stream);
        }
        if (m >= 4) {
          failures += !run_product(report, c, "gguf_mul_mat", pyorch::gguf_mul_mat, m, copy_gbs,
                                   iters, stream);
        }
      }
      // The vector kernel's launch choices, to pick its defaults (rows op=gguf_mmvq_sweep):
      // {sub-blocks per lane, stages, L2::256B hint, PDL, rows per block, x quantized by the
      // product itself (one token only)}, all in the ring form (direct 0). The last two put more
      // bytes in flight per warp (4 tiles of 2 sub-blocks, 3 of 4). Measured on an H200 they did
      // not beat the default (bench/results/NVIDIA_H200/gguf_sweep_20261128/); they stay in the
      // sweep for new GPUs.
      const int sweep[][6] = {
          {2, 2, 1, 1, 4, 0}, {2, 3, 0, 1, 4, 0}, {2, 3, 1, 1, 4, 0}, {2, 4, 1, 1, 4, 0},
          {2, 3, 1, 0, 4, 0}, {4, 2, 1, 1, 4, 0}, {2, 2, 1, 1, 4, 1}, {2, 3, 1, 1, 4, 1},
          {2, 2, 0, 1, 8, 1}, {2, 2, 1, 1, 8, 1}, {2, 3, 1, 1, 8, 1}, {2, 2, 1, 0, 8, 1},
          {4, 2, 1, 1, 4, 1}, {4, 2, 1, 1, 8, 1}, {2, 4, 1, 1, 8, 1}, {4, 3, 1, 1, 8, 1}};
      // Q4_K's direct form at one token: {L2::256B hint, PDL, rows (warps) per thread block,
      // thread blocks per SM (0: all that fit)}.
      const int direct_sweep[][4] = {{0, 1, 32, 0}, {1, 1, 32, 0}, {0, 0, 32, 0}, {0, 1, 16, 0},
                                     {0, 1, 8, 0},  {0, 1, 16, 1}, {0, 1, 8, 3}};
      for (int64_t m : sweep_tokens) {
        for (const auto& v : sweep) {
          if (v[5] == 1 && m != 1) continue;
          pyorch::GgufMulMatVecConfig config;
          config.subs_per_lane = v[0];
          config.num_stages = v[1];
          config.l2_prefetch = v[2];
          config.pdl = v[3];
          config.warps = v[4];
          config.fuse_x = v[5];
          config.direct = 0;
          const std::string name = "subs" + std::to_string(v[0]) + "_stages" +
                                   std::to_string(v[1]) + "_l2" + std::to_string(v[2]) + "_pdl" +
                                   std::to_string(v[3]) + "_warps" + std::to_string(v[4]) +
                                   "_fuse" + std::to_string(v[5]);
          failures += !run_product(report, c, "gguf_mmvq_sweep", mul_mat_vec_with(config), m,
                                   copy_gbs, iters, stream, name);
        }
        if (m != 1 || type.id != int32_t(pyorch::GgmlType::kQ4_K)) continue;
        for (const auto& v : direct_sweep) {
          pyorch::GgufMulMatVecConfig config;
          config.direct = 1;
          config.l2_prefetch = v[0];
          config.pdl = v[1];
          config.warps = v[2];
          if (v[3] > 0) config.blocks_per_sm = v[3];
          const std::string name = "direct_l2" + std::to_string(v[0]) + "_pdl" +
                                   std::to_string(v[1]) + "_warps" + std::to_string(v[2]) + "_bps" +
                                   std::to_string(v[3]);
          failures += !run_product(report, c, "gguf_mmvq_sweep", mul_mat_vec_with(config), m,
                                   copy_gbs, iters, stream, name);
        }
      }
      for (uint8_t* w : c.weights) BENCH_CHECK(cudaFree(w));
      BENCH_CHECK(cudaFree(c.wf));
    }
  }
  BENCH_CHECK(cudaStreamDestroy(stream));
  if (failures > 0) std::printf("FAILED: %d products differ from the reference\n", failures);
  return failures > 0 ? 1 : 0;
}
