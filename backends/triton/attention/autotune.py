"""Autotuning of the attention kernels (``PORTAKERN_TRITON_AUTOTUNE=1``): the candidates worth timing for an op,
its problem bucket, and the cached winner (``common.autotune.cached_best``: keyed by device identity, portakern and
Triton versions, and the bucket; a later process reads it back without timing)."""

from __future__ import annotations

from dataclasses import replace

from .. import tuning
from . import plan
from .config import AttnConfig, next_pow2
from .rules import check

#: The Gluon prefill kernel's ``(block_n, num_stages)`` that autotuning and the benchmark sweep time
WGMMA_CANDIDATE_TILES = ((128, 3), (64, 3), (128, 2), (64, 4))


def bucket(op) -> str:
    """Problem bucket for tuning results: shapes rounded to powers of two, whether a mask and a score_mod are
    given, and what decides which kernels serve the op beside them: the page size (the Gluon decode kernel's
    tiles must divide or be divided by it) and ``seqlens_k`` (the Gluon prefill kernel takes none). Ops of one
    bucket may still differ in what rules a cached winner out (the mask's form, the exact lengths):
    ``restore`` checks it."""
    return (f"{op.kv_layout.value}-d{op.head_dim}-dv{op.head_dim_v}-g{op.group_size}-{op.dtype.value}"
            f"-sq{next_pow2(op.seqlen_q)}-sk{next_pow2(op.seqlen_k)}-b{next_pow2(op.batch)}"
            f"-h{op.heads_q}-m{int(op.mask_mod is not None)}-s{int(op.score_mod is not None)}"
            f"-ps{op.page_size}-sl{int(op.has_seqlens_k)}")


def restore(op, arch: str, entry: dict) -> AttnConfig:
    """A cached winner of ``op``'s bucket as ``op``'s configuration on ``arch``. Raises ``TypeError`` for an entry
    of another shape and ``ValueError`` for a configuration ``op`` rules out (the checks ``forward.build`` makes:
    a Gluon kernel or TMA that does not serve it, ``pdl`` where it cannot run); ``common.autotune.cached_best``
    takes either as a miss and times the bucket again, where the build would have failed the compile."""
    cfg = AttnConfig(**entry)
    check(op, cfg, arch)
    return cfg


def candidates(op, arch: str, num_sms: int) -> list[AttnConfig]:
    """Configurations worth timing for ``op`` (the table's choice first)."""
    base = plan.choose(op, arch, num_sms)
    out = [base]
    if base.pack > 1:
        # the table's kernel and, where that is the Gluon decode kernel, attn_fwd's configuration too
        bases = [base] + ([plan.choose(op, arch, num_sms, wgmma=False)] if base.decode_ws else [])
        for b0 in bases:
            for bn, st, w in ((64, 3, 4), (64, 4, 4), (128, 4, 4), (128, 2, 4), (64, 2, 4)):
                c = plan.fit(op, replace(b0, block_n=bn, num_stages=st, num_warps=w), arch)
                for splits in sorted({b0.num_splits, c.num_splits, max(1, b0.num_splits // 2), b0.num_splits * 2}):
                    n = min(tuning.MAX_SPLITS, max(1, splits))
                    cand = replace(c, num_splits=n, early_merge=c.early_merge and n > 1)
                    if cand not in out:
                        out.append(cand)
        # pdl as the table's (tuning.SPLIT_PDL): checked on the H200 by the GPU tests and conformance
        return out
    out += [c for c in wgmma_candidates(op, arch) if c not in out]
    base = plan.choose(op, arch, num_sms, wgmma=False)
    for bm, bn, w, st in ((128, 64, 8, 3), (128, 128, 8, 2), (128, 64, 4, 3), (64, 64, 4, 3), (128, 32, 4, 3)):
        c = plan.fit(op, replace(base, block_m=bm, block_n=bn, num_warps=w, num_stages=st), arch)
        if c not in out:
            out.append(c)
    out += [replace(c, lazy_rescale=True) for c in [c for c in out if not c.wgmma][:2]]   # the conditional rescale
    for c in (replace(base, tma=True), replace(base, tma=False)):   # TMA loads on the table tile, both ways
        c = plan.fit(op, c, arch)
        if c not in out:
            out.append(c)
    return out


def wgmma_candidates(op, arch: str) -> list[AttnConfig]:
    """The Gluon kernel's tiles worth timing for ``op`` after ``plan.fit`` (none where it does not serve ``op``)."""
    out: list[AttnConfig] = []
    for bn, st in WGMMA_CANDIDATE_TILES:
        c = plan.fit(op, AttnConfig(128, bn, 4, st, wgmma=True), arch)
        if c.wgmma and c not in out:
            out.append(c)
    return out


def tuned(op, device, arch: str, num_sms: int, timer) -> AttnConfig:
    """The cached best configuration of ``op``'s bucket, timing ``candidates`` with ``timer(cfg) -> s``."""
    from ..common.autotune import cached_best

    return cached_best("triton-attention", device, bucket(op), candidates(op, arch, num_sms), timer,
                       default=lambda: plan.choose(op, arch, num_sms), restore=lambda d: restore(op, arch, d))
