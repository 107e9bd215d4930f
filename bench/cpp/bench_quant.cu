// Benchmark and check of the fp8 activation quantization of pyorch/quantization.h (no torch):
// dynamic_per_token_scaled_fp8_quant and static_scaled_fp8_quant, the kernels in front of every
// W8A8 GEMM of the fp8 models, and silu_and_mul_dynamic_per_token_fp8_quant, the fused
// activation + quantization in front of an fp8 down_proj.
//
// Checks (op=check rows, PASS/FAIL): every dtype (fp32/fp16/bf16) x hidden sizes that take the
// register-resident vector kernel and sizes that do not (hidden not a multiple of the vector,
// rows past its largest form, a misaligned input row) x row strides x per-token (with and without
// scale_ub) and static scales, on fresh random rows of different magnitudes, byte for byte and
// scale for scale against a reference kernel (one thread per row: absmax, scale, the same
// division and clamp as the CPU kernels).
//
// Timing (op=fp8_quant rows): bf16 rows [--tokens x --hidden], per-token dynamic scales: time_us
// (median of --iters), GB/s of the bytes it must move (read x, write the fp8 row and a scale) and
// pct_of_copy against the in-run device-to-device copy; elementwise_us is the same call on an
// input one element off 16-byte alignment, which takes the element-wise kernel (the only kernel
// before the vector one).
//
// silu_and_mul + quantization (op=check mode=silu_mul_fp8_quant[_ub] rows): every dtype x d x row
// strides x scale_ub against the two kernels it fuses (pyorch::silu_and_mul into a temporary,
// then dynamic_per_token_scaled_fp8_quant), byte for byte and scale for scale; rows the fused
// kernel does not take (d off the vector, past 16 vectors a thread, a misaligned input) must be
// refused with cudaErrorInvalidValue (the torch op runs the two ops there). Timing
// (op=silu_mul_fp8_quant rows): bf16 [--tokens x 2 * --intermediate] -> fp8 [tokens x
// intermediate]: time_us, GB/s of the bytes it must move and pct_of_copy, against separate_us
// (silu_and_mul then the quantizer: act_us + quant_us, each also timed alone).
// Flags: --tokens 1,16,1024,4096,16384 --hidden 4096,8192,14336,28672
//        --intermediate 14336,28672 --ops fp8_quant,silu_mul_fp8_quant --iters 30 --no-check
//        --no-bench --json FILE
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "common/bench_util.h"
#include "pyorch/activation.h"
#include "pyorch/quantization.h"

namespace {

using pyorch::DType;
using pyorch::bench::Args;
using pyorch::bench::Report;

// Row r of [rows, stride] holds hashed uniform values in [-mag_r, mag_r), mag_r spanning 2^-6 ..
// 2^6 across rows, so per-token scales differ and static scales clip some rows.
__global__ void fill_rows_kernel(void* data, int64_t rows, int64_t hidden, int64_t stride,
                                 DType dtype, uint32_t seed) {
  const int64_t r = blockIdx.y;
  const float mag = exp2f(static_cast<float>(static_cast<int>(r % 13) - 6));
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < hidden;
       i += int64_t(gridDim.x) * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(r * 1000003 + i) * 0x9e3779b1u + seed;
    h ^= h >> 15;
    h *= 0x2c1b3c6du;
    h ^= h >> 12;
    const float x = mag * (2.f * (h & 0xffffff) / 16777216.f - 1.f);
    const int64_t k = r * stride + i;
    if (dtype == DType::kFloat32) {
      static_cast<float*>(data)[k] = x;
    } else if (dtype == DType::kFloat16) {
      static_cast<__half*>(data)[k] = __float2half_rn(x);
    } else {
      static_cast<__nv_bfloat16*>(data)[k] = __float2bfloat16_rn(x);
    }
  }
}

__device__ float load_as_float(const void* data, int64_t k, DType dtype) {
  if (dtype == DType::kFloat32) return static_cast<const float*>(data)[k];
  if (dtype == DType::kFloat16) return __half2float(static_cast<const __half*>(data)[k]);
  return __bfloat162float(static_cast<const __nv_bfloat16*>(data)[k]);
}

