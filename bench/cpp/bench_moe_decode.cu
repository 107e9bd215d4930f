// Benchmark of pyorch::fused_moe_decode (the decode MoE pair: gate_up with SiLU-and-mul, then down
// with the routing weights and the top-k sum) against the weight-read floor: the active experts'
// bytes at the in-run device-to-device copy bandwidth. Sweeps the pair's launch shapes
// (MoeDecodeConfig: gate_up's resident CTAs per SM, down's warps per CTA) beside the default.
//
// Each timed call routes its tokens anew (a pool of --routings random routings, cycled), as a
// decode step does: the active experts change from call to call, so their weights come from
// DRAM, not from the L2 the previous call left. Routing: each token takes top_k distinct random
// experts; the sort is moe_align_block_size's (pairs grouped by expert, each expert padded to the
// block size, 16 once experts average two pairs, else 8). Both kernels launch with PDL as in the
// engine. Every swept shape's output is checked against the default's (fp32 sums in another
// order: close, not equal).
// Shapes (common/moe_bench_util.h): qwen3_moe and mixtral by default, qwen3_235b on request.
// Flags: --shapes qwen3_moe,mixtral --tokens 1,2,8,16 --ctas 4,6,8 --warps 16,32
//        --prefetch 2,0,4,8 --routings 32 --iters 50 --legacy (the default is the old picks)
//        --json FILE
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include <cuda_bf16.h>

#include "common/bench_util.h"
#include "common/moe_bench_util.h"
#include "pyorch/launch.h"
#include "pyorch/moe_decode.h"

