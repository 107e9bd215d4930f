// Custom all-reduce for the GPUs of one host (tensor parallelism): every rank's buffer is mapped
// into every process through CUDA IPC, and one kernel per rank sums them with flag barriers.
//
// Each rank allocates custom_all_reduce_buffer_bytes(max_bytes) of device memory, zeroes it once
// (custom_all_reduce_init_buffer), exports it (ipc_get_mem_handle), and opens every peer's
// (ipc_open_mem_handle). A call copies the input into the rank's buffer inside the kernel, so
// any input works, eagerly and under CUDA-graph capture: nothing needs registering per tensor,
// and the kernel picks one of two buffers from a device-side call counter, so a graph replays
// correctly.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

#include "pyorch/dtype.h"

namespace pyorch {

constexpr int kCustomAllReduceMaxRanks = 8;
constexpr int kCustomAllReduceIpcHandleBytes = 64;  // sizeof(cudaIpcMemHandle_t)

// How the kernel sums: kOneShot reads every peer's whole buffer (one barrier: latency-bound
// sizes); kTwoShot reduces 1/world_size of it per rank, then gathers the reduced parts (two
// barriers, each rank reads about 2x its data: bandwidth-bound sizes); kOneShotPush stores the
// input into every peer's buffer and sums locally (one barrier, no remote loads; messages up to
// custom_all_reduce_push_max_bytes). kAuto picks by size.
enum class AllReduceAlgo : int32_t { kAuto = 0, kOneShot = 1, kTwoShot = 2, kOneShotPush = 3 };

// Bytes one rank allocates for messages of up to max_bytes (signals + two message buffers).
size_t custom_all_reduce_buffer_bytes(int64_t max_bytes);

// Largest message kOneShotPush and custom_all_reduce_rms_norm take with buffers of max_bytes.
int64_t custom_all_reduce_push_max_bytes(int64_t max_bytes);

// The algorithm kAuto uses for a message of `bytes` over world_size ranks.
AllReduceAlgo custom_all_reduce_pick(int64_t bytes, int world_size);

// Zeroes the signal area of this rank's fresh buffer. All ranks must finish this (and open each
// other's handles) before the first custom_all_reduce: the caller puts a barrier in between.
cudaError_t custom_all_reduce_init_buffer(void* buffer, cudaStream_t stream);

// out = sum over ranks of each rank's input, identical on every rank (summed in rank order, in
// fp32). All ranks call it with the same numel, dtype and algo, in the same order.
// buffers: [world_size] every rank's buffer as mapped in this process (own at [rank]);
// input, out: [numel] contiguous, 16-byte aligned; numel * sizeof(dtype) a multiple of 16 and at
// most max_bytes (the size the buffers were made for).
cudaError_t custom_all_reduce(void* out, const void* input, void* const* buffers, int rank,
                              int world_size, int64_t max_bytes, DType dtype, int64_t numel,
                              AllReduceAlgo algo, cudaStream_t stream);

// Fused all-reduce + residual add + RMSNorm (one kernel, one-shot push): with s the all-reduce
// of input (rounded to the dtype), residual = residual + s and out = RMSNorm(residual) * weight,
// the same roundings as custom_all_reduce then fused_add_rms_norm. input, residual, out:
// [num_rows, hidden] contiguous, 16-byte aligned; weight: [hidden]; hidden * sizeof(dtype) a
// multiple of 16 and at most kFusedNormMaxRowBytes; num_rows * hidden * sizeof(dtype) at most
// custom_all_reduce_push_max_bytes(max_bytes). out may alias input.
constexpr int64_t kFusedNormMaxRowBytes = 512 * 4 * 16;
cudaError_t custom_all_reduce_rms_norm(void* out, const void* input, void* residual,
                                       const void* weight, float eps, void* const* buffers,
                                       int rank, int world_size, int64_t max_bytes, DType dtype,
                                       int64_t num_rows, int64_t hidden, cudaStream_t stream);

// Process-wide: whether custom_all_reduce_rms_norm splits each row over several thread blocks
// (at most 36 blocks in all) instead of one block per row. kAuto (the default) splits at most
// kAllReduceNormAutoSplitRows rows: on two and four H100s the split form took 0.2 to 2.8 us off
// every case of 1 to 4 rows at hidden 4096 and 8192; at 8 and 16 rows it was mixed (hidden 8192
// on four GPUs: 11.8 against 11.4 us at 8 rows) (bench_custom_all_reduce --op
// all_reduce_rms_norm --norm-split 0|1; bench/results/NVIDIA_H100_80GB_HBM3x2/, ...x4/). kOn
// splits wherever the grid fits, kOff never. The split outputs may differ from the unsplit
// kernel's in the last bit (the squares add in another order) and are the same on every rank.
// Every rank must use the same setting; set it before CUDA graphs are captured.
enum class AllReduceNormSplit : int { kOff = 0, kOn = 1, kAuto = 2 };
constexpr int64_t kAllReduceNormAutoSplitRows = 4;
void set_custom_all_reduce_rms_norm_split(AllReduceNormSplit mode);
AllReduceNormSplit custom_all_reduce_rms_norm_split();

// CUDA IPC: export a cudaMalloc'd pointer as kCustomAllReduceIpcHandleBytes bytes, map a peer's
// into this process (on the current device), unmap it.
cudaError_t ipc_get_mem_handle(void* handle_out, void* ptr);
cudaError_t ipc_open_mem_handle(void** ptr_out, const void* handle);
cudaError_t ipc_close_mem_handle(void* ptr);

}  // namespace pyorch
