// The CUDA C of the cuda backend's kernels compiled as C++20 for the CPU (backends/cuda/common/host_run.py): what NVRTC
// provides, in plain C++. A block's threads are std::threads sharing one std::barrier (__syncthreads) and one
// dynamic shared-memory buffer; blocks run one after another, so a block-static variable stands in for a static
// __shared__ one. For checking a kernel's index maps, loops, merges and conversions with no GPU -- not for speed,
// and not a model of the memory system (no caches, no asynchrony).
#pragma once

#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>

#define __device__
#define __global__
#define __forceinline__ inline
#define __launch_bounds__(n)
#define __restrict__ __restrict

struct uint2 { unsigned int x, y; };
struct uint4 { unsigned int x, y, z, w; };
struct float4 { float x, y, z, w; };
struct pk_dim3 { unsigned int x = 0, y = 0, z = 0; };

namespace pk_host {
inline thread_local pk_dim3 thread_idx, block_idx;
inline thread_local std::barrier<>* block_barrier = nullptr;
inline thread_local void* dynamic_shared = nullptr;
inline thread_local float* shuffle_slots = nullptr;     // one float per thread of the block, for the shuffles

inline float f16_to_f32(unsigned short h) {
    _Float16 v;
    std::memcpy(&v, &h, 2);
    return (float)v;
}

inline unsigned short f32_to_f16(float f) {        // round to nearest even, as cvt.rn.f16.f32
    _Float16 v = (_Float16)f;
    unsigned short h;
    std::memcpy(&h, &v, 2);
    return h;
}
}  // namespace pk_host

#define threadIdx (pk_host::thread_idx)
#define blockIdx (pk_host::block_idx)
#define PK_DYNAMIC_SHARED(type, name) type* name = static_cast<type*>(pk_host::dynamic_shared)
#define PK_SHARED(type, name) static type name
// a warp shuffle as two block barriers around a slot exchange: every thread of the block must reach it, which holds
// in the kernels that use it (their shuffles sit outside any thread-dependent branch)
#define PK_SHFL_XOR(v, m) pk_host::shfl_xor((v), (m))

inline float __uint_as_float(unsigned int u) { float f; std::memcpy(&f, &u, 4); return f; }
inline unsigned int __float_as_uint(float f) { unsigned int u; std::memcpy(&u, &f, 4); return u; }
template <class T> inline T __ldg(const T* p) { return *p; }
inline float __ldcg(const float* p) {
    std::atomic_thread_fence(std::memory_order_seq_cst);
    return *reinterpret_cast<const volatile float*>(p);
}
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline void __syncthreads() { pk_host::block_barrier->arrive_and_wait(); }
template <class T> inline T min(T a, T b) { return b < a ? b : a; }
namespace pk_host {
inline float shfl_xor(float v, unsigned int lanemask) {
    shuffle_slots[thread_idx.x] = v;
    block_barrier->arrive_and_wait();
    const float other = shuffle_slots[thread_idx.x ^ lanemask];
    block_barrier->arrive_and_wait();
    return other;
}
}  // namespace pk_host
inline unsigned int atomicAdd(unsigned int* p, unsigned int v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
