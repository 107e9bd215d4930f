// Instantiates the attention kernels behind the torch-free C API: dtype x KV-cache dtype x head
// size, the KV-split choice and the workspace layout.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <type_traits>

#include "attention/merge_attn_states.cuh"
#include "attention/paged_attention.cuh"
#include "attention/paged_decode.cuh"
#include "attention/paged_prefill.cuh"
#include "attention/paged_prefill_sm90.cuh"
#include "pyorch/attention.h"

namespace pyorch {
namespace {

using kernels::AttnArgs;
using kernels::DecodeTile;

// Splitting the KV range pays when the (tile, kv head) CTAs cannot fill the GPU: aim for
// kWavesTarget CTAs per SM, keep at least kMinTilesPerSplit KV tiles per split.
constexpr int64_t kWavesTarget = 2;
constexpr int64_t kMinTilesPerSplit = 2;
constexpr int64_t kMaxSplits = kernels::kMaxKvSplits;
// Decode splits: at least this many 64-key chunks each (a CTA's fixed cost, the query load, the
// first load's latency and the warp merge, is then under half its streaming time).
constexpr int64_t kMinDecodeChunksPerSplit = 2;
// A decode sequence with at most this many keys runs in one split when the launch merges its
// splits itself (DecodeMergeArgs), however many splits the grid has. Measured on an
// H100 with `pyorch bench latency` (Llama-3-8B shapes, batch 1, graphs captured for 2048 tokens:
// 16 splits of 128 keys), bench/latency_sweep.sh: at 128 in / 256 out (128-384 keys) one split
// gives 6.18-6.19 ms/token against 6.30-6.31 with 2-3 live splits; at 1536 in (1.5-1.8k keys)
// 4 splits of 512 keys lost to 13 of 128 (6.45 against 6.37), and so did 1-split sequences of
// 512-4096 keys in bench_paged_attention's graphs (1x1k: 16.2 us against 11.6): only short
// sequences gain, so the bound sits below 512.
constexpr int kDecodeSingleSplitKeys = 384;

constexpr int kMaxDevices = 64;

// 132 (an H100) when the device cannot be asked: the choice only affects speed.
int num_sms_of_current_device() {
  const int count = current_device_sm_count();
  return count > 0 ? count : 132;
}

// Raises a kernel's dynamic shared-memory limit once per device (the attribute is per device).
// `done_mask` must belong to one kernel: every instantiation has the same function type, so the
// caller passes its own.
template <typename Kernel>
cudaError_t allow_dynamic_smem(Kernel* kernel, size_t bytes, std::atomic<uint64_t>& done_mask) {
  int device = 0;
  PYORCH_RETURN_IF_ERROR(cudaGetDevice(&device));
  const uint64_t bit = device < kMaxDevices ? uint64_t{1} << device : 0;
  if (bit != 0 && (done_mask.load(std::memory_order_relaxed) & bit)) return cudaSuccess;
  PYORCH_RETURN_IF_ERROR(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                              static_cast<int>(bytes)));
  done_mask.fetch_or(bit, std::memory_order_relaxed);
  return cudaSuccess;
}

// THE list of head sizes (vLLM's attention's): calls f(std::integral_constant<int, D>{}) for
// head_size D and returns true, or returns false for any other value. supported_head_size and
// dispatch_head_size both go through it, so the check and the instantiations cannot disagree.
// Every size runs the tensor-core kernels: whole 64-element panels (64, 128, 192, 256) the wgmma
// prefill kernel with 16-bit caches; multiples of 16 the mma.sync kernels as they are; 120 the
// mma.sync kernels on 128-dim tiles with the dims past 120 zero-filled (attn_tile_head).
template <class F>
bool with_head_size(int64_t head_size, F&& f) {
  switch (head_size) {
#define PYORCH_CASE(D) \
  case D: f(std::integral_constant<int, D>{}); return true;
    PYORCH_CASE(32)
    PYORCH_CASE(64)
    PYORCH_CASE(80)
    PYORCH_CASE(96)
    PYORCH_CASE(112)
    PYORCH_CASE(120)
    PYORCH_CASE(128)
    PYORCH_CASE(192)
    PYORCH_CASE(256)
#undef PYORCH_CASE
    default: return false;
  }
}

bool supported_head_size(int64_t head_size) {
  return with_head_size(head_size, [](auto) {});
}

// Every sequence has at most one m16 tile of rows (by the max_query_len hint): only
// paged_decode_kernel runs.
bool all_decode_rows(const PagedAttentionParams& p) {
  const int64_t group_size = p.num_heads / p.num_kv_heads;
  const int64_t max_q = std::max<int64_t>(1, std::min(p.max_query_len, p.num_tokens));
  return max_q * group_size <= kernels::kDecodeMaxRows;
}

// A pure decode batch: one wave of decode CTAs, at most one per SM, each over whole 64-key
// chunks. Measured on H100 (Llama-3-8B shapes, % of copy in a CUDA graph): one CTA per SM beats
// filling both resident slots (1x32k: 16 splits 74%, 32 splits 72%; 16x1k: no split 73%, 2 splits
// 65%; 1x4k: 16 splits 38%, 32 splits 34%); a second CTA per SM adds more partials, merge work
// and imbalance than bandwidth. Rounded up when one CTA per SM would leave over a quarter of the
// SMs idle (too few CTAs to saturate HBM: 8 splits at 1x32k reach only 55%). fp8 caches aim at
// two CTAs per SM instead: unpacking to bf16 makes each warp issue-bound, so a second CTA's warps
// are worth its merge work (1x32k: 32 splits 47%, 16 splits 36%; 16x1k: 2 splits 44%, none 37%).
// NOTE(fp8kv): those fp8 numbers predate the fragment loads (paged_decode_fp8.cuh), which took
// the unpacking out of the loop; the fp8 policy (two CTAs per SM, 4-warp CTAs) was not re-swept.
// NOTE(decode): measured with the 4-warp CTA and merge_split_kv_kernel; a one-CTA-per-SM grid now
// runs the 8-warp whole-SM shape and merges in the same launch (launch_paged_decode), and these
// counts were not re-swept for it.
int64_t choose_decode_splits(const PagedAttentionParams& p) {
  const int64_t ctas = std::max<int64_t>(1, p.num_seqs * p.num_kv_heads);
  const int64_t target =
      num_sms_of_current_device() * (p.kv_cache_dtype == KVCacheDType::kFp8E4M3 ? 2 : 1);
  const int64_t chunks = (std::max<int64_t>(p.max_seq_len, 0) + kernels::kDecodeChunkKeys - 1) /
                         kernels::kDecodeChunkKeys;
  int64_t splits = target / ctas;
  if (4 * splits * ctas < 3 * target) splits += 1;
  splits = std::min(splits, chunks / kMinDecodeChunksPerSplit);
  splits = std::clamp<int64_t>(splits, 1, kMaxSplits);
  // As many splits as the chunks fill: ceil(chunks / splits) chunks each, no empty tail split.
  const int64_t per_split = (chunks + splits - 1) / splits;
  return std::max<int64_t>(1, (chunks + per_split - 1) / std::max<int64_t>(per_split, 1));
}

// Depends on host-side fields only, so workspace_size() and the launch always agree.
int64_t choose_num_splits(const PagedAttentionParams& p) {
  if (p.num_kv_heads <= 0 || p.num_heads % p.num_kv_heads != 0) return 1;
  if (all_decode_rows(p)) return choose_decode_splits(p);
  const int64_t group_size = p.num_heads / p.num_kv_heads;
  const int64_t max_q = std::max<int64_t>(1, std::min(p.max_query_len, p.num_tokens));
  const int64_t block_m = kernels::kAttnBlockM;
  const int64_t tiles_per_seq = (max_q * group_size + block_m - 1) / block_m;
  const int64_t tiles = std::min(kernels::attn_grid_tiles(p), p.num_seqs * tiles_per_seq);
  const int64_t ctas = std::max<int64_t>(1, tiles * p.num_kv_heads);
  const int64_t target = kWavesTarget * num_sms_of_current_device();
  if (ctas >= target) return 1;
  const int64_t block_n = kernels::attn_block_n(static_cast<int>(p.head_size));
  const int64_t kv_tiles = (std::max<int64_t>(p.max_seq_len, 0) + block_n - 1) / block_n;
  int64_t splits = (target + ctas - 1) / ctas;
  splits = std::min(splits, kv_tiles / kMinTilesPerSplit);
  return std::clamp<int64_t>(splits, 1, kMaxSplits);
}

size_t partial_output_elems(const PagedAttentionParams& p, int64_t num_splits) {
  return static_cast<size_t>(num_splits * p.num_tokens * p.num_heads * p.head_size);
}

// Workspace layout with num_splits > 1: o_partial, lse_partial (one float per (split, token,
// head)), then for a pure decode batch the decode kernel's arrival slots, one 8-byte word per
// (sequence, kv head), from a 16-byte boundary.
size_t split_partials_bytes(const PagedAttentionParams& p, int64_t num_splits) {
  return sizeof(float) * (partial_output_elems(p, num_splits) +
                          static_cast<size_t>(num_splits * p.num_tokens * p.num_heads));
}
size_t decode_arrivals_offset(const PagedAttentionParams& p, int64_t num_splits) {
  return (split_partials_bytes(p, num_splits) + 15) / 16 * 16;
}
size_t decode_arrivals_bytes(const PagedAttentionParams& p) {
  return sizeof(unsigned long long) * static_cast<size_t>(p.num_seqs * p.num_kv_heads);
}

// A pure decode batch merges its split partials inside the decode launch (paged_decode.cuh); a
// mixed one leaves them, with the prefill kernel's, to merge_split_kv_kernel.
bool decode_merges_in_kernel(const PagedAttentionParams& p, int64_t num_splits) {
  return num_splits > 1 && all_decode_rows(p);
}

// The workspace's split partials and decode arrival slots (num_splits > 1).
size_t split_workspace_bytes(const PagedAttentionParams& p, int64_t num_splits) {
  if (num_splits <= 1) return 0;
  if (decode_merges_in_kernel(p, num_splits)) {
    return decode_arrivals_offset(p, num_splits) + decode_arrivals_bytes(p);
  }
  return split_partials_bytes(p, num_splits);
}

// After them, from a 16-byte boundary, when the prefill kernel runs: one item counter per split,
// zeroed by the launch (the persistent prefill kernel's CTAs draw their next item from it).
size_t item_counters_offset(const PagedAttentionParams& p, int64_t num_splits) {
  return (split_workspace_bytes(p, num_splits) + 15) / 16 * 16;
}

// Where the launch's workspace pieces are (null when unused).
struct Workspace {
  int num_splits;
  float* o_partial;
  float* lse_partial;
  int* item_counters;
};

// A fresh tag per call for the decode arrival slots (decode_arrive): 1 .. 2^48 - 1, never 0, so
// that a slot the last CTA put back to 0 matches no call.
unsigned long long next_decode_tag() {
  static std::atomic<unsigned long long> counter{0};
  constexpr unsigned long long kTags = (1ull << 48) - 1;
  return counter.fetch_add(1, std::memory_order_relaxed) % kTags + 1;
}

// set_decode_fp8_l2_prefetch (attention.h).
std::atomic<bool> decode_fp8_l2_prefetch{true};
// set_decode_ctas_per_sm (attention.h): 0 = the launcher's rule.
std::atomic<int> decode_ctas_per_sm{0};

// The 3-CTA decode shape from this many CTAs per SM in the grid (sequences x kv heads x splits).
// Measured on an H200 (paged_decode.cuh): it wins from 256 x 8 kv heads (15 a SM) and loses at
// 64 x 8 (3.9 a SM: 1.3 waves of three against 1.9 of two, and the 2-CTA shape's deeper rings).
constexpr int64_t kDecode3CtaMinCtasPerSm = 8;

template <class Tile, typename Kernel>
cudaError_t launch_decode_grid(Kernel* kernel, const AttnArgs& args,
                               const kernels::DecodeMergeArgs& merge, cudaStream_t stream) {
  if (Tile::kSmemBytes > 48 * 1024) {
    static std::atomic<uint64_t> smem_configured{0};  // one per Tile
    PYORCH_RETURN_IF_ERROR(allow_dynamic_smem(kernel, Tile::kSmemBytes, smem_configured));
  }
  const int64_t ctas = args.p.num_seqs * args.p.num_kv_heads;
  if (ctas > INT32_MAX) PYORCH_INVALID("paged_attention: %lld decode CTAs", (long long)ctas);
  const dim3 grid(static_cast<unsigned>(ctas), static_cast<unsigned>(args.num_splits));
  return kernels::launch_kernel(kernel, grid, dim3(Tile::kThreads), Tile::kSmemBytes, stream,
                                pdl_enabled(), args, merge);
}

// The decode sequences (1..16 query rows) of the call: grid (num_seqs * num_kv_heads, splits).
// A grid that fits one CTA per SM (small batches, split long contexts) gets the whole-SM shape:
// the 2-CTA shape would leave half of each SM's warps and shared memory unused. fp8 caches keep
// the 2-CTA shape there: choose_decode_splits gives them two CTAs per SM. A grid of at least
// kDecode3CtaMinCtasPerSm CTAs per SM (a big decode batch) gets the 3-CTA shape where it fits.
// The choice reads the grid only, never the contexts: a CUDA graph replays its launch for any.
template <typename T, typename CacheT, int HEAD_SIZE>
cudaError_t launch_paged_decode(const AttnArgs& args, cudaStream_t stream) {
  kernels::DecodeMergeArgs merge{nullptr, 0, kDecodeSingleSplitKeys,
                                 decode_fp8_l2_prefetch.load(std::memory_order_relaxed)};
  if (decode_merges_in_kernel(args.p, args.num_splits)) {
    merge.arrivals = reinterpret_cast<unsigned long long*>(
        reinterpret_cast<char*>(args.o_partial) + decode_arrivals_offset(args.p, args.num_splits));
    merge.tag = next_decode_tag();
  }
  const int64_t ctas = args.p.num_seqs * args.p.num_kv_heads * args.num_splits;
  const int64_t sms = num_sms_of_current_device();
  const int forced = decode_ctas_per_sm.load(std::memory_order_relaxed);
  if constexpr (!std::is_same_v<CacheT, uint8_t>) {
    if (forced == 1 || (forced == 0 && ctas <= sms)) {
      constexpr int kWarps = kernels::DecodeBytes<T, CacheT, HEAD_SIZE>::kWholeSmWarps;
      return launch_decode_grid<DecodeTile<T, CacheT, HEAD_SIZE, kWarps, 1>>(
          &kernels::paged_decode_kernel<T, CacheT, HEAD_SIZE, kWarps, 1>, args, merge, stream);
    }
  }
  using Tile3 = DecodeTile<T, CacheT, HEAD_SIZE, 4, 3>;
  if constexpr (Tile3::kFitsCtasPerSm) {
    if (forced == 3 || (forced == 0 && ctas >= kDecode3CtaMinCtasPerSm * sms)) {
      return launch_decode_grid<Tile3>(&kernels::paged_decode_kernel<T, CacheT, HEAD_SIZE, 4, 3>,
                                       args, merge, stream);
    }
  }
  return launch_decode_grid<DecodeTile<T, CacheT, HEAD_SIZE, 4, 2>>(
      &kernels::paged_decode_kernel<T, CacheT, HEAD_SIZE, 4, 2>, args, merge, stream);
}

// Combines the split partials into `out`. Programmatic dependent launch: the merge grid may start
// while the attention kernel before it drains (paged_decode_kernel lets it), and waits for that
// kernel's results in griddepcontrol.wait, so its launch latency hides behind the attention.
template <typename T>
cudaError_t launch_split_kv_merge(const PagedAttentionParams& p, int num_splits,
                                  const float* o_partial, const float* lse_partial,
                                  cudaStream_t stream) {
  if (p.head_size % 4 != 0) PYORCH_INVALID("paged_attention: merge needs head_size % 4 == 0");
  const int64_t pairs = p.num_tokens * p.num_heads;
  const dim3 grid(static_cast<unsigned>((pairs + kernels::kMergeWarps - 1) / kernels::kMergeWarps));
  return kernels::launch_kernel(&kernels::merge_split_kv_kernel<T>, grid,
                                dim3(kernels::kMergeThreads), 0, stream, pdl_enabled(),
                                static_cast<T*>(p.out), o_partial, lse_partial, p.query_start_loc,
                                p.num_seqs, p.num_tokens, p.num_heads, p.head_size, num_splits,
                                p.out_token_stride, p.out_head_stride, p.lse, p.lse_head_stride);
}

static_assert(kernels::kPrefillRowsAbove == kernels::kDecodeMaxRows,
              "every sequence goes to exactly one of the prefill and decode kernels");

// One prefill kernel over the prefill-like sequences (q_len * group_size > 16) of the call: grid
// (upper bound of their tiles * num_kv_heads, splits); the CTAs of decode sequences exit after
// the search.
// A persistent kernel gets at most one CTA per SM and split, each walking the items.
template <class Tile, typename Kernel>
cudaError_t launch_prefill_kernel(Kernel* kernel, const AttnArgs& args, cudaStream_t stream,
                                  bool persistent = false) {
  if (Tile::kSmemBytes > 48 * 1024) {
    static std::atomic<uint64_t> smem_configured{0};  // one per Tile
    PYORCH_RETURN_IF_ERROR(allow_dynamic_smem(kernel, Tile::kSmemBytes, smem_configured));
  }
  int64_t ctas = kernels::prefill_grid_tiles<Tile>(args.p) * args.p.num_kv_heads;
  if (persistent) {
    ctas = std::min<int64_t>(
        ctas, std::max<int64_t>(1, num_sms_of_current_device() / std::max(1, args.num_splits)));
  }
  if (ctas > INT32_MAX) PYORCH_INVALID("paged_attention: %lld prefill CTAs", (long long)ctas);
  const dim3 grid(static_cast<unsigned>(ctas), static_cast<unsigned>(args.num_splits));
  kernel<<<grid, Tile::kThreads, Tile::kSmemBytes, stream>>>(args);
  return cudaGetLastError();
}

// The wgmma kernel where its tiles fit (whole 64-element panels, fp16/bf16 caches); the mma.sync
// kernel for the other head sizes and fp8 caches. Both cover every case of the op (any block size,
// sliding window, soft cap, group size, split KV).
template <typename T, int HEAD_SIZE, class Shape>
cudaError_t launch_prefill_sm90(const AttnArgs& args, cudaStream_t stream) {
  if (Shape::kPersistent && args.item_counters) {
    PYORCH_RETURN_IF_ERROR(
        cudaMemsetAsync(args.item_counters, 0, sizeof(int) * std::max(1, args.num_splits), stream));
  }
  return launch_prefill_kernel<kernels::PrefillSm90Tile<T, HEAD_SIZE, Shape>>(
      &kernels::paged_prefill_sm90_kernel<T, HEAD_SIZE, Shape>, args, stream, Shape::kPersistent);
}

template <typename T, typename CacheT, int HEAD_SIZE>
cudaError_t launch_paged_prefill(const AttnArgs& args, cudaStream_t stream) {
  if constexpr (std::is_same_v<T, CacheT> && HEAD_SIZE % 64 == 0) {
    return launch_prefill_sm90<T, HEAD_SIZE, typename kernels::PrefillSm90Default<HEAD_SIZE>::type>(
        args, stream);
  } else {
    using Shape = kernels::PrefillShape<HEAD_SIZE>;
    return launch_prefill_kernel<kernels::PrefillTile<T, CacheT, HEAD_SIZE, Shape>>(
        &kernels::paged_prefill_kernel<T, CacheT, HEAD_SIZE, Shape>, args, stream);
  }
}

template <typename T, typename CacheT, int HEAD_SIZE>
cudaError_t launch_paged_attention(const PagedAttentionParams& p, const Workspace& ws,
                                   cudaStream_t stream) {
  const int num_splits = ws.num_splits;
  float* o_partial = ws.o_partial;
  float* lse_partial = ws.lse_partial;
  // Decode sequences go to paged_decode_kernel, launched last so that the merge (a mixed batch's
  // only: a pure decode batch merges inside the decode launch) overlaps it.
  const AttnArgs args{p,           static_cast<int>(p.num_heads / p.num_kv_heads),
                      num_splits,  o_partial,
                      lse_partial, ws.item_counters};
  // Prefill sequences go to the prefill kernels (launch_paged_prefill).
  if (!all_decode_rows(p)) {
    PYORCH_RETURN_IF_ERROR((launch_paged_prefill<T, CacheT, HEAD_SIZE>(args, stream)));
  }
  PYORCH_RETURN_IF_ERROR((launch_paged_decode<T, CacheT, HEAD_SIZE>(args, stream)));
  if (num_splits > 1 && !decode_merges_in_kernel(p, num_splits)) {
    PYORCH_RETURN_IF_ERROR(launch_split_kv_merge<T>(p, num_splits, o_partial, lse_partial, stream));
  }
  return cudaGetLastError();
}

template <typename T, typename CacheT>
cudaError_t dispatch_head_size(const PagedAttentionParams& p, const Workspace& ws,
                               cudaStream_t stream) {
  cudaError_t status = cudaSuccess;
  const bool known = with_head_size(p.head_size, [&](auto head) {
    status = launch_paged_attention<T, CacheT, decltype(head)::value>(p, ws, stream);
  });
  if (!known) PYORCH_INVALID("Unsupported head size: %lld", static_cast<long long>(p.head_size));
  return status;
}

}  // namespace

