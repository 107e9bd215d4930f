// The decode MoE kernel pair: the whole expert computation of a few tokens in two launches, each a
// stream of the active experts' weights (vLLM's fused_moe for small M, at the weight-read floor).
//
//   gate_up: act[f, :] = silu(x[f / top_k] @ gate_e^T) * (x[f / top_k] @ up_e^T)  per pair f
//   down:    out[t, :] = sum over the pairs f of token t of w[f] * (act[f] @ down_e^T)
//
// At a few tokens per expert every weight element is used by at most a few mma columns: the
// kernels are bandwidth-bound, and their whole job is to read each active expert's weights once
// with many bytes in flight on every SM. Both reuse the skinny GEMM's slice (cuda/gemm/
// skinny_gemm.cuh): 16 weight rows x 128 k as the mma's A operand, up to 8 tokens per n8 tile as
// its B operand, every load a 16-byte ld.global.nc, weights kept out of L1.
//
// Routing. moe_align_block_size (block_size = 8 * M_TILES) has grouped the pairs by expert into
// blocks of up to 8 * M_TILES pairs of one expert each; a block's pairs are the B operand's
// tokens (pad entries are clamped to the block's first pair and their results dropped). The grid
// is sized from shapes only and *num_tokens_post_pad is read on the device: CUDA-graph safe, no
// host sync. Blocks of expert -1 (another rank's) contribute nothing.
//
// gate_up: a CTA owns one block and 8 gate rows + the same 8 up rows of its expert (mma rows g,
// g + 8), all of K = hidden split over its warps; grid (blocks, ceil(I / 8)). SiLU-and-mul is its
// epilogue, as in the skinny kernel's kSiluMul: the [pairs, 2I] product never reaches memory.
//
// down: a CTA owns 16 output columns (rows of every expert's [H, I] down weight) for ALL tokens,
// so the top-k sum needs no atomics and no moe_sum: grid ceil(H / 16). Its work items are the
// (block, 128-k slice) pairs of the active blocks; warp w takes a contiguous run of them (the
// K = I split is what keeps all warps busy when few experts are active, e.g. Mixtral at M = 1:
// 2 blocks x 112 slices). When a warp's run leaves a block it multiplies the block's partial sums
// by the routing weights and adds them, pair by pair in a fixed order, into its own per-token rows
// in shared memory; at the end the warps' rows are added in warp order. The result is
// deterministic (a fixed order for a given routing), rounded to T once. Under PDL the down kernel
// reads the routing and asks L2 for its warps' first weight slices before waiting on gate_up.
#pragma once

#include <cstdint>

#include "common/launch.cuh"
#include "gemm/skinny_gemm.cuh"  // SkinnySlice, the mma and the streaming loads

