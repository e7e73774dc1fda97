// Weight-only int4 GEMV for M = 1 to 4 rows on CUDA cores, reading the tensor-core fragment layout: the cuda
// backend's kernel for a prepared weight that holds its codes only as fragments (backends/cuda/quant_gemv.py),
// compiled by NVRTC per shape and format.
//
// Design (docs/design/quant-gemv-cuda.md, "Reading the fragment layout"): the arithmetic of gemv_small_m.cu (per code
// one LOP3 and one FFMA: the code masked in place and read as an fp32 subnormal, x pre-scaled per code position) on
// the byte order of ir/gemv_layout.py's pack_fragments, which the triton backend's tensor-core kernel reads at M >= 2.
// Each warp streams whole 1 KB tiles (16 rows x 128 columns of K): lane (g, t) = (lane / 4, lane % 4) loads 16
// bytes of each 512-byte half h, its words reg = 2 cb + rb being row 8 rb + g of the tile and, at nibble e (bits
// 4 e .. 4 e + 3), column 64 h + 16 t + 4 (e % 4) + 2 cb + e / 4 -- 2 rows x 16 contiguous columns of K per lane
// and half. So every lane's x for a half is one 16-column block, staged once per CTA in shared memory, scaled per
// code position and permuted so that word cb's eight codes meet two 16-byte shared loads, shared by the 2 NT rows
// of the lane's NT tiles. The four lanes t of a row add their sums by two xor shuffles; the CTA's K warps through
// shared memory; split K through an fp32 workspace merged by the last CTA of a column tile in slice order
// (deterministic; the counter resets itself, so CUDA graphs replay it), as gemv_small_m.cu.
//
// Layout: frag (KC, NP / 16, 256) int32, KC = K / 128 chunks, tile (c, u) = 256 words at (c * NP / 16 + u) * 256,
// word 128 h + 4 lane + reg; scales s and zero points z (G, NP), fp16 or bf16, G = K / GS (no z: HAS_Z 0, the
// constant ZP); x (M, K) bf16 or fp16, contiguous and 16-byte aligned; out (M, N) bf16, fp16 or fp32, contiguous.
//
// Compile-time constants (-D): M (rows, 1-4), N, K (a multiple of 128), NP (the row stride of frag, s and z, a
// multiple of 16 >= N), GS (group size, a multiple of 128), RW (row warps: a CTA has BN = 16 NT RW rows), NT (16-row
// tiles per warp), KW (K warps: warp kw takes chunks kw, kw + KW, ... of the CTA's slice), S (K slices), PF (chunks
// each thread keeps in flight), PDL (1: programmatic dependent launch -- first weight loads, then griddepcontrol.wait
// before x is read; sm_90+), HAS_Z, ZP, LDNA (1: weight loads as ld.global.nc.L1::no_allocate.L2::256B), X_F16 (x
// is fp16, else bf16), S_BF16 (scales and zeros are bf16, else fp16), OUT_KIND (0 bf16, 1 fp16, 2 fp32).

// PK_HOST: compiled as C++ for the CPU by backends/cuda/common/host_run.py (host_shim.h: threads of a block as
// std::threads, __syncthreads and the shuffles at one barrier); each inline-PTX spot has a plain C++ branch.

typedef unsigned int u32;
typedef unsigned short u16;

#ifndef PK_HOST
#define PK_DYNAMIC_SHARED(type, name) extern __shared__ type name[]
#define PK_SHARED(type, name) __shared__ type name
#define PK_SHFL_XOR(v, m) __shfl_xor_sync(0xFFFFFFFFu, (v), (m))
#endif

#define KC (K / 128)                    // 128-column chunks of K
#define CS (KC / S)                     // chunks of one slice
#define CPW (CS / KW)                   // chunks of one warp
#define KS (CS * 128)                   // columns of one slice
#define NB (KS / 16)                    // 16-column x blocks of one slice
#define NU (NP / 16)                    // 16-row tiles of a chunk
#define BN (16 * NT * RW)               // rows (output columns) of a CTA
#define THREADS (32 * RW * KW)
#define TILES ((N + BN - 1) / BN)
#define WS_STRIDE (TILES * BN)          // row stride of the split-K workspace

