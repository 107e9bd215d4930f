// CUTLASS 3.x sm90a kernels of the scaled_mm family (pyorch/scaled_mm.h): the epilogue visitor
// trees that fuse the scales, bias and zero-point correction into the GEMM's epilogue, the kernel
// type built from a tile configuration, and the launch. Included only by the .cu files of
// cuda/quantization/ that instantiate it (one per dtype family), and only when CUTLASS is there.
#pragma once

#include <cstdint>
#include <cstdio>

#include <cuda_runtime.h>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/operations.hpp"
#include "cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"

#include "common/launch.cuh"
#include "quantization/scaled_mm_internal.h"

namespace pyorch::kernels {

using namespace cute;  // NOLINT: CuTe's shape vocabulary (_1, Shape, Stride) reads best unqualified
namespace fusion = cutlass::epilogue::fusion;

constexpr auto kRound = cutlass::FloatRoundStyle::round_to_nearest;

// One value per row of the GEMM CUTLASS computes, or one scalar for all: chosen at run time by
// the bool stride (true: a vector, false: element 0 everywhere).
template <typename T, typename TileShape>
using ColOrScalar = fusion::Sm90ColBroadcast<0, TileShape, T, T, Stride<bool, _0, _0>, 1>;
// One value per column, or one scalar for all.
template <typename T, typename TileShape>
using RowOrScalar = fusion::Sm90RowBroadcast<0, TileShape, T, T, Stride<_0, bool, _0>>;
// A per-column vector; nullptr reads as the Arguments' null_default.
template <typename T, typename TileShape>
using RowVec = fusion::Sm90RowBroadcast<0, TileShape, T, T, Stride<_0, _1, _0>>;
// A per-row vector; nullptr reads as the Arguments' null_default.
template <typename T, typename TileShape>
using ColVec = fusion::Sm90ColBroadcast<0, TileShape, T, T, Stride<_1, _0, _0>, 1>;

// The problem as CUTLASS sees it. Without SWAP_AB: D[m, n] = A[m, k] B[k, n] with A the
// activations. With SWAP_AB: D'[n, m] = W[n, k] A^T[k, m], the weight fills the 64-row wgmma
// tile and the few tokens are the narrow N side; D' is written column-major, i.e. out row-major.
// Either way the activations' per-token vectors run along the tokens' mode and the weight's
// per-channel vectors along the other, which the two helpers below pick.
template <typename T, typename TileShape, bool SWAP_AB>
using TokenOrScalar =
    std::conditional_t<SWAP_AB, RowOrScalar<T, TileShape>, ColOrScalar<T, TileShape>>;
template <typename T, typename TileShape, bool SWAP_AB>
using ChannelOrScalar =
    std::conditional_t<SWAP_AB, ColOrScalar<T, TileShape>, RowOrScalar<T, TileShape>>;
template <typename T, typename TileShape, bool SWAP_AB>
using TokenVec = std::conditional_t<SWAP_AB, RowVec<T, TileShape>, ColVec<T, TileShape>>;
template <typename T, typename TileShape, bool SWAP_AB>
using ChannelVec = std::conditional_t<SWAP_AB, ColVec<T, TileShape>, RowVec<T, TileShape>>;

// Arguments of the vector-or-scalar broadcasts: the bool stride says which.
template <typename T, typename TileShape>
typename ColOrScalar<T, TileShape>::Arguments col_or_scalar_args(const T* ptr, bool is_vector) {
  return {ptr, T(0), {is_vector, _0{}, _0{}}};
}
template <typename T, typename TileShape>
typename RowOrScalar<T, TileShape>::Arguments row_or_scalar_args(const T* ptr, bool is_vector) {
  return {ptr, T(0), {_0{}, is_vector, _0{}}};
}
template <typename T, typename TileShape, bool SWAP_AB>
typename TokenOrScalar<T, TileShape, SWAP_AB>::Arguments token_args(const T* ptr, bool is_vector) {
  if constexpr (SWAP_AB) {
    return row_or_scalar_args<T, TileShape>(ptr, is_vector);
  } else {
    return col_or_scalar_args<T, TileShape>(ptr, is_vector);
  }
}
template <typename T, typename TileShape, bool SWAP_AB>
typename ChannelOrScalar<T, TileShape, SWAP_AB>::Arguments channel_args(const T* ptr,
                                                                        bool is_vector) {
  if constexpr (SWAP_AB) {
    return col_or_scalar_args<T, TileShape>(ptr, is_vector);
  } else {
    return row_or_scalar_args<T, TileShape>(ptr, is_vector);
  }
}

// out = a_scale * (b_scale * acc) + bias, fp32, rounded once to OutT. bias nullptr reads 0.
template <typename OutT, typename TileShape, bool SWAP_AB>
struct ScaledEpilogue {
  using ScaleA = TokenOrScalar<float, TileShape, SWAP_AB>;
  using ScaleB = ChannelOrScalar<float, TileShape, SWAP_AB>;
  using Bias = ChannelVec<OutT, TileShape, SWAP_AB>;
  using ScaleBAcc = fusion::Sm90EVT<fusion::Sm90Compute<cutlass::multiplies, float, float, kRound>,
                                    ScaleB, fusion::Sm90AccFetch>;
  using EVT =
      fusion::Sm90EVT<fusion::Sm90Compute<cutlass::homogeneous_multiply_add, OutT, float, kRound>,
                      ScaleA, ScaleBAcc, Bias>;

