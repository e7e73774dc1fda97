"""Preparing quantized weights ahead of time: ``portakern.prepare`` (one weight) and ``portakern.prepare_model``
(every ``QuantizedWeight`` a torch model holds).

A backend repacks a weight once into the layout its kernels read (``Backend.prepare_weight``; the GPU GEMV layout
of ``portakern.gemv_weight``), lazily on the first call otherwise. Doing it ahead of time means CUDA-graph capture
and ``torch.compile`` only ever see prepared weights (preparing allocates, uploads and synchronises, which neither
can record: inside capture it raises ``portakern.capture.CaptureError``), and lets the native tensors go, so the
prepared copy is the only resident one.
"""

from __future__ import annotations

from typing import Any

from .backend import support_of
from .devices import CPU, Device, parse_device
from .errors import InvalidInputError, InvalidTypeError, UnsupportedError
from .quantized import QuantizedWeight


def _target(weight: QuantizedWeight, device: Any) -> Device:
    """``device`` ("cuda", "cuda:1", a torch.device, a ``Device``; None: the weight's) as a ``Device``."""
    if device is None:
        return weight.device
    if isinstance(device, Device):
        return device
    text = str(device).strip()
    if text == "cpu":
        return CPU
    head, _, idx = text.partition(":")
    if head == "cuda" and (idx == "" or idx.isdigit()):
        from .devices import torch_device

        return torch_device("cuda", int(idx or 0))
    try:
        return parse_device(text)
    except Exception:
        raise InvalidInputError(f"device={device!r} is not a device to prepare a weight for: use 'cuda', "
                                "'cuda:<index>', a torch.device or a portakern Device") from None


def prepare(weight: QuantizedWeight, device: Any = None, *, layout: str | None = None,
            keep_native: bool = False) -> QuantizedWeight:
    """Prepare ``weight`` now for every backend that would serve its ``quant_gemv`` on ``device``, and return it.

    Each such backend's copy is built and cached on ``weight.prepared`` exactly as the first call would build it,
    so later calls (eager, inside ``torch.cuda.graph`` capture, under ``torch.compile``) find it ready. A weight
    already prepared for a backend is not prepared again (unless ``layout`` is given and the native tensors are
    still there: the GEMV copy is then rebuilt in that layout).

    Args:
        weight: a ``QuantizedWeight`` (numpy, torch or cupy tensors); a host weight prepared for a GPU is repacked
            on the host and uploaded, a GPU weight is repacked on its device with torch ops.
        device: where it will be used: "cuda", "cuda:<index>", a ``torch.device`` or a ``Device``; None: where its
            tensors are. On the CPU nothing is prepared (the CPU backends read the native tensors).
        layout: for the GPU GEMV layout, one of ``portakern.gemv_weight.LAYOUTS``: "fragments" (the default,
            ``portakern.gemv_weight.DEFAULT_LAYOUT``, for None: only the tensor-core fragment copy where the format
            has one, int4 groups of a multiple of 128: each code held once, served at every M and dtype), "words+
            fragments" (the word layout too: each such code held twice), "words" (only the word layout).
        keep_native: keep the native tensors (``weight.tensors``) beside the prepared copy. By default they are
            released when every backend on ``device`` reads a prepared copy (NVIDIA GPUs: triton, cuda), so the
            prepared copy is the only resident one; ``weight.dequantize()`` then reads it, and ``weight.to()``
            another device raises (prepare with ``keep_native=True`` to move the weight later).

    Raises:
        InvalidTypeError: ``weight`` is not a ``QuantizedWeight``.
        InvalidInputError: a bad ``device`` or ``layout``.
        UnsupportedError: no backend runs this weight's ``quant_gemv`` on ``device``.
        CaptureError: called inside CUDA stream capture for a weight that is not prepared yet.
    """
    from . import capture
    from .gemv_weight import GEMV_LAYOUT, check_layout, prepare_gemv_weight
    from .ir import DType
    from .ir.ops import QuantGemv
    from .plugins import registry

    if not isinstance(weight, QuantizedWeight):
        raise InvalidTypeError(f"weight is a {type(weight).__name__}: portakern.prepare takes a portakern."
                               "QuantizedWeight (portakern.quantize(w), or QuantizedWeight.from_awq / from_gptq / "
                               "from_gguf)")
    if not isinstance(keep_native, bool):
        raise InvalidTypeError(f"keep_native={keep_native!r} must be True or False")
    if layout is not None:
        check_layout(layout)
    dev = _target(weight, device)
    if dev.type == "cpu":
        return weight
    op = QuantGemv(M=1, N=weight.N, K=weight.K, dtype=DType.bfloat16, fmt=weight.fmt).verify()
    readers = []
    for name, b in sorted(registry().backends.items()):
        try:
            if support_of(b, op, dev):
                readers.append(b)
        except Exception:   # a broken supports() is dispatch's concern, not a reason to fail here
            continue
    if not readers:
        raise UnsupportedError(f"no backend runs quant_gemv of {capture.weight_label(weight)} on {dev.label}, so "
                               "there is nothing to prepare it for; check portakern.list_backends() for that device")
    built = set()
    for b in readers:
        pkey = (b.weight_layout or b.name, str(dev))
        rebuild = pkey[0] == GEMV_LAYOUT and layout is not None and not weight.native_released
        if pkey in built or (pkey in weight.prepared and not rebuild):
            continue
        built.add(pkey)
        capture.refuse_prepare(weight, dev)
        weight.prepared[pkey] = (prepare_gemv_weight(weight, dev, layout=layout) if pkey[0] == GEMV_LAYOUT
                                 else b.prepare_weight(weight, dev))
    if not keep_native and not weight.native_released and all(b.weight_layout == GEMV_LAYOUT for b in readers):
        weight.release_native()
    return weight


