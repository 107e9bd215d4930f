// Benchmark of pyorch's custom all-reduce against NCCL on the GPUs of one host, in one process
// (no torch, no Python). The kernel reads the peers' buffers through peer access (the same
// addresses CUDA IPC maps in the multi-process engine), so it runs exactly as in the engine.
// One row per message size and algorithm: time_us (median over --iters samples; each sample
// times --inner back-to-back all-reduces on every GPU and takes the slowest GPU, so the host's
// launch skew between GPUs is amortized), algbw_GBs = bytes / time and busbw_GBs = algbw *
// 2 (n - 1) / n (nccl-tests' bus bandwidth), and for the kernel its speedup over NCCL at that size.
// Every configuration first checks the result on every GPU against the exact sum.
// --graph 1 (the default) captures the --inner calls of each GPU into a CUDA graph and times its
// replays, as the engine's decode runs them: one host thread driving every GPU cannot launch
// kernels as fast as they finish (about 10 us per call for two GPUs), so eager timings of small
// messages measure the launches, for NCCL and the kernel alike. --graph 0 times eager launches.
// NCCL's graphs are captured by one host thread per GPU (no group call); --nccl-graph 0 times
// NCCL eagerly even in graph mode.
// --op all_reduce_rms_norm: the fused all-reduce + residual add + RMSNorm against the custom
// all-reduce then fused_add_rms_norm, and NCCL then fused_add_rms_norm, on [rows, --hidden]
// messages (rows 1, 2, 4, ... up to --max-rows); every fused result is compared bit for bit with
// the unfused one (wrong = elements that differ).
// Flags: --ranks 2 --dtype bf16|fp16|fp32 --min-bytes 4096 --max-bytes 268435456 (x2 steps)
//        --algos one_shot_push,one_shot,two_shot,auto,nccl --iters 20 --inner 20 --warmup 5
//        --graph 1 --nccl-graph 1 --op all_reduce|all_reduce_rms_norm --hidden 4096
//        --max-rows 64 --norm-split 0|1|auto (the fused norm's rows split over several blocks;
//        auto, the default, splits at most 4 rows; each row says auto:0 or auto:1) --json FILE
// NCCL comes from the CUDA toolkit or the nvidia-nccl wheel (CMakeLists.txt); a build without it
// runs the kernel alone and says so in each row (nccl_us=nan).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common/bench_util.h"
#include "pyorch/custom_all_reduce.h"
#include "pyorch/norm.h"

#ifdef PYORCH_BENCH_NCCL
#include <nccl.h>
#define NCCL_CHECK(expr)                                                                          \
  do {                                                                                            \
    ncclResult_t r_ = (expr);                                                                     \
    if (r_ != ncclSuccess) {                                                                      \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #expr, ncclGetErrorString(r_)); \
      std::exit(1);                                                                               \
    }                                                                                             \
  } while (0)
#endif

namespace {

using pyorch::AllReduceAlgo;
using pyorch::DType;
using pyorch::bench::Args;
using pyorch::bench::Report;

size_t dtype_bytes(DType dtype) { return dtype == DType::kFloat32 ? 4 : 2; }

// input[i] = (i % 7) + rank: small integers, so every dtype holds each sum exactly.
__global__ void fill_kernel(void* data, int64_t n, DType dtype, int rank) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const float v = static_cast<float>(i % 7 + rank);
    switch (dtype) {
      case DType::kFloat32: static_cast<float*>(data)[i] = v; break;
      case DType::kFloat16: static_cast<__half*>(data)[i] = __float2half(v); break;
      default: static_cast<__nv_bfloat16*>(data)[i] = __float2bfloat16(v); break;
    }
  }
}

// Counts the elements of out that differ from the exact sum over num_ranks ranks.
__global__ void check_kernel(const void* out, int64_t n, DType dtype, int num_ranks,
                             unsigned long long* num_bad) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    float got;
    switch (dtype) {
      case DType::kFloat32: got = static_cast<const float*>(out)[i]; break;
      case DType::kFloat16: got = __half2float(static_cast<const __half*>(out)[i]); break;
      default: got = __bfloat162float(static_cast<const __nv_bfloat16*>(out)[i]); break;
    }
    const float want = static_cast<float>(num_ranks * (i % 7) + num_ranks * (num_ranks - 1) / 2);
    if (got != want) atomicAdd(num_bad, 1ull);
  }
}

