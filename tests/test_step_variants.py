"""The decode step's same-process variants (``benchmarks/step_variants.py``) off the GPU: option parsing and a
variant that cannot be built."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from step_variants import FailedVariant, _built, attention_spec  # noqa: E402


def test_a_variant_that_cannot_be_built_is_timed_as_its_error():
    """``decode_step.py``: a variant whose construction raises (a kernel that does not compile on the device)
    becomes a ``FailedVariant``: timing it raises the original error's name and text, which the run records as that
    variant's error, and the other variants still run."""
    assert _built(lambda: "built") == "built"
    failed = _built(lambda: {}["missing"])
    assert isinstance(failed, FailedVariant)
    for attempt in (failed.bytes, failed):
        with pytest.raises(RuntimeError, match=r"could not be built: KeyError: 'missing'"):
            attempt()


@pytest.mark.parametrize("spec, ok", [("release", True), ("early+o2", True), ("table", True), ("nope", False),
                                      ("early+o3", False), ("early+lm2", False)])
def test_compare_attention_takes_a_variant_and_optionally_a_deeper_linear(spec, ok):
    if ok:
        assert attention_spec(spec) == spec
    else:
        with pytest.raises(argparse.ArgumentTypeError, match=re.escape(repr(spec))):
            attention_spec(spec)
