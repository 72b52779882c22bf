// Can imp's runtime launch a CUTLASS 3.x kernel without CUTLASS's host code? (issue 9, deliverable 1; a feasibility
// probe, not part of a bundle). imp binds every launch once from the program: an argument block and TMA descriptors
// it encodes itself over the device arena (runtime/cuda_program.py). A CUTLASS kernel takes one `Params` struct that
// its host code builds (GemmKernel::to_underlying_arguments), TMA descriptors inside. This host program builds that
// struct at compile time, on a machine without a GPU: CUTLASS's cuTensorMapEncodeTiled call is answered here (the
// direct-call build, CUTLASS_ENABLE_DIRECT_CUDA_DRIVER_CALL), recording its arguments and leaving a marker in the
// descriptor; the operands are fake addresses. It prints the Params bytes, where each descriptor and operand pointer
// sits in them with what the runtime would need to encode it over the arena, and the launch geometry (grid, block,
// shared memory). The kernel: scripts/cutlass_gemm.cu's config 2 (ping-pong persistent, 128 x 128 x 64 tiles, fp16
// A [M, K] and W [N, K], fp32 C and D [M, N], D = alpha A W^T + beta C).
//
// Build and run (scripts/cutlass_params.sh): nvcc -std=c++17 -arch=sm_90a -DCUTLASS_ENABLE_DIRECT_CUDA_DRIVER_CALL
//   -DNDEBUG -I CUTLASS/include -I CUTLASS/tools/util/include cutlass_params.cu -o cutlass_params; ./cutlass_params M N K beta
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include <cuda.h>

// ---- the driver call CUTLASS makes while building Params, answered without a driver ----
struct EncodeCall {
    int dtype, rank;
    unsigned long long address;
    unsigned long long dims[5], strides[5];
    unsigned box[5], elem_strides[5];
    int interleave, swizzle, l2, oob;
};
static std::vector<EncodeCall> g_calls;
static const unsigned long long MARK = 0x1A2B3C4D00000000ull;

extern "C" CUresult cuTensorMapEncodeTiled(CUtensorMap* map, CUtensorMapDataType dtype, cuuint32_t rank, void* address,
                                           const cuuint64_t* dims, const cuuint64_t* strides, const cuuint32_t* box,
                                           const cuuint32_t* elem_strides, CUtensorMapInterleave interleave,
                                           CUtensorMapSwizzle swizzle, CUtensorMapL2promotion l2,
                                           CUtensorMapFloatOOBfill oob) {
    EncodeCall c{};
    c.dtype = (int)dtype;
    c.rank = (int)rank;
    c.address = (unsigned long long)address;
    for (unsigned i = 0; i < rank; ++i) {
        c.dims[i] = dims[i];
        c.box[i] = box[i];
        c.elem_strides[i] = elem_strides[i];
        if (i + 1 < rank) c.strides[i] = strides[i];   // strides of dims 1.. (dim 0 is contiguous)
    }
    c.interleave = (int)interleave;
    c.swizzle = (int)swizzle;
    c.l2 = (int)l2;
    c.oob = (int)oob;
    memset(map, 0, sizeof(*map));
    const unsigned long long mark = MARK | (unsigned long long)g_calls.size();
    memcpy(map, &mark, sizeof mark);
    g_calls.push_back(c);
    return CUDA_SUCCESS;
}

extern "C" CUresult cuTensorMapEncodeIm2col(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                            const cuuint64_t*, const int*, const int*, cuuint32_t, cuuint32_t,
                                            const cuuint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle,
                                            CUtensorMapL2promotion, CUtensorMapFloatOOBfill) {
    return CUDA_ERROR_NOT_SUPPORTED;                          // (convolutions only)
}

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/kernel_hardware_info.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/operations.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/gemm/kernel/tile_scheduler.hpp"
#include "cutlass/util/packed_stride.hpp"

using namespace cute;
using ElementA = cutlass::half_t;
using ElementB = cutlass::half_t;
using ElementC = float;
using ElementD = float;
using TileShape = Shape<_128, _128, _64>;
using ClusterShape = Shape<_1, _1, _1>;
using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float, ElementC, cutlass::layout::RowMajor, 4, ElementD,
    cutlass::layout::RowMajor, 4, cutlass::epilogue::TmaWarpSpecialized,
    cutlass::epilogue::fusion::LinearCombination<ElementD, float, ElementC, float>>::CollectiveOp;
using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA, cutlass::layout::RowMajor, 8, ElementB,
    cutlass::layout::ColumnMajor, 8, float, TileShape, ClusterShape,
    cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
        sizeof(typename CollectiveEpilogue::SharedStorage))>,
    cutlass::gemm::KernelTmaWarpSpecializedPingpong>::CollectiveOp;
using GemmKernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, CollectiveMainloop,
                                                        CollectiveEpilogue, cutlass::gemm::PersistentScheduler>;

