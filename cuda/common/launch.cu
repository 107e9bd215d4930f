// The process-wide PDL setting (pyorch/launch.h) and its per-device capability check.
#include <atomic>

#include <cuda_runtime.h>

#include "pyorch/launch.h"

namespace pyorch {
namespace {

std::atomic<bool> pdl_setting{true};

}  // namespace

void set_pdl_enabled(bool enabled) { pdl_setting.store(enabled, std::memory_order_relaxed); }

// The capability is cached per device: the query costs host time on every launch otherwise.
bool pdl_enabled() {
  if (!pdl_setting.load(std::memory_order_relaxed)) return false;
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cache[kMaxDevices] = {};  // 0 unknown, 1 off, 2 on
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return false;
  if (device < kMaxDevices) {
    const int known = cache[device].load(std::memory_order_relaxed);
    if (known != 0) return known == 2;
  }
  int major = 0;
  const bool on =
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) == cudaSuccess &&
      major >= 9;
  if (device < kMaxDevices) cache[device].store(on ? 2 : 1, std::memory_order_relaxed);
  return on;
}

}  // namespace pyorch
