// Vectorized 16-byte loads and stores: the unit of memory traffic in the elementwise kernels.
#pragma once

#include <cstdint>
#include <initializer_list>

#include "dtype.cuh"

namespace pyorch::kernels {

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
