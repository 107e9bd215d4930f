// The W4A16 GEMM of decode: out [m, n] = a [m, k] @ dequant(W) [k, n] for m <= 64, with W in the
// w4 tile layout (pyorch/w4a16.h). One warp streams one 16-column n-tile over its thread block's
// k-range; each lane loads 16 bytes of codes per 64-row k-block (4 tiles of mma.m16n8k16's A
// operand, the weight on the 16-row side), turns them into 16-bit pairs with lop3 (code | the
// exponent of 128 (bf16) or 1024 (fp16)), subtracts (magic + zero point) and multiplies by the
// group scale in registers, and multiplies with the activations on the n8 side (8 rows of a per
// mma). Weights of the next kW4Stages blocks are loaded while the current ones are computed
// (a register double buffer). For few output columns the k range is split over thread blocks
// (grid.y) so that every SM streams; the last block to arrive at a column group sums the fp32
// partials in split order (deterministic) and resets its counter.
#pragma once

#include <cstdint>

#include "common/dtype.cuh"
#include "pyorch/w4a16.h"

namespace pyorch::kernels {

constexpr int kW4Warps = 4;
constexpr int kW4Threads = kW4Warps * 32;
constexpr int kW4Stages = 4;  // k-blocks (16 bytes each per lane) in flight per buffer
static_assert(kW4Warps * kW4A16TileN == kW4A16BlockN, "a thread block covers kW4A16BlockN columns");

template <typename T>
struct W4Traits;
template <>
struct W4Traits<__nv_bfloat16> {
  using T2 = __nv_bfloat162;
  static constexpr uint32_t kMagic = 0x43004300u;  // (128, 128): 128 + q is exact in bf16
  static constexpr int kMagicValue = 128;
};
template <>
struct W4Traits<__half> {
  using T2 = __half2;
  static constexpr uint32_t kMagic = 0x64006400u;  // (1024, 1024): 1024 + q is exact in fp16
  static constexpr int kMagicValue = 1024;
};

struct W4A16GemmArgs {
  void* out;              // [m, n], row stride out_stride
  const void* a;          // [m, k], row stride a_stride
  const uint4* b_q;       // w4 tiles [n / 16, k * 2] int32, as uint4
  const void* scales;     // [k / group_size, n]
  const uint32_t* zeros;  // [k / group_size, n / 8] or nullptr
  int32_t* counters;      // [ceil(n / 64)], zero
  float* partials;        // [num_splits, m, n] when num_splits > 1
  int m, n, k, group_size;
  int64_t a_stride, out_stride;
  int blocks_per_split, num_splits;
  int group_shift;      // log2(group_size) when it is a power of two, else -1
  int prefetch_blocks;  // k-blocks a warp asks L2 for beyond its register stages (0: none)
};

// (w & 0x000F000F) | magic: the codes in bits 0-3 and 16-19 as (magic + q) 16-bit pairs.
__device__ __forceinline__ uint32_t w4_code_pair(uint32_t w, uint32_t magic) {
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(w), "r"(0x000F000Fu), "r"(magic));
  return r;
}

template <typename T2>
__device__ __forceinline__ uint32_t w4_dequant_pair(uint32_t pair, T2 bias, T2 scale) {
  T2 x = *reinterpret_cast<T2*>(&pair);
  x = __hmul2(__hsub2(x, bias), scale);  // (magic + q) - (magic + z) is exact; one rounding
  return *reinterpret_cast<uint32_t*>(&x);
}

template <typename T2>
__device__ __forceinline__ uint32_t w4_center_pair(uint32_t pair, T2 bias) {
  T2 x = *reinterpret_cast<T2*>(&pair);
  x = __hsub2(x, bias);  // (magic + q) - (magic + z) = q - z, exact
  return *reinterpret_cast<uint32_t*>(&x);
}

