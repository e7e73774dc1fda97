/* portakern opencl backend: attention forward (flash-attention style), OpenCL C 1.2.
 *
 * One work-group per (block of BM query rows, kv head, batch entry). The rows of a block are the
 * (query position, query head) pairs of the G query heads that share the kv head, so GQA/MQA decode
 * fills a work-group and each K/V tile is staged once for all of them. Work-item lid owns row
 * r = blk * BM + lid: query head h = kvh * G + r % G, query position i = r / G.
 *
 * Compile-time defines (set by attention.py): D, DV, BM, BN, G, HQ, LAYOUT (0 dense, 1 paged, 2 varlen),
 * HAS_SEQLENS, RETURN_LSE, PAGE_SIZE, IN_HALF, OUT_HALF; pk_score_mod / pk_mask_mod and
 * PK_HAS_SCORE_MOD / PK_HAS_MASK_MOD come from expr_opencl.py, prepended to this file.
 * Arithmetic is float32 throughout; half is storage only (storage.cl, prepended: tin / LD, tout / ST).
 * The lengths are arguments (seqlen_q, seqlen_k, out_rows; paged: seqlen_k = the block table's width x
 * PAGE_SIZE), so one program serves every length of an op's shape class.
 */

#define LAYOUT_DENSE 0
#define LAYOUT_PAGED 1
#define LAYOUT_VARLEN 2

/* element offset of key position t of this sequence (kv head excluded) */
inline long key_row(int t, int b, long base, long sb, long ss, __global const int *block_table, int max_pages) {
#if LAYOUT == LAYOUT_PAGED
    int page = block_table[b * max_pages + t / PAGE_SIZE];
    return base + (long)page * sb + (long)(t % PAGE_SIZE) * ss;
#else
    return base + (long)b * sb + (long)t * ss;
#endif
}

