"""Helpers of the fault-injection suite (tests/faults): child Python processes that run portakern code."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment without portakern's steering variables, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PORTAKERN_")}
    env.update(extra)
    return env


def spawn(code: str, **env: str) -> subprocess.Popen:
    """Start ``python -c code`` in the repository root with ``child_env(**env)``; stdout and stderr piped."""
    return subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=child_env(**env), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
