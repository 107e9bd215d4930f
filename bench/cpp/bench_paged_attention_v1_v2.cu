// Benchmarks vLLM-style paged_attention_v1 / v2 (split KV layout) through pyorch's C API.
//
//   bench_paged_attention_v1_v2 [--batch 64,256,1,16] [--context 4096,2048,32768,1024]
//       [--num-heads 32] [--num-kv-heads 8] [--head-size 128] [--block-size 16] [--dtype bf16]
//       [--kv-cache-dtype auto|fp8] [--version v1,v2] [--json FILE]
//
// --batch and --context lists of equal length pair up (the default: 64x4096, 256x2048, 1x32768,
// 16x1024); lists of different lengths run every combination. Every sequence has the full context;
// blocks are handed out in a random order. One line per (configuration, version): time_us (CUDA
// events, median after warm-up), KV GB/s (K and V bytes read once per kv head) and pct_of_copy,
// against an in-run device-to-device copy.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <numeric>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include "common/bench_util.h"
#include "pyorch/paged_attention_v1_v2.h"

namespace {

using pyorch::bench::Args;
using pyorch::bench::Report;

// Uniform values in [-1, 1) from a hash of the index, converted to the element type.
__device__ __forceinline__ float hashed_uniform(uint64_t i, uint64_t seed) {
  uint64_t z = i * 0x9E3779B97F4A7C15ull + seed;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return static_cast<float>(z >> 40) / static_cast<float>(1ull << 23) - 1.f;
}

template <typename T>
__device__ __forceinline__ T convert(float v) {
  if constexpr (std::is_same_v<T, float>)
    return v;
  else if constexpr (std::is_same_v<T, __half>)
    return __float2half_rn(v);
  else if constexpr (std::is_same_v<T, __nv_bfloat16>)
    return __float2bfloat16_rn(v);
  else
    return static_cast<uint8_t>(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3));
}

template <typename T>
__global__ void fill_kernel(T* data, size_t n, uint64_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    data[i] = convert<T>(hashed_uniform(i, seed));
  }
}

// Allocates n elements of elem_bytes and fills them with random values of the given type.
void* random_buffer(size_t n, size_t elem_bytes, const std::string& type, uint64_t seed) {
  void* p;
  BENCH_CHECK(cudaMalloc(&p, n * elem_bytes));
  const int threads = 256, blocks = 1024;
  if (type == "fp32")
    fill_kernel<<<blocks, threads>>>(static_cast<float*>(p), n, seed);
  else if (type == "fp16")
    fill_kernel<<<blocks, threads>>>(static_cast<__half*>(p), n, seed);
  else if (type == "bf16")
    fill_kernel<<<blocks, threads>>>(static_cast<__nv_bfloat16*>(p), n, seed);
  else
    fill_kernel<<<blocks, threads>>>(static_cast<uint8_t*>(p), n, seed);
  BENCH_CHECK(cudaGetLastError());
  return p;
}

struct Shape {
  int num_heads, num_kv_heads, head_size, block_size;
  std::string dtype, kv_dtype;
};

pyorch::DType parse_dtype(const std::string& s) {
  if (s == "fp32") return pyorch::DType::kFloat32;
  if (s == "fp16") return pyorch::DType::kFloat16;
  if (s == "bf16") return pyorch::DType::kBFloat16;
  std::fprintf(stderr, "unknown --dtype %s (fp32, fp16, bf16)\n", s.c_str());
  std::exit(2);
}

