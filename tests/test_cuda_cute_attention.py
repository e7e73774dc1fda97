"""The cuda backend's CuTe DSL attention (``backends/cuda/attention.py``, ``kernels/attn_fwd_sm90.py``) without a GPU.

What a CPU-only machine can check, and does here:
* ``supports`` serves exactly the IR features the kernel computes and refuses the rest with the reason;
* the kernel's own per-tile math (``kernels/attn_softmax.py``: score_mod, mask, online softmax, normalisation) and
  the expression lowering (``expr_cute.py``) run on the CPU -- CuTe DSL compiles a host ``@cute.jit`` function to
  x86 -- against numpy and the IR's evaluator;
* the register fragments the kernel hands between its two wgmmas map the same (row, key) elements, and the rows a
  thread holds are shared by exactly the 4 lanes its quad reductions shuffle over;
* ``compile_for_target(op, "sm_90a")`` lowers through CuTe DSL and the PTX holds wgmma, TMA and setmaxnreg, with
  no register spill; a real Blackwell GPU is refused (the sm_100a kernel, lowered in
  ``test_cuda_cute_attention_sm100.py``, has not run on one); dispatch never ranks it above triton.
The kernel has not run on a GPU: its values there are the GPU conformance run's to check.

Without CuTe DSL (``nvidia-cutlass-dsl``, the ``[cuda]`` extra) these tests skip on a developer's machine but fail
under ``CI``, which installs it."""


import re

import numpy as np
import pytest

from portakern.devices import Device
from portakern.ir.dtypes import DType
from portakern.ir.evaluate import evaluate
from portakern.ir.expr import (alibi_score, alibi_slopes, b, causal_mask, document_mask, h, kv_idx, prefix_lm_mask,
                               q_idx, score, softcap_score, where, window_mask)
from portakern.ir.ops import Attention, KVLayout

from cuda_helpers import backend, cute_dsl_required  # noqa: F401 (fixtures: the cuda backend, CuTe DSL present)

H200 = Device("cuda", 0, arch="sm_90", name="H200 (test)", capability=(9, 0), warp_size=32)
B200 = Device("cuda", 0, arch="sm_100", name="B200 (test)", capability=(10, 0), warp_size=32)
A100 = Device("cuda", 0, arch="sm_80", name="A100 (test)", capability=(8, 0), warp_size=32)


def attn(D=128, dtype=DType.bfloat16, Sq=300, Sk=500, Hq=8, Hkv=2, **kw):
    return Attention(batch=2, seqlen_q=Sq, seqlen_k=Sk, heads_q=Hq, heads_kv=Hkv, head_dim=D,
                     head_dim_v=kw.pop("head_dim_v", D), dtype=dtype, scale=D ** -0.5, **kw)


# -- host harness: CuTe DSL functions compiled for and run on the CPU -------------------------------------------------
# (defined in this file: the DSL reads a @cute.jit function's source)

def run_expression(tree, sc: np.ndarray, ints: np.ndarray) -> np.ndarray:
    """``tree`` lowered by ``expr_cute`` and evaluated on the CPU at each row of (score, b, h, q_idx, kv_idx,
    seqlen_q, seqlen_k)."""
    import cutlass
    from cutlass.cute.runtime import from_dlpack

    out = np.zeros(len(sc), np.float32)
    _expression_host(tree, from_dlpack(sc), from_dlpack(ints), from_dlpack(out), cutlass.Int32(len(sc)))
    return out