template <typename T>
__device__ __forceinline__ void w4_mma(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// Streaming 16-byte load of codes: read once, so it does not displace a's rows in L1.
__device__ __forceinline__ uint4 w4_load_stream(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// Asks L2 for blocks [from, to) of a warp's codes (512 bytes each) with one bulk prefetch (sm_90):
// more bytes in flight per warp without holding registers.
__device__ __forceinline__ void w4_prefetch_blocks(const uint4* warp_codes, int from, int to) {
  if (from >= to) return;
  const uint32_t bytes = static_cast<uint32_t>(to - from) * 32 * sizeof(uint4);
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(warp_codes + from * 32),
               "r"(bytes)
               : "memory");
}

// One stage of a lane's weight stream: the codes of a k-block and the lane's two scales (rows g
// and g + 8 of the n-tile) and zero points of that block's group.
struct W4Stage {
  uint4 codes;
  uint32_t scales;  // low 16 bits: column n_lo, high: n_lo + 8
  uint32_t zeros;   // bits 0-3: column n_lo, 4-7: n_lo + 8 (HAS_ZEROS)
};

// The lane's two scales (rows g and g + 8 of the n-tile) and zero points of k-block kb's group
// (everything of a stage but the codes).
template <typename T, bool HAS_ZEROS>
__device__ __forceinline__ void w4_load_group(const W4A16GemmArgs& p, int64_t nt, int kb, int lane,
                                              W4Stage* s) {
  const int g = lane / 4, t = lane % 4;
  const int64_t n_lo = nt * kW4A16TileN + g;
  const int row = kb * static_cast<int>(kW4A16BlockK) + 16 * t;  // k < 2^31
  const int64_t group = p.group_shift >= 0 ? row >> p.group_shift : row / p.group_size;
  const uint16_t* sc = static_cast<const uint16_t*>(p.scales) + group * p.n + n_lo;
  s->scales = static_cast<uint32_t>(__ldg(sc)) | (static_cast<uint32_t>(__ldg(sc + 8)) << 16);
  s->zeros = 0;
  if constexpr (HAS_ZEROS) {
    const uint32_t* z = p.zeros + group * (p.n / 8) + nt * 2;
    s->zeros = ((__ldg(z) >> (4 * g)) & 0xF) | (((__ldg(z + 1) >> (4 * g)) & 0xF) << 4);
  }
}

template <typename T, bool HAS_ZEROS>
__device__ __forceinline__ W4Stage w4_load_stage(const W4A16GemmArgs& p, int64_t nt, int kb,
                                                 int kblocks, int lane) {
  W4Stage s;
  s.codes = w4_load_stream(p.b_q + ((nt * kblocks + kb) * 32 + lane));
  w4_load_group<T, HAS_ZEROS>(p, nt, kb, lane, &s);
  return s;
}

template <typename T>
__device__ __forceinline__ typename W4Traits<T>::T2 w4_broadcast(uint16_t bits) {
  const uint32_t both = static_cast<uint32_t>(bits) | (static_cast<uint32_t>(bits) << 16);
  return *reinterpret_cast<const typename W4Traits<T>::T2*>(&both);
}

// Bits of the 16-bit value magic + z (exact: both are small integers).
template <typename T>
__device__ __forceinline__ uint16_t w4_bias_bits(int z) {
  const T v = from_float<T>(static_cast<float>(W4Traits<T>::kMagicValue + z));
  return *reinterpret_cast<const uint16_t*>(&v);
}

// The lane's activations of k-block kb, the mma's B operand: per m-tile mt, row 8 mt + g's 16
// consecutive values from k = 64 kb + 16 t (the k order of the layout); zeros past row m.
template <int M_TILES>
struct W4Acts {
  uint4 b[M_TILES][2];
};

template <typename T, int M_TILES>
__device__ __forceinline__ void w4_load_acts(const W4A16GemmArgs& p, int kb, int lane,
                                             W4Acts<M_TILES>* x) {
  const int g = lane / 4, t = lane % 4;
  const T* a = static_cast<const T*>(p.a);
#pragma unroll
  for (int mt = 0; mt < M_TILES; ++mt) {
    const int row = mt * 8 + g;
    x->b[mt][0] = x->b[mt][1] = make_uint4(0, 0, 0, 0);
    if (row < p.m) {
      const uint4* ap = reinterpret_cast<const uint4*>(
          a + row * p.a_stride + static_cast<int64_t>(kb) * kW4A16BlockK + 16 * t);
      x->b[mt][0] = __ldg(ap);
      x->b[mt][1] = __ldg(ap + 1);
    }
  }
}

// The A fragments of a stage's 4 k-tiles (register r of k-tile kt holds rows g + 8 (r % 2) of the
// n-tile): the codes dequantized to T ((q - z) * s, one rounding), or with SCALED = false only
// centred (q - z, exact in 16 bits; the caller applies the group scale to the fp32 sums).
template <typename T, bool HAS_ZEROS, bool SCALED = true>
__device__ __forceinline__ void w4_dequant_frags(const W4Stage& s, uint32_t (&frag)[4][4]) {
  using T2 = typename W4Traits<T>::T2;
  const int z_lo = HAS_ZEROS ? static_cast<int>(s.zeros & 0xF) : 8;
  const int z_hi = HAS_ZEROS ? static_cast<int>((s.zeros >> 4) & 0xF) : 8;
  const T2 bias_lo = w4_broadcast<T>(w4_bias_bits<T>(z_lo));
  const T2 bias_hi = w4_broadcast<T>(w4_bias_bits<T>(z_hi));
  const T2 scale_lo = w4_broadcast<T>(static_cast<uint16_t>(s.scales & 0xFFFF));
  const T2 scale_hi = w4_broadcast<T>(static_cast<uint16_t>(s.scales >> 16));
  const uint32_t words[4] = {s.codes.x, s.codes.y, s.codes.z, s.codes.w};
#pragma unroll
  for (int kt = 0; kt < 4; ++kt) {
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const uint32_t pair = w4_code_pair(words[kt] >> (4 * r), W4Traits<T>::kMagic);
      if constexpr (SCALED) {
        frag[kt][r] = (r % 2) ? w4_dequant_pair(pair, bias_hi, scale_hi)
                              : w4_dequant_pair(pair, bias_lo, scale_lo);
      } else {
        frag[kt][r] = w4_center_pair(pair, (r % 2) ? bias_hi : bias_lo);
      }
    }
  }
}

