// CPU GGUF ops: ggml_dequantize, ggml_mul_mat_vec_a8 and ggml_mul_mat_a8 (schemas in
// cpp/torch_bindings.cpp). The products read the quantized blocks directly, llama.cpp-style: each
// activation row is quantized to 8 bits with one fp32 scale per 32 values (qx = round(x / dx),
// dx = max|x| / 127), and every block of the weight is decoded to small unsigned integers
// (cpp/cpu/gguf_decode.h) and dotted with it in integer arithmetic. K-quants use the same
// per-32 activation scales as the 32-element types (llama.cpp's q8_K uses one per 256: ours is
// at least as precise and lets every type share the activation). The kernel is compiled three
// times (cpp/cpu/gguf_kernel.inc): AVX-512 VNNI, AVX2 and portable C++, picked at run time from
// the CPU's features (gguf_cpu_isa() to inspect or force one). Rows are split over threads with
// at::parallel_for.
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define PYORCH_GGUF_X86 1
#else
#define PYORCH_GGUF_X86 0
#endif

#include "cpu/cpu_utils.h"
#include "cpu/gguf_decode.h"
#include "gguf_checks.h"
#include "gguf_fused.h"
#include "ops.h"

namespace pyorch::cpu {
namespace {

using pyorch::gguf::GgmlType;
using pyorch::gguf::GgmlTypeInfo;

// Tokens whose accumulators one pass over a weight row keeps (the row's blocks are decoded
// once per pass).
constexpr int kTokenTile = 8;

template <int64_t TYPE>
constexpr int64_t gd_type_size() {
  switch (TYPE) {
    case GgmlType::kQ4_0: return 18;
    case GgmlType::kQ4_1: return 20;
    case GgmlType::kQ5_0: return 22;
    case GgmlType::kQ5_1: return 24;
    case GgmlType::kQ8_0: return 34;
    case GgmlType::kQ2_K: return 84;
    case GgmlType::kQ3_K: return 110;
    case GgmlType::kQ4_K: return 144;
    case GgmlType::kQ5_K: return 176;
    case GgmlType::kQ6_K: return 210;
    default: return 0;
  }
}

// The activation, 8-bit: x[t, 32 c + i] ~= dx[t, c] * qx[t, 32 c + i].
struct QuantizedActivation {
  int64_t num_tokens;
  int64_t cols;
  const int8_t* qx;    // [num_tokens, cols]
  const float* dx;     // [num_tokens, cols / 32]
  const float* dxsum;  // [num_tokens, cols / 16]: dx times the sum of qx over each 16 values
};

// Repacked layout (ggml_mul_mat_repacked_a8; pyorch/layers/quantization/gguf.py repacks at load):
// rows in groups of 8, each group's blocks one after another, the quants of a block as registers
// of 32 bytes whose byte 4 i + e belongs to row i.
// - Q4_0, Q4_1, Q8_0: a block of a group is [8 fp16 scales][8 fp16 mins, Q4_1 only][quants];
//   byte 4 i + e of register k is byte 4 k + e of row i's qs. For Q8_0 that is value 4 k + e
//   (k < 8); for the 4-bit types the low nibble is value 4 k + e and the high nibble value
//   16 + 4 k + e (k < 4). The bytes per row are those of the file's layout.
// - Q5_0, Q5_1: Q4_0's / Q4_1's block followed by a register of fifth bits: bit k of byte
//   4 i + e is that of row i's value 4 k + e (k < 8). The bytes per row are the file's.
// - Q4_K (256 values, 8 sub-blocks of 32 with 6-bit scales and mins): [8 fp16 d][8 fp16 dmin]
//   [8 x 8 scales: byte 8 j + i is row i's sub-block j][8 x 8 mins, likewise][quants: 4 chunks
//   of 8 registers; byte 4 i + e of register k of chunk c is row i's qs[32 c + 4 k + e], whose
//   low nibble is value 4 k + e of sub-block 2 c and high nibble that of sub-block 2 c + 1].
//   1184 bytes for 8 rows, against the file's 1152 (the scales unpacked from 12 bytes to 16).
// - Q5_K: Q4_K's layout followed by one register of fifth bits per sub-block j: bit k of byte
//   4 i + e is that of row i's value 32 j + 4 k + e. 1440 bytes for 8 rows (the file's 1408).
// - Q6_K (256 values u in 0..63, value = d * scale_g * (u - 32), 16 int8 scales of 16 values):
//   [8 fp16 d][16 x 8 scales: byte 8 g + i is row i's scale g][low nibbles: 4 chunks of 8
//   registers as Q4_K's, nibble 0 of value 64 c + 4 k + e, nibble 1 of value 64 c + 32 + 4 k + e]
//   [high 2 bits: 2 registers per sub-block j of 32 values; bits 2 m of byte 4 i + e of register
//   h are those of row i's value 32 j + 4 (4 h + m) + e]. 1680 bytes for 8 rows, as the file's.
// - Q3_K (256 values u in 0..7, value = d * scale_g * (u - 4), 16 6-bit scales of 16 values):
//   [8 fp16 d][16 x 8 scales - 32 as int8: byte 8 g + i is row i's][low 2 bits: 2 registers per
//   sub-block j; bits 2 m of byte 4 i + e of register h are those of row i's value
//   32 j + 4 (4 h + m) + e][third bits: 1 register per sub-block j; bit k of byte 4 i + e is that
//   of row i's value 32 j + 4 k + e]. 912 bytes for 8 rows, against the file's 880 (the scales
//   unpacked from 12 bytes to 16).
// - Q2_K (256 values q in 0..3, value = d * scale_g * q - dmin * min_g, 4-bit scales and mins of
//   16 values): [8 fp16 d][8 fp16 dmin][16 x 8 bytes: byte 8 g + i is row i's scale g (low
//   nibble) and min g (high nibble), as in the file][low 2 bits: Q3_K's registers]. 672 bytes
//   for 8 rows, as the file's.
constexpr int repacked_header_bytes(int64_t type) {
  switch (type) {
    case GgmlType::kQ2_K: return 160;
    case GgmlType::kQ3_K:
    case GgmlType::kQ6_K: return 144;
    case GgmlType::kQ4_K:
    case GgmlType::kQ5_K: return 160;
    case GgmlType::kQ4_1:
    case GgmlType::kQ5_1: return 32;
    default: return 16;
  }
}
constexpr int64_t repacked_group_bytes(int64_t type) {
  switch (type) {
    case GgmlType::kQ6_K: return repacked_header_bytes(type) + 1536;
    case GgmlType::kQ3_K: return repacked_header_bytes(type) + 768;
    case GgmlType::kQ2_K: return repacked_header_bytes(type) + 512;
    case GgmlType::kQ5_K: return repacked_header_bytes(type) + 1280;
    case GgmlType::kQ4_K: return repacked_header_bytes(type) + 1024;
    case GgmlType::kQ8_0: return repacked_header_bytes(type) + 256;
    case GgmlType::kQ5_0:
    case GgmlType::kQ5_1: return repacked_header_bytes(type) + 160;
    default: return repacked_header_bytes(type) + 128;
  }
}
constexpr bool has_repacked_layout(int64_t type) {
  return type == GgmlType::kQ4_0 || type == GgmlType::kQ4_1 || type == GgmlType::kQ5_0 ||
         type == GgmlType::kQ5_1 || type == GgmlType::kQ8_0 || type == GgmlType::kQ4_K ||
         type == GgmlType::kQ2_K || type == GgmlType::kQ3_K || type == GgmlType::kQ5_K ||
         type == GgmlType::kQ6_K;
}
// Row groups whose weights one pass over the token tiles keeps in the cache (16 groups of Q8_0 at
// 4096 columns: 557 KB), and the tokens one pass over a group's blocks serves.
constexpr int64_t kRepackGroupChunk = 16;
constexpr int kRepackTokenTile = 4;

namespace portable {
#define PYORCH_GGUF_ISA 0
#include "cpu/gguf_kernel.inc"
#undef PYORCH_GGUF_ISA
}  // namespace portable

#if PYORCH_GGUF_X86
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {
#define PYORCH_GGUF_ISA 1
#include "cpu/gguf_kernel.inc"
#undef PYORCH_GGUF_ISA
}  // namespace avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")
namespace avx512vnni {
#define PYORCH_GGUF_ISA 2
#include "cpu/gguf_kernel.inc"
#undef PYORCH_GGUF_ISA
}  // namespace avx512vnni
#pragma GCC pop_options
#endif

enum class Isa { kPortable = 0, kAvx2 = 1, kAvx512Vnni = 2 };

Isa best_isa() {
#if PYORCH_GGUF_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni")) {
    return Isa::kAvx512Vnni;
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return Isa::kAvx2;
#endif
  return Isa::kPortable;
}

Isa& current_isa() {
  static Isa isa = best_isa();
  return isa;
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kAvx512Vnni: return "avx512_vnni";
    case Isa::kAvx2: return "avx2";
    default: return "portable";
  }
}

// x [num_tokens, cols] (row stride x_stride) -> 8-bit blocks of 32.
template <typename T>
void quantize_activation(const T* x, int64_t x_stride, int64_t num_tokens, int64_t cols, int8_t* qx,
                         float* dx, float* dxsum) {
  const int64_t chunks = cols / 32;
  at::parallel_for(0, num_tokens * chunks, 256, [&](int64_t begin, int64_t end) {
    float v[32];
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t = i / chunks, c = i % chunks;
      to_float(x + t * x_stride + c * 32, v, 32);
      float amax = 0.f;
      for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(v[j]));
      const float d = amax / 127.f;
      const float id = d != 0.f ? 1.f / d : 0.f;
      int8_t* q = qx + t * cols + c * 32;
      int32_t s0 = 0, s1 = 0;
      for (int j = 0; j < 32; ++j) {
        q[j] = static_cast<int8_t>(std::nearbyint(v[j] * id));
        (j < 16 ? s0 : s1) += q[j];
      }
      dx[t * chunks + c] = d;
      dxsum[t * (cols / 16) + 2 * c] = d * static_cast<float>(s0);
      dxsum[t * (cols / 16) + 2 * c + 1] = d * static_cast<float>(s1);
    }
  });
}

