"""L2 prefetch: ask the memory system to bring a byte range into the L2 cache, fire and forget.

A program covers ``PER_PROGRAM`` bytes from ``base + program_id * PER_PROGRAM``; each of its lanes
issues one request for ``CHUNK`` bytes (the last one clipped to ``nbytes``). ``BULK``: the Hopper
bulk-copy unit's ``cp.async.bulk.prefetch.L2`` (one instruction per chunk, CHUNK a multiple of
16, sm_90+); otherwise ``prefetch.global.L2::evict_last`` once per 128-byte line of the chunk (sm_80+).
Nothing is written and nothing waits for the data: the program exits once its requests are issued.
"""

import triton
import triton.language as tl


@triton.jit
def l2_prefetch(base, nbytes, CHUNK: tl.constexpr, PER_PROGRAM: tl.constexpr, BULK: tl.constexpr):
    # -- this program's chunks; lanes past the end are predicated off
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * PER_PROGRAM + tl.arange(0, PER_PROGRAM // CHUNK).to(tl.int64) * CHUNK
    live = (offs < nbytes).to(tl.int32)
    ptrs = base + offs
    if BULK:
        # -- one bulk request per lane, clipped to the range (sizes stay multiples of 16)
        size = tl.minimum(nbytes - offs, CHUNK).to(tl.int32)
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $3, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r,r", [ptrs, size, live], dtype=tl.int32, is_pure=False, pack=1)
    else:
        # -- one line request per 128 bytes of the lane's chunk
        for line in tl.static_range(CHUNK // 128):
            ok = (live != 0) & (offs + line * 128 < nbytes)
            tl.inline_asm_elementwise(
                "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0; }",
                "=r,l,r", [ptrs + line * 128, ok.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)
