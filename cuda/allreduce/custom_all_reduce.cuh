// Custom all-reduce kernels over CUDA-IPC-mapped buffers, with per-block flag barriers. See
// cuda/include/pyorch/custom_all_reduce.h for the contract.
//
// Each rank's buffer: [Signal][message buffer 0][message buffer 1][push area 0][push area 1].
// A message buffer is max_bytes; a push area holds one slot of push_bytes (min(max_bytes,
// kPushMaxBytes)) per source rank. A call runs one kernel per rank with the same grid on every
// rank, and only block b of every rank meet at a barrier, so the index mapping (the same on every
// rank) decides which elements each barrier covers.
//
// - one-shot push (kOneShotPush, and the fused all-reduce + residual add + RMSNorm): block b
//   stores its part of the input straight into its slot of every rank's push area (remote
//   stores are posted: no round trip), meets block b of every rank, then sums the slots of its
//   own push area with local loads. One NVLink crossing per call.
// - one-shot pull (kOneShot): block b copies its part into its own message buffer, meets the
//   peers, then loads the peers' buffers (a remote round trip per load).
// - two-shot (kTwoShot): as pull, but rank q reduces partition q and the peers gather it after a
//   second barrier (bandwidth-bound sizes, more than two ranks).
//
// The barrier is one release store per peer after __syncthreads (the release is cumulative: it
// publishes every write the block made before the __syncthreads, local or remote) and an acquire
// spin on the own flags; no per-thread __threadfence_system.
//
// Why no barrier at the end: consecutive calls alternate between the two message buffers and the
// two push areas (the parity of the call counter kept in the rank's own Signal, one copy per
// block slot, all equal between calls; device memory, so CUDA-graph replays alternate too). A
// rank writes buffer p (its own, or a peer's push slot) at call n + 2 only after its call n + 1
// passed its start barrier in block 0, so every peer had started call n + 1, so (stream order)
// every peer's call n, the last reader of buffer p, had finished. Flags are call numbers compared
// with `>=` (in wrapping arithmetic), so a fast rank's next flag cannot hide the current one from
// a slow peer.
#pragma once

#include <cstdint>

#include "common/dtype.cuh"
#include "common/launch.cuh"
#include "common/reduce.cuh"
#include "pyorch/custom_all_reduce.h"

namespace pyorch::kernels {

constexpr int kAllReduceMaxBlocks = 64;     // signal slots; the launch uses at most this many
constexpr int kAllReduceLaunchBlocks = 36;  // blocks a call launches at most
constexpr int kAllReduceThreads = 512;
// Largest message the push kernels take (each rank's push areas: 2 x 8 slots of this).
constexpr int64_t kPushMaxBytes = 512 << 10;

struct alignas(128) AllReduceSignal {
  uint32_t start[kAllReduceMaxBlocks][kCustomAllReduceMaxRanks];  // written by peers
  uint32_t mid[kAllReduceMaxBlocks][kCustomAllReduceMaxRanks];    // written by peers (two-shot)
  uint32_t counter[kAllReduceMaxBlocks];                          // own: calls made by block b
  // The split fused norm (all_reduce_rms_norm_split_kernel): block b's partial sum of squares of
  // its part of a row, published by norm_flag[b] = call number. Own rank only.
  float norm_partial[kAllReduceMaxBlocks];
  uint32_t norm_flag[kAllReduceMaxBlocks];
};
constexpr int64_t kAllReduceSignalBytes = (sizeof(AllReduceSignal) + 255) / 256 * 256;

__host__ __device__ __forceinline__ int64_t push_slot_bytes(int64_t max_bytes) {
  return max_bytes < kPushMaxBytes ? max_bytes : kPushMaxBytes;
}

// Every rank's buffer base as mapped in this process, passed by value (graph-capture safe).
struct RankBuffers {
  char* ptr[kCustomAllReduceMaxRanks];
};

// Release stores and acquire loads of a flag at system scope (the peers' GPUs see it) or, with
// kGpu, at GPU scope (this GPU's other blocks only: the split fused norm's partial sums).
template <bool kGpu = false>
__device__ __forceinline__ void store_release(uint32_t* addr, uint32_t value) {
  if constexpr (kGpu) {
    asm volatile("st.release.gpu.global.u32 [%1], %0;" ::"r"(value), "l"(addr) : "memory");
  } else {
    asm volatile("st.release.sys.global.u32 [%1], %0;" ::"r"(value), "l"(addr) : "memory");
  }
}

template <bool kGpu = false>
__device__ __forceinline__ uint32_t load_acquire(const uint32_t* addr) {
  uint32_t value;
  if constexpr (kGpu) {
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(value) : "l"(addr) : "memory");
  } else {
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(value) : "l"(addr) : "memory");
  }
  return value;
}