// out_f [num_tokens, row] (fp32, contiguous) = the 8-bit activation `a` times W's rows.
void mul_mat_f32(const at::Tensor& W, const GgmlTypeInfo& info, int64_t type, int64_t row,
                 const QuantizedActivation& a, bool repacked, float* out_f) {
  const auto* w = static_cast<const uint8_t*>(W.const_data_ptr());
  const int64_t cols = a.cols;
  const Isa isa = current_isa();
  if (repacked) {
    // Whole groups of 8 rows per task, a few groups at least, an even split over the threads.
    at::parallel_for(0, row / 8, 4, [&](int64_t g0, int64_t g1) {
      switch (isa) {
#if PYORCH_GGUF_X86
        case Isa::kAvx512Vnni:
          avx512vnni::mul_mat_repacked(type, w, cols / info.block_size, g0, g1, a, out_f, row);
          break;
        case Isa::kAvx2:
          avx2::mul_mat_repacked(type, w, cols / info.block_size, g0, g1, a, out_f, row);
          break;
#endif
        default: portable::mul_mat_repacked(type, w, cols / info.block_size, g0, g1, a, out_f, row);
      }
    });
    return;
  }
  const int64_t row_bytes = cols / info.block_size * info.type_size;
  // Enough rows per task to amortize the dispatch, few enough to balance the threads.
  const int64_t grain = std::max<int64_t>(4, row / (4 * at::get_num_threads()));
  at::parallel_for(0, row, grain, [&](int64_t r0, int64_t r1) {
    switch (isa) {
#if PYORCH_GGUF_X86
      case Isa::kAvx512Vnni: avx512vnni::mul_mat(type, w, row_bytes, r0, r1, a, out_f, row); break;
      case Isa::kAvx2: avx2::mul_mat(type, w, row_bytes, r0, r1, a, out_f, row); break;
#endif
      default: portable::mul_mat(type, w, row_bytes, r0, r1, a, out_f, row);
    }
  });
}

