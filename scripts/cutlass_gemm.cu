// CUTLASS 3.x (CUTLASS 4.x headers, the nvidia-cutlass PyPI wheel) Hopper GEMMs next to ours (issue 9): the same
// problem as templates/gemm_wgmma.cu.j2's gemm_wg256_f16, D[M, N] = alpha * A[M, K] @ W[N, K]^T + beta * C[M, N].
// A fp16 row-major (K-major), W fp16 [N, K] row-major, i.e. CUTLASS's B (K x N) column-major: both operands
// K-major, a "TN" GEMM. fp32 accumulate; C and D float32 [M, N] row-major. beta = 1 with C == D is our residual add
// in place (mode 1; the TMA epilogue reads each C tile before it stores the same D tile), beta = 0 our plain store
// (mode 0; C is then not read at all, and C_in may be null).
//
// Built by scripts/build_cutlass_gemm.sh, measured by scripts/bench_cutlass.py. C ABI:
//   int         cutlass_gemm_count(void)                  number of configs
//   const char* cutlass_gemm_name(int config)             what config i is (schedule, tile, cluster, stages, smem)
//   size_t      cutlass_gemm_workspace(int config, M, N, K)   bytes of workspace run needs (0 for most)
//   int         cutlass_gemm_run(config, M, N, K, A, W, C_in, D, alpha, beta, workspace, ws_bytes, stream)
//               0 on success; 1 can_implement refused, 2 workspace too small, 3 initialize failed, 4 launch failed,
//               -1 no such config. cutlass_gemm_last_error() says more.
//   const char* cutlass_gemm_last_error(void)
// The Params a run builds (TMA descriptors: host work) are cached per config and reused while the call's arguments
// stay the same, the way our runtime binds a launch once; the workspace is re-initialised every run (stream-K).
//
// Compilation units: with -DCG_PART=i only kernel i is compiled (to measure nvcc's time per kernel), with
// -DCG_PART=-1 only the C ABI (which then links against the kernel objects); without CG_PART, everything.
#include <cstdio>
#include <cstring>

#include <cuda_runtime.h>

// The kernels: X(index, tile M, tile N, tile K, cluster M, cluster N, mainloop schedule, epilogue schedule,
// tile scheduler, label). Edit this list (and CG_CONFIGS below) to add one; build_cutlass_gemm.sh reads the count.
#define CG_KERNELS(X)                                                                                                  \
    X(0, 128, 256, 64, 1, 1, cutlass::gemm::KernelTmaWarpSpecializedCooperative,                                       \
      cutlass::epilogue::TmaWarpSpecializedCooperative, cutlass::gemm::PersistentScheduler, "cooperative persistent")  \
    X(1, 128, 256, 64, 2, 1, cutlass::gemm::KernelTmaWarpSpecializedCooperative,                                       \
      cutlass::epilogue::TmaWarpSpecializedCooperative, cutlass::gemm::PersistentScheduler, "cooperative persistent")  \
    X(2, 128, 128, 64, 1, 1, cutlass::gemm::KernelTmaWarpSpecializedPingpong, cutlass::epilogue::TmaWarpSpecialized,  \
      cutlass::gemm::PersistentScheduler, "pingpong persistent")                                                       \
    X(3, 64, 256, 64, 1, 1, cutlass::gemm::KernelTmaWarpSpecializedPingpong, cutlass::epilogue::TmaWarpSpecialized,   \
      cutlass::gemm::PersistentScheduler, "pingpong persistent")                                                       \
    X(4, 128, 256, 64, 1, 1, cutlass::gemm::KernelTmaWarpSpecializedCooperative,                                       \
      cutlass::epilogue::TmaWarpSpecializedCooperative, cutlass::gemm::StreamKScheduler, "cooperative stream-K")
#define CG_NKERNELS 5

// The configs the ABI numbers: {kernel, max swizzle (1, 2, 4, 8), raster order (0 heuristic, 1 along M, 2 along N)}.
// Swizzle and raster order are run-time arguments of the tile scheduler: more configs, no more compilation.
#define CG_CONFIGS                                                                                                     \
    {0, 1, 0}, {1, 1, 0}, {2, 1, 0}, {3, 1, 0}, {4, 1, 0}, {0, 8, 0}, {1, 8, 0}, {2, 8, 0}

