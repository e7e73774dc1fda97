"""The triton-rocm backend's lowering of ``score_mod`` / ``mask_mod`` expressions to Triton.

The attention kernel body is the triton backend's ``attn_fwd``, and so is the generator of the two functions it
calls: Triton is one language on every GPU, so the text is the same as for NVIDIA. It lives beside the kernel, in
``portakern.backends.triton.kernels.expr_mods`` (under the one designed edge between two backends; that module
documents the generated functions, their types and the mask analysis). This module binds it to this backend: each
pair of expressions becomes a generated module ``<cache_dir>/triton-rocm-expr/mods_<hash>.py``, imported as
``portakern_triton_rocm_mods_<hash>_<flavour>``.
"""

from __future__ import annotations

from portakern.backends.triton.kernels.expr_mods import (GENERATOR_VERSION, ExprModules, MaskBounds, TritonEmitter,
                                                         analyse_mask)

__all__ = ["GENERATOR_VERSION", "MaskBounds", "TritonEmitter", "analyse_mask", "generate_source", "load_mods"]

_MODULES = ExprModules(writer=__name__, subdir="triton-rocm-expr", prefix="portakern_triton_rocm_mods")

#: ``generate_source(score_mod, mask_mod)``: the text of the generated module for the pair.
generate_source = _MODULES.source
#: ``load_mods(score_mod, mask_mod, interpret)``: the imported module of the pair in the Triton flavour asked for.
load_mods = _MODULES.load
