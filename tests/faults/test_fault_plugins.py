"""Broken plugins, one per failure kind, and backends that fail to compile or launch.

At registration: a plugin that fails to import (ImportError, any Exception), calls ``sys.exit()``, raises a
``BaseException`` subclass, whose ``portakern_register_backends`` raises, or returns something other than a list of
backends (an int, a str, one backend, a dict, a generator, items that are no backend, a backend whose name is no
str, whose capability attributes have the wrong type or whose version raises) is reported by ``portakern info``
(text and ``--json``) and skipped; the other backends keep serving. All of
them at once leave the same registry as none of them.

At dispatch: ``supports()`` raising is a rejection naming the exception; ``compile`` or the kernel raising falls
back to the next candidate with one ``FallbackWarning`` and ``explain()`` says so; strict mode
(``PORTAKERN_STRICT=1``) and a forced backend (``use_backend``, ``backend=``) raise at once, naming the backend and
the cause, and nothing else compiles. Sixteen threads on one cold signature compile once.
"""

from __future__ import annotations

import json
import sys
import threading
import time
import warnings

import numpy as np
import pytest

import portakern
from portakern import Backend, FallbackWarning, cli, hookimpl
from portakern.backend import YES
from portakern.backends.cpu.backend import CpuBackend
from portakern.errors import BackendError, StrictModeError
from plugin_helpers import provides


class Unwind(BaseException):
    """A BaseException that is no Exception (what some frameworks raise to unwind)."""


# -- registration faults --------------------------------------------------------------------------------------------

#: failure kind -> (source of a PORTAKERN_PLUGINS module that fails at import, text its error must hold)
AT_IMPORT = {
    "import-error": ("import portakern_no_such_dependency\n", "ModuleNotFoundError: No module named "
                                                             "'portakern_no_such_dependency'"),
    "runtime-error": ("raise RuntimeError('CUDA driver too old')\n", "RuntimeError: CUDA driver too old"),
    "syntax-error": ("def broken(:\n", "SyntaxError"),
    "system-exit": ("import sys\nsys.exit(2)\n", "SystemExit: the plugin called sys.exit(2)"),
    "base-exception": ("class Unwind(BaseException):\n    pass\nraise Unwind('unwound')\n", "Unwind: unwound"),
}


def _hook(result):
    """A plugin whose register hook returns ``result()``."""

    class Plugin:
        @hookimpl
        def portakern_register_backends(self):
            return result()

    return Plugin()


class ListNamed(CpuBackend):
    name = ["cpu2"]


def _twin(name: str, **attrs):
    """The cpu backend under ``name`` with capability attributes replaced by ``attrs``."""
    return type("Twin", (CpuBackend,), {"name": name, **attrs})()


class VersionRaises(CpuBackend):
    name = "version-raises"

    @property
    def version(self):
        raise RuntimeError("package metadata missing")


def _raising(exc):
    def result():
        raise exc
    return result


def _generator():
    yield CpuBackend()


