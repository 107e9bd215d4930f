// CUDA adapters for the KV-cache ops: check, guard, stream, call cuda/, check status. No math here.
// The token writes never synchronize or read device memory on the host (the fp8 scales travel as
// device pointers), so they can be captured in a CUDA graph.
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "cache_checks.h"
#include "common.h"
#include "ops.h"
#include "pyorch/cache.h"

namespace {

const float* scale_ptr(const at::Tensor& scale, const pyorch::CacheWriteShape& s) {
  return s.kv_cache_dtype == pyorch::KVCacheDType::kFp8E4M3 ? scale.const_data_ptr<float>()
                                                            : nullptr;
}

}  // namespace

void reshape_and_cache_flash(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                             at::Tensor& value_cache, const at::Tensor& slot_mapping,
                             const std::string& kv_cache_dtype, const at::Tensor& k_scale,
                             const at::Tensor& v_scale) {
  constexpr const char* kOp = "reshape_and_cache_flash";
  const pyorch::CacheWriteShape s =
      pyorch::check_cache_write(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype,
                                k_scale, v_scale, pyorch::CacheLayout::kFlash, kOp);
  TORCH_CHECK(key.is_cuda(), kOp, ": tensors must be on CUDA, got ", key.device());
  const c10::cuda::OptionalCUDAGuard guard(key.device());
  PYORCH_CHECK_CUDA(pyorch::reshape_and_cache_flash(
      key.const_data_ptr(), value.const_data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(),
      slot_mapping.const_data_ptr<int64_t>(), scale_ptr(k_scale, s), scale_ptr(v_scale, s),
      pyorch::to_pyorch_dtype(key.scalar_type()), s.kv_cache_dtype, s.num_tokens, s.num_kv_heads,
      s.head_size, s.num_blocks, s.block_size, key.stride(0), key.stride(1), value.stride(0),
      value.stride(1), key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
      c10::cuda::getCurrentCUDAStream()));
}

void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                       at::Tensor& value_cache, const at::Tensor& slot_mapping,
                       const std::string& kv_cache_dtype, const at::Tensor& k_scale,
                       const at::Tensor& v_scale) {
  constexpr const char* kOp = "reshape_and_cache";
  const pyorch::CacheWriteShape s =
      pyorch::check_cache_write(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype,
                                k_scale, v_scale, pyorch::CacheLayout::kSplit, kOp);
  TORCH_CHECK(key.is_cuda(), kOp, ": tensors must be on CUDA, got ", key.device());
  TORCH_CHECK(s.num_kv_heads <= 65535, kOp, ": at most 65535 kv heads, got ", s.num_kv_heads);
  const c10::cuda::OptionalCUDAGuard guard(key.device());
  PYORCH_CHECK_CUDA(pyorch::reshape_and_cache(
      key.const_data_ptr(), value.const_data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(),
      slot_mapping.const_data_ptr<int64_t>(), scale_ptr(k_scale, s), scale_ptr(v_scale, s),
      pyorch::to_pyorch_dtype(key.scalar_type()), s.kv_cache_dtype, s.num_tokens, s.num_kv_heads,
      s.head_size, s.num_blocks, s.block_size, key.stride(0), key.stride(1), value.stride(0),
      value.stride(1), key_cache.stride(0), key_cache.stride(1), value_cache.stride(0),
      value_cache.stride(1), c10::cuda::getCurrentCUDAStream()));
}

void copy_blocks(const std::vector<at::Tensor>& key_caches,
                 const std::vector<at::Tensor>& value_caches, const at::Tensor& block_mapping) {
  constexpr const char* kOp = "copy_blocks";
  const pyorch::CopyBlocksShape s =
      pyorch::check_copy_blocks(key_caches, value_caches, block_mapping, kOp);
  if (s.num_layers == 0 || block_mapping.size(0) == 0) return;
  const at::Device device = key_caches[0].device();
  TORCH_CHECK(device.is_cuda(), kOp, ": caches must be on CUDA, got ", device);
  const c10::cuda::OptionalCUDAGuard guard(device);
  at::Tensor mapping;
  if (block_mapping.device().is_cpu()) {
    const at::Tensor host = block_mapping.contiguous();
    pyorch::check_block_ids(host, s.num_blocks, s.num_blocks, kOp);
    mapping = host.to(device, /*non_blocking=*/true);
  } else {
    pyorch::check_same_device(block_mapping, "block_mapping", key_caches[0], "the caches", kOp);
    mapping = block_mapping.contiguous();
    // A device mapping is checked on the host too (one small sync), except while a graph is
    // captured: then out-of-range pairs are skipped by the kernel instead of raising.
    if (c10::cuda::currentStreamCaptureStatusMayInitCtx() == c10::cuda::CaptureStatus::None) {
      pyorch::check_block_ids(mapping.cpu(), s.num_blocks, s.num_blocks, kOp);
    }
  }
  std::vector<void*> key_ptrs(s.num_layers), value_ptrs(s.num_layers);
  for (int64_t l = 0; l < s.num_layers; ++l) {
    key_ptrs[l] = key_caches[l].data_ptr();
    value_ptrs[l] = value_caches[l].data_ptr();
  }
  PYORCH_CHECK_CUDA(pyorch::copy_blocks(key_ptrs.data(), value_ptrs.data(), s.num_layers,
                                        mapping.const_data_ptr<int64_t>(), mapping.size(0),
                                        s.num_blocks, s.block_bytes, s.block_stride_bytes,
                                        c10::cuda::getCurrentCUDAStream()));
}

void swap_blocks(const at::Tensor& src, at::Tensor& dst, const at::Tensor& block_mapping) {
  constexpr const char* kOp = "swap_blocks";
  cudaMemcpyKind kind;
  if (src.is_cuda() && dst.is_cuda()) {
    pyorch::check_same_device(dst, "dst", src, "src", kOp);
    kind = cudaMemcpyDeviceToDevice;
  } else if (src.is_cuda() && dst.device().is_cpu()) {
    kind = cudaMemcpyDeviceToHost;
  } else if (src.device().is_cpu() && dst.is_cuda()) {
    kind = cudaMemcpyHostToDevice;
  } else {
    TORCH_CHECK(false, kOp, ": copies between CUDA and CPU tensors, got ", src.device(), " -> ",
                dst.device());
  }
  const pyorch::SwapBlocksShape s = pyorch::check_swap_blocks(src, dst, block_mapping, kOp);
  const at::Device cuda_device = src.is_cuda() ? src.device() : dst.device();
  const c10::cuda::OptionalCUDAGuard guard(cuda_device);
  PYORCH_CHECK_CUDA(pyorch::swap_blocks(
      dst.data_ptr(), src.const_data_ptr(), s.host_mapping.const_data_ptr<int64_t>(),
      s.host_mapping.size(0), s.block_bytes, s.src_block_stride_bytes, s.dst_block_stride_bytes,
      kind, c10::cuda::getCurrentCUDAStream(cuda_device.index())));
}
