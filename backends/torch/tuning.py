"""The torch backend's tuning data: data only, read by ``__init__.portakern_backend_priority`` and the lowerings.

The vendor kernels behind this backend (SDPA's math, flash, memory-efficient, cuDNN and CPU flash kernels,
flex_attention, tinygemm) are torch's; portakern tunes none of them. What is portakern's is where they rank against
its own kernels. By default they rank last (``DEFAULT_PRIORITY``), so installing torch never changes what a call
gets; an entry in ``RANK_OVER_OWN`` lifts one backend for one class of problems on one device family, and only
a benchmark run may add one: each entry's ``source`` names its result file under ``benchmarks/results/``.
"""

#: Default rank of every torch backend: below the cpu reference (0), opencl on the host (-5), the triton
#: interpreter (-10) and the torch-eager example (-20), so a vendor kernel serves only when asked for by name
#: (source: none -- a policy, not a measurement).
DEFAULT_PRIORITY = -30

#: The rank given where a measured entry puts a torch backend ahead of portakern's own kernels: above triton (100).
MEASURED_AHEAD_PRIORITY = 120

#: Measured wins: rows of ``dict(backend=..., family=..., op=..., dtype=..., max_d=..., decode=..., source=...)``;
#: the first row whose backend, device family ("sm_90", ...), op kind and bounds match ranks that backend at
#: ``MEASURED_AHEAD_PRIORITY``. Empty: not measured (no GPU run of benchmarks against these backends has been
#: recorded), so no torch backend outranks portakern's kernels anywhere.
RANK_OVER_OWN: tuple = ()
RANK_OVER_OWN_SOURCE = "not measured"

#: Largest float32 score / mask block (per batch entry: heads x query rows x keys) the explicit-mask and
#: logsumexp paths materialise, bytes (source: none -- a memory bound, the one the torch-eager example uses).
MAX_BLOCK_BYTES = 4 << 30