namespace {

using pyorch::bench::Args;
using pyorch::bench::Report;
using bf16 = __nv_bfloat16;

using pyorch::bench::MoeShape;

// One routing of M tokens in moe_align_block_size's layout, on the device.
struct Routing {
  int32_t* sorted_ids = nullptr;  // [num_sorted]
  int32_t* expert_ids = nullptr;  // [num_blocks]
  int32_t* num_post_pad = nullptr;
  float* weights = nullptr;  // [M * top_k]
  int64_t num_sorted = 0, num_blocks = 0, active_experts = 0;
};

Routing make_routing(int64_t m, const MoeShape& s, int64_t block, std::mt19937_64& rng) {
  const int64_t num_flat = m * s.top_k;
  std::vector<int32_t> ids(num_flat);
  std::vector<int32_t> perm(s.experts);
  std::iota(perm.begin(), perm.end(), 0);
  for (int64_t t = 0; t < m; ++t) {  // top_k distinct experts per token, as top-k picks them
    std::shuffle(perm.begin(), perm.end(), rng);
    for (int64_t j = 0; j < s.top_k; ++j) ids[t * s.top_k + j] = perm[j];
  }
  // The worst-case sizes moe_align_block_size allocates (pyorch/layers/fused_moe/fused_moe.py).
  const int64_t max_padded = num_flat + std::min(s.experts, num_flat) * (block - 1);
  const int64_t max_blocks = (max_padded + block - 1) / block;
  std::vector<int32_t> sorted(max_padded, static_cast<int32_t>(num_flat));
  std::vector<int32_t> experts(max_blocks, -1);
  int64_t pos = 0;
  Routing r;
  for (int32_t e = 0; e < s.experts; ++e) {
    const int64_t begin = pos;
    for (int64_t f = 0; f < num_flat; ++f) {
      if (ids[f] == e) sorted[pos++] = static_cast<int32_t>(f);
    }
    if (pos == begin) continue;
    ++r.active_experts;
    pos = begin + (pos - begin + block - 1) / block * block;
    for (int64_t b = begin / block; b < pos / block; ++b) experts[b] = e;
  }
  std::vector<float> w(num_flat);
  std::uniform_real_distribution<float> dist(0.05f, 1.f);
  for (auto& x : w) x = dist(rng);
  const int32_t post_pad = static_cast<int32_t>(pos);
  r.num_sorted = max_padded;
  r.num_blocks = max_blocks;
  BENCH_CHECK(cudaMalloc(&r.sorted_ids, max_padded * sizeof(int32_t)));
  BENCH_CHECK(cudaMalloc(&r.expert_ids, max_blocks * sizeof(int32_t)));
  BENCH_CHECK(cudaMalloc(&r.num_post_pad, sizeof(int32_t)));
  BENCH_CHECK(cudaMalloc(&r.weights, num_flat * sizeof(float)));
  BENCH_CHECK(cudaMemcpy(r.sorted_ids, sorted.data(), max_padded * sizeof(int32_t),
                         cudaMemcpyHostToDevice));
  BENCH_CHECK(cudaMemcpy(r.expert_ids, experts.data(), max_blocks * sizeof(int32_t),
                         cudaMemcpyHostToDevice));
  BENCH_CHECK(cudaMemcpy(r.num_post_pad, &post_pad, sizeof(int32_t), cudaMemcpyHostToDevice));
  BENCH_CHECK(cudaMemcpy(r.weights, w.data(), num_flat * sizeof(float), cudaMemcpyHostToDevice));
  return r;
}

void free_routing(Routing& r) {
  BENCH_CHECK(cudaFree(r.sorted_ids));
  BENCH_CHECK(cudaFree(r.expert_ids));
  BENCH_CHECK(cudaFree(r.num_post_pad));
  BENCH_CHECK(cudaFree(r.weights));
}

std::vector<float> to_host(const bf16* dev, size_t n) {
  std::vector<bf16> h(n);
  BENCH_CHECK(cudaMemcpy(h.data(), dev, n * sizeof(bf16), cudaMemcpyDeviceToHost));
  std::vector<float> out(n);
  for (size_t i = 0; i < n; ++i) out[i] = __bfloat162float(h[i]);
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  Args args(argc, argv);
  Report report(args);
  const std::vector<std::string> names = args.strs("shapes", {"qwen3_moe", "mixtral"});
  const std::vector<int64_t> token_counts = args.list("tokens", {1, 2, 8, 16});
  const int num_routings = static_cast<int>(args.num("routings", 32));
  const int iters = static_cast<int>(args.num("iters", 50));
  pyorch::set_moe_decode_legacy_picks(args.has("legacy"));
  cudaStream_t stream;
  BENCH_CHECK(cudaStreamCreate(&stream));
  const double copy_gbs = pyorch::bench::copy_bandwidth_gbs(stream);
  std::printf("copy bandwidth %.1f GB/s (read + written); PDL %s\n", copy_gbs,
              pyorch::pdl_enabled() ? "on" : "off");
  // (gate_up CTAs per SM, down warps, down prefetch slices); the default first.
  struct Shape3 {
    int ctas, warps, prefetch;
  };
  std::vector<Shape3> sweep;
  for (int ctas : args.list("ctas", {4, 6, 8})) {
    for (int warps : args.list("warps", {16, 32})) {
      for (int prefetch : args.list("prefetch", {2, 0, 4, 8})) {
        sweep.push_back({ctas, warps, prefetch});
      }
    }
  }
  for (const MoeShape& s : pyorch::bench::kMoeShapes) {
    if (std::find(names.begin(), names.end(), s.name) == names.end()) continue;
    const size_t w13_elems = size_t(s.experts) * 2 * s.inter * s.hidden;
    const size_t w2_elems = size_t(s.experts) * s.hidden * s.inter;
    // Weights of unit-scale products: uniform with the variance of 1 / fan-in.
    auto* w13 = static_cast<bf16*>(pyorch::bench::moe_bench_random(
        w13_elems, sizeof(bf16), 1, 2.f * std::sqrt(3.f / float(s.hidden))));
    auto* w2 = static_cast<bf16*>(pyorch::bench::moe_bench_random(
        w2_elems, sizeof(bf16), 2, 2.f * std::sqrt(3.f / float(s.inter))));
    for (int64_t m : token_counts) {
      const int64_t num_flat = m * s.top_k;
      const int64_t block = num_flat >= 2 * s.experts ? 16 : 8;
      std::mt19937_64 rng(1234 + m);
      std::vector<Routing> routings;
      double active = 0;
      for (int i = 0; i < num_routings; ++i) {
        routings.push_back(make_routing(m, s, block, rng));
        active += routings.back().active_experts;
      }
      active /= num_routings;
      auto* x = static_cast<bf16*>(
          pyorch::bench::moe_bench_random(size_t(m) * s.hidden, sizeof(bf16), 3, 2.f));
      bf16* out = nullptr;
      bf16* act = nullptr;
      BENCH_CHECK(cudaMalloc(&out, size_t(m) * s.hidden * sizeof(bf16)));
      BENCH_CHECK(cudaMalloc(&act, size_t(num_flat) * s.inter * sizeof(bf16)));
      const double floor_us = active * 3.0 * s.hidden * s.inter * sizeof(bf16) / (copy_gbs * 1e3);
      const pyorch::MoeDecodeConfig def =
          pyorch::default_moe_decode_config(m, routings[0].num_blocks, s.inter);
      std::printf(
          "default for %s at %lld tokens: gate_up_ctas_per_sm=%d down_warps=%d "
          "down_prefetch_slices=%d%s\n",
          s.name.c_str(), static_cast<long long>(m), def.gate_up_ctas_per_sm, def.down_warps,
          def.down_prefetch_slices, pyorch::moe_decode_legacy_picks() ? " (legacy picks)" : "");
      auto run = [&](const pyorch::MoeDecodeConfig* cfg, const Routing& r, cudaStream_t st) {
        return pyorch::fused_moe_decode(out, act, x, w13, w2, r.weights, r.sorted_ids, r.expert_ids,
                                        r.num_post_pad, pyorch::DType::kBFloat16, m, s.top_k,
                                        r.num_sorted, r.num_blocks, s.experts, s.hidden, s.inter,
                                        s.hidden, block, pyorch::pdl_enabled(), st, cfg);
      };
      BENCH_CHECK(run(nullptr, routings[0], stream));
      BENCH_CHECK(cudaStreamSynchronize(stream));
      const std::vector<float> want = to_host(out, size_t(m) * s.hidden);
      double default_us = 0;
      for (const auto& [ctas, warps, prefetch] : sweep) {
        pyorch::MoeDecodeConfig cfg;
        cfg.gate_up_ctas_per_sm = ctas;
        cfg.down_warps = warps;
        cfg.down_prefetch_slices = prefetch;
        const bool is_default = ctas == def.gate_up_ctas_per_sm && warps == def.down_warps &&
                                prefetch == def.down_prefetch_slices;
        if (run(&cfg, routings[0], stream) != cudaSuccess) {  // a shape this M cannot take
          (void)cudaGetLastError();
          report.add({{"shape", s.name},
                      {"tokens", std::to_string(m)},
                      {"gate_up_ctas_per_sm", std::to_string(ctas)},
                      {"down_warps", std::to_string(warps)},
                      {"down_prefetch_slices", std::to_string(prefetch)},
                      {"status", "unsupported"}});
          continue;
        }
        BENCH_CHECK(cudaStreamSynchronize(stream));
        const std::vector<float> got = to_host(out, size_t(m) * s.hidden);
        double max_err = 0, max_ref = 0;
        for (size_t i = 0; i < got.size(); ++i) {
          max_err = std::max(max_err, double(std::fabs(got[i] - want[i])));
          max_ref = std::max(max_ref, double(std::fabs(want[i])));
        }
        const bool ok = max_err <= 2e-2 * std::max(max_ref, 1e-3);
        int next = 0;
        const double us = pyorch::bench::time_us(
            [&](cudaStream_t st) {
              BENCH_CHECK(run(&cfg, routings[next], st));
              next = (next + 1) % num_routings;
            },
            stream, 5, iters);
        if (is_default) default_us = us;
        report.add({{"shape", s.name},
                    {"tokens", std::to_string(m)},
                    {"block", std::to_string(block)},
                    {"active_experts", Report::fmt(active, 1)},
                    {"gate_up_ctas_per_sm", std::to_string(ctas)},
                    {"down_warps", std::to_string(warps)},
                    {"down_prefetch_slices", std::to_string(prefetch)},
                    {"default", is_default ? "1" : "0"},
                    {"pair_us", Report::fmt(us)},
                    {"floor_us", Report::fmt(floor_us)},
                    {"floor_fraction", Report::fmt(floor_us / us, 3)},
                    {"vs_default", default_us > 0 ? Report::fmt(default_us / us, 3) : "-"},
                    {"check", ok ? "PASS" : "FAIL"}});
      }
      for (auto& r : routings) free_routing(r);
      BENCH_CHECK(cudaFree(x));
      BENCH_CHECK(cudaFree(out));
      BENCH_CHECK(cudaFree(act));
    }
    BENCH_CHECK(cudaFree(w13));
    BENCH_CHECK(cudaFree(w2));
  }
  BENCH_CHECK(cudaStreamDestroy(stream));
  return 0;  // the report writes its JSON as it goes out of scope
}
