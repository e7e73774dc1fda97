"""CUDA stream capture: whether the current stream is being captured, and the error for work that cannot be.

Inside ``torch.cuda.graph(...)`` (or ``torch.compile(mode="reduce-overhead")``'s recording) kernels are recorded,
not run, and a host synchronisation, a device-to-host copy or a benchmark invalidates the capture. A call whose
weight is not prepared (the repacking allocates, uploads and synchronises once), or whose plan must be measured,
or whose backend failed (falling back would run a second backend inside an already invalidated capture) cannot
complete there; such calls raise ``CaptureError`` at once, naming the weight or op, the reason and the way out:
``portakern.prepare(weight, device=...)`` (or ``portakern.prepare_model(module)``) before capture, or one call of
the same shape before capture.

torch is imported inside ``is_capturing``, and only when some other module imported it already: a process without
torch is never capturing.
"""

from __future__ import annotations

import sys
from typing import Any

from .errors import PortakernError

#: what every capture error tells the caller to do
WAY_OUT = ("prepare the weight before capture with portakern.prepare(weight, device=...) (every portakern module "
           "of a model: portakern.prepare_model(model)), or run one call of this shape before capture")


class CaptureError(PortakernError, RuntimeError):
    """A call inside CUDA stream capture needs work that cannot be captured (preparing a weight, measuring
    backends, falling back after a failure); the message names the weight or op, the reason and the way out."""


def is_capturing() -> bool:
    """Whether the current CUDA stream (of the current device) is being captured into a CUDA graph. False without
    torch, without CUDA, or when torch was never imported (no CUDA graph can be capturing then)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    try:
        return bool(torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())
    except (AttributeError, RuntimeError):   # a torch without the probe, or a CUDA that cannot be queried
        return False


def weight_label(weight: Any) -> str:
    """A short description of a quantized weight for messages: shape, format and device."""
    fmt = getattr(weight, "fmt", None)
    shape = getattr(weight, "shape", None) or (getattr(weight, "N", "?"), getattr(weight, "K", "?"))
    if fmt is None:
        return f"weight (N, K)={tuple(shape)}"
    return (f"weight (N, K)={tuple(shape)} {fmt.packing.value} int{fmt.bits} group_size={fmt.group_size}"
            f"{' symmetric' if fmt.symmetric else ''} on {getattr(weight, 'device', '?')}")


def refuse_prepare(weight: Any, device: Any) -> None:
    """Raise ``CaptureError`` when the current stream is capturing: ``weight`` is about to be prepared for
    ``device`` (an allocation, upload and synchronisation that a capture cannot record)."""
    if is_capturing():
        raise CaptureError(f"{weight_label(weight)} is not prepared for {device} and this call is inside CUDA "
                           f"stream capture, where preparing it (repacking, upload, synchronisation) cannot run; "
                           f"{WAY_OUT}")


def refuse(what: str, reason: str, cause: BaseException | None = None) -> None:
    """Raise ``CaptureError`` for ``what`` (the op or weight) when the current stream is capturing: ``reason``
    says what cannot run there; ``cause`` (the backend's error, if any) is chained and quoted."""
    if is_capturing():
        tail = f" ({type(cause).__name__}: {str(cause)[:300]})" if cause is not None else ""
        raise CaptureError(f"{what}: {reason} inside CUDA stream capture{tail}; no other backend is tried there "
                           f"(the capture is already invalid); {WAY_OUT}") from cause


__all__ = ["CaptureError", "WAY_OUT", "is_capturing", "refuse", "refuse_prepare", "weight_label"]
