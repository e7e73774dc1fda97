"""The conformance runner: every selected case on every selected backend, one report.

``run(...)`` is what ``portakern conformance`` calls; it returns ``(report, exit_status)`` where
the exit status is 0 when every record passed or was unsupported (with the backend's reason), and
1 when any record failed, errored, or (with ``repeat > 1``) was not bit-identical across repeats.
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path
from typing import Any, Iterable, Sequence, TextIO

from . import report as R
from .cases import SUITE, all_cases, select
from .execute import run_case, static_op, supports
from .goldens import Store, golden_for
from .generate import hash_arrays
from .report import Record


_STD = object()   # "the current sys.stdout / sys.stderr", resolved at call time


class Progress:
    """A plain-text progress bar on stderr (a line per 10% when stderr is not a terminal)."""

    def __init__(self, total: int, stream: TextIO | None, enabled: bool = True):
        self.total, self.stream, self.enabled = max(total, 1), stream, enabled and stream is not None
        self.tty = bool(self.enabled and getattr(stream, "isatty", lambda: False)())
        self.t0 = time.perf_counter()
        self.done = 0
        self.failed = 0
        self._next_line = 0.1

    def step(self, label: str, failed: bool = False) -> None:
        self.done += 1
        self.failed += failed
        if not self.enabled:
            return
        frac = self.done / self.total
        secs = time.perf_counter() - self.t0
        if self.tty:
            bar = "#" * int(frac * 30)
            text = f"\r[{bar:<30}] {self.done}/{self.total} {secs:5.0f}s fail {self.failed}  {label}"
            self.stream.write(text[:118].ljust(118))
            if self.done == self.total:
                self.stream.write("\n")
            self.stream.flush()
        elif frac >= self._next_line or self.done == self.total:
            self._next_line = (int(frac * 10) + 1) / 10
            self.stream.write(f"conformance: {self.done}/{self.total} ({frac:4.0%}) {secs:.0f}s, "
                              f"{self.failed} failing\n")
            self.stream.flush()


def resolve_backends(names: Sequence[str] | None):
    """Backend objects for ``names`` (comma lists allowed); every registered backend when empty."""
    from portakern.plugins import registry

    reg = registry()
    flat = [n.strip() for x in (names or []) for n in x.split(",") if n.strip()]
    if not flat:
        return [reg.backends[n] for n in sorted(reg.backends)]
    return [reg.get(n) for n in dict.fromkeys(flat)]


def collect_cases(tier: str = "cpu", patterns: Sequence[str] | str | None = None) -> list:
    """The cases of ``tier`` plus those plugins add (``portakern_conformance_cases``), filtered."""
    from portakern.plugins import registry

    cases = all_cases(tier)
    seen = {c.id for c in cases}
    for extra in registry().pm.hook.portakern_conformance_cases():
        for c in extra or []:
            if getattr(c, "id", None) and c.id not in seen:
                cases.append(c)
                seen.add(c.id)
    return select(cases, patterns)


# -- target devices for compile-only ----------------------------------------------------------------

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


def compile_records(cases: list, backends: list, targets: list[str], progress: Progress) -> list[Record]:
    records = []
    for case in cases:
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
                progress.step(f"{b.name} {t} {case.id}", rec.status in R.FAILING)
    return records


# -- the run ---------------------------------------------------------------------------------------

def run(backends: Sequence[str] | None = None, device: str | Any = "cpu", cases_glob: Sequence[str] | str | None = None,
        tier: str = "cpu", repeat: int = 1, report: str | Path | None = None, markdown: str | Path | None = None,
        junit: str | Path | None = None, compile_only: bool = False, targets: Sequence[str] | None = None,
        progress: bool = True, stream: TextIO | None | object = _STD, out: TextIO | None | object = _STD,
        golden_dir: str | Path | None = None) -> tuple[dict, int]:
    """Run the conformance suite and write the requested reports.

    Args:
      backends: backend names (comma lists allowed); default every registered backend.
      device: "cpu", "cuda:0", ... or a ``portakern.Device`` (ignored with ``compile_only``).
      cases_glob: glob(s) over case ids, e.g. ``"attn-*-paged*"``; default every case of the tier.
      tier: "cpu" (checked-in goldens) or "gpu" (adds production shapes; goldens computed on the fly).
      repeat: run each case N times; results that are not bit-identical are "nondeterministic".
      report, markdown, junit: paths to write the JSON report, Markdown matrix, JUnit XML.
      compile_only, targets: lower every case with ``compile_for_target`` for each target instead
        of running (status pass = lowered); backends that do not list a target report unsupported.
      progress: draw the progress bar on ``stream`` (default stderr); ``out`` (default stdout)
        receives the final summary table; None silences either.

    Returns:
      ``(report dict, exit status)``. Raises ``InvalidInputError`` for an unknown backend, device,
      tier or an empty selection.
    """
    from portakern.devices import Device, parse_device
    from portakern.errors import InvalidInputError

    stream = sys.stderr if stream is _STD else stream
    out = sys.stdout if out is _STD else out
    if repeat < 1:
        raise InvalidInputError(f"repeat={repeat} must be >= 1")
    bes = resolve_backends(backends)
    cases = collect_cases(tier, cases_glob)
    if not cases:
        raise InvalidInputError(f"cases={cases_glob!r} matches no case of {SUITE} tier {tier}; "
                                "list the ids with: portakern conformance --list")
    tlist = [t.strip() for x in (targets or []) for t in x.split(",") if t.strip()]
    if compile_only:
        if not tlist:
            raise InvalidInputError("--compile-only needs --target T1,T2 (e.g. sm_100a,gfx942)")
        prog = Progress(len(cases) * len(bes) * len(tlist), stream, progress)
        records = compile_records(cases, bes, tlist, prog)
        dev = None
    else:
        dev = device if isinstance(device, Device) else parse_device(device)
        store = Store(golden_dir) if golden_dir else Store()
        prog = Progress(len(cases) * len(bes), stream, progress)
        records = []
        for case in cases:
            records += _run_case_all(case, bes, dev, store, repeat, prog)
    rep = R.build(records, suite=SUITE, tier=tier, mode="compile-only" if compile_only else "run",
                  device=dev, backends=bes, repeat=repeat, targets=tlist)
    if report:
        R.write_json(rep, report)
    if markdown:
        Path(markdown).write_text(R.markdown(rep))
    if junit:
        Path(junit).write_text(R.junit(rep))
    if out is not None:
        print(R.table(records), file=out)
        code = rep["exit_status"]
        print(f"\n{len(records)} records, exit status {code}" + (f"; report: {report}" if report else ""), file=out)
    return rep, rep["exit_status"]


def _run_case_all(case, backends: Iterable, device, store: Store, repeat: int, prog: Progress) -> list[Record]:
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
        prog.step(f"{b.name} {case.id}", rec.status in R.FAILING)
    return records
