"""Golden outputs: computed by the CPU reference in float64, stored compactly with a sha256 manifest.

Layout under ``conformance/data/<suite>/``:

``goldens.zip``
    one member per array, ``<case id>.out`` and ``<case id>.lse``: the float32 gold (mantissa
    rounded to ``tolerance.STORED_MANTISSA_BITS`` of the case dtype), byte-plane shuffled (all
    first bytes, then all second bytes, ...) and deflated.
``manifest.json``
    per case: op, dtype, shapes, ``input_sha256`` (the generated inputs), ``out_sha256`` /
    ``lse_sha256`` (the stored float32 little-endian bytes), the naive error figures the tolerance
    rule needs and ``gold_max``; at the top the suite, the reference's versions and the
    ``data_sha256`` of ``goldens.zip``.

Regenerate with ``portakern goldens`` (or ``python -m portakern.conformance.goldens``): it
recomputes every golden, prints what changed and refuses to overwrite without ``--force``.
Goldens of cases not stored here (the gpu tier, plugin cases) are computed on the fly and cached
under ``~/.cache/portakern/conformance``.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import json
import os
import sys
import time
import zipfile
from collections import Counter
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Iterable

import numpy as np

from portakern.cache import remove_stale_temp_files
from portakern.errors import PortakernError

from . import naive
from .generate import hash_arrays
from .cases import SUITE
from .tolerance import STORED_MANTISSA_BITS, trim_mantissa

_TMP_SUFFIX = ".tmp.npz"  # a computed golden's temp file: <case>-<key>.<pid>.tmp.npz

FORMAT = 1
DATA_FILE = "goldens.zip"
MANIFEST = "manifest.json"

_RESTORE = ("restore the package's conformance/data (reinstall portakern, or git checkout conformance/data), "
            "or regenerate it with: portakern goldens --force")


class GoldenError(PortakernError, RuntimeError):
    """A golden that should be stored is missing, or its stored bytes do not match the manifest."""


@dataclass
class Golden:
    """The gold output of one case plus the naive error figures of its tolerance."""

    case_id: str
    input_sha256: str
    out: np.ndarray
    lse: np.ndarray | None
    naive_err: float
    naive_nmse: float
    naive_lse_err: float = 0.0

    @property
    def gold_max(self) -> float:
        fin = self.out[np.isfinite(self.out)]
        return float(np.abs(fin).max()) if fin.size else 0.0

    @property
    def lse_max(self) -> float:
        if self.lse is None:
            return 0.0
        fin = self.lse[np.isfinite(self.lse)]
        return float(np.abs(fin).max()) if fin.size else 0.0


def data_dir(suite: str = SUITE) -> Path:
    """``conformance/data/<suite>`` inside the installed (or editable) package."""
    return Path(str(resources.files("portakern.conformance"))) / "data" / suite


def _sha(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a, dtype="<f4").tobytes()).hexdigest()


# -- computing -----------------------------------------------------------------------------------

def reference_outputs(case, inputs: dict) -> tuple[np.ndarray, np.ndarray | None]:
    """The CPU reference's ``(out, lse)`` on float32 numpy inputs (exact in the case dtype)."""
    import portakern

    if case.kind == "attention":
        aux = {k: v for k, v in inputs.items() if k not in ("q", "k", "v")}
        r = portakern.attention(inputs["q"], inputs["k"], inputs["v"], backend="cpu", **case.kwargs(), **aux)
        out, lse = (r if case.return_lse else (r, None))
        return np.asarray(out, np.float32), None if lse is None else np.asarray(lse, np.float32)
    w = case.weight(inputs)
    return np.asarray(portakern.quant_gemv(inputs["x"], w, backend="cpu", **case.kwargs()), np.float32), None