// The reference: one thread per row.
__global__ void reference_kernel(uint8_t* out, float* scales, const void* in, DType dtype,
                                 const float* static_scale, const float* scale_ub, int64_t rows,
                                 int64_t hidden, int64_t out_stride, int64_t in_stride) {
  const int64_t r = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (r >= rows) return;
  float s;
  if (static_scale != nullptr) {
    s = fmaxf(*static_scale, 0.f);
  } else {
    float absmax = 0.f;
    for (int64_t i = 0; i < hidden; ++i) {
      absmax = fmaxf(absmax, fabsf(load_as_float(in, r * in_stride + i, dtype)));
    }
    if (scale_ub != nullptr) absmax = fminf(absmax, *scale_ub);
    s = fmaxf(absmax / pyorch::kQuantFp8Max, pyorch::kQuantFp8MinScale);
    scales[r] = s;
  }
  for (int64_t i = 0; i < hidden; ++i) {
    const float x = load_as_float(in, r * in_stride + i, dtype) / s;
    const float c = fmaxf(-pyorch::kQuantFp8Max, fminf(x, pyorch::kQuantFp8Max));
    out[r * out_stride + i] =
        static_cast<uint8_t>(__nv_cvt_float_to_fp8(c, __NV_SATFINITE, __NV_E4M3));
  }
}

size_t dtype_size(DType d) { return d == DType::kFloat32 ? 4 : 2; }

struct CheckCase {
  DType dtype;
  int64_t rows, hidden, in_pad, out_pad;
  int in_offset;  // elements past a 16-byte boundary (1: the element-wise kernel)
  bool per_token, with_ub;
};

bool run_check(Report& report, const CheckCase& c, cudaStream_t stream) {
  const int64_t in_stride = c.hidden + c.in_pad, out_stride = c.hidden + c.out_pad;
  const size_t esz = dtype_size(c.dtype);
  char* in_base;
  BENCH_CHECK(cudaMalloc(&in_base, (c.rows * in_stride + 16) * esz));
  void* in = in_base + c.in_offset * esz;
  fill_rows_kernel<<<dim3(4, c.rows), 256, 0, stream>>>(in, c.rows, c.hidden, in_stride, c.dtype,
                                                        static_cast<uint32_t>(c.hidden + c.rows));
  uint8_t *out, *ref;
  float *scales, *ref_scales, *aux;
  BENCH_CHECK(cudaMalloc(&out, c.rows * out_stride));
  BENCH_CHECK(cudaMalloc(&ref, c.rows * out_stride));
  BENCH_CHECK(cudaMalloc(&scales, c.rows * sizeof(float)));
  BENCH_CHECK(cudaMalloc(&ref_scales, c.rows * sizeof(float)));
  BENCH_CHECK(cudaMalloc(&aux, sizeof(float)));
  // Static scale 0.05 clips the rows of magnitude >= 2^5 (448 * 0.05 = 22.4); scale_ub 1.0 caps
  // the per-token scales of the rows above 448.
  const float aux_value = c.per_token ? 1.0f : 0.05f;
  BENCH_CHECK(cudaMemcpy(aux, &aux_value, sizeof(float), cudaMemcpyHostToDevice));
  BENCH_CHECK(cudaMemset(out, 0xaa, c.rows * out_stride));
  BENCH_CHECK(cudaMemset(ref, 0xaa, c.rows * out_stride));
  BENCH_CHECK(cudaMemset(scales, 0, c.rows * sizeof(float)));
  BENCH_CHECK(cudaMemset(ref_scales, 0, c.rows * sizeof(float)));
  const float* ub = c.with_ub ? aux : nullptr;
  cudaError_t err =
      c.per_token
          ? pyorch::dynamic_per_token_scaled_fp8_quant(out, in, scales, ub, c.dtype, c.rows,
                                                       c.hidden, out_stride, in_stride, stream)
          : pyorch::static_scaled_fp8_quant(out, in, aux, c.dtype, c.rows, c.hidden, out_stride,
                                            in_stride, stream);
  reference_kernel<<<(c.rows + 63) / 64, 64, 0, stream>>>(ref, ref_scales, in, c.dtype,
                                                          c.per_token ? nullptr : aux, ub, c.rows,
                                                          c.hidden, out_stride, in_stride);
  BENCH_CHECK(cudaStreamSynchronize(stream));
  std::vector<uint8_t> h_out(c.rows * out_stride), h_ref(c.rows * out_stride);
  std::vector<float> h_scales(c.rows), h_ref_scales(c.rows);
  BENCH_CHECK(cudaMemcpy(h_out.data(), out, h_out.size(), cudaMemcpyDeviceToHost));
  BENCH_CHECK(cudaMemcpy(h_ref.data(), ref, h_ref.size(), cudaMemcpyDeviceToHost));
  BENCH_CHECK(cudaMemcpy(h_scales.data(), scales, c.rows * sizeof(float), cudaMemcpyDeviceToHost));
  BENCH_CHECK(
      cudaMemcpy(h_ref_scales.data(), ref_scales, c.rows * sizeof(float), cudaMemcpyDeviceToHost));
  // The padding between rows must be untouched (0xaa in both).
  int64_t bad_bytes = 0, bad_scales = 0;
  for (size_t i = 0; i < h_out.size(); ++i) bad_bytes += h_out[i] != h_ref[i];
  if (c.per_token) {
    bad_scales = std::memcmp(h_scales.data(), h_ref_scales.data(), c.rows * sizeof(float)) != 0;
  }
  const bool pass = err == cudaSuccess && bad_bytes == 0 && bad_scales == 0;
  report.add({{"op", "check"},
              {"dtype", pyorch::dtype_name(c.dtype)},
              {"mode", c.per_token ? (c.with_ub ? "per_token_ub" : "per_token") : "static"},
              {"rows", std::to_string(c.rows)},
              {"hidden", std::to_string(c.hidden)},
              {"in_stride", std::to_string(in_stride)},
              {"out_stride", std::to_string(out_stride)},
              {"in_offset", std::to_string(c.in_offset)},
              {"status", cudaGetErrorString(err)},
              {"bad_bytes", std::to_string(bad_bytes)},
              {"result", pass ? "PASS" : "FAIL"}});
  BENCH_CHECK(cudaFree(in_base));
  BENCH_CHECK(cudaFree(out));
  BENCH_CHECK(cudaFree(ref));
  BENCH_CHECK(cudaFree(scales));
  BENCH_CHECK(cudaFree(ref_scales));
  BENCH_CHECK(cudaFree(aux));
  return pass;
}

