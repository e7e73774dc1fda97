"""Loading quantized checkpoints from disk: GGUF files (``load_gguf``), AWQ and GPTQ safetensors (``load_awq``,
``load_gptq``), and two exact rewrites of GGUF K-quants into native weights (``repack_exact``, ``split_mins``).

Every loader returns plain data: ``{name: QuantizedWeight}`` (and, for GGUF, float arrays for the unquantized
tensors), nothing is moved to a device (``QuantizedWeight.to(device)`` does that). Errors name the file, the
tensor and the way out; a truncated or corrupt file is an ``InvalidInputError``, a type portakern cannot hold an
``UnsupportedError``.

Which backend runs which GGUF type (``portakern.quant_gemv``): Q4_0 and Q8_0 every backend; Q4_K, Q5_K and Q6_K
as stored the cpu, triton, triton-rocm and opencl backends, whose prepared weights keep the float32 scales
``d * sc`` and (Q4_K, Q5_K) the per-group float minimums ``dmin * m`` exactly (``portakern.gemv_kquants``); the
cuda and torch backends refuse them, naming those. Q6_K after ``repack_exact`` (native int8 codes with zero point
32 and float32 scales ``d * sc``: bit for bit the same weight) is a native weight any backend reading 8-bit
groups of 16 runs; ``split_mins`` gives Q4_K and Q5_K an exact form of two native weights (two GEMVs) for a
backend without a K-quant kernel.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from portakern.ir import gguf_kquants
from portakern.ir.dtypes import DType
from portakern.ir.quant import Packing, QuantFormat

from .arrays import to_numpy
from .errors import InvalidInputError, InvalidTypeError, UnsupportedError
from .quantized import _GGML_TYPES, QuantizedWeight

__all__ = ["load_awq", "load_gguf", "load_gptq", "repack_exact", "split_mins"]

_FLOAT_TYPES = ("F32", "F16", "BF16")


# -- GGUF --------------------------------------------------------------------------------------

def load_gguf(path: str | os.PathLike, *, repack: bool = False,
              skip_unsupported: bool = False) -> dict[str, QuantizedWeight | np.ndarray]:
    """Read every tensor of the GGUF file ``path`` with the ``gguf`` package's reader.

    Returns ``{tensor name: value}`` in file order: a ``QuantizedWeight`` for the 2-D tensors of type Q4_0, Q8_0,
    Q4_K, Q5_K and Q6_K (shape ``(N, K)`` in numpy order, the reverse of the file's dimension list; the bytes are
    copy-on-write views of the memory-mapped file: nothing is read before it is used, and a write never reaches
    the file), a numpy array for F32 and F16 (views alike) and BF16 (converted exactly to float32, which numpy
    can hold).

    Args:
        path: the ``.gguf`` file.
        repack: True repacks each Q6_K weight exactly into the native int8 layout (``repack_exact``); Q4_K and
            Q5_K stay as they are (no exact native form exists; the cpu, triton, triton-rocm and opencl backends
            run them as stored, as they do Q6_K).
        skip_unsupported: True leaves out tensors of other types (Q2_K, Q3_K, IQ*, ...) and quantized tensors that
            are not 2-D, with one warning listing them; False raises on the first.

    Raises:
        InvalidInputError: the file is missing, not GGUF, truncated or corrupt (naming the tensor cut off where it
            can be told).
        UnsupportedError: a tensor portakern cannot hold, naming the file, tensor and type, unless
            ``skip_unsupported``; or the ``gguf`` package is not installed.
    """
    reader = _open_gguf(path)
    out: dict[str, QuantizedWeight | np.ndarray] = {}
    skipped = []
    for t in reader.tensors:
        kind = t.tensor_type.name
        shape = tuple(int(s) for s in reversed(t.shape.tolist()))       # numpy order: outermost first
        if kind in _FLOAT_TYPES:
            out[t.name] = _float_tensor(t.data, kind, shape)
            continue
        why = None
        if kind not in _GGML_TYPES:
            why = (f"type {kind} is not one portakern holds (it reads {', '.join(_GGML_TYPES)} and "
                   f"{', '.join(_FLOAT_TYPES)})")
        elif len(shape) != 2:
            why = (f"it is a {len(shape)}-D {kind} tensor of shape {shape}: a QuantizedWeight is a 2-D (N, K) "
                   "weight")
        if why:
            if not skip_unsupported:
                raise UnsupportedError(f"{path}: tensor {t.name!r}: {why}; pass skip_unsupported=True to load the "
                                       "rest, or dequantize it with gguf.quants.dequantize")
            skipped.append(f"{t.name} ({kind}, {shape})")
            continue
        weight = QuantizedWeight.from_gguf(np.asarray(t.data).reshape(shape[0], -1), kind, shape)
        out[t.name] = repack_exact(weight) if repack else weight
    if skipped:
        warnings.warn(f"load_gguf({str(path)!r}) left out {len(skipped)} tensors it cannot hold: "
                      f"{', '.join(skipped)}", stacklevel=2)
    return out


def _float_tensor(data: np.ndarray, kind: str, shape: tuple[int, ...]) -> np.ndarray:
    if kind != "BF16":
        return data.reshape(shape)
    bits = np.ascontiguousarray(data).view("<u2").astype(np.uint32) << 16         # bfloat16 = top half of fp32
    return bits.view(np.float32).reshape(shape)


def _open_gguf(path: str | os.PathLike):
    try:
        import gguf
    except ImportError:
        raise UnsupportedError("load_gguf needs the gguf package: pip install gguf (or portakern[checkpoints])") \
            from None
    if not Path(path).is_file():
        raise InvalidInputError(f"load_gguf: {path} is not a file; pass the path of a .gguf file")
    seen: dict[str, Any] = {}

    class Reader(gguf.GGUFReader):                  # remembers the tensor table to name a truncated tensor
        def _build_tensors(self, start_offs, fields):
            seen.update(start=start_offs, fields=fields, size=len(self.data))
            return super()._build_tensors(start_offs, fields)

    try:
        return Reader(path, "c")                   # copy-on-write: writable views (torch wraps them quietly)
    except Exception as e:                          # the reader raises ValueError, IndexError, struct errors, ...
        cut = _cut_tensor(seen, gguf)
        what = cut or f"{type(e).__name__}: {e}"
        raise InvalidInputError(f"{path} is not a readable GGUF file ({what}); it is truncated or corrupt: "
                                "download or convert it again") from e


def _cut_tensor(seen: dict[str, Any], gguf) -> str | None:
    """Which tensor of the table ends past the end of the file, and where (None when none or unknown)."""
    try:
        for field in seen["fields"]:
            _, name, _, dims, raw_type, offset = field.parts
            block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(int(raw_type[0]))]
            start = seen["start"] + int(offset[0])
            need = int(np.prod(dims.astype(np.int64))) * size // block
            if start + need > seen["size"]:
                return (f"tensor {bytes(name).decode(errors='replace')!r} runs past the end of the file (it needs "
                        f"bytes {start}..{start + need} of a {seen['size']}-byte file)")
    except Exception:                               # an unexpected table: fall back to the reader's message
        return None
    return None


def repack_exact(weight: QuantizedWeight) -> QuantizedWeight:
    """``weight`` in a native layout, holding bit for bit the same dequantized values.

    GGUF Q6_K becomes ``QuantFormat(8, 16, False, NATIVE, float32)``: the 6-bit codes as int8 codes, zero point
    32, scales ``d * sc`` in float32 (exact: at most 19 significant bits). Every other weight is returned as it is:
    either it is native already, or (Q4_K, Q5_K) no exact integer-zero-point form exists. The repack runs
    on the host: a Q6_K weight on a device raises ``InvalidInputError`` (repack it before ``.to(device)``); host
    numpy or torch tensors give numpy tensors.
    """
    if weight.fmt.packing is not Packing.GGUF_Q6_K:
        return weight
    if weight.device.type != "cpu":
        raise InvalidInputError(f"repack_exact repacks on the host, but this Q6_K weight is on {weight.device}: "
                                "repack the loaded checkpoint first, then call .to(device)")
    tensors = gguf_kquants.q6_k_to_native(to_numpy(weight.tensors["data"]), weight.N, weight.K)
    return QuantizedWeight(QuantFormat(8, 16, False, Packing.NATIVE, DType.float32), weight.N, weight.K, tensors)


def split_mins(weight: QuantizedWeight) -> tuple[QuantizedWeight, QuantizedWeight]:
    """GGUF Q4_K / Q5_K ``weight`` as two native weights, exactly: ``(scaled, mins)`` with

    ``dequant(weight)[n, k] = dequant(scaled)[n, k] - dequant(mins)[n, k // 32]``

    ``scaled`` ``(N, K)``: the codes ``q`` (4-bit for Q4_K, 8-bit holding Q5_K's 5), zero point 0, float32 scales
    ``d * sc`` in groups of 32; ``mins`` ``(N, K // 32)``: the 6-bit ``m`` as int8 codes, zero point 0, float16
    scales ``dmin`` in groups of 8 (one super-block). So ``x @ W.T = quant_gemv(x, scaled) -
    quant_gemv(s, mins)`` with ``s[:, g]`` the sum of ``x[:, 32g : 32g + 32]``: two GEMVs on native weights, for a
    backend without a K-quant kernel (cpu, triton, triton-rocm and opencl run ``weight`` as it is), whose weights
    hold every value bit for bit (the sums and the difference round as any float arithmetic does; form them in
    float32). Host tensors only; ``InvalidInputError`` for another packing or a
    weight on a device.
    """
    if not weight.fmt.has_mins:
        raise InvalidInputError(f"split_mins takes a GGUF Q4_K or Q5_K weight (a float minimum per group), not "
                                f"packing {weight.fmt.packing.value}, which quant_gemv runs as it is")
    if weight.device.type != "cpu":
        raise InvalidInputError(f"split_mins works on the host, but this weight is on {weight.device}: split the "
                                "loaded checkpoint first, then move both parts with .to(device)")
    N, K = weight.N, weight.K
    f = gguf_kquants.unpack_fields(weight.fmt.packing, to_numpy(weight.tensors["data"]), N, K)
    bits = 4 if weight.fmt.packing is Packing.GGUF_Q4_K else 8
    q = f["q"]
    scaled = {"qweight": q[:, 0::2] | (q[:, 1::2] << np.uint8(4)) if bits == 4 else q,
              "scales": (f["d"].astype(np.float32)[..., None] * f["sc"]).reshape(N, -1),
              "zeros": np.zeros((N, K // 32), np.uint8)}
    mins = {"qweight": f["m"].reshape(N, -1), "scales": f["dmin"].astype(np.float16),
            "zeros": np.zeros((N, K // 256), np.uint8)}
    return (QuantizedWeight(QuantFormat(bits, 32, False, Packing.NATIVE, DType.float32), N, K, scaled),
            QuantizedWeight(QuantFormat(8, 8, False, Packing.NATIVE, DType.float16), N, K // 32, mins))


# -- AWQ / GPTQ safetensors --------------------------------------------------------------------

def load_awq(source: str | os.PathLike | Mapping[str, Any], prefix: str | None = None, *,
             group_size: int | None = None, bits: int | None = None) -> dict[str, QuantizedWeight]:
    """Read the AWQ (AutoAWQ GEMM layout) layers of a checkpoint: ``{layer prefix: QuantizedWeight}``.

    ``source``: a ``.safetensors`` file, a folder of them (a sharded checkpoint), or a state dict ``{name: array}``
    (numpy or torch). A layer is every ``<layer>.qweight`` with its ``<layer>.qzeros`` and ``<layer>.scales``;
    other tensors (embeddings, norms, biases) are not returned. ``prefix`` keeps only layers whose name starts
    with it (e.g. ``"model.layers.0."``).

    ``bits`` and ``group_size`` come from the arguments, else from the quant config beside the files
    (``quant_config.json``, ``quantize_config.json`` or ``config.json``'s ``quantization_config``), else
    ``group_size`` is read off the shapes (K over the number of scale rows); both must agree where given twice.
    Only 4-bit GEMM-layout checkpoints exist in this layout (``version: gemm``).

    Raises ``InvalidInputError`` naming the file and tensor for a missing or malformed tensor, a truncated or
    corrupt file, no layer at all (or none under ``prefix``), or a config that disagrees with the arguments;
    ``UnsupportedError`` for bits other than 4 or an AWQ version other than GEMM.
    """
    tensors, where, config = _source(source, "load_awq")
    version = str(config.get("version", "gemm")).lower()
    if version != "gemm":
        raise UnsupportedError(f"{where}: AWQ version {version!r}: portakern reads the GEMM layout (version "
                               "'gemm'); convert the checkpoint with AutoAWQ, or dequantize and portakern.quantize")
    _bits(bits, config, where, "load_awq")
    out = {}
    for layer in _layers(tensors, prefix, ("qzeros", "scales"), where):
        t = {k: tensors.get(f"{layer}.{k}") for k in ("qweight", "qzeros", "scales")}
        G = _group_size(group_size, config, t["qweight"].shape[0], t["scales"].shape[0], layer, where)
        out[layer] = _build(QuantizedWeight.from_awq, layer, where, t["qweight"], t["qzeros"], t["scales"],
                            group_size=G)
    return out


def load_gptq(source: str | os.PathLike | Mapping[str, Any], prefix: str | None = None, *,
              group_size: int | None = None, bits: int | None = None,
              checkpoint_format: str | None = None) -> dict[str, QuantizedWeight]:
    """Read the GPTQ layers of a checkpoint: ``{layer prefix: QuantizedWeight}``.

    As ``load_awq`` (sources, ``prefix``, where ``bits`` and ``group_size`` come from), with ``<layer>.qweight``,
    ``.qzeros``, ``.scales`` and an optional ``.g_idx`` (act-order). ``checkpoint_format``: the argument, else the
    config's ``checkpoint_format`` (GPTQModel writes it), else ``"gptq"`` (AutoGPTQ v1: qzeros hold zero - 1);
    ``"gptq_v2"`` qzeros hold the zero points (see ``QuantizedWeight.from_gptq``).

    Raises as ``load_awq`` does (bits other than 4 are ``UnsupportedError``).
    """
    tensors, where, config = _source(source, "load_gptq")
    _bits(bits, config, where, "load_gptq")
    fmt_name = checkpoint_format or str(config.get("checkpoint_format", "gptq"))
    out = {}
    for layer in _layers(tensors, prefix, ("qzeros", "scales"), where):
        t = {k: tensors.get(f"{layer}.{k}") for k in ("qweight", "qzeros", "scales", "g_idx")}
        G = _group_size(group_size, config, t["qweight"].shape[0] * 8, t["scales"].shape[0], layer, where)
        out[layer] = _build(QuantizedWeight.from_gptq, layer, where, t["qweight"], t["qzeros"], t["scales"],
                            group_size=G, g_idx=t["g_idx"], checkpoint_format=fmt_name)
    return out


class _Lazy(Mapping):
    """Tensor name -> array, read from its safetensors file on first access (a checkpoint is not read whole)."""

    def __init__(self, files: list[Path]):
        from safetensors import SafetensorError, safe_open

        self._error = SafetensorError
        self._open = safe_open
        self._where: dict[str, Path] = {}
        for f in files:
            try:
                with safe_open(f, framework="numpy") as h:
                    names = list(h.keys())
            except (SafetensorError, OSError) as e:
                raise InvalidInputError(f"{f} is not a readable safetensors file ({e}); it is truncated or corrupt: "
                                        "download it again") from e
            self._where.update((n, f) for n in names)

    def file_of(self, name: str) -> Path:
        return self._where[name]

    def __getitem__(self, name: str) -> np.ndarray:
        f = self._where[name]
        try:
            with self._open(f, framework="numpy") as h:
                return h.get_tensor(name)
        except (self._error, OSError, TypeError, ValueError) as e:
            raise InvalidInputError(f"{f}: tensor {name!r} cannot be read ({e}); the file is truncated or corrupt, "
                                    "or holds bfloat16 (which numpy cannot: pass a state dict loaded with "
                                    "safetensors.torch.load_file)") from e

    def __contains__(self, name: object) -> bool:   # Mapping's default would read the tensor
        return name in self._where

    def __iter__(self):
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def _source(source: Any, fn: str) -> tuple[Mapping[str, Any], str, dict]:
    """(tensors, how to name the source in errors, the quant config found beside the files or {})."""
    if isinstance(source, Mapping):
        return source, "state dict", {}
    if not isinstance(source, (str, os.PathLike)):
        raise InvalidInputError(f"{fn}(source={type(source).__name__}): pass a .safetensors file, a folder of them, "
                                "or a state dict {name: array}")
    path = Path(source)
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    if not files or not files[0].is_file():
        what = "a folder with no .safetensors files" if path.is_dir() else "not a file"
        raise InvalidInputError(f"{fn}: {path} is {what}; pass a .safetensors file, a folder of them, or a state dict")
    try:
        import safetensors  # noqa: F401
    except ImportError:
        raise UnsupportedError(f"{fn} reads files with the safetensors package: pip install safetensors (or "
                               "portakern[checkpoints]), or pass a state dict") from None
    tensors = _Lazy(files)
    return tensors, (str(files[0]) if len(files) == 1 else f"{path} ({len(files)} files)"), \
        _config(path if path.is_dir() else path.parent)


def _config(folder: Path) -> dict:
    for name in ("quant_config.json", "quantize_config.json", "config.json"):
        f = folder / name
        if not f.is_file():
            continue
        try:
            d = json.loads(f.read_text())
        except (OSError, ValueError) as e:
            raise InvalidInputError(f"{f} is not valid JSON ({e}); fix or remove it, or pass bits and "
                                    "group_size as arguments") from e
        d = d.get("quantization_config", d) if name == "config.json" else d
        if isinstance(d, dict) and ("bits" in d or "w_bit" in d or "group_size" in d or "q_group_size" in d):
            return {"bits": d.get("bits", d.get("w_bit")), "group_size": d.get("group_size", d.get("q_group_size")),
                    **{k: d[k] for k in ("version", "checkpoint_format") if k in d}, "file": str(f)}
    return {}


def _bits(bits: Any, config: dict, where: str, fn: str) -> None:
    got = _agree("bits", bits, config.get("bits"), config, where)
    if got not in (None, 4):
        raise UnsupportedError(f"{where}: bits={got}: {fn} reads 4-bit checkpoints (the layouts portakern holds "
                               "pack eight 4-bit codes a word); dequantize it and requantize with portakern.quantize")


def _agree(name: str, arg: Any, from_config: Any, config: dict, where: str) -> Any:
    if arg is not None and from_config is not None and arg != from_config:
        raise InvalidInputError(f"{where}: {name}={arg!r} was passed but {config['file']} says {name}="
                                f"{from_config!r}; drop the argument or pass the checkpoint's value")
    return arg if arg is not None else from_config


def _group_size(arg: Any, config: dict, K: int, n_groups: int, layer: str, where: str) -> int:
    G = _agree("group_size", arg, config.get("group_size"), config, where)
    if G is None:                                   # read off the shapes: K columns in n_groups rows of scales
        if n_groups < 1 or K % n_groups:
            raise InvalidInputError(f"{where}: layer {layer!r}: {n_groups} rows of scales do not split K={K} into "
                                    "equal groups; pass group_size")
        G = K // n_groups
    return G


def _layers(tensors: Mapping[str, Any], prefix: str | None, parts: tuple[str, ...], where: str) -> list[str]:
    layers = [n[:-len(".qweight")] for n in tensors if n.endswith(".qweight")]
    chosen = [n for n in layers if prefix is None or n.startswith(prefix)]
    if not chosen:
        found = f"; layers found: {', '.join(layers[:4])}{' ...' if len(layers) > 4 else ''}" if layers else ""
        raise InvalidInputError(f"{where}: no tensor named '<layer>.qweight'"
                                + (f" under prefix={prefix!r}{found}" if prefix else "")
                                + ": is this a quantized checkpoint of this kind?")
    for layer in chosen:
        missing = [f"{layer}.{p}" for p in parts if f"{layer}.{p}" not in tensors]
        if missing:
            file = tensors.file_of(f"{layer}.qweight") if isinstance(tensors, _Lazy) else where
            raise InvalidInputError(f"{file}: layer {layer!r} has a qweight but no tensor {missing[0]!r}; the "
                                    "checkpoint is incomplete (a shard missing?)")
    return chosen


def _build(make, layer: str, where: str, *args: Any, **kwargs: Any) -> QuantizedWeight:
    try:
        return make(*args, **kwargs)
    except (InvalidInputError, InvalidTypeError) as e:
        raise type(e)(f"{where}: layer {layer!r}: {e}") from e
