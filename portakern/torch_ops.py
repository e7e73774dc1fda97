"""portakern's ops as torch custom ops, for ``torch.compile`` and CUDA graphs.

Importing this module registers, in the ``portakern`` namespace of ``torch.library``:

``torch.ops.portakern.quant_gemv(x, qweight, scales, zeros, perm, kgroup, bits, group_size, zero_point, n, k, prologue=None, frag=None)``
    ``x (M, K) @ dequant(W)^T`` (``prologue="silu_mul"``: ``x (M, 2K)``, input ``silu(gate) * up``) for a weight
    already in the GEMV layout (the tensors of a ``portakern.gemv_weight.PreparedGemvWeight``; the byte layout
    is ``portakern.ir.gemv_layout``'s; ``frag``, where the prepared weight has one, its tensor-core fragment layout:
    on CUDA by default the weight's only codes, ``qweight`` None). CUDA
    tensors run the kernel ``portakern.quant_gemv`` would pick among the backends that read this layout
    (``gemv_kernel``: triton, or cuda where its measured table ranks it first); CPU tensors run a plain torch
    dequantize-and-matmul in fp32.

``torch.ops.portakern.attention(q, k, v, block_table, seqlens_k, causal, scale, window_left, window_right, softcap)``
    ``portakern.attention`` (dense or paged KV), on the backend dispatch picks for the inputs.

Both have fake (meta) implementations, so ``torch.compile`` traces them as opaque nodes, and both
return a fresh tensor and do no host synchronisation after their first call, so a CUDA graph
(``torch.cuda.graph`` or ``torch.compile(mode="reduce-overhead")``) can capture them.

``QuantLinear`` wraps a ``QuantizedWeight`` as an ``nn.Module`` whose forward calls the op, and
``quant_linear(x, w)`` is the functional form (any leading dimensions on x); ``attention_op`` is the keyword
form of the attention op. In plain eager use (no compiler, tracer or dispatch mode, no autograd) these three
run the op's implementation directly: torch's operator dispatch of a Python custom op costs ~50 us of host time
per call, more than a batch-1 GEMV takes on the GPU. Traced, they go through ``torch.ops.portakern.*``.
"""

from __future__ import annotations

import threading
from typing import Optional

import torch

from portakern import dispatch
from portakern.devices import CPU, Device, torch_device
from portakern.errors import InvalidInputError, InvalidTypeError, UnsupportedError
from portakern.gemv_weight import GEMV_LAYOUT, PreparedGemvWeight, prepare_gemv_weight
from portakern.ir import DType, Packing, QuantFormat
from portakern.ir.ops import QuantGemv, x_columns
from portakern.validate import _is_int, check_prologue

Tensor = torch.Tensor

#: signature -> compiled GEMV kernel: an LRU bounded by ``portakern.dispatch.set_cache_limits(torch_op_kernels=)``
_kernels = dispatch.torch_op_cache
_kernels_lock = threading.Lock()


# -- quant_gemv --------------------------------------------------------------------------------------

@torch.library.custom_op("portakern::quant_gemv", mutates_args=())
def quant_gemv(x: Tensor, qweight: Optional[Tensor], scales: Tensor, zeros: Optional[Tensor], perm: Optional[Tensor],
               kgroup: Optional[Tensor], bits: int, group_size: int, zero_point: int, n: int, k: int,
               prologue: Optional[str] = None, frag: Optional[Tensor] = None) -> Tensor:
    """``x (M, K) @ dequant(W (n, k))^T`` with the weight in the GEMV layout; returns (M, n).
    ``prologue="silu_mul"``: ``x`` is ``(M, 2k)``, gate then up, and the input is ``silu(gate) * up``
    (``QuantGemv.prologue``). ``frag``: the prepared weight's fragment layout (``PreparedGemvWeight.frag``), or
    None; beside ``qweight`` (``layout="words+fragments"``) it serves M = 2..16 on CUDA, without it they run a slower
    tensor-core kernel. ``qweight`` None: a weight prepared with ``layout="fragments"`` (the default on CUDA), whose
    codes are only in ``frag``."""
    _check_gemv_x(x, n, k, prologue)
    w = PreparedGemvWeight(qweight, scales, zeros, perm, kgroup, bits, group_size, zero_point, n, k, frag=frag)
    return _quant_gemv_impl(x, w, prologue)


