"""Run Hugging Face transformers models on portakern's attention and quantized linear layers.

Importing this module imports ``transformers`` (``pip install transformers``) and registers, under the name
``"portakern"``:

- an attention function with ``transformers.AttentionInterface``, so that
  ``AutoModelForCausalLM.from_config(cfg, attn_implementation="portakern")`` (or ``from_pretrained``) runs every
  attention layer through ``torch.ops.portakern.attention`` -- causal prefill, decode against a cache, GQA,
  sliding windows (the layer's ``sliding_window``) and logit soft-capping (``softcap``, Gemma-2) where the model
  has them, with the layer's own ``scaling``;
- a mask function with ``transformers.AttentionMaskInterface``. It builds no ``(B, 1, Sq, Sk)`` mask: the
  attention function needs only how many keys of the cache buffer are valid, and for ``StaticCache`` (a
  full-length buffer) the mask function passes that count as a ``(B,)`` int32 tensor computed on the device
  from the cache's length tensor (``q_offset + q_length - kv_offset``, capped at the buffer), which the
  attention op reads as ``seqlens_k``; the causal diagonal then sits at the last valid key. A
  ``DynamicCache`` returns exactly the valid keys, so no tensor is passed. Nothing here synchronises the host
  under ``torch.compile``, so ``generate(..., cache_implementation="static", compile_config=...)`` and CUDA
  graphs capture it.

Padding masks are not supported: a 2-D ``attention_mask`` holding a zero (left or right padding) raises
``NotImplementedError`` at the forward that receives it (checked outside ``torch.compile`` and CUDA graph
capture; ``generate`` runs its prefill uncompiled, and decode steps only append ones). Batch sequences of equal
length, or run them one by one. Custom 4-D masks and extra mask functions (``or_mask_function`` /
``and_mask_function``, as multimodal models add) raise ``NotImplementedError`` too, as do attention dropout in
training and attention sinks.

``quantize_model(model, bits=4, group_size=128)`` swaps each ``nn.Linear`` for a ``QuantLinear`` (bias kept).
"""

from __future__ import annotations

import logging
from typing import Any, Iterable

try:
    import transformers  # noqa: F401  (the dependency this module states)
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
except ImportError as e:  # pragma: no cover - exercised in a subprocess by the tests
    raise ImportError("portakern.integrations.transformers needs Hugging Face transformers (>= 4.56, with "
                      "AttentionInterface and AttentionMaskInterface): pip install transformers") from e

import torch

from portakern.errors import InvalidInputError, InvalidTypeError
from portakern.torch_ops import QuantLinear, attention_op

logger = logging.getLogger(__name__)

#: the name this module registers its attention and mask functions under
NAME = "portakern"


# -- masks -------------------------------------------------------------------------------------------------

def portakern_mask(batch_size: int, q_length: int, kv_length: int, q_offset: Any = 0, kv_offset: int = 0,
                   mask_function: Any = None, attention_mask: torch.Tensor | None = None, use_vmap: bool = False,
                   device: Any = None, **kwargs) -> torch.Tensor | None:
    """The mask transformers hands to ``portakern_attention``: None when every key the layer returns is valid
    (no cache, ``DynamicCache``), else the number of valid keys per batch entry as a ``(batch_size,)`` int32
    tensor (``StaticCache``'s full-length buffers: ``q_offset + q_length - kv_offset`` capped at ``kv_length``,
    computed on the device from the cache's length tensor, no host sync).

    Raises:
      NotImplementedError for a 2-D ``attention_mask`` holding a zero (padding; checked outside
      ``torch.compile`` and CUDA graph capture) and for extra mask functions (``use_vmap``: an ``or``/``and``
      mask a model adds).
    """
    if use_vmap:
        raise NotImplementedError("attn_implementation='portakern' supports causal, sliding-window and "
                                  "bidirectional masks only: this model adds its own mask function "
                                  "(or_mask_function / and_mask_function); load it with attn_implementation='sdpa'")
    if attention_mask is not None and not _capturing() and not bool(attention_mask.all()):
        raise NotImplementedError("attention_mask holds zeros (padding): attn_implementation='portakern' does not "
                                  "support padded batches; batch sequences of equal length (or run them one by "
                                  "one), or load the model with attn_implementation='sdpa' for padded batches")
    valid = q_offset + q_length - kv_offset
    if isinstance(valid, torch.Tensor):
        valid = valid.clamp(max=kv_length).to(device=device, dtype=torch.int32)
        return valid.reshape(1).expand(batch_size).contiguous()
    valid = min(int(valid), kv_length)
    if valid == kv_length:
        return None
    return torch.full((batch_size,), valid, dtype=torch.int32, device=device)


