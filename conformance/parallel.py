"""Parallel conformance runs (``--jobs N``).

The parent deals the case list round-robin to N "spawn" workers (CUDA cannot fork). Each worker
rebuilds the registry (plugins come from entry points and PORTAKERN_PLUGINS: os.environ is
inherited), looks the backends and cases up by name, runs its shard in order through
compile_case / run_case_all and reports over its own pipe, synchronously (no feeder thread, so
every message sent before a crash arrives):
  ("rec", i, label, failed, record)  after each record of case i (record: dataclasses.asdict)
  ("done", i)                        case i is complete
  ("crash", text)                    the worker raised: the exception's last line
When a pipe closes, the records missing from its shard become error records: the first
unfinished case is the one the worker died on.
"""

from __future__ import annotations

import threading
import traceback
from dataclasses import asdict
from typing import Any

from .goldens import Store
from .records import compile_case, run_case_all
from .report import Record
from .selection import collect_cases, resolve_backends


def check_workers_can_see(bes: list, cases: list) -> None:
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
                compile_case(case, bes, spec["targets"], prog)
            else:
                run_case_all(case, bes, spec["device"], store, spec["repeat"], prog)
            conn.send(("done", i))
    except BaseException as e:
        try:
            conn.send(("crash", traceback.format_exception_only(type(e), e)[-1].strip()))
        except Exception:
            pass
        raise
    finally:
        conn.close()


def run_parallel(spec: dict, cases: list, bes: list, jobs: int, prog) -> tuple[list[Record], bool]:
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
        absorb_sigint()   # stopping: a second Ctrl-C must not cut the workers' shutdown or the report short
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


def _absorb(signum, frame) -> None:
    """The SIGINT handler of a run that is stopping or writing its report: the signal is absorbed."""


def sigint_handler() -> Any:
    """The current SIGINT handler, to give back to ``restore_sigint``; None outside the main thread (where Python
    neither delivers signals nor lets handlers be set)."""
    import signal

    return signal.getsignal(signal.SIGINT) if threading.current_thread() is threading.main_thread() else None


def absorb_sigint() -> None:
    """From now until ``restore_sigint``, Ctrl-C is absorbed instead of raising ``KeyboardInterrupt``: the run
    already stops (or has ended) and its report is being built and written, which a second, impatient Ctrl-C must
    not cut in half. Nothing changes outside the main thread."""
    import signal

    # a handler installed outside Python (getsignal gives None) could not be put back: it is left alone
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is not None:
        signal.signal(signal.SIGINT, _absorb)


def restore_sigint(handler: Any) -> None:
    """Put back the SIGINT ``handler`` that ``sigint_handler`` returned (None: nothing to put back)."""
    import signal

    if handler is not None and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, handler)


def _fill(case, bes: list, spec: dict, recs: list[Record], reason: str, prog) -> list[Record]:
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
