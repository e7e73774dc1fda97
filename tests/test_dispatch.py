"""Dispatch: explain(), override precedence, strict mode, fallback, plan cache, output placement."""

from __future__ import annotations

import json
import threading
import warnings

import numpy as np
import pytest
import torch

import portakern
from portakern import Backend, FallbackWarning
from portakern.backend import YES, no
from portakern.errors import BackendError, InvalidInputError, StrictModeError, UnsupportedError
from plugin_helpers import provides  # noqa: E402


class Fake(Backend):
    """A numpy backend that fills ``out`` with ``fill``; counts supports()/compile()/kernel calls.

    ``fail`` is None, "compile" or "run": where it raises a RuntimeError.
    """

    array_kind = "numpy"
    device_types = ("cpu",)

    def __init__(self, name, fill=1.0, priority=0, fail=None, says_no=None):
        self.name, self.fill, self.priority, self.fail, self.says_no = name, fill, priority, fail, says_no
        self.supports_calls = self.compile_calls = self.runs = 0

    def supports(self, op, device):
        self.supports_calls += 1
        return no(self.says_no) if self.says_no else YES

    def compile(self, op, device):
        self.compile_calls += 1
        if self.fail == "compile":
            raise RuntimeError(f"{self.name} cannot compile this")

        def kernel(*args):
            self.runs += 1
            if self.fail == "run":
                raise RuntimeError(f"{self.name} launch failed")
            args[-1 if op.kind == "quant_gemv" else 3].fill(self.fill)
        return kernel




@pytest.fixture
def q1():
    q = np.linspace(-1, 1, 2 * 3 * 2 * 8, dtype=np.float32).reshape(2, 3, 2, 8)
    return q, q.copy(), q.copy()


# -- explain ---------------------------------------------------------------------------------------

