"""Bad inputs on every public API, at least 40 per API (the tables: tests/faults/bad_input_tables.py).

Each case asserts the exact portakern error type (also the builtin a caller expects: ``ValueError`` for
``InvalidInputError``, ``TypeError`` for ``InvalidTypeError``) and that the message holds its fragments: the argument
(or environment variable), the value as passed, the rule and, where the value alone does not say it, the way out.
Nothing is compiled or launched for a rejected call.
"""

from __future__ import annotations

import pytest

from bad_input_tables import TABLES
from error_helpers import rejects
from portakern.errors import InvalidInputError, InvalidTypeError

CASES = [pytest.param(call, exc, frags, id=f"{api}-{cid}")
         for api, cases in TABLES.items() for cid, call, exc, frags in cases]


@pytest.mark.parametrize("call, exc, fragments", CASES)
def test_a_bad_input_is_refused_with_its_type_and_a_message_that_teaches(fresh_registry, call, exc, fragments):
    msg = rejects(call, exc, *fragments)
    assert len(msg) > 20
    try:
        call()
    except exc as e:
        assert isinstance(e, ValueError if exc is InvalidInputError else TypeError if exc is InvalidTypeError
                          else Exception)


@pytest.mark.parametrize("api", sorted(TABLES))
def test_every_public_api_has_at_least_forty_cases_with_unique_ids(api):
    ids = [c[0] for c in TABLES[api]]
    assert len(ids) >= 40 and len(set(ids)) == len(ids)
