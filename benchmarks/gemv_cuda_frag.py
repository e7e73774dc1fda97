"""The cuda backend's GEMV kernel that reads the fragment layout (``backends/cuda/kernels/gemv_frag.cu``) over its
launch variants, each checked against float64 and timed beside the word-layout kernel at its own choice
(``quant_gemv.choose``: the measured table), the triton table and tinygemm: ``gemv_table_sweep.py --kernel frag``.

    python benchmarks/gemv_table_sweep.py --kernel frag --phase lower          # no GPU: every variant to sm_90a
    python benchmarks/gemv_table_sweep.py --kernel frag --phase bench          # GPU: the int4 table's six shapes, M=1
    python benchmarks/gemv_table_sweep.py --kernel frag --phase bench --m 4    # the same at M = 4

The bench writes ``gemv-cuda-frag-sweep[-m<M>]-<card>.json``: per shape the floor, the word kernel (``word_us``, its
configuration), the fragment kernel translated from it (``frag_config``: what the backend runs for a fragment-only
weight, ``translated_us``), the fastest variant (``best``, ``best_us``), the triton table and tinygemm, all in CUDA
graphs over weights rotated past 4x the L2, in one process.
"""

from __future__ import annotations

import functools

#: (rows warps, 16-row tiles per warp) of the variants: 64-256 rows per CTA, 1-4 tiles per warp
SHAPES_RW_NT = ((4, 2), (2, 2), (8, 1), (4, 1), (2, 4))
#: K warps tried with these (rows warps, tiles) only (more threads for the same rows)
KW2 = ((4, 2), (2, 2))
SPLITS = (1, 2, 4, 7, 8, 14, 16, 32)
NUM_SMS = 132
#: most 16-byte loads in flight per thread (2 NT PF): the ring's registers
MAX_RING = 16


def _op(M, N, K):
    from gemv_problems import gemv_op

    return gemv_op(M, N, K, bits=4)


