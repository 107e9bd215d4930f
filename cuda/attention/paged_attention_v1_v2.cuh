// Decode attention over vLLM's split KV layout (paged_attention_v1 / paged_attention_v2).
//
// One thread block per (head, sequence[, partition]), kNumThreads threads. The context is walked in
// chunks of kChunkSize tokens (a v2 partition is exactly one chunk; v1 walks every chunk of the
// sequence with an online softmax, so shared memory never depends on the context length):
//   1. q.k: warps take the chunk's KV blocks round-robin. A "thread group" of kGroup lanes owns one
//      token; each lane reads 16-byte chunks of x elements from the x-interleaved key layout, so a
//      warp's load covers whole 16-byte columns of consecutive tokens. Scores go to shared memory,
//      already in log2 units (q is pre-multiplied by scale * log2(e)).
//   2. softmax: block max, exp2, block sum; the running max/sum and the V accumulators are rescaled
//      when a later chunk raises the max.
//   3. p.V: warps take blocks round-robin again. In value_cache a block's row for one head dim
//   holds
//      block_size consecutive tokens; kLanesPerRow lanes split that row into kVVec-token vectors
//      and each lane accumulates kRowsPerThread head dims in fp32.
// The per-warp partial outputs are summed through shared memory; v2 writes the partition's
// normalized output, max and exp-sum to the caller's scratch and a reduce kernel combines them.
#pragma once

#include <algorithm>
#include <cfloat>
#include <cstdint>
#include <type_traits>

#include "common/dtype.cuh"
#include "common/reduce.cuh"
#include "common/vec.cuh"
#include "pyorch/paged_attention_v1_v2.h"

// NOTE(pav2): a nested namespace keeps these helpers' names apart from the NHD attention kernels,
// which are linked into the same library (same-named inline templates would collide silently).
namespace pyorch::kernels::paged_v1_v2 {

constexpr int kNumThreads = 128;
constexpr int kNumWarps = kNumThreads / kWarpSize;
constexpr int kChunkSize = kPagedAttentionV2PartitionSize;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr unsigned kFullMask = 0xffffffffu;

__host__ __device__ constexpr int ceil_div(int a, int b) { return (a + b - 1) / b; }
__host__ __device__ constexpr int cmax(int a, int b) { return a > b ? a : b; }
__host__ __device__ constexpr int cmin(int a, int b) { return a < b ? a : b; }

// Thread mapping for one instantiation; everything a kernel's loops and buffers need.
template <typename CacheT, int HEAD_SIZE, int BLOCK_SIZE>
struct PagedConfig {
  static constexpr int kX = 16 / static_cast<int>(sizeof(CacheT));  // elements per 16 bytes
  static constexpr int kNumChunks = HEAD_SIZE / kX;                 // 16-byte chunks per key
  // Lanes per token in q.k: enough that a lane holds at most 64 q values in registers, and that a
  // warp pass never spans two KV blocks.
  static constexpr int kGroup = cmax(kWarpSize / BLOCK_SIZE, HEAD_SIZE > 128 ? 4 : 2);
  static constexpr int kTokensPerPass = kWarpSize / kGroup;
  static constexpr int kPassesPerBlock = BLOCK_SIZE / kTokensPerPass;
  static constexpr int kChunksPerThread = ceil_div(kNumChunks, kGroup);
  // p.V: a lane reads kVVec consecutive tokens of one value row (at most 16 bytes).
  static constexpr int kVVec = cmin(kX, BLOCK_SIZE);
  static constexpr int kLanesPerRow = BLOCK_SIZE / kVVec;
  static constexpr int kRowsPerPass = kWarpSize / kLanesPerRow;
  static constexpr int kRowsPerThread = ceil_div(HEAD_SIZE, kRowsPerPass);
  // Scores of one chunk, later reused for the cross-warp sum of the outputs.
  static constexpr int kScoreFloats = cmax(kChunkSize, kNumWarps* HEAD_SIZE);

