"""sinkhorn: naive NumPy, padded PyTorch and Triton stages side by side."""

__all__: list = []
