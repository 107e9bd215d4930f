// CUDA adapters for cutlass_scaled_mm and cutlass_scaled_mm_azp (vLLM's schemas): the shared
// checks (cpp/quantization_checks.h, the same as the CPU kernels'), then what the CUTLASS kernels
// of cuda/quantization/ need on top (bf16/fp16 out, 16-element alignment, scale layouts), guard,
// stream, call the C API of pyorch/scaled_mm.h. No math here.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <ATen/ops/empty.h>

#include "common.h"
#include "pyorch/scaled_mm.h"
#include "quantization_checks.h"
#include "quantization_ops.h"

static_assert(pyorch::kScaledMmBlock == pyorch::kScaledMmBlockK &&
                  pyorch::kScaledMmBlock == pyorch::kScaledMmBlockN,
              "the shared checks and the CUDA API disagree on the block-scaled GEMM's block size");

namespace {

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

// Row strides (elements); a single row's stride is whatever the view says, so use the packed one.
int64_t a_stride(const at::Tensor& a, const pyorch::ScaledMmShape& s) {
  return s.m <= 1 ? s.k : a.stride(0);
}
int64_t out_stride(const at::Tensor& out, const pyorch::ScaledMmShape& s) {
  return s.m <= 1 ? s.n : out.stride(0);
}

// What the CUTLASS kernels need beyond the shared checks; returns the ab dtype.
pyorch::DType check_cuda_scaled_mm(const at::Tensor& out, const at::Tensor& a, const at::Tensor& b,
                                   const pyorch::ScaledMmShape& s, const char* op) {
  TORCH_CHECK(pyorch::cutlass_scaled_mm_available(), op,
              ": pyorch was built without CUTLASS (install nvidia-cutlass==4.2.0.0 and rebuild), "
              "so the CUDA scaled GEMMs are not available");
  TORCH_CHECK(a.is_cuda(), op, ": tensors must be on a CUDA device");
  int major = 0, minor = 0;
  PYORCH_CHECK_CUDA(
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, a.device().index()));
  PYORCH_CHECK_CUDA(
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, a.device().index()));
  TORCH_CHECK(major == 9 && minor == 0, op,
              ": the CUTLASS kernels are built for sm_90a (H100/H200); this GPU is sm_", major,
              minor);
  TORCH_CHECK(out.scalar_type() == at::kBFloat16 || out.scalar_type() == at::kHalf, op,
              ": on CUDA out must be bfloat16 or float16 (as vLLM's), got ", out.scalar_type());
  TORCH_CHECK(s.k % 16 == 0 && s.n % 16 == 0, op, ": on CUDA K (", s.k, ") and N (", s.n,
              ") must be multiples of 16");
  TORCH_CHECK(s.m >= 1, op, ": a has no rows");
  TORCH_CHECK(a_stride(a, s) % 16 == 0 && b.stride(1) % 16 == 0 && out_stride(out, s) % 8 == 0, op,
              ": a's and b's leading strides must be multiples of 16 elements, out's of 8");
  TORCH_CHECK(aligned16(a.const_data_ptr()) && aligned16(b.const_data_ptr()) &&
                  aligned16(out.const_data_ptr()),
              op, ": a, b and out must be 16-byte aligned");
  return a.scalar_type() == at::kChar ? pyorch::DType::kInt8 : pyorch::DType::kFp8E4M3;
}