// Block b of this rank meets block b of every rank. slots(signal) picks the flag row (start or
// mid). Every write the block made before it (own buffer or a peer's) is visible to the peers
// after it: the __syncthreads orders them before the release store of thread `peer`, and a
// release is cumulative.
template <int NRANKS, typename Slots>
__device__ __forceinline__ void block_barrier(const RankBuffers& bufs, int rank, uint32_t flag,
                                              Slots slots) {
  __syncthreads();
  if (threadIdx.x < NRANKS) {
    auto* peer = reinterpret_cast<AllReduceSignal*>(bufs.ptr[threadIdx.x]);
    auto* self = reinterpret_cast<AllReduceSignal*>(bufs.ptr[rank]);
    store_release(&slots(peer)[rank], flag);
    const uint32_t* mine = &slots(self)[threadIdx.x];
    while (static_cast<int32_t>(load_acquire(mine) - flag) < 0) {
    }
  }
  __syncthreads();
}

using Pack = uint4;  // 16 bytes: the unit every thread moves

template <typename T>
struct PackAcc {
  static constexpr int kElems = sizeof(Pack) / sizeof(T);
  float v[kElems];

  __device__ __forceinline__ void set(const Pack& p) {
    const T* e = reinterpret_cast<const T*>(&p);
#pragma unroll
    for (int i = 0; i < kElems; ++i) v[i] = to_float(e[i]);
  }
  __device__ __forceinline__ void add(const Pack& p) {
    const T* e = reinterpret_cast<const T*>(&p);
#pragma unroll
    for (int i = 0; i < kElems; ++i) v[i] += to_float(e[i]);
  }
  __device__ __forceinline__ Pack get() const {
    Pack p;
    T* e = reinterpret_cast<T*>(&p);
#pragma unroll
    for (int i = 0; i < kElems; ++i) e[i] = from_float<T>(v[i]);
    return p;
  }
};

// Rank r's message buffer of this call's parity.
__device__ __forceinline__ Pack* message(const RankBuffers& bufs, int r, uint32_t flag,
                                         int64_t max_bytes) {
  return reinterpret_cast<Pack*>(bufs.ptr[r] + kAllReduceSignalBytes + (flag & 1) * max_bytes);
}

// The slot of source rank `src` in rank r's push area of this call's parity.
__device__ __forceinline__ Pack* push_slot(const RankBuffers& bufs, int r, int src, uint32_t flag,
                                           int64_t max_bytes) {
  const int64_t slot = push_slot_bytes(max_bytes);
  return reinterpret_cast<Pack*>(bufs.ptr[r] + kAllReduceSignalBytes + 2 * max_bytes +
                                 ((flag & 1) * kCustomAllReduceMaxRanks + src) * slot);
}

// The sum of pack idx over all ranks, in rank order (the same bits on every rank).
template <typename T, int NRANKS>
__device__ __forceinline__ Pack sum_ranks(const RankBuffers& bufs, uint32_t flag, int64_t max_bytes,
                                          int64_t idx) {
  PackAcc<T> acc;
  acc.set(message(bufs, 0, flag, max_bytes)[idx]);
#pragma unroll
  for (int r = 1; r < NRANKS; ++r) acc.add(message(bufs, r, flag, max_bytes)[idx]);
  return acc.get();
}

