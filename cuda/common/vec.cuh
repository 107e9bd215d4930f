// Vectorized 16-byte loads and stores: the unit of memory traffic in the elementwise kernels.
#pragma once

#include <cstdint>
#include <initializer_list>

#include "dtype.cuh"

namespace pyorch::kernels {

// 16 bytes of a weight read once (the decode GEMMs' streams): no L1 allocation, optionally the
// 256-byte L2 prefetch hint. Volatile asm: the loads keep their program order, so a batch of them
// is issued before the first use waits (as plain loads the compiler sinks each to its use).
template <bool L2_PREFETCH>
__device__ __forceinline__ uint4 load_weight_chunk(const void* ptr) {
  uint4 v;
  if constexpr (L2_PREFETCH) {
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(ptr));
  } else {
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(ptr));
  }
  return v;
}

// VEC_SIZE elements of T packed into one aligned register-sized chunk.
template <typename T, int VEC_SIZE>
struct alignas(sizeof(T) * VEC_SIZE) Vec {
  T data[VEC_SIZE];

  __device__ __forceinline__ void load(const T* ptr) { *this = *reinterpret_cast<const Vec*>(ptr); }
  __device__ __forceinline__ void store(T* ptr) const { *reinterpret_cast<Vec*>(ptr) = *this; }
};

// The widest vector (at most 16 bytes) whose alignment all the given pointers and strides allow.
template <typename T>
__host__ inline int max_vec_size(int64_t n, std::initializer_list<const void*> ptrs,
                                 std::initializer_list<int64_t> strides) {
  int vec = 16 / static_cast<int>(sizeof(T));
  auto fits = [&](int v) {
    if (n % v != 0) return false;
    for (const void* p : ptrs) {
      if (reinterpret_cast<uintptr_t>(p) % (v * sizeof(T)) != 0) return false;
    }
    for (int64_t s : strides) {
      if (s % v != 0) return false;
    }
    return true;
  };
  while (vec > 1 && !fits(vec)) vec /= 2;
  return vec;
}

}  // namespace pyorch::kernels
