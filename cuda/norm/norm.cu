// Instantiates the norm kernels for each dtype behind the torch-free C API.
#include "norm/rms_norm.cuh"
#include "pyorch/norm.h"

namespace pyorch {

cudaError_t rms_norm(void* out, const void* in, const void* weight, DType dtype, int64_t num_tokens,
                     int64_t hidden_size, int64_t out_stride, int64_t in_stride, float eps,
                     cudaStream_t stream) {
  return PYORCH_DISPATCH_FLOAT_TYPES(dtype, T, [&] {
    return kernels::launch_rms_norm<T>(static_cast<T*>(out), static_cast<const T*>(in),
                                       static_cast<const T*>(weight), num_tokens, hidden_size,
                                       out_stride, in_stride, eps, stream);
  });
}

cudaError_t fused_add_rms_norm(void* input, void* residual, const void* weight, DType dtype,
                               int64_t num_tokens, int64_t hidden_size, int64_t input_stride,
                               int64_t residual_stride, float eps, cudaStream_t stream) {
  return PYORCH_DISPATCH_FLOAT_TYPES(dtype, T, [&] {
    return kernels::launch_fused_add_rms_norm<T>(
        static_cast<T*>(input), static_cast<T*>(residual), static_cast<const T*>(weight),
        num_tokens, hidden_size, input_stride, residual_stride, eps, stream);
  });
}

}  // namespace pyorch