def _check_gemv_x(x: Tensor, n: int, k: int, prologue: str | None) -> None:
    """Raise ``InvalidInputError`` unless ``x`` is the op's 2-D ``(M, k)`` input (``(M, 2k)`` with the
    ``silu_mul`` prologue). Both the op and its fake implementation call it, so a traced graph refuses what the
    kernel would misread (a 1-D ``x`` used to broadcast one row over ``x.shape[0]`` output rows on the CPU)."""
    check_prologue(prologue)
    width = x_columns(k, prologue)
    if x.dim() != 2 or x.shape[1] != width:
        rule = f"(M, 2 * {k}) with prologue='silu_mul', gate first" if prologue else f"(M, {k})"
        raise InvalidInputError(f"x has shape {tuple(x.shape)} but the weight is ({n}, {k}): "
                                f"torch.ops.portakern.quant_gemv takes a 2-D x {rule}; flatten leading dimensions "
                                "with x.reshape(-1, x.shape[-1]), or call portakern.torch_ops.quant_linear")


def _quant_gemv_impl(x: Tensor, w: PreparedGemvWeight, prologue: str | None) -> Tensor:
    """What the op computes (called by it, and directly by ``quant_linear`` / ``QuantLinear`` when ``_untraced``)."""
    out = torch.empty((x.shape[0], w.N), dtype=x.dtype, device=x.device)
    if x.shape[0] == 0:   # an empty batch (an MoE expert no token chose): nothing to launch, (0, N) as on the CPU
        return out
    if x.is_cuda:
        x = _unit_stride_k(x)
        _cuda_kernel(x, w, prologue)(x, w, out)
    else:
        out.copy_(_dequant_matmul(x, w, prologue))
    return out


def _unit_stride_k(x: Tensor) -> Tensor:
    """``x`` with its K columns adjacent, as the GPU kernels read them (any row stride): a direct
    ``torch.ops.portakern.quant_gemv`` call may pass a transposed or column-sliced view, which is copied once
    (``portakern.quant_gemv`` and ``quant_linear`` never pass one)."""
    return x if x.shape[1] <= 1 or x.stride(1) == 1 else x.contiguous()


def _untraced(*tensors) -> bool:
    """Whether a call may run the op's implementation directly instead of through torch's operator dispatch,
    which costs ~50 us of host time per eager call (more than a batch-1 GEMV takes on the GPU): plain CPU or CUDA
    tensors (not meta) that do not require grad, and no compiler, tracer, dispatch mode, function mode or
    functorch transform (``vmap``, ``grad``) active. Everything else (``torch.compile``, ``make_fx`` / export,
    ``torch.jit.trace``, fake, functional or meta tensors, autograd, ``torch.func``) goes through ``torch.ops``
    and is traced, batched or dispatched as a custom op should be."""
    for t in tensors:
        if t is not None and (type(t) is not torch.Tensor or t.requires_grad or t.is_meta):
            return False
    try:
        return not (torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack()
                    or torch._C._is_torch_function_mode_enabled() or torch._C._get_tracing_state() is not None
                    or torch._C._are_functorch_transforms_active())
    except AttributeError:   # a torch without these probes: always dispatch
        return False


@quant_gemv.register_fake
def _quant_gemv_fake(x, qweight, scales, zeros, perm, kgroup, bits, group_size, zero_point, n, k, prologue=None,
                     frag=None):
    _check_gemv_x(x, n, k, prologue)
    return x.new_empty((x.shape[0], n))


