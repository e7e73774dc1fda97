"""Conformance reports: the JSON document, the Markdown op x backend matrix, JUnit XML, and the
terminal summary.

JSON (``FORMAT`` 1)::

    {"format": 1, "suite": "cases-v1", "tier": "cpu", "mode": "run" | "compile-only",
     "created": ISO-8601 UTC, "portakern": version, "command": [...argv],
     "device": {device, type, arch, name, capability, warp_size, driver, toolkit, ...},
     "targets": [...] (compile-only), "repeat": N,
     "packages": {python, platform, numpy, pluggy, torch, triton, ...},
     "backends": {name: {version, array_kind, status, compile_targets}},
     "git": {"commit": sha, "dirty": bool} | null,
     "summary": {backend: {op: {status: count}}},
     "exit_status": 0 | 1 | 130 (interrupted): 1 also when no record ran (every one unsupported),
     "interrupted": {"records": n, "expected": m} (only when Ctrl-C stopped the run),
     "results": [{case, op, dtype, backend, device, status, max_abs_err, tolerance, time_ms, reason,
                  ...optional: nmse, lse_err, lse_tolerance, first_call_ms}]}

``status`` is one of pass, fail, unsupported, error, nondeterministic. ``max_abs_err`` and
``tolerance`` are null where nothing was compared (unsupported, error, compile-only).
"""

from __future__ import annotations

import datetime
import json
import platform
import subprocess
import sys
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
import os
from pathlib import Path
from typing import Any, Iterable
from xml.sax.saxutils import escape, quoteattr

FORMAT = 1
STATUSES = ("pass", "fail", "error", "nondeterministic", "unsupported")
FAILING = ("fail", "error", "nondeterministic")


@dataclass
class Record:
    case: str
    op: str
    dtype: str
    backend: str
    device: str
    status: str
    max_abs_err: float | None = None
    tolerance: float | None = None
    time_ms: float | None = None
    reason: str = ""
    extra: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        """The record as a JSON-safe dict: extras inlined, every NaN null and every Inf ``"inf"``."""
        d = asdict(self)
        d.update(d.pop("extra"))
        return {k: json_number(v) for k, v in d.items()}


def json_number(v: Any) -> Any:
    """``v`` with a non-finite float made JSON-safe: NaN -> None (the reason says why), +-Inf -> "inf"."""
    if not isinstance(v, float) or v == v and v not in (float("inf"), float("-inf")):
        return v
    return None if v != v else "inf"


# -- identity ------------------------------------------------------------------------------------

