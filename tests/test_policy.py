"""Dispatch policy "fastest": measured ordering, its on-disk ranking, and how it meets overrides.

Every test runs in an isolated registry holding only hand-registered backends (no entry points),
so the candidates are exactly the ones a test names. The backends compute with the cpu reference
kernel, one of them after sleeping 5 ms, so the measured order is known in advance.
"""

from __future__ import annotations

import json
import time
import warnings

import numpy as np
import pytest
import torch

import portakern
from portakern import Backend, FallbackWarning, dispatch, hookimpl, measure
from portakern.backend import YES, no
from portakern.backends.cpu.backend import CpuBackend
from portakern.errors import InvalidInputError, StrictModeError

SLEEP_S = 0.005


class Ref(Backend):
    """A numpy backend running the cpu reference kernel, optionally sleeping first; counts its calls.

    ``fail`` is None, "compile" or "run": where it raises a RuntimeError.
    """

    array_kind = "numpy"
    device_types = ("cpu",)

    def __init__(self, name, priority=0, sleep=0.0, fail=None, version="1"):
        self.name, self.priority, self.sleep, self.fail, self.version = name, priority, sleep, fail, version
        self.compile_calls = self.runs = 0

    def supports(self, op, device):
        return YES if device.type == "cpu" else no(f"{self.name} runs on the host only")

    def compile(self, op, device):
        self.compile_calls += 1
        if self.fail == "compile":
            raise RuntimeError(f"{self.name} cannot compile this")
        inner = CpuBackend().compile(op, device)

        def kernel(*args):
            self.runs += 1
            if self.fail == "run":
                raise RuntimeError(f"{self.name} launch failed")
            if self.sleep:
                time.sleep(self.sleep)
            inner(*args)
        return kernel


class Provides:
    """A plugin providing ``backends`` (a list the test may swap between "processes")."""

    def __init__(self, *backends):
        self.backends = list(backends)

    @hookimpl
    def portakern_register_backends(self):
        return self.backends


