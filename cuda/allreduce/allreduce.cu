// The torch-free C API of the custom all-reduce: rank-count and dtype dispatch, IPC helpers.
#include <atomic>
#include <cstring>

#include "allreduce/custom_all_reduce.cuh"
#include "pyorch/custom_all_reduce.h"

namespace pyorch {

namespace {

std::atomic<AllReduceNormSplit> g_norm_split{AllReduceNormSplit::kAuto};

// NOTE(tp): kAuto is a default for callers without a measured table (pyorch.distributed's
// CustomAllreduce passes the algorithm it measured best, bench/all_reduce_cutoffs.py): push
// one-shot while the message fits the push slots, then pull one-shot (two ranks: the same remote
// traffic as two-shot and one barrier fewer) or two-shot past kOneShotMaxBytes.
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
  return static_cast<size_t>(kernels::kAllReduceSignalBytes + 2 * max_bytes +
                             2 * kCustomAllReduceMaxRanks * kernels::push_slot_bytes(max_bytes));
}

int64_t custom_all_reduce_push_max_bytes(int64_t max_bytes) {
  return kernels::push_slot_bytes(max_bytes);
}

AllReduceAlgo custom_all_reduce_pick(int64_t bytes, int world_size) {
  if (bytes <= kernels::kPushMaxBytes) return AllReduceAlgo::kOneShotPush;
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
  if (algo == AllReduceAlgo::kOneShotPush && bytes > kernels::push_slot_bytes(max_bytes)) {
    PYORCH_INVALID("custom_all_reduce: %lld bytes exceed the push slots (%lld bytes)",
                   static_cast<long long>(bytes),
                   static_cast<long long>(kernels::push_slot_bytes(max_bytes)));
  }
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

namespace {

template <int NRANKS>
cudaError_t dispatch_norm_dtype(const kernels::RankBuffers& bufs, int rank, const void* input,
                                void* residual, const void* weight, void* out, float eps,
                                DType dtype, int64_t num_rows, int64_t row_packs, int64_t max_bytes,
                                cudaStream_t stream) {
  const AllReduceNormSplit mode = g_norm_split.load(std::memory_order_relaxed);
  const bool split = mode == AllReduceNormSplit::kOn ||
                     (mode == AllReduceNormSplit::kAuto && num_rows <= kAllReduceNormAutoSplitRows);
  return PYORCH_DISPATCH_FLOAT_TYPES(dtype, T, [&] {
    return kernels::launch_all_reduce_rms_norm<T, NRANKS>(bufs, rank, input, residual, weight, out,
                                                          num_rows, row_packs, eps, max_bytes,
                                                          split, stream);
  });
}

}  // namespace

void set_custom_all_reduce_rms_norm_split(AllReduceNormSplit mode) {
  g_norm_split.store(mode, std::memory_order_relaxed);
}

AllReduceNormSplit custom_all_reduce_rms_norm_split() {
  return g_norm_split.load(std::memory_order_relaxed);
}

cudaError_t custom_all_reduce_rms_norm(void* out, const void* input, void* residual,
                                       const void* weight, float eps, void* const* buffers,
                                       int rank, int world_size, int64_t max_bytes, DType dtype,
                                       int64_t num_rows, int64_t hidden, cudaStream_t stream) {
  if (world_size < 2 || world_size > kCustomAllReduceMaxRanks || rank < 0 || rank >= world_size) {
    PYORCH_INVALID("custom_all_reduce_rms_norm: rank %d of world size %d (2..%d ranks)", rank,
                   world_size, kCustomAllReduceMaxRanks);
  }
  if (dtype != DType::kFloat32 && dtype != DType::kFloat16 && dtype != DType::kBFloat16) {
    PYORCH_INVALID("custom_all_reduce_rms_norm: unsupported dtype %s", dtype_name(dtype));
  }
  const int64_t elem_bytes = dtype == DType::kFloat32 ? 4 : 2;
  const int64_t row_bytes = hidden * elem_bytes;
  const int64_t pack = static_cast<int64_t>(sizeof(kernels::Pack));
  if (num_rows < 0 || hidden <= 0 || row_bytes % pack != 0 || row_bytes > kFusedNormMaxRowBytes ||
      num_rows * row_bytes > kernels::push_slot_bytes(max_bytes)) {
    PYORCH_INVALID(
        "custom_all_reduce_rms_norm: %lld rows of %lld bytes (rows a multiple of 16 bytes, at "
        "most %lld; at most %lld bytes in all)",
        static_cast<long long>(num_rows), static_cast<long long>(row_bytes),
        static_cast<long long>(kFusedNormMaxRowBytes),
        static_cast<long long>(kernels::push_slot_bytes(max_bytes)));
  }
  for (const void* p :
       {static_cast<const void*>(out), input, static_cast<const void*>(residual), weight}) {
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) {
      PYORCH_INVALID("custom_all_reduce_rms_norm: tensors must be 16-byte aligned");
    }
  }
  if (num_rows == 0) return cudaSuccess;
  kernels::RankBuffers bufs{};
  for (int r = 0; r < world_size; ++r) bufs.ptr[r] = static_cast<char*>(buffers[r]);
  const int64_t row_packs = row_bytes / pack;
  switch (world_size) {
#define PYORCH_CASE(N)                                                                            \
  case N:                                                                                         \
    return dispatch_norm_dtype<N>(bufs, rank, input, residual, weight, out, eps, dtype, num_rows, \
                                  row_packs, max_bytes, stream);
    PYORCH_CASE(2)
    PYORCH_CASE(4)
    PYORCH_CASE(6)
    PYORCH_CASE(8)
#undef PYORCH_CASE
    default:
      PYORCH_INVALID("custom_all_reduce_rms_norm: unsupported world size %d (2, 4, 6 or 8)",
                     world_size);
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