def _run(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout.strip()
    except Exception:
        return ""


def device_identity(device: Any) -> dict:
    """Everything known about ``device``: name, arch, capability, driver and toolkit versions."""
    d = device.to_json() if hasattr(device, "to_json") else {"device": str(device)}
    if getattr(device, "type", "") in ("cuda", "rocm"):
        try:
            import torch

            d.setdefault("toolkit", f"cuda {torch.version.cuda}" if torch.version.cuda
                         else f"hip {getattr(torch.version, 'hip', None)}")
        except Exception:
            pass
        if device.type == "cuda":
            drv = _run(["nvidia-smi", f"--id={device.index}", "--query-gpu=driver_version,name,vbios_version",
                        "--format=csv,noheader"])
            if drv:
                parts = [p.strip() for p in drv.splitlines()[0].split(",")]
                d["driver"] = parts[0]
                if len(parts) > 2:
                    d["vbios"] = parts[2]
            nvcc = _run(["nvcc", "--version"])
            if nvcc:
                d["nvcc"] = nvcc.splitlines()[-1]
        else:
            d["driver"] = (_run(["rocm-smi", "--showdriverversion"]).splitlines() or [""])[-1]
    elif getattr(device, "type", "") == "cpu":
        d["cpu_count"] = _cpu_count()
    return d


def _cpu_count() -> int:
    import os

    try:
        return len(os.sched_getaffinity(0))
    except Exception:
        return os.cpu_count() or 0


def package_versions() -> dict:
    from importlib import metadata

    out = {"python": platform.python_version(), "platform": platform.platform()}
    for name in ("portakern", "numpy", "pluggy", "torch", "triton", "pyopencl", "nvidia-cutlass-dsl", "cupy"):
        try:
            out[name] = metadata.version(name)
        except Exception:
            pass
    return out


def git_info() -> dict | None:
    """Commit and dirty flag of the checkout portakern is imported from, if it is one.

    ``PK_COMMIT`` in the environment wins: a copy of a working tree (e.g. on a lent device) may carry
    a stale ``.git`` that names another commit, so whoever made the copy says which commit it is.
    """
    import portakern

    named = os.environ.get("PK_COMMIT", "")
    if named:
        return {"commit": named, "dirty": None, "from": "PK_COMMIT"}
    root = Path(portakern.__file__).resolve().parent.parent
    commit = _run(["git", "-C", str(root), "rev-parse", "HEAD"]) if (root / ".git").exists() else ""
    if not commit:
        return None
    dirty = bool(_run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"]))
    return {"commit": commit, "dirty": dirty}


def run_identity(device: Any = None) -> dict:
    """Who measured: device identity, package versions and commit, for benchmark result files.

    The commit comes from git when portakern is imported from a checkout, else from the
    ``PK_COMMIT`` environment variable (set it when running on a copy of the tree).
    """
    return {"device": device_identity(device) if device is not None else None,
            "packages": package_versions(), "git": git_info()}


def backend_info(backends: Iterable[Any]) -> dict:
    out = {}
    for b in backends:
        try:
            st = b.status()
        except Exception as e:
            st = f"status() raised {type(e).__name__}: {e}"
        out[b.name] = {"version": str(b.version), "array_kind": b.array_kind, "status": st,
                       "compile_targets": list(b.compile_targets)}
    return out


# -- summaries -----------------------------------------------------------------------------------

def summarize(records: Iterable[Record]) -> dict:
    """``{backend: {op: {status: count}}}``"""
    s: dict = defaultdict(lambda: defaultdict(Counter))
    for r in records:
        s[r.backend][r.op][r.status] += 1
    return {b: {op: dict(c) for op, c in ops.items()} for b, ops in s.items()}


#: the exit status of a run stopped by Ctrl-C (128 + SIGINT, the shell's convention)
EXIT_INTERRUPTED = 130


def exit_status(records: Iterable[Record], interrupted: bool = False) -> int:
    """0 when every record passed or was unsupported and at least one ran; 1 when any failed,
    errored or was nondeterministic, or when none ran (nothing was checked); 130 when interrupted."""
    if interrupted:
        return EXIT_INTERRUPTED
    records = list(records)
    return 1 if nothing_ran(records) or any(r.status in FAILING for r in records) else 0


def nothing_ran(records: Iterable[Record]) -> bool:
    """Whether no record was checked: every one unsupported (or none at all). Such a run qualified
    nothing (a backend that declines every case, a device it cannot use), so it does not pass."""
    return all(r.status == "unsupported" for r in records)


def _nothing_ran_text(n: int) -> str:
    return (f"nothing ran: all {n} record(s) are unsupported, so nothing was checked (exit status 1); "
            "read the reasons, check the backend's status with portakern info, or pick another "
            "--backend / --device")


def build(records: list[Record], *, suite: str, tier: str, mode: str, device: Any, backends: list,
          repeat: int = 1, targets: list[str] | None = None, command: list[str] | None = None,
          interrupted: bool = False, expected: int | None = None) -> dict:
    """The JSON report of ``records`` (see the module docstring for its fields).

    ``interrupted``: the run stopped at Ctrl-C after ``len(records)`` of ``expected`` records; the
    report then carries ``"interrupted": {"records": n, "expected": m}`` and exit status 130.
    """
    import portakern

    stop = {"interrupted": {"records": len(records), "expected": expected}} if interrupted else {}
    return {"format": FORMAT, "suite": suite, "tier": tier, "mode": mode, **stop,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "portakern": portakern.__version__, "command": list(command or sys.argv),
            "device": device_identity(device) if device is not None else None,
            "targets": list(targets or []), "repeat": repeat, "packages": package_versions(),
            "backends": backend_info(backends), "git": git_info(),
            "summary": summarize(records), "exit_status": exit_status(records, interrupted),
            "results": [r.to_json() for r in records]}


def write_json(report: dict, path: str | Path) -> None:
    Path(path).write_text(json.dumps(report, indent=1, allow_nan=False) + "\n")


# -- text table ----------------------------------------------------------------------------------

def table(records: list[Record]) -> str:
    """The op x backend summary for the terminal, then the first failures with their reasons."""
    s = summarize(records)
    cols = ("pass", "fail", "error", "nondet", "unsupported")
    rows = [("op", "backend") + cols]
    for b in sorted(s):
        for op in sorted(s[b]):
            c = s[b][op]
            rows.append((op, b, *(str(c.get("nondeterministic" if k == "nondet" else k, 0)) for k in cols)))
    w = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(x.ljust(w[i]) if i < 2 else x.rjust(w[i]) for i, x in enumerate(r)) for r in rows]
    if nothing_ran(records):
        lines += ["", _nothing_ran_text(len(records))]
    bad = [r for r in records if r.status in FAILING]
    if bad:
        lines.append("")
        lines.append(f"{len(bad)} failing record(s):")
        for r in bad[:25]:
            lines.append(f"  {r.status.upper():<16} {r.backend} {r.case}: {r.reason}")
        if len(bad) > 25:
            lines.append(f"  ... and {len(bad) - 25} more (see the JSON report)")
    return "\n".join(lines)


# -- markdown ------------------------------------------------------------------------------------

def _group(r: Record) -> str:
    """A readable feature group of a case id (first tags after the op)."""
    parts = r.case.split("-")
    if r.op == "quant_gemv":
        return f"quant_gemv {parts[1]}" + (" g_idx" if "gidx" in parts else "")
    layout = next((p for p in parts if p.startswith("paged") or p in ("varlen", "lens")), "dense")
    return f"attention {layout if not layout.startswith('paged') else 'paged'}"


def _cell(c: Counter) -> str:
    total = sum(c.values())
    ok = c.get("pass", 0)
    bad = sum(c.get(k, 0) for k in FAILING)
    uns = c.get("unsupported", 0)
    if bad:
        text = f"FAIL {ok}/{total - uns}"
    elif ok:
        text = f"pass {ok}/{total - uns}"
    else:
        text = "—"
    return text + (f" ({uns} unsupported)" if uns else "")


def markdown(report: dict) -> str:
    """The Markdown report: header, op x backend matrix, feature groups, failures, unsupported reasons."""
    recs = [Record(**{k: r.get(k) for k in ("case", "op", "dtype", "backend", "device", "status",
                                              "max_abs_err", "tolerance", "time_ms", "reason")})
            for r in report["results"]]
    dev = report.get("device") or {}
    backends = sorted({r.backend for r in recs})
    head = [f"# portakern conformance: {report['suite']} ({report['mode']}, tier {report['tier']})", "",
            (f"- device: {dev.get('device', '?')} {dev.get('name', '')} {dev.get('arch', '')}".rstrip() if dev
             else "- device: none (lowered without one)"),
            f"- created: {report['created']}; portakern {report['portakern']}"
            + (f"; commit {report['git']['commit'][:12]}{' (dirty)' if report['git']['dirty'] else ''}"
               if report.get("git") else ""),
            f"- result: {_result(report)}", ""]
    if report.get("targets"):
        head.insert(3, f"- targets: {', '.join(report['targets'])}")

    def matrix(key) -> list[str]:
        cells: dict = defaultdict(Counter)
        for r in recs:
            cells[(key(r), r.backend)][r.status] += 1
        rows = sorted({k for k, _ in cells})
        out = ["| | " + " | ".join(backends) + " |", "|---|" + "---|" * len(backends)]
        for row in rows:
            out.append(f"| {row} | " + " | ".join(_cell(cells[(row, b)]) for b in backends) + " |")
        return out

    lines = head + ["## op x backend", ""] + matrix(lambda r: r.op) + ["", "## by feature", ""] + \
        matrix(_group) + ["", "## by dtype", ""] + matrix(lambda r: f"{r.op} {r.dtype}")
    bad = [r for r in recs if r.status in FAILING]
    if bad:
        lines += ["", "## failures", "", "| backend | case | status | max_abs_err | tolerance | reason |",
                  "|---|---|---|---|---|---|"]
        for r in bad:
            lines.append(f"| {r.backend} | `{r.case}` | {r.status} | {_num(r.max_abs_err)} | {_num(r.tolerance)} | "
                         f"{r.reason.replace('|', '/')} |")
    reasons: dict = defaultdict(list)
    for r in recs:
        if r.status == "unsupported":
            reasons[(r.backend, r.reason)].append(r.case)
    if reasons:
        lines += ["", "## unsupported (reason from the backend's supports())", "",
                  "| backend | cases | reason | example |", "|---|---|---|---|"]
        for (b, why), ids in sorted(reasons.items()):
            lines.append(f"| {b} | {len(ids)} | {why.replace('|', '/')} | `{ids[0]}` |")
    return "\n".join(lines) + "\n"


def _result(report: dict) -> str:
    """PASS, FAIL, or INTERRUPTED with how many records were made."""
    stop = report.get("interrupted")
    if stop:
        return f"INTERRUPTED (Ctrl-C) after {stop['records']} of {stop['expected']} records"
    if all(r["status"] == "unsupported" for r in report["results"]):
        return "FAIL: " + _nothing_ran_text(len(report["results"]))
    return "PASS" if report["exit_status"] == 0 else "FAIL"


def _num(v) -> str:
    if v is None:
        return "—"
    if isinstance(v, str):
        return v
    return f"{v:.3g}"


# -- junit ---------------------------------------------------------------------------------------

def junit(report: dict) -> str:
    """JUnit XML: one testsuite per backend, one testcase per case (unsupported = skipped)."""
    by_backend: dict = defaultdict(list)
    for r in report["results"]:
        by_backend[r["backend"]].append(r)
    out = ['<?xml version="1.0" encoding="utf-8"?>',
           f'<testsuites name="portakern-conformance {escape(report["suite"])}">']
    for b in sorted(by_backend):
        rs = by_backend[b]
        c = Counter(r["status"] for r in rs)
        t = sum((r.get("time_ms") or 0) for r in rs) / 1000
        suite_name = quoteattr(f"{b}@{rs[0]['device']}")
        out.append(f'  <testsuite name={suite_name} tests="{len(rs)}" '
                   f'failures="{c["fail"] + c["nondeterministic"]}" errors="{c["error"]}" '
                   f'skipped="{c["unsupported"]}" time="{t:.3f}">')
        for r in rs:
            secs = (r.get("time_ms") or 0) / 1000
            cls = quoteattr(f"portakern.conformance.{b}.{r['op']}")
            out.append(f'    <testcase classname={cls} name={quoteattr(r["case"])} time="{secs:.4f}">')
            msg = quoteattr(r.get("reason") or "")
            if r["status"] in ("fail", "nondeterministic"):
                out.append(f'      <failure type="{r["status"]}" message={msg}>max_abs_err={r.get("max_abs_err")} '
                           f'tolerance={r.get("tolerance")}</failure>')
            elif r["status"] == "error":
                out.append(f'      <error type="error" message={msg}/>')
            elif r["status"] == "unsupported":
                out.append(f'      <skipped message={msg}/>')
            out.append("    </testcase>")
        out.append("  </testsuite>")
    out.append("</testsuites>")
    return "\n".join(out) + "\n"
