// Benchmark of pyorch::skinny_gemm against cuBLAS on decode-sized linear layers (no torch).
// out[M, N] = x[M, K] @ W[N, K]^T in bf16 with fp32 accumulation; cuBLAS gets the same call
// torch's F.linear makes (cublasGemmEx, W transposed, CUBLAS_COMPUTE_32F), on the same data.
//
// Timing: a CUDA graph of back-to-back launches (--launches, or one per copy if more), rotating
// over enough copies of W that no launch finds any of its weight in L2 (>= 2 GB between two reads
// of one copy); the median replay time over --iters replays, divided by the launch count. Bytes are
// the weight plus x and out, each counted once; pct_of_copy is against the in-run device-to-device
// copy (read + write).
//
// Sections (rows tagged by `op`):
//   skinny_gemm     the five Llama-3-8B shapes x --tokens: ours (default config, plain launch)
//                   vs cuBLAS, with ours' error against cuBLAS's output.
//   skinny_gemm_pdl the same shapes at each M with programmatic dependent launch on (a chain of
//                   GEMMs overlaps one's tail with the next's first loads).
//   skinny_sweep    every launch configuration (warps, L2 hint, L2 prefetch depth) at
//                   --sweep-tokens, PDL off, to pick the default.
//   decode_chain    the per-layer GEMMs of a model (--chain-models: llama3_8b, 32 layers + lm_head,
//                   15 GB; llama3_70b_tp4, one rank's 80 layers + lm_head, 35 GB), one graph,
//                   each layer with its own weights: ours (PDL off / on; the launcher's picks
//                   and the earlier ones, picks=legacy) vs cuBLAS.
//   chain_by_shape  the same weights one layer shape at a time (all layers' copies in a row).
//   fused_sweep     --fused-shapes at --fused-tokens (default 1,8): skinny_gemm_fused's forms
//                   (normed store, normed / plain SiLU-and-mul, add), the pick and every config.
//   span_probe      --span-shapes at M = 1, one weight copied to each of --spans-mb (one launch per
//                   copy): time per launch against the span of memory read.
// Flags: --shapes qkv_proj,o_proj,gate_up,down,lm_head (or any of kTpShapes: 70b_tp4_qkv, ...)
//        --tokens 1,2,4,8,16 --sweep-tokens 1,8,16
//        --chain-models llama3_8b,llama3_70b_tp4 --chain-tokens 1,8,16 --launches 24 --iters 30
//        --span-shapes gate_up,down --spans-mb 250,1000,4000,16000 --no-sweep --no-chain --json
//        FILE
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include <cuda_bf16.h>
#ifdef PYORCH_BENCH_CUBLAS
#include <cublas_v2.h>
#endif

#include "common/bench_util.h"
#include "pyorch/gemm.h"