int run_checks(Report& report, cudaStream_t stream) {
  int failures = 0;
  for (DType dtype : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    // 8..4104: one to two vectors per thread; 14336 / 28672: Llama-3 8B / 70B MLP widths;
    // 36 and 4100: not a multiple of 8 (bf16/fp16 element-wise); 40000: past the largest form.
    for (int64_t hidden : {8, 36, 40, 1000, 4096, 4100, 4104, 14336, 28672, 40000}) {
      for (int64_t rows : {1, 5, 67}) {
        if (hidden >= 14336 && rows > 5) continue;
        for (int mode = 0; mode < 3; ++mode) {
          const CheckCase c{dtype, rows,      hidden,   rows > 1 ? 8 : 0, rows > 1 ? 16 : 0,
                            0,     mode != 0, mode == 2};
          failures += run_check(report, c, stream) ? 0 : 1;
        }
      }
    }
    // A misaligned input row (element-wise kernel) and an output row stride off the vector.
    failures += run_check(report, {dtype, 5, 4096, 8, 0, 1, true, false}, stream) ? 0 : 1;
    failures += run_check(report, {dtype, 5, 4096, 0, 3, 0, true, false}, stream) ? 0 : 1;
    failures += run_check(report, {dtype, 5, 4096, 0, 3, 0, false, false}, stream) ? 0 : 1;
  }
  return failures;
}

// ---- silu_and_mul + per-token fp8 ------------------------------------------------------------

struct ActCheckCase {
  DType dtype;
  int64_t rows, d, in_pad, out_pad;
  int in_offset;  // elements past a 16-byte boundary (1: refused by the fused kernel)
  bool with_ub;
};