// The block-scaled GEMM's scale layouts (pyorch/scaled_mm.h): a_scales column-major with a
// 16-byte multiple stride between groups, b_scales with k-groups contiguous per n-block. vLLM's
// callers pass these (per_token_group_fp8_quant with column-major scales; weight_scale.t());
// other layouts are copied into it first.
void scaled_mm_blockwise(at::Tensor& out, const at::Tensor& a, const at::Tensor& b,
                         const at::Tensor& a_scales, const at::Tensor& b_scales,
                         const std::optional<at::Tensor>& bias, const pyorch::ScaledMmShape& s) {
  const char* op = "cutlass_scaled_mm";
  TORCH_CHECK(s.k % pyorch::kScaledMmBlockK == 0, op, ": block-wise scales on CUDA need K (", s.k,
              ") to be a multiple of ", pyorch::kScaledMmBlockK);
  const int64_t kb = s.k / pyorch::kScaledMmBlockK;
  const int64_t padded_m = (s.m + 3) / 4 * 4;
  at::Tensor sa = a_scales;
  int64_t sa_stride = kb <= 1 ? padded_m : a_scales.stride(1);
  const bool sa_ok = (s.m <= 1 || a_scales.stride(0) == 1) && sa_stride >= s.m &&
                     sa_stride % 4 == 0 && aligned16(a_scales.const_data_ptr());
  if (!sa_ok) {
    at::Tensor buf = at::empty({kb, padded_m}, a_scales.options());
    buf.narrow(1, 0, s.m).copy_(a_scales.t());
    sa = buf;
    sa_stride = padded_m;
  }
  const int64_t nb = b_scales.size(1);
  const bool sb_ok = (kb <= 1 || b_scales.stride(0) == 1) && (nb <= 1 || b_scales.stride(1) == kb);
  const at::Tensor sb = sb_ok ? b_scales : b_scales.t().contiguous();  // [nb, kb] row-major
  PYORCH_CHECK_CUDA(pyorch::cutlass_scaled_mm_blockwise(
      out.data_ptr(), a.const_data_ptr(), b.const_data_ptr(), sa.const_data_ptr<float>(),
      sb.const_data_ptr<float>(), bias ? bias->const_data_ptr() : nullptr,
      pyorch::to_pyorch_dtype(out.scalar_type()), s.m, s.n, s.k, out_stride(out, s), a_stride(a, s),
      b.stride(1), sa_stride, c10::cuda::getCurrentCUDAStream()));
}

}  // namespace

void cutlass_scaled_mm(at::Tensor& out, const at::Tensor& a, const at::Tensor& b,
                       const at::Tensor& a_scales, const at::Tensor& b_scales,
                       const std::optional<at::Tensor>& bias) {
  const char* op = "cutlass_scaled_mm";
  const pyorch::ScaledMmShape s =
      pyorch::check_cutlass_scaled_mm(out, a, b, a_scales, b_scales, bias);
  const c10::cuda::OptionalCUDAGuard guard(a.device());
  const pyorch::DType ab_dtype = check_cuda_scaled_mm(out, a, b, s, op);
  if (s.scales == pyorch::ScaledMmScales::kBlock) {
    scaled_mm_blockwise(out, a, b, a_scales, b_scales, bias, s);
    return;
  }
  PYORCH_CHECK_CUDA(pyorch::cutlass_scaled_mm(
      out.data_ptr(), a.const_data_ptr(), b.const_data_ptr(), a_scales.const_data_ptr<float>(),
      b_scales.const_data_ptr<float>(), bias ? bias->const_data_ptr() : nullptr, ab_dtype,
      pyorch::to_pyorch_dtype(out.scalar_type()), s.m, s.n, s.k, out_stride(out, s), a_stride(a, s),
      b.stride(1), s.per_token_a, s.per_channel_b, c10::cuda::getCurrentCUDAStream()));
}

void cutlass_scaled_mm_azp(at::Tensor& out, const at::Tensor& a, const at::Tensor& b,
                           const at::Tensor& a_scales, const at::Tensor& b_scales,
                           const at::Tensor& azp_adj, const std::optional<at::Tensor>& azp,
                           const std::optional<at::Tensor>& bias) {
  const char* op = "cutlass_scaled_mm_azp";
  const pyorch::ScaledMmShape s =
      pyorch::check_cutlass_scaled_mm_azp(out, a, b, a_scales, b_scales, azp_adj, azp, bias);
  const c10::cuda::OptionalCUDAGuard guard(a.device());
  check_cuda_scaled_mm(out, a, b, s, op);
  PYORCH_CHECK_CUDA(pyorch::cutlass_scaled_mm_azp(
      out.data_ptr(), a.const_data_ptr(), b.const_data_ptr(), a_scales.const_data_ptr<float>(),
      b_scales.const_data_ptr<float>(), azp_adj.const_data_ptr<int32_t>(),
      azp ? azp->const_data_ptr<int32_t>() : nullptr, bias ? bias->const_data_ptr() : nullptr,
      pyorch::to_pyorch_dtype(out.scalar_type()), s.m, s.n, s.k, out_stride(out, s), a_stride(a, s),
      b.stride(1), s.per_token_a, s.per_channel_b, c10::cuda::getCurrentCUDAStream()));
}
