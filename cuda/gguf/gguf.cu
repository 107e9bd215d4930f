// The GGUF kernels behind the torch-free C API (pyorch/gguf.h): type table, argument checks, the
// q8_1 workspace and the type / token-count dispatch.
#include "gguf/gguf_blocks.cuh"
#include "gguf/gguf_dequantize.cuh"
#include "gguf/gguf_mmq.cuh"
#include "gguf/gguf_mmvq.cuh"
#include "gguf/gguf_q8_1.cuh"
#include "pyorch/gguf.h"

namespace pyorch {

namespace {

using kernels::gguf::Q81Scale;

struct TypeInfo {
  const char* name;
  int64_t block_size;
  int64_t block_bytes;
  bool quantized;
};

TypeInfo type_info(int32_t type) {
  switch (static_cast<GgmlType>(type)) {
    case GgmlType::kF32: return {"F32", 1, 4, false};
    case GgmlType::kF16: return {"F16", 1, 2, false};
    case GgmlType::kBF16: return {"BF16", 1, 2, false};
    case GgmlType::kQ4_0: return {"Q4_0", 32, 18, true};
    case GgmlType::kQ4_1: return {"Q4_1", 32, 20, true};
    case GgmlType::kQ5_0: return {"Q5_0", 32, 22, true};
    case GgmlType::kQ5_1: return {"Q5_1", 32, 24, true};
    case GgmlType::kQ8_0: return {"Q8_0", 32, 34, true};
    case GgmlType::kQ2_K: return {"Q2_K", 256, 84, true};
    case GgmlType::kQ3_K: return {"Q3_K", 256, 110, true};
    case GgmlType::kQ4_K: return {"Q4_K", 256, 144, true};
    case GgmlType::kQ5_K: return {"Q5_K", 256, 176, true};
    case GgmlType::kQ6_K: return {"Q6_K", 256, 210, true};
  }
  return {"unknown", 0, 0, false};
}

// The table above and the decoders must agree.
template <int TYPE>
constexpr bool traits_match(int64_t size, int64_t bytes) {
  return kernels::gguf::BlockTraits<TYPE>::kBlockSize == size &&
         kernels::gguf::BlockTraits<TYPE>::kBlockBytes == bytes;
}
static_assert(traits_match<2>(32, 18) && traits_match<3>(32, 20) && traits_match<6>(32, 22) &&
                  traits_match<7>(32, 24) && traits_match<8>(32, 34) && traits_match<10>(256, 84) &&
                  traits_match<11>(256, 110) && traits_match<12>(256, 144) &&
                  traits_match<13>(256, 176) && traits_match<14>(256, 210),
              "block sizes");

size_t align16(size_t n) { return (n + 15) / 16 * 16; }

// The decoders read 4-byte words from blocks whose size is a multiple of 4 (and 2-byte halves
// otherwise), so rows must start at such addresses.
bool weight_aligned(const void* weight, int64_t weight_row_stride_bytes, const TypeInfo& info) {
  const int64_t align = info.block_bytes % 4 == 0 ? 4 : 2;
  return reinterpret_cast<uintptr_t>(weight) % align == 0 && weight_row_stride_bytes % align == 0;
}

bool is_float_dtype(DType dtype) {
  return dtype == DType::kFloat32 || dtype == DType::kFloat16 || dtype == DType::kBFloat16;
}

template <typename T>
cudaError_t launch_convert(void* out, const void* weight, int32_t type, int64_t rows, int64_t cols,
                           int64_t weight_row_stride_bytes, int64_t out_stride,
                           cudaStream_t stream) {
  constexpr int kThreads = 256;
  const int64_t grid = (rows * cols + kThreads - 1) / kThreads;
  const auto* src = static_cast<const uint8_t*>(weight);
  T* dst = static_cast<T*>(out);
  switch (static_cast<GgmlType>(type)) {
    case GgmlType::kF32:
      kernels::gguf::convert_kernel<float, T><<<grid, kThreads, 0, stream>>>(
          dst, src, rows, cols, weight_row_stride_bytes, out_stride);
      break;
    case GgmlType::kF16:
      kernels::gguf::convert_kernel<__half, T><<<grid, kThreads, 0, stream>>>(
          dst, src, rows, cols, weight_row_stride_bytes, out_stride);
      break;
    default:
      kernels::gguf::convert_kernel<__nv_bfloat16, T><<<grid, kThreads, 0, stream>>>(
          dst, src, rows, cols, weight_row_stride_bytes, out_stride);
      break;
  }
  return cudaGetLastError();
}

// Checks shared by both products; quantizes the activation into the workspace.
cudaError_t prepare_mul_mat(const char* op, const void* input, const void* weight, void* workspace,
                            int32_t type, DType dtype, int64_t num_tokens, int64_t output_size,
                            int64_t input_size, int64_t weight_row_stride_bytes,
                            int64_t input_stride, cudaStream_t stream) {
  const TypeInfo info = type_info(type);
  if (!info.quantized) PYORCH_INVALID("%s: GGML type %d has no product kernel", op, int(type));
  if (!is_float_dtype(dtype)) PYORCH_INVALID("%s: dtype %s", op, dtype_name(dtype));
  if (num_tokens < 0 || output_size < 0 || input_size < 0 || input_size % info.block_size != 0) {
    PYORCH_INVALID("%s: input_size %lld is not a whole number of %s blocks", op,
                   static_cast<long long>(input_size), info.name);
  }
  if (!weight_aligned(weight, weight_row_stride_bytes, info) ||
      reinterpret_cast<uintptr_t>(workspace) % 16 != 0) {
    PYORCH_INVALID("%s: weight rows must be %d-byte aligned, the workspace 16-byte aligned", op,
                   info.block_bytes % 4 == 0 ? 4 : 2);
  }
  if (num_tokens == 0 || input_size == 0) return cudaSuccess;
  return gguf_quantize_q8_1(workspace, input, dtype, num_tokens, input_size, input_stride, stream);
}

cudaError_t zero_output(void* out, DType dtype, int64_t num_tokens, int64_t output_size,
                        int64_t out_stride, cudaStream_t stream) {
  // input_size == 0: the product is all zeros.
  const size_t elem = dtype == DType::kFloat32 ? 4 : 2;
  return cudaMemset2DAsync(out, out_stride * elem, 0, output_size * elem, num_tokens, stream);
}

}  // namespace

int64_t gguf_block_size(int32_t type) { return type_info(type).block_size; }
int64_t gguf_block_bytes(int32_t type) { return type_info(type).block_bytes; }
bool gguf_has_mul_mat(int32_t type) { return type_info(type).quantized; }
const char* gguf_type_name(int32_t type) { return type_info(type).name; }

cudaError_t gguf_dequantize(void* out, const void* weight, int32_t type, DType dtype, int64_t rows,
                            int64_t cols, int64_t weight_row_stride_bytes, int64_t out_stride,
                            cudaStream_t stream) {
  const TypeInfo info = type_info(type);
  if (info.block_size == 0) PYORCH_INVALID("gguf_dequantize: unknown GGML type %d", int(type));
  if (rows < 0 || cols < 0 || cols % info.block_size != 0) {
    PYORCH_INVALID("gguf_dequantize: %lld columns are not a whole number of %s blocks",
                   static_cast<long long>(cols), info.name);
  }
  if (!weight_aligned(weight, weight_row_stride_bytes, info)) {
    PYORCH_INVALID("gguf_dequantize: weight rows must be %d-byte aligned",
                   info.block_bytes % 4 == 0 ? 4 : 2);
  }
  if (rows == 0 || cols == 0) return cudaSuccess;
  return PYORCH_DISPATCH_FLOAT_TYPES(dtype, T, [&] {
    if (!info.quantized) {
      return launch_convert<T>(out, weight, type, rows, cols, weight_row_stride_bytes, out_stride,
                               stream);
    }
    return PYORCH_DISPATCH_GGUF_QUANT(type, TYPE, [&] {
      constexpr int kThreads = 128;
      const int64_t num_subs = rows * (cols / kernels::gguf::kSubSize);
      const int64_t grid = (num_subs + kThreads - 1) / kThreads;
      const bool vec =
          reinterpret_cast<uintptr_t>(out) % 16 == 0 && (out_stride * sizeof(T)) % 16 == 0;
      auto* kernel = vec ? kernels::gguf::dequantize_kernel<TYPE, T, true>
                         : kernels::gguf::dequantize_kernel<TYPE, T, false>;
      kernel<<<grid, kThreads, 0, stream>>>(static_cast<T*>(out),
                                            static_cast<const uint8_t*>(weight), rows, cols,
                                            weight_row_stride_bytes, out_stride);
      return cudaGetLastError();
    });
  });
}

size_t gguf_workspace_xds_offset(int64_t num_tokens, int64_t input_size) {
  return align16(static_cast<size_t>(num_tokens * input_size));
}

size_t gguf_workspace_bytes(int64_t num_tokens, int64_t input_size) {
  return gguf_workspace_xds_offset(num_tokens, input_size) +
         static_cast<size_t>(num_tokens * (input_size / 32)) * sizeof(Q81Scale);
}

cudaError_t gguf_quantize_q8_1(void* workspace, const void* input, DType dtype, int64_t num_tokens,
                               int64_t input_size, int64_t input_stride, cudaStream_t stream) {
  if (input_size % 32 != 0) {
    PYORCH_INVALID("gguf_quantize_q8_1: input_size %lld is not a multiple of 32",
                   static_cast<long long>(input_size));
  }
  auto* xq = static_cast<int8_t*>(workspace);
  auto* xds = reinterpret_cast<Q81Scale*>(static_cast<char*>(workspace) +
                                          gguf_workspace_xds_offset(num_tokens, input_size));
  return PYORCH_DISPATCH_FLOAT_TYPES(dtype, T, [&] {
    return kernels::gguf::launch_quantize_q8_1<T>(xq, xds, static_cast<const T*>(input), num_tokens,
                                                  input_size, input_stride, stream);
  });
}

cudaError_t gguf_mul_mat_vec(void* out, const void* input, const void* weight, void* workspace,
                             int32_t type, DType dtype, int64_t num_tokens, int64_t output_size,
                             int64_t input_size, int64_t weight_row_stride_bytes,
                             int64_t input_stride, int64_t out_stride, cudaStream_t stream,
                             const GgufMulMatVecConfig* config) {
  // Defaults: see GgufMulMatVecConfig. NOTE(gguf): first H100 run (commit ad53a07, register
  // double-buffering, no L2 hint): two sub-blocks per lane beat four on every Q4_K / Q8_0 8B
  // shape at M = 1 (four: more registers, fewer resident warps, and a second wave for the
  // 4096-row shapes), PDL gained 1-15%.
  int subs_per_lane = 2;
  int num_stages = 3;
  bool l2_256 = true;
  bool pdl = pdl_enabled();
  if (config != nullptr) {  // the caller's non-default fields win
    if (config->subs_per_lane >= 0) subs_per_lane = config->subs_per_lane;
    if (config->num_stages >= 0) num_stages = config->num_stages;
    if (config->l2_prefetch >= 0) l2_256 = config->l2_prefetch > 0;
    if (config->pdl >= 0) pdl = config->pdl > 0 && pdl_enabled();
  }
  if (subs_per_lane != 2 && subs_per_lane != 4) {
    PYORCH_INVALID("gguf_mul_mat_vec: subs_per_lane %d is not 2 or 4", subs_per_lane);
  }
  if (num_stages < 2 || num_stages > 4) {
    PYORCH_INVALID("gguf_mul_mat_vec: num_stages %d is not 2, 3 or 4", num_stages);
  }
  PYORCH_RETURN_IF_ERROR(prepare_mul_mat("gguf_mul_mat_vec", input, weight, workspace, type, dtype,
                                         num_tokens, output_size, input_size,
                                         weight_row_stride_bytes, input_stride, stream));
  if (num_tokens == 0 || output_size == 0) return cudaSuccess;
  if (input_size == 0) return zero_output(out, dtype, num_tokens, output_size, out_stride, stream);
  const auto* xq = static_cast<const int8_t*>(workspace);
  const auto* xds = reinterpret_cast<const Q81Scale*>(
      static_cast<const char*>(workspace) + gguf_workspace_xds_offset(num_tokens, input_size));
  const auto* w = static_cast<const uint8_t*>(weight);
  const int64_t subs = input_size / 32;
  return PYORCH_DISPATCH_GGUF_QUANT(type, TYPE, [&] {
    // Passes of up to 8 tokens, each reading the whole weight.
    for (int64_t t0 = 0; t0 < num_tokens; t0 += kGgufMulMatVecMaxTokens) {
      const int n = static_cast<int>(std::min(kGgufMulMatVecMaxTokens, num_tokens - t0));
      void* o = static_cast<char*>(out) + t0 * out_stride * (dtype == DType::kFloat32 ? 4 : 2);
      const int8_t* q = xq + t0 * input_size;
      const Q81Scale* ds = xds + t0 * subs;
      cudaError_t err;
      if (n == 1) {
        err = kernels::gguf::launch_mul_mat_vec<TYPE, 1>(
            o, dtype, w, q, ds, n, output_size, input_size, weight_row_stride_bytes, out_stride,
            subs_per_lane, num_stages, l2_256, pdl, stream);
      } else if (n == 2) {
        err = kernels::gguf::launch_mul_mat_vec<TYPE, 2>(
            o, dtype, w, q, ds, n, output_size, input_size, weight_row_stride_bytes, out_stride,
            subs_per_lane, num_stages, l2_256, pdl, stream);
      } else if (n <= 4) {
        err = kernels::gguf::launch_mul_mat_vec<TYPE, 4>(
            o, dtype, w, q, ds, n, output_size, input_size, weight_row_stride_bytes, out_stride,
            subs_per_lane, num_stages, l2_256, pdl, stream);
      } else {
        err = kernels::gguf::launch_mul_mat_vec<TYPE, 8>(
            o, dtype, w, q, ds, n, output_size, input_size, weight_row_stride_bytes, out_stride,
            subs_per_lane, num_stages, l2_256, pdl, stream);
      }
      PYORCH_RETURN_IF_ERROR(err);
    }
    return cudaSuccess;
  });
}

cudaError_t gguf_mul_mat(void* out, const void* input, const void* weight, void* workspace,
                         int32_t type, DType dtype, int64_t num_tokens, int64_t output_size,
                         int64_t input_size, int64_t weight_row_stride_bytes, int64_t input_stride,
                         int64_t out_stride, cudaStream_t stream) {
  PYORCH_RETURN_IF_ERROR(prepare_mul_mat("gguf_mul_mat", input, weight, workspace, type, dtype,
                                         num_tokens, output_size, input_size,
                                         weight_row_stride_bytes, input_stride, stream));
  if (num_tokens == 0 || output_size == 0) return cudaSuccess;
  if (input_size == 0) return zero_output(out, dtype, num_tokens, output_size, out_stride, stream);
  const auto* xq = static_cast<const int8_t*>(workspace);
  const auto* xds = reinterpret_cast<const Q81Scale*>(
      static_cast<const char*>(workspace) + gguf_workspace_xds_offset(num_tokens, input_size));
  return PYORCH_DISPATCH_GGUF_QUANT(type, TYPE, [&] {
    return kernels::gguf::launch_mul_mat<TYPE>(out, dtype, static_cast<const uint8_t*>(weight), xq,
                                               xds, num_tokens, output_size, input_size,
                                               weight_row_stride_bytes, out_stride, stream);
  });
}

}  // namespace pyorch
