// Frozen LM head forward, one GEMM with its epilogue fused (CUTLASS 3, Hopper warp-specialised):
//   P~[m, n] = exp(scale * (X[m] . W[n]) - ref[m])     stored in bf16
//   sum_e[b, m]  = sum over the n of CTA column block b of P~[m, n]             (fp32 partials, m-major)
//   sum_ez[b, m] = sum over the same n of P~[m, n] * (scale * X[m].W[n] - ref[m])  (only when its pointer is set)
// X: [M, K] row-major, W: [N, K] row-major (the head's weight rows), P~: [M, N] with leading dimension ldp.
#include <cuda_runtime.h>

#include "cutlass/cutlass.h"
#include "cute/tensor.hpp"
#include "cutlass/numeric_types.h"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp"

#ifndef TILE_M
#define TILE_M 128
#endif
#ifndef TILE_N
#define TILE_N 128
#endif
#ifndef TILE_K
#define TILE_K 64
#endif
#ifndef CLUSTER_M
#define CLUSTER_M 1
#endif
#ifndef CLUSTER_N
#define CLUSTER_N 2
#endif
#ifndef PINGPONG
#define PINGPONG 1
#endif
#ifndef DAG
#define DAG 0
#endif
#ifndef EPI_M
#define EPI_M 0
#endif
#ifndef EPI_N
#define EPI_N 0
#endif

using namespace cute;
namespace fusion = cutlass::epilogue::fusion;

template <class T>
struct ExpOp;

template <int N>
struct ExpOp<cutlass::Array<float, N>> {
  CUTLASS_HOST_DEVICE cutlass::Array<float, N> operator()(cutlass::Array<float, N> const& x) const {
    cutlass::Array<float, N> y;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < N; ++i) {
      y[i] = exp2f(x[i] * 1.4426950408889634f);
    }
    return y;
  }
};

// The root passes its first child through; the second is there for its side effect (a reduction).
template <class T>
struct FirstOp {
  CUTLASS_HOST_DEVICE T operator()(T const& a, T const& b) const { return a; }
};

using ElementX = cutlass::bfloat16_t;
using ElementW = cutlass::bfloat16_t;
using ElementP = cutlass::bfloat16_t;
using LayoutX = cutlass::layout::RowMajor;
using LayoutW = cutlass::layout::ColumnMajor;  // W[N, K] row-major is B[K, N] column-major
using LayoutP = cutlass::layout::RowMajor;
constexpr int kAlign = 8;
constexpr auto kRound = cutlass::FloatRoundStyle::round_to_nearest;

using TileShape = Shape<Int<TILE_M>, Int<TILE_N>, Int<TILE_K>>;
using ClusterShape = Shape<Int<CLUSTER_M>, Int<CLUSTER_N>, _1>;
#if PINGPONG
using MainloopSchedule = cutlass::gemm::KernelTmaWarpSpecializedPingpong;
using EpilogueSchedule = cutlass::epilogue::TmaWarpSpecialized;
#else
using MainloopSchedule = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
using EpilogueSchedule = cutlass::epilogue::TmaWarpSpecializedCooperative;
#endif

using RowStride = Stride<_1, _0, int64_t>;
// z' = scale * acc + (-ref[m])
using Shifted = fusion::Sm90EVT<fusion::Sm90Compute<cutlass::homogeneous_multiply_add, float, float, kRound>,
                                fusion::Sm90ScalarBroadcast<float>, fusion::Sm90AccFetch,
                                fusion::Sm90ColBroadcast<0, TileShape, float, float, RowStride>>;
using Expd = fusion::Sm90EVT<fusion::Sm90Compute<ExpOp, float, float, kRound>, Shifted>;
template <class Child>
using RowSum = fusion::Sm90EVT<fusion::Sm90ColReduction<cutlass::plus, cutlass::plus, cutlass::plus, 0, TileShape,
                                                        float, float, kRound, RowStride, 4, true, false>,
                               Child>;
using RowSumOp = fusion::Sm90ColReduction<cutlass::plus, cutlass::plus, cutlass::plus, 0, TileShape, float, float,
                                          kRound, RowStride, 4, true, false>;
#if DAG
// The same graph with shared nodes: z' and e^z' computed once per element.
//   0 acc, 1 scale, 2 -ref, 3 z' = scale*acc - ref, 4 e = exp(z'), 5 sum e, 6 e*z', 7 sum e*z', 8 out = e
using Fusion = fusion::Sm90TopologicalVisitor<
    float,
    cute::tuple<cute::seq<>, cute::seq<>, cute::seq<>, cute::seq<1, 0, 2>, cute::seq<3>, cute::seq<4>,
                cute::seq<4, 3>, cute::seq<6>, cute::seq<5, 7>>,
    fusion::Sm90AccFetch, fusion::Sm90ScalarBroadcast<float>,
    fusion::Sm90ColBroadcast<0, TileShape, float, float, RowStride>,
    fusion::Sm90Compute<cutlass::homogeneous_multiply_add, float, float, kRound>,
    fusion::Sm90Compute<ExpOp, float, float, kRound>, RowSumOp,
    fusion::Sm90Compute<cutlass::multiplies, float, float, kRound>, RowSumOp,
    fusion::Sm90Compute<FirstOp, ElementP, float, kRound>>;
