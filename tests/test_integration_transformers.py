"""``portakern.integrations.transformers``: tiny models built from configs (seeded random weights, fp32, CPU)
run with ``attn_implementation="portakern"`` give the logits and greedy tokens of transformers' own "eager"
attention -- prefill, decode with DynamicCache and StaticCache, GQA, sliding windows, Gemma-2's soft-capping, a
compiled decode step -- and ``quantize_model`` gives the logits of the same model with its Linear weights replaced
by their dequantized values. Unsupported inputs raise with their type and message."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import portakern  # noqa: E402
from portakern.integrations.transformers import (QuantLinearWithBias, portakern_attention,  # noqa: E402
                                                 quantize_model)
from portakern.torch_ops import QuantLinear  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TOL = dict(rtol=1e-4, atol=1e-4)


def _tol(device: str) -> dict:
    """fp32 on the CPU (float64 reference inside): 1e-4; on a GPU, where the triton kernels may multiply in TF32,
    1e-2 (a missing window, soft-cap or cache length moves these logits by 0.2 or more)."""
    return TOL if device == "cpu" else dict(rtol=1e-2, atol=1e-2)

LLAMA = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128,
             initializer_range=0.2)   # scores of order 1-10: windows, soft-capping and masks change the logits


def _config(kind: str):
    if kind == "llama":          # GQA 4 query heads over 2 KV heads
        return transformers.LlamaConfig(**LLAMA)
    if kind == "llama-mha":
        return transformers.LlamaConfig(**{**LLAMA, "num_key_value_heads": 4})
    if kind == "mistral":        # a sliding window on every layer, shorter than the sequences
        return transformers.MistralConfig(**LLAMA, sliding_window=6)
    if kind == "qwen2":          # a sliding layer beside a full one, biases on q/k/v
        return transformers.Qwen2Config(**LLAMA, use_sliding_window=True, sliding_window=5, max_window_layers=1,
                                        layer_types=["full_attention", "sliding_attention"])
    if kind == "gemma2":         # soft-capping, its own scaling (query_pre_attn_scalar), alternating windows
        return transformers.Gemma2Config(**LLAMA, head_dim=16, sliding_window=5, attn_logit_softcapping=7.0,
                                         final_logit_softcapping=None, query_pre_attn_scalar=24)
    raise ValueError(kind)


def _pair(kind: str, seed: int = 0, device: str = "cpu"):
    """(eager model, portakern model) with the same seeded random weights, in eval mode, on ``device``."""
    torch.manual_seed(seed)
    # one config object each: from_config records the implementation on the config it is given
    eager = transformers.AutoModelForCausalLM.from_config(_config(kind), attn_implementation="eager").eval()
    pk = transformers.AutoModelForCausalLM.from_config(_config(kind), attn_implementation="portakern").eval()
    pk.load_state_dict(eager.state_dict())
    assert eager.config._attn_implementation == "eager" and pk.config._attn_implementation == "portakern"
    return eager.to(device), pk.to(device)


def _ids(batch: int, length: int, seed: int = 1, device: str = "cpu"):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, LLAMA["vocab_size"], (batch, length), generator=g).to(device)


def _decode(model, ids, cache, steps: int):
    """Prefill ``ids`` into ``cache``, then ``steps`` greedy single-token forwards; all logits concatenated."""
    out = model(ids, past_key_values=cache, use_cache=True)
    logits = [out.logits]
    nxt = out.logits[:, -1:].argmax(-1)
    for _ in range(steps):
        out = model(nxt, past_key_values=cache, use_cache=True)
        logits.append(out.logits)
        nxt = out.logits[:, -1:].argmax(-1)
    return torch.cat(logits, 1)


def _cache(kind: str, model, max_len: int = 32):
    if kind == "dynamic":
        return transformers.DynamicCache(config=model.config)
    return transformers.StaticCache(config=model.config, max_cache_len=max_len)


def test_the_attention_function_is_registered_under_portakern():
    assert transformers.AttentionInterface._global_mapping["portakern"] is portakern_attention
    from transformers.masking_utils import AttentionMaskInterface
    assert "portakern" in AttentionMaskInterface._global_mapping


@pytest.mark.parametrize("kind", ["llama", "llama-mha", "mistral", "qwen2", "gemma2"])
def test_prefill_logits_match_eager(kind, torch_device):
    eager, pk = _pair(kind, device=torch_device)
    ids = _ids(2, 11, device=torch_device)
    with torch.no_grad():
        torch.testing.assert_close(pk(ids).logits, eager(ids).logits, **_tol(torch_device))


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2", "gemma2"])
def test_decode_steps_match_eager(kind, cache, torch_device):
    """9 prompt tokens then 4 steps: the windowed models (5 or 6 keys) slide during both phases, and the
    static cache's buffers (32 keys) are mostly empty, so valid lengths must come from the cache."""
    eager, pk = _pair(kind, device=torch_device)
    ids = _ids(2, 9, device=torch_device)
    with torch.no_grad():
        want = _decode(eager, ids, _cache(cache, eager), 4)
        got = _decode(pk, ids, _cache(cache, pk), 4)
    torch.testing.assert_close(got, want, **_tol(torch_device))