def _module_device(module) -> Any:
    """The device of ``module``'s own first parameter or buffer, or None."""
    for t in list(module.parameters(recurse=False)) + list(module.buffers(recurse=False)):
        return t.device
    return None


def prepare_model(model, device: Any = None, *, layout: str | None = None, keep_native: bool = False):
    """``prepare`` every ``QuantizedWeight`` held by ``model`` (a ``torch.nn.Module``) or its submodules, as an
    attribute or inside a list, tuple or dict attribute; returns ``model``.

    ``device``: None prepares each weight for the device of the module holding it (its own first parameter or
    buffer), else for where the weight's tensors are. ``layout`` and ``keep_native`` as in ``prepare``. A
    ``portakern.torch_ops.QuantLinear`` prepares its weight at construction and holds it as buffers; with
    ``layout`` given it keeps only what that layout holds (``QuantLinear.use_layout``). Call this before
    ``torch.cuda.graph`` capture or ``torch.compile``.

    Raises ``InvalidTypeError`` when ``model`` is not a ``torch.nn.Module``; otherwise what ``prepare`` raises.
    """
    try:
        import torch
    except ImportError:
        torch = None
    if torch is None or not isinstance(model, torch.nn.Module):
        raise InvalidTypeError(f"model is a {type(model).__name__}: portakern.prepare_model takes a torch.nn.Module; "
                               "prepare a single weight with portakern.prepare(w, device=...)")
    import sys

    torch_ops = sys.modules.get("portakern.torch_ops")     # not imported: the model holds no QuantLinear
    seen: set[int] = set()
    for sub in model.modules():
        if layout is not None and torch_ops is not None and isinstance(sub, torch_ops.QuantLinear):
            sub.use_layout(layout)
        where = device if device is not None else _module_device(sub)
        for value in list(vars(sub).values()):
            items = (value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple))
                     else (value,))
            for w in items:
                if isinstance(w, QuantizedWeight) and id(w) not in seen:
                    seen.add(id(w))
                    prepare(w, where, layout=layout, keep_native=keep_native)
    return model


__all__ = ["prepare", "prepare_model"]
