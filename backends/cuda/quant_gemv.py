"""Host side of the cuda backend's quantized GEMV: supports, the launch configurations, compile, compile_for_target.

Two kernels, one per layout of the prepared weight (``portakern.gemv_weight``, ``portakern.ir.gemv_layout``), both for
M = 1 to 4 rows of x, fp16 / bf16 activations and scales:

* ``kernels/gemv_small_m.cu`` reads the words (``qweight``): int4 or int8 codes in groups of 128 along K (every
  packing of those widths without act-order: native, AWQ, GPTQ without ``g_idx``). Per code one LOP3 and one FFMA;
  x staged once per CTA in shared memory; small CTAs, many per SM; split K merged by the last CTA of a column tile in
  slice order (deterministic).
* ``kernels/gemv_frag.cu`` reads the tensor-core fragment layout (``frag``) with the same arithmetic, for a weight
  that holds its codes only as fragments (``qweight`` None): int4. Its launch (``FragConfig``) is the word kernel's
  translated to the same rows, threads and bytes in flight per thread (``frag_config``).

The kernel follows the weight: ``kernel(x, prepared, out)`` runs the word kernel when the weight has words, else
the fragment kernel. The one of the default layout (``portakern.gemv_weight.DEFAULT_LAYOUT``) is compiled with the
op, the other on its first call. Both read the layout either backend prepared (``CudaBackend.weight_layout``).

The launch configuration (``choose``) comes from ``tuning.TABLE`` where a GPU sweep measured the problem
(``benchmarks/gemv_table_sweep.py --phase write-table``), else from a rule. The backend ranks below triton
(``CudaBackend.priority``) except where the table of the kernel that will run timed ahead of the triton table in the
same run (the priority hook): for weights held only as fragments (``fragments_only``: the default layout on CUDA),
``tuning.FRAG_TABLE`` (on an H100: six M = 1 int4 shapes), plus fp16 x, which triton's fragment kernel cannot read
(unmeasured: triton would dequantize the weight for each call); else ``tuning.TABLE`` (on an H100: the large M = 1 int4 shapes and int8, never M = 4). Its CUDA C also runs on the CPU
in CI (``common/host_run.py``) against float64. Design and measurements: ``docs/design/quant-gemv-cuda.md``.

CUDA-graph contract: the first call of a signature (and the first call with a weight of the other layout, which
inside a capture raises ``CaptureError`` instead) compiles and loads the kernel and, when K is split, makes the fp32 workspace and arrival counters of its
stream (``portakern.stream_workspace``; the kernel resets the counters itself); later calls launch one kernel,
allocating nothing, unless x is not a contiguous, 16-byte aligned row (then it is copied each call).
"""

from __future__ import annotations

import re

from dataclasses import dataclass

from portakern.backend import YES, Support, no
from portakern.devices import Device
from portakern.errors import InvalidInputError
from portakern.ir.dtypes import DType
from portakern.ir.gguf_kquants import kquant_refusal
from portakern.ir.ops import QuantGemv

from .common import nvrtc

SOURCE = "gemv_small_m.cu"
ENTRY = "gemv_small_m"
#: the kernel that reads the fragment layout (a weight prepared without words)
FRAG_SOURCE = "gemv_frag.cu"
FRAG_ENTRY = "gemv_frag"
#: K columns of a fragment-layout chunk (``portakern.ir.gemv_layout.FRAG_CHUNK``)
FRAG_CHUNK = 128
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


@dataclass(frozen=True)
class FragConfig:
    """One launch configuration of the fragment kernel: ``rw`` row warps of ``nt`` 16-row tiles each (``16 nt rw``
    rows per CTA), ``kw`` K warps (warp ``kw`` takes chunks ``kw, kw + KW, ...`` of the CTA's slice), ``splits`` K
    slices, ``pf`` 128-column chunks each thread keeps in flight (``nt`` x 32 bytes each), ``ldna`` 1: weight loads
    bypass L1 with a 256-byte L2 hint."""

    rw: int = 4
    nt: int = 2
    kw: int = 1
    splits: int = 1
    pf: int = 2
    ldna: int = 0

    @property
    def threads(self) -> int:
        return 32 * self.rw * self.kw

    @property
    def rows(self) -> int:
        return 16 * self.nt * self.rw


