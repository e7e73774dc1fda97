#!/usr/bin/env python3
"""Check portakern's import boundaries (the design's "nevers") over the source tree; exit 1 on a violation.

The contracts are written once, in ``pyproject.toml`` under ``[tool.portakern.boundaries]``; this script reads
them, parses every ``.py`` file under the folders of ``[tool.setuptools.package-dir]`` with ``ast`` (each file
named by the module it installs as: ``ir/ops.py`` is ``portakern.ir.ops``) and collects every import: top-level
and lazy ones inside functions, ``from . import x`` resolved to absolute names, and
``importlib.import_module("literal")`` calls. It prints one line per violation::

    ir/ops.py:25: portakern.ir.ops imports portakern.errors: breaks ir-self-contained (portakern.ir imports
    nothing from portakern outside portakern.ir); instead: move what the IR needs into portakern.ir ...

Why not import-linter: its graph (grimp) is built from the folder of one importable top-level package, and
portakern maps ``portakern.ir``, ``portakern.backends`` and ``portakern.conformance`` from ``ir/``,
``backends/`` and ``conformance/`` through package-dir, outside the ``portakern/`` folder, so import-linter
cannot see them (nor the imports between them and the core). This checker reads the mapping itself.

Contract types (each contract has ``name``, ``type``, ``rule`` (one sentence) and ``instead`` (the way out)):

``forbidden``
    modules matching ``importers`` (and no ``ignore_importers`` pattern) never import a module matching
    ``forbidden`` unless it also matches ``allowed``.
``independent``
    the members that ``members`` names (``"x.*"``: each child package of ``x``, with everything below it) never
    import one another, except the edges listed in ``allowed`` as ``"importer -> imported"`` patterns.
``no-environ-writes``
    modules matching ``modules`` never write the process environment: ``os.environ[k] = v``, ``del
    os.environ[k]``, ``os.environ.pop/update/setdefault/clear/popitem(...)``, ``os.putenv``, ``os.unsetenv``.

Patterns: ``"a.b"`` matches ``a.b`` and every module below it; ``"a.b.*"`` matches every module below ``a.b``
but not ``a.b`` itself.

Exit status: 0 every contract holds; 1 a violation (or a file that does not parse); 2 the configuration is
missing or malformed.
"""

from __future__ import annotations

import argparse
import ast
import sys
from dataclasses import dataclass, field
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

TABLE = "[tool.portakern.boundaries]"
ENVIRON_WRITERS = frozenset({"pop", "update", "setdefault", "clear", "popitem", "__setitem__", "__delitem__"})


class ConfigError(Exception):
    """The pyproject configuration is missing or malformed (exit status 2)."""


# -- patterns ---------------------------------------------------------------------------------------

def matches(module: str, pattern: str) -> bool:
    """Whether ``module`` matches ``pattern`` ("a.b": a.b and below; "a.b.*": strictly below a.b)."""
    if pattern.endswith(".*"):
        return module.startswith(pattern[:-1])
    return module == pattern or module.startswith(pattern + ".")


def member_of(module: str, pattern: str) -> str | None:
    """The member of an ``independent`` contract that ``module`` belongs to ("x.*" -> "x.<child>"), or None."""
    if not pattern.endswith(".*"):
        raise ConfigError(f"{TABLE}: independent members pattern {pattern!r} must end in '.*' (each child of a "
                          "package is a member)")
    prefix = pattern[:-1]
    if not module.startswith(prefix):
        return None
    return prefix + module[len(prefix):].split(".")[0]


# -- the source tree ----------------------------------------------------------------------------------

@dataclass
class Import:
    """One import statement's target, or one environment write, at a line of a file."""

    line: int
    target: str          # the imported module, or "os.environ" for a write
    what: str = ""       # for a write: how it writes


@dataclass
class Module:
    name: str
    path: Path
    rel: str
    is_package: bool
    imports: list[Import] = field(default_factory=list)
    environ_writes: list[Import] = field(default_factory=list)


def package_dirs(pyproject: dict, root: Path) -> dict[str, Path]:
    """``[tool.setuptools.package-dir]`` as package name -> folder."""
    pkg_dir = pyproject.get("tool", {}).get("setuptools", {}).get("package-dir")
    if not isinstance(pkg_dir, dict) or not pkg_dir:
        raise ConfigError("pyproject.toml has no [tool.setuptools.package-dir] table: the checker maps files to "
                          "module names through it; add one (e.g. \"portakern\" = \"portakern\")")
    return {name: (root / folder).resolve() for name, folder in pkg_dir.items()}


