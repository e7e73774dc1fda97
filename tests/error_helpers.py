"""Assertions on portakern's errors shared by the input tests."""

from __future__ import annotations

import pytest

from portakern.errors import PortakernError


def rejects(call, exc, *fragments):
    """Run ``call``; it must raise exactly ``exc`` (a portakern error) whose message holds every fragment. Returns
    the message."""
    with pytest.raises(PortakernError) as info:
        call()
    assert type(info.value) is exc, f"{type(info.value).__name__}: {info.value}"
    for fragment in fragments:
        assert fragment in str(info.value), f"{fragment!r} not in {str(info.value)!r}"
    return str(info.value)