static_assert(K % 128 == 0 && GS % 128 == 0 && K % GS == 0, "K and the groups are whole 128-column chunks");
static_assert(KC % S == 0 && CS % KW == 0, "each slice holds whole chunks, split evenly between the K warps");
static_assert(NP % 16 == 0 && NP >= N, "the row stride covers every row, in whole 16-row tiles");
static_assert(M >= 1 && M <= 4, "1 to 4 rows of x");
static_assert(PF >= 1 && PF <= CPW, "1 to CPW chunks in flight");

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

// -- nibble e of a word, masked in place and read as an fp32 subnormal, is q * 2^P(e) * 2^-149 (nibbles 5-7 from
//    the word shifted right by 16, so that no code reaches the exponent); x of that nibble carries 2^(85 - P(e)),
//    so each product is q * x * 2^-64
__device__ __forceinline__ bool low_half(int e) { return 4 * e + 4 <= 23; }
__device__ __forceinline__ int code_shift(int e) { return low_half(e) ? 4 * e : 4 * e - 16; }
__device__ __forceinline__ float x_scale(int e) {                // 2^(85 - P(e)), exact
    return __uint_as_float((u32)(127 + 85 - code_shift(e)) << 23);
}

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

// -- the staged x: block b (16 columns of the slice) of row r holds at position 8 cb + e the column
//    16 b + 4 (e % 4) + 2 cb + e / 4, times x_scale(e); its four 16-byte quarters q are stored at q ^ ((b >> 1) & 3),
//    so that the lanes t = 0..3 of a warp, which read blocks b .. b + 3 at one time, meet no bank twice
__device__ __forceinline__ u32 x_slot(u32 b, u32 q) { return 16 * b + 4 * (q ^ ((b >> 1) & 3)); }

struct Chunk {                  // one thread's words, scales and zeros of one chunk: NT tiles x 2 halves, 2 rows each
    uint4 w[NT][2];
    u16 s[NT][2], z[NT][2];
};

// woff[j]: the lane's 16-byte word of tile j within a chunk (unit * 64 + lane); soff[j]: its row g of tile j within
// a row of scales (16 unit + g). Chunk c adds c NU 64 to the words, its group's row of NP to the scales.
__device__ __forceinline__ void load_chunk(Chunk& out, const uint4* fw4, const u16* s, const u16* z, u32 c,
                                           const u32 (&woff)[NT], const u32 (&soff)[NT]) {
    const uint4* wc = fw4 + (size_t)c * (NU * 64);
    const size_t srow = (size_t)(c * 128 / GS) * NP;
#pragma unroll
    for (int j = 0; j < NT; ++j) {
#pragma unroll
        for (int h = 0; h < 2; ++h) out.w[j][h] = load_words(wc + woff[j] + 32 * h);
#pragma unroll
        for (int rb = 0; rb < 2; ++rb) {
            out.s[j][rb] = __ldg(s + srow + soff[j] + 8 * rb);
#if HAS_Z
            out.z[j][rb] = __ldg(z + srow + soff[j] + 8 * rb);
#endif
        }
    }
}

