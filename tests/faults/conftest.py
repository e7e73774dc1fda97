"""Fixtures of the fault-injection suite (tests/faults); the fixtures of tests/conftest.py (``cache_dir``,
``fresh_registry``, ``register_plugin``, ...) apply here too."""

from __future__ import annotations

import subprocess

import pytest

from fault_helpers import spawn


def pytest_configure(config):
    config.addinivalue_line("markers", "subprocess: starts child Python processes (seconds, not milliseconds)")


@pytest.fixture
def python_child():
    """``python_child(code, **env)`` starts a child (see ``fault_helpers.spawn``); every child still running at the
    end is killed."""
    started: list[subprocess.Popen] = []

    def start(code: str, **env: str) -> subprocess.Popen:
        p = spawn(code, **env)
        started.append(p)
        return p

    yield start
    for p in started:
        if p.poll() is None:
            p.kill()
        p.communicate()
