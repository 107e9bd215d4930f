// CPU gated activations: out = act(gate) * up, fp32 math in branch-free loops the compiler
// vectorizes, rounded once to the output dtype (as the CUDA kernels do).
//
// libm's expf/erff are scalar calls that block vectorization (glibc's vector variants need
// -ffast-math), so exp and erfc below are our own polynomial approximations, accurate to a few
// fp32 ulps: far inside every dtype's tolerance. NOTE(elementwise): GCC's if-conversion will not
// turn the clamps and selects into blends while FP ops count as trapping (-ftrapping-math, the
// default), so the math and the row loop are compiled with no-trapping-math (checked with
// -fopt-info-vec: the row loop vectorizes with 32-byte vectors). Exception flags are never read.
#include <algorithm>
#include <cstring>

#include <ATen/Parallel.h>

#include "activation_checks.h"
#include "cpu/cpu_utils.h"
#include "ops.h"

namespace pyorch::cpu {
namespace {

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC push_options
#pragma GCC optimize("no-trapping-math")
#endif

// e^x for x in fp32: x = n * ln2 + r with |r| <= ln2 / 2, e^r by a degree-7 Taylor-like minimax
// polynomial (Cephes' expf coefficients), 2^n built in the exponent bits. Inputs are clamped to
// [-87, 88] so that 2^n stays a normal float; the callers only need e^x to saturate there.
inline float exp_approx(float x) {
  // Plain selects, not std::min/max/abs: GCC will not inline functions compiled with other
  // optimize options (the pragma above) into these.
  x = x < -87.f ? -87.f : x;
  x = x > 88.f ? 88.f : x;
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kRound = 12582912.f;  // 1.5 * 2^23: adding it rounds to an integer
  const float n = (x * kLog2e + kRound) - kRound;
  // ln2 split in two so that n * kLn2Hi is exact.
  const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// 0.5 * erfc(u): Numerical Recipes' erfcc fit (relative error < 1.2e-7 for every u).
inline float half_erfc(float u) {
  const float z = u < 0.f ? -u : u;
  const float t = 1.f / (1.f + 0.5f * z);
  float p = 0.17087277f;
  p = p * t - 0.82215223f;
  p = p * t + 1.48851587f;
  p = p * t - 1.13520398f;
  p = p * t + 0.27886807f;
  p = p * t - 0.18628806f;
  p = p * t + 0.09678418f;
  p = p * t + 0.37409196f;
  p = p * t + 1.00002368f;
  p = p * t - 1.26551223f;
  const float tail = 0.5f * t * exp_approx(p - z * z);  // 0.5 * erfc(|u|)
  return u >= 0.f ? tail : 1.f - tail;
}

struct Silu {
  static float apply(float x) { return x / (1.f + exp_approx(-x)); }
};

// gelu(x) = x * Phi(x) = x * 0.5 * erfc(-x / sqrt(2)).
struct Gelu {
  static float apply(float x) { return x * half_erfc(x * -0.70710678118654752f); }
};

// 0.5 * (1 + tanh(z)) == sigmoid(2z), as in the CUDA kernel.
struct GeluTanh {
  static float apply(float x) {
    const float z = 0.79788456080286536f * (x + 0.044715f * x * x * x);
    return x / (1.f + exp_approx(-2.f * z));
  }
};

template <typename Act>
void act_and_mul_row(float* __restrict__ gate, const float* __restrict__ up, int64_t n) {
  for (int64_t i = 0; i < n; ++i) gate[i] = Act::apply(gate[i]) * up[i];
}

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC pop_options
#endif

// out: [..., d], input: [..., 2 * d]. Work items are (row, column chunk) pairs so that a single
// long row still spreads over all threads.
template <typename Act>
void act_and_mul(at::Tensor& out, const at::Tensor& input, const char* op) {
  TORCH_CHECK(out.device().is_cpu() && input.device().is_cpu(), op, ": tensors must be on CPU");
  const at::ScalarType dtype = input.scalar_type();
  const int64_t d = pyorch::check_act_and_mul(out, input, op);
  if (d == 0 || out.numel() == 0) return;
  const int64_t rows = out.numel() / d;
  const int64_t in_stride = pyorch::act_row_stride(input, op);
  const int64_t out_stride = pyorch::act_row_stride(out, op);
  constexpr int64_t kChunk = 1024;
  const int64_t chunks_per_row = (d + kChunk - 1) / kChunk;
  PYORCH_CPU_DISPATCH_FLOATS(dtype, "act_and_mul", [&] {
    const scalar_t* in = input.const_data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows * chunks_per_row, 16, [&](int64_t begin, int64_t end) {
      float gate[kChunk], up[kChunk];
      for (int64_t w = begin; w < end; ++w) {
        const int64_t row = w / chunks_per_row;
        const int64_t col = (w % chunks_per_row) * kChunk;
        const int64_t n = std::min(kChunk, d - col);
        const scalar_t* x = in + row * in_stride + col;
        to_float(x, gate, n);
        to_float(x + d, up, n);
        act_and_mul_row<Act>(gate, up, n);
        from_float(gate, o + row * out_stride + col, n);
      }
    });
  });
}

}  // namespace

void silu_and_mul(at::Tensor& out, const at::Tensor& input) {
  act_and_mul<Silu>(out, input, "silu_and_mul");
}

void gelu_and_mul(at::Tensor& out, const at::Tensor& input) {
  act_and_mul<Gelu>(out, input, "gelu_and_mul");
}

void gelu_tanh_and_mul(at::Tensor& out, const at::Tensor& input) {
  act_and_mul<GeluTanh>(out, input, "gelu_tanh_and_mul");
}

}  // namespace pyorch::cpu