int main(int argc, char** argv) {
    if (argc != 5) {
        fprintf(stderr, "usage: %s M N K beta\n", argv[0]);
        return 2;
    }
    const int M = atoi(argv[1]), N = atoi(argv[2]), K = atoi(argv[3]);
    const float beta = (float)atof(argv[4]);
    // fake operand addresses, distinct and recognisable in the Params bytes
    const unsigned long long fake[4] = {0x7A0000000000ull, 0x7B0000000000ull, 0x7C0000000000ull, 0x7D0000000000ull};
    const char* names[4] = {"A", "W", "C", "D"};
    auto sA = cutlass::make_cute_packed_stride(typename GemmKernel::StrideA{}, make_shape(M, K, 1));
    auto sB = cutlass::make_cute_packed_stride(typename GemmKernel::StrideB{}, make_shape(N, K, 1));
    auto sC = cutlass::make_cute_packed_stride(typename GemmKernel::StrideC{}, make_shape(M, N, 1));
    auto sD = cutlass::make_cute_packed_stride(typename GemmKernel::StrideD{}, make_shape(M, N, 1));
    cutlass::KernelHardwareInfo hw;
    hw.device_id = 0;
    hw.sm_count = 132;                       // the H200's (targets/sm_90a/target.json); no query
    typename GemmKernel::Arguments args{cutlass::gemm::GemmUniversalMode::kGemm,
                                        {M, N, K, 1},
                                        {reinterpret_cast<const ElementA*>(fake[0]), sA,
                                         reinterpret_cast<const ElementB*>(fake[1]), sB},
                                        {{}, reinterpret_cast<const ElementC*>(fake[2]), sC,
                                         reinterpret_cast<ElementD*>(fake[3]), sD},
                                        hw};
    args.epilogue.thread.alpha = 1.0f;
    args.epilogue.thread.beta = beta;
    if (GemmKernel::can_implement(args) != true) {
        fprintf(stderr, "can_implement refused M=%d N=%d K=%d\n", M, N, K);
        return 1;
    }
    if (GemmKernel::get_workspace_size(args) != 0) {
        fprintf(stderr, "needs a workspace (%zu bytes): not handled\n", GemmKernel::get_workspace_size(args));
        return 1;
    }
    // zeroed first and assigned member by member, so padding holds no stale copy of a descriptor built on the stack
    static typename GemmKernel::Params params;
    memset(static_cast<void*>(&params), 0, sizeof(params));
    {
        const typename GemmKernel::Params built = GemmKernel::to_underlying_arguments(args, nullptr);
        params.mode = built.mode;
        params.problem_shape = built.problem_shape;
        params.mainloop = built.mainloop;
        params.epilogue = built.epilogue;
        params.hw_info = built.hw_info;
        params.scheduler = built.scheduler;
    }
    const unsigned char* p = reinterpret_cast<const unsigned char*>(&params);
    // where each descriptor the kernel reads lives in Params (the fields themselves; the marker scan below also finds
    // stale copies in padding: the runtime patches these offsets only)
    auto at = [&](const void* field) { return (long)(reinterpret_cast<const unsigned char*>(field) - p); };
    const long field[4] = {at(params.mainloop.tma_load_a.get_tma_descriptor()),
                           at(params.mainloop.tma_load_b.get_tma_descriptor()),
                           at(params.epilogue.tma_load_c.get_tma_descriptor()),
                           at(params.epilogue.tma_store_d.get_tma_descriptor())};
    const size_t n = sizeof(params);
    const dim3 grid = GemmKernel::get_grid_shape(params), block = GemmKernel::get_block_shape();
    printf("{\"params_bytes\": %zu, \"params_align\": %zu, \"grid\": [%u, %u, %u], \"block\": [%u, %u, %u], "
           "\"smem\": %d,\n", n, alignof(typename GemmKernel::Params), grid.x, grid.y, grid.z, block.x, block.y,
           block.z, GemmKernel::SharedStorageSize);
    printf(" \"tmaps\": [");
    for (size_t i = 0; i < g_calls.size(); ++i) {
        const EncodeCall& c = g_calls[i];
        const char* op = "?";
        for (int j = 0; j < 4; ++j)
            if (c.address == fake[j]) op = names[j];
        printf("%s\n  {\"offsets\": [", i ? "," : "");      // every copy of the descriptor in Params
        bool f = true;
        for (size_t o = 0; o + 8 <= n; o += 8) {
            unsigned long long v;
            memcpy(&v, p + o, 8);
            if (v == (MARK | i)) {
                printf("%s%zu", f ? "" : ", ", o);
                f = false;
            }
        }
        long fo = -1;
        for (int j = 0; j < 4; ++j)
            if (c.address == fake[j]) fo = field[j];
        printf("], \"field\": %ld, \"operand\": \"%s\", \"dtype\": %d, \"rank\": %d, \"dims\": [", fo, op, c.dtype,
               c.rank);
        for (int d = 0; d < c.rank; ++d) printf("%s%llu", d ? ", " : "", c.dims[d]);
        printf("], \"strides\": [");
        for (int d = 0; d + 1 < c.rank; ++d) printf("%s%llu", d ? ", " : "", c.strides[d]);
        printf("], \"box\": [");
        for (int d = 0; d < c.rank; ++d) printf("%s%u", d ? ", " : "", c.box[d]);
        printf("], \"elem_strides\": [");
        for (int d = 0; d < c.rank; ++d) printf("%s%u", d ? ", " : "", c.elem_strides[d]);
        printf("], \"interleave\": %d, \"swizzle\": %d, \"l2\": %d, \"oob\": %d}", c.interleave, c.swizzle, c.l2, c.oob);
    }
    printf("],\n \"pointers\": [");
    bool first = true;
    for (size_t o = 0; o + 8 <= n; o += 8) {
        unsigned long long v;
        memcpy(&v, p + o, 8);
        for (int j = 0; j < 4; ++j)
            if (v == fake[j]) {
                printf("%s{\"offset\": %zu, \"operand\": \"%s\"}", first ? "" : ", ", o, names[j]);
                first = false;
            }
    }
    printf("],\n \"hex\": \"");
    for (size_t i = 0; i < n; ++i) printf("%02x", p[i]);
    printf("\"}\n");
    return 0;
}
