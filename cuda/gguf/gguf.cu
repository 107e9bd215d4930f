// The GGUF kernels behind the torch-free C API (pyorch/gguf.h): type table, argument checks, the
// q8_1 workspace and the type / token-count dispatch.
#include "gguf/gguf_blocks.cuh"
#include "gguf/gguf_dequantize.cuh"
#include "gguf/gguf_mmq.cuh"
#include "gguf/gguf_mmvq.cuh"
#include "gguf/gguf_mmvq_q4k.cuh"
#include "gguf/gguf_q8_1.cuh"
#include "pyorch/gguf.h"

#include <algorithm>
#include <atomic>
#include <map>
#include <mutex>
#include <tuple>
#include <type_traits>
#include <utility>

namespace pyorch {

namespace {

std::atomic<bool> g_q4k_direct{true};  // set_gguf_q4k_direct
std::atomic<int> g_fused_warps{32};    // set_gguf_fused_warps

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
cudaError_t check_mul_mat(const char* op, const void* weight, void* workspace, int32_t type,
                          DType dtype, int64_t num_tokens, int64_t output_size, int64_t input_size,
                          int64_t weight_row_stride_bytes) {
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
  return cudaSuccess;
}

// The products' argument checks, then x's q8_1 blocks into the workspace.
cudaError_t prepare_mul_mat(const char* op, const void* input, const void* weight, void* workspace,
                            int32_t type, DType dtype, int64_t num_tokens, int64_t output_size,
                            int64_t input_size, int64_t weight_row_stride_bytes,
                            int64_t input_stride, cudaStream_t stream) {
  PYORCH_RETURN_IF_ERROR(check_mul_mat(op, weight, workspace, type, dtype, num_tokens, output_size,
                                       input_size, weight_row_stride_bytes));
  if (num_tokens == 0 || input_size == 0) return cudaSuccess;
  return gguf_quantize_q8_1(workspace, input, dtype, num_tokens, input_size, input_stride, stream);
}

// Thread blocks of a kernel form one SM holds at once: query() (the occupancy calculator) run
// once per device and form key, then cached (0: the form does not fit). Each call site's query
// type keeps its own cache.
template <typename Key, typename Query>
int cached_resident_blocks(const Key& form, Query query) {
  static std::mutex mutex;
  static std::map<std::pair<int, Key>, int> cache;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  const auto key = std::make_pair(device, form);
  std::lock_guard<std::mutex> lock(mutex);
  auto it = cache.find(key);
  if (it == cache.end()) it = cache.emplace(key, query()).first;
  return it->second;
}

// The vector product's FUSE_X / q8_1 forms, per block size, tile and shared memory.
template <int TYPE, bool FUSE_X>
int mmvq_resident_blocks(int warps, int subs_per_lane, size_t smem) {
  return cached_resident_blocks(std::make_tuple(warps, subs_per_lane, smem), [&] {
    return kernels::gguf::mul_mat_vec_resident_blocks<TYPE, 1, FUSE_X>(warps, subs_per_lane, smem);
  });
}

// How one token's product that quantizes x itself (FUSE_X) launches: rows per thread block,
// and the grid capped at the blocks that stay resident (each block then quantizes x once for
// several rows per warp instead of once per row group). Of the candidate block sizes (`warps`,
// or 8 and 4), the one with the most resident warps per SM, 8 on a tie (less quantization per
// row). warps == 0: neither fits an SM (x too long for shared memory).
struct FusedPlan {
  int warps;
  int64_t max_blocks;
};

template <int TYPE>
FusedPlan mmvq_fused_plan(int64_t input_size, int subs_per_lane, int num_stages, int warps) {
  const int64_t sms = current_device_sm_count();
  FusedPlan best{0, 0};
  int64_t best_warps_per_sm = 0;
  for (const int w : {8, 4}) {
    if (warps > 0 && w != warps) continue;
    const size_t smem =
        kernels::gguf::mul_mat_vec_smem<TYPE>(w, subs_per_lane, num_stages, true, input_size);
    const int64_t resident = mmvq_resident_blocks<TYPE, true>(w, subs_per_lane, smem);
    if (resident <= 0 || sms <= 0) continue;
    if (resident * w > best_warps_per_sm) {
      best = {w, resident * sms};
      best_warps_per_sm = resident * w;
    }
  }
  if (warps > 0 && best.warps == 0) {  // a forced block size the calculator refused: no cap
    return {warps, 0};
  }
  return best;
}

// The direct Q4_K form, per block size and shared memory.
template <bool L2_256>
int q4k_direct_resident_blocks(int warps, size_t smem) {
  return cached_resident_blocks(std::make_pair(warps, smem), [&] {
    return kernels::gguf::q4k_mul_mat_vec_resident_blocks<L2_256>(warps, smem);
  });
}

// One token's Q4_K product in the direct form, the grid capped at blocks_per_sm (<= 0: all that
// stay resident) per SM; returns cudaErrorNotSupported (and leaves no error) where the form does
// not fit an SM (x too long for shared memory) or the rows pass 2^30.
template <bool L2_256>
cudaError_t launch_q4k_direct(void* out, DType dtype, const uint8_t* weight, const void* x,
                              int64_t output_size, int64_t input_size,
                              int64_t weight_row_stride_bytes, int warps, int blocks_per_sm,
                              bool pdl, cudaStream_t stream) {
  if (output_size > (int64_t(1) << 30)) return cudaErrorNotSupported;
  int64_t resident =
      q4k_direct_resident_blocks<L2_256>(warps, kernels::gguf::q4k_mul_mat_vec_smem(input_size));
  const int64_t sms = current_device_sm_count();
  if (resident <= 0 || sms <= 0) return cudaErrorNotSupported;
  if (blocks_per_sm > 0 && blocks_per_sm < resident) resident = blocks_per_sm;
  return kernels::gguf::launch_q4k_mul_mat_vec<L2_256>(out, dtype, weight, x, output_size,
                                                       input_size, weight_row_stride_bytes, warps,
                                                       resident * sms, pdl, stream);
}

// The direct form with an input op (its own shared memory): resident blocks of `warps` warps.
template <GgufInputOp IN>
int q4k_fused_resident_blocks(int warps, size_t smem) {
  return cached_resident_blocks(std::make_pair(warps, smem), [&] {
    return kernels::gguf::q4k_mul_mat_vec_resident_blocks<false, IN>(warps, smem);
  });
}

int q4k_fused_resident_blocks(GgufInputOp input_op, int warps, size_t smem) {
  switch (input_op) {
    case GgufInputOp::kNone: return q4k_fused_resident_blocks<GgufInputOp::kNone>(warps, smem);
    case GgufInputOp::kRmsNorm:
      return q4k_fused_resident_blocks<GgufInputOp::kRmsNorm>(warps, smem);
    case GgufInputOp::kSiluAndMul:
      return q4k_fused_resident_blocks<GgufInputOp::kSiluAndMul>(warps, smem);
  }
  return 0;
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

cudaError_t zero_output(void* out, DType dtype, int64_t num_tokens, int64_t output_size,
                        int64_t out_stride, cudaStream_t stream) {
  // input_size == 0: the product is all zeros.
  const size_t elem = dtype == DType::kFloat32 ? 4 : 2;
  return cudaMemset2DAsync(out, out_stride * elem, 0, output_size * elem, num_tokens, stream);
}

}  // namespace

void set_gguf_q4k_direct(bool on) { g_q4k_direct.store(on, std::memory_order_relaxed); }
void set_gguf_fused_warps(int warps) {
  g_fused_warps.store(std::clamp(warps, 1, kernels::gguf::kQ4KMaxWarps), std::memory_order_relaxed);
}
int gguf_fused_warps() { return g_fused_warps.load(std::memory_order_relaxed); }
bool gguf_q4k_direct() { return g_q4k_direct.load(std::memory_order_relaxed); }

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
  // The one-token form that quantizes x itself: 2 stages (less shared memory per block). H100,
  // bench_gguf's sweep (results gguf_fused_20261128, run 7), one Llama-3-8B layer's four shapes
  // at 8 rows per block, 2 against 3 stages: Q4_K 62.4 / 63.5 us, Q6_K 82.4 / 85.6, Q8_0 94.6 /
  // 95.0, Q4_0 56.9 / 57.0 (qkv alone is faster with 3 for some types).
  int subs_per_lane = 2;
  int num_stages = 3;
  int fused_stages = 2;
  bool subs_set = false;
  bool l2_256 = true;
  bool pdl = pdl_enabled();
  if (config != nullptr) {  // the caller's non-default fields win
    subs_set = config->subs_per_lane >= 0;
    if (subs_set) subs_per_lane = config->subs_per_lane;
    if (config->num_stages >= 0) num_stages = fused_stages = config->num_stages;
    if (config->l2_prefetch >= 0) l2_256 = config->l2_prefetch > 0;
    if (config->pdl >= 0) pdl = config->pdl > 0 && pdl_enabled();
  }
  if (subs_per_lane != 2 && subs_per_lane != 4) {
    PYORCH_INVALID("gguf_mul_mat_vec: subs_per_lane %d is not 2 or 4", subs_per_lane);
  }
  if (num_stages < 2 || num_stages > 4) {
    PYORCH_INVALID("gguf_mul_mat_vec: num_stages %d is not 2, 3 or 4", num_stages);
  }
  const int want_warps = config != nullptr ? config->warps : -1;
  const int want_fuse = config != nullptr ? config->fuse_x : -1;
  const int max_warps = config != nullptr && config->direct > 0 ? kernels::gguf::kQ4KMaxWarps
                                                                : kernels::gguf::kMmvqMaxWarps;
  if (want_warps == 0 || want_warps > max_warps) {
    PYORCH_INVALID("gguf_mul_mat_vec: warps %d is not 1..%d", want_warps, max_warps);
  }
  // One token whose x is 16-byte aligned may be quantized by the product itself.
  const bool can_fuse = num_tokens == 1 && reinterpret_cast<uintptr_t>(input) % 16 == 0;
  if (want_fuse > 0 && !can_fuse) {
    PYORCH_INVALID("gguf_mul_mat_vec: fuse_x needs one token (got %lld) and a 16-byte aligned x",
                   static_cast<long long>(num_tokens));
  }
  // The direct form's fields are refused where the ring form would run instead (below).
  const bool direct_fields =
      config != nullptr && (config->direct > 0 || config->blocks_per_sm >= 0);
  if (direct_fields && (!can_fuse || want_fuse == 0)) {
    PYORCH_INVALID(
        "gguf_mul_mat_vec: direct / blocks_per_sm need one token with a 16-byte aligned x and "
        "fuse_x (got %lld tokens, fuse_x %d)",
        static_cast<long long>(num_tokens), want_fuse);
  }
  if (want_fuse > 0 || (want_fuse < 0 && can_fuse)) {
    // prepare_mul_mat's checks, without the q8_1 kernel.
    PYORCH_RETURN_IF_ERROR(check_mul_mat("gguf_mul_mat_vec", weight, workspace, type, dtype,
                                         num_tokens, output_size, input_size,
                                         weight_row_stride_bytes));
    if (output_size == 0) return cudaSuccess;
    if (input_size == 0)
      return zero_output(out, dtype, num_tokens, output_size, out_stride, stream);
    // Q4_K: the direct form where the rows start on 16 bytes (every GGUF file's).
    const int want_direct =
        config != nullptr && config->direct >= 0 ? config->direct : (gguf_q4k_direct() ? -1 : 0);
    const bool can_direct = type == int32_t(GgmlType::kQ4_K) &&
                            reinterpret_cast<uintptr_t>(weight) % 16 == 0 &&
                            weight_row_stride_bytes % 16 == 0;
    if (want_direct > 0 && !can_direct) {
      PYORCH_INVALID(
          "gguf_mul_mat_vec: direct: needs Q4_K (got %s) rows on 16 bytes (weight %% 16 = %d, row "
          "stride %lld bytes)",
          type_info(type).name, static_cast<int>(reinterpret_cast<uintptr_t>(weight) % 16),
          static_cast<long long>(weight_row_stride_bytes));
    }
    if (direct_fields && (want_direct == 0 || !can_direct)) {
      PYORCH_INVALID(
          "gguf_mul_mat_vec: blocks_per_sm is the direct form's (Q4_K rows on 16 bytes, "
          "direct not 0)");
    }
    if (can_direct && want_direct != 0) {
      const int blocks_per_sm = config != nullptr ? config->blocks_per_sm : -1;
      const int direct_warps = want_warps > 0 ? want_warps : kernels::gguf::kQ4KMaxWarps;
      if (blocks_per_sm == 0) PYORCH_INVALID("gguf_mul_mat_vec: direct: blocks_per_sm 0");
      // No L2::256B hint by default: H200, bench_gguf, Llama-3-8B gate_up / down at M = 1 19.71 /
      // 11.70 us without it, 20.32 / 11.87 with it (qkv, o_proj equal).
      const bool hint = config != nullptr && config->l2_prefetch > 0;
      const auto* w = static_cast<const uint8_t*>(weight);
      const cudaError_t err =
          hint ? launch_q4k_direct<true>(out, dtype, w, input, output_size, input_size,
                                         weight_row_stride_bytes, direct_warps, blocks_per_sm, pdl,
                                         stream)
               : launch_q4k_direct<false>(out, dtype, w, input, output_size, input_size,
                                          weight_row_stride_bytes, direct_warps, blocks_per_sm, pdl,
                                          stream);
      if (err != cudaErrorNotSupported) return err;
      if (direct_fields) {
        PYORCH_INVALID(
            "gguf_mul_mat_vec: direct: x of %lld values does not fit in shared memory, or %lld "
            "rows are over 2^30",
            static_cast<long long>(input_size), static_cast<long long>(output_size));
      }
    }
    FusedPlan plan{0, 0};
    int fused_subs = subs_per_lane;
    PYORCH_RETURN_IF_ERROR(PYORCH_DISPATCH_GGUF_QUANT(type, TYPE, [&] {
      plan = mmvq_fused_plan<TYPE>(input_size, fused_subs, fused_stages, want_warps);
      // K-quants whose warps take several rows each stream tiles of 4 sub-blocks per lane (16
      // blocks): half the per-tile work per byte. H100, bench_gguf's sweep, Llama-3-8B gate_up
      // (28672 rows) at M = 1, 8 rows per block, 4 against 2 sub-blocks per lane: Q4_K 27.4 /
      // 29.0 us, Q6_K 37.8 / 39.6, Q2_K 21.3 / 23.6, Q5_K 32.2 / 33.5
      // (bench/results/NVIDIA_H100_80GB_HBM3/gguf_fused_20261128, run 7). A row per warp (qkv,
      // o, down) keeps 2 (Q4_K down 17.0 against 18.8).
      const bool several_rows =
          plan.warps > 0 && plan.max_blocks > 0 && output_size > plan.max_blocks * plan.warps;
      if (!subs_set && several_rows && kernels::gguf::BlockTraits<TYPE>::kBlockSize == 256) {
        const FusedPlan wide = mmvq_fused_plan<TYPE>(input_size, 4, fused_stages, want_warps);
        if (wide.warps > 0) {
          plan = wide;
          fused_subs = 4;
        }
      }
      return cudaSuccess;
    }));
    if (plan.warps > 0) {
      const auto* w = static_cast<const uint8_t*>(weight);
      return PYORCH_DISPATCH_GGUF_QUANT(type, TYPE, [&] {
        return kernels::gguf::launch_mul_mat_vec<TYPE, 1, true>(
            out, dtype, w, nullptr, nullptr, input, 1, output_size, input_size,
            weight_row_stride_bytes, out_stride, plan.warps, plan.max_blocks, fused_subs,
            fused_stages, l2_256, pdl, stream);
      });
    }
    // x does not fit in shared memory: the q8_1 kernel's form below.
    if (want_fuse > 0) {
      PYORCH_INVALID("gguf_mul_mat_vec: fuse_x: x of %lld values does not fit in shared memory",
                     static_cast<long long>(input_size));
    }
  }
  // The q8_1 kernel's form: one row per warp, at most kMmvqWarps per block (its launch bounds).
  if (want_warps > kernels::gguf::kMmvqWarps) {
    PYORCH_INVALID("gguf_mul_mat_vec: warps %d: at most %d without fuse_x", want_warps,
                   kernels::gguf::kMmvqWarps);
  }
  const int warps = want_warps > 0 ? want_warps : kernels::gguf::kMmvqWarps;
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
      auto launch = [&](auto tokens) {
        return kernels::gguf::launch_mul_mat_vec<TYPE, decltype(tokens)::value, false>(
            o, dtype, w, q, ds, nullptr, n, output_size, input_size, weight_row_stride_bytes,
            out_stride, warps, 0, subs_per_lane, num_stages, l2_256, pdl, stream);
      };
      cudaError_t err;
      if (n == 1) {
        err = launch(std::integral_constant<int, 1>{});
      } else if (n == 2) {
        err = launch(std::integral_constant<int, 2>{});
      } else if (n <= 4) {
        err = launch(std::integral_constant<int, 4>{});
      } else {
        err = launch(std::integral_constant<int, 8>{});
      }
      PYORCH_RETURN_IF_ERROR(err);
    }
    return cudaSuccess;
  });
}

