"""sm_90a lowering of the GEMV-chain kernels without a GPU (``chain_kernels.py``), specialised as a launch would be.

A launch marks 16-byte aligned pointers and integers divisible by 16 (and turns an integer equal to 1 into a
constant); without those marks the words load 4 bytes at a time instead of 16, so a lowering meant to stand for
the launched kernel must apply them. ``lower_sm90`` does, from the integers' launch values; ``step_ints`` gives
those of the decode step's shapes; ``ptxas_registers`` reads the registers and spills ``ptxas -v`` reports.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile

#: pointer element types by argument name (the rest of the pointers are bf16 activations / outputs)
_POINTERS = {"qw": "*i32", "s": "*fp16", "z": "*fp16", "ws_ptr": "*fp32", "r_ptr": "*fp32", "ss_ptr": "*fp32",
             "cos_ptr": "*fp32", "sin_ptr": "*fp32", "cnt_ptr": "*i32", "done_ptr": "*i32", "exit_ptr": "*i32",
             "err_ptr": "*i32", "bt_ptr": "*i32", "part_ptr": "*fp32"}


def _pointer_type(name: str) -> str:
    """A pointer argument's type by its name: words, scales and zeros of a phase (``qw0``, ``sG``, ...), the
    fp32 / int32 buffers by name, bf16 activations otherwise."""
    m = re.fullmatch(r"(qw|s|z)[0-9A-Z]", name)
    return _POINTERS[m.group(1)] if m else _POINTERS.get(name, "*bf16")


def step_ints(shapes, layers: int | None = None, bn: int = 256) -> dict[str, int]:
    """Launch values of the chain kernels' integer arguments for phases of ``shapes`` ((N, K) each) in the
    backend's internal layout (rows padded to 128 columns, K to 64 words): ``Nj``, ``Tj`` (column tiles), ``SQj``
    (row stride of the words), and for the pure chain (``layers`` given) ``LWj`` / ``LSj`` (a layer's words and
    scales) and ``layers``."""
    ints = {}
    for j, (N, K) in enumerate(shapes):
        npad = -(-N // 128) * 128
        kwp = -(-(K // 8) // 64) * 64
        ints.update({f"N{j}": N, f"T{j}": -(-N // bn), f"SQ{j}": npad})
        if layers is not None:
            ints.update({f"LW{j}": kwp * npad, f"LS{j}": (K // 128) * npad})
    if layers is not None:
        ints["layers"] = layers
    return ints


def lower_sm90(kernel, consts: dict, ints: dict[str, int], maxnreg: int | None = None, num_warps: int = 8):
    """``kernel`` compiled for sm_90a with ``consts``, its integers specialised on ``ints`` as a launch would and
    its pointers 16-byte aligned; the compiled kernel (``.asm["ptx"]``, ``.metadata.shared``)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from portakern.backends.triton.attention_aot import _as_launched
    from portakern.backends.triton.backend import KERNEL_OPTIONS, interpret_env

    consts = {k: v for k, v in consts.items() if k in kernel.arg_names}
    ptrs = {n: _pointer_type(n) for n in kernel.arg_names if n not in consts and n not in ints}
    sig, consts, attrs = _as_launched(kernel, ptrs, consts, ints)
    opts = dict(num_warps=num_warps, **KERNEL_OPTIONS, **({"maxnreg": maxnreg} if maxnreg else {}))
    with interpret_env(False):
        return triton.compile(GluonASTSource(kernel, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                              options=opts)


def ptxas_registers(ptx: str) -> tuple[int | None, int | None]:
    """``(registers per thread, spill bytes stored)`` of ``ptx`` for sm_90a, as Triton's bundled ``ptxas -v``
    reports them (None where it says nothing)."""
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        p = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name=sm_90a", src, "-o", os.path.join(d, "k.cubin")],
                           capture_output=True, text=True)
    m = re.search(r"Used (\d+) registers", p.stderr)
    spill = re.search(r"(\d+) bytes spill stores", p.stderr)
    return (int(m.group(1)) if m else None), (int(spill.group(1)) if spill else None)


def describe(ck) -> str:
    """One line: shared memory, registers and spills, 16-byte loads, the waits."""
    ptx = ck.asm["ptx"]
    regs, spill = ptxas_registers(ptx)
    wide = len(re.findall(r"ld\.global(\.\w+)*\.v4\.b32", ptx))
    acquires = len(re.findall(r"gpu\.acquire", ptx))
    return (f"shared {ck.metadata.shared} B, {regs} registers, {spill} B spilled, {wide} 16-byte loads, "
            f"{ptx.count('griddepcontrol.wait')} PDL wait, {acquires} acquire loads")
