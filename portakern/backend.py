"""The backend plugin API: what a backend object provides to portakern.

A plugin returns ``Backend`` instances from the ``portakern_register_backends`` hook. Dispatch
asks ``supports(op, device)``; on yes it calls ``compile(op, device)`` once per signature and
then calls the returned kernel with arrays of the backend's ``array_kind``:

* Attention: ``kernel(q, k, v, out, lse, aux)`` where ``out`` (and ``lse`` when the op returns
  it, else None) are preallocated and NaN-filled by portakern, and ``aux`` is a dict holding
  ``block_table``, ``seqlens_k``, ``cu_seqlens_q``, ``cu_seqlens_k`` (arrays or None).
  Shapes are ``op.shapes()``; ``lse`` is float32.
* QuantGemv: ``kernel(x, weight, out)`` where ``weight`` is what ``prepare_weight`` returned for
  the ``QuantizedWeight`` (by default the weight itself, its tensors converted to the backend's
  array kind and device).

A kernel writes every element of ``out`` (and ``lse``) and returns nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar

from .devices import Device


@dataclass(frozen=True)
class Support:
    """Answer of ``Backend.supports``: ``ok`` and, when not ok, the reason a user can act on."""

    ok: bool
    reason: str = ""

    def __bool__(self) -> bool:
        return self.ok


YES = Support(True)


def no(reason: str) -> Support:
    """A negative ``Support`` with its reason."""
    return Support(False, reason)


class Backend:
    """Base class for backends. Subclasses set the class attributes and override the methods.

    Class attributes (capabilities as data):
      name          unique backend name (``backend="name"`` selects it)
      version       the implementing package's version
      array_kind    "numpy" or "torch": the array type its kernels receive
      device_types  device types it can run on ("cpu", "cuda", "rocm", "opencl")
      priority      default rank, higher wins; the ``portakern_backend_priority`` hook may override
      compile_targets  targets it can lower for without the device (``compile_for_target``)
      has_bfloat16  whether its array kind can hold bf16 (numpy cannot: bf16 arrives as float32)
      weight_layout the name of the prepared-weight layout ``prepare_weight`` returns when it is another
                    backend's (None: its own); backends naming one layout share one prepared copy of a weight,
                    cached under ``(weight_layout or name, device)``
      x_prologues   the ``QuantGemv.prologue`` transforms its quant_gemv kernels implement (e.g. "silu_mul":
                    ``x`` is ``(M, 2K)`` and the GEMV's input is ``silu(gate) * up``); dispatch never offers a
                    backend an op whose prologue is not listed, so a backend written before prologues existed
                    is never handed one
    """

    name: ClassVar[str] = ""
    version: ClassVar[str] = "0"
    array_kind: ClassVar[str] = "numpy"
    device_types: ClassVar[tuple[str, ...]] = ("cpu",)
    priority: ClassVar[int] = 0
    compile_targets: ClassVar[tuple[str, ...]] = ()
    x_prologues: ClassVar[tuple[str, ...]] = ()
    weight_layout: ClassVar[str | None] = None

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} {self.version}>"

    def status(self) -> str:
        """One line for ``portakern info``: "ok" or why the backend cannot run here at all."""
        return "ok"

    def supports(self, op: Any, device: Device) -> Support:
        """Whether this backend can run ``op`` on ``device``; a reason when it cannot."""
        raise NotImplementedError(f"backend {self.name!r} does not implement supports()")

    def compile(self, op: Any, device: Device) -> Callable[..., None]:
        """Build the kernel for ``op`` on ``device`` (called once per signature, then cached)."""
        raise NotImplementedError(f"backend {self.name!r} does not implement compile()")

    def prepare_weight(self, weight: Any, device: Device) -> Any:
        """Repack a ``QuantizedWeight`` once into this backend's preferred form (cached on the weight).

        The default converts the weight's tensors to this backend's array kind on ``device``.
        """
        from .arrays import convert_for_backend

        return weight.with_tensors({k: convert_for_backend(v, self, device)
                                    for k, v in weight.tensors.items()})

    def compile_for_target(self, op: Any, target: str) -> Any:
        """Lower ``op`` for ``target`` (e.g. "sm_100a", "gfx942") without the device; return the artifact.

        Only called for targets listed in ``compile_targets``.
        """
        raise NotImplementedError(f"backend {self.name!r} cannot compile without a device")


def support_of(backend: "Backend", op: Any, device: Device) -> Support:
    """``backend.supports(op, device)``, after the checks every backend shares: a quant_gemv prologue the
    backend does not list in ``x_prologues`` is refused without asking it."""
    prologue = getattr(op, "prologue", None)
    if prologue is not None and prologue not in backend.x_prologues:
        return no(f"backend {backend.name!r} does not implement the quant_gemv prologue {prologue!r} (it lists "
                  f"{list(backend.x_prologues)} in x_prologues); form the input first (silu(gate) * up) and call "
                  f"quant_gemv without a prologue, or pick a backend that lists it")
    s = backend.supports(op, device)
    if not isinstance(s, Support):   # a plugin's mistake must not break dispatch for every other backend
        return no(f"backend {backend.name!r}: supports() returned {type(s).__name__} {s!r}, not a "
                  f"portakern.Support; return YES or no('reason') (plugin bug: reported, backend skipped)")
    return s
