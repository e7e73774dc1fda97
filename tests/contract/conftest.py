"""The contract suite's placements as fixtures: ``target`` (each backend on each device it declares, with the array
library its kernels take), ``target_lib`` (with every library on that device), and ``dtype`` alongside either (each
float dtype the placement's library holds)."""

from __future__ import annotations

import pytest

from contract_targets import DTYPES, TARGETS, TARGETS_EVERY_LIBRARY, Target, backend_device_types


def pytest_generate_tests(metafunc):
    for name, targets in (("target", TARGETS), ("target_lib", TARGETS_EVERY_LIBRARY)):
        if name not in metafunc.fixturenames:
            continue
        if "dtype" in metafunc.fixturenames:
            combos = [(t, d) for t in targets for d in (DTYPES.get(t.lib) or ("float32",))]
            metafunc.parametrize(f"{name}, dtype", combos, ids=[f"{t.id}-{d}" for t, d in combos], indirect=[name])
        else:
            metafunc.parametrize(name, targets, ids=[t.id for t in targets], indirect=True)


def _placed(request) -> Target:
    t: Target = request.param
    if t.device is None:
        types = ", ".join(backend_device_types(t.backend))
        pytest.skip(f"backend {t.backend!r} runs on {types}: no such device on this machine")
    return t


@pytest.fixture
def target(request) -> Target:
    """One backend on one present device of a type it declares, with the array library its kernels take."""
    return _placed(request)


@pytest.fixture
def target_lib(request) -> Target:
    """One backend on one present device of a type it declares, with one array library living on that device."""
    return _placed(request)
