"""The built wheel maps ir/, backends/ and conformance/ into the portakern namespace and runs."""

import os
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_layout_and_import(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(tmp_path), str(ROOT)], check=True)
    wheel = next(tmp_path.glob("portakern-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names}
    assert top <= {"portakern", f"{wheel.name.split('-')[0]}-{wheel.name.split('-')[1]}.dist-info"}, top
    for module in ("portakern/ir/ops.py", "portakern/backends/cpu/attention.py",
                   "portakern/backends/triton/backend.py", "portakern/backends/triton/kernels/attention_fwd.py",
                   "portakern/backends/opencl/backend.py", "portakern/backends/opencl/kernels/attention.cl",
                   "portakern/backends/opencl/kernels/quant_gemv.cl", "portakern/backends/opencl/kernels/storage.cl",
                   "portakern/backends/cuda/backend.py", "portakern/backends/cuda/kernels/gemv_small_m.cu",
                   "portakern/backends/cuda/kernels/host_shim.h", "portakern/backends/cuda/kernels/host_launch.cpp",
                   "portakern/conformance/data/cases-v3/manifest.json", "portakern/conformance/__init__.py"):
        assert module in names
    entry_points = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "[portakern.backends]" in entry_points and "cpu = portakern.backends.cpu" in entry_points
    assert "opencl = portakern.backends.opencl" in entry_points and "cuda = portakern.backends.cuda" in entry_points

    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
                   check=True)
    code = ("import portakern, numpy as np; assert portakern.__file__.startswith(%r), portakern.__file__;"
            "q = np.ones((1, 2, 1, 4), np.float32); out = portakern.attention(q, q, q, backend='cpu');"
            "assert np.allclose(out, 1.0); print(sorted(b.name for b in portakern.list_backends()));"
            # the opencl kernels load from the installed package data (when an OpenCL device is present)
            "ok = portakern.list_backends()[[b.name for b in portakern.list_backends()].index('opencl')].status() == 'ok';"
            "out = portakern.attention(q, q, q, backend='opencl') if ok else out; assert np.allclose(out, 1.0)"
            % str(target))
    env = dict(os.environ, PYTHONPATH=str(target))
    res = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert "cpu" in res.stdout


def test_wheel_carries_license_and_py_typed_and_builds_without_warnings(tmp_path):
    """The wheel ships the Apache-2.0 LICENSE and the PEP 561 marker, and building it prints none of setuptools'
    warnings (a data folder absent from ``packages``, a deprecated license table)."""
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "--no-build-isolation",
                            "-w", str(tmp_path), str(ROOT)], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-3000:]
    log = build.stdout + build.stderr
    for warning in ("BuildBackendWarning", "absent from the `packages` configuration", "SetuptoolsDeprecationWarning"):
        assert warning not in log, log[log.find(warning) - 500:][:1500]
    wheel = zipfile.ZipFile(next(tmp_path.glob("portakern-*.whl")))
    names = wheel.namelist()
    assert "portakern/py.typed" in names
    (license_name,) = [n for n in names if n.endswith(".dist-info/licenses/LICENSE")]
    assert "Apache License" in wheel.read(license_name).decode() and "Version 2.0" in wheel.read(license_name).decode()
    metadata = wheel.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "License-Expression: Apache-2.0" in metadata