// The same sum from this rank's push area (local loads): slot r holds rank r's input.
template <typename T, int NRANKS>
__device__ __forceinline__ void sum_pushed(PackAcc<T>& acc, const RankBuffers& bufs, int rank,
                                           uint32_t flag, int64_t max_bytes, int64_t idx) {
  acc.set(push_slot(bufs, rank, 0, flag, max_bytes)[idx]);
#pragma unroll
  for (int r = 1; r < NRANKS; ++r) acc.add(push_slot(bufs, rank, r, flag, max_bytes)[idx]);
}

// Stores pack idx of this rank's input into its slot of every rank's push area.
template <int NRANKS>
__device__ __forceinline__ void push_to_all(const RankBuffers& bufs, int rank, uint32_t flag,
                                            int64_t max_bytes, int64_t idx, const Pack& value) {
#pragma unroll
  for (int q = 0; q < NRANKS; ++q) {
    const int r = (rank + q) % NRANKS;  // spread the ranks' stores over the peers
    push_slot(bufs, r, rank, flag, max_bytes)[idx] = value;
  }
}

__device__ __forceinline__ uint32_t next_flag(const RankBuffers& bufs, int rank) {
  return reinterpret_cast<AllReduceSignal*>(bufs.ptr[rank])->counter[blockIdx.x] + 1;
}

// Every call advances all kAllReduceMaxBlocks counters, launched blocks or not, so that all
// blocks of the next call, whatever its grid, share one call number and so one buffer parity
// (the reuse argument above needs the whole call on one buffer).
__device__ __forceinline__ void finish_call(const RankBuffers& bufs, int rank, uint32_t flag) {
  auto* self = reinterpret_cast<AllReduceSignal*>(bufs.ptr[rank]);
  if (threadIdx.x == 0) self->counter[blockIdx.x] = flag;
  if (blockIdx.x == 0) {
    for (int b = gridDim.x + threadIdx.x; b < kAllReduceMaxBlocks; b += blockDim.x) {
      self->counter[b] = flag;
    }
  }
}

template <typename T, int NRANKS>
__global__ void __launch_bounds__(kAllReduceThreads)
    one_shot_push_all_reduce_kernel(RankBuffers bufs, int rank,
                                    const Pack* input,  // [num_packs]
                                    Pack* out,          // [num_packs]
                                    int64_t num_packs, int64_t max_bytes) {
  const uint32_t flag = next_flag(bufs, rank);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t i = first; i < num_packs; i += stride) {
    push_to_all<NRANKS>(bufs, rank, flag, max_bytes, i, input[i]);
  }
  block_barrier<NRANKS>(bufs, rank, flag, [](AllReduceSignal* s) { return s->start[blockIdx.x]; });
  for (int64_t i = first; i < num_packs; i += stride) {
    PackAcc<T> acc;
    sum_pushed<T, NRANKS>(acc, bufs, rank, flag, max_bytes, i);
    out[i] = acc.get();
  }
  finish_call(bufs, rank, flag);
}

template <typename T, int NRANKS>
__global__ void __launch_bounds__(kAllReduceThreads)
    one_shot_all_reduce_kernel(RankBuffers bufs, int rank,
                               const Pack* input,  // [num_packs]
                               Pack* out,          // [num_packs]
                               int64_t num_packs, int64_t max_bytes) {
  const uint32_t flag = next_flag(bufs, rank);
  Pack* mine = message(bufs, rank, flag, max_bytes);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t i = first; i < num_packs; i += stride) mine[i] = input[i];
  block_barrier<NRANKS>(bufs, rank, flag, [](AllReduceSignal* s) { return s->start[blockIdx.x]; });
  for (int64_t i = first; i < num_packs; i += stride) {
    out[i] = sum_ranks<T, NRANKS>(bufs, flag, max_bytes, i);
  }
  finish_call(bufs, rank, flag);
}

