// Weight-only quantized GEMV for M = 1 to 4 rows (int4 / int8, groups of 128) in the memory-bound regime: the cuda
// backend's kernel (backends/cuda/quant_gemv.py), compiled by NVRTC per shape and format.
//
// Design (docs/design/quant-gemv-cuda.md): per code one LOP3 and one FFMA -- the code masked in place and read as an
// fp32 subnormal, x pre-scaled per code position (the Triton "dq=3" kernels' trick) -- and little else: x is staged
// once per CTA in shared memory, scaled and in word-row order (two 16-byte shared loads serve one word row of
// 4 columns, 32 codes), the scale and zero apply once per group, and the CTAs are small (64-512 threads) so that
// many sit on each SM and their loads overlap each other's arithmetic. Split K merges through an fp32 workspace,
// summed in slice order by the last CTA of a column tile to arrive (deterministic; the counter resets itself, so
// CUDA graphs replay it).
//
// Layout: the GEMV layout (ir/gemv_layout.py): words qw (KWP, NP) int32, K-major, EPW = 32 / BITS
// codes per word, int4 word rows interleaved in blocks of IW = 8 (int8: IW = 1): code e of word row j is column
// k = (j / IW) * IW * EPW + e * IW + j % IW of K; scales s and zero points z (G, NP), fp16 or bf16 (no z: HAS_Z 0,
// the constant ZP); x (M, K) bf16 or fp16, contiguous and 16-byte aligned; out (M, N) bf16, fp16 or fp32,
// contiguous. Each thread applies every dequantized code to all M rows of x (M FFMAs per LOP3).
//
// Compile-time constants (-D): M (rows, 1-4), BITS (4 or 8), N, K, NP (the words' row stride, a multiple of 128
// >= N), QUADS (16-byte column quads per CTA: BN = 4 QUADS columns), LANES (row lanes: thread t reads word rows lane,
// lane + LANES, ... of its quad), S (K slices), PF (groups of words each thread keeps in flight), PDL (1:
// programmatic dependent launch -- first weight loads, then griddepcontrol.wait before x is read; sm_90+), HAS_Z,
// ZP, LDNA (1: weight loads as ld.global.nc.L1::no_allocate.L2::256B), X_F16 (x is fp16, else bf16), S_BF16
// (scales and zeros are bf16, else fp16), OUT_KIND (0 bf16, 1 fp16, 2 fp32).

// PK_HOST: compiled as C++ for the CPU by backends/cuda/common/host_run.py, which supplies host_shim.h (threads of a
// block as std::threads, __syncthreads as a barrier); each inline-PTX spot has a plain C++ branch under PK_HOST.

typedef unsigned int u32;
typedef unsigned short u16;

#ifndef PK_HOST
#define PK_DYNAMIC_SHARED(type, name) extern __shared__ type name[]
#define PK_SHARED(type, name) __shared__ type name
#endif

#define EPW (32 / BITS)                  // codes per 32-bit word
#define IW (BITS == 4 ? 8 : 1)           // word rows per interleaved block
#define GROUP_ROWS (128 / EPW)           // word rows per group of 128 codes
#define RPG (GROUP_ROWS / LANES)         // word rows of one thread in one group
#define BN (4 * QUADS)                   // columns of a CTA
#define THREADS (QUADS * LANES)
#define GROUPS (K / 128 / S)             // groups of one CTA's K slice
#define ROWS (GROUPS * GROUP_ROWS)       // word rows of one slice
#define KS (ROWS * EPW)                  // codes of one slice
#define TILES ((N + BN - 1) / BN)

static_assert(K % (128 * S) == 0, "each slice holds whole groups of 128");
static_assert(NP % BN == 0 && NP >= N, "the words' row stride covers every column tile");
static_assert(GROUP_ROWS % LANES == 0, "row lanes must divide a group's word rows");
static_assert(BITS == 4 || BITS == 8, "int4 or int8 codes");
static_assert(M >= 1 && M <= 4, "1 to 4 rows of x");

