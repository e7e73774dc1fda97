"""End-to-end batch-1 decode of a Llama-3-8B-shaped transformers model on portakern, beside transformers' own paths.

A model built from a config with random weights (bf16, no download), batch 1, a prompt of --ctx tokens, greedy
tokens. Families: ``portakern`` (``quantize_model``: every Linear but lm_head int4 g128 through
``torch.ops.portakern.quant_gemv``; attention ``attn_implementation="portakern"``), ``bf16`` (transformers' SDPA) and
``torchao`` (int4 g128 weight-only, tinygemm layout, lm_head bf16; skipped with the reason where torchao does not
import). Each family in two modes, in one process:

- ``generate``: ``model.generate(..., cache_implementation="static")``, which compiles the decode step itself
  (torch.compile, reduce-overhead: CUDA graphs). ms/token = ``(t(new + 1 tokens) - t(1 token)) / new``, so the
  prefill cancels;
- ``loop``: the model's forward compiled (reduce-overhead, fullgraph) and called in a plain Python loop over a
  StaticCache, one token a call, no ``generate``.

The floor is the bytes one token must read (every weight but the embedding table as stored -- int4 codes, scales and
zeros; bf16 elsewhere -- plus the KV cache at the mean length) over the copy bandwidth measured in the same run;
``frac_floor`` = floor / measured. ``generate_overhead_ms`` is generate's minus the loop's ms/token per family. With
``--layers N`` (< 32) every figure, the floor included, is for that N-layer model (lm_head and embedding unchanged):
measured, not scaled. ``--dry-run`` runs every mode on a 2-layer tiny config on the CPU (compile with the eager
backend, a few tokens) to check the code path; its figures mean nothing. ``--profile``: each loop mode's step is
also replayed under the profiler and its span attributed to kernels (``step_timing.exposed_times``: the time by which
each kernel moved the finish line, and the idle time when none ran), grouped by who launched them.
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402  (benchmarks/harness.py)

FAMILIES = ("portakern", "bf16", "torchao")
MODES = tuple(f"{f}-{m}" for f in FAMILIES for m in ("generate", "loop"))
#: --quick: the portakern pair and each peer's plain loop (the anchors file has the peers' generate figures)
QUICK = ("portakern-generate", "portakern-loop", "bf16-loop", "torchao-loop")
#: Llama-3-8B's shapes (the anchors' config)
LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
                 tie_word_embeddings=False)
TINY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=512, max_position_embeddings=512, tie_word_embeddings=False)
#: the issue's targets: loop >= 70% of the floor and >= 3x torchao's loop; generate >= 2.5x torchao's generate
TARGETS = {"loop_frac_floor": 0.70, "loop_vs_torchao": 3.0, "generate_vs_torchao": 2.5}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ctx", type=int, default=2048, help="prompt tokens (default 2048)")
    ap.add_argument("--new", type=int, default=128, help="timed tokens per repeat (default 128)")
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats per mode; the best and the median kept")
    ap.add_argument("--layers", type=int, default=32, help="decoder layers (default 32, Llama-3-8B); fewer saves "
                    "time and memory, and every figure is then for that model")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma list of {', '.join(MODES)}")
    ap.add_argument("--quick", action="store_true", help=f"--new 32 --repeats 2 --modes {','.join(QUICK)} "
                    "(fits a 10-minute command on an H100 at 32 layers)")
    ap.add_argument("--budget-s", type=float, default=480.0, help="skip (and record) modes that would start after "
                    "this many seconds (default 480)")
    ap.add_argument("--dry-run", action="store_true", help="a 2-layer tiny config on the CPU, a few tokens: checks "
                    "the code path, measures nothing")
    ap.add_argument("--profile", action="store_true", help="per-kernel breakdown of each loop mode's step (CUDA "
                    "profiler): the time each kernel family moves the step's end, and the idle time")
    ap.add_argument("--out", default=harness.default_out(), help="folder of the JSON (default $OUT or "
                    "benchmarks/results)")
    ap.add_argument("--tag", default="", help="added to the result name (e.g. -quick)")
    a = ap.parse_args(argv)
    if a.quick:
        a.new, a.repeats, a.modes = min(a.new, 32), min(a.repeats, 2), ",".join(QUICK)
    if a.dry_run:
        a.ctx, a.new, a.repeats, a.layers = min(a.ctx, 8), min(a.new, 2), 1, 2
    modes = [m for m in a.modes.split(",") if m]
    bad = [m for m in modes if m not in MODES]
    if bad:
        ap.error(f"--modes names {bad}: choose from {', '.join(MODES)}")
    a.modes = modes
    return a


class Run:
    """One run's settings: device, config, bandwidth, timers."""

    def __init__(self, a):
        import transformers

        self.a = a
        self.dev = "cpu" if a.dry_run or not torch.cuda.is_available() else "cuda"
        self.cfg = transformers.LlamaConfig(**{**(TINY if a.dry_run else LLAMA3_8B), "num_hidden_layers": a.layers})
        self.cfg.eos_token_id = self.cfg.pad_token_id = 0
        self.copy_TBps = copy_bandwidth(self.dev)
        self.warm_calls = 1 if a.dry_run else 2   # compile, capture, then replay at least once before timing
        g = torch.Generator().manual_seed(0)
        self.prompt = torch.randint(1, self.cfg.vocab_size, (1, a.ctx), generator=g).to(self.dev)
        hd = self.cfg.hidden_size // self.cfg.num_attention_heads
        self.kv_bytes = int(2 * a.layers * self.cfg.num_key_value_heads * hd * 2 * (a.ctx + a.new / 2))

    def sync(self):
        if self.dev == "cuda":
            torch.cuda.synchronize()

    def compile(self, fn):
        """``fn`` compiled as transformers compiles its decode step: reduce-overhead (CUDA graphs), fullgraph;
        the eager backend on the CPU (dry run)."""
        if self.dev == "cuda":
            return torch.compile(fn, mode="reduce-overhead", fullgraph=True)
        return torch.compile(fn, backend="eager", fullgraph=True)


