/* portakern opencl backend: weight-only quantized GEMV, out = x_in @ dequant(W)^T, OpenCL C 1.2.
 *
 * The weight arrives repacked once by quant_gemv.prepare_weight into one layout for every packing:
 *   codes  uchar (N, K/2) at BITS 4 (k = 2j low nibble, 2j+1 high nibble) or (N, K) at BITS 8 (5-, 6- and
 *          8-bit codes, one a byte), unsigned;
 *   scales float (N, NG), zeros float (N, NG): dequant(W)[n, k] = (code - zeros[n, g]) * scales[n, g];
 *   g_idx  int (K,) with HAS_GIDX (GPTQ act-order), else g = k / GS;
 *   mins   float (N, NG) with HAS_MINS (GGUF Q4_K / Q5_K, zeros unused): dequant = code * scales - mins.
 * One work-group per (output column n, block of MT activation rows). Its WG work-items split K into
 * chunks of CH consecutive k inside one quantization group, so a work-item reads the scale and zero
 * point once per chunk; every code is dequantized once and used for all MT rows. A local-memory tree
 * reduction sums the work-items' partial dot products. Accumulation is float32; half is storage only.
 * With HAS_MINS a chunk is one whole group (CH == GS) and the group's term is
 *   scales[n, g] * sum_{k in g} x[k] * code[n, k] - mins[n, g] * xs[m, g],   xs[m, g] = sum_{k in g} x[m, k],
 * the group sums formed once for all output columns by pk_group_sums.
 *
 * Defines (quant_gemv.py): K, N, M, MT, WG, GS, NG, CH, BITS (code storage: 4 or 8), HAS_GIDX, HAS_MINS,
 * IN_HALF (x), OUT_HALF, XIN_FLOAT; storage.cl (prepended) gives tin / LD, tout / ST.
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

#if HAS_MINS
/* The group sums of the minimum term: xs[m, g] = sum_{k in g} x_in[m, k] in float32, once for all columns. */
__kernel void pk_group_sums(__global const ta *x, __global float *xs, const long x_off, const long x_sm)
{
    const int g = get_global_id(0);
    const int m = get_global_id(1);
    if (g >= NG)
        return;
    const long base = x_off + m * x_sm + (long)g * GS;
    float s = 0.0f;
    for (int i = 0; i < GS; ++i)
        s += LDA(x, base + i);
    xs[(long)m * NG + g] = s;
}
#endif

/* The unsigned code of weight (n, k): crow is the first byte of row n. */
#if BITS == 4
#define CODE(k) ((codes[crow + ((k) >> 1)] >> (((k) & 1) * 4)) & 15u)
#else
#define CODE(k) ((uint)codes[crow + (k)])
#endif

__kernel __attribute__((reqd_work_group_size(WG, 1, 1)))
void pk_quant_gemv(__global const ta *x, __global const uchar *codes, __global const float *scales,
                   __global const float *zeros, __global const int *g_idx, __global const float *mins,
                   __global const float *xs, __global tout *out, const long x_off, const long x_sm)
{
    __local float red[MT * WG];
    const int lid = get_local_id(0);
    const int n = get_group_id(0);
    const int m0 = get_group_id(1) * MT;
    const int rows = min(MT, M - m0);
    float acc[MT];
    for (int r = 0; r < MT; ++r)
        acc[r] = 0.0f;

    const long crow = (long)n * (BITS == 4 ? K / 2 : K);
    const long srow = (long)n * NG;
#if HAS_MINS
    /* -- phase 1 (float minimums): per group g of this work-item, s * sum(x * code) - min * sum(x) */
    for (int g = lid; g < NG; g += WG) {
        float dot[MT];
        for (int r = 0; r < MT; ++r)
            dot[r] = 0.0f;
        for (int kk = 0; kk < GS; ++kk) {
            const int k = g * GS + kk;
            const float code = (float)CODE(k);
            for (int r = 0; r < MT; ++r)
                if (r < rows)
                    dot[r] = fma(LDA(x, x_off + (long)(m0 + r) * x_sm + k), code, dot[r]);
        }
        const float s = scales[srow + g];
        const float mn = mins[srow + g];
        for (int r = 0; r < MT; ++r)
            if (r < rows)
                acc[r] = fma(-mn, xs[(long)(m0 + r) * NG + g], fma(s, dot[r], acc[r]));
    }
#else
    /* -- phase 1: this work-item's chunks of K: dequantize each code once, FMA it into every row */
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
            const float w = ((float)CODE(k) - z) * s;
            for (int r = 0; r < MT; ++r)
                if (r < rows)
                    acc[r] = fma(LDA(x, x_off + (long)(m0 + r) * x_sm + k), w, acc[r]);
        }
    }
#endif

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