#: failure kind -> (plugin object, text its error must hold)
IN_HOOK = {
    "hook-raises": (lambda: _hook(_raising(ValueError("no device found"))),
                    "portakern_register_backends: ValueError: no device found"),
    "hook-exits": (lambda: _hook(_raising(SystemExit(5))), "SystemExit: the plugin called sys.exit(5)"),
    "hook-base-exception": (lambda: _hook(_raising(Unwind("hook unwound"))), "Unwind: hook unwound"),
    "returns-int": (lambda: _hook(lambda: 42), "returned 42 (int); return a list of portakern.Backend instances"),
    "returns-str": (lambda: _hook(lambda: "cpu"), "returned 'cpu' (str); return a list of portakern.Backend"),
    "returns-one-backend": (lambda: _hook(CpuBackend), "(CpuBackend); return a list of portakern.Backend"),
    "returns-dict": (lambda: _hook(lambda: {"cpu": CpuBackend()}), "(dict); return a list of portakern.Backend"),
    "returns-generator": (lambda: _hook(_generator), "(generator); return a list of portakern.Backend"),
    "returns-non-backends": (lambda: _hook(lambda: [object()]), "which is not a portakern.Backend; return "
                                                               "instances of a portakern.Backend subclass"),
    "backend-name-not-str": (lambda: _hook(lambda: [ListNamed()]), "has name=['cpu2'] (list); a backend's name "
                                                                  "must be a non-empty str"),
    "device-types-none": (lambda: _hook(lambda: [_twin("dt", device_types=None)]),
                          "backend 'dt' has device_types=None (NoneType); it must be a tuple of device type names"),
    "priority-str": (lambda: _hook(lambda: [_twin("prio", priority="high")]),
                     "backend 'prio' has priority='high' (str); it must be an int"),
    "priority-bool": (lambda: _hook(lambda: [_twin("prio", priority=True)]),
                      "backend 'prio' has priority=True (bool); it must be an int"),
    "compile-targets-int": (lambda: _hook(lambda: [_twin("ct", compile_targets=5)]),
                            "backend 'ct' has compile_targets=5 (int); it must be a tuple of target names"),
    "compile-targets-str": (lambda: _hook(lambda: [_twin("ct", compile_targets="sm_90a")]),
                            "backend 'ct' has compile_targets='sm_90a' (str)"),
    "array-kind-none": (lambda: _hook(lambda: [_twin("ak", array_kind=None)]),
                        "backend 'ak' has array_kind=None (NoneType); it must be a non-empty str"),
    "version-raises": (lambda: _hook(lambda: [VersionRaises()]),
                       "backend 'version-raises' raises RuntimeError when its version is read: package metadata"),
    "duplicate-name": (lambda: _hook(lambda: [CpuBackend()]), "backend name 'cpu' is empty or already taken "
                                                             "(by plugin 'cpu')"),
}


@pytest.fixture
def env_plugins(tmp_path, fresh_registry, monkeypatch):
    """``env_plugins({name: source})`` installs PORTAKERN_PLUGINS modules; they are forgotten after the test."""
    made = []

    def install(sources: dict[str, str]) -> None:
        for name, source in sources.items():
            (tmp_path / f"{name}.py").write_text(source)
            made.append(name)
        monkeypatch.syspath_prepend(str(tmp_path))
        monkeypatch.setenv("PORTAKERN_PLUGINS", ",".join(sources))
        fresh_registry.reset()

    yield install
    for name in made:
        sys.modules.pop(name, None)


def _module(kind: str) -> str:
    return "pk_broken_" + kind.replace("-", "_")


