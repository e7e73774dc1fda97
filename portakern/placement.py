"""Device placement of compiled kernels: ``on_device`` makes a kernel launch on the device it was built for."""

from __future__ import annotations

import functools

from portakern.devices import Device


def on_device(kernel, device: Device):
    """``kernel`` launched on ``device``: Triton launches on the *current* CUDA device and its stream, so a call
    on cuda:1 tensors while cuda:0 is current would run on the wrong GPU. With one visible GPU (or on the CPU)
    nothing can differ and ``kernel`` is returned as it is; otherwise a wrapper makes ``device`` current around
    the call when it is not (one integer compare per call)."""
    if device.type != "cuda" or device.index is None:
        return kernel
    import torch

    if torch.cuda.device_count() < 2:
        return kernel
    index, current, switch = device.index, torch.cuda.current_device, torch.cuda.device

    def run(*args):
        if current() == index:
            return kernel(*args)
        with switch(index):
            return kernel(*args)

    functools.update_wrapper(run, kernel, assigned=("__name__", "__qualname__", "__doc__"))  # and __dict__
    run.inner = kernel
    return run


__all__ = ["on_device"]
