"""Split-KV combine: merge the per-split partial outputs of ``attention_fwd`` into ``out``/``lse``.

Split ``s`` of row ``(r, h)`` left its normalised partial output ``O_s`` (float32) and the
log-sum-exp ``lse_s`` of the keys it saw (-inf when none) in the workspace::

    ws_o   (NUM_SPLITS, R, HQ, DV)   ws_lse  (NUM_SPLITS, R, HQ)

The merge is ``lse = log sum_s exp(lse_s)``, ``out = sum_s exp(lse_s - lse) O_s``; a row no split
saw gets zeros and ``lse = -inf``.

``PDL``: the kernel is launched with programmatic dependent launch while ``attn_fwd`` still runs
(sm_90+) and starts by waiting for it (``griddepcontrol.wait``). ``RELEASE``: it then lets the next kernel
in the stream launch (``griddepcontrol.launch_dependents``); that kernel, if launched as a dependent, waits
for this one's completion before reading its output. ``EARLY`` (with ``PDL``): the release comes before the wait,
so that next kernel launches while the kernel before this one still runs (``AttnConfig.early_merge``).
"""

import triton
import triton.language as tl

NEG_INF: tl.constexpr = tl.constexpr(float("-inf"))


@triton.jit
def attn_combine(
    WS_O, WS_LSE, O, LSE,
    stride_ob, stride_os, stride_oh, stride_lb, stride_lh, stride_ls,
    seqlen_q, total_rows,
    HQ: tl.constexpr, DV: tl.constexpr, BLOCK_DV: tl.constexpr,
    NUM_SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr, VARLEN: tl.constexpr, RETURN_LSE: tl.constexpr,
    PDL: tl.constexpr, RELEASE: tl.constexpr, EARLY: tl.constexpr = False,
):
    if RELEASE and EARLY:
        # the next kernel may launch while the partials are still being written: it waits for this
        # kernel's completion, which comes after the wait below
        tl.extra.cuda.gdc_launch_dependents()
    if PDL:
        # launched as a programmatic dependent of attn_fwd: wait until its partials are complete
        # and visible (a no-op when launched normally)
        tl.extra.cuda.gdc_wait()
    if RELEASE and not EARLY:
        # the next kernel may launch now (it waits for this one's completion before reading the output)
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    row = pid // HQ
    h = pid % HQ
    s = tl.arange(0, SPLITS_P2)
    offs_dv = tl.arange(0, BLOCK_DV)
    s_ok = s < NUM_SPLITS
    ws_rows = (s.to(tl.int64) * total_rows + row) * HQ + h
    # -- weights of the splits
    lse_s = tl.load(WS_LSE + ws_rows, mask=s_ok, other=NEG_INF)
    m = tl.max(lse_s, 0)
    m_use = tl.where(m == NEG_INF, 0.0, m)
    w = tl.exp(lse_s - m_use)
    den = tl.sum(w, 0)
    # -- weighted sum of the partial outputs
    o_s = tl.load(WS_O + ws_rows[:, None] * DV + offs_dv[None, :], mask=s_ok[:, None] & (offs_dv < DV)[None, :],
                  other=0.0)
    seen = den != 0.0   # a NaN partial (docs/ir.md "Non-finite values") makes den NaN: the row stays NaN
    den_safe = tl.where(seen, den, 1.0)
    out = tl.sum(w[:, None] * o_s, 0) / den_safe
    lse = tl.where(seen, m_use + tl.log(den_safe), NEG_INF)
    # -- store
    if VARLEN:
        o_off = row.to(tl.int64) * stride_os
        l_off = row.to(tl.int64) * stride_ls
    else:
        bb = row // seqlen_q
        qq = row % seqlen_q
        o_off = bb.to(tl.int64) * stride_ob + qq.to(tl.int64) * stride_os
        l_off = bb.to(tl.int64) * stride_lb + qq.to(tl.int64) * stride_ls
    tl.store(O + o_off + h * stride_oh + offs_dv, out.to(O.dtype.element_ty), mask=offs_dv < DV)
    if RETURN_LSE:
        tl.store(LSE + l_off + h * stride_lh, lse)
