"""The rules a configuration must meet to run an attention op on an architecture family.

``check_tma``, ``check_wgmma``, ``check_decode_ws`` (and ``common.arch.check_pdl``) raise a ``ValueError`` for a
configuration that cannot run ``op``, naming the field, the rule and the way out; ``plan.fit`` turns any
configuration into one that passes them.
"""

from __future__ import annotations

from .. import tuning
from ..common.arch import TMA_ARCHS, check_pdl
from . import decode_ws, wgmma
from .config import AttnConfig, smem_bytes, tma_applies


def check_tma(op, cfg: AttnConfig, arch: str) -> None:
    """Raise when ``cfg`` asks for TMA loads where they cannot run."""
    if not cfg.tma:
        return
    if arch != "interp" and arch not in TMA_ARCHS:
        raise ValueError(f"AttnConfig(tma=True) on {arch}: tensor-descriptor (TMA) loads need one of "
                         f"{', '.join(TMA_ARCHS)}; use tma=False")
    if not tma_applies(op, cfg):
        raise ValueError(f"AttnConfig(tma=True) for {op.kv_layout.value} attention with pack={cfg.pack} "
                         f"and seqlen_k={op.seqlen_k}: the TMA path serves dense keys with one head per tile "
                         f"(prefill) and more than one key; use tma=False "
                         f"or pass the config through attention.plan.fit")


def check_wgmma(op, cfg: AttnConfig, arch: str) -> None:
    """Raise when ``cfg`` asks for the Gluon prefill kernel where it cannot run or in a shape it has not."""
    if not cfg.wgmma:
        if cfg.k_stages:
            raise ValueError(f"AttnConfig(k_stages={cfg.k_stages}) without wgmma: a separate K ring depth is the "
                             f"Gluon prefill kernel's; use k_stages=0 or wgmma=True")
        return
    why = wgmma.blocker(op, arch)
    if why is not None:
        why = f"does not serve this op ({why})"
    elif (cfg.block_m, cfg.num_warps) != (128, 4):
        why = f"runs block_m=128 with num_warps=4, not {cfg.block_m} / {cfg.num_warps}"
    if why is None and (cfg.num_stages < 2 or cfg.block_n not in (32, 64, 128)):
        why = f"needs num_stages >= 2 and block_n 32, 64 or 128, not {cfg.num_stages} / {cfg.block_n}"
    if why is None and cfg.k_stages and cfg.k_stages < 2:
        why = f"needs k_stages 0 (num_stages) or >= 2, not {cfg.k_stages}"
    need = smem_bytes(op, 128, cfg.block_n, cfg.num_stages, cfg.k_stages) + tuning.WGMMA_SMEM_EXTRA
    limit = tuning.SMEM_LIMIT[arch]
    if why is None and need > limit:
        why = (f"with block_n={cfg.block_n}, num_stages={cfg.num_stages} and k_stages={cfg.k_stages} needs "
               f"{need} bytes of shared memory, over {arch}'s {limit}")
    if why is None and (cfg.tma or cfg.lazy_rescale or cfg.pack > 1 or cfg.num_splits > 1):
        why = "has its own TMA loads and schedule: tma, lazy_rescale, pack and num_splits stay off"
    if why:
        raise ValueError(f"AttnConfig(wgmma=True): the Gluon prefill kernel {why}; use wgmma=False "
                         f"or pass the config through attention.plan.fit")


def check_decode_ws(op, cfg: AttnConfig, arch: str) -> None:
    """Raise when ``cfg`` asks for the Gluon decode kernel where it cannot run or in a shape it has not."""
    if not cfg.decode_ws:
        return
    why = decode_ws.blocker(op, arch, cfg.block_n)
    need = decode_ws.smem_bytes(op, cfg.block_n, cfg.num_stages) + tuning.WGMMA_SMEM_EXTRA
    if why is not None:
        why = f"does not serve this op ({why})"
    elif cfg.num_stages < 2:
        why = f"needs num_stages >= 2, not {cfg.num_stages}"
    elif need > tuning.SMEM_LIMIT[arch]:
        why = (f"with block_n={cfg.block_n} and num_stages={cfg.num_stages} needs {need} bytes of shared memory, "
               f"over {arch}'s {tuning.SMEM_LIMIT[arch]}")
    elif cfg.wgmma or cfg.tma or cfg.lazy_rescale:
        why = "has its own TMA loads and schedule: wgmma, tma and lazy_rescale stay off"
    if why:
        raise ValueError(f"AttnConfig(decode_ws=True): the Gluon decode kernel {why}; use decode_ws=False "
                         f"or pass the config through attention.plan.fit")


def check(op, cfg: AttnConfig, arch: str) -> None:
    """Every rule ``cfg`` must meet to run ``op`` on ``arch`` (raises the first broken one's ``ValueError``)."""
    check_pdl(cfg, arch)
    check_tma(op, cfg, arch)
    check_wgmma(op, cfg, arch)
    check_decode_ws(op, cfg, arch)