  static typename EVT::Arguments args(const ScaledMmParams& p) {
    return {token_args<float, TileShape, SWAP_AB>(p.a_scales, p.a_per_token),
            {channel_args<float, TileShape, SWAP_AB>(p.b_scales, p.b_per_channel), {}, {}},
            {static_cast<const OutT*>(p.bias), OutT(0), {}},
            {}};
  }
};

// vLLM's zero-point epilogue: out = a_scale * (b_scale * float(acc - azp * azp_adj)) + bias, the
// correction in int32. azp nullptr reads 1 (per-tensor: azp_adj already holds zp * colsum).
template <typename OutT, typename TileShape, bool SWAP_AB>
struct AzpEpilogue {
  static_assert(!SWAP_AB, "the zero-point epilogue is instantiated for the unswapped GEMM only");
  using ScaleA = TokenOrScalar<float, TileShape, false>;
  using ScaleB = ChannelOrScalar<float, TileShape, false>;
  using Bias = ChannelVec<OutT, TileShape, false>;
  using Azp = TokenVec<int32_t, TileShape, false>;
  using AzpAdj = ChannelVec<int32_t, TileShape, false>;
  using AzpTimesAdj =
      fusion::Sm90EVT<fusion::Sm90Compute<cutlass::multiplies, int32_t, int32_t, kRound>, Azp,
                      AzpAdj>;
  using Corrected = fusion::Sm90EVT<fusion::Sm90Compute<cutlass::minus, float, int32_t, kRound>,
                                    fusion::Sm90AccFetch, AzpTimesAdj>;
  using ScaleBAcc = fusion::Sm90EVT<fusion::Sm90Compute<cutlass::multiplies, float, float, kRound>,
                                    ScaleB, Corrected>;
  using EVT =
      fusion::Sm90EVT<fusion::Sm90Compute<cutlass::homogeneous_multiply_add, OutT, float, kRound>,
                      ScaleA, ScaleBAcc, Bias>;