namespace {

using pyorch::SkinnyGemmConfig;
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
// Built where cuBLAS is missing (a CPU-only CI machine): everything compiles, main() refuses to
// run.
using cublasHandle_t = void*;
#endif

struct Shape {
  std::string name;
  int64_t n, k;
};

// Llama-3-8B (hidden 4096, 32 q / 8 kv heads of 128, MLP 14336, vocab 128256), merged as the
// engine runs them.
const std::vector<Shape> kLlamaShapes = {{"qkv_proj", 6144, 4096},
                                         {"o_proj", 4096, 4096},
                                         {"gate_up", 28672, 4096},
                                         {"down", 4096, 14336},
                                         {"lm_head", 128256, 4096}};
constexpr int kLlamaLayers = 32;

// One rank's share of Llama-3-70B (hidden 8192, 64 q / 8 kv heads, MLP 28672) under tensor
// parallelism, and of Llama-3-8B at TP=2: the layers with few output rows (qkv_proj) or a short
// K (o_proj) that the 8B shapes above do not cover.
const std::vector<Shape> kTpShapes = {
    {"70b_tp2_qkv", 5120, 8192},  {"70b_tp2_o", 8192, 4096},   {"70b_tp2_down", 8192, 14336},
    {"70b_tp4_qkv", 2560, 8192},  {"70b_tp4_o", 8192, 2048},   {"70b_tp4_gate_up", 14336, 8192},
    {"70b_tp4_down", 8192, 7168}, {"70b_tp8_qkv", 1280, 8192}, {"70b_tp8_o", 8192, 1024},
    {"70b_tp8_down", 8192, 3584}, {"8b_tp2_qkv", 3072, 4096},  {"8b_tp2_o", 4096, 2048},
    {"8b_tp2_down", 4096, 7168}};

// The per-layer GEMMs of a model's decode step for bench_chain: its layers and lm_head.
struct ChainModel {
  std::string name;
  std::vector<Shape> layer;  // per layer, in order
  Shape lm_head;
  int layers;
};

const std::vector<ChainModel> kChainModels = {
    {"llama3_8b",
     {kLlamaShapes.begin(), kLlamaShapes.end() - 1},  // qkv_proj .. down
     kLlamaShapes.back(),                             // lm_head
     kLlamaLayers},
    // One rank of TP=4 (the vocabulary split four ways, as the engine's lm_head is).
    {"llama3_70b_tp4",
     {{"qkv_proj", 2560, 8192},
      {"o_proj", 8192, 2048},
      {"gate_up", 14336, 8192},
      {"down", 8192, 7168}},
     {"lm_head", 32064, 8192},
     80}};

// Uniform values in [-scale, scale) from a per-element integer hash (a host fill of 15 GB would
// take minutes).
__global__ void fill_bf16_kernel(bf16* data, size_t n, float scale, uint64_t seed) {
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += stride) {
    uint64_t z = (i + seed * 0x632be59bd9b4e019ull) * 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 31)) * 0xbf58476d1ce4e5b9ull;
    z ^= z >> 29;
    const float u = static_cast<float>(z >> 40) * (1.f / 16777216.f);  // [0, 1)
    data[i] = __float2bfloat16((2.f * u - 1.f) * scale);
  }
}

bf16* device_bf16(size_t n, float scale, uint64_t seed) {
  bf16* ptr;
  BENCH_CHECK(cudaMalloc(&ptr, std::max<size_t>(n, 1) * sizeof(bf16)));
  fill_bf16_kernel<<<2048, 256>>>(ptr, n, scale, seed);
  BENCH_CHECK(cudaGetLastError());
  return ptr;
}

// One GEMM call: out = x @ w^T.
struct Gemm {
  const bf16* w;  // [n, k]
  const bf16* x;  // [m, k]
  bf16* out;      // [m, n]
  int64_t m, n, k;
};

void run_ours(const Gemm& g, const SkinnyGemmConfig* config, cudaStream_t s) {
  BENCH_CHECK(pyorch::skinny_gemm(g.out, g.x, g.w, nullptr, pyorch::DType::kBFloat16, g.m, g.n, g.k,
                                  g.n, g.k, s, config));
}

void run_cublas(cublasHandle_t handle, const Gemm& g, cudaStream_t s) {
#ifdef PYORCH_BENCH_CUBLAS
  // Column-major view: out^T [n, m] = (w as [k, n])^T @ (x^T as [k, m]).
  const float alpha = 1.f, beta = 0.f;
  CUBLAS_CHECK(cublasSetStream(handle, s));
  CUBLAS_CHECK(cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(g.n),
                            static_cast<int>(g.m), static_cast<int>(g.k), &alpha, g.w, CUDA_R_16BF,
                            static_cast<int>(g.k), g.x, CUDA_R_16BF, static_cast<int>(g.k), &beta,
                            g.out, CUDA_R_16BF, static_cast<int>(g.n), CUBLAS_COMPUTE_32F,
                            CUBLAS_GEMM_DEFAULT));
#endif
}

