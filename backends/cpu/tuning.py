"""Tuning data of the cpu reference backend.

The reference is written to be read, not tuned: it has no measured table, so no entry here names a result file
under ``benchmarks/results/``. What it has is one memory bound, kept here so that every backend's sizes live in its
``tuning.py``.
"""

#: Scores per block of the attention reference (query heads of one kv group x query rows x keys): 8M float64 =
#: 64 MiB, a bound on the memory one block takes, not a measured optimum (source: none).
SCORE_BLOCK_ELEMENTS = 1 << 23
