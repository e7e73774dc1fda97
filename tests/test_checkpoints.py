"""portakern.load_gguf / load_awq / load_gptq on real files written here.

GGUF files are written with ``gguf.GGUFWriter`` (Q4_0 / Q8_0 / BF16 quantized by gguf-py, K-quants as raw block
bytes) and every loaded value is checked against ``gguf.quants.dequantize`` of the bytes gguf's own reader
returns. AWQ / GPTQ checkpoints are packed here bit by bit (plain Python shifts, not portakern's packers), saved
with ``safetensors.numpy`` and checked against the float64 formula ``(q - z) * s``.
"""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest

import portakern
from portakern.errors import InvalidInputError, UnsupportedError
from portakern.ir import DType, Packing
from portakern.ir import gguf_kquants as KQ

gguf = pytest.importorskip("gguf")
safetensors_numpy = pytest.importorskip("safetensors.numpy")
T = gguf.GGMLQuantizationType
RNG = np.random.default_rng(0)
W = RNG.standard_normal((8, 512)).astype(np.float32)


def write_gguf(path, tensors):
    """``tensors``: name -> (array, raw ggml type or None for a float array gguf-py types itself)."""
    w = gguf.GGUFWriter(str(path), "llama")
    for name, (arr, qtype) in tensors.items():
        if qtype is None:
            w.add_tensor(name, arr)
        else:
            w.add_tensor(name, arr, raw_shape=arr.shape, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def model_gguf(tmp_path_factory):
    kq = {name: KQ.quantize(getattr(Packing, f"GGUF_{name}"), W) for name in ("Q4_K", "Q5_K", "Q6_K")}
    return write_gguf(tmp_path_factory.mktemp("gguf") / "model.gguf", {
        "norm.weight": (W[0], None),
        "half.weight": (W.astype(np.float16), None),
        "bf16.weight": (gguf.quants.quantize(W, T.BF16), T.BF16),
        "q4_0.weight": (gguf.quants.quantize(W, T.Q4_0), T.Q4_0),
        "q8_0.weight": (gguf.quants.quantize(W, T.Q8_0), T.Q8_0),
        **{f"{n.lower()}.weight": (data, getattr(T, n)) for n, data in kq.items()},
    })


def test_load_gguf_matches_gguf_py(model_gguf):
    got = portakern.load_gguf(model_gguf)
    reader = gguf.GGUFReader(str(model_gguf))
    assert list(got) == [t.name for t in reader.tensors]
    np.testing.assert_array_equal(got["norm.weight"], W[0])
    np.testing.assert_array_equal(got["half.weight"], W.astype(np.float16))
    assert got["bf16.weight"].dtype == np.float32
    np.testing.assert_array_equal(got["bf16.weight"], gguf.quants.dequantize(reader.tensors[2].data, T.BF16))
    for t in reader.tensors[3:]:
        q = got[t.name]
        assert isinstance(q, portakern.QuantizedWeight) and q.shape == (8, 512)
        assert q.fmt.packing is getattr(Packing, f"GGUF_{t.tensor_type.name}")
        theirs = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
        np.testing.assert_array_equal(q.dequantize().view(np.uint32), theirs.view(np.uint32))


def test_gemv_on_cpu_and_exact_repack(model_gguf):
    x = RNG.standard_normal((2, 512)).astype(np.float32)
    got = portakern.load_gguf(model_gguf, repack=True)
    reader = {t.name: t for t in gguf.GGUFReader(str(model_gguf)).tensors}
    six = got["q6_k.weight"]
    assert six.fmt.packing is Packing.NATIVE and six.fmt.bits == 8 and six.fmt.scale_dtype is DType.float32
    assert got["q4_k.weight"].fmt.packing is Packing.GGUF_Q4_K        # no exact repack: kept as stored
    for name in ("q4_0.weight", "q8_0.weight", "q4_k.weight", "q5_k.weight", "q6_k.weight"):
        t = reader[name]
        w64 = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).astype(np.float64)
        np.testing.assert_array_equal(got[name].dequantize(), w64.astype(np.float32))
        y = portakern.quant_gemv(x, got[name], backend="cpu")
        np.testing.assert_allclose(y, x.astype(np.float64) @ w64.T, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("module, device", [("triton", "cuda"), ("triton_rocm", "rocm"), ("opencl", "opencl")])
def test_gpu_backends_serve_kquants_as_stored(model_gguf, module, device):
    """triton, triton-rocm and opencl run Q4_K / Q5_K (float minimums) and Q6_K as loaded, and the repacked Q6_K."""
    from portakern.devices import Device
    from portakern.ir import QuantGemv

    mod = pytest.importorskip(f"portakern.backends.{module}.quant_gemv")
    device = Device(device, 0)
    stored, repacked = portakern.load_gguf(model_gguf), portakern.load_gguf(model_gguf, repack=True)
    for weight in [stored[n] for n in KQUANTS] + [repacked["q6_k.weight"]]:
        s = mod.supports(QuantGemv(1, 8, 512, DType.float16, weight.fmt), device)
        assert s, (weight.fmt, s)


def test_unsupported_type_names_file_tensor_and_type(tmp_path):
    q2k = RNG.integers(0, 256, (4, 84), dtype=np.uint8)             # one Q2_K super-block per row
    path = write_gguf(tmp_path / "m.gguf", {"ok.weight": (W[:4], None), "q2.weight": (q2k, T.Q2_K),
                                            "cube.weight": (gguf.quants.quantize(W.reshape(2, 4, 512), T.Q8_0),
                                                            T.Q8_0)})
    with pytest.raises(UnsupportedError, match=r"m\.gguf: tensor 'q2\.weight': type Q2_K .*skip_unsupported=True"):
        portakern.load_gguf(path)
    left_out = r"left out 2 tensors.*q2\.weight \(Q2_K.*cube\.weight \(Q8_0, \(2, 4, 512\)\)"
    with pytest.warns(UserWarning, match=left_out):
        got = portakern.load_gguf(path, skip_unsupported=True)
    assert list(got) == ["ok.weight"]


def test_truncated_corrupt_and_missing_files(tmp_path, model_gguf):
    data = model_gguf.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:-300])
    with pytest.raises(InvalidInputError, match=r"cut\.gguf is not a readable GGUF file \(tensor 'q6_k\.weight' runs "
                                                r"past the end of the file"):
        portakern.load_gguf(cut)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGML" + data[4:])
    with pytest.raises(InvalidInputError, match=r"bad\.gguf is not a readable GGUF file .*corrupt"):
        portakern.load_gguf(bad)
    with pytest.raises(InvalidInputError, match=r"nothere\.gguf is not a file"):
        portakern.load_gguf(tmp_path / "nothere.gguf")


