"""KernelLaunch: later launches bypass Triton's binding only when Triton would pick the same kernel.

A stand-in JIT function records what ``fn[grid](...)`` (Triton's path) and the compiled kernel's
``run`` (the fast path) receive; the driver and the runtime knobs are stand-ins too, so the guard's
every branch runs on the CPU. The real launches are checked on the GPU by
``test_triton_gemv.py::test_gpu_fast_launch_values``.
"""

from __future__ import annotations

import types

import numpy as np
import pytest

pytest.importorskip("triton")

from portakern.backends.triton.common import switches  # noqa: E402
from portakern.backends.triton.common.launch import KernelLaunch  # noqa: E402


def _kernel_py(x_ptr, out_ptr, n, stride, BLOCK, FLAG=True):   # the stand-in kernel's signature
    pass


class _Tensor:
    def __init__(self, ptr, dtype="bf16"):
        self.ptr, self.dtype = ptr, dtype

    def data_ptr(self):
        return self.ptr


class _Compiled:
    function, packed_metadata = "fn-handle", "meta"

    def __init__(self, log):
        self.log = log

    def run(self, *a):
        self.log.append(("fast", a))


class _JIT:
    """``fn[grid](*args, **kw)`` as Triton's JITFunction: launches (logged) and returns the compiled kernel."""

    fn = staticmethod(_kernel_py)
    __name__ = "stand_in"

    def __init__(self):
        self.log = []
        self.compiled = _Compiled(self.log)

    def __getitem__(self, grid):
        def runner(*args, **kw):
            self.log.append(("slow", grid, args, kw))
            return self.compiled
        return runner


class _Driver:
    device = 0

    def get_current_device(self):
        return self.device

    def get_current_stream(self, device):
        return 1000 + device


@pytest.fixture()
def fake_triton(monkeypatch):
    """Triton's active driver and runtime knobs replaced by stand-ins the test can change."""
    import triton
    import triton.runtime

    drv = _Driver()
    # Triton 3.6 keeps empty hook chains (no hook installed); earlier versions None
    rt = types.SimpleNamespace(launch_enter_hook=types.SimpleNamespace(calls=[]), launch_exit_hook=None)
    monkeypatch.setattr(triton.runtime, "driver", types.SimpleNamespace(active=drv))
    monkeypatch.setattr(triton, "knobs", types.SimpleNamespace(runtime=rt))
    monkeypatch.delenv(switches.FAST_LAUNCH_ENV, raising=False)
    return drv, rt


def _kinds(jit):
    return [e[0] for e in jit.log]


def test_first_call_binds_later_calls_launch_directly(fake_triton):
    jit = _JIT()
    ln = KernelLaunch(jit, (4, 2), {"BLOCK": 64}, {"num_warps": 4})
    x, out = _Tensor(4096), _Tensor(8192)
    ln(x, out, 100, 7)
    assert jit.log[0] == ("slow", (4, 2), (x, out, 100, 7), {"BLOCK": 64, "num_warps": 4})
    x2 = _Tensor(4096 + 64)
    ln(x2, out, 100, 7)
    kind, a = jit.log[1]
    # grid padded to three, the stream of the current device, no metadata or hooks, then every parameter in
    # signature order: the runtime ones, the constexpr and the default of the one left out
    assert kind == "fast" and a == (4, 2, 1, 1000, "fn-handle", "meta", None, None, None, x2, out, 100, 7, 64, True)
    assert (ln.slow_calls, ln.fast_calls) == (1, 1)


@pytest.mark.parametrize("change", ["misaligned", "int", "none", "not_none", "not_tensor", "device", "hook",
                                    "hook_chain", "dtype", "float_for_int", "bool_for_int", "extra_arg",
                                    "tensor_for_int"])
