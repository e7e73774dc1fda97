"""portakern's kernel IR: what to compute, independent of any device.

Imported as ``portakern.ir``. See ``docs/ir.md`` for the exact semantics of every node.
"""

from . import expr
from .dtypes import DType, STORAGE_FLOATS, TensorSpec
from .expr import Expr, Op
from .ops import Attention, KVLayout, QuantGemv, content_hash, op_from_json
from .quant import Packing, QuantFormat

__all__ = ["Attention", "DType", "Expr", "KVLayout", "Op", "Packing", "QuantFormat", "QuantGemv",
           "STORAGE_FLOATS", "TensorSpec", "content_hash", "expr", "op_from_json"]
