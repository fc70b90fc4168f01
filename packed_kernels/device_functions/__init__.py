"""Triton device functions (``@triton.jit`` helpers called from inside kernels) shared
by several algorithms: single-instruction math and register-level column handling."""
