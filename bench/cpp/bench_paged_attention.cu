// Benchmark of pyorch::paged_attention through the C API (no torch). One row per configuration.
//   decode : --batch 64,256,1,16,1 --context 4096,2048,32768,1024,4096 (paired element-wise;
//            a single --context applies to every batch). Rows give time_us, KV GB/s (KV bytes read
//            + q/out bytes) and pct_of_copy against the in-run device-to-device copy.
//            graph_us / graph_pct_of_copy: the same call replayed from a CUDA graph.
//            Both time one call on an idle GPU, so the launch latency is in them (and a KV that
//            fits in L2 stays there between calls). steady_us / steady_pct_of_copy: 20 calls
//            back to back in one graph, per call, cycling through copies of the KV cache that
//            together exceed L2 several times: the kernels' own time, from HBM, as inside a
//            model's forward pass.
//   prefill: --mode prefill --batch 1 --context 4096,8192: causal self-attention of whole prompts;
//            rows give TFLOP/s counting 4 * q * k * d / 2 per head (the causal half).
// Other flags: --num-heads 32 --num-kv-heads 8 --head-size 128 --block-size 16 --dtype bf16|fp16
//              --kv-dtype auto|fp8 --fp8-l2-prefetch 1|0 (fp8 decode: L2 fetches 256 bytes around
//              each row, pyorch::set_decode_fp8_l2_prefetch) --decode-ctas-per-sm 0|1|2|3 (decode
//              kernel shape, 0 = the launcher's rule; pyorch::set_decode_ctas_per_sm) --json FILE.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common/bench_util.h"
#include "pyorch/attention.h"

namespace {

using pyorch::bench::Args;
using pyorch::bench::Report;

int g_decode_ctas_per_sm = 0;  // --decode-ctas-per-sm, reported in every decode row

// Fills n elements of 2-byte (bits=16) or 1-byte (bits=8) data with hashed uniform noise in
// [-1, 1) (fp16/bf16) or with fp8 e4m3 bytes of magnitude <= 2 (never NaN): real data, not zeros.
__global__ void fill_random_kernel(void* data, size_t n, uint32_t seed, int kind) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    h ^= h >> 16;
    h *= 0x7feb352du;
    h ^= h >> 15;
    h *= 0x846ca68bu;
    h ^= h >> 16;
    const float u = (h & 0xffffff) / 8388608.f - 1.f;
    if (kind == 0) static_cast<__half*>(data)[i] = __float2half(u);
    if (kind == 1) static_cast<__nv_bfloat16*>(data)[i] = __float2bfloat16(u);
    if (kind == 2) static_cast<uint8_t*>(data)[i] = static_cast<uint8_t>(h & 0xbf);  // |x| < 2
  }
}

void* device_random(size_t n, size_t elem_bytes, int kind, uint32_t seed) {
  void* p;
  BENCH_CHECK(cudaMalloc(&p, n * elem_bytes));
  fill_random_kernel<<<1024, 256>>>(p, n, seed, kind);
  BENCH_CHECK(cudaGetLastError());
  return p;
}