  static_assert(HEAD_SIZE % kX == 0, "the key layout needs head_size % x == 0");
  static_assert(BLOCK_SIZE >= 8 && BLOCK_SIZE <= kWarpSize && (BLOCK_SIZE & (BLOCK_SIZE - 1)) == 0,
                "block_size must be 8, 16 or 32");
  static_assert(kChunkSize % BLOCK_SIZE == 0, "chunks must start on block boundaries");
  static_assert(kTokensPerPass <= BLOCK_SIZE && BLOCK_SIZE % kTokensPerPass == 0, "q.k mapping");
  static_assert(kChunksPerThread * kX <= 64, "q registers per lane");
  static_assert(kVVec % 2 == 0 && kVVec % 4 == 0, "score vectors are read as float4");
  static_assert((HEAD_SIZE + kScoreFloats) * sizeof(float) <= 48 * 1024, "static shared memory");
};

// ---- element conversion -------------------------------------------------------------------------

// N cache elements to fp32 (fp8 bytes are raw e4m3 values; the scale is applied by the caller).
template <typename CacheT, int N>
__device__ __forceinline__ void vec_to_float(const Vec<CacheT, N>& v, float* out) {
  if constexpr (std::is_same_v<CacheT, uint8_t>) {
    // Two bytes per conversion instruction; the low byte is the first element.
    const auto* pairs = reinterpret_cast<const __nv_fp8x2_storage_t*>(v.data);
#pragma unroll
    for (int i = 0; i < N / 2; ++i) {
      const __half2 h = __half2(__nv_cvt_fp8x2_to_halfraw2(pairs[i], __NV_E4M3));
      const float2 f = __half22float2(h);
      out[2 * i] = f.x;
      out[2 * i + 1] = f.y;
    }
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) out[i] = to_float(v.data[i]);
  }
}

// ---- block reductions over kNumThreads threads (all threads get the result) --------------------

template <bool IS_MAX>
__device__ __forceinline__ float block_allreduce(float x, float* smem /* [kNumWarps] */) {
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  x = IS_MAX ? warp_reduce_max(x) : warp_reduce_sum(x);
  if (lane == 0) smem[warp] = x;
  __syncthreads();
  x = lane < kNumWarps ? smem[lane] : (IS_MAX ? -FLT_MAX : 0.f);
  x = IS_MAX ? warp_reduce_max(x) : warp_reduce_sum(x);
  __syncthreads();  // smem is reused by the next reduction
  return x;
}

// ---- phase 1: scores of one chunk ---------------------------------------------------------------

