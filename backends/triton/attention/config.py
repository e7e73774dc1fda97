"""One launch configuration of the attention kernels (``AttnConfig``), the lengths a built kernel reads of a call
(``Lengths``) and the shared-memory estimate of a tile.

``rules.py`` says which configurations can run an op; ``plan.py`` picks the table's and fits any other.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import NamedTuple


class Lengths(NamedTuple):
    """What a built kernel reads of a call's lengths: the op's ``seqlen_q``, ``seqlen_k`` and ``total_q`` at them
    (as ``portakern.lengths.attention_at`` sets them: varlen has ``seqlen_q = total_q``, ``seqlen_k = total_k``;
    paged ``seqlen_k`` = the block table's width x page size)."""

    seqlen_q: int
    seqlen_k: int
    total_q: int


@dataclass(frozen=True)
class AttnConfig:
    """One launch configuration of ``attn_fwd`` (and ``attn_combine`` when ``num_splits > 1``)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    pack: int = 1          # query heads per tile row group: 1 or the GQA group size
    num_splits: int = 1    # KV splits (1 = no workspace, no combine)
    fused_combine: bool = True  # the last split merges (one launch) instead of attn_combine
    #: programmatic dependent launch (sm_90+): ``attn_fwd`` is launched while the previous kernel in
    #: the stream drains and waits for it (``griddepcontrol.wait``) before its first read; with a
    #: separate merge, ``attn_combine`` is launched the same way behind ``attn_fwd`` (the merge alone as a
    #: dependent gained < 0.1 us on the H200: ``attention-decode-sweep-pdl-h200.json``)
    pdl: bool = False
    #: rescale the accumulator only when a row maximum grows by > 2^8 (FA4's conditional rescale).
    #: In no table: not measured; autotuning times it
    lazy_rescale: bool = False
    #: dense prefill (pack 1): load K and V tiles through host-built TMA tensor descriptors instead of
    #: pointer tiles (sm_90+; the interpreter runs them too). A call whose K or V breaks TMA's rules
    #: (base 16-byte aligned, every stride but the last a multiple of 16 bytes, last stride 1) runs
    #: the pointer kernel instead, compiled on first need (``attention.forward.build``). ``plan.fit`` clears
    #: it for ops it cannot serve (paged, varlen, packed decode); ``tuning.TMA_PREFILL`` says where the table
    #: takes it
    tma: bool = False
    #: run the Gluon prefill kernel for sm_90 (``kernels/attention_wgmma.py``: a TMA load warp and two
    #: 64-row consumer warpgroups with their own schedule) with ``block_n`` keys per tile and a ring of
    #: ``num_stages >= 2`` K/V buffers; ``block_m`` 128 and ``num_warps`` 4 (12 at launch) are fixed.
    #: ``wgmma.blocker`` says which ops it serves (``check_wgmma``, ``plan.fit``)
    wgmma: bool = False
    #: the Gluon kernel's K ring depth where it differs from the V ring's ``num_stages`` (0: the same).
    #: A K stage is free once the tile's scores are done, a tile before its V stage, so a deeper K ring
    #: lets the loads run further ahead where shared memory has room for one more K tile but not a
    #: K/V pair (D=256: 3 K + 2 V buffers of 64 keys beside the 64 KiB query tile)
    k_stages: int = 0
    #: run split decode on the Gluon kernel for sm_90 (``kernels/attention_decode_ws.py``: a load warp that
    #: reads the block table and fills a ring of ``num_stages`` K/V stages of ``block_n`` keys by TMA, one
    #: consumer warpgroup) with ``num_splits`` splits merged by ``attn_combine`` (``fused_combine`` is
    #: ignored; ``pdl`` launches the kernel as a dependent of the previous one and the merge as its
    #: dependent). ``decode_ws.blocker`` says which ops it serves (``check_decode_ws``, ``plan.fit``)
    decode_ws: bool = False
    #: (sm_90+) the merge (``attn_combine``) lets the next kernel in the stream launch as soon as it starts
    #: (``griddepcontrol.launch_dependents``), so a next kernel launched as a programmatic dependent -- the
    #: GEMV of the output projection in a decode step -- sets up and requests its first weight tiles while the
    #: merge runs; that kernel still waits for the merge's completion before it reads the output. ``attn_fwd``
    #: and the Gluon decode kernel with ``pdl`` already do so at their start; without a separate merge
    #: (``num_splits`` 1, or ``fused_combine`` on ``attn_fwd``) it changes nothing
    release_next: bool = False
    #: (sm_90+, the Gluon decode kernel with ``num_splits > 1``) the decode kernel lets its merge launch as soon
    #: as it starts, the merge is launched as a programmatic dependent of it (it waits for the partials before
    #: reading them) and, with ``release_next``, lets the next kernel launch *before* that wait: a next kernel
    #: launched as a programmatic dependent (the o-projection GEMV of a decode step) becomes resident and
    #: requests its first weight tiles while the decode kernel itself runs, and still waits for the merge's
    #: completion (hence the decode kernel's) before reading the output
    early_merge: bool = False

    def to_json(self) -> dict:
        return asdict(self)


def next_pow2(n: int) -> int:
    """The smallest power of two at least ``n`` (1 for ``n <= 1``)."""
    return 1 << max(0, math.ceil(math.log2(max(1, n))))


def smem_bytes(op, block_m: int, block_n: int, stages: int, k_stages: int = 0) -> int:
    """Estimate of shared memory: pipelined K and V tiles (``k_stages`` K tiles when not 0) plus the q tile."""
    elt = 4 if op.dtype.value == "float32" else 2
    bd, bdv = max(16, next_pow2(op.head_dim)), max(16, next_pow2(op.head_dim_v))
    return ((k_stages or stages) * bd + stages * bdv) * block_n * elt + block_m * bd * elt


def tma_applies(op, cfg: AttnConfig) -> bool:
    """Whether ``op`` under ``cfg`` is a tile walk the TMA path serves: dense keys, one head per tile,
    more than one key. With ``seqlen_k == 1`` Triton specialises the argument to the constant 1 and
    the TMA kernel then crashes Triton 3.6's ptxas (exit -11, sm_90a; reproduced off the GPU by
    compiling with that specialisation); one key gains nothing from TMA anyway."""
    return op.kv_layout.value == "dense" and cfg.pack == 1 and op.seqlen_k > 1