// acc += one k-block of the weight's A fragments (w4_dequant_frags) times 8 rows of activations
// (b0, b1: the lane's 16 consecutive values of its row, the mma's B operand).
template <typename T>
__device__ __forceinline__ void w4_mma_block(float (&acc)[4], const uint32_t (&frag)[4][4],
                                             const uint4& b0, const uint4& b1) {
  w4_mma<T>(acc, frag[0], b0.x, b0.y);
  w4_mma<T>(acc, frag[1], b0.z, b0.w);
  w4_mma<T>(acc, frag[2], b1.x, b1.y);
  w4_mma<T>(acc, frag[3], b1.z, b1.w);
}

// acc[mt] += activations x (rows 8 mt .. 8 mt + 7 of one k-block) @ the stage's dequantized
// codes (SCALED: see w4_dequant_frags; false is w4a16_stream.cuh's, groups of whole k-blocks).
template <typename T, int M_TILES, bool HAS_ZEROS, bool SCALED = true>
__device__ __forceinline__ void w4_compute_acts(const W4Stage& s, const W4Acts<M_TILES>& x,
                                                float (&acc)[M_TILES][4]) {
  uint32_t frag[4][4];
  w4_dequant_frags<T, HAS_ZEROS, SCALED>(s, frag);
#pragma unroll
  for (int mt = 0; mt < M_TILES; ++mt) w4_mma_block<T>(acc[mt], frag, x.b[mt][0], x.b[mt][1]);
}

// w4_compute_acts with the activations of k-block kb loaded here, just before their use.
template <typename T, int M_TILES, bool HAS_ZEROS, bool SCALED = true>
__device__ __forceinline__ void w4_compute_stage(const W4A16GemmArgs& p, const W4Stage& s, int kb,
                                                 int lane, float (&acc)[M_TILES][4]) {
  W4Acts<M_TILES> x;
  w4_load_acts<T, M_TILES>(p, kb, lane, &x);
  w4_compute_acts<T, M_TILES, HAS_ZEROS, SCALED>(s, x, acc);
}

