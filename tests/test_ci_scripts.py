"""The CI scripts, run in a sandbox beside stub tools: scripts/main.sh runs the conformance suite once per device on
its tier (ROCm and OpenCL devices included), scripts/test.sh runs its conformance steps with progress and its two
pytest steps (the suite without the interpreter tier, then the interpreter tier under TRITON_INTERPRET=1), each
failing on pytest's "no tests ran"."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


# -- scripts/main.sh ----------------------------------------------------------------------------------

FAKE_PORTAKERN = """
class _D:
    def __init__(self, type, index, info=()):
        self.type, self.index, self.info = type, index, info

    def __str__(self):
        return self.type if self.type == "cpu" else f"{self.type}:{self.index}"


def devices():
    {body}
"""


def _main_sh_sandbox(tmp_path, devices_body: str):
    """Run a copy of scripts/main.sh beside a no-op setup.sh and a stub .venv: its ``python`` is this
    interpreter importing a fake ``portakern`` whose ``devices()`` runs ``devices_body``, and its
    ``portakern`` logs its arguments. Returns the completed process and the conformance calls."""
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "main.sh").write_text((repo / "scripts" / "main.sh").read_text())
    (tmp_path / "scripts" / "setup.sh").write_text("true\n")
    (tmp_path / "fake" / "portakern").mkdir(parents=True)
    (tmp_path / "fake" / "portakern" / "__init__.py").write_text(FAKE_PORTAKERN.replace("{body}", devices_body))
    bin_ = tmp_path / ".venv" / "bin"
    bin_.mkdir(parents=True)
    (bin_ / "python").write_text(f'#!/usr/bin/env bash\nPYTHONPATH={tmp_path}/fake exec {sys.executable} "$@"\n')
    (bin_ / "portakern").write_text(f'#!/usr/bin/env bash\necho "$*" >> {tmp_path}/calls\n')
    for f in bin_.iterdir():
        f.chmod(0o755)
    r = subprocess.run(["bash", str(tmp_path / "scripts" / "main.sh")], capture_output=True, text=True, timeout=60)
    calls = (tmp_path / "calls").read_text().splitlines() if (tmp_path / "calls").exists() else []
    return r, [c for c in calls if c.startswith("conformance")]


def test_main_sh_runs_the_suite_on_rocm_devices_too(tmp_path):
    r, runs = _main_sh_sandbox(tmp_path, "return [_D('cpu', 0), _D('rocm', 0), _D('opencl', 0)]")
    assert r.returncode == 0, r.stderr
    assert any("--device rocm:0 --tier gpu" in c for c in runs), runs
    assert any("--device cpu --tier cpu" in c for c in runs), runs
    assert any("--device opencl:0 --tier gpu" in c for c in runs), runs   # an OpenCL device of unknown type


def test_main_sh_runs_the_cpu_tier_on_opencl_cpu_devices(tmp_path):
    r, runs = _main_sh_sandbox(tmp_path, "return [_D('cpu', 0), _D('opencl', 0, (('device_type', 'cpu'),)), "
                                         "_D('opencl', 1, (('device_type', 'gpu'),))]")
    assert r.returncode == 0, r.stderr
    assert any("--device opencl:0 --tier cpu" in c for c in runs), runs   # PoCL: the CPU's tier
    assert any("--device opencl:1 --tier gpu" in c for c in runs), runs
    assert len(runs) == 3, runs


def test_main_sh_fails_when_the_devices_cannot_be_listed(tmp_path):
    r, runs = _main_sh_sandbox(tmp_path, "raise RuntimeError('the driver is broken')")
    assert r.returncode != 0 and runs == []
    assert "listing the devices failed" in r.stderr


def test_main_sh_runs_each_gpu_once_on_the_gpu_tier_with_workers(tmp_path):
    # the gpu tier holds every cpu-tier case, so a cpu-tier run before it repeated 439 cases per backend;
    # and a serial run compiles some 300 kernels one after another (--jobs 0: one worker per core)
    r, runs = _main_sh_sandbox(tmp_path, "return [_D('cpu', 0), _D('cuda', 0)]")
    assert r.returncode == 0, r.stderr
    cuda = [c for c in runs if "--device cuda:0" in c]
    assert len(cuda) == 1 and "--tier gpu" in cuda[0] and "--report reports/cuda-0.json" in cuda[0], runs
    assert all("--jobs 0" in c for c in runs), runs


def _test_sh_sandbox(tmp_path, python_exit: int = 0, skip_slow: bool = False):
    """Run a copy of scripts/test.sh beside a no-op setup.sh and a stub .venv whose ``portakern`` and ``python`` log
    their arguments (``python`` with its TRITON_INTERPRET) and ``python -m pytest`` exits ``python_exit``. Returns the
    completed process, the conformance calls and the pytest calls."""
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "test.sh").write_text((repo / "scripts" / "test.sh").read_text())
    (tmp_path / "scripts" / "setup.sh").write_text("true\n")
    bin_ = tmp_path / ".venv" / "bin"
    bin_.mkdir(parents=True)
    (bin_ / "python").write_text(f'#!/usr/bin/env bash\necho "TRITON_INTERPRET=${{TRITON_INTERPRET:-}} $*" >> '
                                 f'{tmp_path}/python\ncase "$*" in *"-m pytest"*) exit {python_exit};; esac\n')
    (bin_ / "portakern").write_text(f'#!/usr/bin/env bash\necho "$*" >> {tmp_path}/calls\n')
    for f in bin_.iterdir():
        f.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("PORTAKERN_SKIP_SLOW_CONFORMANCE", "TRITON_INTERPRET")}
    if skip_slow:
        env["PORTAKERN_SKIP_SLOW_CONFORMANCE"] = "1"
    r = subprocess.run(["bash", str(tmp_path / "scripts" / "test.sh")], capture_output=True, text=True, timeout=60,
                       env=env)
    read = lambda name: (tmp_path / name).read_text().splitlines() if (tmp_path / name).exists() else []  # noqa: E731
    return r, read("calls"), [c for c in read("python") if " -m pytest " in c]


def test_test_sh_conformance_steps_show_progress(tmp_path):
    # CI logs are not a terminal: the runner then prints one line per 10 %; --no-progress left the
    # interpreter run (many minutes) silent until its end
    r, calls, _ = _test_sh_sandbox(tmp_path)
    assert r.returncode == 0, r.stderr
    assert len(calls) == 8 and all(c.startswith("conformance") for c in calls), calls   # triton x2, triton-rocm x2, cuda, opencl x2, torch
    assert any("--backend torch --device cpu" in c for c in calls), calls
    assert any("--backend cuda --compile-only" in c for c in calls), calls
    assert any("--backend opencl --device opencl:0" in c for c in calls), calls
    assert any("--backend opencl --device cpu" in c for c in calls), calls
    assert any("--backend triton-rocm --compile-only --target gfx942,gfx950" in c for c in calls), calls
    assert not any("--no-progress" in c for c in calls), calls


def test_test_sh_runs_the_interpreter_tier_as_its_own_timed_pytest_step(tmp_path):
    """The suite without the interpreter tier, then the tests marked ``interpreter`` and the contract suite in a
    process started with TRITON_INTERPRET=1 (no pytest inside pytest); each step prints its time."""
    r, _, python = _test_sh_sandbox(tmp_path, skip_slow=True)
    assert r.returncode == 0, r.stderr
    assert python == ["TRITON_INTERPRET= -m pytest -q -m not interpreter",
                      "TRITON_INTERPRET=1 -m pytest -q -m interpreter or contract"], python
    assert "== pytest suite: " in r.stdout and "== interpreter tier: " in r.stdout and " s, exit 0 ==" in r.stdout


@pytest.mark.parametrize("code", [5, 1], ids=["no-tests-ran", "failures"])
def test_test_sh_fails_when_a_pytest_step_fails_or_runs_no_tests(tmp_path, code):
    r, _, python = _test_sh_sandbox(tmp_path, python_exit=code, skip_slow=True)
    assert r.returncode != 0 and len(python) == 2, (r.returncode, python)   # both steps run, either fails the script
    if code == 5:
        assert "pytest (pytest suite) collected no tests: failing (exit 5)" in r.stderr
        assert "pytest (interpreter tier) collected no tests: failing (exit 5)" in r.stderr
