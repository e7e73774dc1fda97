"""The backend plugin API: what a backend object provides to portakern, and the base that provides most of it.

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

Writing a backend on the base
-----------------------------
A backend is a package with one module per op (its *lowerings*) and a ``Backend`` subclass that
declares, as class attributes, what the base needs to answer ``status``, ``supports``, ``compile``,
``compile_for_target`` and ``prepare_weight`` for it::

    class MyBackend(Backend):
        name = "mine"
        version = "1.0"
        array_kind = "torch"
        device_types = ("cuda",)
        priority = 80
        requires = ("torch", "mylib")                   # must import, else status() says "unavailable: ..."
        install_hint = "pip install 'mine[gpu]'"        # appended to that status line
        lowerings = {"attention": "attention",          # op kind -> submodule of this class's package
                     "quant_gemv": "quant_gemv"}
        min_capability = (8, 0)                         # CUDA devices older than sm_80 are refused
        device_refusal = "the mine backend runs on NVIDIA GPUs, not on {type} devices"

Each lowering module provides, for ops of its kind:

``supports(op, device) -> Support``
    optional: the op-specific limits (head dims, formats, shapes); absent means every op of the
    kind is supported once the shared checks pass.
``compile(op, device) -> kernel``
    required: the kernel described above.
``compile_for_target(op, target) -> artifact``
    optional: lowering without the device, for the targets in ``compile_targets``.
``prepare_weight(weight, device) -> prepared``
    optional, in the ``quant_gemv`` module only: the one-time repacking of a ``QuantizedWeight``.

The base's ``supports`` runs the shared checks in this order, each refusal a reason a user can act
on, and only then asks the lowering module:

1. ``status()``: every module in ``requires`` imports, then the ``runtime_status()`` hook (a driver,
   a platform, a compiler present) -- anything not starting with "ok" is the refusal;
2. ``device.type`` is one of ``device_types`` (else ``device_refusal``);
3. a CUDA device's compute capability is at least ``min_capability``;
4. the ``check(op, device)`` hook: a backend-wide rule that is neither of the above (say a dtype
   its array kind cannot hold on one device type);
5. ``lowerings`` has a module for ``op.kind``;
6. that module's ``supports(op, device)``.

So a backend file holds its capabilities as data plus only what is truly its own: a
``runtime_status`` or ``check`` override, or a ``prepare_weight`` that another module provides.
Every method stays overridable; a backend that needs none of the declared machinery (say one
generated at run time) overrides ``supports`` and ``compile`` directly, as before.
"""

from __future__ import annotations

