"""The architecture family of a device or target: the key of every table in ``tuning.py``.

One mapping serves every op. Ampere's consumer and embedded parts (sm_86, sm_87) and Ada (sm_89) are
families of their own, not sm_80: they have about 100 KB of shared memory per block against sm_80's
163 KiB (``tuning.SMEM_LIMIT``), which bounds the attention kernels' tiles and pipeline depth. The GEMV
tables give them sm_80's entries row for row (their kernels fit in the smaller shared memory).
"""

from __future__ import annotations

from ..tuning import DEFAULT_SMS

#: Table key of each compute capability that is not the first of its major version's family.
_MINOR_FAMILIES = {86: "sm_86", 87: "sm_86", 89: "sm_89"}


def arch_family(cc: int | tuple[int, int] | None) -> str:
    """Table key for a compute capability, given as ``(8, 6)`` or ``86``: "sm_80", "sm_86" (also sm_87),
    "sm_89", "sm_90", "sm_100" or "sm_120" (each the family of all later minor versions of its major one);
    None is Triton's CPU interpreter, "interp"."""
    if cc is None:
        return "interp"
    cc = cc[0] * 10 + cc[1] if isinstance(cc, tuple) else int(cc)
    if cc >= 120:
        return "sm_120"
    if cc >= 100:
        return "sm_100"
    if cc >= 90:
        return "sm_90"
    return _MINOR_FAMILIES.get(cc, "sm_80")


def default_sms(arch: str) -> int:
    """Multiprocessors assumed for family ``arch`` when the device does not say (``tuning.DEFAULT_SMS``)."""
    return DEFAULT_SMS.get(arch, 132)


def device_family(device, interp_sms: int) -> tuple[str, int]:
    """``(family, multiprocessors)`` of a ``portakern.Device``: ``("interp", interp_sms)`` off CUDA (Triton's
    interpreter; each op states how many multiprocessors its interpreter runs stand for); on CUDA the family
    of the device's capability (sm_90 when unknown) and the multiprocessors it reports, else
    ``default_sms``."""
    if device.type != "cuda":
        return "interp", interp_sms
    arch = arch_family(device.capability or 90)
    try:
        return arch, int(dict(device.info).get("multiprocessors", 0)) or default_sms(arch)
    except ValueError:
        return arch, default_sms(arch)


#: Families with grid dependency control (``griddepcontrol``): programmatic dependent launch (``pdl``) and the
#: early release of the next kernel (``release_next``, ``early_merge``).
PDL_ARCHS = ("sm_90", "sm_100", "sm_120")
#: Families with the tensor-memory accelerator (TMA descriptors).
TMA_ARCHS = ("sm_90", "sm_100", "sm_120")


def check_pdl(cfg, arch: str) -> None:
    """Raise when ``cfg`` (an attention ``AttnConfig`` or a GEMV ``GemvConfig``) asks for programmatic dependent
    launch, or lets a next kernel launch early, where it cannot run."""
    if cfg.pdl and arch not in PDL_ARCHS:
        raise ValueError(f"{type(cfg).__name__}(pdl=True) on {arch}: programmatic dependent launch needs one of "
                         f"{', '.join(PDL_ARCHS)} (and a compiled kernel, not the interpreter); use pdl=False")
    if getattr(cfg, "release_next", False) and arch not in PDL_ARCHS:
        raise ValueError(f"{type(cfg).__name__}(release_next=True) on {arch}: letting the next kernel launch early "
                         f"needs grid dependency control, on {', '.join(PDL_ARCHS)} (and a compiled kernel, not the "
                         f"interpreter); use release_next=False")
    if getattr(cfg, "early_merge", False):
        if arch not in PDL_ARCHS:
            raise ValueError(f"AttnConfig(early_merge=True) on {arch}: launching the merge while the decode kernel "
                             f"runs needs grid dependency control, on {', '.join(PDL_ARCHS)} (and a compiled "
                             f"kernel, not the interpreter); use early_merge=False")
        if not cfg.decode_ws or cfg.num_splits < 2:
            raise ValueError(f"AttnConfig(early_merge=True, decode_ws={cfg.decode_ws}, num_splits={cfg.num_splits}): "
                             f"early_merge is an option of the Gluon decode kernel with a separate merge "
                             f"(decode_ws=True, num_splits >= 2); use early_merge=False")