bool paged_attention_supports_head_size(int64_t head_size) {
  return supported_head_size(head_size);
}

size_t paged_attention_workspace_size(const PagedAttentionParams& p) {
  const int64_t num_splits = choose_num_splits(p);
  if (!all_decode_rows(p)) {
    return item_counters_offset(p, num_splits) + sizeof(int) * static_cast<size_t>(num_splits);
  }
  return split_workspace_bytes(p, num_splits);
}

cudaError_t paged_attention(const PagedAttentionParams& p, void* workspace, size_t workspace_bytes,
                            cudaStream_t stream) {
  if (p.num_kv_heads <= 0 || p.num_heads % p.num_kv_heads != 0) {
    PYORCH_INVALID("paged_attention: num_heads %lld is not a multiple of num_kv_heads %lld",
                   static_cast<long long>(p.num_heads), static_cast<long long>(p.num_kv_heads));
  }
  if (!supported_head_size(p.head_size)) {
    PYORCH_INVALID("Unsupported head size: %lld", static_cast<long long>(p.head_size));
  }
  if (p.block_size <= 0) PYORCH_INVALID("paged_attention: block_size must be positive");
  if (p.num_tokens == 0 || p.num_seqs == 0) return cudaSuccess;
  const int64_t num_splits = choose_num_splits(p);
  const size_t need = paged_attention_workspace_size(p);
  if (workspace_bytes < need || (need > 0 && !workspace)) {
    PYORCH_INVALID("paged_attention: workspace of %zu bytes is too small", workspace_bytes);
  }
  float* o_partial = num_splits > 1 ? static_cast<float*>(workspace) : nullptr;
  float* lse_partial = num_splits > 1 ? o_partial + partial_output_elems(p, num_splits) : nullptr;
  int* item_counters = all_decode_rows(p)
                           ? nullptr
                           : reinterpret_cast<int*>(static_cast<char*>(workspace) +
                                                    item_counters_offset(p, num_splits));
  const Workspace ws{static_cast<int>(num_splits), o_partial, lse_partial, item_counters};
  return PYORCH_DISPATCH_HALF_TYPES(p.dtype, T, [&] {
    if (p.kv_cache_dtype == KVCacheDType::kFp8E4M3) {
      return dispatch_head_size<T, uint8_t>(p, ws, stream);
    }
    return dispatch_head_size<T, T>(p, ws, stream);
  });
}

