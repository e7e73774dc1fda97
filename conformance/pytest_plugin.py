"""pytest plugin: ``pytest --portakern-backend NAME`` runs the conformance suite as test items.

Registered as the ``pytest11`` entry point ``portakern``, so it loads in every pytest run of an
environment where portakern is installed. Without ``--portakern-backend`` it only adds its
options and does nothing else (no cases, goldens or backends are loaded, nothing is collected).

Options::

    --portakern-backend NAME   backend to check (repeatable); enables the plugin
    --portakern-cases GLOB     only case ids matching GLOB (repeatable / comma-separated)
    --portakern-device DEV     device to run on (default cpu)
    --portakern-tier TIER      cpu (default) or gpu
    --portakern-repeat N       run each case N times; non-bit-identical results fail

One item per (case, backend), named ``<case id>[<backend>]`` under ``portakern-conformance``;
``-k``, ``-x``, ``--junitxml`` and xdist-free parallelism work as with any test. Unsupported cases
are skipped with the backend's reason; fail / error / nondeterministic records fail the item.
"""

from __future__ import annotations

import pytest


def pytest_addoption(parser) -> None:
    group = parser.getgroup("portakern", "portakern conformance suite")
    group.addoption("--portakern-backend", action="append", default=[], metavar="NAME",
                    help="run the portakern conformance suite against backend NAME (repeatable)")
    group.addoption("--portakern-cases", action="append", default=[], metavar="GLOB",
                    help="only conformance cases whose id matches GLOB")
    group.addoption("--portakern-device", default="cpu", metavar="DEV",
                    help="device for the conformance suite: cpu, cuda:0, ... (default cpu)")
    group.addoption("--portakern-tier", default="cpu", choices=("cpu", "gpu"),
                    help="conformance tier: cpu (checked-in goldens) or gpu (default cpu)")
    group.addoption("--portakern-repeat", default=1, type=int, metavar="N",
                    help="run each conformance case N times and require bit-identical results")


def _enabled(config) -> bool:
    return bool(config.getoption("--portakern-backend", default=None))


def pytest_configure(config) -> None:
    if _enabled(config):
        config.addinivalue_line("markers", "portakern_conformance: a portakern conformance case")


class ConformanceFailure(Exception):
    """A conformance record that did not pass (its reason is the failure text)."""


class ConformanceCollector(pytest.Collector):
    """Holds one item per (case, backend); created by the plugin, not from a file."""

    def collect(self):  # pragma: no cover - items are created directly
        return []


class ConformanceItem(pytest.Item):
    def __init__(self, *, case, backend, state, **kw):
        super().__init__(**kw)
        self.case = case
        self.backend = backend
        self.state = state
        self.add_marker("portakern_conformance")

    def runtest(self) -> None:
        from .execute import run_case
        from .generate import hash_arrays
        from .goldens import golden_for

        st = self.state
        inputs = self.case.inputs()

        def golden():
            g = golden_for(self.case, st["store"])
            if g.input_sha256 != hash_arrays(inputs):
                raise RuntimeError("the generated inputs differ from the golden's input_sha256")
            return g

        rec = run_case(self.case, inputs, golden, self.backend, st["device"], st["repeat"])
        self.user_properties.append(("status", rec.status))
        if rec.max_abs_err is not None:
            self.user_properties.append(("max_abs_err", rec.max_abs_err))
            self.user_properties.append(("tolerance", rec.tolerance))
        if rec.status == "unsupported":
            pytest.skip(f"unsupported: {rec.reason}")
        if rec.status != "pass":
            raise ConformanceFailure(f"{rec.status}: {self.case.id} on {self.backend.name} "
                                     f"@ {rec.device}: {rec.reason}")

    def repr_failure(self, excinfo, style=None):
        if excinfo.errisinstance(ConformanceFailure):
            return str(excinfo.value)
        return super().repr_failure(excinfo, style)

    def reportinfo(self):
        return self.path, None, f"portakern conformance {self.case.id} [{self.backend.name}]"


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(session, config, items) -> None:
    """Append the conformance items first, so -k / -m deselection applies to them as well."""
    if not _enabled(config):
        return
    from portakern.devices import parse_device

    from .goldens import Store
    from .runner import collect_cases, resolve_backends

    backends = resolve_backends(config.getoption("--portakern-backend"))
    cases = collect_cases(config.getoption("--portakern-tier"), config.getoption("--portakern-cases") or None)
    state = {"store": Store(), "device": parse_device(config.getoption("--portakern-device")),
             "repeat": config.getoption("--portakern-repeat")}
    parent = ConformanceCollector.from_parent(session, name="portakern-conformance")
    for case in cases:
        for b in backends:
            items.append(ConformanceItem.from_parent(parent, name=f"{case.id}[{b.name}]", case=case,
                                                     backend=b, state=state))