def test_explain_lists_candidates_reasons_and_choice(fresh_registry, q1, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    d = portakern.explain(portakern.attention, *q1, causal=True)
    assert d.chosen == "cpu"
    assert d.device.type == "cpu"
    assert d.op.kind == "attention" and d.op.heads_q == 2 and d.op.mask_mod is not None
    by_name = {c.name: c for c in d.candidates}
    assert by_name["cpu"].support.ok
    assert not by_name["triton"].support.ok and "TRITON_INTERPRET" in by_name["triton"].support.reason
    text = str(d)
    assert "chosen   cpu" in text and "* cpu" in text and "no: triton runs on NVIDIA GPUs" in text
    js = json.loads(json.dumps(d.to_json()))
    assert js["chosen"] == "cpu" and js["op"]["op"] == "attention" and js["device"]["type"] == "cpu"
    assert {c["backend"] for c in js["candidates"]} >= {"cpu", "triton"}


def test_explain_takes_function_names_and_does_not_compile(register_plugin, q1):
    spy = Fake("spy", priority=50)
    register_plugin(provides(spy), name="spy")
    d = portakern.explain("attention", *q1)
    assert d.chosen == "spy" and spy.compile_calls == 0 and spy.runs == 0
    with pytest.raises(portakern.InvalidTypeError, match="fn must be portakern.attention or portakern.quant_gemv"):
        portakern.explain(print, *q1)


def test_explain_quant_gemv(fresh_registry, rng):
    w = portakern.quantize(rng.standard_normal((16, 64)).astype(np.float32), bits=4, group_size=32)
    d = portakern.explain(portakern.quant_gemv, np.zeros((2, 64), np.float32), w)
    assert d.chosen == "cpu" and d.op.kind == "quant_gemv" and (d.op.M, d.op.N, d.op.K) == (2, 16, 64)


def test_explain_records_fallbacks_after_a_run(register_plugin, q1):
    register_plugin(provides(Fake("broken", priority=50, fail="compile")), name="broken")
    with pytest.warns(FallbackWarning):
        portakern.attention(*q1)
    from portakern import dispatch

    plan = next(p for p in dispatch._plans.values() if p.decision.op.kind == "attention")
    assert plan.decision.chosen == "cpu"
    assert plan.decision.fallbacks == [("broken", "compile: RuntimeError: broken cannot compile this")]
    assert "fell back from broken" in str(plan.decision)


# -- overrides --------------------------------------------------------------------------------------

@pytest.fixture
def ab(register_plugin):
    a, b = Fake("pick-a", fill=1.0), Fake("pick-b", fill=2.0)
    register_plugin(provides(a, b), name="ab")
    return a, b


def test_env_override(ab, q1, monkeypatch):
    monkeypatch.setenv("PORTAKERN_BACKEND", "pick-a")
    assert (portakern.attention(*q1) == 1.0).all()
    assert portakern.explain(portakern.attention, *q1).forced_by == "PORTAKERN_BACKEND"


def test_context_beats_env(ab, q1, monkeypatch):
    monkeypatch.setenv("PORTAKERN_BACKEND", "pick-a")
    with portakern.use_backend("pick-b"):
        assert (portakern.attention(*q1) == 2.0).all()
        d = portakern.explain(portakern.attention, *q1)
        assert (d.forced, d.forced_by) == ("pick-b", "use_backend()")
    assert (portakern.attention(*q1) == 1.0).all()  # the context ended


def test_argument_beats_context_and_env(ab, q1, ref_attention, monkeypatch):
    monkeypatch.setenv("PORTAKERN_BACKEND", "pick-a")
    with portakern.use_backend("pick-b"):
        out = portakern.attention(*q1, backend="cpu")
        np.testing.assert_allclose(out, ref_attention(*q1), atol=1e-6)
        assert portakern.explain(portakern.attention, *q1, backend="cpu").forced_by == "argument"


def test_no_override_picks_the_highest_priority(register_plugin, q1):
    register_plugin(provides(Fake("lo", fill=1.0, priority=-5), Fake("hi", fill=9.0, priority=5)), name="p")
    assert (portakern.attention(*q1) == 9.0).all()


def test_use_backend_rejects_unknown_names(fresh_registry):
    with pytest.raises(InvalidInputError, match="backend='nope' is not registered: registered backends are"):
        with portakern.use_backend("nope"):
            pass


def test_forced_backend_that_says_no_names_the_way_out(register_plugin, q1):
    register_plugin(provides(Fake("picky", says_no="head_dim must be 128; pad the head dimension")), name="p")
    with pytest.raises(UnsupportedError, match=r"not supported by picky on cpu.*head_dim must be 128.*pass backend='cpu'"):
        portakern.attention(*q1, backend="picky")


def test_no_candidate_lists_every_reason(register_plugin, q1, monkeypatch):
    register_plugin(provides(Fake("nah", says_no="not today")), name="p")
    monkeypatch.setenv("PORTAKERN_DISABLE_PLUGIN_AUTOLOAD", "1")
    from portakern import plugins

    plugins._manual[:] = [(n, o) for n, o in plugins._manual if n == "p"]
    with monkeypatch.context() as m:
        m.setattr(plugins, "_entry_points", lambda: [])
        plugins.reset()
        with pytest.raises(UnsupportedError, match="no backend supports attention .* nah: not today"):
            portakern.attention(*q1)
    plugins.reset()


# -- strict mode and fallback -------------------------------------------------------------------------

@pytest.mark.parametrize("stage", ["compile", "run"])
def test_fallback_to_next_candidate_warns_once(register_plugin, q1, ref_attention, stage):
    bad = Fake("flaky", priority=50, fail=stage)
    register_plugin(provides(bad), name="flaky")
    with pytest.warns(FallbackWarning, match=f"backend 'flaky' failed to {stage} attention: RuntimeError"):
        out = portakern.attention(*q1)
    np.testing.assert_allclose(out, ref_attention(*q1), atol=1e-6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second call neither warns nor retries the failed backend
        portakern.attention(*q1)
    assert bad.compile_calls == 1 and bad.runs == (1 if stage == "run" else 0)


@pytest.mark.parametrize("stage", ["compile", "run"])
def test_strict_mode_turns_fallback_into_error(register_plugin, q1, monkeypatch, stage):
    register_plugin(provides(Fake("flaky", priority=50, fail=stage)), name="flaky")
    monkeypatch.setenv("PORTAKERN_STRICT", "1")
    with pytest.raises(StrictModeError, match=f"'flaky' failed to {stage} .*PORTAKERN_STRICT=1 forbids") as e:
        portakern.attention(*q1)
    assert isinstance(e.value, BackendError) and isinstance(e.value, RuntimeError)


def test_forced_backend_failure_is_an_error_not_a_fallback(register_plugin, q1):
    register_plugin(provides(Fake("flaky", fail="run")), name="flaky")
    with pytest.raises(BackendError, match="'flaky' \\(forced by argument\\) failed to run"):
        portakern.attention(*q1, backend="flaky")


def test_supports_that_raises_is_a_rejection(register_plugin, q1):
    class Crashy(Fake):
        def supports(self, op, device):
            raise KeyError("oops")

    register_plugin(provides(Crashy("crashy", priority=99)), name="c")
    d = portakern.explain(portakern.attention, *q1)
    (c,) = [c for c in d.candidates if c.name == "crashy"]
    assert not c.support.ok and "supports() raised KeyError" in c.support.reason
    assert d.chosen == "cpu"


def test_every_candidate_failing_is_a_backend_error(register_plugin, q1, monkeypatch):
    from portakern import plugins

    register_plugin(provides(Fake("f1", priority=2, fail="compile"), Fake("f2", priority=1, fail="compile")), name="p")
    monkeypatch.setattr(plugins, "_entry_points", lambda: [])
    plugins.reset()
    with pytest.warns(FallbackWarning), pytest.raises(BackendError, match="every candidate failed .* f1: .* f2: "):
        portakern.attention(*q1)
    plugins.reset()


# -- plan cache -------------------------------------------------------------------------------------

def test_second_call_does_not_replan(register_plugin, q1):
    spy = Fake("spy", priority=50)
    register_plugin(provides(spy), name="spy")
    portakern.attention(*q1)
    assert (spy.supports_calls, spy.compile_calls, spy.runs) == (1, 1, 1)
    for _ in range(5):
        portakern.attention(*q1)
    assert (spy.supports_calls, spy.compile_calls, spy.runs) == (1, 1, 6)
    portakern.attention(*q1, causal=True)  # a new signature plans once more
    portakern.attention(q1[0][:1], q1[1][:1], q1[2][:1])
    assert (spy.supports_calls, spy.compile_calls) == (3, 3)


def test_concurrent_first_calls_compile_once(register_plugin, q1):
    spy = Fake("spy", priority=50)
    register_plugin(provides(spy), name="spy")
    barrier = threading.Barrier(8)
    errors = []

    def call():
        barrier.wait()
        try:
            portakern.attention(*q1)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=call) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and spy.compile_calls == 1 and spy.runs == 8


def test_env_change_is_seen_by_the_next_call(ab, q1, monkeypatch):
    monkeypatch.setenv("PORTAKERN_BACKEND", "pick-a")
    assert (portakern.attention(*q1) == 1.0).all()
    monkeypatch.setenv("PORTAKERN_BACKEND", "pick-b")
    assert (portakern.attention(*q1) == 2.0).all()


# -- outputs look like inputs ----------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_numpy_output_matches_input(fresh_registry, qkv, ref_attention, dtype):
    q, k, v = qkv(B=2, Sq=3, Sk=5, Hq=4, Hkv=2, D=16, dtype=dtype)
    out, lse = portakern.attention(q, k, v, causal=True, return_lse=True)
    assert type(out) is np.ndarray and out.dtype == dtype and out.shape == (2, 3, 4, 16)
    assert lse.dtype == np.float32 and lse.shape == (2, 4, 3)
    tol = 2e-3 if dtype == np.float16 else 1e-5
    np.testing.assert_allclose(out.astype(np.float64), ref_attention(q, k, v, causal=True), atol=tol)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_torch_output_matches_input(fresh_registry, qkv, ref_attention, dtype, torch_device):
    q, k, v = (torch.from_numpy(a).to(dtype).to(torch_device) for a in qkv(B=1, Sq=4, Sk=4, Hq=2, Hkv=1, D=64))
    out = portakern.attention(q, k, v, causal=True)
    assert isinstance(out, torch.Tensor) and out.dtype == dtype and out.device == q.device
    assert out.shape == (1, 4, 2, 64)
    tol = {torch.float16: 2e-3, torch.bfloat16: 2e-2, torch.float32: 1e-5}[dtype]
    want = ref_attention(*(a.float().cpu().numpy() for a in (q, k, v)), causal=True)
    np.testing.assert_allclose(out.float().cpu().numpy(), want, atol=tol)


@pytest.mark.parametrize("lib, dtype", [("numpy", "float16"), ("numpy", "float32"), ("torch", "float16"),
                                        ("torch", "bfloat16"), ("torch", "float32")])  # numpy has no bf16
def test_quant_gemv_output_matches_input(fresh_registry, rng, lib, dtype):
    w = rng.standard_normal((24, 64)).astype(np.float32)
    x = rng.standard_normal((3, 64)).astype(np.float32)
    qw = portakern.quantize(w, bits=8, group_size=32)
    xin = x.astype(dtype) if lib == "numpy" else torch.from_numpy(x).to(getattr(torch, dtype))
    y = portakern.quant_gemv(xin, qw)
    assert y.shape == (3, 24)
    if lib == "numpy":
        assert type(y) is np.ndarray and y.dtype == np.dtype(dtype)
    else:
        assert isinstance(y, torch.Tensor) and y.dtype == getattr(torch, dtype) and y.device.type == "cpu"
    want = np.asarray(xin.float().numpy() if lib == "torch" else xin, np.float64) @ np.asarray(qw.dequantize(), np.float64).T
    got = np.asarray(y.float().numpy() if lib == "torch" else y, np.float64)
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)