def _cuda_kernel(x: Tensor, w: PreparedGemvWeight, prologue: str | None = None):
    """The compiled kernel for this signature (``gemv_kernel``'s choice, built once, then a dict lookup)."""
    key = (x.shape[0], w.N, w.K, x.dtype, x.device.index, w.bits, w.group_size, w.zeros is None, w.zero_point,
           w.scales.dtype, w.perm is None and w.kgroup is None, prologue, dispatch.override_key(None))
    kern = _kernels.get(key)
    if kern is None:
        with _kernels_lock:
            kern = _kernels.get(key)
            if kern is None:
                op = gemv_op_of(x, w, prologue)
                kern = gemv_kernel(op, torch_device("cuda", x.device.index or 0))[1]
                _kernels.put(key, kern)
    return kern


def gemv_op_of(x: Tensor, w: PreparedGemvWeight, prologue: str | None = None) -> QuantGemv:
    """The ``QuantGemv`` op that ``x`` times the prepared weight ``w`` computes: its codes' bits and groups, zero
    points stored or fixed (``w.zero_point``, the native format's), its scales' dtype, act-order (a ``perm`` or
    ``kgroup``: GPTQ with ``g_idx``), ``x``'s rows and dtype."""
    _dtype = lambda t: DType(str(t.dtype).replace("torch.", ""))   # noqa: E731
    g_idx = w.perm is not None or w.kgroup is not None
    fmt = QuantFormat(bits=w.bits, group_size=w.group_size, symmetric=w.zeros is None,
                      packing=Packing.GPTQ if g_idx else Packing.NATIVE, scale_dtype=_dtype(w.scales), has_g_idx=g_idx)
    if fmt.symmetric and w.zero_point != fmt.zero_point:
        raise InvalidInputError(f"the prepared weight's zero point is {w.zero_point}, but a symmetric int{w.bits} "
                                f"weight in the GEMV layout has {fmt.zero_point}: prepare it with "
                                "portakern.torch_ops.prepared(...)")
    return QuantGemv(M=int(x.shape[0]), N=w.N, K=w.K, dtype=_dtype(x), fmt=fmt, prologue=prologue).verify()


#: the weight layout this module's op takes (``PreparedGemvWeight``): backends with this ``weight_layout`` can serve it
LAYOUT = GEMV_LAYOUT


def gemv_kernel(op: QuantGemv, device: Device) -> tuple[str, object]:
    """``(backend name, kernel(x, prepared, out))`` for ``op`` on the CUDA ``device``, where ``prepared`` is a
    ``PreparedGemvWeight`` (the GEMV layout): the backend ``portakern.quant_gemv`` would rank first for the op,
    among those that read that layout (``Backend.weight_layout``) -- triton, or cuda where its measured table ranks it
    above triton (``backends/cuda/tuning.py``) -- honouring ``use_backend`` / ``PORTAKERN_BACKEND`` and falling
    back (with a ``FallbackWarning``) past a backend that fails to compile. The kernel launches on ``device``.

    Raises:
      UnsupportedError when no backend of that layout supports ``op`` (or the forced backend does not read it).
    """
    from portakern import dispatch
    from portakern.errors import UnsupportedError

    plan = dispatch.decide(op, device, None)
    plan.order = [b for b in plan.order if (b.weight_layout or b.name) == LAYOUT]
    if not plan.order:
        d = plan.decision
        why = f"the backend forced by {d.forced_by}, {d.forced!r}," if d.forced else "no supporting backend"
        raise UnsupportedError(f"torch.ops.portakern.quant_gemv takes weights in the {LAYOUT!r} layout, and {why} "
                               f"reads it for {op.kind} (M={op.M} N={op.N} K={op.K}) on {device.label}; call "
                               "portakern.quant_gemv with the QuantizedWeight instead, or force backend 'triton'")
    plan = dispatch.compile_next(plan)
    return plan.backend.name, plan.kernel


