// Host emulation of the CUDA subset that pipec's kernels use
// (cuda/src/kernels.rs), so that the exact kernel source can be compiled by a
// host C++20 compiler and run on the CPU by tests/integration/cuda_kernels.rs.
//
// Reproduced:
// - Qualifiers: `__global__` and `__device__` vanish, `__forceinline__` is `inline`, and
//   `__shared__` is `static`. That is correct per block because emu::launch runs the blocks of a
//   grid one after another.
// - Thread identity: `blockIdx`, `threadIdx`, `blockDim`, `gridDim` are thread_local dim3s.
//   Every thread of a block is its own std::thread, so the threads really run concurrently.
// - `__syncthreads()` is a real barrier among the threads of one block (std::barrier). A thread
//   that returns from the kernel leaves the barrier (arrive_and_drop), so the others can still
//   meet there. The kernels return early only uniformly per block (softmax's `r >= rows`).
// - Bit casts `__uint_as_float`, `__float_as_uint`, `__int_as_float` (memcpy, exact), and
//   `fmaxf`, `expf`, `logf`, `tanhf` from the host's <math.h>.
// - float arithmetic: IEEE binary32 with round-to-nearest-even. The driver is compiled with
//   -ffp-contract=off: no expression is fused into an FMA.
//
// Not reproduced:
// - Warps: no warp-synchronous execution, shuffles or votes (the kernels use none).
// - Scheduling: the threads interleave however the host OS runs them. A data race can go unseen
//   (or show up) here differently from a GPU.
// - Misuse: a `__syncthreads()` in divergent code is undefined on a GPU and is not detected here.
// - Math: CUDA's expf, logf and tanhf may differ from the host libm's by a few ulps.
// - FMA contraction: NVRTC compiles with --fmad=true by default, so on a GPU `w - lr * g` can
//   become one fused multiply-add. The host does two roundings.
// - Denormals: the host keeps them. NVRTC keeps them too unless --ftz=true is given.
// - Memory: device pointers are host pointers. There is no address space or bounds check.
//   The driver adds canaries after each buffer instead.
#pragma once

#include <barrier>
#include <cstring>
#include <math.h>
#include <thread>
#include <vector>

struct dim3 {
    unsigned int x = 1, y = 1, z = 1;
};

inline thread_local dim3 blockIdx, threadIdx, blockDim, gridDim;

#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static

namespace emu {
// The barrier of the block the calling thread belongs to.
inline thread_local std::barrier<>* block_barrier = nullptr;
}  // namespace emu

inline void __syncthreads() { emu::block_barrier->arrive_and_wait(); }

inline float __uint_as_float(unsigned int u) {
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
}
inline float __int_as_float(int i) {
    float f;
    std::memcpy(&f, &i, sizeof f);
    return f;
}
inline unsigned int __float_as_uint(float f) {
    unsigned int u;
    std::memcpy(&u, &f, sizeof u);
    return u;
}

namespace emu {
// Run `body(ctx)` (a call of one kernel with its arguments) as the launch <<<grid, block>>>. The
// blocks run one after another, in blockIdx order. Inside a block every thread is a std::thread.
// Not a template, so that the thread machinery is compiled once, not once per kernel.
inline void launch(dim3 grid, dim3 block, void (*body)(void*), void* ctx) {
    const std::ptrdiff_t threads = std::ptrdiff_t(block.x) * block.y * block.z;
    for (unsigned bz = 0; bz < grid.z; bz++)
        for (unsigned by = 0; by < grid.y; by++)
            for (unsigned bx = 0; bx < grid.x; bx++) {
                std::barrier<> bar(threads);
                std::vector<std::thread> pool;
                pool.reserve(threads);
                for (unsigned tz = 0; tz < block.z; tz++)
                    for (unsigned ty = 0; ty < block.y; ty++)
                        for (unsigned tx = 0; tx < block.x; tx++)
                            pool.emplace_back([&, tx, ty, tz, bx, by, bz] {
                                gridDim = grid;
                                blockDim = block;
                                blockIdx = dim3{bx, by, bz};
                                threadIdx = dim3{tx, ty, tz};
                                block_barrier = &bar;
                                body(ctx);
                                bar.arrive_and_drop();
                            });
                for (auto& t : pool) t.join();
            }
}
}  // namespace emu
