// The C API of pyorch/scaled_mm.h: checks the arguments, picks the tile configuration by m and
// hands over to the CUTLASS instantiations (scaled_mm_fp8.cu, scaled_mm_int8.cu,
// scaled_mm_blockwise.cu). Built with or without CUTLASS; without it every call returns
// cudaErrorNotSupported and cutlass_scaled_mm_available() says why.
#include <cstdint>

#include "common/check.cuh"
#include "common/launch.cuh"
#include "pyorch/scaled_mm.h"
#include "quantization/scaled_mm_internal.h"

namespace pyorch {

namespace {

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

bool is_out_dtype(DType t) { return t == DType::kBFloat16 || t == DType::kFloat16; }

// The checks every variant shares: sizes, strides, alignment, output dtype.
cudaError_t check_common(const kernels::ScaledMmParams& p) {
  if (p.m < 1 || p.n < 1 || p.k < 1) {
    PYORCH_INVALID("%s: empty problem (m=%lld n=%lld k=%lld)", p.op, (long long)p.m, (long long)p.n,
                   (long long)p.k);
  }
  if (p.k % 16 != 0 || p.n % 16 != 0) {
    PYORCH_INVALID("%s: k (%lld) and n (%lld) must be multiples of 16", p.op, (long long)p.k,
                   (long long)p.n);
  }
  if (p.m > INT32_MAX || p.n > INT32_MAX || p.k > INT32_MAX) {
    PYORCH_INVALID("%s: sizes must fit in int32", p.op);
  }
  if (p.a_stride < p.k || p.a_stride % 16 != 0 || p.b_stride < p.k || p.b_stride % 16 != 0) {
    PYORCH_INVALID("%s: a_stride and b_stride must be >= k and multiples of 16", p.op);
  }
  if (p.out_stride < p.n || p.out_stride % 8 != 0) {
    PYORCH_INVALID("%s: out_stride must be >= n and a multiple of 8", p.op);
  }
  if (!is_out_dtype(p.out_dtype)) {
    PYORCH_INVALID("%s: out dtype must be bfloat16 or float16, got %s", p.op,
                   dtype_name(p.out_dtype));
  }
  if (!aligned16(p.out) || !aligned16(p.a) || !aligned16(p.b)) {
    PYORCH_INVALID("%s: out, a and b must be 16-byte aligned", p.op);
  }
  if (p.a_scales == nullptr || p.b_scales == nullptr) {
    PYORCH_INVALID("%s: a_scales and b_scales are required", p.op);
  }
  return cudaSuccess;
}

kernels::ScaledMmParams make_params(const char* op, void* out, const void* a, const void* b,
                                    const float* a_scales, const float* b_scales, const void* bias,
                                    DType out_dtype, int64_t m, int64_t n, int64_t k,
                                    int64_t out_stride, int64_t a_stride, int64_t b_stride,
                                    bool a_per_token, bool b_per_channel) {
  kernels::ScaledMmParams p{};
  p.out = out;
  p.a = a;
  p.b = b;
  p.a_scales = a_scales;
  p.b_scales = b_scales;
  p.bias = bias;
  p.out_dtype = out_dtype;
  p.m = m;
  p.n = n;
  p.k = k;
  p.out_stride = out_stride;
  p.a_stride = a_stride;
  p.b_stride = b_stride;
  p.a_per_token = a_per_token;
  p.b_per_channel = b_per_channel;
  p.op = op;
  return p;
}

}  // namespace

bool cutlass_scaled_mm_available() {
#ifdef PYORCH_WITH_CUTLASS
  return true;
#else
  return false;
#endif
}

const char* scaled_mm_tile_name(ScaledMmTile tile) {
  switch (tile) {
    case ScaledMmTile::kAuto: return "auto";
    case ScaledMmTile::kSwapM16: return "swap_64x16x256";
    case ScaledMmTile::kSwapM64: return "swap_64x64x256";
    case ScaledMmTile::kM256: return "64x128x128_c2x1";
    case ScaledMmTile::kLarge: return "128x128x128_c2x1";
    case ScaledMmTile::kHuge: return "128x256x128_c2x1";
    case ScaledMmTile::kLargeCoop: return "128x128x128_coop_c2x1";
    case ScaledMmTile::kTall: return "256x128x128_coop_c2x1";
  }
  return "unknown";
}

bool scaled_mm_tile_instantiated(ScaledMmTile tile, DType ab_dtype) {
  const int t = static_cast<int>(tile);
  if (tile == ScaledMmTile::kAuto) return true;
  if (t < 0 || t >= kNumScaledMmTiles) return false;
  if (tile == ScaledMmTile::kLargeCoop || tile == ScaledMmTile::kTall) {
    return ab_dtype == DType::kFp8E4M3;
  }
  return ab_dtype == DType::kFp8E4M3 || ab_dtype == DType::kInt8;
}

namespace {

// The SM count of the current device (the tile choice below); 132, an H100, when unknown.
int sm_count() {
  const int count = current_device_sm_count();
  return count > 0 ? count : 132;
}

}  // namespace

// The tile for m tokens, from the H200 sweep of every tile against cuBLASLt (`bench_scaled_mm
// --sweep-tiles --rounds 3`, Llama-3-8B and 70B shapes, fp8 and int8;
// bench/results/NVIDIA_H200/scaled_mm_tiles_20261129/). The decode tiles put the weight's n on the
// 64-row side of wgmma, so a few tokens fill a 16- or 64-wide tile instead of a 64-row one padded
// with zeros (as vLLM's sm90 dispatch).
// - m <= 32: 64 x 16. At m = 32 it ran 0.93-1.10x of cuBLASLt (fp8; int8 1.04-1.23x) where
//   64 x 64 ran 0.66-0.84x (0.77-1.03x): two passes of 16 tokens beat one half-empty 64-wide
//   tile.
// - m <= 64: 64 x 64, unless its n / 64 CTAs spill into a second wave less than half full
//   (Llama-3-70B qkv_proj, n = 10240: 160 CTAs on 132 SMs; 64 x 16 ran 0.90x against 0.76x at
//   m = 48).
// - m <= 128: 64 x 64 while its CTAs fit in one wave (n = 4096 at m = 128: 0.96-1.26x against
//   0.80-1.03x on 64 x 128), else 64 x 128 (8B gate_up at m = 128: 0.94x against 0.55x on 128 x
//   128, which the wave rule below used to pick).
// - m <= 256: 64 x 128 or 128 x 128 by wave count, taking a 128 x 128 tile as about 1.8 of a
//   64 x 128 one; never 64 x 128 on an odd number of 64-row tiles, which its clusters of 2 along m
//   round up to even (m = 192: 0.52-0.82x against 0.70-0.80x on 128 x 128).
// - larger m: 128 x 128 ping-pong; fp8 problems of m n k >= 2^40 (Llama-3-8B gate_up from 16384
//   tokens, 70B gate_up and down from 4096 / 8192) on 128 x 256 cooperative: there the GPU is
//   power-bound and the wider tile, which halves the A reloads per wgmma, ran 0.91-0.99x against
//   0.82-0.89x; below that 128 x 128 won (8B gate_up at 8192: 0.96x against 0.89x). int8 from 2048
//   rows on 128 x 256 (128 x 128 ran 0.81-0.96x against 0.85-1.05x).
ScaledMmTile default_scaled_mm_tile(int64_t m, int64_t n, int64_t k, DType ab_dtype) {
  const int64_t sms = sm_count();
  if (m <= 32) return ScaledMmTile::kSwapM16;
  if (m <= 64) {
    const int64_t ctas = (n + 63) / 64;
    return ctas > sms && 2 * ctas <= 3 * sms ? ScaledMmTile::kSwapM16 : ScaledMmTile::kSwapM64;
  }
  if (m <= 128) {
    const int64_t swap_ctas = (n + 63) / 64 * ((m + 63) / 64);
    return swap_ctas <= sms ? ScaledMmTile::kSwapM64 : ScaledMmTile::kM256;
  }
  if (m <= 256) {
    const int64_t m_tiles64 = (m + 63) / 64;
    if (m_tiles64 % 2 == 1) return ScaledMmTile::kLarge;
    const int64_t n_tiles = (n + 127) / 128;
    const int64_t waves64 = (m_tiles64 * n_tiles + sms - 1) / sms;
    const int64_t waves128 = ((m + 127) / 128 * n_tiles + sms - 1) / sms;
    return 10 * waves64 <= 18 * waves128 ? ScaledMmTile::kM256 : ScaledMmTile::kLarge;
  }
  if (ab_dtype == DType::kInt8) return m >= 2048 ? ScaledMmTile::kHuge : ScaledMmTile::kLarge;
  // m * n * k >= 2^40, without overflow (m, n, k < 2^31).
  const double work = double(m) * double(n) * double(k);
  return work >= 1099511627776.0 ? ScaledMmTile::kHuge : ScaledMmTile::kLarge;
}

cudaError_t cutlass_scaled_mm(void* out, const void* a, const void* b, const float* a_scales,
                              const float* b_scales, const void* bias, DType ab_dtype,
                              DType out_dtype, int64_t m, int64_t n, int64_t k, int64_t out_stride,
                              int64_t a_stride, int64_t b_stride, bool a_per_token,
                              bool b_per_channel, cudaStream_t stream, ScaledMmTile tile) {
  const kernels::ScaledMmParams p =
      make_params("cutlass_scaled_mm", out, a, b, a_scales, b_scales, bias, out_dtype, m, n, k,
                  out_stride, a_stride, b_stride, a_per_token, b_per_channel);
#ifdef PYORCH_WITH_CUTLASS
  PYORCH_RETURN_IF_ERROR(check_common(p));
  if (tile == ScaledMmTile::kAuto) tile = default_scaled_mm_tile(m, n, k, ab_dtype);
  if ((ab_dtype == DType::kFp8E4M3 || ab_dtype == DType::kInt8) &&
      !scaled_mm_tile_instantiated(tile, ab_dtype)) {
    PYORCH_INVALID("cutlass_scaled_mm: tile %s (%d) is not instantiated for %s operands",
                   scaled_mm_tile_name(tile), static_cast<int>(tile), dtype_name(ab_dtype));
  }
  switch (ab_dtype) {
    case DType::kFp8E4M3: return kernels::launch_scaled_mm_fp8(p, tile, stream);
    case DType::kInt8: return kernels::launch_scaled_mm_int8(p, tile, stream);
    default:
      PYORCH_INVALID("cutlass_scaled_mm: a and b must be fp8_e4m3 or int8, got %s",
                     dtype_name(ab_dtype));
  }
#else
  (void)p, (void)ab_dtype, (void)stream, (void)tile;
  return cudaErrorNotSupported;
#endif
}

cudaError_t cutlass_scaled_mm_azp(void* out, const void* a, const void* b, const float* a_scales,
                                  const float* b_scales, const int32_t* azp_adj, const int32_t* azp,
                                  const void* bias, DType out_dtype, int64_t m, int64_t n,
                                  int64_t k, int64_t out_stride, int64_t a_stride, int64_t b_stride,
                                  bool a_per_token, bool b_per_channel, cudaStream_t stream,
                                  ScaledMmTile tile) {
  kernels::ScaledMmParams p =
      make_params("cutlass_scaled_mm_azp", out, a, b, a_scales, b_scales, bias, out_dtype, m, n, k,
                  out_stride, a_stride, b_stride, a_per_token, b_per_channel);
  p.azp_adj = azp_adj;
  p.azp = azp;
#ifdef PYORCH_WITH_CUTLASS
  PYORCH_RETURN_IF_ERROR(check_common(p));
  if (azp_adj == nullptr) PYORCH_INVALID("cutlass_scaled_mm_azp: azp_adj is required");
  if (tile == ScaledMmTile::kAuto) {
    tile = m <= 256 ? ScaledMmTile::kM256 : ScaledMmTile::kLarge;
  }
  if (tile != ScaledMmTile::kM256 && tile != ScaledMmTile::kLarge) {
    PYORCH_INVALID("cutlass_scaled_mm_azp: tile %s is not instantiated for the azp epilogue",
                   scaled_mm_tile_name(tile));
  }
  return kernels::launch_scaled_mm_azp(p, tile, stream);
#else
  (void)p, (void)stream, (void)tile;
  return cudaErrorNotSupported;
#endif
}

cudaError_t cutlass_scaled_mm_blockwise(void* out, const void* a, const void* b,
                                        const float* a_scales, const float* b_scales,
                                        const void* bias, DType out_dtype, int64_t m, int64_t n,
                                        int64_t k, int64_t out_stride, int64_t a_stride,
                                        int64_t b_stride, int64_t a_scales_stride,
                                        cudaStream_t stream) {
  kernels::ScaledMmParams p =
      make_params("cutlass_scaled_mm_blockwise", out, a, b, a_scales, b_scales, bias, out_dtype, m,
                  n, k, out_stride, a_stride, b_stride, true, true);
  p.a_scales_stride = a_scales_stride;
#ifdef PYORCH_WITH_CUTLASS
  PYORCH_RETURN_IF_ERROR(check_common(p));
  if (k % kScaledMmBlockK != 0) {
    PYORCH_INVALID("cutlass_scaled_mm_blockwise: k (%lld) must be a multiple of %lld", (long long)k,
                   (long long)kScaledMmBlockK);
  }
  if (a_scales_stride < m || a_scales_stride % 4 != 0 || !aligned16(a_scales)) {
    PYORCH_INVALID(
        "cutlass_scaled_mm_blockwise: a_scales must be column-major with a stride >= m that is "
        "a multiple of 4 (got %lld for m=%lld), 16-byte aligned",
        (long long)a_scales_stride, (long long)m);
  }
  return kernels::launch_scaled_mm_blockwise(p, stream);
#else
  (void)p, (void)stream;
  return cudaErrorNotSupported;
#endif
}

}  // namespace pyorch
