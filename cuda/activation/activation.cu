// Instantiates the gated activation kernels for each (dtype, activation) behind the C API.
#include "activation/activation.cuh"
#include "pyorch/activation.h"

namespace pyorch {

cudaError_t act_and_mul(void* out, const void* in, Activation act, DType dtype, int64_t num_tokens,
                        int64_t d, int64_t out_stride, int64_t in_stride, cudaStream_t stream) {
  return PYORCH_DISPATCH_FLOAT_TYPES(dtype, T, [&]() -> cudaError_t {
    T* o = static_cast<T*>(out);
    const T* x = static_cast<const T*>(in);
    switch (act) {
      case Activation::kSilu:
        return kernels::launch_act_and_mul<T, Activation::kSilu>(o, x, num_tokens, d, out_stride,
                                                                 in_stride, stream);
      case Activation::kGelu:
        return kernels::launch_act_and_mul<T, Activation::kGelu>(o, x, num_tokens, d, out_stride,
                                                                 in_stride, stream);
      case Activation::kGeluTanh:
        return kernels::launch_act_and_mul<T, Activation::kGeluTanh>(o, x, num_tokens, d,
                                                                     out_stride, in_stride, stream);
    }
    PYORCH_INVALID("act_and_mul: unknown activation %d", static_cast<int>(act));
  });
}

}  // namespace pyorch
