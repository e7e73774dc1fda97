"""Shared pieces of the opencl backend tests: the device guard and float64 references written here.

``require_opencl()``: the tests need pyopencl and an OpenCL device (PoCL on the CPU in CI). Without them a test
is skipped on a developer's machine, but **fails** when ``CI`` or ``PORTAKERN_REQUIRE_OPENCL`` is set (CI's
scripts/test.sh sets the latter), so CI can never go green by skipping them.
"""

from __future__ import annotations

import os

import numpy as np
import pytest


def require_opencl():
    """The first OpenCL device's ``(Device, queue)``; skip (fail under CI) when there is none."""
    why = None
    try:
        import pyopencl  # noqa: F401

        from portakern.opencl_runtime import devices, queue
        devs = devices()
        if not devs:
            why = "pyopencl finds no OpenCL device"
    except ImportError as e:
        why = f"pyopencl is not installed ({e})"
    if why is not None:
        if os.environ.get("CI") or os.environ.get("PORTAKERN_REQUIRE_OPENCL"):
            pytest.fail(f"the opencl tests must run here (CI / PORTAKERN_REQUIRE_OPENCL is set) but {why}; "
                        "install 'portakern[opencl]' (pyopencl + pocl-binary-distribution)")
        pytest.skip(why)
    return devs[0], queue(devs[0])


def to_cl(queue, a):
    import pyopencl.array as cla

    return cla.to_device(queue, np.ascontiguousarray(a))


def ref_attention(q, k, v, *, scale=None, mask=None, score=None, lens_k=None):
    """float64 attention over dense ``(B, Sq, Hq, D)`` / ``(B, Sk, Hkv, D|Dv)`` numpy arrays, written out here.

    ``mask(b, h, i, j, sq, sk) -> bool`` and ``score(s, b, h, i, j, sq, sk) -> float`` are plain Python callables
    over scalars; ``lens_k[b]`` limits the keys of batch entry b. Returns ``out`` (B, Sq, Hq, Dv) float64 and
    ``lse`` (B, Hq, Sq) float64 with the empty-row rule (zeros, -inf).
    """
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    B, Sq, Hq, D = q.shape
    Hkv, Dv = k.shape[2], v.shape[3]
    G = Hq // Hkv
    scale = 1.0 / np.sqrt(D) if scale is None else scale
    out = np.zeros((B, Sq, Hq, Dv))
    lse = np.full((B, Hq, Sq), -np.inf)
    for b in range(B):
        sk = k.shape[1] if lens_k is None else int(lens_k[b])
        for h in range(Hq):
            kv = h // G
            for i in range(Sq):
                s = scale * (k[b, :sk, kv] @ q[b, i, h])
                keep = np.ones(sk, bool)
                for j in range(sk):
                    if score is not None:
                        s[j] = score(s[j], b, h, i, j, Sq, sk)
                    if mask is not None:
                        keep[j] = mask(b, h, i, j, Sq, sk)
                s = np.where(keep, s, -np.inf)
                if sk == 0 or not np.isfinite(s.max()):
                    continue
                m = s.max()
                p = np.exp(s - m)
                out[b, i, h] = p @ v[b, :sk, kv] / p.sum()
                lse[b, h, i] = m + np.log(p.sum())
    return out, lse