def run_tiles(S, V, scale, score_mod, mask_mod, head, tile_n):
    """The kernel's per-tile math over S (Sq, Sk) in key tiles of ``tile_n`` on the CPU (one thread holding
    whole rows); P V accumulated here in fp32. Returns (out, lse)."""
    import cutlass
    from cutlass.cute.runtime import from_dlpack

    Sq, Sk = S.shape
    n_tiles = -(-Sk // tile_n)
    Sp = np.zeros((Sq, n_tiles * tile_n), np.float32)
    Sp[:, :Sk] = S
    Vp = np.zeros((n_tiles * tile_n, V.shape[1]), np.float32)
    Vp[:Sk] = V
    out = np.full((Sq, V.shape[1]), np.nan, np.float32)
    lse = np.full(Sq, np.nan, np.float32)
    _tiles_host(from_dlpack(Sp), from_dlpack(Vp), from_dlpack(out), from_dlpack(lse), cutlass.Float32(scale),
                cutlass.Int32(Sq), cutlass.Int32(Sk), score_mod, mask_mod, Sq, tile_n, n_tiles, V.shape[1], head)
    return out, lse


def fragment_maps(tile_n: int, threads: list) -> dict:
    """Per consumer thread: (S accumulator read as the PV A operand, the PV wgmma's A partition, the rows of the
    thread's S view, its columns) as tile coordinates, read at trace time of a host function compiled for
    sm_90a."""
    import cutlass.cute as cute

    found: dict = {t: None for t in threads}
    cute.compile(_probe_fragments, tile_n, found, options="--gpu-arch sm_90a")
    return found


def _record_fragments(qk, pv, tile_n, found):
    import cutlass.cute as cute
    from portakern.backends.cuda.kernels.attn_fwd_sm90 import acc_as_operand_a, acc_mn_layout

    for t in list(found):
        c = qk.get_slice(t).partition_C(cute.make_identity_tensor((128, tile_n)))
        a_view = cute.make_tensor(c.iterator, acc_as_operand_a(c.layout))
        a_part = pv.get_slice(t).partition_A(cute.make_identity_tensor((128, tile_n)))
        mn = cute.make_tensor(c.iterator, acc_mn_layout(c.layout))
        rows, cols = cute.size(mn, mode=[0]), cute.size(mn, mode=[1])
        found[t] = ([tuple(a_view[i]) for i in range(cute.size(a_view))],
                    [tuple(a_part[i]) for i in range(cute.size(a_part))],
                    [mn[r, c2][0] for r in range(rows) for c2 in range(cols)],
                    [mn[r, c2][1] for r in range(rows) for c2 in range(cols)])


def _define_host_functions():
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32

    from portakern.backends.cuda.expr_cute import CuteLowering
    from portakern.backends.cuda.kernels import attn_softmax as sm
    from portakern.backends.cuda.kernels.attn_fwd_sm90 import make_tiled_mmas

    @cute.jit
    def expression_host(tree: cutlass.Constexpr, sc: cute.Tensor, ints: cute.Tensor, out: cute.Tensor, n: Int32):
        for i in cutlass.range(n, unroll=1):
            env = {"score": sc[i], "b": ints[i, 0], "h": ints[i, 1], "q_idx": ints[i, 2], "kv_idx": ints[i, 3],
                   "seqlen_q": ints[i, 4], "seqlen_k": ints[i, 5]}
            out[i] = Float32(CuteLowering(env).emit(tree))

    @cute.jit
    def _accumulate_pv(o, p, V, key0: cutlass.Constexpr, rows: cutlass.Constexpr, tile_n: cutlass.Constexpr,
                       dv: cutlass.Constexpr):
        """O += P V over one key tile (the harness's stand-in for the PV wgmma, in fp32)."""
        for r in cutlass.range(rows, unroll=1):
            for d in cutlass.range_constexpr(dv):
                acc = o[r, d]
                for c in cutlass.range_constexpr(tile_n):
                    acc = acc + p[r, c] * V[key0 + c, d]
                o[r, d] = acc

    @cute.jit
    def tiles_host(S: cute.Tensor, V: cute.Tensor, out: cute.Tensor, lse: cute.Tensor, scale: Float32,
                   seqlen_q: Int32, seqlen_k: Int32, score_mod: cutlass.Constexpr, mask_mod: cutlass.Constexpr,
                   rows: cutlass.Constexpr, tile_n: cutlass.Constexpr, n_tiles: cutlass.Constexpr,
                   dv: cutlass.Constexpr, head: cutlass.Constexpr):
        s = cute.make_rmem_tensor((rows, tile_n), Float32)
        p_prev = cute.make_rmem_tensor((rows, tile_n), Float32)
        o = cute.make_rmem_tensor((rows, dv), Float32)
        row_max = cute.make_rmem_tensor(rows, Float32)
        row_sum = cute.make_rmem_tensor(rows, Float32)
        correction = cute.make_rmem_tensor(rows, Float32)
        inv = cute.make_rmem_tensor(rows, Float32)
        l_out = cute.make_rmem_tensor(rows, Float32)
        o.fill(0.0)
        row_max.fill(-Float32.inf)
        row_sum.fill(0.0)
        coords = cute.make_identity_tensor((rows, tile_n))
        ctx = sm.TileContext(score_mod, mask_mod, Int32(0), Int32(head), seqlen_q, seqlen_k)
        # the kernel's order: tile t's softmax, then (while its P V would run) O += P_{t-1} V_{t-1}, then O rescaled
        for t in cutlass.range_constexpr(n_tiles):
            for r in cutlass.range(rows, unroll=1):
                for c in cutlass.range_constexpr(tile_n):
                    s[r, c] = S[r, t * tile_n + c]
            sm.to_log2_units(s, coords, Int32(0), Int32(t * tile_n), scale, ctx)
            sm.mask(s, coords, Int32(0), Int32(t * tile_n), seqlen_k, ctx)
            sm.online_softmax(s, row_max, row_sum, correction, sm.same)
            if cutlass.const_expr(t > 0):
                _accumulate_pv(o, p_prev, V, (t - 1) * tile_n, rows, tile_n, dv)
            sm.rescale(o, correction)
            for r in cutlass.range(rows, unroll=1):
                for c in cutlass.range_constexpr(tile_n):
                    p_prev[r, c] = s[r, c]
        _accumulate_pv(o, p_prev, V, (n_tiles - 1) * tile_n, rows, tile_n, dv)
        sm.finish(row_max, row_sum, inv, l_out, sm.same)
        for r in cutlass.range(rows, unroll=1):
            lse[r] = l_out[r]
            for d in cutlass.range_constexpr(dv):
                out[r, d] = o[r, d] * inv[r]

    @cute.jit
    def key_tiles_host(kernel: cutlass.Constexpr, m_block: Int32, seqlen_q: Int32, seqlen_k: Int32, tile: Int32,
                       out: cute.Tensor):
        start, count = kernel.key_tiles(m_block, seqlen_q, seqlen_k)
        out[0] = start
        out[1] = count
        out[2] = Int32(kernel.needs_mask(tile, m_block, seqlen_q, seqlen_k))

    @cute.jit
    def probe_fragments(tile_n: cutlass.Constexpr, found: cutlass.Constexpr):
        qk, pv = make_tiled_mmas(cutlass.BFloat16, 128, tile_n, 128)
        _record_fragments(qk, pv, tile_n, found)

    return expression_host, tiles_host, probe_fragments, key_tiles_host


try:
    _expression_host, _tiles_host, _probe_fragments, _key_tiles_host = _define_host_functions()
except ImportError:          # no CuTe DSL: the module fixture skips (or fails under CI) with the reason
    pass


# -- supports: what the kernel computes, and why not the rest ---------------------------------------------------------

@pytest.mark.parametrize("op", [attn(), attn(64, DType.float16), attn(96), attn(256, DType.float16),
                                attn(mask_mod=causal_mask(), return_lse=True),
                                attn(Hq=32, Hkv=1, mask_mod=window_mask(64, 0)),
                                attn(score_mod=softcap_score(30.0), mask_mod=prefix_lm_mask(16)),
                                attn(score_mod=alibi_score(alibi_slopes(8)), Sq=1, Sk=4096)])
def test_serves_dense_half_precision_with_any_expression(backend, op):
    assert backend.supports(op, H200).ok


@pytest.mark.parametrize("op,why", [
    (attn(dtype=DType.float32), "float16 or bfloat16"),
    (attn(80), "one of 32, 64, 96, 128, 256"),
    (attn(128, head_dim_v=64), "head_dim must equal head_dim_v"),
    (attn(kv_layout=KVLayout.PAGED, page_size=16, num_pages=64), "paged KV"),
    (attn(has_seqlens_k=True), "seqlens_k"),
    (attn(mask_mod=(kv_idx <= 2 ** 40)), "does not fit the Int32"),
])
def test_refusals_say_why(backend, op, why):
    s = backend.supports(op, H200)
    assert not s.ok and why in s.reason and "backend='triton'" in s.reason


def test_blackwell_and_older_gpus_are_refused_with_the_reason(backend):
    # a real Blackwell GPU: the sm_100a kernel is compiled, not run (test_cuda_cute_attention_sm100.py lowers it)
    assert "compiled but has not run on a Blackwell GPU" in backend.supports(attn(), B200).reason
    assert "needs a Hopper GPU" in backend.supports(attn(), A100).reason
    rtx = Device("cuda", 0, arch="sm_120", name="RTX 5090 (test)", capability=(12, 0), warp_size=32)
    assert "needs a Hopper GPU" in backend.supports(attn(), rtx).reason
    from portakern.backends.cuda import attention

    for target in ("sm_80", "sm_120"):
        with pytest.raises(NotImplementedError, match=f"lowers for sm_90a, sm_100a only, not {target}"):
            attention.compile_for_target(attn(), target)


def test_dispatch_never_ranks_it_above_triton(backend):
    import portakern.backends.cuda as plugin
    from portakern.backends.cuda import tuning

    assert tuning.ATTENTION_TABLE == {}
    assert plugin.portakern_backend_priority(backend=backend, op=attn(), device=H200) is None
    assert backend.priority < 100          # triton's


# -- the expression lowering, run on the CPU through CuTe DSL ----------------------------------------------------------

EXPRS = [causal_mask(), window_mask(8, 3), prefix_lm_mask(7), document_mask((13, 29)), softcap_score(5.0),
         alibi_score(alibi_slopes(4)), where(h.eq(1), score * 2, score - 1), (q_idx / 3 > kv_idx) | ~b.eq(2),
         abs(q_idx - kv_idx) + 0.5 * score, (kv_idx - q_idx) * 1.5 <= score]


@pytest.mark.parametrize("tree", EXPRS, ids=lambda t: str(t)[:40])
def test_expression_lowering_matches_the_reference_evaluator(tree):
    rng = np.random.default_rng(7)
    n = 96
    sc = (rng.normal(size=n) * 4).astype(np.float32)
    ints = np.stack([rng.integers(0, 3, n), rng.integers(0, 4, n), rng.integers(0, 50, n), rng.integers(0, 60, n),
                     np.full(n, 40), np.full(n, 55)], 1).astype(np.int32)
    got = run_expression(tree, sc, ints)
    env = {"score": sc.astype(np.float64), **{k: ints[:, i].astype(np.int64) for i, k in
                                              enumerate(("b", "h", "q_idx", "kv_idx", "seqlen_q", "seqlen_k"))}}
    want = np.asarray(evaluate(tree, env), dtype=np.float64)
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6)