def compute(case, trim: bool = True) -> Golden:
    """Run the reference and the naive computation for ``case``."""
    inputs = case.inputs()
    out, lse = reference_outputs(case, inputs)
    if trim:
        out = trim_mantissa(out, STORED_MANTISSA_BITS[case.dtype])
    out, lse = _canonical_nan(out), None if lse is None else _canonical_nan(lse)
    if case.kind == "attention":
        n_out, n_lse = naive.attention(case, inputs)
        err, nmse = naive.errors(out, n_out)
        lse_err = naive.errors(lse, n_lse[...])[0] if lse is not None else 0.0
    else:
        err, nmse = naive.errors(out, naive.quant_gemv(case, inputs))
        lse_err = 0.0
    return Golden(case.id, hash_arrays(inputs), out, lse, err, nmse, lse_err)


def _canonical_nan(a: np.ndarray) -> np.ndarray:
    """``a`` with every NaN as the one quiet NaN 0x7FC00000: a NaN's sign and payload depend on the
    operation and the CPU (x86 makes inf - inf negative), but the stored bytes and their sha256 may not."""
    return np.where(np.isnan(a), np.float32(np.nan), a).astype(np.float32) if np.isnan(a).any() else a


# -- storing and loading -------------------------------------------------------------------------

def _encode(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a, dtype="<f4").view(np.uint8).reshape(-1, 4).T.tobytes()


def _decode(b: bytes, shape) -> np.ndarray:
    planes = np.frombuffer(b, dtype=np.uint8).reshape(4, -1)
    return np.ascontiguousarray(planes.T).view("<f4").reshape(shape).astype(np.float32)


def entry(case, g: Golden) -> dict:
    e = {"op": case.kind, "dtype": case.dtype, "input_sha256": g.input_sha256,
         "out_shape": list(g.out.shape), "out_sha256": _sha(g.out), "gold_max": g.gold_max,
         "naive_err": g.naive_err, "naive_nmse": g.naive_nmse,
         "mantissa_bits": STORED_MANTISSA_BITS[case.dtype]}
    if g.lse is not None:
        e.update(lse_shape=list(g.lse.shape), lse_sha256=_sha(g.lse), lse_max=g.lse_max,
                 naive_lse_err=g.naive_lse_err)
    return e


def write(goldens: dict[str, tuple], directory: Path, suite: str = SUITE) -> Path:
    """Write ``{id: (case, Golden)}`` to ``directory`` atomically; return the manifest path."""
    import portakern

    directory.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=9) as z:
        for cid in sorted(goldens):
            case, g = goldens[cid]
            for name, arr in (("out", g.out), ("lse", g.lse)):
                if arr is not None:
                    info = zipfile.ZipInfo(f"{cid}.{name}", date_time=(1980, 1, 1, 0, 0, 0))
                    info.compress_type = zipfile.ZIP_DEFLATED
                    z.writestr(info, _encode(arr), compresslevel=9)
    data = buf.getvalue()
    manifest = {"suite": suite, "format": FORMAT, "generator": "splitmix64-v1",
                "reference": {"backend": "cpu", "portakern": portakern.__version__,
                              "numpy": np.__version__},
                "data_file": DATA_FILE, "data_sha256": hashlib.sha256(data).hexdigest(),
                "cases": {cid: entry(*goldens[cid]) for cid in sorted(goldens)}}
    for name, payload in ((DATA_FILE, data), (MANIFEST, (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode())):
        tmp = directory / (name + ".tmp")
        tmp.write_bytes(payload)
        os.replace(tmp, directory / name)
    return directory / MANIFEST


def read_manifest(path: Path) -> dict:
    """The golden manifest at ``path``: a JSON object whose ``"cases"`` is an object.

    Raises:
      GoldenError naming the file, what is wrong with it and the way out, when it cannot be read, is no JSON
      (a truncated or edited file) or is not shaped like a manifest.
    """
    try:
        manifest = json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError) as e:
        problem = f"cannot be read as JSON ({type(e).__name__}: {e})"
    else:
        if isinstance(manifest, dict) and isinstance(manifest.get("cases"), dict):
            return manifest
        problem = 'is JSON but not a golden manifest (an object whose "cases" is an object)'
    raise GoldenError(f"{path} {problem}; restore the file (e.g. from version control), or write a new "
                      f"golden directory with: portakern goldens --force --dir {path.parent}")


