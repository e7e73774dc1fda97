// Experiment (benchmarks/experiments/gemv_cluster.py): M = 1 int4 / int8 group-128 GEMV, K split merged
// through distributed shared memory. A thread-block cluster of CS CTAs owns BN output columns; CTA r of the
// cluster reads the r-th slice of K (whole groups), sums its columns, and the cluster adds the CS partial
// columns in shared memory behind one cluster barrier -- no workspace, no arrival counter, no second pass
// over global memory (the Triton kernels' split-K merge: gemv_notes.md v10, "Next for the batch-1 step").
//
// Layout (portakern's internal one, backends/triton/kernels/gemv_quant.py): words qw (KWP, NP) int32,
// K-major, EPW = 32 / BITS codes per word, int4 word rows interleaved in blocks of IW = 8 (int8: IW = 1): code e of
// word row j is column k = (j / IW) * IW * EPW + e * IW + j % IW of K; scales s and zero points z (G, NP) fp16;
// x (1, K) and out (1, N) bf16 (raw 16-bit words here: no headers needed under NVRTC).
//
// Compile-time constants (-D): BITS (4 or 8), N, K, NP (the words' row stride), CS (CTAs per cluster = K slices),
// BN (columns per cluster), PF (groups of words each thread keeps in flight), PDL (1: programmatic
// dependent launch -- first weight loads, then griddepcontrol.wait before x is read).

typedef unsigned int u32;
typedef unsigned short u16;

#define EPW (32 / BITS)          // codes per 32-bit word
#define IW (BITS == 4 ? 8 : 1)   // word rows per interleaved block
#define GROUP_ROWS (128 / EPW)   // word rows per group of 128 codes
#define LANES 4                  // row lanes: thread t reads word rows lane, lane + 4, ... of its quad
#define RPG (GROUP_ROWS / LANES) // word rows of one lane in one group
#define QUADS (BN / 4)           // 16-byte column quads of a tile
#define THREADS (QUADS * LANES)
#define ROWS (K / EPW / CS)      // word rows of one CTA's K slice
#define GROUPS (ROWS / GROUP_ROWS)
#define KS (ROWS * EPW)          // codes of one CTA's K slice
#define COLS_PER_RANK (BN / CS)  // output columns each CTA of the cluster merges

static_assert(K % (128 * CS) == 0, "each CTA's K slice must hold whole groups of 128");
static_assert(N % BN == 0, "N must be a multiple of the column tile");
static_assert(BN % CS == 0 && COLS_PER_RANK <= THREADS, "the merge gives each CTA BN / CS columns");
static_assert(GROUPS >= 1, "at least one group per CTA");
static_assert(BITS == 4 || BITS == 8, "int4 or int8 codes");

// -- conversions (bf16 as raw bits; fp16 through PTX)
__device__ __forceinline__ float bf16_to_f32(u16 h) { return __uint_as_float(((u32)h) << 16); }

__device__ __forceinline__ u16 f32_to_bf16(float f) {           // round to nearest even (finite values)
    u32 u = __float_as_uint(f);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (u16)(u >> 16);
}