// Partition q of the packs is [q * part, min((q + 1) * part, num_packs)); rank q reduces it.
template <typename T, int NRANKS>
__global__ void __launch_bounds__(kAllReduceThreads)
    two_shot_all_reduce_kernel(RankBuffers bufs, int rank,
                               const Pack* input,  // [num_packs]
                               Pack* out,          // [num_packs]
                               int64_t num_packs, int64_t part, int64_t max_bytes) {
  const uint32_t flag = next_flag(bufs, rank);
  Pack* mine = message(bufs, rank, flag, max_bytes);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  // Copy in with the mapping the peers' reduce uses: offset i of every partition.
  for (int64_t i = first; i < part; i += stride) {
#pragma unroll
    for (int q = 0; q < NRANKS; ++q) {
      const int64_t idx = q * part + i;
      if (idx < num_packs) mine[idx] = input[idx];
    }
  }
  block_barrier<NRANKS>(bufs, rank, flag, [](AllReduceSignal* s) { return s->start[blockIdx.x]; });
  // Reduce this rank's partition; peers read it from here after the next barrier (no peer reads
  // this partition of this rank's buffer before then).
  for (int64_t i = first; i < part; i += stride) {
    const int64_t idx = rank * part + i;
    if (idx < num_packs) {
      const Pack sum = sum_ranks<T, NRANKS>(bufs, flag, max_bytes, idx);
      mine[idx] = sum;
      out[idx] = sum;
    }
  }
  block_barrier<NRANKS>(bufs, rank, flag, [](AllReduceSignal* s) { return s->mid[blockIdx.x]; });
  for (int64_t i = first; i < part; i += stride) {
#pragma unroll
    for (int q = 1; q < NRANKS; ++q) {
      const int peer = (rank + q) % NRANKS;  // spread the ranks' reads over the peers
      const int64_t idx = peer * part + i;
      if (idx < num_packs) out[idx] = message(bufs, peer, flag, max_bytes)[idx];
    }
  }
  finish_call(bufs, rank, flag);
}

// The fused norm's per-pack math, with the roundings of all-reduce then fused_add_rms_norm:
// kept = T(reduced + residual) (its squares added to sum_sq in element order), and the output
// pack T(T(kept * inv_rms) * weight).
template <typename T>
__device__ __forceinline__ void add_residual_pack(const Pack& reduced, const Pack& residual,
                                                  Pack& kept, float& sum_sq) {
  const T* a = reinterpret_cast<const T*>(&reduced);
  const T* r = reinterpret_cast<const T*>(&residual);
  T* s = reinterpret_cast<T*>(&kept);
#pragma unroll
  for (int e = 0; e < PackAcc<T>::kElems; ++e) {
    s[e] = from_float<T>(to_float(a[e]) + to_float(r[e]));
    const float f = to_float(s[e]);
    sum_sq += f * f;
  }
}

template <typename T>
__device__ __forceinline__ Pack norm_pack(const Pack& kept, const Pack& weight, float inv_rms) {
  const T* wv = reinterpret_cast<const T*>(&weight);
  const T* s = reinterpret_cast<const T*>(&kept);
  Pack o;
  T* ov = reinterpret_cast<T*>(&o);
#pragma unroll
  for (int e = 0; e < PackAcc<T>::kElems; ++e) {
    const float normed = to_float(from_float<T>(to_float(s[e]) * inv_rms));
    ov[e] = from_float<T>(normed * to_float(wv[e]));
  }
  return o;
}

// Fused all-reduce + residual add + RMSNorm, one-shot push. Block b handles rows b, b + grid,
// ...; a row is row_packs packs, each thread holds up to kFusedNormPacks of them in registers.
// Per element, the same roundings as custom all-reduce then fused_add_rms_norm
// (cuda/norm/rms_norm.cuh): sum = T(sum over ranks, fp32, rank order); residual = T(sum +
// residual); out = T(T(residual * inv_rms) * weight), with inv_rms from the fp32 squares of the
// rounded residual.
constexpr int kFusedNormThreads = 512;
constexpr int kFusedNormPacks = 4;
static_assert(kFusedNormMaxRowBytes == kFusedNormThreads * kFusedNormPacks * sizeof(uint4),
              "the row limit of the C API is what one block holds in registers");

