"""Host side of the cuda backend's quantized GEMV: supports, the launch configuration, compile, compile_for_target.

One kernel (``kernels/gemv_small_m.cu``): M = 1 to 4 rows of x, int4 or int8 codes in groups of 128 along K
(every packing of those widths without act-order: native, AWQ, GPTQ without ``g_idx``), fp16 / bf16 activations,
fp16 / bf16 scales. It
reads the GEMV weight layout (``portakern.ir.gemv_layout``, ``portakern.gemv_weight``), so a weight prepared by either
backend serves both (``CudaBackend.weight_layout``). Per code one LOP3 and one FFMA; x staged once per CTA in
shared memory; small CTAs, many per SM; split K merged by the last CTA of a column tile in slice order
(deterministic). Compiled by NVRTC per shape and format (``common/nvrtc.py``).

The launch configuration (``choose``) comes from ``tuning.TABLE`` where a GPU sweep measured the problem
(``benchmarks/gemv_table_sweep.py --phase write-table``), else from a rule. The backend ranks below triton
(``CudaBackend.priority``) except where its table entry timed ahead of the triton table in the same run (the priority
hook; on an H100: the large M = 1 int4 shapes and int8, never M = 4). Its CUDA C also runs on the CPU
in CI (``common/host_run.py``) against float64. Design and measurements: ``docs/design/quant-gemv-cuda.md``.

CUDA-graph contract: the first call of a signature compiles and loads the kernel and, when K is split, makes the
fp32 workspace and arrival counters of its stream (``portakern.stream_workspace``; the kernel resets the counters
itself); later calls launch one kernel, allocating nothing, unless x is not a contiguous, 16-byte aligned row
(then it is copied each call).
"""

from __future__ import annotations

import re

from dataclasses import dataclass

from portakern.backend import YES, Support, no
from portakern.devices import Device
from portakern.errors import InvalidInputError
from portakern.ir.dtypes import DType
from portakern.ir.ops import QuantGemv

from .common import nvrtc

SOURCE = "gemv_small_m.cu"
ENTRY = "gemv_small_m"
GROUP = 128
#: row stride of the prepared words (``portakern.ir.gemv_layout.N_ALIGN_WORDS``; checked against it at compile)
N_ALIGN = 128
SPLITS = (1, 2, 4, 8, 16, 32)
#: rows of x one launch takes (each dequantized code is applied to every row: M FFMAs per LOP3)
MAX_M = 4
_OUT_KIND = {DType.bfloat16: 0, DType.float16: 1, DType.float32: 2}
#: CUDA targets it lowers for without the device, and the NVRTC architecture of each
TARGETS = {"sm_80": "sm_80", "sm_90a": "sm_90a", "sm_100a": "sm_100a", "sm_120": "sm_120"}
DEFAULT_SMS = {"sm_80": 108, "sm_90a": 132, "sm_100a": 148, "sm_120": 84}
#: local-memory spill (stores + loads, bytes) a lowering may report before compile_for_target calls it a failure
MAX_SPILL_BYTES = 16
#: the bound on the stack frame the cubin records (the spill's storage: two registers' slots), which is all there is
#: to go by when NVRTC answers from the driver's compute cache without ptxas' report (``cubin_info``); coarser than
#: MAX_SPILL_BYTES: the spilling lowerings seen keep 8 bytes of frame for 8 bytes of spill traffic and for 24-32
MAX_SPILL_FRAME_BYTES = 8
#: shared memory one CTA may take (so that two fit on every target's multiprocessor)
SMEM_PER_CTA = 48 * 1024


@dataclass(frozen=True)
class SmallMConfig:
    """One launch configuration: ``quads`` 16-byte column quads per CTA (4 * quads columns), ``lanes`` row lanes,
    ``splits`` K slices, ``pf`` groups of words each thread keeps in flight, ``ldna`` 1: weight loads bypass L1 with
    a 256-byte L2 hint."""

    quads: int = 32
    lanes: int = 4
    splits: int = 1
    pf: int = 2
    ldna: int = 0

    @property
    def threads(self) -> int:
        return self.quads * self.lanes

    @property
    def columns(self) -> int:
        return 4 * self.quads


