"""Which backends and cases a conformance run covers: backends from the registry by name, the tier's cases plus those
plugins add (``portakern_conformance_cases``), filtered by id globs."""

from __future__ import annotations

from typing import Sequence

from .cases import SUITE, all_cases, select


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
