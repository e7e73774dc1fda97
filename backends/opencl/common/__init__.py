"""The opencl backend's own build and launch machinery, shared by its ops (``program``: kernel sources from package
data, one ``cl.Program`` per context and source, build logs in errors, locked launches)."""
