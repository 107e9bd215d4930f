// Error plumbing for the C API: launchers return cudaError_t, never throw, never synchronize.
#pragma once

#include <cstdio>

#include <cuda_runtime.h>

// Returns the error of the last launch from the enclosing function if there was one.
#define PYORCH_RETURN_IF_ERROR(expr)  \
  do {                                \
    cudaError_t pyorch_err_ = (expr); \
    if (pyorch_err_ != cudaSuccess) { \
      return pyorch_err_;             \
    }                                 \
  } while (0)

// Logs why a value is unsupported and returns cudaErrorInvalidValue; the adapter turns it into a
// Python exception, but adapters check the same conditions first with clearer messages.
#define PYORCH_INVALID(...)                       \
  do {                                            \
    std::fprintf(stderr, "pyorch: " __VA_ARGS__); \
    std::fprintf(stderr, "\n");                   \
    return cudaErrorInvalidValue;                 \
  } while (0)