def _info(capsys) -> tuple[dict, str]:
    assert cli.main(["info", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert cli.main(["info"]) == 0
    return data, capsys.readouterr().out


def _tiny():
    q = np.ones((1, 2, 1, 8), np.float32)
    return q, q, q


@pytest.mark.parametrize("kind", sorted(AT_IMPORT))
def test_a_plugin_failing_at_import_is_reported_by_info_and_skipped(env_plugins, capsys, kind):
    source, text = AT_IMPORT[kind]
    env_plugins({_module(kind): source})
    data, text_out = _info(capsys)
    (error,) = [e for e in data["plugin_errors"] if e["plugin"] == _module(kind)]
    assert error["error"].startswith(f'Error importing plugin "{_module(kind)}": ') and text in error["error"]
    assert "cpu" in [b["name"] for b in data["backends"]]
    assert "plugin errors" in text_out and _module(kind) in text_out
    assert np.allclose(portakern.attention(*_tiny()), 1.0)


@pytest.mark.parametrize("kind", sorted(IN_HOOK))
def test_a_plugin_whose_hook_fails_or_returns_garbage_is_reported_by_info_and_skipped(register_plugin, capsys, kind):
    make, text = IN_HOOK[kind]
    reg = register_plugin(make(), name=f"broken-{kind}")
    errors = [e for p, e in reg.errors if p == f"broken-{kind}"]
    assert len(errors) == 1 and text in errors[0], errors
    data, text_out = _info(capsys)
    assert {"plugin": f"broken-{kind}", "error": errors[0]} in data["plugin_errors"]
    assert f"broken-{kind}" in text_out
    assert sorted(b["name"] for b in data["backends"]) == sorted(reg.backends)
    assert np.allclose(portakern.attention(*_tiny()), 1.0)


def test_every_broken_plugin_at_once_leaves_the_same_backends_as_none(env_plugins, fresh_registry, capsys):
    from portakern import plugins

    healthy = sorted(plugins.registry().backends)
    env_plugins({_module(k): s for k, (s, _) in AT_IMPORT.items()})
    for kind, (make, _) in IN_HOOK.items():
        plugins._manual.append((f"broken-{kind}", make()))
    fresh_registry.reset()
    data, _ = _info(capsys)
    assert sorted(b["name"] for b in data["backends"]) == healthy
    assert {e["plugin"] for e in data["plugin_errors"]} == \
        {_module(k) for k in AT_IMPORT} | {f"broken-{k}" for k in IN_HOOK}


# -- dispatch faults: supports, compile, launch ------------------------------------------------------------------

class Flaky(Backend):
    """A numpy backend ahead of cpu; ``fail``: where it raises (``supports``, ``compile``, ``run``), ``exc`` what."""

    array_kind = "numpy"
    device_types = ("cpu",)

    def __init__(self, name="flaky", fail=None, exc=None, priority=500, compile_s=0.0):
        self.name, self.fail, self.priority, self.compile_s = name, fail, priority, compile_s
        self.exc = exc or RuntimeError(f"{name} is broken")
        self.compiles = self.runs = 0
        self._count = threading.Lock()

    def supports(self, op, device):
        if self.fail == "supports":
            raise self.exc
        return YES

    def compile(self, op, device):
        with self._count:
            self.compiles += 1
        time.sleep(self.compile_s)      # a slow compile widens the window concurrent first calls race in
        if self.fail == "compile":
            raise self.exc

        def kernel(*args):
            with self._count:
                self.runs += 1
            if self.fail == "run":
                raise self.exc
            (args[-1] if op.kind == "quant_gemv" else args[3]).fill(7.0)
        return kernel


def _gemv_args():
    w = portakern.quantize(np.linspace(-1, 1, 16 * 64, dtype=np.float32).reshape(16, 64), bits=4, group_size=32)
    return np.ones((1, 64), np.float32), w


def _reference(fn):
    """What the cpu backend gives for ``fn``'s arguments (the candidate after the failed one)."""
    args = _tiny() if fn is portakern.attention else _gemv_args()
    return args, fn(*args, backend="cpu")


OPS = [pytest.param(portakern.attention, id="attention"), pytest.param(portakern.quant_gemv, id="quant_gemv")]


@pytest.mark.parametrize("fn", OPS)
@pytest.mark.parametrize("exc", [RuntimeError("ptxas died"), MemoryError("out of shared memory"),
                                 NotImplementedError("no kernel for this shape"), KeyError("BLOCK_M")],
                         ids=["RuntimeError", "MemoryError", "NotImplementedError", "KeyError"])
@pytest.mark.parametrize("stage", ["compile", "run"])
def test_a_failing_backend_falls_back_to_the_next_with_one_warning(register_plugin, fn, exc, stage):
    bad = Flaky(fail=stage, exc=exc)
    register_plugin(provides(bad), name="flaky")
    args, want = _reference(fn)
    with pytest.warns(FallbackWarning) as caught:
        out = fn(*args)
    msgs = [str(w.message) for w in caught if issubclass(w.category, FallbackWarning)]
    assert len(msgs) == 1 and f"backend 'flaky' failed to {stage} {fn.__name__}: {type(exc).__name__}" in msgs[0]
    assert "PORTAKERN_STRICT=1" in msgs[0]                      # the way to make it an error
    np.testing.assert_array_equal(out, want)                   # the next candidate served, its result returned
    with warnings.catch_warnings():
        warnings.simplefilter("error")                          # later calls neither warn nor retry
        np.testing.assert_array_equal(fn(*args), want)
    assert bad.compiles == 1 and bad.runs == (1 if stage == "run" else 0)


@pytest.mark.parametrize("fn", OPS)
@pytest.mark.parametrize("stage", ["compile", "run"])
def test_explain_after_a_fallback_shows_what_serves_the_signature_and_why(register_plugin, fn, stage):
    """explain() of a signature already planned returns that plan's decision: the backend that serves the calls and
    the fallback, not a fresh decision that names the failed backend as chosen."""
    register_plugin(provides(Flaky(fail=stage, exc=RuntimeError("ptxas died"))), name="flaky")
    args = _tiny() if fn is portakern.attention else _gemv_args()
    with pytest.warns(FallbackWarning):
        fn(*args)
    d = portakern.explain(fn, *args)
    assert d.chosen == "cpu" and d.fallbacks == [("flaky", f"{stage}: RuntimeError: ptxas died")]
    assert f"fell back from flaky: {stage}: RuntimeError: ptxas died" in str(d)
    assert "* cpu" in str(d)


@pytest.mark.parametrize("fn", OPS)
@pytest.mark.parametrize("stage", ["compile", "run"])
def test_strict_mode_raises_at_once_naming_the_backend_and_the_cause(register_plugin, monkeypatch, fn, stage):
    bad, spare = Flaky(fail=stage, exc=RuntimeError("ptxas died")), Flaky(name="spare", priority=400)
    register_plugin(provides(bad, spare), name="flaky")
    monkeypatch.setenv("PORTAKERN_STRICT", "1")
    args = _tiny() if fn is portakern.attention else _gemv_args()
    with warnings.catch_warnings():
        warnings.simplefilter("error")                          # no FallbackWarning either
        with pytest.raises(StrictModeError) as e:
            fn(*args)
    msg = str(e.value)
    assert f"backend 'flaky' failed to {stage} {fn.__name__}" in msg and "RuntimeError: ptxas died" in msg
    assert "PORTAKERN_STRICT=1 forbids falling back" in msg
    assert isinstance(e.value.__cause__, RuntimeError)
    assert spare.compiles == 0 and spare.runs == 0               # nothing else was tried


@pytest.mark.parametrize("force", ["use_backend", "argument", "env"])
@pytest.mark.parametrize("stage", ["compile", "run"])
def test_a_forced_backend_that_fails_raises_naming_it_and_the_cause(register_plugin, monkeypatch, force, stage):
    bad = Flaky(fail=stage, exc=RuntimeError("launch timed out"))
    register_plugin(provides(bad), name="flaky")
    by = {"use_backend": "use_backend()", "argument": "argument", "env": "PORTAKERN_BACKEND"}[force]
    with pytest.raises(BackendError) as e:
        if force == "use_backend":
            with portakern.use_backend("flaky"):
                portakern.attention(*_tiny())
        elif force == "argument":
            portakern.attention(*_tiny(), backend="flaky")
        else:
            monkeypatch.setenv("PORTAKERN_BACKEND", "flaky")
            portakern.attention(*_tiny())
    assert f"backend 'flaky' (forced by {by}) failed to {stage} attention" in str(e.value)
    assert "RuntimeError: launch timed out" in str(e.value)


@pytest.mark.parametrize("exc", [KeyError("sm_90"), AttributeError("no attribute 'arch'"), ValueError("bad")],
                         ids=["KeyError", "AttributeError", "ValueError"])
def test_supports_raising_is_a_rejection_explain_names(register_plugin, exc):
    bad = Flaky(fail="supports", exc=exc)
    register_plugin(provides(bad), name="flaky")
    np.testing.assert_array_equal(portakern.attention(*_tiny()), portakern.attention(*_tiny(), backend="cpu"))
    d = portakern.explain(portakern.attention, *_tiny())
    (c,) = [c for c in d.candidates if c.name == "flaky"]
    assert not c.support.ok and c.support.reason == f"supports() raised {type(exc).__name__}: {exc}"
    assert d.chosen == "cpu" and bad.compiles == 0


# -- concurrent first calls ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("fn", OPS)
@pytest.mark.parametrize("policy", ["priority", "fastest"])
def test_sixteen_threads_on_one_cold_signature_compile_once(register_plugin, cache_dir, fn, policy):
    spy = Flaky(name="spy", compile_s=0.05)
    register_plugin(provides(spy), name="spy")
    args = _tiny() if fn is portakern.attention else _gemv_args()
    barrier, outs, errors = threading.Barrier(16), [], []

    def call():
        barrier.wait()
        try:
            with portakern.use_policy(policy):
                outs.append(fn(*args))
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=call) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    assert spy.compiles == 1, f"{spy.compiles} compiles for one signature"
    assert len(outs) == 16 and all((o == 7.0).all() for o in outs)