template <typename T, int NRANKS>
__global__ void __launch_bounds__(kFusedNormThreads)
    all_reduce_rms_norm_kernel(RankBuffers bufs, int rank,
                               const Pack* input,   // [num_rows, row_packs]: this rank's partial
                               Pack* residual,      // [num_rows, row_packs], updated in place
                               const Pack* weight,  // [row_packs]
                               Pack* out,           // [num_rows, row_packs]
                               int64_t num_rows, int64_t row_packs, float eps, int64_t max_bytes) {
  constexpr int kElems = PackAcc<T>::kElems;
  // The kernel after this one (the next layer's GEMM, launched with PDL) may be scheduled now:
  // its launch and its first weight prefetches overlap this kernel, and its pdl_wait() still
  // waits for this grid to complete (common/launch.cuh). This kernel itself is launched without
  // PDL, so everything before it has completed.
  pdl_launch_dependents();
  const uint32_t flag = next_flag(bufs, rank);
  for (int64_t row = blockIdx.x; row < num_rows; row += gridDim.x) {
    for (int64_t j = threadIdx.x; j < row_packs; j += blockDim.x) {
      const int64_t idx = row * row_packs + j;
      push_to_all<NRANKS>(bufs, rank, flag, max_bytes, idx, input[idx]);
    }
  }
  // The block's first row of residual and the norm weight do not depend on the peers: load them
  // while the barrier waits (after it, their latency added to the reduction's).
  Pack first_res[kFusedNormPacks];
  Pack weights[kFusedNormPacks];
#pragma unroll
  for (int k = 0; k < kFusedNormPacks; ++k) {
    const int64_t j = threadIdx.x + static_cast<int64_t>(k) * blockDim.x;
    if (j < row_packs) {
      weights[k] = weight[j];
      if (blockIdx.x < num_rows) first_res[k] = residual[blockIdx.x * row_packs + j];
    }
  }
  block_barrier<NRANKS>(bufs, rank, flag, [](AllReduceSignal* s) { return s->start[blockIdx.x]; });
  const float hidden = static_cast<float>(row_packs * kElems);
  for (int64_t row = blockIdx.x; row < num_rows; row += gridDim.x) {
    Pack kept[kFusedNormPacks];
    float sum_sq = 0.f;
#pragma unroll
    for (int k = 0; k < kFusedNormPacks; ++k) {
      const int64_t j = threadIdx.x + static_cast<int64_t>(k) * blockDim.x;
      if (j < row_packs) {
        const int64_t idx = row * row_packs + j;
        PackAcc<T> acc;
        sum_pushed<T, NRANKS>(acc, bufs, rank, flag, max_bytes, idx);
        const Pack res = row == blockIdx.x ? first_res[k] : residual[idx];
        add_residual_pack<T>(acc.get(), res, kept[k], sum_sq);
        residual[idx] = kept[k];
      }
    }
    sum_sq = block_reduce_sum<kFusedNormThreads>(sum_sq);
    const float inv_rms = rsqrtf(sum_sq / hidden + eps);
#pragma unroll
    for (int k = 0; k < kFusedNormPacks; ++k) {
      const int64_t j = threadIdx.x + static_cast<int64_t>(k) * blockDim.x;
      if (j < row_packs) out[row * row_packs + j] = norm_pack<T>(kept[k], weights[k], inv_rms);
    }
  }
  finish_call(bufs, rank, flag);
}