#else
using SumE = RowSum<Expd>;
using SumEZ = RowSum<fusion::Sm90EVT<fusion::Sm90Compute<cutlass::multiplies, float, float, kRound>, Expd, Shifted>>;
using Fusion = fusion::Sm90EVT<fusion::Sm90Compute<FirstOp, ElementP, float, kRound>, SumE, SumEZ>;
#endif
#if EPI_M
using EpilogueTile = Shape<Int<EPI_M>, Int<EPI_N>>;
#else
using EpilogueTile = cutlass::epilogue::collective::EpilogueTileAuto;
#endif

using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
    EpilogueTile, float, float, void, LayoutP, kAlign, ElementP, LayoutP, kAlign,
    EpilogueSchedule, Fusion>::CollectiveOp;

using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementX, LayoutX, kAlign, ElementW, LayoutW, kAlign, float,
    TileShape, ClusterShape,
    cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
        sizeof(typename CollectiveEpilogue::SharedStorage))>,
    MainloopSchedule>::CollectiveOp;

using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, CollectiveMainloop, CollectiveEpilogue>;
using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

static typename Gemm::Arguments make_arguments(const void* x, const void* w, const float* neg_ref, void* p,
                                               float* sum_e, float* sum_ez, int m, int n, int k, long ldx, long ldw,
                                               long ldp, float scale) {
  using StrideX = typename Kernel::StrideA;
  using StrideW = typename Kernel::StrideB;
  using StrideP = typename Kernel::StrideD;
  StrideX stride_x = make_stride(int64_t(ldx), _1{}, int64_t(0));
  StrideW stride_w = make_stride(int64_t(ldw), _1{}, int64_t(0));
  StrideP stride_p = make_stride(int64_t(ldp), _1{}, int64_t(0));
#if DAG
  typename Fusion::Arguments fusion_args{{}, {{scale}}, {neg_ref, 0.0f, {}}, {}, {}, {sum_e, 0.0f, {}}, {},
                                         {sum_ez, 0.0f, {}}, {}};
#else
  typename Shifted::Arguments shifted{{{scale}}, {}, {neg_ref, 0.0f, {}}, {}};
  typename Expd::Arguments expd{shifted, {}};
  typename SumE::Arguments sum_e_args{expd, {sum_e, 0.0f, {}}};
  typename SumEZ::Arguments sum_ez_args{{expd, shifted, {}}, {sum_ez, 0.0f, {}}};
  typename Fusion::Arguments fusion_args{sum_e_args, sum_ez_args, {}};
#endif
  return typename Gemm::Arguments{
      cutlass::gemm::GemmUniversalMode::kGemm,
      {m, n, k, 1},
      {static_cast<const ElementX*>(x), stride_x, static_cast<const ElementW*>(w), stride_w},
      {fusion_args, nullptr, stride_p, static_cast<ElementP*>(p), stride_p}};
}

extern "C" {

// Column blocks of the partial sums: sum_e / sum_ez hold [blocks, round_up(m, TILE_M)] floats.
int grpo_frozen_tile_n() { return TILE_N; }
int grpo_frozen_tile_m() { return TILE_M; }

size_t grpo_frozen_workspace_size(int m, int n, int k) {
  auto args = make_arguments(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, m, n, k, k, k, n, 1.0f);
  return Gemm::get_workspace_size(args);
}

// 0 on success, else a cutlass::Status code (+100 when the shape cannot be run, +200 for a launch failure).
int grpo_frozen_forward(const void* x, const void* w, const float* neg_ref, void* p, float* sum_e, float* sum_ez, int m,
                        int n, int k, long ldx, long ldw, long ldp, float scale, void* workspace, cudaStream_t stream) {
  auto args = make_arguments(x, w, neg_ref, p, sum_e, sum_ez, m, n, k, ldx, ldw, ldp, scale);
  Gemm gemm;
  cutlass::Status status = gemm.can_implement(args);
  if (status != cutlass::Status::kSuccess) return 100 + int(status);
  status = gemm.initialize(args, workspace, stream);
  if (status != cutlass::Status::kSuccess) return 200 + int(status);
  status = gemm.run(stream);
  if (status != cutlass::Status::kSuccess) return 300 + int(status);
  return 0;
}
}