def _codes(w: PreparedGemvWeight) -> Tensor:
    """The weight's codes ``(K, N)`` (int32, in ``qweight``'s column order) unpacked with torch ops."""
    epw = 32 // w.bits
    mask = (1 << w.bits) - 1
    q = w.qweight
    if q is None:   # a fragments-only weight (layout="fragments"): unpacked on its device, no host copy
        from portakern.gemv_torch import unpack_fragments

        return unpack_fragments(w.frag, w.N, w.K).to(torch.int32).T
    iw = w.interleave
    codes = torch.stack([(q >> (w.bits * e)) & mask for e in range(epw)], dim=1)   # (KWP, epw, NP)
    # interleaved rows: (block, j, e, NP) -> (block, e, j, NP) is column k's order
    codes = codes.reshape(-1, iw, epw, q.shape[1]).transpose(1, 2)
    return codes.reshape(-1, q.shape[1])[: w.K, : w.N]


def _dequant_matmul(x: Tensor, w: PreparedGemvWeight, prologue: str | None = None) -> Tensor:
    """CPU path: unpack the words with torch ops, ``(q - z) * s``, one fp32 matmul (``silu_mul``: of
    ``silu(gate) * up`` in fp32)."""
    codes = _codes(w).float()                                                     # (K, N)
    g = w.kgroup.long() if w.kgroup is not None else torch.arange(w.K, device=codes.device) // w.group_size
    s = w.scales.float()[g, : w.N]
    z = w.zeros.float()[g, : w.N] if w.zeros is not None else float(w.zero_point)
    wt = (codes - z) * s                                                           # (K, N) = W^T
    xf = x.float()
    if prologue == "silu_mul":
        xf = torch.nn.functional.silu(xf[:, : w.K]) * xf[:, w.K:]
    xx = xf if w.perm is None else xf[:, w.perm.long()]
    return (xx @ wt).to(x.dtype)


def prepared(w, device: Device | str | torch.device | None = None, layout: str | None = None) -> PreparedGemvWeight:
    """The GEMV layout of ``w`` on ``device`` (default: where ``w``'s tensors are), cached on ``w.prepared`` under
    the key ``portakern.quant_gemv`` uses for the backends of that layout (``(GEMV_LAYOUT, device)``), so both
    share one copy. ``layout``: ``portakern.gemv_weight.LAYOUTS`` (None: the default), for a copy built here.
    Inside CUDA stream capture a copy that is not built yet raises ``portakern.capture.CaptureError``; a GGUF K-quant
    weight (whose minimums the op's signature does not carry) raises ``UnsupportedError``."""
    from portakern.gemv_kquants import PACKINGS as KQUANTS
    from portakern.quantized import QuantizedWeight

    if isinstance(w, PreparedGemvWeight) and w.mins is None:
        return w
    if isinstance(w, PreparedGemvWeight) or (isinstance(w, QuantizedWeight) and w.fmt.packing in KQUANTS):
        # the op's signature carries no minimums and names no K-quant packing: refuse rather than drop them
        raise UnsupportedError("torch.ops.portakern.quant_gemv, quant_linear and QuantLinear take no GGUF K-quant "
                               "weight (Q4_K, Q5_K, Q6_K: float32 scales d * sc and per-group minimums); call "
                               "portakern.quant_gemv(x, weight), which runs them on triton, triton-rocm, opencl "
                               "and cpu")
    if not isinstance(w, QuantizedWeight):
        raise InvalidTypeError(f"w is a {type(w).__name__}: expected a portakern.QuantizedWeight "
                               "(portakern.quantize(...)) or a PreparedGemvWeight")
    if device is None:
        dev = w.device
    elif isinstance(device, Device):
        dev = device
    else:
        td = torch.device(device)
        dev = CPU if td.type == "cpu" else torch_device("cuda", td.index or 0)
    key = (GEMV_LAYOUT, str(dev))
    p = w.prepared.get(key)
    if p is None:
        p = w.prepared[key] = prepare_gemv_weight(w, dev, layout=layout)
    return p