# -- AWQ / GPTQ ----------------------------------------------------------------------------------

ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def words(nibbles: np.ndarray, order=tuple(range(8))) -> np.ndarray:
    """(R, 8C) 4-bit values -> int32 (R, C), nibble i of word c = value 8c + order[i] (Python shifts)."""
    R, C8 = nibbles.shape
    out = np.zeros((R, C8 // 8), dtype=np.int64)
    for r in range(R):
        for c in range(C8 // 8):
            out[r, c] = sum(int(nibbles[r, 8 * c + order[i]]) << (4 * i) for i in range(8))
    return out.astype(np.uint32).view(np.int32)


def layer(N, K, G, seed, g_idx=False):
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 16, (N, K))
    zeros = rng.integers(1, 16, (N, K // G))
    scales = rng.uniform(0.01, 0.2, (N, K // G)).astype(np.float16)
    group = (np.arange(K) // G)[rng.permutation(K)] if g_idx else np.arange(K) // G
    ref = (codes - zeros[:, group]) * scales.astype(np.float64)[:, group]
    return codes, zeros, scales, group, ref


def awq_tensors(name, codes, zeros, scales):
    return {f"{name}.qweight": words(codes.T, ORDER), f"{name}.qzeros": words(zeros.T, ORDER),
            f"{name}.scales": np.ascontiguousarray(scales.T)}


def gptq_tensors(name, codes, zeros, scales, group=None, v2=False):
    t = {f"{name}.qweight": np.ascontiguousarray(words(codes).T), f"{name}.qzeros": words(zeros.T - (0 if v2 else 1)),
         f"{name}.scales": np.ascontiguousarray(scales.T)}
    if group is not None:
        t[f"{name}.g_idx"] = group.astype(np.int32)
    return t


def test_load_awq_folder_of_shards_with_config(tmp_path):
    refs, shard = {}, [{}, {}]
    for i, name in enumerate(["model.layers.0.self_attn.q_proj", "model.layers.0.mlp.up_proj",
                              "model.layers.1.mlp.down_proj"]):
        codes, zeros, scales, _, refs[name] = layer(16, 128, 32, seed=i)
        shard[i % 2].update(awq_tensors(name, codes, zeros, scales))
    shard[0]["model.embed_tokens.weight"] = np.ones((4, 4), np.float16)
    for i, s in enumerate(shard):
        safetensors_numpy.save_file(s, str(tmp_path / f"model-0000{i + 1}-of-00002.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {
        "quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemm", "zero_point": True}}))
    got = portakern.load_awq(tmp_path)
    assert sorted(got) == sorted(refs)
    for name, ref in refs.items():
        assert got[name].fmt.packing is Packing.AWQ and got[name].fmt.group_size == 32
        np.testing.assert_array_equal(got[name].dequantize(), ref.astype(np.float32))
    assert list(portakern.load_awq(tmp_path, prefix="model.layers.1.")) == ["model.layers.1.mlp.down_proj"]
    with pytest.raises(InvalidInputError, match=r"group_size=64 was passed but .*config\.json says group_size=32"):
        portakern.load_awq(tmp_path, group_size=64)
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"bits": 4, "version": "gemv"}}))
    with pytest.raises(UnsupportedError, match="AWQ version 'gemv'"):
        portakern.load_awq(tmp_path)


def test_load_gptq_file_state_dict_g_idx_and_v2(tmp_path):
    codes, zeros, scales, group, ref = layer(16, 256, 64, seed=5, g_idx=True)
    c2, z2, s2, _, ref2 = layer(8, 128, 128, seed=6)
    path = tmp_path / "model.safetensors"
    safetensors_numpy.save_file({**gptq_tensors("a", codes, zeros, scales, group), **gptq_tensors("b", c2, z2, s2)},
                                str(path))
    got = portakern.load_gptq(path)                                  # no config: group sizes read off the shapes
    assert got["a"].fmt.has_g_idx and got["a"].fmt.group_size == 64 and got["b"].fmt.group_size == 128
    np.testing.assert_array_equal(got["a"].dequantize(), ref.astype(np.float32))
    np.testing.assert_array_equal(got["b"].dequantize(), ref2.astype(np.float32))
    # a state dict, and the v2 zero points named by the config beside a file
    sd = gptq_tensors("c", c2, z2, s2, v2=True)
    np.testing.assert_array_equal(portakern.load_gptq(sd, checkpoint_format="gptq_v2")["c"].dequantize(),
                                  ref2.astype(np.float32))
    safetensors_numpy.save_file(sd, str(tmp_path / "v2.safetensors"))
    (tmp_path / "quantize_config.json").write_text(json.dumps({"bits": 4, "group_size": 128,
                                                               "checkpoint_format": "gptq_v2"}))
    np.testing.assert_array_equal(portakern.load_gptq(tmp_path / "v2.safetensors")["c"].dequantize(),
                                  ref2.astype(np.float32))
    (tmp_path / "quantize_config.json").write_text(json.dumps({"bits": 8, "group_size": 128}))
    with pytest.raises(UnsupportedError, match=r"v2\.safetensors: bits=8: load_gptq reads 4-bit"):
        portakern.load_gptq(tmp_path / "v2.safetensors")


def test_checkpoint_errors_name_file_and_tensor(tmp_path):
    codes, zeros, scales, _, _ = layer(16, 128, 32, seed=1)
    t = awq_tensors("proj", codes, zeros, scales)
    del t["proj.qzeros"]
    path = tmp_path / "m.safetensors"
    safetensors_numpy.save_file(t, str(path))
    with pytest.raises(InvalidInputError, match=r"m\.safetensors: layer 'proj' has a qweight but no tensor "
                                                r"'proj\.qzeros'"):
        portakern.load_awq(path)
    full = tmp_path / "full.safetensors"
    safetensors_numpy.save_file(awq_tensors("proj", codes, zeros, scales), str(full))
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(full.read_bytes()[:-40])
    with pytest.raises(InvalidInputError, match=r"cut\.safetensors is not a readable safetensors file.*truncated"):
        portakern.load_awq(cut)
    with pytest.raises(InvalidInputError, match=r"no tensor named '<layer>\.qweight' under prefix='x\.'; layers "
                                                r"found: proj"):
        portakern.load_awq(full, prefix="x.")
    bad = awq_tensors("proj", codes, zeros, scales)
    bad["proj.scales"] = bad["proj.scales"][:, :8]
    with pytest.raises(InvalidInputError, match=r"state dict: layer 'proj': .*scales"):
        portakern.load_awq(bad, group_size=32)
    with pytest.raises(InvalidInputError, match=r"nothere is not a file"):
        portakern.load_gptq(tmp_path / "nothere")


def test_load_gguf_quiet_on_a_clean_file(model_gguf):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(portakern.load_gguf(model_gguf)) == 8


def test_readme_example_runs(tmp_path, monkeypatch):
    """README's "Loading checkpoints" snippet runs as written and computes x @ W^T of the file's weight."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    code = re.search(r"## Loading checkpoints\n.*?```python\n(.*?)```", text, re.S).group(1)
    monkeypatch.chdir(tmp_path)                                      # the snippet writes tiny.gguf here
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)
    data = gguf.GGUFReader("tiny.gguf").tensors[0].data
    w64 = gguf.quants.dequantize(np.asarray(data), T.Q8_0).astype(np.float64)
    np.testing.assert_allclose(scope["y"], np.ones((1, 256)) @ w64.T, rtol=1e-5, atol=1e-4)


# -- the device kernels on a loaded file -----------------------------------------------------------

GPU_SERVED = ("q4_0.weight", "q8_0.weight", "q6_k.weight")        # q6_k through load_gguf(repack=True)
#: the K-quants as stored (no repack), which the triton backend runs too
KQUANTS = ("q4_k.weight", "q5_k.weight", "q6_k.weight")


def _reference(model_gguf, name, x):
    t = {t.name: t for t in gguf.GGUFReader(str(model_gguf)).tensors}[name]
    return x.astype(np.float64) @ gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).astype(np.float64).T


def test_opencl_runs_the_served_types(model_gguf):
    from opencl_helpers import require_opencl, to_cl

    dev, queue = require_opencl()
    got, stored = portakern.load_gguf(model_gguf, repack=True), portakern.load_gguf(model_gguf)
    x = RNG.standard_normal((3, 512)).astype(np.float32)
    for weight, name in [(got[n], n) for n in GPU_SERVED] + [(stored[n], n) for n in KQUANTS]:
        y = portakern.quant_gemv(to_cl(queue, x), weight.to(str(dev)), backend="opencl").get()
        ref = _reference(model_gguf, name, x)
        np.testing.assert_allclose(y, ref, rtol=0, atol=1e-5 * np.abs(ref).max())


def _torch_values(model_gguf, device):
    torch = pytest.importorskip("torch")
    got = portakern.load_gguf(model_gguf, repack=True)
    x = RNG.standard_normal((2, 512)).astype(np.float32)
    stored = portakern.load_gguf(model_gguf)
    for weight, name in [(got[n], n) for n in GPU_SERVED] + [(stored[n], n) for n in KQUANTS]:
        y = portakern.quant_gemv(torch.from_numpy(x).to(device), weight.to(device), backend="triton")
        ref = _reference(model_gguf, name, x)
        np.testing.assert_allclose(y.cpu().numpy(), ref, rtol=0, atol=1e-5 * np.abs(ref).max())
    from portakern.checkpoints import split_mins

    sums = torch.from_numpy(x.reshape(2, 16, 32).sum(axis=-1, dtype=np.float32)).to(device)
    for name in ("q4_k.weight", "q5_k.weight"):                     # the exact two-GEMV form
        scaled, mins = (w.to(device) for w in split_mins(got[name]))
        y = portakern.quant_gemv(torch.from_numpy(x).to(device), scaled, backend="triton") - \
            portakern.quant_gemv(sums, mins, backend="triton")
        ref = _reference(model_gguf, name, x)
        np.testing.assert_allclose(y.cpu().numpy(), ref, rtol=0, atol=1e-5 * np.abs(ref).max())


@pytest.mark.interpreter
def test_triton_interpreter_runs_the_served_types(model_gguf):
    _torch_values(model_gguf, "cpu")


def test_triton_on_cuda_runs_the_served_types(model_gguf):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device here: the interpreter test covers the lowering on the CPU")
    _torch_values(model_gguf, "cuda")


def test_loaded_arrays_are_copy_on_write_views(model_gguf, tmp_path):
    """Loading maps the file (no copy); writing to a loaded array never changes the file."""
    before = model_gguf.read_bytes()
    got = portakern.load_gguf(model_gguf)
    assert isinstance(got["norm.weight"].base, np.memmap) or isinstance(got["norm.weight"], np.memmap)
    got["norm.weight"][:] = 0
    got["q8_0.weight"].tensors["data"][:] = 0
    del got
    assert model_gguf.read_bytes() == before


def test_repack_exact_reads_host_torch_tensors_and_leaves_other_weights(model_gguf):
    from portakern.checkpoints import repack_exact

    torch = pytest.importorskip("torch")
    got = portakern.load_gguf(model_gguf)
    six = got["q6_k.weight"]
    on_torch = six.with_tensors({"data": torch.from_numpy(np.asarray(six.tensors["data"]).copy())})
    np.testing.assert_array_equal(repack_exact(on_torch).dequantize(), six.dequantize())
    for name in ("q4_0.weight", "q8_0.weight", "q4_k.weight", "q5_k.weight"):
        assert repack_exact(got[name]) is got[name]


def test_split_mins_is_exact_and_two_gemvs_give_the_product(model_gguf):
    from portakern.checkpoints import split_mins

    got = portakern.load_gguf(model_gguf)
    x = RNG.standard_normal((3, 512)).astype(np.float32)
    sums = x.reshape(3, 16, 32).sum(axis=-1, dtype=np.float32)
    for name in ("q4_k.weight", "q5_k.weight"):
        scaled, mins = split_mins(got[name])
        assert scaled.shape == (8, 512) and mins.shape == (8, 16) and scaled.fmt.packing is Packing.NATIVE
        from portakern.ir import packing as P
        whole = P.dequantize(got[name].fmt, dict(got[name].tensors), 8, 512)
        parts = P.dequantize(scaled.fmt, scaled.tensors, 8, 512) - \
            np.repeat(P.dequantize(mins.fmt, mins.tensors, 8, 16), 32, axis=1)
        np.testing.assert_array_equal(parts, whole)                                  # bit for bit, in float64
        y = portakern.quant_gemv(x, scaled, backend="cpu") - portakern.quant_gemv(sums, mins, backend="cpu")
        ref = _reference(model_gguf, name, x)
        np.testing.assert_allclose(y, ref, rtol=0, atol=1e-5 * np.abs(ref).max())
    with pytest.raises(InvalidInputError, match="split_mins takes a GGUF Q4_K or Q5_K weight"):
        split_mins(got["q6_k.weight"])


def test_split_mins_runs_on_opencl(model_gguf):
    from opencl_helpers import require_opencl, to_cl

    from portakern.checkpoints import split_mins

    dev, queue = require_opencl()
    x = RNG.standard_normal((2, 512)).astype(np.float32)
    sums = x.reshape(2, 16, 32).sum(axis=-1, dtype=np.float32)
    for name in ("q4_k.weight", "q5_k.weight"):
        scaled, mins = (w.to(str(dev)) for w in split_mins(portakern.load_gguf(model_gguf)[name]))
        y = portakern.quant_gemv(to_cl(queue, x), scaled, backend="opencl").get() - \
            portakern.quant_gemv(to_cl(queue, sums), mins, backend="opencl").get()
        ref = _reference(model_gguf, name, x)
        np.testing.assert_allclose(y, ref, rtol=0, atol=1e-5 * np.abs(ref).max())