// -- conversions (16-bit floats as raw bits; fp16 through PTX)
__device__ __forceinline__ float bf16_to_f32(u16 h) { return __uint_as_float(((u32)h) << 16); }

__device__ __forceinline__ u16 f32_to_bf16(float f) {           // round to nearest even; NaN stays NaN
    u32 u = __float_as_uint(f);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (u16)((u >> 16) | 0x40u);  // quiet NaN, sign kept (the rounding
                                                                           // carry would wrap 0x7FFFFFFF to -0.0)
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (u16)(u >> 16);
}

__device__ __forceinline__ float f16_to_f32(u16 h) {
#ifdef PK_HOST
    return pk_host::f16_to_f32(h);
#else
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
#endif
}

__device__ __forceinline__ u16 f32_to_f16(float f) {
#ifdef PK_HOST
    return pk_host::f32_to_f16(f);
#else
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
#endif
}

#if X_F16
#define X_TO_F32 f16_to_f32
#else
#define X_TO_F32 bf16_to_f32
#endif
#if S_BF16
#define S_TO_F32 bf16_to_f32
#else
#define S_TO_F32 f16_to_f32
#endif
#if OUT_KIND == 2
typedef float out_t;
__device__ __forceinline__ out_t to_out(float f) { return f; }
#elif OUT_KIND == 1
typedef u16 out_t;
__device__ __forceinline__ out_t to_out(float f) { return f32_to_f16(f); }
#else
typedef u16 out_t;
__device__ __forceinline__ out_t to_out(float f) { return f32_to_bf16(f); }
#endif

// -- code positions: code e of a word, masked in place and read as an fp32 subnormal, is q * 2^P(e) * 2^-149
//    (codes whose bits reach past bit 22 come from the word shifted right by 16); x of that position carries
//    2^(85 - P(e)), so each product is q * x * 2^-64
__device__ __forceinline__ bool low_half(int e) { return BITS * e + BITS <= 23; }
__device__ __forceinline__ int code_shift(int e) { return low_half(e) ? BITS * e : BITS * e - 16; }
__device__ __forceinline__ float x_scale(int e) {                // 2^(85 - P(e)), exact
    return __uint_as_float((u32)(127 + 85 - code_shift(e)) << 23);
}
__device__ __forceinline__ u32 k_of(u32 j, int e) { return (j / IW) * IW * EPW + e * IW + j % IW; }

__device__ __forceinline__ uint4 load_words(const uint4* p) {
#if LDNA && !defined(PK_HOST)
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
#else
    return __ldg(p);
#endif
}

struct Group {                  // one thread's words, scales and zeros of one group: RPG rows x 4 columns
    uint4 w[RPG];
    uint2 s, z;
};

__device__ __forceinline__ void load_group(Group& out, const uint4* qw4, const uint2* s2, const uint2* z2,
                                           u32 row0, u32 lane, u32 quad4, u32 g) {
#pragma unroll
    for (int m = 0; m < RPG; ++m)
        out.w[m] = load_words(qw4 + (size_t)(row0 + g * GROUP_ROWS + lane + LANES * m) * (NP / 4) + quad4);
    out.s = __ldg(s2 + (size_t)(row0 / GROUP_ROWS + g) * (NP / 4) + quad4);
#if HAS_Z
    out.z = __ldg(z2 + (size_t)(row0 / GROUP_ROWS + g) * (NP / 4) + quad4);
#endif
}

