"""The kernel bodies of the triton-rocm backend are the triton backend's (``portakern.backends.triton.kernels``:
the one designed edge between two backends). This package names the ones it launches and loads them in this
process's Triton flavour (interpreter or compiler); nothing NVIDIA-only is among them (no Gluon kernel, no inline
PTX: the "mma" GEMV's PTX dequantization, the wgmma and warp-specialised decode kernels are never loaded here).
The generator of the ``score_mod`` / ``mask_mod`` functions ``attn_fwd`` calls sits beside those bodies too
(``kernels.expr_mods``); ``expr_triton.py`` binds it to this backend.
"""

from __future__ import annotations

from types import ModuleType

#: The kernel modules of ``portakern.backends.triton.kernels`` this backend launches.
USED = ("attention_fwd", "attention_combine", "gemv_quant")


def load(name: str) -> ModuleType:
    """The kernel module ``name`` (one of ``USED``) with its ``@triton.jit`` functions in this process's flavour."""
    if name not in USED:
        raise ValueError(f"kernels.load({name!r}): triton-rocm launches only {', '.join(USED)}; the other triton "
                         f"kernels use NVIDIA-only features (Gluon, TMA, inline PTX)")
    from portakern.backends.triton import kernels

    return kernels.load(name)


def interpreted() -> bool:
    """Whether this process's Triton was imported in interpreter mode (``TRITON_INTERPRET=1``)."""
    from portakern.backends.triton import kernels

    return kernels.interpreted()

