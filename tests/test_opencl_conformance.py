"""The conformance suite's cpu tier for the opencl backend, from pytest: a fixed sample of the cases on the
OpenCL device (PoCL in CI) must pass against the checked-in float64 goldens, bfloat16 ones reported unsupported
with the reason; a broken kernel must fail the suite. (scripts/test.sh runs the *whole* tier, on the OpenCL
device and from host arrays, as steps of its own.)"""

from __future__ import annotations

import pytest

from opencl_helpers import require_opencl


@pytest.fixture(scope="module")
def cl_dev():
    return require_opencl()


def _sample(step: int = 8) -> list[str]:
    from portakern.conformance.runner import collect_cases

    return [c.id for c in collect_cases("cpu")][::step]


def test_cpu_tier_sample_passes_on_the_opencl_device(cl_dev):
    from portakern.conformance.runner import run

    dev, _ = cl_dev
    ids = _sample()
    rep, status = run(backends=["opencl"], device=str(dev), cases_glob=ids, progress=False, out=None)
    results = rep["results"]
    assert len(results) == len(ids) and status == 0
    by = {}
    for r in results:
        by.setdefault(r["status"], []).append(r)
    assert set(by) <= {"pass", "unsupported"}, {k: [r["case"] for r in v] for k, v in by.items()}
    assert len(by["pass"]) >= 0.5 * len(ids)
    for r in by.get("unsupported", []):    # only what pyopencl arrays cannot hold
        assert r["dtype"] == "bfloat16" and r["reason"].startswith("dtype=bfloat16 on an OpenCL device"), r


def test_host_arrays_run_the_bfloat16_cases_too(cl_dev):
    from portakern.conformance.runner import run

    ids = [i for i in _sample(5) if i.endswith("-bf16") or "-bf16-" in i][:12]
    assert ids
    rep, status = run(backends=["opencl"], device="cpu", cases_glob=ids, progress=False, out=None)
    assert status == 0 and {r["status"] for r in rep["results"]} == {"pass"}, rep["results"]


def test_a_broken_kernel_fails_conformance(cl_dev, monkeypatch):
    """The suite has teeth for this backend: a kernel that forgets to normalise by the softmax sum fails."""
    from portakern import dispatch
    from portakern.backends.opencl import attention as A
    from portakern.conformance.runner import run

    real = A.kernel_source
    normalise = "const float inv = l != 0.0f ? 1.0f / l : 0.0f;"
    assert normalise in real("attention.cl"), "the mutation no longer matches the kernel: update it"
    monkeypatch.setattr(A, "kernel_source", lambda name: real(name).replace(
        normalise, "const float inv = l != 0.0f ? 1.0f : 0.0f;"))
    dispatch.clear_cache()
    try:
        ids = [i for i in _sample(3) if i.startswith("attn-") and not i.endswith("bf16")][:4]
        rep, status = run(backends=["opencl"], device=str(cl_dev[0]), cases_glob=ids, progress=False, out=None)
    finally:
        dispatch.clear_cache()
    assert status != 0 and any(r["status"] == "fail" for r in rep["results"]), rep["results"]