def copy_bandwidth(dev: str) -> float:
    """Device-to-device copy TB/s (bytes read + written) of 1 GiB copies; a nominal 0.01 on the CPU (dry run)."""
    if dev != "cuda":
        return 0.01
    from timing import copy_bandwidth_TBps   # benchmarks/timing.py

    return copy_bandwidth_TBps()


# -- models ------------------------------------------------------------------------------------------------

def build(r: Run, family: str):
    """The model of ``family`` on the run's device, eval mode, seeded random bf16 weights (fp32 on the CPU)."""
    import transformers

    attn = {"portakern": "portakern", "bf16": "sdpa", "torchao": "sdpa"}[family]
    if family == "portakern":
        import portakern.integrations.transformers  # noqa: F401  (registers "portakern")
    dtype = torch.bfloat16 if r.dev == "cuda" else torch.float32
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**r.cfg.to_dict())
    with torch.device(r.dev):
        m = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=dtype)
    m.eval()
    if family == "portakern":
        from portakern.integrations.transformers import quantize_model

        quantize_model(m, bits=4, group_size=128, exclude=("lm_head",))
    elif family == "torchao":
        from torchao.quantization import Int4WeightOnlyConfig, quantize_

        quantize_(m, Int4WeightOnlyConfig(group_size=128, int4_packing_format="tile_packed_to_4d"),
                  filter_fn=lambda mod, fqn: isinstance(mod, torch.nn.Linear) and "lm_head" not in fqn)
    return m