bool run_act_check(Report& report, const ActCheckCase& c, cudaStream_t stream) {
  const int64_t in_stride = 2 * c.d + c.in_pad, out_stride = c.d + c.out_pad;
  const size_t esz = dtype_size(c.dtype);
  char *in_base, *act;
  BENCH_CHECK(cudaMalloc(&in_base, (c.rows * in_stride + 16) * esz));
  BENCH_CHECK(cudaMalloc(&act, c.rows * c.d * esz));
  void* in = in_base + c.in_offset * esz;
  fill_rows_kernel<<<dim3(4, c.rows), 256, 0, stream>>>(in, c.rows, 2 * c.d, in_stride, c.dtype,
                                                        static_cast<uint32_t>(c.d + 7 * c.rows));
  uint8_t *out, *ref;
  float *scales, *ref_scales, *ub;
  BENCH_CHECK(cudaMalloc(&out, c.rows * out_stride));
  BENCH_CHECK(cudaMalloc(&ref, c.rows * out_stride));
  BENCH_CHECK(cudaMalloc(&scales, c.rows * sizeof(float)));
  BENCH_CHECK(cudaMalloc(&ref_scales, c.rows * sizeof(float)));
  BENCH_CHECK(cudaMalloc(&ub, sizeof(float)));
  // silu(gate) * up reaches 2^12 on the largest rows: scale_ub 1.0 caps their scales (and clamps).
  const float ub_value = 1.0f;
  BENCH_CHECK(cudaMemcpy(ub, &ub_value, sizeof(float), cudaMemcpyHostToDevice));
  BENCH_CHECK(cudaMemset(out, 0xaa, c.rows * out_stride));
  BENCH_CHECK(cudaMemset(ref, 0xaa, c.rows * out_stride));
  BENCH_CHECK(cudaMemset(scales, 0, c.rows * sizeof(float)));
  BENCH_CHECK(cudaMemset(ref_scales, 0, c.rows * sizeof(float)));
  const float* scale_ub = c.with_ub ? ub : nullptr;
  const bool takes = pyorch::silu_and_mul_dynamic_per_token_fp8_quant_supported(
      c.dtype, c.d, out, in, out_stride, in_stride);
  const cudaError_t err = pyorch::silu_and_mul_dynamic_per_token_fp8_quant(
      out, scales, in, scale_ub, c.dtype, c.rows, c.d, out_stride, in_stride, stream);
  BENCH_CHECK(pyorch::silu_and_mul(act, in, c.dtype, c.rows, c.d, c.d, in_stride, stream));
  BENCH_CHECK(pyorch::dynamic_per_token_scaled_fp8_quant(ref, act, ref_scales, scale_ub, c.dtype,
                                                         c.rows, c.d, out_stride, c.d, stream));
  BENCH_CHECK(cudaStreamSynchronize(stream));
  std::vector<uint8_t> h_out(c.rows * out_stride), h_ref(c.rows * out_stride);
  std::vector<float> h_scales(c.rows), h_ref_scales(c.rows);
  BENCH_CHECK(cudaMemcpy(h_out.data(), out, h_out.size(), cudaMemcpyDeviceToHost));
  BENCH_CHECK(cudaMemcpy(h_ref.data(), ref, h_ref.size(), cudaMemcpyDeviceToHost));
  BENCH_CHECK(cudaMemcpy(h_scales.data(), scales, c.rows * sizeof(float), cudaMemcpyDeviceToHost));
  BENCH_CHECK(
      cudaMemcpy(h_ref_scales.data(), ref_scales, c.rows * sizeof(float), cudaMemcpyDeviceToHost));
  int64_t bad_bytes = 0;
  bool pass;
  if (takes) {  // the padding between rows must be untouched (0xaa in both)
    for (size_t i = 0; i < h_out.size(); ++i) bad_bytes += h_out[i] != h_ref[i];
    const bool same_scales =
        std::memcmp(h_scales.data(), h_ref_scales.data(), c.rows * sizeof(float)) == 0;
    pass = err == cudaSuccess && bad_bytes == 0 && same_scales;
  } else {
    pass = err == cudaErrorInvalidValue;
  }
  report.add({{"op", "check"},
              {"dtype", pyorch::dtype_name(c.dtype)},
              {"mode", c.with_ub ? "silu_mul_fp8_quant_ub" : "silu_mul_fp8_quant"},
              {"rows", std::to_string(c.rows)},
              {"d", std::to_string(c.d)},
              {"in_stride", std::to_string(in_stride)},
              {"out_stride", std::to_string(out_stride)},
              {"in_offset", std::to_string(c.in_offset)},
              {"path", takes ? "fused" : "refused"},
              {"status", cudaGetErrorString(err)},
              {"bad_bytes", std::to_string(bad_bytes)},
              {"result", pass ? "PASS" : "FAIL"}});
  for (void* p : {static_cast<void*>(in_base), static_cast<void*>(act), static_cast<void*>(out),
                  static_cast<void*>(ref), static_cast<void*>(scales),
                  static_cast<void*>(ref_scales), static_cast<void*>(ub)}) {
    BENCH_CHECK(cudaFree(p));
  }
  return pass;
}

