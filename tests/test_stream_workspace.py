"""Split-K / split-KV scratch buffers are kept per CUDA stream (``portakern/stream_workspace.py``).

On the CPU: the bookkeeping, with the current stream and the capture state replaced by test doubles.
On a CUDA device (``gpu`` tests): one signature run on two streams at once, every call's output kept
and compared with float64 -- with one shared workspace the two streams' partials and arrival counts
mix and some outputs come out wrong.
"""

from __future__ import annotations

import numpy as np
import pytest

from portakern import stream_workspace as SW


class _Streams:
    """A stand-in for the CUDA runtime: the current stream and whether it is being captured."""

    def __init__(self, monkeypatch):
        self.current, self.capturing, self.asked, self.off_stream = 7, False, [], []
        monkeypatch.setattr(SW, "_current_stream", self._stream)
        monkeypatch.setattr(SW, "_capturing", lambda: self.capturing)
        monkeypatch.setattr(SW, "made_off_stream", self._off_stream)

    def _off_stream(self, make, index):
        made = make()
        self.off_stream.append((index, made))
        return made

    def _stream(self, index):
        self.asked.append(index)
        return self.current


def _maker():
    made = []

    def make():
        made.append(object())
        return made[-1]
    return make, made


def test_one_set_per_stream_made_on_its_first_call(monkeypatch):
    rt = _Streams(monkeypatch)
    make, made = _maker()
    ws = SW.StreamWorkspace(make, 3)
    a = ws.get()
    assert ws.get() is a and made == [a] and rt.asked == [3, 3]
    rt.current = 9
    b = ws.get()
    assert b is not a and ws.get() is b and made == [a, b]
    rt.current = 7
    assert ws.get() is a
    rt.current = 9
    assert ws.get() is b and ws.streams == 2 and len(made) == 2
    assert rt.off_stream == [(3, a), (3, b)]          # both made with the device's side stream current


def test_a_capture_makes_no_set_and_takes_the_first(monkeypatch):
    rt = _Streams(monkeypatch)
    make, made = _maker()
    ws = SW.StreamWorkspace(make, 0)
    first = ws.get()                  # warm-up on stream 7
    rt.current, rt.capturing = 11, True
    assert ws.get() is first and made == [first]   # captured on stream 11: nothing allocated
    rt.capturing = False
    own = ws.get()                    # an eager call on 11 afterwards gets its own
    assert own is not first and ws.streams == 2


def test_a_capture_takes_its_own_streams_set_when_it_has_one(monkeypatch):
    rt = _Streams(monkeypatch)
    make, made = _maker()
    ws = SW.StreamWorkspace(make, 0)
    ws.get()
    rt.current = 5
    warm = ws.get()                   # warm-up on stream 5 ...
    rt.capturing = True
    assert ws.get() is warm           # ... and the capture on 5 uses that set
    assert len(made) == 2


def test_a_first_call_inside_a_capture_makes_the_first_set(monkeypatch):
    rt = _Streams(monkeypatch)
    rt.capturing = True
    make, made = _maker()
    ws = SW.StreamWorkspace(make, 0)
    a = ws.get()
    assert made == [a] and ws.get() is a
    assert rt.off_stream == []                        # inside a capture: made on the capturing stream


class _FakeStream:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def wait_stream(self, other):
        self.log.append(f"{self.name} waits for {other.name}")


def test_a_set_is_made_by_another_thread_on_a_side_stream_and_the_caller_waits_for_it(monkeypatch):
    # what keeps a set out of a CUDA-graph tree's pool (which takes every allocation of the calling thread during the
    # tree's warm-up and recording): the allocation happens in another thread, with another stream current, and the
    # caller orders its next launch after that stream's zeroing
    import contextlib
    import threading

    torch = pytest.importorskip("torch")
    log, current = [], []
    caller = _FakeStream("caller", log)
    monkeypatch.setattr(SW, "_SIDE_STREAMS", {})
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: _FakeStream(f"side{device}", log))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda index: current[-1] if current else caller)

    @contextlib.contextmanager
    def use(stream):
        current.append(stream)
        yield
        current.pop()
    monkeypatch.setattr(torch.cuda, "stream", use)

    def make():
        log.append(f"made on {torch.cuda.current_stream(2).name}"
                   f"{' in the caller thread' if threading.get_ident() == caller_thread else ''}")
        return ("ws", "counters")
    caller_thread = threading.get_ident()
    assert SW.made_off_stream(make, 2) == ("ws", "counters")
    assert log == ["side2 waits for caller", "made on side2", "caller waits for side2"]
    side = SW._SIDE_STREAMS[2]
    SW.made_off_stream(make, 2)
    assert SW._SIDE_STREAMS == {2: side}              # one side stream per device, reused


def test_an_error_of_make_reaches_the_caller_and_the_caller_does_not_wait(monkeypatch):
    import contextlib

    torch = pytest.importorskip("torch")
    log = []
    caller = _FakeStream("caller", log)
    monkeypatch.setattr(SW, "_SIDE_STREAMS", {})
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: _FakeStream(f"side{device}", log))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda index: caller)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())

    def make():
        raise MemoryError("CUDA out of memory (test)")
    with pytest.raises(MemoryError, match="out of memory"):
        SW.made_off_stream(make, 0)
    assert log == ["side0 waits for caller"]


def test_the_interpreter_keeps_one_set_and_asks_no_stream(monkeypatch):
    rt = _Streams(monkeypatch)
    make, made = _maker()
    ws = SW.StreamWorkspace(make, None)
    a = ws.get()
    rt.current = 99
    assert ws.get() is a and made == [a] and rt.asked == [] and ws.streams == 1