// Writes scores (log2 units, ALiBi included) of tokens [first_block * BLOCK_SIZE, end_block *
// BLOCK_SIZE) to scores[token - chunk_begin]; tokens past chunk_end get 0 and no say in the max.
// Returns this thread's max over the scores it wrote.
template <typename CacheT, int HEAD_SIZE, int BLOCK_SIZE>
__device__ __forceinline__ float qk_chunk(
    const float (&q)[PagedConfig<CacheT, HEAD_SIZE, BLOCK_SIZE>::kChunksPerThread]
                    [PagedConfig<CacheT, HEAD_SIZE, BLOCK_SIZE>::kX],
    const CacheT* __restrict__ key_head,      // key_cache + kv_head * k_head_stride
    const int32_t* __restrict__ block_table,  // [max_blocks_per_seq]
    int64_t k_block_stride, int first_block, int end_block, int chunk_begin, int chunk_end,
    int seq_len, float alibi_log2, float* scores /* [kScoreFloats] */) {
  using Cfg = PagedConfig<CacheT, HEAD_SIZE, BLOCK_SIZE>;
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const int tok_lane = lane % Cfg::kTokensPerPass;    // token within a pass
  const int group_lane = lane / Cfg::kTokensPerPass;  // which 16-byte chunks of the key
  float thread_max = -FLT_MAX;
  for (int blk = first_block + warp; blk < end_block; blk += kNumWarps) {
    const int64_t phys_block = block_table[blk];
    const CacheT* kb = key_head + phys_block * k_block_stride;  // [head_size / x, block_size, x]
#pragma unroll
    for (int pass = 0; pass < Cfg::kPassesPerBlock; ++pass) {
      const int t = pass * Cfg::kTokensPerPass + tok_lane;
      float dot = 0.f;
#pragma unroll
      for (int i = 0; i < Cfg::kChunksPerThread; ++i) {
        const int c = group_lane + i * Cfg::kGroup;
        if (Cfg::kNumChunks % Cfg::kGroup == 0 || c < Cfg::kNumChunks) {
          Vec<CacheT, Cfg::kX> kv;
          kv.load(kb + (c * BLOCK_SIZE + t) * Cfg::kX);
          float kf[Cfg::kX];
          vec_to_float(kv, kf);
#pragma unroll
          for (int j = 0; j < Cfg::kX; ++j) dot = fmaf(q[i][j], kf[j], dot);
        }
      }
      // The kGroup lanes of a token differ in the bits above log2(kTokensPerPass).
#pragma unroll
      for (int offset = Cfg::kTokensPerPass; offset < kWarpSize; offset *= 2) {
        dot += __shfl_xor_sync(kFullMask, dot, offset);
      }
      const int token = blk * BLOCK_SIZE + t;
      if (group_lane == 0) {
        float s = 0.f;
        if (token < chunk_end) {
          s = dot + alibi_log2 * static_cast<float>(token - seq_len + 1);
          thread_max = fmaxf(thread_max, s);
        }
        scores[token - chunk_begin] = s;
      }
    }
  }
  return thread_max;
}

// ---- phase 2: online softmax over one chunk
// ------------------------------------------------------

// scores[0, len) := exp2(score - new_max), new_max = max(run_max, chunk max), and run_sum becomes
// the sum over all chunks so far at the new max. Returns alpha = exp2(old max - new max), the
// factor by which the caller rescales what it accumulated for earlier chunks. Ends with a barrier,
// so the exponentials are visible to every thread.
__device__ __forceinline__ float softmax_chunk(float* scores, int len, float thread_max,
                                               float& run_max, float& run_sum,
                                               float* red_smem /* [kNumWarps] */) {
  const float new_max = fmaxf(run_max, block_allreduce<true>(thread_max, red_smem));
  float thread_sum = 0.f;
  for (int i = threadIdx.x; i < len; i += kNumThreads) {
    const float e = exp2f(scores[i] - new_max);
    scores[i] = e;
    thread_sum += e;
  }
  const float alpha = exp2f(run_max - new_max);
  run_sum = run_sum * alpha + block_allreduce<false>(thread_sum, red_smem);
  run_max = new_max;
  return alpha;
}

// ---- phase 3: probabilities times values --------------------------------------------------------