def test_every_conformance_expression_lowers_to_the_reference_values():
    """Every distinct score_mod / mask_mod of the conformance suite's attention cases (both tiers), lowered to CuTe
    DSL and run on the CPU, equals the IR's evaluator on a grid of (b, h, q_idx, kv_idx) and scores."""
    from conformance.cases import all_cases
    from conformance.execute import static_op

    trees = {e for tier in ("cpu", "gpu") for c in all_cases(tier) if c.kind == "attention"
             for e in (static_op(c).score_mod, static_op(c).mask_mod) if e is not None}
    assert len(trees) >= 10
    rng = np.random.default_rng(11)
    n = 256
    sc = (rng.normal(size=n) * 6).astype(np.float32)
    ints = np.stack([rng.integers(0, 4, n), rng.integers(0, 8, n), rng.integers(0, 300, n), rng.integers(0, 600, n),
                     rng.integers(200, 300, n), rng.integers(300, 600, n)], 1).astype(np.int32)
    env = {"score": sc.astype(np.float64), **{k: ints[:, i].astype(np.int64) for i, k in
                                              enumerate(("b", "h", "q_idx", "kv_idx", "seqlen_q", "seqlen_k"))}}
    for tree in sorted(trees, key=str):
        want = np.asarray(evaluate(tree, env), dtype=np.float64)
        np.testing.assert_allclose(run_expression(tree, sc, ints), want, rtol=2e-6, atol=2e-5, err_msg=str(tree))