// The 8-bit activation of a [num_tokens, cols] float matrix (row stride x_stride).
struct ActivationBuffers {
  std::vector<int8_t> qx;
  std::vector<float> dx, dxsum;
  template <typename T>
  QuantizedActivation quantize(const T* x, int64_t x_stride, int64_t num_tokens, int64_t cols) {
    qx.resize(num_tokens * cols);
    dx.resize(num_tokens * cols / 32);
    dxsum.resize(num_tokens * cols / 16);
    quantize_activation(x, x_stride, num_tokens, cols, qx.data(), dx.data(), dxsum.data());
    return {num_tokens, cols, qx.data(), dx.data(), dxsum.data()};
  }
};

GgmlTypeInfo check_repacked_mul_mat(const at::Tensor& W, const at::Tensor& X, int64_t type,
                                    int64_t row, const char* op) {
  const GgmlTypeInfo info = pyorch::gguf::check_ggml_type(type, op, true);
  TORCH_CHECK(has_repacked_layout(type), op, ": ", info.name,
              " has no repacked layout (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K have)");
  return pyorch::gguf::check_ggml_mul_mat(W, X, type, row, op, repacked_group_bytes(type));
}

at::Tensor ggml_mul_mat_impl(const at::Tensor& W, const at::Tensor& X, int64_t type, int64_t row,
                             const char* op, bool repacked = false) {
  const GgmlTypeInfo info = repacked ? check_repacked_mul_mat(W, X, type, row, op)
                                     : pyorch::gguf::check_ggml_mul_mat(W, X, type, row, op);
  const int64_t num_tokens = X.size(0), cols = X.size(1);
  at::Tensor out = at::empty({num_tokens, row}, X.options());
  if (num_tokens == 0 || row == 0) return out;
  if (cols == 0) return out.zero_();
  TORCH_CHECK(cols % 32 == 0, op, ": cols ", cols, " must be a multiple of 32");
  const int64_t x_stride = num_tokens <= 1 ? cols : X.stride(0);
  ActivationBuffers buffers;
  QuantizedActivation a;
  PYORCH_CPU_DISPATCH_FLOATS(X.scalar_type(), "ggml_mul_mat", [&] {
    a = buffers.quantize(X.const_data_ptr<scalar_t>(), x_stride, num_tokens, cols);
  });
  const bool f32_out = X.scalar_type() == at::kFloat;
  std::vector<float> staging(f32_out ? 0 : num_tokens * row);
  float* out_f = f32_out ? out.mutable_data_ptr<float>() : staging.data();
  mul_mat_f32(W, info, type, row, a, repacked, out_f);
  if (!f32_out) {
    PYORCH_CPU_DISPATCH_FLOATS(X.scalar_type(), "ggml_mul_mat", [&] {
      from_float(staging.data(), out.mutable_data_ptr<scalar_t>(), num_tokens * row);
    });
  }
  return out;
}

