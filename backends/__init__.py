"""Built-in backends, one sub-package each (``portakern.backends.cpu``, ``.triton``, ``.opencl``, ``.cuda``).

They are registered through the ``portakern.backends`` entry-point group exactly like a third-party plugin; the
core never imports them by name. The registered backends are listed by ``portakern.list_backends()``.
"""
