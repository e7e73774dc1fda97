"""Devices: what portakern can run on, found from the installed array libraries."""

from __future__ import annotations

import functools
import platform
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Device:
    """One device. ``type`` is "cpu", "cuda", "rocm" or "opencl"; ``arch`` e.g. "sm_90", "gfx942".

    ``capability`` is the CUDA compute capability ``(major, minor)`` (None elsewhere);
    ``warp_size`` 32 on NVIDIA, 64 on AMD CDNA; ``info`` holds name, memory, driver, toolkit.
    """

    type: str
    index: int = 0
    arch: str = ""
    name: str = ""
    capability: tuple[int, int] | None = None
    warp_size: int = 1
    info: tuple[tuple[str, str], ...] = field(default=(), compare=False)

    def __str__(self) -> str:
        if self.type == "cpu":
            return "cpu"
        return f"{self.type}:{self.index}"

    @property
    def label(self) -> str:
        """Readable identity, e.g. ``cuda:0 (NVIDIA H200, sm_90)``."""
        bits = list(dict.fromkeys(b for b in (self.name, self.arch) if b))
        return f"{self}" + (f" ({', '.join(bits)})" if bits else "")

    def to_json(self) -> dict:
        return {"device": str(self), "type": self.type, "index": self.index, "arch": self.arch,
                "name": self.name, "capability": list(self.capability) if self.capability else None,
                "warp_size": self.warp_size, **dict(self.info)}


CPU = Device("cpu", 0, arch=platform.machine(), name=platform.processor() or platform.machine())


@functools.lru_cache(maxsize=None)
def torch_device(type_: str, index: int) -> Device:
    """The Device for torch device ``type_:index`` ("cuda" covers ROCm on a HIP build)."""
    if type_ == "cpu":
        return CPU
    import torch

    props = torch.cuda.get_device_properties(index)
    hip = getattr(torch.version, "hip", None)
    info = [("total_memory", str(props.total_memory)), ("torch", torch.__version__)]
    if hip:  # a HIP build: torch calls the AMD GPU "cuda"; gcnArchName is e.g. "gfx942:sramecc+:xnack-"
        full = str(getattr(props, "gcnArchName", "") or "")
        arch = full.split(":")[0]
        info += [("hip", str(hip)), ("gcn_arch_name", full),
                 ("compute_units", str(getattr(props, "multi_processor_count", 0)))]
        return Device("rocm", index, arch=arch, name=props.name, warp_size=int(getattr(props, "warp_size", 64) or 64),
                      info=tuple(info))
    cap = (props.major, props.minor)
    info += [("cuda", str(torch.version.cuda)), ("multiprocessors", str(props.multi_processor_count))]
    return Device("cuda", index, arch=f"sm_{cap[0]}{cap[1]}", name=props.name, capability=cap,
                  warp_size=32, info=tuple(info))


def parse_device(text: str) -> Device:
    """Parse "cpu", "cuda", "cuda:1", "rocm:0", "opencl:0" into a present Device; raise naming what exists.

    OpenCL devices are numbered flat across platforms (``portakern.opencl_runtime``); "opencl" alone is opencl:0.
    """
    from .errors import InvalidInputError

    text = str(text).strip()
    if text == "cpu":
        return CPU
    for dev in detect_devices():
        if str(dev) == text or (":" not in text and dev.type == text):
            return dev
    present = ", ".join(str(d) for d in detect_devices())
    raise InvalidInputError(f"device={text!r} is not present on this machine: present devices are {present}")


def detect_devices() -> list[Device]:
    """Every device visible through the installed libraries (torch, pyopencl). CPU always first."""
    devices = [CPU]
    try:
        import torch

        if torch.cuda.is_available():
            devices += [torch_device("cuda", i) for i in range(torch.cuda.device_count())]
    except Exception:  # torch missing or broken: CPU and OpenCL still work
        pass
    from .opencl_runtime import devices as opencl_devices  # empty without pyopencl or an OpenCL platform

    devices += opencl_devices()
    return devices
