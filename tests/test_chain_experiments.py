"""The GEMV-chain experiments (``benchmarks/experiments/chain_kernels.py``, ``gemv_chain.py``, ``layer_chain.py``) off
the GPU: the completion count the phases wait on, the grid that must fit at once, and the sm_90a lowering of both
kernels. Their values are checked on the GPU (``gemv_chain.py --phase check``, ``decode_step.py --chain``)."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from test_triton_attention import parent_only  # noqa: E402  (tests/ is on sys.path)

#: (N, K) of the decode step's chain phases and the lm head
STEP_SHAPES = [(4096, 4096), (28672, 4096), (4096, 14336), (6144, 4096), (128256, 4096)]


def _finished_tiles(N: int, K: int, P: int, BN: int = 256) -> tuple[list[int], int]:
    """A model of one phase's programs (the stream kernel's segments, as ``chain_kernels._phase`` walks them),
    written from the kernel's rules: a segment is a program's units of one column tile; one that covers its tile
    stores it, any other publishes and arrives, and the arrival that finds ``c_last - c_first`` earlier ones
    (``_arrive_sum``'s count of the programs whose ranges meet the tile) finishes the tile. Returns how often each
    tile is finished, and the fewest units any program owns."""
    G = K // 128
    tiles = -(-N // BN)
    T = tiles * G
    arrivals = [0] * tiles
    finished = [0] * tiles
    fewest = T
    for pid in range(P):
        u0 = (pid * T) // P
        n = ((pid + 1) * T) // P - u0
        fewest = min(fewest, n)
        seg_start = u0
        for u in range(u0, u0 + n):
            t, g = divmod(u, G)
            if g == G - 1 or u == u0 + n - 1:
                if seg_start == t * G and u + 1 == (t + 1) * G:
                    finished[t] += 1
                else:
                    arrivals[t] += 1
                seg_start = u + 1
    for t in range(tiles):
        c_first = ((t * G + 1) * P - 1) // T
        c_last = ((t + 1) * G * P - 1) // T
        if arrivals[t]:
            # the last arrival sees arrivals - 1 earlier ones: it finishes iff that is c_last - c_first
            finished[t] += int(arrivals[t] - 1 == c_last - c_first)
    return finished, fewest


@pytest.mark.parametrize("N,K", STEP_SHAPES)
@pytest.mark.parametrize("P", [1, 7, 131, 132, 264, 512])
def test_every_tile_of_a_phase_is_finished_exactly_once(N, K, P):
    """The next phase waits for the phase's count of finished tiles to reach its tile count: each tile must be
    finished once (never twice, never not at all), for every grid the chain may use (capped at the units)."""
    units = -(-N // 256) * (K // 128)
    P = min(P, units)
    finished, fewest = _finished_tiles(N, K, P)
    assert finished == [1] * len(finished)
    assert fewest >= 1          # every program owns a unit of every phase: the chain's buffer reuse relies on it


def test_the_grid_is_capped_at_the_smallest_phase():
    """``LayerChain``'s grid: two programs per SM unless a phase has fewer units (then one per unit)."""
    from experiments.layer_chain import BN

    units = min(-(-N // BN) * (K // 128) for N, K in STEP_SHAPES)
    assert units == 512 and min(2 * 132, units) == 264


def _compiled(n_regs: int, shared: int):
    return SimpleNamespace(n_regs=n_regs, metadata=SimpleNamespace(shared=shared))


@pytest.mark.parametrize("regs,shared,fit", [(128, 13312, 2), (196, 13312, 1), (110, 22528, 2), (64, 13312, 4),
                                             (32, 13312, 8), (64, 120 * 1024, 1),
                                             (84, 13312, 2)])   # 84 registers take 88 a thread: 3 x 22528 > 64K
def test_resident_per_sm_counts_registers_shared_memory_and_warps(regs, shared, fit):
    """Programs of 8 warps that fit on an H100/H200 SM at once: 64K registers (allocated per warp in 256s), 228
    KiB of shared memory (1 KiB reserved per block), 64 warps."""
    from experiments.gemv_chain import resident_per_sm

    assert resident_per_sm(_compiled(regs, shared)) == fit


def test_layer_constexprs_follow_the_stream_kernel_per_phase():
    """Each phase's groups and x slots are the stream kernel's for its shape and the grid; the norm sums one
    square per column tile of the hidden size; phase 3 is RoPE (qkv) or a plain store (lm head)."""
    from experiments.chain_kernels import EPI_ROPE, EPI_STORE
    from experiments.layer_chain import EPS, constexprs

    from portakern.backends.triton.gemv_stream import x_slots

    for shapes, epi in ((STEP_SHAPES[:4], EPI_ROPE), (STEP_SHAPES[:3] + STEP_SHAPES[4:], EPI_STORE)):
        c = constexprs(shapes, 264, 1, 0, epi)
        for j, (N, K) in enumerate(shapes):
            assert (c[f"G{j}"], (c[f"XS{j}"], c[f"BY{j}"])) == (K // 128, x_slots(K // 128, -(-N // 256) * (K // 128),
                                                                                    264))
        assert c["NSS"] == 16 and c["EPS"] == EPS and c["EPI3"] == epi and c["BN"] == 256
    assert constexprs(STEP_SHAPES[:3] + STEP_SHAPES[4:], 264, 1, 0, EPI_STORE)["BY3"] is False   # lm: 61 units


@parent_only
@pytest.mark.parametrize("which", ["gemv-chain", "layer-qkv", "layer-lm"])
def test_chain_kernels_lower_for_sm90a_with_two_programs_per_sm(which):
    """Both kernels, specialised as a launch would (aligned pointers, strides divisible by 16), lower for sm_90a
    at 8 warps within 128 registers and no spills at one unit ahead (two programs per SM: the grid must be
    resident at once), with 16-byte word loads, the PDL wait of phase 0 only, the acquire spin of the others,
    finished tiles counted with release, and x read past L1 (``ld.global.cg``)."""
    import re

    from experiments import chain_kernels as CK
    from experiments.chain_lowering import lower_sm90, ptxas_registers, step_ints
    from experiments.layer_chain import constexprs

    if which == "gemv-chain":
        kernel, shapes, epi, ints = CK.gemv_chain_kernel, STEP_SHAPES[:4], CK.EPI_STORE, step_ints(STEP_SHAPES[:4], 32)
    else:
        kernel = CK.layer_chain_kernel
        shapes = STEP_SHAPES[:4] if which == "layer-qkv" else STEP_SHAPES[:3] + STEP_SHAPES[4:]
        epi = CK.EPI_ROPE if which == "layer-qkv" else CK.EPI_STORE
        ints = step_ints(shapes)
    ck = lower_sm90(kernel, constexprs(shapes, 264, 1, 0, epi), ints, maxnreg=128)
    ptx = ck.asm["ptx"]
    regs, spilled = ptxas_registers(ptx)
    assert regs is not None and regs <= 128 and spilled == 0, (regs, spilled)
    assert len(re.findall(r"ld\.global(\.\w+)*\.v4\.b32", ptx)) >= 4 * 16     # the words, 16 bytes a load
    assert ptx.count("griddepcontrol.wait") == 1
    assert re.search(r"(ld|atom)\.global\.gpu\.acquire", ptx)               # the spin on the previous phase
    assert re.search(r"(red|atom)\.global\.gpu\.release\.add", ptx)         # a finished tile counted
    assert "ld.global.cg" in ptx and ".reqntid 256" in ptx
    assert ck.metadata.shared <= 99 * 1024
    # the point of the chain: each phase's first unit of words (four 16-byte loads a thread) is requested before
    # the phase waits -- for the kernel before (PDL) or for the previous phase (the acquire spin) -- and after the
    # previous phase's last tile count
    events = []
    for line in ptx.splitlines():
        kind = ("wait" if "griddepcontrol.wait" in line or "gpu.acquire" in line else
                "count" if "gpu.release.add" in line else
                "words" if re.search(r"ld\.global(\.\w+)*\.v4\.b32", line) else None)
        if kind and events and events[-1][0] == kind:
            events[-1][1] += 1
        elif kind:
            events.append([kind, 1])
    waits = [i for i, (kind, _) in enumerate(events) if kind == "wait"]
    assert len(waits) == 4                        # one per phase (the pure chain's loop holds the four once)
    for i in waits:
        assert events[i - 1] == ["words", 4] and (i == 1 or events[i - 2][0] == "count"), events


@pytest.mark.parametrize("spec,want", [("1,2,0", (1, 2, 0, "gemv")), ("2,1,8", (2, 1, 8, "gemv")),
                                       ("1,2,0,attn", (1, 2, 0, "attn")), ("1,1,0,step", (1, 1, 0, "step")),
                                       ("1,3,0", None), ("0,2,0", None), ("1,2", None), ("1,2,x", None),
                                       ("1,2,9", None), ("1,2,0,at", None), ("1,2,0,attn,x", None)])
def test_chain_option_takes_three_small_numbers_and_says_which(spec, want):
    """``decode_step.py --chain``: a bad configuration is refused by the parser, naming the rule and an example."""
    import argparse

    from step_variants import chain_spec

    if want is not None:
        assert chain_spec(spec) == want
    else:
        with pytest.raises(argparse.ArgumentTypeError, match=r"AHEAD,PER_SM,L2_AHEAD\[,attn\|,step\] with AHEAD 1 or "
                                                             r"2, PER_SM 1 or 2 and L2_AHEAD 0 to 8") as e:
            chain_spec(spec)
        assert repr(spec) in str(e.value)


# -- the host sides' launches, argument by argument (a fake kernel records them; CPU tensors) --------------------

class _FakeKernel:
    """Stands for a Gluon kernel: its real parameter names, a ``warmup`` giving a compiled kernel of ``n_regs``
    registers, and launches that record ``(grid, args, kwargs)``."""

    def __init__(self, real, n_regs: int = 106, shared: int = 13312):
        self.arg_names, self.launches = real.arg_names, []
        self.compiled = SimpleNamespace(n_regs=n_regs, metadata=SimpleNamespace(shared=shared),
                                        _init_handles=lambda: None)

    def warmup(self, *args, grid, **kwargs):
        return self.compiled

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((grid, args, kwargs))


def _bound(kernel: _FakeKernel, launch: int = -1) -> tuple[dict, dict, tuple]:
    """The recorded launch's runtime arguments by parameter name, its keyword arguments, its grid."""
    grid, args, kwargs = kernel.launches[launch]
    names = [n for n in kernel.arg_names if n not in kwargs]
    assert len(names) == len(args), (names, len(args))
    return dict(zip(names, args)), kwargs, grid


def _fake_step(layers: int = 2):
    import torch

    def w(N, K):
        npad = -(-N // 128) * 128
        t = torch.empty(1, npad)
        return SimpleNamespace(qweight=torch.empty(1, npad, dtype=torch.int32), scales=t.half(), zeros=t.half() + 1,
                               N=N, K=K, stride_qk=npad)
    return SimpleNamespace(
        layers=[{"qkv": w(6144, 4096), "o": w(4096, 4096), "gu": w(28672, 4096), "down": w(4096, 14336)}
                for _ in range(layers)],
        lm=w(128256, 4096), norms=[torch.empty(4096, dtype=torch.bfloat16) for _ in range(2 * layers + 1)],
        kv=[torch.zeros(2, 3, 64, 8, 128, dtype=torch.bfloat16) for _ in range(layers)], slot=torch.tensor([70]),
        cos=torch.empty(64), sin=torch.empty(64), h=torch.empty(1, 4096),
        block_table=torch.tensor([[2, 0, 1]], dtype=torch.int32), seqlens=torch.tensor([130], dtype=torch.int32))


def test_layer_chain_launch_passes_each_tensor_and_size_to_its_parameter(monkeypatch):
    """``LayerChain.layer``: layer i's o / gate-up / down weights and the next layer's qkv (or, after the last
    layer, the lm head), the norms 2i+1 and 2i+2, the next layer's cache rows at the step's slot, every buffer and
    size at the parameter of that name; phase 3 RoPE before the last layer, a plain store after it."""
    import torch

    import experiments.layer_chain as LC
    from experiments import chain_kernels as CK

    fake = _FakeKernel(CK.layer_chain_kernel)
    monkeypatch.setattr(LC, "layer_chain_kernel", fake)
    st = _fake_step()
    ch = LC.LayerChain(st, num_sms=132)
    a = torch.empty(1, 4096, dtype=torch.bfloat16)
    for i in range(2):
        ch.layer(i, a)
        rec, kw, grid = _bound(fake)
        last = i == 1
        L = st.layers[i]
        w3 = st.lm if last else st.layers[i + 1]["qkv"]
        assert grid == (264,) and kw["num_warps"] == 8 and kw["launch_pdl"] and kw["maxnreg"] == 128
        assert rec["a_ptr"] is a and rec["gu_ptr"] is ch.gu and rec["o3"] is (ch.logits if last else ch.qkv)
        for j, wj in enumerate((L["o"], L["gu"], L["down"], w3)):
            assert (rec[f"qw{j}"], rec[f"s{j}"], rec[f"z{j}"]) == (wj.qweight, wj.scales, wj.zeros)
            assert (rec[f"N{j}"], rec[f"T{j}"], rec[f"SQ{j}"]) == (wj.N, -(-wj.N // 256), wj.stride_qk)
        assert rec["nw1_ptr"] is st.norms[2 * i + 1] and rec["nw3_ptr"] is st.norms[2 * i + 2]
        kvf = st.kv[min(i + 1, 1)].view(2, -1, 8, 128)
        assert rec["k_ptr"].data_ptr() == kvf[0, 70].data_ptr() and rec["v_ptr"].data_ptr() == kvf[1, 70].data_ptr()
        assert rec["k_ptr"].shape == (8, 128)
        for name, buf in (("r_ptr", ch.r), ("ss_ptr", ch.ss), ("q_ptr", ch.q), ("cos_ptr", st.cos),
                          ("sin_ptr", st.sin), ("ws_ptr", ch.ws), ("cnt_ptr", ch.cnt), ("done_ptr", ch.done),
                          ("exit_ptr", ch.exit), ("err_ptr", ch.err)):
            assert rec[name] is buf, name
        assert kw["EPI3"] == (CK.EPI_STORE if last else CK.EPI_ROPE) and kw["NSS"] == 16
        assert [kw[f"G{j}"] for j in range(4)] == [32, 32, 112, 32]
    assert ch.cnt.numel() == 501 and ch.ws.shape == (528, 256)


def test_layer_chain_refuses_a_grid_that_cannot_be_resident(monkeypatch):
    """Two programs per SM of 196 registers do not fit: the first launch is refused with the way out, before any
    launch (the phase waits would never end)."""
    import torch

    import experiments.layer_chain as LC
    from experiments import chain_kernels as CK

    fake = _FakeKernel(CK.layer_chain_kernel, n_regs=196)
    monkeypatch.setattr(LC, "layer_chain_kernel", fake)
    ch = LC.LayerChain(_fake_step(), num_sms=132)
    with pytest.raises(ValueError, match=r"programs=264: only 132 fit on the GPU at once \(196 registers.*use per_sm=1"):
        ch.layer(0, torch.empty(1, 4096, dtype=torch.bfloat16))
    assert fake.launches == []


def test_gemv_chain_launch_passes_each_phase_its_weights_strides_and_output(monkeypatch):
    """``gemv_chain.Chain``: phase j's stacked weight, scales, zeros and output at ``qwj`` / ``sj`` / ``zj`` / ``oj``,
    its size, tiles, row stride and per-layer strides at ``Nj`` / ``Tj`` / ``SQj`` / ``LWj`` / ``LSj``."""
    import experiments.gemv_chain as GC
    from experiments import chain_kernels as CK

    fake = _FakeKernel(CK.gemv_chain_kernel)
    monkeypatch.setattr(GC, "gemv_chain_kernel", fake)
    w = GC.Weights(1, device="cpu")
    outs = GC._outs("cpu")
    ch = GC.Chain(w, outs, 1, 2, 0, 132)
    ch()
    rec, kw, grid = _bound(fake)
    assert grid == (264,) and rec["layers"] == 1 and kw["maxnreg"] == 128 and kw["AHEAD"] == 1
    for j, (name, N, K) in enumerate(GC.PHASES):
        qw, s, z, _, _ = w.lin[name]
        assert (rec[f"qw{j}"], rec[f"s{j}"], rec[f"z{j}"], rec[f"o{j}"]) == (qw, s, z, outs[j])
        assert (rec[f"N{j}"], rec[f"T{j}"], rec[f"SQ{j}"]) == (N, -(-N // 256), qw.shape[2])
        assert (rec[f"LW{j}"], rec[f"LS{j}"]) == (qw.shape[1] * qw.shape[2], s.shape[1] * s.shape[2])
        assert kw[f"G{j}"] == K // 128


def test_whole_layer_launch_adds_the_attention_inputs_and_constants(monkeypatch):
    """``LayerChain(attention=True)``: the launch attends the chain's q over layer i's own cache (its block table,
    the sequence length, one plane's elements), writes the partials and the attention output to the chain's
    buffers, and carries the GEMV phases' arguments as the chain without attention does; ``layer(i, a)`` with an
    attention output is refused (the launch makes its own)."""
    import torch

    import experiments.layer_chain as LC
    from experiments import chain_kernels as CK

    fake = _FakeKernel(CK.decode_layer_kernel)
    monkeypatch.setattr(LC, "decode_layer_kernel", fake)
    st = _fake_step()
    ch = LC.LayerChain(st, num_sms=132, attention=True)
    assert ch.part.shape == (32, 4, 130) and ch.a.shape == (1, 4096) and ch.done.numel() == 5
    with pytest.raises(ValueError, match=r"attends self\.q itself: call layer\(i\) without a"):
        ch.layer(0, torch.empty(1, 4096, dtype=torch.bfloat16))
    for i in range(2):
        ch.layer(i)
        rec, kw, grid = _bound(fake)
        assert rec["q_ptr"] is ch.q and rec["kv_ptr"] is st.kv[i] and rec["part_ptr"] is ch.part and rec["a_ptr"] is ch.a
        assert rec["bt_ptr"].data_ptr() == st.block_table.data_ptr() and rec["bt_ptr"].shape == (3,)
        assert rec["seqlen"] == 130 and rec["kv_plane"] == 3 * 64 * 8 * 128
        assert (kw["HKV"], kw["QG"], kw["PAGE"], kw["D"], kw["NPMAX"]) == (8, 4, 64, 128, 4)
        assert kw["SM_SCALE"] == pytest.approx(128 ** -0.5)
        L = st.layers[i]
        w3 = st.lm if i == 1 else st.layers[1]["qkv"]
        for j, wj in enumerate((L["o"], L["gu"], L["down"], w3)):
            assert (rec[f"qw{j}"], rec[f"N{j}"], rec[f"SQ{j}"]) == (wj.qweight, wj.N, wj.stride_qk)
        assert rec["nw1_ptr"] is st.norms[2 * i + 1] and rec["nw3_ptr"] is st.norms[2 * i + 2]
        assert rec["o3"] is (ch.logits if i == 1 else ch.qkv) and rec["gu_ptr"] is ch.gu
        for name, buf in (("r_ptr", ch.r), ("ss_ptr", ch.ss), ("cos_ptr", st.cos), ("ws_ptr", ch.ws),
                          ("cnt_ptr", ch.cnt), ("done_ptr", ch.done), ("err_ptr", ch.err)):
            assert rec[name] is buf, name


@parent_only
@pytest.mark.parametrize("ctx", [2048, 8192])
def test_whole_layer_kernel_lowers_attention_first_then_the_chain(ctx):
    """``decode_layer_kernel`` for sm_90a as launched: within 128 registers (Triton 3.6, the device's: no spills;
    3.9 spills a few bytes), the PDL wait first (the attention reads q and the new cache row the previous launch
    wrote), then each GEMV phase requests its first words before spinning on the phase before."""
    import re

    from experiments import chain_kernels as CK
    from experiments.chain_lowering import lower_sm90, ptxas_registers, step_ints
    from experiments.layer_chain import attention_constexprs, attention_ints, constexprs

    consts = {**constexprs(STEP_SHAPES[:4], 264, 1, 0, CK.EPI_ROPE), **attention_constexprs(ctx + 1)}
    ck = lower_sm90(CK.decode_layer_kernel, consts, {**step_ints(STEP_SHAPES[:4]), **attention_ints(ctx + 1)},
                    maxnreg=128)
    ptx = ck.asm["ptx"]
    regs, spilled = ptxas_registers(ptx)
    assert regs is not None and regs <= 128 and spilled is not None and spilled <= 64, (regs, spilled)
    first_wait = ptx.index("griddepcontrol.wait")
    assert ptx.count("griddepcontrol.wait") == 1 and "gpu.acquire" not in ptx[:first_wait]
    assert not re.search(r"ld\.global(\.\w+)*\.v4\.b32", ptx[:first_wait])   # nothing read before the wait
    spins = [m.start() for m in re.finditer(r"gpu\.acquire", ptx)]
    assert len(spins) >= 4
    assert consts["NPMAX"] == (64 if ctx == 2048 else 256)


def test_one_launch_step_binds_stacked_layers_by_stride(monkeypatch):
    """``StepChain.launch``: copies of every layer's weights, norms and caches stacked (same values), each linear's
    per-layer strides, the slot's offset in a cache plane, the five shape sets (o, gate/up, down, qkv, lm head)
    and the attention's constants at the parameters of those names."""
    import torch

    import experiments.step_chain as SC
    from experiments import chain_kernels as CK

    fake = _FakeKernel(CK.decode_step_kernel)
    monkeypatch.setattr(SC, "decode_step_kernel", fake)
    st = _fake_step()
    ch = SC.StepChain(st, num_sms=132)
    assert torch.equal(ch.kv[1], st.kv[1]) and ch.kv.data_ptr() != st.kv[1].data_ptr() and ch.done.numel() == 10
    assert torch.equal(ch.stack["gu"][0][1], st.layers[1]["gu"].qweight)
    ch.launch()
    rec, kw, grid = _bound(fake)
    assert grid == (264,) and kw["maxnreg"] == 128 and (kw["NPMAX"], kw["HKV"], kw["QG"]) == (4, 8, 4)
    for name, buf in (("q_ptr", ch.q), ("kv_ptr", ch.kv), ("part_ptr", ch.part), ("a_ptr", ch.a), ("gu_ptr", ch.gu),
                      ("qkv_ptr", ch.qkv), ("logits_ptr", ch.logits), ("r_ptr", ch.r), ("ss_ptr", ch.ss),
                      ("nw_ptr", ch.norms), ("cos_ptr", st.cos), ("ws_ptr", ch.ws), ("done_ptr", ch.done),
                      ("err_ptr", ch.err), ("qwL", st.lm.qweight), ("sL", st.lm.scales), ("zL", st.lm.zeros)):
        assert rec[name] is buf, name
    for x, n in zip("OGDQ", SC.LINEARS):
        qw, sc, z = ch.stack[n]
        assert (rec[f"qw{x}"], rec[f"s{x}"], rec[f"z{x}"]) == (qw, sc, z)
        assert (rec[f"LW{x}"], rec[f"LS{x}"]) == (qw.stride(0), sc.stride(0))
    assert (rec["layers"], rec["seqlen"], rec["hid"]) == (2, 130, 4096)
    assert (rec["kv_plane"], rec["kv_layer"], rec["slot_off"]) == (3 * 64 * 1024, 2 * 3 * 64 * 1024, 70 * 1024)
    shapes = [(4096, 4096), (28672, 4096), (4096, 14336), (6144, 4096), (128256, 4096)]
    for j, (N, K) in enumerate(shapes):
        assert (rec[f"N{j}"], rec[f"T{j}"], rec[f"SQ{j}"], kw[f"G{j}"]) == (N, -(-N // 256), -(-N // 128) * 128, K // 128)


@parent_only
def test_one_launch_step_lowers_within_the_register_budget():
    """``decode_step_kernel`` for sm_90a as launched (ctx 2048): at most 128 registers (two programs per SM) with at
    most a few hundred bytes spilled (the layer loop keeps every linear's base pointer live), one PDL wait (layer
    0's attention), the phases' acquire spins."""
    from experiments.chain_lowering import ptxas_registers
    from experiments.step_chain import lower_ints, step_constexprs

    from experiments import chain_kernels as CK
    from experiments.chain_lowering import lower_sm90

    shapes = ((4096, 4096), (28672, 4096), (4096, 14336), (6144, 4096), (128256, 4096))
    ck = lower_sm90(CK.decode_step_kernel, step_constexprs(shapes, 264, 1, 0, 2049), lower_ints(shapes, 2048),
                    maxnreg=128)
    ptx = ck.asm["ptx"]
    regs, spilled = ptxas_registers(ptx)
    assert regs is not None and regs <= 128 and spilled is not None and spilled <= 512, (regs, spilled)
    assert ptx.count("griddepcontrol.wait") == 1 and ptx.count("gpu.acquire") >= 5


def test_a_variant_that_cannot_be_built_is_timed_as_its_error():
    """``decode_step.py``: a chain variant whose construction raises (a kernel that does not compile on the device)
    becomes a ``FailedVariant``: timing it raises the original error's name and text, which the run records as that
    variant's error, and the other variants still run."""
    from step_variants import FailedVariant, _built

    assert _built(lambda: "built") == "built"
    failed = _built(lambda: {}["missing"])
    assert isinstance(failed, FailedVariant)
    for attempt in (failed.bytes, failed):
        with pytest.raises(RuntimeError, match=r"could not be built: KeyError: 'missing'"):
            attempt()


def test_reset_counters_zeroes_every_synchronisation_buffer():
    """After a spin error the counters may be left mid-count: ``reset_counters`` zeroes all four (arrival counts,
    phases done, programs left, error flag) before the next launch."""
    from types import SimpleNamespace

    from experiments.gemv_chain import reset_counters

    c = SimpleNamespace(cnt=torch.tensor([3, 0, 7], dtype=torch.int32), done=torch.tensor([16, 5], dtype=torch.int32),
                        exit=torch.tensor([200], dtype=torch.int32), err=torch.tensor([1], dtype=torch.int32))
    reset_counters(c)
    assert all(int(t.abs().sum()) == 0 for t in (c.cnt, c.done, c.exit, c.err))


def test_wait_profile_reads_the_kernels_wrapped_cycle_sums():
    """The kernels add each program's cycles from its first clock read to its leave, and each wait's cycles to its
    kind, into int32 slots after the error flag (``chain_kernels.STAT_KINDS``): sums that wrap. ``wait_profile``
    must read them modulo 2^32, report each kind's share of the programs' cycles after their wait for the previous
    kernel, and that wait apart."""
    from types import SimpleNamespace

    import numpy as np

    from experiments import chain_kernels as CK
    from experiments.gemv_chain import wait_profile

    P, K1 = 3, CK.STAT_KINDS.value + 1
    c = SimpleNamespace(programs=P, cnt=torch.zeros(1, dtype=torch.int32), done=torch.zeros(1, dtype=torch.int32),
                        exit=torch.zeros(1, dtype=torch.int32), err=torch.zeros(1 + K1 * P, dtype=torch.int32))
    spans = [1_500_000_000, 200_000_000, 300_000_000]      # two launches of program 0 pass 2^31: the sum wraps
    pdl = [500_000_000, 0, 100_000_000]
    waits = {1: [100_000_000, 0, 20_000_000], 7: [50_000_000, 50_000_000, 0],
             CK.ATTN_KIND.value: [0, 10_000_000, 0], CK.PDL_KIND.value: pdl}

    def launch():      # what one launch of the kernels adds, with int32 wrap-around
        acc = c.err.numpy().astype(np.int64)
        for p in range(P):
            acc[1 + CK.STAT_KINDS.value * P + p] += spans[p]
            for k, w in waits.items():
                acc[1 + k * P + p] += w[p]
        c.err.copy_(torch.from_numpy(((acc + 2**31) % 2**32 - 2**31).astype(np.int32)))

    prof = wait_profile(c, run=launch, launches=2)
    after = [s - d for s, d in zip(spans, pdl)]          # cycles after the wait for the previous kernel
    total = sum(after)
    assert int(c.err[1 + CK.STAT_KINDS.value * P]) < 0                      # the int32 slot did wrap
    assert prof["cycles_per_call"] == round(total / P) and prof["spin_error"] == 0
    assert prof["wait_o"] == pytest.approx(120e6 / total) and prof["wait_down"] == pytest.approx(100e6 / total)
    assert prof["wait_attention"] == pytest.approx(10e6 / total) and "wait_qkv" not in prof
    assert prof["wait_all"] == pytest.approx(230e6 / total)
    assert prof["wait_previous_kernel"] == pytest.approx(sum(pdl) / sum(spans))
    assert prof["wait_max_program"] == pytest.approx(60e6 / after[1])       # program 1: down + attention


def test_chain_kernels_count_their_waits_in_cycles():
    """The layer kernel as launched reads the SM clock around each wait and adds it, with relaxed atomics, to its
    statistics; the whole-layer kernel still reads nothing before its PDL wait."""
    from experiments import chain_kernels as CK
    from experiments.chain_lowering import lower_sm90, step_ints
    from experiments.layer_chain import attention_constexprs, attention_ints, constexprs

    consts = {**constexprs(STEP_SHAPES[:4], 264, 1, 0, CK.EPI_ROPE), **attention_constexprs(2049)}
    ptx = lower_sm90(CK.decode_layer_kernel, consts, {**step_ints(STEP_SHAPES[:4]), **attention_ints(2049)},
                     maxnreg=128).asm["ptx"]
    import re

    # one clock read at the start and at the leave, two around the PDL wait and around each of the four phase
    # waits; one relaxed add of cycles at the leave and for each of the five waits; no write before the PDL wait
    assert ptx.count("%clock;") == 2 + 2 * 5
    assert len(re.findall(r"(atom|red)\.global\.gpu\.relaxed\.add", ptx)) == 6
    assert not re.search(r"\b(atom|red|st)\.global", ptx[:ptx.index("griddepcontrol.wait")])