def weight_bytes(m, family: str) -> int:
    """Bytes one token reads from the weights: every parameter and weight buffer but the embedding table, as
    stored (portakern: one copy of the int4 codes with scales, zeros and bias -- not the fragment copy, which M = 1
    does not read; torchao: int4 codes plus a bf16 scale and zero per 128, as the anchors count it)."""
    from portakern.torch_ops import QuantLinear

    n = 0
    for name, mod in m.named_modules():
        if isinstance(mod, QuantLinear):
            codes = mod.qweight if mod.qweight is not None else mod.frag   # a fragments-only module holds no words
            n += sum(t.numel() * t.element_size() for t in (codes, mod.scales, mod.zeros, getattr(mod, "bias", None))
                     if t is not None)
            continue
        for pname, p in mod.named_parameters(recurse=False):
            if "embed_tokens" in name:
                continue
            if family == "torchao" and p.dim() == 2 and "lm_head" not in name:
                n += p.numel() // 2 + p.numel() // 128 * 4
            else:
                n += p.numel() * p.element_size()
    return n


# -- the two modes --------------------------------------------------------------------------------------

def time_generate(r: Run, m) -> dict:
    """Mode (a): ``generate`` with the static cache (it compiles and graph-captures the decode step)."""
    a = r.a

    def run(n):
        r.sync()
        t = time.perf_counter()
        with torch.no_grad():
            out = m.generate(r.prompt, attention_mask=torch.ones_like(r.prompt), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, cache_implementation="static")
        r.sync()
        assert out.shape[1] == a.ctx + n, out.shape
        run.tokens = out[0, a.ctx:].tolist()
        return time.perf_counter() - t

    # the longest call first: generate sizes each static cache to the longest it has seen, so the compiled step's
    # shapes stay those of the timed calls
    c0 = time.perf_counter()
    for i in range(r.warm_calls):
        run(a.new + 1 if i == 0 else 4)
    warm = time.perf_counter() - c0
    ts = []
    for _ in range(a.repeats):
        t1 = run(1)
        ts.append((run(a.new + 1) - t1) / a.new)
    return {**_figures(ts, warm), "tokens": run.tokens[:8]}


def time_loop(r: Run, m) -> dict:
    """Mode (b): the forward compiled once and called in a plain loop over a StaticCache, one token a call."""
    import transformers

    a = r.a
    params = inspect.signature(m.forward).parameters
    cache_kw = "cache" if "cache" in params else "past_key_values"
    cache = transformers.StaticCache(config=m.config, max_cache_len=a.ctx + 3 * 4 + (a.repeats + 1) * a.new + 16)
    with torch.no_grad():
        first = m(r.prompt, use_cache=True, **{cache_kw: cache}).logits[:, -1:].argmax(-1)
    step = r.compile(m.forward)
    state = {"pos": a.ctx, "tok": first}

    def decode(n):
        toks = []
        with torch.no_grad():
            for _ in range(n):
                if r.dev == "cuda":
                    torch.compiler.cudagraph_mark_step_begin()
                pos = torch.tensor([[state["pos"]]], device=r.dev)
                kw = {"cache_position": pos[0]} if "cache_position" in params else {}
                o = step(input_ids=state["tok"], position_ids=pos, use_cache=True, **{cache_kw: cache}, **kw)
                state["tok"] = o.logits[:, -1:].argmax(-1)
                state["pos"] += 1
                toks.append(state["tok"])
        return toks

    c0 = time.perf_counter()
    tokens = [first] + decode(4)   # the tokens generate gives for the same prompt: compared in the JSON
    for _ in range(r.warm_calls):
        decode(4)
    r.sync()
    warm = time.perf_counter() - c0
    ts = []
    for _ in range(a.repeats):
        r.sync()
        t0 = time.perf_counter()
        decode(a.new)
        r.sync()
        ts.append((time.perf_counter() - t0) / a.new)
    fig = {**_figures(ts, warm), "tokens": [int(t) for t in torch.cat(tokens, 1)[0].tolist()]}
    if a.profile and r.dev == "cuda":
        fig["breakdown"] = breakdown(decode)
    return fig


