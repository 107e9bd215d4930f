// Benchmark of the memory-bound elementwise ops through the C API (no torch): rms_norm,
// fused_add_rms_norm, rotary_embedding, silu_and_mul, gelu_and_mul, gelu_tanh_and_mul.
// One row per configuration: op, dtype, shape, time_us (median of --iters after warm-up),
// GB/s (the bytes each op must read + write, counted once) and pct_of_copy against the in-run
// device-to-device copy (bench_util.h copy_bandwidth_gbs).
//   norms:        [tokens, hidden] for each --tokens x --hidden
//   activations:  input [tokens, 2 * hidden] -> out [tokens, hidden] (hidden = d, the MLP width)
//   rope:         query/key views of a fused qkv [tokens, (heads + 2 * kv_heads) * head_size],
//                 for each --tokens (hidden is not used), neox and gpt-j style
// Flags: --ops a,b,... --tokens 1,83,1024,4096,16384 --hidden 4096,8192,14336
//        --dtype bf16|fp16|fp32 --iters 30 --warmup 5 --num-heads 32 --num-kv-heads 8
//        --head-size 128 --rot-dim head_size --max-position 8192 --json FILE
#include <cstdint>
#include <string>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common/bench_util.h"
#include "pyorch/activation.h"
#include "pyorch/norm.h"
#include "pyorch/rope.h"

namespace {

using pyorch::DType;
using pyorch::bench::Args;
using pyorch::bench::Report;

// Hashed uniform noise in [lo, hi) written as fp32/fp16/bf16 on the device (a 1 GiB host fill
// would take longer than the whole benchmark).
__global__ void fill_uniform_kernel(void* data, size_t n, DType dtype, float lo, float hi,
                                    uint32_t seed) {
  const size_t step = size_t(gridDim.x) * blockDim.x;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += step) {
    uint32_t h = static_cast<uint32_t>(i ^ (i >> 32)) * 0x9e3779b1u + seed;
    h ^= h >> 15;
    h *= 0x2c1b3c6du;
    h ^= h >> 12;
    h *= 0x297a2d39u;
    h ^= h >> 15;
    const float v = lo + (hi - lo) * ((h >> 8) * (1.f / 16777216.f));
    switch (dtype) {
      case DType::kFloat32: static_cast<float*>(data)[i] = v; break;
      case DType::kFloat16: static_cast<__half*>(data)[i] = __float2half(v); break;
      default: static_cast<__nv_bfloat16*>(data)[i] = __float2bfloat16(v); break;
    }
  }
}

size_t dtype_bytes(DType dtype) { return dtype == DType::kFloat32 ? 4 : 2; }

