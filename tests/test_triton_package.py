"""The triton backend's package shape: one architecture-family mapping, tuning tables as data with their sources,
no import cycles, no module over 500 lines, no environment writes (all checked on the source, no GPU)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "backends" / "triton"
RESULTS = ROOT / "benchmarks" / "results"
NAME = "portakern.backends.triton"


def _modules() -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, is a package's __init__) for every module of the package."""
    mods = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        mods[".".join([NAME] + (parts[:-1] if is_pkg else parts))] = (path, is_pkg)
    return mods


def _import_graph() -> dict[str, set[str]]:
    """Every import of a module of the package by another, at module level or inside a function (a lazy import
    closes a cycle as surely as an eager one). ``from . import x`` imports the submodule ``x``, not the package."""
    mods = _modules()
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for mod, (path, is_pkg) in mods.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    base = base[:len(base) - (node.level - 1)] + ([node.module] if node.module else [])
                    base = ".".join(base)
                else:
                    base = node.module
                subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in mods]
                targets = subs + ([base] if len(subs) < len(node.names) else [])
            else:
                continue
            edges[mod].update(t for t in targets if t in mods and t != mod)
    return edges


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    state: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(u: str) -> None:
        state[u] = 1
        stack.append(u)
        for v in sorted(edges[u]):
            if state.get(v) == 1:
                found.append(stack[stack.index(v):] + [v])
            elif v not in state:
                visit(v)
        stack.pop()
        state[u] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m)
    return found


def test_the_cycle_finder_finds_a_lazy_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c", "a"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles_in_the_package():
    edges = _import_graph()
    assert f"{NAME}.attention.forward" in edges and f"{NAME}.attention.plan" in edges[f"{NAME}.attention.forward"]
    cycles = _cycles(edges)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_no_module_over_500_lines():
    long = {str(p.relative_to(ROOT)): n for p, _ in _modules().values() if (n := len(p.read_text().splitlines())) > 500}
    assert not long, long


def _environment_writes(tree: ast.AST) -> list[int]:
    """Lines that write ``os.environ`` (item assignment or deletion, a mutating method) or call ``os.putenv``."""
    def is_environ(node) -> bool:
        return isinstance(node, ast.Attribute) and node.attr == "environ"

    lines = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.Delete)):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
            lines += [node.lineno for t in targets if isinstance(t, ast.Subscript) and is_environ(t.value)]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if is_environ(node.func.value) and node.func.attr in ("pop", "update", "setdefault", "clear", "popitem"):
                lines.append(node.lineno)
            if node.func.attr in ("putenv", "unsetenv"):
                lines.append(node.lineno)
    return lines


def test_the_environment_write_finder_finds_writes():
    src = "import os\nos.environ['A'] = '1'\nos.environ.pop('A')\ndel os.environ['B']\nenv = dict(os.environ, A='0')\n"
    assert _environment_writes(ast.parse(src)) == [2, 4, 3]


def test_no_environment_writes_in_the_package():
    writes = {str(p.relative_to(ROOT)): w for p, _ in _modules().values()
              if (w := _environment_writes(ast.parse(p.read_text())))}
    assert not writes, writes


def test_environment_variables_are_read_in_one_module():
    readers = sorted(str(p.relative_to(PACKAGE)) for p, _ in _modules().values()
                     if "os.environ.get" in p.read_text() or "os.getenv" in p.read_text())
    assert readers == ["common/switches.py"], readers


# -- tuning.py: data tables, each entry with its source ---------------------------------------------------------

def test_tuning_is_data_only():
    """No function, class, branch or loop in tuning.py: selection logic reads the tables from attention/plan.py
    and quant_gemv/config.py."""
    tree = ast.parse((PACKAGE / "tuning.py").read_text())
    logic = [type(n).__name__ for n in ast.walk(tree)
             if isinstance(n, (ast.FunctionDef, ast.ClassDef, ast.If, ast.For, ast.While, ast.Import, ast.ImportFrom,
                               ast.Lambda, ast.IfExp))]
    assert not logic, logic


def _sources(name: str, value) -> list[str]:
    """The ``source`` strings of a table: its rows' (dicts with a "source"), a family set's values (a dict of
    family -> source), a ``*_SOURCE`` constant's text (or dict of texts)."""
    if isinstance(value, dict) and isinstance(value.get("source"), str):
        return [value["source"]]
    if isinstance(value, (list, tuple)):
        return [s for v in value for s in _sources(name, v)]
    if isinstance(value, dict):
        texts = [v for v in value.values() if isinstance(v, str)]
        return texts + [s for v in value.values() if isinstance(v, dict) for s in _sources(name, v)]
    return [value] if name.endswith("_SOURCE") and isinstance(value, str) else []


