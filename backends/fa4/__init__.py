"""The ``fa4`` backend: FlashAttention-4 (``flash_attn.cute``) behind portakern's door, optional.

Registered through the ``portakern.backends`` entry point. It needs ``flash_attn.cute`` (not a dependency of
portakern); without it ``portakern info`` lists the backend as unavailable with the install line. It ranks below
portakern's own kernels unless a measured entry in ``tuning.RANK_OVER_OWN`` says otherwise. No ``kernels/``: the
device code is FlashAttention-4's.
"""

from portakern.plugins import hookimpl

from .backend import Fa4Backend
from .tuning import MEASURED_AHEAD_PRIORITY, RANK_OVER_OWN


@hookimpl
def portakern_register_backends():
    return [Fa4Backend()]


@hookimpl
def portakern_backend_priority(backend, op, device):
    # Measured wins only (none yet): a RANK_OVER_OWN row lifts fa4 above portakern's kernels for its class.
    if backend.name != Fa4Backend.name or device.type != "cuda" or getattr(op, "kind", None) != "attention":
        return None
    for row in RANK_OVER_OWN:
        if (str(device.arch).startswith(row["family"]) and row.get("dtype") in (None, op.dtype.value)
                and max(op.head_dim, op.head_dim_v) <= row.get("max_d", 1 << 30)
                and row.get("decode", op.seqlen_q == 1) == (op.seqlen_q == 1)):
            return MEASURED_AHEAD_PRIORITY
    return None