def test_band_reads_the_library_masks():
    from portakern.backends.cuda.expr_cute import Band, band

    assert band(None) == Band(None, None, True)
    assert band(causal_mask()) == Band(None, 0, True)
    assert band(window_mask(48, 16)) == Band(48, 16, True)
    assert band(window_mask(48, -1)) == Band(48, None, True)
    assert band(prefix_lm_mask(8)) == Band(None, None, False)              # an OR: no band
    assert band(causal_mask() & (kv_idx > 3)) == Band(None, 0, False)      # a band plus another term


# -- the kernel's per-tile math, run on the CPU ------------------------------------------------------------------------

@pytest.mark.parametrize("score_mod,mask_mod,Sq,Sk,scale,nonfinite", [
    (None, None, 12, 40, 0.3, False), (None, causal_mask(), 12, 40, 0.3, False),
    (None, causal_mask(), 40, 12, 0.3, False), (softcap_score(2.0), window_mask(5, 2), 20, 37, 0.5, False),
    (None, prefix_lm_mask(3), 16, 16, -0.4, False), (alibi_score(alibi_slopes(2)), document_mask((5, 9)), 16, 30,
                                                      0.25, False),
    (None, causal_mask(), 20, 30, 0.3, True), (softcap_score(2.0), causal_mask(), 20, 30, 0.3, True)])
