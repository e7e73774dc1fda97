"""The support matrix: every backend's ``supports()`` over the conformance cases, as Markdown.

``docs/support.md`` is this module's output (``portakern support --markdown``), never written by
hand; a test fails when it is stale. To be the same on every machine it asks about a fixed set of
*device descriptions* (not the devices present) and pins the one environment variable a built-in
backend reads (``TRITON_INTERPRET``) per column. Because Triton reads that variable once, at its
first import, each environment's answers come from a fresh subprocess (``python -m
portakern.conformance.support --answers``), so they never depend on what the calling process
imported before.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter, defaultdict
from dataclasses import dataclass

from portakern.devices import Device

from .cases import SUITE, all_cases
from .execute import static_op, supports


@dataclass(frozen=True)
class Column:
    label: str
    device: Device
    env: tuple[tuple[str, str], ...] = ()


#: The device descriptions of the matrix (synthetic: no device needs to be present).
COLUMNS = (
    Column("cpu", Device("cpu", 0, arch="host", name="cpu"), (("TRITON_INTERPRET", "0"),)),
    Column("cpu, TRITON_INTERPRET=1", Device("cpu", 0, arch="host", name="cpu"), (("TRITON_INTERPRET", "1"),)),
    Column("cuda sm_80", Device("cuda", 0, arch="sm_80", name="sm_80", capability=(8, 0), warp_size=32),
           (("TRITON_INTERPRET", "0"),)),
    Column("cuda sm_90", Device("cuda", 0, arch="sm_90", name="sm_90", capability=(9, 0), warp_size=32),
           (("TRITON_INTERPRET", "0"),)),
    Column("cuda sm_100", Device("cuda", 0, arch="sm_100", name="sm_100", capability=(10, 0), warp_size=32),
           (("TRITON_INTERPRET", "0"),)),
    Column("rocm gfx942", Device("rocm", 0, arch="gfx942", name="gfx942", warp_size=64),
           (("TRITON_INTERPRET", "0"),)),
    Column("opencl 1.2", Device("opencl", 0, arch="OpenCL 1.2", name="opencl"), (("TRITON_INTERPRET", "0"),)),
)


def features(case) -> list[str]:
    """The matrix rows a case counts towards."""
    if case.kind == "quant_gemv":
        g = "K" if case.group_size == case.K else str(case.group_size)
        return [f"format {case.tags[0] if case.tags else case.packing}", f"activations {case.dtype}",
                f"group size {g}", f"scales {case.scale_dtype}"]
    rows = [f"dtype {case.dtype}", f"head dim {case.D}" + (f" / {case.dv}" if case.dv != case.D else ""),
            "layout " + (f"paged {case.page_size}" if case.layout == "paged"
                         else "dense + seqlens_k" if case.seqlens_k is not None else case.layout)]
    rows.append(f"variant {case.tags[0] if case.tags else 'none'}")
    if case.return_lse:
        rows.append("return_lse")
    return rows


def builtin_backends():
    """The backends shipped in the portakern distribution (module under portakern.backends)."""
    from portakern.plugins import registry

    reg = registry()
    return [reg.backends[n] for n in sorted(reg.backends)
            if type(reg.backends[n]).__module__.startswith("portakern.backends.")]


def _answers_here(backend_names: list[str], labels: list[str], builtin_only: bool) -> dict:
    """In this process: ``{backend: {column label: {case id: [ok, reason]}}}``."""
    from portakern.plugins import registry

    pool = builtin_backends() if builtin_only else [registry().backends[n] for n in sorted(registry().backends)]
    backends = [b for b in pool if b.name in backend_names]
    cols = [c for c in COLUMNS if c.label in labels]
    ops = [(c, static_op(c)) for c in all_cases("gpu")]
    return {b.name: {col.label: {c.id: list(_ask(b, op, col.device)) for c, op in ops} for col in cols}
            for b in backends}


def _ask(b, op, device) -> tuple[bool, str]:
    s = supports(b, op, device)
    return bool(s.ok), s.reason


def matrix(backend_names: list[str], builtin_only: bool = True) -> dict:
    """``{(backend, column label): {case id: (ok, reason)}}``, one subprocess per column environment."""
    groups: dict = defaultdict(list)
    for col in COLUMNS:
        groups[col.env].append(col.label)
    out = {}
    for env_pairs, labels in groups.items():
        env = dict(os.environ, **dict(env_pairs))
        if builtin_only:
            env["PORTAKERN_DISABLE_PLUGIN_AUTOLOAD"] = "1"
        arg = json.dumps({"backends": backend_names, "columns": labels, "builtin_only": builtin_only})
        proc = subprocess.run([sys.executable, "-m", "portakern.conformance.support", "--answers", arg],
                              env=env, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"the support worker failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
        data = json.loads(proc.stdout.splitlines()[-1])
        for b, cols in data.items():
            for label, answers in cols.items():
                out[(b, label)] = {cid: (ok, why) for cid, (ok, why) in answers.items()}
    return out


def generate_markdown(builtin_only: bool = True) -> str:
    """The support matrix as Markdown (deterministic: no dates, versions or machine details)."""
    from portakern.plugins import registry

    backends = builtin_backends() if builtin_only else [registry().backends[n] for n in sorted(registry().backends)]
    cases = all_cases("gpu")
    m = matrix([b.name for b in backends], builtin_only)
    lines = [
        "# Support matrix",
        "",
        "<!-- generated by `portakern support --markdown > docs/support.md`; do not edit by hand -->",
        "",
        f"What each {'built-in ' if builtin_only else ''}backend's `supports()` answers for the {len(cases)} "
        f"cases of `{SUITE}` (cpu and gpu tiers),",
        "asked for fixed device descriptions so the page is the same on every machine. A cell is",
        "`supported / cases`. Supported is a promise to run, not a result: the conformance report of a",
        "machine (`portakern conformance`) says what passes there. Answers of the `triton` backend need",
        "torch and triton importable (the `[triton]` extra); without them every triton cell is 0. Answers of the",
        "`opencl` backend need pyopencl and an OpenCL device (the `[opencl]` extra brings PoCL); its `cpu` columns",
        "are host arrays with `backend=\"opencl\"` (copied to the OpenCL device). Answers of the `cuda` backend",
        "need cuda-bindings and NVRTC, and for attention CuTe DSL (the `[cuda]` extra); it runs on NVIDIA GPUs only,",
        "so its `cpu` columns are 0; its attention runs on sm_90 (Hopper) only.",
        "",
        "Devices: " + "; ".join(f"**{c.label}**: `{c.device.type}` arch `{c.device.arch}`"
                                + (f", capability {c.device.capability}" if c.device.capability else "")
                                + (f", warp {c.device.warp_size}" if c.device.type not in ("cpu", "opencl") else "")
                                + (f", `{'`, `'.join(f'{k}={v}' for k, v in c.env)}`" if c.env else "")
                                for c in COLUMNS) + ".",
        "",
    ]
    keys = [(b.name, c.label) for b in backends for c in COLUMNS]
    for op in ("attention", "quant_gemv"):
        op_cases = [c for c in cases if c.kind == op]
        rows: dict[str, list] = defaultdict(list)
        for c in op_cases:
            for f in features(c):
                rows[f].append(c.id)
        lines += [f"## {op}", "", "| | " + " | ".join(f"{b} @ {d}" for b, d in keys) + " |",
                  "|---|" + "---|" * len(keys)]
        lines.append(f"| **all {len(op_cases)} cases** | "
                     + " | ".join(_cell(m[k], [c.id for c in op_cases]) for k in keys) + " |")
        for f in sorted(rows, key=_row_key):
            lines.append(f"| {f} | " + " | ".join(_cell(m[k], rows[f]) for k in keys) + " |")
        lines.append("")
    lines += ["## Why not", "", "Each distinct reason a backend gave, with the number of cases and one example.", ""]
    for b, d in keys:
        reasons: Counter = Counter()
        example: dict = {}
        for cid, (ok, why) in m[(b, d)].items():
            if not ok:
                reasons[why] += 1
                example.setdefault(why, cid)
        if not reasons:
            continue
        lines += [f"### {b} @ {d}", "", "| cases | reason | example |", "|---|---|---|"]
        for why, n in sorted(reasons.items(), key=lambda kv: (-kv[1], kv[0])):
            lines.append(f"| {n} | {why.replace('|', '/')} | `{example[why]}` |")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def _cell(answers: dict, ids: list[str]) -> str:
    ok = sum(1 for i in ids if answers[i][0])
    return f"{ok}/{len(ids)}"


def _row_key(f: str):
    """Natural order: numbers numerically ("head dim 59" before "head dim 111")."""
    return [(0, int(t), "") if t.isdigit() else (1, 0, t) for t in f.split(" ")]


if __name__ == "__main__":  # worker mode: python -m portakern.conformance.support --answers JSON
    if len(sys.argv) == 3 and sys.argv[1] == "--answers":
        req = json.loads(sys.argv[2])
        print(json.dumps(_answers_here(req["backends"], req["columns"], req["builtin_only"])))
    else:
        from .cli import support_main

        raise SystemExit(support_main(sys.argv[1:]))