// Counts the elements of a and b ([n] of dtype) whose bits differ.
__global__ void diff_kernel(const void* a, const void* b, int64_t n, DType dtype,
                            unsigned long long* num_bad) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const bool differ =
        dtype == DType::kFloat32
            ? static_cast<const uint32_t*>(a)[i] != static_cast<const uint32_t*>(b)[i]
            : static_cast<const uint16_t*>(a)[i] != static_cast<const uint16_t*>(b)[i];
    if (differ) atomicAdd(num_bad, 1ull);
  }
}

struct Rank {
  int device;
  cudaStream_t stream;
  void* input;
  void* out;
  void* buffer;  // the custom all-reduce buffer (signals + two message buffers)
  unsigned long long* num_bad;
};

// Median over iters samples of the slowest rank's time per call of `inner` calls of fn(rank).
double time_all_us(std::vector<Rank>& ranks, const std::function<void(Rank&)>& fn, int warmup,
                   int iters, int inner) {
  for (int i = 0; i < warmup; ++i)
    for (auto& r : ranks) {
      BENCH_CHECK(cudaSetDevice(r.device));
      fn(r);
    }
  for (auto& r : ranks) {
    BENCH_CHECK(cudaSetDevice(r.device));
    BENCH_CHECK(cudaStreamSynchronize(r.stream));
  }
  const size_t n = ranks.size();
  std::vector<cudaEvent_t> start(n), stop(n);
  for (size_t k = 0; k < n; ++k) {
    BENCH_CHECK(cudaSetDevice(ranks[k].device));
    BENCH_CHECK(cudaEventCreate(&start[k]));
    BENCH_CHECK(cudaEventCreate(&stop[k]));
  }
  std::vector<double> samples;
  for (int it = 0; it < iters; ++it) {
    for (size_t k = 0; k < n; ++k) {
      BENCH_CHECK(cudaSetDevice(ranks[k].device));
      BENCH_CHECK(cudaEventRecord(start[k], ranks[k].stream));
    }
    for (int j = 0; j < inner; ++j)
      for (auto& r : ranks) {
        BENCH_CHECK(cudaSetDevice(r.device));
        fn(r);
      }
    double slowest = 0;
    for (size_t k = 0; k < n; ++k) {
      BENCH_CHECK(cudaSetDevice(ranks[k].device));
      BENCH_CHECK(cudaEventRecord(stop[k], ranks[k].stream));
    }
    for (size_t k = 0; k < n; ++k) {
      BENCH_CHECK(cudaEventSynchronize(stop[k]));
      float ms = 0;
      BENCH_CHECK(cudaEventElapsedTime(&ms, start[k], stop[k]));
      slowest = std::max(slowest, 1000.0 * ms / inner);
    }
    samples.push_back(slowest);
  }
  for (size_t k = 0; k < n; ++k) {
    BENCH_CHECK(cudaEventDestroy(start[k]));
    BENCH_CHECK(cudaEventDestroy(stop[k]));
  }
  std::sort(samples.begin(), samples.end());
  return samples[samples.size() / 2];
}