template <int64_t TYPE, typename T>
void dequantize_rows(const uint8_t* W, int64_t m, int64_t n, T* out) {
  namespace gd = gguf_decode;
  constexpr int kBlock = TYPE >= GgmlType::kQ2_K ? 256 : 32;
  constexpr int kGroup = gd::group_size(TYPE);
  constexpr float kOffset = static_cast<float>(gd::value_offset(TYPE));
  const int64_t blocks = n / kBlock;
  at::parallel_for(0, m * blocks, 64, [&](int64_t begin, int64_t end) {
    uint8_t u[kBlock];
    float scale[kBlock / kGroup], bias[kBlock / kGroup];
    for (int64_t i = begin; i < end; ++i) {
      gd::decode_block<TYPE>(W + i * gd_type_size<TYPE>(), u, scale, bias);
      T* o = out + i * kBlock;
      for (int e = 0; e < kBlock; ++e) {
        // the gguf package's rounding: (scale * q) rounded, then + bias
        const float p = scale[e / kGroup] * (static_cast<float>(u[e]) - kOffset);
        o[e] = static_cast<T>(p + bias[e / kGroup]);
      }
    }
  });
}

template <typename T>
void dequantize_any(int64_t type, const void* W, int64_t m, int64_t n, T* out) {
  const auto* w = static_cast<const uint8_t*>(W);
  switch (type) {
    case GgmlType::kF32: {
      const auto* src = static_cast<const float*>(W);
      at::parallel_for(0, m * n, 1 << 16, [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) out[i] = static_cast<T>(src[i]);
      });
      return;
    }
    case GgmlType::kF16: {
      const auto* src = static_cast<const c10::Half*>(W);
      at::parallel_for(0, m * n, 1 << 16, [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) out[i] = static_cast<T>(static_cast<float>(src[i]));
      });
      return;
    }
    case GgmlType::kBF16: {
      const auto* src = static_cast<const c10::BFloat16*>(W);
      at::parallel_for(0, m * n, 1 << 16, [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) out[i] = static_cast<T>(static_cast<float>(src[i]));
      });
      return;
    }
    case GgmlType::kQ4_0: return dequantize_rows<GgmlType::kQ4_0>(w, m, n, out);
    case GgmlType::kQ4_1: return dequantize_rows<GgmlType::kQ4_1>(w, m, n, out);
    case GgmlType::kQ5_0: return dequantize_rows<GgmlType::kQ5_0>(w, m, n, out);
    case GgmlType::kQ5_1: return dequantize_rows<GgmlType::kQ5_1>(w, m, n, out);
    case GgmlType::kQ8_0: return dequantize_rows<GgmlType::kQ8_0>(w, m, n, out);
    case GgmlType::kQ2_K: return dequantize_rows<GgmlType::kQ2_K>(w, m, n, out);
    case GgmlType::kQ3_K: return dequantize_rows<GgmlType::kQ3_K>(w, m, n, out);
    case GgmlType::kQ4_K: return dequantize_rows<GgmlType::kQ4_K>(w, m, n, out);
    case GgmlType::kQ5_K: return dequantize_rows<GgmlType::kQ5_K>(w, m, n, out);
    case GgmlType::kQ6_K: return dequantize_rows<GgmlType::kQ6_K>(w, m, n, out);
    default: TORCH_CHECK(false, "ggml_dequantize: GGML type ", type, " is not supported");
  }
}

}  // namespace

