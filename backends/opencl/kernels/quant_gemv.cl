/* portakern opencl backend: weight-only quantized GEMV, out = x_in @ dequant(W)^T, OpenCL C 1.2.
 *
 * The weight arrives repacked once by quant_gemv.prepare_weight into one layout for every packing:
 *   codes  uchar (N, K/2) at 4 bits (k = 2j low nibble, 2j+1 high nibble) or (N, K) at 8 bits, unsigned;
 *   scales float (N, NG), zeros float (N, NG): dequant(W)[n, k] = (code - zeros[n, g]) * scales[n, g];
 *   g_idx  int (K,) with HAS_GIDX (GPTQ act-order), else g = k / GS.
 * One work-group per (output column n, block of MT activation rows). Its WG work-items split K into
 * chunks of CH consecutive k inside one quantization group, so a work-item reads the scale and zero
 * point once per chunk; every code is dequantized once and used for all MT rows. A local-memory tree
 * reduction sums the work-items' partial dot products. Accumulation is float32; half is storage only.
 *
 * Defines (quant_gemv.py): K, N, M, MT, WG, GS, NG, CH, BITS, HAS_GIDX, IN_HALF (x), OUT_HALF; storage.cl (prepended) gives tin / LD, tout / ST.
 */

/* The silu_mul prologue: x_in[m, k] = silu(x[m, k]) * x[m, K + k] in float32, into a float buffer the
 * GEMV kernel then reads (formed once, not once per output column). silu(g) = g * (1 + tanh(g / 2)) / 2. */
__kernel void pk_silu_mul(__global const tin *x, __global float *xin, const long x_off, const long x_sm)
{
    const int k = get_global_id(0);
    const int m = get_global_id(1);
    if (k >= K)
        return;
    const float g = LD(x, x_off + m * x_sm + k);
    const float u = LD(x, x_off + m * x_sm + K + k);
    xin[(long)m * K + k] = g * (0.5f * (1.0f + tanh(0.5f * g))) * u;
}

#if XIN_FLOAT
#define LDA(p, i) ((p)[(i)])
typedef float ta;
#else
#define LDA(p, i) LD(p, i)
typedef tin ta;
#endif

__kernel __attribute__((reqd_work_group_size(WG, 1, 1)))
void pk_quant_gemv(__global const ta *x, __global const uchar *codes, __global const float *scales,
                   __global const float *zeros, __global const int *g_idx, __global tout *out,
                   const long x_off, const long x_sm)
{
    __local float red[MT * WG];
    const int lid = get_local_id(0);
    const int n = get_group_id(0);
    const int m0 = get_group_id(1) * MT;
    const int rows = min(MT, M - m0);
    float acc[MT];
    for (int r = 0; r < MT; ++r)
        acc[r] = 0.0f;

    /* -- phase 1: this work-item's chunks of K: dequantize each code once, FMA it into every row */
    const long crow = (long)n * (BITS == 4 ? K / 2 : K);
    const long srow = (long)n * NG;
    for (int c = lid; c < K / CH; c += WG) {
        const int k0 = c * CH;
#if !HAS_GIDX
        const float s = scales[srow + k0 / GS];      /* one scale and zero point per chunk (inside one group) */
        const float z = zeros[srow + k0 / GS];
#endif
        for (int kk = 0; kk < CH; ++kk) {
            const int k = k0 + kk;
#if HAS_GIDX
            const int g = g_idx[k];
            const float s = scales[srow + g];
            const float z = zeros[srow + g];
#endif
#if BITS == 4
            const uint code = (codes[crow + (k >> 1)] >> ((k & 1) * 4)) & 15u;
#else
            const uint code = codes[crow + k];
#endif
            const float w = ((float)code - z) * s;
            for (int r = 0; r < MT; ++r)
                if (r < rows)
                    acc[r] = fma(LDA(x, x_off + (long)(m0 + r) * x_sm + k), w, acc[r]);
        }
    }

    /* -- phase 2: tree reduction of the WG partial sums of each row in local memory */
    for (int r = 0; r < MT; ++r)
        red[r * WG + lid] = acc[r];
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int step = WG / 2; step > 0; step >>= 1) {
        if (lid < step)
            for (int r = 0; r < MT; ++r)
                red[r * WG + lid] += red[r * WG + lid + step];
        barrier(CLK_LOCAL_MEM_FENCE);
    }

    /* -- phase 3: work-item r writes row m0 + r of column n */
    if (lid < rows)
        ST(red[lid * WG], out, (long)(m0 + lid) * N + n);
}
