"""Lowering one kernel to an AMD code object (hsaco) for a gfx target, without the device or a ROCm install.

``triton.compile`` with ``GPUTarget("hip", <gfx>, 64)`` runs Triton's HIP backend in-process: TTIR -> TTGIR ->
LLVM IR -> AMDGCN assembly -> hsaco, linked by the ``lld`` bundled in Triton's own library (no ``/opt/rocm``
needed; the device libraries ``ocml.bc`` / ``ockl.bc`` ship in ``triton/backends/amd/lib``). The signature is
specialised as a launch on 16-byte aligned tensors would be.
"""

from __future__ import annotations

from typing import Any

from portakern.errors import UnsupportedError

from .. import tuning
from .launch import compile_options

#: Triton's type names of the activation / output dtypes.
POINTER = {"float16": "*fp16", "bfloat16": "*bf16", "float32": "*fp32"}


def check_target(target: str) -> None:
    """Raise unless ``target`` is one this backend lowers for (``tuning.COMPILE_TARGETS``)."""
    if target not in tuning.COMPILE_TARGETS:
        raise UnsupportedError(f"compile_for_target(target={target!r}): triton-rocm lowers for "
                               f"{', '.join(tuning.COMPILE_TARGETS)}; pick one of those")


def compiler_kernel(module: str, name: str):
    """The ``@triton.jit`` function ``name`` of kernel module ``module`` as a compiler ``JITFunction``; raises
    ``UnsupportedError`` in a process whose Triton was imported under ``TRITON_INTERPRET=1`` (its kernels are
    interpreter functions, which ``triton.compile`` cannot lower)."""
    from .. import kernels

    if kernels.interpreted():
        raise UnsupportedError("compile_for_target: this process imported triton under TRITON_INTERPRET=1, so its "
                               "kernels are interpreter functions; lower in a process without TRITON_INTERPRET")
    return getattr(kernels.load(module), name)


def lower(fn, target: str, pointers: dict[str, str], constexprs: dict[str, Any], aligned: set[str],
          num_warps: int, num_stages: int, hip: dict) -> dict:
    """``fn`` (a compiler-flavour ``JITFunction``) lowered for ``target``.

    ``pointers``: Triton pointer types of the pointer parameters (others are i32 unless constexpr; pointers the
    launch passes ``None`` for are listed as ``"constexpr"`` in ``constexprs`` with value None); ``aligned``: the
    parameters specialised as multiples of 16. Returns ``{"name", "hsaco", "amdgcn", "shared", "num_warps",
    "options"}``.
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    check_target(target)
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        else:
            sig[name] = pointers.get(name, "i32")
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
             if name in aligned and name not in constexprs}
    options = compile_options(num_warps, num_stages, hip)
    wave = tuning.TARGETS[target]["wave"]
    ck = triton.compile(ASTSource(fn, sig, constexprs, attrs), target=GPUTarget("hip", target, wave), options=options)
    return {"name": fn.__name__, "hsaco": ck.asm.get("hsaco"), "amdgcn": ck.asm.get("amdgcn"),
            "shared": getattr(ck.metadata, "shared", None), "num_warps": num_warps, "options": options}