__device__ __forceinline__ float f16_to_f32(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

// -- the layout: column of K of code e of word row j (of a slice), and the code position of slice column i
__device__ __forceinline__ u32 k_of(u32 j, int e) { return (j / IW) * IW * EPW + e * IW + j % IW; }
__device__ __forceinline__ int pos_of(u32 i) { return (int)((i % (IW * EPW)) / IW); }

// -- code positions: code e of a word, masked in place, read as an fp32 subnormal is q * 2^P(e) * 2^-149
//    (codes whose bits reach past bit 22 from the word shifted right by 16); x of that position is pre-scaled
//    by 2^(85 - P(e)), so the product is q * x * 2^-64 (one LOP3 and one FFMA per code, as the Triton
//    kernels' dq=3)
__device__ __forceinline__ bool low_half(int e) { return BITS * e + BITS <= 23; }
__device__ __forceinline__ int code_shift(int e) { return low_half(e) ? BITS * e : BITS * e - 16; }

__device__ __forceinline__ float x_scale(int e) {                // 2^(85 - P(e))
    return __uint_as_float((u32)(127 + 85 - code_shift(e)) << 23);
}

// -- distributed shared memory: a float of CTA `rank`'s copy of a shared variable
__device__ __forceinline__ float ld_cluster(const float* p, u32 rank) {
    u32 local = (u32)__cvta_generic_to_shared(p), remote;
    float v;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
    return v;
}

__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

struct Group {                  // one thread's words, scales and zeros of one group: RPG rows x 4 columns
    uint4 w[RPG];
    uint2 s, z;
};

__device__ __forceinline__ void load_group(Group& out, const uint4* qw4, const uint2* s2, const uint2* z2,
                                           u32 row0, u32 lane, u32 quad4, u32 g_abs, int g) {
#pragma unroll
    for (int m = 0; m < RPG; ++m) {
        const u32 row = row0 + g * GROUP_ROWS + lane + LANES * m;
        out.w[m] = __ldg(qw4 + (size_t)row * (NP / 4) + quad4);
    }
    out.s = __ldg(s2 + (size_t)g_abs * (NP / 4) + quad4);
    out.z = __ldg(z2 + (size_t)g_abs * (NP / 4) + quad4);
}

extern "C" __global__ void __cluster_dims__(CS, 1, 1) __launch_bounds__(THREADS)
gemv_cluster(const int* __restrict__ qw, const u16* __restrict__ s, const u16* __restrict__ z,
             const u16* __restrict__ x, u16* __restrict__ out) {
    __shared__ float xs[KS];                  // x of the slice, fp32, pre-scaled per code position
    __shared__ float xsum[GROUPS][LANES];     // per group and row lane: the sum of x over that lane's codes
    __shared__ float red[LANES][BN];          // the row lanes' partial columns
    __shared__ float part[BN];                // this CTA's partial columns, read by the whole cluster

    u32 rank;
    asm("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
    const u32 t = threadIdx.x, quad = t % QUADS, lane = t / QUADS;
    const u32 tile = blockIdx.x / CS;
    const u32 quad4 = (tile * BN) / 4 + quad;          // 16-byte column quad within a row of NP words
    const u32 row0 = rank * ROWS;                      // first word row of this CTA's slice
    const u32 g0 = rank * GROUPS;                      // first group of the slice
    const uint4* qw4 = reinterpret_cast<const uint4*>(qw);
    const uint2* s2 = reinterpret_cast<const uint2*>(s);
    const uint2* z2 = reinterpret_cast<const uint2*>(z);

    // -- phase 1: the first PF groups of words, scales and zeros in flight (constant across launches, so
    //    before the wait for the previous kernel)
    Group buf[PF];
#pragma unroll
    for (int p = 0; p < PF; ++p)
        if (p < GROUPS) load_group(buf[p], qw4, s2, z2, row0, lane, quad4, g0 + p, p);
#if PDL
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif

    // -- phase 2: stage x (pre-scaled per code position) and the row lanes' sums of x
    for (u32 i = t; i < KS; i += THREADS)
        xs[i] = bf16_to_f32(x[rank * KS + i]) * x_scale(pos_of(i));
    for (u32 i = t; i < GROUPS * LANES; i += THREADS) {
        const u32 g = i / LANES, l = i % LANES;
        float acc = 0.f;
        for (int m = 0; m < RPG; ++m) {
            const u32 j = g * GROUP_ROWS + l + LANES * m;
            for (int e = 0; e < EPW; ++e) acc += bf16_to_f32(x[rank * KS + k_of(j, e)]);
        }
        xsum[g][l] = acc;
    }
    __syncthreads();
#if PDL
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif

    // -- phase 3: per group, the products of its RPG rows x 4 columns (q x 2^-64), then the group's scale and
    //    zero: res += s (sum q x - z sum x); the next group's words replace the consumed ones
    float res[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int g = 0; g < GROUPS; ++g) {
        Group& cur = buf[g % PF];
        float aq[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int m = 0; m < RPG; ++m) {
            const u32 j = g * GROUP_ROWS + lane + LANES * m;
            const float* xr = xs + k_of(j, 0);
            float xv[EPW];
#pragma unroll
            for (int e = 0; e < EPW; ++e) xv[e] = xr[e * IW];
            const u32 wc[4] = {cur.w[m].x, cur.w[m].y, cur.w[m].z, cur.w[m].w};
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                const u32 lo = wc[c], hi = wc[c] >> 16;
#pragma unroll
                for (int e = 0; e < EPW; ++e) {
                    const u32 bits = (low_half(e) ? lo : hi) & (((1u << BITS) - 1u) << code_shift(e));
                    aq[c] = fmaf(__uint_as_float(bits), xv[e], aq[c]);
                }
            }
        }
        const u32 sv[2] = {cur.s.x, cur.s.y}, zv[2] = {cur.z.x, cur.z.y};
        const float xg = xsum[g][lane];
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            const float sc = f16_to_f32((u16)(sv[c / 2] >> (16 * (c % 2))));
            const float zc = f16_to_f32((u16)(zv[c / 2] >> (16 * (c % 2))));
            res[c] = fmaf(sc, fmaf(aq[c], 0x1p64f, -zc * xg), res[c]);
        }
        if (g + PF < GROUPS) load_group(cur, qw4, s2, z2, row0, lane, quad4, g0 + g + PF, g + PF);
    }

    // -- phase 4: the row lanes' sums (fixed order), then the cluster's: CTA `rank` adds columns
    //    rank * BN / CS .. of every CTA's partials, in rank order (deterministic), and writes them
#pragma unroll
    for (int c = 0; c < 4; ++c) red[lane][quad * 4 + c] = res[c];
    __syncthreads();
    if (t < BN) part[t] = ((red[0][t] + red[1][t]) + red[2][t]) + red[3][t];
    cluster_sync();                                    // every CTA's partials written and visible
    if (t < COLS_PER_RANK) {
        const u32 col = rank * COLS_PER_RANK + t;
        float acc = 0.f;
#pragma unroll
        for (u32 q = 0; q < CS; ++q) acc += ld_cluster(&part[col], q);
        out[tile * BN + col] = f32_to_bf16(acc);
    }
    cluster_sync();                                    // no CTA leaves while another reads its shared memory
}