struct CgCall {
    int M, N, K;
    const void* A;
    const void* W;
    void* C;
    void* D;
    float alpha, beta;
    void* ws;
    size_t ws_bytes;
    cudaStream_t stream;
    int swizzle, raster;
};

extern char cg_error[512];      // the last failure's message (defined with the ABI)

// One function template per entry point, specialised by kernel index: a kernel's compilation unit instantiates its
// own (explicit instantiation below), the ABI's only calls them, so each kernel can be compiled alone.
template <int I> int cg_run(const CgCall& c);
template <int I> size_t cg_workspace(const CgCall& c);
template <int I> const char* cg_name();

#if !defined(CG_PART) || CG_PART >= 0
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/kernel_hardware_info.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/operations.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/gemm/kernel/tile_scheduler.hpp"
#include "cutlass/util/packed_stride.hpp"

static void cg_set_error(const char* what, int kernel, const CgCall& c, cutlass::Status st) {
    snprintf(cg_error, sizeof cg_error, "kernel %d, M=%d N=%d K=%d: %s: %s (last CUDA error: %s)", kernel, c.M, c.N,
             c.K, what, cutlassGetStatusString(st), cudaGetErrorString(cudaGetLastError()));
}

namespace cg {          // (named: an anonymous one here clashes with cute's in nvcc's stub file)
using namespace cute;

static int cg_sm_count() {
    static int dev = -1, sms = 0;
    int d = 0;
    cudaGetDevice(&d);
    if (d != dev) {
        sms = cutlass::KernelHardwareInfo::query_device_multiprocessor_count(d);
        dev = d;
    }
    return sms;
}

template <int TM, int TN, int TK, int CM, int CN, class MainSched, class EpiSched, class TileSched>
struct CgKernel {
    using ElementA = cutlass::half_t;
    using ElementB = cutlass::half_t;
    using ElementC = float;
    using ElementD = float;
    using LayoutA = cutlass::layout::RowMajor;
    using LayoutB = cutlass::layout::ColumnMajor;     // W [N, K] row-major = B (K x N) column-major
    using LayoutC = cutlass::layout::RowMajor;
    using LayoutD = cutlass::layout::RowMajor;
    static constexpr int AlignA = 16 / sizeof(ElementA), AlignB = 16 / sizeof(ElementB);
    static constexpr int AlignC = 16 / sizeof(ElementC), AlignD = 16 / sizeof(ElementD);
    using TileShape = Shape<Int<TM>, Int<TN>, Int<TK>>;
    using ClusterShape = Shape<Int<CM>, Int<CN>, _1>;

    using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
        cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
        cutlass::epilogue::collective::EpilogueTileAuto, float, float, ElementC, LayoutC, AlignC, ElementD, LayoutD,
        AlignD, EpiSched,
        cutlass::epilogue::fusion::LinearCombination<ElementD, float, ElementC, float>>::CollectiveOp;

    using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
        cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA, LayoutA, AlignA, ElementB, LayoutB, AlignB,
        float, TileShape, ClusterShape,
        cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
            sizeof(typename CollectiveEpilogue::SharedStorage))>,
        MainSched>::CollectiveOp;

    using GemmKernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, CollectiveMainloop,
                                                            CollectiveEpilogue, TileSched>;
    using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;
    using Arguments = typename Gemm::Arguments;
    using Params = typename GemmKernel::Params;
    using RasterOrder = typename GemmKernel::TileScheduler::RasterOrderOptions;

