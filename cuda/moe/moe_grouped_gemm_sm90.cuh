// The expert GEMM of the MoE prefill path on Hopper: a CUTLASS 3.x ptr-array grouped GEMM
// (wgmma + TMA, warp-specialized, persistent), one problem per expert over the expert-sorted rows
// moe_grouped_permute wrote. out[r] = a[r] @ weight[e]^T for r in [offsets[e], offsets[e + 1]).
//
// The per-expert problems (sizes, pointers, strides) are written on the device by
// moe_grouped_setup_kernel from expert_offsets, so the host never reads the routing: the launch is
// CUDA-graph safe and every size is a function of the shapes only. An expert with no row is a
// 0-row problem the tile scheduler skips.
//
// Two forms (Sm90GroupedTile::kSwapAB):
//   plain:   D[m_e, N] = A[m_e, K] B[K, N], A the rows (row-major), B = weight[e] (K-major), D
//            row-major. For many rows per expert (prefill).
//   swapped: D'[N, m_e] = weight[e][N, K] rows^T: the weight fills the 128-row wgmma side and the
//            few rows per expert are the narrow tile side; D' column-major is out row-major.
// Included only by the .cu files that instantiate it, and only when CUTLASS is there.
#pragma once

#include <cstdint>
#include <cstdio>

#include <cuda_runtime.h>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"

#include "moe/moe_grouped_internal.h"

namespace pyorch::kernels {

using namespace cute;  // NOLINT: CuTe's shape vocabulary (_1, Shape) reads best unqualified

template <typename TILE, typename CLUSTER, typename KERNEL_SCHEDULE, typename EPILOGUE_SCHEDULE,
          bool SWAP_AB>
struct Sm90GroupedTile {
  using TileShape = TILE;
  using ClusterShape = CLUSTER;
  using KernelSchedule = KERNEL_SCHEDULE;
  using EpilogueSchedule = EPILOGUE_SCHEDULE;
  static constexpr bool kSwapAB = SWAP_AB;
};

// The CUTLASS kernel of one (operand type, output type, tile). D = alpha[e] * acc, alpha[e] read
// from a per-expert array when one is given (fp8: activation scale x expert weight scale), else 1.
template <typename ElementAB, typename OutT, typename Tile>
struct Sm90GroupedGemm {
  static constexpr bool kSwapAB = Tile::kSwapAB;
  using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;
  using LayoutA = cutlass::layout::RowMajor;
  using LayoutB = cutlass::layout::ColumnMajor;
  using LayoutD =
      std::conditional_t<kSwapAB, cutlass::layout::ColumnMajor, cutlass::layout::RowMajor>;
  static constexpr int kAlignAB = 128 / cutlass::sizeof_bits<ElementAB>::value;
  static constexpr int kAlignD = 128 / cutlass::sizeof_bits<OutT>::value;
  using Fusion = cutlass::epilogue::fusion::LinearCombination<OutT, float, void, float>;

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, typename Tile::TileShape,
      typename Tile::ClusterShape, cutlass::epilogue::collective::EpilogueTileAuto, float, float,
      void, LayoutD*, kAlignD, OutT, LayoutD*, kAlignD, typename Tile::EpilogueSchedule,
      Fusion>::CollectiveOp;
  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementAB, LayoutA*, kAlignAB, ElementAB,
      LayoutB*, kAlignAB, float, typename Tile::TileShape, typename Tile::ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      typename Tile::KernelSchedule>::CollectiveOp;
  using GemmKernel =
      cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;
  using StrideA = typename GemmKernel::InternalStrideA;
  using StrideB = typename GemmKernel::InternalStrideB;
  using StrideD = typename GemmKernel::InternalStrideD;
  using Shape3 = typename ProblemShape::UnderlyingProblemShape;

  // The per-expert arrays the kernel reads, carved from the caller's workspace.
  struct Groups {
    Shape3* problems;
    const ElementAB** a;
    const ElementAB** b;
    OutT** d;
    StrideA* stride_a;
    StrideB* stride_b;
    StrideD* stride_d;
    const float** alpha;  // per-expert alpha pointers (fp8), unused when alpha is null
  };

  static size_t groups_bytes(int64_t num_experts) {
    const size_t e = static_cast<size_t>(num_experts);
    auto round = [](size_t b) { return (b + 127) / 128 * 128; };
    return round(e * sizeof(Shape3)) + 4 * round(e * sizeof(void*)) + round(e * sizeof(StrideA)) +
           round(e * sizeof(StrideB)) + round(e * sizeof(StrideD));
  }

  static Groups carve(void* workspace, int64_t num_experts) {
    const size_t e = static_cast<size_t>(num_experts);
    auto round = [](size_t b) { return (b + 127) / 128 * 128; };
    auto* p = static_cast<unsigned char*>(workspace);
    Groups g{};
    g.problems = reinterpret_cast<Shape3*>(p);
    p += round(e * sizeof(Shape3));
    g.a = reinterpret_cast<const ElementAB**>(p);
    p += round(e * sizeof(void*));
    g.b = reinterpret_cast<const ElementAB**>(p);
    p += round(e * sizeof(void*));
    g.d = reinterpret_cast<OutT**>(p);
    p += round(e * sizeof(void*));
    g.alpha = reinterpret_cast<const float**>(p);
    p += round(e * sizeof(void*));
    g.stride_a = reinterpret_cast<StrideA*>(p);
    p += round(e * sizeof(StrideA));
    g.stride_b = reinterpret_cast<StrideB*>(p);
    p += round(e * sizeof(StrideB));
    g.stride_d = reinterpret_cast<StrideD*>(p);
    return g;
  }