// One group of one thread: RPG word rows x 4 columns x M rows of x of products (q x 2^-64), then the group's
// scale and zero: res[c][r] += s_c (sum q x_r - z_c sum x_r).
__device__ __forceinline__ void group_products(const Group& cur, const float* xs, const float* xrow, u32 g,
                                               u32 lane, float res[4][M]) {
    float aq[4][M] = {};
    float xg[M] = {};
#pragma unroll
    for (int m = 0; m < RPG; ++m) {
        const u32 j = g * GROUP_ROWS + lane + LANES * m;
        float xv[M][EPW];
#pragma unroll
        for (int r = 0; r < M; ++r) {
            const float4* xr = reinterpret_cast<const float4*>(xs + r * KS + j * EPW);
#pragma unroll
            for (int v = 0; v < EPW / 4; ++v) {
                const float4 q = xr[v];
                xv[r][4 * v] = q.x, xv[r][4 * v + 1] = q.y, xv[r][4 * v + 2] = q.z, xv[r][4 * v + 3] = q.w;
            }
            xg[r] += xrow[r * ROWS + j];
        }
        const u32 wc[4] = {cur.w[m].x, cur.w[m].y, cur.w[m].z, cur.w[m].w};
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            const u32 lo = wc[c], hi = wc[c] >> 16;
#pragma unroll
            for (int e = 0; e < EPW; ++e) {
                const float q = __uint_as_float((low_half(e) ? lo : hi) & (((1u << BITS) - 1u) << code_shift(e)));
#pragma unroll
                for (int r = 0; r < M; ++r) aq[c][r] = fmaf(q, xv[r][e], aq[c][r]);
            }
        }
    }
    const u32 sv[2] = {cur.s.x, cur.s.y};
#if HAS_Z
    const u32 zv[2] = {cur.z.x, cur.z.y};
#endif
#pragma unroll
    for (int c = 0; c < 4; ++c) {
        const float sc = S_TO_F32((u16)(sv[c / 2] >> (16 * (c % 2))));
#if HAS_Z
        const float zc = S_TO_F32((u16)(zv[c / 2] >> (16 * (c % 2))));
#else
        const float zc = (float)ZP;
#endif
#pragma unroll
        for (int r = 0; r < M; ++r) res[c][r] = fmaf(sc, fmaf(aq[c][r], 0x1p64f, -zc * xg[r]), res[c][r]);
    }
}