int run_act_checks(Report& report, cudaStream_t stream) {
  int failures = 0;
  for (DType dtype : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    // 8..4104: one to two vectors a thread; 14336 / 28672: Llama-3 8B / 70B; 36: off the 16-bit
    // vector (fp32 takes it); 40000: past 16 vectors a thread (refused).
    for (int64_t d : {8, 36, 40, 1000, 4096, 4104, 14336, 28672, 40000}) {
      for (int64_t rows : {1, 5, 67}) {
        if (d >= 14336 && rows > 5) continue;
        for (bool with_ub : {false, true}) {
          const ActCheckCase c{dtype, rows, d, rows > 1 ? 8 : 0, rows > 1 ? 16 : 0, 0, with_ub};
          failures += run_act_check(report, c, stream) ? 0 : 1;
        }
      }
    }
    // A misaligned input row (refused) and an output row stride off the vector (refused).
    failures += run_act_check(report, {dtype, 5, 4096, 8, 0, 1, false}, stream) ? 0 : 1;
    failures += run_act_check(report, {dtype, 5, 4096, 0, 3, 0, false}, stream) ? 0 : 1;
  }
  return failures;
}

void bench_silu_mul_fp8_quant(Report& report, const Args& args, double copy_gbs,
                              cudaStream_t stream) {
  const int iters = static_cast<int>(args.num("iters", 30));
  for (int64_t d : args.list("intermediate", {14336, 28672})) {
    for (int64_t tokens : args.list("tokens", {1, 16, 1024, 4096, 16384})) {
      void *in, *act;
      uint8_t* out;
      float* scales;
      BENCH_CHECK(cudaMalloc(&in, tokens * 2 * d * 2));
      BENCH_CHECK(cudaMalloc(&act, tokens * d * 2));
      BENCH_CHECK(cudaMalloc(&out, tokens * d));
      BENCH_CHECK(cudaMalloc(&scales, tokens * sizeof(float)));
      fill_rows_kernel<<<dim3(8, static_cast<unsigned>(tokens)), 256, 0, stream>>>(
          in, tokens, 2 * d, 2 * d, DType::kBFloat16, 11);
      auto fused = [&](cudaStream_t s) {
        BENCH_CHECK(pyorch::silu_and_mul_dynamic_per_token_fp8_quant(
            out, scales, in, nullptr, DType::kBFloat16, tokens, d, d, 2 * d, s));
      };
      auto act_only = [&](cudaStream_t s) {
        BENCH_CHECK(pyorch::silu_and_mul(act, in, DType::kBFloat16, tokens, d, d, 2 * d, s));
      };
      auto quant_only = [&](cudaStream_t s) {
        BENCH_CHECK(pyorch::dynamic_per_token_scaled_fp8_quant(
            out, act, scales, nullptr, DType::kBFloat16, tokens, d, d, d, s));
      };
      const double us = pyorch::bench::time_us(fused, stream, 5, iters);
      const double separate_us = pyorch::bench::time_us(
          [&](cudaStream_t s) {
            act_only(s);
            quant_only(s);
          },
          stream, 5, iters);
      const double act_us = pyorch::bench::time_us(act_only, stream, 5, iters);
      const double quant_us = pyorch::bench::time_us(quant_only, stream, 5, iters);
      // Read gate and up (bf16), write the fp8 row and its scale.
      const double bytes = double(tokens) * d * 5 + tokens * 4.0;
      const double gbs = bytes / (us * 1e3);
      report.add({{"op", "silu_mul_fp8_quant"},
                  {"dtype", "bf16"},
                  {"tokens", std::to_string(tokens)},
                  {"intermediate", std::to_string(d)},
                  {"time_us", Report::fmt(us)},
                  {"GB/s", Report::fmt(gbs, 1)},
                  {"pct_of_copy", Report::fmt(100.0 * gbs / copy_gbs, 1)},
                  {"separate_us", Report::fmt(separate_us)},
                  {"act_us", Report::fmt(act_us)},
                  {"quant_us", Report::fmt(quant_us)},
                  {"speedup", Report::fmt(separate_us / us, 2)}});
      for (void* p : {in, act, static_cast<void*>(out), static_cast<void*>(scales)}) {
        BENCH_CHECK(cudaFree(p));
      }
    }
  }
}

