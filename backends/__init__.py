"""Built-in backends, one sub-package each (``portakern.backends.cpu``, ``portakern.backends.triton``).

They are registered through the ``portakern.backends`` entry-point group exactly like a
third-party plugin. The package object itself is callable so that ``portakern.backends()`` (the
public listing function) and ``portakern.backends.<name>`` (these sub-packages) share one name.
"""

import sys
import types


class _CallablePackage(types.ModuleType):
    def __call__(self):
        """List the registered backends (see ``portakern.api.backends``)."""
        from portakern.api import backends

        return backends()


sys.modules[__name__].__class__ = _CallablePackage