// One chunk (local index cl of the slice) of one thread: its 2 x 16 columns of K for 2 NT rows and M rows of x, the
// products summed per row (q x 2^-64), then the group's scale and zero: res += s (sum q x - z sum x).
__device__ __forceinline__ void chunk_products(const Chunk& cur, const float* xe, const float* xo, const float* xsum,
                                               u32 cl, u32 t, float (&res)[NT][2][M]) {
    float aq[NT][2][M] = {};
    float xg[M];
#pragma unroll
    for (int r = 0; r < M; ++r) xg[r] = xsum[r * NB + 8 * cl + t] + xsum[r * NB + 8 * cl + 4 + t];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
        for (int cb = 0; cb < 2; ++cb) {
            float xv[M][8];
#pragma unroll
            for (int r = 0; r < M; ++r) {
#pragma unroll
                for (int v = 0; v < 2; ++v) {
                    // quarter q = 2 cb + v of block 8 cl + 4 h + t, at slot q ^ (2 h) ^ (t >> 1) (x_slot): xe / xo
                    // carry the thread's t part for slots of even / odd q ^ 2h
                    const int q = (2 * cb + v) ^ (2 * h);
                    const float* base = (q & 1) ? xo : xe;
                    const float4 f = *reinterpret_cast<const float4*>(base + r * KS + 128 * cl + 64 * h + 4 * q);
                    xv[r][4 * v] = f.x, xv[r][4 * v + 1] = f.y, xv[r][4 * v + 2] = f.z, xv[r][4 * v + 3] = f.w;
                }
            }
#pragma unroll
            for (int j = 0; j < NT; ++j) {
                const u32 wr[4] = {cur.w[j][h].x, cur.w[j][h].y, cur.w[j][h].z, cur.w[j][h].w};
#pragma unroll
                for (int rb = 0; rb < 2; ++rb) {
                    const u32 lo = wr[2 * cb + rb], hi = lo >> 16;
#pragma unroll
                    for (int e = 0; e < 8; ++e) {
                        const float qf = __uint_as_float((low_half(e) ? lo : hi) & (0xFu << code_shift(e)));
#pragma unroll
                        for (int r = 0; r < M; ++r) aq[j][rb][r] = fmaf(qf, xv[r][e], aq[j][rb][r]);
                    }
                }
            }
        }
    }
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int rb = 0; rb < 2; ++rb) {
            const float sc = S_TO_F32(cur.s[j][rb]);
#if HAS_Z
            const float zc = S_TO_F32(cur.z[j][rb]);
#else
            const float zc = (float)ZP;
#endif
#pragma unroll
            for (int r = 0; r < M; ++r)
                res[j][rb][r] = fmaf(sc, fmaf(aq[j][rb][r], 0x1p64f, -zc * xg[r]), res[j][rb][r]);
        }
}