@pytest.mark.parametrize("device, index", [("cpu", None), ("cuda", 0), ("cuda:0", 0), ("cuda:3", 3)])
def test_stream_index(device, index):
    assert SW.stream_index(device) == index
    torch = pytest.importorskip("torch")
    assert SW.stream_index(torch.device(device)) == index


# -- on a CUDA device ------------------------------------------------------------------------------

torch = pytest.importorskip("torch")


def _gpu():
    from portakern.devices import detect_devices

    return [d for d in detect_devices() if d.type == "cuda"]


GPU = _gpu()
gpu_param = pytest.mark.parametrize("dev", GPU or [None], ids=[str(d) for d in GPU] or ["no-cuda-device"])
ROUNDS = 40


def _need(dev):
    if dev is None:
        pytest.skip("no CUDA device on this machine: the stream bookkeeping is tested above with test doubles")


def _two_streams(call, inputs):
    """``call(x)`` for ``ROUNDS`` rounds, the two inputs alternating between two streams, no synchronisation
    between them; every output kept."""
    s = [torch.cuda.Stream(), torch.cuda.Stream()]
    torch.cuda.synchronize()
    outs = [[], []]
    for _ in range(ROUNDS):
        for j in (0, 1):
            with torch.cuda.stream(s[j]):
                outs[j].append(call(inputs[j]))
    torch.cuda.synchronize()
    return outs


@gpu_param
@pytest.mark.parametrize("N, K, split", [(4096, 4096, 8), (14336, 4096, 0), (4096, 14336, 16)],
                         ids=["fma-split8", "table", "fma-split16"])
def test_gpu_split_k_gemv_on_two_streams(dev, N, K, split):
    """The same split-K GEMV signature on two streams at once (split 0: the table's configuration, the
    stream-K kernel on sm_90): every output of both streams against float64, and two workspaces made."""
    _need(dev)
    from gemv_cases import forced_config, weight

    from portakern.backends.triton import quant_gemv as Q
    from portakern.gemv_weight import prepare_gemv_weight
    from portakern.ir.packing import dequantize
    from portakern.validate import quant_gemv_op

    w = weight(("s", "native", 4, 128, False, 1, N, K, "bfloat16", {}))
    cuda = f"cuda:{dev.index}"
    xs = [torch.randn(1, K, device=cuda, dtype=torch.bfloat16) for _ in range(2)]
    op, _ = quant_gemv_op(xs[0], w.with_tensors({k: torch.as_tensor(v).to(cuda) for k, v in w.tensors.items()}))
    kern = Q.compile(op, dev, forced_config(("fma", 64, 32, split, 3), num_warps=4) if split else None)
    p = prepare_gemv_weight(w, dev)

    def call(x):
        out = torch.full((1, N), float("nan"), device=cuda, dtype=torch.bfloat16)
        kern(x, p, out)
        return out

    outs = _two_streams(call, xs)
    launcher = next(iter(kern.launchers.values()))
    buffers = launcher.stream.buffers if launcher.kind == "stream" else launcher.buffers
    assert buffers is not None and buffers.streams == 2, launcher.kind
    deq = dequantize(w.fmt, w.tensors, w.N, w.K)
    for j in (0, 1):
        ref = xs[j].double().cpu().numpy() @ deq.T
        got = torch.cat(outs[j]).double().cpu().numpy()
        err = np.abs(got - ref).max(axis=1) / np.abs(ref).max()
        assert (err < 1e-2).all(), f"stream {j}: rounds {np.flatnonzero(err >= 1e-2).tolist()} wrong"


@gpu_param
def test_gpu_split_decode_on_two_streams(dev):
    """Paged batch-1 decode over 16k keys (split-KV on every table) through the API on two streams at once:
    every output against float64 (a shared workspace mixes the two streams' partials)."""
    _need(dev)
    import portakern

    cuda = f"cuda:{dev.index}"
    g = torch.Generator(device="cpu").manual_seed(1)
    Hq, Hkv, D, page, S = 32, 8, 128, 64, 16384
    pages = S // page
    k = torch.randn(pages, page, Hkv, D, generator=g).to(cuda, torch.bfloat16)
    v = torch.randn(pages, page, Hkv, D, generator=g).to(cuda, torch.bfloat16)
    bt = torch.randperm(pages, generator=g).to(torch.int32).reshape(1, pages).to(cuda)
    sk = torch.tensor([S], dtype=torch.int32, device=cuda)
    qs = [torch.randn(1, 1, Hq, D, generator=g).to(cuda, torch.bfloat16) for _ in range(2)]
    outs = _two_streams(lambda q: portakern.attention(q, k, v, block_table=bt, seqlens_k=sk), qs)
    kk = k.double().cpu()[bt[0].long().cpu()].reshape(S, Hkv, D).repeat_interleave(Hq // Hkv, dim=1)
    vv = v.double().cpu()[bt[0].long().cpu()].reshape(S, Hkv, D).repeat_interleave(Hq // Hkv, dim=1)
    for j in (0, 1):
        q = qs[j].double().cpu()[0, 0]                            # (Hq, D)
        p = torch.softmax(torch.einsum("hd,shd->hs", q, kk) / D ** 0.5, dim=-1)
        ref = torch.einsum("hs,shd->hd", p, vv).numpy()
        for r, o in enumerate(outs[j]):
            err = np.abs(o.double().cpu().numpy()[0, 0] - ref).max()
            assert err < 2e-2, f"stream {j} round {r}: max error {err:.3g}"
