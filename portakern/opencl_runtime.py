"""OpenCL devices, contexts and queues for portakern (only imported when pyopencl is present).

Naming: every OpenCL device of every platform gets one flat index, in platform order then device order
(``cl.get_platforms()``, ``platform.get_devices()``), so ``opencl:0``, ``opencl:1``, ... are unique across
platforms and ``parse_device("opencl:1")`` works like ``"cuda:1"``. The platform and the device's index inside it
are in ``Device.info`` (``platform``, ``platform_index``, ``device_index``) and ``portakern info`` prints them.
``PORTAKERN_OPENCL_DEVICE=<n>`` picks the OpenCL device that host (numpy / CPU torch) arrays run on with
``backend="opencl"`` (default: ``opencl:0``).

One context and one in-order queue per device, created on first use and kept for the process.
"""

from __future__ import annotations

import functools
import os
import threading
from typing import Any

from .devices import Device

_queues: dict[int, Any] = {}        # flat index -> cl.CommandQueue
_lock = threading.Lock()


@functools.lru_cache(maxsize=None)
def cl_devices() -> tuple[tuple[Device, Any], ...]:
    """``(Device, pyopencl.Device)`` for every OpenCL device, flat-indexed; empty without pyopencl or a platform."""
    try:
        import pyopencl as cl

        platforms = cl.get_platforms()
    except Exception:  # pyopencl missing, or no ICD / platform at all
        return ()
    out = []
    for pi, p in enumerate(platforms):
        try:
            devs = p.get_devices()
        except Exception:
            continue
        for di, d in enumerate(devs):
            kind = ("gpu" if d.type & cl.device_type.GPU else "cpu" if d.type & cl.device_type.CPU
                    else "accelerator" if d.type & cl.device_type.ACCELERATOR else "other")
            info = (("platform", p.name.strip()), ("platform_index", str(pi)), ("device_index", str(di)),
                    ("device_type", kind), ("driver", d.driver_version), ("opencl_c", d.opencl_c_version),
                    ("local_mem_size", str(d.local_mem_size)), ("max_work_group_size", str(d.max_work_group_size)),
                    ("pyopencl", cl.VERSION_TEXT))
            out.append((Device("opencl", len(out), arch=d.version.strip(), name=f"{p.name.strip()}:{d.name.strip()}",
                               warp_size=1, info=info), d))
    return tuple(out)


def devices() -> list[Device]:
    return [d for d, _ in cl_devices()]


def cl_device(device: Device) -> Any:
    """The pyopencl.Device behind ``device`` (an ``opencl:<n>`` Device)."""
    for d, c in cl_devices():
        if d.index == device.index:
            return c
    from .errors import InvalidInputError

    raise InvalidInputError(f"device {device} is not an OpenCL device present here: present OpenCL devices are "
                            f"{', '.join(str(d) for d in devices()) or 'none'}")


@functools.lru_cache(maxsize=None)
def _by_pointer() -> dict[int, Device]:
    return {c.int_ptr: d for d, c in cl_devices()}


def device_for(cl_dev: Any) -> Device:
    """The portakern Device of a pyopencl.Device (e.g. ``array.queue.device``)."""
    d = _by_pointer().get(cl_dev.int_ptr)
    if d is None:
        from .errors import InvalidTypeError

        raise InvalidTypeError(f"the OpenCL device {cl_dev.name!r} of this array is not one portakern lists "
                               "(portakern.devices()); create the array on a listed device")
    return d


def default_device() -> Device:
    """The OpenCL device host arrays run on with ``backend="opencl"``: ``$PORTAKERN_OPENCL_DEVICE`` or opencl:0."""
    from .errors import InvalidInputError

    devs = devices()
    if not devs:
        raise InvalidInputError("no OpenCL device is present: install an OpenCL driver (for the CPU: "
                                "pip install 'portakern[opencl]', which brings PoCL) or use backend='cpu'")
    want = os.environ.get("PORTAKERN_OPENCL_DEVICE", "").strip()
    if not want:
        return devs[0]
    for d in devs:
        if want in (str(d.index), str(d)):
            return d
    raise InvalidInputError(f"PORTAKERN_OPENCL_DEVICE={want!r} names no OpenCL device: present are "
                            f"{', '.join(str(d) for d in devs)}")


def queue(device: Device) -> Any:
    """The cached in-order command queue (and with it the context) of ``device``; a host device maps to
    ``default_device()``."""
    if device.type != "opencl":
        device = default_device()
    q = _queues.get(device.index)
    if q is not None:
        return q
    import pyopencl as cl

    with _lock:
        q = _queues.get(device.index)
        if q is None:
            ctx = cl.Context([cl_device(device)])
            q = _queues[device.index] = cl.CommandQueue(ctx)
    return q