extern "C" __global__ void __launch_bounds__(THREADS)
gemv_frag(const int* __restrict__ fw, const u16* __restrict__ s, const u16* __restrict__ z,
          const u16* __restrict__ x, out_t* __restrict__ out, float* __restrict__ ws, u32* __restrict__ counters) {
    PK_DYNAMIC_SHARED(float4, smem4);
    float* xs = reinterpret_cast<float*>(smem4);   // [M][KS]: x of the slice, scaled and permuted (x_slot)
    float* xsum = xs + M * KS;                      // [M][NB]: per 16-column block, the sum of its x (unscaled)
    float* red = xsum + M * NB;                     // [KW][M][BN]: the K warps' partial rows
    PK_SHARED(u32, last);

    const u32 tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const u32 rw = warp % RW, kw = warp / RW, g = lane / 4, t = lane % 4;
    const u32 slice = blockIdx.x % S, tile = blockIdx.x / S;
    const u32 c0 = slice * CS;                      // first chunk of the slice
    const uint4* fw4 = reinterpret_cast<const uint4*>(fw);
    u32 woff[NT], soff[NT];                         // the warp's tiles; past the last one (N % BN) read the last
#pragma unroll
    for (int j = 0; j < NT; ++j) {
        const u32 unit = min((u32)((tile * RW + rw) * NT + j), (u32)(NU - 1));
        woff[j] = unit * 64 + lane;
        soff[j] = unit * 16 + g;
    }

    // -- phase 1: the first PF chunks of words, scales and zeros in flight (constant: before the wait)
    Chunk buf[PF];
#pragma unroll
    for (int p = 0; p < PF; ++p) load_chunk(buf[p], fw4, s, z, c0 + kw + KW * p, woff, soff);
#if PDL && !defined(PK_HOST)
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif

    // -- phase 2: stage x of the slice, one 16-column block per step (two 16-byte loads), scaled and permuted, and
    //    each block's plain sum
#pragma unroll 2
    for (u32 i = tid; i < M * NB; i += THREADS) {          // i = (r, block b)
        const u32 r = i / NB, b = i % NB;
        const uint4* src = reinterpret_cast<const uint4*>(x + (size_t)r * K + slice * KS + 16 * b);
        const uint4 v0 = __ldg(src), v1 = __ldg(src + 1);
        const u32 hw[8] = {v0.x, v0.y, v0.z, v0.w, v1.x, v1.y, v1.z, v1.w};
        float xf[16];
        float sum = 0.f;
#pragma unroll
        for (int k = 0; k < 16; ++k) {
            xf[k] = X_TO_F32((u16)(hw[k / 2] >> (16 * (k % 2))));
            sum += xf[k];
        }
        float* row = xs + r * KS;
#pragma unroll
        for (int q = 0; q < 4; ++q) {                      // quarter q = 2 cb + e / 4: nibbles e % 4 = 0..3
            const int cb = q / 2, hi = q % 2;
            float4 f;
            f.x = xf[0 + 2 * cb + hi] * x_scale(4 * hi + 0);
            f.y = xf[4 + 2 * cb + hi] * x_scale(4 * hi + 1);
            f.z = xf[8 + 2 * cb + hi] * x_scale(4 * hi + 2);
            f.w = xf[12 + 2 * cb + hi] * x_scale(4 * hi + 3);
            *reinterpret_cast<float4*>(row + x_slot(b, q)) = f;
        }
        xsum[r * NB + b] = sum;
    }
    __syncthreads();
#if PDL && !defined(PK_HOST)
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif

    // -- phase 3: the warp's chunks of the slice, PF in flight: consume buffer p, refill it PF chunks ahead
    const float* xe = xs + 16 * t + 4 * (t >> 1);  // slots of even q ^ 2h: q ^ (t >> 1) = q + (t >> 1)
    const float* xo = xs + 16 * t - 4 * (t >> 1);  //          odd:                     = q - (t >> 1)
    float res[NT][2][M] = {};
    for (u32 i0 = 0; i0 < CPW; i0 += PF) {
#pragma unroll
        for (int p = 0; p < PF; ++p) {
            const u32 i = i0 + p;
            if (i < CPW) {
                chunk_products(buf[p], xe, xo, xsum, kw + KW * i, t, res);
                if (i + PF < CPW) load_chunk(buf[p], fw4, s, z, c0 + kw + KW * (i + PF), woff, soff);
            }
        }
    }

    // -- phase 4: the four lanes of a row add their sums (xor shuffles), lane t = 0 writes the K warp's rows; the K
    //    warps' sums in warp order, then this slice's rows: written directly (S = 1), or to the workspace, and the
    //    last slice of the tile to arrive adds all S in slice order
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int rb = 0; rb < 2; ++rb)
#pragma unroll
            for (int r = 0; r < M; ++r) {
                float v = res[j][rb][r];
                v += PK_SHFL_XOR(v, 1);
                v += PK_SHFL_XOR(v, 2);
                if (t == 0) red[(kw * M + r) * BN + (rw * NT + j) * 16 + 8 * rb + g] = v;
            }
    __syncthreads();
#if S == 1
    for (u32 i = tid; i < M * BN; i += THREADS) {           // i = (r, row)
        const u32 r = i / BN, n = i % BN;
        float part = 0.f;
#pragma unroll
        for (int k = 0; k < KW; ++k) part += red[(k * M + r) * BN + n];
        if (tile * BN + n < N) out[(size_t)r * N + tile * BN + n] = to_out(part);
    }
#else
    for (u32 i = tid; i < M * BN; i += THREADS) {
        const u32 r = i / BN, n = i % BN;
        float part = 0.f;
#pragma unroll
        for (int k = 0; k < KW; ++k) part += red[(k * M + r) * BN + n];
        ws[(size_t)(slice * M + r) * WS_STRIDE + tile * BN + n] = part;
    }
    __threadfence();
    __syncthreads();
    if (tid == 0) last = atomicAdd(counters + tile, 1u) == S - 1;
    __syncthreads();
    if (last) {
        __threadfence();
        for (u32 i = tid; i < M * BN; i += THREADS) {
            const u32 r = i / BN, n = i % BN;
            float acc = 0.f;
#pragma unroll 4
            for (u32 q = 0; q < S; ++q) acc += __ldcg(ws + (size_t)(q * M + r) * WS_STRIDE + tile * BN + n);
            if (tile * BN + n < N) out[(size_t)r * N + tile * BN + n] = to_out(acc);
        }
        if (tid == 0) counters[tile] = 0u;          // ready for the next launch
    }
#endif
}