// The same fused all-reduce + residual add + RMSNorm with each row split over `splits` blocks
// (few rows: one 512-thread block per row left the 16 KB row of a decode step at 8.2 us on two
// H100s against 5.9 for the all-reduce alone). Block b handles packs [part * chunk, (part + 1) *
// chunk) of row b / splits, part = b % splits: it pushes them, meets block b of every rank, sums
// and adds the residual, then the row's blocks of this rank exchange their sums of squares
// through the rank's own Signal (norm_partial / norm_flag, release / acquire at GPU scope) and
// each adds them in part order, so every block and every rank gets the same inv_rms. The grid is
// num_rows * splits <= kAllReduceLaunchBlocks blocks, all resident: a block waits for its row's
// other blocks, and the next kernel (launched with PDL) is scheduled only once every block of
// this one has started. The roundings are the unsplit kernel's, but the squares add in another
// order (inv_rms may differ in its last bit).
constexpr int kSplitNormThreads = 128;
constexpr int kSplitNormPacks = 4;      // packs per thread at most: chunk <= 512 packs
constexpr int kSplitNormMaxSplits = 8;  // blocks per row at most

template <typename T, int NRANKS>
__global__ void __launch_bounds__(kSplitNormThreads)
    all_reduce_rms_norm_split_kernel(RankBuffers bufs, int rank, const Pack* input, Pack* residual,
                                     const Pack* weight, Pack* out, int64_t row_packs, int splits,
                                     int64_t chunk, float eps, int64_t max_bytes) {
  constexpr int kElems = PackAcc<T>::kElems;
  pdl_launch_dependents();  // as in all_reduce_rms_norm_kernel
  const uint32_t flag = next_flag(bufs, rank);
  const int64_t row = blockIdx.x / splits;
  const int64_t begin = (blockIdx.x % splits) * chunk;
  const int64_t end = begin + chunk < row_packs ? begin + chunk : row_packs;
  Pack res[kSplitNormPacks];
  Pack weights[kSplitNormPacks];
#pragma unroll
  for (int k = 0; k < kSplitNormPacks; ++k) {
    const int64_t j = begin + threadIdx.x + static_cast<int64_t>(k) * kSplitNormThreads;
    if (j < end) {
      const int64_t idx = row * row_packs + j;
      push_to_all<NRANKS>(bufs, rank, flag, max_bytes, idx, input[idx]);
      weights[k] = weight[j];
      res[k] = residual[idx];
    }
  }
  block_barrier<NRANKS>(bufs, rank, flag, [](AllReduceSignal* s) { return s->start[blockIdx.x]; });
  Pack kept[kSplitNormPacks];
  float sum_sq = 0.f;
#pragma unroll
  for (int k = 0; k < kSplitNormPacks; ++k) {
    const int64_t j = begin + threadIdx.x + static_cast<int64_t>(k) * kSplitNormThreads;
    if (j < end) {
      const int64_t idx = row * row_packs + j;
      PackAcc<T> acc;
      sum_pushed<T, NRANKS>(acc, bufs, rank, flag, max_bytes, idx);
      add_residual_pack<T>(acc.get(), res[k], kept[k], sum_sq);
      residual[idx] = kept[k];
    }
  }
  sum_sq = block_reduce_sum<kSplitNormThreads>(sum_sq);
  auto* self = reinterpret_cast<AllReduceSignal*>(bufs.ptr[rank]);
  if (threadIdx.x == 0) {
    self->norm_partial[blockIdx.x] = sum_sq;
    store_release<true>(&self->norm_flag[blockIdx.x], flag);  // orders the partial's store
  }
  __shared__ float partials[kSplitNormMaxSplits];
  if (threadIdx.x < splits) {
    const int64_t b = row * splits + threadIdx.x;
    while (static_cast<int32_t>(load_acquire<true>(&self->norm_flag[b]) - flag) < 0) {
    }
    partials[threadIdx.x] = __ldcg(&self->norm_partial[b]);  // L2: the acquiring thread reads
  }
  __syncthreads();
  float total = 0.f;
  for (int p = 0; p < splits; ++p) total += partials[p];  // part order: the same everywhere
  const float inv_rms = rsqrtf(total / static_cast<float>(row_packs * kElems) + eps);
#pragma unroll
  for (int k = 0; k < kSplitNormPacks; ++k) {
    const int64_t j = begin + threadIdx.x + static_cast<int64_t>(k) * kSplitNormThreads;
    if (j < end) out[row * row_packs + j] = norm_pack<T>(kept[k], weights[k], inv_rms);
  }
  finish_call(bufs, rank, flag);
}

