"""The conformance runner: every selected case on every selected backend, one report.

``run(...)`` is what ``portakern conformance`` calls; it returns ``(report, exit_status)`` where
the exit status is 0 when every record passed or was unsupported (with the backend's reason) and at
least one ran, 1 when any record failed, errored, or (with ``repeat > 1``) was not bit-identical
across repeats, or when every record was unsupported (nothing was checked), and 130 on Ctrl-C.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
import traceback
from dataclasses import asdict
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


def selected_cases(tier: str, patterns: Sequence[str] | str | None) -> list:
    """``collect_cases(tier, patterns)``, refusing a selection of no case (a run of nothing).

    Raises:
      InvalidInputError naming the globs, the tier and how to list the ids.
    """
    from portakern.errors import InvalidInputError

    cases = collect_cases(tier, patterns)
    if not cases:
        raise InvalidInputError(f"cases={patterns!r} matches no case of {SUITE} tier {tier}; "
                                f"list the ids with: portakern conformance --list --tier {tier}")
    return cases


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


def _compile_case(case, backends: list, targets: list[str], progress) -> list[Record]:
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
        _check_workers_can_see(bes, cases)
    tlist = [t.strip() for x in (targets or []) for t in x.split(",") if t.strip()]
    if compile_only:
        if not tlist:
            raise InvalidInputError("--compile-only needs --target T1,T2 (e.g. sm_100a,gfx942)")
        prog = Progress(len(cases) * len(bes) * len(tlist), stream, progress)
        dev = None
    else:
        dev = device if isinstance(device, Device) else parse_device(device)
        prog = Progress(len(cases) * len(bes), stream, progress)
    if jobs > 1:
        spec = dict(backends=[b.name for b in bes], ids=[c.id for c in cases], tier=tier, device=dev,
                    repeat=repeat, compile_only=compile_only, targets=tlist,
                    golden_dir=str(golden_dir) if golden_dir else None)
        records, interrupted = _run_parallel(spec, cases, bes, jobs, prog)
    else:
        store = None if compile_only else Store(golden_dir) if golden_dir else Store()
        records, interrupted = _run_serial(cases, bes, dev, store, repeat, tlist, prog, journal_path(report))
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
                _compile_case(case, bes, targets, keep)
            else:
                _run_case_all(case, bes, dev, store, repeat, keep)
    except KeyboardInterrupt:
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
        prog.step(f"{b.name} {case.id}", rec.status in R.FAILING, rec)
    return records


# -- parallel runs (--jobs N) ------------------------------------------------------------------------
#
# The parent deals the case list round-robin to N "spawn" workers (CUDA cannot fork). Each worker
# rebuilds the registry (plugins come from entry points and PORTAKERN_PLUGINS: os.environ is
# inherited), looks the backends and cases up by name, runs its shard in order through
# _compile_case / _run_case_all and reports over its own pipe, synchronously (no feeder thread, so
# every message sent before a crash arrives):
#   ("rec", i, label, failed, record)  after each record of case i (record: dataclasses.asdict)
#   ("done", i)                        case i is complete
#   ("crash", text)                    the worker raised: the exception's last line
# When a pipe closes, the records missing from its shard become error records: the first
# unfinished case is the one the worker died on.


def _with_jobs(rep: dict, jobs: int) -> dict:
    """``rep`` with ``"jobs"`` placed after ``"repeat"``."""
    out = {}
    for k, v in rep.items():
        out[k] = v
        if k == "repeat":
            out["jobs"] = jobs
    out.setdefault("jobs", jobs)
    return out


def _check_workers_can_see(bes: list, cases: list) -> None:
    """Refuse (usage error) backends or cases that exist only in this process (``plugins.register``)."""
    from portakern import plugins
    from portakern.errors import InvalidInputError

    reg = plugins.registry()
    manual = {name for name, src in reg.plugins.items() if src == "manual"}
    local = [b.name for b in bes if reg.origins.get(b.name) in manual]
    ids = {c.id for c in cases}
    for name, obj in plugins._manual:
        hook = getattr(obj, "portakern_conformance_cases", None)
        if hook is not None and name in manual:
            try:
                local += [c.id for c in hook() or [] if getattr(c, "id", None) in ids]
            except Exception:
                pass
    if local:
        raise InvalidInputError(f"jobs > 1: {', '.join(local)} were registered by hand in this process, which "
                                "the worker processes cannot see; load the plugin through PORTAKERN_PLUGINS or "
                                "an entry point, or use one job")


class _PipeProgress:
    """The worker's progress: every record goes to the parent as it is made."""

    def __init__(self, conn):
        self.conn, self.case = conn, -1

    def step(self, label: str, failed: bool = False, record: Record | None = None) -> None:
        self.conn.send(("rec", self.case, label, bool(failed), asdict(record)))


