// W4A16: 4-bit integer weights (GPTQ, AWQ, compressed-tensors pack-quantized) times 16-bit
// activations. The weights are repacked once at load into pyorch's tile layout (below), then
// gptq_marlin_gemm streams them and dequantizes in registers.
//
// The tile layout ("w4 tiles"). For a weight W [size_k, size_n] (K rows = input features, N
// columns = output features) of 4-bit codes, the packed tensor is int32 [size_n / 16,
// size_k * 2]: for each 16-column n-tile nt and each 64-row k-block kb, 32 lanes x 4 words
// (one uint4 per lane, 512 bytes per block). Word kt (0..3) of lane L = (g = L / 4, t = L % 4)
// holds 8 codes; code p (bits 4p..4p+3), with r = p % 4 and h = p / 4, is the one of
//   n = 16 nt + g + 8 (r % 2),  k = 64 kb + 16 t + 4 kt + h + 2 (r / 2).
// That is the A-fragment of mma.m16n8k16 (rows = n, columns = k) with the k order inside each
// 64-row block permuted so that lane t's activations are 16 consecutive elements (one 32-byte
// load); the product sums over k, so any permutation applied to both sides gives the same
// result. Codes p and p + 4 sit 16 bits apart, so one lop3 turns a pair into a 16-bit pair.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "pyorch/dtype.h"
#include "pyorch/w4a16_layout.h"

