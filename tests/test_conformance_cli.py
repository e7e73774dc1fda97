"""The conformance command line: a run where every record is unsupported fails, a --list glob matching nothing and
bad numbers are usage errors that name the option and the way out."""

from __future__ import annotations

import pytest

from portakern.backends.cpu.backend import CpuBackend
from portakern.plugins import hookimpl

ONE = "gemv-q8_0-g32-m1-n77-k352-fp32"


# -- a run that checks nothing does not pass --------------------------------------------------------

class Declines(CpuBackend):
    """Says no to everything, with a reason."""

    name = "declines"
    priority = -100

    def supports(self, op, device):
        from portakern.backend import no

        return no("declines: this build has no kernels for this device")


def test_a_run_where_every_record_is_unsupported_exits_1(register_plugin, tmp_path, capsys):
    from portakern.conformance import cli_main

    class P:
        @hookimpl
        def portakern_register_backends(self):
            return [Declines()]

    register_plugin(P(), name="declines")
    md = tmp_path / "r.md"
    assert cli_main(["--backend", "declines", "--cases", "gemv-q8_0-*", "--no-progress",
                     "--markdown", str(md)]) == 1
    assert "nothing ran: all 8 record(s) are unsupported" in capsys.readouterr().out
    assert "result: FAIL: nothing ran" in md.read_text()
    # one backend that ran is enough: the other's unsupported records are not failures
    assert cli_main(["--backend", "declines,cpu", "--cases", "gemv-q8_0-*", "--no-progress"]) == 0


# -- usage errors -------------------------------------------------------------------------------------

def test_list_of_a_glob_matching_nothing_is_a_usage_error(capsys):
    from portakern.conformance import cli_main

    assert cli_main(["--list", "--cases", "no-such-case-*", "--tier", "gpu"]) == 2
    assert "matches no case of cases-v3 tier gpu; list the ids with: portakern conformance --list --tier gpu" \
        in capsys.readouterr().err


@pytest.mark.parametrize("argv, fragment", [
    (["--repeat", "0"], "--repeat 0: must be >= 1 (--repeat N runs every case N times; 1 runs each once"),
    (["--jobs", "-3"], "--jobs -3: must be >= 0 (0 = one worker per CPU core; 1 runs every case in this process)"),
])
def test_bad_numbers_name_the_option_and_the_way_out(capsys, argv, fragment):
    from portakern.conformance import cli_main

    assert cli_main(["--backend", "cpu", "--cases", ONE, *argv]) == 2
    assert fragment in capsys.readouterr().err
