"""Checks of command-line values that name things (backends, devices, case globs, targets), shared by
``portakern explain`` and the conformance tools.

A value the command cannot use is a usage error (exit 2) that names the option as typed on the command line
(``--backend``, never the Python parameter ``backends=``), the value, the rule and the way out. An empty value,
or an empty item of a comma list, is refused rather than read as "no filter": an unset shell variable
(``--backend "$BACKEND"``) must not silently widen a qualification run to every backend or case.
"""

from __future__ import annotations

import argparse
from typing import Sequence


class UsageError(Exception):
    """A command-line argument the parser accepted but the command cannot use."""


def empty_option(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> str | None:
    """The option of ``parser`` given an empty (or blank) value on the command line, or None.

    A value equal to the option's default is not reported (the option was then not typed, or typed as its default).
    """
    for action in parser._actions:  # argparse keeps no public list of a parser's options
        if not action.option_strings:
            continue
        value = getattr(ns, action.dest, None)
        if value == action.default:
            continue
        values = value if isinstance(value, list) else [value]
        if any(isinstance(v, str) and not v.strip() for v in values):
            return max(action.option_strings, key=len)
    return None


def empty_value_message(option: str) -> str:
    """The usage error for an empty ``option`` value."""
    return (f"{option} '': the value is empty (an unset shell variable?); give {option} a value, or leave "
            f"{option} out to use its default")


def name_list(option: str, values: Sequence[str], example: str) -> list[str]:
    """The names in ``values`` (each a name or a comma list), in order, duplicates dropped.

    Raises:
      UsageError when an item is empty (``--backend ''``, ``--cases a,,b``, ``--target sm_90a,``).
    """
    names = []
    for raw in values:
        items = [x.strip() for x in raw.split(",")]
        if not all(items):
            raise UsageError(f"{option} {raw!r}: an empty name in the list (an unset shell variable, a stray "
                             f"comma?) would widen or change the selection; name each item, e.g. {option} {example}")
        names += items
    return list(dict.fromkeys(names))


def backends(option: str, values: Sequence[str]) -> list:
    """The registered backends that ``values`` name (comma lists allowed); every registered one when ``values``
    is empty (the option was not given).

    Raises:
      UsageError for an empty name, or a name no registered backend has (naming the registered ones and the
      plugins that failed to load).
    """
    from .plugins import registry

    reg = registry()
    names = name_list(option, values, "cpu,triton")
    if not values:
        return [reg.backends[n] for n in sorted(reg.backends)]
    for name in names:
        if name not in reg.backends:
            known = ", ".join(sorted(reg.backends)) or "none"
            failed = "".join(f"; plugin {p!r} failed to load: {e}" for p, e in reg.errors)
            raise UsageError(f"{option} {name}: no backend of that name is registered; registered backends are "
                             f"{known}{failed}; name one of them (portakern info lists them)")
    return [reg.backends[n] for n in names]


def device(option: str, text: str):
    """The present device ``text`` names ("cpu", "cuda:1", "opencl:0", ...).

    Raises:
      UsageError for an empty value or a device not present on this machine (naming the present ones).
    """
    from .devices import detect_devices, parse_device
    from .errors import InvalidInputError

    if not str(text).strip():
        raise UsageError(empty_value_message(option))
    try:
        return parse_device(text)
    except InvalidInputError:
        present = ", ".join(str(d) for d in detect_devices())
        raise UsageError(f"{option} {text}: no such device on this machine; present devices are {present}; "
                         f"name one of them (portakern info lists them)") from None