// Times both versions asked for on one (batch, context) configuration.
void bench_config(int batch, int context, const Shape& sh, const std::vector<std::string>& versions,
                  double copy_gbs, Report& report, cudaStream_t stream) {
  const bool fp8 = sh.kv_dtype == "fp8";
  const size_t elem = sh.dtype == "fp32" ? 4 : 2;
  const size_t cache_elem = fp8 ? 1 : elem;
  const int blocks_per_seq = (context + sh.block_size - 1) / sh.block_size;
  const size_t num_blocks = size_t(batch) * blocks_per_seq;
  const size_t block_elems = size_t(sh.num_kv_heads) * sh.head_size * sh.block_size;

  // key [num_blocks, kv_heads, head/x, block, x] and value [num_blocks, kv_heads, head, block]
  // hold the same number of elements.
  const std::string cache_type = fp8 ? "fp8" : sh.dtype;
  void* key_cache = random_buffer(num_blocks * block_elems, cache_elem, cache_type, 1);
  void* value_cache = random_buffer(num_blocks * block_elems, cache_elem, cache_type, 2);
  const size_t q_elems = size_t(batch) * sh.num_heads * sh.head_size;
  void* query = random_buffer(q_elems, elem, sh.dtype, 3);
  void* out;
  BENCH_CHECK(cudaMalloc(&out, q_elems * elem));

  std::vector<int32_t> table(num_blocks);
  std::iota(table.begin(), table.end(), 0);
  std::shuffle(table.begin(), table.end(), std::mt19937(42));
  std::vector<int32_t> lens(batch, context);
  int32_t *block_tables, *seq_lens;
  BENCH_CHECK(cudaMalloc(&block_tables, table.size() * sizeof(int32_t)));
  BENCH_CHECK(cudaMalloc(&seq_lens, lens.size() * sizeof(int32_t)));
  BENCH_CHECK(cudaMemcpy(block_tables, table.data(), table.size() * 4, cudaMemcpyHostToDevice));
  BENCH_CHECK(cudaMemcpy(seq_lens, lens.data(), lens.size() * 4, cudaMemcpyHostToDevice));
  const float one = 1.f;
  float* scales;
  BENCH_CHECK(cudaMalloc(&scales, 2 * sizeof(float)));
  BENCH_CHECK(cudaMemcpy(scales, &one, sizeof(float), cudaMemcpyHostToDevice));
  BENCH_CHECK(cudaMemcpy(scales + 1, &one, sizeof(float), cudaMemcpyHostToDevice));

  const int64_t parts = pyorch::paged_attention_v2_num_partitions(context);
  const size_t scratch_rows = size_t(batch) * sh.num_heads * parts;
  float *exp_sums, *max_logits;
  void* tmp_out;
  BENCH_CHECK(cudaMalloc(&exp_sums, scratch_rows * sizeof(float)));
  BENCH_CHECK(cudaMalloc(&max_logits, scratch_rows * sizeof(float)));
  BENCH_CHECK(cudaMalloc(&tmp_out, scratch_rows * sh.head_size * elem));

  pyorch::PagedAttentionV1V2Args a{};
  a.out = out;
  a.query = query;
  a.key_cache = key_cache;
  a.value_cache = value_cache;
  a.block_tables = block_tables;
  a.seq_lens = seq_lens;
  a.alibi_slopes = nullptr;
  a.k_scale = scales;
  a.v_scale = scales + 1;
  a.dtype = parse_dtype(sh.dtype);
  a.kv_cache_dtype = fp8 ? pyorch::KVCacheDType::kFp8E4M3 : pyorch::KVCacheDType::kAuto;
  a.num_seqs = batch;
  a.num_heads = sh.num_heads;
  a.num_kv_heads = sh.num_kv_heads;
  a.head_size = sh.head_size;
  a.block_size = sh.block_size;
  a.max_seq_len = context;
  a.scale = 1.f / std::sqrt(static_cast<float>(sh.head_size));
  a.q_seq_stride = int64_t(sh.num_heads) * sh.head_size;
  a.q_head_stride = sh.head_size;
  a.out_seq_stride = a.q_seq_stride;
  a.out_head_stride = a.q_head_stride;
  a.k_block_stride = a.v_block_stride = int64_t(block_elems);
  a.k_head_stride = a.v_head_stride = int64_t(sh.head_size) * sh.block_size;
  a.block_table_stride = blocks_per_seq;

  const double kv_bytes =
      2.0 * batch * double(context) * sh.num_kv_heads * sh.head_size * cache_elem;
  for (const std::string& version : versions) {
    auto fn = [&](cudaStream_t s) {
      if (version == "v1") {
        BENCH_CHECK(pyorch::paged_attention_v1(a, s));
      } else {
        BENCH_CHECK(pyorch::paged_attention_v2(a, exp_sums, max_logits, tmp_out, parts, s));
      }
    };
    const double us = pyorch::bench::time_us(fn, stream);
    const double gbs = kv_bytes / (us * 1e3);
    report.add({{"op", "paged_attention_" + version},
                {"dtype", sh.dtype},
                {"kv_cache_dtype", sh.kv_dtype},
                {"batch", std::to_string(batch)},
                {"context", std::to_string(context)},
                {"num_heads", std::to_string(sh.num_heads)},
                {"num_kv_heads", std::to_string(sh.num_kv_heads)},
                {"head_size", std::to_string(sh.head_size)},
                {"block_size", std::to_string(sh.block_size)},
                {"time_us", Report::fmt(us)},
                {"kv_GB/s", Report::fmt(gbs, 1)},
                {"copy_GB/s", Report::fmt(copy_gbs, 1)},
                {"pct_of_copy", Report::fmt(100.0 * gbs / copy_gbs, 1)}});
  }
  for (void* p : {key_cache, value_cache, query, out, static_cast<void*>(block_tables),
                  static_cast<void*>(seq_lens), static_cast<void*>(scales),
                  static_cast<void*>(exp_sums), static_cast<void*>(max_logits), tmp_out}) {
    BENCH_CHECK(cudaFree(p));
  }
}

}  // namespace

int main(int argc, char** argv) {
  const Args args(argc, argv);
  const std::vector<int64_t> batches = args.list("batch", {64, 256, 1, 16});
  const std::vector<int64_t> contexts = args.list("context", {4096, 2048, 32768, 1024});
  Shape sh;
  sh.num_heads = static_cast<int>(args.num("num-heads", 32));
  sh.num_kv_heads = static_cast<int>(args.num("num-kv-heads", 8));
  sh.head_size = static_cast<int>(args.num("head-size", 128));
  sh.block_size = static_cast<int>(args.num("block-size", 16));
  sh.dtype = args.str("dtype", "bf16");
  sh.kv_dtype = args.str("kv-cache-dtype", "auto");
  parse_dtype(sh.dtype);
  const std::vector<std::string> versions = args.strs("version", {"v1", "v2"});
  for (const std::string& v : versions) {
    if (v != "v1" && v != "v2") {
      std::fprintf(stderr, "unknown --version %s (v1, v2)\n", v.c_str());
      return 2;
    }
  }

  std::vector<std::pair<int, int>> configs;
  if (batches.size() == contexts.size()) {
    for (size_t i = 0; i < batches.size(); ++i) configs.emplace_back(batches[i], contexts[i]);
  } else {
    for (int64_t b : batches) {
      for (int64_t c : contexts) configs.emplace_back(static_cast<int>(b), static_cast<int>(c));
    }
  }

  cudaStream_t stream;
  BENCH_CHECK(cudaStreamCreate(&stream));
  const double copy_gbs = pyorch::bench::copy_bandwidth_gbs(stream);
  std::printf("# device=%s copy_GB/s=%.1f\n", pyorch::bench::device_name().c_str(), copy_gbs);
  Report report(args);
  for (const auto& [batch, context] : configs) {
    bench_config(batch, context, sh, versions, copy_gbs, report, stream);
  }
  BENCH_CHECK(cudaStreamDestroy(stream));
  return 0;
}