def discover(root: Path, pkg_dirs: dict[str, Path]) -> dict[str, Module]:
    """Every .py file under the package-dir folders, by module name (longest mapped folder wins)."""
    by_folder = sorted(pkg_dirs.items(), key=lambda kv: len(kv[1].parts), reverse=True)
    tops = [p for p in pkg_dirs.values() if not any(q != p and q in p.parents for q in pkg_dirs.values())]
    modules: dict[str, Module] = {}
    for top in sorted(set(tops)):
        if not top.is_dir():
            continue
        for path in sorted(top.rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            for pkg, folder in by_folder:
                if folder == path.parent or folder in path.parents:
                    parts = list(path.relative_to(folder).with_suffix("").parts)
                    break
            else:
                continue
            is_package = parts[-1] == "__init__"
            if is_package:
                parts = parts[:-1]
            if not all(p.isidentifier() for p in parts):
                continue  # not importable (e.g. a data folder with a dash)
            name = ".".join(([pkg] if pkg else []) + parts)
            if not name:
                continue
            modules[name] = Module(name, path, path.relative_to(root).as_posix(), is_package)
    return modules


def _resolve_relative(module: Module, level: int, target: str | None) -> str | None:
    package = module.name if module.is_package else module.name.rpartition(".")[0]
    parts = package.split(".") if package else []
    if level - 1 > len(parts):
        return None
    base = parts[:len(parts) - (level - 1)]
    return ".".join(base + ([target] if target else [])) or None


def scan(module: Module, known: set[str]) -> None:
    """Fill ``module.imports`` and ``module.environ_writes`` from its source."""
    tree = ast.parse(module.path.read_text(encoding="utf-8"), filename=str(module.path))
    os_names, environ_names, env_funcs = set(), set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                module.imports.append(Import(node.lineno, alias.name))
                if alias.name == "os":
                    os_names.add(alias.asname or "os")
        elif isinstance(node, ast.ImportFrom):
            base = node.module if node.level == 0 else _resolve_relative(module, node.level, node.module)
            if base is None:
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                module.imports.append(Import(node.lineno, sub if sub in known else base))
                if base == "os" and alias.name == "environ":
                    environ_names.add(alias.asname or "environ")
                if base == "os" and alias.name in ("putenv", "unsetenv"):
                    env_funcs.add(alias.asname or alias.name)
        elif isinstance(node, ast.Call):
            name = _dynamic_import(node, module)
            if name:
                module.imports.append(Import(node.lineno, name))

    def is_environ(n: ast.AST) -> bool:
        return ((isinstance(n, ast.Attribute) and n.attr == "environ" and isinstance(n.value, ast.Name)
                 and n.value.id in os_names) or (isinstance(n, ast.Name) and n.id in environ_names))

    def written(target: ast.AST) -> bool:
        if isinstance(target, (ast.Tuple, ast.List)):
            return any(written(t) for t in target.elts)
        return is_environ(target) or (isinstance(target, ast.Subscript) and is_environ(target.value))

    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(written(t) for t in targets):
                module.environ_writes.append(Import(node.lineno, "os.environ", "assignment"))
        elif isinstance(node, ast.Delete) and any(written(t) for t in node.targets):
            module.environ_writes.append(Import(node.lineno, "os.environ", "del"))
        elif isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Attribute) and f.attr in ENVIRON_WRITERS and is_environ(f.value):
                module.environ_writes.append(Import(node.lineno, "os.environ", f"os.environ.{f.attr}()"))
            elif (isinstance(f, ast.Attribute) and f.attr in ("putenv", "unsetenv") and isinstance(f.value, ast.Name)
                  and f.value.id in os_names) or (isinstance(f, ast.Name) and f.id in env_funcs):
                how = f"os.{f.attr if isinstance(f, ast.Attribute) else f.id}()"
                module.environ_writes.append(Import(node.lineno, "os.environ", how))


def _dynamic_import(call: ast.Call, module: Module) -> str | None:
    """The module an ``importlib.import_module("literal"[, package])`` or ``__import__("literal")`` call names."""
    f = call.func
    fname = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
    if fname not in ("import_module", "__import__") or not call.args:
        return None
    arg = call.args[0]
    if not (isinstance(arg, ast.Constant) and isinstance(arg.value, str)) or not arg.value:
        return None
    name = arg.value
    if name.startswith("."):
        level = len(name) - len(name.lstrip("."))
        return _resolve_relative(module, level, name.lstrip(".") or None)
    return name


# -- contracts ----------------------------------------------------------------------------------------

@dataclass
class Violation:
    rel: str
    line: int
    importer: str
    imported: str
    contract: dict
    what: str = ""

    def __str__(self) -> str:
        c = self.contract
        verb = f"writes {self.imported} ({self.what})" if self.what else f"imports {self.imported}"
        return (f"{self.rel}:{self.line}: {self.importer} {verb}: breaks {c['name']} ({c['rule']}); "
                f"instead: {c['instead']}")


def _strings(contract: dict, key: str, required: bool = True) -> list[str]:
    value = contract.get(key)
    if value is None and not required:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value) or (required and not value):
        raise ConfigError(f"{TABLE} contract {contract['name']!r}: {key} must be a "
                          f"{'non-empty ' if required else ''}list of module patterns, got {value!r}")
    return value


def _edge(spec: str, contract: dict) -> tuple[str, str]:
    importer, sep, imported = (s.strip() for s in spec.partition("->"))
    if not sep or not importer or not imported:
        raise ConfigError(f"{TABLE} contract {contract['name']!r}: allowed edge {spec!r} must read "
                          "'importer-pattern -> imported-pattern'")
    return importer, imported


