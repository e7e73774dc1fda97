// Runs one kernel of the cuda backend on the CPU (backends/cuda/common/host_run.py compiles this file with -DPK_HOST,
// -DPK_SOURCE="<kernel>.cu", -DPK_ENTRY=<function> and the kernel's own -D constants). Blocks run one after
// another; each block's threads are std::threads meeting at one barrier, over a shared-memory buffer filled with
// 0xFF bytes first (a float read before it is written is a NaN, which the callers' checks catch) and one shuffle
// slot per thread.
#include "host_shim.h"
#include PK_SOURCE

#include <cstring>
#include <thread>
#include <utility>
#include <vector>

template <class... P, std::size_t... I>
static void call_with(void (*f)(P...), void** args, std::index_sequence<I...>) {
    f(static_cast<P>(args[I])...);
}

template <class... P>
static void call(void (*f)(P...), void** args) {
    call_with(f, args, std::index_sequence_for<P...>{});
}

extern "C" int pk_run(int grid, int threads, long smem_bytes, void** args) {
    std::vector<float4> smem(smem_bytes / 16 + 1);
    std::vector<float> slots(threads);
    for (int b = 0; b < grid; ++b) {
        std::memset(smem.data(), 0xFF, smem.size() * sizeof(float4));
        std::barrier<> bar(threads);
        std::vector<std::thread> team;
        team.reserve(threads);
        for (int t = 0; t < threads; ++t)
            team.emplace_back([&, t] {
                pk_host::thread_idx.x = (unsigned)t;
                pk_host::block_idx.x = (unsigned)b;
                pk_host::block_barrier = &bar;
                pk_host::dynamic_shared = smem.data();
                pk_host::shuffle_slots = slots.data();
                call(&PK_ENTRY, args);
            });
        for (auto& th : team) th.join();
    }
    return 0;
}