at::Tensor ggml_dequantize(const at::Tensor& W, int64_t quant_type, int64_t m, int64_t n,
                           std::optional<at::ScalarType> dtype) {
  const at::ScalarType out_dtype = dtype.value_or(at::kHalf);
  pyorch::gguf::check_ggml_dequantize(W, quant_type, m, n, out_dtype);
  at::Tensor out = at::empty({m, n}, W.options().dtype(out_dtype));
  if (m == 0 || n == 0) return out;
  PYORCH_CPU_DISPATCH_FLOATS(out_dtype, "ggml_dequantize", [&] {
    dequantize_any(quant_type, W.const_data_ptr(), m, n, out.mutable_data_ptr<scalar_t>());
  });
  return out;
}

at::Tensor ggml_mul_mat_vec_a8(const at::Tensor& W, const at::Tensor& X, int64_t quant_type,
                               int64_t row) {
  return ggml_mul_mat_impl(W, X, quant_type, row, "ggml_mul_mat_vec_a8");
}

at::Tensor ggml_mul_mat_a8(const at::Tensor& W, const at::Tensor& X, int64_t quant_type,
                           int64_t row) {
  return ggml_mul_mat_impl(W, X, quant_type, row, "ggml_mul_mat_a8");
}

at::Tensor ggml_mul_mat_repacked_a8(const at::Tensor& W, const at::Tensor& X, int64_t quant_type,
                                    int64_t row) {
  return ggml_mul_mat_impl(W, X, quant_type, row, "ggml_mul_mat_repacked_a8", true);
}