@pytest.fixture
def isolated(register_plugin, monkeypatch, tmp_path):
    """``isolated(*backends)``: a registry of exactly these backends; the tuning cache in tmp_path."""
    from portakern import plugins

    monkeypatch.setenv("PORTAKERN_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("PORTAKERN_POLICY", raising=False)
    monkeypatch.setattr(plugins, "_entry_points", lambda: [])
    plugin = Provides()

    def make(*backends):
        plugin.backends[:] = backends
        register_plugin(plugin, name="policy-test")
        return plugin
    return make


@pytest.fixture
def q1(qkv):
    return qkv(B=1, Sq=3, Sk=5, Hq=2, Hkv=1, D=8)


def cpu_reference(q, k, v):
    """The output of the cpu backend's own kernel (what every backend here must reproduce)."""
    from portakern.validate import attention_op

    op, info = attention_op(q, k, v)
    out = np.empty(op.shapes()["out"], np.float32)
    CpuBackend().compile(op, info.device)(q, k, v, out, None, {})
    return out


def new_process(plugin, *backends):
    """Forget every plan and the registry, and serve these fresh backend objects (like a new process)."""
    from portakern import plugins

    plugin.backends[:] = backends
    plugins.reset()


def the_plan(kind="attention"):
    (plan,) = [p for p in dispatch._plans.values() if p.decision.op.kind == kind]
    return plan


def cache_files(tmp_path):
    return sorted(tmp_path.glob(f"{measure.FASTEST_NAMESPACE}-*.json"))


# -- ordering ---------------------------------------------------------------------------------------

def test_fastest_wins_even_with_lower_priority(isolated, q1, ref_attention, tmp_path):
    slow, fast = Ref("slow", priority=50, sleep=SLEEP_S), Ref("fast", priority=10)
    isolated(slow, fast)
    with portakern.use_policy("fastest"):
        out = portakern.attention(*q1)
        np.testing.assert_array_equal(out, cpu_reference(*q1))
        np.testing.assert_allclose(out, ref_attention(*q1), atol=1e-6)
        runs = 1 + measure.MEASURE_WARMUP + measure.MEASURE_REPEATS
        assert (fast.compile_calls, fast.runs) == (1, runs)  # measured, then served without recompiling
        assert (slow.compile_calls, slow.runs) == (1, runs - 1)
        portakern.attention(*q1)
        assert (fast.runs, slow.runs) == (runs + 1, runs - 1)  # cached plan: no re-measuring
    d = the_plan().decision
    assert (d.chosen, d.policy, d.policy_by, d.ranked_by) == ("fast", "fastest", "use_policy()", "measured")
    assert d.measured_us["slow"] >= SLEEP_S * 1e6 > d.measured_us["fast"]
    text = str(d)
    assert "policy   fastest (by use_policy()), ranked by measured" in text and "* fast" in text and " us  ok" in text
    js = json.loads(json.dumps(d.to_json()))
    assert js["policy"] == "fastest" and js["ranked_by"] == "measured"
    times = {c["backend"]: c["time_us"] for c in js["candidates"]}
    assert times["slow"] > times["fast"] > 0
    assert len(cache_files(tmp_path)) == 1


def test_env_selects_fastest(isolated, q1, monkeypatch):
    slow, fast = Ref("slow", priority=50, sleep=SLEEP_S), Ref("fast", priority=10)
    isolated(slow, fast)
    monkeypatch.setenv("PORTAKERN_POLICY", "fastest")
    portakern.attention(*q1)
    d = the_plan().decision
    assert (d.chosen, d.policy_by) == ("fast", "PORTAKERN_POLICY")
    with portakern.use_policy("priority"):  # the context beats the environment
        assert portakern.explain(portakern.attention, *q1).chosen == "slow"


@pytest.mark.parametrize("how", ["default", "context"])
def test_priority_policy_unchanged(isolated, q1, tmp_path, how):
    slow, fast = Ref("slow", priority=50, sleep=SLEEP_S), Ref("fast", priority=10)
    isolated(slow, fast)
    if how == "context":
        with portakern.use_policy("priority"):
            out = portakern.attention(*q1)
    else:
        out = portakern.attention(*q1)
    np.testing.assert_array_equal(out, cpu_reference(*q1))
    assert (slow.compile_calls, slow.runs, fast.compile_calls, fast.runs) == (1, 1, 0, 0)
    d = the_plan().decision
    assert (d.policy, d.ranked_by, d.measured_us) == ("priority", "priority", None)
    assert "policy   priority" in str(d) and "median" not in str(d)
    assert cache_files(tmp_path) == []


def test_policy_is_part_of_the_plan_key(isolated, q1):
    slow, fast = Ref("slow", priority=50, sleep=SLEEP_S), Ref("fast", priority=10)
    isolated(slow, fast)
    portakern.attention(*q1)
    with portakern.use_policy("fastest"):
        portakern.attention(*q1)
    before = (slow.compile_calls, fast.compile_calls, slow.runs)
    portakern.attention(*q1)  # the priority plan is still cached: no re-plan, slow serves
    assert (slow.compile_calls, fast.compile_calls) == before[:2] and slow.runs == before[2] + 1
    assert {p.decision.chosen for p in dispatch._plans.values()} == {"slow", "fast"}


def test_quant_gemv_fastest(isolated, rng):
    slow, fast = Ref("slow", priority=50, sleep=SLEEP_S), Ref("fast", priority=10)
    isolated(slow, fast)
    w = portakern.quantize(rng.standard_normal((16, 64)).astype(np.float32), bits=4, group_size=32)
    x = rng.standard_normal((2, 64)).astype(np.float32)
    with portakern.use_policy("fastest"):
        y = portakern.quant_gemv(x, w)
    assert the_plan("quant_gemv").decision.chosen == "fast"
    with portakern.use_backend("slow"):
        np.testing.assert_array_equal(y, portakern.quant_gemv(x, w))
    want = x.astype(np.float64) @ np.asarray(w.dequantize(), np.float64).T
    np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-4)


# -- the ranking on disk ------------------------------------------------------------------------------