  static typename Gemm::Arguments arguments(const Groups& g, int64_t num_experts,
                                            const float* alpha, int sm_count, int device) {
    typename Gemm::Arguments args{};
    args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
    args.problem_shape = {static_cast<int>(num_experts), g.problems, nullptr};
    args.mainloop = {g.a, g.stride_a, g.b, g.stride_b};
    auto& fusion = args.epilogue.thread;
    fusion.alpha = 1.f;
    fusion.beta = 0.f;
    fusion.alpha_ptr = nullptr;
    fusion.beta_ptr = nullptr;
    fusion.alpha_ptr_array = alpha != nullptr ? g.alpha : nullptr;
    fusion.beta_ptr_array = nullptr;
    fusion.dAlpha = {_0{}, _0{}, alpha != nullptr ? 1 : 0};
    fusion.dBeta = {_0{}, _0{}, 0};
    args.epilogue.ptr_C = nullptr;
    args.epilogue.dC = g.stride_d;
    args.epilogue.ptr_D = g.d;
    args.epilogue.dD = g.stride_d;
    args.hw_info.device_id = device;
    args.hw_info.sm_count = sm_count;
    return args;
  }
};

// One thread per expert: its problem, pointers and strides (see the file comment for the forms).
template <typename G>
__global__ void moe_grouped_setup_kernel(typename G::Groups g, const int32_t* offsets,
                                         const void* a, const void* weight, void* out,
                                         const float* alpha, int num_experts, int n, int k) {
  using ElementAB = std::remove_cv_t<std::remove_pointer_t<std::remove_pointer_t<decltype(g.a)>>>;
  using OutT = std::remove_pointer_t<std::remove_pointer_t<decltype(g.d)>>;
  const int e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e >= num_experts) return;
  const int64_t row0 = offsets[e];
  const int m = offsets[e + 1] - offsets[e];
  const auto* rows = static_cast<const ElementAB*>(a) + row0 * k;
  const auto* w = static_cast<const ElementAB*>(weight) + static_cast<int64_t>(e) * n * k;
  g.d[e] = static_cast<OutT*>(out) + row0 * n;
  // Both operands K-major with leading dimension K; D row-major (ld N), or column-major (ld N)
  // when swapped, which is the same memory.
  typename G::StrideA stride_a{};
  typename G::StrideB stride_b{};
  typename G::StrideD stride_d{};
  get<0>(stride_a) = k;
  get<0>(stride_b) = k;
  if constexpr (G::kSwapAB) {
    g.problems[e] = typename G::Shape3(n, m, k);
    g.a[e] = w;
    g.b[e] = rows;
    get<1>(stride_d) = n;
  } else {
    g.problems[e] = typename G::Shape3(m, n, k);
    g.a[e] = rows;
    g.b[e] = w;
    get<0>(stride_d) = n;
  }
  g.stride_a[e] = stride_a;
  g.stride_b[e] = stride_b;
  g.stride_d[e] = stride_d;
  if (alpha != nullptr) g.alpha[e] = alpha + e;
}

// The device workspace one launch needs: the per-expert arrays, then CUTLASS's own (the
// per-SM TMA descriptors of the ptr-array kernel).
template <typename ElementAB, typename OutT, typename Tile>
size_t grouped_gemm_workspace(int64_t num_experts, int sm_count, int device) {
  using G = Sm90GroupedGemm<ElementAB, OutT, Tile>;
  typename G::Groups none{};
  const auto args = G::arguments(none, num_experts, nullptr, sm_count, device);
  return G::groups_bytes(num_experts) + G::Gemm::get_workspace_size(args) + 128;
}

template <typename ElementAB, typename OutT, typename Tile>
cudaError_t launch_grouped_gemm(const MoeGroupedGemmParams& p, cudaStream_t stream) {
  using G = Sm90GroupedGemm<ElementAB, OutT, Tile>;
  const int64_t e = p.num_experts;
  if (p.workspace_bytes < grouped_gemm_workspace<ElementAB, OutT, Tile>(e, p.sm_count, p.device)) {
    std::fprintf(stderr, "pyorch: moe_grouped_gemm: workspace of %zu bytes is too small\n",
                 p.workspace_bytes);
    return cudaErrorInvalidValue;
  }
  const typename G::Groups g = G::carve(p.workspace, e);
  const int threads = 128;
  moe_grouped_setup_kernel<G>
      <<<static_cast<unsigned>((e + threads - 1) / threads), threads, 0, stream>>>(
          g, p.expert_offsets, p.a, p.weight, p.out, p.alpha, static_cast<int>(e),
          static_cast<int>(p.n), static_cast<int>(p.k));
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  const auto args = G::arguments(g, e, p.alpha, p.sm_count, p.device);
  // CUTLASS's workspace follows the arrays, 128-byte aligned.
  unsigned char* cutlass_ws = static_cast<unsigned char*>(p.workspace) + G::groups_bytes(e);
  typename G::Gemm gemm;
  cutlass::Status status = gemm.can_implement(args);
  if (status != cutlass::Status::kSuccess) {
    std::fprintf(stderr, "pyorch: moe_grouped_gemm: CUTLASS cannot run this problem: %s\n",
                 cutlassGetStatusString(status));
    return cudaErrorInvalidValue;
  }
  status = gemm.initialize(args, cutlass_ws, stream);
  if (status == cutlass::Status::kSuccess) status = gemm.run(stream);
  if (status != cutlass::Status::kSuccess) {
    err = cudaGetLastError();
    std::fprintf(stderr, "pyorch: moe_grouped_gemm: CUTLASS launch failed: %s\n",
                 cutlassGetStatusString(status));
    return err != cudaSuccess ? err : cudaErrorLaunchFailure;
  }
  return cudaGetLastError();
}

}  // namespace pyorch::kernels
