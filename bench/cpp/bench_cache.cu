// Benchmark of the KV-cache ops through the C API (no torch): reshape_and_cache_flash (NHD layout),
// reshape_and_cache (vLLM's split layout) and copy_blocks. One row per configuration: time_us
// (CUDA events, median of --iters after --warmup), GB/s of the bytes the op must read + write
// (new keys/values and slot_mapping in, cache rows out; for copy_blocks every block read and
// written once) and pct_of_copy against the in-run device-to-device copy (bench_util.h).
//   writes: for each --tokens, key/value [tokens, num_kv_heads, head_size] into caches of
//           ceil(tokens / block_size) blocks (prefill: blocks in random order, consecutive slots
//           within each) or twice that many (random: distinct random slots, a decode-like scatter)
//   copy:   --layers caches x (key, value), --pairs (src, dst) pairs over 2 * pairs blocks each
// Flags: --ops flash,split,copy --tokens 16,256,4096,16384,65536 --num-kv-heads 8 --head-size 128
//        --block-size 16 --dtype bf16[,fp16,fp32] --kv-dtype auto[,fp8] --slots prefill[,random]
//        --layers 32 --pairs 256 --iters 30 --warmup 5 --json FILE
#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common/bench_util.h"
#include "pyorch/cache.h"

namespace {

using pyorch::DType;
using pyorch::KVCacheDType;
using pyorch::bench::Args;
using pyorch::bench::Report;

// Hashed uniform noise in [-1, 1) written as fp32/fp16/bf16, or random bytes (kInt32 marks "raw").
__global__ void fill_kernel(void* data, size_t n, DType dtype, uint32_t seed) {
  const size_t step = size_t(gridDim.x) * blockDim.x;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += step) {
    uint32_t h = static_cast<uint32_t>(i ^ (i >> 32)) * 0x9e3779b1u + seed;
    h ^= h >> 15;
    h *= 0x2c1b3c6du;
    h ^= h >> 12;
    const float v = (h >> 8) * (2.f / 16777216.f) - 1.f;
    switch (dtype) {
      case DType::kFloat32: static_cast<float*>(data)[i] = v; break;
      case DType::kFloat16: static_cast<__half*>(data)[i] = __float2half(v); break;
      case DType::kBFloat16: static_cast<__nv_bfloat16*>(data)[i] = __float2bfloat16(v); break;
      default: static_cast<uint8_t*>(data)[i] = static_cast<uint8_t>(h); break;
    }
  }
}

size_t dtype_bytes(DType dtype) {
  return dtype == DType::kFloat32 ? 4 : (dtype == DType::kFp8E4M3 ? 1 : 2);
}

