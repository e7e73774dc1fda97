"""Lower an ``ir.expr.Expr`` tree to Triton source, and load it as ``@triton.jit`` functions.

``@triton.jit`` needs real source on disk, so each distinct pair of expressions becomes a small
generated module ``<cache_dir>/triton-expr/mods_<hash>.py`` holding two functions::

    score_mod(score, b, h, q_idx, kv_idx, seqlen_q, seqlen_k) -> float32 tile (the new score)
    mask_mod(b, h, q_idx, kv_idx, seqlen_q, seqlen_k)        -> boolean tile (True keeps the key)

The attention kernel receives them as ``tl.constexpr`` function arguments and calls them on each
score tile; Triton inlines them. Variables arrive as int32 scalars (``b``, ``seqlen_q``,
``seqlen_k``) or broadcastable int32 tensors (``h`` and ``q_idx`` of shape (M, 1), ``kv_idx``
of shape (1, N)); ``score`` is a float32 (M, N) tile.

Types follow the IR's evaluator (``portakern.ir.evaluate``): booleans read as 0/1 in
arithmetic, ``div`` is true division, ``and``/``or``/``not`` act on truth values. Integers are
int32 here (int64 in the reference): positions and lengths fit. Subtrees without variables are
folded to constants with the reference evaluator, so the two agree on them exactly.

This module also recognises the library masks (``causal_mask``, ``window_mask``) inside an AND
of terms, so the kernel can skip key tiles that no query row of a tile can see (``MaskBounds``).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import os
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from portakern.errors import UnsupportedError
from portakern.ir import expr as E
from portakern.ir.expr import Expr, Op

#: Bump when the generated text changes meaning (it is part of every file name).
GENERATOR_VERSION = 1

_BINARY_SYMBOL = {Op.ADD: "+", Op.SUB: "-", Op.MUL: "*", Op.DIV: "/", Op.LT: "<", Op.LE: "<=",
                  Op.GT: ">", Op.GE: ">=", Op.EQ: "==", Op.NE: "!="}
_INT_VARS = frozenset({"b", "h", "q_idx", "kv_idx", "seqlen_q", "seqlen_k"})


# -- typing --------------------------------------------------------------------------------------

kind_of = E.value_kind  # the IR's typing of an expression (numpy promotion)


# -- code generation ------------------------------------------------------------------------------

class _Emitter:
    """Turns a tree into one Python/Triton expression string."""

    def __init__(self) -> None:
        self.needs_tanh = False

    def emit(self, node: Expr) -> str:
        if not node.variables() and node.op is not Op.CONST:
            return self._fold(node)
        op = node.op
        if op is Op.VAR:
            return str(node.value)
        if op is Op.CONST:
            return self._literal(node.value)
        a = node.args
        if op is Op.NEG:
            return f"(-{self.num(a[0])})"
        if op is Op.ABS:
            return f"tl.abs({self.num(a[0])})"
        if op is Op.EXP:
            return f"tl.exp({self.flt(a[0])})"
        if op is Op.TANH:
            self.needs_tanh = True
            return f"_tanh({self.flt(a[0])})"
        if op is Op.NOT:
            return f"({self.truth(a[0])} == 0)"
        if op in (Op.AND, Op.OR):
            sym = "&" if op is Op.AND else "|"
            return f"({self.truth(a[0])} {sym} {self.truth(a[1])})"
        if op in (Op.MIN, Op.MAX):
            fn = "tl.minimum" if op is Op.MIN else "tl.maximum"
            x, y = self._pair(a[0], a[1], kind_of(node))
            return f"{fn}({x}, {y})"
        if op is Op.DIV:
            return f"({self.flt(a[0])} / {self.num(a[1])})"
        if op in _BINARY_SYMBOL:
            return f"({self.num(a[0])} {_BINARY_SYMBOL[op]} {self.num(a[1])})"
        if op is Op.WHERE:
            kind = kind_of(node)
            if kind == "bool":
                x, y = self.truth(a[1]), self.truth(a[2])
            else:
                x, y = self._pair(a[1], a[2], kind)
            return f"tl.where({self.truth(a[0])}, {x}, {y})"
        raise UnsupportedError(f"expression node {node.op.value!r} has no Triton lowering")

    # numeric views of a child ------------------------------------------------------------------
    def num(self, node: Expr) -> str:
        """The child as a number (booleans become int32 0/1)."""
        if not node.variables():
            v = self._value(node)
            return self._literal(int(v) if isinstance(v, bool) else v)
        s = self.emit(node)
        return f"{s}.to(tl.int32)" if kind_of(node) == "bool" else s

    def flt(self, node: Expr) -> str:
        """The child as float32."""
        if not node.variables():
            return self._literal(float(self._value(node)))
        s = self.num(node)
        return s if kind_of(node) == "float" else f"{s}.to(tl.float32)"

    def truth(self, node: Expr) -> str:
        """The child's truth value as a boolean."""
        s = self.emit(node)
        return s if kind_of(node) == "bool" else f"({s} != 0)"

    def _pair(self, x: Expr, y: Expr, kind: str) -> tuple[str, str]:
        if kind == "float":
            return self.flt(x), self.flt(y)
        return self.num(x), self.num(y)

    # constants ----------------------------------------------------------------------------------
    @staticmethod
    def _value(node: Expr):
        """The Python value of a variable-free subtree, by the numpy reference."""
        from portakern.ir.evaluate import evaluate

        value = evaluate(node, {}).item()
        kind = kind_of(node)
        return bool(value) if kind == "bool" else int(value) if kind == "int" else float(value)

    def _fold(self, node: Expr) -> str:
        return self._literal(self._value(node))

    @staticmethod
    def _literal(v) -> str:
        if isinstance(v, bool):
            return "True" if v else "False"
        if isinstance(v, int):
            if not -(2 ** 31) <= v < 2 ** 31:
                raise UnsupportedError(f"integer constant {v} does not fit int32 in the Triton lowering")
            return f"({v})"
        if math.isnan(v):
            return "_NAN"
        if math.isinf(v):
            return "_INF" if v > 0 else "(-_INF)"
        return f"({v!r})"


