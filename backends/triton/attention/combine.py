"""The split-KV merge (``kernels/attention_combine.py``): its compile-time arguments and the partials it merges.

Split-KV (decode, when the query tiles alone do not fill the GPU): the keys of each query tile are split
``num_splits`` ways; each split writes a float32 partial output and LSE, and either the separate
``attn_combine`` kernel or the last split to finish (in ``attn_fwd``'s own launch) merges them
(``AttnConfig.fused_combine``; ``tuning.FUSED_COMBINE``). The Gluon decode kernel always merges in
``attn_combine``.
"""

from __future__ import annotations

from typing import Any

from portakern.ir.ops import Attention

from ..kernels.attention_args import combine_constexprs
from .config import AttnConfig


def merge_pdl(cfg: AttnConfig) -> bool:
    """Whether the merge runs as a programmatic dependent launch (only with a separate merge kernel;
    ``attn_fwd`` itself is launched so whenever ``cfg.pdl``; ``early_merge``: behind the Gluon decode kernel,
    which lets it launch at its start)."""
    return (cfg.pdl or cfg.early_merge) and cfg.num_splits > 1 and not cfg.fused_combine


def constexprs(op: Attention, cfg: AttnConfig, block_dv: int) -> dict[str, Any]:
    """The compile-time arguments of ``attn_combine`` (shared by launches and AOT lowering):
    ``kernels.attention_args.combine_constexprs`` with the configuration's launch switches."""
    return combine_constexprs(op, cfg.num_splits, block_dv, pdl=merge_pdl(cfg), release=cfg.release_next,
                              early=cfg.early_merge)


def split_partials(op: Attention, cfg: AttnConfig, R: int, device):
    """The float32 partial outputs ``(num_splits, R, Hq, Dv)`` and log-sum-exps ``(num_splits, R, Hq)`` that
    ``attn_combine`` merges (``attn_fwd``'s and the Gluon decode kernel's workspace)."""
    import torch

    f32 = dict(dtype=torch.float32, device=device)
    return (torch.empty((cfg.num_splits, R, op.heads_q, op.head_dim_v), **f32),
            torch.empty((cfg.num_splits, R, op.heads_q), **f32))