bool gguf_mul_mat_vec_fused_supported(const void* input, const void* weight,
                                      const void* norm_weight, int32_t type, DType dtype,
                                      int64_t output_size, int64_t input_size,
                                      int64_t weight_row_stride_bytes, GgufInputOp input_op) {
  const bool op_ok =
      input_op == GgufInputOp::kNone || input_op == GgufInputOp::kSiluAndMul ||
      (input_op == GgufInputOp::kRmsNorm && aligned16(norm_weight) && norm_weight != nullptr);
  if (!op_ok || type != int32_t(GgmlType::kQ4_K) || !gguf_q4k_direct() || !is_float_dtype(dtype) ||
      !aligned16(input) || !aligned16(weight) || weight_row_stride_bytes % 16 != 0 ||
      input_size <= 0 || input_size % 256 != 0 || output_size <= 0 ||
      output_size > (int64_t(1) << 30) || current_device_sm_count() <= 0) {
    return false;
  }
  const size_t smem = kernels::gguf::q4k_mul_mat_vec_smem(input_size, input_op);
  return q4k_fused_resident_blocks(input_op, gguf_fused_warps(), smem) > 0;
}

cudaError_t gguf_mul_mat_vec_fused(void* out, const void* input, const void* weight,
                                   const void* norm_weight, float eps, GgufInputOp input_op,
                                   bool accumulate, int32_t type, DType dtype, int64_t output_size,
                                   int64_t input_size, int64_t weight_row_stride_bytes,
                                   cudaStream_t stream) {
  if (!gguf_mul_mat_vec_fused_supported(input, weight, norm_weight, type, dtype, output_size,
                                        input_size, weight_row_stride_bytes, input_op)) {
    PYORCH_INVALID(
        "gguf_mul_mat_vec_fused: no fused kernel for %s, input op %d, %lld x %lld, %s (it takes "
        "one token of Q4_K rows on 16 bytes with x and the norm weight 16-byte aligned, the "
        "direct form on): compose the input op, gguf_mul_mat_vec and an add instead",
        type_info(type).name, static_cast<int>(input_op), static_cast<long long>(output_size),
        static_cast<long long>(input_size), dtype_name(dtype));
  }
  const size_t smem = kernels::gguf::q4k_mul_mat_vec_smem(input_size, input_op);
  // One thread block per SM (x is rounded once per SM; with fewer than 32 warps the next
  // kernel's blocks fit beside it).
  const int64_t max_blocks = current_device_sm_count();
  const auto* w = static_cast<const uint8_t*>(weight);
  const int kWarps = gguf_fused_warps();
  switch (input_op) {
    case GgufInputOp::kNone:
      return kernels::gguf::launch_q4k_mul_mat_vec<false, GgufInputOp::kNone>(
          out, dtype, w, input, output_size, input_size, weight_row_stride_bytes, kWarps,
          max_blocks, pdl_enabled(), stream, nullptr, 0.f, accumulate);
    case GgufInputOp::kRmsNorm:
      return kernels::gguf::launch_q4k_mul_mat_vec<false, GgufInputOp::kRmsNorm>(
          out, dtype, w, input, output_size, input_size, weight_row_stride_bytes, kWarps,
          max_blocks, pdl_enabled(), stream, norm_weight, eps, accumulate);
    case GgufInputOp::kSiluAndMul:
      return kernels::gguf::launch_q4k_mul_mat_vec<false, GgufInputOp::kSiluAndMul>(
          out, dtype, w, input, output_size, input_size, weight_row_stride_bytes, kWarps,
          max_blocks, pdl_enabled(), stream, nullptr, 0.f, accumulate);
  }
  PYORCH_INVALID("gguf_mul_mat_vec_fused: input op %d", static_cast<int>(input_op));
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
