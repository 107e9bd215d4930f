// Kernel launches with programmatic dependent launch (PDL, compute capability 9.0+).
//
// A kernel launched through launch_kernel() may be scheduled while the kernel before it in the
// stream is still running, so its launch latency and ramp-up hide behind that kernel's tail. The
// rules that keep it correct:
// - the kernel calls pdl_wait() before its first access to memory that an earlier kernel in the
//   stream reads or writes (activations, caches, counters); only memory nothing writes while the
//   model runs (weights, cos/sin tables) may be touched before it. pdl_wait() returns once every
//   earlier grid has completed and its writes are visible, so the order is the stream's order.
// - pdl_launch_dependents() lets the next PDL kernel be scheduled once every block of this grid
//   has called it (or exited). It does not publish anything: the next kernel still waits.
// Without the launch attribute (PDL off, or an older GPU) both calls are no-ops.
//
// PYORCH_PDL=0 in the environment turns PDL off for every pyorch kernel (A/B timing, or a
// driver that mishandles it); it is read once per process.
#pragma once

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <utility>

#include <cuda_runtime.h>

namespace pyorch {

// Whether pyorch kernels launch with PDL on the current device: compute capability 9.0+ and not
// turned off by PYORCH_PDL=0. Cached per device (the query costs host time on every launch).
inline bool pdl_enabled() {
  static const bool env_on = [] {
    const char* env = std::getenv("PYORCH_PDL");
    return env == nullptr || std::strcmp(env, "0") != 0;
  }();
  if (!env_on) return false;
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cache[kMaxDevices] = {};  // 0 unknown, 1 off, 2 on
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return false;
  if (device < kMaxDevices) {
    const int known = cache[device].load(std::memory_order_relaxed);
    if (known != 0) return known == 2;
  }
  int major = 0;
  const bool on = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) ==
                      cudaSuccess &&
                  major >= 9;
  if (device < kMaxDevices) cache[device].store(on ? 2 : 1, std::memory_order_relaxed);
  return on;
}

namespace kernels {

// PDL: wait until the grids this one depends on have completed and their writes are visible.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// PDL: the next kernel in the stream may be scheduled once every block got here or exited.
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Launches `kernel` on `stream`, with PDL when `pdl` (callers pass pdl_enabled()).
template <typename... Params, typename... Args>
cudaError_t launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem_bytes,
                          cudaStream_t stream, bool pdl, Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem_bytes;
  config.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attr;
  config.numAttrs = pdl ? 1 : 0;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

}  // namespace kernels
}  // namespace pyorch
