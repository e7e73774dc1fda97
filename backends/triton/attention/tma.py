"""TMA's rules for the K and V a call passes, and ``attn_fwd``'s host-side TMA descriptors.

TMA needs each base 16-byte aligned, every stride but the last a multiple of 16 bytes and the last stride 1.
A call whose tensors break those rules (e.g. fp16 K with an odd ``Hkv * D``, or a view at an unaligned offset)
runs the pointer kernel instead (``forward.build``; the Gluon kernels' ``call_blocker`` ask the same rules).
"""

from __future__ import annotations


def tma_blocker(k, v) -> str | None:
    """Why this call's K and V cannot go through ``attn_fwd``'s TMA descriptors (None when they can)."""
    for name, a in (("k", k), ("v", v)):
        why = tma_rules(name, a, a.stride()[:-1])
        if why:
            return why
    return None


def tma_rules(name: str, a, strides) -> str | None:
    """TMA's alignment rules for a descriptor over ``a`` with outer ``strides`` (elements)."""
    elt = a.element_size()
    if a.data_ptr() % 16:
        return f"{name} starts at address {a.data_ptr():#x}, not 16-byte aligned"
    if a.stride(-1) != 1:
        return f"{name}.stride(-1) = {a.stride(-1)}, TMA needs 1"
    for st in strides:
        if st <= 0 or (st * elt) % 16:
            return (f"{name} has a stride of {st} elements ({st * elt} bytes), TMA needs positive "
                    f"multiples of 16 bytes")
    return None


def descriptors(cfg, k, v, block_d: int, block_dv: int):
    """Host TMA descriptors ``(k, v)`` of ``attn_fwd``, 4-D over the (B, Sk, Hkv, D) tensors with their own
    strides, in blocks of ``[1, cfg.block_n, 1, block_d]`` (small host objects, built per call; no device
    allocation)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    return (TensorDescriptor(k, list(k.shape), list(k.stride()), [1, cfg.block_n, 1, block_d]),
            TensorDescriptor(v, list(v.shape), list(v.stride()), [1, cfg.block_n, 1, block_dv]))