def _capturing() -> bool:
    """Whether values cannot be read on the host here: under ``torch.compile`` or during CUDA graph capture."""
    return torch.compiler.is_compiling() or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


# -- attention ---------------------------------------------------------------------------------------------

def portakern_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                        **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract on ``torch.ops.portakern.attention``.

    Args:
      module: the attention layer (its ``is_causal`` and, when the call has none, ``sliding_window``).
      query: ``(B, Hq, Sq, D)``; key, value: ``(B, Hkv, Sk, D)`` (``Hq % Hkv == 0``; read as strided views,
        not copied).
      attention_mask: what ``portakern_mask`` built: None (every key valid) or ``(B,)`` int32 valid-key counts.
      scaling: score scale (default ``1 / sqrt(D)``).
      dropout: must be 0 (inference).
      kwargs: ``sliding_window`` (a query sees the ``sliding_window`` keys ending at its own position),
        ``softcap`` (scores become ``softcap * tanh(score / softcap)``), ``is_causal``; the rest are ignored.

    Returns:
      ``(out (B, Sq, Hq, D), None)``: no attention weights.

    Raises:
      NotImplementedError for dropout > 0, a 4-D or float mask, attention sinks (``s_aux``), position biases.
    """
    if dropout:
        raise NotImplementedError(f"dropout={dropout}: attn_implementation='portakern' runs inference only; call "
                                  "model.eval() (or set the config's attention_dropout to 0.0) before training-"
                                  "mode forwards, or train with attn_implementation='sdpa'")
    for name in ("s_aux", "sinks", "position_bias"):
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"{name} is given: attn_implementation='portakern' has no attention sinks "
                                      "or position biases; load this model with attn_implementation='sdpa'")
    seqlens_k = None
    if attention_mask is not None:
        if attention_mask.dim() != 1 or attention_mask.dtype != torch.int32:
            raise NotImplementedError(
                f"attention_mask has shape {tuple(attention_mask.shape)} and dtype {attention_mask.dtype}: "
                "attn_implementation='portakern' takes no explicit 4-D masks, only the causal / sliding-window masks "
                "transformers builds from a 2-D attention_mask; pass a 2-D mask (or none), or use 'sdpa'")
        seqlens_k = attention_mask
    window = kwargs["sliding_window"] if "sliding_window" in kwargs else getattr(module, "sliding_window", None)
    causal = kwargs.get("is_causal")
    causal = bool(getattr(module, "is_causal", True) if causal is None else causal)
    softcap = kwargs.get("softcap") or 0.0
    out = attention_op(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), causal=causal,
                       scale=scaling, window=_window(window, causal), softcap=float(softcap), seqlens_k=seqlens_k)
    return out, None


def _window(sliding_window: int | None, causal: bool) -> tuple[int, int] | None:
    """transformers' ``sliding_window`` W (a query sees keys ``j > i - W``) as portakern's ``(left, right)``:
    ``(W - 1, 0)`` causal, ``(W - 1, W - 1)`` bidirectional; None without a window."""
    if not sliding_window:
        return None
    w = int(sliding_window) - 1
    return (w, 0) if causal else (w, w)


def register() -> None:
    """Register ``portakern_attention`` and ``portakern_mask`` under ``"portakern"`` (importing this module does
    it; calling again is harmless)."""
    AttentionInterface.register(NAME, portakern_attention)
    AttentionMaskInterface.register(NAME, portakern_mask)


register()


# -- quantized linear layers ---------------------------------------------------------------------------------

class QuantLinearWithBias(QuantLinear):
    """``QuantLinear`` plus a bias buffer: ``forward(x) = x @ dequant(W)^T + bias`` (in ``x``'s dtype)."""

    def __init__(self, w, bias: torch.Tensor, device: Any = None, layout: str | None = None):
        super().__init__(w, device, layout)
        self.register_buffer("bias", bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + self.bias.to(x.dtype)


def quantize_model(model: torch.nn.Module, bits: int = 4, group_size: int = 128,
                   exclude: Iterable[str] = ("lm_head",), *, symmetric: bool = False,
                   scale_dtype: str = "float16", layout: str | None = None) -> torch.nn.Module:
    """Swap every ``nn.Linear`` of ``model`` (in place) for portakern's quantized linear, except ``exclude``.

    Each weight is quantized with ``portakern.quantize`` (round-to-nearest per group of ``group_size`` input
    channels, asymmetric unless ``symmetric``) on the device it is on, and repacked once into the GEMV layout
    (``portakern.torch_ops.QuantLinear``); a bias is kept (``QuantLinearWithBias``). Tied weights: an excluded
    ``lm_head`` keeps its tie to the embedding.

    Args:
      model: any ``nn.Module`` (a transformers model or not).
      bits: 4 or 8.
      group_size: a divisor of every swapped layer's in_features, or -1 for one group per row.
      exclude: module names kept in float: a name matches a module whose qualified name equals it or ends
        with ``"." + name`` (``"lm_head"``, ``"mlp.down_proj"``, ``"model.layers.0.self_attn.q_proj"``).
      symmetric, scale_dtype: as ``portakern.quantize``.
      layout: as ``QuantLinear`` (``portakern.gemv_weight.LAYOUTS``; None: its default).

    Returns:
      ``model``, with ``model.portakern_quantized`` a dict: ``"swapped"`` (the qualified names replaced),
      ``"excluded"`` (Linear layers kept), ``"bits"``, ``"group_size"``. The same summary is logged at INFO.

    Raises:
      InvalidInputError for bits other than 4 or 8, a group size that does not divide a layer's in_features
      (naming the layer), a name in ``exclude`` that matches no module (unless it is the default ``"lm_head"``)
      or matches a module that is not an ``nn.Linear``.
      InvalidTypeError for a ``model`` that is not an ``nn.Module`` or an ``exclude`` that is a plain string.
    """
    import portakern

    if not isinstance(model, torch.nn.Module):
        raise InvalidTypeError(f"model is a {type(model).__name__}: quantize_model takes a torch.nn.Module")
    if isinstance(exclude, str):
        raise InvalidTypeError(f"exclude={exclude!r} is a string: pass a tuple of module names, e.g. ({exclude!r},)")
    if isinstance(bits, bool) or bits not in (4, 8):
        raise InvalidInputError(f"bits={bits!r} is not supported by quantize_model: choose 4 or 8")
    exclude = tuple(exclude)
    modules = dict(model.named_modules())

    def excluded(name: str) -> bool:
        return any(name == e or name.endswith("." + e) for e in exclude)

    for e in exclude:
        hits = [n for n in modules if n == e or n.endswith("." + e)]
        if not hits and e != "lm_head":
            raise InvalidInputError(f"exclude names {e!r}, which matches no module of this "
                                    f"{type(model).__name__}: use a name from model.named_modules()")
        bad = [n for n in hits if not isinstance(modules[n], torch.nn.Linear)]
        if bad:
            raise InvalidInputError(f"exclude names {e!r}, which matches {bad[0]!r}, a "
                                    f"{type(modules[bad[0]]).__name__}, not an nn.Linear: quantize_model swaps "
                                    "only nn.Linear layers, so name Linear layers only")
    targets = [n for n, m in modules.items() if type(m) is torch.nn.Linear and not excluded(n)]
    kept = [n for n, m in modules.items() if type(m) is torch.nn.Linear and excluded(n)]
    for name in targets:
        k = modules[name].in_features
        if group_size != -1 and (not isinstance(group_size, int) or group_size < 2 or k % group_size):
            raise InvalidInputError(f"group_size={group_size!r} does not divide in_features={k} of {name!r}: pick a "
                                    "divisor of every layer's in_features, -1 for one group per row, or add the "
                                    "layer to exclude")
    del modules   # each float layer is freed as it is swapped: the peak stays near the float model's size
    for name in targets:
        parent, _, attr = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        lin = getattr(owner, attr)
        w = portakern.quantize(lin.weight.detach(), bits=bits, group_size=group_size, symmetric=symmetric,
                               scale_dtype=scale_dtype)
        dev = lin.weight.device
        setattr(owner, attr, QuantLinear(w, dev, layout) if lin.bias is None
                else QuantLinearWithBias(w, lin.bias, dev, layout))
        del lin, w
    swapped = targets
    model.portakern_quantized = {"swapped": swapped, "excluded": kept, "bits": bits, "group_size": group_size}
    logger.info("portakern quantize_model: %d Linear layers to int%d g%s, %d kept in float (%s)", len(swapped),
                bits, group_size, len(kept), ", ".join(kept) or "none")
    return model


__all__ = ["NAME", "QuantLinearWithBias", "portakern_attention", "portakern_mask", "quantize_model", "register"]
