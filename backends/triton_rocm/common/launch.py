"""One Triton kernel launched on one grid with fixed compile-time arguments and HIP compile options.

Every launch goes through Triton's own ``fn[grid](...)`` (binding, specialisation, its compile cache): on AMD the
host cost of that path was not measured against a bypass like the triton backend's, so the simple, always-correct
path is the one taken. Under the interpreter no compile options are passed (it runs no compiler).
"""

from __future__ import annotations

from typing import Any

#: Options every kernel of this backend is compiled with. ``enable_fp_fusion``: the kernel bodies are written for
#: fused multiply-adds (the GEMV's one FMA per code, the attention's rescaled accumulation).
KERNEL_OPTIONS = {"enable_fp_fusion": True}


def compile_options(num_warps: int, num_stages: int, hip: dict) -> dict[str, Any]:
    """The launch / compile options of a configuration: warps, pipeline depth and the HIP options (``hip``:
    ``waves_per_eu``, ``matrix_instr_nonkdim``, ``kpack`` from ``tuning.py``)."""
    return dict(num_warps=num_warps, num_stages=num_stages, **hip, **KERNEL_OPTIONS)


class Launch:
    """``launch(*args)``: ``fn`` on ``grid`` with ``constexprs`` (by name, after the positional runtime
    arguments) and ``options`` (none under the interpreter: ``interpret``)."""

    def __init__(self, fn, grid: tuple[int, ...], constexprs: dict[str, Any], options: dict[str, Any],
                 interpret: bool):
        self.fn, self.grid, self.constexprs = fn, tuple(grid), constexprs
        self.options = {} if interpret else dict(options)
        self.calls = 0

    def __call__(self, *args) -> None:
        self.calls += 1
        self.fn[self.grid](*args, **self.constexprs, **self.options)


def on_device(kernel, index: int):
    """``kernel`` made to launch on GPU ``index`` whatever device is current (Triton launches on the current one;
    torch names a HIP build's GPUs "cuda"). With one visible GPU it is returned unchanged."""
    import functools

    import torch

    if torch.cuda.device_count() < 2:
        return kernel

    @functools.wraps(kernel)
    def placed(*args, **kwargs):
        if torch.cuda.current_device() == index:
            return kernel(*args, **kwargs)
        with torch.cuda.device(index):
            return kernel(*args, **kwargs)

    return placed
