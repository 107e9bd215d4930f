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
// Launchers pass pdl_enabled() (pyorch/launch.h): off on older GPUs and wherever the process
// turned PDL off with set_pdl_enabled(false) (pyorch does for PYORCH_PDL=0).
#pragma once

#include <utility>

#include <cuda_runtime.h>

#include "pyorch/launch.h"

namespace pyorch {

// The current device's SM count, asked once per device (the query costs host time on every
// launch otherwise); 0 when it cannot be asked. Launchers that size grids by it keep their own
// fallback for 0. Safe to call from any thread.
int current_device_sm_count();

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
