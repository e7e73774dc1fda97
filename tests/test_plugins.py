"""Plugin loading: entry points, PORTAKERN_PLUGINS, broken plugins isolated, autoload switch."""

from __future__ import annotations

import sys
import textwrap
from importlib import metadata

import numpy as np
import pytest

import portakern
from portakern import Backend, hookimpl
from portakern.backend import YES
from portakern.errors import InvalidInputError, PluginError
from plugin_helpers import provides  # noqa: E402


class Named(Backend):
    """A numpy backend whose kernel fills the output with ``fill``."""

    array_kind = "numpy"
    device_types = ("cpu",)

    def __init__(self, name: str, fill: float = 1.0, priority: int = 0):
        self.name, self.fill, self.priority = name, fill, priority

    def supports(self, op, device):
        return YES

    def compile(self, op, device):
        def kernel(q, k, v, out, lse, aux):
            out.fill(self.fill)
        return kernel




def _tiny():
    q = np.ones((1, 2, 1, 8), np.float32)
    return q, q, q


# -- fake installed distributions -------------------------------------------------------------------

def _write_dist(root, dist: str, entry_points: dict[str, str], modules: dict[str, str]) -> None:
    """An installed-looking distribution: ``<dist>-0.1.dist-info`` plus top-level modules."""
    info = root / f"{dist}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    eps = "".join(f"{name} = {target}\n" for name, target in entry_points.items())
    (info / "entry_points.txt").write_text(f"[portakern.backends]\n{eps}")
    for mod, src in modules.items():
        (root / f"{mod}.py").write_text(textwrap.dedent(src))


OK_PLUGIN = """
    import numpy as np
    import portakern
    from portakern.backend import YES

    class FakeOk(portakern.Backend):
        name = "fake-ok"
        array_kind = "numpy"

        def supports(self, op, device):
            return YES

        def compile(self, op, device):
            def kernel(q, k, v, out, lse, aux):
                out.fill(7.0)
            return kernel

    @portakern.hookimpl
    def portakern_register_backends():
        return [FakeOk()]
"""


@pytest.fixture
def fake_dists(tmp_path, fresh_registry, monkeypatch):
    """Two installed plugins: ``fake-ok`` (works) and ``fake-broken`` (raises at import)."""
    _write_dist(tmp_path, "fakeplug", {"fake-ok": "pk_fake_ok", "fake-broken": "pk_fake_broken"},
                {"pk_fake_ok": OK_PLUGIN,
                 "pk_fake_broken": "raise ImportError('pk_fake_broken needs libfoo, which is missing')\n"})
    monkeypatch.syspath_prepend(str(tmp_path))
    yield fresh_registry
    for mod in ("pk_fake_ok", "pk_fake_broken"):
        sys.modules.pop(mod, None)


def test_builtin_cpu_backend_loads_through_the_entry_point(fresh_registry):
    eps = {ep.name: ep for ep in metadata.entry_points(group="portakern.backends")}
    assert eps["cpu"].value == "portakern.backends.cpu"
    assert eps["cpu"].dist.name == "portakern"
    reg = fresh_registry.registry()
    assert reg.plugins["cpu"] == "portakern"
    assert reg.origins["cpu"] == "cpu"
    assert "cpu" in [b.name for b in portakern.list_backends()]


def test_plugin_that_raises_at_import_is_reported_and_skipped(fake_dists):
    reg = fake_dists.registry()
    errors = dict(portakern.plugin_errors())
    assert 'Error importing plugin "fake-broken" (pk_fake_broken)' in errors["fake-broken"]
    assert "ImportError: pk_fake_broken needs libfoo" in errors["fake-broken"]
    assert "fake-broken" not in reg.plugins
    # the other plugins, from the same distribution and built in, keep working
    assert reg.plugins["fake-ok"] == "fakeplug"
    out = portakern.attention(*_tiny(), backend="fake-ok")
    assert (out == 7.0).all()
    out = portakern.attention(*_tiny(), backend="cpu")
    assert np.allclose(out, 1.0)


def test_unknown_backend_error_names_failed_plugins(fake_dists):
    with pytest.raises(InvalidInputError, match="is not registered") as e:
        portakern.attention(*_tiny(), backend="fake-broken")
    assert "fake-ok" in str(e.value) and "plugin 'fake-broken' failed to load" in str(e.value)


def test_autoload_disabled_keeps_builtins_only(fake_dists, monkeypatch):
    monkeypatch.setenv("PORTAKERN_DISABLE_PLUGIN_AUTOLOAD", "1")
    fake_dists.reset()
    reg = fake_dists.registry()
    assert "cpu" in reg.backends
    assert "fake-ok" not in reg.backends
    assert portakern.plugin_errors() == []  # the broken one is not even imported
    assert "pk_fake_broken" not in sys.modules


