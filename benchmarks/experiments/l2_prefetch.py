"""L2 prefetch from a side stream (an experiment that lost): warm the L2 cache with tensors that a
later kernel will read, from a side stream, while the main stream runs kernels that leave the
memory bus idle (element-wise glue, short attention, the tails of other kernels).

A decode step reads every weight once per step; between two GEMVs the DRAM is idle for the glue and
the next kernel's ramp. Launched on a second stream after GEMV ``i`` finishes, a prefetch of GEMV
``i + 1``'s weight moves some of its bytes during that idle time, and GEMV ``i + 1`` then reads them
from L2. Correctness never depends on it: a prefetch writes nothing and reads only constant data.
CUDA-graph safe: a launch allocates nothing and creates no tensor.

Measured in session 7 (``decode_step.py --prefetch``): the step got slower with every variant
(2.56 ms without, 2.76-2.87 ms with), see ``benchmarks/gemv_notes.md`` v9; kept as an experiment.

The kernel: L2 prefetch: ask the memory system to bring a byte range into the L2 cache, fire and forget.

A program covers ``PER_PROGRAM`` bytes from ``base + program_id * PER_PROGRAM``; each of its lanes
issues one request for ``CHUNK`` bytes (the last one clipped to ``nbytes``). ``BULK``: the Hopper
bulk-copy unit's ``cp.async.bulk.prefetch.L2`` (one instruction per chunk, CHUNK a multiple of
16, sm_90+); otherwise ``prefetch.global.L2::evict_last`` once per 128-byte line of the chunk (sm_80+).
Nothing is written and nothing waits for the data: the program exits once its requests are issued.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
import triton
import triton.language as tl

#: bytes per request (one lane) and lanes per program (one warp)
CHUNK = 4096
LANES = 32
PER_PROGRAM = CHUNK * LANES


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


def prefetch_l2(tensors: Iterable[Any], max_bytes: int | None = None, bulk: bool = True) -> int:
    """Issue L2 prefetches for the leading bytes of each CUDA tensor in ``tensors``, in order,
    ``max_bytes`` in all (None: everything). Returns the bytes requested.

    ``bulk``: the bulk-copy unit's prefetch (sm_90+), else one ``prefetch.global.L2`` per 128-byte
    line (sm_80+). Runs on the current stream and returns at once; the data arrives asynchronously.
    Raises ``ValueError`` for a tensor that is not a contiguous CUDA tensor.
    """
    fn = l2_prefetch
    left = max_bytes
    issued = 0
    for t in tensors:
        if t is None:
            continue
        if not isinstance(t, torch.Tensor) or t.device.type != "cuda" or not t.is_contiguous():
            raise ValueError(f"prefetch_l2: tensors must be contiguous CUDA tensors, got "
                             f"{type(t).__name__} on {getattr(t, 'device', '?')}; pass .contiguous() copies")
        n = t.numel() * t.element_size()
        if left is not None:
            n = min(n, left)
        n -= n % 16
        if n <= 0:
            break
        fn[(-(-n // PER_PROGRAM),)](t.view(torch.uint8).view(-1), n, CHUNK=CHUNK, PER_PROGRAM=PER_PROGRAM,
                                    BULK=bulk, num_warps=1)
        issued += n
        if left is not None:
            left -= n
    return issued