#: kernel-name fragments -> the family a kernel is counted in by ``breakdown`` (first match; else "other")
KERNEL_FAMILIES = (("gemv", "portakern quant_gemv"), ("frag", "portakern quant_gemv"),
                   ("attn", "attention"), ("flash", "attention"), ("fmha", "attention"),
                   ("triton_", "Inductor glue"), ("gemm", "dense GEMM (lm_head, bf16 linears)"),
                   ("cutlass", "dense GEMM (lm_head, bf16 linears)"), ("nvjet", "dense GEMM (lm_head, bf16 linears)"),
                   ("Memcpy", "copies"), ("Memset", "copies"))


def breakdown(decode, tokens: int = 4) -> dict:
    """``tokens`` decode steps under the CUDA profiler: per token, the idle time and each kernel family's exposed
    time (``step_timing.exposed_times``, so overlapping programmatic-dependent launches are not counted twice),
    plus the ten kernels with the most exposed time."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        decode(tokens)
        torch.cuda.synchronize()
    spans = [(ev.name, ev.time_range.start, ev.time_range.end) for ev in prof.events()
             if ev.device_type == torch.autograd.DeviceType.CUDA]
    return summarise_spans(spans, tokens)


def summarise_spans(spans, tokens: int) -> dict:
    """``breakdown``'s figures from kernel ``(name, start_us, end_us)`` spans of ``tokens`` steps."""
    from step_timing import exposed_times

    ex = exposed_times(spans)
    families: dict[str, float] = {}
    for k in ex["kernels"]:
        fam = next((f for frag, f in KERNEL_FAMILIES if frag.lower() in k["name"].lower()), "other")
        families[fam] = families.get(fam, 0.0) + k["us_exposed"] / tokens
    return {"tokens": tokens, "span_us_per_token": round(ex["span_us"] / tokens, 1),
            "idle_us_per_token": round(ex["idle_us"] / tokens, 1),
            "families_us_per_token": {f: round(v, 1) for f, v in sorted(families.items(), key=lambda kv: -kv[1])},
            "top_kernels": [{"name": k["name"][:120], "calls_per_token": k["calls"] / tokens,
                             "us_exposed_per_token": round(k["us_exposed"] / tokens, 1)} for k in ex["kernels"][:10]]}