class Store:
    """Read access to the stored goldens of one suite (lazy: arrays are read on demand)."""

    def __init__(self, directory: Path | None = None, suite: str = SUITE):
        self.directory = Path(directory) if directory else data_dir(suite)
        path = self.directory / MANIFEST
        self.manifest = read_manifest(path) if path.exists() else {"cases": {}}
        self._zip: zipfile.ZipFile | None = None

    @property
    def cases(self) -> dict[str, dict]:
        return self.manifest["cases"]

    def __contains__(self, case_id: str) -> bool:
        return case_id in self.cases

    def _member(self, name: str) -> bytes:
        if self._zip is None:
            self._zip = zipfile.ZipFile(self.directory / DATA_FILE)
        return self._zip.read(name)

    def get(self, case_id: str, check: bool = True) -> Golden:
        """The stored golden of ``case_id``, its arrays checked against the manifest's sha256
        (``check=False``: unchecked, for the tools that report or replace mismatches themselves).

        Raises:
          KeyError when ``case_id`` is not in the manifest or a member is missing from the data file;
          GoldenError when a stored array's bytes differ from the manifest (data and manifest of
          different versions, or an edited file), rather than judging a backend by a wrong gold.
        """
        e = self.cases[case_id]
        out = _decode(self._member(f"{case_id}.out"), e["out_shape"])
        lse = _decode(self._member(f"{case_id}.lse"), e["lse_shape"]) if "lse_shape" in e else None
        for name, arr in (("out", out), ("lse", lse)):
            if check and arr is not None and _sha(arr) != e.get(f"{name}_sha256"):
                raise GoldenError(f"{case_id}: the stored {name} in {self.directory / DATA_FILE} does not match "
                                  f"{name}_sha256 in {self.directory / MANIFEST} (the two files are of different "
                                  f"versions or one was edited); {_RESTORE}")
        return Golden(case_id, e["input_sha256"], out, lse, e["naive_err"], e["naive_nmse"],
                      e.get("naive_lse_err", 0.0))

    def verify_sha(self) -> list[str]:
        """Problems with the stored data: data file hash and every per-array hash."""
        problems = []
        data = (self.directory / DATA_FILE).read_bytes()
        if hashlib.sha256(data).hexdigest() != self.manifest.get("data_sha256"):
            problems.append(f"{DATA_FILE}: sha256 differs from the manifest's data_sha256")
        for cid, e in self.cases.items():
            try:
                g = self.get(cid, check=False)
            except KeyError:
                problems.append(f"{cid}: listed in the manifest but missing from {DATA_FILE}")
                continue
            if _sha(g.out) != e["out_sha256"]:
                problems.append(f"{cid}: out sha256 differs from the manifest")
            if g.lse is not None and _sha(g.lse) != e.get("lse_sha256"):
                problems.append(f"{cid}: lse sha256 differs from the manifest")
        return problems


#: where computed goldens are cached; None: ``<portakern.cache.cache_dir()>/conformance``, read from the environment
#: when a golden is looked up, never at import (tests point it elsewhere)
_CACHE_DIR: Path | None = None


def _golden_cache_dir() -> Path:
    from portakern.cache import cache_dir

    return _CACHE_DIR if _CACHE_DIR is not None else cache_dir() / "conformance"


