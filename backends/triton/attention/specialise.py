"""What a launch on contiguous tensors of an op's shapes hands Triton, so that lowering without the device
(``aot.py``, ``gluon.lower_gluon``) compiles the kernel such a launch runs.

``launch_scalars`` derives the integer arguments ``forward.build``'s launches pass (strides, lengths, rows) from
the op's shapes; ``as_launched`` applies Triton's launch-time specialisation to a signature (16-byte aligned
pointers, integers equal to 1 constant, divisible by 16 marked, past 32 bits i64).
"""

from __future__ import annotations

from typing import Any

from portakern.ir.ops import Attention, KVLayout


def launch_scalars(op: Attention) -> dict[str, int]:
    """The integer arguments ``forward.build``'s launches pass for contiguous operands of ``op``'s shapes, by name
    (strides, lengths, rows), so that ``aot.compile_for_target`` lowers what such a launch runs."""
    shapes = op.shapes()

    def strides(name: str, n: int) -> tuple[int, ...]:
        if name not in shapes:
            return (0,) * n
        out, acc = [], 1
        for d in reversed(shapes[name]):
            out.append(acc)
            acc *= d
        return tuple(reversed(out))

    varlen = op.kv_layout is KVLayout.VARLEN
    if varlen:
        per = {t: (0,) + strides(t, 3)[:2] for t in ("q", "k", "v", "out")}
        per["lse"] = (0,) + strides("lse", 2)
    else:
        per = {t: strides(t, 4)[:3] for t in ("q", "k", "v", "out")}
        per["lse"] = strides("lse", 3)
    names = {"q": "stride_q", "k": "stride_k", "v": "stride_v", "out": "stride_o"}
    vals = {f"{names[t]}{x}": v for t in names for x, v in zip("bsh", per[t])}
    vals.update(zip(("stride_lb", "stride_lh", "stride_ls"), per["lse"]))
    vals.update(zip(("stride_btb", "stride_btp"), strides("block_table", 2)))
    rows = op.total_q if varlen else op.batch * op.seqlen_q
    vals.update(batch=op.batch, seqlen_q=op.total_q if varlen else op.seqlen_q, seqlen_k=op.seqlen_k,
                total_rows=rows)
    return vals


def as_launched(fn, sig: dict[str, str], consts: dict[str, Any], scalars: dict[str, int]):
    """``(sig, consts, attrs)`` for ``ASTSource`` with Triton's launch-time specialisation applied: pointers
    16-byte aligned (as torch allocates), an integer equal to 1 a constant, one divisible by 16 marked so,
    one past 32 bits an i64; ``scale`` an fp32. Names already in ``sig`` or ``consts`` keep their entry."""
    sig, consts, attrs = dict(sig), dict(consts), {}
    for i, name in enumerate(fn.arg_names):
        if name in consts and name not in sig:
            sig[name] = "constexpr"
        elif name in sig:
            if sig[name].startswith("*"):
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif name == "scale":
            sig[name] = "fp32"
        else:
            v = scalars[name]
            if v == 1:
                sig[name], consts[name] = "constexpr", 1
                continue
            sig[name] = "i64" if abs(v) >= 1 << 31 else "i32"
            if v % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, consts, attrs


def artifact(ck, num_warps: int) -> dict:
    """The artifact of compiled kernel ``ck``: ``{"cubin", "ptx", "shared", "num_warps"}``."""
    md = ck.metadata
    return {"cubin": ck.asm.get("cubin"), "ptx": ck.asm.get("ptx"),
            "shared": getattr(md, "shared", None), "num_warps": num_warps}
