"""Shared by the experiment scripts: their command line, the header of their JSON, and writing it."""

from __future__ import annotations

import argparse
import datetime
import json
import os

import torch
import triton


def parse_args(doc: str, extra=None) -> argparse.Namespace:
    """``--out DIR`` (default ``$OUT`` or ``benchmarks/results``) and ``--tag T`` (file-name suffix), plus
    whatever ``extra(parser)`` adds."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    ap.add_argument("--tag", default="")
    if extra:
        extra(ap)
    return ap.parse_args()


def header(doc: str, copy_tbps: float, **lists) -> dict:
    """The result's identity: what, date, copy bandwidth, GPU, Triton, commit (``$PK_COMMIT``), plus
    the empty lists named in ``lists`` (``rows=[]``)."""
    return {"what": doc.splitlines()[0], "date": datetime.date.today().isoformat(), "copy_TBps": copy_tbps,
            "gpu": torch.cuda.get_device_name(0), "triton": triton.__version__,
            "commit": os.environ.get("PK_COMMIT", ""), **lists}


def write(res: dict, out: str, name: str, tag: str) -> str:
    """``res`` as ``<out>/<name>-<date><tag>.json``; prints and returns the path."""
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, f"{name}-{res['date']}{tag}.json")
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
    print(path)
    return path


def poisoned_errors(launch, out, ref, times: int = 2) -> list[float]:
    """Relative errors ``max |out - ref| / max |ref|`` of ``times`` calls of ``launch()``, each on ``out`` filled
    with NaN first (a call that leaves any element unwritten or non-finite scores inf)."""
    import numpy as np

    errs = []
    for _ in range(times):
        out.fill_(float("nan"))
        launch()
        if out.is_cuda:
            torch.cuda.synchronize()
        y = out.double().cpu().numpy()
        errs.append(float(np.abs(y - ref).max() / np.abs(ref).max()) if np.isfinite(y).all() else float("inf"))
    return errs