namespace pyorch::kernels {

constexpr int kMoeDecodeGateUpWarps = 4;
constexpr int kMoeDecodeDownWarps = 16;

// Hopper's opt-in shared memory per CTA: the down kernel's per-token rows must fit it.
constexpr size_t kMoeDecodeMaxDownSmem = 227 * 1024;

// Resident CTAs per SM a kernel's register cap is set for: the skinny GEMM's (128 registers a
// thread) unless a launch shape asks for more (MoeDecodeConfig), and at least one.
template <int NUM_WARPS, int CTAS_PER_SM>
constexpr int moe_decode_min_blocks() {
  constexpr int skinny = skinny_min_blocks<NUM_WARPS>();
  return CTAS_PER_SM > skinny ? CTAS_PER_SM : (skinny > 0 ? skinny : 1);
}
// Weight slices per warp of the down kernel asked of L2 before it waits on gate_up's output (the
// default; MoeDecodeConfig::down_prefetch_slices).
constexpr int kMoeDecodeDownPrefetchSlices = 2;

template <typename T>
struct MoeDecodeParams {
  T* out;                              // [num_tokens, hidden]
  T* act;                              // [num_flat, inter]: the gate_up kernel's output
  const T* hidden_states;              // [num_tokens, hidden], row stride hidden_stride
  const T* w13;                        // [E, 2 * inter, hidden]: [gate; up]
  const T* w2;                         // [E, hidden, inter]
  const float* topk_weights;           // [num_flat]
  const int32_t* sorted_token_ids;     // [num_sorted]
  const int32_t* expert_ids;           // [num_blocks]
  const int32_t* num_tokens_post_pad;  // [1]
  int down_prefetch_slices;            // weight slices per down warp asked of L2 before its wait
  int64_t num_tokens, num_flat, num_sorted, num_blocks, num_experts, top_k, hidden, inter,
      hidden_stride;
};

// The flat pair id of entry j of block b (or -1 for padding and entries past the end).
template <typename T>
__device__ __forceinline__ int64_t moe_decode_pair(const MoeDecodeParams<T>& p, int64_t entry) {
  if (entry >= p.num_sorted) return -1;
  const int64_t f = p.sorted_token_ids[entry];
  return f >= 0 && f < p.num_flat ? f : -1;
}

template <typename T, int M_TILES, int NUM_WARPS, int CTAS_PER_SM = 0>
__global__ void __launch_bounds__(NUM_WARPS* kWarpSize,
                                  moe_decode_min_blocks<NUM_WARPS, CTAS_PER_SM>())
    moe_decode_gate_up_kernel(const MoeDecodeParams<T> p) {
  constexpr int kPairs = M_TILES * kSkinnyTileTokens;  // the block size of the routing
  __shared__ float partial[NUM_WARPS][kPairs][kSkinnyRows];
  pdl_wait();  // the routing is the previous kernels' output
  pdl_launch_dependents();
  const int64_t b = blockIdx.x;
  const int64_t entry0 = b * kPairs;
  const int32_t expert = p.expert_ids[b];
  if (entry0 >= min(static_cast<int64_t>(*p.num_tokens_post_pad), p.num_sorted) || expert < 0 ||
      expert >= p.num_experts) {
    return;
  }
  const int warp = threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  const int g = lane / 4;
  const int t = lane % 4;
  const int64_t K = p.hidden;
  const int64_t row0 = static_cast<int64_t>(blockIdx.y) * (kSkinnyRows / 2);
  const T* w = p.w13 + static_cast<int64_t>(expert) * 2 * p.inter * K;
  const int64_t r = min(row0 + g, p.inter - 1);
  const T* w_lo_row = w + r * K;                     // gate row
  const T* w_hi_row = w + (p.inter + r) * K;         // the matching up row
  const int64_t first = moe_decode_pair(p, entry0);  // a block's first entry is a real pair
  const T* x_rows[M_TILES];
#pragma unroll
  for (int mt = 0; mt < M_TILES; ++mt) {
    int64_t f = moe_decode_pair(p, entry0 + mt * kSkinnyTileTokens + g);
    if (f < 0) f = first;
    x_rows[mt] = p.hidden_states + (f / p.top_k) * p.hidden_stride;
  }
  const int num_slices = static_cast<int>((K + kSkinnySliceK - 1) / kSkinnySliceK);
  const int num_full_slices = static_cast<int>(K / kSkinnySliceK);
  const int64_t lane_k = kSkinnyChunk * t;
  float acc[M_TILES][4] = {};
  int slice = warp;
  for (; slice < num_full_slices; slice += NUM_WARPS) {
    SkinnySlice<M_TILES, T> s;
    s.template load<false, true>(w_lo_row, w_hi_row, x_rows,
                                 static_cast<int64_t>(slice) * kSkinnySliceK + lane_k, K);
    s.multiply(acc);
  }
  if (slice < num_slices) {
    SkinnySlice<M_TILES, T> s;
    s.template load<true, true>(w_lo_row, w_hi_row, x_rows,
                                static_cast<int64_t>(slice) * kSkinnySliceK + lane_k, K);
    s.multiply(acc);
  }
#pragma unroll
  for (int mt = 0; mt < M_TILES; ++mt) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int pair = mt * kSkinnyTileTokens + 2 * t + j;
      partial[warp][pair][g] = acc[mt][j];
      partial[warp][pair][g + 8] = acc[mt][2 + j];
    }
  }
  __syncthreads();
  constexpr int kCols = kSkinnyRows / 2;
  for (int idx = threadIdx.x; idx < kPairs * kCols; idx += NUM_WARPS * kWarpSize) {
    const int pair = idx / kCols;
    const int c = idx % kCols;
    const int64_t col = row0 + c;
    const int64_t f = moe_decode_pair(p, entry0 + pair);
    if (col >= p.inter || f < 0) continue;
    float gate = 0.f, up = 0.f;
#pragma unroll
    for (int ww = 0; ww < NUM_WARPS; ++ww) {
      gate += partial[ww][pair][c];
      up += partial[ww][pair][c + 8];
    }
    p.act[f * p.inter + col] = from_float<T>(
        act_fn<Activation::kSilu>(to_float(from_float<T>(gate))) * to_float(from_float<T>(up)));
  }
}

// Shared memory of the down kernel: each warp's per-token output rows, then each warp's staging
// tile of one block's partial sums.
template <int M_TILES, int NUM_WARPS>
__host__ __device__ constexpr size_t moe_decode_down_smem(int64_t num_tokens) {
  return sizeof(float) * NUM_WARPS * kSkinnyRows *
         (static_cast<size_t>(num_tokens) + M_TILES * kSkinnyTileTokens);
}

