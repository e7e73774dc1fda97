"""Shared by the benchmark commands: the result file's name and header, writing it, and a NaN-poisoned check.

Result files are named by what they measured and on which device (``gemv-h200.json``, ``decode-step-h100.json``);
a new run on the same device replaces the file, and git keeps the earlier ones. The date, the commit and the
versions live inside the file.
"""

from __future__ import annotations

import datetime
import json
import os
import re

#: where the commands write their JSON unless ``--out`` says otherwise
DEFAULT_OUT = "benchmarks/results"


def default_out() -> str:
    """``$OUT`` (the device machine's output folder) or ``benchmarks/results``."""
    return os.environ.get("OUT", DEFAULT_OUT)


def card_of(name: str) -> str:
    """The card in a device name, lower case (``"NVIDIA H200"`` -> ``"h200"``, ``"NVIDIA H100 80GB HBM3"`` ->
    ``"h100"``); ``"gpu"`` where the name holds none (``"Graphics Device"``)."""
    m = re.search(r"\b([A-Za-z]\d{3})\b", name)
    return m.group(1).lower() if m else "gpu"


def device_card() -> str:
    """The card of CUDA device 0 (``card_of``), or ``"cpu"`` where torch sees no GPU."""
    import torch

    return card_of(torch.cuda.get_device_name(0)) if torch.cuda.is_available() else "cpu"


def result_path(out: str, name: str, tag: str = "", card: str | None = None) -> str:
    """``<out>/<name><tag>-<card>.json``: ``name`` says what was measured (``gemv``, ``gemv-wide-sweep``), ``tag``
    what the run varies (``-m4``, ``-int8-sweep``; empty for the benchmark's standard run), ``card`` the device
    (default ``device_card()``): ``gemv-int8-sweep-h200.json``."""
    if tag and not re.fullmatch(r"-[a-z0-9][a-z0-9-]*", tag):
        raise ValueError(f"tag={tag!r}: a suffix of the result name must be '-' followed by lower-case letters, "
                         "digits and '-' (e.g. '-deep'); the date and commit are recorded inside the file")
    return os.path.join(out, f"{name}{tag}-{card or device_card()}.json")


def header(doc: str, copy_tbps: float, **lists) -> dict:
    """The result's identity: what (``doc``'s first line), date, copy bandwidth, GPU, Triton, commit
    (``$PK_COMMIT``: the device copy has no git history), plus the lists named in ``lists`` (``rows=[]``)."""
    import torch
    import triton

    return {"what": doc.splitlines()[0], "date": datetime.date.today().isoformat(), "copy_TBps": copy_tbps,
            "gpu": torch.cuda.get_device_name(0), "triton": triton.__version__,
            "commit": os.environ.get("PK_COMMIT", ""), **lists}


def write(res: dict, path: str) -> str:
    """``res`` as JSON at ``path`` (its folder made); prints and returns the path."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
    print(path)
    return path


def poisoned_errors(launch, out, ref, times: int = 2) -> list[float]:
    """Relative errors ``max |out - ref| / max |ref|`` of ``times`` calls of ``launch()``, each on ``out`` filled
    with NaN first (a call that leaves any element unwritten or non-finite scores inf)."""
    import numpy as np
    import torch

    errs = []
    for _ in range(times):
        out.fill_(float("nan"))
        launch()
        if out.is_cuda:
            torch.cuda.synchronize()
        y = out.double().cpu().numpy()
        errs.append(float(np.abs(y - ref).max() / np.abs(ref).max()) if np.isfinite(y).all() else float("inf"))
    return errs