// As time_all_us, but the `inner` calls of each rank are captured into one CUDA graph per rank
// (all ranks' streams captured together, so collectives that need every rank inside a group
// call can be captured too), and a sample times one replay of every rank's graph.
// per_rank (optional): what rank r's graph records, captured by one host thread per rank
// (NCCL: one device per thread needs no group call, and each rank's capture may wait for the
// others); without it the ranks' `fn` calls are captured from this thread.
double time_graph_us(std::vector<Rank>& ranks, const std::function<void(Rank&)>& fn, int warmup,
                     int iters, int inner, const std::function<void(Rank&)>& per_rank = nullptr) {
  for (int i = 0; i < warmup; ++i)
    for (auto& r : ranks) {
      BENCH_CHECK(cudaSetDevice(r.device));
      fn(r);
    }
  for (auto& r : ranks) {
    BENCH_CHECK(cudaSetDevice(r.device));
    BENCH_CHECK(cudaStreamSynchronize(r.stream));
  }
  const size_t n = ranks.size();
  std::vector<cudaGraphExec_t> execs(n);
  if (per_rank) {
    std::vector<std::thread> threads;
    for (size_t k = 0; k < n; ++k) {
      threads.emplace_back([&, k] {
        Rank& r = ranks[k];
        BENCH_CHECK(cudaSetDevice(r.device));
        BENCH_CHECK(cudaStreamBeginCapture(r.stream, cudaStreamCaptureModeThreadLocal));
        for (int j = 0; j < inner; ++j) per_rank(r);
        cudaGraph_t graph;
        BENCH_CHECK(cudaStreamEndCapture(r.stream, &graph));
        BENCH_CHECK(cudaGraphInstantiate(&execs[k], graph, 0));
        BENCH_CHECK(cudaGraphDestroy(graph));
      });
    }
    for (auto& t : threads) t.join();
  } else {
    for (auto& r : ranks) {
      BENCH_CHECK(cudaSetDevice(r.device));
      BENCH_CHECK(cudaStreamBeginCapture(r.stream, cudaStreamCaptureModeRelaxed));
    }
    for (int j = 0; j < inner; ++j)
      for (auto& r : ranks) {
        BENCH_CHECK(cudaSetDevice(r.device));
        fn(r);
      }
    for (size_t k = 0; k < n; ++k) {
      BENCH_CHECK(cudaSetDevice(ranks[k].device));
      cudaGraph_t graph;
      BENCH_CHECK(cudaStreamEndCapture(ranks[k].stream, &graph));
      BENCH_CHECK(cudaGraphInstantiate(&execs[k], graph, 0));
      BENCH_CHECK(cudaGraphDestroy(graph));
    }
  }
  auto replay = [&](Rank& r) {
    const size_t k = &r - ranks.data();
    BENCH_CHECK(cudaGraphLaunch(execs[k], r.stream));
  };
  // One replay is `inner` calls: time_all_us's per-call division by 1, then by inner here.
  const double us = time_all_us(ranks, replay, 2, iters, 1) / inner;
  for (size_t k = 0; k < n; ++k) {
    BENCH_CHECK(cudaSetDevice(ranks[k].device));
    BENCH_CHECK(cudaStreamSynchronize(ranks[k].stream));
    BENCH_CHECK(cudaGraphExecDestroy(execs[k]));
  }
  return us;
}

// Runs one all-reduce of numel elements on every rank, then counts wrong outputs.
uint64_t check_all(std::vector<Rank>& ranks, const std::function<void(Rank&)>& fn, int64_t numel,
                   DType dtype) {
  for (auto& r : ranks) {
    BENCH_CHECK(cudaSetDevice(r.device));
    BENCH_CHECK(cudaMemsetAsync(r.out, 0, numel * dtype_bytes(dtype), r.stream));
    BENCH_CHECK(cudaMemsetAsync(r.num_bad, 0, sizeof(unsigned long long), r.stream));
    BENCH_CHECK(cudaStreamSynchronize(r.stream));
  }
  for (auto& r : ranks) {
    BENCH_CHECK(cudaSetDevice(r.device));
    fn(r);
  }
  uint64_t bad = 0;
  for (auto& r : ranks) {
    BENCH_CHECK(cudaSetDevice(r.device));
    check_kernel<<<1024, 256, 0, r.stream>>>(r.out, numel, dtype, static_cast<int>(ranks.size()),
                                             r.num_bad);
    unsigned long long host = 0;
    BENCH_CHECK(cudaMemcpyAsync(&host, r.num_bad, sizeof(host), cudaMemcpyDeviceToHost, r.stream));
    BENCH_CHECK(cudaStreamSynchronize(r.stream));
    bad += host;
  }
  return bad;
}

// The split mode as a report cell: 0, 1, or auto:0 / auto:1 (what auto took for `rows`).
std::string norm_split_label(int64_t rows) {
  switch (pyorch::custom_all_reduce_rms_norm_split()) {
    case pyorch::AllReduceNormSplit::kOff: return "0";
    case pyorch::AllReduceNormSplit::kOn: return "1";
    default: return rows <= pyorch::kAllReduceNormAutoSplitRows ? "auto:1" : "auto:0";
  }
}

}  // namespace