def frag_variants(N: int, K: int, M: int = 1) -> list[tuple[int, ...]]:
    """(rw, nt, kw, splits, pf, ldna) to time for one shape: ``SHAPES_RW_NT`` (with ``kw`` 2 for ``KW2``), K splits
    that leave 1-8 CTAs per SM (or one slice from one wave), rings of 1, 2 or 4 chunks (``MAX_RING``), weight loads
    past L1 (and through it at 2 chunks); only those ``_check_frag_config`` accepts."""
    from portakern.backends.cuda import quant_gemv as C
    from portakern.errors import InvalidInputError

    op, out = _op(M, N, K), []
    for rw, nt in SHAPES_RW_NT:
        tiles = -(-N // (16 * nt * rw))
        for kw in (1, 2) if (rw, nt) in KW2 else (1,):
            for s in SPLITS:
                if not (NUM_SMS <= tiles * s <= 8 * NUM_SMS or (s == 1 and tiles >= NUM_SMS)):
                    continue
                for pf in (1, 2, 4):
                    for ldna in (0, 1):
                        cfg = C.FragConfig(rw, nt, kw, s, pf, ldna)
                        if 2 * nt * pf > MAX_RING or (pf != 2 and ldna == 0):
                            continue
                        try:
                            C._check_frag_config(op, cfg)
                        except InvalidInputError:
                            continue
                        out.append((rw, nt, kw, s, pf, ldna))
    return out


def compile_job(job, target: str = "sm_90a"):
    """(job, Compiled or None, log) for one (M, N, K, variant): the backend's NVRTC path and ``-D`` constants."""
    from portakern.backends.cuda import quant_gemv as C
    from portakern.backends.cuda.common import nvrtc
    from portakern.errors import BackendError

    M, N, K, v = job
    op = _op(M, N, K)
    try:
        c = nvrtc.compile_source(C.FRAG_SOURCE, tuple(C.frag_defines(op, C.FragConfig(*v), True, None).items()),
                                 target)
        return job, c, c.log
    except BackendError as e:
        return job, None, str(e)


def compile_all(jobs, workers: int = 16) -> dict:
    """Every job compiled in parallel processes (before CUDA is initialised in the caller)."""
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(workers) as ex:
        return {job: (compiled, log) for job, compiled, log in ex.map(compile_job, jobs)}


def lower(M: int, shapes) -> int:
    """``--phase lower``: every variant of ``shapes`` to sm_90a, with registers and spills."""
    from gemv_table_sweep import report

    jobs = [(M, N, K, v) for _, N, K in shapes for v in frag_variants(N, K, M)]
    bad = 0
    for (m, N, K, v), (compiled, log) in compile_all(jobs).items():
        r = report(compiled, log) if compiled else None
        bad += compiled is None or bool(r["spill_stores"] or r.get("frame_bytes"))
        print(f"M={m} int4 {N}x{K} rw,nt,kw,S,PF,ldna={v}: {r if compiled else 'FAILED ' + log}")
    print(f"{len(jobs)} variants, {bad} failed or spilled")
    return 1 if bad else 0


@functools.lru_cache(maxsize=1)
def _frag_index_torch(device: str):
    import numpy as np
    import torch

    from portakern.ir.gemv_layout import _frag_index

    row, k = _frag_index()                             # (lane, reg, p, half) -> row 0..15, column 0..63
    return torch.tensor(np.array(row), device=device), torch.tensor(np.array(k), device=device)


def frag_reference(x, w):
    """float64 ``x @ dequant(W)^T`` of a prepared weight read from its fragments (``w.frag``), unpacked with torch on
    its device by ``ir.gemv_layout``'s index map (``_frag_index``): nibble ``4 p + 16 half`` of word ``(c, u, 128 h
    + 4 lane + reg)`` is row ``16 u + row`` and column ``128 c + 64 h + k``."""
    import torch

    KC, NU, _ = w.frag.shape
    row, k = _frag_index_torch(str(w.frag.device))
    codes = torch.zeros(NU, 16, KC, 128, dtype=torch.uint8, device=w.frag.device)
    C = torch.arange(KC, device=w.frag.device)[:, None, None, None]
    U = torch.arange(NU, device=w.frag.device)[None, :, None, None]
    for h in range(2):
        words = w.frag[:, :, 128 * h: 128 * h + 128].reshape(KC, NU, 32, 4)
        for p in range(4):
            for half in range(2):
                q = ((words >> (4 * p + 16 * half)) & 15).to(torch.uint8)
                codes[U, row[None, None, :, :, p, half], C, 64 * h + k[None, None, :, :, p, half]] = q
    codes = codes.reshape(NU * 16, KC * 128)[: w.N, : w.K].double()
    g = torch.arange(w.K, device=codes.device) // w.group_size
    z = w.zeros.double()[g, : w.N].T if w.zeros is not None else float(w.zero_point)
    dq = (codes - z) * w.scales.double()[g, : w.N].T
    return (x.double() @ dq.T).cpu().numpy()


class Launch:
    """``kern(x, w, out)`` of a compiled kernel (word or fragment) under its launch: ``codes`` picks the weight's
    tensor (``"qweight"`` or ``"frag"``); a zeroed split-K workspace and counters of its own."""

    def __init__(self, compiled, entry: str, smem: int, grid: int, threads: int, ws_floats: int, tiles: int,
                 codes: str):
        import torch

        from portakern.backends.cuda.common import nvrtc

        self.fn = nvrtc.Function(compiled, entry, 0, smem, True)
        self.grid, self.threads, self.codes = grid, threads, codes
        self.ws = torch.zeros(max(1, ws_floats), device="cuda", dtype=torch.float32)
        self.counters = torch.zeros(max(1, tiles), device="cuda", dtype=torch.int32)

    def __call__(self, x, w, out) -> None:
        self.fn(self.grid, self.threads, getattr(w, self.codes).data_ptr(), w.scales.data_ptr(), w.zeros.data_ptr(),
                x.data_ptr(), out.data_ptr(), self.ws.data_ptr(), self.counters.data_ptr())


def frag_launch(compiled, M, N, K, v) -> Launch:
    from portakern.backends.cuda import quant_gemv as C

    op, cfg = _op(M, N, K), C.FragConfig(*v)
    tiles = -(-N // cfg.rows)
    return Launch(compiled, C.FRAG_ENTRY, C.frag_smem_bytes(op, cfg), tiles * cfg.splits, cfg.threads,
                  cfg.splits * M * tiles * cfg.rows, tiles, "frag")


def word_launch(M, N, K, cfg) -> Launch:
    """The word kernel under ``cfg`` (compiled here, after CUDA is up: one compile per shape)."""
    from portakern.backends.cuda import quant_gemv as C
    from portakern.backends.cuda.common import nvrtc

    op = _op(M, N, K)
    compiled = nvrtc.compile_source(C.SOURCE, tuple(C.defines(op, cfg, True, None).items()), "sm_90a")
    tiles = -(-N // cfg.columns)
    return Launch(compiled, C.ENTRY, C.smem_bytes(op, cfg), tiles * cfg.splits, cfg.threads,
                  cfg.splits * M * (-(-N // 128) * 128), tiles, "qweight")


def run(res, M: int, shapes, save, time: bool = True) -> int:
    """Check every compiled fragment variant of ``shapes`` against float64 (NaN-poisoned), then (``time``) time the
    correct ones beside the word kernel at ``choose``'s configuration, the triton table and tinygemm; ``save()`` after
    each shape."""
    from dataclasses import astuple

    import torch

    from gemv_peers import tinygemm
    from gemv_problems import floor_bytes, ours, random_prepared
    from gemv_table_sweep import reference
    from harness import poisoned_errors
    from timing import copies_for, graph_us

    from portakern.backends.cuda import quant_gemv as C

    cubins = res.pop("_cubins")
    cap, name = torch.cuda.get_device_capability(0), torch.cuda.get_device_name(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    bad = 0
    for _, N, K in shapes:
        op = _op(M, N, K)
        w = random_prepared(N, K, 4, 128, False)
        x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
        ref = frag_reference(x, w)
        word_cfg = C.choose(op, sms, cap, name)
        translated = C.frag_config(op, word_cfg)
        kerns = {}
        tjob = (M, N, K, astuple(translated))
        if tjob not in cubins:             # what the backend runs for a fragment-only weight: always timed
            cubins[tjob] = compile_job(tjob)[1:]
        for job in [j for j in cubins if j[:3] == (M, N, K)]:
            compiled, log = cubins[job]
            row = {"M": M, "N": N, "K": K, "variant": job[3]}
            if compiled is not None:
                kern = frag_launch(compiled, M, N, K, job[3])
                out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
                errs = poisoned_errors(lambda: kern(x, w, out), out, ref, times=3)
                row.update(rel_err=errs, ok=max(errs) <= 1e-2)
                if row["ok"]:
                    kerns[job[3]] = kern
            else:
                row["error"] = log
            bad += not row.get("ok", False)
            res["check"].append(row)
        word = word_launch(M, N, K, word_cfg)
        out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
        word_err = max(poisoned_errors(lambda: word(x, w, out), out, reference(x, w), times=2))
        print(f"M={M} int4 {N}x{K}: {len(kerns)} fragment variants correct; word kernel err {word_err:.1e}",
              flush=True)
        if not time:
            save()
            continue
        fb = floor_bytes(op)
        copies = copies_for(fb)
        row = {"M": M, "bits": 4, "N": N, "K": K, "floor_us": fb / (res["copy_TBps"] * 1e12) * 1e6,
               "word_config": list(astuple(word_cfg)), "word_err": word_err,
               "frag_config": list(astuple(translated))}
        table_fns, _ = ours(op, None, copies)
        row["table_us"] = graph_us(table_fns)
        del table_fns
        row["tinygemm_us"] = graph_us(tinygemm(M, N, K, 128, copies_for(N * K // 2)))
        wss = [random_prepared(N, K, 4, 128, False) for _ in range(copies)]
        xs = [torch.randn(M, K, device="cuda").to(torch.bfloat16) for _ in range(copies)]
        row["word_us"] = graph_us([lambda x=x, w=w: word(x, w, out) for x, w in zip(xs, wss)])
        row["frag_us"] = {}
        for v, kern in kerns.items():
            row["frag_us"][",".join(map(str, v))] = graph_us([lambda x=x, w=w, k=kern: k(x, w, out)
                                                              for x, w in zip(xs, wss)])
        tkey = ",".join(map(str, astuple(translated)))
        row["translated_us"] = row["frag_us"].get(tkey)
        if row["frag_us"]:
            best = min(row["frag_us"], key=row["frag_us"].get)
            row["best"], row["best_us"] = best, row["frag_us"][best]
            print(f"M={M} int4 {N}x{K}: floor {row['floor_us']:.2f} word {row['word_us']:.2f} "
                  f"({row['floor_us'] / row['word_us']:.0%}) "
                  f"frag translated {row['translated_us'] or float('nan'):.2f} "
                  f"best {row['best_us']:.2f} ({best}) table {row['table_us']:.2f} tinygemm "
                  f"{row['tinygemm_us']:.2f} -> {row['tinygemm_us'] / row['best_us']:.2f}x", flush=True)
        res["bench"].append(row)
        del wss, xs
        torch.cuda.empty_cache()
        save()
    return bad


def summary(res) -> None:
    """The run as a markdown table: floor, word kernel, fragment kernel (translated, best), triton table, tinygemm."""
    print("| shape | floor us | word us | frag translated us | frag best us (variant) | triton table us | "
          "tinygemm us | best vs word | best vs tinygemm |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in res["bench"]:
        if "best_us" not in r:
            continue
        tr = f"{r['translated_us']:.2f}" if r.get("translated_us") else "-"
        print(f"| M={r['M']} {r['N']}x{r['K']} | {r['floor_us']:.2f} | {r['word_us']:.2f} | {tr} | "
              f"{r['best_us']:.2f} ({r['best']}) | {r['table_us']:.2f} | {r['tinygemm_us']:.2f} | "
              f"{r['word_us'] / r['best_us']:.2f}x | {r['tinygemm_us'] / r['best_us']:.2f}x |")
