"""scripts/check_boundaries.py, the import-contract checker CI runs, on small synthetic trees.

Each tree is a miniature of portakern's layout (``portakern/``, ``ir/``, ``backends/``, ``conformance/`` mapped
through package-dir) carrying the contracts written in the repository's pyproject.toml, so these tests also
check that the written list says what the design says. Whether the real tree holds is the CI step's verdict,
not this file's.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CHECKER = REPO / "scripts" / "check_boundaries.py"

PACKAGE_DIR = {"portakern": "portakern", "portakern.ir": "ir", "portakern.backends": "backends",
               "portakern.backends.cpu": "backends/cpu", "portakern.conformance": "conformance"}

CLEAN = {
    "portakern/__init__.py": "from . import api\n",
    "portakern/errors.py": "from portakern.ir.errors import InvalidInputError\n",
    "portakern/api.py": "import os\nfrom .backends import find_backend\nVERBOSE = os.environ.get('X', '')\n",
    "ir/__init__.py": "from . import ops\n",
    "ir/errors.py": "class InvalidInputError(ValueError):\n    pass\n",
    "ir/ops.py": "from .errors import InvalidInputError\nfrom portakern.ir import errors\n",
    "backends/__init__.py": "import importlib.metadata\ndef find_backend(name):\n    pass\n",   # the registry
    "backends/cpu/__init__.py": "from . import attention\n",
    "backends/cpu/attention.py": "from portakern.ir.ops import InvalidInputError\nfrom portakern.errors import X\n"
                                 "from .. import find_backend\n",
    "backends/cuda/__init__.py": "",
    "backends/cuda/launch.py": "from .common import nvrtc\n",
    "backends/cuda/common/__init__.py": "",
    "backends/cuda/common/nvrtc.py": "from portakern.backends.cuda import launch\n",
    "backends/triton/__init__.py": "",
    "backends/triton/kernels/__init__.py": "",
    "backends/triton/kernels/attention.py": "import triton\n",
    "backends/triton_rocm/__init__.py": "from portakern.backends.triton.kernels import attention\n",
    "conformance/__init__.py": "from portakern.backends import find_backend\n",
    "conformance/naive.py": "def f():\n    from portakern.ir.ops import InvalidInputError\n",
}


def _toml(value) -> str:
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return json.dumps(value)   # a JSON string is a TOML basic string


def _contracts_toml() -> str:
    """The repository's [tool.portakern.boundaries] contracts, written back as TOML."""
    table = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["portakern"]["boundaries"]
    out = ["[tool.portakern.boundaries]"]
    for contract in table["contract"]:
        out.append("\n[[tool.portakern.boundaries.contract]]")
        out += [f"{key} = {_toml(value)}" for key, value in contract.items()]
    return "\n".join(out) + "\n"


def make_tree(root: Path, files: dict[str, str], contracts: str | None = None) -> Path:
    lines = ["[tool.setuptools.package-dir]"] + [f"{_toml(k)} = {_toml(v)}" for k, v in PACKAGE_DIR.items()]
    (root / "pyproject.toml").write_text("\n".join(lines) + "\n\n" + (_contracts_toml() if contracts is None
                                                                       else contracts))
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


def run_checker(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(CHECKER), *args], capture_output=True, text=True, timeout=60)


def violations(tmp_path: Path, changes: dict[str, str]) -> list[str]:
    """The checker's violation lines for the clean tree with ``changes`` (relative path -> new text)."""
    make_tree(tmp_path, {**CLEAN, **changes})
    proc = run_checker("--root", str(tmp_path))
    assert proc.returncode == (1 if proc.stdout else 0), proc.stderr
    return proc.stdout.splitlines()


