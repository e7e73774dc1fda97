"""Host side of the Triton quantized GEMV: supports, prepare_weight, compile, compile_for_target.

Every packing of ``portakern.ir.Packing`` is repacked once, at ``prepare_weight``, into one
internal layout (``portakern.gemv_weight``: ``PreparedGemvWeight``; the byte layout is documented in
``portakern.ir.gemv_layout``), so the kernels know a single format; act-order GPTQ reads ``x`` through
the weight's K permutation, an irregular ``g_idx`` runs the per-element path.

``compile(op, device)`` returns ``kernel(x, prepared, out)``. The launch configuration comes from
``gemv_tuning`` (table, or autotuned and cached with ``PORTAKERN_TRITON_AUTOTUNE=1``). CUDA-graph
contract: the first call of a signature builds the launcher (and, for split-K, its fp32
workspace and arrival counters, which the kernel resets itself; one set per CUDA stream, made on the
stream's first call: ``stream_workspace``); every later call on a stream launches one
kernel with no allocation, no host synchronisation and no tensor created on the host (except for an x
view whose rows lie 2^31 or more elements apart, past the kernels' 32-bit offsets: it is copied each call).

Programmatic dependent launch (``GemvConfig.pdl``, the sm_90+ tables' choice for the CUDA-core
kernel): a launch may start while the previous kernel in the stream drains and reads its first tiles
of the prepared weight before waiting for that kernel; x, the output and the workspace are touched
only after the wait. So a prepared weight must not be written by the kernel launched just before a
GEMV that reads it; ``prepare_weight`` synchronises once after its own upload.
"""

from __future__ import annotations

import threading

from portakern.backend import YES, Support, no
from portakern.devices import Device
from portakern.errors import UnsupportedError
from portakern.gemv_weight import PreparedGemvWeight
from portakern.gemv_weight import fragment_kernel_available as frag_kernel_available
from portakern.ir.dtypes import DType
from portakern.ir.gemv_layout import K_ALIGN_WORDS, N_ALIGN_WORDS, frag_eligible, interleave_words
from portakern.ir.ops import QuantGemv
from portakern.ir.quant import Packing

from . import gemv_tuning as tuning
from .backend import KERNEL_OPTIONS, interpret_env
from .gemv_checks import MAX_OFFSET, check_weight, max_row_stride, raise_out_stride
from .launch import KernelLaunch
from portakern.stream_workspace import StreamWorkspace, stream_index

_TARGETS = {"sm_80": 80, "sm_90a": 90, "sm_100a": 100, "sm_120": 120}


# -- supports ----------------------------------------------------------------------------------------

def supports(op: QuantGemv, device: Device) -> Support:
    """Every packing, 4 and 8 bits, fp16/bf16/fp32 activations, any N and K, and M while x and the output each
    hold fewer than 2^31 elements (``MAX_OFFSET``)."""
    if op.fmt.bits not in (4, 8):
        return no(f"quant_gemv(bits={op.fmt.bits}) is not supported by triton on {device}: bits must be 4 or 8")
    if op.dtype not in (DType.float16, DType.bfloat16, DType.float32):
        return no(f"quant_gemv(dtype={op.dtype.value}) is not supported by triton: use float16, bfloat16 "
                  "or float32 activations")
    widest = max(op.x_columns, op.N)
    if op.M * widest > MAX_OFFSET + 1:
        return no(f"quant_gemv(M={op.M}) with x of {op.x_columns} and an output of {op.N} columns is not supported "
                  f"by triton: x and the output must hold at most 2^31 elements each (the kernels' 32-bit offsets); "
                  f"split M into chunks of at most {(MAX_OFFSET + 1) // widest} rows")
    if device.type == "cpu":
        from . import kernels

        if not kernels.interpreted():
            return no("triton was imported before TRITON_INTERPRET=1 was set, so its interpreter cannot run "
                      "quant_gemv here; set TRITON_INTERPRET=1 before the first import of triton")
    return YES


# -- launchers ---------------------------------------------------------------------------------------

