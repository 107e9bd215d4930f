// Shared plumbing for the C++ benchmark binaries (no torch, no Python): command-line parsing,
// CUDA-event timing (median of N after warm-up), the in-run device-to-device copy baseline, and
// one output row per configuration (text, plus JSON with --json FILE).
#pragma once

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <cuda_runtime.h>

namespace pyorch::bench {

#define BENCH_CHECK(expr)                                                                         \
  do {                                                                                            \
    cudaError_t e_ = (expr);                                                                      \
    if (e_ != cudaSuccess) {                                                                      \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #expr, cudaGetErrorString(e_)); \
      std::exit(1);                                                                               \
    }                                                                                             \
  } while (0)

// --key value / --flag arguments. Lists are comma-separated: --tokens 1,83,4096.
class Args {
 public:
  Args(int argc, char** argv) {
    for (int i = 1; i < argc; ++i) {
      std::string a = argv[i];
      if (a.rfind("--", 0) != 0) continue;
      a = a.substr(2);
      if (i + 1 < argc && std::strncmp(argv[i + 1], "--", 2) != 0) {
        kv_[a] = argv[++i];
      } else {
        kv_[a] = "1";
      }
    }
  }
  bool has(const std::string& k) const { return kv_.count(k) > 0; }
  std::string str(const std::string& k, const std::string& def) const {
    auto it = kv_.find(k);
    return it == kv_.end() ? def : it->second;
  }
  int64_t num(const std::string& k, int64_t def) const {
    auto it = kv_.find(k);
    return it == kv_.end() ? def : std::atoll(it->second.c_str());
  }
  std::vector<int64_t> list(const std::string& k, const std::vector<int64_t>& def) const {
    auto it = kv_.find(k);
    if (it == kv_.end()) return def;
    std::vector<int64_t> out;
    std::stringstream ss(it->second);
    std::string item;
    while (std::getline(ss, item, ',')) out.push_back(std::atoll(item.c_str()));
    return out;
  }
  std::vector<std::string> strs(const std::string& k, const std::vector<std::string>& def) const {
    auto it = kv_.find(k);
    if (it == kv_.end()) return def;
    std::vector<std::string> out;
    std::stringstream ss(it->second);
    std::string item;
    while (std::getline(ss, item, ',')) out.push_back(item);
    return out;
  }

 private:
  std::map<std::string, std::string> kv_;
};

// Median time in microseconds of `iters` runs of fn after `warmup` runs, each timed with events.
inline double time_us(const std::function<void(cudaStream_t)>& fn, cudaStream_t stream,
                      int warmup = 5, int iters = 30) {
  for (int i = 0; i < warmup; ++i) fn(stream);
  BENCH_CHECK(cudaStreamSynchronize(stream));
  cudaEvent_t start, stop;
  BENCH_CHECK(cudaEventCreate(&start));
  BENCH_CHECK(cudaEventCreate(&stop));
  std::vector<float> ms(iters);
  for (int i = 0; i < iters; ++i) {
    BENCH_CHECK(cudaEventRecord(start, stream));
    fn(stream);
    BENCH_CHECK(cudaEventRecord(stop, stream));
    BENCH_CHECK(cudaEventSynchronize(stop));
    BENCH_CHECK(cudaEventElapsedTime(&ms[i], start, stop));
  }
  BENCH_CHECK(cudaGetLastError());
  BENCH_CHECK(cudaEventDestroy(start));
  BENCH_CHECK(cudaEventDestroy(stop));
  std::sort(ms.begin(), ms.end());
  return 1000.0 * ms[iters / 2];
}

// Device-to-device copy bandwidth in GB/s (bytes read + written), the in-run baseline that every
// memory-bound kernel is compared with. 1 GiB each way by default: far past L2.
inline double copy_bandwidth_gbs(cudaStream_t stream, size_t bytes = size_t(1) << 30) {
  void *src, *dst;
  BENCH_CHECK(cudaMalloc(&src, bytes));
  BENCH_CHECK(cudaMalloc(&dst, bytes));
  BENCH_CHECK(cudaMemsetAsync(src, 1, bytes, stream));
  const double us = time_us(
      [&](cudaStream_t s) {
        BENCH_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, s));
      },
      stream, 3, 20);
  BENCH_CHECK(cudaFree(src));
  BENCH_CHECK(cudaFree(dst));
  return 2.0 * bytes / (us * 1e3);
}

// Device buffer filled with uniform random values in [lo, hi) converted by `convert` (host side).
template <typename T>
T* random_device_buffer(size_t n, float lo, float hi, uint64_t seed, T (*convert)(float)) {
  std::vector<T> host(n);
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  for (auto& x : host) x = convert(dist(rng));
  T* dev;
  BENCH_CHECK(cudaMalloc(&dev, n * sizeof(T)));
  BENCH_CHECK(cudaMemcpy(dev, host.data(), n * sizeof(T), cudaMemcpyHostToDevice));
  return dev;
}

// Collects result rows: prints each as "key=value ..." and writes them all as a JSON array.
class Report {
 public:
  explicit Report(const Args& args) : json_path_(args.str("json", "")) {}
  using Row = std::vector<std::pair<std::string, std::string>>;

  static std::string fmt(double v, int prec = 2) {
    char buf[64];
    std::snprintf(buf, sizeof(buf), "%.*f", prec, v);
    return buf;
  }

  void add(const Row& row) {
    std::string line;
    for (const auto& [k, v] : row) line += k + "=" + v + " ";
    std::printf("%s\n", line.c_str());
    std::fflush(stdout);
    rows_.push_back(row);
  }

  ~Report() {
    if (json_path_.empty()) return;
    FILE* f = std::fopen(json_path_.c_str(), "w");
    if (!f) {
      std::fprintf(stderr, "cannot write %s\n", json_path_.c_str());
      return;
    }
    std::fprintf(f, "[\n");
    for (size_t i = 0; i < rows_.size(); ++i) {
      std::fprintf(f, "  {");
      for (size_t j = 0; j < rows_[i].size(); ++j) {
        const auto& [k, v] = rows_[i][j];
        const bool numeric = !v.empty() &&
                             (std::isdigit(static_cast<unsigned char>(v[0])) || v[0] == '-') &&
                             v.find_first_not_of("0123456789.-e+") == std::string::npos;
        std::fprintf(f, "%s\"%s\": %s%s%s", j ? ", " : "", k.c_str(), numeric ? "" : "\"",
                     v.c_str(), numeric ? "" : "\"");
      }
      std::fprintf(f, "}%s\n", i + 1 < rows_.size() ? "," : "");
    }
    std::fprintf(f, "]\n");
    std::fclose(f);
  }

 private:
  std::string json_path_;
  std::vector<Row> rows_;
};

// Device name for the report rows.
inline std::string device_name() {
  cudaDeviceProp prop;
  BENCH_CHECK(cudaGetDeviceProperties(&prop, 0));
  return prop.name;
}

}  // namespace pyorch::bench
