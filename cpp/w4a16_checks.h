// Argument checks of the W4A16 ops (gptq_marlin_repack, awq_marlin_repack, gptq_marlin_gemm),
// shared by the CPU kernels (cpp/cpu/w4a16.cpp) and the CUDA adapters (cpp/ops/w4a16.cpp), so
// both backends accept and reject the same inputs. The tile layout and its constants are in
// cuda/include/pyorch/w4a16_layout.h (no CUDA headers: the CPU build includes it).
#pragma once

#include <cstdint>
#include <optional>

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include "pyorch/w4a16_layout.h"

namespace pyorch {

// vLLM's ScalarType ids (vllm/scalar_type.py): mantissa bits in bits 0-7, exponent bits in 8-15,
// signed in bit 16, bias in bits 17-48. The W4A16 ops take 4-bit unsigned integers: uint4b8
// (bias 8, GPTQ's symmetric codes) and uint4 (with zero points, AWQ).
struct W4A16QuantType {
  bool has_zeros;  // uint4: w = (q - z) * s; uint4b8: w = (q - 8) * s
};

inline W4A16QuantType parse_w4a16_type(int64_t id, const char* op) {
  const int64_t mantissa = id & 0xFF, exponent = (id >> 8) & 0xFF, is_signed = (id >> 16) & 1;
  const int64_t bias = (id >> 17) & 0xFFFFFFFFLL;
  TORCH_CHECK(mantissa == 4 && exponent == 0 && is_signed == 0 && (bias == 8 || bias == 0), op,
              ": b_q_type must be scalar_types.uint4b8 or scalar_types.uint4 (4-bit weights; "
              "8-bit and others are not supported), got id ",
              id);
  return W4A16QuantType{bias == 0};
}

inline void check_w4a16_sizes(int64_t size_k, int64_t size_n, const char* op) {
  TORCH_CHECK(size_k > 0 && size_k % kW4A16BlockK == 0, op, ": size_k (input features) must be a ",
              "positive multiple of ", kW4A16BlockK, ", got ", size_k);
  TORCH_CHECK(size_n > 0 && size_n % kW4A16TileN == 0, op, ": size_n (output features) must be ",
              "a positive multiple of ", kW4A16TileN, ", got ", size_n);
}

inline void check_w4a16_repack(const at::Tensor& b_q_weight, const std::optional<at::Tensor>& perm,
                               int64_t size_k, int64_t size_n, int64_t num_bits, bool awq) {
  const char* op = awq ? "awq_marlin_repack" : "gptq_marlin_repack";
  TORCH_CHECK(num_bits == 4, op, ": only num_bits=4 is supported, got ", num_bits);
  check_w4a16_sizes(size_k, size_n, op);
  TORCH_CHECK(
      b_q_weight.scalar_type() == at::kInt && b_q_weight.dim() == 2 && b_q_weight.is_contiguous(),
      op, ": b_q_weight must be a contiguous 2-D int32 tensor");
  if (awq) {
    TORCH_CHECK(b_q_weight.size(0) == size_k && b_q_weight.size(1) == size_n / 8, op,
                ": AWQ b_q_weight must be [size_k, size_n / 8] = [", size_k, ", ", size_n / 8,
                "], got ", b_q_weight.sizes());
  } else {
    TORCH_CHECK(b_q_weight.size(0) == size_k / 8 && b_q_weight.size(1) == size_n, op,
                ": GPTQ b_q_weight must be [size_k / 8, size_n] = [", size_k / 8, ", ", size_n,
                "], got ", b_q_weight.sizes());
  }
  if (perm && perm->numel() > 0) {
    TORCH_CHECK(perm->scalar_type() == at::kInt && perm->dim() == 1 && perm->numel() == size_k &&
                    perm->is_contiguous() && perm->device() == b_q_weight.device(),
                op, ": perm must be a contiguous [size_k] int32 tensor on b_q_weight's device");
  }
}

// The sizes of a checked gptq_marlin_gemm call.
struct W4A16GemmShape {
  int64_t size_m, size_n, size_k, group_size;
  bool has_zeros;
};

inline W4A16GemmShape check_w4a16_gemm(const at::Tensor& a, const std::optional<at::Tensor>& c,
                                       const at::Tensor& b_q_weight, const at::Tensor& b_scales,
                                       const std::optional<at::Tensor>& b_zeros,
                                       const std::optional<at::Tensor>& perm,
                                       const at::Tensor& workspace, int64_t b_q_type,
                                       int64_t size_m, int64_t size_n, int64_t size_k,
                                       bool allow_fp32) {
  const char* op = "gptq_marlin_gemm";
  const W4A16QuantType type = parse_w4a16_type(b_q_type, op);
  check_w4a16_sizes(size_k, size_n, op);
  const at::ScalarType dtype = a.scalar_type();
  TORCH_CHECK(dtype == at::kHalf || dtype == at::kBFloat16 || (allow_fp32 && dtype == at::kFloat),
              op, ": a must be float16 or bfloat16", allow_fp32 ? " (or float32 on the CPU)" : "",
              ", got ", dtype);
  TORCH_CHECK(a.dim() == 2 && a.size(0) == size_m && a.size(1) == size_k, op, ": a must be [",
              size_m, ", ", size_k, "], got ", a.sizes());
  TORCH_CHECK(a.stride(1) == 1 || size_k <= 1, op, ": a's last dimension must be contiguous");
  TORCH_CHECK(b_q_weight.scalar_type() == at::kInt && b_q_weight.is_contiguous() &&
                  b_q_weight.numel() == size_k * size_n / 8 && b_q_weight.dim() == 2 &&
                  b_q_weight.size(0) == size_n / kW4A16TileN,
              op, ": b_q_weight must be the repacked [size_n / 16, size_k * 2] int32 tensor (",
              "gptq_marlin_repack / awq_marlin_repack), got ", b_q_weight.sizes());
  TORCH_CHECK(b_scales.scalar_type() == dtype && b_scales.dim() == 2 &&
                  b_scales.size(1) == size_n && b_scales.size(0) > 0 && b_scales.is_contiguous(),
              op, ": b_scales must be a contiguous [num_groups, size_n] tensor of a's dtype ",
              dtype, ", got ", b_scales.sizes(), " ", b_scales.scalar_type());
  const int64_t num_groups = b_scales.size(0);
  TORCH_CHECK(size_k % num_groups == 0, op, ": size_k ", size_k, " is not a multiple of the ",
              num_groups, " scale groups");
  const int64_t group_size = size_k / num_groups;
  TORCH_CHECK(group_size % 16 == 0, op, ": the group size (", group_size,
              ") must be a multiple of 16 (32, 64, 128 or the whole of size_k)");
  TORCH_CHECK(
      type.has_zeros == (b_zeros.has_value() && b_zeros->numel() > 0), op,
      type.has_zeros ? ": uint4 weights need b_zeros" : ": uint4b8 weights take no b_zeros");
  if (type.has_zeros) {
    TORCH_CHECK(b_zeros->scalar_type() == at::kInt && b_zeros->is_contiguous() &&
                    b_zeros->dim() == 2 && b_zeros->size(0) == num_groups &&
                    b_zeros->size(1) == size_n / 8,
                op, ": b_zeros must be a contiguous [num_groups, size_n / 8] int32 tensor, got ",
                b_zeros->sizes());
  }
  if (perm && perm->numel() > 0) {
    TORCH_CHECK(perm->scalar_type() == at::kInt && perm->dim() == 1 && perm->numel() == size_k &&
                    perm->is_contiguous(),
                op, ": perm must be a contiguous [size_k] int32 tensor");
  }
  TORCH_CHECK(workspace.scalar_type() == at::kInt && workspace.is_contiguous() &&
                  workspace.numel() >= (size_n + kW4A16BlockN - 1) / kW4A16BlockN,
              op, ": workspace must be a zeroed int32 tensor of at least ceil(size_n / ",
              kW4A16BlockN, ") elements");
  if (c) {
    TORCH_CHECK(c->scalar_type() == dtype && c->dim() == 2 && c->size(0) == size_m &&
                    c->size(1) == size_n && (c->stride(1) == 1 || size_n <= 1),
                op, ": c must be [size_m, size_n] of a's dtype with a contiguous last dimension");
  }
  for (const at::Tensor* t : {&b_q_weight, &b_scales, &workspace}) {
    TORCH_CHECK(t->device() == a.device(), op, ": all tensors must be on a's device");
  }
  TORCH_CHECK((!b_zeros || b_zeros->device() == a.device()) &&
                  (!perm || perm->device() == a.device()) && (!c || c->device() == a.device()),
              op, ": all tensors must be on a's device");
  return W4A16GemmShape{size_m, size_n, size_k, group_size, type.has_zeros};
}

}  // namespace pyorch
