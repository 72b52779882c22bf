// What a dependency between two steps of decode costs on the GPU, measured without any model (scripts/boundary_cost.py):
// - as a kernel boundary: `chain_step` launched L times in a row, each under programmatic dependent launch (the
//   decode graph's way: templates/prelude.cuh.j2 pdl_wait / pdl_launch) or plainly;
// - as a grid-wide barrier inside one persistent kernel: `persistent_steps` runs L phases, a barrier between each
//   two (every block's arrival counted on one global counter, every block spinning until the phase's count).
// Each step (a launch, or a phase) busy-waits `work_ns` on the global timer, then every block writes one word that a
// different block reads after the next dependency (the data a real step hands to the next: an L2 round trip), so
// the time a step takes beyond `work_ns` is the dependency's cost. Compiled by scripts/boundary_cost.py --build.
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

// One step as a kernel: wait for the previous launch (a no-op without the PDL attribute), let the next one start
// its prologue, read the word another block wrote in the previous step, work, write this block's word.
extern "C" __global__ void chain_step(unsigned int* __restrict__ words, int work_ns, int parity) {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    __shared__ unsigned int got;
    const int n = gridDim.x, b = blockIdx.x;
    if (threadIdx.x == 0) got = words[(size_t)(parity ^ 1) * n + (b + 1) % n];
    __syncthreads();
    busy_ns(work_ns);
    if (threadIdx.x == 0) words[(size_t)parity * n + b] = got + 1;
}

// L steps in one launch: a grid barrier between each two (bar: the arrival counter, zero before the launch; the
// whole grid must be resident: the driver checks the grid against the occupancy).
extern "C" __global__ void persistent_steps(unsigned int* __restrict__ words, unsigned int* __restrict__ bar,
                                            int steps, int work_ns) {
    __shared__ unsigned int got;
    const int n = gridDim.x, b = blockIdx.x;
    for (int s = 0; s < steps; ++s) {
        const int parity = s & 1;
        if (threadIdx.x == 0) got = words[(size_t)(parity ^ 1) * n + (b + 1) % n];
        __syncthreads();
        busy_ns(work_ns);
        if (threadIdx.x == 0) {
            words[(size_t)parity * n + b] = got + 1;
            __threadfence();                                  // this block's word before its arrival
            atomicAdd(bar, 1u);
            const unsigned int target = (unsigned int)(s + 1) * (unsigned int)n;
            unsigned int seen;
            do {
                asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(bar) : "memory");
            } while (seen < target);
        }
        __syncthreads();
    }
}