template <typename T, int M_TILES, int NUM_WARPS>
__global__ void __launch_bounds__(NUM_WARPS* kWarpSize, moe_decode_min_blocks<NUM_WARPS, 0>())
    moe_decode_down_kernel(const MoeDecodeParams<T> p) {
  constexpr int kPairs = M_TILES * kSkinnyTileTokens;
  extern __shared__ __align__(16) float moe_down_smem[];
  const int warp = threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  const int g = lane / 4;
  const int t = lane % 4;
  const int64_t T_ = p.num_tokens;
  float* rows = moe_down_smem + warp * T_ * kSkinnyRows;  // [num_tokens][16]: this warp's sums
  float* stage =
      moe_down_smem + NUM_WARPS * T_ * kSkinnyRows + warp * kPairs * kSkinnyRows;  // [kPairs][16]
  for (int64_t i = lane; i < T_ * kSkinnyRows; i += kWarpSize) rows[i] = 0.f;

  // Everything here up to pdl_wait reads only the routing, which was complete before the gate_up
  // kernel let this one launch (each of its CTAs waited on the routing first): the work split,
  // and this warp's first weight slices asked of L2, overlapping gate_up's tail. (gate_up is
  // launched whenever there is a pair; without one there are no items to read.)
  const int64_t K = p.inter;
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * kSkinnyRows;
  const int64_t last_row = p.hidden - 1;
  const int64_t num_blocks =
      min((min(static_cast<int64_t>(*p.num_tokens_post_pad), p.num_sorted) + kPairs - 1) / kPairs,
          p.num_blocks);
  const int64_t num_slices = (K + kSkinnySliceK - 1) / kSkinnySliceK;
  const int64_t num_full_slices = K / kSkinnySliceK;
  const int64_t num_items = num_blocks * num_slices;
  const int64_t per_warp = (num_items + NUM_WARPS - 1) / NUM_WARPS;
  const int64_t item_end = min(num_items, (warp + 1) * per_warp);
  const int64_t lane_k = kSkinnyChunk * t;
  if (warp * per_warp < item_end) {
    const int64_t b = warp * per_warp / num_slices;
    const int32_t expert = p.expert_ids[b];
    if (expert >= 0 && expert < p.num_experts) {
      const T* w = p.w2 + static_cast<int64_t>(expert) * p.hidden * K;
      const int64_t run_end = min(item_end, (b + 1) * num_slices);
      const int64_t last = min(run_end, warp * per_warp + p.down_prefetch_slices);
      for (int64_t item = warp * per_warp; item < last; ++item) {
        // Two 128-byte lines of each of the rows g and g + 8 per slice: lane t asks for bytes
        // 64t.. of the slice's 256.
        const int64_t k = (item - b * num_slices) * kSkinnySliceK + (64 / sizeof(T)) * t;
        if (k < K) {
          prefetch_l2(w + min(row0 + g, last_row) * K + k);
          prefetch_l2(w + min(row0 + g + 8, last_row) * K + k);
        }
      }
    }
  }
  pdl_wait();  // act is the gate_up kernel's output
  pdl_launch_dependents();

  for (int64_t item = warp * per_warp; item < item_end;) {
    const int64_t b = item / num_slices;
    const int64_t run_end = min(item_end, (b + 1) * num_slices);  // this block's part of the run
    const int32_t expert = p.expert_ids[b];
    const int64_t entry0 = b * kPairs;
    if (expert < 0 || expert >= p.num_experts) {  // another rank's expert: contributes nothing
      item = run_end;
      continue;
    }
    const T* w = p.w2 + static_cast<int64_t>(expert) * p.hidden * K;
    const T* w_lo_row = w + min(row0 + g, last_row) * K;
    const T* w_hi_row = w + min(row0 + g + 8, last_row) * K;
    const int64_t first = moe_decode_pair(p, entry0);
    const T* x_rows[M_TILES];
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt) {
      int64_t f = moe_decode_pair(p, entry0 + mt * kSkinnyTileTokens + g);
      if (f < 0) f = first;
      x_rows[mt] = p.act + f * K;
    }
    // Lane j < kPairs fetches pair j's id and routing weight now, beside the weight stream, for
    // the staging below (fetched there pair by pair, they were 2 * kPairs dependent L2 trips).
    int64_t lane_pair = -1;
    float lane_weight = 0.f;
    if (lane < kPairs) {
      lane_pair = moe_decode_pair(p, entry0 + lane);
      if (lane_pair >= 0) lane_weight = p.topk_weights[lane_pair];
    }
    float acc[M_TILES][4] = {};
    int64_t slice = item - b * num_slices;
    const int64_t slice_end = run_end - b * num_slices;
    for (; slice < min(slice_end, num_full_slices); ++slice) {
      SkinnySlice<M_TILES, T> s;
      s.template load<false, true>(w_lo_row, w_hi_row, x_rows, slice * kSkinnySliceK + lane_k, K);
      s.multiply(acc);
    }
    if (slice < slice_end) {  // the K tail
      SkinnySlice<M_TILES, T> s;
      s.template load<true, true>(w_lo_row, w_hi_row, x_rows, slice * kSkinnySliceK + lane_k, K);
      s.multiply(acc);
    }
    // acc[mt]: weight rows (g, g + 8) x pairs (mt * 8 + 2t, + 1). Stage, then add pair by pair.
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int pair = mt * kSkinnyTileTokens + 2 * t + j;
        stage[pair * kSkinnyRows + g] = acc[mt][j];
        stage[pair * kSkinnyRows + g + 8] = acc[mt][2 + j];
      }
    }
    __syncwarp();
    for (int pair = 0; pair < kPairs; ++pair) {  // pair order: a fixed order of the sums
      const int64_t f = __shfl_sync(0xffffffffu, lane_pair, pair);
      const float w = __shfl_sync(0xffffffffu, lane_weight, pair);
      if (f >= 0 && lane < kSkinnyRows) {
        rows[(f / p.top_k) * kSkinnyRows + lane] += w * stage[pair * kSkinnyRows + lane];
      }
    }
    __syncwarp();
    item = run_end;
  }
  __syncthreads();
  for (int64_t idx = threadIdx.x; idx < T_ * kSkinnyRows; idx += NUM_WARPS * kWarpSize) {
    const int64_t token = idx / kSkinnyRows;
    const int r = static_cast<int>(idx % kSkinnyRows);
    if (row0 + r > last_row) continue;
    float sum = 0.f;
#pragma unroll
    for (int ww = 0; ww < NUM_WARPS; ++ww)
      sum += moe_down_smem[(ww * T_ + token) * kSkinnyRows + r];
    p.out[token * p.hidden + row0 + r] = from_float<T>(sum);
  }
}