def _figures(ts: list[float], warm: float) -> dict:
    best, med = min(ts), sorted(ts)[len(ts) // 2]
    return {"ms_per_token_best": round(best * 1e3, 3), "ms_per_token_median": round(med * 1e3, 3),
            "tokens_per_s": round(1 / best, 1), "warmup_s": round(warm, 1)}


# -- the run -----------------------------------------------------------------------------------------------

def identity(r: Run) -> dict:
    """The result's header: harness.header on the GPU; the same keys with the CPU named on a dry run."""
    import transformers

    doc = __doc__.splitlines()[0]
    if r.dev == "cuda":
        res = harness.header(doc, round(r.copy_TBps, 3), modes={})
    else:
        res = {"what": doc, "date": datetime.date.today().isoformat(), "copy_TBps": r.copy_TBps, "gpu": "cpu (dry run)",
               "commit": os.environ.get("PK_COMMIT", ""), "modes": {}}
    try:
        import torchao
        ao = torchao.__version__
    except Exception as e:   # recorded: the torchao modes say why they were skipped
        ao = f"not importable: {e!r}"[:200]
    res.update(torch=torch.__version__, transformers=transformers.__version__, torchao=ao,
               config={"layers": r.a.layers, "hidden": r.cfg.hidden_size, "intermediate": r.cfg.intermediate_size,
                       "heads": r.cfg.num_attention_heads, "kv_heads": r.cfg.num_key_value_heads,
                       "vocab": r.cfg.vocab_size, "batch": 1, "ctx": r.a.ctx, "new": r.a.new,
                       "repeats": r.a.repeats, "quick": r.a.quick, "dry_run": r.a.dry_run},
               kv_bytes=r.kv_bytes, targets=dict(TARGETS))
    if r.a.layers != 32 and not r.a.dry_run:
        res["note"] = (f"a {r.a.layers}-layer model (Llama-3-8B has 32): every figure, the floor included, is "
                       "measured on it, not scaled")
    return res


def summarise(res: dict) -> None:
    """generate's own per-step cost per family, the portakern ratios against torchao, and the targets met."""
    modes = res["modes"]
    ms = {k: v["ms_per_token_best"] for k, v in modes.items() if "ms_per_token_best" in v}
    res["generate_overhead_ms"] = {f: round(ms[f"{f}-generate"] - ms[f"{f}-loop"], 3) for f in FAMILIES
                                   if f"{f}-generate" in ms and f"{f}-loop" in ms}
    checks = {}
    if "portakern-loop" in ms:
        checks["loop_frac_floor"] = modes["portakern-loop"]["frac_floor"]
    for kind in ("loop", "generate"):
        if f"portakern-{kind}" in ms and f"torchao-{kind}" in ms:
            checks[f"{kind}_vs_torchao"] = round(ms[f"torchao-{kind}"] / ms[f"portakern-{kind}"], 2)
    res["measured"] = checks
    res["met"] = {k: v >= TARGETS[k] for k, v in checks.items()}
    gen, loop = modes.get("portakern-generate", {}), modes.get("portakern-loop", {})
    if "tokens" in gen and "tokens" in loop:
        n = min(len(gen["tokens"]), len(loop["tokens"]))
        res["portakern_generate_and_loop_tokens_agree"] = gen["tokens"][:n] == loop["tokens"][:n]


def main(argv=None) -> dict:
    a = parse_args(argv)
    t_start = time.perf_counter()
    r = Run(a)
    res = identity(r)
    card = "cpu" if r.dev == "cpu" else harness.device_card()
    tag = a.tag + (f"-l{a.layers}" if a.layers != 32 and not a.dry_run else "") + ("-dry-run" if a.dry_run else "")
    path = harness.result_path(a.out, "e2e-decode", tag, card)
    for family in FAMILIES:
        wanted = [m for m in a.modes if m.startswith(family + "-")]
        if not wanted:
            continue
        if time.perf_counter() - t_start > a.budget_s:
            for mode in wanted:
                res["modes"][mode] = {"skipped": f"the time budget (--budget-s {a.budget_s:g}) was spent"}
            continue
        if family == "torchao":
            try:
                import torchao  # noqa: F401
            except Exception as e:
                for mode in wanted:
                    res["modes"][mode] = {"skipped": f"torchao does not import: {e!r}"[:300]}
                continue
        m = None
        try:
            t0 = time.perf_counter()
            m = build(r, family)
            r.sync()
            wb, build_s = weight_bytes(m, family), round(time.perf_counter() - t0, 1)
            for mode in wanted:
                if time.perf_counter() - t_start > a.budget_s:
                    res["modes"][mode] = {"skipped": f"the time budget (--budget-s {a.budget_s:g}) was spent"}
                    continue
                torch._dynamo.reset()
                try:
                    fig = (time_generate if mode.endswith("generate") else time_loop)(r, m)
                    floor_s = (wb + r.kv_bytes) / (r.copy_TBps * 1e12)
                    fig.update(weight_bytes=wb, floor_ms=round(floor_s * 1e3, 3), build_s=build_s,
                               frac_floor=round(floor_s / (fig["ms_per_token_best"] * 1e-3), 3))
                except Exception as e:
                    traceback.print_exc()
                    fig = {"error": repr(e)[:500]}
                res["modes"][mode] = fig
                print(mode, fig, flush=True)
                summarise(res)
                harness.write(res, path)
        except Exception as e:
            traceback.print_exc()
            for mode in wanted:
                res["modes"].setdefault(mode, {"error": f"building the {family} model: {e!r}"[:500]})
        del m
        if r.dev == "cuda":
            torch.cuda.empty_cache()
    summarise(res)
    res["wall_s"] = round(time.perf_counter() - t_start, 1)
    harness.write(res, path)
    return res


if __name__ == "__main__":
    main()
