"""Hand-written kernels behind the model's backends: `cpu` (C++ as XLA FFI targets)."""