void ggml_mul_mat_repacked_fused(at::Tensor& out, const at::Tensor& X, const at::Tensor& W,
                                 int64_t quant_type, int64_t row,
                                 const std::optional<at::Tensor>& bias,
                                 const std::optional<at::Tensor>& norm_weight, double eps,
                                 const std::string& epilogue) {
  constexpr const char* op = "ggml_mul_mat_repacked_fused";
  const GgmlTypeInfo info = check_repacked_mul_mat(W, X, quant_type, row, op);
  const int64_t num_tokens = X.size(0), cols = X.size(1);
  const bool silu = epilogue == "silu_and_mul", add = epilogue == "add";
  TORCH_CHECK(silu || add || epilogue == "store", op,
              ": epilogue must be store, add or "
              "silu_and_mul, got ",
              epilogue);
  TORCH_CHECK(!silu || row % 16 == 0, op,
              ": silu_and_mul needs [gate; up] halves of whole "
              "groups of 8 rows, got row ",
              row);
  const int64_t out_cols = silu ? row / 2 : row;
  TORCH_CHECK(out.device().is_cpu() && out.scalar_type() == X.scalar_type() && out.dim() == 2 &&
                  out.size(0) == num_tokens && out.size(1) == out_cols &&
                  (out_cols <= 1 || out.stride(1) == 1),
              op, ": out must be ", X.scalar_type(), " [", num_tokens, ", ", out_cols,
              "] with contiguous rows, got ", out.scalar_type(), " ", out.sizes());
  TORCH_CHECK(!norm_weight || !add, op, ": the add epilogue takes no norm");
  for (const auto* t : {&bias, &norm_weight}) {
    if (!t->has_value()) continue;
    const int64_t n = t == &bias ? row : cols;
    TORCH_CHECK((*t)->device().is_cpu() && (*t)->scalar_type() == X.scalar_type() &&
                    (*t)->dim() == 1 && (*t)->size(0) == n && (*t)->is_contiguous(),
                op, ": ", t == &bias ? "bias" : "norm_weight", " must be contiguous ",
                X.scalar_type(), " [", n, "]");
  }
  if (num_tokens == 0 || row == 0) return;
  TORCH_CHECK(cols % 32 == 0, op, ": cols ", cols, " must be a multiple of 32");
  const int64_t x_stride = num_tokens <= 1 ? cols : X.stride(0);
  const int64_t out_stride = num_tokens <= 1 ? out_cols : out.stride(0);
  ActivationBuffers buffers;
  QuantizedActivation a;
  std::vector<float> y(num_tokens * row);
  PYORCH_CPU_DISPATCH_FLOATS(X.scalar_type(), op, [&] {
    const scalar_t* x = X.const_data_ptr<scalar_t>();
    if (norm_weight) {  // RMSNorm in fp32, then the 8-bit activation of the normed rows
      const scalar_t* nw = norm_weight->const_data_ptr<scalar_t>();
      std::vector<float> normed(num_tokens * cols);
      for (int64_t t = 0; t < num_tokens; ++t) {
        float* r = normed.data() + t * cols;
        to_float(x + t * x_stride, r, cols);
        float ss = 0.f;
        for (int64_t c = 0; c < cols; ++c) ss += r[c] * r[c];
        const float inv = 1.f / std::sqrt(ss / static_cast<float>(cols) + static_cast<float>(eps));
        for (int64_t c = 0; c < cols; ++c) {
          // RMSNorm's rounding: the normed value in the model's dtype, then times the weight
          r[c] = round_to<scalar_t>(round_to<scalar_t>(r[c] * inv) * static_cast<float>(nw[c]));
        }
      }
      a = buffers.quantize(normed.data(), cols, num_tokens, cols);
    } else {
      a = buffers.quantize(x, x_stride, num_tokens, cols);
    }
    mul_mat_f32(W, info, quant_type, row, a, true, y.data());
    const scalar_t* b = bias ? bias->const_data_ptr<scalar_t>() : nullptr;
    scalar_t* o = out.mutable_data_ptr<scalar_t>();
    for (int64_t t = 0; t < num_tokens; ++t) {
      float* yt = y.data() + t * row;
      if (b != nullptr) {
        // the linear layer's output rounds to the model's dtype with its bias
        for (int64_t r = 0; r < row; ++r) yt[r] += static_cast<float>(b[r]);
      }
      scalar_t* ot = o + t * out_stride;
      if (silu) {
        for (int64_t j = 0; j < out_cols; ++j) {
          const float g = round_to<scalar_t>(yt[j]), u = round_to<scalar_t>(yt[j + out_cols]);
          ot[j] = static_cast<scalar_t>(g / (1.f + std::exp(-g)) * u);
        }
      } else if (add) {
        for (int64_t j = 0; j < row; ++j) {
          ot[j] = static_cast<scalar_t>(static_cast<float>(ot[j]) + round_to<scalar_t>(yt[j]));
        }
      } else {
        from_float(yt, ot, row);
      }
    }
  });
}

