// CUDA adapters of the W4A16 ops: check, guard, stream, call cuda/, check status. Where
// w4a16_mma_path says so (many rows), gptq_marlin_gemm dequantizes the weight in column chunks and
// calls cuBLAS through at::mm (the product is then compute-bound, and cuBLAS's bf16 GEMM wins).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "common.h"
#include "ops.h"
#include "pyorch/w4a16.h"
#include "w4a16_checks.h"

namespace {

const int32_t* optional_ptr(const std::optional<at::Tensor>& t) {
  return t && t->numel() > 0 ? t->const_data_ptr<int32_t>() : nullptr;
}

at::Tensor repack(const at::Tensor& b_q_weight, const std::optional<at::Tensor>& perm,
                  int64_t size_k, int64_t size_n, int64_t num_bits, bool awq) {
  pyorch::check_w4a16_repack(b_q_weight, perm, size_k, size_n, num_bits, awq);
  TORCH_CHECK(b_q_weight.is_cuda(), "marlin repack: b_q_weight must be on a CUDA device here");
  const c10::cuda::OptionalCUDAGuard guard(b_q_weight.device());
  at::Tensor out = at::empty({size_n / pyorch::kW4A16TileN, size_k * 2}, b_q_weight.options());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  if (awq) {
    PYORCH_CHECK_CUDA(pyorch::awq_marlin_repack(
        out.data_ptr<int32_t>(), b_q_weight.const_data_ptr<int32_t>(), size_k, size_n, stream));
  } else {
    PYORCH_CHECK_CUDA(pyorch::gptq_marlin_repack(out.data_ptr<int32_t>(),
                                                 b_q_weight.const_data_ptr<int32_t>(),
                                                 optional_ptr(perm), size_k, size_n, stream));
  }
  return out;
}

}  // namespace

at::Tensor gptq_marlin_repack(const at::Tensor& b_q_weight, const std::optional<at::Tensor>& perm,
                              int64_t size_k, int64_t size_n, int64_t num_bits) {
  return repack(b_q_weight, perm, size_k, size_n, num_bits, /*awq=*/false);
}

at::Tensor awq_marlin_repack(const at::Tensor& b_q_weight, int64_t size_k, int64_t size_n,
                             int64_t num_bits) {
  return repack(b_q_weight, std::nullopt, size_k, size_n, num_bits, /*awq=*/true);
}

at::Tensor gptq_marlin_gemm(const at::Tensor& a, const std::optional<at::Tensor>& c_or_none,
                            const at::Tensor& b_q_weight, const at::Tensor& b_scales,
                            const std::optional<at::Tensor>& b_zeros_or_none,
                            const std::optional<at::Tensor>& perm_or_none,
                            const at::Tensor& workspace, int64_t b_q_type, int64_t size_m,
                            int64_t size_n, int64_t size_k) {
  const pyorch::W4A16GemmShape s =
      pyorch::check_w4a16_gemm(a, c_or_none, b_q_weight, b_scales, b_zeros_or_none, perm_or_none,
                               workspace, b_q_type, size_m, size_n, size_k, /*allow_fp32=*/false);
  TORCH_CHECK(a.is_cuda(), "gptq_marlin_gemm: a must be on a CUDA device here");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(a.const_data_ptr()) % 16 == 0 &&
                  (size_m <= 1 || a.stride(0) % 8 == 0),
              "gptq_marlin_gemm: a's rows must be 16-byte aligned");
  const c10::cuda::OptionalCUDAGuard guard(a.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  at::Tensor out = c_or_none ? *c_or_none : at::empty({size_m, size_n}, a.options());
  if (size_m == 0) return out;
  const pyorch::DType dtype = pyorch::to_pyorch_dtype(a.scalar_type());
  const pyorch::W4A16Type type =
      s.has_zeros ? pyorch::W4A16Type::kUint4 : pyorch::W4A16Type::kUint4b8;
  const int32_t* zeros = optional_ptr(b_zeros_or_none);
  const int32_t* perm = optional_ptr(perm_or_none);
  const int64_t a_stride = size_m <= 1 ? size_k : a.stride(0);
  const int64_t out_stride = size_m <= 1 ? size_n : out.stride(0);
  if (pyorch::w4a16_mma_path(size_m, size_n, size_k)) {
    at::Tensor a_perm = perm != nullptr ? at::empty({size_m, size_k}, a.options()) : at::Tensor();
    const int64_t num_partials = pyorch::w4a16_partials_size(size_m, size_n, size_k);
    at::Tensor partials = at::empty({num_partials}, a.options().dtype(at::kFloat));
    PYORCH_CHECK_CUDA(pyorch::gptq_marlin_gemm(
        out.data_ptr(), a.const_data_ptr(), b_q_weight.const_data_ptr<int32_t>(),
        b_scales.const_data_ptr(), zeros, perm, perm != nullptr ? a_perm.data_ptr() : nullptr,
        const_cast<int32_t*>(workspace.const_data_ptr<int32_t>()),
        num_partials > 0 ? partials.data_ptr<float>() : nullptr, type, dtype, size_m, size_n,
        size_k, s.group_size, a_stride, out_stride, stream));
    return out;
  }
  // Large M: a (permuted for act-order) @ W, W dequantized chunk by chunk of columns.
  at::Tensor a_in = a;
  if (perm != nullptr) {
    a_in = at::empty({size_m, size_k}, a.options());
    PYORCH_CHECK_CUDA(pyorch::w4a16_permute_cols(a_in.data_ptr(), a.const_data_ptr(), perm, dtype,
                                                 size_m, size_k, a_stride, stream));
  }
  const int64_t chunk = pyorch::w4a16_dequant_chunk_cols(size_n, size_k, a.element_size());
  at::Tensor w = at::empty({chunk, size_k}, a.options());
  for (int64_t n0 = 0; n0 < size_n; n0 += chunk) {
    const int64_t cols = std::min(chunk, size_n - n0);
    PYORCH_CHECK_CUDA(pyorch::w4a16_dequantize(w.data_ptr(), b_q_weight.const_data_ptr<int32_t>(),
                                               b_scales.const_data_ptr(), zeros, type, dtype,
                                               size_n, size_k, s.group_size, n0, cols, stream));
    const at::Tensor wc = w.narrow(0, 0, cols);
    if (cols == size_n && out.is_contiguous()) {
      at::mm_out(out, a_in, wc.t());
    } else {
      out.narrow(1, n0, cols).copy_(at::mm(a_in, wc.t()));
    }
  }
  return out;
}