// out[row0 .. row0 + rows) x [n0 .. n0 + cols) = the sum of the k-split's partials in split
// order. Each thread keeps OUTPUTS sums and reads all of them for one split before the next, so
// that OUTPUTS L2 reads are in flight instead of one (this sum, at the end of a column group, is
// the kernel's tail). More outputs cost registers: the caller's kernel keeps its count below its
// occupancy steps (w4_sum_outputs).
template <typename T, int OUTPUTS>
__device__ __forceinline__ void w4_sum_partials(const W4A16GemmArgs& p, int row0, int rows,
                                                int64_t n0, int cols) {
  const int total = rows * cols;
  const int64_t split_stride = static_cast<int64_t>(p.m) * p.n;
  const float* part = p.partials + static_cast<int64_t>(row0) * p.n + n0;
  T* out = static_cast<T*>(p.out) + static_cast<int64_t>(row0) * p.out_stride + n0;
  for (int base = threadIdx.x; base < total; base += OUTPUTS * blockDim.x) {
    int offset[OUTPUTS];  // into part (row * n + col), or -1 past the rectangle
#pragma unroll
    for (int u = 0; u < OUTPUTS; ++u) {
      const int idx = base + u * static_cast<int>(blockDim.x);
      offset[u] = idx < total ? (idx / cols) * p.n + idx % cols : -1;
    }
    float sum[OUTPUTS] = {};
    const float* src = part;
    for (int split = 0; split < p.num_splits; ++split, src += split_stride) {
      float v[OUTPUTS];
#pragma unroll
      for (int u = 0; u < OUTPUTS; ++u) v[u] = offset[u] >= 0 ? __ldcg(src + offset[u]) : 0.f;
#pragma unroll
      for (int u = 0; u < OUTPUTS; ++u) sum[u] += v[u];
    }
#pragma unroll
    for (int u = 0; u < OUTPUTS; ++u) {
      if (offset[u] < 0) continue;
      const int row = offset[u] / p.n, col = offset[u] - row * p.n;
      out[static_cast<int64_t>(row) * p.out_stride + col] = from_float<T>(sum[u]);
    }
  }
}

// The partial sums each thread of the k-split's reduction keeps in flight, by the kernel's
// m-tiles: with 4 at one m-tile the decode kernels' AWQ forms took 72 registers instead of 64 (7
// resident blocks instead of 8, nvcc 13.0); from two m-tiles the count is set by the main loop.
constexpr int w4_sum_outputs(int m_tiles) { return m_tiles == 1 ? 1 : 4; }

// The last thread block of a column group sums the k-split's partials (split order) into out.
template <typename T, int OUTPUTS>
__device__ __forceinline__ void w4_reduce_splits(const W4A16GemmArgs& p) {
  __shared__ int is_last;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    is_last = atomicAdd(&p.counters[blockIdx.x], 1) == p.num_splits - 1;
  }
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  const int64_t n0 = static_cast<int64_t>(blockIdx.x) * kW4A16BlockN;
  if constexpr (OUTPUTS == 1) {  // one sum per thread (the loop of the decode kernels' 1..8 rows)
    T* out = static_cast<T*>(p.out);
    for (int idx = threadIdx.x; idx < p.m * kW4A16BlockN; idx += blockDim.x) {
      const int row = idx / kW4A16BlockN;
      const int64_t col = n0 + idx % kW4A16BlockN;
      if (col >= p.n) continue;
      float sum = 0.f;
      for (int split = 0; split < p.num_splits; ++split) {
        sum += __ldcg(p.partials + (static_cast<int64_t>(split) * p.m + row) * p.n + col);
      }
      out[row * p.out_stride + col] = from_float<T>(sum);
    }
  } else {
    w4_sum_partials<T, OUTPUTS>(
        p, 0, p.m, n0, static_cast<int>(min(static_cast<int64_t>(kW4A16BlockN), p.n - n0)));
  }
  if (threadIdx.x == 0) p.counters[blockIdx.x] = 0;
}

// acc[mt] = out rows 8 mt + 2 t (+1), columns n_lo and n_lo + 8: stored (no k-split) or written
// as this split's partials and reduced by the column group's last thread block.
template <typename T, int M_TILES>
__device__ __forceinline__ void w4_store_or_reduce(const W4A16GemmArgs& p,
                                                   const float (&acc)[M_TILES][4], int64_t nt,
                                                   bool valid_tile, int g, int t) {
  const int64_t n_lo = nt * kW4A16TileN + g;
  if (p.num_splits == 1) {
    if (!valid_tile) return;
    T* out = static_cast<T*>(p.out);
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int row = mt * 8 + 2 * t + (i % 2);
        if (row < p.m) out[row * p.out_stride + n_lo + 8 * (i / 2)] = from_float<T>(acc[mt][i]);
      }
    }
    return;
  }
  if (valid_tile) {
    float* part = p.partials + static_cast<int64_t>(blockIdx.y) * p.m * p.n;
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int row = mt * 8 + 2 * t + (i % 2);
        if (row < p.m) part[static_cast<int64_t>(row) * p.n + n_lo + 8 * (i / 2)] = acc[mt][i];
      }
    }
  }
  w4_reduce_splits<T, w4_sum_outputs(M_TILES)>(p);
}