// Owns one device allocation for the duration of a configuration.
struct DeviceBuffer {
  void* ptr = nullptr;
  DeviceBuffer(size_t n, DType dtype, float lo, float hi, uint32_t seed) {
    BENCH_CHECK(cudaMalloc(&ptr, std::max<size_t>(n, 1) * dtype_bytes(dtype)));
    fill_uniform_kernel<<<1024, 256>>>(ptr, n, dtype, lo, hi, seed);
    BENCH_CHECK(cudaGetLastError());
  }
  ~DeviceBuffer() { cudaFree(ptr); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
};

struct Config {
  DType dtype;
  std::string dtype_name;
  int iters, warmup;
  double copy_gbs;
  cudaStream_t stream;
};

void add_row(Report& report, const Config& c, const std::string& op, const std::string& shape,
             double us, double bytes) {
  const double gbs = bytes / (us * 1e3);
  report.add({{"op", op},
              {"dtype", c.dtype_name},
              {"shape", shape},
              {"time_us", Report::fmt(us)},
              {"GB/s", Report::fmt(gbs, 1)},
              {"pct_of_copy", Report::fmt(100.0 * gbs / c.copy_gbs, 1)}});
}

void bench_norm(const std::string& op, int64_t tokens, int64_t hidden, const Config& c,
                Report& report) {
  const size_t n = size_t(tokens) * hidden;
  const size_t es = dtype_bytes(c.dtype);
  DeviceBuffer in(n, c.dtype, -2.f, 2.f, 1), out(n, c.dtype, 0.f, 0.f, 2);
  DeviceBuffer residual(n, c.dtype, -2.f, 2.f, 3), weight(hidden, c.dtype, 0.5f, 1.5f, 4);
  double bytes;
  std::function<void(cudaStream_t)> fn;
  if (op == "rms_norm") {
    bytes = double(es) * (2.0 * n + hidden);  // read in, write out, read weight
    fn = [&](cudaStream_t s) {
      BENCH_CHECK(pyorch::rms_norm(out.ptr, in.ptr, weight.ptr, c.dtype, tokens, hidden, hidden,
                                   hidden, 1e-6f, s));
    };
  } else {
    bytes = double(es) * (4.0 * n + hidden);  // read input + residual, write both, read weight
    fn = [&](cudaStream_t s) {
      BENCH_CHECK(pyorch::fused_add_rms_norm(in.ptr, residual.ptr, weight.ptr, c.dtype, tokens,
                                             hidden, hidden, hidden, 1e-6f, s));
    };
  }
  const double us = pyorch::bench::time_us(fn, c.stream, c.warmup, c.iters);
  add_row(report, c, op, std::to_string(tokens) + "x" + std::to_string(hidden), us, bytes);
}

void bench_act(const std::string& op, int64_t tokens, int64_t d, const Config& c, Report& report) {
  const size_t n_out = size_t(tokens) * d;
  DeviceBuffer in(2 * n_out, c.dtype, -4.f, 4.f, 5), out(n_out, c.dtype, 0.f, 0.f, 6);
  const pyorch::Activation act = op == "silu_and_mul"   ? pyorch::Activation::kSilu
                                 : op == "gelu_and_mul" ? pyorch::Activation::kGelu
                                                        : pyorch::Activation::kGeluTanh;
  const double us = pyorch::bench::time_us(
      [&](cudaStream_t s) {
        BENCH_CHECK(pyorch::act_and_mul(out.ptr, in.ptr, act, c.dtype, tokens, d, d, 2 * d, s));
      },
      c.stream, c.warmup, c.iters);
  const double bytes = double(dtype_bytes(c.dtype)) * 3.0 * n_out;  // read 2d, write d per row
  add_row(report, c, op, std::to_string(tokens) + "x" + std::to_string(2 * d), us, bytes);
}

struct RopeShape {
  int64_t num_heads, num_kv_heads, head_size, rot_dim, max_position;
};

void bench_rope(int64_t tokens, const RopeShape& r, bool is_neox, const Config& c, Report& report) {
  const int64_t qkv_width = (r.num_heads + 2 * r.num_kv_heads) * r.head_size;
  DeviceBuffer qkv(size_t(tokens) * qkv_width, c.dtype, -2.f, 2.f, 7);
  DeviceBuffer cache(size_t(r.max_position) * r.rot_dim, c.dtype, -1.f, 1.f, 8);
  std::vector<int64_t> host_pos(tokens);
  std::mt19937_64 rng(9);
  for (auto& p : host_pos) p = static_cast<int64_t>(rng() % uint64_t(r.max_position));
  int64_t* positions;
  BENCH_CHECK(cudaMalloc(&positions, std::max<size_t>(tokens, 1) * sizeof(int64_t)));
  BENCH_CHECK(
      cudaMemcpy(positions, host_pos.data(), tokens * sizeof(int64_t), cudaMemcpyHostToDevice));
  char* q = static_cast<char*>(qkv.ptr);
  char* k = q + r.num_heads * r.head_size * dtype_bytes(c.dtype);
  const double us = pyorch::bench::time_us(
      [&](cudaStream_t s) {
        BENCH_CHECK(pyorch::rotary_embedding(positions, q, k, cache.ptr, c.dtype, c.dtype, tokens,
                                             r.num_heads, r.num_kv_heads, r.head_size, r.rot_dim,
                                             qkv_width, r.head_size, qkv_width, r.head_size,
                                             r.rot_dim, is_neox, s));
      },
      c.stream, c.warmup, c.iters);
  BENCH_CHECK(cudaFree(positions));
  // Rotated parts of every q/k head read and written, plus a position and a cache row per token.
  const double es = double(dtype_bytes(c.dtype));
  const double bytes =
      tokens * (2.0 * (r.num_heads + r.num_kv_heads) * r.rot_dim * es + 8.0 + r.rot_dim * es);
  const std::string shape = std::to_string(tokens) + "x(" + std::to_string(r.num_heads) + "+" +
                            std::to_string(r.num_kv_heads) + ")x" + std::to_string(r.head_size) +
                            "/rot" + std::to_string(r.rot_dim);
  add_row(report, c, is_neox ? "rotary_embedding_neox" : "rotary_embedding_gptj", shape, us, bytes);
}

}  // namespace

int main(int argc, char** argv) {
  const Args args(argc, argv);
  Report report(args);
  const std::vector<std::string> ops =
      args.strs("ops", {"rms_norm", "fused_add_rms_norm", "rotary_embedding", "silu_and_mul",
                        "gelu_and_mul", "gelu_tanh_and_mul"});
  const std::vector<int64_t> tokens_list = args.list("tokens", {1, 83, 1024, 4096, 16384});
  const std::vector<int64_t> hidden_list = args.list("hidden", {4096, 8192, 14336});
  const std::string dtype_name = args.str("dtype", "bf16");
  DType dtype;
  if (dtype_name == "bf16") {
    dtype = DType::kBFloat16;
  } else if (dtype_name == "fp16") {
    dtype = DType::kFloat16;
  } else if (dtype_name == "fp32") {
    dtype = DType::kFloat32;
  } else {
    std::fprintf(stderr, "unknown --dtype %s (bf16, fp16 or fp32)\n", dtype_name.c_str());
    return 1;
  }
  RopeShape rope{args.num("num-heads", 32), args.num("num-kv-heads", 8), args.num("head-size", 128),
                 0, args.num("max-position", 8192)};
  rope.rot_dim = args.num("rot-dim", rope.head_size);

  cudaStream_t stream;
  BENCH_CHECK(cudaStreamCreate(&stream));
  Config c{dtype,
           dtype_name,
           static_cast<int>(args.num("iters", 30)),
           static_cast<int>(args.num("warmup", 5)),
           0.0,
           stream};
  c.copy_gbs = pyorch::bench::copy_bandwidth_gbs(stream);
  std::printf("device=\"%s\" copy_GB/s=%.1f\n", pyorch::bench::device_name().c_str(), c.copy_gbs);

  for (const std::string& op : ops) {
    for (int64_t tokens : tokens_list) {
      if (op == "rotary_embedding") {
        bench_rope(tokens, rope, true, c, report);
        bench_rope(tokens, rope, false, c, report);
        continue;
      }
      for (int64_t hidden : hidden_list) {
        if (op == "rms_norm" || op == "fused_add_rms_norm") {
          bench_norm(op, tokens, hidden, c, report);
        } else if (op == "silu_and_mul" || op == "gelu_and_mul" || op == "gelu_tanh_and_mul") {
          bench_act(op, tokens, hidden, c, report);
        } else {
          std::fprintf(stderr, "unknown op %s\n", op.c_str());
          return 1;
        }
      }
    }
  }
  BENCH_CHECK(cudaStreamDestroy(stream));
  return 0;
}