  static typename EVT::Arguments args(const ScaledMmParams& p) {
    return {token_args<float, TileShape, false>(p.a_scales, p.a_per_token),
            {channel_args<float, TileShape, false>(p.b_scales, p.b_per_channel),
             {{}, {{p.azp, int32_t(1), {}}, {p.azp_adj, int32_t(0), {}}, {}}, {}},
             {}},
            {static_cast<const OutT*>(p.bias), OutT(0), {}},
            {}};
  }
};

// A tile configuration: CTA tile (M, N, K of the GEMM CUTLASS sees), cluster, kernel and epilogue
// schedules, and whether the GEMM is computed transposed (see TokenOrScalar).
template <typename TILE, typename CLUSTER, typename KERNEL_SCHEDULE, typename EPILOGUE_SCHEDULE,
          bool SWAP_AB>
struct Sm90Tile {
  using TileShape = TILE;
  using ClusterShape = CLUSTER;
  using KernelSchedule = KERNEL_SCHEDULE;
  using EpilogueSchedule = EPILOGUE_SCHEDULE;
  static constexpr bool kSwapAB = SWAP_AB;
};

// The CUTLASS kernel of one (operand type, output type, tile, epilogue).
template <typename ElementAB, typename OutT, typename Tile,
          template <typename, typename, bool> class Epilogue>
struct Sm90ScaledMm {
  static constexpr bool kSwapAB = Tile::kSwapAB;
  using TileShape = typename Tile::TileShape;
  using ElementAcc = std::conditional_t<std::is_same_v<ElementAB, int8_t>, int32_t, float>;
  using Fusion = Epilogue<OutT, TileShape, kSwapAB>;
  // Both operands are K-major (A row-major, B column-major) swapped or not; only D flips.
  using LayoutA = cutlass::layout::RowMajor;
  using LayoutB = cutlass::layout::ColumnMajor;
  using LayoutD =
      std::conditional_t<kSwapAB, cutlass::layout::ColumnMajor, cutlass::layout::RowMajor>;
  static constexpr int kAlignAB = 128 / cutlass::sizeof_bits<ElementAB>::value;
  static constexpr int kAlignD = 128 / cutlass::sizeof_bits<OutT>::value;

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, typename Tile::ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, ElementAcc, float, void, LayoutD, kAlignD,
      OutT, LayoutD, kAlignD, typename Tile::EpilogueSchedule, typename Fusion::EVT>::CollectiveOp;
  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementAB, LayoutA, kAlignAB, ElementAB,
      LayoutB, kAlignAB, ElementAcc, TileShape, typename Tile::ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      typename Tile::KernelSchedule>::CollectiveOp;
  using GemmKernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>,
                                                          CollectiveMainloop, CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;
};

// Initializes and launches a CUTLASS device GEMM on `stream`. The kernels here need no workspace
// (a data-parallel persistent schedule), which keeps the launch graph-capturable; a kernel that
// asked for one would be refused here, not silently given a stale pointer.
template <typename Gemm>
cudaError_t run_cutlass_gemm(typename Gemm::Arguments args, const char* what, cudaStream_t stream) {
  cudaGetDevice(&args.hw_info.device_id);
  // The persistent tile scheduler sizes its grid by the SM count; CUTLASS would otherwise ask
  // on every launch (0, unknown, lets it ask).
  args.hw_info.sm_count = current_device_sm_count();
  Gemm gemm;
  if (Gemm::get_workspace_size(args) != 0) {
    std::fprintf(stderr, "pyorch: %s: this CUTLASS kernel wants a workspace\n", what);
    return cudaErrorNotSupported;
  }
  cutlass::Status status = gemm.can_implement(args);
  if (status != cutlass::Status::kSuccess) {
    std::fprintf(stderr, "pyorch: %s: CUTLASS cannot run this problem: %s\n", what,
                 cutlassGetStatusString(status));
    return cudaErrorInvalidValue;
  }
  status = gemm.initialize(args, nullptr, stream);
  if (status == cutlass::Status::kSuccess) status = gemm.run(stream);
  if (status != cutlass::Status::kSuccess) {
    const cudaError_t err = cudaGetLastError();
    std::fprintf(stderr, "pyorch: %s: CUTLASS launch failed: %s\n", what,
                 cutlassGetStatusString(status));
    return err != cudaSuccess ? err : cudaErrorLaunchFailure;
  }
  return cudaGetLastError();
}

// Launches out = epilogue(A @ B) for one tile configuration (see Sm90ScaledMm).
template <typename ElementAB, typename OutT, typename Tile,
          template <typename, typename, bool> class Epilogue>
cudaError_t launch_scaled_mm_sm90(const ScaledMmParams& p, cudaStream_t stream) {
  using Kernel = Sm90ScaledMm<ElementAB, OutT, Tile, Epilogue>;
  using Gemm = typename Kernel::Gemm;
  using StrideA = typename Gemm::GemmKernel::StrideA;  // (rows, k, batch): (ld, 1, 0)
  using StrideB = typename Gemm::GemmKernel::StrideB;  // (cols, k, batch): (ld, 1, 0)
  using StrideD = typename Gemm::GemmKernel::StrideD;
  const auto* a = static_cast<const ElementAB*>(p.a);
  const auto* b = static_cast<const ElementAB*>(p.b);
  StrideA stride_a{};
  StrideB stride_b{};
  StrideD stride_d{};
  int gemm_m = static_cast<int>(p.m), gemm_n = static_cast<int>(p.n);
  if constexpr (Kernel::kSwapAB) {
    // D'[n, m] = W[n, k] A^T: the weight is CUTLASS's A, the activations its B, and D' column-
    // major with leading dimension out_stride is out row-major.
    std::swap(a, b);
    std::swap(gemm_m, gemm_n);
    get<0>(stride_a) = p.b_stride;
    get<0>(stride_b) = p.a_stride;
    get<1>(stride_d) = p.out_stride;
  } else {
    get<0>(stride_a) = p.a_stride;
    get<0>(stride_b) = p.b_stride;
    get<0>(stride_d) = p.out_stride;
  }
  typename Gemm::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGemm,
      {gemm_m, gemm_n, static_cast<int>(p.k), 1},
      {a, stride_a, b, stride_b},
      {Kernel::Fusion::args(p), nullptr, stride_d, static_cast<OutT*>(p.out), stride_d}};
  return run_cutlass_gemm<Gemm>(args, p.op, stream);
}

}  // namespace pyorch::kernels
