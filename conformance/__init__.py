"""The conformance suite: versioned cases, golden outputs, the runner, reports, the pytest plugin.

Entry points the ``portakern`` CLI calls (each takes the arguments after the subcommand and
returns an exit status):

* ``cli_main(argv)``      ``portakern conformance``
* ``support_main(argv)``  ``portakern support``
* ``goldens_main(argv)``  ``portakern goldens``

From Python: ``portakern.conformance.run(backends=["cpu"], device="cpu")`` returns
``(report, exit_status)``. See ``docs/conformance.md``.

Imports are lazy: the pytest plugin loads this package in every pytest run of the environment.
"""

from __future__ import annotations

SUITE_VERSION = "cases-v3"

__all__ = ["SUITE_VERSION", "cli_main", "goldens_main", "run", "support_main"]


def cli_main(argv=None) -> int:
    from .cli import cli_main as f

    return f(argv)


def support_main(argv=None) -> int:
    from .cli import support_main as f

    return f(argv)


def goldens_main(argv=None) -> int:
    from .cli import goldens_main as f

    return f(argv)


def run(*args, **kwargs):
    """See ``portakern.conformance.runner.run``."""
    from .runner import run as f

    return f(*args, **kwargs)
