"""Compile and launch machinery shared by the triton backend's ops.

``switches``: the backend's environment switches, read in this one module; ``launch``: the fast launcher and
the compile options every kernel is built with; ``flavour``: ``@triton.jit`` functions in the interpreter's or
the compiler's flavour, chosen explicitly; ``arch``: the architecture family of a device or target;
``autotune``: time candidate configurations once and keep the winner on disk.
"""