template <typename T, int M_TILES, int CTAS_PER_SM>
cudaError_t launch_moe_decode_gate_up(const MoeDecodeParams<T>& p, int64_t grid_n, bool pdl,
                                      cudaStream_t stream) {
  return launch_kernel(&moe_decode_gate_up_kernel<T, M_TILES, kMoeDecodeGateUpWarps, CTAS_PER_SM>,
                       dim3(static_cast<unsigned>(p.num_blocks), static_cast<unsigned>(grid_n)),
                       dim3(kMoeDecodeGateUpWarps * kWarpSize), 0, stream, pdl, p);
}

template <typename T, int M_TILES, int NUM_WARPS>
cudaError_t launch_moe_decode_down(const MoeDecodeParams<T>& p, bool pdl, cudaStream_t stream) {
  // The down kernel writes every output (zeros for a token with no local expert).
  auto down = &moe_decode_down_kernel<T, M_TILES, NUM_WARPS>;
  const size_t smem = moe_decode_down_smem<M_TILES, NUM_WARPS>(p.num_tokens);
  PYORCH_RETURN_IF_ERROR(cudaFuncSetAttribute(down, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                              static_cast<int>(smem)));
  return launch_kernel(down,
                       dim3(static_cast<unsigned>((p.hidden + kSkinnyRows - 1) / kSkinnyRows)),
                       dim3(NUM_WARPS * kWarpSize), smem, stream, pdl, p);
}

// gate_up_ctas_per_sm: 0 (the skinny GEMM's register cap: 4 CTAs of 4 warps), 6 or 8;
// down_warps: 16 or 32. Other values are the caller's error (fused_moe_decode checks them).
template <typename T, int M_TILES>
cudaError_t launch_moe_decode(const MoeDecodeParams<T>& p, int gate_up_ctas_per_sm, int down_warps,
                              bool pdl, cudaStream_t stream) {
  const int64_t grid_n = (p.inter + kSkinnyRows / 2 - 1) / (kSkinnyRows / 2);
  if (p.num_blocks > 0x7fffffff || grid_n > 65535) return cudaErrorInvalidValue;
  if (p.num_blocks > 0 && p.num_flat > 0) {
    cudaError_t status;
    switch (gate_up_ctas_per_sm) {
      case 6: status = launch_moe_decode_gate_up<T, M_TILES, 6>(p, grid_n, pdl, stream); break;
      case 8: status = launch_moe_decode_gate_up<T, M_TILES, 8>(p, grid_n, pdl, stream); break;
      default: status = launch_moe_decode_gate_up<T, M_TILES, 0>(p, grid_n, pdl, stream);
    }
    PYORCH_RETURN_IF_ERROR(status);
  }
  return down_warps == 32 ? launch_moe_decode_down<T, M_TILES, 32>(p, pdl, stream)
                          : launch_moe_decode_down<T, M_TILES, kMoeDecodeDownWarps>(p, pdl, stream);
}

}  // namespace pyorch::kernels
