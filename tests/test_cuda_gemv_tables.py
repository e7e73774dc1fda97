"""The cuda backend's GEMV tables as data (``backends/cuda/tuning.py``: ``TABLE`` for the word kernel, ``FRAG_TABLE``
for the fragment kernel) and the priority hook that ranks by them (``backends/cuda/__init__.py``): every entry tied to
the sweep under ``benchmarks/results/`` that measured it, the launch an entry or the rule gives, and which table ranks
an op -- the fragment kernel's for weights held only as fragments (the default layout on CUDA), the word kernel's
for weights that hold words. No GPU."""

from __future__ import annotations

import pytest

from portakern.devices import Device
from portakern.ir import DType

from cuda_helpers import H200, C, backend, gemv  # noqa: F401 (C, backend: fixtures)


# -- the word kernel's table (weights that hold words) -----------------------------------------------------

def test_choose_takes_a_measured_entry_and_the_hook_ranks_only_wins(C, backend, monkeypatch):
    from portakern import gemv_weight
    from portakern.backends import cuda as plugin
    from portakern.backends.cuda import tuning

    # weights that hold words (the word kernel runs them): its table ranks; fragments-only: the section below
    monkeypatch.setattr(gemv_weight, "DEFAULT_LAYOUT", "words+fragments")
    op = gemv(N=4096, K=14336)
    rule = C.choose(op, 132)                                                      # no family: the rule
    monkeypatch.setattr(tuning, "TABLE", {})        # a table of its own: no committed family or card entries
    assert plugin.portakern_backend_priority(backend, op, H200) is None          # unmeasured: the class priority
    monkeypatch.setitem(tuning.TABLE, ("sm_90", 1, 4, 4096, 14336), tuning.GemvEntry(16, 8, 7, 1, 1, False, "t"))
    assert C.choose(op, 132, (9, 0)) == C.SmallMConfig(16, 8, 7, 1, 1) != rule
    assert C.choose(op, 132, (10, 0)) == rule                                     # another family: the rule
    assert plugin.portakern_backend_priority(backend, op, H200) is None          # measured, but not ahead
    monkeypatch.setitem(tuning.TABLE, ("sm_90", 1, 4, 4096, 14336), tuning.GemvEntry(16, 8, 7, 1, 1, True, "t"))
    assert plugin.portakern_backend_priority(backend, op, H200) == plugin.MEASURED_WIN_PRIORITY > 100
    assert plugin.portakern_backend_priority(backend, gemv(N=4096, K=4096), H200) is None


def test_the_committed_table_ranks_cuda_first_only_where_it_measured_ahead(backend, monkeypatch):
    # tuning.py as written from the sweeps (H100 family and card entries, H200 card entries): for weights that hold
    # words, cuda above triton exactly where an entry says it won, never at M = 4 (the triton tensor-core kernel stays
    # ahead there). Fragments-only weights (the default layout) rank by FRAG_TABLE: the section below
    from portakern import gemv_weight
    from portakern.backends import cuda as plugin
    from portakern.backends.cuda.tuning import TABLE

    monkeypatch.setattr(gemv_weight, "DEFAULT_LAYOUT", "words+fragments")
    for (key, M, bits, N, K), entry in TABLE.items():
        op = gemv(M=M, N=N, K=K, bits=bits)
        fam, _, card = key.partition("/")
        dev = Device("cuda", 0, arch=fam, name=f"NVIDIA {card.upper()}" if card else fam,
                     capability=(int(fam[3:-1]), int(fam[-1])), warp_size=32)
        want = plugin.MEASURED_WIN_PRIORITY if entry.beats_triton else None
        assert plugin.portakern_backend_priority(backend, op, dev) == want
        assert not (M > 1 and entry.beats_triton)


def test_every_table_entry_names_the_result_file_that_measured_it():
    # each entry's source is a sweep under benchmarks/results/ of that GPU family (and card, for a card's own entry)
    # whose fastest variant for the problem is the entry's configuration, with the same verdict against triton
    import json
    from pathlib import Path

    from portakern.backends.cuda import quant_gemv
    from portakern.backends.cuda.tuning import TABLE

    results = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
    sweeps: dict = {}
    for (key, M, bits, N, K), entry in TABLE.items():
        path = results / entry.source
        assert path.is_file(), f"{key} {M} {bits} {N} {K}: source {entry.source} is not under benchmarks/results/"
        res = sweeps.setdefault(entry.source, json.loads(path.read_text()))
        fam, _, card = key.partition("/")
        assert "sm_{}{}".format(*res["capability"]) == fam and (not card or quant_gemv.card(res["gpu"]) == card)
        (row,) = [r for r in res["bench"] if (r.get("M", 1), r["bits"], r["N"], r["K"]) == (M, bits, N, K)]
        assert tuple(int(t) for t in row["best"].split(",")) == entry[:5]
        assert (row["best_us"] <= 0.98 * row["table_us"]) == entry.beats_triton


