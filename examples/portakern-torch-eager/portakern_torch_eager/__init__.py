"""portakern plugin module: registers the ``torch-eager`` backend.

portakern imports this module through the entry point in ``pyproject.toml``::

    [project.entry-points."portakern.backends"]
    torch-eager = "portakern_torch_eager"

and calls every ``@portakern.hookimpl`` function it finds here.
"""

import portakern

from .backend import TorchEagerBackend

__version__ = "0.1.0"


@portakern.hookimpl
def portakern_register_backends():
    return [TorchEagerBackend()]
