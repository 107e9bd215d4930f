// The process-wide PDL setting (pyorch/launch.h), its per-device capability check, and the
// per-device SM count (common/launch.cuh).
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

int current_device_sm_count() {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cache[kMaxDevices] = {};  // 0: not asked yet
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    cudaGetLastError();  // not sticky: leave no error behind for the caller's next check
    return 0;
  }
  if (device >= 0 && device < kMaxDevices) {
    const int known = cache[device].load(std::memory_order_relaxed);
    if (known > 0) return known;
  }
  int count = 0;
  if (cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
      count <= 0) {
    cudaGetLastError();
    return 0;
  }
  if (device >= 0 && device < kMaxDevices) cache[device].store(count, std::memory_order_relaxed);
  return count;
}

}  // namespace pyorch
