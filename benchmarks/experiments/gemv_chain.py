"""Experiment, not part of the backend: every layer's four int4 GEMVs (o, gate/up, down, qkv) in ONE launch.

Why (``benchmarks/gemv_notes.md`` v19): in the decode step each GEMV is its own kernel, and even launched as a
programmatic dependent of the kernel before it, a GEMV becomes resident only as that kernel's programs exit,
then pays a ramp (first bytes one DRAM latency away) and a tail (the split-K merge, the last programs): the
step's GEMVs take ~1.7x their weight floor where one long read of the same bytes runs at ~90%. Here one
persistent grid (``per_sm`` programs on every SM, all resident) runs the phases back to back: each program
walks its stream-K range of a phase exactly as the stream kernel does (``kernels/gemv_stream.py``, whose
helpers it calls), and when its range is done it at once issues the first units' weight loads of the next
phase (constant data) and only then spins until every tile of the previous phase is stored -- so DRAM is
never idle between two GEMVs, and there is no launch at all.

* Phase order per layer: o (4096 x 4096), gate/up (28672 x 4096), down (4096 x 14336: x = the first 14336
  outputs of gate/up), qkv (6144 x 4096); the next layer's o reads the first 4096 outputs of qkv. No glue
  (norms, SiLU, RoPE, attention): this measures the GEMVs' chain alone against the same GEMVs launched one by
  one, which is what decides whether a layer-persistent kernel is worth building.
* The kernel and its synchronisation: ``experiments/chain_kernels.py`` (``gemv_chain_kernel``, the phases plain:
  no prologue, epilogue "store").

    python benchmarks/experiments/gemv_chain.py --phase check   # GPU: bit-equal to the stream kernel launched per
                                                                # GEMV, and the first GEMV against float64
    python benchmarks/experiments/gemv_chain.py --phase bench   # GPU: the chain against per-GEMV launches
    python benchmarks/experiments/gemv_chain.py --phase lower   # no GPU: sm_90a lowering, registers, shared memory
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from experiments.chain_kernels import ATTN_KIND, MAX_PHASES, PDL_KIND, STAT_KINDS, gemv_chain_kernel  # noqa: E402

#: the decode step's linears, in the chain's order (N, K)
PHASES = (("o", 4096, 4096), ("gu", 28672, 4096), ("down", 4096, 14336), ("qkv", 6144, 4096))


# -- host ----------------------------------------------------------------------------------------------------

class Weights:
    """Every layer's four int4 g128 asymmetric weights, stacked per linear (one tensor per linear: the kernel
    steps through layers by stride), with scales that keep the chain's activations near unit size."""

    def __init__(self, layers: int, device: str = "cuda", seed: int = 0):
        import torch

        from portakern.backends.triton import quant_gemv as Q

        g = torch.Generator(device=device).manual_seed(seed)
        self.layers = layers
        self.lin = {}
        for name, N, K in PHASES:
            kwp = -(-(K // 8) // Q.K_ALIGN_WORDS) * Q.K_ALIGN_WORDS
            npad = -(-N // Q.N_ALIGN_WORDS) * Q.N_ALIGN_WORDS
            qw = torch.randint(-2**31, 2**31 - 1, (layers, kwp, npad), dtype=torch.int32, device=device, generator=g)
            G = K // 128
            # (q - z) s with q, z uniform on 0..15 has variance 2 * 21.25 s^2: unit-size outputs for unit-size x
            sc = 1.0 / (6.5 * K ** 0.5)
            s = ((torch.rand(layers, G, npad, device=device, generator=g) + 0.5) * sc).to(torch.float16)
            z = torch.randint(0, 16, (layers, G, npad), device=device, generator=g).to(torch.float16)
            self.lin[name] = (qw, s, z, N, K)

    def prepared(self, name: str, layer: int):
        """Layer ``layer``'s weight ``name`` as the backend's ``PreparedGemvWeight`` (views, no copy)."""
        from portakern.backends.triton import quant_gemv as Q

        qw, s, z, N, K = self.lin[name]
        return Q.PreparedGemvWeight(qw[layer], s[layer], z[layer], None, None, 4, 128, 8, N, K)

    def nbytes(self) -> int:
        """Codes + fp16 scales + fp16 zeros of every layer (the floor's bytes; x and outputs are noise)."""
        return sum(self.layers * (N * K // 2 + N * (K // 128) * 4) for _, N, K in PHASES)


def _stream_cfg(layout, ahead: int, per_sm: int, l2_ahead: int = 0):
    from portakern.backends.triton import gemv_tuning as T

    return T.fit(T.GemvConfig("stream", 256, 16, num_warps=8, prefetch=ahead, per_sm=per_sm, pdl=True,
                              l2_prefetch=l2_ahead), layout, 1)


def _op(N: int, K: int):
    from portakern.ir import DType, QuantFormat, QuantGemv

    return QuantGemv(M=1, N=N, K=K, dtype=DType.bfloat16, fmt=QuantFormat(bits=4, group_size=128, symmetric=False))


class Chain:
    """The chain kernel over ``weights``: ``per_sm`` programs per SM (capped so every phase gives each program a
    unit), ``ahead`` units in registers, ``l2_ahead`` units asked of the L2 before each wait. ``outs`` are the four
    phases' output buffers (bf16, ``(1, N)``); ``self()`` launches once over every layer."""

    def __init__(self, weights: Weights, outs, ahead: int = 1, per_sm: int = 2, l2_ahead: int = 0,
                 num_sms: int = 132, spin_limit: int = 1 << 20, programs: int | None = None):
        from experiments.layer_chain import constexprs
        from portakern.backends.triton.backend import KERNEL_OPTIONS

        self.w, self.outs, self.num_sms = weights, outs, num_sms
        units = min(-(-N // 256) * (K // 128) for _, N, K in PHASES)
        self.programs = min(programs or per_sm * num_sms, units)
        self.args = []
        for name, N, K in PHASES:
            qw, s, _, _, _ = weights.lin[name]
            self.args.append((N, -(-N // 256), qw.shape[2], qw.stride(0), s.stride(0)))
        consts = constexprs([(N, K) for _, N, K in PHASES], self.programs, ahead, l2_ahead)
        self.consts = {**{k: v for k, v in consts.items() if k in gemv_chain_kernel.arg_names},
                       "SPIN_LIMIT": spin_limit}
        # two programs per SM need the stream kernel's 128 registers (ptxas, sm_90a as launched: 106 at one unit
        # ahead, 128 at two, no spills)
        self.opts = dict(num_warps=8, launch_pdl=True, **KERNEL_OPTIONS, **({"maxnreg": 128} if per_sm > 1 else {}))
        dev = outs[0].device
        sync_buffers(self, max(a[1] for a in self.args), MAX_PHASES.value, dev)
        self.checked = False
        if 4 * weights.layers > MAX_PHASES.value:
            raise ValueError(f"layers={weights.layers}: the kernel resets at most {MAX_PHASES.value // 4} layers' "
                             f"counters; raise MAX_PHASES")

    def __call__(self) -> None:
        tensors = []
        for j, (name, _, _) in enumerate(PHASES):
            qw, s, z, _, _ = self.w.lin[name]
            tensors += [qw, s, z, self.outs[j]]
        scalars = [v for a in self.args for v in a]
        args = (*tensors, self.ws, self.cnt, self.done, self.exit, self.err, self.w.layers, *scalars)
        if not self.checked:
            check_resident(gemv_chain_kernel, args, self.programs, self.num_sms, self.consts, self.opts)
            self.checked = True
        gemv_chain_kernel[(self.programs,)](*args, **self.consts, **self.opts)


def sync_buffers(chain, tiles: int, phases: int, dev, bn: int = 256) -> None:
    """A chain launch's shared state, set on ``chain`` (whose ``programs`` is its grid): ``ws`` the split-K partials
    (two rows of ``bn`` a program), ``cnt`` arrival counts for ``tiles`` column tiles, ``done`` tiles finished for
    ``phases`` phases, ``exit`` programs gone, ``err`` the spin error flag followed by the kernels' cycle statistics
    (``chain_kernels.STAT_KINDS``; ``wait_profile`` reads them). All int32 and zeroed but the partials."""
    import torch

    i32 = dict(dtype=torch.int32, device=dev)
    chain.ws = torch.empty((chain.programs * 2, bn), dtype=torch.float32, device=dev)
    chain.cnt = torch.zeros((tiles,), **i32)
    chain.done = torch.zeros((phases,), **i32)
    chain.exit = torch.zeros((1,), **i32)
    chain.err = torch.zeros((1 + (STAT_KINDS.value + 1) * chain.programs,), **i32)


def spin_error(chain) -> int:
    """The chain's spin error flag: 1 if a wait gave up since the counters were last reset (the results are then
    wrong), else 0."""
    return int(chain.err[0].item())


#: ``wait_profile``'s names of the statistics kinds (``chain_kernels``: a GEMV phase's ``3 PRO + EPI``)
KIND_NAMES = {0: "gemv", 1: "o", 3: "gate_up_or_lm", 5: "qkv", 7: "down", ATTN_KIND.value: "attention",
              PDL_KIND.value: "previous_kernel"}


def wait_profile(chain, run=None, launches: int = 16) -> dict:
    """Where a chain's programs wait: ``launches`` calls of ``run`` (default: the chain) from zeroed counters, then
    the cycles spent waiting before each kind of phase (``KIND_NAMES``) as a fraction of all programs' cycles from
    the end of their wait for the previous kernel to their leave, their sum (``wait_all``), the most any one
    program waited (``wait_max_program``) and the mean such cycles of a program per call (a step of a layer
    chain is one call and several launches). The wait for the previous kernel is reported apart, as a fraction
    of the programs' whole time (``wait_previous_kernel``): with room for two launches' programs on an SM (one
    per SM), a launch's programs become resident early and wait out most of the launch before them."""
    import torch

    reset_counters(chain)
    for _ in range(launches):
        (run or chain)()
    if chain.err.is_cuda:
        torch.cuda.synchronize()
    k1, P = STAT_KINDS.value + 1, chain.programs
    v = (chain.err[1:1 + k1 * P].to(torch.int64).cpu() % 2**32).double().view(k1, P)   # int32 sums that wrapped
    pdl = v[PDL_KIND.value]
    waits = torch.cat([v[:PDL_KIND.value], v[PDL_KIND.value + 1:-1]])
    names = {k - (k > PDL_KIND.value): n for k, n in KIND_NAMES.items() if k != PDL_KIND.value}
    total = (v[-1] - pdl).clamp(min=1)            # from the end of the wait for the previous kernel to the leave
    out = {"launches": launches, "spin_error": spin_error(chain),
           "cycles_per_call": round(float(total.mean()) / launches),
           "wait_all": float(waits.sum() / total.sum()),
           "wait_max_program": float((waits.sum(0) / total).max()),
           "wait_previous_kernel": float(pdl.sum() / v[-1].sum().clamp(min=1))}
    out.update({f"wait_{name}": float(waits[k].sum() / total.sum()) for k, name in names.items()
                if waits[k].sum() > 0})
    return out


def reset_counters(chain) -> None:
    """Zero a chain's synchronisation state: the tiles' arrival counts, the phases' tiles done, the programs left
    and the spin error flag. A clean launch leaves them zeroed; after a spin error (later waits skipped, phases
    overlapped) arrivals of two phases may have mixed, and the next launch needs this first."""
    for t in (chain.cnt, chain.done, chain.exit, chain.err):
        t.zero_()


def check_resident(kernel, args, programs: int, num_sms: int, consts: dict, opts: dict) -> None:
    """Compile ``kernel`` for ``args`` and refuse a grid of ``programs`` that cannot be resident at once on
    ``num_sms`` SMs (a chain's phase waits would never end): ValueError naming the way out."""
    ck = kernel.warmup(*args, grid=(programs,), **consts, **opts)
    ck._init_handles()
    fit = resident_per_sm(ck) * num_sms
    if fit < programs:
        raise ValueError(f"programs={programs}: only {fit} fit on the GPU at once ({ck.n_regs} registers, "
                         f"{ck.metadata.shared} bytes of shared memory each); use per_sm=1")


def resident_per_sm(ck, num_warps: int = 8) -> int:
    """Programs of the compiled kernel ``ck`` that fit on one H100/H200 SM at once (registers, shared memory,
    warps): the chain deadlocks if its grid does not fit."""
    warp_regs = -(-max(1, ck.n_regs) // 8) * 8 * 32      # a warp's registers, allocated in units of 256
    by_regs = 65536 // (warp_regs * num_warps)
    by_smem = (228 * 1024) // max(1, ck.metadata.shared + 1024)
    return min(by_regs, by_smem, 64 // num_warps)


# -- phases of the script --------------------------------------------------------------------------------

def _outs(device="cuda"):
    import torch

    return [torch.zeros((1, N), dtype=torch.bfloat16, device=device) for _, N, _ in PHASES]


def per_gemv(weights: Weights, outs, make):
    """The same chain as one launch per GEMV: ``make(op, prepared)`` gives each linear's launcher."""
    lin = {}
    for j, (name, N, K) in enumerate(PHASES):
        lin[name] = make(_op(N, K), weights.prepared(name, 0))
    calls = []
    for layer in range(weights.layers):
        for j, (name, N, K) in enumerate(PHASES):
            x = outs[j - 1][:, :K]
            calls.append((lin[name], x, weights.prepared(name, layer), outs[j]))

    def run():
        for f, x, w, o in calls:
            f(x, w, o)
    return run


def check(res) -> int:
    """The chain (2 and 3 layers, several grids and depths) bit-equal to the stream kernel launched per GEMV from
    the same start, twice in a row (the counters reset themselves), and its first GEMV against float64."""
    import numpy as np
    import torch

    from portakern.backends.triton import gemv_stream as S
    from portakern.backends.triton import quant_gemv as Q

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    fails = 0
    w = Weights(3)
    x0 = torch.randn(1, 6144, device="cuda").to(torch.bfloat16)
    for ahead, per_sm, l2, programs in ((1, 2, 0, None), (2, 2, 0, None), (1, 1, 2, None), (1, 2, 0, 7),
                                        (2, 1, 0, 131)):
        ours, ref = _outs(), _outs()
        chain = Chain(w, ours, ahead, per_sm, l2, sms, programs=programs)

        def make(op, p):
            return S.Launcher(op, p, _stream_cfg(p, ahead, per_sm, l2), sms, "cuda", programs=chain.programs)
        run_ref = per_gemv(w, ref, make)
        for rep in range(2):
            for o in ours + ref:
                o.fill_(float("nan"))
            ours[3].copy_(x0)
            ref[3].copy_(x0)
            chain()
            run_ref()
            torch.cuda.synchronize()
            same = all(torch.equal(a, b) for a, b in zip(ours, ref))
            finite = all(bool(torch.isfinite(a.float()).all()) for a in ours)
            err = spin_error(chain)
            ok = same and finite and err == 0
            fails += not ok
            row = dict(ahead=ahead, per_sm=per_sm, l2_ahead=l2, programs=chain.programs, rep=rep, bit_equal=same,
                       finite=finite, spin_error=err, ok=ok)
            res["check"].append(row)
            print(row, flush=True)
            reset_counters(chain)
    # the first GEMV of the chain (layer 0's o on x0[:4096]) against float64
    ours = _outs()
    chain = Chain(Weights(1), ours, 1, 2, 0, sms)
    ours[3].copy_(x0)
    chain()
    torch.cuda.synchronize()
    qw, s, z, N, K = chain.w.lin["o"]
    codes = Q.unpack_internal(qw[0].cpu().numpy(), 4, 8, N, K).astype(np.float64)          # (N, K)
    G = K // 128
    sc = np.repeat(s[0, :, :N].double().cpu().numpy().T, 128, axis=1)
    zz = np.repeat(z[0, :, :N].double().cpu().numpy().T, 128, axis=1)
    ref64 = (codes - zz) * sc @ x0[0, :K].double().cpu().numpy()
    got = ours[0][0].double().cpu().numpy()
    rel = float(np.abs(got - ref64).max() / np.abs(ref64).max())
    ok = rel < 1e-2 and G == 32
    fails += not ok
    res["check"].append(dict(what="layer 0 o against float64", rel_err=rel, ok=ok))
    print(f"layer 0 o against float64: rel err {rel:.2e} ({'ok' if ok else 'FAIL'})", flush=True)
    return fails


def bench(res, layers: int, variants) -> None:
    """32 layers' GEMVs: the table's kernels launched one by one (PDL, as in the step), the stream kernel launched
    one by one, and the chain under each ``(ahead, per_sm, l2_ahead)``, each in a CUDA graph, alternating twice."""
    import torch

    from portakern.backends.triton import gemv_stream as S
    from portakern.backends.triton import quant_gemv as Q
    from portakern.devices import torch_device
    from step_timing import time_step

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    dev = torch_device("cuda", 0)
    w = Weights(layers)
    floor_ms = w.nbytes() / (res["copy_TBps"] * 1e12) * 1e3
    res["floor_ms"] = floor_ms
    outs = _outs()
    outs[3].copy_(torch.randn(1, 6144, device="cuda").to(torch.bfloat16))
    fns = {"table": per_gemv(w, outs, lambda op, p: Q.compile(op, dev)),
           "stream-per-gemv": per_gemv(w, outs, lambda op, p: S.Launcher(op, p, _stream_cfg(p, 1, 2), sms, "cuda"))}
    for ahead, per_sm, l2 in variants:
        ch = Chain(w, outs, ahead, per_sm, l2, sms)
        fns[f"chain-a{ahead}-x{per_sm}-l2{l2}"] = ch
    times = {k: [] for k in fns}
    for rnd in range(2):
        for k, f in fns.items():
            try:
                times[k].append(time_step(f, graph=True, reps=7))
            except Exception as e:       # a variant that fails to build or run is recorded, the rest go on
                times[k].append(f"{type(e).__name__}: {str(e)[:200]}")
        errs = [spin_error(f) for f in fns.values() if isinstance(f, Chain)]
        print(f"round {rnd}: " + "  ".join(f"{k} {v[-1]:.3f}" if isinstance(v[-1], float) else f"{k} x"
                                           for k, v in times.items()) + f"  spin errors {errs}", flush=True)
    for k, v in times.items():
        ok = [t for t in v if isinstance(t, float)]
        best = min(ok) if ok else None
        row = dict(variant=k, ms=v, best_ms=best, of_floor=(floor_ms / best) if best else None)
        if isinstance(fns[k], Chain):
            row["spin_error"] = spin_error(fns[k])
            try:      # after the timing: its own launches, eager
                row["wait_profile"] = wait_profile(fns[k])
            except Exception as e:
                row["wait_profile"] = f"{type(e).__name__}: {str(e)[:200]}"
        res["bench"].append(row)
    print(f"\n{layers} layers x (o, gate/up, down, qkv), floor {floor_ms:.3f} ms")
    print(f"{'variant':24s} {'best ms':>8s} {'of floor':>8s} {'waiting':>8s}")
    for r in res["bench"]:
        b, wp = r["best_ms"], r.get("wait_profile")
        waiting = f"{wp['wait_all']:8.0%}" if isinstance(wp, dict) else f"{'-':>8s}"
        print(f"{r['variant']:24s} {b if b else float('nan'):8.3f} {(r['of_floor'] or 0):8.0%} {waiting}")


def lower(variants) -> int:
    """sm_90a lowering of the 32-layer chain for the decode step's shapes as a launch specialises it (no GPU):
    shared memory, registers and spills (two programs per SM: capped at 128), 16-byte loads, waits."""
    from experiments.chain_lowering import describe, lower_sm90, step_ints
    from experiments.layer_chain import constexprs

    for ahead, per_sm, l2 in variants:
        consts = constexprs([(N, K) for _, N, K in PHASES], per_sm * 132, ahead, l2, 0)
        ck = lower_sm90(gemv_chain_kernel, consts, step_ints([(N, K) for _, N, K in PHASES], layers=32),
                        maxnreg=128 if per_sm > 1 else None)
        print(f"ahead {ahead}, {per_sm}/SM, l2 {l2}: {describe(ck)}", flush=True)
    return 0


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--phase", choices=("check", "bench", "lower"), required=True)
    ap.add_argument("--layers", type=int, default=32, help="layers of the bench (default 32, the decode step's)")
    ap.add_argument("--variants", nargs="+", default=["1,2,0", "2,2,0", "1,1,0", "1,2,2", "1,2,4"],
                    metavar="AHEAD,PER_SM,L2_AHEAD")
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    ap.add_argument("--tag", default="")
    a = ap.parse_args()
    variants = [tuple(int(v) for v in s.split(",")) for s in a.variants]
    if a.phase == "lower":
        raise SystemExit(lower(variants))
    import gemv as B
    from experiments import harness

    res = harness.header(__doc__, B.copy_bandwidth_TBps(), check=[], bench=[])
    fails = 0
    try:
        if a.phase == "check":
            fails = check(res)
        else:
            bench(res, a.layers, variants)
    finally:
        harness.write(res, a.out, f"gemv-chain-{a.phase}", a.tag)
    raise SystemExit(1 if fails else 0)


if __name__ == "__main__":
    main()