template <typename T>
T* device_copy(const std::vector<T>& host) {
  T* p;
  BENCH_CHECK(cudaMalloc(&p, host.size() * sizeof(T)));
  BENCH_CHECK(cudaMemcpy(p, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  return p;
}

struct Shape {
  int64_t num_heads, num_kv_heads, head_size, block_size;
  bool bf16, fp8;
};

// Runs one configuration: `batch` sequences of `context` tokens, each with q_len new tokens.
void bench_one(const Shape& s, int64_t batch, int64_t context, int64_t q_len, bool prefill,
               double copy_gbs, cudaStream_t stream, Report& report) {
  const int64_t blocks_per_seq = (context + s.block_size - 1) / s.block_size;
  const int64_t num_blocks = batch * blocks_per_seq;
  const int64_t num_tokens = batch * q_len;
  std::mt19937 rng(1234);
  std::vector<int32_t> table(num_blocks);
  std::iota(table.begin(), table.end(), 0);
  std::shuffle(table.begin(), table.end(), rng);  // random, non-contiguous block tables
  std::vector<int32_t> qsl(batch + 1), lens(batch, static_cast<int32_t>(context));
  for (int64_t i = 0; i <= batch; ++i) qsl[i] = static_cast<int32_t>(i * q_len);

  const size_t cache_elems = size_t(num_blocks) * s.block_size * s.num_kv_heads * s.head_size;
  const size_t q_elems = size_t(num_tokens) * s.num_heads * s.head_size;
  const int kind = s.bf16 ? 1 : 0;
  void* k_cache = device_random(cache_elems, s.fp8 ? 1 : 2, s.fp8 ? 2 : kind, 11);
  void* v_cache = device_random(cache_elems, s.fp8 ? 1 : 2, s.fp8 ? 2 : kind, 12);
  void* query = device_random(q_elems, 2, kind, 13);
  void* out = device_random(q_elems, 2, kind, 14);
  int32_t* d_table = device_copy(table);
  int32_t* d_qsl = device_copy(qsl);
  int32_t* d_lens = device_copy(lens);
  float* d_scales = device_copy(std::vector<float>{0.05f, 0.05f});

  pyorch::PagedAttentionParams p{};
  p.out = out;
  p.query = query;
  p.key_cache = k_cache;
  p.value_cache = v_cache;
  p.query_start_loc = d_qsl;
  p.seq_lens = d_lens;
  p.block_table = d_table;
  p.k_scale = s.fp8 ? d_scales : nullptr;
  p.v_scale = s.fp8 ? d_scales + 1 : nullptr;
  p.dtype = s.bf16 ? pyorch::DType::kBFloat16 : pyorch::DType::kFloat16;
  p.kv_cache_dtype = s.fp8 ? pyorch::KVCacheDType::kFp8E4M3 : pyorch::KVCacheDType::kAuto;
  p.num_tokens = num_tokens;
  p.num_seqs = batch;
  p.num_heads = s.num_heads;
  p.num_kv_heads = s.num_kv_heads;
  p.head_size = s.head_size;
  p.block_size = s.block_size;
  p.max_blocks_per_seq = blocks_per_seq;
  p.block_table_stride = blocks_per_seq;
  p.q_token_stride = p.out_token_stride = s.num_heads * s.head_size;
  p.q_head_stride = p.out_head_stride = s.head_size;
  p.k_token_stride = p.v_token_stride = s.num_kv_heads * s.head_size;
  p.k_block_stride = p.v_block_stride = s.block_size * p.k_token_stride;
  p.k_head_stride = p.v_head_stride = s.head_size;
  p.max_query_len = q_len;
  p.max_seq_len = context;
  p.scale = 1.f / std::sqrt(static_cast<float>(s.head_size));
  p.causal = true;
  p.sliding_window = 0;
  p.logits_soft_cap = 0.f;

  const size_t ws_bytes = pyorch::paged_attention_workspace_size(p);
  void* workspace = nullptr;
  if (ws_bytes) BENCH_CHECK(cudaMalloc(&workspace, ws_bytes));
  const double us = pyorch::bench::time_us(
      [&](cudaStream_t st) { BENCH_CHECK(pyorch::paged_attention(p, workspace, ws_bytes, st)); },
      stream, prefill ? 3 : 10, prefill ? 10 : 50);
  // The same call replayed from a CUDA graph: the kernels' own time, without launch overhead.
  cudaGraph_t graph;
  cudaGraphExec_t graph_exec;
  BENCH_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  BENCH_CHECK(pyorch::paged_attention(p, workspace, ws_bytes, stream));
  BENCH_CHECK(cudaStreamEndCapture(stream, &graph));
  BENCH_CHECK(cudaGraphInstantiate(&graph_exec, graph, 0));
  const double graph_us =
      pyorch::bench::time_us([&](cudaStream_t st) { BENCH_CHECK(cudaGraphLaunch(graph_exec, st)); },
                             stream, prefill ? 3 : 10, prefill ? 10 : 50);
  BENCH_CHECK(cudaGraphExecDestroy(graph_exec));
  BENCH_CHECK(cudaGraphDestroy(graph));
  const double kv_bytes = 2.0 * batch * context * s.num_kv_heads * s.head_size * (s.fp8 ? 1 : 2);
  double steady_us = 0;
  if (!prefill) {
    // Copies of the cache (beyond the first) so that 20 calls stream at least 256 MB apart.
    const int copies = static_cast<int>(std::min(20.0, std::ceil(256e6 / kv_bytes)));
    std::vector<std::pair<void*, void*>> caches = {{k_cache, v_cache}};
    for (int c = 1; c < copies; ++c) {
      caches.push_back({device_random(cache_elems, s.fp8 ? 1 : 2, s.fp8 ? 2 : kind, 11 + 2 * c),
                        device_random(cache_elems, s.fp8 ? 1 : 2, s.fp8 ? 2 : kind, 12 + 2 * c)});
    }
    constexpr int kSteadyCalls = 20;
    BENCH_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    for (int i = 0; i < kSteadyCalls; ++i) {
      pyorch::PagedAttentionParams pi = p;
      pi.key_cache = caches[i % copies].first;
      pi.value_cache = caches[i % copies].second;
      BENCH_CHECK(pyorch::paged_attention(pi, workspace, ws_bytes, stream));
    }
    BENCH_CHECK(cudaStreamEndCapture(stream, &graph));
    BENCH_CHECK(cudaGraphInstantiate(&graph_exec, graph, 0));
    steady_us =
        pyorch::bench::time_us(
            [&](cudaStream_t st) { BENCH_CHECK(cudaGraphLaunch(graph_exec, st)); }, stream, 3, 15) /
        kSteadyCalls;
    BENCH_CHECK(cudaGraphExecDestroy(graph_exec));
    BENCH_CHECK(cudaGraphDestroy(graph));
    for (int c = 1; c < copies; ++c) {
      BENCH_CHECK(cudaFree(caches[c].first));
      BENCH_CHECK(cudaFree(caches[c].second));
    }
  }

  Report::Row row = {{"op", "paged_attention"},
                     {"mode", prefill ? "prefill" : "decode"},
                     {"dtype", s.bf16 ? "bf16" : "fp16"},
                     {"kv_dtype", s.fp8 ? "fp8" : "auto"},
                     {"batch", std::to_string(batch)},
                     {"context", std::to_string(context)},
                     {"heads", std::to_string(s.num_heads) + "/" + std::to_string(s.num_kv_heads)},
                     {"head_size", std::to_string(s.head_size)},
                     {"block_size", std::to_string(s.block_size)},
                     {"time_us", Report::fmt(us)},
                     {"graph_us", Report::fmt(graph_us)}};
  if (prefill) {
    const double flops = 4.0 * batch * s.num_heads * double(q_len) * context * s.head_size / 2;
    row.push_back({"TFLOP/s", Report::fmt(flops / (us * 1e6), 1)});
    row.push_back({"graph_TFLOP/s", Report::fmt(flops / (graph_us * 1e6), 1)});
  } else {
    const double gbs = (kv_bytes + 2.0 * q_elems * 2) / (us * 1e3);
    row.push_back({"ctas_per_sm", g_decode_ctas_per_sm ? std::to_string(g_decode_ctas_per_sm)
                                                       : std::string("auto")});
    row.push_back({"GB/s", Report::fmt(gbs, 1)});
    row.push_back({"pct_of_copy", Report::fmt(100.0 * gbs / copy_gbs, 1)});
    const double graph_gbs = (kv_bytes + 2.0 * q_elems * 2) / (graph_us * 1e3);
    row.push_back({"graph_pct_of_copy", Report::fmt(100.0 * graph_gbs / copy_gbs, 1)});
    row.push_back({"steady_us", Report::fmt(steady_us)});
    const double steady_gbs = (kv_bytes + 2.0 * q_elems * 2) / (steady_us * 1e3);
    row.push_back({"steady_pct_of_copy", Report::fmt(100.0 * steady_gbs / copy_gbs, 1)});
  }
  row.push_back({"splits_workspace_MB", Report::fmt(ws_bytes / 1e6, 2)});
  report.add(row);
  for (void* ptr :
       {k_cache, v_cache, query, out, static_cast<void*>(d_table), static_cast<void*>(d_qsl),
        static_cast<void*>(d_lens), static_cast<void*>(d_scales), workspace}) {
    if (ptr) BENCH_CHECK(cudaFree(ptr));
  }
}

}  // namespace

int main(int argc, char** argv) {
  Args args(argc, argv);
  Report report(args);
  const bool prefill = args.str("mode", "decode") == "prefill";
  Shape s{args.num("num-heads", 32),           args.num("num-kv-heads", 8),
          args.num("head-size", 128),          args.num("block-size", 16),
          args.str("dtype", "bf16") == "bf16", args.str("kv-dtype", "auto") == "fp8"};
  const std::vector<int64_t> batches = args.list(
      "batch", prefill ? std::vector<int64_t>{1, 1} : std::vector<int64_t>{64, 256, 1, 16, 1});
  std::vector<int64_t> contexts =
      args.list("context", prefill ? std::vector<int64_t>{4096, 8192}
                                   : std::vector<int64_t>{4096, 2048, 32768, 1024, 4096});
  if (contexts.size() == 1) contexts.assign(batches.size(), contexts[0]);
  if (contexts.size() != batches.size()) {
    std::fprintf(stderr, "--batch and --context must have the same length (or one context)\n");
    return 1;
  }
  pyorch::set_decode_fp8_l2_prefetch(args.num("fp8-l2-prefetch", 1) != 0);
  const int ctas_per_sm = static_cast<int>(args.num("decode-ctas-per-sm", 0));
  if (!pyorch::set_decode_ctas_per_sm(ctas_per_sm)) {
    std::fprintf(stderr, "--decode-ctas-per-sm must be 0, 1, 2 or 3 (got %d)\n", ctas_per_sm);
    return 1;
  }
  g_decode_ctas_per_sm = ctas_per_sm;
  cudaStream_t stream;
  BENCH_CHECK(cudaStreamCreate(&stream));
  const double copy_gbs = pyorch::bench::copy_bandwidth_gbs(stream);
  std::printf("device=\"%s\" copy_GB/s=%.1f\n", pyorch::bench::device_name().c_str(), copy_gbs);
  for (size_t i = 0; i < batches.size(); ++i) {
    const int64_t q_len = prefill ? contexts[i] : 1;
    bench_one(s, batches[i], contexts[i], q_len, prefill, copy_gbs, stream, report);
  }
  BENCH_CHECK(cudaStreamDestroy(stream));
  return 0;
}