// Median milliseconds of one replay of a graph holding `body`'s launches.
double graph_ms(const std::function<void(cudaStream_t)>& body, cudaStream_t stream, int iters) {
  body(stream);  // warm-up outside the capture (cuBLAS picks its kernel, modules load)
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

// max |a - b| / max |b| over two device bf16 arrays.
double rel_err(const bf16* a, const bf16* b, size_t n) {
  std::vector<bf16> ha(n), hb(n);
  BENCH_CHECK(cudaMemcpy(ha.data(), a, n * sizeof(bf16), cudaMemcpyDeviceToHost));
  BENCH_CHECK(cudaMemcpy(hb.data(), b, n * sizeof(bf16), cudaMemcpyDeviceToHost));
  double diff = 0, ref = 0;
  for (size_t i = 0; i < n; ++i) {
    const double x = __bfloat162float(ha[i]), y = __bfloat162float(hb[i]);
    diff = std::isnan(x) ? INFINITY : std::max(diff, std::fabs(x - y));
    ref = std::max(ref, std::fabs(y));
  }
  return diff / std::max(ref, 1e-30);
}

// Bytes of weight copies the timed launches rotate over. 200 MB kept every weight out of L2 but
// flattered the largest layers: two alternating copies of a 235 MB gate_up left part of each in
// L2 for its next read (our kernel 80.6 us, 87 at 1.4 GB of span or more, where a model's 15 GB
// of weights are; cuBLAS flat at ~82: skinny_gemm_tp_20261127/span_probe_*). 2 GB is past that.
constexpr double kRotateSpanBytes = 2e9;

// The weight copies, x and out buffers of one shape at the largest M.
struct ShapeBuffers {
  std::vector<bf16*> weights;  // each [n, k]
  bf16* x;                     // [max_m, k]
  bf16* out;                   // [max_m, n]
  bf16* ref;                   // [max_m, n], cuBLAS's result
  ShapeBuffers(const Shape& s, int64_t max_m) {
    const double bytes = 2.0 * s.n * s.k;
    const int copies = std::max(2, static_cast<int>(std::ceil(kRotateSpanBytes / bytes)) + 1);
    for (int c = 0; c < copies; ++c) {
      weights.push_back(device_bf16(size_t(s.n) * s.k, 1.f / std::sqrt(float(s.k)), 100 + c));
    }
    x = device_bf16(size_t(max_m) * s.k, 1.f, 7);
    out = device_bf16(size_t(max_m) * s.n, 0.f, 8);
    ref = device_bf16(size_t(max_m) * s.n, 0.f, 9);
    // The fills ran on the legacy stream, which the benchmark's non-blocking stream does not wait
    // for: without this, cuBLAS's reference could read a weight or x still being written.
    BENCH_CHECK(cudaDeviceSynchronize());
  }
  ~ShapeBuffers() {
    for (bf16* w : weights) cudaFree(w);
    cudaFree(x);
    cudaFree(out);
    cudaFree(ref);
  }
};

struct Bench {
  cublasHandle_t handle;
  cudaStream_t stream;
  double copy_gbs;
  int launches, iters;
  Report* report;
};

// Microseconds per launch of `launch(gemm)` over the rotating weight copies.
double time_per_launch(const Bench& b, const ShapeBuffers& buf, const Shape& s, int64_t m,
                       const std::function<void(const Gemm&, cudaStream_t)>& launch) {
  // At least one launch per copy, so that every replay reads the whole span.
  const int launches = std::max(b.launches, static_cast<int>(buf.weights.size()));
  auto body = [&](cudaStream_t st) {
    for (int i = 0; i < launches; ++i) {
      launch(Gemm{buf.weights[i % buf.weights.size()], buf.x, buf.out, m, s.n, s.k}, st);
    }
  };
  return 1e3 * graph_ms(body, b.stream, b.iters) / launches;
}

double gemm_bytes(const Shape& s, int64_t m) { return 2.0 * (s.n * s.k + m * s.k + m * s.n); }

std::string config_name(const SkinnyGemmConfig& c) {
  return "w" + std::to_string(c.num_warps) + "_l2" + std::to_string(c.l2_prefetch) + "_pf" +
         std::to_string(c.prefetch_slices) + "_pdl" + std::to_string(c.pdl);
}

// Ours with `config` at one (shape, M): time, and the error against cuBLAS's output in buf.ref.
std::pair<double, double> measure_ours(const Bench& b, const ShapeBuffers& buf, const Shape& s,
                                       int64_t m, const SkinnyGemmConfig& config) {
  BENCH_CHECK(cudaMemset(buf.out, 0xff, size_t(m) * s.n * sizeof(bf16)));  // NaN poison
  run_ours(Gemm{buf.weights[0], buf.x, buf.out, m, s.n, s.k}, &config, b.stream);
  BENCH_CHECK(cudaStreamSynchronize(b.stream));
  const double err = rel_err(buf.out, buf.ref, size_t(m) * s.n);
  const double us = time_per_launch(
      b, buf, s, m, [&](const Gemm& g, cudaStream_t st) { run_ours(g, &config, st); });
  return {us, err};
}

// The fused forms the engine runs (skinny_gemm_fused) on one shape over the same 2 GB rotation:
// normed store (qkv_proj), normed and plain SiLU-and-mul ([gate; up] paired rows), the residual
// add (o_proj / down); the launcher's pick against every (warps, L2 hint) at PDL off.
void bench_fused(const Bench& b, const Shape& s, const std::vector<int64_t>& tokens) {
  int64_t max_m = 1;
  for (int64_t m : tokens) max_m = std::max(max_m, m);
  ShapeBuffers buf(s, max_m);
  bf16* norm = device_bf16(size_t(s.k), 1.f, 13);
  BENCH_CHECK(cudaDeviceSynchronize());
  struct Form {
    const char* name;
    pyorch::SkinnyGemmEpilogue epilogue;
    bool norm;
  };
  using E = pyorch::SkinnyGemmEpilogue;
  const Form forms[] = {{"norm_store", E::kStore, true},
                        {"norm_silu_mul", E::kSiluMul, true},
                        {"silu_mul", E::kSiluMul, false},
                        {"add", E::kAdd, false}};
  for (int64_t m : tokens) {
    for (const Form& f : forms) {
      const int64_t cols = f.epilogue == E::kSiluMul ? s.n / 2 : s.n;
      auto time_config = [&](const SkinnyGemmConfig* config) {
        return time_per_launch(b, buf, s, m, [&](const Gemm& g, cudaStream_t st) {
          BENCH_CHECK(pyorch::skinny_gemm_fused(g.out, g.x, g.w, nullptr, f.norm ? norm : nullptr,
                                                1e-5f, f.epilogue, pyorch::DType::kBFloat16, g.m,
                                                g.n, g.k, cols, g.k, st, config));
        });
      };
      SkinnyGemmConfig picked = pyorch::default_skinny_gemm_config(m, s.n, s.k, f.norm);
      picked.pdl = 0;
      const double picked_us = time_config(&picked);
      for (int warps : {4, 8, 16}) {
        for (int l2 : {0, 1}) {
          const SkinnyGemmConfig config{warps, l2, 1, 0};
          const double us = time_config(&config);
          b.report->add({{"op", "fused_sweep"},
                         {"shape", s.name},
                         {"form", f.name},
                         {"M", std::to_string(m)},
                         {"config", config_name(config)},
                         {"time_us", Report::fmt(us)},
                         {"picked", config_name(picked)},
                         {"picked_us", Report::fmt(picked_us)},
                         {"pct_of_copy",
                          Report::fmt(100.0 * gemm_bytes(s, m) / (us * 1e3) / b.copy_gbs, 1)}});
        }
      }
    }
  }
  cudaFree(norm);
}

void bench_shape(const Bench& b, const Shape& s, const std::vector<int64_t>& tokens,
                 const std::vector<int64_t>& sweep_tokens) {
  int64_t max_m = 1;
  for (int64_t m : tokens) max_m = std::max(max_m, m);
  for (int64_t m : sweep_tokens) max_m = std::max(max_m, m);
  ShapeBuffers buf(s, max_m);
  auto cublas_ref = [&](int64_t m) {
    run_cublas(b.handle, Gemm{buf.weights[0], buf.x, buf.ref, m, s.n, s.k}, b.stream);
    BENCH_CHECK(cudaStreamSynchronize(b.stream));
  };
  auto pct = [&](double us, int64_t m) {
    return 100.0 * gemm_bytes(s, m) / (us * 1e3) / b.copy_gbs;
  };

  for (int64_t m : tokens) {
    cublas_ref(m);
    const double cublas_us = time_per_launch(
        b, buf, s, m, [&](const Gemm& g, cudaStream_t st) { run_cublas(b.handle, g, st); });
    for (int pdl = 0; pdl <= 1; ++pdl) {
      SkinnyGemmConfig config = pyorch::default_skinny_gemm_config(m, s.n, s.k);
      config.pdl = pdl;
      const auto [us, err] = measure_ours(b, buf, s, m, config);
      const double gbs = gemm_bytes(s, m) / (us * 1e3);
      b.report->add({{"op", pdl ? "skinny_gemm_pdl" : "skinny_gemm"},
                     {"shape", s.name},
                     {"M", std::to_string(m)},
                     {"N", std::to_string(s.n)},
                     {"K", std::to_string(s.k)},
                     {"config", config_name(config)},
                     {"time_us", Report::fmt(us)},
                     {"GB/s", Report::fmt(gbs, 1)},
                     {"pct_of_copy", Report::fmt(pct(us, m), 1)},
                     {"cublas_us", Report::fmt(cublas_us)},
                     {"cublas_pct_of_copy", Report::fmt(pct(cublas_us, m), 1)},
                     {"speedup", Report::fmt(cublas_us / us, 3)},
                     {"rel_err", Report::fmt(err, 5)}});
    }
  }
  for (int64_t m : sweep_tokens) {
    cublas_ref(m);
    for (int warps : {4, 8, 16}) {
      for (int l2 : {0, 1}) {
        for (int prefetch : {1, 4}) {
          const SkinnyGemmConfig config{warps, l2, prefetch, 0};
          const auto [us, err] = measure_ours(b, buf, s, m, config);
          b.report->add({{"op", "skinny_sweep"},
                         {"shape", s.name},
                         {"M", std::to_string(m)},
                         {"config", config_name(config)},
                         {"time_us", Report::fmt(us)},
                         {"pct_of_copy", Report::fmt(pct(us, m), 1)},
                         {"rel_err", Report::fmt(err, 5)}});
        }
      }
    }
  }
}

// The decode step's GEMMs: the model's layers of (qkv_proj, o_proj, gate_up, down) with their own
// weights, then lm_head, captured as one graph.
void bench_chain(const Bench& b, const ChainModel& model, const std::vector<int64_t>& tokens) {
  int64_t max_m = 1;
  for (int64_t m : tokens) max_m = std::max(max_m, m);
  int64_t max_k = model.lm_head.k, max_n = model.lm_head.n;
  for (const Shape& s : model.layer) {
    max_k = std::max(max_k, s.k);
    max_n = std::max(max_n, s.n);
  }
  std::vector<Gemm> chain;
  std::vector<bf16*> allocations;
  bf16* x_hidden = device_bf16(size_t(max_m) * max_k, 1.f, 11);
  bf16* out = device_bf16(size_t(max_m) * max_n, 0.f, 12);
  double bytes = 0;
  for (int layer = 0; layer <= model.layers; ++layer) {
    std::vector<Shape> shapes = model.layer;
    if (layer == model.layers) shapes = {model.lm_head};
    for (size_t i = 0; i < shapes.size(); ++i) {
      const Shape& s = shapes[i];
      bf16* w = device_bf16(size_t(s.n) * s.k, 1.f / std::sqrt(float(s.k)), 1000 + layer * 8 + i);
      allocations.push_back(w);
      chain.push_back(Gemm{w, x_hidden, out, 1, s.n, s.k});
      bytes += 2.0 * s.n * s.k;
    }
  }
  BENCH_CHECK(cudaDeviceSynchronize());
  for (int64_t m : tokens) {
    auto time_chain = [&](const std::function<void(const Gemm&, cudaStream_t)>& launch) {
      auto body = [&](cudaStream_t st) {
        for (Gemm g : chain) {
          g.m = m;
          launch(g, st);
        }
      };
      return graph_ms(body, b.stream, std::max(5, b.iters / 3));
    };
    const double cublas_ms =
        time_chain([&](const Gemm& g, cudaStream_t st) { run_cublas(b.handle, g, st); });
    // PDL off, on, and on again (the last two rows show the run-to-run spread), with the
    // launcher's picks and with those from before the 2 GB-span sweep (legacy_skinny_gemm_config).
    for (const bool legacy : {false, true}) {
      for (int pdl : {0, 1, 1}) {
        const double ms = time_chain([&](const Gemm& g, cudaStream_t st) {
          SkinnyGemmConfig config = legacy ? pyorch::legacy_skinny_gemm_config(g.m, g.n, g.k)
                                           : pyorch::default_skinny_gemm_config(g.m, g.n, g.k);
          config.pdl = pdl;
          run_ours(g, &config, st);
        });
        const double floor_ms = bytes / (b.copy_gbs * 1e6);
        b.report->add({{"op", "decode_chain"},
                       {"model", model.name},
                       {"picks", legacy ? "legacy" : "default"},
                       {"M", std::to_string(m)},
                       {"num_gemms", std::to_string(chain.size())},
                       {"weight_GB", Report::fmt(bytes / 1e9, 2)},
                       {"pdl", std::to_string(pdl)},
                       {"time_ms", Report::fmt(ms, 3)},
                       {"cublas_ms", Report::fmt(cublas_ms, 3)},
                       {"copy_floor_ms", Report::fmt(floor_ms, 3)},
                       {"pct_of_copy", Report::fmt(100.0 * floor_ms / ms, 1)},
                       {"cublas_pct_of_copy", Report::fmt(100.0 * floor_ms / cublas_ms, 1)},
                       {"speedup", Report::fmt(cublas_ms / ms, 3)}});
      }
    }
  }
  // The same weights one shape at a time (every layer's copy of it in a row, as one graph): the
  // per-launch time against the mixed chain's shows what the alternation of shapes costs, and
  // against skinny_gemm's rows (a few hundred MB of rotating copies) what reading fresh memory
  // from a span of many GB costs.
  for (int64_t m : tokens) {
    for (const Shape& shape : model.layer) {
      std::vector<Gemm> same;
      for (const Gemm& g : chain) {
        if (g.n == shape.n && g.k == shape.k) same.push_back(Gemm{g.w, g.x, g.out, m, g.n, g.k});
      }
      auto time_same = [&](const std::function<void(const Gemm&, cudaStream_t)>& launch) {
        auto body = [&](cudaStream_t st) {
          for (const Gemm& g : same) launch(g, st);
        };
        return 1e3 * graph_ms(body, b.stream, std::max(5, b.iters / 3)) / same.size();
      };
      const double cublas_us =
          time_same([&](const Gemm& g, cudaStream_t st) { run_cublas(b.handle, g, st); });
      for (int pdl : {0, 1}) {
        const double us = time_same([&](const Gemm& g, cudaStream_t st) {
          SkinnyGemmConfig config = pyorch::default_skinny_gemm_config(g.m, g.n, g.k);
          config.pdl = pdl;
          run_ours(g, &config, st);
        });
        const double floor_us = gemm_bytes(shape, m) / (b.copy_gbs * 1e3);
        b.report->add({{"op", "chain_by_shape"},
                       {"model", model.name},
                       {"shape", shape.name},
                       {"M", std::to_string(m)},
                       {"launches", std::to_string(same.size())},
                       {"pdl", std::to_string(pdl)},
                       {"time_us", Report::fmt(us)},
                       {"cublas_us", Report::fmt(cublas_us)},
                       {"pct_of_copy", Report::fmt(100.0 * floor_us / us, 1)},
                       {"cublas_pct_of_copy", Report::fmt(100.0 * floor_us / cublas_us, 1)},
                       {"speedup", Report::fmt(cublas_us / us, 3)}});
      }
    }
  }
  for (bf16* w : allocations) cudaFree(w);
  cudaFree(x_hidden);
  cudaFree(out);
}

// One shape's weight copied to span `span_mb` MB, each copy read once in turn (a graph of one
// launch per copy): how the time per launch changes with the span of memory read, ours (PDL off
// and on) against cuBLAS.
void bench_span(const Bench& b, const Shape& s, const std::vector<int64_t>& spans_mb) {
  const double bytes = 2.0 * s.n * s.k;
  bf16* x = device_bf16(size_t(16) * s.k, 1.f, 7);
  bf16* out = device_bf16(size_t(16) * s.n, 0.f, 8);
  for (int64_t span_mb : spans_mb) {
    const int copies = std::max(2, static_cast<int>(std::ceil(span_mb * 1e6 / bytes)));
    std::vector<bf16*> w;
    for (int c = 0; c < copies; ++c) {
      w.push_back(device_bf16(size_t(s.n) * s.k, 1.f / std::sqrt(float(s.k)), 500 + c));
    }
    BENCH_CHECK(cudaDeviceSynchronize());
    auto time_all = [&](const std::function<void(int, cudaStream_t)>& launch) {
      auto body = [&](cudaStream_t st) {
        for (int c = 0; c < copies; ++c) launch(c, st);
      };
      return 1e3 * graph_ms(body, b.stream, std::max(5, b.iters / 3)) / copies;
    };
    const double cublas_us = time_all(
        [&](int c, cudaStream_t st) { run_cublas(b.handle, Gemm{w[c], x, out, 1, s.n, s.k}, st); });
    for (int variant = 0; variant < 3; ++variant) {
      // 0: the default config; 1: with PDL; 2: the other L2 hint setting
      const int pdl = variant == 1 ? 1 : 0;
      const double us = time_all([&](int c, cudaStream_t st) {
        SkinnyGemmConfig config = pyorch::default_skinny_gemm_config(1, s.n, s.k);
        config.pdl = pdl;
        if (variant == 2) config.l2_prefetch = config.l2_prefetch > 0 ? 0 : 1;
        run_ours(Gemm{w[c], x, out, 1, s.n, s.k}, &config, st);
      });
      b.report->add({{"op", "span_probe"},
                     {"shape", s.name},
                     {"span_MB", std::to_string(static_cast<int64_t>(copies * bytes / 1e6))},
                     {"copies", std::to_string(copies)},
                     {"variant", std::to_string(variant)},
                     {"time_us", Report::fmt(us)},
                     {"cublas_us", Report::fmt(cublas_us)},
                     {"pct_of_copy", Report::fmt(100.0 * bytes / (us * 1e3) / b.copy_gbs, 1)},
                     {"speedup", Report::fmt(cublas_us / us, 3)}});
    }
    for (bf16* p : w) cudaFree(p);
  }
  cudaFree(x);
  cudaFree(out);
}

// A cuBLAS handle with a workspace of our own: cuBLAS must not allocate while a graph is being
// captured.
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
  std::fprintf(stderr, "bench_gemm was built without cuBLAS: nothing to compare with\n");
  std::exit(1);
#endif
}