// grid (ceil(n / 64), num_splits), kW4Threads threads.
template <typename T, int M_TILES, bool HAS_ZEROS>
__global__ void __launch_bounds__(kW4Threads) w4a16_gemm_kernel(const W4A16GemmArgs p) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const int64_t nt = static_cast<int64_t>(blockIdx.x) * kW4Warps + warp;
  const int kblocks = p.k / static_cast<int>(kW4A16BlockK);
  const int kb_begin = blockIdx.y * p.blocks_per_split;
  const int kb_end = min(kb_begin + p.blocks_per_split, kblocks);
  float acc[M_TILES][4] = {};
  if (nt < p.n / kW4A16TileN) {
    const uint4* warp_codes = p.b_q + nt * kblocks * 32;  // block kb at warp_codes + 32 kb
    const bool prefetch = p.prefetch_blocks > 0 && lane == 0;
    if (prefetch) {
      w4_prefetch_blocks(warp_codes, kb_begin + kW4Stages,
                         min(kb_begin + kW4Stages + p.prefetch_blocks, kb_end));
    }
    W4Stage cur[kW4Stages];
#pragma unroll
    for (int s = 0; s < kW4Stages; ++s) {
      if (kb_begin + s < kb_end)
        cur[s] = w4_load_stage<T, HAS_ZEROS>(p, nt, kb_begin + s, kblocks, lane);
    }
    for (int kb0 = kb_begin; kb0 < kb_end; kb0 += kW4Stages) {
      if (prefetch) {  // keep prefetch_blocks ahead of the register stages being loaded
        const int from = kb0 + kW4Stages + p.prefetch_blocks;
        w4_prefetch_blocks(warp_codes, from, min(from + kW4Stages, kb_end));
      }
      W4Stage next[kW4Stages];
#pragma unroll
      for (int s = 0; s < kW4Stages; ++s) {
        const int kb = kb0 + kW4Stages + s;
        if (kb < kb_end) next[s] = w4_load_stage<T, HAS_ZEROS>(p, nt, kb, kblocks, lane);
      }
#pragma unroll
      for (int s = 0; s < kW4Stages; ++s) {
        if (kb0 + s < kb_end)
          w4_compute_stage<T, M_TILES, HAS_ZEROS>(p, cur[s], kb0 + s, lane, acc);
      }
#pragma unroll
      for (int s = 0; s < kW4Stages; ++s) cur[s] = next[s];
    }
  }
  w4_store_or_reduce<T, M_TILES>(p, acc, nt, nt < p.n / kW4A16TileN, g, t);
}

template <typename T>
cudaError_t launch_w4a16_gemm(const W4A16GemmArgs& p, bool has_zeros, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>((p.n + kW4A16BlockN - 1) / kW4A16BlockN),
                  static_cast<unsigned>(p.num_splits));
  auto launch = [&](auto m_tiles, auto zeros) {
    w4a16_gemm_kernel<T, decltype(m_tiles)::value, decltype(zeros)::value>
        <<<grid, kW4Threads, 0, stream>>>(p);
  };
  auto with_tiles = [&](auto zeros) {
    if (p.m <= 8) {
      launch(std::integral_constant<int, 1>{}, zeros);
    } else if (p.m <= 16) {
      launch(std::integral_constant<int, 2>{}, zeros);
    } else if (p.m <= 32) {
      launch(std::integral_constant<int, 4>{}, zeros);
    } else {
      launch(std::integral_constant<int, 8>{}, zeros);
    }
  };
  if (has_zeros) {
    with_tiles(std::true_type{});
  } else {
    with_tiles(std::false_type{});
  }
  return cudaGetLastError();
}

}  // namespace pyorch::kernels