def supports(op: QuantGemv, device: Device) -> Support:
    """M = 1 to 4, int4 / int8 codes in groups of 128 without act-order, K a multiple of 128, fp16 / bf16
    activations and scales, no prologue."""
    f = op.fmt
    if not 1 <= op.M <= MAX_M:
        return no(f"quant_gemv(M={op.M}) is not supported by cuda: its kernel takes M = 1 to {MAX_M} rows; use "
                  f"the triton backend for M > {MAX_M}")
    if f.bits not in (4, 8):
        return no(f"quant_gemv(bits={f.bits}) is not supported by cuda: bits must be 4 or 8")
    if f.group_size != GROUP:
        return no(f"quant_gemv(group_size={f.group_size}) is not supported by cuda: its kernel takes groups of "
                  f"{GROUP} (use the triton backend)")
    if f.has_g_idx:
        return no("quant_gemv with g_idx (act-order) is not supported by cuda: use the triton backend")
    if op.K % GROUP:
        return no(f"quant_gemv(K={op.K}) is not supported by cuda: K must be a multiple of {GROUP}")
    if op.dtype not in (DType.float16, DType.bfloat16):
        return no(f"quant_gemv(dtype={op.dtype.value}) is not supported by cuda: use float16 or bfloat16 "
                  "activations")
    if f.scale_dtype not in (DType.float16, DType.bfloat16):
        return no(f"quant_gemv(scale_dtype={f.scale_dtype.value}) is not supported by cuda: scales must be "
                  "float16 or bfloat16")
    if op.result_dtype not in _OUT_KIND:
        return no(f"quant_gemv(out_dtype={op.result_dtype.value}) is not supported by cuda: bfloat16, float16 "
                  "or float32")
    if op.prologue is not None:
        return no(f"quant_gemv(prologue={op.prologue!r}) is not supported by cuda")
    if not _fitting_splits(op, *_tile(op)):
        return no(f"quant_gemv(K={op.K}) is not supported by cuda: no K split in {SPLITS} holds whole groups and "
                  f"leaves a slice of x that fits {SMEM_PER_CTA} bytes of shared memory (use the triton backend)")
    return YES


def family(capability: tuple[int, int]) -> str:
    """The GPU family a measured configuration applies to: "sm_90" for (9, 0), "sm_100" for (10, 0), ..."""
    return f"sm_{capability[0]}{capability[1]}"


def card(name: str) -> str | None:
    """The card of a GPU name, as the table's card-specific keys spell it: "h200" for "NVIDIA H200", "h100" for
    "NVIDIA H100 80GB HBM3", "b200", "l40" ...; None when the name has no such model number."""
    m = re.search(r"\b([A-Z]{1,2}\d{2,3})\b", name or "")
    return m.group(1).lower() if m else None


def table_entry(op: QuantGemv, capability: tuple[int, int] | None, name: str = ""):
    """``tuning.TABLE``'s entry for ``op`` on a GPU of ``capability`` named ``name``: the one measured on that
    card (key ``"sm_90/h200"``) if any, else the family's (``"sm_90"``: measured on another card of the family);
    None when unmeasured."""
    from .tuning import TABLE

    if capability is None:
        return None
    fam, rest = family(capability), (op.M, op.fmt.bits, op.N, op.K)
    c = card(name)
    entry = TABLE.get((f"{fam}/{c}", *rest)) if c else None
    return entry if entry is not None else TABLE.get((fam, *rest))


