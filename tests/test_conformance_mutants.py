"""The conformance suite has teeth: each planted bug (``conformance_mutants``) yields failing records
that name the case, and the mutants still pass the cases their bug cannot affect."""

from __future__ import annotations

import pytest

from conformance_mutants import MutantPlugin
from portakern.conformance.runner import run


@pytest.fixture
def mutants(register_plugin):
    """Every mutant backend registered through the public plugin API, for one test."""
    register_plugin(MutantPlugin(), name="conformance-mutants")
    yield
    # fresh_registry (behind register_plugin) restores the hand-registered list and resets


def _records(backend: str, cases: str) -> list[dict]:
    report, code = run(backends=[backend], device="cpu", cases_glob=cases, progress=False, out=None)
    assert report["results"], f"{cases} selected no case"
    return report["results"]


def _failing(records):
    return [r for r in records if r["status"] == "fail"]


# (mutant, cases it must fail, what the failure must mention)
CAUGHT = [
    ("mutant-topleft-causal", "attn-d64-sq24-sk300-*-causal-*,attn-*-paged*-causal-*", "max |out - gold|"),
    ("mutant-unwritten", "attn-d32-sq48-sk48-*-none-*,attn-d96-sq33-*-softcap-*,gemv-q8_0-*", "nan"),
    ("mutant-nan-masked", "attn-*-rowmask-*,attn-*-lens-*,attn-*varlen-vB-*", "nan"),
    ("mutant-group-off-by-one", "gemv-native4a-g32-*,gemv-gptq-gidx-g64-*,gemv-q4_0-*", ""),
    ("mutant-awq-nibbles", "gemv-awq-*", "max |out - gold|"),
]


@pytest.mark.parametrize("mutant, cases, mention", CAUGHT, ids=[c[0] for c in CAUGHT])
def test_mutant_is_caught_on_every_case_it_breaks(mutants, mutant, cases, mention):
    records = _records(mutant, cases)
    bad = _failing(records)
    assert bad, f"{mutant} passed every case of {cases}: the suite missed the bug"
    for r in bad:
        assert r["case"] and r["backend"] == mutant and r["reason"]
        assert mention.lower() in r["reason"].lower()
    # every selected case exercises the bug: all of them must fail
    assert len(bad) == len(records), [r["case"] for r in records if r["status"] != "fail"]


@pytest.mark.parametrize("mutant, cases", [
    ("mutant-topleft-causal", "attn-d32-sq48-sk48-*-causal-*,attn-*-none-*"),   # Sq == Sk, or no mask
    ("mutant-nan-masked", "attn-d64-sq24-sk300-*-causal-*,attn-*-sq1-sk4096-*"),  # no fully masked rows
    ("mutant-group-off-by-one", "gemv-*-gK-*"),                                # one group: no neighbour
    ("mutant-awq-nibbles", "gemv-gptq-g32-*,gemv-native4a-g32-*"),             # not AWQ
])
def test_mutant_passes_where_its_bug_is_invisible(mutants, mutant, cases):
    records = _records(mutant, cases)
    assert all(r["status"] == "pass" for r in records), _failing(records)[:3]


def test_unwritten_element_fails_only_because_outputs_are_poisoned(mutants):
    """Without NaN poisoning the missing element would hold whatever the allocator left there."""
    import numpy as np

    import portakern
    from portakern.conformance.cases import all_cases, select
    from portakern.dispatch import poison_outputs

    case = select(all_cases(), "attn-d32-sq48-sk48-*-causal-fp32*")[0]
    inp = case.inputs()
    with poison_outputs():
        out = portakern.attention(inp["q"], inp["k"], inp["v"], causal=True, backend="mutant-unwritten")
    assert np.isnan(out.reshape(-1)[-1]) and np.isfinite(out.reshape(-1)[:-1]).all()
