"""The C++ CPU kernels (paged attention, the float32 and W8A8 linear layers) as XLA FFI
targets: the sources beside this file, built, cached and loaded by `build` (see its
docstring for the instruction-set variants and the environment switches). The Python calls
that pack weights and invoke the targets are runtime/kernels/cpu/attention.py and runtime/kernels/cpu/matmul.py."""