def choose(op: QuantGemv, num_sms: int, capability: tuple[int, int] | None = None, name: str = "") -> SmallMConfig:
    """The launch configuration for ``op`` on a GPU of ``num_sms`` multiprocessors, ``capability`` and ``name``: the
    measured one from ``tuning.TABLE`` when the problem has an entry (``table_entry``); else the rule -- 128-column
    CTAs (64 below N = 4096), 4 row lanes for int4 and 8 for int8, two groups in flight, and the fewest K slices that
    give every multiprocessor two CTAs (slices hold whole groups, and each CTA's slice of x fits ``SMEM_PER_CTA``)."""
    entry = table_entry(op, capability, name)
    if entry is not None:
        return SmallMConfig(*entry[:5])
    quads, lanes = _tile(op)
    fits = _fitting_splits(op, quads, lanes)
    if not fits:
        raise InvalidInputError(f"quant_gemv(K={op.K}) on cuda: no K split in {SPLITS} leaves a slice of x that fits "
                                f"{SMEM_PER_CTA} bytes of shared memory; use the triton backend")
    tiles = -(-op.N // (4 * quads))
    splits = next((s for s in fits if tiles * s >= 2 * num_sms), fits[-1])
    return SmallMConfig(quads=quads, lanes=lanes, splits=splits, pf=min(2, op.K // GROUP // splits))


def _tile(op: QuantGemv) -> tuple[int, int]:
    """(column quads, row lanes) of ``choose``'s CTA for ``op``."""
    return (32 if op.N >= 4096 else 16), (4 if op.fmt.bits == 4 else 8)


def _fitting_splits(op: QuantGemv, quads: int, lanes: int) -> list[int]:
    """The K splits (of ``SPLITS``) whose slices hold whole groups and whose CTA fits ``SMEM_PER_CTA``."""
    return [s for s in SPLITS if (op.K // GROUP) % s == 0
            and smem_bytes(op, SmallMConfig(quads, lanes, s)) <= SMEM_PER_CTA]


def smem_bytes(op: QuantGemv, cfg: SmallMConfig) -> int:
    """Dynamic shared memory of one CTA: the slice of each row of x (fp32), their word rows' sums, the row lanes'
    partials."""
    ks = op.K // cfg.splits
    return 4 * op.M * (ks + ks // (32 // op.fmt.bits) + cfg.lanes * cfg.columns)


def defines(op: QuantGemv, cfg: SmallMConfig, pdl: bool, zero_point: int | None) -> dict[str, int]:
    """The kernel's ``-D`` constants (``kernels/gemv_small_m.cu``'s header); ``zero_point`` None: the weight has
    zeros."""
    return {"M": op.M, "BITS": op.fmt.bits, "N": op.N, "K": op.K, "NP": -(-op.N // N_ALIGN) * N_ALIGN,
            "QUADS": cfg.quads, "LANES": cfg.lanes, "S": cfg.splits, "PF": cfg.pf, "LDNA": cfg.ldna, "PDL": int(pdl),
            "HAS_Z": int(zero_point is None), "ZP": zero_point or 0, "X_F16": int(op.dtype is DType.float16),
            "S_BF16": int(op.fmt.scale_dtype is DType.bfloat16), "OUT_KIND": _OUT_KIND[op.result_dtype]}


def _zero_point(op: QuantGemv) -> int | None:
    return int(op.fmt.zero_point) if op.fmt.symmetric else None


def _capability(target: str) -> tuple[int, int]:
    digits = target[3:].rstrip("af")
    return int(digits[:-1]), int(digits[-1])


def _target(device: Device) -> str:
    major, minor = device.capability
    return f"sm_{major}{minor}" + ("a" if major in (9, 10) else "")


def compile(op: QuantGemv, device: Device, config: SmallMConfig | None = None):
    """``kernel(x, prepared, out)`` for ``op`` on CUDA ``device`` (``prepared``: a ``PreparedGemvWeight``, the GEMV layout)."""
    import torch

    from portakern.ir.gemv_layout import N_ALIGN_WORDS
    from portakern.stream_workspace import StreamWorkspace, stream_index

    if N_ALIGN_WORDS != N_ALIGN:
        raise AssertionError(f"the GEMV layout's row stride alignment is {N_ALIGN_WORDS}, this kernel's {N_ALIGN}")
    props = torch.cuda.get_device_properties(device.index or 0)
    cfg = config or choose(op, props.multi_processor_count, device.capability, device.name)
    pdl = device.capability >= (9, 0)
    zp = _zero_point(op)
    consts = defines(op, cfg, pdl, zp)
    smem = smem_bytes(op, cfg)
    fn = nvrtc.Function(nvrtc.compile_source(SOURCE, tuple(consts.items()), _target(device)), ENTRY,
                        device.index or 0, smem, pdl)
    grid = -(-op.N // cfg.columns) * cfg.splits
    tdev = f"cuda:{device.index or 0}"
    np_ = consts["NP"]
    buffers = None
    if cfg.splits > 1:
        buffers = StreamWorkspace(lambda: (torch.zeros(cfg.splits * op.M * np_, device=tdev, dtype=torch.float32),
                                           torch.zeros(-(-op.N // cfg.columns), device=tdev, dtype=torch.int32)),
                                  stream_index(tdev))

    def kernel(x, w, out):
        if w.zeros is None and zp is None or w.zeros is not None and zp is not None:
            raise InvalidInputError(f"quant_gemv on cuda: the prepared weight {'lacks' if zp is None else 'has'} "
                                    "zero points but the op's format says otherwise; prepare it for this format")
        if zp is not None and w.zero_point != zp:
            raise InvalidInputError(f"quant_gemv on cuda: the prepared weight's zero point is {w.zero_point}, the "
                                    f"op's format's {zp}; prepare the weight for this format")
        if not x.is_contiguous() or x.data_ptr() % 16:
            x = x.contiguous() if not x.is_contiguous() else x.clone()
        if w.stride_qk != np_:
            raise InvalidInputError(f"quant_gemv on cuda: the prepared words' row stride is {w.stride_qk}, expected "
                                    f"{np_} for N={op.N}; pass the weight this op was built for")
        if not out.is_contiguous():
            raise InvalidInputError(f"quant_gemv on cuda: out has strides {tuple(out.stride())}; it must be "
                                    "contiguous")
        ws, counters = buffers.get() if buffers is not None else (out, out)
        fn(grid, cfg.threads, w.qweight.data_ptr(), w.scales.data_ptr(),
           (w.zeros if w.zeros is not None else w.scales).data_ptr(), x.data_ptr(), out.data_ptr(),
           ws.data_ptr(), counters.data_ptr())

    kernel.config = cfg
    return kernel


def compile_for_target(op: QuantGemv, target: str, config: SmallMConfig | None = None) -> dict:
    """Lower ``op`` for ``target`` with NVRTC, no device: the cubin and ptxas' report (``spill_bytes`` None where
    NVRTC answered from the driver's compute cache; ``registers`` and ``frame_bytes`` from the cubin then).

    Raises:
      BackendError when NVRTC rejects it, ptxas spills more than ``MAX_SPILL_BYTES`` to local memory or, where
      ptxas did not run, the cubin's stack frame exceeds ``MAX_SPILL_FRAME_BYTES`` (a kernel of this kind that
      spills its words or accumulators is a configuration error, never a fast path; ptxas spills a register or two,
      4-8 bytes, in a few M = 2 configurations, which stay in L1)."""
    from portakern.errors import BackendError

    cfg = config or choose(op, DEFAULT_SMS[target], _capability(target))
    consts = defines(op, cfg, target != "sm_80", _zero_point(op))
    compiled = nvrtc.compile_source(SOURCE, tuple(consts.items()), TARGETS[target])
    spills = compiled.spill_bytes                   # None where ptxas did not run: the frame is all there is
    too_much = spills > MAX_SPILL_BYTES if spills is not None else compiled.frame_bytes > MAX_SPILL_FRAME_BYTES
    if too_much:
        raise BackendError(f"gemv_small_m for {target} with {consts} spills ({spills} bytes of spill traffic, "
                           f"{compiled.frame_bytes} bytes of stack frame):\n{compiled.log}")
    return {"target": target, "config": cfg, "cubin_bytes": len(compiled.cubin), "registers": compiled.registers,
            "spill_bytes": spills, "frame_bytes": compiled.frame_bytes, "smem_bytes": smem_bytes(op, cfg)}
