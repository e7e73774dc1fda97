"""The conformance runner: every selected case on every selected backend, one report.

``run(...)`` is what ``portakern conformance`` calls; it returns ``(report, exit_status)`` where
the exit status is 0 when every record passed or was unsupported (with the backend's reason) and at
least one ran, 1 when any record failed, errored, or (with ``repeat > 1``) was not bit-identical
across repeats, or when every record was unsupported (nothing was checked), and 130 on Ctrl-C.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Sequence, TextIO

from . import report as R
from .cases import SUITE
from .goldens import Store
from .parallel import absorb_sigint, check_workers_can_see, restore_sigint, run_parallel as _run_parallel, \
    sigint_handler
from .records import compile_case, run_case_all, target_device
from .report import Record
from .selection import collect_cases, resolve_backends, selected_cases


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

    def step(self, label: str, failed: bool = False, record: Record | None = None) -> None:
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

    def interrupted(self) -> None:
        """End the bar's line and say that the run stopped at Ctrl-C (the report keeps what was made)."""
        if self.enabled:
            self.stream.write(f"{chr(10) if self.tty else ''}conformance: interrupted after {self.done} of "
                              f"{self.total} records; writing what was made\n")
            self.stream.flush()


# -- the run ---------------------------------------------------------------------------------------

