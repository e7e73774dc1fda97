"""Shared by the benchmark scripts: run callables once on a side stream before a CUDA-graph capture."""

from __future__ import annotations

import torch


def warm_on_side_stream(fns) -> None:
    """Call each of ``fns`` once on a fresh stream ordered after the current one (what
    ``torch.cuda.graph`` needs first: lazy initialisation and allocations happen outside the capture)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(s)