def golden_for(case, store: Store | None) -> Golden:
    """The stored golden of ``case``, or for a case with no stored golden (gpu tier, plugin cases)
    one computed by the CPU reference and disk-cached.

    Raises:
      GoldenError when ``case`` is a cpu-tier case missing from ``store``: computing its gold would
      compare the CPU reference with itself, so a missing or wrong golden directory never passes.
    """
    if store is not None and case.id in store:
        return store.get(case.id)
    if is_stored_case(case):
        where = store.directory if store is not None else data_dir()
        raise GoldenError(f"{case.id} is a cpu-tier case but {where / MANIFEST} has no golden for it; "
                          f"{_RESTORE}")
    key = hashlib.sha256((json.dumps(case.to_json(), sort_keys=True) + _reference_fingerprint()).encode())
    key = key.hexdigest()[:24]
    path = _golden_cache_dir() / SUITE / f"{case.id}-{key}.npz"
    try:
        with np.load(path) as z:
            lse = z["lse"] if "lse" in z.files else None
            return Golden(case.id, str(z["input_sha256"]), z["out"], lse, float(z["naive_err"]),
                          float(z["naive_nmse"]), float(z["naive_lse_err"]))
    except Exception:
        pass  # a missing or corrupt cache entry is a miss
    g = compute(case)
    tmp = path.with_suffix(f".{os.getpid()}{_TMP_SUFFIX}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        extra = {"lse": g.lse} if g.lse is not None else {}
        np.savez(tmp, out=g.out, input_sha256=g.input_sha256, naive_err=g.naive_err,
                 naive_nmse=g.naive_nmse, naive_lse_err=g.naive_lse_err, **extra)
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)  # a failed write (disk full) leaves no partial file behind
    # a writer killed between savez and os.replace left its temp file: removed once it is an hour old
    remove_stale_temp_files(path.parent, pattern=f"*{_TMP_SUFFIX}")
    return g


@functools.lru_cache(maxsize=1)
def _reference_fingerprint() -> str:
    """sha256 of the sources that make a computed golden (case inputs, the CPU reference, the naive error model), so
    a cached gpu-tier golden is never served after any of them changed. The CPU reference is reached through the
    registry like every backend: its code is the registered ``cpu`` backend's ``source_fingerprint()``."""
    import importlib

    from portakern.plugins import registry

    h = hashlib.sha256()
    for name in _REFERENCE_MODULES:
        h.update(Path(importlib.import_module(name).__file__).read_bytes())
    h.update(registry().get("cpu").source_fingerprint().encode())
    return h.hexdigest()


#: the core and IR modules whose code decides a computed golden's bytes, besides the cpu backend's own
_REFERENCE_MODULES = ("portakern.conformance.case", "portakern.conformance.generate", "portakern.conformance.naive",
                      "portakern.ir.evaluate", "portakern.ir.packing", "portakern.quantized", "portakern.quantize")


def is_stored_case(case) -> bool:
    """Whether ``case`` is one of the cpu tier, whose goldens are checked in (never computed on the fly)."""
    return case.id in _stored_ids()


@functools.lru_cache(maxsize=1)
def _stored_ids() -> frozenset:
    from .cases import all_cases

    return frozenset(c.id for c in all_cases("cpu"))


# -- regeneration and verification ----------------------------------------------------------------

def diff(store: Store, fresh: dict[str, tuple], catalog: set[str]) -> list[str]:
    """Readable lines describing how ``fresh`` goldens differ from the stored ones.

    A stored case is "removed" when it is no longer in ``catalog`` (the ids of the tier).
    """
    lines = []
    old = store.cases
    for cid in sorted(set(old) - catalog):
        lines.append(f"removed  {cid}")
    for cid in sorted(fresh):
        case, g = fresh[cid]
        e = entry(case, g)
        if cid not in old:
            lines.append(f"added    {cid}")
            continue
        o = old[cid]
        what = []
        if o["input_sha256"] != e["input_sha256"]:
            what.append("inputs")
        if o["out_sha256"] != e["out_sha256"] or o.get("lse_sha256") != e.get("lse_sha256"):
            prev = store.get(cid, check=False)
            same = prev.out.shape == g.out.shape
            dmax = float(np.nanmax(np.abs(prev.out.astype(np.float64) - g.out))) if same and g.out.size else 0.0
            what.append(f"gold (max change {dmax:.3g})" if same else "gold shape")
        for k in ("naive_err", "naive_nmse", "naive_lse_err"):
            a, b = o.get(k, 0.0), e.get(k, 0.0)
            if a != b and abs(a - b) > 1e-3 * max(abs(a), abs(b)):
                what.append(f"{k} {a:.3g} -> {b:.3g}")
        if what:
            lines.append(f"changed  {cid}: {', '.join(what)}")
    return lines