def test_online_softmax_over_key_tiles_matches_numpy(score_mod, mask_mod, Sq, Sk, scale, nonfinite):
    """Rows of S split into key tiles of 8, through the kernel's own to_log2_units / mask / online_softmax /
    finish, P V accumulated in the harness; against float64 softmax(mask(score_mod(scale S))) V and its LSE.
    Rows with no visible key (causal with Sq > Sk) must give zeros and -inf. ``nonfinite`` (docs/ir.md, "Non-finite
    values"): a NaN row (NaN q), a NaN key seen by the later rows only (NaN k under the causal mask), a +inf score
    (the row NaN; softcap makes it finite) and a row of -inf scores (no visible key: zeros and -inf)."""
    rng = np.random.default_rng(3)
    S = rng.normal(size=(Sq, Sk)).astype(np.float32) * 3
    if nonfinite:
        S[2] = np.nan
        S[:, 25] = np.nan            # key 25: visible to rows i >= 15 (causal, Sk - Sq = 10)
        S[5, 3] = np.inf
        S[7] = -np.inf
    V = rng.normal(size=(Sk, 4)).astype(np.float32)
    out, lse = run_tiles(S, V, scale, score_mod, mask_mod, head=1, tile_n=8)

    qi, kj = np.arange(Sq)[:, None], np.arange(Sk)[None, :]
    env = {"score": scale * S.astype(np.float64), "b": 0, "h": 1, "q_idx": qi, "kv_idx": kj, "seqlen_q": Sq,
           "seqlen_k": Sk}
    t = evaluate(score_mod, env) if score_mod is not None else env["score"]
    keep = np.broadcast_to(evaluate(mask_mod, env) if mask_mod is not None else True, (Sq, Sk))
    t = np.where(keep, t, -np.inf)
    with np.errstate(invalid="ignore"):
        m = t.max(1, keepdims=True)
        seen = m[:, 0] != -np.inf
        p = np.exp(t - np.where(seen[:, None], m, 0))
        l = p.sum(1, keepdims=True)
        want = np.where(seen[:, None], (p @ V) / np.where(seen[:, None], l, 1), 0)
        want_lse = np.where(seen, m[:, 0] + np.log(np.where(seen, l[:, 0], 1)), -np.inf)
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-5)          # NaN where want is NaN, nowhere else
    np.testing.assert_allclose(lse, want_lse, rtol=1e-5, atol=1e-5)
    if nonfinite:
        assert np.isnan(lse[2]) and np.isnan(out[15:]).all() and np.isfinite(out[8:15]).all()
        if score_mod is None:
            assert np.isnan(lse[5]) and lse[7] == -np.inf and (out[7] == 0).all()
        else:                        # softcap maps +-inf to +-c: those rows are finite
            assert np.isfinite(lse[5]) and np.isfinite(lse[7])
    if Sq > Sk and mask_mod == causal_mask():
        assert not seen.all() and np.all(out[~seen] == 0) and np.all(lse[~seen] == -np.inf)


@pytest.mark.parametrize("mask_mod", [None, causal_mask(), window_mask(100, 0), window_mask(5, 40),
                                      window_mask(-1, 3), window_mask(3, -1), prefix_lm_mask(9)],
                         ids=lambda m: str(m)[:30])