# -- the fragment kernel's table and the launch translation ----------------------------------------------

@pytest.mark.parametrize("word,frag", [
    ((32, 4, 8, 2, 1), (4, 2, 1, 8, 2, 1)),       # the H100's int4 rows: 128 rows, 128 threads, 64 bytes a step
    ((16, 4, 8, 2, 1), (2, 2, 1, 8, 2, 1)),
    ((32, 8, 1, 2, 0), (8, 1, 1, 1, 2, 0)),       # 8 row lanes: one tile per warp, 256 threads
    ((16, 2, 4, 4, 0), (1, 4, 1, 4, 4, 0)),       # 2 row lanes: four tiles per warp, 32 threads
])
def test_frag_config_streams_what_the_word_config_streams(C, word, frag):
    op = gemv(N=8192, K=8192)
    w, f = C.SmallMConfig(*word), C.frag_config(op, C.SmallMConfig(*word))
    assert f == C.FragConfig(*frag)
    assert (f.rows, f.threads, f.splits, f.pf, f.ldna) == (w.columns, w.threads, w.splits, w.pf, w.ldna)
    assert 32 * f.nt == 128 * 4 // 8 // w.lanes * 4     # bytes a thread loads per chunk = per group in the word kernel


def test_choose_frag_follows_the_word_kernels_table(C, monkeypatch):
    from portakern.backends.cuda import tuning

    op = gemv(N=4096, K=14336)
    monkeypatch.setitem(tuning.TABLE, ("sm_90/h200", 1, 4, 4096, 14336), tuning.GemvEntry(16, 8, 7, 1, 1, True, "t"))
    assert C.choose_frag(op, 132, (9, 0), "NVIDIA H200") == C.FragConfig(rw=4, nt=1, kw=1, splits=7, pf=1, ldna=1)
    rule = C.choose_frag(op, 132)
    assert (rule.rows, rule.splits) == (C.choose(op, 132).columns, C.choose(op, 132).splits)


def test_choose_frag_takes_its_own_measured_entry_before_the_translation(C, monkeypatch):
    from portakern.backends.cuda import tuning

    op = gemv(N=4096, K=14336)
    monkeypatch.setitem(tuning.TABLE, ("sm_90/h200", 1, 4, 4096, 14336), tuning.GemvEntry(16, 8, 7, 1, 1, True, "t"))
    monkeypatch.setitem(tuning.FRAG_TABLE, ("sm_90/h200", 1, 4096, 14336), tuning.FragEntry(2, 2, 2, 7, 1, 1, "t"))
    assert C.choose_frag(op, 132, (9, 0), "NVIDIA H200") == C.FragConfig(rw=2, nt=2, kw=2, splits=7, pf=1, ldna=1)
    # the committed H100 entry serves the H100; an unmeasured card of the family falls back to the translation
    assert C.choose_frag(op, 132, (9, 0), "NVIDIA H100 80GB HBM3") == C.FragConfig(2, 2, 2, 8, 2, 1)
    assert C.choose_frag(op, 132, (9, 0), "NVIDIA H20") == C.frag_config(op, C.choose(op, 132, (9, 0), "NVIDIA H20"))
    assert C.frag_table_entry(gemv(N=4096, K=14336, bits=8), (9, 0), "NVIDIA H100") is None   # int4 only


def test_every_frag_table_entry_is_its_sweeps_fastest_variant_and_a_launch_that_does_not_spill(C):
    # tuning is data: each entry names the result file whose sweep timed it fastest, more than 2% ahead of the
    # translated launch, and it is a launch the kernel takes, lowered for sm_90a without spilling
    import json
    from pathlib import Path

    from portakern.backends.cuda.common import nvrtc
    from portakern.backends.cuda.tuning import FRAG_TABLE

    results = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
    assert FRAG_TABLE
    for (key, M, N, K), entry in FRAG_TABLE.items():
        sweep = json.loads((results / entry.source).read_text())
        assert key == "sm_{}{}/h100".format(*sweep["capability"]) and "H100" in sweep["gpu"]
        row = next(r for r in sweep["bench"] if (r["M"], r["N"], r["K"]) == (M, N, K))
        assert tuple(int(v) for v in row["best"].split(",")) == tuple(entry[:6]), (key, M, N, K)
        assert row["best_us"] < 0.98 * row["translated_us"], (key, M, N, K)
        op, f = gemv(M=M, N=N, K=K), C.FragConfig(*entry[:6])
        C._check_frag_config(op, f)
        c = nvrtc.compile_source(C.FRAG_SOURCE, tuple(C.frag_defines(op, f, True, None).items()), "sm_90a")
        assert (c.spill_bytes or 0) == 0 and c.frame_bytes == 0, (key, M, N, K, f)


