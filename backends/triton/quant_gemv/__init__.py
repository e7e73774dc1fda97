"""The triton backend's quantized GEMV lowering: ``supports``, ``prepare_weight``, ``compile``, ``compile_for_target``.

Every packing of ``portakern.ir.Packing`` is repacked once, at ``prepare_weight``, into one
internal layout (``portakern.gemv_weight``: ``PreparedGemvWeight``; the byte layout is documented in
``portakern.ir.gemv_layout``), so the kernels know a single format; act-order GPTQ reads ``x`` through
the weight's K permutation, an irregular ``g_idx`` runs the per-element path. GGUF Q4_K and Q5_K carry a
float minimum per group (``PreparedGemvWeight.mins``, ``portakern.gemv_kquants``), which the "fma" and "dot"
kernels subtract once per group (their ``MINS`` constexpr); the "mma", "stream" and "frag" kernels refuse it.

``compile(op, device)`` returns ``kernel(x, prepared, out)``: one ``launcher.Launcher`` per weight layout, built
on the layout's first call (the CUDA-graph contract is ``launcher.py``'s). A weight held only as fragments
(``layout="fragments"``, the default on CUDA) runs the "frag" kernel where it can run the call and otherwise
(``fragments_refusal``: M > 16, fp16 / fp32 x, a prologue, the interpreter) ``fragments_dense.FragmentsDense``:
the fragments dequantized for the call, then one ``torch.matmul``. The launch configuration comes from
``config.choose`` (``tuning.py``'s tables), or is autotuned and cached with ``PORTAKERN_TRITON_AUTOTUNE=1``
(``autotune.py``). ``checks.py`` holds the host-side checks, ``stream.py`` the stream-K kernel's host side,
``aot.py`` the lowering without the device.

Programmatic dependent launch (``GemvConfig.pdl``, the sm_90+ tables' choice for the CUDA-core
kernel): a launch may start while the previous kernel in the stream drains and reads its first tiles
of the prepared weight before waiting for that kernel; x, the output and the workspace are touched
only after the wait. So a prepared weight must not be written by the kernel launched just before a
GEMV that reads it; ``prepare_weight`` synchronises once after its own upload.
"""

from __future__ import annotations

import threading

from portakern.backend import YES, Support, no
from portakern.devices import Device
from portakern.errors import UnsupportedError
from portakern.gemv_weight import PreparedGemvWeight
from portakern.ir.dtypes import DType
from portakern.ir.gguf_kquants import gemv_bits
from portakern.ir.ops import QuantGemv

from .. import tuning
from ..common.arch import check_pdl, device_family
from ..common.switches import autotune_enabled
from .checks import MAX_OFFSET, check_weight
from .config import GemvConfig, choose, fit, frag_usable
from .fragments_dense import FragmentsDense
from .launcher import Launcher


def supports(op: QuantGemv, device: Device) -> Support:
    """Every packing (4 and 8 bits, and GGUF Q4_K / Q5_K / Q6_K, whose codes the prepared weight holds in 4- or
    8-bit words: ``gemv_bits``), fp16/bf16/fp32 activations, any N and K, and M while x and the output each hold
    fewer than 2^31 elements (``MAX_OFFSET``)."""
    if gemv_bits(op.fmt) not in (4, 8):
        return no(f"quant_gemv(bits={op.fmt.bits}) is not supported by triton on {device}: bits must be 4 or 8")
    if op.dtype not in (DType.float16, DType.bfloat16, DType.float32):
        return no(f"quant_gemv(dtype={op.dtype.value}) is not supported by triton: use float16, bfloat16 "
                  "or float32 activations")
    widest = max(op.x_columns, op.N)
    if op.M * widest > MAX_OFFSET + 1:
        return no(f"quant_gemv(M={op.M}) with x of {op.x_columns} and an output of {op.N} columns is not supported "
                  f"by triton: x and the output must hold at most 2^31 elements each (the kernels' 32-bit offsets); "
                  f"split M into chunks of at most {(MAX_OFFSET + 1) // widest} rows")
    if device.type == "cpu":
        from .. import kernels

        if not kernels.interpreted():
            return no("triton was imported before TRITON_INTERPRET=1 was set, so its interpreter cannot run "
                      "quant_gemv here; set TRITON_INTERPRET=1 before the first import of triton")
    return YES


