"""The Triton backend launches on the tensors' GPU, not on whichever is current (Triton launches
on the current device and its stream). No second GPU here: torch.cuda's device calls are replaced."""

from __future__ import annotations

import contextlib

import pytest

torch = pytest.importorskip("torch")

from portakern.devices import Device  # noqa: E402


def _guard(monkeypatch, count, current):
    state = {"current": current, "switched": []}

    @contextlib.contextmanager
    def device(i):
        prev, state["current"] = state["current"], i
        state["switched"].append(i)
        try:
            yield
        finally:
            state["current"] = prev

    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: state["current"])
    monkeypatch.setattr(torch.cuda, "device", device)
    return state


def _on_device():
    from portakern.placement import on_device
    return on_device


def test_the_kernel_runs_with_its_device_current(monkeypatch):
    state = _guard(monkeypatch, count=2, current=0)
    seen = []
    run = _on_device()(lambda *a: seen.append((state["current"], a)) or "done", Device("cuda", 1, "GPU 1"))
    assert run(1, 2) == "done" and seen == [(1, (1, 2))] and state["switched"] == [1]
    assert state["current"] == 0                                  # the caller's device restored
    state["current"] = 1
    run(3)                                                        # already current: no switch
    assert seen[-1] == (1, (3,)) and state["switched"] == [1]


def test_one_gpu_or_the_cpu_gets_the_kernel_itself(monkeypatch):
    _guard(monkeypatch, count=1, current=0)
    k = object()
    assert _on_device()(k, Device("cuda", 0, "GPU 0")) is k
    assert _on_device()(k, Device("cpu", None, "cpu")) is k


def test_the_wrapper_keeps_the_kernel_s_attributes(monkeypatch):
    _guard(monkeypatch, count=2, current=0)

    class Kernel:
        def __init__(self):
            self.launchers = {"a": 1}

        def __call__(self, *a):
            return a

    k = Kernel()
    run = _on_device()(k, Device("cuda", 1, "GPU 1"))
    assert run is not k and run.inner is k and run.launchers == {"a": 1} and run(5) == (5,)
