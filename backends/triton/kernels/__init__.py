"""The ``@triton.jit`` bodies of the triton backend (host launchers live one level up).

Triton decides at decoration time whether ``@triton.jit`` builds interpreter functions
(``TRITON_INTERPRET=1``) or compiler ``JITFunction``s, and its own library functions (``tl.max``,
``tl.cdiv``, ...) were decorated when ``triton`` was first imported. ``interpreted()`` says which
flavour that was; ``load(name)`` imports ``kernels/<name>.py`` in the same flavour, whatever the
environment says now, so the two never mix. ``exec_module_file`` is that loader, also used for the
generated expression modules (``expr_triton.load_mods``).
"""

from __future__ import annotations

import importlib.util
import sys
import threading
from pathlib import Path
from types import ModuleType

_HERE = Path(__file__).resolve().parent
_loaded: dict[tuple[str, bool], ModuleType] = {}
_lock = threading.RLock()   # a kernel module may load another while it loads


def interpreted() -> bool:
    """Whether this process's Triton was imported in interpreter mode (``TRITON_INTERPRET=1``)."""
    import triton.language as tl

    return type(tl.standard.cdiv).__name__ == "InterpretedFunction"


def load(name: str) -> ModuleType:
    """The kernel module ``name``, its ``@triton.jit`` functions in this process's Triton flavour."""
    interpret = interpreted()
    key = (name, interpret)
    mod = _loaded.get(key)
    if mod is None:
        with _lock:
            mod = _loaded.get(key)
            if mod is None:
                flavour = "interp" if interpret else "jit"
                mod = exec_module_file(_HERE / f"{name}.py", f"{__name__}._{flavour}_{name}", interpret)
                _loaded[key] = mod
    return mod


def exec_module_file(path: Path, name: str, interpret: bool) -> ModuleType:
    """Import the file at ``path`` as module ``name`` with its ``@triton.jit`` functions in the flavour
    ``interpret`` names: interpreter functions (True) or compiler ``JITFunction``s (False), whatever the process
    environment says (``common.flavour.jit_flavour``; the environment is never written).
    """
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    from ..common.flavour import jit_flavour

    with jit_flavour(interpret):
        try:
            sys.modules[name] = mod
            spec.loader.exec_module(mod)
        except BaseException:
            sys.modules.pop(name, None)
            raise
    return mod
