"""The flashinfer backend's tuning data: data only.

FlashInfer picks its own tiles; portakern tunes nothing inside it. What is portakern's is the rank: below its
own kernels (``DEFAULT_PRIORITY``) until a benchmark run on the GPU shows FlashInfer faster for a class of problems,
each such entry naming its result file under ``benchmarks/results/``. None has been measured.
"""

#: Default rank: below every built-in backend, so installing flashinfer changes nothing a call gets unless a
#: measured entry says otherwise (source: none -- a policy, not a measurement).
DEFAULT_PRIORITY = -30

#: The rank where a measured entry puts FlashInfer ahead of portakern's kernels (above triton's 100).
MEASURED_AHEAD_PRIORITY = 120

#: Measured wins: ``dict(family=..., dtype=..., max_d=..., decode=..., source=...)`` rows (see the torch backend's
#: ``tuning.RANK_OVER_OWN``). Empty: not measured.
RANK_OVER_OWN: tuple = ()
RANK_OVER_OWN_SOURCE = "not measured"