def test_every_tuning_entry_names_an_existing_result_file_or_says_it_was_not_measured():
    from portakern.backends.triton import tuning

    for name in ("PREFILL_TILES", "DECODE_TILES", "WGMMA_TILES", "GEMV_TILES"):
        assert all("source" in row for row in getattr(tuning, name)), name
    sources = [s for name in dir(tuning) if name.isupper() for s in _sources(name, getattr(tuning, name))]
    assert len(sources) > 40
    for s in sources:
        files = re.findall(r"[\w.-]+\.(?:json|log|txt)", s)
        assert s.startswith("none (") or files, f"source names no result file: {s!r}"
        for f in files:
            assert (RESULTS / f).is_file(), f"{f} (in {s!r}) is not under benchmarks/results/"


# -- one architecture family mapping ------------------------------------------------------------------------------

@pytest.mark.parametrize("cc, family", [
    ((8, 0), "sm_80"), ((8, 6), "sm_86"), ((8, 7), "sm_86"), ((8, 9), "sm_89"), ((9, 0), "sm_90"),
    ((10, 0), "sm_100"), ((10, 3), "sm_100"), ((12, 0), "sm_120"), ((12, 1), "sm_120"),
    (80, "sm_80"), (86, "sm_86"), (89, "sm_89"), (90, "sm_90"), (100, "sm_100"), (120, "sm_120"), (None, "interp"),
])
def test_arch_family_maps_each_capability_once_for_every_op(cc, family):
    """sm_86 / sm_87 / sm_89 are families of their own (about 100 KB of shared memory per block against sm_80's
    163 KiB), for attention and GEMV alike; every family has an entry in each per-family table."""
    from portakern.backends.triton import tuning
    from portakern.backends.triton.common.arch import arch_family

    assert arch_family(cc) == family
    for table in (tuning.SMEM_LIMIT, tuning.FMA_MAX_M):
        assert family in table
    assert family == "interp" or family in tuning.DEFAULT_SMS


def test_sm86_and_sm89_take_sm80s_gemv_entries_and_their_own_attention_tiles():
    """The GEMV tables give sm_86 / sm_89 sm_80's configuration for every kind of weight and M; attention fits
    its tiles to their 99 KiB (D=128 prefill: sm_80's 128 x 64 tile with 2 stages needs more)."""
    pytest.importorskip("triton")
    from portakern.backends.triton.attention import plan
    from portakern.backends.triton.quant_gemv import config
    from portakern.backends.triton.quant_gemv.aot import LayoutStub
    from portakern.ir import DType, QuantFormat
    from portakern.ir.ops import QuantGemv
    from portakern.ir.quant import Packing

    from triton_helpers import make_op

    for bits, gs, sym, packing, act in ((4, 128, False, "native", False), (8, 128, True, "native", False),
                                        (4, 128, False, "gptq", True), (4, 32, True, "native", False)):
        fmt = QuantFormat(bits=bits, group_size=gs, symmetric=sym, packing=Packing(packing), has_g_idx=act)
        for M, N, K in ((1, 4096, 4096), (1, 28672, 8192), (4, 4096, 14336), (16, 8192, 8192)):
            lay = LayoutStub(QuantGemv(M=M, N=N, K=K, dtype=DType.bfloat16, fmt=fmt))
            want = config.choose(lay, M, N, "sm_80", 108)
            for family in ("sm_86", "sm_89"):
                assert config.choose(lay, M, N, family, 108) == want, (family, bits, gs, M, N, K)
    op = make_op(B=2, Sq=2048, Sk=2048, Hq=16, Hkv=16, D=128, dtype=DType.bfloat16)
    sm80, sm86 = plan.choose(op, "sm_80", 108), plan.choose(op, "sm_86", 84)
    assert (sm80.block_m, sm80.block_n, sm80.num_stages) == (128, 64, 2)
    assert (sm86.block_m, sm86.block_n, sm86.num_stages) == (64, 64, 2)
    assert plan.choose(op, "sm_89", 128) == sm86      # prefill: one split, whatever the multiprocessors