def test_stored_ranking_is_reused_without_measuring(isolated, q1, tmp_path):
    plugin = isolated(Ref("slow", priority=50, sleep=SLEEP_S), Ref("fast", priority=10))
    with portakern.use_policy("fastest"):
        portakern.attention(*q1)
    slow, fast = Ref("slow", priority=50, sleep=SLEEP_S), Ref("fast", priority=10)
    new_process(plugin, slow, fast)
    with portakern.use_policy("fastest"):
        out = portakern.attention(*q1)
        assert portakern.explain(portakern.attention, *q1).ranked_by == "tuning cache"
    np.testing.assert_array_equal(out, cpu_reference(*q1))
    assert (slow.compile_calls, slow.runs, fast.compile_calls, fast.runs) == (0, 0, 1, 1)
    d = the_plan().decision
    assert (d.chosen, d.ranked_by) == ("fast", "tuning cache") and d.measured_us["slow"] > d.measured_us["fast"]


def test_another_backend_version_measures_again(isolated, q1, tmp_path):
    plugin = isolated(Ref("slow", priority=50, sleep=SLEEP_S), Ref("fast", priority=10))
    with portakern.use_policy("fastest"):
        portakern.attention(*q1)
    slow, fast = Ref("slow", priority=50, sleep=SLEEP_S, version="2"), Ref("fast", priority=10)
    new_process(plugin, slow, fast)
    with portakern.use_policy("fastest"):
        portakern.attention(*q1)
    assert slow.runs > 0 and the_plan().decision.ranked_by == "measured"
    assert len(cache_files(tmp_path)) == 2


@pytest.mark.parametrize("garbage", ["{not json", '{"tag": 1}', "[]", None])
def test_corrupt_cache_file_is_a_miss(isolated, q1, tmp_path, garbage):
    plugin = isolated(Ref("slow", priority=50, sleep=SLEEP_S), Ref("fast", priority=10))
    with portakern.use_policy("fastest"):
        portakern.attention(*q1)
    (path,) = cache_files(tmp_path)
    if garbage is None:  # a well-formed file whose entry is not a ranking
        raw = json.loads(path.read_text())
        raw["entries"] = {k: "fast" for k in raw["entries"]}
        garbage = json.dumps(raw)
    path.write_text(garbage)
    slow, fast = Ref("slow", priority=50, sleep=SLEEP_S), Ref("fast", priority=10)
    new_process(plugin, slow, fast)
    with portakern.use_policy("fastest"):
        out = portakern.attention(*q1)
    np.testing.assert_array_equal(out, cpu_reference(*q1))
    assert slow.runs > 0 and the_plan().decision.ranked_by == "measured"
    (entry,) = json.loads(path.read_text())["entries"].values()  # rewritten with a ranking again
    assert set(entry) == {"slow", "fast"} and entry["slow"] > entry["fast"]


# -- errors, strict mode and overrides ---------------------------------------------------------------

def test_unknown_policy_names_the_allowed_ones(isolated, q1, monkeypatch):
    isolated(Ref("fast"))
    with pytest.raises(InvalidInputError, match=r"use_policy\(name\)='speed' is not a dispatch policy: "
                                                r"the policies are 'priority': .*; 'fastest': "):
        with portakern.use_policy("speed"):
            pass
    monkeypatch.setenv("PORTAKERN_POLICY", "speed")
    with pytest.raises(InvalidInputError, match="PORTAKERN_POLICY='speed' is not a dispatch policy"):
        portakern.attention(*q1)
    with pytest.raises(InvalidInputError, match="PORTAKERN_POLICY='speed'"):
        portakern.explain(portakern.attention, *q1)


@pytest.mark.parametrize("stage", ["compile", "run"])
def test_failing_candidate_under_fastest(isolated, q1, tmp_path, stage):
    plugin = isolated(Ref("broken", priority=90, fail=stage), Ref("slow", priority=50, sleep=SLEEP_S),
                      Ref("fast", priority=10))
    with portakern.use_policy("fastest"), pytest.warns(FallbackWarning, match=f"'broken' failed to {stage}"):
        out = portakern.attention(*q1)
    np.testing.assert_array_equal(out, cpu_reference(*q1))
    d = the_plan().decision
    assert d.chosen == "fast" and set(d.measured_us) == {"slow", "fast"}
    assert [b for b, _ in d.fallbacks] == ["broken"]
    broken = Ref("broken", priority=90, fail=stage)
    new_process(plugin, broken, Ref("slow", priority=50, sleep=SLEEP_S), Ref("fast", priority=10))
    with portakern.use_policy("fastest"), warnings.catch_warnings():
        warnings.simplefilter("error")  # the stored ranking puts broken last: never tried again
        portakern.attention(*q1)
    assert broken.compile_calls == 0


