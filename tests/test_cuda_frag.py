"""The cuda backend's GEMV kernel that reads the fragment layout (``backends/cuda/kernels/gemv_frag.cu``).

Four levels, from no dependency to the GPU:

* a numpy emulation of the kernel's index maps -- which (row, column) each lane's nibble is, where x is staged and
  read (with its bank swizzle), how lanes, warps and slices are added -- written from the CUDA code's formulas and
  checked against float64 ``x @ dequant(W)^T`` of fragments packed by ``ir.gemv_layout.pack_fragments`` (numpy
  only: runs everywhere, CI included); a mutated map must fail it;
* the kernel's own CUDA C run on the CPU (``host_run``: threads as std::threads, shuffles at a barrier);
* the host side without a GPU: which kernel a weight gets (words: the word kernel; fragments only: this one), the
  refusals, the NVRTC lowering on every target (its launches -- ``FRAG_TABLE``, the translation ``frag_config`` --
  and the ranking they give: ``tests/test_cuda_gemv_tables.py``);
* values on a GPU (skipped without a CUDA device), through dispatch with a fragment-only prepared weight.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import pytest

import portakern
from portakern.devices import Device
from portakern.ir import DType, QuantFormat
from portakern.ir.gemv_layout import pack_fragments, padded_columns
from portakern.ir.ops import QuantGemv

from cuda_helpers import H200, C, gemv, require_cxx, require_nvrtc  # noqa: F401 (C: a fixture)

# -- the numpy emulation of gemv_frag.cu's index maps -----------------------------------------------------------


@dataclass(frozen=True)
class Cfg:
    """The kernel's launch constants (``quant_gemv.FragConfig``'s fields), restated so that this level needs no
    backend import."""

    rw: int = 4
    nt: int = 2
    kw: int = 1
    splits: int = 1
    pf: int = 2


def _code_shift(e):                 # low_half(e): 4 e + 4 <= 23, i.e. e <= 4; nibbles 5..7 from the word >> 16
    return 4 * e if 4 * e + 4 <= 23 else 4 * e - 16


def _x_scale(e):
    return 2.0 ** (85 - _code_shift(e))


def _x_slot(b, q):                  # x_slot(b, q): quarter q of block b at q ^ ((b >> 1) & 3)
    return 16 * b + 4 * (q ^ ((b >> 1) & 3))


def emulate(frag, s, z, zp, x, N, K, GS, cfg: Cfg, reg_of=lambda cb, rb: 2 * cb + rb):
    """``gemv_frag``'s result in float64, following its CUDA code step by step (vectorised over the lanes, row warps
    and tiles): ``frag`` uint32 ``(KC, NU, 256)``, ``s`` / ``z`` float ``(G, NP)`` (``z`` None: the constant ``zp``),
    ``x`` ``(M, K)``. ``reg_of`` is the word of a lane's 16 bytes that holds (cb, rb) (mutated by the tests)."""
    M = x.shape[0]
    KC, NU = K // 128, frag.shape[1]
    CS, BN = KC // cfg.splits, 16 * cfg.nt * cfg.rw
    CPW, KS, NB = CS // cfg.kw, CS * 128, CS * 128 // 16
    tiles = -(-N // BN)
    lane = np.arange(32)[None, None, :]                      # axes: (tile, rw, lane)
    g, t = lane // 4, lane % 4
    tile = np.arange(tiles)[:, None, None]
    rw = np.arange(cfg.rw)[None, :, None]
    words = frag.reshape(-1)
    out = np.zeros((M, tiles * BN))
    for slice_ in range(cfg.splits):
        # phase 2: staging, by the kernel's formulas
        xs = np.full((M, KS), np.nan)
        xsum = np.zeros((M, NB))
        for b in range(NB):
            xf = x[:, slice_ * KS + 16 * b: slice_ * KS + 16 * b + 16]
            for q in range(4):
                cb, hi = q // 2, q % 2
                for i in range(4):
                    xs[:, _x_slot(b, q) + i] = xf[:, 4 * i + 2 * cb + hi] * _x_scale(4 * hi + i)
            xsum[:, b] = xf.sum(axis=1)
        assert not np.isnan(xs).any()
        red = np.zeros((cfg.kw, M, tiles, BN))
        for kw in range(cfg.kw):
            res = np.zeros((cfg.nt, 2, M) + np.broadcast(tile, rw, lane).shape)
            for i in range(CPW):                             # the ring only reorders loads: chunk order is i
                cl = kw + cfg.kw * i
                c = slice_ * CS + cl
                xg = xsum[:, 8 * cl + t] + xsum[:, 8 * cl + 4 + t]          # (M, 1, 1, 32)
                xe = 16 * t + 4 * (t >> 1)
                xo = 16 * t - 4 * (t >> 1)
                for j in range(cfg.nt):
                    unit = np.minimum((tile * cfg.rw + rw) * cfg.nt + j, NU - 1)
                    srow = (c * 128 // GS) * s.shape[1] + 16 * unit + g
                    for rb in range(2):
                        aq = np.zeros((M,) + np.broadcast(tile, rw, lane).shape)
                        for h in range(2):
                            for cb in range(2):
                                w = words[(c * NU + unit) * 256 + 128 * h + 4 * lane + reg_of(cb, rb)].astype(np.int64)
                                lo, hi = w, w >> 16
                                for e in range(8):
                                    v = 2 * cb + e // 4
                                    qq = v ^ (2 * h)
                                    addr = (xo if qq & 1 else xe) + 128 * cl + 64 * h + 4 * qq + e % 4
                                    bits = (lo if 4 * e + 4 <= 23 else hi) & (0xF << _code_shift(e))
                                    qf = bits * 2.0 ** -149                     # the masked word as an fp32 subnormal
                                    aq += qf[None] * xs[:, addr]
                        sc = s.reshape(-1)[srow + 8 * rb]
                        zc = z.reshape(-1)[srow + 8 * rb] if z is not None else np.full(sc.shape, float(zp))
                        res[j, rb] += sc[None] * (aq * 2.0 ** 64 - zc[None] * xg)
            # phase 4: the four lanes t of a row, then lane t = 0 writes row (rw NT + j) 16 + 8 rb + g
            for j in range(cfg.nt):
                for rb in range(2):
                    v = res[j, rb].reshape(M, tiles, cfg.rw, 8, 4).sum(axis=-1)       # (M, tile, rw, g)
                    rows = (np.arange(cfg.rw)[:, None] * cfg.nt + j) * 16 + 8 * rb + np.arange(8)[None, :]
                    red[kw][:, :, rows] = v
        out += red.sum(axis=0).reshape(M, tiles * BN)
    return out[:, :N]


def _problem(rng, N, K, GS, M, sym):
    codes = rng.integers(0, 16, size=(N, K))
    G, NP = K // GS, padded_columns(N)
    s = np.zeros((G, NP))
    s[:, :N] = rng.uniform(0.5, 2.0, size=(G, N)) * 2.0 ** -rng.integers(0, 4, size=(G, N))
    s[:, N:] = s[:, :1]
    z = None if sym else np.zeros((G, NP))
    if z is not None:
        z[:, :N] = rng.integers(0, 16, size=(G, N))
        z[:, N:] = z[:, :1]
    x = rng.standard_normal((M, K))
    grp = np.arange(K) // GS
    W = (codes - (z[grp, :N].T if z is not None else 8)) * s[grp, :N].T
    return pack_fragments(codes.astype(np.uint32)).view(np.uint32), s, z, x, x @ W.T


@pytest.mark.parametrize("N,K,GS,M,sym,cfg", [
    (256, 1024, 128, 1, False, Cfg()),                          # two tiles of 128 rows, one slice
    (1000, 1024, 128, 2, False, Cfg(rw=2, nt=2, kw=2, splits=2)),   # rows past N, K warps, two slices
    (300, 1536, 256, 3, True, Cfg(rw=1, nt=4, splits=3, pf=1)),     # groups of two chunks, symmetric
    (1100, 2048, 128, 4, False, Cfg(rw=4, nt=4, kw=1, splits=4)),   # 256-row tiles past the padded rows: clamped
    (128, 512, 512, 1, False, Cfg(rw=1, nt=1, kw=4)),               # one group, one chunk per K warp
])
def test_emulated_index_maps_match_float64(N, K, GS, M, sym, cfg):
    rng = np.random.default_rng(N + K + M)
    frag, s, z, x, ref = _problem(rng, N, K, GS, M, sym)
    out = emulate(frag, s, z, 8, x, N, K, GS, cfg)
    np.testing.assert_allclose(out, ref, rtol=1e-12, atol=1e-9 * np.abs(ref).max())


@pytest.mark.parametrize("mutant", ["cb<->rb", "halves"])
def test_a_mutated_map_fails_the_emulation(mutant):
    # the emulation is sensitive to the maps it restates: the word of (cb, rb) taken as (rb, cb), or the nibbles'
    # halves read from the other 16 bits, give wrong results
    rng = np.random.default_rng(7)
    frag, s, z, x, ref = _problem(rng, 256, 1024, 128, 1, False)
    if mutant == "cb<->rb":
        out = emulate(frag, s, z, 8, x, 256, 1024, 128, Cfg(), reg_of=lambda cb, rb: 2 * rb + cb)
    else:
        swapped = ((frag >> 16) | (frag << 16)).astype(np.uint32)
        out = emulate(swapped, s, z, 8, x, 256, 1024, 128, Cfg())
    assert np.abs(out - ref).max() > 1e-2 * np.abs(ref).max()


def test_x_reads_cover_the_staged_slice_and_meet_no_bank_twice():
    # every lane's x addresses of one chunk are the 32 staged positions of its two 16-column blocks (each once), and
    # each 16-byte shared load of a quarter warp (8 lanes: g = 2p, 2p + 1, t = 0..3) touches distinct banks
    # wherever its lanes read distinct addresses
    for cl in range(3):
        for t in range(4):
            xe, xo = 16 * t + 4 * (t >> 1), 16 * t - 4 * (t >> 1)
            seen = []
            for h in range(2):
                for v in range(4):
                    qq = v ^ (2 * h)
                    seen += [(xo if qq & 1 else xe) + 128 * cl + 64 * h + 4 * qq + i for i in range(4)]
            blocks = [8 * cl + 4 * h + t for h in range(2)]
            assert sorted(seen) == sorted(_x_slot(b, q) + i for b in blocks for q in range(4) for i in range(4))
    for h in range(2):
        for v in range(4):
            qq = v ^ (2 * h)
            addrs = {(16 * t + (-1 if qq & 1 else 1) * 4 * (t >> 1)) + 64 * h + 4 * qq for t in range(4)}
            banks = [(a + i) % 32 for a in addrs for i in range(4)]
            assert len(addrs) == 4 and len(set(banks)) == 16


# -- the CUDA C on the CPU ------------------------------------------------------------------------------------


def _float64(x, w):
    """float64 ``x @ dequant(W)^T``, the weight unpacked by its format's own reader (``ir.packing.unpack``)."""
    from portakern.arrays import to_numpy
    from portakern.ir.packing import unpack

    host = {k: np.asarray(to_numpy(v)) for k, v in w.tensors.items()}
    codes, scales, zeros, group = unpack(w.fmt, host, w.N, w.K)
    W = (codes - zeros[:, group]) * scales[:, group]
    return x.double().cpu().numpy() @ W.T


CPU = Device("cpu", None, arch="x86_64", name="cpu")


def _host_frag(N, K, M, sym, xdt, sdt, odt, cfg, gs=128, x_nan=None):
    torch = pytest.importorskip("torch")
    from portakern.backends.cuda import quant_gemv as C
    from portakern.backends.cuda.common.host_run import frag_gemv_on_host
    from portakern.gemv_weight import prepare_gemv_weight

    g = torch.Generator().manual_seed(N * 7 + K + M)
    w = portakern.quantize(torch.randn(N, K, generator=g).numpy(), bits=4, group_size=gs, symmetric=sym,
                           scale_dtype=sdt)
    x = torch.randn(M, K, generator=g).to(getattr(torch, xdt))
    if x_nan is not None:   # a NaN of every mantissa bit set: fp16 0x7FFF widens to 0x7FFFE000, like the GPU's 0x7FFFFFFF
        x.view(torch.int16)[x_nan] = 0x7FFF
    op = QuantGemv(M=M, N=N, K=K, dtype=DType(xdt), fmt=w.fmt, out_dtype=DType(odt))
    pw = prepare_gemv_weight(w, CPU, fragments=True, layout="fragments")        # each code once, as fragments
    assert pw.qweight is None
    return frag_gemv_on_host(op, pw, x, C.FragConfig(*cfg)), _float64(x, w)


@pytest.mark.parametrize("M,N,K,sym,xdt,sdt,cfg", [
    (1, 256, 1024, False, "bfloat16", "float16", (4, 2, 1, 1, 2)),      # one slice, the ring refilled
    (2, 1000, 1024, False, "float16", "bfloat16", (2, 2, 2, 2, 1)),     # rows past N, two K warps, two slices
    (3, 300, 1536, True, "bfloat16", "bfloat16", (1, 4, 1, 3, 2)),      # symmetric: the constant zero point
    (4, 1100, 2048, False, "bfloat16", "float16", (4, 4, 1, 2, 3)),     # 256-row tiles past the padded rows
    (1, 256, 4096, False, "float16", "float16", (2, 2, 1, 32, 1)),      # 32 slices of one chunk each
])
def test_kernel_source_on_the_host_matches_float64(M, N, K, sym, xdt, sdt, cfg):
    require_cxx()
    out, ref = _host_frag(N, K, M, sym, xdt, sdt, "float32", cfg)
    assert out.shape == (M, N) and np.isfinite(out).all()
    assert np.abs(out - ref).max() / np.abs(ref).max() < 1e-6       # fp32 accumulation, fp32 out


@pytest.mark.parametrize("odt", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("cfg", [(2, 2, 2, 2, 1), (4, 2, 1, 4, 2)])
def test_a_nan_in_x_reaches_every_output_of_its_row_in_every_output_dtype(odt, cfg):
    # the bf16 rounding's carry must not turn CUDA's NaN (0x7FFFFFFF) into -0.0 (GPU case nf-xnan-gemv-native4a)
    require_cxx()
    out, _ = _host_frag(256, 1024, 2, False, "float16", "float16", odt, cfg, x_nan=(1, 700))
    assert np.isnan(out[1]).all() and np.isfinite(out[0]).all()


@pytest.mark.parametrize("odt,tol", [("bfloat16", 2 ** -8), ("float16", 2 ** -11)])
def test_kernel_rounds_its_output_to_the_dtype(odt, tol):
    require_cxx()
    out, ref = _host_frag(512, 1024, 1, False, "bfloat16", "float16", odt, (4, 2, 1, 4, 2))
    rel = np.abs(out - ref) / np.maximum(np.abs(ref), 1e-3)
    assert np.isfinite(out).all() and np.median(rel) < tol and np.abs(out - ref).max() / np.abs(ref).max() < 8 * tol


def test_host_run_sees_a_broken_lane_map(monkeypatch):
    # the kernel with each lane's two rows swapped (rb taken as 1 - rb): the host run must not pass it
    require_cxx()
    import tempfile
    from pathlib import Path

    from portakern.backends.cuda.common import host_run

    src = (host_run._KERNELS / "gemv_frag.cu").read_text()
    bad = src.replace("const u32 lo = wr[2 * cb + rb], hi = lo >> 16;",
                      "const u32 lo = wr[2 * cb + 1 - rb], hi = lo >> 16;")
    assert bad != src
    d = Path(tempfile.mkdtemp())
    for f in ("host_shim.h", "host_launch.cpp"):
        (d / f).write_text((host_run._KERNELS / f).read_text())
    (d / "gemv_frag.cu").write_text(bad)
    monkeypatch.setattr(host_run, "_KERNELS", d)
    host_run.build.cache_clear()
    try:
        out, ref = _host_frag(256, 1024, 1, False, "bfloat16", "float16", "float32", (4, 2, 1, 1, 2))
    finally:
        host_run.build.cache_clear()
    assert np.abs(out - ref).max() / np.abs(ref).max() > 1e-2


# -- the host side, no GPU --------------------------------------------------------------------------------------

@pytest.mark.parametrize("op,why", [
    (gemv(bits=8), "bits=8 (the fragment layout holds int4 codes)"),
    (gemv(gs=64), "group_size=64, K=4096 (both must be multiples of 128)"),
])
def test_frag_refusal_says_why(C, op, why):
    assert C.frag_refusal(op) == why
    assert C.frag_refusal(gemv()) is None and C.frag_refusal(gemv(M=4, gs=256)) is None


def test_a_bad_frag_config_is_refused_with_the_way_out(C):
    from portakern.errors import InvalidInputError

    with pytest.raises(InvalidInputError, match=r"whole 128-column chunks .* pick splits and kw dividing 32"):
        C._check_frag_config(gemv(), C.FragConfig(splits=3))
    with pytest.raises(InvalidInputError, match=r"whole 128-column chunks"):
        C._check_frag_config(gemv(), C.FragConfig(splits=8, pf=8))     # 4 chunks a slice: 8 cannot be in flight
    with pytest.raises(InvalidInputError, match=r"needs 70144 bytes of shared memory, over 49152; use more splits"):
        C._check_frag_config(gemv(K=16384), C.FragConfig())


def test_the_kernel_follows_the_weights_layout(C, monkeypatch):
    # words present: the word kernel (as before); fragments only: the fragment kernel, compiled on its first call,
    # with the fragments' pointer; neither, or an op the fragment kernel cannot run: a clear error
    torch = pytest.importorskip("torch")
    from types import SimpleNamespace

    from portakern.backends.cuda.common import nvrtc
    from portakern.errors import InvalidInputError
    from portakern.gemv_weight import prepare_gemv_weight

    made, launches = [], []

    class Recorder:
        def __init__(self, compiled, entry, index, smem, pdl):
            self.entry, self.smem = entry, smem
            made.append(entry)

        def __call__(self, grid, threads, *ptrs):
            launches.append((self.entry, grid, threads, ptrs))

    monkeypatch.setattr(nvrtc, "Function", Recorder)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(multi_processor_count=132))
    from portakern import capture, gemv_weight

    # weights prepared with words by default first: the word kernel is compiled with the op
    monkeypatch.setattr(gemv_weight, "DEFAULT_LAYOUT", "words+fragments")
    N, K = 1000, 1024
    w = portakern.quantize(np.random.default_rng(0).standard_normal((N, K)).astype(np.float32), bits=4,
                           group_size=128)
    both = prepare_gemv_weight(w, CPU, fragments=True)
    only = prepare_gemv_weight(w, CPU, fragments=True, layout="fragments")
    assert both.qweight is not None and only.qweight is None
    op = QuantGemv(M=1, N=N, K=K, dtype=DType.bfloat16, fmt=w.fmt)
    fcfg = C.FragConfig(rw=2, nt=2, kw=1, splits=1, pf=2)        # one slice: no per-stream workspace (needs CUDA)
    kern = C.compile(op, H200, C.SmallMConfig(16, 4, 1, 2), fcfg)
    assert made == [C.ENTRY] and kern.frag_config == fcfg
    x = torch.randn(1, K).to(torch.bfloat16)
    out = torch.empty(1, N, dtype=torch.bfloat16)
    kern(x, both, out)
    assert launches[-1][0] == C.ENTRY and launches[-1][3][0] == both.qweight.data_ptr()
    kern(x, only, out)
    kern(x, only, out)
    assert made == [C.ENTRY, C.FRAG_ENTRY]                     # compiled once, on the first fragment-only call
    entry, grid, threads, ptrs = launches[-1]
    assert (entry, grid, threads) == (C.FRAG_ENTRY, -(-N // 64), 64)
    assert ptrs[:5] == (only.frag.data_ptr(), only.scales.data_ptr(), only.zeros.data_ptr(), x.data_ptr(),
                        out.data_ptr())
    with pytest.raises(InvalidInputError, match="holds neither words .* nor fragments"):
        kern(x, replace(only, frag=None), out)
    wide = prepare_gemv_weight(portakern.quantize(np.ones((1200, K), np.float32), bits=4, group_size=128), CPU,
                               fragments=True, layout="fragments")
    with pytest.raises(InvalidInputError, match="fragments' row stride is 1280, expected 1024"):
        kern(x, wide, out)
    # weights prepared as fragments by default (the committed default): the fragment kernel is compiled with the op,
    # the word kernel on its first call, which inside CUDA stream capture is refused with the way out
    monkeypatch.setattr(gemv_weight, "DEFAULT_LAYOUT", "fragments")
    made.clear()
    kern = C.compile(op, H200, C.SmallMConfig(16, 4, 1, 2), fcfg)
    assert made == [C.FRAG_ENTRY]
    monkeypatch.setattr(capture, "is_capturing", lambda: True)
    with pytest.raises(capture.CaptureError, match=r"quant_gemv\(M=1, N=1000, K=1024\) on cuda: the first call with "
                                                   r"a weight holding words compiles .* before capture"):
        kern(x, both, out)
    kern(x, only, out)                                         # compiled already: launches inside the capture
    monkeypatch.setattr(capture, "is_capturing", lambda: False)
    kern(x, both, out)
    assert made == [C.FRAG_ENTRY, C.ENTRY] and launches[-1][0] == C.ENTRY
    op8 = QuantGemv(M=1, N=N, K=K, dtype=DType.bfloat16, fmt=QuantFormat(bits=8, group_size=128, symmetric=False))
    kern8 = C.compile(op8, H200, C.SmallMConfig(16, 8, 1, 2))
    assert kern8.frag_config is None
    with pytest.raises(InvalidInputError, match=r"holds only fragments, .* bits=8"):
        kern8(x, replace(only, zero_point=128), out)


@pytest.mark.parametrize("target", ["sm_80", "sm_90a", "sm_100a", "sm_120"])
@pytest.mark.parametrize("op,cfg", [
    # the default translation is lowered for every int4 op of test_cuda_backend's lowering test; here the launch
    # shapes the translation does not give (K warps, four tiles a warp, deep rings) and rows of x
    (gemv(N=8192, K=8192), (4, 4, 2, 4, 2, 1)), (gemv(M=4, N=8192, K=8192), (2, 2, 4, 8, 1, 0)),
    (gemv(M=3, N=28672, K=8192, sym=True, dtype=DType.float16), None), (gemv(M=1, N=4096, K=14336), (2, 2, 1, 7, 4, 1)),
])
def test_lowers_for_every_target_without_spilling(C, target, op, cfg):
    art = C.compile_for_target(op, target, frag=C.FragConfig(*cfg) if cfg else None)
    f = art["frag"]
    assert f["cubin_bytes"] > 1000 and f["registers"] and f["registers"] <= 255
    assert f["spill_bytes"] is None or f["spill_bytes"] <= C.MAX_SPILL_BYTES
    assert f["frame_bytes"] <= C.MAX_SPILL_FRAME_BYTES and f["smem_bytes"] <= C.SMEM_PER_CTA


def test_every_int4_table_entry_translates_to_a_launch_that_does_not_spill(C):
    # a fragment-only weight runs the word kernel's measured entry translated (frag_config): each committed int4 entry
    # gives a launch the kernel takes, lowered for sm_90a without spilling
    from portakern.backends.cuda.common import nvrtc
    from portakern.backends.cuda.tuning import TABLE

    seen = set()
    for (key, M, bits, N, K), entry in TABLE.items():
        op = gemv(M=M, N=N, K=K)
        f = C.frag_config(op, C.SmallMConfig(*entry[:5]))
        if bits != 4 or (M, N, K, f) in seen:
            continue
        seen.add((M, N, K, f))
        C._check_frag_config(op, f)
        c = nvrtc.compile_source(C.FRAG_SOURCE, tuple(C.frag_defines(op, f, True, None).items()), "sm_90a")
        assert (c.spill_bytes or 0) == 0 and c.frame_bytes == 0, (key, M, N, K, f)
    assert len(seen) >= 20


def test_int8_lowers_the_word_kernel_only(C):
    assert "frag" not in C.compile_for_target(gemv(bits=8, N=8192, K=8192), "sm_90a")


# -- on a GPU ------------------------------------------------------------------------------------------------------


def _cuda():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    require_nvrtc()
    return torch


def _fragment_only(w, torch):
    """``w`` with a fragment-only prepared copy (``layout="fragments"``: each code held once) in its cache, under the
    key dispatch uses, so the cuda backend runs its fragment kernel on it."""
    from portakern.devices import torch_device
    from portakern.gemv_weight import GEMV_LAYOUT, prepare_gemv_weight

    dev = torch_device("cuda", 0)
    pw = prepare_gemv_weight(w, dev, fragments=True, layout="fragments")
    assert pw.frag is not None and pw.qweight is None
    w.prepared[(GEMV_LAYOUT, str(dev))] = pw
    return w


@pytest.mark.parametrize("M,N,K,sym,dtype,sdt", [
    (1, 4096, 4096, False, "bfloat16", "float16"), (1, 1000, 4096, True, "float16", "float16"),
    (1, 4096, 14336, False, "bfloat16", "bfloat16"), (1, 28672, 8192, False, "bfloat16", "float16"),
    (1, 14336, 4096, False, "float16", "float16"), (1, 6144, 4096, False, "bfloat16", "float16"),
    (2, 4096, 4096, False, "bfloat16", "float16"), (4, 4096, 14336, False, "bfloat16", "float16"),
    (3, 8192, 8192, True, "float16", "bfloat16"),
])
def test_gpu_fragment_only_values_against_float64(M, N, K, sym, dtype, sdt):
    torch = _cuda()
    g = torch.Generator().manual_seed(N + K + M)
    w = portakern.quantize(torch.randn(N, K, generator=g).numpy(), bits=4, group_size=128, symmetric=sym,
                           scale_dtype=sdt).to("cuda")
    x = torch.randn(M, K, generator=g).to(getattr(torch, dtype)).cuda()
    ref = _float64(x, w)
    _fragment_only(w, torch)
    for _ in range(2):                                   # the second call: the counters were reset by the first
        out = portakern.quant_gemv(x, w, backend="cuda")
        err = np.abs(out.double().cpu().numpy() - ref).max() / np.abs(ref).max()
        assert err < 1e-2, err


def test_gpu_fragment_only_graph_replays_with_new_inputs():
    torch = _cuda()
    N, K = 4096, 4096
    g = torch.Generator().manual_seed(0)
    w = _fragment_only(portakern.quantize(torch.randn(N, K, generator=g).numpy(), bits=4, group_size=128)
                       .to("cuda"), torch)
    x = torch.randn(1, K, generator=g).to(torch.bfloat16).cuda()
    portakern.quant_gemv(x, w, backend="cuda")                     # first call: compile, workspace
    with portakern.use_backend("cuda"):
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            portakern.quant_gemv(x, w)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = portakern.quant_gemv(x, w)
    for seed in (1, 2):
        x.copy_(torch.randn(1, K, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = _float64(x, w)
        assert np.abs(out.double().cpu().numpy() - ref).max() / np.abs(ref).max() < 1e-2


# -- the sweep's helpers (benchmarks/gemv_cuda_frag.py), no GPU ----------------------------------------------------


def _sweep():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import gemv_cuda_frag

    return gemv_cuda_frag


def test_sweep_variants_are_launchable_and_bounded(C):
    F = _sweep()
    total = 0
    for N, K in ((4096, 4096), (14336, 4096), (4096, 14336), (8192, 8192), (28672, 8192), (16384, 16384)):
        op = gemv(N=N, K=K)
        vs = F.frag_variants(N, K)
        assert vs and len(set(vs)) == len(vs)
        for v in vs:
            C._check_frag_config(op, C.FragConfig(*v))        # raises for one the kernel cannot take
        total += len(vs)
    assert total <= 500          # what the GPU times in the one-command budget (~0.1 s a variant)


def test_sweep_reference_reads_the_fragments():
    # the sweep's float64 reference unpacks the fragments with torch by ir.gemv_layout's index map: equal to the
    # format's own reader's
    torch = pytest.importorskip("torch")
    from portakern.gemv_weight import prepare_gemv_weight

    F = _sweep()
    w = portakern.quantize(np.random.default_rng(3).standard_normal((300, 1024)).astype(np.float32), bits=4,
                           group_size=256)
    pw = prepare_gemv_weight(w, CPU, fragments=True, layout="fragments")
    x = torch.randn(2, 1024).to(torch.bfloat16)
    np.testing.assert_allclose(F.frag_reference(x, pw), _float64(x, w), rtol=1e-12, atol=1e-12)
