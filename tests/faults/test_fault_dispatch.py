"""Dispatch faults: a backend whose supports() or
compile raises SystemExit (or another BaseException but KeyboardInterrupt) is rejected / falls back instead of ending
the host, and a plugin whose portakern_backend_priority hook raises is skipped with one warning instead of failing
every call."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import portakern
from portakern import FallbackWarning, hookimpl
from portakern.backends.cpu.backend import CpuBackend
from plugin_helpers import provides


class Unwind(BaseException):
    pass


def _q():
    q = np.ones((1, 2, 1, 8), np.float32)
    return q, q, q


@pytest.mark.parametrize("exc", [SystemExit(3), Unwind("unwound")], ids=["SystemExit", "BaseException"])
def test_supports_raising_a_base_exception_is_a_rejection(register_plugin, exc):
    class Sup(CpuBackend):
        name, priority = "sup", 1000

        def supports(self, op, device):
            raise exc

    register_plugin(provides(Sup()), name="sup")
    assert np.allclose(portakern.attention(*_q()), 1.0)
    d = portakern.explain(portakern.attention, *_q())
    (c,) = [c for c in d.candidates if c.name == "sup"]
    assert not c.support.ok and c.support.reason.startswith(f"supports() raised {type(exc).__name__}")


@pytest.mark.parametrize("exc", [SystemExit(3), Unwind("unwound")], ids=["SystemExit", "BaseException"])
def test_compile_raising_a_base_exception_falls_back(register_plugin, exc):
    class Comp(CpuBackend):
        name, priority = "comp", 1000

        def compile(self, op, device):
            raise exc

    register_plugin(provides(Comp()), name="comp")
    with pytest.warns(FallbackWarning, match=f"backend 'comp' failed to compile attention: {type(exc).__name__}"):
        assert np.allclose(portakern.attention(*_q()), 1.0)


def test_keyboard_interrupt_in_supports_still_stops(register_plugin):
    class Sup(CpuBackend):
        name, priority = "sup", 1000

        def supports(self, op, device):
            raise KeyboardInterrupt

    register_plugin(provides(Sup()), name="sup")
    with pytest.raises(KeyboardInterrupt):
        portakern.attention(*_q())


def test_a_priority_hook_that_raises_is_skipped_with_one_warning(register_plugin):
    class Prio:
        @hookimpl
        def portakern_backend_priority(self, backend, op, device):
            raise RuntimeError("priority table missing")

    want = portakern.attention(*_q(), backend="cpu")
    register_plugin(Prio(), name="prio")
    with pytest.warns(RuntimeWarning, match="plugin 'prio'.*RuntimeError: priority table missing"):
        np.testing.assert_array_equal(portakern.attention(*_q()), want)
    assert portakern.explain(portakern.attention, *_q()).chosen == "cpu"    # the other plugins' answers kept
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        portakern.attention(*_q(), causal=True)      # a new signature: no second warning


@pytest.mark.parametrize("exc", [SystemExit(3), Unwind("unwound")], ids=["SystemExit", "BaseException"])
def test_a_status_raising_a_base_exception_is_reported_by_info(register_plugin, capsys, exc):
    import json

    from portakern import cli

    class Stat(CpuBackend):
        name = "stat"

        def status(self):
            raise exc

    register_plugin(provides(Stat()), name="stat")
    assert cli.main(["info", "--json"]) == 0
    (row,) = [b for b in json.loads(capsys.readouterr().out)["backends"] if b["name"] == "stat"]
    assert row["status"].startswith(f"status() raised {type(exc).__name__}")