# -- fallback leaves whole plans; plugin and option mistakes -------------------------------------------------

def _only(monkeypatch, *names):
    """Keep only the backends ``names`` registered (for the rest of the test)."""
    from portakern import plugins
    reg = plugins.registry()
    for n in [n for n in reg.backends if n not in names]:
        monkeypatch.delitem(reg.backends, n)


def test_every_candidate_failing_at_run_raises_the_same_error_on_every_call(register_plugin, q1, monkeypatch):
    bad = Fake("flaky", priority=50, fail="run")
    register_plugin(provides(bad), name="flaky")
    _only(monkeypatch, "flaky")
    for _ in range(3):   # was: BackendError once, then AttributeError from a plan left without a backend
        with pytest.warns(FallbackWarning) if _ == 0 else warnings.catch_warnings():
            with pytest.raises(BackendError, match="every candidate failed for attention .*flaky: run: RuntimeError"):
                portakern.attention(*q1)
    assert bad.compile_calls == 3          # the key was forgotten: each call decided afresh


def test_fallback_replaces_the_plan_and_leaves_the_old_one_whole(register_plugin, q1, ref_attention):
    from portakern import dispatch
    bad = Fake("flaky", priority=50, fail="run")
    register_plugin(provides(bad), name="flaky")
    dispatch.clear_cache()
    key_plan = {}
    real = dispatch.get_plan

    def spy(key, build, backend_arg):
        plan = real(key, build, backend_arg)
        key_plan.setdefault("first", (key, plan))
        return plan

    dispatch.get_plan = spy
    try:
        with pytest.warns(FallbackWarning):
            out = portakern.attention(*q1)
    finally:
        dispatch.get_plan = real
    np.testing.assert_allclose(out, ref_attention(*q1), atol=1e-6)
    key, old = key_plan["first"]
    assert old.backend is bad and old.kernel is not None and old.decision.chosen == "flaky"   # a racing thread's view
    new = dispatch._plans[key]
    assert new is not old and new.backend.name == "cpu" and bad not in new.order
    assert new.decision.fallbacks == [("flaky", "run: RuntimeError: flaky launch failed")] and not old.decision.fallbacks