cudaError_t merge_attn_states(void* output, float* output_lse, const void* prefix_output,
                              const float* prefix_lse, const void* suffix_output,
                              const float* suffix_lse, DType dtype, int64_t num_tokens,
                              int64_t num_heads, int64_t head_size, int64_t out_token_stride,
                              int64_t out_head_stride, int64_t prefix_token_stride,
                              int64_t prefix_head_stride, int64_t suffix_token_stride,
                              int64_t suffix_head_stride, int64_t lse_head_stride,
                              cudaStream_t stream) {
  const int64_t pairs = num_tokens * num_heads;
  if (pairs == 0 || head_size == 0) return cudaSuccess;
  const unsigned blocks =
      static_cast<unsigned>((pairs + kernels::kMergeWarps - 1) / kernels::kMergeWarps);
  return PYORCH_DISPATCH_FLOAT_TYPES(dtype, T, [&] {
    kernels::merge_attn_states_kernel<T><<<blocks, kernels::kMergeThreads, 0, stream>>>(
        static_cast<T*>(output), output_lse, static_cast<const T*>(prefix_output), prefix_lse,
        static_cast<const T*>(suffix_output), suffix_lse, num_tokens, num_heads, head_size,
        out_token_stride, out_head_stride, prefix_token_stride, prefix_head_stride,
        suffix_token_stride, suffix_head_stride, lse_head_stride);
    return cudaGetLastError();
  });
}