_HEADER = '''"""Generated by portakern.backends.triton.expr_triton (version {version}); do not edit.

score_mod: {score}
mask_mod:  {mask}
"""
import triton
import triton.language as tl

_INF = tl.constexpr(float("inf"))
_NAN = tl.constexpr(float("nan"))


@triton.jit
def _tanh(x):
    # tanh(|x|) = (1 - e) / (1 + e) with e = exp(-2|x|): no overflow, odd symmetry restored
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
    """The text of the generated module for this pair of expressions (None = identity / all-true)."""
    em = _Emitter()
    if score_mod is None:
        score_body = "score"
    else:
        body = em.flt(score_mod)
        # a score_mod that ignores `score` (or is constant) still returns a full float tile
        score_body = body if "score" in score_mod.variables() else f"{body} + tl.zeros_like(score)"
    if mask_mod is None:
        mask_body = "kv_idx >= 0"
    elif not mask_mod.variables():
        mask_body = "kv_idx >= 0" if em._fold(mask_mod) == "True" else "kv_idx < 0"
    else:
        mask_body = em.truth(mask_mod)
    return _HEADER.format(version=GENERATOR_VERSION, score=score_mod, mask=mask_mod,
                          score_body=score_body, mask_body=mask_body)


# -- loading --------------------------------------------------------------------------------------

_modules: dict[tuple[str, bool], ModuleType] = {}
_lock = threading.Lock()


def _cache_root() -> Path:
    from portakern.cache import cache_dir

    return cache_dir() / "triton-expr"


def load_mods(score_mod: Expr | None, mask_mod: Expr | None, interpret: bool) -> ModuleType:
    """Generate (once per expression hash), write and import the module of the two functions.

    ``interpret`` selects Triton's interpreter flavour of ``@triton.jit`` (CPU) or the compiler's;
    the same file is imported once for each flavour asked for.
    """
    text = generate_source(score_mod, mask_mod)
    digest = hashlib.sha256(text.encode()).hexdigest()[:20]
    key = (digest, interpret)
    mod = _modules.get(key)
    if mod is not None:
        return mod
    with _lock:
        mod = _modules.get(key)
        if mod is None:
            path = _write(digest, text)
            name = f"portakern_triton_mods_{digest}_{'interp' if interpret else 'jit'}"
            mod = exec_module_file(path, name, interpret)
            _modules[key] = mod
    return mod


def _write(digest: str, text: str) -> Path:
    root = _cache_root()
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


def exec_module_file(path: Path, name: str, interpret: bool) -> ModuleType:
    """Import the file at ``path`` as module ``name`` with ``TRITON_INTERPRET`` forced to ``interpret``.

    ``@triton.jit`` reads the variable when it decorates, so this yields interpreter functions or
    compiler ``JITFunction``s regardless of the process environment.
    """
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    from .backend import interpret_env

    with interpret_env(interpret):
        try:
            sys.modules[name] = mod
            spec.loader.exec_module(mod)
        except BaseException:
            sys.modules.pop(name, None)
            raise
    return mod


# -- library-mask recognition ----------------------------------------------------------------------

_DIAG = E.q_idx + E.seqlen_k - E.seqlen_q   # the bottom-right aligned diagonal


@dataclass(frozen=True)
class MaskBounds:
    """What the kernel may assume about a mask_mod, derived structurally.

    ``left`` / ``right``: the key range ``[i + off - left, i + off + right]`` (off = Sk - Sq) outside
    of which every key is hidden; None = unbounded on that side. ``residual``: the mask has other
    terms, so it must be evaluated on every tile (bounds still allow skipping). ``never``: the mask
    is constantly False.
    """

    left: int | None = None
    right: int | None = None
    residual: bool = False
    never: bool = False

    def to_json(self) -> dict:
        return {"left": self.left, "right": self.right, "residual": self.residual, "never": self.never}


def _terms(node: Expr) -> list[Expr]:
    if node.op is Op.AND:
        return _terms(node.args[0]) + _terms(node.args[1])
    return [node]


def _int_const(node: Expr) -> int | None:
    if node.op is Op.CONST and isinstance(node.value, int) and not isinstance(node.value, bool):
        return node.value
    return None


def analyse_mask(mask_mod: Expr | None) -> MaskBounds:
    """Split ``mask_mod`` into AND-terms and recognise ``causal_mask()`` / ``window_mask(l, r)`` terms."""
    if mask_mod is None:
        return MaskBounds()
    left: int | None = None
    right: int | None = None
    residual = never = False
    for term in _terms(mask_mod):
        if term.op is Op.CONST and isinstance(term.value, bool):
            never |= not term.value
            continue
        lhs, rhs = (term.args + (None, None))[:2]
        if term.op is Op.LE and lhs == E.kv_idx:
            c = 0 if rhs == _DIAG else (_int_const(rhs.args[1]) if rhs.op is Op.ADD and rhs.args[0] == _DIAG else None)
            if c is not None:
                right = c if right is None else min(right, c)
                continue
        if term.op is Op.GE and lhs == E.kv_idx:
            c = 0 if rhs == _DIAG else (_int_const(rhs.args[1]) if rhs.op is Op.SUB and rhs.args[0] == _DIAG else None)
            if c is not None:
                left = c if left is None else min(left, c)
                continue
        residual = True
    return MaskBounds(left, right, residual, never)


def expression_key(score_mod: Expr | None, mask_mod: Expr | None) -> str:
    """A short stable hash of the expression pair (for logs and tuning keys)."""
    text = json.dumps([None if score_mod is None else score_mod.to_json(),
                       None if mask_mod is None else mask_mod.to_json()], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]