def test_concurrent_calls_during_a_fallback_all_succeed(register_plugin, q1, ref_attention):
    import time
    bad = Fake("flaky", priority=50, fail="run")
    register_plugin(provides(bad), name="flaky")
    from portakern.backends.cpu.backend import CpuBackend
    real = CpuBackend.compile

    def slow(self, op, device):
        time.sleep(0.2)
        return real(self, op, device)

    CpuBackend.compile = slow
    results = []
    try:
        def call():
            try:
                results.append(portakern.attention(*q1))
            except Exception as e:       # recorded; asserted below
                results.append(e)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ts = [threading.Thread(target=call) for _ in range(4)]
            for t in ts:
                t.start()
                time.sleep(0.05)
            for t in ts:
                t.join()
    finally:
        CpuBackend.compile = real
    ref = ref_attention(*q1)
    assert len(results) == 4 and all(isinstance(r, np.ndarray) for r in results), results
    for r in results:
        np.testing.assert_allclose(r, ref, atol=1e-6)


def test_supports_returning_a_bool_is_a_rejection_naming_the_plugin(register_plugin, q1, ref_attention):
    class Sloppy(Fake):
        def supports(self, op, device):
            return device.type == "cpu"      # a plain bool, not a Support
    register_plugin(provides(Sloppy("sloppy", priority=50)), name="sloppy")
    np.testing.assert_allclose(portakern.attention(*q1), ref_attention(*q1), atol=1e-6)   # others still dispatch
    c = {c.name: c for c in portakern.explain(portakern.attention, *q1).candidates}["sloppy"]
    assert not c.support.ok and "'sloppy': supports() returned bool True, not a portakern.Support" in c.support.reason


