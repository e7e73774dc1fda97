"""Plugin fault injection: a plugin that calls ``sys.exit()`` or raises any ``BaseException`` but
``KeyboardInterrupt`` -- at import, or in its ``portakern_register_backends`` hook -- is reported as a plugin
error (``portakern.plugin_errors()``, ``portakern info``) and skipped; the host process and the other backends
keep working. A ``KeyboardInterrupt`` still stops the process.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

import portakern
from portakern import cli, hookimpl


class PluginBaseError(BaseException):
    """A BaseException subclass that is no Exception (what some frameworks raise to unwind)."""


def _tiny():
    q = np.ones((1, 2, 1, 8), np.float32)
    return q, q, q


# each failure kind, as the source of a module that fails at import
AT_IMPORT = {
    "exit-no-code": ("import sys\nsys.exit()\n", "SystemExit: the plugin called sys.exit(None)"),
    "exit-code-3": ("import sys\nsys.exit(3)\n", "SystemExit: the plugin called sys.exit(3)"),
    "exit-message": ("raise SystemExit('no GPU here, bye')\n", "SystemExit: the plugin called sys.exit('no GPU here, bye')"),
    "generator-exit": ("raise GeneratorExit('odd unwind')\n", "GeneratorExit: odd unwind"),
    "base-subclass": ("class Unwind(BaseException):\n    pass\nraise Unwind('framework unwind')\n",
                      "Unwind: framework unwind"),
}


@pytest.fixture
def env_plugin(tmp_path, fresh_registry, monkeypatch):
    """``env_plugin(source)`` installs a PORTAKERN_PLUGINS module with ``source``; returns its name."""
    made = []

    def install(source: str, name: str = "pk_fault_plugin") -> str:
        (tmp_path / f"{name}.py").write_text(source)
        monkeypatch.syspath_prepend(str(tmp_path))
        monkeypatch.setenv("PORTAKERN_PLUGINS", name)
        made.append(name)
        fresh_registry.reset()
        return name

    yield install
    for name in made:
        sys.modules.pop(name, None)


@pytest.mark.parametrize("kind", sorted(AT_IMPORT))
def test_plugin_that_exits_or_raises_a_base_exception_at_import_is_reported(env_plugin, kind):
    source, text = AT_IMPORT[kind]
    name = env_plugin(source)
    errors = dict(portakern.plugin_errors())        # must not raise SystemExit / BaseException
    assert errors[name] == f'Error importing plugin "{name}": {text}'
    assert name not in portakern.plugins.registry().plugins
    assert np.allclose(portakern.attention(*_tiny()), 1.0)  # cpu still serves


def test_plugin_that_exits_at_import_is_shown_by_portakern_info(env_plugin, capsys):
    name = env_plugin("import sys\nsys.exit(3)\n")
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "plugin errors" in out and f'Error importing plugin "{name}": SystemExit' in out and "cpu" in out
    assert cli.main(["info", "--json"]) == 0
    errors = json.loads(capsys.readouterr().out)["plugin_errors"]
    assert errors == [{"plugin": name, "error": f'Error importing plugin "{name}": SystemExit: the plugin '
                                                 f'called sys.exit(3)'}]


def test_entry_point_plugin_that_exits_at_import_is_reported(tmp_path, fresh_registry, monkeypatch):
    info = tmp_path / "pkexit-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: pkexit\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[portakern.backends]\nfake-exit = pk_fake_exit\n")
    (tmp_path / "pk_fake_exit.py").write_text("import sys\nsys.exit('plugin gave up')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        fresh_registry.reset()
        errors = dict(portakern.plugin_errors())
        assert errors["fake-exit"] == ('Error importing plugin "fake-exit" (pk_fake_exit): SystemExit: the plugin '
                                       "called sys.exit('plugin gave up')")
        assert "cpu" in fresh_registry.registry().backends
    finally:
        sys.modules.pop("pk_fake_exit", None)


@pytest.mark.parametrize("exc, text", [
    (SystemExit(4), "SystemExit: the plugin called sys.exit(4)"),
    (PluginBaseError("unwound in the hook"), "PluginBaseError: unwound in the hook"),
])
def test_hook_that_exits_or_raises_a_base_exception_is_reported(register_plugin, exc, text):
    class Quitter:
        @hookimpl
        def portakern_register_backends(self):
            raise exc

    reg = register_plugin(Quitter(), name="quitter")
    assert ("quitter", f"Error in plugin 'quitter' portakern_register_backends: {text}") in reg.errors
    assert "cpu" in reg.backends
    assert np.allclose(portakern.attention(*_tiny()), 1.0)


def test_keyboard_interrupt_at_import_still_propagates(env_plugin):
    with pytest.raises(KeyboardInterrupt, match="ctrl-c while loading"):
        env_plugin("raise KeyboardInterrupt('ctrl-c while loading')\n")
        portakern.plugin_errors()


def test_keyboard_interrupt_in_the_hook_still_propagates(register_plugin):
    class Interrupted:
        @hookimpl
        def portakern_register_backends(self):
            raise KeyboardInterrupt("ctrl-c in the hook")

    with pytest.raises(KeyboardInterrupt, match="ctrl-c in the hook"):
        register_plugin(Interrupted(), name="interrupted")
