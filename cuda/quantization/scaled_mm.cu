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
  }
  return "unknown";
}

namespace {

// The SM count of the current device (the tile choice below); 132, an H100, when unknown.
int sm_count() {
  const int count = current_device_sm_count();
  return count > 0 ? count : 132;
}

}  // namespace

// The decode tiles put the weight's n on the 64-row side of wgmma, so m <= 16 tokens fill a
// 16-wide tile instead of a 64-row one padded with zeros, and m <= 64 one 64-wide tile (as vLLM's
// sm90 dispatch). Between 64 and 256 rows, 64 x 128 or 128 x 128 tiles by wave count. First H100
// run (bench_scaled_mm, Llama-3-8B qkv_proj, fp8, 64 x 128 up to 256): M = 128 (96 tiles, one
// wave) 12.9 us, 0.91x cuBLASLt; M = 256 (192 tiles, two waves) 17.8 us, 0.74x; M = 512 on 128 x
// 128 (192 tiles) 24.3 us. Taking a 128 x 128 tile as about 1.8 of a 64 x 128 one, the larger
// tile is chosen when it saves a wave (qkv_proj at M = 256), not when both fit in one (o_proj, n =
// 4096, at M = 256: 128 tiles of 64 x 128). Not yet measured with this rule. int8 from 2048 rows
// takes 128 x 256 tiles: on 128 x 128 cooperative it ran 0.82-0.91x of cuBLASLt's int8 (1,205
// against 1,470 TOPS at M = 4096) where fp8 on 128 x 128 ping-pong matched cuBLASLt; the wider
// tile halves the A reloads per wgmma (not yet measured).
ScaledMmTile default_scaled_mm_tile(int64_t m, int64_t n, DType ab_dtype) {
  if (m <= 16) return ScaledMmTile::kSwapM16;
  if (m <= 64) return ScaledMmTile::kSwapM64;
  if (m >= 2048 && ab_dtype == DType::kInt8) return ScaledMmTile::kHuge;
  if (m > 256) return ScaledMmTile::kLarge;
  const int64_t sms = sm_count();
  const int64_t n_tiles = (n + 127) / 128;
  const int64_t waves64 = ((m + 63) / 64 * n_tiles + sms - 1) / sms;
  const int64_t waves128 = ((m + 127) / 128 * n_tiles + sms - 1) / sms;
  return 10 * waves64 <= 18 * waves128 ? ScaledMmTile::kM256 : ScaledMmTile::kLarge;
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
  if (tile == ScaledMmTile::kAuto) tile = default_scaled_mm_tile(m, n, ab_dtype);
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
