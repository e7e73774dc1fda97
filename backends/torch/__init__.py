"""The ``torch`` backends: torch's own kernels behind portakern's door, certified by the same conformance suite.

``torch`` (SDPA with torch's kernel choice, flex_attention, tinygemm int4 GEMV) and one backend per SDPA kernel
(``torch-math``, ``torch-flash``, ``torch-efficient``, ``torch-cudnn``), registered through the
``portakern.backends`` entry point like every built-in. They rank below portakern's own kernels
(``tuning.DEFAULT_PRIORITY``) unless a measured entry in ``tuning.RANK_OVER_OWN`` says otherwise; every one serves
when named (``backend="torch"``). No ``kernels/`` folder: the device code is torch's.
"""

from portakern.plugins import hookimpl

from .backend import BACKENDS
from .tuning import MEASURED_AHEAD_PRIORITY, RANK_OVER_OWN

_NAMES = frozenset(b.name for b in BACKENDS)


@hookimpl
def portakern_register_backends():
    return [cls() for cls in BACKENDS]


@hookimpl
def portakern_backend_priority(backend, op, device):
    # Measured wins only: a row of RANK_OVER_OWN lifts a torch backend above portakern's kernels for its class.
    if backend.name not in _NAMES or not RANK_OVER_OWN:
        return None
    for row in RANK_OVER_OWN:
        if _matches(row, backend, op, device):
            return MEASURED_AHEAD_PRIORITY
    return None


def _matches(row: dict, backend, op, device) -> bool:
    """Whether a ``RANK_OVER_OWN`` row covers ``backend`` running ``op`` on ``device``."""
    if row["backend"] != backend.name or row["op"] != getattr(op, "kind", None) or device.type != "cuda":
        return False
    if row.get("family") not in (None, device.arch) and not str(device.arch).startswith(str(row.get("family"))):
        return False
    if row.get("dtype") not in (None, op.dtype.value):
        return False
    if op.kind == "attention":
        if max(op.head_dim, op.head_dim_v) > row.get("max_d", 1 << 30):
            return False
        if "decode" in row and row["decode"] != (op.seqlen_q == 1):
            return False
    return True
