"""portakern: portable attention and weight-only quantized GEMV kernels for LLM inference.

Quickstart::

    import portakern
    out = portakern.attention(q, k, v, causal=True)          # fastest backend for q's device
    w4 = portakern.quantize(w, bits=4, group_size=128)
    y = portakern.quant_gemv(x, w4)
    print(portakern.explain(portakern.attention, q, k, v, causal=True))
"""

from . import ir  # noqa: F401  (portakern.ir)
from .api import attention, devices, explain, list_backends, plugin_errors, quant_gemv
from .backend import Backend, Support
from .checkpoints import load_awq, load_gguf, load_gptq
from .devices import Device
from .dispatch import FallbackWarning, use_backend, use_policy
from .errors import (BackendError, InvalidInputError, InvalidTypeError, PluginError, PortakernError,
                     StrictModeError, UnsupportedError)
from .capture import CaptureError
from .plugins import hookimpl
from .prepare_ahead import prepare, prepare_model
from .quantize import quantize
from .quantized import QuantizedWeight

__version__ = "0.1.0"

__all__ = ["Backend", "BackendError", "CaptureError", "Device", "FallbackWarning", "InvalidInputError",
           "InvalidTypeError", "PluginError", "PortakernError", "QuantizedWeight", "StrictModeError", "Support",
           "UnsupportedError", "attention", "devices", "explain", "hookimpl", "list_backends", "plugin_errors", "prepare",
           "prepare_model", "quant_gemv", "quantize", "use_backend", "use_policy"]
__all__ += ["load_awq", "load_gguf", "load_gptq"]
