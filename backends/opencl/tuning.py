"""Tuning data of the opencl backend: the work-group shapes its kernels are built with.

None of these is a measured optimum: the backend's reference device is PoCL on a CPU, where no sweep has been run,
so no entry names a result file under ``benchmarks/results/`` (source: none). They are the sizes every OpenCL 1.2
device accepts (a device with a smaller ``max_work_group_size`` gets the largest power of two it allows,
``common.program.work_group_cap``); a sweep on a real device would replace them, with its result file as source.
"""

#: quant_gemv: work-items per output column (K is split among them).
GEMV_WG = 64
#: quant_gemv: activation rows per work-group (M above it takes several work-groups per column).
GEMV_MT = 16
#: attention: most query rows per work-group (``BM``; decode with GQA fills it with the G heads of a kv head).
ATTENTION_BM_MAX = 64
#: attention: most keys per K/V tile (``BN``), halved until both tiles fit the local memory.
ATTENTION_BN_MAX = 64
