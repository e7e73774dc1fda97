"""The backend base (``portakern.backend.Backend``): the shared status / supports / compile / prepare_weight preamble
that a backend declares as data (``requires``, ``install_hint``, ``lowerings``, ``min_capability``,
``device_refusal``, ``launches_on_current_device``) plus the ``runtime_status`` and ``check`` hooks, and
``source_fingerprint``. A throw-away backend package is written to ``tmp_path`` for each test."""

from __future__ import annotations

import importlib
import sys
import textwrap

import numpy as np
import pytest

import portakern
from portakern.backend import YES, Backend, Support, no
from portakern.devices import Device
from portakern.ir import DType
from portakern.ir.ops import Attention

CPU = Device("cpu", 0, arch="x86_64", name="cpu")
CUDA_OLD = Device("cuda", 0, arch="sm_75", name="T4", capability=(7, 5), warp_size=32)
CUDA_NEW = Device("cuda", 0, arch="sm_90a", name="H200", capability=(9, 0), warp_size=32)
OP = Attention(batch=1, seqlen_q=1, seqlen_k=8, heads_q=1, heads_kv=1, head_dim=8, head_dim_v=8,
               dtype=DType.float16, scale=1.0)

BACKEND = '''
from portakern.backend import YES, Backend, no

class Demo(Backend):
    name = "demo"
    device_types = ("cpu", "cuda")
    lowerings = {"attention": "lower_attention", "quant_gemv": "lower_gemv"}
'''
ATTENTION = '''
from portakern.backend import YES, no
calls = []

def supports(op, device):
    return no("head_dim=8 is too small for demo") if op.head_dim < 16 else YES

def compile(op, device):
    calls.append(("compile", op.kind, str(device)))
    return lambda *a: None
'''
GEMV = '''
def compile(op, device):
    return "gemv kernel"

def prepare_weight(weight, device):
    return ("prepared", weight, str(device))
'''


@pytest.fixture
def pkg(tmp_path, monkeypatch):
    """A backend package ``demo_pk_<n>`` with ``backend.py`` and two lowering modules; returns the package name."""
    name = f"demo_pk_{abs(hash(str(tmp_path))) % 10**8}"
    root = tmp_path / name
    root.mkdir()
    (root / "__init__.py").write_text("")
    (root / "backend.py").write_text(textwrap.dedent(BACKEND))
    (root / "lower_attention.py").write_text(textwrap.dedent(ATTENTION))
    (root / "lower_gemv.py").write_text(textwrap.dedent(GEMV))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    for m in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
        del sys.modules[m]


def demo(pkg, **attrs):
    cls = importlib.import_module(f"{pkg}.backend").Demo
    return type("Demo", (cls,), attrs)() if attrs else cls()


def test_status_imports_requires_and_names_the_install_hint(pkg):
    assert demo(pkg).status() == "ok"
    b = demo(pkg, requires=("numpy", "no_such_module_pk"), install_hint="pip install 'demo[gpu]'")
    st = b.status()
    assert st.startswith("unavailable: ModuleNotFoundError: ") and "no_such_module_pk" in st
    assert st.endswith("(pip install 'demo[gpu]')")
    assert b.supports(OP, CPU) == no(st)                     # the status is the first refusal
    ok = demo(pkg, runtime_status=lambda self: "unavailable: no driver")
    assert ok.supports(OP, CPU).reason == "unavailable: no driver"
    noted = demo(pkg, runtime_status=lambda self: "ok (interpreter)")
    assert noted.supports(OP, CPU).reason == "head_dim=8 is too small for demo"   # "ok (...)" is available


def test_supports_runs_the_shared_checks_in_order_then_asks_the_lowering(pkg):
    b = demo(pkg)
    opencl = Device("opencl", 0, name="pocl")
    assert b.supports(OP, opencl).reason == ("the demo backend runs on cpu and cuda devices, not on opencl:0; pass "
                                             "arrays on one of those, or backend=None to let portakern pick")
    custom = demo(pkg, device_refusal="demo: {name} wants {types}, got {type} ({device})")
    assert custom.supports(OP, opencl).reason == "demo: demo wants cpu and cuda, got opencl (opencl:0)"
    floor = demo(pkg, min_capability=(8, 0))
    assert floor.supports(OP, CUDA_OLD).reason == "the demo backend's kernels need sm_80 or newer; cuda:0 is sm_75"
    assert floor.supports(OP, CUDA_NEW).reason == "head_dim=8 is too small for demo"   # the floor passed
    checked = demo(pkg, min_capability=(8, 0), check=lambda self, op, device: no("check says no"))
    assert checked.supports(OP, CUDA_OLD).reason.startswith("the demo backend's kernels need sm_80")
    assert checked.supports(OP, CUDA_NEW).reason == "check says no"
    assert b.supports(OP, CPU).reason == "head_dim=8 is too small for demo"       # the module's own answer
    wide = Attention(batch=1, seqlen_q=1, seqlen_k=8, heads_q=1, heads_kv=1, head_dim=32, head_dim_v=32,
                     dtype=DType.float16, scale=1.0)
    assert b.supports(wide, CPU) is YES


