"""The triton backend's attention lowering: ``supports``, ``compile``, ``compile_for_target``.

``plan.py`` picks a configuration from ``tuning.py``'s tables (``config.py``: what one holds; ``rules.py``: which
can run an op; ``autotune.py``: timing candidates instead, with ``PORTAKERN_TRITON_AUTOTUNE=1``); ``forward.py``
builds the kernel and its per-call checks (``checks.py``, ``tma.py``); ``combine.py`` the split-KV merge;
``wgmma.py`` and ``decode_ws.py`` host the two Gluon kernels for sm_90 (``gluon.py``: what they share);
``aot.py`` lowers for a target without the device (``specialise.py``: what a launch would specialise).
"""

from __future__ import annotations

from typing import Callable

from portakern.backend import YES, Support, no
from portakern.devices import Device
from portakern.errors import UnsupportedError
from portakern.ir.ops import Attention, KVLayout

from ..common.switches import autotune_enabled
from . import plan

MAX_HEAD_DIM = 256
MAX_GRID_Y = 65535
MAX_VARLEN_BATCH = 1 << 14


def supports(op: Attention, device: Device) -> Support:
    """Whether the kernels can run ``op`` on ``device``; a reason naming the limit when not."""
    from .. import kernels

    where = f"triton on {device.arch or device.type}"
    for field, value in (("head_dim", op.head_dim), ("head_dim_v", op.head_dim_v)):
        if value > MAX_HEAD_DIM:
            return no(f"attention({field}={value}) is not supported by {where}: head dimensions up to "
                      f"{MAX_HEAD_DIM} fit the kernel's tiles; pass backend=\"cpu\" or split the head dimension")
    if device.type == "cpu" and not kernels.interpreted():
        return no("triton was imported before TRITON_INTERPRET=1 was set, so its interpreter cannot run "
                  "here; set TRITON_INTERPRET=1 before the first import of triton")
    cfg = plan.for_device(op, device)
    if op.kv_layout is KVLayout.VARLEN:
        if op.batch >= MAX_VARLEN_BATCH:
            return no(f"varlen attention with batch={op.batch} is not supported by {where}: at most "
                      f"{MAX_VARLEN_BATCH - 1} sequences per call; split the batch")
        grid_y = op.heads_q // cfg.pack
    else:
        grid_y = op.batch * op.heads_q // cfg.pack
    if grid_y > MAX_GRID_Y:
        return no(f"attention with batch x heads = {grid_y} programs on the grid's second axis is not "
                  f"supported by {where} (CUDA allows {MAX_GRID_Y}); split the batch")
    try:
        from ..expr_triton import generate_source

        generate_source(op.score_mod, op.mask_mod)
    except UnsupportedError as e:
        return no(f"{e}; pass backend=\"cpu\"")
    return YES


def compile(op: Attention, device: Device) -> Callable[..., None]:
    """The kernel ``kernel(q, k, v, out, lse, aux)`` for every sequence length of ``op``'s shape class on ``device``
    (``runtime.LengthKernel``: the configuration, table or tuned, follows each call's lengths)."""
    from . import forward
    from .runtime import LengthKernel

    arch, sms = plan.family(device)
    if autotune_enabled() and device.type == "cuda":
        from .autotune import tuned

        def choose(at):
            return tuned(at, device, arch, sms, lambda c: forward.time_config(at, device, c))
    else:
        def choose(at):
            return plan.choose(at, arch, sms)
    return LengthKernel(op, device, choose)


def compile_for_target(op: Attention, target: str, config=None) -> dict:
    """``op`` lowered for ``target`` without the device (``aot.compile_for_target``)."""
    from .aot import compile_for_target as lower

    return lower(op, target, config)