int main(int argc, char** argv) {
  // Load every kernel when each GPU's context is made. Under lazy loading (CUDA's default) the
  // first launch of a kernel on GPU 1 loads its module, which may wait for GPU 0, whose kernel of
  // the same call spins until GPU 1's runs: one host thread driving every GPU then hangs (the
  // first fused-norm run stopped at its first call). The engine has a process per GPU.
  setenv("CUDA_MODULE_LOADING", "EAGER", 0);
  const Args args(argc, argv);
  Report report(args);
  const int num_ranks = static_cast<int>(args.num("ranks", 2));
  const std::string dtype_name = args.str("dtype", "bf16");
  const DType dtype = dtype_name == "fp32"   ? DType::kFloat32
                      : dtype_name == "fp16" ? DType::kFloat16
                                             : DType::kBFloat16;
  const int64_t min_bytes = args.num("min-bytes", 4096);
  const int64_t max_bytes = args.num("max-bytes", int64_t(256) << 20);
  const int iters = static_cast<int>(args.num("iters", 20));
  const int inner = static_cast<int>(args.num("inner", 20));
  const int warmup = static_cast<int>(args.num("warmup", 5));
  const std::vector<std::string> algos =
      args.strs("algos", {"one_shot_push", "one_shot", "two_shot", "auto", "nccl"});
  const bool graph = args.num("graph", 1) != 0;
  const bool nccl_graph = graph && args.num("nccl-graph", 1) != 0;
  const std::string op = args.str("op", "all_reduce");
  const char* mode = graph ? "graph" : "eager";
  int device_count = 0;
  BENCH_CHECK(cudaGetDeviceCount(&device_count));
  if (!args.has("ranks") && device_count < 2) {
    // Run without flags by bench/gpu_check.sh on every machine: one GPU has nothing to reduce.
    std::printf("bench_custom_all_reduce: skipped, this host has %d GPU(s) (needs 2)\n",
                device_count);
    return 0;
  }
  if (device_count < num_ranks || num_ranks < 2) {
    std::fprintf(stderr, "--ranks %d needs that many GPUs (this host has %d)\n", num_ranks,
                 device_count);
    return 1;
  }

  std::vector<Rank> ranks(num_ranks);
  std::vector<void*> buffers(num_ranks);
  for (int k = 0; k < num_ranks; ++k) {
    Rank& r = ranks[k];
    r.device = k;
    BENCH_CHECK(cudaSetDevice(k));
    for (int p = 0; p < num_ranks; ++p) {
      if (p == k) continue;
      int ok = 0;
      BENCH_CHECK(cudaDeviceCanAccessPeer(&ok, k, p));
      if (!ok) {
        std::fprintf(stderr, "GPU %d cannot access GPU %d: no custom all-reduce here\n", k, p);
        return 1;
      }
      BENCH_CHECK(cudaDeviceEnablePeerAccess(p, 0));
    }
    BENCH_CHECK(cudaStreamCreateWithFlags(&r.stream, cudaStreamNonBlocking));
    const int64_t max_numel = max_bytes / static_cast<int64_t>(dtype_bytes(dtype));
    BENCH_CHECK(cudaMalloc(&r.input, max_bytes));
    BENCH_CHECK(cudaMalloc(&r.out, max_bytes));
    BENCH_CHECK(cudaMalloc(&r.buffer, pyorch::custom_all_reduce_buffer_bytes(max_bytes)));
    BENCH_CHECK(cudaMalloc(&r.num_bad, sizeof(unsigned long long)));
    BENCH_CHECK(pyorch::custom_all_reduce_init_buffer(r.buffer, r.stream));
    fill_kernel<<<1024, 256, 0, r.stream>>>(r.input, max_numel, dtype, k);
    BENCH_CHECK(cudaGetLastError());
    BENCH_CHECK(cudaStreamSynchronize(r.stream));
    buffers[k] = r.buffer;
  }
#ifdef PYORCH_BENCH_NCCL
  std::vector<ncclComm_t> comms(num_ranks);
  std::vector<int> devs(num_ranks);
  for (int k = 0; k < num_ranks; ++k) devs[k] = k;
  NCCL_CHECK(ncclCommInitAll(comms.data(), num_ranks, devs.data()));
  const ncclDataType_t nccl_type = dtype == DType::kFloat32   ? ncclFloat32
                                   : dtype == DType::kFloat16 ? ncclFloat16
                                                              : ncclBfloat16;
#endif
  cudaDeviceProp prop;
  BENCH_CHECK(cudaGetDeviceProperties(&prop, 0));

  if (op == "all_reduce_rms_norm") {
    const int64_t hidden = args.num("hidden", 4096);
    const int64_t max_rows = args.num("max-rows", 64);
    if (args.has("norm-split")) {
      const std::string split = args.str("norm-split", "auto");
      using S = pyorch::AllReduceNormSplit;
      if (split != "0" && split != "1" && split != "auto") {
        std::fprintf(stderr, "--norm-split must be 0, 1 or auto, got %s\n", split.c_str());
        return 2;
      }
      pyorch::set_custom_all_reduce_rms_norm_split(split == "0"   ? S::kOff
                                                   : split == "1" ? S::kOn
                                                                  : S::kAuto);
    }
    const float eps = 1e-6f;
    const size_t esize = dtype_bytes(dtype);
    struct NormBufs {
      void* residual_a;  // fused
      void* residual_b;  // unfused
      void* weight;
      void* out;  // fused output
      void* tmp;  // unfused: the all-reduce's output, normed in place
    };
    std::vector<NormBufs> nb(num_ranks);
    const int64_t cap = max_rows * hidden * static_cast<int64_t>(esize);
    for (int k = 0; k < num_ranks; ++k) {
      BENCH_CHECK(cudaSetDevice(k));
      for (void** p :
           {&nb[k].residual_a, &nb[k].residual_b, &nb[k].weight, &nb[k].out, &nb[k].tmp}) {
        BENCH_CHECK(cudaMalloc(p, cap));
      }
      // Residual and weight are the same on every rank (replicated), the input is not.
      fill_kernel<<<1024, 256, 0, ranks[k].stream>>>(nb[k].weight, hidden, dtype, 1);
      BENCH_CHECK(cudaStreamSynchronize(ranks[k].stream));
    }
    for (int64_t rows = 1; rows <= max_rows; rows *= 2) {
      const int64_t numel = rows * hidden;
      const int64_t bytes = numel * static_cast<int64_t>(esize);
      if (bytes > pyorch::custom_all_reduce_push_max_bytes(max_bytes)) break;
      auto fused = [&](Rank& r) {
        NormBufs& b = nb[r.device];
        BENCH_CHECK(pyorch::custom_all_reduce_rms_norm(b.out, r.input, b.residual_a, b.weight, eps,
                                                       buffers.data(), r.device, num_ranks,
                                                       max_bytes, dtype, rows, hidden, r.stream));
      };
      auto unfused = [&](Rank& r) {
        NormBufs& b = nb[r.device];
        BENCH_CHECK(pyorch::custom_all_reduce(b.tmp, r.input, buffers.data(), r.device, num_ranks,
                                              max_bytes, dtype, numel, AllReduceAlgo::kAuto,
                                              r.stream));
        BENCH_CHECK(pyorch::fused_add_rms_norm(b.tmp, b.residual_b, b.weight, dtype, rows, hidden,
                                               hidden, hidden, eps, r.stream));
      };
      // Progress on stderr: a run that stops here says at which step (the lease that first ran
      // this mode got no output at all).
      std::fprintf(stderr, "all_reduce_rms_norm rows=%lld: check\n", static_cast<long long>(rows));
      // Correctness: one call of each from the same residual, compared bit for bit.
      for (int k = 0; k < num_ranks; ++k) {
        BENCH_CHECK(cudaSetDevice(k));
        fill_kernel<<<256, 256, 0, ranks[k].stream>>>(nb[k].residual_a, numel, dtype, 0);
        fill_kernel<<<256, 256, 0, ranks[k].stream>>>(nb[k].residual_b, numel, dtype, 0);
        BENCH_CHECK(cudaStreamSynchronize(ranks[k].stream));
      }
      for (auto& r : ranks) {
        BENCH_CHECK(cudaSetDevice(r.device));
        fused(r);
      }
      for (auto& r : ranks) {
        BENCH_CHECK(cudaSetDevice(r.device));
        unfused(r);
      }
      uint64_t bad = 0;
      for (int k = 0; k < num_ranks; ++k) {
        BENCH_CHECK(cudaSetDevice(k));
        BENCH_CHECK(
            cudaMemsetAsync(ranks[k].num_bad, 0, sizeof(unsigned long long), ranks[k].stream));
        diff_kernel<<<256, 256, 0, ranks[k].stream>>>(nb[k].out, nb[k].tmp, numel, dtype,
                                                      ranks[k].num_bad);
        diff_kernel<<<256, 256, 0, ranks[k].stream>>>(nb[k].residual_a, nb[k].residual_b, numel,
                                                      dtype, ranks[k].num_bad);
        unsigned long long host = 0;
        BENCH_CHECK(cudaMemcpyAsync(&host, ranks[k].num_bad, sizeof(host), cudaMemcpyDeviceToHost,
                                    ranks[k].stream));
        BENCH_CHECK(cudaStreamSynchronize(ranks[k].stream));
        bad += host;
      }
      auto time = [&](const std::function<void(Rank&)>& fn) {
        return graph ? time_graph_us(ranks, fn, warmup, iters, inner)
                     : time_all_us(ranks, fn, warmup, iters, inner);
      };
      std::fprintf(stderr, "all_reduce_rms_norm rows=%lld: %llu wrong; timing fused\n",
                   static_cast<long long>(rows), static_cast<unsigned long long>(bad));
      const double fused_us = time(fused);
      std::fprintf(stderr, "all_reduce_rms_norm rows=%lld: timing unfused\n",
                   static_cast<long long>(rows));
      const double unfused_us = time(unfused);
      std::fprintf(stderr, "all_reduce_rms_norm rows=%lld: timing NCCL\n",
                   static_cast<long long>(rows));
      double nccl_us = NAN;
#ifdef PYORCH_BENCH_NCCL
      auto nccl_norm = [&](Rank& r) {
        NormBufs& b = nb[r.device];
        if (r.device == 0) NCCL_CHECK(ncclGroupStart());
        NCCL_CHECK(
            ncclAllReduce(r.input, b.tmp, numel, nccl_type, ncclSum, comms[r.device], r.stream));
        if (r.device == num_ranks - 1) NCCL_CHECK(ncclGroupEnd());
      };
      auto nccl_then_norm = [&](Rank& r) {
        nccl_norm(r);
        if (r.device == num_ranks - 1) {
          for (auto& q : ranks) {
            BENCH_CHECK(cudaSetDevice(q.device));
            NormBufs& b = nb[q.device];
            BENCH_CHECK(pyorch::fused_add_rms_norm(b.tmp, b.residual_b, b.weight, dtype, rows,
                                                   hidden, hidden, hidden, eps, q.stream));
          }
        }
      };
      auto nccl_then_norm_one = [&](Rank& r) {
        NormBufs& b = nb[r.device];
        NCCL_CHECK(
            ncclAllReduce(r.input, b.tmp, numel, nccl_type, ncclSum, comms[r.device], r.stream));
        BENCH_CHECK(pyorch::fused_add_rms_norm(b.tmp, b.residual_b, b.weight, dtype, rows, hidden,
                                               hidden, hidden, eps, r.stream));
      };
      nccl_us = nccl_graph
                    ? time_graph_us(ranks, nccl_then_norm, warmup, iters, inner, nccl_then_norm_one)
                    : time_all_us(ranks, nccl_then_norm, warmup, iters, inner);
#endif
      report.add({{"op", "all_reduce_rms_norm"},
                  {"mode", mode},
                  {"dtype", dtype_name},
                  {"ranks", std::to_string(num_ranks)},
                  {"rows", std::to_string(rows)},
                  {"hidden", std::to_string(hidden)},
                  {"norm_split", norm_split_label(rows)},
                  {"bytes", std::to_string(bytes)},
                  {"fused_us", Report::fmt(fused_us)},
                  {"custom_then_norm_us", Report::fmt(unfused_us)},
                  {"nccl_then_norm_us", std::isnan(nccl_us) ? "nan" : Report::fmt(nccl_us)},
                  {"speedup_vs_custom_then_norm", Report::fmt(unfused_us / fused_us)},
                  {"wrong", std::to_string(bad)},
                  {"device", prop.name}});
    }
#ifdef PYORCH_BENCH_NCCL
    for (auto& c : comms) ncclCommDestroy(c);
#endif
    return 0;
  }

  for (int64_t bytes = min_bytes; bytes <= max_bytes; bytes *= 2) {
    const int64_t numel = bytes / static_cast<int64_t>(dtype_bytes(dtype));
    double nccl_us = NAN;
#ifdef PYORCH_BENCH_NCCL
    {
      // One group call per round: NCCL needs every rank's call inside ncclGroupStart/End when
      // one thread drives all GPUs.
      auto nccl_all = [&](Rank& r) {
        if (r.device == 0) NCCL_CHECK(ncclGroupStart());
        NCCL_CHECK(
            ncclAllReduce(r.input, r.out, numel, nccl_type, ncclSum, comms[r.device], r.stream));
        if (r.device == num_ranks - 1) NCCL_CHECK(ncclGroupEnd());
      };
      const uint64_t bad = check_all(ranks, nccl_all, numel, dtype);
      auto nccl_one = [&](Rank& r) {
        NCCL_CHECK(
            ncclAllReduce(r.input, r.out, numel, nccl_type, ncclSum, comms[r.device], r.stream));
      };
      nccl_us = nccl_graph ? time_graph_us(ranks, nccl_all, warmup, iters, inner, nccl_one)
                           : time_all_us(ranks, nccl_all, warmup, iters, inner);
      if (std::find(algos.begin(), algos.end(), "nccl") != algos.end()) {
        const double algbw = bytes / (nccl_us * 1e3);
        report.add({{"op", "all_reduce"},
                    {"impl", "nccl"},
                    {"algo", "nccl"},
                    {"mode", nccl_graph ? "graph" : "eager"},
                    {"dtype", dtype_name},
                    {"ranks", std::to_string(num_ranks)},
                    {"bytes", std::to_string(bytes)},
                    {"time_us", Report::fmt(nccl_us)},
                    {"algbw_GBs", Report::fmt(algbw)},
                    {"busbw_GBs", Report::fmt(algbw * 2.0 * (num_ranks - 1) / num_ranks)},
                    {"wrong", std::to_string(bad)},
                    {"device", prop.name}});
      }
    }
#endif
    for (const std::string& name : algos) {
      if (name == "nccl") continue;
      const AllReduceAlgo algo = name == "one_shot"        ? AllReduceAlgo::kOneShot
                                 : name == "two_shot"      ? AllReduceAlgo::kTwoShot
                                 : name == "one_shot_push" ? AllReduceAlgo::kOneShotPush
                                                           : AllReduceAlgo::kAuto;
      if (algo == AllReduceAlgo::kOneShotPush &&
          bytes > pyorch::custom_all_reduce_push_max_bytes(max_bytes)) {
        continue;  // past the push slots
      }
      auto custom = [&](Rank& r) {
        BENCH_CHECK(pyorch::custom_all_reduce(r.out, r.input, buffers.data(), r.device, num_ranks,
                                              max_bytes, dtype, numel, algo, r.stream));
      };
      const uint64_t bad = check_all(ranks, custom, numel, dtype);
      const double us = graph ? time_graph_us(ranks, custom, warmup, iters, inner)
                              : time_all_us(ranks, custom, warmup, iters, inner);
      const double algbw = bytes / (us * 1e3);
      const AllReduceAlgo picked =
          algo == AllReduceAlgo::kAuto ? pyorch::custom_all_reduce_pick(bytes, num_ranks) : algo;
      report.add({{"op", "all_reduce"},
                  {"impl", "custom"},
                  {"algo", name},
                  {"picked", picked == AllReduceAlgo::kOneShot       ? "one_shot"
                             : picked == AllReduceAlgo::kOneShotPush ? "one_shot_push"
                                                                     : "two_shot"},
                  {"mode", mode},
                  {"dtype", dtype_name},
                  {"ranks", std::to_string(num_ranks)},
                  {"bytes", std::to_string(bytes)},
                  {"time_us", Report::fmt(us)},
                  {"algbw_GBs", Report::fmt(algbw)},
                  {"busbw_GBs", Report::fmt(algbw * 2.0 * (num_ranks - 1) / num_ranks)},
                  {"nccl_us", std::isnan(nccl_us) ? "nan" : Report::fmt(nccl_us)},
                  {"speedup_vs_nccl", std::isnan(nccl_us) ? "nan" : Report::fmt(nccl_us / us)},
                  {"wrong", std::to_string(bad)},
                  {"device", prop.name}});
    }
  }
#ifdef PYORCH_BENCH_NCCL
  for (auto& c : comms) ncclCommDestroy(c);
#endif
  return 0;
}