// acc[r] += sum over the chunk's tokens of p[token] * V[token][row r of this lane] (raw cache
// values; v_scale is applied at the end). Tokens past chunk_end are masked: their cache slots may
// hold anything, NaN included.
template <typename CacheT, int HEAD_SIZE, int BLOCK_SIZE>
__device__ __forceinline__ void pv_chunk(
    float (&acc)[PagedConfig<CacheT, HEAD_SIZE, BLOCK_SIZE>::kRowsPerThread],
    const CacheT* __restrict__ value_head,    // value_cache + kv_head * v_head_stride
    const int32_t* __restrict__ block_table,  // [max_blocks_per_seq]
    int64_t v_block_stride, int first_block, int end_block, int chunk_begin, int chunk_end,
    const float* probs /* [kScoreFloats] */) {
  using Cfg = PagedConfig<CacheT, HEAD_SIZE, BLOCK_SIZE>;
  constexpr int kVVec = Cfg::kVVec;
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const int vec_lane = lane % Cfg::kLanesPerRow;  // which kVVec tokens of the row
  const int row_lane = lane / Cfg::kLanesPerRow;  // first head dim of this lane
  const int t0 = vec_lane * kVVec;
  for (int blk = first_block + warp; blk < end_block; blk += kNumWarps) {
    const int64_t phys_block = block_table[blk];
    const CacheT* vb = value_head + phys_block * v_block_stride;  // [head_size, block_size]
    const int tok0 = blk * BLOCK_SIZE + t0;
    float p[kVVec];
#pragma unroll
    for (int j = 0; j < kVVec; j += 4) {
      const float4 p4 = *reinterpret_cast<const float4*>(probs + (tok0 - chunk_begin) + j);
      p[j] = p4.x;
      p[j + 1] = p4.y;
      p[j + 2] = p4.z;
      p[j + 3] = p4.w;
    }
    bool valid[kVVec];
#pragma unroll
    for (int j = 0; j < kVVec; ++j) valid[j] = tok0 + j < chunk_end;
#pragma unroll
    for (int r = 0; r < Cfg::kRowsPerThread; ++r) {
      const int row = row_lane + r * Cfg::kRowsPerPass;
      if (HEAD_SIZE % Cfg::kRowsPerPass == 0 || row < HEAD_SIZE) {
        Vec<CacheT, kVVec> vv;
        vv.load(vb + row * BLOCK_SIZE + t0);
        float vf[kVVec];
        vec_to_float(vv, vf);
        float sum = 0.f;
#pragma unroll
        for (int j = 0; j < kVVec; ++j) sum = fmaf(p[j], valid[j] ? vf[j] : 0.f, sum);
        acc[r] += sum;
      }
    }
  }
}

// ---- prologue and epilogue ---------------------------------------------------------------------

// q[i][j] = q_row[c * kX + j] * q_scale for this lane's key chunks c = group_lane + i * kGroup
// (0 past the head), staged through shared memory so that the global reads coalesce.
template <typename T, typename CacheT, int HEAD_SIZE, int BLOCK_SIZE>
__device__ __forceinline__ void load_q(
    float (&q)[PagedConfig<CacheT, HEAD_SIZE, BLOCK_SIZE>::kChunksPerThread]
              [PagedConfig<CacheT, HEAD_SIZE, BLOCK_SIZE>::kX],
    const T* __restrict__ q_row,  // [head_size]
    float q_scale, float* q_smem /* [HEAD_SIZE] */) {
  using Cfg = PagedConfig<CacheT, HEAD_SIZE, BLOCK_SIZE>;
  for (int d = threadIdx.x; d < HEAD_SIZE; d += kNumThreads)
    q_smem[d] = to_float(q_row[d]) * q_scale;
  __syncthreads();
  const int group_lane = (threadIdx.x % kWarpSize) / Cfg::kTokensPerPass;
#pragma unroll
  for (int i = 0; i < Cfg::kChunksPerThread; ++i) {
    const int c = group_lane + i * Cfg::kGroup;
#pragma unroll
    for (int j = 0; j < Cfg::kX; ++j) q[i][j] = c < Cfg::kNumChunks ? q_smem[c * Cfg::kX + j] : 0.f;
  }
}

// dst[d] = out_scale * (sum over all lanes and warps of their partial acc for head dim d).
// smem must be free (callers pass the scores buffer after a barrier).
template <typename T, typename CacheT, int HEAD_SIZE, int BLOCK_SIZE>
__device__ __forceinline__ void store_output(
    float (&acc)[PagedConfig<CacheT, HEAD_SIZE, BLOCK_SIZE>::kRowsPerThread], float out_scale,
    float* smem /* [kNumWarps, HEAD_SIZE] */, T* __restrict__ dst /* [HEAD_SIZE] */) {
  using Cfg = PagedConfig<CacheT, HEAD_SIZE, BLOCK_SIZE>;
  // Lanes that share a row hold partial sums over different tokens.
#pragma unroll
  for (int r = 0; r < Cfg::kRowsPerThread; ++r) {
#pragma unroll
    for (int offset = 1; offset < Cfg::kLanesPerRow; offset *= 2) {
      acc[r] += __shfl_xor_sync(kFullMask, acc[r], offset);
    }
  }
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  if (lane % Cfg::kLanesPerRow == 0) {
#pragma unroll
    for (int r = 0; r < Cfg::kRowsPerThread; ++r) {
      const int row = lane / Cfg::kLanesPerRow + r * Cfg::kRowsPerPass;
      if (row < HEAD_SIZE) smem[warp * HEAD_SIZE + row] = acc[r];
    }
  }
  __syncthreads();
  for (int d = threadIdx.x; d < HEAD_SIZE; d += kNumThreads) {
    float o = 0.f;
#pragma unroll
    for (int w = 0; w < kNumWarps; ++w) o += smem[w * HEAD_SIZE + d];
    dst[d] = from_float<T>(o * out_scale);
  }
}