void destroy_cublas(cublasHandle_t handle, void* workspace) {
#ifdef PYORCH_BENCH_CUBLAS
  CUBLAS_CHECK(cublasDestroy(handle));
  BENCH_CHECK(cudaFree(workspace));
#endif
}

}  // namespace

int main(int argc, char** argv) {
  const Args args(argc, argv);
  Report report(args);
  Bench b;
  void* workspace = nullptr;
  b.handle = create_cublas(&workspace);
  BENCH_CHECK(cudaStreamCreateWithFlags(&b.stream, cudaStreamNonBlocking));
  b.copy_gbs = pyorch::bench::copy_bandwidth_gbs(b.stream);
  b.launches = static_cast<int>(args.num("launches", 24));
  b.iters = static_cast<int>(args.num("iters", 30));
  b.report = &report;
  std::printf("device=%s copy_GB/s=%.1f\n", pyorch::bench::device_name().c_str(), b.copy_gbs);

  const auto names = args.strs("shapes", {"qkv_proj", "o_proj", "gate_up", "down", "lm_head"});
  const auto tokens = args.list("tokens", {1, 2, 4, 8, 16});
  const auto sweep =
      args.has("no-sweep") ? std::vector<int64_t>{} : args.list("sweep-tokens", {1, 8, 16});
  std::vector<Shape> all_shapes = kLlamaShapes;
  all_shapes.insert(all_shapes.end(), kTpShapes.begin(), kTpShapes.end());
  // Every name of a shape list flag, looked up in all_shapes; false (after a message) if unknown.
  auto shapes_of = [&](const std::vector<std::string>& list, std::vector<Shape>* found) {
    for (const std::string& name : list) {
      const auto it = std::find_if(all_shapes.begin(), all_shapes.end(),
                                   [&](const Shape& s) { return s.name == name; });
      if (it == all_shapes.end()) {
        std::fprintf(stderr, "bench_gemm: unknown shape %s\n", name.c_str());
        return false;
      }
      found->push_back(*it);
    }
    return true;
  };
  std::vector<Shape> plain, fused, spans;
  if (!shapes_of(names, &plain) || !shapes_of(args.strs("fused-shapes", {}), &fused) ||
      !shapes_of(args.strs("span-shapes", {}), &spans)) {
    return 2;
  }
  for (const Shape& s : plain) bench_shape(b, s, tokens, sweep);
  for (const Shape& s : fused) bench_fused(b, s, args.list("fused-tokens", {1, 8}));
  for (const Shape& s : spans) bench_span(b, s, args.list("spans-mb", {250, 1000, 4000, 16000}));
  if (!args.has("no-chain")) {
    for (const std::string& name : args.strs("chain-models", {"llama3_8b"})) {
      const auto it = std::find_if(kChainModels.begin(), kChainModels.end(),
                                   [&](const ChainModel& c) { return c.name == name; });
      if (it == kChainModels.end()) {
        std::fprintf(stderr, "bench_gemm: unknown chain model %s\n", name.c_str());
        return 2;
      }
      bench_chain(b, *it, args.list("chain-tokens", {1, 8, 16}));
    }
  }
  destroy_cublas(b.handle, workspace);
  return 0;
}