def test_key_tiles_and_mask_skipping_never_drop_a_visible_key(mask_mod):
    """The kernel's own ``key_tiles`` / ``needs_mask``, run on the CPU over query tiles of many (Sq, Sk): every key
    tile holding a key some row of the query tile sees lies in the visited range, and a tile the kernel leaves
    unmasked holds only visible, existing keys (against the IR's evaluator of the mask, tile by tile)."""
    import cutlass
    from cutlass.cute.runtime import from_dlpack

    BM, BN = 128, 64
    rows, want = [], []
    pairs = [(1, 1), (1, 700), (239, 1), (130, 500), (500, 130), (257, 1000)]
    # Sk - Sq such that each band edge of these masks falls on a tile edge (right: 62 - r mod 64, left: 2 + l)
    pairs += [(300, 300 + d) for d in (-66, -2, -1, 0, 1, 4, 5, 6, 7, 22, 23, 38, 39, 61, 62, 63, 64, 65)]
    for Sq, Sk in pairs:
        qi = np.arange(Sq)[:, None]
        kj = np.arange(Sk)[None, :]
        env = {"b": 0, "h": 0, "q_idx": qi, "kv_idx": kj, "seqlen_q": Sq, "seqlen_k": Sk}
        keep = np.broadcast_to(evaluate(mask_mod, env) if mask_mod is not None else True, (Sq, Sk))
        for m in range(-(-Sq // BM)):
            block = keep[m * BM:(m + 1) * BM]
            for n in range(-(-Sk // BN) + 1):
                rows.append((m, Sq, Sk, n))
                tile = block[:, n * BN:(n + 1) * BN]
                full = tile.shape[1] == BN and bool(tile.all())      # rows past Sq are never written
                want.append((bool(tile.any()), full))
    from portakern.backends.cuda.kernels.attn_fwd_sm90 import AttnFwdSm90

    kernel = AttnFwdSm90(cutlass.BFloat16, 64, None, mask_mod, False, tile_n=BN)
    out = np.zeros((len(rows), 3), np.int32)
    for row, res in zip(rows, out):
        _key_tiles_host(kernel, *(cutlass.Int32(x) for x in row), from_dlpack(res))
    for (m, Sq, Sk, n), (start, count, masked), (any_visible, all_visible) in zip(rows, out, want):
        visited = start <= n < start + count
        assert visited or not any_visible, f"m_block {m}, Sq {Sq}, Sk {Sk}: tile {n} holds a visible key, skipped"
        assert not visited or masked or all_visible, f"m_block {m}, Sq {Sq}, Sk {Sk}: tile {n} left unmasked"


# -- the fragments between the two wgmmas ---------------------------------------------------------------------------

@pytest.mark.parametrize("tile_n", [128, 64])
def test_p_fragment_feeds_the_pv_wgmma_the_same_elements(tile_n):
    """For every lane of the first warp and a sample of the other warps of both consumer warpgroups: S's accumulator
    read as the A operand of O += P V holds, element for element, the (row, key) the PV wgmma's A partition expects;
    each thread's rows are those of its quad (lane // 4) and no other quad's; the first warp's lanes cover its 16
    rows x ``tile_n`` keys once. (The A partition depends on the 128 x ``tile_n`` P tile only, not on the head dim;
    reading coordinates at trace time costs ~0.3 s a thread, hence the sample.)"""
    threads = list(range(32)) + [37, 70, 103, 127, 128, 161, 194, 227, 255]
    maps = fragment_maps(tile_n, threads)
    seen = np.zeros((128, tile_n), np.int32)
    for t, (a_view, a_part, rows, cols) in maps.items():
        assert a_view == a_part, f"thread {t}: P's register order differs from the wgmma A operand's"
        warp, lane = divmod(t, 32)
        assert sorted(set(rows)) == [16 * warp + lane // 4, 16 * warp + lane // 4 + 8]
        assert {c % 8 for c in cols} == {2 * (lane % 4), 2 * (lane % 4) + 1}
        for r, c in a_view:
            seen[r, c] += 1
    assert (seen[:16] == 1).all() and seen.max() == 1


# -- lowering for sm_90a: wgmma, TMA, setmaxnreg, no spill ------------------------------------------------------------

@pytest.mark.parametrize("op", [attn(mask_mod=causal_mask(), return_lse=True), attn(64, DType.float16),
                                attn(score_mod=softcap_score(30.0), mask_mod=window_mask(128, 0)),
                                attn(256, DType.float16, mask_mod=causal_mask()),
                                attn(mask_mod=document_mask((259, 518)))],
                         ids=["bf16-d128-causal-lse", "fp16-d64", "bf16-d128-softcap-window", "fp16-d256-causal",
                              "bf16-d128-docmask"])
def test_lowers_for_sm90a_with_wgmma_and_tma(backend, op):
    art = backend.compile_for_target(op, "sm_90a")
    ptx = art["ptx"]
    t = "bf16" if op.dtype is DType.bfloat16 else "f16"
    assert ".target sm_90a" in ptx
    # S = Q K^T: D/16 k-steps of m64nBNk16, both operands in shared memory; O += P V: BN/16 k-steps of m64nDk16
    # with P from registers (the A operand a brace list of 4 registers); the loop overlaps S_i with P_{i-1} V_{i-1}
    from portakern.backends.cuda.attention import TILE_N

    D, BN = op.head_dim, TILE_N[op.head_dim]
    qk = ptx.count(f"wgmma.mma_async.sync.aligned.m64n{BN}k16.f32.{t}.{t}")
    pv_rs = len(re.findall(rf"wgmma\.mma_async\.sync\.aligned\.m64n{D}k16\.f32\.{t}\.{t} \{{[^}}]*\}}, "
                           r"\{%r\d+, %r\d+, %r\d+, %r\d+\}", ptx))
    # with the overlap each GEMM appears twice (the first tile's S and the last tile's P V outside the overlapped
    # loop, both inside it) and the loop waits for S alone (wait_group 1); without it (a specialisation whose
    # overlapped lowering spilled) once each
    times = 2 if art["overlap"] else 1
    assert pv_rs == times * (BN // 16) and ptx.count("wgmma.mma_async") == times * (D // 16 + BN // 16)
    assert qk >= times * (D // 16)
    assert bool(re.search(r"wgmma\.wait_group\.sync\.aligned\s+1;", ptx)) == art["overlap"]
    assert "cp.async.bulk.tensor" in ptx and "setmaxnreg.inc" in ptx and "setmaxnreg.dec" in ptx
    # the consumers' ping-pong: named barriers of 256 threads (both consumer warpgroups), waited on and arrived at
    assert re.search(r"bar\.sync\s+%r\d+, 256;", ptx) and re.search(r"bar\.arrive %r\d+, 256;", ptx)
    assert art["frame_bytes"] == 0 and art["registers"] <= 168
    assert art["cubin"][:4] == b"\x7fELF"


def test_the_gpu_launcher_compiles_on_its_own_arguments():
    """The run path (``attention.compile``) builds its DSL arguments from torch tensors (dynamic-layout
    ``from_dlpack`` views, the scale, a stream) and compiles the kernel on them for sm_90a: traced and compiled here
    from CPU tensors of the same layout. Launching needs the GPU: the GPU conformance run checks that."""
    import cuda.bindings.driver as cuda
    import torch

    from portakern.backends.cuda import attention

    op = attn(64, DType.float16, mask_mod=causal_mask(), return_lse=True)
    q = torch.zeros(2, 300, 8, 64, dtype=torch.float16)
    k = torch.zeros(2, 500, 2, 64, dtype=torch.float16)
    args = attention.call_args(q, k, k.clone(), torch.empty_like(q), torch.empty(2, 8, 300), op.scale,
                               cuda.CUstream(0))
    fn = attention._device_kernel(attention.spec(op), args)
    assert fn is attention._device_kernel(attention.spec(op), args)        # compiled once per specialisation
    assert fn.kernel_info, "the launcher holds no kernel"


def test_without_the_overlap_the_kernel_runs_one_tile_at_a_time():
    """The fallback a spilling specialisation gets (``attention._build``): each GEMM once, every group waited on in
    full (no ``wgmma.wait_group 1``), no spill."""
    from portakern.backends.cuda import attention
    from portakern.backends.cuda.common import cute_dsl

    s = attention.spec(attn(mask_mod=causal_mask(), return_lse=True))
    low, _ = cute_dsl.lower(attention._kernel(s, overlap=False), attention._host_args(s, 2, 1), "sm_90a")
    assert low.count(r"wgmma\.mma_async") == 128 // 16 + 128 // 16 and low.frame_bytes == 0
    assert not re.search(r"wgmma\.wait_group\.sync\.aligned\s+1;", low.ptx)
