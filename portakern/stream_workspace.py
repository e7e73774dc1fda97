"""Scratch buffers of a compiled kernel, one set per CUDA stream (shared by the triton and cuda backends).

Split-K GEMVs and split-KV attention merge their partial results through an fp32 workspace and
arrival counters that the kernels reset after each use. Two launches of one signature running at
the same time would mix each other's partials and counts, so each CUDA stream that calls a kernel
gets its own set, made on its first call there (launches on one stream run one after another).

A CUDA-graph capture does not make a set: allocating and zeroing counters while capturing would
record a memset into the graph, replayed before every launch. A capture takes the set of the
stream it captures, or else the first set made (normally the warm-up stream's, the way
``torch.cuda.graph`` is used); only a signature whose very first call is captured (no warm-up) makes
its first set inside the capture. So a graph's replays share that set with eager calls on the
stream that made it, and two graphs of one signature share it too: replaying them concurrently with
each other, or with eager calls on that stream, is not supported (``docs/api.md``, "Streams and
threads").

A set is made by a helper thread with a side stream of the device current (``made_off_stream``), never by the
calling thread on the calling stream: torch.compile's CUDA-graph trees run their warm-up and their recording with
every allocation of the calling *thread* routed to a private pool, and they refuse a pool that still holds buffers
after the call ("tensor(s) in the cudagraph pool not tracked as outputs") -- a set made there would outlive it. The
calling stream then waits for the side stream (the counters' zeroing), with no host synchronisation. Inside a
capture a set is made on the capturing stream as before (a wait on a stream outside the capture is not allowed
there).

Sets are never freed while the kernel (its dispatch plan) lives: one per stream that called it, bounded for
``torch.cuda.Stream()`` streams (PyTorch hands them out from a fixed pool) and dropped with the plan by
``portakern.dispatch.clear_cache()``.

The hot path is one current-stream read (``torch._C._cuda_getCurrentRawStream``, what Triton's own
launcher reads) and a compare with the first set's stream.
"""

from __future__ import annotations

from typing import Any, Callable


def stream_index(device) -> int | None:
    """The CUDA device index of a torch device or its string (``"cuda:1"`` -> 1, ``"cuda"`` -> 0); None for
    ``"cpu"`` (the interpreter: one set, no stream)."""
    device = str(device)
    if not device.startswith("cuda"):
        return None
    _, _, index = device.partition(":")
    return int(index or 0)


def _current_stream(index: int) -> int:
    import torch

    return torch._C._cuda_getCurrentRawStream(index)


def _capturing() -> bool:
    import torch

    return torch.cuda.is_current_stream_capturing()


_SIDE_STREAMS: dict[int, Any] = {}


def made_off_stream(make: Callable[[], Any], index: int) -> Any:
    """``make()`` run by a helper thread with a side stream of CUDA device ``index`` current, so that no memory pool
    that takes the calling thread's allocations (a CUDA-graph tree's, during its warm-up or recording) takes its
    buffers; the calling stream waits for the side stream's work (zeroing) before its next launch, and each tensor
    made is marked as used by the calling stream, so that freeing it (``dispatch.clear_cache()``) waits for that
    stream's kernels. An exception of ``make()`` is raised here. Not for use inside a capture."""
    from concurrent.futures import ThreadPoolExecutor

    import torch

    side = _SIDE_STREAMS.get(index)
    if side is None:
        side = _SIDE_STREAMS.setdefault(index, torch.cuda.Stream(device=index))
    caller = torch.cuda.current_stream(index)
    side.wait_stream(caller)

    def on_side_stream():
        with torch.cuda.stream(side):
            return make()

    with ThreadPoolExecutor(1, thread_name_prefix="portakern-workspace") as helper:
        made = helper.submit(on_side_stream).result()        # an exception of make() is raised here
    caller.wait_stream(side)
    for t in made if isinstance(made, (tuple, list)) else (made,):
        if isinstance(t, torch.Tensor):
            t.record_stream(caller)
    return made


class StreamWorkspace:
    """``get()`` returns ``make()``'s buffers for the current CUDA stream of device ``index``, made once per
    stream (``index`` None: the CPU interpreter, one set)."""

    __slots__ = ("_make", "_index", "_first", "_first_stream", "_others")

    def __init__(self, make: Callable[[], Any], index: int | None):
        self._make, self._index = make, index
        self._first: Any = None
        self._first_stream: int | None = None
        self._others: dict[int, Any] = {}

    def get(self) -> Any:
        if self._index is None:
            if self._first is None:
                self._first = self._make()
            return self._first
        stream = _current_stream(self._index)
        if stream == self._first_stream:
            return self._first
        return self._other(stream)

    def _other(self, stream: int) -> Any:
        if self._first is None:   # the signature's first call (a capture without warm-up makes it too)
            self._first = self._make() if _capturing() else made_off_stream(self._make, self._index)
            self._first_stream = stream
            return self._first
        found = self._others.get(stream)
        if found is not None:
            return found
        if _capturing():          # no allocation inside a capture: the first set (see the module docstring)
            return self._first
        return self._others.setdefault(stream, made_off_stream(self._make, self._index))

    @property
    def streams(self) -> int:
        """How many sets have been made (introspection, tests)."""
        return (self._first is not None) + len(self._others)