namespace pyorch {

// How the 4-bit codes become numbers: w = (q - 8) * s (GPTQ's uint4b8, no zero points) or
// w = (q - z) * s with 4-bit zero points z (AWQ's uint4).
enum class W4A16Type : int { kUint4b8 = 0, kUint4 = 1 };

// gptq_marlin_repack: GPTQ's qweight int32 [size_k / 8, size_n] (code of row k in bits
// 4 (k % 8) of word [k / 8, n]) -> w4 tiles [size_n / 16, size_k * 2]. perm: [size_k] int32 or
// nullptr (act-order: row perm[j] of the checkpoint becomes row j).
cudaError_t gptq_marlin_repack(int32_t* out, const int32_t* b_q_weight, const int32_t* perm,
                               int64_t size_k, int64_t size_n, cudaStream_t stream);

// awq_marlin_repack: AWQ's qweight int32 [size_k, size_n / 8] (column 8 c + j in the nibble
// kAwqOrder[j] of word [k, c], AutoAWQ's interleave) -> w4 tiles [size_n / 16, size_k * 2].
cudaError_t awq_marlin_repack(int32_t* out, const int32_t* b_q_weight, int64_t size_k,
                              int64_t size_n, cudaStream_t stream);

// out [size_m, size_n] = a [size_m, size_k] @ W, W dequantized from the w4 tiles:
//   W[k, n] = (q[k, n] - z[k / group, n]) * scales[k / group, n], rounded to dtype (z = 8 for
//   kUint4b8), products accumulated in fp32 and rounded once. (The stream kernel, m <= 16 with
//   groups of whole 64-row blocks, multiplies exact q - z and scales each group's fp32 sum
//   instead: W is then not rounded, which is closer to the exact product.)
//   a:         [size_m, size_k], row stride a_stride, 16-byte aligned rows (dtype fp16/bf16)
//   b_q:       w4 tiles [size_n / 16, size_k * 2] int32
//   scales:    [size_k / group_size, size_n] in dtype (one row when group_size = size_k)
//   zeros:     [size_k / group_size, size_n / 8] int32, column n in bits 4 (n % 8) of word n / 8
//              (kUint4 only; nullptr for kUint4b8)
//   perm:      [size_k] int32 or nullptr: act-order, a's columns are permuted first
//              (a'[:, j] = a[:, perm[j]]) into a_perm_buffer [size_m, size_k] (dtype)
//   workspace: >= ceil(size_n / kW4A16BlockN) ints, zero before the first call; every call
//              leaves it zero (the k-split's arrival counters). Calls sharing one must be ordered.
//   partials:  >= w4a16_partials_size(size_m, size_n, size_k) floats (unused when that is 0)
// Any size_m >= 0 (the kernel by rows: w4a16_kernel_name); size_k a multiple of kW4A16BlockK and
// of group_size; size_n of kW4A16TileN; group_size a multiple of 16 dividing size_k. Captures in
// a CUDA graph.
cudaError_t gptq_marlin_gemm(void* out, const void* a, const int32_t* b_q, const void* scales,
                             const int32_t* zeros, const int32_t* perm, void* a_perm_buffer,
                             int32_t* workspace, float* partials, W4A16Type type, DType dtype,
                             int64_t size_m, int64_t size_n, int64_t size_k, int64_t group_size,
                             int64_t a_stride, int64_t out_stride, cudaStream_t stream);

// Process-wide: how many 512-byte k-blocks each warp of gptq_marlin_gemm asks L2 for ahead of
// the blocks it is loading (one bulk prefetch per step; 0 turns it off). For the benchmark's
// A/B (bench_w4a16 --prefetch N); the default is in w4a16.cu.
void set_w4a16_l2_prefetch(int blocks);
int w4a16_l2_prefetch();

// The kernel of gptq_marlin_gemm for m <= kW4A16StreamMaxRows: kStream (w4a16_stream.cuh: TMA
// bulk copies of the codes into a per-warp shared-memory ring, the default) or kRegisters
// (w4a16_gemm.cuh: register-staged loads, the kernel of every m above). Process-wide, for the
// benchmark's A/B (bench_w4a16 --kernel stream|registers --stages N --ctas-per-sm N).
enum class W4A16Kernel : int { kRegisters = 0, kStream = 1 };
constexpr int64_t kW4A16StreamMaxRows = 16;
void set_w4a16_kernel(W4A16Kernel kernel);
W4A16Kernel w4a16_kernel();
// Ring slots per warp of the stream kernel, 1..8 (default 2); the grouped form
// (group sizes of whole 64-row k-blocks) rounds it down to a power of two.
void set_w4a16_stream_stages(int stages);
int w4a16_stream_stages();
// Whether the stream kernel loads the next k-block's activations before it dequantizes and
// multiplies the current one (default on since the H100 A/B of bench_w4a16 --prefetch-acts 0|1).
// An ncu profile of the default (bench/results/NVIDIA_H100_80GB_HBM3/w4a16/ncu_20261127) had
// half of each warp's cycles stalled on these loads, issued just before their use.
// (The grouped form of the stream kernel, for group sizes of whole 64-row k-blocks, always loads
// them one k-block ahead; this setting is for the per-weight form of smaller groups.)
void set_w4a16_prefetch_acts(bool on);
bool w4a16_prefetch_acts();
// k-blocks (512 bytes each) per ring slot of the stream kernel's grouped form (groups of 64+
// rows): 4 or 8 (default 4; anything else rounds to one of them). Process-wide, for the A/B.
void set_w4a16_stream_chunk(int blocks);
int w4a16_stream_chunk();
// Whether the stream kernel's grouped form takes the scales and zero points of groups of 128 by
// its ring slots' bulk copies (with the codes) instead of global loads into registers (default
// off; the register path runs where the copies cannot read them). Process-wide, for the A/B.
void set_w4a16_stream_scales_by_copy(bool on);
bool w4a16_stream_scales_by_copy();
// Thread blocks per SM the decode kernels' k-split aims for (default 4).
void set_w4a16_ctas_per_sm(int ctas);
int w4a16_ctas_per_sm();
// From this many rows on gptq_marlin_gemm runs the tiled kernel (w4a16_tiled.cuh: activations
// and codes staged in shared memory, 2 n-tiles x up to 8 m-tiles per warp; any m); below it the
// decode kernels. 1..kW4A16RegistersMaxRows + 1 (clamped); default kW4A16DefaultTiledMinRows.
constexpr int64_t kW4A16DefaultTiledMinRows = kW4A16StreamMaxRows + 1;
void set_w4a16_tiled_min_rows(int64_t rows);
int64_t w4a16_tiled_min_rows();
// Whether the adapter (cpp/ops/w4a16.cpp) and bench_w4a16 run gptq_marlin_gemm for size_m rows
// of a [size_k, size_n] weight; otherwise they dequantize the weight in column chunks
// (w4a16_dequantize) and call cuBLAS, whose bf16 GEMM wins once the product is compute-bound.
// set_w4a16_mma_max_rows(R > 0): exactly when size_m <= R. 0 (the default, "auto"): up to
// kW4A16MmaRows rows, and up to kW4A16MmaMaxRowsLarge rows for weights of at least
// kW4A16MmaLargeWeight elements (H100, bench_w4a16 at 128 rows: the tiled kernel beat
// dequantize + cuBLAS on 8B gate_up (117 M elements) and 70B qkv / gate_up / down (84-470 M), lost
// on 8B qkv / o / down and 70B o_proj (17-67 M); at 256 rows it won only on 70B gate_up, by 6%).
constexpr int64_t kW4A16MmaRows = 64;
constexpr int64_t kW4A16MmaMaxRowsLarge = 128;
constexpr int64_t kW4A16MmaLargeWeight = int64_t{72} << 20;
void set_w4a16_mma_max_rows(int64_t rows);
int64_t w4a16_mma_max_rows();  // the setting: 0 = auto
bool w4a16_mma_path(int64_t size_m, int64_t size_n, int64_t size_k);
// The large-M path's chunk: it dequantizes at most this many bytes of weight columns at a time
// (default 64 MiB; >= one n-tile of columns). w4a16_dequant_chunk_cols: the columns of a chunk
// (a multiple of kW4A16TileN, at most size_n) for a [size_n, size_k] weight of elem_bytes values.
void set_w4a16_dequant_chunk_bytes(int64_t bytes);
int64_t w4a16_dequant_chunk_cols(int64_t size_n, int64_t size_k, int64_t elem_bytes);
// The kernel gptq_marlin_gemm runs for size_m rows: "stream", "registers" or "tiled".
const char* w4a16_kernel_name(int64_t size_m);

// Whether the stream kernel's 9..16-row form loads activations a k-block ahead for this shape
// (the default), or drops that look-ahead for fewer registers: where the shape's column groups
// outnumber the blocks of the look-ahead form that stay resident at once on the current device.
// True outside the stream kernel's rows.
bool w4a16_stream_acts_ahead(int64_t size_m, int64_t size_n, int64_t size_k);

// The k-split gptq_marlin_gemm uses for a shape on the current device (1 = none) and the fp32
// partial sums it needs (0 without a split).
int64_t w4a16_num_splits(int64_t size_m, int64_t size_n, int64_t size_k);
int64_t w4a16_partials_size(int64_t size_m, int64_t size_n, int64_t size_k);

// The large-M path: out [n_count, size_k] (row-major, nn.Linear's layout, dtype) = W^T for the
// columns n_begin .. n_begin + n_count (multiples of kW4A16TileN), same arguments as the GEMM
// (group_size a multiple of 16); out 16-byte aligned (it is written in 16-byte stores).
cudaError_t w4a16_dequantize(void* out, const int32_t* b_q, const void* scales,
                             const int32_t* zeros, W4A16Type type, DType dtype, int64_t size_n,
                             int64_t size_k, int64_t group_size, int64_t n_begin, int64_t n_count,
                             cudaStream_t stream);

// a_out [size_m, size_k] (contiguous) = a[:, perm]: act-order's column permutation.
cudaError_t w4a16_permute_cols(void* a_out, const void* a, const int32_t* perm, DType dtype,
                               int64_t size_m, int64_t size_k, int64_t a_stride,
                               cudaStream_t stream);

}  // namespace pyorch