def check(contract: dict, modules: dict[str, Module]) -> list[Violation]:
    """The violations of one contract over the scanned modules."""
    kind = contract["type"]
    out: list[Violation] = []
    if kind == "forbidden":
        importers, ignore = _strings(contract, "importers"), _strings(contract, "ignore_importers", False)
        forbidden, allowed = _strings(contract, "forbidden"), _strings(contract, "allowed", False)
        for m in modules.values():
            if not any(matches(m.name, p) for p in importers) or any(matches(m.name, p) for p in ignore):
                continue
            for imp in m.imports:
                if any(matches(imp.target, p) for p in forbidden) and not any(matches(imp.target, p) for p in allowed):
                    out.append(Violation(m.rel, imp.line, m.name, imp.target, contract))
    elif kind == "independent":
        members = _strings(contract, "members")
        edges = [_edge(s, contract) for s in _strings(contract, "allowed", False)]
        for m in modules.values():
            for pattern in members:
                own = member_of(m.name, pattern)
                if own is None:
                    continue
                for imp in m.imports:
                    other = member_of(imp.target, pattern)
                    if other is None or other == own:
                        continue
                    if any(matches(m.name, a) and matches(imp.target, b) for a, b in edges):
                        continue
                    out.append(Violation(m.rel, imp.line, m.name, imp.target, contract))
    elif kind == "no-environ-writes":
        scope = _strings(contract, "modules")
        for m in modules.values():
            if any(matches(m.name, p) for p in scope):
                out += [Violation(m.rel, w.line, m.name, w.target, contract, w.what) for w in m.environ_writes]
    else:
        raise ConfigError(f"{TABLE} contract {contract.get('name', '?')!r}: type {kind!r} is unknown: expected "
                          "forbidden, independent or no-environ-writes")
    return out


def load_contracts(pyproject: dict) -> list[dict]:
    """The contracts of ``[tool.portakern.boundaries]``, each checked for its common keys."""
    table = pyproject.get("tool", {}).get("portakern", {}).get("boundaries")
    if not isinstance(table, dict):
        raise ConfigError(f"pyproject.toml has no {TABLE} table: write the import contracts there "
                          "([[tool.portakern.boundaries.contract]] entries; see this script's --help)")
    contracts = table.get("contract")
    if not isinstance(contracts, list) or not contracts:
        raise ConfigError(f"{TABLE} has no [[tool.portakern.boundaries.contract]] entries")
    for c in contracts:
        for key in ("name", "type", "rule", "instead"):
            if not isinstance(c.get(key), str) or not c[key]:
                raise ConfigError(f"{TABLE} contract {c.get('name', '?')!r}: {key} must be a non-empty string")
    return contracts


def run(root: Path) -> tuple[list[str], int, int]:
    """(violation lines, contracts, modules) for the project at ``root``; raises ConfigError."""
    path = root / "pyproject.toml"
    try:
        pyproject = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e.strerror}; pass --root, the folder holding pyproject.toml")
    contracts = load_contracts(pyproject)
    modules = discover(root, package_dirs(pyproject, root))
    lines: list[str] = []
    for m in modules.values():
        try:
            scan(m, set(modules))
        except SyntaxError as e:
            lines.append(f"{m.rel}:{e.lineno}: {m.name} does not parse ({e.msg}): no contract can be checked on it; "
                         "fix the syntax")
    violations = [v for c in contracts for v in check(c, modules)]
    seen = set()
    for v in sorted(violations, key=lambda v: (v.rel, v.line, v.contract["name"], v.imported)):
        key = (v.rel, v.line, v.contract["name"], v.imported, v.what)
        if key not in seen:
            seen.add(key)
            lines.append(str(v))
    return lines, len(contracts), len(modules)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="check_boundaries.py", formatter_class=argparse.RawDescriptionHelpFormatter,
        description=__doc__,
        epilog="The contracts live in pyproject.toml under [tool.portakern.boundaries]; each violation prints as\n"
               "  FILE:LINE: IMPORTER imports IMPORTED: breaks CONTRACT (rule); instead: what to do\n"
               "Exit status: 0 all contracts hold, 1 a violation, 2 a missing or malformed configuration.")
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent,
                        help="the project folder holding pyproject.toml (default: this script's parent's parent)")
    args = parser.parse_args(argv)
    try:
        lines, n_contracts, n_modules = run(args.root.resolve())
    except ConfigError as e:
        print(f"check_boundaries: {e}", file=sys.stderr)
        return 2
    for line in lines:
        print(line)
    if lines:
        print(f"check_boundaries: {len(lines)} violation(s) of the {n_contracts} import contracts in "
              f"pyproject.toml {TABLE} ({n_modules} modules checked)", file=sys.stderr)
        return 1
    print(f"check_boundaries: {n_contracts} import contracts hold over {n_modules} modules")
    return 0


if __name__ == "__main__":
    sys.exit(main())