def test_a_clean_tree_passes(tmp_path):
    make_tree(tmp_path, CLEAN)
    proc = run_checker("--root", str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip() == f"check_boundaries: 4 import contracts hold over {len(CLEAN)} modules"


def test_the_ir_importing_the_core_fails_with_file_line_and_way_out(tmp_path):
    make_tree(tmp_path, {**CLEAN, "ir/ops.py": "import math\nfrom portakern.errors import InvalidInputError\n"})
    proc = run_checker("--root", str(tmp_path))
    assert proc.returncode == 1
    assert proc.stdout.splitlines() == [
        "ir/ops.py:2: portakern.ir.ops imports portakern.errors: breaks ir-self-contained (portakern.ir imports "
        "nothing from portakern outside portakern.ir); instead: move what the IR needs into portakern.ir (the core "
        "re-exports it, as portakern.errors does portakern.ir.errors) or take it as an argument"]
    assert "1 violation(s)" in proc.stderr and "[tool.portakern.boundaries]" in proc.stderr


def test_lazy_and_relative_imports_are_seen(tmp_path):
    got = violations(tmp_path, {"ir/ops.py": (
        "from .errors import InvalidInputError\n"
        "def fail():\n"
        "    from portakern.errors import PortakernError\n"        # lazy, inside a function
        "    from .. import api\n"                                  # relative, up to portakern
        "    import portakern\n")})
    assert [line.split(": breaks")[0] for line in got] == [
        "ir/ops.py:3: portakern.ir.ops imports portakern.errors",
        "ir/ops.py:4: portakern.ir.ops imports portakern.api",
        "ir/ops.py:5: portakern.ir.ops imports portakern"]


def test_the_core_and_conformance_reach_backends_only_through_the_registry(tmp_path):
    got = violations(tmp_path, {
        "portakern/api.py": "from .backends import find_backend\nfrom .backends import cpu\n",
        "portakern/torch_ops.py": "def f():\n    from portakern.backends.cpu.attention import x\n",
        "conformance/goldens.py": "import importlib\nimportlib.import_module('portakern.backends.cpu.attention')\n"})
    assert [line.split(": breaks")[0] for line in got] == [
        "conformance/goldens.py:2: portakern.conformance.goldens imports portakern.backends.cpu.attention",
        "portakern/api.py:2: portakern.api imports portakern.backends.cpu",
        "portakern/torch_ops.py:2: portakern.torch_ops imports portakern.backends.cpu.attention"]
    assert all("breaks core-reaches-backends-through-the-registry" in line and "instead: reach the backend "
               "through the registry" in line for line in got)


def test_a_backend_importing_another_fails_except_the_allowed_edge(tmp_path):
    got = violations(tmp_path, {"backends/cuda/launch.py": "from ..triton.kernels import attention\n"
                                                           "from .common import nvrtc\n",
                                "backends/cpu/attention.py": "import portakern.backends.cuda.launch\n"})
    assert [line.split(": breaks")[0] for line in got] == [
        "backends/cpu/attention.py:1: portakern.backends.cpu.attention imports portakern.backends.cuda.launch",
        "backends/cuda/launch.py:1: portakern.backends.cuda.launch imports portakern.backends.triton.kernels.attention"]
    assert all("breaks backends-independent (a backend never imports another backend)" in line for line in got)
    # triton_rocm -> triton is the listed edge (in CLEAN); the reverse is not
    (tmp_path / "rev").mkdir()
    assert violations(tmp_path / "rev",
                      {"backends/triton/kernels/__init__.py": "import portakern.backends.triton_rocm\n"})
    # the edge reaches triton's kernel bodies only, not its host code
    (tmp_path / "host").mkdir()
    got = violations(tmp_path / "host", {"backends/triton_rocm/quant_gemv.py":
                                         "from portakern.backends.triton.quant_gemv import compile\n"})
    assert [line.split(": breaks")[0] for line in got] == [
        "backends/triton_rocm/quant_gemv.py:1: portakern.backends.triton_rocm.quant_gemv imports "
        "portakern.backends.triton.quant_gemv"]


def test_environment_writes_are_refused_and_reads_are_not(tmp_path):
    got = violations(tmp_path, {"backends/cpu/attention.py": (
        "import os\n"
        "from os import environ as ENV\n"
        "os.environ['A'] = '1'\n"
        "os.environ.pop('A', None)\n"
        "ENV.update({'B': '2'})\n"
        "del os.environ['B']\n"
        "os.putenv('C', '3')\n"
        "value = os.environ.get('D', '') + ENV['E']\n")})
    assert [line.split(": breaks")[0] for line in got] == [
        "backends/cpu/attention.py:3: portakern.backends.cpu.attention writes os.environ (assignment)",
        "backends/cpu/attention.py:4: portakern.backends.cpu.attention writes os.environ (os.environ.pop())",
        "backends/cpu/attention.py:5: portakern.backends.cpu.attention writes os.environ (os.environ.update())",
        "backends/cpu/attention.py:6: portakern.backends.cpu.attention writes os.environ (del)",
        "backends/cpu/attention.py:7: portakern.backends.cpu.attention writes os.environ (os.putenv())"]
    assert all("instead: keep the value as explicit state" in line for line in got)


def test_a_file_that_does_not_parse_fails(tmp_path):
    got = violations(tmp_path, {"portakern/api.py": "def broken(:\n"})
    assert got == ["portakern/api.py:1: portakern.api does not parse (invalid syntax): no contract can be checked "
                   "on it; fix the syntax"]


@pytest.mark.parametrize("contracts, message", [
    ("", "no [tool.portakern.boundaries] table"),
    ("[tool.portakern.boundaries]\n", "has no [[tool.portakern.boundaries.contract]] entries"),
    ('[[tool.portakern.boundaries.contract]]\nname = "x"\ntype = "layers"\nrule = "r"\ninstead = "i"\n',
     "type 'layers' is unknown: expected forbidden, independent or no-environ-writes"),
    ('[[tool.portakern.boundaries.contract]]\nname = "x"\ntype = "forbidden"\nrule = "r"\ninstead = "i"\n',
     "contract 'x': importers must be a non-empty list of module patterns"),
])
def test_a_malformed_configuration_exits_2_naming_the_problem(tmp_path, contracts, message):
    make_tree(tmp_path, CLEAN, contracts)
    proc = run_checker("--root", str(tmp_path))
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


def test_help_names_the_table_and_why_not_import_linter():
    proc = run_checker("--help")
    assert proc.returncode == 0
    assert "[tool.portakern.boundaries]" in proc.stdout and "--root" in proc.stdout
    assert "import-linter" in CHECKER.read_text()