// ---- the quantizer alone ------------------------------------------------------------------------

void bench_fp8_quant(Report& report, const Args& args, double copy_gbs, cudaStream_t stream) {
  const int iters = static_cast<int>(args.num("iters", 30));
  for (int64_t hidden : args.list("hidden", {4096, 8192, 14336, 28672})) {
    for (int64_t tokens : args.list("tokens", {1, 16, 1024, 4096, 16384})) {
      char* in_base;
      uint8_t* out;
      float* scales;
      BENCH_CHECK(cudaMalloc(&in_base, (tokens * hidden + 8) * 2));
      BENCH_CHECK(cudaMalloc(&out, tokens * hidden));
      BENCH_CHECK(cudaMalloc(&scales, tokens * sizeof(float)));
      for (int offset : {0, 1}) {
        fill_rows_kernel<<<dim3(8, static_cast<unsigned>(tokens)), 256, 0, stream>>>(
            in_base + offset * 2, tokens, hidden, hidden, DType::kBFloat16, 7);
      }
      auto time_at = [&](int offset) {
        return pyorch::bench::time_us(
            [&](cudaStream_t s) {
              BENCH_CHECK(pyorch::dynamic_per_token_scaled_fp8_quant(
                  out, in_base + offset * 2, scales, nullptr, DType::kBFloat16, tokens, hidden,
                  hidden, hidden, s));
            },
            stream, 5, iters);
      };
      const double us = time_at(0), elementwise_us = time_at(1);
      const double bytes = double(tokens) * hidden * 3 + tokens * 4.0;
      const double gbs = bytes / (us * 1e3);
      report.add({{"op", "fp8_quant"},
                  {"dtype", "bf16"},
                  {"tokens", std::to_string(tokens)},
                  {"hidden", std::to_string(hidden)},
                  {"time_us", Report::fmt(us)},
                  {"GB/s", Report::fmt(gbs, 1)},
                  {"pct_of_copy", Report::fmt(100.0 * gbs / copy_gbs, 1)},
                  {"elementwise_us", Report::fmt(elementwise_us)},
                  {"speedup", Report::fmt(elementwise_us / us, 2)}});
      BENCH_CHECK(cudaFree(in_base));
      BENCH_CHECK(cudaFree(out));
      BENCH_CHECK(cudaFree(scales));
    }
  }
}

bool wants(const Args& args, const std::string& op) {
  const std::vector<std::string> ops = args.strs("ops", {"fp8_quant", "silu_mul_fp8_quant"});
  return std::find(ops.begin(), ops.end(), op) != ops.end();
}

}  // namespace

int main(int argc, char** argv) {
  const Args args(argc, argv);
  Report report(args);
  cudaStream_t stream;
  BENCH_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  std::printf("device=%s\n", pyorch::bench::device_name().c_str());
  int failures = 0;
  if (!args.has("no-check")) {
    if (wants(args, "fp8_quant")) failures += run_checks(report, stream);
    if (wants(args, "silu_mul_fp8_quant")) failures += run_act_checks(report, stream);
  }
  if (!args.has("no-bench")) {
    const double copy_gbs = pyorch::bench::copy_bandwidth_gbs(stream);
    std::printf("copy_GB/s=%.1f\n", copy_gbs);
    if (wants(args, "fp8_quant")) bench_fp8_quant(report, args, copy_gbs, stream);
    if (wants(args, "silu_mul_fp8_quant")) bench_silu_mul_fp8_quant(report, args, copy_gbs, stream);
  }
  BENCH_CHECK(cudaStreamDestroy(stream));
  std::printf("%s: %d failing checks\n", failures == 0 ? "ALL PASS" : "FAILURES", failures);
  return failures == 0 ? 0 : 2;
}