namespace {
struct CpuOps {
  static void rms_norm(at::Tensor& out, const at::Tensor& x, const at::Tensor& w, double eps) {
    pyorch::cpu::rms_norm(out, x, w, eps);
  }
  static void silu_and_mul(at::Tensor& out, const at::Tensor& x) {
    pyorch::cpu::silu_and_mul(out, x);
  }
  static at::Tensor mul_mat_vec(const at::Tensor& W, const at::Tensor& x, int64_t type,
                                int64_t row) {
    return pyorch::cpu::ggml_mul_mat_vec_a8(W, x, type, row);
  }
};
}  // namespace

// The CPU's ggml_mul_mat_vec_fused: the ops it fuses, one after another (the file's layout; the
// repacked layout has ggml_mul_mat_repacked_fused).
void ggml_mul_mat_vec_fused(at::Tensor& out, const at::Tensor& X, const at::Tensor& W,
                            int64_t quant_type, int64_t row,
                            const std::optional<at::Tensor>& norm_weight, double eps,
                            const std::string& input_op, const std::string& epilogue) {
  const char* op = "ggml_mul_mat_vec_fused";
  const gguf::FusedArgs a = gguf::check_ggml_mul_mat_vec_fused(out, X, W, quant_type, row,
                                                               norm_weight, input_op, epilogue, op);
  TORCH_CHECK(X.device().is_cpu(), op, ": X must be a CPU tensor here");
  gguf::ggml_mul_mat_vec_fused_composed<CpuOps>(out, X, W, quant_type, row, norm_weight, eps, a);
}

std::string gguf_cpu_isa(const std::string& name) {
  if (!name.empty()) {
    const Isa best = best_isa();
    Isa want;
    if (name == "avx512_vnni") {
      want = Isa::kAvx512Vnni;
    } else if (name == "avx2") {
      want = Isa::kAvx2;
    } else if (name == "portable") {
      want = Isa::kPortable;
    } else if (name == "best") {
      want = best;
    } else {
      TORCH_CHECK(false, "gguf_cpu_isa: unknown ", name, " (best, avx512_vnni, avx2 or portable)");
    }
    TORCH_CHECK(static_cast<int>(want) <= static_cast<int>(best), "gguf_cpu_isa: this CPU has no ",
                name, " (best: ", isa_name(best), ")");
    current_isa() = want;
  }
  return isa_name(current_isa());
}

}  // namespace pyorch::cpu
