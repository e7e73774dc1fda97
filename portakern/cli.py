"""The ``portakern`` command line: ``info``, ``explain``, and the conformance tools.

Exit status (every subcommand):

    0   success
    1   the job ran and found a problem: ``explain`` found no backend that supports the
        problem; ``conformance`` had a failing case (the conformance tools set their own codes)
    2   usage error: a bad argument, an invalid problem description, or a missing component
        (e.g. the conformance suite is not installed)
    130 interrupted (Ctrl-C)
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from typing import Any, Callable, Sequence

from . import cli_checks
from .cli_checks import UsageError as _UsageError  # shared with the conformance tools
from .cli_checks import empty_option, empty_value_message

EXIT_OK, EXIT_PROBLEM, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130

#: subcommands handed, with their arguments untouched, to ``portakern.conformance``
DELEGATES = {
    "conformance": ("cli_main", "run the conformance suite against the goldens and write a report"),
    "support": ("support_main", "generate the support matrix (docs/support.md) from supports()"),
    "goldens": ("goldens_main", "recompute or verify the golden outputs with the CPU reference"),
}

_EPILOG = """\
examples:
  portakern info                       devices, backends, plugin errors
  portakern info --json
  portakern explain attention --shape 1,1,4096,32,8,128 --dtype bf16 --causal
  portakern explain attention --shape 4,1,8192,32,8,128 --paged 16 --device cuda
  portakern explain quant_gemv --shape 1,4096,4096 --bits 4 --group-size 128 --packing native
  portakern conformance --backend cpu  (see: portakern conformance --help)
  python -m portakern info             same as portakern info