def quant_linear(x: Tensor, w, prologue: str | None = None) -> Tensor:
    """``x (..., K) @ dequant(w)^T`` through ``torch.ops.portakern.quant_gemv``; w a QuantizedWeight
    (prepared for x's device on first use) or a PreparedGemvWeight. ``prologue="silu_mul"``: ``x`` is
    ``(..., 2K)``, gate then up, and the input is ``silu(gate) * up``.

    Under ``torch.compile`` and inside CUDA-graph capture the weight must already be prepared for x's device
    (``portakern.prepare(w, device)``, ``prepared(w, device)``, one eager call, or a ``QuantLinear``): preparing
    allocates and synchronises, which Dynamo does not trace (a first use inside a compiled region breaks the
    graph; an error with ``fullgraph=True``) and a capture cannot record (``portakern.CaptureError``)."""
    check_prologue(prologue)
    p = prepared(w, x.device)
    width = x_columns(p.K, prologue)
    if x.shape[-1] != width:
        rule = f"(..., 2 * {p.K}) with prologue='silu_mul', gate first" if prologue else f"(..., {p.K})"
        raise InvalidInputError(f"x has {x.shape[-1]} columns but the weight is ({p.N}, {p.K}): x must be {rule}")
    x2 = x.reshape(-1, width)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if _untraced(x2, *p.tensors().values()):
        y = _quant_gemv_impl(x2, p, prologue)
    else:
        y = torch.ops.portakern.quant_gemv(x2, p.qweight, p.scales, p.zeros, p.perm, p.kgroup, p.bits,
                                           p.group_size, p.zero_point, p.N, p.K, prologue, p.frag)
    return y.reshape(*x.shape[:-1], p.N)


#: the tensors of a ``PreparedGemvWeight`` that ``QuantLinear`` keeps as buffers
_BUFFERS = ("qweight", "scales", "zeros", "perm", "kgroup", "frag")


