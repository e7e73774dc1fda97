"""The triton backend's lowering of ``score_mod`` / ``mask_mod`` expressions to Triton.

The generator is ``attn_fwd``'s own and lives beside it, in ``kernels/expr_mods.py`` (shared with triton-rocm,
which launches the same kernel body; that module documents the generated functions, their types and the mask
analysis). This module binds it to this backend: each pair of expressions becomes a generated module
``<cache_dir>/triton-expr/mods_<hash>.py``, imported as ``portakern_triton_mods_<hash>_<flavour>``.
"""

from __future__ import annotations

from .kernels.expr_mods import (GENERATOR_VERSION, ExprModules, MaskBounds, TritonEmitter, analyse_mask,
                                expression_key)

__all__ = ["GENERATOR_VERSION", "MaskBounds", "TritonEmitter", "analyse_mask", "expression_key", "generate_source",
           "load_mods"]

_MODULES = ExprModules(writer=__name__, subdir="triton-expr", prefix="portakern_triton_mods")

#: ``generate_source(score_mod, mask_mod)``: the text of the generated module for the pair.
generate_source = _MODULES.source
#: ``load_mods(score_mod, mask_mod, interpret)``: the imported module of the pair in the Triton flavour asked for.
load_mods = _MODULES.load
