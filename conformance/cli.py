"""Command-line entry points of the conformance tools, called by ``portakern.cli``:

``cli_main(argv)``      ``portakern conformance ...``
``support_main(argv)``  ``portakern support ...``
``goldens_main(argv)``  ``portakern goldens ...`` (also ``python -m portakern.conformance.goldens``)

Each takes the arguments after the subcommand and returns the exit status: 0 success, 1 the job
found a problem (a failing case, stale goldens or support matrix), 2 usage error.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from portakern.cli import ArgumentParser

from .report import EXIT_INTERRUPTED

_RUN_EPILOG = """\
examples:
  portakern conformance --backend cpu --device cpu --report r.json
  portakern conformance --backend triton --device cuda:0 --tier gpu --report h200.json --markdown h200.md
  portakern conformance --backend theirs --cases 'attn-*-paged*' --repeat 3
  portakern conformance --compile-only --target sm_90a,sm_100a,gfx942 --backend triton,triton-rocm --report aot.json
  portakern conformance --list --cases 'gemv-awq-*'
  portakern conformance --backend triton --device cuda:0 --jobs 0        one worker per CPU core
  portakern conformance --backend opencl --device opencl:0 --jobs 0      pyopencl arrays on an OpenCL device

status per record: pass | fail | error | nondeterministic | unsupported (with the backend's reason).
exit status: 0 every record passed or was unsupported, and at least one ran;
  1 any fail, error or nondeterministic record, or none ran (every record unsupported: nothing was
    checked; the distinct reasons are printed on stderr);
  2 usage error (unknown backend or device, no case matched, a report path that cannot be written,
    a --target no selected backend compiles for);
  130 interrupted (Ctrl-C): the records made so far are still printed and written to the reports,
    marked "interrupted".
"""


def _run_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="portakern conformance", formatter_class=argparse.RawDescriptionHelpFormatter, epilog=_RUN_EPILOG,
        description="Run the conformance suite (cases-v3) on backends and compare every output with the "
                    "float64 CPU-reference goldens. Tolerance: max|out - gold| <= 2 * naive error + floor "
                    "(see docs/conformance.md).")
    p.add_argument("--backend", action="extend", nargs="+", metavar="NAME", default=[],
                   help="backend(s) to check; repeat or comma-separate (default: every registered backend)")
    p.add_argument("--device", default="cpu",
                   help="device to run on: cpu, cuda, cuda:1, opencl:0, ... (default cpu)")
    p.add_argument("--cases", action="append", metavar="GLOB", default=[],
                   help="only cases whose id matches GLOB (repeat or comma-separate), e.g. 'attn-d128-*'")
    p.add_argument("--tier", choices=("cpu", "gpu"), default="cpu",
                   help="cpu: the checked-in tier; gpu: adds production-sized cases whose goldens are "
                        "computed by the CPU reference on first use and cached (default cpu)")
    p.add_argument("--repeat", type=int, default=1, metavar="N",
                   help="run every case N times; results not bit-identical are flagged nondeterministic")
    p.add_argument("--report", metavar="PATH.json", help="write the JSON report here")
    p.add_argument("--markdown", metavar="PATH.md", help="write the Markdown op x backend matrix here")
    p.add_argument("--junit", metavar="PATH.xml", help="write JUnit XML here (one testcase per case)")
    p.add_argument("--compile-only", action="store_true",
                   help="do not run: lower every case for each --target (status pass = it lowered)")
    p.add_argument("--target", action="append", metavar="T1,T2", default=[],
                   help="compile-only targets, e.g. sm_90a,sm_100a,gfx942")
    p.add_argument("--jobs", "-j", type=int, default=1, metavar="N",
                   help="run the cases in N worker processes (0: one per CPU core; default 1, no workers). "
                        "Kernel compilation dominates a run, so this is the way to speed one up")
    p.add_argument("--list", action="store_true", help="list the selected cases and exit")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument("--goldens", metavar="DIR",
                   help="compare with the goldens in DIR (a directory holding manifest.json, as written by "
                        "portakern goldens --force --dir DIR; default: the package's cpu-tier goldens)")
    return p


def _usage(prog: str, err: Exception | str) -> int:
    print(f"{prog}: {err}", file=sys.stderr)
    return 2


def _output_problem(option: str, path: str, example: str) -> str | None:
    """Why ``path`` (the value of ``option``) cannot be written as one file, or None if it can."""
    from pathlib import Path

    p = Path(path)
    if p.is_dir():
        return f"{option} {path}: is a directory; name a file, e.g. {option} {p / example}"
    if not p.parent.is_dir():
        return (f"{option} {path}: the directory {p.parent} does not exist; create it first "
                f"(mkdir -p {p.parent}) or write elsewhere")
    return None


def _input_problem(option: str, path: str, what: str, example: str) -> str | None:
    """Why ``path`` (the value of ``option``) cannot be read as one file, or None if it can."""
    from pathlib import Path

    p = Path(path)
    if p.is_dir():
        return f"{option} {path}: is a directory; name {what}, e.g. {option} {example}"
    if not p.exists():
        return f"{option} {path}: no such file; name {what}, e.g. {option} {example}"
    return None


def _shared_report_path(*options: tuple[str, str | None]) -> str | None:
    """The usage error when two report options name one file (the later writer would replace the
    earlier without a word), or None."""
    from pathlib import Path

    seen: dict[Path, str] = {}
    for option, value in options:
        if not value:
            continue
        key = Path(value).resolve()
        if key in seen:
            return f"{seen[key]} and {option} name the same file ({value}); give each report its own path"
        seen[key] = option
    return None


def _unknown_target(backends: list[str], targets: list[str]) -> str | None:
    """The usage error for the first ``--target`` that no selected backend lists in
    ``compile_targets`` (a typo such as sm90a), or None when every target has a backend."""
    from .runner import resolve_backends

    bes = resolve_backends(backends)
    for t in (t.strip() for x in targets for t in x.split(",") if t.strip()):
        if not any(t in b.compile_targets for b in bes):
            known = "; ".join(f"{b.name}: {', '.join(b.compile_targets) or 'none'}" for b in bes)
            return (f"--target {t}: no selected backend compiles for it ({known}); "
                    "pick targets from those lists, or add a --backend that compiles for it")
    return None


def _check_run_options(args: argparse.Namespace) -> None:
    """Refuse, before anything runs (or is listed), a value of ``portakern conformance`` that would narrow,
    widen or break the run: an empty or unknown backend, case glob, target or device, a bad count, a golden
    directory without a readable manifest. Each error names the option as typed.

    Raises:
      UsageError naming the option, the value, the rule and the way out.
    """
    from pathlib import Path

    from portakern import cli_checks
    from portakern.cli_checks import UsageError

    from . import goldens as G
    from .cases import SUITE
    from .selection import collect_cases

    cli_checks.backends("--backend", args.backend)
    patterns = cli_checks.name_list("--cases", args.cases, "'attn-d128-*'")
    cli_checks.name_list("--target", args.target, "sm_90a,gfx942")
    if patterns and not collect_cases(args.tier, patterns):
        raise UsageError(f"--cases {','.join(patterns)}: matches no case of {SUITE} tier {args.tier}; "
                         f"list the ids with: portakern conformance --list --tier {args.tier}")
    if not args.compile_only:
        cli_checks.device("--device", args.device)
    if args.repeat < 1:
        raise UsageError(f"--repeat {args.repeat}: must be >= 1 (--repeat N runs every case N times; "
                         "1 runs each once, 2 or more also checks that the results are bit-identical)")
    if args.jobs < 0:
        raise UsageError(f"--jobs {args.jobs}: must be >= 0 (0 = one worker per CPU core; "
                         "1 runs every case in this process)")
    if args.goldens:
        manifest = Path(args.goldens) / G.MANIFEST
        if not manifest.is_file():
            raise UsageError(f"--goldens {args.goldens}: holds no {G.MANIFEST}, so it is not a golden directory; "
                             "name the directory that portakern goldens --force --dir wrote, or leave --goldens "
                             "out to use the package's goldens")
        try:
            G.read_manifest(manifest)
        except G.GoldenError as e:
            raise UsageError(f"--goldens {args.goldens}: {e}; or leave --goldens out to use the package's "
                             "goldens") from None


def _print_reasons_if_nothing_ran(results: list[dict], limit: int = 5) -> None:
    """When every record is unsupported, print (on stderr) the distinct reasons with their counts,
    so the summary's "read the reasons" can be done without opening a report."""
    from collections import Counter

    if not results or any(r.get("status") != "unsupported" for r in results):
        return
    reasons = Counter((r.get("backend"), r.get("reason") or "no reason given") for r in results)
    print("unsupported reasons:", file=sys.stderr)
    for (backend, reason), n in reasons.most_common(limit):
        print(f"  {n} x {backend}: {reason}", file=sys.stderr)
    if len(reasons) > limit:
        print(f"  ... {len(reasons) - limit} more distinct reason(s) (see --report / --markdown)", file=sys.stderr)


def cli_main(argv: Sequence[str] | None = None) -> int:
    """``portakern conformance [--backend NAME ...] [--device DEV] [--cases GLOB] [--tier cpu|gpu]
    [--repeat N] [--report PATH.json] [--markdown PATH.md] [--junit PATH.xml]
    [--compile-only --target T1,T2] [--jobs N] [--list]``. Returns the exit status."""
    from portakern.cli_checks import UsageError
    from portakern.errors import PortakernError

    from .runner import run, selected_cases

    p = _run_parser()
    try:
        args = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    except SystemExit as e:
        return int(e.code or 0)
    if args.target and not args.compile_only:
        return _usage(p.prog, ValueError("--target is only meaningful with --compile-only"))
    try:
        _check_run_options(args)
        if args.list:
            cases = selected_cases(args.tier, args.cases or None)
            for c in cases:
                print(f"{c.id}\t{c.kind}\t{c.dtype}\t{c.tier}")
            print(f"{len(cases)} case(s)", file=sys.stderr)
            return 0
        problem = _shared_report_path(("--report", args.report), ("--markdown", args.markdown),
                                      ("--junit", args.junit))
        if problem:
            return _usage(p.prog, problem)
        if args.compile_only:
            problem = _unknown_target(args.backend, args.target)
            if problem:
                return _usage(p.prog, problem)
        rep, code = run(backends=args.backend, device=args.device, cases_glob=args.cases or None, tier=args.tier,
                        repeat=args.repeat, report=args.report, markdown=args.markdown, junit=args.junit,
                        compile_only=args.compile_only, targets=args.target, progress=not args.no_progress,
                        golden_dir=args.goldens, jobs=args.jobs)
        _print_reasons_if_nothing_ran(rep.get("results", []))
        return code
    except (PortakernError, UsageError) as e:
        return _usage(p.prog, e)
    except KeyboardInterrupt:   # before the first case ran (a run in progress writes its report)
        print(f"{p.prog}: interrupted (Ctrl-C) before any case ran; nothing was written", file=sys.stderr)
        return EXIT_INTERRUPTED


def support_main(argv: Sequence[str] | None = None) -> int:
    """``portakern support [--markdown] [--output PATH] [--check PATH] [--all-backends]``."""
    from .support import generate_markdown

    p = ArgumentParser(
        prog="portakern support", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Generate the support matrix from every backend's supports() over the conformance "
                    "cases, for a fixed set of device descriptions (so the result is the same on any machine).",
        epilog="examples:\n  portakern support --markdown > docs/support.md\n"
               "  portakern support --check docs/support.md     exit 1 when the file is stale")
    p.add_argument("--markdown", action="store_true", help="print Markdown (the only format; accepted for clarity)")
    p.add_argument("--output", metavar="PATH", help="write to PATH instead of stdout")
    p.add_argument("--check", metavar="PATH", help="compare with PATH; exit 1 (with a diff) when it is stale")
    p.add_argument("--all-backends", action="store_true",
                   help="include third-party plugin backends (default: the built-in backends only)")
    try:
        args = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    except SystemExit as e:
        return int(e.code or 0)
    problem = ((args.check and _input_problem("--check", args.check, "the support matrix file", "docs/support.md"))
               or (args.output and _output_problem("--output", args.output, "support.md")))
    if problem:
        return _usage(p.prog, problem)
    text = generate_markdown(builtin_only=not args.all_backends)
    if args.check:
        import difflib
        from pathlib import Path

        try:
            old = Path(args.check).read_text()
        except OSError as e:
            return _usage(p.prog, f"--check {args.check}: cannot be read ({e})")
        if old == text:
            print(f"{args.check} is up to date")
            return 0
        sys.stdout.writelines(difflib.unified_diff(old.splitlines(True), text.splitlines(True),
                                                   args.check, "generated", n=1))
        print(f"\n{args.check} is stale: regenerate with  portakern support --markdown --output {args.check}")
        return 1
    if args.output:
        from pathlib import Path

        try:
            Path(args.output).write_text(text)
        except OSError as e:
            return _usage(p.prog, f"--output {args.output}: cannot be written ({e}); write elsewhere")
    else:
        sys.stdout.write(text)
    return 0


def goldens_main(argv: Sequence[str] | None = None) -> int:
    """``portakern goldens [--force] [--check] [--cases GLOB] [--dir DIR]``."""
    from pathlib import Path

    from . import goldens as G
    from .cases import all_cases, select

    p = ArgumentParser(
        prog="portakern goldens", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Recompute the cpu-tier goldens with the float64 CPU reference and compare them with the "
                    "stored ones. Prints what changed; overwrites only with --force.",
        epilog="examples:\n  portakern goldens                 show what would change (exit 1 if anything)\n"
               "  portakern goldens --force         write the new goldens\n"
               "  portakern goldens --check         verify the reference reproduces the stored goldens\n"
               "  python -m portakern.conformance.goldens --force")
    p.add_argument("--force", action="store_true", help="overwrite the stored goldens")
    p.add_argument("--check", action="store_true",
                   help="verify the stored goldens (sha256 manifest, and that the reference reproduces them)")
    p.add_argument("--cases", action="append", metavar="GLOB", default=[], help="only these cases")
    p.add_argument("--dir", metavar="DIR", help="golden directory (default: the package's conformance/data)")
    try:
        args = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    except SystemExit as e:
        return int(e.code or 0)
    if args.dir and Path(args.dir).exists() and not Path(args.dir).is_dir():
        return _usage(p.prog, f"--dir {args.dir}: is a file, not a golden directory; name a directory "
                              "(--force creates it), or leave --dir out to use the package's goldens")
    if args.force and args.check:
        return _usage(p.prog, "--force and --check exclude each other: --check verifies the stored goldens, "
                              "--force rewrites them; run one, then the other")
    cases = select(all_cases("cpu"), args.cases or None)
    if not cases:
        return _usage(p.prog, ValueError(f"--cases {args.cases} matches no cpu-tier case"))
    try:
        return _goldens_job(args, cases)
    except G.GoldenError as e:   # a manifest that cannot be read: name the option that chose it
        return _usage(p.prog, f"--dir {args.dir}: {e}" if args.dir else e)


def _goldens_job(args: argparse.Namespace, cases: list) -> int:
    """Check (``--check``) or regenerate the goldens of ``cases`` (the body of ``portakern goldens``)."""
    from . import goldens as G

    if args.check:
        store = G.Store(args.dir)
        if not (store.directory / G.MANIFEST).is_file():
            return _usage("portakern goldens", ValueError(f"--dir {store.directory} holds no {G.MANIFEST}, so there is nothing to "
                                             "check; name a golden directory, or write one there with --force"))
        problems = store.verify_sha() + G.verify(cases, store)
        for line in problems:
            print(line)
        print(f"{len(cases)} case(s) checked: {'OK' if not problems else f'{len(problems)} problem(s)'}")
        return 1 if problems else 0
    return G.regenerate(cases, args.dir, force=args.force)