class _Launcher:
    """One kernel, its constexprs, grid and (split-K) workspace, for one op and weight layout."""

    def __init__(self, op: QuantGemv, layout, cfg: tuning.GemvConfig, interpret: bool, tdev: str,
                 num_sms: int = 132):
        import torch

        self.cfg = cfg
        _check_prologue(op, cfg)
        if cfg.kind == "stream":   # its own launcher (gemv_stream.py)
            from .gemv_stream import Launcher

            self.kind, self.stream = cfg.kind, Launcher(op, layout, cfg, num_sms, tdev)
            return
        self.fn = _kernel_fn(cfg)
        self.kind = cfg.kind
        self.consts = _consts_for(op, layout, cfg, interpret)
        bm = self.consts["BM"]
        tiles_m = -(-op.M // bm)
        tiles_n = -(-op.N // cfg.block_n)
        self.grid = (tiles_n, cfg.split_k, tiles_m)
        self.ksw = _slice_words(layout.KWP, cfg)
        self.opts = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages, **KERNEL_OPTIONS)
        if cfg.pdl:
            self.opts["launch_pdl"] = True
        # split-K partials and arrival counters (the kernel's last slice resets its counter after each use) and
        # the silu_mul prologue's per-program scratch rows: one set per stream, made on its first call there
        glu = self.consts.get("GLU") == 2
        self.glu_len = self.ksw * layout.codes_per_word if glu else 0

        def make():
            ws = lock = scratch = None
            if cfg.split_k > 1:
                ws = torch.empty((cfg.split_k, tiles_m * bm, op.N), dtype=torch.float32, device=tdev)
                lock = torch.zeros((tiles_m * tiles_n,), dtype=torch.int32, device=tdev)
            if glu:
                scratch = torch.empty((glu_scratch_values(op, layout, cfg),), dtype=torch.float32, device=tdev)
            return ws, lock, scratch

        self.buffers = StreamWorkspace(make, stream_index(tdev)) if cfg.split_k > 1 or glu else None
        self.dims = (op.M, op.N, op.K, layout.KWP, layout.stride_qk)
        # the largest row strides whose last element the kernels' 32-bit offsets still reach
        self.x_stride_max = max_row_stride(op.M, op.x_columns)
        self.out_stride_max = max_row_stride(op.M, op.N)
        self.mask_rt = (1 << layout.bits) - 1
        if self.kind == "frag":   # chunks, chunks per slice, word strides of a unit and of a chunk
            kc, nu = int(layout.frag.shape[0]), int(layout.frag.shape[1])
            self.frag_dims = (kc, -(-kc // cfg.split_k), 256, nu * 256)
            self.opts.pop("num_stages", None)
        self.launch = KernelLaunch(self.fn, self.grid, self.consts, self.opts, interpret)

    def __call__(self, x, w: PreparedGemvWeight, out) -> None:
        if self.kind == "stream":
            return self.stream(x, w, out)
        M, N, K, KWP, sqk = self.dims
        sx, so = x.stride(0), out.stride(0)
        if sx > self.x_stride_max:   # a view whose rows lie 2^31 elements apart: its contiguous copy fits
            x = x.contiguous()
            sx = x.stride(0)
        if so > self.out_stride_max:
            raise_out_stride(M, so)
        ws = lock = glu = None
        if self.buffers is not None:
            ws, lock, glu = self.buffers.get()
        ws = out if ws is None else ws
        lock = w.qweight if lock is None else lock
        z = w.scales if w.zeros is None else w.zeros
        perm = w.qweight if w.perm is None else w.perm
        launch = self.launch
        if self.kind == "frag":
            kc, kcs, su, sc = self.frag_dims
            launch(x, w.frag, w.scales, z, out, ws, lock, M, N, K, kc, sqk, sx, so, kcs, su, sc)
        elif self.kind == "mma":
            launch(x, w.qweight, w.scales, z, out, ws, lock, M, N, K, KWP, sqk, sx, so, self.ksw)
        elif self.kind == "fma":
            kg = w.qweight if w.kgroup is None else w.kgroup
            glu = ws if glu is None else glu
            launch(x, w.qweight, w.scales, z, perm, kg, out, ws, lock, M, N, K, KWP, sqk,
                   sx, so, self.ksw, self.mask_rt, glu, self.glu_len)
        else:
            launch(x, w.qweight, w.scales, z, perm, out, ws, lock, M, N, K, KWP, sqk,
                   sx, so, self.ksw, self.mask_rt)


def _slice_words(kwp: int, cfg: tuning.GemvConfig) -> int:
    """Word rows per split-K slice: whole tiles."""
    tiles = -(-kwp // cfg.block_kw)
    return -(-tiles // cfg.split_k) * cfg.block_kw


def _num_sms(device: Device) -> int:
    info = dict(device.info)
    try:
        return int(info.get("multiprocessors", 0)) or tuning.DEFAULT_SMS.get(tuning.arch_family(device.capability), 132)
    except ValueError:
        return 132


def compile(op: QuantGemv, device: Device, config: tuning.GemvConfig | None = None):
    """The kernel ``kernel(x, prepared, out)`` for ``op`` on ``device`` (torch tensors).

    ``config`` forces a launch configuration (benchmarks, tests); by default the tuning table
    (or the autotune cache) chooses one per weight layout on the first call.
    """
    op.verify()
    interpret = device.type == "cpu"
    arch = "interp" if interpret else tuning.arch_family(device.capability)
    num_sms = tuning.DEFAULT_SMS["interp"] if interpret else _num_sms(device)
    tdev = "cpu" if interpret else f"cuda:{device.index}"
    launchers: dict[tuple, _Launcher] = {}
    lock = threading.Lock()

    if config is not None:
        tuning.check_pdl(config, arch)
        if interpret and config.kind in ("stream", "frag"):
            raise UnsupportedError(f"GemvConfig(kind={config.kind!r}) is a Gluon kernel, which Triton's interpreter "
                                   "cannot run; force it on a CUDA device, or use kind='fma' or 'dot' here")

    def build(x, w: PreparedGemvWeight, out) -> _Launcher:
        check_weight(op, w, tdev)
        if config is not None:
            cfg = tuning.fit(config, w, op.M)
            why = tuning.frag_usable(w, op.M, op.dtype.value) if cfg.kind == "frag" else None
            if why is not None:
                raise UnsupportedError(f"GemvConfig(kind='frag') cannot run this op: {why}; use kind='mma' or 'dot'")
        elif op.prologue is not None:   # only the CUDA-core kernel reads x through a prologue: its table entry
            cfg = tuning.choose(w, op.M, op.N, arch, num_sms, dtype=op.dtype.value, cuda_core=True)
        elif tuning.autotune_enabled() and not interpret:
            import triton.testing

            def timer(c):
                ln = _Launcher(op, w, tuning.fit(c, w, op.M), interpret, tdev, num_sms)
                return triton.testing.do_bench(lambda: ln(x, w, out), warmup=5, rep=25, return_mode="median")

            cfg = tuning.tuned(w, op.M, op.N, op.dtype.value, device, arch, num_sms, timer)
        else:
            cfg = tuning.choose(w, op.M, op.N, arch, num_sms, dtype=op.dtype.value)
        return _Launcher(op, w, cfg, interpret, tdev, num_sms)

    def kernel(x, w: PreparedGemvWeight, out) -> None:
        key = w.key()
        ln = launchers.get(key)
        if ln is None:
            with lock:
                ln = launchers.get(key)
                if ln is None:
                    ln = launchers[key] = build(x, w, out)
        ln(x, w, out)

    kernel.__name__ = f"triton_quant_gemv_{op.content_hash()}"
    kernel.launchers = launchers  # introspection: the chosen configurations
    return kernel


# -- compile for a target without the device ----------------------------------------------------------

class _LayoutStub:
    """The layout facts a launch depends on, derived from the op alone (no weight data)."""

    def __init__(self, op: QuantGemv):
        f = op.fmt
        self.bits, self.group_size, self.N, self.K = f.bits, f.group_size, op.N, op.K
        self.codes_per_word = 32 // f.bits
        kw = -(-op.K // self.codes_per_word)
        self.KWP = -(-kw // K_ALIGN_WORDS) * K_ALIGN_WORDS
        self.stride_qk = -(-op.N // N_ALIGN_WORDS) * N_ALIGN_WORDS
        self.has_z = not f.symmetric
        self.has_perm = f.has_g_idx
        self.kgroup = None
        self.zero_point = f.zero_point + ((1 << (f.bits - 1)) if f.packing is Packing.GGUF_Q8_0 else 0)
        self.per_elem_group = self.group_size % self.codes_per_word != 0
        self.interleave = interleave_words(self.bits, self.group_size, False)
        # what prepare_weight builds on a CUDA device: a fragment layout for the eligible formats
        eligible = frag_kernel_available() and frag_eligible(f.bits, f.group_size, f.has_g_idx, False) is None
        self.frag = True if eligible else None


def compile_for_target(op: QuantGemv, target: str, config: tuning.GemvConfig | None = None) -> dict:
    """Lower ``op`` for ``target`` ("sm_80", "sm_90a", "sm_100a", "sm_120") with Triton, no GPU needed.

    ``config`` forces a launch configuration (as in ``compile``; static instruction counts of a
    variant); by default the target's tuning table chooses.

    Returns ``{"target", "config", "kernels": {name: {"cubin", "ptx", "shared", "num_warps"}}}``.
    A ``g_idx`` format is lowered for the regular act-order layout (K permuted, x gathered).
    """
    try:
        cc = _TARGETS[target]
    except KeyError:
        raise UnsupportedError(f"compile_for_target(target={target!r}): the triton backend lowers "
                               f"quant_gemv for {', '.join(sorted(_TARGETS))}") from None
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    op.verify()
    arch = tuning.arch_family(cc)
    lay = _LayoutStub(op)
    if config is not None:
        tuning.check_pdl(config, arch)
        cfg = tuning.fit(config, lay, op.M)
    else:
        cfg = tuning.choose(lay, op.M, op.N, arch, tuning.DEFAULT_SMS.get(arch, 132), dtype=op.dtype.value,
                            cuda_core=op.prologue is not None)
    _check_prologue(op, cfg)
    fn = _kernel_fn(cfg)
    act = {"float16": "*fp16", "bfloat16": "*bf16", "float32": "*fp32"}[op.dtype.value]
    outp = {"float16": "*fp16", "bfloat16": "*bf16", "float32": "*fp32"}[op.result_dtype.value]
    sdt = {"float16": "*fp16", "bfloat16": "*bf16", "float32": "*fp32"}[op.fmt.scale_dtype.value]
    ptrs = {"x_ptr": act, "qw_ptr": "*i32", "fw_ptr": "*i32", "s_ptr": sdt, "z_ptr": sdt, "perm_ptr": "*i32",
            "kg_ptr": "*i32", "out_ptr": outp, "ws_ptr": "*fp32", "lock_ptr": "*i32", "cnt_ptr": "*i32",
            "glu_ptr": "*fp32"}
    if cfg.kind == "stream":   # fit refused the weights the kernel cannot serve (tuning._fit_stream)
        from .gemv_stream import constexprs, grid_programs

        programs = grid_programs(op, lay, cfg, tuning.DEFAULT_SMS.get(arch, 132))
        return _compile_gluon_for_target(op, target, cc, cfg, fn, constexprs(op, lay, cfg, programs), ptrs,
                                         {"stride_qk"} | ({"N"} if op.N % 16 == 0 else set()))
    consts = _consts_for(op, lay, cfg)   # exactly what a launch passes
    if cfg.kind == "frag":
        why = tuning.frag_usable(lay, op.M, op.dtype.value)
        if why is not None:
            raise UnsupportedError(f"compile_for_target: GemvConfig(kind='frag') cannot lower this op: {why}")
        return _compile_frag_for_target(op, target, cc, cfg, fn, consts, ptrs)
    sig = {}
    for name in fn.arg_names:
        if name in consts:
            sig[name] = "constexpr"
        elif name in ptrs:
            sig[name] = ptrs[name]
        else:
            sig[name] = "i32"
    options = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages, launch_pdl=cfg.pdl, **KERNEL_OPTIONS)
    with interpret_env(False):
        # what a launch specializes on: 16-byte aligned tensors, row stride and padded K multiples of 16,
        # and the row strides of contiguous x and out when K and N are
        aligned = set(ptrs) | {"KWP", "stride_qk", "K_SPLIT_W"}
        aligned |= {"stride_xm"} if op.K % 16 == 0 else set()
        aligned |= {"stride_om"} if op.N % 16 == 0 else set()
        attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names) if a in aligned}
        ck = triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", cc, 32), options=options)
    md = ck.metadata
    return {"target": target, "config": cfg.to_json(),
            "kernels": {fn.__name__: {"cubin": ck.asm.get("cubin"), "ptx": ck.asm.get("ptx"),
                                      "shared": getattr(md, "shared", None), "num_warps": cfg.num_warps}}}


def _compile_frag_for_target(op: QuantGemv, target: str, cc: int, cfg: tuning.GemvConfig, fn, consts: dict,
                             ptrs: dict) -> dict:
    """``compile_for_target`` for the Gluon kernel of kind "frag" (``kernels/gemv_frag.py``)."""
    return _compile_gluon_for_target(op, target, cc, cfg, fn, consts, ptrs, {"stride_s", "stride_u", "stride_c", "K"})


def _compile_gluon_for_target(op: QuantGemv, target: str, cc: int, cfg: tuning.GemvConfig, fn, consts: dict,
                              ptrs: dict, aligned_ints: set[str]) -> dict:
    """``compile_for_target`` for a Gluon kernel (kinds "frag", "stream"): ``aligned_ints`` are the integer
    arguments a launch specialises as multiples of 16 (strides of padded layouts)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    sig = {n: "constexpr" if n in consts else ptrs.get(n, "i32") for n in fn.arg_names}
    aligned = set(ptrs) | aligned_ints
    aligned |= {"stride_xm"} if op.K % 16 == 0 else set()
    aligned |= {"stride_om"} if op.N % 16 == 0 else set()
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names) if a in aligned}
    with interpret_env(False):
        ck = triton.compile(GluonASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", cc, 32),
                            options=dict(num_warps=cfg.num_warps, **KERNEL_OPTIONS))
    md = ck.metadata
    return {"target": target, "config": cfg.to_json(),
            "kernels": {fn.__name__: {"cubin": ck.asm.get("cubin"), "ptx": ck.asm.get("ptx"),
                                      "shared": getattr(md, "shared", None), "num_warps": cfg.num_warps}}}


def _kernel_fn(cfg: tuning.GemvConfig):
    """The ``@triton.jit`` kernel of ``cfg.kind``, in this process's Triton flavour."""
    from . import kernels

    if cfg.kind == "frag":
        return kernels.load("gemv_frag").gemv_frag_kernel
    if cfg.kind == "stream":
        return kernels.load("gemv_stream").gemv_stream_kernel
    if cfg.kind == "mma":
        return kernels.load("gemv_mma").gemv_mma_kernel
    mod = kernels.load("gemv_quant")
    return mod.gemv_fma_kernel if cfg.kind == "fma" else mod.gemv_dot_kernel


#: The silu_mul prologue formed once per program (GLU mode 2) needs one fp32 scratch row per program; above this
#: many bytes the kernel forms it per tile instead (mode 1)
GLU_SCRATCH_MAX_BYTES = 64 << 20


def glu_mode(op: QuantGemv, layout, cfg: tuning.GemvConfig) -> int:
    """The CUDA-core kernel's ``GLU`` constexpr for ``op``: 0 no prologue; 2 ``silu(gate) * up`` formed once per
    program into a scratch row (one row of x per program, no act-order permutation, whole interleave blocks per
    tile, and a scratch of at most ``GLU_SCRATCH_MAX_BYTES``); 1 formed by every thread for the x it holds."""
    if op.prologue != "silu_mul":
        return 0
    staged = (tuning.block_m(cfg.kind, op.M) == 1 and not layout.has_perm and layout.kgroup is None
              and cfg.block_kw >= layout.interleave and glu_scratch_values(op, layout, cfg) * 4 <= GLU_SCRATCH_MAX_BYTES)
    return 2 if staged else 1


def glu_scratch_values(op: QuantGemv, layout, cfg: tuning.GemvConfig) -> int:
    """fp32 values of the GLU scratch: one row of ``K_SPLIT_W * EPW`` per program of the grid."""
    programs = -(-op.N // cfg.block_n) * cfg.split_k * op.M
    return programs * _slice_words(layout.KWP, cfg) * layout.codes_per_word


def _check_prologue(op: QuantGemv, cfg: tuning.GemvConfig) -> None:
    """Raise when ``op`` has an x prologue and ``cfg`` names a kernel that does not read x through one."""
    if op.prologue is not None and cfg.kind != "fma":
        raise UnsupportedError(f"GemvConfig(kind={cfg.kind!r}) has no x prologue; the {op.prologue!r} prologue runs "
                               f"on the CUDA-core kernel: use kind='fma' (the table chooses it for such ops)")


def _consts_for(op: QuantGemv, layout, cfg: tuning.GemvConfig, interpret: bool = False) -> dict:
    """The constexpr arguments a launch of ``cfg`` passes (shared by launches and AOT lowering).
    ``interpret``: Triton's CPU interpreter (which computes bf16 wrongly and runs no PTX)."""
    even_k = layout.KWP * layout.codes_per_word == op.K
    f32 = op.dtype is DType.float32 or (interpret and op.dtype is DType.bfloat16)
    if cfg.kind == "stream":
        raise ValueError("_consts_for(kind='stream'): the stream kernel's constexprs depend on the grid; "
                         "use gemv_stream.constexprs")
    if cfg.kind == "frag":
        return dict(BM=tuning.block_m(cfg.kind, op.M), W=cfg.num_warps, NT=cfg.block_n // (16 * cfg.num_warps),
                    GS=layout.group_size, HAS_Z=layout.has_z, ZP=layout.zero_point, SPLIT_K=cfg.split_k,
                    PDL=cfg.pdl, MODE=0, MERGE=tuning.split_merge("frag", op.N, op.K))
    if cfg.kind == "mma":
        return dict(GS=layout.group_size, ZP=layout.zero_point, HAS_Z=layout.has_z, BM=tuning.block_m(cfg.kind, op.M),
                    BN=cfg.block_n, BKW=cfg.block_kw, SPLIT_K=cfg.split_k, EVEN_K=even_k, IW=layout.interleave,
                    ASM=not interpret, COMPUTE_F32=f32, PDL=cfg.pdl, X_RUNS=cfg.x_runs)
    c = dict(BITS=layout.bits, GS=layout.group_size, ZP=layout.zero_point, HAS_Z=layout.has_z,
             HAS_PERM=layout.has_perm, BM=tuning.block_m(cfg.kind, op.M), BN=cfg.block_n,
             BKW=cfg.block_kw, SPLIT_K=cfg.split_k, DQ=cfg.dq, EVEN_K=even_k, PDL=cfg.pdl, IW=layout.interleave)
    if cfg.kind == "fma":
        c.update(PER_ELEM_GROUP=layout.per_elem_group, HAS_KG=layout.kgroup is not None, PIPE=cfg.num_stages,
                 PREFETCH=cfg.prefetch, GROUP_ROWS=cfg.group_rows, NMASK=layout.stride_qk % cfg.block_n != 0,
                 GLU=glu_mode(op, layout, cfg), MERGE=0 if interpret else tuning.split_merge("fma", op.N, op.K))
    else:
        c.update(COMPUTE_F32=f32, SWAP_AB=cfg.swap_ab)
    return c