def supports(op: QuantGemv, device: Device) -> Support:
    """M = 1 to 4, int4 / int8 codes in groups of 128 without act-order, K a multiple of 128, fp16 / bf16
    activations and scales, no prologue."""
    f = op.fmt
    why = kquant_refusal(f, "cuda", "triton on NVIDIA GPUs (backend='triton')")   # GGUF K-quants
    if why:
        return no(why)
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


def _measured(table: dict, capability: tuple[int, int] | None, name: str, rest: tuple):
    """``table``'s entry keyed ``(family/card, *rest)`` for the card named ``name`` if any, else ``(family, *rest)``
    (measured on another card of the family); None without a capability or an entry."""
    if capability is None:
        return None
    fam, c = family(capability), card(name)
    entry = table.get((f"{fam}/{c}", *rest)) if c else None
    return entry if entry is not None else table.get((fam, *rest))


def table_entry(op: QuantGemv, capability: tuple[int, int] | None, name: str = ""):
    """``tuning.TABLE``'s entry for ``op`` on a GPU of ``capability`` named ``name``: the one measured on that
    card (key ``"sm_90/h200"``) if any, else the family's (``"sm_90"``: measured on another card of the family);
    None when unmeasured."""
    from .tuning import TABLE

    return _measured(TABLE, capability, name, (op.M, op.fmt.bits, op.N, op.K))


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


def frag_refusal(op: QuantGemv) -> str | None:
    """Why the fragment kernel cannot run ``op`` (None when it can): it reads int4 codes in 128-column chunks whose
    group is one per chunk (groups a multiple of 128, no act-order), the formats ``frag_eligible`` gives a fragment
    layout; the rest of ``supports`` holds for it as for the word kernel."""
    f = op.fmt
    if f.bits != 4:
        return f"bits={f.bits} (the fragment layout holds int4 codes)"
    if f.group_size % FRAG_CHUNK or op.K % FRAG_CHUNK:
        return f"group_size={f.group_size}, K={op.K} (both must be multiples of {FRAG_CHUNK})"
    if f.has_g_idx:
        return "g_idx (act-order: x would be gathered)"
    return None