@pytest.mark.parametrize("stage", ["compile", "run"])
def test_strict_mode_failing_candidate_under_fastest(isolated, q1, tmp_path, monkeypatch, stage):
    isolated(Ref("broken", priority=0, fail=stage), Ref("fast", priority=10))
    monkeypatch.setenv("PORTAKERN_STRICT", "1")
    with portakern.use_policy("fastest"):
        with pytest.raises(StrictModeError, match=f"'broken' failed to {stage} .*PORTAKERN_STRICT=1 forbids"):
            portakern.attention(*q1)
    assert cache_files(tmp_path) == [] and not dispatch._plans


@pytest.mark.parametrize("how", ["argument", "use_backend()", "PORTAKERN_BACKEND"])
def test_forced_backend_skips_measurement(isolated, q1, tmp_path, monkeypatch, how):
    slow, fast = Ref("slow", priority=50, sleep=SLEEP_S), Ref("fast", priority=10)
    isolated(slow, fast)
    with portakern.use_policy("fastest"):
        if how == "argument":
            out = portakern.attention(*q1, backend="slow")
        elif how == "use_backend()":
            with portakern.use_backend("slow"):
                out = portakern.attention(*q1)
        else:
            monkeypatch.setenv("PORTAKERN_BACKEND", "slow")
            out = portakern.attention(*q1)
    np.testing.assert_array_equal(out, cpu_reference(*q1))
    assert (slow.compile_calls, slow.runs, fast.compile_calls, fast.runs) == (1, 1, 0, 0)
    d = the_plan().decision
    assert (d.forced_by, d.policy, d.ranked_by, d.measured_us) == (how, "fastest", "forced", None)
    assert cache_files(tmp_path) == []


def test_one_candidate_is_not_measured(isolated, q1, tmp_path):
    only = Ref("only")
    isolated(only)
    with portakern.use_policy("fastest"):
        portakern.attention(*q1)
    assert only.runs == 1 and the_plan().decision.ranked_by == "one candidate" and cache_files(tmp_path) == []


def test_explain_before_and_after_measuring(isolated, q1):
    slow, fast = Ref("slow", priority=50, sleep=SLEEP_S), Ref("fast", priority=10)
    isolated(slow, fast)
    with portakern.use_policy("fastest"):
        before = portakern.explain(portakern.attention, *q1)
        assert (before.chosen, before.ranked_by, before.measured_us) == ("slow", "not measured yet", None)
        assert slow.runs == fast.runs == 0  # explain never executes
        portakern.attention(*q1)
        after = portakern.explain(portakern.attention, *q1)
    # after the call, explain shows the plan that call made and runs (ranked by measuring it)
    assert (after.chosen, after.ranked_by) == ("fast", "measured")
    assert "ranked by measured" in str(after) and "median" in str(after)


class TorchRef(Ref):
    """``Ref`` for torch tensors on any device (the cpu reference runs on host copies)."""

    array_kind = "torch"
    device_types = ("cpu", "cuda")

    def supports(self, op, device):
        return YES

    def compile(self, op, device):
        inner = Ref.compile(self, op, device)

        def kernel(q, k, v, out, lse, aux):
            host = np.empty(tuple(out.shape), np.float32)
            inner(*(a.cpu().numpy() for a in (q, k, v)), host, None, aux)
            out.copy_(torch.from_numpy(host).to(out.device))
        return kernel


def test_fastest_on_torch_tensors(isolated, q1, torch_device):
    """Times torch tensors on each device present (on CUDA: synchronised around every timed run)."""
    slow, fast = TorchRef("slow", priority=50, sleep=SLEEP_S), TorchRef("fast", priority=10)
    isolated(slow, fast)
    q, k, v = (torch.from_numpy(a).to(torch_device) for a in q1)
    with portakern.use_policy("fastest"):
        out = portakern.attention(q, k, v)
    assert out.device == q.device and the_plan().decision.chosen == "fast"
    np.testing.assert_array_equal(out.cpu().numpy(), cpu_reference(*q1))
