"""The opencl backend's refusals, errors and device plumbing: supports() reasons, build failures as portakern
errors with the build log, bad inputs, device naming, registration."""

from __future__ import annotations

import numpy as np
import pytest

import portakern
from portakern.devices import Device, parse_device
from portakern.errors import BackendError, InvalidInputError, InvalidTypeError, UnsupportedError
from portakern.ir.ops import Attention, QuantGemv
from portakern.ir.quant import QuantFormat

from opencl_helpers import require_opencl, to_cl


@pytest.fixture(scope="module")
def cl_dev():
    return require_opencl()


def _backend():
    return portakern.api.registry().get("opencl")


def _attn(**kw):
    base = dict(batch=1, seqlen_q=4, seqlen_k=8, heads_q=2, heads_kv=1, head_dim=64, head_dim_v=64,
                dtype="float32", scale=0.125)
    return Attention(**{**base, **kw})


def test_registered_through_the_entry_point_with_its_capabilities(cl_dev):
    be = _backend()
    assert be.name == "opencl" and be.array_kind == "pyopencl" and "opencl" in be.device_types
    assert 0 < be.priority < portakern.api.registry().get("triton").priority
    assert be.status() == "ok" and be.version.startswith("pyopencl ") and "Portable Computing Language" in be.version
    assert "silu_mul" in be.x_prologues


def test_supports_refuses_with_reasons_naming_argument_rule_and_way_out(cl_dev):
    dev, _ = cl_dev
    be = _backend()
    s = be.supports(_attn(head_dim=600, head_dim_v=64), dev)
    assert not s and "head_dim=600" in s.reason and "512" in s.reason and "backend='cpu'" in s.reason
    s = be.supports(_attn(dtype="bfloat16"), dev)
    assert not s and "bfloat16" in s.reason and "backend='opencl'" in s.reason
    assert be.supports(_attn(dtype="bfloat16"), portakern.devices()[0])      # host torch bf16: carried as fp32
    cuda = Device("cuda", 0, arch="sm_90", capability=(9, 0), warp_size=32)
    s = be.supports(_attn(), cuda)
    assert not s and "cuda" in s.reason and "pyopencl arrays" in s.reason
    assert be.supports(_attn(head_dim=59, head_dim_v=111), dev)
    assert be.supports(QuantGemv(3, 16, 64, "float16", QuantFormat(4, 32, True)), dev)


def test_unsupported_problem_raises_with_the_reason(cl_dev, rng):
    _, queue = cl_dev
    q = rng.standard_normal((1, 2, 1, 600)).astype(np.float32)
    with pytest.raises(UnsupportedError, match="head_dim=600"):
        portakern.attention(to_cl(queue, q), to_cl(queue, q), to_cl(queue, q[..., :8]), backend="opencl")


def test_build_failure_is_a_backend_error_with_the_build_log(cl_dev, monkeypatch):
    dev, queue = cl_dev
    from portakern.backends.opencl import attention as A

    monkeypatch.setattr(A, "kernel_source", lambda name: "__kernel void pk_attention() { this is not C; }")
    kernel = A.compile(_attn(head_dim=8, head_dim_v=8), dev)
    x = to_cl(queue, np.zeros((1, 4, 2, 8), np.float32))
    kv = to_cl(queue, np.zeros((1, 8, 1, 8), np.float32))
    import pyopencl.array as cla
    with pytest.raises(BackendError) as e:
        kernel(x, kv, kv, cla.empty(queue, (1, 4, 2, 8), np.float32), None, {})
    msg = str(e.value)
    assert "backend 'opencl'" in msg and "attention" in msg and "build log" in msg and "this" in msg


def test_mixed_array_libraries_and_devices_are_refused(cl_dev, rng):
    _, queue = cl_dev
    q = rng.standard_normal((1, 3, 2, 16)).astype(np.float32)
    with pytest.raises(InvalidTypeError, match="mixed array"):
        portakern.attention(to_cl(queue, q), q, q)
    with pytest.raises(InvalidInputError, match="stride"):
        portakern.attention(to_cl(queue, q)[..., ::2], to_cl(queue, q)[..., ::2], to_cl(queue, q)[..., ::2])


def test_device_names_are_flat_and_parse(cl_dev):
    dev, queue = cl_dev
    ocl = [d for d in portakern.devices() if d.type == "opencl"]
    assert [d.index for d in ocl] == list(range(len(ocl)))               # unique across platforms
    assert str(dev) == "opencl:0" and parse_device("opencl:0") == dev and parse_device("opencl") == dev
    info = dict(dev.info)
    assert {"platform", "platform_index", "device_index", "device_type"} <= set(info)
    with pytest.raises(InvalidInputError, match="opencl:0"):
        parse_device(f"opencl:{len(ocl) + 5}")
    from portakern.arrays import device_of, kind_of
    a = to_cl(queue, np.zeros(3, np.float32))
    assert kind_of(a) == "pyopencl" and device_of(a, "pyopencl") == dev


def test_quantized_weight_to_opencl_and_bad_target(cl_dev):
    w = portakern.quantize(np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32), group_size=32)
    wd = w.to("opencl:0")
    assert wd.device.type == "opencl" and wd.to("opencl") is wd
    np.testing.assert_array_equal(wd.dequantize().get(), w.dequantize())
    with pytest.raises(InvalidInputError, match="not present"):
        w.to("opencl:99")


def test_cli_explain_on_the_opencl_device(cl_dev, capsys):
    from portakern.cli import main

    assert main(["explain", "attention", "--shape", "1,1,300,8,2,64", "--causal", "--device", "opencl:0",
                 "--dtype", "fp16"]) == 0
    out = capsys.readouterr().out
    assert "chosen   opencl" in out and "device   opencl:0" in out
    assert main(["explain", "quant_gemv", "--shape", "3,64,256", "--bits", "4", "--group-size", "32",
                 "--device", "opencl:0", "--dtype", "fp32"]) == 0
    assert "chosen   opencl" in capsys.readouterr().out
    assert main(["explain", "attention", "--shape", "1,1,64,4,1,64", "--device", "opencl:0"]) == 2   # bf16 default
    assert "pyopencl arrays have no bfloat16" in capsys.readouterr().err


def test_host_arrays_name_a_missing_opencl_device(cl_dev, monkeypatch):
    from portakern import opencl_runtime as R

    monkeypatch.setenv("PORTAKERN_OPENCL_DEVICE", "7")
    with pytest.raises(InvalidInputError, match=r"PORTAKERN_OPENCL_DEVICE='7' names no OpenCL device: present are "
                                                r"opencl:0"):
        R.default_device()
    monkeypatch.setenv("PORTAKERN_OPENCL_DEVICE", "opencl:0")
    assert R.default_device() == cl_dev[0]
    monkeypatch.setattr(R, "devices", lambda: [])
    with pytest.raises(InvalidInputError, match=r"no OpenCL device is present: install an OpenCL driver .*"
                                                r"backend='cpu'"):
        R.default_device()


def test_an_opencl_device_portakern_does_not_list_is_named(cl_dev, monkeypatch):
    from portakern import opencl_runtime as R

    with pytest.raises(InvalidInputError, match=r"device opencl:9 is not an OpenCL device present here: present "
                                                r"OpenCL devices are opencl:0"):
        R.cl_device(Device("opencl", 9))
    monkeypatch.setattr(R, "_by_pointer", lambda: {})   # an array made on a device of a platform loaded later
    with pytest.raises(InvalidTypeError, match=r"is not one portakern lists \(portakern.devices\(\)\); create the "
                                               r"array on a listed device"):
        R.device_for(cl_dev[1].device)
