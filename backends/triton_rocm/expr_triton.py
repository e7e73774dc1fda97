"""``score_mod`` / ``mask_mod`` expression trees as Triton functions for the triton-rocm backend.

The attention kernel body (the triton backend's ``attn_fwd``) takes the two modifications as ``tl.constexpr``
functions with the signatures::

    score_mod(score, b, h, q_idx, kv_idx, seqlen_q, seqlen_k) -> float32 (M, N) tile, the new score
    mask_mod(b, h, q_idx, kv_idx, seqlen_q, seqlen_k)        -> boolean tile, True keeps the key

with ``b`` and the lengths int32 scalars, ``h`` and ``q_idx`` int32 (M, 1), ``kv_idx`` int32 (1, N). This module
writes them, per distinct pair of trees, into a Python file under ``<cache_dir>/triton-rocm-expr/`` (``@triton.jit``
reads its function's source from disk) and imports it in the process's Triton flavour. Triton is one language on
every GPU, so the text is the same as for NVIDIA; this backend owns its own copy of the generator because a
backend imports no other backend's modules but its kernel bodies.

Semantics are the IR evaluator's (``portakern.ir.evaluate``) through ``portakern.cstyle.CStyleEmitter``: booleans
are 0/1 in arithmetic, ``div`` is true division, ``and`` / ``or`` / ``not`` act on truth values, constants are
folded by the evaluator. ``analyse_mask`` finds ``causal_mask()`` / ``window_mask(l, r)`` terms in an AND so the
kernel skips key tiles no row of a query tile can see.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from portakern.cstyle import CStyleEmitter
from portakern.ir import expr as E
from portakern.ir.expr import Expr, Op, value_kind

#: Part of every generated file's name: change it when the generated text changes meaning.
GENERATOR_VERSION = 1


def _binary_fn(name: str):
    def code(em: CStyleEmitter, node: Expr, a: tuple) -> str:
        x, y = em.pair(a[0], a[1], value_kind(node))
        return f"{name}({x}, {y})"

    return code


class TritonEmitter(CStyleEmitter):
    """Triton's spelling: Python operators, ``tl.*`` functions, Python literals, int32 integers; Triton promotes
    mixed operands itself, and a constant child is written as a literal of the view asked for (a literal has no
    ``.to``)."""

    language = "Triton"
    int_bits = 32
    int_type = "int32"
    true_literal, false_literal = "True", "False"
    nan_literal, inf_literal = "_NAN", "_INF"
    explicit_promotion = False
    code_for_op = {
        **CStyleEmitter.code_for_op,
        Op.ABS: lambda em, n, a: f"tl.abs({em.num(a[0])})",
        Op.EXP: lambda em, n, a: f"tl.exp({em.flt(a[0])})",
        Op.TANH: lambda em, n, a: f"_tanh({em.flt(a[0])})",
        Op.NOT: lambda em, n, a: f"({em.truth(a[0])} == 0)",
        Op.AND: lambda em, n, a: f"({em.truth(a[0])} & {em.truth(a[1])})",
        Op.OR: lambda em, n, a: f"({em.truth(a[0])} | {em.truth(a[1])})",
        Op.MIN: _binary_fn("tl.minimum"),
        Op.MAX: _binary_fn("tl.maximum"),
        Op.WHERE: lambda em, n, a: "tl.where({}, {}, {})".format(em.truth(a[0]), *em.select(n)),
    }

    def to_int(self, s: str) -> str:
        return f"{s}.to(tl.int32)"

    def to_float(self, s: str) -> str:
        return f"{s}.to(tl.float32)"

    def num(self, node: Expr) -> str:
        if not node.variables():
            v = self.value(node)
            return self.literal(int(v) if isinstance(v, bool) else v)
        return super().num(node)

    def flt(self, node: Expr) -> str:
        if not node.variables():
            return self.literal(float(self.value(node)))
        return super().flt(node)


_MODULE = '''"""Written by portakern.backends.triton_rocm.expr_triton (generator {version}); regenerated, never edited.