exit status: 0 ok; 1 the job found a problem (no backend supports the problem, a conformance
case failed); 2 usage error (bad argument, invalid problem, missing component); 130 Ctrl-C
"""


class ArgumentParser(argparse.ArgumentParser):
    """An ``argparse.ArgumentParser`` whose usage errors end with the way out,
    ``(see: <prog> --help)``, and that reports unknown arguments as the innermost subcommand
    that received them (``portakern explain attention: error: unrecognized arguments: ...``)."""

    def error(self, message: str):
        """Print the usage and ``<prog>: error: <message> (see: <prog> --help)``; exit 2."""
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see: {self.prog} --help)\n")

    def parse_args(self, args=None, namespace=None):
        """As argparse's, but unknown arguments are reported by the subcommand's parser."""
        ns, extra = self.parse_known_args(args, namespace)
        if extra:
            getattr(ns, "parser_", self).error(f"unrecognized arguments: {' '.join(extra)}")
        for parser in dict.fromkeys((getattr(ns, "parser_", self), self)):  # the subcommand's options, then ours
            option = empty_option(parser, ns)
            if option:
                parser.error(empty_value_message(option))
        return ns




# -- parsing helpers ------------------------------------------------------------------------------

def _ints(text: str, names: Sequence[str], option: str, sizes: bool = False) -> tuple[int, ...]:
    parts = [p.strip() for p in text.split(",")]
    try:
        vals = tuple(int(p) for p in parts)
    except ValueError:
        vals = ()
    if len(vals) != len(names):
        raise _UsageError(f"{option} {text!r}: expected {len(names)} comma-separated integers "
                          f"{','.join(names)}")
    for name, v in zip(names, vals):
        if sizes and v < 1:
            raise _UsageError(f"{option} {text!r}: {name}={v} must be a positive integer (a size); "
                              f"e.g. {option} {','.join(str(max(abs(x), 1)) for x in vals)}")
    return vals


#: a value such as -1,0 or -3 (argparse would take it for an option and say "expected one argument")
_NEGATIVE_VALUE = re.compile(r"-\d[\d.,eE+-]*")


def _join_negative_values(argv: list[str]) -> list[str]:
    """``--window -1,0`` -> ``--window=-1,0``: an option followed by a negative number (list) takes it
    as its value; no portakern option looks like a number, so nothing else changes."""
    out: list[str] = []
    for tok in argv:
        prev = out[-1] if out else ""
        if _NEGATIVE_VALUE.fullmatch(tok) and prev.startswith("--") and "=" not in prev:
            out[-1] = f"{prev}={tok}"
        else:
            out.append(tok)
    return out


def _dtype(text: str):
    from portakern.errors import InvalidInputError
    from portakern.ir.dtypes import STORAGE_FLOATS, DType

    try:
        dt = DType.parse(text.strip().lower(), argument="--dtype")
    except InvalidInputError:
        dt = None
    if dt not in STORAGE_FLOATS:
        raise _UsageError(f"--dtype {text}: must be one of fp16, bf16, fp32 (or float16, bfloat16, float32)")
    return dt


def _has_torch() -> bool:
    import importlib.util

    return importlib.util.find_spec("torch") is not None


def _explain_dtype(args):
    """``--dtype`` as an IR dtype. Left out: bf16, or fp32 on a CPU without torch (bf16 placeholder arrays on the
    host are torch tensors), said on stderr; ``--dtype bf16`` there is a usage error naming the way out."""
    if args.dtype is None:
        if args.device != "cpu" or _has_torch():
            return _dtype("bf16")
        print("portakern explain: --dtype fp32 (the default bf16 needs torch for its placeholder arrays, and torch "
              "is not installed: pip install torch, or pass --dtype to choose)", file=sys.stderr)
        return _dtype("fp32")
    dt = _dtype(args.dtype)
    if dt.value == "bfloat16" and args.device == "cpu" and not _has_torch():
        raise _UsageError(f"--dtype {args.dtype}: bf16 placeholder arrays on the CPU are torch tensors and torch is "
                          "not installed; pass --dtype fp16 or fp32, or pip install torch")
    return dt


class _Arrays:
    """Allocates cheap placeholder arrays (values are never read) on the requested device."""

    def __init__(self, device: str, dtype, shape_arg: str = ""):
        self.device = device
        self.dtype = dtype
        self.shape_arg = shape_arg  # named in the error when an array cannot be allocated
        self.use_torch = device != "cpu" or dtype.value == "bfloat16"
        self.opencl = None      # the OpenCL device's queue: placeholders are pyopencl arrays there
        if device != "cpu":
            from portakern.devices import parse_device

            d = parse_device(device)  # raises naming the present devices
            if d.type == "opencl":
                if dtype.value == "bfloat16":
                    raise _UsageError(f"--device {device} --dtype bf16: pyopencl arrays have no bfloat16; pass "
                                      "--dtype fp16 or fp32 (bf16 runs on the opencl backend from CPU torch "
                                      "tensors: --device cpu --backend opencl)")
                from portakern.opencl_runtime import queue

                self.opencl, self.use_torch = queue(d), False

    def float(self, shape: tuple[int, ...], name: str, dtype=None):
        return self._alloc(shape, (dtype or self.dtype).value, name)

    def index(self, values: Any):
        import numpy as np

        a = np.ascontiguousarray(np.asarray(values, dtype=np.int32))
        if self.opencl is not None:
            import pyopencl.array as cla

            return cla.to_device(self.opencl, a)
        if not self.use_torch:
            return a
        import torch

        return torch.from_numpy(a).to(self._torch_device())

    def raw(self, shape: tuple[int, ...], dtype_name: str, name: str):
        return self._alloc(shape, dtype_name, name)

    def _torch_device(self) -> str:
        from portakern.devices import parse_device

        d = parse_device(self.device)
        return "cpu" if d.type == "cpu" else f"cuda:{d.index}"

    def _alloc(self, shape, dtype_name: str, name: str):
        try:
            if self.opencl is not None:
                import pyopencl.array as cla

                return cla.zeros(self.opencl, shape, dtype=dtype_name)
            if not self.use_torch:
                import numpy as np

                return np.zeros(shape, dtype=dtype_name)  # calloc: pages are never touched
            import torch

            return torch.empty(shape, dtype=getattr(torch, dtype_name), device=self._torch_device())
        except (MemoryError, RuntimeError) as e:  # numpy's MemoryError; torch's (CUDA out of memory too)
            reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise _UsageError(f"{self.shape_arg}: the placeholder {name} of shape {tuple(shape)} ({dtype_name}) "
                              f"cannot be allocated on {self.device} ({reason}); explain builds arrays of the "
                              "problem's real size: explain a smaller problem, or on a device with the memory") from None


def _attention_call(args) -> tuple[tuple, dict]:
    B, Sq, Sk, Hq, Hkv, D = _ints(args.shape, ("B", "Sq", "Sk", "Hq", "Hkv", "D"), "--shape", sizes=True)
    if args.dv < 0:
        raise _UsageError(f"--dv {args.dv}: the value head dim must be a positive integer "
                          "(leave --dv out to use D)")
    Dv = args.dv or D
    arr = _Arrays(args.device, _explain_dtype(args), f"--shape {args.shape!r}")
    kwargs: dict[str, Any] = {"causal": args.causal, "return_lse": args.return_lse}
    if args.window:
        kwargs["window"] = _ints(args.window, ("L", "R"), "--window")
    if args.softcap:
        kwargs["softcap"] = args.softcap
    if args.scale is not None:
        kwargs["scale"] = args.scale
    if args.paged is not None and args.varlen:
        raise _UsageError("--paged and --varlen exclude each other")
    if args.paged is not None:
        page = args.paged
        if page < 1:
            raise _UsageError(f"--paged {page}: the page size must be a positive integer, e.g. --paged 16")
        pages_per_seq = -(-Sk // page)
        q = arr.float((B, Sq, Hq, D), "q")
        k = arr.float((B * pages_per_seq, page, Hkv, D), "k")
        v = arr.float((B * pages_per_seq, page, Hkv, Dv), "v")
        kwargs["block_table"] = arr.index([[b * pages_per_seq + p for p in range(pages_per_seq)] for b in range(B)])
        kwargs["seqlens_k"] = arr.index([Sk] * B)
    elif args.varlen:
        q = arr.float((B * Sq, Hq, D), "q")
        k = arr.float((B * Sk, Hkv, D), "k")
        v = arr.float((B * Sk, Hkv, Dv), "v")
        kwargs["cu_seqlens_q"] = arr.index([i * Sq for i in range(B + 1)])
        kwargs["cu_seqlens_k"] = arr.index([i * Sk for i in range(B + 1)])
    else:
        q, k, v = arr.float((B, Sq, Hq, D), "q"), arr.float((B, Sk, Hkv, D), "k"), arr.float((B, Sk, Hkv, Dv), "v")
    return (q, k, v), kwargs


def _quant_gemv_call(args) -> tuple[tuple, dict]:
    from portakern.ir.quant import GGUF_LAYOUT, PACKING_BITS, Packing, QuantFormat
    from portakern.quantized import QuantizedWeight

    M, N, K = _ints(args.shape, ("M", "N", "K"), "--shape", sizes=True)
    try:
        packing = Packing(args.packing)
    except ValueError:
        raise _UsageError(f"--packing {args.packing}: expected one of "
                          f"{', '.join(p.value for p in Packing)}") from None
    if packing in GGUF_LAYOUT:  # fixed bits, group size and zero points
        bits, (group, symmetric, _) = PACKING_BITS[packing][0], GGUF_LAYOUT[packing]
        if args.bits not in (None, bits):
            raise _UsageError(f"--bits {args.bits}: packing {packing.value} is always {bits} bits; "
                              f"leave --bits out (or pass --bits {bits})")
        if args.group_size not in (None, group):
            raise _UsageError(f"--group-size {args.group_size}: packing {packing.value} always has groups "
                              f"of {group}; leave --group-size out (or pass --group-size {group})")
    else:
        bits = 4 if args.bits is None else args.bits
        group = {None: 128, 0: K}.get(args.group_size, args.group_size)
        if args.symmetric and packing is not Packing.NATIVE:
            raise _UsageError(f"--symmetric: packing {packing.value} always stores zero points; "
                              "--symmetric applies to --packing native only")
        symmetric = args.symmetric
    fmt = QuantFormat(bits=bits, group_size=group, symmetric=symmetric, packing=packing,
                      has_g_idx=args.act_order)
    fmt.verify(K=K, N=N)
    arr = _Arrays(args.device, _explain_dtype(args), f"--shape {args.shape!r}")
    tensors = {name: arr.raw(shape, dtypes[0] if dtypes[0] != "bfloat16" or arr.use_torch else "float32", name)
               for name, (shape, dtypes, _) in _tensor_specs(fmt, N, K).items()}
    from portakern.ir.ops import x_columns

    prologue = args.prologue
    return (arr.float((M, x_columns(K, prologue)), "x"), QuantizedWeight(fmt, N, K, tensors)), \
        ({"prologue": prologue} if prologue else {})


def _tensor_specs(fmt, N: int, K: int) -> dict:
    from portakern.ir.packing import tensor_specs

    return tensor_specs(fmt, N, K)


# -- commands -------------------------------------------------------------------------------------

def cmd_info(args) -> int:
    import portakern
    from portakern.plugins import registry

    reg = registry()
    devices = portakern.devices()
    backends = []
    for b in portakern.list_backends():
        try:
            status = b.status()
        except BaseException as e:  # a broken status() (a SystemExit too) is reported, not fatal
            if isinstance(e, KeyboardInterrupt):
                raise
            status = f"status() raised {type(e).__name__}: {e}"
        plugin = reg.origins.get(b.name, "?")
        backends.append({"name": b.name, "version": str(b.version), "plugin": plugin,
                         "distribution": reg.plugins.get(plugin, "?"), "array_kind": b.array_kind,
                         "device_types": list(b.device_types), "priority": b.priority,
                         "compile_targets": list(b.compile_targets), "status": status})
    errors = [{"plugin": p, "error": e} for p, e in reg.errors]
    if args.json:
        print(json.dumps({"portakern": portakern.__version__, "python": sys.version.split()[0],
                          "devices": [d.to_json() for d in devices], "backends": backends,
                          "plugin_errors": errors}, indent=2))
        return EXIT_OK
    print(f"portakern {portakern.__version__} (python {sys.version.split()[0]})")
    print("\ndevices")
    for d in devices:
        print(f"  {d.label}")
    print("\nbackends")
    w = max([len(b["name"]) for b in backends] + [4])
    for b in backends:
        print(f"  {b['name'].ljust(w)}  {b['version']}  [{b['distribution']}]")
        print(f"  {''.ljust(w)}  arrays {b['array_kind']}, devices {', '.join(b['device_types'])}, "
              f"priority {b['priority']}")
        if b["compile_targets"]:
            print(f"  {''.ljust(w)}  compile targets {', '.join(b['compile_targets'])}")
        print(f"  {''.ljust(w)}  status {b['status']}")
    if not backends:
        print("  none registered")
    if errors:
        print("\nplugin errors (these plugins were skipped; the others work)")
        for e in errors:
            print(f"  {e['plugin']}: {e['error']}")
    return EXIT_OK


def cmd_explain(args) -> int:
    import portakern
    from portakern.errors import UnsupportedError

    fn: Callable = portakern.attention if args.op == "attention" else portakern.quant_gemv
    if args.backend is not None:
        if "," in args.backend:
            raise _UsageError(f"--backend {args.backend}: explain forces one backend; name one, e.g. --backend cpu "
                              "(leave --backend out to see every candidate)")
        cli_checks.backends("--backend", [args.backend])
    cli_checks.device("--device", args.device)
    call_args, kwargs = (_attention_call if args.op == "attention" else _quant_gemv_call)(args)
    if args.backend:
        kwargs["backend"] = args.backend
    try:
        decision = portakern.explain(fn, *call_args, **kwargs)
    except UnsupportedError as e:
        if args.json:
            print(json.dumps({"op": args.op, "chosen": None, "error": str(e)}, indent=2))
        else:
            print(f"unsupported: {e}", file=sys.stderr)
        return EXIT_PROBLEM
    print(json.dumps(decision.to_json(), indent=2) if args.json else str(decision))
    return EXIT_OK


def _delegate(command: str, argv: list[str]) -> int:
    func_name = DELEGATES[command][0]
    try:
        from portakern import conformance
    except ImportError as e:
        print(f"portakern {command}: the conformance suite cannot be imported ({e}); "
              "reinstall portakern (pip install -e .) to get portakern.conformance", file=sys.stderr)
        return EXIT_USAGE
    func = getattr(conformance, func_name, None)
    if func is None:
        print(f"portakern {command}: this build's portakern.conformance has no {func_name}(); "
              "the conformance suite is missing or too old", file=sys.stderr)
        return EXIT_USAGE
    return int(func(argv) or 0)


# -- parser ---------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    fmt = argparse.RawDescriptionHelpFormatter
    p = ArgumentParser(prog="portakern", formatter_class=fmt, epilog=_EPILOG,
                                description="Portable attention and quantized-GEMV kernels: inspect "
                                            "devices and backends, explain dispatch, run conformance.")
    p.add_argument("--version", action="version", version=f"portakern {_version()}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    info = sub.add_parser("info", help="devices, backends (version, devices, targets, status), plugin errors",
                          formatter_class=fmt, epilog="example:\n  portakern info --json")
    info.add_argument("--json", action="store_true", help="print JSON instead of text")
    info.set_defaults(func=cmd_info, parser_=info)

    ex = sub.add_parser("explain", help="show which backend would run a problem, and why",
                        formatter_class=fmt, description="Plan a call without running it: candidates, "
                        "priority, why each rejected backend said no, and the chosen backend.",
                        epilog="examples:\n"
                               "  portakern explain attention --shape 1,1,4096,32,8,128 --dtype bf16 --causal\n"
                               "  portakern explain quant_gemv --shape 1,4096,4096 --bits 4 --group-size 128")
    exsub = ex.add_subparsers(dest="op", metavar="OP", required=True)

    at = exsub.add_parser("attention", help="explain portakern.attention", formatter_class=fmt,
                          epilog="examples:\n"
                                 "  portakern explain attention --shape 2,128,128,16,16,64 --causal\n"
                                 "  portakern explain attention --shape 1,1,4096,32,8,128 --window 1024,0 --json\n"
                                 "  portakern explain attention --shape 8,1,2048,32,8,128 --paged 16 --device cuda")
    at.add_argument("--shape", required=True, metavar="B,Sq,Sk,Hq,Hkv,D",
                    help="batch, query length, key length, query heads, kv heads, head dim")
    at.add_argument("--dv", type=int, default=0, metavar="DV", help="value head dim (default D)")
    at.add_argument("--causal", action="store_true", help="bottom-right aligned causal mask")
    at.add_argument("--window", metavar="L,R", help="sliding window (left, right); -1 = unbounded")
    at.add_argument("--softcap", type=float, default=0.0, metavar="C", help="soft-cap scores at C")
    at.add_argument("--scale", type=float, default=None, help="score scale (default 1/sqrt(D))")
    at.add_argument("--paged", type=int, default=None, metavar="PAGE", help="paged KV with this page size")
    at.add_argument("--varlen", action="store_true", help="varlen (packed) batch with cu_seqlens")
    at.add_argument("--return-lse", action="store_true", help="also return the log-sum-exp")
    _common(at)
    at.set_defaults(parser_=at)

    qg = exsub.add_parser("quant_gemv", help="explain portakern.quant_gemv", formatter_class=fmt,
                          epilog="examples:\n"
                                 "  portakern explain quant_gemv --shape 1,4096,4096 --bits 4 --group-size 128\n"
                                 "  portakern explain quant_gemv --shape 8,4096,4096 --packing gguf_q4_0 --json\n"
                                 "  portakern explain quant_gemv --shape 1,4096,14336 --prologue silu_mul")
    qg.add_argument("--shape", required=True, metavar="M,N,K", help="rows of x, output features, input features")
    from portakern.ir.quant import PACKING_BITS

    qg.add_argument("--bits", type=int, default=None, choices=sorted({b for bs in PACKING_BITS.values() for b in bs}),
                    help="bits per weight (default 4; gguf_q4_0 / gguf_q8_0 fix it at 4 / 8)")
    qg.add_argument("--group-size", type=int, default=None, metavar="G",
                    help="weights per scale along K (default 128; 0 = K; the gguf packings fix it at 32)")
    qg.add_argument("--packing", default="native",
                    help="native | awq | gptq | gguf_q4_0 | gguf_q8_0 (default native)")
    qg.add_argument("--symmetric", action="store_true",
                    help="no zero points (native packing; awq and gptq store zero points, gguf never does)")
    qg.add_argument("--act-order", action="store_true", help="gptq with g_idx")
    qg.add_argument("--prologue", choices=("silu_mul",), default=None,
                    help="silu_mul: x is (M, 2K), gate then up, and the input is silu(gate) * up (backends that "
                         "do not implement it are shown refusing it)")
    _common(qg)
    qg.set_defaults(parser_=qg)
    ex.set_defaults(func=cmd_explain)

    for name, (_, text) in DELEGATES.items():
        sub.add_parser(name, help=f"{text} (see: portakern {name} --help)", add_help=False)
    return p


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", default=None, help="fp16 | bf16 | fp32 (default bf16; fp32 on a CPU without torch)")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, opencl:0, ... (default cpu)")
    p.add_argument("--backend", default=None, help="explain a forced backend (as backend=NAME)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _version() -> str:
    from portakern import __version__

    return __version__


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``portakern`` console script and ``python -m portakern``; returns the exit status
    (130 when Ctrl-C stopped the command; the conformance runner still writes what it has)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return _main(argv)
    except KeyboardInterrupt:
        where = f"portakern {argv[0]}" if argv else "portakern"
        print(f"{where}: interrupted (Ctrl-C)", file=sys.stderr)
        return EXIT_INTERRUPTED


def _main(argv: list[str]) -> int:
    if argv and argv[0] in DELEGATES:
        return _delegate(argv[0], argv[1:])
    parser = build_parser()
    try:
        args = parser.parse_args(_join_negative_values(argv))
    except SystemExit as e:  # --help, --version, or an argparse usage error (already printed)
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_USAGE
    from portakern.errors import PortakernError

    where = " ".join(filter(None, (args.command, getattr(args, "op", None))))
    try:
        return args.func(args)
    except (_UsageError, PortakernError) as e:  # a PortakernError: an invalid problem; it names the rule
        print(f"portakern {where}: error: {e} (see: portakern {where} --help)", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
