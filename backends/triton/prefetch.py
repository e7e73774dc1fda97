"""Host side of the L2 prefetch (``kernels/l2_prefetch.py``): warm the L2 cache with tensors that a
later kernel will read, from a side stream, while the main stream runs kernels that leave the
memory bus idle (element-wise glue, short attention, the tails of other kernels).

A decode step reads every weight once per step; between two GEMVs the DRAM is idle for the glue and
the next kernel's ramp. Launched on a second stream after GEMV ``i`` finishes, a prefetch of GEMV
``i + 1``'s weight moves some of its bytes during that idle time, and GEMV ``i + 1`` then reads them
from L2. Correctness never depends on it: a prefetch writes nothing and reads only constant data.
CUDA-graph safe: a launch allocates nothing and creates no tensor.
"""

from __future__ import annotations

from typing import Any, Iterable

from portakern.errors import UnsupportedError

from . import kernels

#: bytes per request (one lane) and lanes per program (one warp)
CHUNK = 4096
LANES = 32
PER_PROGRAM = CHUNK * LANES


def prefetch_l2(tensors: Iterable[Any], max_bytes: int | None = None, bulk: bool = True) -> int:
    """Issue L2 prefetches for the leading bytes of each CUDA tensor in ``tensors``, in order,
    ``max_bytes`` in all (None: everything). Returns the bytes requested.

    ``bulk``: the bulk-copy unit's prefetch (sm_90+), else one ``prefetch.global.L2`` per 128-byte
    line (sm_80+). Runs on the current stream and returns at once; the data arrives asynchronously.
    Raises ``UnsupportedError`` for a tensor that is not a contiguous CUDA tensor, or under the
    Triton interpreter (there is no cache to warm).
    """
    import torch

    if kernels.interpreted():
        raise UnsupportedError("prefetch_l2: the Triton interpreter has no L2 cache to warm; "
                               "call it on a CUDA device without TRITON_INTERPRET=1")
    fn = kernels.load("l2_prefetch").l2_prefetch
    left = max_bytes
    issued = 0
    for t in tensors:
        if t is None:
            continue
        if not isinstance(t, torch.Tensor) or t.device.type != "cuda" or not t.is_contiguous():
            raise UnsupportedError(f"prefetch_l2: tensors must be contiguous CUDA tensors, got "
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
