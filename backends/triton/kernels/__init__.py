"""The ``@triton.jit`` bodies of the triton backend (host launchers live one level up).

``load(name, interpret)`` imports ``kernels/<name>.py`` in the flavour asked for: Triton decides
at decoration time whether ``@triton.jit`` builds interpreter functions (``TRITON_INTERPRET=1``)
or compiler ``JITFunction``s, so a process that interprets on the CPU can still lower the same
kernels for a GPU target (``compile_for_target``), and vice versa.
"""

from __future__ import annotations

import threading
from pathlib import Path
from types import ModuleType

_HERE = Path(__file__).resolve().parent
_loaded: dict[tuple[str, bool], ModuleType] = {}
_lock = threading.Lock()


def load(name: str, interpret: bool) -> ModuleType:
    """The kernel module ``name`` with ``@triton.jit`` in interpreter (True) or compiler (False) form."""
    key = (name, interpret)
    mod = _loaded.get(key)
    if mod is None:
        from ..expr_triton import exec_module_file

        with _lock:
            mod = _loaded.get(key)
            if mod is None:
                flavour = "interp" if interpret else "jit"
                mod = exec_module_file(_HERE / f"{name}.py", f"{__name__}._{flavour}_{name}", interpret)
                _loaded[key] = mod
    return mod