def compile(op: QuantGemv, device: Device, config: GemvConfig | None = None):
    """The kernel ``kernel(x, prepared, out)`` for ``op`` on ``device`` (torch tensors).

    ``config`` forces a launch configuration (benchmarks, tests); by default the tuning table
    (or the autotune cache) chooses one per weight layout on the first call. A weight held only as fragments runs
    the "frag" kernel, or ``FragmentsDense`` where that kernel cannot run the call (``fragments_refusal``); a forced
    configuration of another kind raises ``UnsupportedError`` for it (those kernels read the words).
    """
    op.verify()
    interpret = device.type == "cpu"
    arch, num_sms = device_family(device, tuning.GEMV_INTERP_SMS)
    tdev = "cpu" if interpret else f"cuda:{device.index}"
    launchers: dict[tuple, Launcher] = {}
    lock = threading.Lock()

    if config is not None:
        check_pdl(config, arch)
        if interpret and config.kind in ("stream", "frag"):
            raise UnsupportedError(f"GemvConfig(kind={config.kind!r}) is a Gluon kernel, which Triton's interpreter "
                                   "cannot run; force it on a CUDA device, or use kind='fma' or 'dot' here")

    def build(x, w: PreparedGemvWeight, out) -> Launcher | FragmentsDense:
        check_weight(op, w, tdev)
        if not w.has_words:   # fragments only: the "frag" kernel where it runs the call, else dequantize + matmul
            why = fragments_refusal(op, w, interpret)
            if config is not None and config.kind != "frag":
                raise UnsupportedError(f"GemvConfig(kind={config.kind!r}) reads the word layout, and this prepared "
                                       "weight holds its codes only as fragments (layout='fragments'); force "
                                       "kind='frag', or leave the configuration to the table")
            if why is not None and config is None:
                return FragmentsDense(op, why)
        if config is not None:
            cfg = fit(config, w, op.M)
            why = frag_usable(w, op.M, op.dtype.value) if cfg.kind == "frag" else None
            if why is not None:
                raise UnsupportedError(f"GemvConfig(kind='frag') cannot run this op: {why}; use kind='mma' or 'dot'")
        elif op.prologue is not None:   # only the CUDA-core kernel reads x through a prologue: its table entry
            cfg = choose(w, op.M, op.N, arch, num_sms, dtype=op.dtype.value, cuda_core=True)
        elif autotune_enabled() and not interpret:
            import triton.testing

            from .autotune import tuned

            def timer(c):
                ln = Launcher(op, w, fit(c, w, op.M), interpret, tdev, num_sms)
                return triton.testing.do_bench(lambda: ln(x, w, out), warmup=5, rep=25, return_mode="median")

            cfg = tuned(w, op.M, op.N, op.dtype.value, device, arch, num_sms, timer)
        else:
            cfg = choose(w, op.M, op.N, arch, num_sms, dtype=op.dtype.value)
        return Launcher(op, w, cfg, interpret, tdev, num_sms)

    def kernel(x, w: PreparedGemvWeight, out) -> None:
        key = w.key()
        ln = launchers.get(key)
        if ln is None:
            with lock:
                ln = launchers.get(key)
                if ln is None:
                    ln = launchers[key] = build(x, w, out)
        ln(x, w, out)

    kernel.__name__ = f"triton_quant_gemv_{op.content_hash()}"
    kernel.launchers = launchers  # introspection: the chosen configurations
    return kernel


def fragments_refusal(op: QuantGemv, w: PreparedGemvWeight, interpret: bool) -> str | None:
    """Why the "frag" kernel cannot run ``op`` on the fragments-only weight ``w`` (then ``FragmentsDense`` does),
    or None if it can: a prologue (only the CUDA-core kernel reads x through one), Triton's interpreter (the kernel
    is Gluon), or ``frag_usable``'s reasons (M > 16, activations other than bf16)."""
    if op.prologue is not None:
        return f"prologue={op.prologue!r} (only the CUDA-core kernel, which reads words, applies it)"
    if interpret:
        return "Triton's interpreter (the 'frag' kernel is a Gluon kernel)"
    return frag_usable(w, op.M, op.dtype.value)


def prepare_weight(weight, device: Device):
    """``weight`` repacked once into the GEMV layout (``portakern.gemv_weight``), with the fragment copy the
    tensor-core kernel reads (``kernels/gemv_frag.py``) where the device runs it."""
    from portakern.gemv_weight import prepare_gemv_weight, wants_fragments

    return prepare_gemv_weight(weight, device, fragments=wants_fragments(device))


def compile_for_target(op: QuantGemv, target: str, config: GemvConfig | None = None) -> dict:
    """``op`` lowered for ``target`` without the device (``aot.compile_for_target``)."""
    from .aot import compile_for_target as lower

    return lower(op, target, config)