class QuantLinear(torch.nn.Module):
    """``nn.Linear`` without bias over a quantized weight: ``forward(x) = x @ dequant(W)^T``.

    The weight is repacked once (``prepared``) and kept as buffers, so ``.to(device)`` moves it and
    ``torch.compile`` sees plain tensors. Eager calls reuse one ``PreparedGemvWeight`` over the buffers until a
    buffer is replaced (``.to``, ``_apply``).

    The weight is prepared at construction (on the device given, else where ``w`` is), sharing ``w``'s cached
    copy, in ``layout`` (``portakern.gemv_weight.LAYOUTS``; None: ``DEFAULT_LAYOUT``, "fragments"). On CUDA, for
    int4 groups of a multiple of 128, the default holds each code once, in the fragment layout: ``frag`` is then the
    codes (``qweight`` None) and is saved in the state dict; every M and activation dtype runs on it. Elsewhere
    (the CPU, formats without a fragment layout) the codes are in ``qweight``. With ``layout="words+fragments"``
    ``frag`` holds a second copy of ``qweight``'s codes for the M = 2..16 kernel: derived data, not saved in the
    state dict and rebuilt from ``qweight`` after ``load_state_dict``; after writing ``qweight`` in place any other
    way, call ``refresh_fragments()`` (else M = 2..16 would keep reading the old codes). ``load_state_dict``
    reads a state dict saved in either layout (``qweight`` or ``frag``), repacking the codes into the layout this
    module holds: a checkpoint written on the CPU loads on a GPU and the reverse.
    """

    def __init__(self, w, device: Device | str | torch.device | None = None, layout: str | None = None):
        super().__init__()
        p = prepared(w, device, layout)
        self.in_features, self.out_features = p.K, p.N
        self.bits, self.group_size, self.zero_point = p.bits, p.group_size, p.zero_point
        for name in _BUFFERS:
            self.register_buffer(name, getattr(p, name), persistent=name != "frag" or p.qweight is None)
        self._prepared = None
        self.register_load_state_dict_post_hook(lambda module, incompatible: module.refresh_fragments())

    def use_layout(self, layout: str) -> None:
        """Keep only what ``layout`` (``portakern.gemv_weight.LAYOUTS``) holds: "fragments" drops the words
        (``qweight`` None, ``frag`` then saved in the state dict: each code held once) where a fragment layout is
        present, "words" drops ``frag``; "words+fragments" keeps what there is. The dropped buffer's memory is
        freed once nothing else holds it (the ``QuantizedWeight``'s cached copy shares it while that weight lives).

        Raises ``InvalidInputError`` for an unknown layout, or "words" on a module that holds no words."""
        from portakern.gemv_weight import check_layout

        layout = check_layout(layout)
        if layout == "fragments" and self.frag is not None:
            self.qweight = None
            self._non_persistent_buffers_set.discard("frag")
        elif layout == "words" and self.frag is not None:
            if self.qweight is None:
                raise InvalidInputError("this QuantLinear holds its codes only as fragments (layout='fragments'); "
                                        "build it again from the QuantizedWeight with layout='words'")
            self.frag = None
        self._prepared = None

    def refresh_fragments(self) -> None:
        """Rebuild the fragment layout (``frag``, if this module has one) from ``qweight``'s codes (nothing to do
        for a fragments-only module: ``frag`` is its codes)."""
        if self.frag is None or self.qweight is None:
            return
        self.frag.copy_(_fragments_of(self, self.qweight))   # on the buffers' device

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        # a state dict saved in the other layout (words from a CPU module or "words+fragments", fragments from a
        # fragments-only module) is converted to the layout this module holds before it is read
        _convert_codes(self, state_dict, prefix)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def _prepared_weight(self) -> PreparedGemvWeight:
        """The buffers as one ``PreparedGemvWeight``, built again only when a buffer object changed."""
        p = self._prepared
        if p is None or any(getattr(p, n) is not getattr(self, n) for n in _BUFFERS):
            p = self._prepared = PreparedGemvWeight(self.qweight, self.scales, self.zeros, self.perm, self.kgroup,
                                                    self.bits, self.group_size, self.zero_point, self.out_features,
                                                    self.in_features, frag=self.frag)
        return p

    def forward(self, x: Tensor) -> Tensor:
        """``x (..., in_features) @ dequant(W)^T``: ``(..., out_features)`` in ``x``'s dtype, on its device.

        Raises ``InvalidInputError`` when ``x``'s last dimension is not ``in_features``."""
        # under torch.jit.trace sizes are traced values (a Python bool of one warns): the op checks x there
        if not torch.jit.is_tracing() and (x.dim() == 0 or x.shape[-1] != self.in_features):
            raise InvalidInputError(f"x has shape {tuple(x.shape)} but this QuantLinear is ({self.out_features}, "
                                    f"{self.in_features}): x must be (..., {self.in_features}); pass the layer's "
                                    "input features as x's last dimension")
        x2 = x.reshape(-1, self.in_features)
        if _untraced(x2, self.qweight, self.scales, self.zeros):
            y = _quant_gemv_impl(x2, self._prepared_weight(), None)
        else:
            y = torch.ops.portakern.quant_gemv(x2, self.qweight, self.scales, self.zeros, self.perm, self.kgroup,
                                               self.bits, self.group_size, self.zero_point, self.out_features,
                                               self.in_features, None, self.frag)
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, " \
               f"group_size={self.group_size}"


def _fragments_of(module: QuantLinear, words: Tensor) -> Tensor:
    """The fragment layout of the codes in ``words`` (a ``qweight`` of ``module``'s format and shape), built with
    torch ops on ``words``' device."""
    from portakern.gemv_torch import pack_fragments
    from portakern.ir.gemv_layout import N_ALIGN_WORDS

    w = PreparedGemvWeight(words, module.scales, module.zeros, module.perm, module.kgroup, module.bits,
                           module.group_size, module.zero_point, module.out_features, module.in_features)
    return pack_fragments(_codes(w).T.to(torch.uint8), N_ALIGN_WORDS)