// ---- the attention kernel (v1 when exp_sums == nullptr) ----------------------------------------

// grid: (num_heads, num_seqs, 1) for v1; (num_heads, num_seqs, num_launched_partitions) for v2.
// v2 scratch (row = seq * num_heads + head, each of max_num_partitions entries):
//   exp_sums, max_logits: [num_seqs, num_heads, max_num_partitions];
//   tmp_out: [num_seqs, num_heads, max_num_partitions, HEAD_SIZE].
// A sequence that fits one partition is written straight to out (the reduce kernel skips it).
template <typename T, typename CacheT, int HEAD_SIZE, int BLOCK_SIZE>
__global__ void __launch_bounds__(kNumThreads)
    paged_attention_v1_v2_kernel(const PagedAttentionV1V2Args args, float* __restrict__ exp_sums,
                                 float* __restrict__ max_logits, T* __restrict__ tmp_out,
                                 int64_t max_num_partitions) {
  using Cfg = PagedConfig<CacheT, HEAD_SIZE, BLOCK_SIZE>;
  constexpr bool kIsFp8 = std::is_same_v<CacheT, uint8_t>;
  __shared__ float q_smem[HEAD_SIZE];
  __shared__ __align__(16) float scores[Cfg::kScoreFloats];
  __shared__ float red_smem[kNumWarps];

  const int head = blockIdx.x;
  const int seq = blockIdx.y;
  const int part = blockIdx.z;
  const bool partitioned = exp_sums != nullptr;
  const int seq_len = args.seq_lens[seq];
  const int num_partitions =
      partitioned ? cmin(ceil_div(seq_len, kChunkSize), static_cast<int>(gridDim.z)) : 1;
  const int range_begin = partitioned ? part * kChunkSize : 0;
  const int range_end = partitioned ? cmin(seq_len, range_begin + kChunkSize) : seq_len;
  const bool write_out = num_partitions <= 1;
  T* out_row = static_cast<T*>(args.out) + seq * args.out_seq_stride + head * args.out_head_stride;

  if (range_begin >= range_end) {
    // An empty sequence attends to nothing: zeros (written once). Partitions past the end idle.
    if (part == 0) {
      for (int d = threadIdx.x; d < HEAD_SIZE; d += kNumThreads) out_row[d] = from_float<T>(0.f);
    }
    return;
  }

  const int kv_head = head / (args.num_heads / args.num_kv_heads);
  const float k_scale = kIsFp8 ? *args.k_scale : 1.f;
  const float v_scale = kIsFp8 ? *args.v_scale : 1.f;
  const float alibi_log2 = args.alibi_slopes != nullptr ? args.alibi_slopes[head] * kLog2e : 0.f;

  // q, pre-scaled so that q.k is the score in log2 units.
  const T* q_row =
      static_cast<const T*>(args.query) + seq * args.q_seq_stride + head * args.q_head_stride;
  float q[Cfg::kChunksPerThread][Cfg::kX];
  load_q<T, CacheT, HEAD_SIZE, BLOCK_SIZE>(q, q_row, args.scale * kLog2e * k_scale, q_smem);

  const int32_t* block_table = args.block_tables + seq * args.block_table_stride;
  const CacheT* key_head =
      static_cast<const CacheT*>(args.key_cache) + kv_head * args.k_head_stride;
  const CacheT* value_head =
      static_cast<const CacheT*>(args.value_cache) + kv_head * args.v_head_stride;

  float run_max = -FLT_MAX;  // finite, so that exp2(run_max - new_max) is 0, never NaN
  float run_sum = 0.f;
  float acc[Cfg::kRowsPerThread];
#pragma unroll
  for (int r = 0; r < Cfg::kRowsPerThread; ++r) acc[r] = 0.f;

  for (int chunk_begin = range_begin; chunk_begin < range_end; chunk_begin += kChunkSize) {
    const int chunk_end = cmin(range_end, chunk_begin + kChunkSize);
    const int first_block = chunk_begin / BLOCK_SIZE;
    const int end_block = ceil_div(chunk_end, BLOCK_SIZE);
    const float thread_max = qk_chunk<CacheT, HEAD_SIZE, BLOCK_SIZE>(
        q, key_head, block_table, args.k_block_stride, first_block, end_block, chunk_begin,
        chunk_end, seq_len, alibi_log2, scores);
    const float alpha =
        softmax_chunk(scores, chunk_end - chunk_begin, thread_max, run_max, run_sum, red_smem);
#pragma unroll
    for (int r = 0; r < Cfg::kRowsPerThread; ++r) acc[r] *= alpha;
    pv_chunk<CacheT, HEAD_SIZE, BLOCK_SIZE>(acc, value_head, block_table, args.v_block_stride,
                                            first_block, end_block, chunk_begin, chunk_end, scores);
    __syncthreads();  // the next chunk (or the sum below) overwrites scores
  }

  // v2 with several partitions: this partition's normalized output, max and exp-sum go to the
  // scratch; otherwise the final output.
  const int64_t scratch_idx =
      (static_cast<int64_t>(seq) * args.num_heads + head) * max_num_partitions + part;
  T* dst = write_out ? out_row : tmp_out + scratch_idx * HEAD_SIZE;
  store_output<T, CacheT, HEAD_SIZE, BLOCK_SIZE>(acc, v_scale / run_sum, scores, dst);
  if (!write_out && threadIdx.x == 0) {
    max_logits[scratch_idx] = run_max * kLn2;  // natural-log units, as vLLM stores them
    exp_sums[scratch_idx] = run_sum;
  }
}

