// CPU kernels of the W4A16 ops: the repacks into pyorch's tile layout and gptq_marlin_gemm, which
// dequantizes 64 output columns at a time into an fp32 buffer (each weight rounded to a's dtype
// first, as the CUDA kernel's registers hold it) and multiplies it with at::mm, the column chunks
// spread over the threads. Same contracts as the CUDA ops (cuda/include/pyorch/w4a16.h).
#include <algorithm>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "ops.h"
#include "w4a16_checks.h"

namespace pyorch::cpu {
namespace {

// Output columns dequantized per task: 4 n-tiles, like a CUDA thread block.
constexpr int64_t kColumnsPerTask = kW4A16BlockN;

template <bool AWQ>
at::Tensor repack(const at::Tensor& b_q_weight, const std::optional<at::Tensor>& perm,
                  int64_t size_k, int64_t size_n) {
  at::Tensor out = at::empty({size_n / kW4A16TileN, size_k * 2}, b_q_weight.options());
  const auto* src = reinterpret_cast<const uint32_t*>(b_q_weight.const_data_ptr<int32_t>());
  const int32_t* p = perm && perm->numel() > 0 ? perm->const_data_ptr<int32_t>() : nullptr;
  if (p != nullptr) {
    for (int64_t k = 0; k < size_k; ++k) {
      TORCH_CHECK(p[k] >= 0 && p[k] < size_k, "gptq_marlin_repack: perm[", k, "] = ", p[k],
                  " is out of range");
    }
  }
  auto* dst = reinterpret_cast<uint32_t*>(out.data_ptr<int32_t>());
  at::parallel_for(0, size_k * size_n / 8, 4096, [&](int64_t begin, int64_t end) {
    for (int64_t word = begin; word < end; ++word) {
      uint32_t packed = 0;
      for (int c = 0; c < 8; ++c) {
        int64_t n, k;
        w4a16_code_coord(word, c, size_k, size_n, &n, &k);
        uint32_t code;
        if (AWQ) {
          code = src[k * (size_n / 8) + n / 8] >> (4 * awq_nibble_of_column(n % 8));
        } else {
          const int64_t src_k = p != nullptr ? p[k] : k;
          code = src[(src_k / 8) * size_n + n] >> (4 * (src_k % 8));
        }
        packed |= (code & 0xF) << (4 * c);
      }
      dst[word] = packed;
    }
  });
  return out;
}

// w [columns, size_k] (fp32) = W^T of the tile columns n0 .. n0 + columns, each value (q - z) * s
// rounded to T (exact for float). Walks the tiles in storage order (w4a16_layout.h): a lane's 16
// codes of a k-block share one group, so its two columns' scales and zeros are read once.
template <typename T>
void dequantize_columns(float* w, const uint32_t* b_q, const T* scales, const uint32_t* zeros,
                        int64_t size_n, int64_t size_k, int64_t group_size, int64_t n0,
                        int64_t columns) {
  const int64_t kblocks = size_k / kW4A16BlockK;
  for (int64_t nt = n0 / kW4A16TileN; nt < (n0 + columns) / kW4A16TileN; ++nt) {
    for (int64_t kb = 0; kb < kblocks; ++kb) {
      const uint32_t* block =
          b_q + w4a16_block_index(nt, kb, kblocks, size_n / kW4A16TileN) * kW4A16WordsPerBlock;
      for (int lane = 0; lane < 32; ++lane) {
        const int g = lane / 4, t = lane % 4;
        const int64_t group = (kb * kW4A16BlockK + 16 * t) / group_size;
        float scale[2];
        int zero[2];
        for (int half = 0; half < 2; ++half) {
          const int64_t n = nt * kW4A16TileN + g + 8 * half;
          scale[half] = static_cast<float>(scales[group * size_n + n]);
          zero[half] =
              zeros != nullptr
                  ? static_cast<int>((zeros[group * (size_n / 8) + n / 8] >> (4 * (n % 8))) & 0xF)
                  : 8;
        }
        for (int kt = 0; kt < 4; ++kt) {
          const uint32_t packed = block[lane * 4 + kt];
          for (int c = 0; c < 8; ++c) {
            const int r = c % 4, h = c / 4, half = r % 2;
            const int64_t n = nt * kW4A16TileN + g + 8 * half;
            const int64_t k = kb * kW4A16BlockK + 16 * t + 4 * kt + h + 2 * (r / 2);
            const int q = static_cast<int>((packed >> (4 * c)) & 0xF);
            w[(n - n0) * size_k + k] = static_cast<float>(
                static_cast<T>(static_cast<float>(q - zero[half]) * scale[half]));
          }
        }
      }
    }
  }
}

template <typename T>
void gemm(float* out, const at::Tensor& a_float, const at::Tensor& b_q_weight,
          const at::Tensor& b_scales, const std::optional<at::Tensor>& b_zeros,
          const W4A16GemmShape& s) {
  const auto* b_q = reinterpret_cast<const uint32_t*>(b_q_weight.const_data_ptr<int32_t>());
  const T* scales = b_scales.const_data_ptr<T>();
  const uint32_t* zeros =
      s.has_zeros ? reinterpret_cast<const uint32_t*>(b_zeros->const_data_ptr<int32_t>()) : nullptr;
  const int64_t num_tasks = (s.size_n + kColumnsPerTask - 1) / kColumnsPerTask;
  at::parallel_for(0, num_tasks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buffer(kColumnsPerTask * s.size_k);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t n0 = task * kColumnsPerTask;
      const int64_t columns = std::min(kColumnsPerTask, s.size_n - n0);
      dequantize_columns<T>(buffer.data(), b_q, scales, zeros, s.size_n, s.size_k, s.group_size, n0,
                            columns);
      const at::Tensor w = at::from_blob(buffer.data(), {columns, s.size_k}, at::kFloat);
      // [size_m, columns] fp32. Written through a raw pointer: parallel_for's threads do not
      // carry the caller's InferenceMode, and an in-place op on its tensors would be refused.
      const at::Tensor part = at::mm(a_float, w.t()).contiguous();
      const float* src = part.const_data_ptr<float>();
      for (int64_t m = 0; m < s.size_m; ++m) {
        std::copy(src + m * columns, src + (m + 1) * columns, out + m * s.size_n + n0);
      }
    }
  });
}

}  // namespace

