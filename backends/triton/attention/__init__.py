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
from portakern.ir.ops import Attention

from ..common.switches import autotune_enabled
from ..kernels.attention_args import MAX_GRID_Y, MAX_HEAD_DIM, MAX_VARLEN_BATCH, refusal  # noqa: F401 (the limits)
from . import plan


def supports(op: Attention, device: Device) -> Support:
    """Whether the kernels can run ``op`` on ``device``; a reason naming the limit when not (the kernel's limits,
    ``kernels.attention_args.refusal``, on this backend's table plan)."""
    why = refusal(op, device, "triton", lambda: plan.for_device(op, device).pack, "CUDA allows")
    return no(why) if why else YES


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