def test_guard_falls_back_to_triton(fake_triton, change):
    drv, rt = fake_triton
    jit = _JIT()
    ln = KernelLaunch(jit, (1,), {"BLOCK": 64}, {})
    x, out = _Tensor(4096), _Tensor(8192)
    ln(x, out, None, 7)
    args = [_Tensor(512), out, None, 7]
    if change == "misaligned":
        args[0] = _Tensor(4096 + 8)   # 8-byte aligned: Triton would not assume 16
    elif change == "int":
        args[3] = 1                   # Triton specialises integers equal to 1
    elif change == "none":
        args[1] = None
    elif change == "not_none":
        args[2] = _Tensor(256)
    elif change == "not_tensor":
        args[0] = 3
    elif change == "device":
        drv.device = 1
    elif change == "hook":
        rt.launch_exit_hook = lambda *a: None
    elif change == "hook_chain":
        rt.launch_enter_hook.calls.append(lambda *a: None)
    elif change == "dtype":
        args[0] = _Tensor(512, "fp16")   # same element size, another compiled kernel
    elif change == "float_for_int":
        args[3] = 7.0                 # equal in Python, a float argument to Triton
    elif change == "bool_for_int":
        ln(x, out, None, 1)           # the kernel compiled for the integer 1 ...
        args[3] = True                # ... is not the one for a bool, though 1 == True
    elif change == "extra_arg":
        args.append(5)                # would shift every later argument of the compiled launcher
    elif change == "tensor_for_int":
        args[3] = np.array([7, 7])    # compares equal element-wise; its truth raised in the guard
    ln(*args)
    if change == "bool_for_int":
        assert _kinds(jit) == ["slow", "slow", "slow"]
        return
    assert _kinds(jit) == ["slow", "slow"]


def test_the_latest_triton_call_becomes_the_fast_one(fake_triton):
    jit = _JIT()
    ln = KernelLaunch(jit, (1,), {"BLOCK": 64}, {})
    out = _Tensor(0)
    ln(_Tensor(16), out, 5, 7)
    ln(_Tensor(16), out, 5, 9)    # new stride: Triton's path, then fast for stride 9
    ln(_Tensor(32), out, 5, 9)
    ln(_Tensor(32), out, 5, 7)    # back to 7: Triton's path again
    assert _kinds(jit) == ["slow", "slow", "fast", "slow"]


def test_misaligned_first_call_keeps_triton_path(fake_triton):
    jit = _JIT()
    ln = KernelLaunch(jit, (1,), {"BLOCK": 64}, {})
    ln(_Tensor(4), _Tensor(0), 5, 7)
    ln(_Tensor(16), _Tensor(0), 5, 7)   # Triton compiled the first without alignment; the second binds anew
    ln(_Tensor(16), _Tensor(0), 5, 7)
    assert _kinds(jit) == ["slow", "slow", "fast"]


@pytest.mark.parametrize("how", ["interpret", "env", "switch"])
def test_fast_path_off(fake_triton, monkeypatch, how):
    if how == "env":
        monkeypatch.setenv(switches.FAST_LAUNCH_ENV, "off")
    jit = _JIT()
    ln = KernelLaunch(jit, (1,), {"BLOCK": 64}, {}, interpret=how == "interpret")
    ln(_Tensor(16), _Tensor(0), 5, 7)
    if how == "switch":   # off after the fast kernel was recorded: it is not used, nor re-recorded
        assert ln.set_fast(False) is True
    for _ in range(3):
        ln(_Tensor(16), _Tensor(0), 5, 7)
    if how == "switch":   # the launcher's own state: back on, the next kernel Triton's path records is the fast one
        ln.set_fast(True)
    assert _kinds(jit) == ["slow"] * 4
    ln(_Tensor(16), _Tensor(0), 5, 7)
    ln(_Tensor(16), _Tensor(0), 5, 7)
    assert _kinds(jit)[4:] == (["slow"] * 2 if how != "switch" else ["slow", "fast"])


def test_compiled_kernel_without_a_launcher_keeps_triton_path(fake_triton):
    jit = _JIT()
    jit.compiled = object()   # a Triton whose compiled kernels have no run / function / packed_metadata
    ln = KernelLaunch(jit, (1,), {"BLOCK": 64}, {})
    for _ in range(3):
        ln(_Tensor(16), _Tensor(0), 5, 7)
    assert _kinds(jit) == ["slow"] * 3 and not ln.fast_ok


def test_parameter_neither_positional_nor_constexpr_is_named(fake_triton):
    ln = KernelLaunch(_JIT(), (1,), {}, {})
    with pytest.raises(TypeError, match=r"KernelLaunch of stand_in: parameter 'BLOCK' was given neither"):
        ln(_Tensor(16), _Tensor(0), 5, 7)


def test_numpy_and_float_scalars_are_compared_by_value(fake_triton):
    jit = _JIT()
    ln = KernelLaunch(jit, (1,), {"BLOCK": 64}, {})
    out = _Tensor(0)
    ln(_Tensor(16), out, np.int64(5), 0.5)
    ln(_Tensor(16), out, np.int64(5), 0.5)   # same values: fast
    ln(_Tensor(16), out, np.int64(1), 0.5)   # Triton would specialise the 1
    ln(_Tensor(16), out, np.int64(1), 0.25)  # a float changed: Triton's path too (stricter than Triton)
    assert _kinds(jit) == ["slow", "fast", "slow", "slow"]