at::Tensor gptq_marlin_repack(const at::Tensor& b_q_weight, const std::optional<at::Tensor>& perm,
                              int64_t size_k, int64_t size_n, int64_t num_bits) {
  check_w4a16_repack(b_q_weight, perm, size_k, size_n, num_bits, /*awq=*/false);
  return repack<false>(b_q_weight, perm, size_k, size_n);
}

at::Tensor awq_marlin_repack(const at::Tensor& b_q_weight, int64_t size_k, int64_t size_n,
                             int64_t num_bits) {
  check_w4a16_repack(b_q_weight, std::nullopt, size_k, size_n, num_bits, /*awq=*/true);
  return repack<true>(b_q_weight, std::nullopt, size_k, size_n);
}

at::Tensor gptq_marlin_gemm(const at::Tensor& a, const std::optional<at::Tensor>& c_or_none,
                            const at::Tensor& b_q_weight, const at::Tensor& b_scales,
                            const std::optional<at::Tensor>& b_zeros_or_none,
                            const std::optional<at::Tensor>& perm_or_none,
                            const at::Tensor& workspace, int64_t b_q_type, int64_t size_m,
                            int64_t size_n, int64_t size_k) {
  const W4A16GemmShape s =
      check_w4a16_gemm(a, c_or_none, b_q_weight, b_scales, b_zeros_or_none, perm_or_none, workspace,
                       b_q_type, size_m, size_n, size_k, /*allow_fp32=*/true);
  at::Tensor out = c_or_none ? *c_or_none : at::empty({size_m, size_n}, a.options());
  if (size_m == 0) return out;
  at::Tensor a_in = a;
  if (perm_or_none && perm_or_none->numel() > 0) {
    const at::Tensor perm = perm_or_none->to(at::kLong);
    TORCH_CHECK(perm.min().item<int64_t>() >= 0 && perm.max().item<int64_t>() < size_k,
                "gptq_marlin_gemm: perm holds indices out of [0, size_k)");
    a_in = a.index_select(1, perm);
  }
  const at::Tensor a_float = a_in.to(at::kFloat).contiguous();
  at::Tensor out_float = at::empty({size_m, size_n}, a.options().dtype(at::kFloat));
  switch (a.scalar_type()) {
    case at::kBFloat16:
      gemm<at::BFloat16>(out_float.data_ptr<float>(), a_float, b_q_weight, b_scales,
                         b_zeros_or_none, s);
      break;
    case at::kHalf:
      gemm<at::Half>(out_float.data_ptr<float>(), a_float, b_q_weight, b_scales, b_zeros_or_none,
                     s);
      break;
    default:
      gemm<float>(out_float.data_ptr<float>(), a_float, b_q_weight, b_scales, b_zeros_or_none, s);
      break;
  }
  out.copy_(out_float);
  return out;
}

}  // namespace pyorch::cpu