@pytest.mark.parametrize("implementation", [None, "static"])
@pytest.mark.parametrize("kind", ["llama", "gemma2"])
def test_greedy_generate_tokens_equal_eager(kind, implementation):
    eager, pk = _pair(kind)
    ids = _ids(2, 7)
    mask = torch.ones_like(ids)
    kw = dict(max_new_tokens=8, do_sample=False, attention_mask=mask, pad_token_id=0,
              cache_implementation=implementation)
    with torch.no_grad():
        want = eager.generate(ids, **kw)
        got = pk.generate(ids, **kw)
    assert want.shape == (2, 15)
    assert torch.equal(got, want)


@pytest.mark.parametrize("quantized", [False, True])
def test_a_compiled_static_cache_decode_step_matches_eager(torch_device, quantized):
    """The decode step traces as one graph (fullgraph: the mask function, the attention op and the quantized linears
    break nothing) and reads the valid length from the cache's length tensor on every call: on a GPU compiled as
    generate compiles it (reduce-overhead: CUDA graphs replayed), on the CPU with the aot_eager backend. Quantized:
    against eager attention over the dequantized weights."""
    eager, pk = _pair("llama", device=torch_device)
    if quantized:
        eager = _dequantized_reference(eager, 4, 32)
        quantize_model(pk, bits=4, group_size=32)
    ids = _ids(1, 5, device=torch_device)
    cuda = torch_device != "cpu"
    with torch.no_grad():
        ce, cp = _cache("static", eager, 16), _cache("static", pk, 16)
        nxt = eager(ids, past_key_values=ce).logits[:, -1:].argmax(-1)
        pk(ids, past_key_values=cp)
        torch._dynamo.reset()
        step = torch.compile(pk.forward, fullgraph=True,
                             **(dict(mode="reduce-overhead") if cuda else dict(backend="aot_eager")))
        for i in range(4):
            pos = torch.tensor([[5 + i]], device=torch_device)
            want = eager(input_ids=nxt, past_key_values=ce, position_ids=pos).logits
            if cuda:
                torch.compiler.cudagraph_mark_step_begin()
            got = step(input_ids=nxt, past_key_values=cp, position_ids=pos).logits
            torch.testing.assert_close(got, want, **_tol(torch_device))
            nxt = want[:, -1:].argmax(-1)


def test_generate_compiles_its_static_cache_decode_step_into_one_graph():
    """generate's own compile of the decode step (what it does on a GPU with cache_implementation="static"; here
    forced on the CPU with the aot_eager backend, fullgraph): one graph, no recompiles as the cache fills, and the
    greedy tokens of eager attention."""
    eager, pk = _pair("llama")
    ids = _ids(1, 6)
    cc = transformers.CompileConfig(backend="aot_eager", fullgraph=True, mode=None)
    cc._compile_all_devices = True   # generate compiles only on accelerators unless told
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(ids),
              cache_implementation="static")
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    with torch.no_grad():
        want = eager.generate(ids, **kw)
        got = pk.generate(ids, compile_config=cc, **kw)
    assert torch.equal(got, want)
    assert counters["stats"]["unique_graphs"] == 1 and not counters["recompiles"], dict(counters)


