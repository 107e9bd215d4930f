// The W4A16 C API (pyorch/w4a16.h): argument checks, the k-split choice and the dtype switch.
#include <algorithm>
#include <atomic>

#include "pyorch/w4a16.h"
#include "w4a16/w4a16_gemm.cuh"
#include "w4a16/w4a16_repack.cuh"
#include "w4a16/w4a16_stream.cuh"
#include "w4a16/w4a16_tiled.cuh"

namespace pyorch {

namespace {

// Thread blocks the k-split aims for per SM (set_w4a16_ctas_per_sm): 4 x 4 warps keep ~32 KiB
// of codes in flight per SM with register stages, 4 x 4 x 8 KiB with the stream kernel's rings.
std::atomic<int> g_ctas_per_sm{4};
// The decode kernel for m <= kW4A16StreamMaxRows (set_w4a16_kernel) and its ring depth.
std::atomic<int> g_kernel{static_cast<int>(W4A16Kernel::kStream)};
// H100, Llama-3-8B / 70B shapes at M = 1, 4, 16 (bench_w4a16 --stages): with the per-block form,
// 2 slots beat 4 on every shape (8B gate_up 42 against 65 us, 70B gate_up 149 against 228) and 8
// was slowest (89, 307). With the grouped form in 8-block chunks, 1 slot beat 2 and 4 at M = 1
// (8B decode chain 2.39 / 2.72 / 3.68 ms; 70B gate_up 106 / 150 / 166 us) and tied at M = 16:
// the shared memory of deeper rings costs resident blocks and the L1 the activations are read
// through, and the time follows those, not the bytes in flight. In 4-block chunks (the default,
// g_stream_chunk) 2 slots hold the same 16 KiB per thread block as 8 x 1 and were a little faster.
std::atomic<int> g_stream_stages{2};
// The stream kernel's activation prefetch (set_w4a16_prefetch_acts). H100 A/B, two runs each
// (bench/results/NVIDIA_H100_80GB_HBM3/w4a16/prefetch_acts_ab_20261127/), on / off: 70B gate_up
// M = 1 140 / 139 against 157 / 154 us; 8B chain M = 8 3.36 / 3.36 against 3.50 / 3.50 ms, M = 16
// 5.40 / 5.40 against 5.51 / 5.50; 8B chain M = 1 3.14 / 3.17 against 2.99 / 3.21 (within the
// spread). Every check passed with it on.
std::atomic<bool> g_prefetch_acts{true};
// The grouped stream kernel's chunk (set_w4a16_stream_chunk). H100, bench_w4a16 at M = 1..16
// (bench/results/NVIDIA_H100_80GB_HBM3/w4a16/stream_grouped_20261127): 4 blocks x 2 slots beat
// 8 x 1 (the same shared memory) on 30 of 32 shapes, 8B decode chain 2.27 against 2.40 ms at
// M = 1, 3.57 against 3.72 at M = 16.
std::atomic<int> g_stream_chunk{4};
// Whether the grouped stream kernel's groups of 128 get their scales by the ring slots' bulk
// copies (set_w4a16_stream_scales_by_copy) instead of global loads into registers. H100, one
// machine, registers / by copy (bench/results/NVIDIA_H100_80GB_HBM3/w4a16/waves_20261128, run 0
// and 1): bench_w4a16 8B decode chain at M = 1 2.10 / 2.21 ms, 70B gate_up M = 1 86.0 / 89.3 us;
// 8B GPTQ engine decode, alternated twice, 2.864, 2.871 / 2.872, 2.865 ms/token (a tie). Off.
std::atomic<bool> g_stream_scales_by_copy{false};
// Fewest k-blocks (64 rows each) one split streams: shorter ones spend more on the partials.
constexpr int64_t kW4MinBlocksPerSplit = 2;
// k-blocks each warp keeps requested from L2 ahead of its register stages (set_w4a16_l2_prefetch).
// The first H100 run without it streamed 1.0-1.45 TB/s of codes (35-48% of copy): latency-bound,
// the warps had too few bytes in flight.
std::atomic<int> g_prefetch_blocks{8};

// The tiled kernel's first row count (set_w4a16_tiled_min_rows) and the adapter's last row count
// for gptq_marlin_gemm before dequantize + cuBLAS (set_w4a16_mma_max_rows).
std::atomic<int64_t> g_tiled_min_rows{kW4A16DefaultTiledMinRows};
std::atomic<int64_t> g_mma_max_rows{0};  // auto
std::atomic<int64_t> g_dequant_chunk_bytes{int64_t{64} << 20};
// The tiled kernel's k-split: thread blocks it aims for per SM (8 warps each, about 2 resident)
// and the fewest k-blocks per split.
constexpr int64_t kW4TiledCtasPerSm = 2;
constexpr int64_t kW4TiledMinBlocksPerSplit = 4;

int w4_num_sms() {  // 132 (an H100) when unknown: the choice only affects speed
  const int count = current_device_sm_count();
  return count > 0 ? count : 132;
}

enum class W4Path { kStream, kRegisters, kTiled };

W4Path w4_path(int64_t size_m) {
  if (size_m >= g_tiled_min_rows.load(std::memory_order_relaxed)) return W4Path::kTiled;
  if (size_m <= kW4A16StreamMaxRows &&
      g_kernel.load(std::memory_order_relaxed) == static_cast<int>(W4A16Kernel::kStream)) {
    return W4Path::kStream;
  }
  return W4Path::kRegisters;
}

// k-blocks per split: enough thread blocks for target_blocks, at least min_per_split each.
int64_t w4_split_blocks(int64_t kblocks, int64_t tiles, int64_t target_blocks,
                        int64_t min_per_split) {
  const int64_t splits = std::max<int64_t>(1, (target_blocks + tiles - 1) / tiles);
  const int64_t per_split = std::max((kblocks + splits - 1) / splits, min_per_split);
  return std::max<int64_t>(1, std::min(kblocks, per_split));
}

// Resident thread blocks per SM of the stream kernel's row form (kernels::
// w4_stream_resident_blocks), cached per form, chunk and ring depth (one GPU model per process).
int w4_stream_resident(int m_tiles, bool acts_ahead) {
  static std::atomic<int> cache[2][2][2][4];  // 0: not asked yet; -1: the query failed
  const int chunk = g_stream_chunk.load(std::memory_order_relaxed);
  const int log2_stages = kernels::w4_stream_log2_stages(g_stream_stages.load());
  std::atomic<int>& slot = cache[m_tiles > 1][acts_ahead][chunk > 4][std::min(log2_stages, 3)];
  int blocks = slot.load(std::memory_order_relaxed);
  if (blocks == 0) {
    blocks = kernels::w4_stream_resident_blocks(m_tiles, acts_ahead, chunk, 1 << log2_stages);
    if (blocks <= 0) blocks = -1;
    slot.store(blocks, std::memory_order_relaxed);
  }
  return blocks;
}

// The stream kernel's launch for m <= kW4A16StreamMaxRows: k-blocks per split, and whether the
// 9..16-row form loads activations a k-block ahead.
struct W4StreamPlan {
  int64_t blocks_per_split;
  bool acts_ahead;
};

// The k-split aims at g_ctas_per_sm thread blocks per SM, but never at more than stay resident at
// once: a last partial wave of blocks streams with few warps per SM. Where even one split
// overflows them, the 9..16-row form drops its activation look-ahead (8 resident blocks of 64
// registers instead of 5 of 96). H100, bench_w4a16 at M = 16, before / after, one machine
// (bench/results/NVIDIA_H100_80GB_HBM3/w4a16/waves_20261128, run 3): 8B gate_up 50.5 / 39.3 us
// (2 splits, 896 blocks for 660 places, against 1 split); 70B gate_up 160.0 / 141.6 (896 column
// groups, the lean form); 8B decode chain 3.44 / 2.95 ms. Up to 8 rows nothing changes on
// Llama shapes (8 resident blocks already hold every split).
W4StreamPlan w4_stream_plan(int64_t size_m, int64_t size_n, int64_t size_k) {
  const int64_t kblocks = size_k / kW4A16BlockK;
  const int64_t column_groups = (size_n + kW4A16BlockN - 1) / kW4A16BlockN;
  const int64_t sms = w4_num_sms();
  int64_t per_split = w4_split_blocks(kblocks, column_groups,
                                      int64_t{g_ctas_per_sm.load(std::memory_order_relaxed)} * sms,
                                      kW4MinBlocksPerSplit);
  const int m_tiles = size_m <= 8 ? 1 : 2;
  bool acts_ahead = true;
  int64_t resident = w4_stream_resident(m_tiles, true);
  if (m_tiles == 2 && resident > 0 && column_groups > resident * sms) {
    const int64_t lean = w4_stream_resident(2, false);
    if (lean > resident) {
      acts_ahead = false;
      resident = lean;
    }
  }
  if (resident > 0) {
    const int64_t max_splits = std::max<int64_t>(1, resident * sms / column_groups);
    if ((kblocks + per_split - 1) / per_split > max_splits) {
      per_split = (kblocks + max_splits - 1) / max_splits;
    }
  }
  // The grouped form places the ends of 128-row groups at fixed k-blocks when every split starts
  // on an even k-block.
  return {std::min(kblocks, (per_split + 1) / 2 * 2), acts_ahead};
}

int64_t w4_blocks_per_split(int64_t size_m, int64_t size_n, int64_t size_k) {
  const int64_t kblocks = size_k / kW4A16BlockK;
  if (w4_path(size_m) == W4Path::kStream)
    return w4_stream_plan(size_m, size_n, size_k).blocks_per_split;
  if (w4_path(size_m) == W4Path::kTiled) {
    const int64_t block_m = kernels::w4_tiled_block_m(size_m);
    const int64_t tiles = (size_m + block_m - 1) / block_m *
                          ((size_n + kernels::kW4TiledBlockN - 1) / kernels::kW4TiledBlockN);
    // One arrival counter per tile, in a workspace of ceil(size_n / kW4A16BlockN) ints.
    if (tiles > (size_n + kW4A16BlockN - 1) / kW4A16BlockN) return kblocks;
    return w4_split_blocks(kblocks, tiles, kW4TiledCtasPerSm * w4_num_sms(),
                           kW4TiledMinBlocksPerSplit);
  }
  const int64_t column_groups = (size_n + kW4A16BlockN - 1) / kW4A16BlockN;
  return w4_split_blocks(kblocks, column_groups,
                         int64_t{g_ctas_per_sm.load(std::memory_order_relaxed)} * w4_num_sms(),
                         kW4MinBlocksPerSplit);
}

bool w4_shape_ok(int64_t size_n, int64_t size_k) {
  return size_n > 0 && size_k > 0 && size_n % kW4A16TileN == 0 && size_k % kW4A16BlockK == 0;
}

}  // namespace

void set_w4a16_l2_prefetch(int blocks) { g_prefetch_blocks.store(blocks < 0 ? 0 : blocks); }

int w4a16_l2_prefetch() { return g_prefetch_blocks.load(); }

void set_w4a16_kernel(W4A16Kernel kernel) { g_kernel.store(static_cast<int>(kernel)); }

W4A16Kernel w4a16_kernel() { return static_cast<W4A16Kernel>(g_kernel.load()); }

void set_w4a16_stream_stages(int stages) {
  g_stream_stages.store(std::clamp(stages, 1, kernels::kW4StreamMaxStages));
}

int w4a16_stream_stages() { return g_stream_stages.load(); }

void set_w4a16_prefetch_acts(bool on) { g_prefetch_acts.store(on); }

bool w4a16_prefetch_acts() { return g_prefetch_acts.load(); }

void set_w4a16_stream_chunk(int blocks) { g_stream_chunk.store(blocks <= 4 ? 4 : 8); }

int w4a16_stream_chunk() { return g_stream_chunk.load(); }

void set_w4a16_stream_scales_by_copy(bool on) { g_stream_scales_by_copy.store(on); }

bool w4a16_stream_scales_by_copy() { return g_stream_scales_by_copy.load(); }

void set_w4a16_ctas_per_sm(int ctas) { g_ctas_per_sm.store(std::max(ctas, 1)); }

int w4a16_ctas_per_sm() { return g_ctas_per_sm.load(); }

void set_w4a16_tiled_min_rows(int64_t rows) {
  g_tiled_min_rows.store(std::clamp<int64_t>(rows, 1, kW4A16RegistersMaxRows + 1));
}

int64_t w4a16_tiled_min_rows() { return g_tiled_min_rows.load(); }

void set_w4a16_mma_max_rows(int64_t rows) { g_mma_max_rows.store(std::max<int64_t>(rows, 0)); }

int64_t w4a16_mma_max_rows() { return g_mma_max_rows.load(); }

bool w4a16_mma_path(int64_t size_m, int64_t size_n, int64_t size_k) {
  const int64_t max_rows = g_mma_max_rows.load(std::memory_order_relaxed);
  if (max_rows > 0) return size_m <= max_rows;
  return size_m <= kW4A16MmaRows ||
         (size_m <= kW4A16MmaMaxRowsLarge && size_n * size_k >= kW4A16MmaLargeWeight);
}

void set_w4a16_dequant_chunk_bytes(int64_t bytes) {
  g_dequant_chunk_bytes.store(std::max<int64_t>(bytes, 1));
}

int64_t w4a16_dequant_chunk_cols(int64_t size_n, int64_t size_k, int64_t elem_bytes) {
  const int64_t bytes = g_dequant_chunk_bytes.load(std::memory_order_relaxed);
  const int64_t cols =
      bytes / std::max<int64_t>(size_k * elem_bytes, 1) / kW4A16TileN * kW4A16TileN;
  return std::max(kW4A16TileN, std::min(cols, size_n));
}

const char* w4a16_kernel_name(int64_t size_m) {
  switch (w4_path(size_m)) {
    case W4Path::kStream: return "stream";
    case W4Path::kRegisters: return "registers";
    case W4Path::kTiled: return "tiled";
  }
  return "?";
}

bool w4a16_stream_acts_ahead(int64_t size_m, int64_t size_n, int64_t size_k) {
  if (!w4_shape_ok(size_n, size_k) || size_m <= 0 || w4_path(size_m) != W4Path::kStream)
    return true;
  return w4_stream_plan(size_m, size_n, size_k).acts_ahead;
}

int64_t w4a16_num_splits(int64_t size_m, int64_t size_n, int64_t size_k) {
  if (!w4_shape_ok(size_n, size_k) || size_m <= 0) return 1;
  const int64_t per_split = w4_blocks_per_split(size_m, size_n, size_k);
  return (size_k / kW4A16BlockK + per_split - 1) / per_split;
}

int64_t w4a16_partials_size(int64_t size_m, int64_t size_n, int64_t size_k) {
  const int64_t splits = w4a16_num_splits(size_m, size_n, size_k);
  return splits > 1 ? splits * size_m * size_n : 0;
}

cudaError_t gptq_marlin_repack(int32_t* out, const int32_t* b_q_weight, const int32_t* perm,
                               int64_t size_k, int64_t size_n, cudaStream_t stream) {
  if (!w4_shape_ok(size_n, size_k)) {
    PYORCH_INVALID("gptq_marlin_repack: size_k %lld must be a multiple of 64, size_n %lld of 16",
                   static_cast<long long>(size_k), static_cast<long long>(size_n));
  }
  kernels::w4a16_repack_kernel<false>
      <<<kernels::w4_helper_blocks(size_k * size_n / 8), kernels::kW4HelperThreads, 0, stream>>>(
          reinterpret_cast<uint32_t*>(out), reinterpret_cast<const uint32_t*>(b_q_weight), perm,
          size_k, size_n);
  return cudaGetLastError();
}

cudaError_t awq_marlin_repack(int32_t* out, const int32_t* b_q_weight, int64_t size_k,
                              int64_t size_n, cudaStream_t stream) {
  if (!w4_shape_ok(size_n, size_k)) {
    PYORCH_INVALID("awq_marlin_repack: size_k %lld must be a multiple of 64, size_n %lld of 16",
                   static_cast<long long>(size_k), static_cast<long long>(size_n));
  }
  kernels::w4a16_repack_kernel<true>
      <<<kernels::w4_helper_blocks(size_k * size_n / 8), kernels::kW4HelperThreads, 0, stream>>>(
          reinterpret_cast<uint32_t*>(out), reinterpret_cast<const uint32_t*>(b_q_weight), nullptr,
          size_k, size_n);
  return cudaGetLastError();
}

cudaError_t w4a16_permute_cols(void* a_out, const void* a, const int32_t* perm, DType dtype,
                               int64_t size_m, int64_t size_k, int64_t a_stride,
                               cudaStream_t stream) {
  if (size_m * size_k == 0) return cudaSuccess;
  return PYORCH_DISPATCH_HALF_TYPES(dtype, T, [&] {
    kernels::w4a16_permute_cols_kernel<T>
        <<<kernels::w4_helper_blocks(size_m * size_k), kernels::kW4HelperThreads, 0, stream>>>(
            static_cast<T*>(a_out), static_cast<const T*>(a), perm, size_m, size_k, a_stride);
    return cudaGetLastError();
  });
}

cudaError_t w4a16_dequantize(void* out, const int32_t* b_q, const void* scales,
                             const int32_t* zeros, W4A16Type type, DType dtype, int64_t size_n,
                             int64_t size_k, int64_t group_size, int64_t n_begin, int64_t n_count,
                             cudaStream_t stream) {
  if (!w4_shape_ok(size_n, size_k) || group_size <= 0 || size_k % group_size != 0 ||
      n_begin % kW4A16TileN != 0 || n_count % kW4A16TileN != 0 || n_begin + n_count > size_n) {
    PYORCH_INVALID("w4a16_dequantize: bad shape");
  }
  if ((type == W4A16Type::kUint4) != (zeros != nullptr)) {
    PYORCH_INVALID("w4a16_dequantize: zero points go with uint4 and only with it");
  }
  if (n_count == 0) return cudaSuccess;
  if (group_size % 16 != 0) PYORCH_INVALID("w4a16_dequantize: group_size must be a multiple of 16");
  if (reinterpret_cast<uintptr_t>(out) % 16 != 0) {
    PYORCH_INVALID("w4a16_dequantize: out must be 16-byte aligned");
  }
  kernels::W4A16GemmArgs p{};
  p.b_q = reinterpret_cast<const uint4*>(b_q);
  p.scales = scales;
  p.zeros = reinterpret_cast<const uint32_t*>(zeros);
  p.n = static_cast<int>(size_n);
  p.k = static_cast<int>(size_k);
  p.group_size = static_cast<int>(group_size);
  p.group_shift = (group_size & (group_size - 1)) == 0 ? __builtin_ctzll(group_size) : -1;
  // One thread per 16 bytes of codes: 32 per (n-tile, k-block).
  const unsigned blocks = kernels::w4_helper_blocks(n_count * size_k / 32);
  return PYORCH_DISPATCH_HALF_TYPES(dtype, T, [&] {
    if (zeros != nullptr) {
      kernels::w4a16_dequantize_kernel<T, true><<<blocks, kernels::kW4HelperThreads, 0, stream>>>(
          static_cast<T*>(out), p, n_begin, n_count);
    } else {
      kernels::w4a16_dequantize_kernel<T, false><<<blocks, kernels::kW4HelperThreads, 0, stream>>>(
          static_cast<T*>(out), p, n_begin, n_count);
    }
    return cudaGetLastError();
  });
}

cudaError_t gptq_marlin_gemm(void* out, const void* a, const int32_t* b_q, const void* scales,
                             const int32_t* zeros, const int32_t* perm, void* a_perm_buffer,
                             int32_t* workspace, float* partials, W4A16Type type, DType dtype,
                             int64_t size_m, int64_t size_n, int64_t size_k, int64_t group_size,
                             int64_t a_stride, int64_t out_stride, cudaStream_t stream) {
  if (!w4_shape_ok(size_n, size_k) || group_size <= 0 || group_size % 16 != 0 ||
      size_k % group_size != 0) {
    PYORCH_INVALID(
        "gptq_marlin_gemm: size_k %lld (a multiple of 64 and of group_size %lld, itself"
        " a multiple of 16), size_n %lld (a multiple of 16)",
        static_cast<long long>(size_k), static_cast<long long>(group_size),
        static_cast<long long>(size_n));
  }
  if (size_m < 0 || size_m > INT32_MAX) {
    PYORCH_INVALID("gptq_marlin_gemm: size_m %lld out of range", static_cast<long long>(size_m));
  }
  if ((type == W4A16Type::kUint4) != (zeros != nullptr)) {
    PYORCH_INVALID("gptq_marlin_gemm: zero points go with uint4 and only with it");
  }
  if (size_m == 0) return cudaSuccess;
  if (perm != nullptr) {
    PYORCH_RETURN_IF_ERROR(
        w4a16_permute_cols(a_perm_buffer, a, perm, dtype, size_m, size_k, a_stride, stream));
    a = a_perm_buffer;
    a_stride = size_k;
  }
  kernels::W4A16GemmArgs p;
  p.out = out;
  p.a = a;
  p.b_q = reinterpret_cast<const uint4*>(b_q);
  p.scales = scales;
  p.zeros = reinterpret_cast<const uint32_t*>(zeros);
  p.counters = workspace;
  p.partials = partials;
  p.m = static_cast<int>(size_m);
  p.n = static_cast<int>(size_n);
  p.k = static_cast<int>(size_k);
  p.group_size = static_cast<int>(group_size);
  p.a_stride = a_stride;
  p.out_stride = out_stride;
  const W4Path path = w4_path(size_m);
  const W4StreamPlan plan =
      path == W4Path::kStream ? w4_stream_plan(size_m, size_n, size_k) : W4StreamPlan{0, true};
  p.blocks_per_split =
      static_cast<int>(path == W4Path::kStream ? plan.blocks_per_split
                                               : w4_blocks_per_split(size_m, size_n, size_k));
  p.num_splits =
      (p.k / static_cast<int>(kW4A16BlockK) + p.blocks_per_split - 1) / p.blocks_per_split;
  p.group_shift = (group_size & (group_size - 1)) == 0 ? __builtin_ctzll(group_size) : -1;
  p.prefetch_blocks = g_prefetch_blocks.load(std::memory_order_relaxed);
  if (path == W4Path::kRegisters && size_m > kW4A16RegistersMaxRows) {
    PYORCH_INVALID("gptq_marlin_gemm: the registers kernel takes at most %lld rows, got %lld",
                   static_cast<long long>(kW4A16RegistersMaxRows), static_cast<long long>(size_m));
  }
  const int stages = g_stream_stages.load(std::memory_order_relaxed);
  const bool prefetch_acts = g_prefetch_acts.load(std::memory_order_relaxed);
  const int chunk = g_stream_chunk.load(std::memory_order_relaxed);
  const bool by_copy = g_stream_scales_by_copy.load(std::memory_order_relaxed);
  return PYORCH_DISPATCH_HALF_TYPES(dtype, T, [&] {
    switch (path) {
      case W4Path::kStream:
        return kernels::launch_w4a16_stream<T>(p, zeros != nullptr, stages, prefetch_acts, chunk,
                                               by_copy, plan.acts_ahead, stream);
      case W4Path::kTiled: return kernels::launch_w4a16_tiled<T>(p, zeros != nullptr, stream);
      case W4Path::kRegisters: break;
    }
    return kernels::launch_w4a16_gemm<T>(p, zeros != nullptr, stream);
  });
}

}  // namespace pyorch