@pytest.mark.parametrize("opts, match", [
    (dict(window=5), "window"), (dict(softcap=[1.0]), "softcap"), (dict(causal=[True]), "causal"),
    (dict(backend=["cpu"]), "backend"),
])
def test_options_of_the_wrong_type_are_named_not_a_bare_type_error(fresh_registry, q1, opts, match):
    with pytest.raises((InvalidInputError, portakern.InvalidTypeError), match=match):
        portakern.attention(*q1, **opts)


def test_an_option_equal_to_a_valid_one_is_still_validated_after_a_hit(fresh_registry, q1):
    portakern.attention(*q1, causal=True)
    with pytest.raises(portakern.InvalidTypeError, match="causal"):    # 1 == True: was a plan hit, unvalidated
        portakern.attention(*q1, causal=1)
    portakern.attention(*q1, softcap=1.0)
    with pytest.raises((InvalidInputError, portakern.InvalidTypeError), match="softcap"):
        portakern.attention(*q1, softcap=True)


def test_a_window_of_other_item_types_is_still_validated_after_a_hit(fresh_registry, q1):
    portakern.attention(*q1, window=(1, 0))
    for bad in ((True, 0), (1.0, 0)):          # equal to (1, 0) and hashed alike: was a plan hit, unvalidated
        with pytest.raises(InvalidInputError, match="window"):
            portakern.attention(*q1, window=bad)


def test_a_fallback_after_clear_cache_serves_the_call_without_restoring_the_old_plan(register_plugin, q1):
    from portakern import dispatch
    bad = Fake("flaky", priority=50, fail="run")
    register_plugin(provides(bad), name="flaky")
    real = dispatch.fall_back

    def cleared_first(key, plan, e):
        dispatch.clear_cache()                  # another thread cleared the plans meanwhile
        return real(key, plan, e)

    dispatch.fall_back = cleared_first
    try:
        with pytest.warns(FallbackWarning):
            out = portakern.attention(*q1)
    finally:
        dispatch.fall_back = real
    assert out.shape == q1[0].shape and not dispatch._plans     # served, and nothing stale put back
