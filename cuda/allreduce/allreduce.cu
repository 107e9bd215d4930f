// The torch-free C API of the custom all-reduce: rank-count and dtype dispatch, IPC helpers.
#include <cstring>

#include "allreduce/custom_all_reduce.cuh"
#include "pyorch/custom_all_reduce.h"

namespace pyorch {

namespace {

// NOTE(tp): one-shot reads every peer's whole message; with two ranks that is the same remote
// traffic as two-shot and one barrier fewer, so two ranks always take one-shot. With more ranks
// two-shot reads (2 / world_size) of the message remotely instead of (world_size - 1) / world_size
// per rank; the crossover below is vLLM's published one for NVLink H100s, to be re-measured with
// bench/cpp/bench_custom_all_reduce.cu.
constexpr int64_t kOneShotMaxBytes = 256 << 10;

template <int NRANKS>
cudaError_t dispatch_dtype(const kernels::RankBuffers& bufs, int rank, const void* input, void* out,
                           DType dtype, int64_t num_packs, int64_t max_bytes, AllReduceAlgo algo,
                           cudaStream_t stream) {
  return PYORCH_DISPATCH_FLOAT_TYPES(dtype, T, [&] {
    return kernels::launch_custom_all_reduce<T, NRANKS>(bufs, rank, input, out, num_packs,
                                                        max_bytes, algo, stream);
  });
}

}  // namespace

size_t custom_all_reduce_buffer_bytes(int64_t max_bytes) {
  return static_cast<size_t>(kernels::kAllReduceSignalBytes + 2 * max_bytes);
}

AllReduceAlgo custom_all_reduce_pick(int64_t bytes, int world_size) {
  return (world_size == 2 || bytes <= kOneShotMaxBytes) ? AllReduceAlgo::kOneShot
                                                        : AllReduceAlgo::kTwoShot;
}

cudaError_t custom_all_reduce_init_buffer(void* buffer, cudaStream_t stream) {
  return cudaMemsetAsync(buffer, 0, kernels::kAllReduceSignalBytes, stream);
}

cudaError_t custom_all_reduce(void* out, const void* input, void* const* buffers, int rank,
                              int world_size, int64_t max_bytes, DType dtype, int64_t numel,
                              AllReduceAlgo algo, cudaStream_t stream) {
  if (world_size < 2 || world_size > kCustomAllReduceMaxRanks || rank < 0 || rank >= world_size) {
    PYORCH_INVALID("custom_all_reduce: rank %d of world size %d (2..%d ranks)", rank, world_size,
                   kCustomAllReduceMaxRanks);
  }
  int64_t elem_bytes = 0;
  switch (dtype) {
    case DType::kFloat32: elem_bytes = 4; break;
    case DType::kFloat16:
    case DType::kBFloat16: elem_bytes = 2; break;
    default: PYORCH_INVALID("custom_all_reduce: unsupported dtype %s", dtype_name(dtype));
  }
  const int64_t bytes = numel * elem_bytes;
  if (numel < 0 || bytes % static_cast<int64_t>(sizeof(kernels::Pack)) != 0 || bytes > max_bytes ||
      max_bytes % static_cast<int64_t>(sizeof(kernels::Pack)) != 0) {
    PYORCH_INVALID("custom_all_reduce: %lld bytes (a multiple of 16, at most max_bytes %lld)",
                   static_cast<long long>(bytes), static_cast<long long>(max_bytes));
  }
  if (reinterpret_cast<uintptr_t>(input) % 16 != 0 || reinterpret_cast<uintptr_t>(out) % 16 != 0) {
    PYORCH_INVALID("custom_all_reduce: input and out must be 16-byte aligned");
  }
  if (bytes == 0) return cudaSuccess;
  if (algo == AllReduceAlgo::kAuto) algo = custom_all_reduce_pick(bytes, world_size);
  kernels::RankBuffers bufs{};
  for (int r = 0; r < world_size; ++r) bufs.ptr[r] = static_cast<char*>(buffers[r]);
  const int64_t num_packs = bytes / static_cast<int64_t>(sizeof(kernels::Pack));
  switch (world_size) {
    case 2:
      return dispatch_dtype<2>(bufs, rank, input, out, dtype, num_packs, max_bytes, algo, stream);
    case 4:
      return dispatch_dtype<4>(bufs, rank, input, out, dtype, num_packs, max_bytes, algo, stream);
    case 6:
      return dispatch_dtype<6>(bufs, rank, input, out, dtype, num_packs, max_bytes, algo, stream);
    case 8:
      return dispatch_dtype<8>(bufs, rank, input, out, dtype, num_packs, max_bytes, algo, stream);
    default:
      PYORCH_INVALID("custom_all_reduce: unsupported world size %d (2, 4, 6 or 8)", world_size);
  }
}

cudaError_t ipc_get_mem_handle(void* handle_out, void* ptr) {
  static_assert(sizeof(cudaIpcMemHandle_t) == kCustomAllReduceIpcHandleBytes, "IPC handle size");
  cudaIpcMemHandle_t handle;
  PYORCH_RETURN_IF_ERROR(cudaIpcGetMemHandle(&handle, ptr));
  std::memcpy(handle_out, &handle, sizeof(handle));
  return cudaSuccess;
}

cudaError_t ipc_open_mem_handle(void** ptr_out, const void* handle) {
  cudaIpcMemHandle_t h;
  std::memcpy(&h, handle, sizeof(h));
  return cudaIpcOpenMemHandle(ptr_out, h, cudaIpcMemLazyEnablePeerAccess);
}

cudaError_t ipc_close_mem_handle(void* ptr) { return cudaIpcCloseMemHandle(ptr); }

}  // namespace pyorch