@pytest.mark.interpreter
@pytest.mark.parametrize("kind", ["llama", "gemma2"])
def test_the_triton_kernels_serve_the_integration_under_the_interpreter(kind):
    """The GPU path on the CPU: portakern's triton attention kernels (TRITON_INTERPRET=1) read the static cache's
    strided buffers with the valid-length tensor, the window and the soft-cap, and match eager attention."""
    eager, pk = _pair(kind)
    ids = _ids(1, 6)
    with torch.no_grad(), portakern.use_backend("triton"):
        for cache in ("static", "dynamic"):
            want = _decode(eager, ids, _cache(cache, eager, 16), 2)
            got = _decode(pk, ids, _cache(cache, pk, 16), 2)
            torch.testing.assert_close(got, want, **TOL)


def test_the_attention_function_reads_strided_bhsd_views_and_returns_bshd():
    """Called directly as transformers does: (B, H, S, D) in, (B, S, H, D) out; against SDPA with an explicit
    bottom-right causal mask over the first 6 keys of an 8-key buffer."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, h, s, 8, generator=g) for h, s in ((4, 2), (2, 8), (2, 8)))
    module = torch.nn.Module()
    out, weights = portakern_attention(module, q, k, v, torch.tensor([6, 6], dtype=torch.int32), scaling=0.3)
    assert weights is None and out.shape == (2, 2, 4, 8)
    kk, vv = k[:, :, :6].repeat_interleave(2, 1), v[:, :, :6].repeat_interleave(2, 1)
    mask = torch.tensor([[True] * 5 + [False], [True] * 6])
    want = torch.nn.functional.scaled_dot_product_attention(q, kk, vv, attn_mask=mask, scale=0.3)
    torch.testing.assert_close(out, want.transpose(1, 2), **TOL)


# -- quantize_model ----------------------------------------------------------------------------------------

def _dequantized_reference(model, bits, group_size, exclude=("lm_head",)):
    """A copy of ``model`` whose swapped Linear weights are ``portakern.quantize(...).dequantize()``."""
    import copy

    ref = copy.deepcopy(model)
    for name, m in ref.named_modules():
        if type(m) is torch.nn.Linear and not any(name == e or name.endswith("." + e) for e in exclude):
            w = portakern.quantize(m.weight.detach(), bits=bits, group_size=group_size)
            m.weight.data = torch.as_tensor(w.dequantize(), device=m.weight.device)
    return ref


@pytest.mark.parametrize("bits,group_size", [(4, 32), (8, -1)])
def test_quantize_model_matches_the_dequantized_weights(bits, group_size, torch_device):
    _, pk = _pair("qwen2", device=torch_device)   # q/k/v projections with biases
    ref = _dequantized_reference(pk, bits, group_size)
    out = quantize_model(pk, bits=bits, group_size=group_size)
    assert out is pk
    summary = pk.portakern_quantized
    assert summary["excluded"] == ["lm_head"] and summary["bits"] == bits
    assert len(summary["swapped"]) == 2 * 7   # q, k, v, o, gate, up, down per layer
    attn = pk.model.layers[0].self_attn
    assert isinstance(attn.q_proj, QuantLinearWithBias) and type(attn.o_proj) is QuantLinear
    assert type(pk.lm_head) is torch.nn.Linear
    ids = _ids(2, 9, device=torch_device)
    with torch.no_grad():
        torch.testing.assert_close(pk(ids).logits, ref(ids).logits, **_tol(torch_device))
        if torch_device == "cpu":   # the same fp32 products: the same greedy tokens
            kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(ids))
            assert torch.equal(pk.generate(ids, **kw), ref.generate(ids, **kw))


def test_quantize_model_excludes_by_suffix_and_reports_it():
    _, pk = _pair("llama")
    quantize_model(pk, bits=4, group_size=32, exclude=("lm_head", "mlp.down_proj"))
    assert pk.portakern_quantized["excluded"] == ["model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj",
                                                  "lm_head"]
    assert type(pk.model.layers[1].mlp.down_proj) is torch.nn.Linear
    assert isinstance(pk.model.layers[1].mlp.up_proj, QuantLinear)


@pytest.mark.parametrize("kwargs,exc,message", [
    (dict(bits=3), portakern.InvalidInputError, r"bits=3 is not supported by quantize_model: choose 4 or 8"),
    (dict(bits=True), portakern.InvalidInputError, r"bits=True"),
    (dict(exclude=("model.norm",)), portakern.InvalidInputError,
     r"exclude names 'model.norm', which matches 'model.norm', a LlamaRMSNorm, not an nn.Linear"),
    (dict(exclude=("nope",)), portakern.InvalidInputError, r"exclude names 'nope', which matches no module"),
    (dict(exclude="lm_head"), portakern.InvalidTypeError, r"exclude='lm_head' is a string"),
    (dict(group_size=48), portakern.InvalidInputError,
     r"group_size=48 does not divide in_features=64 of 'model.layers.0.self_attn.q_proj'"),
])
def test_quantize_model_refuses_bad_arguments(kwargs, exc, message):
    _, pk = _pair("llama")
    with pytest.raises(exc, match=message):
        quantize_model(pk, **{"group_size": 32, **kwargs})
    assert type(pk.model.layers[0].self_attn.q_proj) is torch.nn.Linear   # nothing swapped before the refusal


def test_quantize_model_refuses_a_non_module():
    with pytest.raises(portakern.InvalidTypeError, match=r"model is a dict: quantize_model takes a torch.nn.Module"):
        quantize_model({})


# -- what the attention function refuses ----------------------------------------------------------------

def test_a_padding_mask_is_refused():
    _, pk = _pair("llama")
    ids = _ids(2, 6)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0   # left padding
    with pytest.raises(NotImplementedError, match=r"attention_mask holds zeros \(padding\).*does not support "
                                                  r"padded batches"):
        pk(ids, attention_mask=mask)
    pk(ids, attention_mask=torch.ones_like(ids))   # an all-ones mask is fine


def test_dropout_in_training_is_refused():
    cfg = transformers.LlamaConfig(**LLAMA, attention_dropout=0.1)
    pk = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="portakern").train()
    with pytest.raises(NotImplementedError, match=r"dropout=0.1: attn_implementation='portakern' runs inference"):
        pk(_ids(1, 4))
    pk.eval()(_ids(1, 4))   # eval mode passes dropout 0


def test_a_custom_4d_mask_is_refused():
    _, pk = _pair("llama")
    mask = torch.zeros(1, 1, 4, 4)
    with pytest.raises(NotImplementedError, match=r"takes no explicit 4-D masks"):
        pk(_ids(1, 4), attention_mask=mask)


# -- imports and docs -------------------------------------------------------------------------------------

def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)


def test_importing_portakern_never_imports_transformers():
    p = _run("import sys, portakern, portakern.integrations, portakern.torch_ops; "
             "print('transformers' in sys.modules)")
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip() == "False"


def test_the_integration_names_the_install_when_transformers_is_absent():
    p = _run("import sys; sys.modules['transformers'] = None\n"
             "try:\n    import portakern.integrations.transformers\n"
             "except ImportError as e:\n    print(type(e).__name__, e)")
    assert p.returncode == 0, p.stderr[-2000:]
    assert "pip install transformers" in p.stdout and p.stdout.startswith("ImportError")


def test_readme_use_with_transformers_runs():
    text = (ROOT / "README.md").read_text()
    code = re.search(r"## Use with transformers\n.*?```python\n(.*?)```", text, re.S).group(1)
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)
    assert scope["tokens"].shape == (1, 12)
    assert scope["model"].portakern_quantized["excluded"] == ["lm_head"]