def _card(name):
    return Device("cuda", 0, arch="sm_90a", name=name, capability=(9, 0), warp_size=32)


def test_the_default_layout_holds_each_code_once():
    from portakern import gemv_weight

    assert gemv_weight.DEFAULT_LAYOUT == "fragments" and gemv_weight.check_layout(None) == "fragments"


def test_the_hook_ranks_fragments_only_ops_by_the_fragment_kernels_table(C, monkeypatch):
    # the hook sees the op, not the weight: with the default layout ("fragments") an int4 g128 weight on a device that
    # builds fragments holds only fragments, so the fragment kernel's measured table ranks cuda, not the word kernel's
    from portakern import gemv_weight
    from portakern.backends import cuda as plugin
    from portakern.backends.cuda.backend import CudaBackend

    monkeypatch.setattr(gemv_weight, "wants_fragments", lambda device: True)   # the device builds fragments
    backend, rank = CudaBackend(), plugin.portakern_backend_priority
    h100, h200 = _card("NVIDIA H100 80GB HBM3"), _card("NVIDIA H200")
    op = gemv(N=4096, K=14336)
    assert C.frag_table_entry(op, (9, 0), h100.name) is not None and C.frag_table_entry(op, (9, 0), h200.name) is None
    assert C.table_entry(op, (9, 0), h200.name).beats_triton                   # the word kernel won there ...
    assert rank(backend, op, h100) == plugin.MEASURED_WIN_PRIORITY
    assert rank(backend, op, h200) is None                                      # ... but fragments-only: unmeasured
    assert rank(backend, gemv(M=2, N=4096, K=14336), h100) is None              # no M = 2 entry: triton's frag kernel
    # fp16 x: triton's fragment kernel is bf16-only, so the cuda fragment kernel ranks first wherever it runs
    fp16 = gemv(N=4096, K=14336, dtype=DType.float16)
    assert rank(backend, fp16, h200) == plugin.FRAGMENT_FP16_PRIORITY > 100
    assert rank(backend, fp16, h100) == plugin.MEASURED_WIN_PRIORITY
    fp16_lost = gemv(N=6144, K=4096, dtype=DType.float16)                      # the word kernel lost there on an H200
    assert rank(backend, fp16_lost, h200) == plugin.FRAGMENT_FP16_PRIORITY
    # formats without a fragment layout keep their words: the word kernel's table (its H100 int8 entry won)
    int8 = gemv(N=8192, K=8192, bits=8)
    assert C.frag_refusal(int8) is not None and C.table_entry(int8, (9, 0), h100.name).beats_triton
    assert rank(backend, int8, h100) == plugin.MEASURED_WIN_PRIORITY
    # words held after all (no fragment kernel in this process, or the words+fragments layout): the word table
    small = gemv(N=4096, K=4096)
    assert C.frag_table_entry(small, (9, 0), h100.name) is not None
    assert not C.table_entry(small, (9, 0), h100.name).beats_triton
    assert rank(backend, small, h100) == plugin.MEASURED_WIN_PRIORITY
    monkeypatch.setattr(gemv_weight, "wants_fragments", lambda device: False)
    assert rank(backend, small, h100) is None and rank(backend, fp16_lost, h200) is None
    monkeypatch.setattr(gemv_weight, "wants_fragments", lambda device: True)
    monkeypatch.setattr(gemv_weight, "DEFAULT_LAYOUT", "words+fragments")
    assert rank(backend, small, h100) is None and rank(backend, op, h200) == plugin.MEASURED_WIN_PRIORITY


def test_every_frag_table_entry_timed_ahead_of_the_triton_table_and_ranks_cuda_first(C, monkeypatch):
    # the sweep timed the triton backend's table (table_us, on a weight with words: its fastest layout at M = 1)
    # in the same run: each entry's best variant beat it by the margin the word table's verdicts use (2%), so the
    # hook ranks cuda first for that card's fragments-only weights
    import json
    from pathlib import Path

    from portakern import gemv_weight
    from portakern.backends import cuda as plugin
    from portakern.backends.cuda.backend import CudaBackend
    from portakern.backends.cuda.tuning import FRAG_TABLE

    monkeypatch.setattr(gemv_weight, "wants_fragments", lambda device: True)
    results = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
    for (key, M, N, K), entry in FRAG_TABLE.items():
        sweep = json.loads((results / entry.source).read_text())
        row = next(r for r in sweep["bench"] if (r["M"], r["N"], r["K"]) == (M, N, K))
        assert row["best_us"] <= 0.98 * row["table_us"], (key, M, N, K, row["best_us"], row["table_us"])
        card = _card(sweep["gpu"])
        assert key == f"sm_90/{C.card(card.name)}"
        assert plugin.portakern_backend_priority(CudaBackend(), gemv(M=M, N=N, K=K), card) == \
            plugin.MEASURED_WIN_PRIORITY