import hashlib
import importlib
import sys
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable, ClassVar, Mapping

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
    """Base class for backends: capabilities as class attributes, the shared checks as methods.

    Class attributes (capabilities as data):
      name          unique backend name (``backend="name"`` selects it)
      version       the implementing package's version
      array_kind    "numpy", "torch" or "pyopencl": the array type its kernels receive
      device_types  device types it can run on ("cpu", "cuda", "rocm", "opencl")
      priority      default rank, higher wins; the ``portakern_backend_priority`` hook may override
      compile_targets  targets it can lower for without the device (``compile_for_target``)
      weight_layout the name of a prepared-weight layout it shares with other backends (None: its own);
                    backends naming one layout share one prepared copy of a weight, cached under
                    ``(weight_layout or name, device)``
      x_prologues   the ``QuantGemv.prologue`` transforms its quant_gemv kernels implement (e.g. "silu_mul":
                    ``x`` is ``(M, 2K)`` and the GEMV's input is ``silu(gate) * up``); dispatch never offers a
                    backend an op whose prologue is not listed, so a backend written before prologues existed
                    is never handed one

    Class attributes the base's methods read (see the module docstring for the order of the checks):
      requires      modules that must import for the backend to run at all (``status``)
      install_hint  how to install them, appended to the "unavailable" status line
      lowerings     op kind -> module name relative to the package of the class that declares it
                    (``lowering``); an op kind not listed has no lowering here
      min_capability  the lowest CUDA compute capability ``(major, minor)`` its kernels run on (None: any)
      device_refusal  the refusal for a device type outside ``device_types``; ``str.format`` fields
                    ``{name}``, ``{device}`` (e.g. cuda:0), ``{type}`` (e.g. cuda), ``{types}`` (the list)
      launches_on_current_device  its kernels launch on the *current* CUDA device (Triton, the CUDA driver
                    API): ``compile`` wraps each kernel with ``portakern.placement.on_device`` so a call on
                    cuda:1 arrays runs on cuda:1
      runtime_lengths  its attention kernels read the sequence lengths (seqlen_q, seqlen_k, total_q, total_k,
                    the block table's pages) from the arrays of each call, and ``supports`` does not depend on
                    them: dispatch hands one compiled kernel every length of a shape class (``portakern.lengths``).
                    False: dispatch compiles once more for each further length (the decision is still made once)
    """

    name: ClassVar[str] = ""
    version: ClassVar[str] = "0"
    array_kind: ClassVar[str] = "numpy"
    device_types: ClassVar[tuple[str, ...]] = ("cpu",)
    priority: ClassVar[int] = 0
    compile_targets: ClassVar[tuple[str, ...]] = ()
    x_prologues: ClassVar[tuple[str, ...]] = ()
    weight_layout: ClassVar[str | None] = None

    requires: ClassVar[tuple[str, ...]] = ()
    install_hint: ClassVar[str] = ""
    lowerings: ClassVar[Mapping[str, str]] = {}
    min_capability: ClassVar[tuple[int, int] | None] = None
    device_refusal: ClassVar[str] = ("the {name} backend runs on {types} devices, not on {device}; "
                                     "pass arrays on one of those, or backend=None to let portakern pick")
    launches_on_current_device: ClassVar[bool] = False
    runtime_lengths: ClassVar[bool] = False

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} {self.version}>"

    # -- availability ---------------------------------------------------------------------------

    def status(self) -> str:
        """One line for ``portakern info``: "ok" (or "ok (note)") or why the backend cannot run here at all.

        The base imports every module of ``requires`` (the first failure gives ``"unavailable: <error>
        (<install_hint>)"``), then returns ``runtime_status()``.
        """
        for module in self.requires:
            try:
                importlib.import_module(module)
            except Exception as e:
                hint = f" ({self.install_hint})" if self.install_hint else ""
                return f"unavailable: {type(e).__name__}: {e}{hint}"
        return self.runtime_status()

    def runtime_status(self) -> str:
        """Hook: the status once ``requires`` imports -- "ok", "ok (note)" or "unavailable: why" (a missing driver,
        platform or compiler). Default "ok"."""
        return "ok"

    # -- the question dispatch asks -------------------------------------------------------------

    def supports(self, op: Any, device: Device) -> Support:
        """Whether this backend can run ``op`` on ``device``; a reason when it cannot.

        The base runs the shared checks (status, device type, capability floor, the ``check`` hook, a lowering
        for ``op.kind``) and then asks the lowering module's ``supports(op, device)`` when it has one.
        """
        st = self.status()
        if not st.startswith("ok"):
            return no(st)
        if device.type not in self.device_types:
            return no(self.device_refusal.format(name=self.name, device=device, type=device.type,
                                                 types=" and ".join(self.device_types)))
        floor = self.min_capability
        if floor is not None and device.type == "cuda" and device.capability and device.capability < floor:
            return no(f"the {self.name} backend's kernels need sm_{floor[0]}{floor[1]} or newer; "
                      f"{device} is {device.arch}")
        s = self.check(op, device)
        if not s:
            return s
        mod = self.lowering(op)
        if mod is None:
            return no(f"op {getattr(op, 'kind', op)!r} has no {self.name} lowering")
        check = getattr(mod, "supports", None)
        return YES if check is None else check(op, device)

    def check(self, op: Any, device: Device) -> Support:
        """Hook: a backend-wide refusal that is not a device type or a capability floor (run after those, before
        the lowering's own ``supports``). Default ``YES``."""
        return YES

    # -- lowerings ------------------------------------------------------------------------------

    def lowering(self, op: Any) -> ModuleType | None:
        """The module that lowers ``op`` (``lowerings[op.kind]``, imported relative to the package of the class
        that declares ``lowerings``), or None when this backend has none for its kind."""
        sub = self.lowerings.get(getattr(op, "kind", None))
        if sub is None:
            return None
        return importlib.import_module(f".{sub}", self._package())

    def _package(self) -> str:
        """The package the ``lowerings`` names are relative to."""
        owner = next((c for c in type(self).__mro__ if "lowerings" in c.__dict__ and c is not Backend), type(self))
        package = getattr(sys.modules.get(owner.__module__), "__package__", None)
        if not package:
            raise TypeError(f"{owner.__qualname__}.lowerings names modules relative to its package, but "
                            f"{owner.__module__!r} is not inside a package; define the backend class in a package "
                            f"beside its lowering modules")
        return package

    def compile(self, op: Any, device: Device) -> Callable[..., None]:
        """Build the kernel for ``op`` on ``device`` (called once per signature, then cached).

        The base calls the lowering module's ``compile(op, device)``, wrapped with
        ``portakern.placement.on_device`` when ``launches_on_current_device``.
        """
        kernel = self._lowering_for(op, "compile").compile(op, device)
        if self.launches_on_current_device:
            from .placement import on_device

            kernel = on_device(kernel, device)
        return kernel

    def compile_for_target(self, op: Any, target: str) -> Any:
        """Lower ``op`` for ``target`` (e.g. "sm_100a", "gfx942") without the device; return the artifact.

        Only called for targets listed in ``compile_targets``. The base calls the lowering module's
        ``compile_for_target(op, target)``.
        """
        mod = self._lowering_for(op, "compile_for_target")
        lower = getattr(mod, "compile_for_target", None)
        if lower is None:
            raise NotImplementedError(f"backend {self.name!r} cannot compile {op.kind} without a device: "
                                      f"{mod.__name__} defines no compile_for_target(op, target)")
        return lower(op, target)

    def _lowering_for(self, op: Any, method: str) -> ModuleType:
        mod = self.lowering(op)
        if mod is None:
            kinds = ", ".join(sorted(self.lowerings)) or "none"
            raise NotImplementedError(f"backend {self.name!r} has no lowering for op {getattr(op, 'kind', op)!r} "
                                      f"(its lowerings: {kinds}); {method}() is only called after supports() "
                                      f"said yes")
        return mod

    def prepare_weight(self, weight: Any, device: Device) -> Any:
        """Repack a ``QuantizedWeight`` once into this backend's preferred form (cached on the weight).

        The base uses the ``quant_gemv`` lowering's ``prepare_weight(weight, device)`` when it defines one; else
        it converts the weight's tensors to this backend's array kind on ``device``.
        """
        sub = self.lowerings.get("quant_gemv")
        prepare = getattr(importlib.import_module(f".{sub}", self._package()), "prepare_weight", None) \
            if sub is not None else None
        if prepare is not None:
            return prepare(weight, device)
        from .arrays import convert_for_backend

        return weight.with_tensors({k: convert_for_backend(v, self, device)
                                    for k, v in weight.tensors.items()})

    # -- identity of the code -------------------------------------------------------------------

    def source_fingerprint(self) -> str:
        """sha256 over the files of this backend's package (every file under it but byte code), read in path order.

        The conformance suite keys the goldens it computes on the fly with the cpu reference backend's fingerprint,
        so a cached golden is never served after the reference's code changed; any caller that must notice a change
        of a backend's code can use it the same way. A backend class outside a package fingerprints its module.
        """
        module = sys.modules[type(self).__module__]
        h = hashlib.sha256()
        if not module.__package__:
            h.update(_read(getattr(module, "__file__", None)))
            return h.hexdigest()
        from importlib import resources

        for rel, item in sorted(_files(resources.files(module.__package__), ""), key=lambda f: f[0]):
            h.update(rel.encode() + b"\0")
            h.update(item.read_bytes())
        return h.hexdigest()


def _files(root, prefix: str):
    """``(relative path, Traversable)`` of every file under ``root``, byte code left out."""
    for item in root.iterdir():
        rel = f"{prefix}{item.name}"
        if item.is_dir():
            if item.name != "__pycache__":
                yield from _files(item, rel + "/")
        elif not item.name.endswith((".pyc", ".pyo")):
            yield rel, item


def _read(path: str | None) -> bytes:
    if path is None:
        return b""
    with open(path, "rb") as f:
        return f.read()


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