cudaError_t merge_prefix_into_rows(void* out, const float* suffix_lse,
                                   int64_t suffix_lse_head_stride, const void* prefix_output,
                                   const float* prefix_lse, int64_t prefix_lse_head_stride,
                                   const int64_t* rows, int64_t num_rows, int64_t num_tokens,
                                   DType dtype, int64_t num_heads, int64_t head_size,
                                   int64_t out_token_stride, int64_t out_head_stride,
                                   int64_t prefix_token_stride, int64_t prefix_head_stride,
                                   cudaStream_t stream) {
  const int64_t pairs = num_rows * num_heads;
  if (pairs == 0 || head_size == 0) return cudaSuccess;
  const unsigned blocks =
      static_cast<unsigned>((pairs + kernels::kMergeWarps - 1) / kernels::kMergeWarps);
  return PYORCH_DISPATCH_FLOAT_TYPES(dtype, T, [&] {
    kernels::merge_prefix_into_rows_kernel<T><<<blocks, kernels::kMergeThreads, 0, stream>>>(
        static_cast<T*>(out), suffix_lse, static_cast<const T*>(prefix_output), prefix_lse, rows,
        num_rows, num_tokens, num_heads, head_size, out_token_stride, out_head_stride,
        prefix_token_stride, prefix_head_stride, suffix_lse_head_stride, prefix_lse_head_stride);
    return cudaGetLastError();
  });
}

void set_decode_fp8_l2_prefetch(bool enabled) {
  decode_fp8_l2_prefetch.store(enabled, std::memory_order_relaxed);
}

bool set_decode_ctas_per_sm(int ctas_per_sm) {
  if (ctas_per_sm < 0 || ctas_per_sm > 3) return false;
  decode_ctas_per_sm.store(ctas_per_sm, std::memory_order_relaxed);
  return true;
}

}  // namespace pyorch
