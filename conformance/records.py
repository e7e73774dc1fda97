"""The records of one case: run on every selected backend against its golden (``run_case_all``), or lowered by every
backend for every target without the device (``compile_case``). Serial and parallel runs both make their records
here, one case at a time, and step a progress object (``step(label, failed, record)``) after each record."""

from __future__ import annotations

import re
import time
from typing import Iterable

from . import report as R
from .execute import run_case, static_op, supports
from .generate import hash_arrays
from .goldens import Store, golden_for
from .report import Record


def target_device(target: str):
    """A synthetic Device describing ``target`` (e.g. sm_100a, gfx942) for ``supports()``."""
    from portakern.devices import Device

    m = re.fullmatch(r"sm_(\d+)(\d)([af]?)", target)
    if m:
        cap = (int(m.group(1)), int(m.group(2)))
        return Device("cuda", 0, arch=target, name=f"{target} (compile-only)", capability=cap, warp_size=32)
    if target.startswith("gfx"):
        return Device("rocm", 0, arch=target, name=f"{target} (compile-only)", warp_size=64)
    return Device(target.split(":")[0], 0, arch=target, name=f"{target} (compile-only)")


def compile_case(case, backends: list, targets: list[str], progress) -> list[Record]:
    """One case lowered by every backend for every target (``progress.step`` after each record)."""
    records = []
    try:
        op = static_op(case)
    except Exception as e:
        op, why = None, f"building the op failed: {type(e).__name__}: {e}"
    for b in backends:
        for t in targets:
            rec = Record(case.id, case.kind, case.dtype, b.name, t, "error")
            if op is None:
                rec.reason = why
            elif t not in b.compile_targets:
                rec.status = "unsupported"
                rec.reason = (f"{b.name} cannot compile for {t} without the device (compile_targets: "
                              f"{', '.join(b.compile_targets) or 'none'})")
            else:
                s = supports(b, op, target_device(t))
                if not s.ok:
                    rec.status, rec.reason = "unsupported", s.reason
                else:
                    t0 = time.perf_counter()
                    try:
                        b.compile_for_target(op, t)
                        rec.status = "pass"
                    except Exception as e:
                        rec.status, rec.reason = "fail", f"compile_for_target raised {type(e).__name__}: {e}"
                    rec.time_ms = (time.perf_counter() - t0) * 1e3
            records.append(rec)
            progress.step(f"{b.name} {t} {case.id}", rec.status in R.FAILING, rec)
    return records


def run_case_all(case, backends: Iterable, device, store: Store, repeat: int, prog) -> list[Record]:
    """One case on every backend; the golden is fetched (or computed) once, on first need."""
    records = []
    try:
        inputs = case.inputs()
    except Exception as e:
        inputs, why = None, f"generating the inputs failed: {type(e).__name__}: {e}"
    memo: list = []

    def golden():
        if not memo:
            g = golden_for(case, store)
            if g.input_sha256 != hash_arrays(inputs):
                raise RuntimeError("the generated inputs differ from the golden's input_sha256: the case or "
                                   "the generator changed; regenerate the goldens (portakern goldens --force)")
            memo.append(g)
        return memo[0]

    for b in backends:
        if inputs is None:
            rec = Record(case.id, case.kind, case.dtype, b.name, str(device), "error", reason=why)
        else:
            rec = run_case(case, inputs, golden, b, device, repeat)
        records.append(rec)
        prog.step(f"{b.name} {case.id}", rec.status in R.FAILING, rec)
    return records