def _convert_codes(module: QuantLinear, state: dict, prefix: str) -> None:
    """Rewrite ``state`` in place so that it holds ``module``'s codes in the layout the module keeps: words
    (``qweight``) for a module that has them, else fragments (``frag``). A state saved by a module of the other
    layout (a checkpoint written on the CPU, where weights hold words, read on a GPU where they hold fragments, or
    the reverse) is repacked with torch ops on the device of its tensor; the same codes either way."""
    from portakern.gemv_torch import pack_words, unpack_fragments

    words_key, frag_key = prefix + "qweight", prefix + "frag"
    words, frag = state.get(words_key), state.get(frag_key)
    if module.qweight is None and module.frag is not None and words is not None and frag is None:
        state[frag_key] = _fragments_of(module, words)
        del state[words_key]
    elif module.qweight is not None and frag is not None and words is None:
        codes = unpack_fragments(frag, module.out_features, module.in_features)
        w = module._prepared_weight()
        state[words_key] = pack_words(codes, module.bits, w.interleave)
        del state[frag_key]


# -- attention ---------------------------------------------------------------------------------------

@torch.library.custom_op("portakern::attention", mutates_args=())
def attention(q: Tensor, k: Tensor, v: Tensor, block_table: Optional[Tensor], seqlens_k: Optional[Tensor],
              causal: bool, scale: Optional[float], window_left: int, window_right: int, softcap: float) -> Tensor:
    """``portakern.attention`` on BSHD tensors (dense, or paged with block_table + seqlens_k)."""
    return _attention_impl(q, k, v, block_table, seqlens_k, causal, scale, window_left, window_right, softcap)


def _attention_impl(q, k, v, block_table, seqlens_k, causal, scale, window_left, window_right, softcap) -> Tensor:
    """What the op computes (called by it, and directly by ``attention_op`` when ``_untraced``)."""
    import portakern

    window = None if (window_left, window_right) == (-1, -1) else (window_left, window_right)
    out = portakern.attention(q, k, v, causal=causal, window=window, softcap=softcap, scale=scale,
                              block_table=block_table, seqlens_k=seqlens_k)
    if out.data_ptr() in (q.data_ptr(), k.data_ptr(), v.data_ptr()):  # never alias an input
        out = out.clone()
    return out


@attention.register_fake
def _attention_fake(q, k, v, block_table, seqlens_k, causal, scale, window_left, window_right, softcap):
    return q.new_empty((*q.shape[:-1], v.shape[-1]))


def attention_op(q, k, v, *, causal=False, scale=None, window=None, softcap=0.0, block_table=None,
                 seqlens_k=None) -> Tensor:
    """Keyword form of ``torch.ops.portakern.attention`` (window ``(left, right)``, -1 = unbounded)."""
    wl, wr = _window_sides(window)
    args = (q, k, v, block_table, seqlens_k, causal, scale, wl, wr, softcap)
    if _untraced(q, k, v, block_table, seqlens_k):
        return _attention_impl(*args)
    return torch.ops.portakern.attention(*args)


def _window_sides(window) -> tuple[int, int]:
    """``window`` as the op's ``(window_left, window_right)`` ints; ``(-1, -1)`` (unbounded) for None. Raises
    ``InvalidInputError`` (the rule ``portakern.attention`` states) for anything but a pair of ints."""
    if window is None:
        return -1, -1
    if not isinstance(window, (tuple, list)) or len(window) != 2 or not all(_is_int(w) for w in window):
        raise InvalidInputError(f"window={window!r} must be a (left, right) pair of ints; -1 means unbounded")
    return int(window[0]), int(window[1])


__all__ = ["QuantLinear", "attention", "attention_op", "gemv_kernel", "prepared", "quant_gemv", "quant_linear"]
