"""Sinkhorn normalisation of many small matrices, with two exact backwards.

Three stages side by side:

* :mod:`.naive_numpy`: one matrix in float64 NumPy (iterations, hand-written reverse
  mode, and the implicit gradient by a least-squares solve of the singular system);
* :mod:`.padded_torch`: batched PyTorch (autograd through the loop; the implicit
  gradient by batched conjugate gradient; the epsilon-CG of published kernels);
* :mod:`.triton_kernels`: the fused Triton kernels, wired into autograd by :mod:`.api`.
"""
from .api import sinkhorn, sinkhorn_backward

__all__ = ["sinkhorn", "sinkhorn_backward"]