def regenerate(cases: Iterable, directory: Path | None = None, force: bool = False, out=None) -> int:
    """Recompute goldens for ``cases`` (cpu tier), print what changed, write only with ``force``.

    Stored goldens of other cpu-tier cases are kept; stored cases no longer in the tier are
    dropped. Returns 0 when the stored goldens are up to date or were written, 1 when they differ
    and ``force`` is False (nothing is written then).
    """
    from .cases import all_cases

    out = out or sys.stdout
    store = Store(directory)
    catalog = {c.id: c for c in all_cases("cpu")}
    cases = list(cases)
    t0 = time.perf_counter()
    fresh = {}
    for i, c in enumerate(cases):
        fresh[c.id] = (c, compute(c))
        if (i + 1) % 100 == 0:
            print(f"  computed {i + 1}/{len(cases)} goldens ({time.perf_counter() - t0:.0f} s)", file=out)
    lines = diff(store, fresh, set(catalog))
    if not lines:
        print(f"goldens of {len(fresh)} cases are up to date in {store.directory}", file=out)
        return 0
    print("\n".join(lines), file=out)
    kinds = Counter(line.split()[0] for line in lines)
    print(", ".join(f"{n} {k}" for k, n in sorted(kinds.items())), file=out)
    if not force:
        print(f"{len(lines)} difference(s); refusing to overwrite {store.directory} without --force", file=out)
        return 1
    merged = dict(fresh)
    for cid in store.cases:
        if cid not in merged and cid in catalog:
            try:
                merged[cid] = (catalog[cid], store.get(cid))
            except GoldenError as e:   # never carry a corrupt golden into a new manifest
                print(f"{e}\nnothing written: regenerate every golden (no --cases) to replace it", file=out)
                return 1
    path = write(merged, store.directory)
    size = (path.parent / DATA_FILE).stat().st_size / 1e6
    print(f"wrote {len(merged)} goldens to {path.parent} ({size:.2f} MB)", file=out)
    return 0


def verify(cases: Iterable, store: Store | None = None) -> list[str]:
    """Check that the reference still reproduces the stored goldens (to the stored precision)."""
    store = store or Store()
    problems = []
    for c in cases:
        if c.id not in store:
            problems.append(f"{c.id}: no stored golden")
            continue
        e = store.cases[c.id]
        inputs = c.inputs()
        if hash_arrays(inputs) != e["input_sha256"]:
            problems.append(f"{c.id}: generated inputs differ from the stored input_sha256")
            continue
        out, lse = reference_outputs(c, inputs)
        gold = store.get(c.id, check=False)
        ulp = 2.0 ** -e["mantissa_bits"]
        for name, a, b in (("out", out, gold.out), ("lse", lse, gold.lse)):
            if b is None:
                continue
            fin = np.isfinite(b)
            inf = np.isinf(b)   # NaN where the gold is NaN, the same infinity where it is infinite
            if (np.isfinite(a) != fin).any() or (np.isnan(a) != np.isnan(b)).any() or (a[inf] != b[inf]).any():
                problems.append(f"{c.id}: {name} non-finite entries differ")
                continue
            d = np.abs(a[fin].astype(np.float64) - b[fin])
            lim = ulp * np.abs(b[fin]) + 1e-7 * (1.0 + np.abs(b[fin]))
            if (d > lim).any():
                problems.append(f"{c.id}: {name} differs from the stored gold by up to {d.max():.3g}")
    return problems


def main(argv: list[str] | None = None) -> int:
    from .cli import goldens_main

    return goldens_main(argv)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
