"""``@triton.jit`` decorations in the flavour asked for, whatever the environment says.

``@triton.jit`` decides when it decorates whether it builds interpreter functions (``InterpretedFunction``, run
on CPU tensors) or compiler ones (``JITFunction``, lowered by ``triton.compile``): it asks Triton's
``knobs.runtime.interpret``, which reads ``TRITON_INTERPRET`` unless the knob object holds a value of its own.
``jit_flavour(interpret)`` gives it that value for the block and takes it back after, so a kernel module
imported inside the block has its functions in the flavour ``interpret`` names. The value is set on the knob
object itself: Triton's setter would also write ``TRITON_INTERPRET`` into the environment, which this never
does.
"""

from __future__ import annotations

import contextlib
import threading

_lock = threading.RLock()   # one flavour at a time; a kernel module may load another while it loads
_UNSET = object()


@contextlib.contextmanager
def jit_flavour(interpret: bool):
    """``@triton.jit`` inside the block builds interpreter functions (``interpret``) or compiler ones."""
    from triton import knobs

    runtime = knobs.runtime
    with _lock:
        previous = runtime.__dict__.get("interpret", _UNSET)
        runtime.__dict__["interpret"] = bool(interpret)
        try:
            yield
        finally:
            if previous is _UNSET:
                runtime.__dict__.pop("interpret", None)
            else:
                runtime.__dict__["interpret"] = previous
