"""What a cubin says of its kernels' resources, read from its ELF ``.nv.info`` section.

ptxas prints a kernel's registers and spills into NVRTC's log, but only when it ran: on a machine with a CUDA driver,
NVRTC (12.9 and newer) keeps compiled output in the driver's compute cache (``~/.nv/ComputeCache``; off with
``CUDA_CACHE_DISABLE=1``) and a hit returns the cubin with an empty log. The cubin itself records the same facts in
its ``.nv.info`` section as a list of attributes (format byte, attribute byte, then the value): per kernel symbol,
``EIATTR_REGCOUNT`` (registers a thread) and ``EIATTR_FRAME_SIZE`` (bytes of stack frame a thread: where spilled
registers go, so an upper bound on the spill).

    cubin_resources(cubin)      # {"registers": 96, "frame_bytes": 0} for a one-kernel cubin, or None
"""

from __future__ import annotations

import struct

_EIFMT_NVAL, _EIFMT_BVAL, _EIFMT_HVAL, _EIFMT_SVAL = 0x01, 0x02, 0x03, 0x04
_EIATTR_FRAME_SIZE, _EIATTR_REGCOUNT = 0x11, 0x2F


def _sections(cubin: bytes) -> dict[str, bytes]:
    """Section name -> contents of a little-endian ELF64 file."""
    if cubin[:4] != b"\x7fELF" or cubin[4] != 2 or cubin[5] != 1:
        raise ValueError("not a little-endian ELF64 cubin")
    (shoff,) = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    heads = [struct.unpack_from("<IIQQQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    names_at = heads[shstrndx][4]
    out = {}
    for name, _type, _flags, _addr, offset, size in heads:
        start = names_at + name
        out[cubin[start:cubin.index(b"\0", start)].decode()] = cubin[offset:offset + size]
    return out


def _attributes(info: bytes):
    """(attribute, value bytes) of an ``.nv.info`` section, in order."""
    i = 0
    while i + 2 <= len(info):
        fmt, attr = info[i], info[i + 1]
        if fmt == _EIFMT_SVAL:
            (size,) = struct.unpack_from("<H", info, i + 2)
            yield attr, info[i + 4:i + 4 + size]
            i += 4 + size
        elif fmt == _EIFMT_HVAL:
            yield attr, info[i + 2:i + 4]
            i += 4
        elif fmt == _EIFMT_BVAL:
            yield attr, info[i + 2:i + 3]
            i += 3
        elif fmt == _EIFMT_NVAL:
            yield attr, b""
            i += 2
        else:
            raise ValueError(f".nv.info: unknown attribute format {fmt:#x} at byte {i}")


def cubin_resources(cubin: bytes) -> dict[str, int] | None:
    """``{"registers", "frame_bytes"}`` of the cubin's kernel (the largest over its kernels when it holds several),
    or None when its ``.nv.info`` records no register count.

    Raises:
      ValueError when ``cubin`` is not an ELF64 cubin or its ``.nv.info`` cannot be read.
    """
    info = _sections(cubin).get(".nv.info")
    if info is None:
        return None
    regs, frame = {}, {}
    for attr, value in _attributes(info):
        if attr in (_EIATTR_REGCOUNT, _EIATTR_FRAME_SIZE) and len(value) == 8:
            symbol, n = struct.unpack("<II", value)
            (regs if attr == _EIATTR_REGCOUNT else frame)[symbol] = n
    if not regs:
        return None
    return {"registers": max(regs.values()), "frame_bytes": max(frame.values(), default=0)}