__kernel __attribute__((reqd_work_group_size(BM, 1, 1)))
void pk_attention(__global const tin *q, __global const tin *k, __global const tin *v,
                  __global tout *out, __global float *lse,
                  __global const int *idx0,      /* block_table (paged) | cu_seqlens_q (varlen) | unused */
                  __global const int *idx1,      /* seqlens_k (dense with lengths, paged) | cu_seqlens_k */
                  const float scale, const int seqlen_q, const int seqlen_k, const int out_rows,
                  const long q_off, const long q_sb, const long q_ss, const long q_sh,
                  const long k_off, const long k_sb, const long k_ss, const long k_sh,
                  const long v_off, const long v_sb, const long v_ss, const long v_sh)
{
    __local float ks[BN * D];     /* the K tile: BN keys x D */
    __local float vs[BN * DV];    /* the V tile: BN keys x DV */
    const int lid = get_local_id(0);
    const int blk = get_group_id(0);
    const int kvh = get_group_id(1);
    const int b = get_group_id(2);

    /* -- phase 0: this batch entry's lengths and first rows (uniform over the work-group) */
    int sq_b = seqlen_q, sk_b = seqlen_k, q0 = 0, k0 = 0;
#if LAYOUT == LAYOUT_VARLEN
    q0 = idx0[b]; sq_b = idx0[b + 1] - q0;
    k0 = idx1[b]; sk_b = idx1[b + 1] - k0;
#elif LAYOUT == LAYOUT_PAGED || HAS_SEQLENS
    sk_b = idx1[b];
#endif
    if (blk * BM >= G * sq_b)
        return;                       /* every row of this block is past the sequence: whole group leaves */
    const int row = blk * BM + lid;
    const int valid = row < G * sq_b;
    const int i = row / G;
    const int h = kvh * G + row % G;

    /* -- phase 1: this work-item's query row into private memory */
    float qv[D];
    const long qbase = q_off + (long)b * q_sb + (long)(q0 + i) * q_ss + (long)h * q_sh;
    for (int d = 0; d < D; ++d)
        qv[d] = valid ? LD(q, qbase + d) : 0.0f;
    float acc[DV];
    for (int d = 0; d < DV; ++d)
        acc[d] = 0.0f;
    float m = -INFINITY;              /* running max of the visible scores */
    float l = 0.0f;                   /* running sum of exp(score - m) */
    int poisoned = 0;                 /* a visible score was NaN (fmax skips NaN): the row is NaN */
    const long kseq = LAYOUT == LAYOUT_PAGED ? k_off : k_off + (long)k0 * k_ss;
    const long vseq = LAYOUT == LAYOUT_PAGED ? v_off : v_off + (long)k0 * v_ss;

    for (int t0 = 0; t0 < sk_b; t0 += BN) {
        /* -- phase 2: stage the K and V tiles of keys t0 .. t0+BN-1 in local memory (all work-items) */
        for (int e = lid; e < BN * D; e += BM) {
            const int t = t0 + e / D;
            ks[e] = t < sk_b ? LD(k, key_row(t, b, kseq, k_sb, k_ss, idx0, seqlen_k / PAGE_SIZE) + (long)kvh * k_sh + e % D) : 0.0f;
        }
        for (int e = lid; e < BN * DV; e += BM) {
            const int t = t0 + e / DV;
            vs[e] = t < sk_b ? LD(v, key_row(t, b, vseq, v_sb, v_ss, idx0, seqlen_k / PAGE_SIZE) + (long)kvh * v_sh + e % DV) : 0.0f;
        }
        barrier(CLK_LOCAL_MEM_FENCE);

        if (valid) {
            /* -- phase 3: scores of this row against the tile: scale * q.k, score_mod, mask (-inf hides) */
            float s[BN];
            float mt = -INFINITY;
            for (int j = 0; j < BN; ++j) {
                const int t = t0 + j;
                float sc = -INFINITY;
                int keep = t < sk_b;
#ifdef PK_HAS_MASK_MOD
                keep = keep && pk_mask_mod(b, h, i, t, sq_b, sk_b);
#endif
                if (keep) {
                    float dot = 0.0f;
                    for (int d = 0; d < D; ++d)
                        dot = fma(qv[d], ks[j * D + d], dot);
                    sc = scale * dot;
#ifdef PK_HAS_SCORE_MOD
                    sc = pk_score_mod(sc, b, h, i, t, sq_b, sk_b);
#endif
                }
                s[j] = sc;
                poisoned |= isnan(sc);
                mt = fmax(mt, sc);
            }
            /* -- phase 4: online softmax: rescale the running sum and accumulator to the new max, add p.V */
            const float mn = fmax(m, mt);
            if (mn != -INFINITY) {    /* nothing visible yet: leave m = -inf, l = 0, acc = 0 */
                const float alpha = exp(m - mn);
                l *= alpha;
                for (int d = 0; d < DV; ++d)
                    acc[d] *= alpha;
                for (int j = 0; j < BN; ++j) {
                    const float p = exp(s[j] - mn);
                    if (p == 0.0f)
                        continue;
                    l += p;
                    for (int d = 0; d < DV; ++d)
                        acc[d] = fma(p, vs[j * DV + d], acc[d]);
                }
                m = mn;
            }
        }
        barrier(CLK_LOCAL_MEM_FENCE);
    }

    /* -- phase 5: normalise and write; a row with no visible key gets out = 0, lse = -inf; a NaN or
     *    +inf visible score (docs/ir.md "Non-finite values") makes l NaN, and so out and lse */
    if (!valid)
        return;
    if (poisoned)
        l = NAN;
    const float inv = l != 0.0f ? 1.0f / l : 0.0f;
#if LAYOUT == LAYOUT_VARLEN
    const long orow = (long)(q0 + i);
#else
    const long orow = (long)b * seqlen_q + i;
#endif
    const long obase = (orow * HQ + h) * DV;
    for (int d = 0; d < DV; ++d)
        ST(acc[d] * inv, out, obase + d);
#if RETURN_LSE
#if LAYOUT == LAYOUT_VARLEN
    lse[(long)h * out_rows + q0 + i] = l != 0.0f ? m + log(l) : -INFINITY;
#else
    lse[((long)b * HQ + h) * seqlen_q + i] = l != 0.0f ? m + log(l) : -INFINITY;
#endif
#endif
}
