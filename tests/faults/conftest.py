"""Fixtures of the fault-injection suite (tests/faults): child Python processes that run portakern code.

The fixtures of tests/conftest.py (``cache_dir``, ``fresh_registry``, ``register_plugin``, ...) apply here too.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def pytest_configure(config):
    config.addinivalue_line("markers", "subprocess: starts child Python processes (seconds, not milliseconds)")


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment without portakern's steering variables, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PORTAKERN_")}
    env.update(extra)
    return env


def spawn(code: str, **env: str) -> subprocess.Popen:
    """Start ``python -c code`` in the repository root with ``child_env(**env)``; stdout and stderr piped."""
    return subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=child_env(**env), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


@pytest.fixture
def python_child():
    """``python_child(code, **env)`` starts a child (see ``spawn``); every child still running at the end is
    killed."""
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