// One device allocation, filled with noise of `dtype` (raw bytes for kFp8E4M3), freed on scope
// exit.
struct DeviceBuffer {
  void* ptr = nullptr;
  DeviceBuffer(size_t n, DType dtype, uint32_t seed) {
    BENCH_CHECK(cudaMalloc(&ptr, std::max<size_t>(n, 1) * dtype_bytes(dtype)));
    fill_kernel<<<1024, 256>>>(ptr, n, dtype, seed);
    BENCH_CHECK(cudaGetLastError());
  }
  template <typename T>
  explicit DeviceBuffer(const std::vector<T>& host) {
    BENCH_CHECK(cudaMalloc(&ptr, std::max<size_t>(host.size(), 1) * sizeof(T)));
    BENCH_CHECK(cudaMemcpy(ptr, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  }
  ~DeviceBuffer() { cudaFree(ptr); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
};

struct Config {
  DType dtype;
  std::string dtype_name;
  KVCacheDType kv_dtype;
  std::string kv_dtype_name;
  int64_t num_kv_heads, head_size, block_size;
  int iters, warmup;
  double copy_gbs;
  cudaStream_t stream;

  DType cache_dtype() const { return kv_dtype == KVCacheDType::kAuto ? dtype : DType::kFp8E4M3; }
};

void add_row(Report& report, const Config& c, const std::string& op, Report::Row extra, double us,
             double bytes) {
  const double gbs = bytes / (us * 1e3);
  Report::Row row{{"op", op}, {"dtype", c.dtype_name}, {"kv_dtype", c.kv_dtype_name}};
  row.insert(row.end(), extra.begin(), extra.end());
  row.insert(row.end(), {{"num_kv_heads", std::to_string(c.num_kv_heads)},
                         {"head_size", std::to_string(c.head_size)},
                         {"block_size", std::to_string(c.block_size)},
                         {"time_us", Report::fmt(us)},
                         {"GB/s", Report::fmt(gbs, 1)},
                         {"pct_of_copy", Report::fmt(100.0 * gbs / c.copy_gbs, 1)}});
  report.add(row);
}

// prefill: every slot of a random permutation of blocks, in order; random: distinct random slots
// out of twice as many.
std::vector<int64_t> make_slots(int64_t num_tokens, int64_t block_size, bool prefill,
                                int64_t* num_blocks) {
  std::mt19937_64 rng(1234);
  const int64_t needed = (num_tokens + block_size - 1) / block_size;
  std::vector<int64_t> slots(num_tokens);
  if (prefill) {
    *num_blocks = needed;
    std::vector<int64_t> blocks(needed);
    std::iota(blocks.begin(), blocks.end(), 0);
    std::shuffle(blocks.begin(), blocks.end(), rng);
    for (int64_t t = 0; t < num_tokens; ++t) {
      slots[t] = blocks[t / block_size] * block_size + t % block_size;
    }
  } else {
    *num_blocks = 2 * needed;
    std::vector<int64_t> all(*num_blocks * block_size);
    std::iota(all.begin(), all.end(), 0);
    std::shuffle(all.begin(), all.end(), rng);
    std::copy(all.begin(), all.begin() + num_tokens, slots.begin());
  }
  return slots;
}

void bench_write(const Config& c, bool split, int64_t num_tokens, bool prefill, Report& report) {
  int64_t num_blocks = 0;
  const std::vector<int64_t> slots = make_slots(num_tokens, c.block_size, prefill, &num_blocks);
  const int64_t row = c.num_kv_heads * c.head_size;
  const size_t kv_elems = size_t(num_tokens) * row;
  const size_t cache_elems = size_t(num_blocks) * c.block_size * row;
  DeviceBuffer key(kv_elems, c.dtype, 1), value(kv_elems, c.dtype, 2);
  DeviceBuffer key_cache(cache_elems, c.cache_dtype(), 3),
      value_cache(cache_elems, c.cache_dtype(), 4);
  DeviceBuffer slot_mapping(slots);
  DeviceBuffer scales(std::vector<float>{0.37f, 2.5f});
  const float* k_scale = static_cast<const float*>(scales.ptr);

  const double us = pyorch::bench::time_us(
      [&](cudaStream_t s) {
        if (split) {
          BENCH_CHECK(pyorch::reshape_and_cache(
              key.ptr, value.ptr, key_cache.ptr, value_cache.ptr,
              static_cast<const int64_t*>(slot_mapping.ptr), k_scale, k_scale + 1, c.dtype,
              c.kv_dtype, num_tokens, c.num_kv_heads, c.head_size, num_blocks, c.block_size, row,
              c.head_size, row, c.head_size, c.block_size * row, c.block_size * c.head_size,
              c.block_size * row, c.block_size * c.head_size, s));
        } else {
          BENCH_CHECK(pyorch::reshape_and_cache_flash(
              key.ptr, value.ptr, key_cache.ptr, value_cache.ptr,
              static_cast<const int64_t*>(slot_mapping.ptr), k_scale, k_scale + 1, c.dtype,
              c.kv_dtype, num_tokens, c.num_kv_heads, c.head_size, num_blocks, c.block_size, row,
              c.head_size, row, c.head_size, c.block_size * row, row, c.head_size, s));
        }
      },
      c.stream, c.warmup, c.iters);
  const double bytes =
      2.0 * kv_elems * (dtype_bytes(c.dtype) + dtype_bytes(c.cache_dtype())) + 8.0 * num_tokens;
  add_row(report, c, split ? "reshape_and_cache" : "reshape_and_cache_flash",
          {{"tokens", std::to_string(num_tokens)}, {"slots", prefill ? "prefill" : "random"}}, us,
          bytes);
}

void bench_copy(const Config& c, int64_t num_layers, int64_t num_pairs, Report& report) {
  const int64_t num_blocks = 2 * num_pairs;
  const size_t block_elems = size_t(c.block_size) * c.num_kv_heads * c.head_size;
  const int64_t block_bytes = static_cast<int64_t>(block_elems * dtype_bytes(c.cache_dtype()));
  // One allocation per layer and kind, as an engine holds them.
  std::vector<DeviceBuffer*> buffers;
  std::vector<void*> key_ptrs, value_ptrs;
  for (int64_t l = 0; l < num_layers; ++l) {
    buffers.push_back(new DeviceBuffer(num_blocks * block_elems, c.cache_dtype(), 10 + 2 * l));
    key_ptrs.push_back(buffers.back()->ptr);
    buffers.push_back(new DeviceBuffer(num_blocks * block_elems, c.cache_dtype(), 11 + 2 * l));
    value_ptrs.push_back(buffers.back()->ptr);
  }
  std::vector<int64_t> ids(num_blocks);
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), std::mt19937_64(99));
  std::vector<int64_t> pairs(2 * num_pairs);
  for (int64_t i = 0; i < num_pairs; ++i) {
    pairs[2 * i] = ids[i];
    pairs[2 * i + 1] = ids[num_pairs + i];
  }
  DeviceBuffer mapping(pairs);
  const double us = pyorch::bench::time_us(
      [&](cudaStream_t s) {
        BENCH_CHECK(pyorch::copy_blocks(key_ptrs.data(), value_ptrs.data(), num_layers,
                                        static_cast<const int64_t*>(mapping.ptr), num_pairs,
                                        num_blocks, block_bytes, block_bytes, s));
      },
      c.stream, c.warmup, c.iters);
  for (DeviceBuffer* b : buffers) delete b;
  const double bytes = 2.0 * 2.0 * num_layers * num_pairs * block_bytes;  // k + v, read + write
  add_row(report, c, "copy_blocks",
          {{"layers", std::to_string(num_layers)}, {"pairs", std::to_string(num_pairs)}}, us,
          bytes);
}

DType parse_dtype(const std::string& s) {
  if (s == "fp32") return DType::kFloat32;
  if (s == "fp16") return DType::kFloat16;
  if (s == "bf16") return DType::kBFloat16;
  std::fprintf(stderr, "unknown --dtype %s (bf16, fp16, fp32)\n", s.c_str());
  std::exit(2);
}

KVCacheDType parse_kv_dtype(const std::string& s) {
  if (s == "auto") return KVCacheDType::kAuto;
  if (s == "fp8" || s == "fp8_e4m3") return KVCacheDType::kFp8E4M3;
  std::fprintf(stderr, "unknown --kv-dtype %s (auto, fp8)\n", s.c_str());
  std::exit(2);
}

}  // namespace

