// What a dependency between two steps of decode costs on the GPU, measured without any model (scripts/boundary_cost.py):
// - as a kernel boundary: `chain_step` launched L times in a row, each under programmatic dependent launch (the
//   decode graph's way: templates/prelude.cuh.j2 pdl_wait / pdl_launch) or plainly;
// - as a grid-wide barrier inside one persistent kernel: `persistent_steps` runs L phases, a barrier between each
//   two (every block's arrival counted on one global counter, every block spinning until the phase's count);
// - as point-to-point flags inside one persistent kernel: `flag_steps`, each block waiting only for the one block
//   whose word it reads: a lower bound (a GEMV's every block needs all of the previous GEMV's output: a barrier).
// Each step (a launch, or a phase) busy-waits `work_ns` on the global timer, then every block writes one word that a
// different block reads after the next dependency (the data a real step hands to the next: an L2 round trip), so
// the time a step takes beyond `work_ns` is the dependency's cost. `pre_ns` of the work is independent of the
// previous step (a GEMV's weight loads): before griddepcontrol.wait in a launch, between arriving and waiting in the
// persistent kernels, so each form may hide it behind the dependency. Compiled by scripts/boundary_cost.py --build.
#include <cstdint>

__device__ __forceinline__ uint64_t global_ns() {
    uint64_t t;
    asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
    return t;
}

__device__ __forceinline__ void busy_ns(int ns) {
    if (ns <= 0) return;
    const uint64_t end = global_ns() + (uint64_t)ns;
    while (global_ns() < end) {
    }
}

__device__ __forceinline__ unsigned int ld_acquire(const unsigned int* p) {
    unsigned int v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// One step as a kernel: the independent part of the work, wait for the previous launch (a no-op without the PDL
// attribute), let the next one start its own, read the word another block wrote in the previous step, the rest of
// the work, write this block's word.
extern "C" __global__ void chain_step(unsigned int* __restrict__ words, int work_ns, int pre_ns, int parity) {
    busy_ns(pre_ns);
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    __shared__ unsigned int got;
    const int n = gridDim.x, b = blockIdx.x;
    if (threadIdx.x == 0) got = words[(size_t)(parity ^ 1) * n + (b + 1) % n];
    __syncthreads();
    busy_ns(work_ns - pre_ns);
    if (threadIdx.x == 0) words[(size_t)parity * n + b] = got + 1;
}

// L steps in one launch: a grid barrier between each two (bar: the arrival counter, zero before the launch; the
// whole grid must be resident: the driver checks the grid against the occupancy). A step: the independent work, wait
// for every block's arrival at the last step, read, the rest of the work, write, arrive. REL: the arrival as
// templates/gemv_ring_pair.cu.j2 does it, an acquire-release fence and a relaxed add (CUTLASS's generic barrier);
// else __threadfence's sequentially consistent fence and an atomic add.
template <bool REL>
__device__ __forceinline__ void persistent_body(unsigned int* __restrict__ words, unsigned int* __restrict__ bar,
                                                int steps, int work_ns, int pre_ns) {
    __shared__ unsigned int got;
    const int n = gridDim.x, b = blockIdx.x;
    for (int s = 0; s < steps; ++s) {
        const int parity = s & 1;
        busy_ns(pre_ns);
        if (s > 0 && threadIdx.x == 0) {
            const unsigned int target = (unsigned int)s * (unsigned int)n;
            while (ld_acquire(bar) < target) {
            }
        }
        if (threadIdx.x == 0) got = words[(size_t)(parity ^ 1) * n + (b + 1) % n];
        __syncthreads();
        busy_ns(work_ns - pre_ns);
        if (threadIdx.x == 0) {
            words[(size_t)parity * n + b] = got + 1;              // this block's word before its arrival
            if constexpr (REL) {
                asm volatile("fence.acq_rel.gpu;" ::: "memory");
                asm volatile("red.relaxed.gpu.global.add.u32 [%0], 1;" :: "l"(bar) : "memory");
            } else {
                __threadfence();
                atomicAdd(bar, 1u);
            }
        }
        __syncthreads();
    }
}
extern "C" __global__ void persistent_steps(unsigned int* __restrict__ words, unsigned int* __restrict__ bar,
                                            int steps, int work_ns, int pre_ns) {
    persistent_body<false>(words, bar, steps, work_ns, pre_ns);
}
extern "C" __global__ void persistent_steps_rel(unsigned int* __restrict__ words, unsigned int* __restrict__ bar,
                                                int steps, int work_ns, int pre_ns) {
    persistent_body<true>(words, bar, steps, work_ns, pre_ns);
}

// L steps in one launch, each block waiting only for the block whose word it reads: flags[b] counts the steps block
// b has finished (zero before the launch).
extern "C" __global__ void flag_steps(unsigned int* __restrict__ words, unsigned int* __restrict__ flags, int steps,
                                      int work_ns, int pre_ns) {
    __shared__ unsigned int got;
    const int n = gridDim.x, b = blockIdx.x, src = (b + 1) % n;
    for (int s = 0; s < steps; ++s) {
        const int parity = s & 1;
        busy_ns(pre_ns);
        if (threadIdx.x == 0) {
            while (ld_acquire(flags + src) < (unsigned int)s) {
            }
            got = words[(size_t)(parity ^ 1) * n + src];
        }
        __syncthreads();
        busy_ns(work_ns - pre_ns);
        if (threadIdx.x == 0) {
            words[(size_t)parity * n + b] = got + 1;
            // the word before the flag (release). A block may run steps ahead of its reader and overwrite a word not
            // yet read: the values are not checked, only the waiting is measured.
            asm volatile("st.release.gpu.global.u32 [%0], %1;" :: "l"(flags + b), "r"((unsigned int)s + 1) : "memory");
        }
        __syncthreads();
    }
}