def _worker(conn, spec: dict, shard: list[int]) -> None:
    """Entry point of a worker process: run the cases ``shard`` (indices into ``spec["ids"]``).

    Ctrl-C is the parent's to handle (it keeps the records received and stops the workers), so a
    worker ignores SIGINT: the terminal sends it to the whole process group.
    """
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        bes = resolve_backends(spec["backends"])
        known = {c.id: c for c in collect_cases(spec["tier"], None)}
        prog = _PipeProgress(conn)
        store = None
        if not spec["compile_only"]:
            store = Store(spec["golden_dir"]) if spec["golden_dir"] else Store()
        for i in shard:
            case = known.get(spec["ids"][i])
            if case is None:
                raise RuntimeError(f"case {spec['ids'][i]} is unknown in the worker process (a plugin registered "
                                   "by hand?); load plugins through PORTAKERN_PLUGINS or an entry point")
            prog.case = i
            if spec["compile_only"]:
                _compile_case(case, bes, spec["targets"], prog)
            else:
                _run_case_all(case, bes, spec["device"], store, spec["repeat"], prog)
            conn.send(("done", i))
    except BaseException as e:
        try:
            conn.send(("crash", traceback.format_exception_only(type(e), e)[-1].strip()))
        except Exception:
            pass
        raise
    finally:
        conn.close()


def _run_parallel(spec: dict, cases: list, bes: list, jobs: int, prog: Progress) -> tuple[list[Record], bool]:
    """Run ``cases`` in ``jobs`` spawned workers: ``(records in the serial order, interrupted)``.

    On Ctrl-C the workers are stopped and the records received so far are kept (no error records
    stand in for the cases that were not run).
    """
    import multiprocessing as mp
    from multiprocessing.connection import wait

    ctx = mp.get_context("spawn")
    shards = [list(range(k, len(cases), jobs)) for k in range(jobs)]
    got: dict[int, list[Record]] = {}
    done: set[int] = set()
    crash: dict[int, str] = {}
    procs, readers = [], {}
    interrupted = False
    try:
        for k, shard in enumerate(shards):
            r, w = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_worker, args=(w, spec, shard), name=f"portakern-conformance-{k}", daemon=True)
            p.start()
            w.close()     # the parent's copy: the pipe reads EOF once the worker has gone
            procs.append(p)
            readers[r] = k
        while readers:
            for r in wait(list(readers)):
                try:
                    msg = r.recv()
                except (EOFError, OSError):
                    r.close()
                    del readers[r]
                    continue
                if msg[0] == "rec":
                    got.setdefault(msg[1], []).append(Record(**msg[4]))
                    prog.step(msg[2], msg[3])
                elif msg[0] == "done":
                    done.add(msg[1])
                elif msg[0] == "crash":
                    crash[readers[r]] = msg[1]
        for p in procs:
            p.join()
    except KeyboardInterrupt:
        interrupted = True
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(5)
    records = []
    for i, case in enumerate(cases):
        recs = got.get(i, [])
        if i not in done and not interrupted:
            k = i % jobs
            why = crash.get(k) or f"exit status {procs[k].exitcode}"
            first = next(j for j in shards[k] if j not in done)
            reason = (f"worker process {k} of {jobs} died ({why}) while running this case" if i == first else
                      f"not run: worker process {k} of {jobs} died ({why}) while running {cases[first].id}")
            recs = _fill(case, bes, spec, recs, reason, prog)
        records += recs
    return records, interrupted


def _fill(case, bes: list, spec: dict, recs: list[Record], reason: str, prog: Progress) -> list[Record]:
    """The records of an unfinished case in the serial order: those received, errors for the rest."""
    where = spec["targets"] if spec["compile_only"] else [str(spec["device"])]
    have = {(r.backend, r.device): r for r in recs}
    out = []
    for b in bes:
        for t in where:
            rec = have.get((b.name, t))
            if rec is None:
                rec = Record(case.id, case.kind, case.dtype, b.name, t, "error", reason=reason)
                prog.step(f"{b.name} {t} {case.id}" if spec["compile_only"] else f"{b.name} {case.id}", True)
            out.append(rec)
    return out
