// Instantiates the sampling-side kernels for each logits dtype behind the C API.
#include "pyorch/sampling.h"
#include "sampling/random_sample.cuh"
#include "sampling/token_bitmask.cuh"

namespace pyorch {

cudaError_t apply_token_bitmask_inplace(void* logits, const int32_t* bitmask,
                                        const int32_t* indices, DType dtype, int64_t num_rows,
                                        int64_t num_indices, int64_t vocab_size,
                                        int64_t logits_stride, int64_t bitmask_stride,
                                        cudaStream_t stream) {
  return PYORCH_DISPATCH_FLOAT_TYPES(dtype, T, [&]() -> cudaError_t {
    return kernels::launch_apply_token_bitmask<T>(static_cast<T*>(logits), bitmask, indices,
                                                  num_rows, num_indices, vocab_size, logits_stride,
                                                  bitmask_stride, stream);
  });
}

cudaError_t random_sample_from_logits(int64_t* out, const void* logits, const float* temperature,
                                      const int64_t* seeds, DType dtype, int64_t num_rows,
                                      int64_t vocab_size, int64_t logits_stride,
                                      cudaStream_t stream) {
  return PYORCH_DISPATCH_FLOAT_TYPES(dtype, T, [&]() -> cudaError_t {
    return kernels::launch_random_sample<T>(out, static_cast<const T*>(logits), temperature, seeds,
                                            num_rows, vocab_size, logits_stride, stream);
  });
}

}  // namespace pyorch