// ---- v2 reduce: combine the partitions of each (head, sequence) --------------------------------

// grid: (num_heads, num_seqs); dynamic shared memory: num_launched_partitions floats.
// out = sum_p w_p * tmp_out_p / sum_p w_p with w_p = exp_sums_p * exp(max_logits_p - max).
template <typename T>
__global__ void __launch_bounds__(kNumThreads) paged_attention_v2_reduce_kernel(
    T* __restrict__ out,                   // [num_seqs, num_heads, head_size] (strides below)
    const float* __restrict__ exp_sums,    // [num_seqs, num_heads, max_num_partitions]
    const float* __restrict__ max_logits,  // [num_seqs, num_heads, max_num_partitions]
    const T* __restrict__ tmp_out,         // [num_seqs, num_heads, max_num_partitions, head_size]
    const int32_t* __restrict__ seq_lens,  // [num_seqs]
    int num_heads, int head_size, int64_t max_num_partitions, int num_launched_partitions,
    int64_t out_seq_stride, int64_t out_head_stride) {
  extern __shared__ float weights[];  // [num_launched_partitions]
  __shared__ float red_smem[kNumWarps];
  const int head = blockIdx.x;
  const int seq = blockIdx.y;
  const int num_partitions = cmin(ceil_div(seq_lens[seq], kChunkSize), num_launched_partitions);
  if (num_partitions <= 1) return;  // the attention kernel wrote out itself

  const int64_t row = static_cast<int64_t>(seq) * num_heads + head;
  const float* row_max = max_logits + row * max_num_partitions;
  const float* row_sum = exp_sums + row * max_num_partitions;
  float m = -FLT_MAX;
  for (int p = threadIdx.x; p < num_partitions; p += kNumThreads) m = fmaxf(m, row_max[p]);
  m = block_allreduce<true>(m, red_smem);
  float s = 0.f;
  for (int p = threadIdx.x; p < num_partitions; p += kNumThreads) {
    const float w = row_sum[p] * expf(row_max[p] - m);
    weights[p] = w;
    s += w;
  }
  s = block_allreduce<false>(s, red_smem);  // also publishes weights[]
  const float inv_sum = 1.f / s;

  const T* parts = tmp_out + row * max_num_partitions * head_size;
  T* out_row = out + seq * out_seq_stride + head * out_head_stride;
  for (int d = threadIdx.x; d < head_size; d += kNumThreads) {
    float o = 0.f;
    for (int p = 0; p < num_partitions; ++p) {
      o = fmaf(weights[p], to_float(parts[static_cast<int64_t>(p) * head_size + d]), o);
    }
    out_row[d] = from_float<T>(o * inv_sum);
  }
}

