// Block-scaled fp8 (1 x 128 activation groups, 128 x 128 weight blocks) -> bf16 / fp16 on
// CUTLASS's sm90 blockwise mainloop, which applies each k block's scales to the wgmma partial
// sums in registers before adding them to the fp32 accumulator; bias in the epilogue (2 kernels).
#ifdef PYORCH_WITH_CUTLASS

#include "cutlass/detail/blockwise_scale_layout.hpp"

#include "quantization/scaled_mm_sm90.cuh"

namespace pyorch::kernels {

namespace {

using Fp8 = cutlass::float_e4m3_t;
using TileShape = Shape<_128, _128, _128>;  // k: one scale group per k tile
using ClusterShape = Shape<_1, _2, _1>;
// SFA m-major (loaded by TMA: 128 scales of one k block per tile), SFB k-major (the
// checkpoint's [n / 128, k / 128] layout, one scale per tile and k block).
using ScaleConfig =
    cutlass::detail::Sm90BlockwiseScaleConfig<1, kScaledMmBlockN, kScaledMmBlockK,
                                              cute::GMMA::Major::MN, cute::GMMA::Major::K>;
using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());

// out = acc + bias (the scales are already in acc), rounded once to OutT; bias nullptr reads 0.
template <typename OutT>
struct BlockwiseBiasEpilogue {
  using EVT = fusion::Sm90EVT<fusion::Sm90Compute<cutlass::plus, OutT, float, kRound>,
                              fusion::Sm90AccFetch, RowVec<OutT, TileShape>>;
};

template <typename OutT>
struct BlockwiseGemm {
  using BiasEpilogue = BlockwiseBiasEpilogue<OutT>;
  static constexpr int kAlignD = 128 / cutlass::sizeof_bits<OutT>::value;
  using LayoutD = cutlass::layout::RowMajor;
  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, LayoutD, kAlignD, OutT,
      LayoutD, kAlignD, cutlass::epilogue::TmaWarpSpecializedCooperative,
      typename BiasEpilogue::EVT>::CollectiveOp;
  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Fp8,
      cute::tuple<cutlass::layout::RowMajor, LayoutSFA>, 16, Fp8,
      cute::tuple<cutlass::layout::ColumnMajor, LayoutSFB>, 16, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      cutlass::gemm::KernelTmaWarpSpecializedCooperativeFP8Blockwise>::CollectiveOp;
  using GemmKernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>,
                                                          CollectiveMainloop, CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;
};

template <typename OutT>
cudaError_t launch(const ScaledMmParams& p, cudaStream_t stream) {
  using Gemm = typename BlockwiseGemm<OutT>::Gemm;
  typename Gemm::GemmKernel::StrideA stride_a{};
  typename Gemm::GemmKernel::StrideB stride_b{};
  typename Gemm::GemmKernel::StrideD stride_d{};
  get<0>(stride_a) = p.a_stride;
  get<0>(stride_b) = p.b_stride;
  get<0>(stride_d) = p.out_stride;
  const int m = static_cast<int>(p.m), n = static_cast<int>(p.n), k = static_cast<int>(p.k);
  const int k_groups = static_cast<int>(p.k / kScaledMmBlockK);
  const int sfa_stride = static_cast<int>(p.a_scales_stride);
  // ((1, m4), (128, k / 128), batch): scale (i, g) at g * a_scales_stride + i. The TMA that loads
  // the scales needs the m extent a multiple of 4 (16 bytes; CUTLASS's can_implement refuses it
  // otherwise), so it is rounded up: a_scales_stride >= m4 (a multiple of 4 >= m), and the extra
  // scales only meet rows past m, whose A rows TMA fills with zeros and whose outputs are never
  // stored.
  const int m4 = (m + 3) / 4 * 4;
  const LayoutSFA layout_sfa = make_layout(
      make_shape(make_shape(_1{}, m4), make_shape(Int<kScaledMmBlockK>{}, k_groups), 1),
      make_stride(make_stride(_0{}, _1{}), make_stride(_0{}, sfa_stride), sfa_stride * k_groups));
  // ((128, ceil(n / 128)), (128, k / 128), batch): scale (g, jb) at jb * (k / 128) + g.
  const LayoutSFB layout_sfb = ScaleConfig::tile_atom_to_shape_SFB(make_shape(m, n, k, 1));
  typename Gemm::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGemm,
      {m, n, k, 1},
      {static_cast<const Fp8*>(p.a), stride_a, static_cast<const Fp8*>(p.b), stride_b, p.a_scales,
       layout_sfa, p.b_scales, layout_sfb},
      {{{}, {static_cast<const OutT*>(p.bias), OutT(0), {}}, {}},
       nullptr,
       stride_d,
       static_cast<OutT*>(p.out),
       stride_d}};
  return run_cutlass_gemm<Gemm>(args, p.op, stream);
}

}  // namespace

cudaError_t launch_scaled_mm_blockwise(const ScaledMmParams& p, cudaStream_t stream) {
  if (p.out_dtype == DType::kBFloat16) return launch<cutlass::bfloat16_t>(p, stream);
  return launch<cutlass::half_t>(p, stream);
}

}  // namespace pyorch::kernels

#endif  // PYORCH_WITH_CUTLASS
