"""Shared by the CUDA C experiments (``gemv_cluster.py``, ``gemv_wide.py``): compile a ``.cu`` file outside the
package to a cubin -- with the cuda backend's NVRTC path (``portakern.backends.cuda.nvrtc.compile_text``), or
``nvcc`` where NVRTC cannot be loaded -- and read ptxas' report. Launches go through the backend's
``nvrtc.Function``."""

from __future__ import annotations

import os
import re
import subprocess
import tempfile


def compile_cubin(source: str, defs: dict[str, int], arch: str = "sm_90a") -> tuple[bytes, str]:
    """The cubin of ``source`` with ``-D`` ``defs`` for ``arch`` and the compiler's log (ptxas' register and spill
    report): NVRTC through ``cuda.bindings``, else ``nvcc`` where NVRTC cannot be loaded."""
    from portakern.backends.cuda.nvrtc import compile_text, unavailable

    why = unavailable()
    if why is not None:
        return _compile_nvcc(source, defs, arch, why=why)
    c = compile_text(open(source).read(), os.path.basename(source), tuple(defs.items()), arch)
    return c.cubin, c.log


def _compile_nvcc(source: str, defs: dict[str, int], arch: str, why: str) -> tuple[bytes, str]:
    with tempfile.TemporaryDirectory() as d:
        cubin = os.path.join(d, "k.cubin")
        cmd = ["nvcc", "--cubin", f"-arch={arch}", "-std=c++17", "-Xptxas", "-v", "-o", cubin, source]
        cmd += [f"-D{k}={v}" for k, v in defs.items()]
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode:
            raise RuntimeError(f"nvcc failed for {defs} (NVRTC unavailable: {why}):\n{p.stderr}")
        return open(cubin, "rb").read(), p.stderr


def registers(log: str) -> dict:
    """ptxas' report in a compiler log: registers, spill stores / loads, static shared memory."""
    find = lambda pat: int(m.group(1)) if (m := re.search(pat, log)) else None   # noqa: E731
    return {"registers": find(r"Used (\d+) registers"), "spill_stores": find(r"(\d+) bytes spill stores"),
            "spill_loads": find(r"(\d+) bytes spill loads"), "smem": find(r"(\d+) bytes smem")}
