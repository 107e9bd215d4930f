// Custom all-reduce kernels: one-shot and two-shot over CUDA-IPC-mapped buffers, with per-block
// flag barriers. See cuda/include/pyorch/custom_all_reduce.h for the contract.
//
// Each rank's buffer: [Signal][message buffer 0][message buffer 1], each message buffer
// max_bytes. A call runs one kernel per rank with the same grid on every rank. Block b of each
// rank copies its part of the input into the rank's message buffer, then meets block b of every
// other rank at a barrier, then reads the peers' buffers. Only block b's of the ranks wait for
// each other, so every block reads exactly the elements the peers' block b wrote (the index
// mapping is the same on every rank).
//
// Why no barrier at the end: consecutive calls alternate between the two message buffers (the
// parity of the call counter kept in the rank's own Signal, one copy per block slot, all equal
// between calls; device memory, so CUDA-graph replays alternate too). A rank overwrites buffer p at
// call n + 2 only after its call n + 1 passed its start barrier, so every peer had started call n +
// 1, so (stream order) every peer's call n, the last reader of buffer p, had finished. Flags are
// call numbers compared with `>=` (in wrapping arithmetic), so a fast rank's next flag cannot hide
// the current one from a slow peer.
#pragma once

#include <cstdint>

#include "common/dtype.cuh"
#include "pyorch/custom_all_reduce.h"

namespace pyorch::kernels {

constexpr int kAllReduceMaxBlocks = 64;     // signal slots; the launch uses at most this many
constexpr int kAllReduceLaunchBlocks = 36;  // blocks a call launches at most
constexpr int kAllReduceThreads = 512;

struct alignas(128) AllReduceSignal {
  uint32_t start[kAllReduceMaxBlocks][kCustomAllReduceMaxRanks];  // written by peers
  uint32_t mid[kAllReduceMaxBlocks][kCustomAllReduceMaxRanks];    // written by peers (two-shot)
  uint32_t counter[kAllReduceMaxBlocks];                          // own: calls made by block b
};
constexpr int64_t kAllReduceSignalBytes = (sizeof(AllReduceSignal) + 255) / 256 * 256;

// Every rank's buffer base as mapped in this process, passed by value (graph-capture safe).
struct RankBuffers {
  char* ptr[kCustomAllReduceMaxRanks];
};

__device__ __forceinline__ void store_release_sys(uint32_t* addr, uint32_t value) {
  asm volatile("st.release.sys.global.u32 [%1], %0;" ::"r"(value), "l"(addr) : "memory");
}

__device__ __forceinline__ uint32_t load_acquire_sys(const uint32_t* addr) {
  uint32_t value;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(value) : "l"(addr) : "memory");
  return value;
}

// Block b of this rank meets block b of every rank. slots(signal) picks the flag row (start or
// mid). The writes before it are made visible system-wide first.
template <int NRANKS, typename Slots>
__device__ __forceinline__ void block_barrier(const RankBuffers& bufs, int rank, uint32_t flag,
                                              Slots slots) {
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x < NRANKS) {
    auto* peer = reinterpret_cast<AllReduceSignal*>(bufs.ptr[threadIdx.x]);
    auto* self = reinterpret_cast<AllReduceSignal*>(bufs.ptr[rank]);
    store_release_sys(&slots(peer)[rank], flag);
    const uint32_t* mine = &slots(self)[threadIdx.x];
    while (static_cast<int32_t>(load_acquire_sys(mine) - flag) < 0) {
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
  if (algo == AllReduceAlgo::kOneShot) {
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

}  // namespace pyorch::kernels