def frag_config(op: QuantGemv, cfg: SmallMConfig) -> FragConfig:
    """The fragment kernel's launch for ``op`` that streams what the word kernel's ``cfg`` streams: the same rows per
    CTA (``16 nt rw = 4 quads``), threads (``32 rw = quads lanes``), bytes per thread and chunk (``32 nt = 256 /
    lanes``, a word-kernel thread's bytes per group), K slices and ring depth; ``kw`` 1. A ``cfg`` with no such
    translation (fewer than 32 threads, or 16 row lanes) gets the nearest: 2 tiles per warp, 4 row warps at most."""
    nt = 8 // cfg.lanes if cfg.lanes in (2, 4, 8) else 2
    rw = max(1, min(cfg.quads * cfg.lanes // 32, 4 * cfg.quads // (16 * nt)))
    chunks = op.K // FRAG_CHUNK // cfg.splits
    return FragConfig(rw=rw, nt=nt, kw=1, splits=cfg.splits, pf=max(1, min(cfg.pf, chunks)), ldna=cfg.ldna)


def frag_table_entry(op: QuantGemv, capability: tuple[int, int] | None, name: str = ""):
    """``tuning.FRAG_TABLE``'s entry for ``op`` (int4) on a GPU of ``capability`` named ``name``: that card's, else
    the family's; None when unmeasured."""
    from .tuning import FRAG_TABLE

    return _measured(FRAG_TABLE, capability, name, (op.M, op.N, op.K)) if op.fmt.bits == 4 else None


def choose_frag(op: QuantGemv, num_sms: int, capability: tuple[int, int] | None = None,
                name: str = "") -> FragConfig:
    """The fragment kernel's launch for ``op``: its own measured entry (``frag_table_entry``) when the problem has
    one, else ``frag_config`` of the word kernel's choice (``choose``: its measured entry, else its rule), so that a
    weight serves at a tuned shape whichever layout it holds."""
    entry = frag_table_entry(op, capability, name)
    if entry is not None:
        return FragConfig(*entry[:6])
    return frag_config(op, choose(op, num_sms, capability, name))


def frag_smem_bytes(op: QuantGemv, cfg: FragConfig) -> int:
    """Dynamic shared memory of one fragment-kernel CTA: the slice of each row of x (fp32), its 16-column blocks'
    sums, the K warps' partial rows."""
    ks = op.K // cfg.splits
    return 4 * op.M * (ks + ks // 16 + cfg.kw * cfg.rows)


def frag_defines(op: QuantGemv, cfg: FragConfig, pdl: bool, zero_point: int | None) -> dict[str, int]:
    """The fragment kernel's ``-D`` constants (``kernels/gemv_frag.cu``'s header)."""
    return {"M": op.M, "N": op.N, "K": op.K, "NP": -(-op.N // N_ALIGN) * N_ALIGN, "GS": op.fmt.group_size,
            "RW": cfg.rw, "NT": cfg.nt, "KW": cfg.kw, "S": cfg.splits, "PF": cfg.pf, "LDNA": cfg.ldna,
            "PDL": int(pdl), "HAS_Z": int(zero_point is None), "ZP": zero_point or 0,
            "X_F16": int(op.dtype is DType.float16), "S_BF16": int(op.fmt.scale_dtype is DType.bfloat16),
            "OUT_KIND": _OUT_KIND[op.result_dtype]}


def _check_frag_config(op: QuantGemv, cfg: FragConfig) -> None:
    """InvalidInputError unless ``cfg`` splits ``op``'s chunks evenly and fits ``SMEM_PER_CTA``."""
    chunks = op.K // FRAG_CHUNK
    if chunks % cfg.splits or (chunks // cfg.splits) % cfg.kw or not 1 <= cfg.pf <= chunks // cfg.splits // cfg.kw:
        raise InvalidInputError(f"quant_gemv(K={op.K}) on cuda: {cfg} does not give each K warp of each slice whole "
                                f"128-column chunks with pf <= its chunks; pick splits and kw dividing {chunks}")
    if frag_smem_bytes(op, cfg) > SMEM_PER_CTA:
        raise InvalidInputError(f"quant_gemv(M={op.M}, K={op.K}) on cuda: {cfg} needs {frag_smem_bytes(op, cfg)} "
                                f"bytes of shared memory, over {SMEM_PER_CTA}; use more splits")


def _zero_point(op: QuantGemv) -> int | None:
    return int(op.fmt.zero_point) if op.fmt.symmetric else None


def _capability(target: str) -> tuple[int, int]:
    digits = target[3:].rstrip("af")
    return int(digits[:-1]), int(digits[-1])


def _target(device: Device) -> str:
    major, minor = device.capability
    return f"sm_{major}{minor}" + ("a" if major in (9, 10) else "")


def _launcher(op: QuantGemv, device: Device, source: str, entry: str, consts: dict, smem: int, tiles: int,
              splits: int, threads: int, ws_row: int, pdl: bool):
    """``launch(weights, scales, zeros, x, out)`` (device pointers) of ``entry`` in ``kernels/<source>``: compiled by
    NVRTC, loaded on ``device``, with a per-stream fp32 workspace of ``splits`` x M rows of ``ws_row`` and ``tiles``
    arrival counters when K is split."""
    import torch

    from portakern.stream_workspace import StreamWorkspace, stream_index

    fn = nvrtc.Function(nvrtc.compile_source(source, tuple(consts.items()), _target(device)), entry, device.index or 0,
                        smem, pdl)
    grid = tiles * splits
    tdev = f"cuda:{device.index or 0}"
    buffers = None
    if splits > 1:
        buffers = StreamWorkspace(lambda: (torch.zeros(splits * op.M * ws_row, device=tdev, dtype=torch.float32),
                                           torch.zeros(tiles, device=tdev, dtype=torch.int32)), stream_index(tdev))

    def launch(wp: int, sp: int, zp: int, xp: int, op_: int) -> None:
        ws, counters = buffers.get() if buffers is not None else (None, None)
        fn(grid, threads, wp, sp, zp, xp, op_, ws.data_ptr() if ws is not None else op_,
           counters.data_ptr() if counters is not None else op_)

    return launch


def _default_layout() -> str:
    """The layout ``prepare_gemv_weight`` builds when none is asked for (``portakern.gemv_weight.DEFAULT_LAYOUT``)."""
    from portakern import gemv_weight

    return gemv_weight.DEFAULT_LAYOUT


def fragments_only(op: QuantGemv, device: Device) -> bool:
    """Whether the weights of ``op`` prepared for ``device`` by default hold their codes only as fragments: the
    default layout is "fragments", the device builds the fragment layout (``wants_fragments``) and the op's format has
    one (``frag_refusal``). The priority hook ranks by ``FRAG_TABLE`` then, not by ``TABLE``."""
    from portakern.gemv_weight import wants_fragments

    return _default_layout() == "fragments" and frag_refusal(op) is None and wants_fragments(device)


def compile(op: QuantGemv, device: Device, config: SmallMConfig | None = None, frag: FragConfig | None = None):
    """``kernel(x, prepared, out)`` for ``op`` on CUDA ``device`` (``prepared``: a ``PreparedGemvWeight``, the GEMV
    layout): the word kernel (``config``, default ``choose``) when the weight has words, else the fragment kernel
    (``frag``, default ``choose_frag``: its measured entry, else the word kernel's choice translated). The kernel of
    the layout weights are prepared in by default (``portakern.gemv_weight.DEFAULT_LAYOUT``) is compiled here, the
    other on its first call -- which, inside CUDA stream capture, raises ``portakern.capture.CaptureError`` naming
    the way out (one call before capture).

    Raises (from the kernel): InvalidInputError when the weight's zero points, zero point or row stride differ from
    the op's, when it holds neither words nor fragments, when the op is one the fragment kernel cannot run
    (``frag_refusal``) and the weight has only fragments, or when ``out`` is not contiguous."""
    import threading

    import torch

    from portakern.ir.gemv_layout import N_ALIGN_WORDS

    if N_ALIGN_WORDS != N_ALIGN:
        raise AssertionError(f"the GEMV layout's row stride alignment is {N_ALIGN_WORDS}, this kernel's {N_ALIGN}")
    props = torch.cuda.get_device_properties(device.index or 0)
    cfg = config or choose(op, props.multi_processor_count, device.capability, device.name)
    fcfg = frag or (frag_config(op, config) if config is not None
                    else choose_frag(op, props.multi_processor_count, device.capability, device.name))
    pdl = device.capability >= (9, 0)
    zp = _zero_point(op)
    np_ = -(-op.N // N_ALIGN) * N_ALIGN
    frag_why = frag_refusal(op)
    if frag_why is None and frag is not None:
        _check_frag_config(op, fcfg)

    def build(kind):
        if kind == "words":
            return _launcher(op, device, SOURCE, ENTRY, defines(op, cfg, pdl, zp), smem_bytes(op, cfg),
                             -(-op.N // cfg.columns), cfg.splits, cfg.threads, np_, pdl)
        _check_frag_config(op, fcfg)
        tiles = -(-op.N // fcfg.rows)
        return _launcher(op, device, FRAG_SOURCE, FRAG_ENTRY, frag_defines(op, fcfg, pdl, zp),
                         frag_smem_bytes(op, fcfg), tiles, fcfg.splits, fcfg.threads, tiles * fcfg.rows, pdl)

    # the kernel of the layout weights are prepared in by default now, the other one on its first call
    paths, lock = {}, threading.Lock()
    first = "frags" if frag_why is None and _default_layout() == "fragments" else "words"
    paths[first] = build(first)

    def path(kind):
        launch = paths.get(kind)
        if launch is None:
            from portakern.capture import refuse

            refuse(f"quant_gemv(M={op.M}, N={op.N}, K={op.K}) on cuda", f"the first call with a weight holding "
                   f"{'only fragments' if kind == 'frags' else 'words'} compiles that layout's kernel and makes its "
                   "workspace, which cannot run")
            with lock:
                launch = paths.get(kind) or paths.setdefault(kind, build(kind))
        return launch

    def kernel(x, w, out):
        if w.zeros is None and zp is None or w.zeros is not None and zp is not None:
            raise InvalidInputError(f"quant_gemv on cuda: the prepared weight {'lacks' if zp is None else 'has'} "
                                    "zero points but the op's format says otherwise; prepare it for this format")
        if zp is not None and w.zero_point != zp:
            raise InvalidInputError(f"quant_gemv on cuda: the prepared weight's zero point is {w.zero_point}, the "
                                    f"op's format's {zp}; prepare the weight for this format")
        if not x.is_contiguous() or x.data_ptr() % 16:
            x = x.contiguous() if not x.is_contiguous() else x.clone()
        if not out.is_contiguous():
            raise InvalidInputError(f"quant_gemv on cuda: out has strides {tuple(out.stride())}; it must be "
                                    "contiguous")
        z = w.zeros if w.zeros is not None else w.scales
        if w.qweight is not None:
            if w.qweight.shape[1] != np_:
                raise InvalidInputError(f"quant_gemv on cuda: the prepared words' row stride is {w.qweight.shape[1]}, "
                                        f"expected {np_} for N={op.N}; pass the weight this op was built for")
            path("words")(w.qweight.data_ptr(), w.scales.data_ptr(), z.data_ptr(), x.data_ptr(), out.data_ptr())
            return
        if w.frag is None:
            raise InvalidInputError("quant_gemv on cuda: the prepared weight holds neither words (qweight) nor "
                                    "fragments (frag); prepare it with portakern.gemv_weight.prepare_gemv_weight")
        if frag_why is not None:
            raise InvalidInputError(f"quant_gemv on cuda: the prepared weight holds only fragments, which the cuda "
                                    f"fragment kernel cannot read for this op: {frag_why}")
        if w.frag.shape[1] * 16 != np_:
            raise InvalidInputError(f"quant_gemv on cuda: the prepared fragments' row stride is "
                                    f"{w.frag.shape[1] * 16}, expected {np_} for N={op.N}; pass the weight this op "
                                    "was built for")
        path("frags")(w.frag.data_ptr(), w.scales.data_ptr(), z.data_ptr(), x.data_ptr(), out.data_ptr())

    kernel.config, kernel.frag_config = cfg, (fcfg if frag_why is None else None)
    return kernel


def _lowered(source: str, consts: dict, target: str, what: str) -> dict:
    """``kernels/<source>`` compiled for ``target`` with ``consts``: its cubin size, registers, spill and frame.

    Raises:
      BackendError when NVRTC rejects it or it spills past ``MAX_SPILL_BYTES`` (``MAX_SPILL_FRAME_BYTES`` of frame
      where ptxas did not run)."""
    from portakern.errors import BackendError

    compiled = nvrtc.compile_source(source, tuple(consts.items()), TARGETS[target])
    spills = compiled.spill_bytes                   # None where ptxas did not run: the frame is all there is
    too_much = spills > MAX_SPILL_BYTES if spills is not None else compiled.frame_bytes > MAX_SPILL_FRAME_BYTES
    if too_much:
        raise BackendError(f"{what} for {target} with {consts} spills ({spills} bytes of spill traffic, "
                           f"{compiled.frame_bytes} bytes of stack frame):\n{compiled.log}")
    return {"cubin_bytes": len(compiled.cubin), "registers": compiled.registers, "spill_bytes": spills,
            "frame_bytes": compiled.frame_bytes}


def compile_for_target(op: QuantGemv, target: str, config: SmallMConfig | None = None,
                       frag: FragConfig | None = None) -> dict:
    """Lower ``op`` for ``target`` with NVRTC, no device: the word kernel's cubin and ptxas' report (``spill_bytes``
    None where NVRTC answered from the driver's compute cache; ``registers`` and ``frame_bytes`` from the cubin then)
    and, for the ops the fragment kernel runs (``frag_refusal``), the same of the fragment kernel under ``"frag"``.

    Raises:
      BackendError when NVRTC rejects either, ptxas spills more than ``MAX_SPILL_BYTES`` to local memory or, where
      ptxas did not run, the cubin's stack frame exceeds ``MAX_SPILL_FRAME_BYTES`` (a kernel of this kind that
      spills its words or accumulators is a configuration error, never a fast path; ptxas spills a register or two,
      4-8 bytes, in a few M = 2 configurations, which stay in L1)."""
    cfg = config or choose(op, DEFAULT_SMS[target], _capability(target))
    pdl = target != "sm_80"
    art = {"target": target, "config": cfg, **_lowered(SOURCE, defines(op, cfg, pdl, _zero_point(op)), target,
                                                       ENTRY), "smem_bytes": smem_bytes(op, cfg)}
    if frag_refusal(op) is None:
        fcfg = frag or (frag_config(op, config) if config is not None
                        else choose_frag(op, DEFAULT_SMS[target], _capability(target)))
        _check_frag_config(op, fcfg)
        art["frag"] = {"config": fcfg, **_lowered(FRAG_SOURCE, frag_defines(op, fcfg, pdl, _zero_point(op)), target,
                                                  FRAG_ENTRY), "smem_bytes": frag_smem_bytes(op, fcfg)}
    return art