def run(backends: Sequence[str] | None = None, device: str | Any = "cpu", cases_glob: Sequence[str] | str | None = None,
        tier: str = "cpu", repeat: int = 1, report: str | Path | None = None, markdown: str | Path | None = None,
        junit: str | Path | None = None, compile_only: bool = False, targets: Sequence[str] | None = None,
        progress: bool = True, stream: TextIO | None | object = _STD, out: TextIO | None | object = _STD,
        golden_dir: str | Path | None = None, jobs: int = 1) -> tuple[dict, int]:
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
      jobs: worker processes (0 = one per CPU core). With more than one, the selected cases are
        dealt round-robin to that many "spawn" processes, each running its share through the same
        per-case code; the records come back merged in the serial order. A worker that dies turns
        the cases it had not finished into ``error`` records. Backends and cases must reach the
        workers through entry points or ``PORTAKERN_PLUGINS`` (not ``plugins.register``).

    Ctrl-C (``KeyboardInterrupt``) during the cases stops the run but loses nothing: the records
    made so far are printed and written to the reports, which carry ``"interrupted"``, and the
    exit status is 130.

    Returns:
      ``(report dict, exit status)``. Raises ``InvalidInputError`` for an unknown backend, device,
      tier, an empty selection or a report path that cannot be written.
    """
    from portakern.devices import Device, parse_device
    from portakern.errors import InvalidInputError

    stream = sys.stderr if stream is _STD else stream
    out = sys.stdout if out is _STD else out
    if repeat < 1:
        raise InvalidInputError(f"repeat={repeat} must be >= 1 (--repeat N runs every case N times; "
                                "1 runs each once, 2 or more also checks that the results are bit-identical)")
    if jobs < 0:
        raise InvalidInputError(f"jobs={jobs} must be >= 0 (0 = one worker per CPU core) (--jobs N; "
                                "1 runs every case in this process)")
    check_output_paths(report=report, markdown=markdown, junit=junit)
    check_golden_dir(golden_dir)
    bes = resolve_backends(backends)
    cases = selected_cases(tier, cases_glob)
    jobs = max(1, min(jobs or os.cpu_count() or 1, len(cases)))
    if jobs > 1:
        check_workers_can_see(bes, cases)
    tlist = [t.strip() for x in (targets or []) for t in x.split(",") if t.strip()]
    if compile_only:
        if not tlist:
            raise InvalidInputError("--compile-only needs --target T1,T2 (e.g. sm_100a,gfx942)")
        prog = Progress(len(cases) * len(bes) * len(tlist), stream, progress)
        dev = None
    else:
        dev = device if isinstance(device, Device) else parse_device(device)
        prog = Progress(len(cases) * len(bes), stream, progress)
    handler = sigint_handler()
    try:
        if jobs > 1:
            spec = dict(backends=[b.name for b in bes], ids=[c.id for c in cases], tier=tier, device=dev,
                        repeat=repeat, compile_only=compile_only, targets=tlist,
                        golden_dir=str(golden_dir) if golden_dir else None)
            records, interrupted = _run_parallel(spec, cases, bes, jobs, prog)
        else:
            store = None if compile_only else Store(golden_dir) if golden_dir else Store()
            records, interrupted = _run_serial(cases, bes, dev, store, repeat, tlist, prog, journal_path(report))
        absorb_sigint()   # the records are made: a further Ctrl-C must not cut the report being written in half
        return _finish(records, interrupted, prog, bes, dev, repeat, tlist, tier, compile_only, jobs, out, report,
                       markdown, junit)
    finally:
        restore_sigint(handler)


def _finish(records, interrupted, prog, bes, dev, repeat, tlist, tier, compile_only, jobs, out, report, markdown,
            junit) -> tuple[dict, int]:
    """Build the report of ``records``, print its table to ``out``, write the outputs and remove the journal."""
    if interrupted:
        prog.interrupted()
    rep = R.build(records, suite=SUITE, tier=tier, mode="compile-only" if compile_only else "run",
                  device=dev, backends=bes, repeat=repeat, targets=tlist, interrupted=interrupted,
                  expected=prog.total)
    rep = _with_jobs(rep, jobs)
    if out is not None:
        print(R.table(records), file=out)
        code = rep["exit_status"]
        stop = f" (interrupted: {len(records)} of {prog.total} records made)" if interrupted else ""
        print(f"\n{len(records)} records, exit status {code}{stop}" + (f"; report: {report}" if report else ""),
              file=out)
    write_outputs(rep, report=report, markdown=markdown, junit=junit)
    journal = journal_path(report)
    if journal is not None and journal.exists():   # the report holds every record now
        journal.unlink()
    return rep, rep["exit_status"]


class _Keep:
    """A serial run's progress: keeps every record as it is made (and appends it, as one JSON line, to the journal
    when there is one), then steps the progress bar."""

    def __init__(self, progress: Progress, journal: Path | None = None):
        self.progress, self.records = progress, []
        self.journal = journal.open("w", encoding="utf-8") if journal is not None else None

    def step(self, label: str, failed: bool = False, record: Record | None = None) -> None:
        self.records.append(record)
        if self.journal is not None and record is not None:
            self.journal.write(json.dumps(record.to_json()) + "\n")
            self.journal.flush()      # in the OS's hands: a crash of this process keeps it
        self.progress.step(label, failed, record)

    def close(self) -> None:
        if self.journal is not None:
            self.journal.close()


def journal_path(report: str | Path | None) -> Path | None:
    """Where a serial run with ``report=`` appends each record as it is made: ``<report>.partial.jsonl``, removed
    once the report is written. A run that dies (a segfault in a kernel, the machine taken away) leaves it behind
    with every record made before."""
    return Path(str(report) + ".partial.jsonl") if report else None


def _run_serial(cases: list, bes: list, dev, store: Store | None, repeat: int, targets: list[str],
                prog: Progress, journal: Path | None = None) -> tuple[list[Record], bool]:
    """Every case in this process: ``(records, interrupted)``; Ctrl-C keeps the records made so far. ``journal``:
    the file each record is appended to as it is made (``journal_path``)."""
    keep = _Keep(prog, journal)
    try:
        for case in cases:
            if store is None:
                compile_case(case, bes, targets, keep)
            else:
                run_case_all(case, bes, dev, store, repeat, keep)
    except KeyboardInterrupt:
        absorb_sigint()   # stopping: a second Ctrl-C is absorbed until the report is written
        return keep.records, True
    finally:
        keep.close()
    return keep.records, False


#: the report files of a run: (argument of ``run``, command-line option, file suffix, writer)
_OUTPUTS = (("report", "--report", ".json", R.write_json),
            ("markdown", "--markdown", ".md", lambda rep, p: Path(p).write_text(R.markdown(rep))),
            ("junit", "--junit", ".xml", lambda rep, p: Path(p).write_text(R.junit(rep))))


def check_output_paths(**paths: str | Path | None) -> None:
    """Refuse, before anything runs, report paths (``report=``, ``markdown=``, ``junit=``) that
    cannot be written, so a long run never ends in a traceback that loses its results.

    Raises:
      InvalidInputError naming the argument, its option, the path, what is wrong and the way out.
    """
    for arg, option, suffix, _ in _OUTPUTS:
        if paths.get(arg):
            _check_output_path(arg, option, suffix, Path(paths[arg]))


def _check_output_path(arg: str, option: str, suffix: str, path: Path) -> None:
    from portakern.errors import InvalidInputError

    where = f"{arg}={str(path)!r} ({option})"
    if path.is_dir():
        raise InvalidInputError(f"{where} is a directory, but the report is one file; name a file in it, "
                                f"e.g. {option} {path / ('conformance' + suffix)}")
    parent = path.parent
    if not parent.is_dir():
        raise InvalidInputError(f"{where}: the directory {parent} does not exist; create it first "
                                f"(mkdir -p {parent}) or write the report elsewhere")
    if not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise InvalidInputError(f"{where}: {path if path.exists() else parent} is not writable; "
                                "write the report to a path you may write")


def check_golden_dir(golden_dir: str | Path | None) -> None:
    """Refuse a golden directory (``golden_dir=``, ``--goldens``) that holds no golden manifest.

    Raises:
      InvalidInputError naming the argument, the directory and the way out.
    """
    from portakern.errors import InvalidInputError

    from .goldens import MANIFEST

    if golden_dir and not (Path(golden_dir) / MANIFEST).is_file():
        raise InvalidInputError(f"golden_dir={str(golden_dir)!r} (--goldens) holds no {MANIFEST}: it is not a "
                                "golden directory; name the directory that portakern goldens --force --dir wrote, "
                                "or leave the option out to use the package's goldens")


def write_outputs(rep: dict, **paths: str | Path | None) -> None:
    """Write ``rep`` as JSON (``report=``), Markdown (``markdown=``) and JUnit XML (``junit=``)."""
    for arg, _, _, writer in _OUTPUTS:
        if paths.get(arg):
            writer(rep, paths[arg])


def _with_jobs(rep: dict, jobs: int) -> dict:
    """``rep`` with ``"jobs"`` placed after ``"repeat"``."""
    out = {}
    for k, v in rep.items():
        out[k] = v
        if k == "repeat":
            out["jobs"] = jobs
    out.setdefault("jobs", jobs)
    return out


__all__ = ["Progress", "check_golden_dir", "check_output_paths", "collect_cases", "journal_path", "resolve_backends",
           "run", "selected_cases", "target_device", "write_outputs"]
