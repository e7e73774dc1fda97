"""The cuda backend's own compile and launch machinery, shared by its ops: ``nvrtc`` (CUDA C -> cubin at run time,
loaded and launched through the driver API), ``cubin_info`` (registers and stack frame read from a cubin) and
``host_run`` (a kernel's CUDA C built by the host C++ compiler and run on the CPU, for CI without a GPU)."""