def test_autoload_disabled_still_loads_portakern_plugins_env(tmp_path, fresh_registry, monkeypatch):
    (tmp_path / "pk_env_plugin.py").write_text(textwrap.dedent(OK_PLUGIN))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PORTAKERN_DISABLE_PLUGIN_AUTOLOAD", "1")
    monkeypatch.setenv("PORTAKERN_PLUGINS", "pk_env_plugin")
    try:
        fresh_registry.reset()
        reg = fresh_registry.registry()
        assert reg.plugins["pk_env_plugin"] == "PORTAKERN_PLUGINS"
        assert "fake-ok" in reg.backends
    finally:
        sys.modules.pop("pk_env_plugin", None)


def test_portakern_plugins_env_module_that_raises(tmp_path, fresh_registry, monkeypatch):
    (tmp_path / "pk_raises_at_import.py").write_text("raise RuntimeError('boom at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PORTAKERN_PLUGINS", "pk_raises_at_import, pk_not_a_module_at_all")
    fresh_registry.reset()
    errors = dict(portakern.plugin_errors())
    assert errors["pk_raises_at_import"] == 'Error importing plugin "pk_raises_at_import": RuntimeError: boom at import'
    assert "ModuleNotFoundError" in errors["pk_not_a_module_at_all"]
    assert np.allclose(portakern.attention(*_tiny()), 1.0)  # cpu still serves


def test_bad_hook_signature_is_a_registration_error(register_plugin):
    class BadSignature:
        @hookimpl
        def portakern_register_backends(self, extra):
            return [Named("never")]

    reg = register_plugin(BadSignature(), name="badsig")
    (name, err), = [(n, e) for n, e in reg.errors if n == "badsig"]
    assert err.startswith("Error registering plugin 'badsig': PluginValidationError")
    assert "extra" in err and "portakern_register_backends" in err
    assert "never" not in reg.backends
    assert np.allclose(portakern.attention(*_tiny()), 1.0)


def test_unknown_hook_name_is_a_registration_error(register_plugin):
    class Typo:
        @hookimpl
        def portakern_register_backend(self):  # missing trailing s
            return [Named("typo")]

    reg = register_plugin(Typo(), name="typo")
    assert any(n == "typo" and "unknown hook 'portakern_register_backend'" in e for n, e in reg.errors)


def test_hook_that_raises_is_reported(register_plugin):
    class Raises:
        @hookimpl
        def portakern_register_backends(self):
            raise RuntimeError("no GPU driver")

    reg = register_plugin(Raises(), name="raiser")
    assert ("raiser", "Error in plugin 'raiser' portakern_register_backends: RuntimeError: no GPU driver") in reg.errors
    assert "cpu" in reg.backends


def test_non_backend_and_duplicate_names_are_reported(register_plugin):
    reg = register_plugin(provides("not a backend", Named("cpu"), Named("dup-ok")), name="sloppy")
    texts = [e for n, e in reg.errors if n == "sloppy"]
    assert any("is not a portakern.Backend" in t for t in texts)
    assert any("backend name 'cpu' is empty or already taken" in t for t in texts)
    assert "plugin 'sloppy': backend name 'cpu' is empty or already taken (by plugin 'cpu'); give the backend " \
           "a unique, non-empty name" in texts
    assert "plugin 'sloppy' returned 'not a backend', which is not a portakern.Backend; return instances of a " \
           "portakern.Backend subclass" in texts
    assert "dup-ok" in reg.backends
    assert reg.origins["cpu"] == "cpu"  # the built-in keeps its name


def test_register_and_unregister_by_hand(register_plugin, fresh_registry):
    reg = register_plugin(provides(Named("by-hand", fill=3.0)), name="hand")
    assert reg.plugins["hand"] == "manual"
    assert (portakern.attention(*_tiny(), backend="by-hand") == 3.0).all()
    fresh_registry.unregister("hand")
    assert "by-hand" not in fresh_registry.registry().backends
    with pytest.raises(PluginError, match="'hand' was not registered by hand"):
        fresh_registry.unregister("hand")


def test_priority_hook_reorders_candidates(register_plugin):
    class PreferLow:
        @hookimpl
        def portakern_backend_priority(self, backend, op, device):
            return 1000 if backend.name == "low" else None

    register_plugin(provides(Named("low", fill=5.0, priority=-50), Named("high", fill=6.0, priority=50)),
                    name="two")
    assert (portakern.attention(*_tiny()) == 6.0).all()
    register_plugin(PreferLow(), name="prefer-low")
    d = portakern.explain(portakern.attention, *_tiny())
    assert d.chosen == "low"
    assert [c.priority for c in d.candidates if c.name == "low"] == [1000]
    assert (portakern.attention(*_tiny()) == 5.0).all()


def test_hookspecs_are_documented():
    from portakern import hookspecs

    for name in ("portakern_register_backends", "portakern_backend_priority", "portakern_conformance_cases"):
        fn = getattr(hookspecs, name)
        assert fn.__doc__ and len(fn.__doc__.split()) > 15, name