def test_a_kind_without_lowering_and_a_module_without_supports(pkg):
    b = demo(pkg)

    class Other:
        kind = "layernorm"

    assert b.supports(Other(), CPU).reason == "op 'layernorm' has no demo lowering"
    gemv = portakern.ir.QuantGemv(M=1, N=16, K=64, dtype=DType.float32,
                                  fmt=portakern.ir.QuantFormat(bits=4, group_size=32, symmetric=True))
    assert b.supports(gemv, CPU) is YES                      # lower_gemv defines no supports: every op of its kind
    with pytest.raises(NotImplementedError, match=r"no lowering for op 'layernorm' \(its lowerings: attention, "
                                                  r"quant_gemv\)"):
        b.compile(Other(), CPU)


def test_compile_calls_the_lowering_and_wraps_current_device_launches(pkg, monkeypatch):
    b = demo(pkg)
    b.compile(OP, CPU)
    assert importlib.import_module(f"{pkg}.lower_attention").calls == [("compile", "attention", "cpu")]
    from portakern import placement

    placed = []
    monkeypatch.setattr(placement, "on_device", lambda kernel, device: placed.append(device) or ("placed", kernel))
    kernel = demo(pkg).compile(OP, CUDA_NEW)
    assert callable(kernel) and placed == []                 # not declared: the kernel as the module built it
    wrapped = demo(pkg, launches_on_current_device=True).compile(OP, CUDA_NEW)
    assert wrapped[0] == "placed" and placed == [CUDA_NEW]


def test_compile_for_target_needs_the_modules_function(pkg):
    b = demo(pkg)
    with pytest.raises(NotImplementedError, match=rf"cannot compile attention without a device: "
                                                  rf"{pkg}.lower_attention defines no compile_for_target"):
        b.compile_for_target(OP, "sm_90a")
    mod = importlib.import_module(f"{pkg}.lower_attention")
    mod.compile_for_target = lambda op, target: f"artifact for {target}"
    assert b.compile_for_target(OP, "sm_90a") == "artifact for sm_90a"


def test_prepare_weight_from_the_gemv_module_else_the_conversion(pkg):
    w = portakern.quantize(np.ones((16, 64), np.float32), bits=4, group_size=32)
    assert demo(pkg).prepare_weight(w, CPU) == ("prepared", w, "cpu")
    plain = demo(pkg, lowerings={"attention": "lower_attention"})
    prepared = plain.prepare_weight(w, CPU)                   # no gemv module: tensors converted to numpy
    assert prepared is not w and set(prepared.tensors) == set(w.tensors)
    assert all(isinstance(t, np.ndarray) for t in prepared.tensors.values())


def test_lowerings_resolve_in_the_package_of_the_class_that_declares_them(pkg):
    # a subclass defined here (tests/, no package) still finds the demo package's modules
    sub = demo(pkg, name="demo-sub")
    assert sub.lowering(OP).__name__ == f"{pkg}.lower_attention"

    class Loose(Backend):
        name = "loose"
        lowerings = {"attention": "attention"}

    Loose.__module__ = "loose_module_pk"
    sys.modules["loose_module_pk"] = type(sys)("loose_module_pk")
    try:
        with pytest.raises(TypeError, match="Loose.lowerings names modules relative to its package, but "
                                            "'loose_module_pk' is not inside a package"):
            Loose().lowering(OP)
    finally:
        del sys.modules["loose_module_pk"]


def test_source_fingerprint_follows_the_packages_files(pkg, tmp_path):
    b = demo(pkg)
    first = b.source_fingerprint()
    assert len(first) == 64 and b.source_fingerprint() == first
    cache = tmp_path / pkg / "__pycache__"
    cache.mkdir(exist_ok=True)
    (cache / "junk.cpython-311.pyc").write_bytes(b"byte code")
    assert b.source_fingerprint() == first                   # byte code is not source
    (tmp_path / pkg / "lower_gemv.py").write_text(textwrap.dedent(GEMV) + "\n# changed\n")
    assert b.source_fingerprint() != first
    (tmp_path / pkg / "kernels").mkdir()
    second = b.source_fingerprint()
    (tmp_path / pkg / "kernels" / "k.cl").write_text("kernel void k() {}")
    assert b.source_fingerprint() != second                  # kernel sources count too


def test_every_registered_backend_declares_lowerings_that_import():
    # the built-ins are written on the base: each declared lowering module imports and builds kernels
    for b in portakern.list_backends():
        if not b.status().startswith("ok") or not b.lowerings:
            continue
        for kind, module in b.lowerings.items():
            class Op:
                pass

            Op.kind = kind
            mod = b.lowering(Op())
            assert mod.__name__.endswith("." + module) and callable(mod.compile), (b.name, kind)


def test_a_plain_subclass_that_overrides_supports_and_compile_needs_nothing_declared():
    class Manual(Backend):
        name = "manual"

        def supports(self, op, device) -> Support:
            return YES

        def compile(self, op, device):
            return "kernel"

    m = Manual()
    assert m.status() == "ok" and m.supports(OP, CPU) is YES and m.compile(OP, CPU) == "kernel"