int main(int argc, char** argv) {
  const Args args(argc, argv);
  Report report(args);
  cudaStream_t stream;
  BENCH_CHECK(cudaStreamCreate(&stream));
  const double copy_gbs = pyorch::bench::copy_bandwidth_gbs(stream);
  std::printf("device=\"%s\" copy_GB/s=%.1f\n", pyorch::bench::device_name().c_str(), copy_gbs);

  const auto ops = args.strs("ops", {"flash", "split", "copy"});
  const auto has_op = [&](const char* op) { return std::count(ops.begin(), ops.end(), op) > 0; };
  const auto tokens = args.list("tokens", {16, 256, 4096, 16384, 65536});
  const auto slot_modes = args.strs("slots", {"prefill"});
  for (const std::string& dtype : args.strs("dtype", {"bf16"})) {
    for (const std::string& kv_dtype : args.strs("kv-dtype", {"auto", "fp8"})) {
      const Config c{parse_dtype(dtype),
                     dtype,
                     parse_kv_dtype(kv_dtype),
                     kv_dtype,
                     args.num("num-kv-heads", 8),
                     args.num("head-size", 128),
                     args.num("block-size", 16),
                     static_cast<int>(args.num("iters", 30)),
                     static_cast<int>(args.num("warmup", 5)),
                     copy_gbs,
                     stream};
      for (const std::string& mode : slot_modes) {
        for (int64_t t : tokens) {
          if (has_op("flash")) bench_write(c, false, t, mode == "prefill", report);
          if (has_op("split")) bench_write(c, true, t, mode == "prefill", report);
        }
      }
      if (has_op("copy")) bench_copy(c, args.num("layers", 32), args.num("pairs", 256), report);
    }
  }
  BENCH_CHECK(cudaStreamDestroy(stream));
  return 0;
}