    static Arguments arguments(const CgCall& c) {
        using StrideA = typename GemmKernel::StrideA;
        using StrideB = typename GemmKernel::StrideB;
        using StrideC = typename GemmKernel::StrideC;
        using StrideD = typename GemmKernel::StrideD;
        StrideA sA = cutlass::make_cute_packed_stride(StrideA{}, make_shape(c.M, c.K, 1));
        StrideB sB = cutlass::make_cute_packed_stride(StrideB{}, make_shape(c.N, c.K, 1));
        StrideC sC = cutlass::make_cute_packed_stride(StrideC{}, make_shape(c.M, c.N, 1));
        StrideD sD = cutlass::make_cute_packed_stride(StrideD{}, make_shape(c.M, c.N, 1));
        cutlass::KernelHardwareInfo hw;
        cudaGetDevice(&hw.device_id);
        hw.sm_count = cg_sm_count();
        Arguments args{cutlass::gemm::GemmUniversalMode::kGemm,
                       {c.M, c.N, c.K, 1},
                       {static_cast<const ElementA*>(c.A), sA, static_cast<const ElementB*>(c.W), sB},
                       {{}, static_cast<const ElementC*>(c.C ? c.C : c.D), sC, static_cast<ElementD*>(c.D), sD},
                       hw};
        args.epilogue.thread.alpha = c.alpha;
        args.epilogue.thread.beta = c.beta;
        args.scheduler.max_swizzle_size = c.swizzle;
        args.scheduler.raster_order = c.raster == 1 ? RasterOrder::AlongM
                                      : c.raster == 2 ? RasterOrder::AlongN
                                                      : RasterOrder::Heuristic;
        return args;
    }

    static size_t workspace(const CgCall& c) { return Gemm::get_workspace_size(arguments(c)); }

    static int run(int index, const CgCall& c) {
        static bool have = false, attr = false;
        static CgCall last;
        static Params params;
        Arguments args = arguments(c);
        cutlass::Status st;
        const bool same = have && last.M == c.M && last.N == c.N && last.K == c.K && last.A == c.A && last.W == c.W &&
                          last.C == c.C && last.D == c.D && last.alpha == c.alpha && last.beta == c.beta &&
                          last.ws == c.ws && last.ws_bytes == c.ws_bytes && last.swizzle == c.swizzle &&
                          last.raster == c.raster;
        if (!same) {
            have = false;
            st = Gemm::can_implement(args);
            if (st != cutlass::Status::kSuccess) {
                cg_set_error("can_implement", index, c, st);
                return 1;
            }
            if (Gemm::get_workspace_size(args) > c.ws_bytes) {
                snprintf(cg_error, sizeof cg_error, "kernel %d: workspace %zu bytes < %zu needed", index, c.ws_bytes,
                         Gemm::get_workspace_size(args));
                return 2;
            }
        }
        st = GemmKernel::initialize_workspace(args, c.ws, c.stream, nullptr);     // stream-K's flags; else nothing
        if (st != cutlass::Status::kSuccess) {
            cg_set_error("initialize_workspace", index, c, st);
            return 3;
        }
        if (!same) {
            params = GemmKernel::to_underlying_arguments(args, c.ws);
            if (!attr) {
                const int smem = GemmKernel::SharedStorageSize;
                if (smem >= (48 << 10) &&
                    cudaFuncSetAttribute(cutlass::device_kernel<GemmKernel>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, smem) != cudaSuccess) {
                    cg_set_error("cudaFuncSetAttribute", index, c, cutlass::Status::kErrorInternal);
                    return 3;
                }
                attr = true;
            }
            last = c;
            have = true;
        }
        st = Gemm::run(params, c.stream);
        if (st != cutlass::Status::kSuccess) {
            cg_set_error("run", index, c, st);
            return 4;
        }
        return 0;
    }

    static const char* name(int index, const char* label) {
        static char buf[200];
        snprintf(buf, sizeof buf, "k%d %s %dx%dx%d cluster %dx%d, %d stages, %d KB smem", index, label, TM, TN, TK,
                 CM, CN, Gemm::kStages, int(GemmKernel::SharedStorageSize / 1024));
        return buf;
    }
};
}  // namespace cg

template <int I> struct CgSel;          // kernel I's type (naming it instantiates nothing)
#define CG_SELECT(i, TM, TN, TK, CM, CN, MS, ES, TS, LABEL)                                                            \
    template <> struct CgSel<i> {                                                                                      \
        using K = cg::CgKernel<TM, TN, TK, CM, CN, MS, ES, TS>;                                                        \
        static constexpr const char* label = LABEL;                                                                    \
    };
CG_KERNELS(CG_SELECT)

template <int I> int cg_run(const CgCall& c) { return CgSel<I>::K::run(I, c); }
template <int I> size_t cg_workspace(const CgCall& c) { return CgSel<I>::K::workspace(c); }
template <int I> const char* cg_name() { return CgSel<I>::K::name(I, CgSel<I>::label); }