score_mod: {score}
mask_mod:  {mask}
"""
import triton
import triton.language as tl

_INF = tl.constexpr(float("inf"))
_NAN = tl.constexpr(float("nan"))


@triton.jit
def _tanh(x):
    # from exp(-2|x|), which never overflows; the sign put back after
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def score_mod(score, b, h, q_idx, kv_idx, seqlen_q, seqlen_k):
    return {score_body}


@triton.jit
def mask_mod(b, h, q_idx, kv_idx, seqlen_q, seqlen_k):
    return {mask_body}
'''


def generate_source(score_mod: Expr | None, mask_mod: Expr | None) -> str:
    """The generated module's text for the pair (None: the score unchanged / every key kept). Raises
    ``UnsupportedError`` for a tree with an op Triton has no spelling for (``supports`` turns it into a reason)."""
    em = TritonEmitter()
    if score_mod is None:
        score_body = "score"
    else:
        body = em.flt(score_mod)
        # a tree that does not read `score` still has to return a full tile
        score_body = body if "score" in score_mod.variables() else f"{body} + tl.zeros_like(score)"
    if mask_mod is None:
        mask_body = "kv_idx >= 0"
    elif not mask_mod.variables():
        keep = em.literal(em.value(mask_mod)) == em.true_literal
        mask_body = "kv_idx >= 0" if keep else "kv_idx < 0"
    else:
        mask_body = em.truth(mask_mod)
    return _MODULE.format(version=GENERATOR_VERSION, score=score_mod, mask=mask_mod,
                          score_body=score_body, mask_body=mask_body)


_loaded: dict[tuple[str, bool], ModuleType] = {}
_lock = threading.Lock()


def load_mods(score_mod: Expr | None, mask_mod: Expr | None, interpret: bool) -> ModuleType:
    """The generated module of the pair, written once per text and imported once per flavour (``interpret``:
    Triton's interpreter functions, else compiler ones)."""
    text = generate_source(score_mod, mask_mod)
    digest = hashlib.sha256(text.encode()).hexdigest()[:20]
    key = (digest, interpret)
    mod = _loaded.get(key)
    if mod is None:
        from .kernels import exec_module_file

        with _lock:
            mod = _loaded.get(key)
            if mod is None:
                path = _write(digest, text)
                flavour = "interp" if interpret else "jit"
                mod = _loaded[key] = exec_module_file(path, f"portakern_triton_rocm_mods_{digest}_{flavour}",
                                                      interpret)
    return mod


def _write(digest: str, text: str) -> Path:
    """The file of ``text`` under the cache directory (written atomically unless it already holds ``text``)."""
    from portakern.cache import cache_dir

    root = cache_dir() / "triton-rocm-expr"
    path = root / f"mods_{digest}.py"
    try:
        if path.read_text() == text:
            return path
    except OSError:
        pass
    root.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=root, prefix=".tmp-", suffix=".py")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


# -- the library masks ---------------------------------------------------------------------------------------------

#: The diagonal of bottom-right aligned causal attention: query i sees keys up to i + Sk - Sq.
_DIAGONAL = E.q_idx + E.seqlen_k - E.seqlen_q


@dataclass(frozen=True)
class MaskBounds:
    """What the kernel may assume of a mask: every key outside ``[i + off - left, i + off + right]``
    (``off = Sk - Sq``; None: unbounded on that side) is hidden; ``residual``: other terms remain, evaluated on
    every tile; ``never``: the mask is constantly False."""

    left: int | None = None
    right: int | None = None
    residual: bool = False
    never: bool = False


def _and_terms(node: Expr) -> list[Expr]:
    return _and_terms(node.args[0]) + _and_terms(node.args[1]) if node.op is Op.AND else [node]


def _offset(node: Expr, op: Op) -> int | None:
    """``c`` when ``node`` is the diagonal (0) or ``diagonal <op> c`` with an integer constant c, else None."""
    if node == _DIAGONAL:
        return 0
    if node.op is op and node.args[0] == _DIAGONAL:
        c = node.args[1]
        if c.op is Op.CONST and isinstance(c.value, int) and not isinstance(c.value, bool):
            return c.value
    return None


def analyse_mask(mask_mod: Expr | None) -> MaskBounds:
    """Recognise ``kv_idx <= diagonal [+ c]`` and ``kv_idx >= diagonal [- c]`` among the AND terms of
    ``mask_mod`` (what ``causal_mask()`` and ``window_mask(l, r)`` build); anything else is residual."""
    if mask_mod is None:
        return MaskBounds()
    left = right = None
    residual = never = False
    for term in _and_terms(mask_mod):
        if term.op is Op.CONST and isinstance(term.value, bool):
            never |= not term.value
            continue
        if term.op in (Op.LE, Op.GE) and term.args[0] == E.kv_idx:
            if term.op is Op.LE:
                c = _offset(term.args[1], Op.ADD)
                if c is not None:
                    right = c if right is None else min(right, c)
                    continue
            else:
                c = _offset(term.args[1], Op.SUB)
                if c is not None:
                    left = c if left is None else min(left, c)
                    continue
        residual = True
    return MaskBounds(left, right, residual, never)