inline int all_reduce_blocks(int64_t work) {
  const int64_t blocks = (work + kAllReduceThreads - 1) / kAllReduceThreads;
  return static_cast<int>(
      blocks < 1 ? 1 : (blocks > kAllReduceLaunchBlocks ? kAllReduceLaunchBlocks : blocks));
}

template <typename T, int NRANKS>
cudaError_t launch_custom_all_reduce(const RankBuffers& bufs, int rank, const void* input,
                                     void* out, int64_t num_packs, int64_t max_bytes,
                                     AllReduceAlgo algo, cudaStream_t stream) {
  const auto* in = static_cast<const Pack*>(input);
  auto* o = static_cast<Pack*>(out);
  if (algo == AllReduceAlgo::kOneShotPush) {
    one_shot_push_all_reduce_kernel<T, NRANKS>
        <<<all_reduce_blocks(num_packs), kAllReduceThreads, 0, stream>>>(bufs, rank, in, o,
                                                                         num_packs, max_bytes);
  } else if (algo == AllReduceAlgo::kOneShot) {
    one_shot_all_reduce_kernel<T, NRANKS>
        <<<all_reduce_blocks(num_packs), kAllReduceThreads, 0, stream>>>(bufs, rank, in, o,
                                                                         num_packs, max_bytes);
  } else {
    const int64_t part = (num_packs + NRANKS - 1) / NRANKS;
    two_shot_all_reduce_kernel<T, NRANKS>
        <<<all_reduce_blocks(part), kAllReduceThreads, 0, stream>>>(bufs, rank, in, o, num_packs,
                                                                    part, max_bytes);
  }
  return cudaGetLastError();
}

// split: take the split kernel where its grid fits (num_rows * splits <= kAllReduceLaunchBlocks).
template <typename T, int NRANKS>
cudaError_t launch_all_reduce_rms_norm(const RankBuffers& bufs, int rank, const void* input,
                                       void* residual, const void* weight, void* out,
                                       int64_t num_rows, int64_t row_packs, float eps,
                                       int64_t max_bytes, bool split, cudaStream_t stream) {
  int64_t splits = (row_packs + kSplitNormThreads - 1) / kSplitNormThreads;
  if (splits > kSplitNormMaxSplits) splits = kSplitNormMaxSplits;
  const int64_t chunk = (row_packs + splits - 1) / splits;
  if (split && num_rows * splits <= kAllReduceLaunchBlocks &&
      chunk <= static_cast<int64_t>(kSplitNormThreads) * kSplitNormPacks) {
    all_reduce_rms_norm_split_kernel<T, NRANKS>
        <<<static_cast<int>(num_rows * splits), kSplitNormThreads, 0, stream>>>(
            bufs, rank, static_cast<const Pack*>(input), static_cast<Pack*>(residual),
            static_cast<const Pack*>(weight), static_cast<Pack*>(out), row_packs,
            static_cast<int>(splits), chunk, eps, max_bytes);
    return cudaGetLastError();
  }
  const int grid =
      static_cast<int>(num_rows < kAllReduceLaunchBlocks ? num_rows : kAllReduceLaunchBlocks);
  all_reduce_rms_norm_kernel<T, NRANKS><<<grid, kFusedNormThreads, 0, stream>>>(
      bufs, rank, static_cast<const Pack*>(input), static_cast<Pack*>(residual),
      static_cast<const Pack*>(weight), static_cast<Pack*>(out), num_rows, row_packs, eps,
      max_bytes);
  return cudaGetLastError();
}

}  // namespace pyorch::kernels