#define CG_INSTANTIATE(i, ...)                                                                                         \
    template int cg_run<i>(const CgCall&);                                                                             \
    template size_t cg_workspace<i>(const CgCall&);                                                                    \
    template const char* cg_name<i>();
#if defined(CG_PART)
CG_INSTANTIATE(CG_PART)
#else
CG_KERNELS(CG_INSTANTIATE)
#endif

#endif  // kernels

#if !defined(CG_PART) || CG_PART < 0
// The C ABI.
namespace cg_abi {
struct CgConfig {
    int kernel, swizzle, raster;
};
constexpr CgConfig cg_configs[] = {CG_CONFIGS};
constexpr int cg_nconfigs = sizeof(cg_configs) / sizeof(cg_configs[0]);
#define CG_COUNT(i, ...) +1
static_assert(0 CG_KERNELS(CG_COUNT) == CG_NKERNELS, "CG_NKERNELS must be the length of CG_KERNELS");
constexpr bool cg_configs_valid() {
    for (const CgConfig& g : cg_configs)
        if (g.kernel < 0 || g.kernel >= CG_NKERNELS || g.raster < 0 || g.raster > 2 || g.swizzle < 1) return false;
    return true;
}
static_assert(cg_configs_valid(), "CG_CONFIGS names a kernel CG_KERNELS lacks, or a bad raster order / swizzle");

#define CG_CASE_RUN(i, ...)                                                                                            \
    case i:                                                                                                            \
        return cg_run<i>(c);
#define CG_CASE_WS(i, ...)                                                                                             \
    case i:                                                                                                            \
        return cg_workspace<i>(c);
#define CG_CASE_NAME(i, ...)                                                                                           \
    case i:                                                                                                            \
        return cg_name<i>();
int cg_dispatch_run(int k, const CgCall& c) {
    switch (k) { CG_KERNELS(CG_CASE_RUN) }
    return -1;
}
size_t cg_dispatch_ws(int k, const CgCall& c) {
    switch (k) { CG_KERNELS(CG_CASE_WS) }
    return 0;
}
const char* cg_dispatch_name(int k) {
    switch (k) { CG_KERNELS(CG_CASE_NAME) }
    return nullptr;
}
}  // namespace cg_abi
using namespace cg_abi;

char cg_error[512];

extern "C" int cutlass_gemm_count(void) { return cg_nconfigs; }

extern "C" const char* cutlass_gemm_last_error(void) { return cg_error; }

extern "C" const char* cutlass_gemm_name(int config) {
    static char buf[cg_nconfigs][256];
    if (config < 0 || config >= cg_nconfigs) return nullptr;
    const CgConfig& g = cg_configs[config];
    const char raster[3][12] = {"heuristic", "along M", "along N"};
    snprintf(buf[config], sizeof buf[config], "%s, swizzle %d, raster %s", cg_dispatch_name(g.kernel), g.swizzle,
             raster[g.raster]);
    return buf[config];
}

extern "C" size_t cutlass_gemm_workspace(int config, int M, int N, int K) {
    if (config < 0 || config >= cg_nconfigs) return 0;
    const CgConfig& g = cg_configs[config];
    CgCall c{M, N, K, nullptr, nullptr, nullptr, nullptr, 1.0f, 0.0f, nullptr, 0, nullptr, g.swizzle, g.raster};
    return cg_dispatch_ws(g.kernel, c);
}

extern "C" int cutlass_gemm_run(int config, int M, int N, int K, const void* A, const void* W, void* C_in, void* D,
                                float alpha, float beta, void* workspace, size_t ws_bytes, void* stream) {
    if (config < 0 || config >= cg_nconfigs) {
        snprintf(cg_error, sizeof cg_error, "no config %d (%d configs)", config, cg_nconfigs);
        return -1;
    }
    const CgConfig& g = cg_configs[config];
    CgCall c{M,     N,         K,        A, W, C_in, D, alpha, beta, workspace, ws_bytes,
             static_cast<cudaStream_t>(stream), g.swizzle, g.raster};
    cg_error[0] = 0;
    return cg_dispatch_run(g.kernel, c);
}
#endif  // ABI
