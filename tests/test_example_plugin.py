"""The out-of-tree example plugin ``examples/portakern-torch-eager``: installed as its own
distribution, found through its entry point, listed by ``portakern info``, and serving calls
with ``backend="torch-eager"`` that agree with the CPU reference."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import numpy as np
import pytest
import torch

import portakern
from portakern.ir import expr as E

ROOT = Path(__file__).resolve().parents[1]
PLUGIN_DIR = ROOT / "examples" / "portakern-torch-eager"
INSTALL = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "-e", str(PLUGIN_DIR)]


@pytest.fixture(scope="module")
def torch_eager():
    """The plugin's distribution, installed (CI does it in .ci/run; else this does) and loaded."""
    added = False
    try:
        metadata.distribution("portakern-torch-eager")
    except metadata.PackageNotFoundError:
        r = subprocess.run(INSTALL, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, f"could not install the example plugin: {r.stderr[-2000:]}"
        importlib.invalidate_caches()
        # the editable install's import hook is a .pth file, read at interpreter start-up only:
        # make the freshly installed package importable in this process too
        sys.path.insert(0, str(PLUGIN_DIR))
        added = True
    from portakern import plugins

    plugins.reset()
    assert "torch-eager" in plugins.registry().backends, portakern.plugin_errors()
    yield "torch-eager"
    if added:
        sys.path.remove(str(PLUGIN_DIR))
    plugins.reset()


def test_entry_point_is_declared_by_its_own_distribution(torch_eager):
    (ep,) = [ep for ep in metadata.entry_points(group="portakern.backends") if ep.name == "torch-eager"]
    assert ep.value == "portakern_torch_eager" and ep.dist.name == "portakern-torch-eager"


def test_portakern_info_lists_it(torch_eager):
    r = subprocess.run([sys.executable, "-m", "portakern", "info", "--json"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    be = {b["name"]: b for b in json.loads(r.stdout)["backends"]}["torch-eager"]
    assert be["distribution"] == "portakern-torch-eager" and be["status"] == "ok"
    assert be["array_kind"] == "torch" and be["device_types"] == ["cpu", "cuda"]
    r = subprocess.run([sys.executable, "-m", "portakern", "info"], capture_output=True, text=True, timeout=120)
    assert "torch-eager" in r.stdout and "[portakern-torch-eager]" in r.stdout


def test_it_never_takes_over_default_dispatch(torch_eager, fresh_registry):
    q = np.zeros((1, 2, 2, 16), np.float32)
    d = portakern.explain(portakern.attention, q, q, q)
    assert d.chosen == "cpu" and "torch-eager" in [c.name for c in d.candidates]
    d = portakern.explain(portakern.attention, q, q, q, backend="torch-eager")
    assert d.chosen == "torch-eager" and d.forced_by == "argument"


def _rand(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


ATTENTION_VARIANTS = {
    "plain": {},
    "causal": {"causal": True},
    "window": {"window": (3, 1)},
    "softcap": {"softcap": 4.0},
    "alibi": {"score_mod": E.alibi_score(E.alibi_slopes(4))},
    "document_mask": {"mask_mod": E.document_mask((2, 6))},
    "causal_lse": {"causal": True, "return_lse": True},
    "window_fully_masked_rows": {"window": (0, 0), "return_lse": True},
}


@pytest.mark.parametrize("variant", list(ATTENTION_VARIANTS))
@pytest.mark.parametrize("Sq, Sk", [(5, 9), (9, 4)])
def test_attention_matches_the_cpu_reference(torch_eager, fresh_registry, rng, variant, Sq, Sk, torch_device):
    kw = ATTENTION_VARIANTS[variant]
    q, k, v = _rand(rng, 2, Sq, 4, 16), _rand(rng, 2, Sk, 2, 16), _rand(rng, 2, Sk, 2, 8)
    want = portakern.attention(q, k, v, backend="cpu", **kw)
    got = portakern.attention(*(torch.from_numpy(a).to(torch_device) for a in (q, k, v)), backend=torch_eager, **kw)
    if kw.get("return_lse"):
        (want, want_lse), (got, got_lse) = want, got
        np.testing.assert_allclose(got_lse.cpu().numpy(), want_lse, atol=1e-5)
    assert isinstance(got, torch.Tensor) and got.dtype == torch.float32 and got.device.type == torch_device
    np.testing.assert_allclose(got.cpu().numpy(), want, atol=2e-5 if torch_device == "cpu" else 2e-3)


def test_paged_and_varlen(torch_eager, fresh_registry, rng, torch_device):
    def t(a):
        return torch.from_numpy(a).to(torch_device)

    k, v, q = _rand(rng, 10, 4, 2, 16), _rand(rng, 10, 4, 2, 16), _rand(rng, 3, 2, 4, 16)
    bt = rng.permutation(10)[:9].reshape(3, 3).astype(np.int32)
    sl = np.array([12, 5, 1], np.int32)
    want = portakern.attention(q, k, v, block_table=bt, seqlens_k=sl, causal=True, backend="cpu")
    got = portakern.attention(t(q), t(k), t(v), block_table=t(bt), seqlens_k=t(sl), causal=True, backend=torch_eager)
    np.testing.assert_allclose(got.cpu().numpy(), want, atol=2e-3)

    cq, ck = np.array([0, 3, 3, 7], np.int32), np.array([0, 5, 9, 9], np.int32)
    q, k, v = _rand(rng, 7, 4, 16), _rand(rng, 9, 2, 16), _rand(rng, 9, 2, 16)
    want = portakern.attention(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck, return_lse=True, backend="cpu")
    got = portakern.attention(t(q), t(k), t(v), cu_seqlens_q=t(cq), cu_seqlens_k=t(ck), return_lse=True,
                              backend=torch_eager)
    np.testing.assert_allclose(got[0].cpu().numpy(), want[0], atol=2e-3)
    np.testing.assert_array_equal(np.isinf(got[1].cpu().numpy()), np.isinf(want[1]))


@pytest.mark.parametrize("dtype, tol", [(torch.float16, 2e-3), (torch.bfloat16, 2e-2)])
def test_half_precision_inputs(torch_eager, fresh_registry, rng, dtype, tol):
    q, k, v = (torch.from_numpy(_rand(rng, 1, 6, 4, 32)).to(dtype) for _ in range(3))
    got = portakern.attention(q, k, v, causal=True, backend=torch_eager)
    want = portakern.attention(q, k, v, causal=True, backend="cpu")
    assert got.dtype == dtype
    np.testing.assert_allclose(got.float().numpy(), want.float().numpy(), atol=tol)


@pytest.mark.parametrize("make", ["native4", "native8_symmetric", "gguf_q4_0"])
def test_quant_gemv_matches_the_cpu_reference(torch_eager, fresh_registry, rng, make, torch_device):
    w = _rand(rng, 32, 128)
    if make == "gguf_q4_0":
        from gguf import GGMLQuantizationType, quants

        qw = portakern.QuantizedWeight.from_gguf(quants.quantize(w, GGMLQuantizationType.Q4_0), "Q4_0", (32, 128))
    else:
        qw = portakern.quantize(w, bits=4 if make == "native4" else 8, group_size=64,
                                symmetric=make.endswith("symmetric"))
    x = _rand(rng, 3, 128)
    want = portakern.quant_gemv(x, qw, backend="cpu")
    qw = qw.to(torch_device)
    got = portakern.quant_gemv(torch.from_numpy(x).to(torch_device), qw, backend=torch_eager)
    assert isinstance(got, torch.Tensor) and got.shape == (3, 32) and got.device.type == torch_device
    np.testing.assert_allclose(got.cpu().numpy(), want, rtol=1e-3, atol=2e-3)
    assert [k for k in qw.prepared if k[0] == torch_eager] == [(torch_eager, str(qw.device))]  # dequantized once


@pytest.mark.parametrize("script", ["attention_quickstart.py", "quantized_decode.py"])
def test_example_scripts_run(script):
    r = subprocess.run([sys.executable, str(ROOT / "examples" / script)], capture_output=True, text=True,
                       timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "chosen" in r.stdout


def test_it_passes_conformance(torch_eager, tmp_path):
    """What a plugin author runs in their CI: ``portakern conformance --backend theirs``."""
    cases = "*paged*,*varlen*,*softcap*,*alibi*,*causal*,gemv-awq-*,gemv-gptq-*,gemv-q4_0*,gemv-q8_0*"
    r = subprocess.run([sys.executable, "-m", "portakern", "conformance", "--backend", torch_eager, "--no-progress",
                        "--cases", cases, "--report", str(tmp_path / "r.json")],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "torch-eager" in r.stdout


def test_the_example_declares_its_refusals_on_the_backend_base(monkeypatch):
    # the example is written on portakern.Backend: status from `requires`, the device refusal from `device_refusal`,
    # the dtype rule in its `check` hook, the score-block limit in attention.supports
    from portakern.devices import Device
    from portakern.ir import DType
    from portakern.ir.ops import Attention

    (be,) = [b for b in portakern.list_backends() if b.name == "torch-eager"]
    cpu = Device("cpu", 0, arch="x86_64", name="cpu")

    def attn(Sq=4, Sk=4, H=2, dtype=DType.float32):
        return Attention(batch=1, seqlen_q=Sq, seqlen_k=Sk, heads_q=H, heads_kv=H, head_dim=8, head_dim_v=8,
                         dtype=dtype, scale=1.0)

    assert be.supports(attn(), cpu).ok
    assert be.supports(attn(), Device("opencl", 0, name="pocl")).reason == (
        "torch-eager runs on cpu and cuda torch devices, not on opencl; pass backend=None to let portakern pick a "
        "backend for opencl:0")
    big = be.supports(attn(Sq=65536, Sk=65536, H=32), cpu).reason
    assert "score block per batch entry, 512.0 GiB > 4 GiB" in big and "backend=None" in big
    monkeypatch.setattr(type(be), "requires", ("torch", "no_such_module_pk"))
    assert be.status().startswith("unavailable: ModuleNotFoundError") and be.status().endswith("(pip install torch)")