// ---- launchers ----------------------------------------------------------------------------------

// Raises a kernel's dynamic shared-memory limit when it needs more than the default 48 KB.
template <typename Kernel>
cudaError_t allow_dynamic_smem(Kernel kernel, size_t bytes) {
  if (bytes <= 48 * 1024) return cudaSuccess;
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                              static_cast<int>(bytes));
}

// v1 when exp_sums == nullptr, else v2 (attention kernel over all partitions, then the reduce).
template <typename T, typename CacheT, int HEAD_SIZE, int BLOCK_SIZE>
cudaError_t launch_paged_attention_v1_v2(const PagedAttentionV1V2Args& args, float* exp_sums,
                                         float* max_logits, T* tmp_out, int64_t max_num_partitions,
                                         cudaStream_t stream) {
  const bool partitioned = exp_sums != nullptr;
  // At least one partition, so that empty sequences still get their zeros. With one partition
  // every sequence writes out directly and the scratch is never touched.
  const int64_t num_launched =
      partitioned ? std::max<int64_t>(1, paged_attention_v2_num_partitions(args.max_seq_len)) : 1;
  if (args.num_seqs > 65535 || num_launched > 65535 ||
      (num_launched > 1 && num_launched > max_num_partitions)) {
    PYORCH_INVALID("paged_attention: grid too large (num_seqs %d, partitions %lld of %lld)",
                   args.num_seqs, static_cast<long long>(num_launched),
                   static_cast<long long>(max_num_partitions));
  }
  const dim3 grid(args.num_heads, args.num_seqs, static_cast<unsigned>(num_launched));
  paged_attention_v1_v2_kernel<T, CacheT, HEAD_SIZE, BLOCK_SIZE>
      <<<grid, kNumThreads, 0, stream>>>(args, exp_sums, max_logits, tmp_out, max_num_partitions);
  PYORCH_RETURN_IF_ERROR(cudaGetLastError());
  if (!partitioned || num_launched == 1) return cudaSuccess;  // every sequence wrote out itself

  const size_t smem = static_cast<size_t>(num_launched) * sizeof(float);
  PYORCH_RETURN_IF_ERROR(allow_dynamic_smem(paged_attention_v2_reduce_kernel<T>, smem));
  paged_attention_v2_reduce_kernel<T>
      <<<dim3(args.num_heads, args.num_seqs), kNumThreads, smem, stream>>>(
          static_cast<T*>(args.out), exp_sums, max_logits, tmp_out, args.seq_lens, args.num_heads,
          HEAD_SIZE, max_num_partitions, static_cast<int>(num_launched), args.out_seq_stride,
          args.out_head_stride);
  return cudaGetLastError();
}

}  // namespace pyorch::kernels::paged_v1_v2
