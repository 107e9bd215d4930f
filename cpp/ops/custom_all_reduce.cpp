// CUDA adapters of the custom all-reduce (tensor parallelism): check, guard, stream, call cuda/,
// check status. The IPC helpers are plain functions bound with pybind11 (they map memory into the
// process: state, not a tensor op).
#include <string>
#include <vector>

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "common.h"
#include "ops.h"
#include "pyorch/custom_all_reduce.h"

void custom_all_reduce(at::Tensor& out, const at::Tensor& input,
                       const std::vector<int64_t>& buffers, int64_t rank, int64_t max_bytes,
                       int64_t algo) {
  TORCH_CHECK(input.is_cuda() && out.device() == input.device(),
              "custom_all_reduce: input and out must be on the same CUDA device");
  TORCH_CHECK(input.is_contiguous() && out.is_contiguous(),
              "custom_all_reduce: input and out must be contiguous");
  TORCH_CHECK(out.scalar_type() == input.scalar_type() && out.numel() == input.numel(),
              "custom_all_reduce: out must match input's dtype and size");
  const int64_t world_size = static_cast<int64_t>(buffers.size());
  TORCH_CHECK(world_size >= 2 && world_size <= pyorch::kCustomAllReduceMaxRanks,
              "custom_all_reduce: ", world_size, " buffers (2 to ",
              pyorch::kCustomAllReduceMaxRanks, " ranks)");
  TORCH_CHECK(rank >= 0 && rank < world_size, "custom_all_reduce: rank ", rank, " of ", world_size);
  TORCH_CHECK(algo >= 0 && algo <= 3, "custom_all_reduce: algo must be 0 (auto), 1, 2 or 3, got ",
              algo);
  const int64_t bytes = input.numel() * input.element_size();
  TORCH_CHECK(bytes % 16 == 0 && bytes <= max_bytes, "custom_all_reduce: ", bytes,
              " bytes (a multiple of 16, at most ", max_bytes, ")");
  void* ptrs[pyorch::kCustomAllReduceMaxRanks];
  for (int64_t r = 0; r < world_size; ++r) ptrs[r] = reinterpret_cast<void*>(buffers[r]);
  const c10::cuda::OptionalCUDAGuard guard(input.device());
  PYORCH_CHECK_CUDA(pyorch::custom_all_reduce(
      out.data_ptr(), input.const_data_ptr(), ptrs, static_cast<int>(rank),
      static_cast<int>(world_size), max_bytes, pyorch::to_pyorch_dtype(input.scalar_type()),
      input.numel(), static_cast<pyorch::AllReduceAlgo>(algo), c10::cuda::getCurrentCUDAStream()));
}

void custom_all_reduce_rms_norm(at::Tensor& out, const at::Tensor& input, at::Tensor& residual,
                                const at::Tensor& weight, double epsilon,
                                const std::vector<int64_t>& buffers, int64_t rank,
                                int64_t max_bytes) {
  TORCH_CHECK(input.is_cuda() && out.device() == input.device() &&
                  residual.device() == input.device() && weight.device() == input.device(),
              "custom_all_reduce_rms_norm: all tensors on the same CUDA device");
  TORCH_CHECK(input.dim() == 2 && out.sizes() == input.sizes() &&
                  residual.sizes() == input.sizes() && weight.dim() == 1 &&
                  weight.size(0) == input.size(1),
              "custom_all_reduce_rms_norm: input, residual, out [rows, hidden], weight [hidden]");
  TORCH_CHECK(input.is_contiguous() && out.is_contiguous() && residual.is_contiguous() &&
                  weight.is_contiguous(),
              "custom_all_reduce_rms_norm: contiguous tensors");
  TORCH_CHECK(out.scalar_type() == input.scalar_type() &&
                  residual.scalar_type() == input.scalar_type() &&
                  weight.scalar_type() == input.scalar_type(),
              "custom_all_reduce_rms_norm: one dtype for all tensors");
  const int64_t world_size = static_cast<int64_t>(buffers.size());
  TORCH_CHECK(world_size >= 2 && world_size <= pyorch::kCustomAllReduceMaxRanks,
              "custom_all_reduce_rms_norm: ", world_size, " buffers (2 to ",
              pyorch::kCustomAllReduceMaxRanks, " ranks)");
  TORCH_CHECK(rank >= 0 && rank < world_size, "custom_all_reduce_rms_norm: rank ", rank, " of ",
              world_size);
  void* ptrs[pyorch::kCustomAllReduceMaxRanks];
  for (int64_t r = 0; r < world_size; ++r) ptrs[r] = reinterpret_cast<void*>(buffers[r]);
  const c10::cuda::OptionalCUDAGuard guard(input.device());
  PYORCH_CHECK_CUDA(pyorch::custom_all_reduce_rms_norm(
      out.data_ptr(), input.const_data_ptr(), residual.data_ptr(), weight.const_data_ptr(),
      static_cast<float>(epsilon), ptrs, static_cast<int>(rank), static_cast<int>(world_size),
      max_bytes, pyorch::to_pyorch_dtype(input.scalar_type()), input.size(0), input.size(1),
      c10::cuda::getCurrentCUDAStream()));
}

void custom_all_reduce_init_buffer(at::Tensor& buffer) {
  TORCH_CHECK(buffer.is_cuda() && buffer.is_contiguous() && buffer.scalar_type() == at::kByte,
              "custom_all_reduce_init_buffer: a contiguous uint8 CUDA tensor");
  const c10::cuda::OptionalCUDAGuard guard(buffer.device());
  PYORCH_CHECK_CUDA(
      pyorch::custom_all_reduce_init_buffer(buffer.data_ptr(), c10::cuda::getCurrentCUDAStream()));
}

namespace pyorch {

int64_t custom_all_reduce_buffer_size(int64_t max_bytes) {
  TORCH_CHECK(max_bytes > 0 && max_bytes % 16 == 0, "max_bytes must be a positive multiple of 16");
  return static_cast<int64_t>(custom_all_reduce_buffer_bytes(max_bytes));
}

int64_t custom_all_reduce_push_bytes(int64_t max_bytes) {
  TORCH_CHECK(max_bytes > 0 && max_bytes % 16 == 0, "max_bytes must be a positive multiple of 16");
  return custom_all_reduce_push_max_bytes(max_bytes);
}

std::string ipc_handle_of(int64_t ptr) {
  std::string handle(kCustomAllReduceIpcHandleBytes, '\0');
  PYORCH_CHECK_CUDA(ipc_get_mem_handle(handle.data(), reinterpret_cast<void*>(ptr)));
  return handle;
}

int64_t ipc_open(const std::string& handle) {
  TORCH_CHECK(handle.size() == kCustomAllReduceIpcHandleBytes, "ipc_open: a handle is ",
              kCustomAllReduceIpcHandleBytes, " bytes, got ", handle.size());
  void* ptr = nullptr;
  PYORCH_CHECK_CUDA(ipc_open_mem_handle(&ptr, handle.data()));
  return reinterpret_cast<int64_t>(ptr);
}

void ipc_close(int64_t ptr) {
  PYORCH_CHECK_CUDA(ipc_close_mem_handle(reinterpret_cast<void*>(ptr)));
}

}  // namespace pyorch
