"""Launch and lowering machinery of the triton-rocm backend: ``launch`` (one kernel on one grid, with the HIP
compile options), ``hip`` (lowering to hsaco for a gfx target without the device), ``plan`` (a configuration from
``tuning.py`` for an op and target), ``switches`` (the environment variables it reads)."""