extern "C" __global__ void __launch_bounds__(THREADS)
gemv_small_m(const int* __restrict__ qw, const u16* __restrict__ s, const u16* __restrict__ z,
        const u16* __restrict__ x, out_t* __restrict__ out, float* __restrict__ ws, u32* __restrict__ counters) {
    PK_DYNAMIC_SHARED(float4, smem4);
    float* xs = reinterpret_cast<float*>(smem4);   // [M][KS]: x of the slice, pre-scaled, in word-row order
    float* xrow = xs + M * KS;                      // [M][ROWS]: per word row, the sum of its x (unscaled)
    float* red = xrow + M * ROWS;                   // [LANES][M][BN]: the row lanes' partial columns
    PK_SHARED(u32, last);

    const u32 t = threadIdx.x, quad = t % QUADS, lane = t / QUADS;
    const u32 slice = blockIdx.x % S, tile = blockIdx.x / S;
    const u32 quad4 = tile * QUADS + quad;          // 16-byte column quad within a row of NP words
    const u32 row0 = slice * ROWS;                  // first word row of the slice
    const uint4* qw4 = reinterpret_cast<const uint4*>(qw);
    const uint2* s2 = reinterpret_cast<const uint2*>(s);
    const uint2* z2 = reinterpret_cast<const uint2*>(z);

    // -- phase 1: the first PF groups of words, scales and zeros in flight (they do not depend on the kernel
    //    before this one, so they go out before the wait)
    Group buf[PF];
#pragma unroll
    for (int p = 0; p < PF; ++p)
        if (p < GROUPS) load_group(buf[p], qw4, s2, z2, row0, lane, quad4, p);
#if PDL && !defined(PK_HOST)
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif

    // -- phase 2: stage x of the slice in word-row order, scaled per code position (16-byte loads of x: for int4
    //    the 8 rows of an interleave block at one code position, for int8 one row's 4 codes), then each word
    //    row's plain sum from the staged values (the scales are powers of two: exact)
#if BITS == 4
#pragma unroll 4
    for (u32 i = t; i < M * (KS / 8); i += THREADS) {    // i = (r, block * 8 + e): rows block * 8 .. + 7, position e
        const u32 r = i / (KS / 8), ib = i % (KS / 8);
        const uint4 v = __ldg(reinterpret_cast<const uint4*>(x + (size_t)r * K + slice * KS) + ib);
        const u32 blk = ib / 8, e = ib % 8;
        const u32 h[4] = {v.x, v.y, v.z, v.w};
        const float sc = x_scale(e);
#pragma unroll
        for (int q = 0; q < 8; ++q)
            xs[r * KS + (blk * 8 + q) * EPW + e] = X_TO_F32((u16)(h[q / 2] >> (16 * (q % 2)))) * sc;
    }
#else
#pragma unroll 4
    for (u32 i = t; i < M * ROWS; i += THREADS) {        // i = (r, word row j)
        const u32 r = i / ROWS, j = i % ROWS;
        const uint2 v = __ldg(reinterpret_cast<const uint2*>(x + (size_t)r * K + slice * KS) + j);
        const u32 h[2] = {v.x, v.y};
#pragma unroll
        for (int e = 0; e < 4; ++e)
            xs[r * KS + j * EPW + e] = X_TO_F32((u16)(h[e / 2] >> (16 * (e % 2)))) * x_scale(e);
    }
#endif
    __syncthreads();
    for (u32 i = t; i < M * ROWS; i += THREADS) {
        float sum = 0.f;
#pragma unroll
        for (int e = 0; e < EPW; ++e) sum += xs[i * EPW + e] * __uint_as_float((u32)(127 - 85 + code_shift(e)) << 23);
        xrow[i] = sum;                                 // i = r * ROWS + j: xs row r starts at r * KS = r * ROWS * EPW
    }
    __syncthreads();
#if PDL && !defined(PK_HOST)
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif

    // -- phase 3: the groups of the slice, PF in flight: consume buffer p, refill it PF groups ahead
    float res[4][M] = {};
    for (u32 g0 = 0; g0 < GROUPS; g0 += PF) {
#pragma unroll
        for (int p = 0; p < PF; ++p) {
            const u32 g = g0 + p;
            if (g < GROUPS) {
                group_products(buf[p], xs, xrow, g, lane, res);
                if (g + PF < GROUPS) load_group(buf[p], qw4, s2, z2, row0, lane, quad4, g + PF);
            }
        }
    }

    // -- phase 4: the row lanes' sums in lane order, then this slice's columns: written directly (S = 1), or
    //    to the workspace, and the last slice of the tile to arrive adds all S in slice order
#pragma unroll
    for (int c = 0; c < 4; ++c)
#pragma unroll
        for (int r = 0; r < M; ++r) red[(lane * M + r) * BN + quad * 4 + c] = res[c][r];
    __syncthreads();
#if S == 1
    for (u32 i = t; i < M * BN; i += THREADS) {          // i = (r, col)
        const u32 r = i / BN, col = i % BN;
        float part = 0.f;
#pragma unroll
        for (int l = 0; l < LANES; ++l) part += red[(l * M + r) * BN + col];
        if (tile * BN + col < N) out[(size_t)r * N + tile * BN + col] = to_out(part);
    }
#else
    for (u32 i = t; i < M * BN; i += THREADS) {
        const u32 r = i / BN, col = i % BN;
        float part = 0.f;
#pragma unroll
        for (int l = 0; l < LANES; ++l) part += red[(l * M + r) * BN + col];
        ws[(size_t)(slice * M + r) * NP + tile * BN + col] = part;
    }
    __threadfence();
    __syncthreads();
    if (t == 0) last = atomicAdd(counters + tile, 1u) == S - 1;
    __syncthreads();
    if (last) {
        __threadfence();
        for (u32 i = t; i < M * BN; i += THREADS) {
            const u32 r = i / BN, col = i % BN;
            float acc = 0.f;
#pragma unroll 4
            for (u32 q = 0; q < S; ++q) acc += __ldcg(ws + (size_t)(q * M + r) * NP + tile * BN + col);
            if (tile * BN + col < N) out[(size_t)r * N + tile * BN + col] = to_out(acc);
        }
        if (t == 0) counters[tile] = 0u;           // ready for the next launch
    }
#endif
}
