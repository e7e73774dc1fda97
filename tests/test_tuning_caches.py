"""The on-disk tuning caches: ``portakern.cache.TuningCache`` and the triton autotuner on top of it
(``backends/triton/common/autotune.cached_best``, the GEMV buckets of ``quant_gemv/autotune.bucket``, the
attention buckets of ``attention/autotune.bucket`` and their ``restore``), on the CPU.

A corrupt or unwritable cache costs a re-tune, never the call: entries of another type are a miss,
a cached configuration the weight rules out is a miss, a cache directory that cannot be written warns
and the measured winner is still returned. Concurrent writers merge instead of overwriting each other.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

from portakern.cache import TuningCache
from portakern.devices import Device

pytest.importorskip("triton")

from portakern.backends.triton.common import autotune  # noqa: E402
from portakern.backends.triton.quant_gemv import autotune as GT  # noqa: E402
from portakern.backends.triton.quant_gemv import config as T  # noqa: E402

DEV = Device("cuda", 0, "sm_90", "test GPU", (9, 0), 32)
VERSIONS = {"portakern": "test", "triton": "test"}


# -- portakern.cache.TuningCache ------------------------------------------------------------------

@pytest.mark.parametrize("entries", [[], None, "x", 3])
def test_entries_of_another_type_are_a_miss(cache_dir, entries):
    """A file whose tag matches but whose entries are no dict reads as empty, and the next put repairs it."""
    c = TuningCache("ns", DEV, VERSIONS)
    c.path.write_text(json.dumps({"tag": c.tag, "entries": entries}))
    c2 = TuningCache("ns", DEV, VERSIONS)
    assert c2.get("k") is None and c2.get("k", "default") == "default"
    c2.put("k", {"a": 1})
    assert json.loads(c.path.read_text()) == {"tag": c.tag, "entries": {"k": {"a": 1}}}
    assert TuningCache("ns", DEV, VERSIONS).get("k") == {"a": 1}


def test_put_merges_entries_other_instances_stored_since_loading(cache_dir):
    """Two instances (e.g. two processes) that loaded the same file both keep their entries."""
    a, b = TuningCache("ns", DEV, VERSIONS), TuningCache("ns", DEV, VERSIONS)
    assert a.get("ka") is None and b.get("kb") is None     # both hold an (empty) snapshot now
    b.put("kb", 2)
    a.put("ka", 1)                                          # must not write back a's snapshot without "kb"
    assert json.loads(a.path.read_text())["entries"] == {"ka": 1, "kb": 2}
    assert a.get("kb") == 2                                 # the writer sees the merged contents too
    fresh = TuningCache("ns", DEV, VERSIONS)
    assert (fresh.get("ka"), fresh.get("kb")) == (1, 2)


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX permission bits")
def test_put_leaves_the_file_readable_by_others(cache_dir):
    """mkstemp creates 0600; a shared cache directory needs the file readable by its other users."""
    c = TuningCache("ns", DEV, VERSIONS)
    c.put("k", 1)
    assert os.stat(c.path).st_mode & 0o777 == 0o644
    assert not [p.name for p in cache_dir.iterdir() if p.name.startswith(".tmp-")]


# -- backends/triton/common/autotune.cached_best --------------------------------------------------

FAST, SLOW = T.GemvConfig("fma", block_n=64, block_kw=16), T.GemvConfig("fma", block_n=32, block_kw=16)


def _timer(times, calls=None):
    def timer(cfg):
        if calls is not None:
            calls.append(cfg)
        return times[cfg]
    return timer


def test_unwritable_cache_dir_warns_and_returns_the_measured_winner(tmp_path, monkeypatch):
    """PORTAKERN_CACHE_DIR under a regular file: the put fails with NotADirectoryError, which must cost
    only the persistence (a warning), not the tuned configuration or the backend."""
    blocker = tmp_path / "afile"
    blocker.write_text("not a directory")
    monkeypatch.setenv("PORTAKERN_CACHE_DIR", str(blocker / "cache"))
    with pytest.warns(RuntimeWarning, match=r"portakern: could not store the autotuned configuration of "
                                            r"triton-gemv \(bucket-1\)") as rec:
        best = autotune.cached_best("triton-gemv", DEV, "bucket-1", [SLOW, FAST], _timer({SLOW: 2.0, FAST: 1.0}),
                                    default=lambda: SLOW, restore=lambda d: T.GemvConfig(**d))
    assert best == FAST
    assert len([w for w in rec if issubclass(w.category, RuntimeWarning)]) == 1
    assert blocker.read_text() == "not a directory"


def test_cached_config_the_weight_rules_out_is_a_miss(cache_dir):
    """A cached "mma" entry restored on a weight with irregular groups: ``fit`` raises ValueError, which
    is a miss (the bucket is timed again and the new winner stored), not an error of the call."""
    from types import SimpleNamespace

    irregular = SimpleNamespace(bits=4, group_size=128, K=1024, codes_per_word=8, has_perm=False, has_z=True,
                                kgroup=object(), per_elem_group=True, interleave=1, frag=None)
    mma = T.GemvConfig("mma", block_n=64, block_kw=16)
    with pytest.raises(ValueError, match="kind='mma'"):
        T.fit(mma, irregular, 4)                                # what the restore below meets
    import triton

    from portakern import __version__
    versions = {"portakern": __version__, "triton": triton.__version__}
    TuningCache("triton-gemv", DEV, versions).put("bucket-2", mma.to_json())
    calls = []
    best = autotune.cached_best("triton-gemv", DEV, "bucket-2", [SLOW, FAST], _timer({SLOW: 2.0, FAST: 1.0}, calls),
                                default=lambda: SLOW, restore=lambda d: T.fit(T.GemvConfig(**d), irregular, 4))
    assert best == T.fit(FAST, irregular, 4) and calls == [SLOW, FAST]
    assert TuningCache("triton-gemv", DEV, versions).get("bucket-2") == FAST.to_json()


# -- backends/triton/quant_gemv/autotune.bucket ------------------------------------------------------

def _prepared(g_idx=None):
    """A GPTQ int4 weight (group 128, N=256, K=1024) prepared for the triton backend on the CPU."""
    from gemv_cases import weight

    from portakern.devices import CPU
    from portakern.gemv_weight import prepare_gemv_weight

    extra = {} if g_idx is None else {"g_idx": g_idx}
    return prepare_gemv_weight(weight(("c", "gptq", 4, 128, False, 4, 256, 1024, "bfloat16", extra)), CPU)


def test_bucket_separates_irregular_groups_and_fragment_layouts():
    """Regular and irregular (per-code group table) weights, and weights with and without a fragment
    layout, admit different kinds; they must not share a cached configuration."""
    from dataclasses import replace

    regular, irregular = _prepared(), _prepared("random")
    assert regular.kgroup is None and irregular.kgroup is not None and not irregular.has_perm
    assert GT.bucket(regular, 4, 256, "bfloat16") == "b4-g128-z1-p0-bfloat16-m4-n256-k1024-kg0-fr0"
    assert GT.bucket(irregular, 4, 256, "bfloat16") == "b4-g128-z1-p0-bfloat16-m4-n256-k1024-kg1-fr0"
    with_frag = replace(regular, frag=object())             # as prepare_weight builds it on a CUDA device
    assert GT.bucket(with_frag, 4, 256, "bfloat16") == "b4-g128-z1-p0-bfloat16-m4-n256-k1024-kg0-fr1"


def test_tuned_keeps_regular_and_irregular_winners_apart(cache_dir):
    """The regular weight's winner ("mma", which irregular groups rule out) is stored; tuning the irregular
    weight of the same shape then times its own candidates and stores its winner beside it."""
    regular, irregular = _prepared(), _prepared("random")

    def timer(cfg):
        return 0.5 if cfg.kind == "mma" else 1.0 + cfg.block_n / 1e3

    first = GT.tuned(regular, 4, 256, "bfloat16", DEV, "sm_90", 132, timer)
    assert first.kind == "mma"
    calls = []
    second = GT.tuned(irregular, 4, 256, "bfloat16", DEV, "sm_90", 132, lambda c: calls.append(c) or timer(c))
    assert second.kind == "fma" and calls                     # timed, not restored from the regular entry
    assert T.fit(second, irregular, 4) == second
    import triton

    from portakern import __version__
    cache = TuningCache("triton-gemv", DEV, {"portakern": __version__, "triton": triton.__version__})
    assert cache.get(GT.bucket(regular, 4, 256, "bfloat16")) == first.to_json()
    assert cache.get(GT.bucket(irregular, 4, 256, "bfloat16")) == second.to_json()


# -- backends/triton/attention/autotune: bucket and restore ----------------------------------------

def _attention(**kw):
    from portakern.ir.dtypes import DType
    from portakern.ir.ops import Attention

    base = dict(batch=2, seqlen_q=1024, seqlen_k=4096, heads_q=8, heads_kv=8, head_dim=128, head_dim_v=128,
                dtype=DType.bfloat16, scale=0.1)
    return Attention(**{**base, **kw})


def _paged(page_size):
    from portakern.ir.ops import KVLayout

    pages = 32768 // page_size
    return _attention(batch=1, seqlen_q=1, seqlen_k=pages * page_size, heads_q=32, heads_kv=8,
                      kv_layout=KVLayout.PAGED, page_size=page_size, num_pages=pages, has_seqlens_k=True)


def _prefers(flag):
    """A timer under which the configurations with ``flag`` set (a Gluon kernel) win."""
    return lambda cfg: 0.5 if getattr(cfg, flag) else 1.0


def _passes_build_checks(op, cfg):
    """Whether ``attention.forward.build`` on sm_90 accepts ``cfg`` for ``op`` (its checks raise ValueError)."""
    from portakern.backends.triton.attention import rules
    from portakern.backends.triton.common.arch import check_pdl

    check_pdl(cfg, "sm_90")
    for check in (rules.check_tma, rules.check_wgmma, rules.check_decode_ws):
        check(op, cfg, "sm_90")
    return True


def test_attention_bucket_separates_page_sizes_and_seqlens_k(cache_dir):
    """The Gluon decode kernel serves pages of 16 but not 24, the Gluon prefill kernel dense keys without
    seqlens_k only: such ops must not share a cached winner (before: one bucket, and the restored winner failed
    the compile)."""
    from portakern.backends.triton.attention import autotune as AT

    assert AT.bucket(_paged(16)) != AT.bucket(_paged(24))
    assert AT.bucket(_attention()) != AT.bucket(_attention(has_seqlens_k=True))
    first = AT.tuned(_paged(16), DEV, "sm_90", 132, _prefers("decode_ws"))
    assert first.decode_ws
    calls = []
    second = AT.tuned(_paged(24), DEV, "sm_90", 132, lambda c: calls.append(c) or 1.0)
    assert calls and not second.decode_ws and _passes_build_checks(_paged(24), second)


def test_attention_cached_winner_the_op_rules_out_is_a_miss(cache_dir):
    """Causal and sliding-window prefill share a bucket; the causal op's winner (the Gluon prefill kernel, which
    serves no window) restored for the window op is a miss: the bucket is timed again for it (before: restored as
    it was, and ``attention.build`` raised ValueError on the first call)."""
    from portakern.backends.triton.attention import autotune as AT
    from portakern.ir import expr as E

    causal, window = _attention(mask_mod=E.causal_mask()), _attention(mask_mod=E.window_mask(256, 0))
    assert AT.bucket(causal) == AT.bucket(window)
    first = AT.tuned(causal, DEV, "sm_90", 132, _prefers("wgmma"))
    assert first.wgmma
    calls = []
    second = AT.tuned(window, DEV, "sm_90", 132, lambda c: calls.append(c) or 1.0)
    assert calls and not second.wgmma and _passes_build_checks(window, second)
    with pytest.raises(ValueError, match=r"AttnConfig\(wgmma=True\): the Gluon prefill kernel does not serve"):
        AT.restore(window, "sm_90", first.to_json())
    assert AT.restore(causal, "sm_90", first.to_json()) == first
