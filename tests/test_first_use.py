"""What a new user meets first: README commands on an install without torch, ``portakern info``'s cuda line, and
arrays from other libraries that speak DLPack (JAX, MLX)."""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

import portakern
from portakern.errors import InvalidTypeError

ROOT = Path(__file__).resolve().parents[1]


# -- the README's explain commands without torch ------------------------------------------------

@pytest.fixture
def no_torch(tmp_path):
    """An environment whose Python cannot import torch (a base install), through a ``sitecustomize``."""
    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['torch'] = None  # import torch fails\n")
    return dict(os.environ, PYTHONPATH=str(tmp_path))


def explain(env, *argv):
    return subprocess.run([sys.executable, "-m", "portakern", "explain", *argv], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=300)


@pytest.mark.parametrize("argv", [
    ("attention", "--shape", "1,1,4096,32,8,128", "--causal"),
    ("quant_gemv", "--shape", "1,4096,4096", "--bits", "4", "--group-size", "128"),
], ids=["attention", "quant_gemv"])
def test_readme_explain_commands_run_without_torch(no_torch, argv):
    r = explain(no_torch, *argv)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    assert "* cpu" in r.stdout and "chosen   cpu" in r.stdout
    assert "--dtype fp32 (the default bf16 needs torch" in r.stderr
    assert "float32" in explain(no_torch, *argv, "--json").stdout


def test_explicit_bf16_without_torch_is_a_usage_error(no_torch):
    r = explain(no_torch, "attention", "--shape", "1,1,64,4,4,64", "--dtype", "bf16")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "--dtype bf16: bf16 placeholder arrays on the CPU are torch tensors and torch is not installed; " \
           "pass --dtype fp16 or fp32, or pip install torch" in r.stderr


def test_the_default_dtype_stays_bf16_with_torch():
    pytest.importorskip("torch")
    from portakern import cli

    args = cli.build_parser().parse_args(["explain", "attention", "--shape", "1,1,16,2,2,16"])
    assert args.dtype is None and cli._explain_dtype(args).value == "bfloat16"


# -- portakern info: which part of the cuda toolchain is missing ---------------------------------

def _fake_cuda_bindings(monkeypatch, nvrtc):
    cuda, bindings = types.ModuleType("cuda"), types.ModuleType("cuda.bindings")
    cuda.bindings, bindings.nvrtc = bindings, nvrtc
    for name, mod in (("cuda", cuda), ("cuda.bindings", bindings), ("cuda.bindings.nvrtc", nvrtc)):
        monkeypatch.setitem(sys.modules, name, mod)


def test_info_says_nvrtc_is_missing_not_cuda_bindings(monkeypatch):
    from portakern.backends.cuda import backend

    nvrtc = types.ModuleType("cuda.bindings.nvrtc")

    def no_library():
        raise RuntimeError("Failed to dlopen libnvrtc.so.12")

    nvrtc.nvrtcVersion = no_library
    _fake_cuda_bindings(monkeypatch, nvrtc)
    assert backend._version() == "cuda-bindings, NVRTC library not loadable"
    status = backend.CudaBackend().runtime_status()
    assert status.startswith("unavailable: the NVRTC library cannot be loaded") and "cuda-bindings" not in status


def test_info_says_cuda_bindings_is_missing(monkeypatch):
    from portakern.backends.cuda import backend

    for name in ("cuda", "cuda.bindings", "cuda.bindings.nvrtc"):
        monkeypatch.setitem(sys.modules, name, None)
    assert backend._version() == "cuda-bindings not installed"


def test_info_names_the_nvrtc_version(monkeypatch):
    from portakern.backends.cuda import backend

    nvrtc = types.ModuleType("cuda.bindings.nvrtc")
    nvrtc.nvrtcResult = types.SimpleNamespace(NVRTC_SUCCESS=0)
    nvrtc.nvrtcVersion = lambda: (0, 12, 8)
    _fake_cuda_bindings(monkeypatch, nvrtc)
    assert backend._version() == "cuda-bindings, NVRTC 12.8"


# -- arrays that speak DLPack only ----------------------------------------------------------------

class OnlyDLPack:
    """An array of another library as portakern sees it: nothing but the DLPack protocol (as JAX and MLX arrays)."""

    def __init__(self, a):
        self._a = a

    def __dlpack__(self, **kwargs):
        return self._a.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()


def test_attention_reads_dlpack_arrays(rng):
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in ((2, 3, 4, 8), (2, 5, 2, 8), (2, 5, 2, 8)))
    out = portakern.attention(OnlyDLPack(q), OnlyDLPack(k), OnlyDLPack(v), causal=True)
    assert type(out) is np.ndarray and out.dtype == np.float32
    kk, vv = (np.repeat(a.astype(np.float64), 2, axis=2) for a in (k, v))
    s = np.einsum("bqhd,bkhd->bhqk", q.astype(np.float64), kk) / np.sqrt(8)
    s = np.where(np.arange(5)[None, :] <= np.arange(3)[:, None] + 2, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    np.testing.assert_allclose(out, np.einsum("bhqk,bkhd->bqhd", p / p.sum(-1, keepdims=True), vv),
                               rtol=2e-5, atol=2e-6)


def test_quant_gemv_and_index_arrays_read_dlpack_arrays(rng):
    w = portakern.quantize(rng.standard_normal((16, 64)).astype(np.float32), bits=4, group_size=32)
    x = rng.standard_normal((2, 64)).astype(np.float32)
    np.testing.assert_array_equal(portakern.quant_gemv(OnlyDLPack(x), w), portakern.quant_gemv(x, w))
    q, k = rng.standard_normal((1, 1, 2, 8)).astype(np.float32), rng.standard_normal((1, 6, 2, 8)).astype(np.float32)
    lengths = np.array([4], np.int32)
    np.testing.assert_array_equal(
        portakern.attention(OnlyDLPack(q), OnlyDLPack(k), OnlyDLPack(k), seqlens_k=OnlyDLPack(lengths)),
        portakern.attention(q, k[:, :4], k[:, :4]))


def test_a_dlpack_array_numpy_cannot_hold_is_named(rng):
    class Bf16Host(OnlyDLPack):
        def __dlpack__(self, **kwargs):
            raise BufferError("bfloat16 is not supported by numpy")

    q = rng.standard_normal((1, 1, 2, 8)).astype(np.float32)
    with pytest.raises(InvalidTypeError, match=r"q is a .*Bf16Host that DLPack cannot hand over \(BufferError: "
                                                r"bfloat16 is not supported by numpy\); convert it"):
        portakern.attention(Bf16Host(q), q, q)


def test_an_object_without_dlpack_is_still_refused_by_name():
    with pytest.raises(InvalidTypeError, match=r"q is a builtins.list: expected a numpy array.*__dlpack__"):
        portakern.attention([[1.0]], np.ones((1, 1, 1, 4), np.float32), np.ones((1, 1, 1, 4), np.float32))
